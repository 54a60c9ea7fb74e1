/* SPDX-License-Identifier: MIT */
/*
 * kvdctl: the operator's command line for a running kvd. It shows what the daemon holds
 * (status, for people or as JSON), sets the node budget and sets per-tenant guarantees,
 * caps and weights. It talks to the daemon only through the public libkvd API, over an
 * administrative connection (no tenant), so it exercises the same ABI that engines use.
 *
 * Exit codes: 0 success, 1 the request failed (daemon unreachable or refused), 2 usage.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/macro.h"
#include "common/number.h"
#include "common/size.h"
#include "config.h"
#include "kvd/kvd.h"
#include "score-cmd.h"

enum {
	EXIT_OK = 0,
	EXIT_FAIL = 1,
	EXIT_USAGE = 2,
};

static const char *arg_socket;
static int arg_json;

static int is_no_cap(uint64_t v) {
	return v == KVD_TENANT_NO_CAP;
}

static void help(void) {
	printf("Usage: kvdctl [OPTIONS] COMMAND [ARGS]\n"
	       "\n"
	       "Inspect and steer a running kvd KV-cache daemon.\n"
	       "\n"
	       "Commands:\n"
	       "  status [--json]            Show pool, budget, usage and tenants\n"
	       "  budget set SIZE            Set the node-wide budget (e.g. 768MiB, 2G)\n"
	       "  tenant set NAME [--min SIZE] [--max SIZE|none] [--weight N]\n"
	       "                             Create or change a tenant; options left out keep\n"
	       "                             their value (a new tenant starts with min 0,\n"
	       "                             no cap, weight 1)\n"
	       "  score --policy P --q F --k F [--v F] [--wo F] --capacity N --window W [...]\n"
	       "                             Score captured .npy tensors offline and print the\n"
	       "                             kept positions (see 'kvdctl score --help')\n"
	       "\n"
	       "Options:\n"
	       "  --socket PATH   Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	       "  --json          With status: print JSON for scripts (default: a table)\n"
	       "  --min SIZE      With tenant set: guaranteed minimum (default: unchanged)\n"
	       "  --max SIZE|none With tenant set: cap, or none for no cap (default: unchanged)\n"
	       "  --weight N      With tenant set: eviction weight, at least 1; the daemon sets\n"
	       "                  the upper bound (default: unchanged)\n"
	       "  -h --help       Show this help and exit\n"
	       "  --version       Show the version and exit\n"
	       "\n"
	       "Sizes take the suffixes K, M, G, T (binary; KiB, MiB... also accepted).\n"
	       "In JSON, max_bytes is null when a tenant has no cap.\n"
	       "Exit status: 0 on success, 1 when the daemon is unreachable or refuses, 2 on\n"
	       "usage errors.\n",
	       KVD_DEFAULT_SOCKET);
}

static _printf_(1, 2) int usage_error(const char *fmt, ...) {
	va_list ap;

	fputs("kvdctl: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\nTry 'kvdctl --help'.\n", stderr);
	return EXIT_USAGE;
}

/* Prints "kvdctl: WHAT: strerror[: daemon message]" and returns EXIT_FAIL. */
static int request_error(kvd_client *c, int r, const char *what) {
	const char *msg = c ? kvd_client_last_error(c) : "";

	if (msg && *msg)
		fprintf(stderr, "kvdctl: %s: %s: %s\n", what, strerror(-r), msg);
	else
		fprintf(stderr, "kvdctl: %s: %s\n", what, strerror(-r));
	return EXIT_FAIL;
}

static int connect_admin(kvd_client **ret) {
	int r;

	r = kvd_client_connect(arg_socket, NULL, ret);
	if (r < 0) {
		fprintf(stderr, "kvdctl: cannot connect to kvd at %s: %s\n", arg_socket, strerror(-r));
		if (r == -ENOENT || r == -ECONNREFUSED)
			fprintf(stderr, "kvdctl: is the daemon running? (--socket or $KVD_SOCKET)\n");
		return EXIT_FAIL;
	}
	return EXIT_OK;
}

