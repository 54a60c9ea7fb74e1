/* SPDX-License-Identifier: MIT */
/*
 * kvdctl's shared pieces: errors and exit codes, the administrative connection, status
 * values that older daemons may not send, the tenant table and its JSON, tables and
 * all-or-nothing output. See kvdctl.h.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/size.h"
#include "kvdctl.h"

const char *arg_socket;
int arg_json;

int request_error(kvd_client *c, int r, const char *what) {
	const char *msg = c ? kvd_client_last_error(c) : "";

	if (msg && *msg)
		fprintf(stderr, "kvdctl: %s: %s: %s\n", what, strerror(-r), msg);
	else
		fprintf(stderr, "kvdctl: %s: %s\n", what, strerror(-r));
	if (r == -EOPNOTSUPP)
		fprintf(stderr, "kvdctl: the daemon does not know this request (kvd older than "
				"kvdctl %s?)\n", kvd_version());
	return EXIT_FAIL;
}

void change_warning(kvd_client *c, int r, const char *what) {
	const char *msg = kvd_client_last_error(c);

	if (r > 0)
		fprintf(stderr, "kvdctl: warning: %s: %s\n", what,
			*msg ? msg : "applied, but not saved: it will not survive a restart");
}

int connect_admin(kvd_client **ret) {
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

/* ---- Status values ---- */

static int missing_is_one(int r) {
	return r == -ENOENT ? 1 : r;
}

int status_u64(const kvd_status *st, const char *key, uint64_t *ret) {
	return missing_is_one(kvd_status_u64(st, key, ret));
}

int status_str(const kvd_status *st, const char *key, const char **ret) {
	return missing_is_one(kvd_status_str(st, key, ret));
}

int status_tenant_u64(const kvd_status *st, uint32_t t, const char *key, uint64_t *ret) {
	return missing_is_one(kvd_status_tenant_u64(st, t, key, ret));
}

int status_tenant_str(const kvd_status *st, uint32_t t, const char *key, const char **ret) {
	return missing_is_one(kvd_status_tenant_str(st, t, key, ret));
}

static const kvd_status *sort_status;

static int cmp_tenant(const void *a, const void *b) {
	const char *x = "", *y = "";

	(void)kvd_status_tenant_name(sort_status, *(const uint32_t *)a, &x);
	(void)kvd_status_tenant_name(sort_status, *(const uint32_t *)b, &y);
	return strcmp(x, y);
}

