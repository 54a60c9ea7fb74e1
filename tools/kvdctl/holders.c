/* SPDX-License-Identifier: MIT */
/*
 * Who holds what: kvdctl connections, kvdctl seqs (the daemon's listings, kvd_table rows)
 * and kvdctl disconnect.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/size.h"
#include "kvdctl.h"

enum column_kind { COL_U64, COL_SIZE, COL_AGE, COL_STR, COL_FLAG };

/* A column: its title, the row's value it shows (kvd_table key), and how. */
struct column {
	const char *title, *key;
	enum column_kind kind;
};

static const struct column connection_columns[] = {
	{ "ID", "id", COL_U64 },          { "PID", "pid", COL_U64 },
	{ "UID", "uid", COL_U64 },        { "TENANT", "tenant", COL_STR },
	{ "PROCESS", "process", COL_STR }, { "AGE", "age_ms", COL_AGE },
	{ "SEQS", "sequences", COL_U64 }, { "PINNED", "pinned", COL_U64 },
	{ "BYTES", "bytes", COL_SIZE },   { "WAITING", "outstanding", COL_U64 },
	{ "RING", "ring", COL_FLAG },     { "DEPARTED", "departed", COL_FLAG },
};

static const struct column sequence_columns[] = {
	{ "ID", "id", COL_U64 },             { "CONN", "connection", COL_U64 },
	{ "TENANT", "tenant", COL_STR },     { "TOKENS", "tokens", COL_U64 },
	{ "MAX", "max_tokens", COL_U64 },    { "PINS", "pins", COL_U64 },
	{ "BYTES", "bytes", COL_SIZE },      { "EVICTABLE", "evictable", COL_FLAG },
	{ "EVICTED", "evicted_bytes", COL_SIZE }, { "WAITING", "waiting_bytes", COL_SIZE },
	{ "SHARED", "shared_bytes", COL_SIZE }, { "PLACE", "place", COL_STR },
};

/* Columns past the table's: JSON has every value a row carries, tables what fits. */
static const char *const connection_json_extra[] = { "device", "chunks" };
static const char *const sequence_json_extra[] = { "evicted_tokens", "layers", "kv_heads", "head_dim" };

struct listing {
	const kvd_table *t;
	const struct column *cols;
	size_t n_cols;
	const char *const *extra;
	size_t n_extra;
	const char *empty;            /* what a table with no rows says */
};

static void cell(const kvd_table *t, uint32_t row, const struct column *col, char *out) {
	const char *s;
	uint64_t v;

	if (col->kind == COL_STR) {
		snprintf(out, CELL_MAX, "%s", kvd_table_str(t, row, col->key, &s) == 0 ? s : "-");
		return;
	}
	if (kvd_table_u64(t, row, col->key, &v) != 0) {
		snprintf(out, CELL_MAX, "-");
		return;
	}
	switch (col->kind) {
	case COL_SIZE:
		size_format(v, out, CELL_MAX);
		break;
	case COL_AGE:
		fmt_uptime(v, out, CELL_MAX);
		break;
	case COL_FLAG:
		snprintf(out, CELL_MAX, "%s", v ? "yes" : "no");
		break;
	default:
		snprintf(out, CELL_MAX, "%" PRIu64, v);
	}
}

static int listing_table(FILE *f, const void *userdata) {
	const struct listing *l = userdata;
	uint32_t n = kvd_table_rows(l->t);
	_cleanup_(freep) char(*cells)[CELL_MAX] = NULL;
	const char *titles[16];
	unsigned char left[16] = {};

	if (n == 0) {
		fprintf(f, "%s\n", l->empty);
		return 0;
	}
	cells = calloc((size_t)n * l->n_cols, CELL_MAX);
	if (!cells)
		return -ENOMEM;
	for (size_t k = 0; k < l->n_cols; k++) {
		titles[k] = l->cols[k].title;
		left[k] = l->cols[k].kind == COL_STR;
	}
	for (uint32_t i = 0; i < n; i++)
		for (size_t k = 0; k < l->n_cols; k++)
			cell(l->t, i, &l->cols[k], cells[i * l->n_cols + k]);
	table_print(f, &(struct table){ .n_cols = l->n_cols, .n_rows = n, .titles = titles,
	                                .left = left, .cells = cells });
	return 0;
}