/* Parses a size argument; prints a usage error and returns -EINVAL when it is not one. */
static int parse_size_arg(const char *what, const char *s, uint64_t *ret) {
	int r;

	r = size_parse(s, ret);
	if (r < 0) {
		usage_error("%s: '%s' is not a size%s", what, s,
			    r == -ERANGE ? " (too large)" : " (e.g. 512M, 4GiB)");
		return -EINVAL;
	}
	return 0;
}

/*
 * Tenant indices sorted by name: the daemon lists tenants in its own table order, which
 * changes as tenants come and go, and people (and diffs of --json) want a stable order.
 */
static const kvd_status *sort_status;

static int cmp_tenant(const void *a, const void *b) {
	const char *x = "", *y = "";

	(void)kvd_status_tenant_name(sort_status, *(const uint32_t *)a, &x);
	(void)kvd_status_tenant_name(sort_status, *(const uint32_t *)b, &y);
	return strcmp(x, y);
}

static int tenant_order(const kvd_status *st, uint32_t **ret) {
	uint32_t n = kvd_status_tenants(st), *order;

	order = calloc(n ? n : 1, sizeof(*order));
	if (!order)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++)
		order[i] = i;
	sort_status = st;
	qsort(order, n, sizeof(*order), cmp_tenant);
	sort_status = NULL;
	*ret = order;
	return 0;
}

/* ---- JSON ---- */

static void json_string(FILE *f, const char *s) {
	fputc('"', f);
	for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
		switch (*p) {
		case '"':
			fputs("\\\"", f);
			break;
		case '\\':
			fputs("\\\\", f);
			break;
		case '\b':
			fputs("\\b", f);
			break;
		case '\f':
			fputs("\\f", f);
			break;
		case '\n':
			fputs("\\n", f);
			break;
		case '\r':
			fputs("\\r", f);
			break;
		case '\t':
			fputs("\\t", f);
			break;
		default:
			/* Bytes >= 0x80 pass through: the daemon sends UTF-8 (protobuf strings). */
			if (*p < 0x20 || *p == 0x7f)
				fprintf(f, "\\u%04x", *p);
			else
				fputc(*p, f);
		}
	}
	fputc('"', f);
}

static const char *const node_keys[] = {
	"pool_bytes",     "budget_bytes",     "used_bytes",      "block_bytes",
	"chunk_bytes",    "chunks_total",     "chunks_free",     "chunks_draining",
	"connections",    "protocol_version", "uptime_ms",       "grants_refused",
	"protocol_errors",
};

static const char *const tenant_keys[] = {
	"used_bytes", "block_bytes", "min_bytes",   "max_bytes",
	"weight",     "sequences",   "connections", "chunks",
};

/*
 * Values the daemon does not send (an older or newer daemon) are left out rather than
 * invented; any other getter failure is a real error.
 */