int tenant_order(const kvd_status *st, uint32_t **ret) {
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

int tenant_find(const kvd_status *st, const char *name, uint32_t *ret) {
	uint32_t n = kvd_status_tenants(st);

	for (uint32_t i = 0; i < n; i++) {
		const char *s;

		if (kvd_status_tenant_name(st, i, &s) == 0 && strcmp(s, name) == 0) {
			*ret = i;
			return 0;
		}
	}
	return -ENOENT;
}

char *fmt_percent(uint64_t part, uint64_t whole, char *buf, size_t n) {
	if (whole == 0)
		snprintf(buf, n, "-");
	else
		snprintf(buf, n, "%.1f%%", 100.0 * (double)part / (double)whole);
	return buf;
}

void fmt_uptime(uint64_t ms, char *buf, size_t n) {
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

/* ---- Tables ---- */

void table_print(FILE *f, const struct table *t) {
	size_t width[32] = { 0 };
	int tail = t->tail != NULL;

	for (size_t c = 0; c < t->n_cols && c < ELEMENTSOF(width); c++) {
		width[c] = strlen(t->titles[c]);
		for (size_t r = 0; r < t->n_rows; r++)
			width[c] = MAX(width[c], strlen(t->cells[r * t->n_cols + c]));
	}
	for (size_t r = 0; r <= t->n_rows; r++) {
		for (size_t c = 0; c < t->n_cols; c++) {
			const char *s = r == 0 ? t->titles[c] : t->cells[(r - 1) * t->n_cols + c];
			int left = c == 0 || (t->left && t->left[c]);

			if (c >= ELEMENTSOF(width))
				break;

			if (c > 0)
				fputs("  ", f);
			if (!left)
				fprintf(f, "%*s", (int)width[c], s);
			else if (c + 1 == t->n_cols && !tail)
				fputs(s, f);
			else
				fprintf(f, "%-*s", (int)width[c], s);
		}
		if (tail)
			fprintf(f, "  %s", r == 0 ? t->tail_title : t->tail[r - 1]);
		fputc('\n', f);
	}
}

/* ---- The tenant table ---- */

enum {
	COL_NAME,
	COL_USED,
	COL_PCT,
	COL_BLOCKS,
	COL_MIN,
	COL_MAX,
	COL_WEIGHT,
	COL_POLICY,
	COL_TIER,
	COL_SEQS,
	COL_CONNS,
	COL_EVICTED, /* last: left out for a daemon that does not evict */
	COL_MAX_,
};

static const char *const col_title[COL_MAX_] = {
	"TENANT", "USED", "%BUDGET", "BLOCKS", "MIN", "MAX", "WEIGHT", "POLICY", "TIER", "SEQS",
	"CONNS", "EVICTED",
};
/* The same titles with room for the source marker. */
static const char *const col_title_marked[COL_MAX_] = {
	"TENANT", "USED", "%BUDGET", "BLOCKS", "MIN ", "MAX ", "WEIGHT ", "POLICY", "TIER", "SEQS",
	"CONNS", "EVICTED",
};
static const unsigned char col_left[COL_MAX_] = { [COL_NAME] = 1, [COL_POLICY] = 1,
	                                          [COL_TIER] = 1 };

/*
 * Where a tenant's min, max or weight comes from, as the daemon says it, and the marker the
 * table puts after the value. A value the daemon does not place gets no marker; one of a
 * source this kvdctl does not know gets '?'.
 */
static const struct {
	const char *source;
	char marker;
	const char *meaning;
} sources[] = {
	{ "default", ' ', NULL },
	{ "live", '*', "set live with kvdctl: kept across daemon restarts until 'kvdctl tenant "
		       "reset NAME'" },
	{ "config", '+', "from the config file" },
	{ "flag", '^', "from kvd's command line" },
};

#define SOURCE_UNKNOWN ELEMENTSOF(sources)

static size_t source_index(const char *source) {
	for (size_t i = 0; i < ELEMENTSOF(sources); i++)
		if (strcmp(source, sources[i].source) == 0)
			return i;
	return SOURCE_UNKNOWN;
}

/* The columns whose source the daemon reports, and the key that holds it. */
static const struct {
	int col;
	const char *key;
} source_cols[] = {
	{ COL_MIN, "min_source" },
	{ COL_MAX, "max_source" },
	{ COL_WEIGHT, "weight_source" },
	{ COL_POLICY, "policy_source" },
	{ COL_TIER, "tier_source" },
};

/* Sets cell to the size of the tenant's key, "-" for KVD_TENANT_NO_CAP with no_cap, "?"
 * when the daemon did not send it. */
static int cell_size(const kvd_status *st, uint32_t t, const char *key, int no_cap, char *cell) {
	uint64_t v;
	int r;

	r = status_tenant_u64(st, t, key, &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cell, CELL_MAX, "?");
	else if (no_cap && v == KVD_TENANT_NO_CAP)
		snprintf(cell, CELL_MAX, "-");
	else
		size_format(v, cell, CELL_MAX);
	return 0;
}

static int cell_count(const kvd_status *st, uint32_t t, const char *key, char *cell) {
	uint64_t v;
	int r;

	r = status_tenant_u64(st, t, key, &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cell, CELL_MAX, "?");
	else
		snprintf(cell, CELL_MAX, "%" PRIu64, v);
	return 0;
}

/* "64.0 MiB 4096t 3r": bytes, token slots and rounds evicted; "?" for a part not sent. */
static int cell_evicted(const kvd_status *st, uint32_t t, char *cell) {
	static const char *const keys[] = { "evicted_bytes", "evicted_tokens", "rounds" };
	static const char *const units[] = { "", "t", "r" };
	size_t len = 0;

	for (size_t i = 0; i < ELEMENTSOF(keys); i++) {
		char part[CELL_MAX];
		uint64_t v;
		int r;

		r = status_tenant_u64(st, t, keys[i], &v);
		if (r < 0)
			return r;
		if (r > 0)
			snprintf(part, sizeof(part), "?");
		else if (i == 0)
			size_format(v, part, sizeof(part));
		else
			snprintf(part, sizeof(part), "%" PRIu64 "%s", v, units[i]);
		len += snprintf(cell + len, CELL_MAX - len, "%s%s", i ? " " : "", part);
		if (len >= CELL_MAX)
			break;
	}
	return 0;
}

/* Fills one row (with COL_EVICTED when evicted is set); with marked, adds the source markers
 * and sets a bit per source seen (1 << its index in sources[], or 1 << SOURCE_UNKNOWN) in
 * *seen. */
static int tenant_row(const kvd_status *st, uint32_t t, uint64_t budget, int marked,
		      int evicted, char (*cells)[CELL_MAX], unsigned *seen) {
	const char *name, *s;
	uint64_t v;
	int r;

	r = kvd_status_tenant_name(st, t, &name);
	if (r < 0)
		return r;
	snprintf(cells[COL_NAME], CELL_MAX, "%s", name);

	r = status_tenant_u64(st, t, "used_bytes", &v);
	if (r < 0)
		return r;
	if (r > 0) {
		snprintf(cells[COL_USED], CELL_MAX, "?");
		snprintf(cells[COL_PCT], CELL_MAX, "?");
	} else {
		size_format(v, cells[COL_USED], CELL_MAX);
		fmt_percent(v, budget, cells[COL_PCT], CELL_MAX);
	}
	if ((r = cell_size(st, t, "block_bytes", 0, cells[COL_BLOCKS])) < 0 ||
	    (r = cell_size(st, t, "min_bytes", 0, cells[COL_MIN])) < 0 ||
	    (r = cell_size(st, t, "max_bytes", 1, cells[COL_MAX])) < 0 ||
	    (r = cell_count(st, t, "weight", cells[COL_WEIGHT])) < 0 ||
	    (r = cell_count(st, t, "sequences", cells[COL_SEQS])) < 0 ||
	    (r = cell_count(st, t, "connections", cells[COL_CONNS])) < 0)
		return r;

	r = status_tenant_str(st, t, "policy", &s);
	if (r < 0)
		return r;
	snprintf(cells[COL_POLICY], CELL_MAX, "%s", r > 0 || !*s ? "-" : s);
	/* What memory pressure does with it, and what its sequences moved out hold of the host
	 * and file tiers (outside USED, which counts the pool's chunks). */
	r = status_tenant_str(st, t, "tier", &s);
	if (r < 0)
		return r;
	if (r > 0 || !*s)
		snprintf(cells[COL_TIER], CELL_MAX, "-");
	else {
		uint64_t host = 0, file = 0;
		char size[32];

		(void)status_tenant_u64(st, t, "tier_bytes", &host);
		(void)status_tenant_u64(st, t, "tier_file_bytes", &file);
		if (host + file > 0)
			snprintf(cells[COL_TIER], CELL_MAX, "%s %s", s,
			         size_format(host + file, size, sizeof(size)));
		else
			snprintf(cells[COL_TIER], CELL_MAX, "%s", s);
	}
	if (evicted && (r = cell_evicted(st, t, cells[COL_EVICTED])) < 0)
		return r;

	if (!marked)
		return 0;
	for (size_t i = 0; i < ELEMENTSOF(source_cols); i++) {
		char *cell = cells[source_cols[i].col];
		size_t len = strlen(cell), k;
		char m = ' ';

		r = status_tenant_str(st, t, source_cols[i].key, &s);
		if (r < 0)
			return r;
		if (r == 0) {
			k = source_index(s);
			*seen |= 1u << k;
			m = k == SOURCE_UNKNOWN ? '?' : sources[k].marker;
		}
		if (len + 1 < CELL_MAX) {
			cell[len] = m;
			cell[len + 1] = 0;
		}
	}
	return 0;
}

int tenants_report(const kvd_status *st, const char *key) {
	uint32_t n = kvd_status_tenants(st);
	uint64_t v;

	for (uint32_t t = 0; t < n; t++)
		if (status_tenant_u64(st, t, key, &v) == 0)
			return 1;
	return 0;
}

/* Whether the daemon says where any tenant's values come from (newer daemons do). */
static int reports_sources(const kvd_status *st) {
	uint32_t n = kvd_status_tenants(st);

	for (uint32_t t = 0; t < n; t++)
		for (size_t i = 0; i < ELEMENTSOF(source_cols); i++) {
			const char *s;

			if (status_tenant_str(st, t, source_cols[i].key, &s) == 0)
				return 1;
		}
	return 0;
}

int tenants_table_write(FILE *f, const kvd_status *st) {
	_cleanup_(freep) char (*cells)[CELL_MAX] = NULL;
	_cleanup_(freep) uint32_t *order = NULL;
	uint32_t n = kvd_status_tenants(st);
	uint64_t budget = 0;
	unsigned seen = 0;
	int marked, evicted, r;
	size_t n_cols;

	if (n == 0) {
		fprintf(f, "No tenants.\n");
		return 0;
	}
	r = status_u64(st, "budget_bytes", &budget);
	if (r < 0)
		return r;
	r = tenant_order(st, &order);
	if (r < 0)
		return r;
	cells = calloc((size_t)n * COL_MAX_, sizeof(*cells));
	if (!cells)
		return -ENOMEM;
	marked = reports_sources(st);
	/* The column appears with a daemon that evicts, which reports evicted bytes. */
	evicted = tenants_report(st, "evicted_bytes");
	n_cols = evicted ? COL_MAX_ : COL_EVICTED;
	for (uint32_t i = 0; i < n; i++) {
		r = tenant_row(st, order[i], budget, marked, evicted, cells + (size_t)i * n_cols,
			       &seen);
		if (r < 0)
			return r;
	}

	table_print(f, &(struct table){
				.n_cols = n_cols,
				.n_rows = n,
				.titles = marked ? col_title_marked : col_title,
				.left = col_left,
				.cells = cells,
			});

	if (!marked) {
		fprintf(f, "\n(this kvd does not report where MIN, MAX and WEIGHT come from)\n");
		return 0;
	}
	/* A footer line for each marker in the table, none when all values are defaults. */
	for (size_t i = 0, first = 1; i <= SOURCE_UNKNOWN; i++) {
		if (!(seen & (1u << i)) || (i < SOURCE_UNKNOWN && !sources[i].meaning))
			continue;
		if (first)
			fputc('\n', f);
		first = 0;
		if (i == SOURCE_UNKNOWN)
			fprintf(f, "? from a source this kvdctl does not know (see --json)\n");
		else
			fprintf(f, "%c %s\n", sources[i].marker, sources[i].meaning);
	}
	return 0;
}

/* ---- JSON ---- */

void json_string(FILE *f, const char *s) {
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

static const char *const tenant_u64_keys[] = {
	"used_bytes", "block_bytes", "min_bytes",   "max_bytes",
	"weight",     "sequences",   "connections", "chunks",
	"evicted_bytes", "evicted_tokens", "rounds", "grants", "grants_refused", "grants_waited",
	"tier_bytes", "tier_file_bytes", "tier_sequences", "tier_lost", "tier_degraded",
	"recall", "recalled_tokens",
};

static const char *const tenant_str_keys[] = {
	"min_source",
	"max_source",
	"weight_source",
	"policy",
	"policy_source",
	"tier",
	"tier_source",
	"recall_source",
};

/*
 * Values the daemon does not send (an older or newer daemon) are left out rather than
 * invented; any other getter failure is a real error.
 */
int tenants_json_write(FILE *f, const kvd_status *st, int indent) {
	_cleanup_(freep) uint32_t *order = NULL;
	uint32_t n = kvd_status_tenants(st);
	int in = indent, r;

	r = tenant_order(st, &order);
	if (r < 0)
		return r;

	fprintf(f, "\"tenants\": [");
	for (uint32_t j = 0; j < n; j++) {
		uint32_t t = order[j];
		const char *name;

		r = kvd_status_tenant_name(st, t, &name);
		if (r < 0)
			return r;
		fprintf(f, "%s\n%*s{\n%*s\"name\": ", j ? "," : "", in + 2, "", in + 4, "");
		json_string(f, name);
		for (size_t i = 0; i < ELEMENTSOF(tenant_u64_keys); i++) {
			uint64_t v;

			r = status_tenant_u64(st, t, tenant_u64_keys[i], &v);
			if (r < 0)
				return r;
			if (r > 0)
				continue;
			fprintf(f, ",\n%*s\"%s\": ", in + 4, "", tenant_u64_keys[i]);
			/* "No cap" is UINT64_MAX on the wire, which JSON numbers (doubles in
			 * most parsers) cannot hold exactly; null says it plainly. */
			if (strcmp(tenant_u64_keys[i], "max_bytes") == 0 && v == KVD_TENANT_NO_CAP)
				fputs("null", f);
			else
				fprintf(f, "%" PRIu64, v);
		}
		for (size_t i = 0; i < ELEMENTSOF(tenant_str_keys); i++) {
			const char *v;

			r = status_tenant_str(st, t, tenant_str_keys[i], &v);
			if (r < 0)
				return r;
			if (r > 0)
				continue;
			fprintf(f, ",\n%*s\"%s\": ", in + 4, "", tenant_str_keys[i]);
			json_string(f, v);
		}
		fprintf(f, "\n%*s}", in + 2, "");
	}
	if (n)
		fprintf(f, "\n%*s", in, "");
	fputc(']', f);
	return 0;
}

int node_json_write(FILE *f, const kvd_status *st, const char *const *u64_keys,
			   size_t n_u64, const char *const *str_keys, size_t n_str) {
	const char *sep = "";
	int r;

	for (size_t i = 0; i < n_str; i++) {
		const char *v;

		r = status_str(st, str_keys[i], &v);
		if (r < 0)
			return r;
		if (r > 0)
			continue;
		fprintf(f, "%s  \"%s\": ", sep, str_keys[i]);
		json_string(f, v);
		sep = ",\n";
	}
	for (size_t i = 0; i < n_u64; i++) {
		uint64_t v;

		r = status_u64(st, u64_keys[i], &v);
		if (r < 0)
			return r;
		if (r > 0)
			continue;
		fprintf(f, "%s  \"%s\": %" PRIu64, sep, u64_keys[i], v);
		sep = ",\n";
	}
	fprintf(f, "%s  \"library_version\": ", sep);
	json_string(f, kvd_version());
	return 0;
}

/* ---- Output ---- */

int output_emit(int (*write)(FILE *f, const void *userdata), const void *userdata) {
	_cleanup_(freep) char *buf = NULL;
	size_t size = 0;
	FILE *f;
	int r;

	f = open_memstream(&buf, &size);
	if (!f)
		return negative_errno();
	r = write(f, userdata);
	if (fclose(f) != 0 && r >= 0)
		r = -ENOMEM;
	if (r < 0)
		return r;
	fwrite(buf, 1, size, stdout);
	return 0;
}

int output_flush(void) {
	if (fflush(stdout) != 0 || ferror(stdout)) {
		fprintf(stderr, "kvdctl: writing the output failed: %m\n");
		return EXIT_FAIL;
	}
	return EXIT_OK;
}

/* The daemon's standing warnings, each on a line "<indent>warning: ...". */
void warnings_lines(FILE *f, const kvd_status *st, const char *indent) {
	const char *text, *line, *end;

	if (status_str(st, "warnings", &text) != 0)
		return;
	for (line = text; *line; line = *end ? end + 1 : end) {
		end = strchrnul(line, '\n');
		fprintf(f, "%swarning: %.*s\n", indent, (int)(end - line), line);
	}
}

int parse_common(int argc, char **argv, const char *cmd, unsigned allow,
		 struct common_args *ret) {
	static const struct option options[] = {
		{ "json", no_argument, NULL, 'j' },
		{ "tenant", required_argument, NULL, 't' },
		{ "dry-run", no_argument, NULL, 'n' },
		{ "force", no_argument, NULL, 'f' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	int opt;

	/* "kvdctl --json status" as "kvdctl status --json". */
	*ret = (struct common_args){ .json = arg_json && (allow & ARGS_JSON) };
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'j':
			if (!(allow & ARGS_JSON))
				return usage_error("%s: --json is not an option of this command", cmd);
			ret->json = 1;
			break;
		case 't':
			if (!(allow & ARGS_TENANT))
				return usage_error("%s: --tenant is not an option of this command", cmd);
			ret->tenant = optarg;
			break;
		case 'n':
		case 'f':
			if (!(allow & ARGS_CHANGE))
				return usage_error("%s: --dry-run and --force are options of budget set "
						   "(and --dry-run of tenant set and evict)", cmd);
			*(opt == 'n' ? &ret->dry_run : &ret->force) = 1;
			break;
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("%s: bad option", cmd);
		}
	return -1;
}