/* One JSON member of a row, when the row has that value. */
static void json_member(FILE *f, const kvd_table *t, uint32_t row, const char *key, bool str,
                        const char **sep) {
	const char *s;
	uint64_t v;

	if (str ? kvd_table_str(t, row, key, &s) != 0 : kvd_table_u64(t, row, key, &v) != 0)
		return;
	fprintf(f, "%s\"%s\": ", *sep, key);
	if (str)
		json_string(f, s);
	else
		fprintf(f, "%" PRIu64, v);
	*sep = ", ";
}

static int listing_json(FILE *f, const void *userdata) {
	const struct listing *l = userdata;
	uint32_t n = kvd_table_rows(l->t);

	fputc('[', f);
	for (uint32_t i = 0; i < n; i++) {
		const char *sep = "";

		fprintf(f, "%s\n  { ", i ? "," : "");
		for (size_t k = 0; k < l->n_cols; k++)
			json_member(f, l->t, i, l->cols[k].key, l->cols[k].kind == COL_STR, &sep);
		for (size_t k = 0; k < l->n_extra; k++)
			json_member(f, l->t, i, l->extra[k], false, &sep);
		fputs(" }", f);
	}
	fprintf(f, "%s]\n", n ? "\n" : "");
	return 0;
}

static int emit(const struct listing *l, int json) {
	int r = output_emit(json ? listing_json : listing_table, l);

	if (r < 0) {
		fprintf(stderr, "kvdctl: cannot write the listing: %s\n", strerror(-r));
		return EXIT_FAIL;
	}
	return output_flush();
}

/* kvdctl connections and kvdctl seqs: a listing, as a table or JSON. */
static int list_command(int argc, char **argv, bool sequences) {
	const char *cmd = sequences ? "seqs" : "connections";
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_table_freep) kvd_table *t = NULL;
	struct common_args a;
	int r;

	r = parse_common(argc, argv, cmd, ARGS_JSON | (sequences ? ARGS_TENANT : 0), &a);
	if (r >= 0)
		return r;
	if (optind < argc)
		return usage_error("%s: unexpected argument '%s'", cmd, argv[optind]);
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	r = sequences ? kvd_sequences_get(c, a.tenant, &t) : kvd_connections_get(c, &t);
	if (r < 0)
		return request_error(c, r, cmd);
	if (sequences)
		return emit(&(struct listing){ t, sequence_columns, ELEMENTSOF(sequence_columns),
		                               sequence_json_extra, ELEMENTSOF(sequence_json_extra),
		                               "No open sequences." },
		            a.json);
	return emit(&(struct listing){ t, connection_columns, ELEMENTSOF(connection_columns),
	                               connection_json_extra, ELEMENTSOF(connection_json_extra),
	                               "No connections." },
	            a.json);
}

int cmd_connections(int argc, char **argv) {
	return list_command(argc, argv, false);
}

int cmd_seqs(int argc, char **argv) {
	return list_command(argc, argv, true);
}

int cmd_disconnect(int argc, char **argv) {
	static const struct option options[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_table_freep) kvd_table *t = NULL;
	uint64_t departed = 0, chunks = 0, v;
	unsigned long long id;
	char what[64], *end;
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
			return usage_error("disconnect: bad option");
		}
	if (optind + 1 != argc)
		return usage_error("disconnect: takes one connection id (kvdctl connections lists them)");
	errno = 0;
	id = strtoull(argv[optind], &end, 10);
	if (errno || end == argv[optind] || *end || argv[optind][0] == '-' || id == 0)
		return usage_error("disconnect: '%s' is not a connection id", argv[optind]);
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	snprintf(what, sizeof(what), "disconnect %llu", id);
	/* A departed holder (closed, its process alive) is ended, not disconnected: say so. */
	if (kvd_connections_get(c, &t) < 0)
		t = NULL;
	for (uint32_t i = 0; i < kvd_table_rows(t); i++)
		if (kvd_table_u64(t, i, "id", &v) == 0 && v == id) {
			(void)kvd_table_u64(t, i, "departed", &departed);
			(void)kvd_table_u64(t, i, "chunks", &chunks);
		}
	r = kvd_disconnect(c, id);
	if (r < 0)
		return request_error(c, r, what);
	if (departed)
		printf("departed connection %llu: the charge of its %" PRIu64 " chunks ended; they "
		       "get new memory objects\n", id, chunks);
	else
		printf("connection %llu disconnected\n", id);
	return output_flush();
}