static int status_json_write(FILE *f, const kvd_status *st) {
	_cleanup_(freep) uint32_t *order = NULL;
	const char *sep = "";
	uint32_t n;
	int r;

	r = tenant_order(st, &order);
	if (r < 0)
		return r;

	fprintf(f, "{\n");
	{
		const char *const str_keys[] = { "daemon_version", "backend" };

		for (size_t i = 0; i < ELEMENTSOF(str_keys); i++) {
			const char *v;

			r = kvd_status_str(st, str_keys[i], &v);
			if (r == -ENOENT)
				continue;
			if (r < 0)
				return r;
			fprintf(f, "%s  \"%s\": ", sep, str_keys[i]);
			json_string(f, v);
			sep = ",\n";
		}
	}
	for (size_t i = 0; i < ELEMENTSOF(node_keys); i++) {
		uint64_t v;

		r = kvd_status_u64(st, node_keys[i], &v);
		if (r == -ENOENT)
			continue;
		if (r < 0)
			return r;
		fprintf(f, "%s  \"%s\": %" PRIu64, sep, node_keys[i], v);
		sep = ",\n";
	}
	fprintf(f, "%s  \"library_version\": ", sep);
	json_string(f, kvd_version());

	n = kvd_status_tenants(st);
	fprintf(f, ",\n  \"tenants\": [");
	for (uint32_t j = 0; j < n; j++) {
		uint32_t t = order[j];
		const char *name;

		r = kvd_status_tenant_name(st, t, &name);
		if (r < 0)
			return r;
		fprintf(f, "%s\n    {\n      \"name\": ", j ? "," : "");
		json_string(f, name);
		for (size_t i = 0; i < ELEMENTSOF(tenant_keys); i++) {
			uint64_t v;

			r = kvd_status_tenant_u64(st, t, tenant_keys[i], &v);
			if (r == -ENOENT)
				continue;
			if (r < 0)
				return r;
			/* "No cap" is UINT64_MAX on the wire, which JSON numbers (doubles in
			 * most parsers) cannot hold exactly; null says it plainly. */
			if (strcmp(tenant_keys[i], "max_bytes") == 0 && is_no_cap(v))
				fprintf(f, ",\n      \"%s\": null", tenant_keys[i]);
			else
				fprintf(f, ",\n      \"%s\": %" PRIu64, tenant_keys[i], v);
		}
		fprintf(f, "\n    }");
	}
	fprintf(f, "%s]\n}\n", n ? "\n  " : "");
	return 0;
}

/* Built in memory first, so that a failure never leaves half a JSON document on stdout. */
static int status_json(const kvd_status *st) {
	_cleanup_(freep) char *buf = NULL;
	size_t size = 0;
	FILE *f;
	int r;

	f = open_memstream(&buf, &size);
	if (!f)
		return negative_errno();
	r = status_json_write(f, st);
	if (fclose(f) != 0 && r >= 0)
		r = -ENOMEM;
	if (r < 0)
		return r;
	fwrite(buf, 1, size, stdout);
	return 0;
}

/* ---- Human output ---- */

/* Returns 0, or 1 when the daemon did not send the value, or a negative errno. */
static int get_u64(const kvd_status *st, const char *key, uint64_t *ret) {
	int r = kvd_status_u64(st, key, ret);

	if (r == -ENOENT)
		return 1;
	return r;
}

static int get_tenant_u64(const kvd_status *st, uint32_t t, const char *key, uint64_t *ret) {
	int r = kvd_status_tenant_u64(st, t, key, ret);

	if (r == -ENOENT)
		return 1;
	return r;
}

static char *fmt_size(const kvd_status *st, const char *key, char *buf, size_t n) {
	uint64_t v;

	if (get_u64(st, key, &v) != 0)
		snprintf(buf, n, "?");
	else
		size_format(v, buf, n);
	return buf;
}

static char *fmt_percent(uint64_t part, uint64_t whole, char *buf, size_t n) {
	if (whole == 0)
		snprintf(buf, n, "-");
	else
		snprintf(buf, n, "%.1f%%", 100.0 * (double)part / (double)whole);
	return buf;
}

static void fmt_uptime(uint64_t ms, char *buf, size_t n) {
	uint64_t s = ms / 1000;

	if (s < 60)
		snprintf(buf, n, "%.1fs", (double)ms / 1000.0);
	else if (s < 3600)
		snprintf(buf, n, "%" PRIu64 "m %" PRIu64 "s", s / 60, s % 60);
	else if (s < 86400)
		snprintf(buf, n, "%" PRIu64 "h %" PRIu64 "m", s / 3600, s / 60 % 60);
	else
		snprintf(buf, n, "%" PRIu64 "d %" PRIu64 "h", s / 86400, s / 3600 % 24);
}

enum {
	COL_NAME,
	COL_USED,
	COL_PCT,
	COL_BLOCKS,
	COL_MIN,
	COL_MAX,
	COL_WEIGHT,
	COL_SEQS,
	COL_CONNS,
	COL_MAX_,
};

#define CELL_MAX 64

static const char *const col_title[COL_MAX_] = {
	"TENANT", "USED", "%BUDGET", "BLOCKS", "MIN", "MAX", "WEIGHT", "SEQS", "CONNS",
};

static int tenant_row(const kvd_status *st, uint32_t t, uint64_t budget, char (*cells)[CELL_MAX]) {
	const char *name;
	uint64_t v;
	int r;

	r = kvd_status_tenant_name(st, t, &name);
	if (r < 0)
		return r;
	snprintf(cells[COL_NAME], CELL_MAX, "%s", name);

	r = get_tenant_u64(st, t, "used_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0) {
		snprintf(cells[COL_USED], CELL_MAX, "?");
		snprintf(cells[COL_PCT], CELL_MAX, "?");
	} else {
		size_format(v, cells[COL_USED], CELL_MAX);
		fmt_percent(v, budget, cells[COL_PCT], CELL_MAX);
	}

	r = get_tenant_u64(st, t, "block_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cells[COL_BLOCKS], CELL_MAX, "?");
	else
		size_format(v, cells[COL_BLOCKS], CELL_MAX);

	r = get_tenant_u64(st, t, "min_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cells[COL_MIN], CELL_MAX, "?");
	else
		size_format(v, cells[COL_MIN], CELL_MAX);

	r = get_tenant_u64(st, t, "max_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cells[COL_MAX], CELL_MAX, "?");
	else if (is_no_cap(v))
		snprintf(cells[COL_MAX], CELL_MAX, "-");
	else
		size_format(v, cells[COL_MAX], CELL_MAX);

	{
		static const struct {
			int col;
			const char *key;
		} counts[] = {
			{ COL_WEIGHT, "weight" },
			{ COL_SEQS, "sequences" },
			{ COL_CONNS, "connections" },
		};

		for (size_t i = 0; i < ELEMENTSOF(counts); i++) {
			r = get_tenant_u64(st, t, counts[i].key, &v);
			if (r < 0)
				return r;
			if (r > 0)
				snprintf(cells[counts[i].col], CELL_MAX, "?");
			else
				snprintf(cells[counts[i].col], CELL_MAX, "%" PRIu64, v);
		}
	}
	return 0;
}

static int status_table(const kvd_status *st) {
	_cleanup_(freep) char (*cells)[COL_MAX_][CELL_MAX] = NULL;
	_cleanup_(freep) uint32_t *order = NULL;
	size_t width[COL_MAX_];
	uint32_t n = kvd_status_tenants(st);
	uint64_t pool = 0, budget = 0, v;
	char a[CELL_MAX], b[CELL_MAX];
	int r;

	(void)get_u64(st, "pool_bytes", &pool);
	(void)get_u64(st, "budget_bytes", &budget);

	/* Rows first, so that a status the daemon cannot describe fails before any output. */
	r = tenant_order(st, &order);
	if (r < 0)
		return r;
	cells = calloc(n ? n : 1, sizeof(*cells));
	if (!cells)
		return -ENOMEM;
	for (uint32_t t = 0; t < n; t++) {
		r = tenant_row(st, order[t], budget, cells[t]);
		if (r < 0)
			return r;
	}

	{
		const char *version = "?", *backend = "?";

		(void)kvd_status_str(st, "daemon_version", &version);
		(void)kvd_status_str(st, "backend", &backend);
		printf("kvd %s, protocol ", version);
		if (get_u64(st, "protocol_version", &v) == 0)
			printf("%" PRIu64, v);
		else
			printf("?");
		printf(", backend %s", backend);
		if (get_u64(st, "uptime_ms", &v) == 0) {
			fmt_uptime(v, a, sizeof(a));
			printf(", up %s", a);
		}
		printf("\n");
	}
	printf("  %-13s %s\n", "socket", arg_socket);
	printf("  %-13s %s\n", "pool", fmt_size(st, "pool_bytes", a, sizeof(a)));
	printf("  %-13s %-11s %s of pool\n", "budget", fmt_size(st, "budget_bytes", a, sizeof(a)),
	       fmt_percent(budget, pool, b, sizeof(b)));
	if (get_u64(st, "used_bytes", &v) == 0)
		printf("  %-13s %-11s %s of budget (chunks held by tenants)\n", "used",
		       size_format(v, a, sizeof(a)), fmt_percent(v, budget, b, sizeof(b)));
	else
		printf("  %-13s ?\n", "used");
	if (get_u64(st, "block_bytes", &v) == 0)
		printf("  %-13s %-11s %s of budget (inside granted blocks)\n", "in blocks",
		       size_format(v, a, sizeof(a)), fmt_percent(v, budget, b, sizeof(b)));
	else
		printf("  %-13s ?\n", "in blocks");
	printf("  %-13s %s\n", "chunk size", fmt_size(st, "chunk_bytes", a, sizeof(a)));
	{
		uint64_t total = 0, freec = 0, draining = 0;

		if (get_u64(st, "chunks_total", &total) == 0 && get_u64(st, "chunks_free", &freec) == 0 &&
		    get_u64(st, "chunks_draining", &draining) == 0)
			printf("  %-13s %" PRIu64 " total, %" PRIu64 " free, %" PRIu64 " draining\n",
			       "chunks", total, freec, draining);
		else
			printf("  %-13s ?\n", "chunks");
	}
	if (get_u64(st, "connections", &v) == 0)
		printf("  %-13s %" PRIu64 "\n", "connections", v);
	{
		uint64_t refused, perr;

		if (get_u64(st, "grants_refused", &refused) == 0 &&
		    get_u64(st, "protocol_errors", &perr) == 0)
			printf("  %-13s %" PRIu64 " grants refused, %" PRIu64 " protocol errors\n",
			       "errors", refused, perr);
	}
	printf("\n");

	if (n == 0) {
		printf("No tenants.\n");
		return 0;
	}

	for (int c = 0; c < COL_MAX_; c++) {
		width[c] = strlen(col_title[c]);
		for (uint32_t t = 0; t < n; t++)
			width[c] = MAX(width[c], strlen(cells[t][c]));
	}
	for (int c = 0; c < COL_MAX_; c++)
		printf(c == 0 ? "%-*s" : "  %*s", (int)width[c], col_title[c]);
	printf("\n");
	for (uint32_t t = 0; t < n; t++) {
		for (int c = 0; c < COL_MAX_; c++)
			printf(c == 0 ? "%-*s" : "  %*s", (int)width[c], cells[t][c]);
		printf("\n");
	}
	return 0;
}

/* ---- Commands ---- */

static int cmd_status(int argc, char **argv) {
	static const struct option options[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'j':
			arg_json = 1;
			break;
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("status: bad option");
		}
	if (optind < argc)
		return usage_error("status: unexpected argument '%s'", argv[optind]);

	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	r = kvd_status_get(c, &st);
	if (r < 0)
		return request_error(c, r, "status");

	r = arg_json ? status_json(st) : status_table(st);
	if (r < 0) {
		fprintf(stderr, "kvdctl: status: cannot read the daemon's answer: %s\n", strerror(-r));
		return EXIT_FAIL;
	}
	if (fflush(stdout) != 0) {
		fprintf(stderr, "kvdctl: writing the status failed: %m\n");
		return EXIT_FAIL;
	}
	return EXIT_OK;
}

static int cmd_budget(int argc, char **argv) {
	static const struct option options[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	uint64_t bytes;
	char buf[32], what[64];
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("budget: bad option");
		}
	if (optind >= argc || strcmp(argv[optind], "set") != 0)
		return usage_error("budget: expected 'budget set SIZE'");
	if (argc - optind != 2)
		return usage_error("budget set: expected exactly one SIZE");
	if (parse_size_arg("budget set", argv[optind + 1], &bytes) < 0)
		return EXIT_USAGE;

	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	snprintf(what, sizeof(what), "budget set %s", size_format(bytes, buf, sizeof(buf)));
	r = kvd_budget_set(c, bytes);
	if (r < 0)
		return request_error(c, r, what);
	printf("budget set to %s (%" PRIu64 " bytes)\n", buf, bytes);
	return EXIT_OK;
}

static int cmd_tenant(int argc, char **argv) {
	static const struct option options[] = {
		{ "min", required_argument, NULL, 'm' },
		{ "max", required_argument, NULL, 'M' },
		{ "weight", required_argument, NULL, 'w' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	uint64_t min = KVD_TENANT_KEEP, max = KVD_TENANT_KEEP;
	uint32_t weight = 0;
	const char *name;
	char what[128];
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'm':
			if (parse_size_arg("--min", optarg, &min) < 0)
				return EXIT_USAGE;
			if (min >= KVD_TENANT_KEEP)
				return usage_error("--min: too large");
			break;
		case 'M':
			if (strcmp(optarg, "none") == 0)
				max = KVD_TENANT_NO_CAP;
			else if (parse_size_arg("--max", optarg, &max) < 0)
				return EXIT_USAGE;
			else if (max >= KVD_TENANT_KEEP)
				return usage_error("--max: too large (use none for no cap)");
			break;
		case 'w':
			if (number_parse_u32(optarg, 1, UINT32_MAX, &weight) < 0)
				return usage_error("--weight: '%s' must be a number in 1..%u", optarg,
						   UINT32_MAX);
			break;
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("tenant: bad option");
		}
	if (optind >= argc || strcmp(argv[optind], "set") != 0)
		return usage_error("tenant: expected 'tenant set NAME [--min SIZE] [--max SIZE|none] [--weight N]'");
	if (argc - optind != 2)
		return usage_error("tenant set: expected exactly one NAME");
	name = argv[optind + 1];
	/* With no option this still does something: it creates the tenant with the defaults. */
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	snprintf(what, sizeof(what), "tenant set %s", name);
	r = kvd_tenant_set(c, name, min, max, weight);
	if (r < 0)
		return request_error(c, r, what);
	printf("tenant %s set\n", name);
	return EXIT_OK;
}

int main(int argc, char **argv) {
	static const struct option options[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{},
	};
	static const struct {
		const char *name;
		int (*run)(int argc, char **argv);
	} commands[] = {
		{ "status", cmd_status },
		{ "budget", cmd_budget },
		{ "tenant", cmd_tenant },
		{ "score", cmd_score },
	};
	int opt;

	arg_socket = getenv("KVD_SOCKET");
	if (!arg_socket || !*arg_socket)
		arg_socket = KVD_DEFAULT_SOCKET;

	/* "+": stop at the command, whose own options are parsed by the command. */
	while ((opt = getopt_long(argc, argv, "+h", options, NULL)) >= 0)
		switch (opt) {
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		case 'V':
			printf("kvdctl %s (libkvd %s, protocol %d..%d)\n", KVD_VERSION, kvd_version(),
			       KVD_PROTOCOL_VERSION_MIN, KVD_PROTOCOL_VERSION_MAX);
			return EXIT_OK;
		default:
			return usage_error("bad option");
		}
	if (optind >= argc)
		return usage_error("missing command (status, budget, tenant, score)");

	for (size_t i = 0; i < ELEMENTSOF(commands); i++)
		if (strcmp(argv[optind], commands[i].name) == 0)
			return commands[i].run(argc - optind, argv + optind);
	return usage_error("unknown command '%s'", argv[optind]);
}
