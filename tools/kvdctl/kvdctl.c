/* SPDX-License-Identifier: MIT */
/*
 * kvdctl: the operator's command line for a running kvd. It shows what the daemon holds
 * (status, tenants, budget get, top, evictions; for people or as JSON), sets and resets the
 * node budget and per-tenant guarantees, caps and weights, and runs eviction rounds on
 * demand (evict). It talks to the daemon only through the
 * public libkvd API, over an administrative connection (no tenant), so it exercises the same
 * ABI that engines use. `score` (score.c) works offline, `top` lives in top.c and what the
 * commands share in util.c (kvdctl.h).
 *
 * Exit codes: 0 success, 1 the request failed (daemon unreachable or refused), 2 usage.
 */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "config.h"
#include "kvdctl.h"
#include "score-cmd.h"

void help(void) {
	printf("Usage: kvdctl [--socket PATH] COMMAND [ARGS]\n"
	       "\n"
	       "Inspect and steer a running kvd KV-cache daemon.\n"
	       "\n"
	       "Commands:\n"
	       "  status [--json]          Daemon, pool, budget and usage, then the tenant table\n"
	       "  tenants [--json]         The tenant table alone\n"
	       "  budget get [--json]      The node budget and where it comes from, the pool\n"
	       "                           and what tenants use\n"
	       "  budget set SIZE|N%% [--dry-run] [--force]\n"
	       "                           Set the node budget live (e.g. 768MiB, 2G, 80%% of the\n"
	       "                           pool). Kept across daemon restarts until reset\n"
	       "  budget reset             Drop the live budget: back to kvd's --budget, the\n"
	       "                           config file's value, or the pool size\n"
	       "  tenant set NAME [--min SIZE] [--max SIZE|none] [--weight N] [--policy NAME]\n"
	       "           [--tier drop|host|host+file] [--recall N] [--dry-run]\n"
	       "                           Create or change a tenant live; options left out keep\n"
	       "                           their value (a new tenant starts with min 0, no cap,\n"
	       "                           weight 1). Kept across daemon restarts until reset\n"
	       "  tenant reset NAME        Drop the tenant's live min, max, weight, policy, tier and\n"
	       "                           recall:\n"
	       "                           back to the config file's values (or the defaults)\n"
	       "  tenant delete NAME       Forget a tenant that holds nothing (no connection,\n"
	       "                           sequence or chunk) and is not in the config file,\n"
	       "                           with its live values; kvd forgets idle ones by itself\n"
	       "                           after its tenant-forget time\n"
	       "  reload                   Make kvd read its config file again (as SIGHUP does);\n"
	       "                           exits 1 with the errors when that failed, the\n"
	       "                           running settings staying\n"
	       "  config [--json]          The settings kvd runs with ([kvd] of kvd.conf), each\n"
	       "                           with its source: default, flag, live or FILE:LINE\n"
	       "  top [--interval SECONDS] [--once] [--json]\n"
	       "                           Per-tenant usage, share of the budget and rates,\n"
	       "                           redrawn in place until q or Ctrl-C\n"
	       "  evict [--tenant NAME] [--bytes SIZE] [--dry-run]\n"
	       "                           Run an eviction round now and wait for it: free SIZE\n"
	       "                           (default: down to the low watermark) from NAME\n"
	       "                           (default: ranked across all tenants)\n"
	       "  evictions [--json]       The daemon's recent eviction rounds, oldest first:\n"
	       "                           what started them, how long they took, what they\n"
	       "                           freed and from whom\n"
	       "  connections [--json]     Who is connected: pid, uid, tenant, sequences, pinned\n"
	       "                           and bytes of each connection\n"
	       "  seqs [--tenant NAME] [--json]\n"
	       "                           Every open sequence (or NAME's): its connection,\n"
	       "                           tokens, pins, bytes, what eviction took and where\n"
	       "                           its K/V are (pool, host tier)\n"
	       "  disconnect ID            Close connection ID (a stuck client): its sequences\n"
	       "                           are released\n"
	       "  score --policy P --q F --k F [--v F] [--wo F] --capacity N --window W [...]\n"
	       "                           Score captured .npy tensors offline (no daemon) and\n"
	       "                           print the kept positions (see 'kvdctl score --help')\n"
	       "\n"
	       "Options:\n"
	       "  --socket PATH       Daemon socket, before or after the command (default:\n"
	       "                      $KVD_SOCKET if set, else %s)\n"
	       "  --json              With status, tenants, budget get and top --once: print one\n"
	       "                      JSON object for scripts; with evictions, connections,\n"
	       "                      seqs and config, one array (default: text for people);\n"
	       "                      before or after the command\n"
	       "  --min SIZE          With tenant set: guaranteed minimum (default: unchanged)\n"
	       "  --max SIZE|none     With tenant set: cap, or none for no cap (default:\n"
	       "                      unchanged)\n"
	       "  --weight N          With tenant set: eviction weight, 1..10000 (default:\n"
	       "                      unchanged)\n"
	       "  --policy NAME       With tenant set: eviction policy, a name kvd.conf(5) lists\n"
	       "                      (default: unchanged)\n"
	       "  --tier WHERE        With tenant set: what memory pressure does with its\n"
	       "                      sequences: drop (evict tokens), host (first move idle\n"
	       "                      ones whole to kvd's host tier) or host+file (and from a\n"
	       "                      full host tier to its file tier) (default: unchanged)\n"
	       "  --recall N          With tenant set: token recall, at most N tokens per row a\n"
	       "                      recall (kvd_seq_recall) brings back of those its rounds\n"
	       "                      evicted and kept in the host tier; 0 turns it off\n"
	       "                      (default: unchanged)\n"
	       "  --interval SECONDS  With top: time between refreshes, 0.1 to 3600, fractions\n"
	       "                      allowed (default: 2)\n"
	       "  --once              With top: sample twice, SECONDS apart, print one frame\n"
	       "                      without clearing the screen and exit (default: refresh\n"
	       "                      until interrupted)\n"
	       "  --tenant NAME       With evict: the tenant to evict from (default: all,\n"
	       "                      ranked by the daemon's policy); with seqs: only its\n"
	       "                      sequences\n"
	       "  --bytes SIZE        With evict: how much to free (default: down to the\n"
	       "                      daemon's low watermark)\n"
	       "  --dry-run           With budget set, tenant set and evict: print what the\n"
	       "                      change would evict now, from whom (bytes, tokens,\n"
	       "                      predicted cost), and change nothing\n"
	       "  --force             With budget set: set a budget below the floor (the\n"
	       "                      tenants' guaranteed minimums together, one chunk)\n"
	       "  -h --help           Show this help and exit\n"
	       "  --version           Show the versions of kvdctl and libkvd and exit\n"
	       "\n"
	       "Tables: USED counts the chunks a tenant holds (what the budget limits), BLOCKS\n"
	       "the bytes inside its granted blocks; %%BUDGET is USED as a share of the node\n"
	       "budget; MAX is - for no cap. TIER: drop, host or host+file, then what the\n"
	       "tenant's sequences moved out hold of the host and file tiers (outside USED).\n"
	       "After MIN, MAX, WEIGHT, POLICY and TIER, * marks a value set live\n"
	       "with kvdctl, + one from the config file and ^ one from kvd's command line; no\n"
	       "mark, the default. A - where a value belongs means the daemon does not report it\n"
	       "(an older kvd). EVICTED (with a kvd that evicts): block bytes evicted from the\n"
	       "tenant so far, then the token slots (t) and the rounds (r) that took them.\n"
	       "top: USED/s is the change of USED per second. EVICTED/s is the block bytes\n"
	       "evicted from the tenant per second, - while the daemon does not report them;\n"
	       "GRANTS/s and REFUSED/s (per tenant) appear once the daemon counts them. HOST\n"
	       "TIER is what the tenant's sequences moved out hold of kvd's host tier. CACHED is\n"
	       "what its prefix cache holds, HIT%% the share of its prefix opens that found\n"
	       "blocks, since the start. No rate is ever estimated.\n"
	       "evictions: TOOK is the whole round, SCORE, SELECT and COMPACT its phases; TARGET\n"
	       "what it set out to free and FREED the chunk bytes it gave back; SEQS the\n"
	       "sequences it scored, UNITS the units it ranked, PREDICTED the summed cost of what\n"
	       "it evicted; then per tenant the block bytes and token slots taken.\n"
	       "\n"
	       "JSON: sizes in bytes; max_bytes is null for no cap; values the daemon does not\n"
	       "report are left out; in top, rates that cannot be computed are null.\n"
	       "Sizes take the suffixes K, M, G, T (binary; KiB, MiB... also accepted).\n"
	       "Exit status: 0 on success, 1 when the daemon is unreachable or refuses (its\n"
	       "message goes to stderr), 2 on usage errors.\n",
	       KVD_DEFAULT_SOCKET);
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
 * Prints what a dry run says the change would take: one line, then per tenant the block
 * bytes, token slots and predicted cost, and that nothing was changed.
 */
static int plan_print(const kvd_evictions *e, const char *change) {
	uint32_t n = kvd_evictions_tenants(e, 0);
	uint64_t planned = 0, target = 0;
	char a[CELL_MAX], b[CELL_MAX];
	const char *note;
	double x;

	(void)kvd_evictions_u64(e, 0, "planned_bytes", &planned);
	(void)kvd_evictions_u64(e, 0, "target_bytes", &target);
	if (planned == 0) {
		printf("dry run: %s would evict nothing now", change);
		if (kvd_evictions_str(e, 0, "note", &note) == 0)
			printf(" (%s)", note);
		printf("; nothing was changed\n");
		return output_flush();
	}
	printf("dry run: %s would evict %s now (the round's target: %s", change,
	       size_format(planned, a, sizeof(a)), size_format(target, b, sizeof(b)));
	if (kvd_evictions_double(e, 0, "predicted_error", &x) == 0)
		printf("; predicted cost %.4g", x);
	printf("); nothing was changed\n");
	{
		static const char *const titles[] = { "TENANT", "EVICTED", "TOKENS", "PREDICTED" };
		_cleanup_(freep) char(*cells)[CELL_MAX] = calloc((size_t)MAX(n, 1u) * 4, CELL_MAX);

		if (!cells)
			return EXIT_FAIL;
		for (uint32_t t = 0; t < n; t++) {
			const char *name;
			uint64_t bytes, tokens;

			if (kvd_evictions_tenant(e, 0, t, &name, &bytes, &tokens) < 0)
				return EXIT_FAIL;
			snprintf(cells[t * 4], CELL_MAX, "%s", name);
			size_format(bytes, cells[t * 4 + 1], CELL_MAX);
			snprintf(cells[t * 4 + 2], CELL_MAX, "%" PRIu64, tokens);
			if (kvd_evictions_tenant_double(e, 0, t, "predicted_error", &x) == 0)
				snprintf(cells[t * 4 + 3], CELL_MAX, "%.4g", x);
			else
				snprintf(cells[t * 4 + 3], CELL_MAX, "-");
		}
		table_print(stdout, &(struct table){ .n_cols = 4, .n_rows = n, .titles = titles,
		                                     .cells = cells });
	}
	return output_flush();
}

/* Parses the budget's SIZE or N% (of the pool). */
static int parse_budget_arg(const char *arg, kvd_budget_params *p) {
	size_t n = strlen(arg);

	if (n > 1 && arg[n - 1] == '%') {
		char digits[8] = "";

		if (n - 1 < sizeof(digits))
			memcpy(digits, arg, n - 1);
		if (n - 1 >= sizeof(digits) || number_parse_u32(digits, 1, 100, &p->percent) < 0)
			return usage_error("budget set: '%s' is not a percent of the pool (1%% to 100%%)",
					   arg);
		return 0;
	}
	return parse_size_arg("budget set", arg, &p->bytes) < 0 ? EXIT_USAGE : 0;
}

/* Connects, gets a status snapshot and reports errors; returns EXIT_OK or EXIT_FAIL. */
static int get_status(kvd_client **ret_c, kvd_status **ret_st) {
	int r;

	r = connect_admin(ret_c);
	if (r != EXIT_OK)
		return r;
	r = kvd_status_get(*ret_c, ret_st);
	if (r < 0)
		return request_error(*ret_c, r, "status");
	return EXIT_OK;
}

/* Emits with write() and reports a failure; returns the exit code. */
static int emit(const char *what, int (*write)(FILE *f, const void *st), const kvd_status *st) {
	int r = output_emit(write, st);

	if (r < 0) {
		fprintf(stderr, "kvdctl: %s: cannot read the daemon's answer: %s\n", what,
			strerror(-r));
		return EXIT_FAIL;
	}
	return output_flush();
}

/* ---- status ---- */

static const char *const node_u64_keys[] = {
	"pool_bytes",     "budget_bytes",     "used_bytes",      "block_bytes",
	"chunk_bytes",    "chunks_total",     "chunks_free",     "chunks_draining",
	"connections",    "protocol_version", "uptime_ms",       "grants_refused",
	"protocol_errors",  "access_refused",   "uid_connections_refused", "rounds_total",
	"unmap_timeouts",   "unmap_disconnects", "engine_events_done", "sequences",
	"sequences_max",    "metadata_bytes",   "metadata_max_bytes", "last_round_us",
	"host_tier_bytes",  "host_tier_used_bytes", "host_tier_sequences", "host_tier_moves",
	"tier_offloads",    "tier_offload_bytes", "tier_offload_us",  "tier_recalls",
	"tier_recall_bytes", "tier_recall_us",  "tier_lost_full",   "tier_lost_corrupt",
	"tier_lost_no_memory", "file_tier_bytes", "file_tier_used_bytes", "file_tier_sequences",
	"tier_demotes",     "tier_demote_bytes", "tier_demote_us",   "tier_file_recalls",
	"tier_file_recall_bytes", "tier_file_recall_us", "tier_file_read_us", "tier_lost_io",
	"recall_kept_tokens", "recall_kept_bytes", "recall_lost_tokens", "recalls",
	"recalled_tokens", "recall_scored_tokens", "recall_us", "gpu_scored_layers",
	"gpu_fallbacks",
};

static const char *const node_str_keys[] = {
	"daemon_version",
	"backend",
	"budget_source",
	"state_error",
};

/* A status string of lines (the standing warnings, the GPUs): ",\n  "KEY": [...]", one
 * string a line; nothing when there is none. */
static int lines_json_write(FILE *f, const kvd_status *st, const char *key) {
	const char *text, *line, *end;

	if (status_str(st, key, &text) != 0 || !*text)
		return 0;
	fprintf(f, ",\n  \"%s\": [", key);
	for (line = text; *line; line = *end ? end + 1 : end) {
		_cleanup_(freep) char *one = NULL;

		end = strchrnul(line, '\n');
		one = strndup(line, (size_t)(end - line));
		if (!one)
			return -ENOMEM;
		fprintf(f, "%s\n    ", line == text ? "" : ",");
		json_string(f, one);
	}
	fprintf(f, "\n  ]");
	return 0;
}

static int status_json_write(FILE *f, const void *userdata) {
	const kvd_status *st = userdata;
	uint64_t v;
	int r;

	fprintf(f, "{\n");
	r = node_json_write(f, st, node_u64_keys, ELEMENTSOF(node_u64_keys), node_str_keys,
			    ELEMENTSOF(node_str_keys));
	if (r < 0)
		return r;
	r = lines_json_write(f, st, "warnings");
	if (r >= 0)
		r = lines_json_write(f, st, "devices");
	if (r < 0)
		return r;
	/* Refusals at each limit, by the daemon's names: an object, so new limits add keys. */
	fprintf(f, ",\n  \"refused\": {");
	for (uint32_t i = 0; i < kvd_status_refusals(st); i++) {
		const char *name;

		if (kvd_status_refusal(st, i, &name, &v) < 0)
			return -EPROTO;
		fprintf(f, "%s\n    ", i ? "," : "");
		json_string(f, name);
		fprintf(f, ": %" PRIu64, v);
	}
	fprintf(f, "%s}", kvd_status_refusals(st) ? "\n  " : "");
	fprintf(f, ",\n  ");
	r = tenants_json_write(f, st, 2);
	if (r < 0)
		return r;
	fprintf(f, "\n}\n");
	return 0;
}

static char *fmt_size(const kvd_status *st, const char *key, char *buf, size_t n) {
	uint64_t v;

	if (status_u64(st, key, &v) != 0)
		snprintf(buf, n, "-");
	else
		size_format(v, buf, n);
	return buf;
}

static const char *budget_source(const kvd_status *st) {
	const char *s;

	return status_str(st, "budget_source", &s) == 0 && *s ? s : "-";
}

/* When the daemon says it cannot save live changes: a line "<indent><label> <why>". */
static void state_error_line(FILE *f, const kvd_status *st, const char *indent, int width,
			     const char *label) {
	const char *why;

	if (status_str(st, "state_error", &why) == 0 && *why)
		fprintf(f, "%s%-*s not saved, lost on restart: %s\n", indent, width, label, why);
}

static int status_table_write(FILE *f, const void *userdata) {
	const kvd_status *st = userdata;
	uint64_t pool = 0, budget = 0, v;
	char a[CELL_MAX], b[CELL_MAX];
	const char *text;

	(void)status_u64(st, "pool_bytes", &pool);
	(void)status_u64(st, "budget_bytes", &budget);

	{
		const char *version = "?", *backend = "?";

		(void)status_str(st, "daemon_version", &version);
		(void)status_str(st, "backend", &backend);
		fprintf(f, "kvd %s, protocol ", version);
		if (status_u64(st, "protocol_version", &v) == 0)
			fprintf(f, "%" PRIu64, v);
		else
			fprintf(f, "?");
		fprintf(f, ", backend %s", backend);
		if (status_u64(st, "uptime_ms", &v) == 0) {
			fmt_uptime(v, a, sizeof(a));
			fprintf(f, ", up %s", a);
		}
		fprintf(f, "\n");
	}
	fprintf(f, "  %-13s %s\n", "socket", arg_socket);
	fprintf(f, "  %-13s %s\n", "pool", fmt_size(st, "pool_bytes", a, sizeof(a)));
	if (status_str(st, "devices", &text) == 0)
		for (const char *line = text, *end; *line; line = *end ? end + 1 : end) {
			end = strchrnul(line, '\n');
			fprintf(f, "  %-13s %.*s\n", line == text ? "gpus" : "", (int)(end - line), line);
		}
	fprintf(f, "  %-13s %-11s %s of pool (source: %s)\n", "budget",
		fmt_size(st, "budget_bytes", a, sizeof(a)), fmt_percent(budget, pool, b, sizeof(b)),
		budget_source(st));
	state_error_line(f, st, "  ", 13, "live state");
	warnings_lines(f, st, "  ");
	if (status_u64(st, "used_bytes", &v) == 0)
		fprintf(f, "  %-13s %-11s %s of budget (chunks held by tenants)\n", "used",
			size_format(v, a, sizeof(a)), fmt_percent(v, budget, b, sizeof(b)));
	else
		fprintf(f, "  %-13s -\n", "used");
	if (status_u64(st, "block_bytes", &v) == 0)
		fprintf(f, "  %-13s %-11s %s of budget (inside granted blocks)\n", "in blocks",
			size_format(v, a, sizeof(a)), fmt_percent(v, budget, b, sizeof(b)));
	else
		fprintf(f, "  %-13s -\n", "in blocks");
	fprintf(f, "  %-13s %s\n", "chunk size", fmt_size(st, "chunk_bytes", a, sizeof(a)));
	{
		uint64_t total = 0, freec = 0, draining = 0;

		if (status_u64(st, "chunks_total", &total) == 0 &&
		    status_u64(st, "chunks_free", &freec) == 0 &&
		    status_u64(st, "chunks_draining", &draining) == 0)
			fprintf(f, "  %-13s %" PRIu64 " total, %" PRIu64 " free, %" PRIu64 " draining\n",
				"chunks", total, freec, draining);
		else
			fprintf(f, "  %-13s -\n", "chunks");
	}
	if (status_u64(st, "host_tier_bytes", &v) == 0 && v > 0) {
		uint64_t used = 0, seqs = 0, in = 0, out = 0, lost = 0, k;

		(void)status_u64(st, "host_tier_used_bytes", &used);
		(void)status_u64(st, "host_tier_sequences", &seqs);
		(void)status_u64(st, "tier_offloads", &out);
		(void)status_u64(st, "tier_recalls", &in);
		for (const char *const *key = (const char *const[]){ "tier_lost_full", "tier_lost_corrupt",
								     "tier_lost_no_memory", "tier_lost_io",
								     NULL };
		     *key; key++)
			if (status_u64(st, *key, &k) == 0)
				lost += k;
		fprintf(f, "  %-13s %s of %s, %" PRIu64 " sequences (outside the budget); %" PRIu64
			" moved out, %" PRIu64 " back, %" PRIu64 " lost\n", "host tier",
			size_format(used, a, sizeof(a)), size_format(v, b, sizeof(b)), seqs, out, in, lost);
		/* Token recall keeps its tokens there too (docs/recall.md). */
		if (status_u64(st, "recall_kept_tokens", &k) == 0) {
			uint64_t bytes = 0, n = 0, back = 0, not_kept = 0;

			(void)status_u64(st, "recall_kept_bytes", &bytes);
			(void)status_u64(st, "recalls", &n);
			(void)status_u64(st, "recalled_tokens", &back);
			(void)status_u64(st, "recall_lost_tokens", &not_kept);
			fprintf(f, "  %-13s %" PRIu64 " evicted tokens kept (%s of the host tier); %" PRIu64
				" recalls brought %" PRIu64 " back; %" PRIu64 " not kept\n", "recall", k,
				size_format(bytes, a, sizeof(a)), n, back, not_kept);
		}
	}
	if (status_u64(st, "file_tier_bytes", &v) == 0 && v > 0) {
		uint64_t used = 0, seqs = 0, in = 0, down = 0;

		(void)status_u64(st, "file_tier_used_bytes", &used);
		(void)status_u64(st, "file_tier_sequences", &seqs);
		(void)status_u64(st, "tier_demotes", &down);
		(void)status_u64(st, "tier_file_recalls", &in);
		fprintf(f, "  %-13s %s of %s, %" PRIu64 " sequences; %" PRIu64 " moved in from the "
			"host tier, %" PRIu64 " back\n", "file tier", size_format(used, a, sizeof(a)),
			size_format(v, b, sizeof(b)), seqs, down, in);
	}
	if (status_u64(st, "connections", &v) == 0)
		fprintf(f, "  %-13s %" PRIu64 "\n", "connections", v);
	{
		uint64_t refused, perr;

		if (status_u64(st, "grants_refused", &refused) == 0 &&
		    status_u64(st, "protocol_errors", &perr) == 0)
			fprintf(f, "  %-13s %" PRIu64 " grants refused, %" PRIu64 " protocol errors\n",
				"errors", refused, perr);
	}
	{
		/* Only the limits that refused something, so that a quiet node shows nothing. */
		bool any = false;

		for (uint32_t i = 0; i < kvd_status_refusals(st); i++) {
			const char *name;

			if (kvd_status_refusal(st, i, &name, &v) < 0 || v == 0)
				continue;
			if (!any)
				fprintf(f, "  %-13s ", "limits hit");
			fprintf(f, "%s%s %" PRIu64, any ? ", " : "", name, v);
			any = true;
		}
		if (any)
			fprintf(f, "\n");
	}
	if (status_u64(st, "rounds_total", &v) == 0) {
		uint64_t us;

		fprintf(f, "  %-13s %" PRIu64 " round%s", "eviction", v, v == 1 ? "" : "s");
		if (v > 0 && status_u64(st, "last_round_us", &us) == 0)
			fprintf(f, ", the last took %.1f ms", (double)us / 1000.0);
		fprintf(f, "\n");
	}
	fprintf(f, "\n");
	return tenants_table_write(f, st);
}

/* A command that prints the daemon's status: as a table, or as JSON with --json. */
static int show_status(int argc, char **argv, const char *name,
		       int (*json_write)(FILE *f, const void *st),
		       int (*table_write)(FILE *f, const void *st)) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	struct common_args a;
	int json, r;

	r = parse_common(argc, argv, name, ARGS_JSON, &a);
	if (r >= 0)
		return r;
	json = a.json;
	if (optind < argc)
		return usage_error("%s: unexpected argument '%s'", name, argv[optind]);

	r = get_status(&c, &st);
	if (r != EXIT_OK)
		return r;
	return emit(name, json ? json_write : table_write, st);
}

static int cmd_status(int argc, char **argv) {
	return show_status(argc, argv, "status", status_json_write, status_table_write);
}

/* ---- tenants ---- */

static int tenants_json(FILE *f, const void *userdata) {
	const kvd_status *st = userdata;
	uint64_t budget;
	int r;

	fprintf(f, "{\n");
	r = status_u64(st, "budget_bytes", &budget);
	if (r < 0)
		return r;
	if (r == 0)
		fprintf(f, "  \"budget_bytes\": %" PRIu64 ",\n", budget);
	fprintf(f, "  ");
	r = tenants_json_write(f, st, 2);
	if (r < 0)
		return r;
	fprintf(f, "\n}\n");
	return 0;
}

static int tenants_table(FILE *f, const void *userdata) {
	return tenants_table_write(f, userdata);
}

static int cmd_tenants(int argc, char **argv) {
	return show_status(argc, argv, "tenants", tenants_json, tenants_table);
}

/* ---- budget ---- */

static int budget_json(FILE *f, const void *userdata) {
	static const char *const u64_keys[] = { "budget_bytes", "pool_bytes", "used_bytes" };
	static const char *const str_keys[] = { "budget_source", "state_error" };
	int r;

	fprintf(f, "{\n");
	r = node_json_write(f, userdata, u64_keys, ELEMENTSOF(u64_keys), str_keys,
			    ELEMENTSOF(str_keys));
	if (r < 0)
		return r;
	fprintf(f, "\n}\n");
	return 0;
}

static int budget_table(FILE *f, const void *userdata) {
	const kvd_status *st = userdata;
	uint64_t pool = 0, budget = 0, used;
	char a[CELL_MAX], b[CELL_MAX];
	const char *source = budget_source(st);

	(void)status_u64(st, "pool_bytes", &pool);
	(void)status_u64(st, "budget_bytes", &budget);
	fprintf(f, "%-7s %-11s %s of pool\n", "budget", fmt_size(st, "budget_bytes", a, sizeof(a)),
		fmt_percent(budget, pool, b, sizeof(b)));
	fprintf(f, "%-7s %s%s\n", "source", source,
		strcmp(source, "live") == 0 ? " (set with kvdctl: kept across daemon restarts until "
					      "'kvdctl budget reset')" :
		strcmp(source, "config") == 0 ? " (the config file)" :
		strcmp(source, "flag") == 0   ? " (kvd's command line)" : "");
	state_error_line(f, st, "", 7, "state");
	fprintf(f, "%-7s %s\n", "pool", fmt_size(st, "pool_bytes", a, sizeof(a)));
	if (status_u64(st, "used_bytes", &used) == 0)
		fprintf(f, "%-7s %-11s %s of budget\n", "used", size_format(used, a, sizeof(a)),
			fmt_percent(used, budget, b, sizeof(b)));
	else
		fprintf(f, "%-7s -\n", "used");
	return 0;
}

/* After a change, says what the budget is now; a failed look-up only loses that detail. */
static void budget_report(kvd_client *c, const char *done) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	uint64_t v;
	char buf[CELL_MAX];

	if (kvd_status_get(c, &st) < 0 || status_u64(st, "budget_bytes", &v) != 0) {
		printf("%s\n", done);
		return;
	}
	printf("%s: budget %s (%" PRIu64 " bytes, source: %s)\n", done,
	       size_format(v, buf, sizeof(buf)), v, budget_source(st));
}

/* kvdctl reload: the daemon reads its config file again; the exit status says whether
 * that worked, which a service manager's reload (ExecReload) reports. */
static int cmd_reload(int argc, char **argv) {
	static const struct option options[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
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
			return usage_error("reload: bad option");
		}
	if (optind != argc)
		return usage_error("reload: takes no arguments");
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	r = kvd_reload(c);
	if (r < 0)
		return request_error(c, r, "reload");
	printf("reloaded: kvd applied its config file\n");
	return EXIT_OK;
}

/* kvdctl config: the settings kvd runs with, each with its source, as --check-config
 * prints a file's before a start. */
static int config_text(FILE *f, const void *userdata) {
	const kvd_table *t = userdata;
	int width = 0;

	for (uint32_t i = 0; i < kvd_table_rows(t); i++) {
		const char *name;

		if (kvd_table_str(t, i, "name", &name) == 0 && (int)strlen(name) > width)
			width = (int)strlen(name);
	}
	for (uint32_t i = 0; i < kvd_table_rows(t); i++) {
		const char *name = "?", *value = "?", *source = "?";

		(void)kvd_table_str(t, i, "name", &name);
		(void)kvd_table_str(t, i, "value", &value);
		(void)kvd_table_str(t, i, "source", &source);
		fprintf(f, "%-*s  %-24s  %s\n", width, name, value, source);
	}
	return 0;
}

static int config_json(FILE *f, const void *userdata) {
	const kvd_table *t = userdata;

	fputs("[", f);
	for (uint32_t i = 0; i < kvd_table_rows(t); i++) {
		static const char *const keys[] = { "name", "value", "source" };

		fputs(i ? ",\n  {" : "\n  {", f);
		for (size_t k = 0; k < ELEMENTSOF(keys); k++) {
			const char *v = "";

			(void)kvd_table_str(t, i, keys[k], &v);
			fprintf(f, "%s\"%s\": ", k ? ", " : "", keys[k]);
			json_string(f, v);
		}
		fputs("}", f);
	}
	fputs(kvd_table_rows(t) ? "\n]\n" : "]\n", f);
	return 0;
}

static int cmd_config(int argc, char **argv) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_table_freep) kvd_table *t = NULL;
	struct common_args a;
	int r;

	r = parse_common(argc, argv, "config", ARGS_JSON, &a);
	if (r >= 0)
		return r;
	if (optind < argc)
		return usage_error("config: unexpected argument '%s'", argv[optind]);
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	r = kvd_config_get(c, &t);
	if (r < 0)
		return request_error(c, r, "config");
	r = output_emit(a.json ? config_json : config_text, t);
	if (r < 0) {
		fprintf(stderr, "kvdctl: config: cannot read the daemon's answer: %s\n", strerror(-r));
		return EXIT_FAIL;
	}
	return output_flush();
}

static int cmd_budget(int argc, char **argv) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	const char *sub;
	char buf[CELL_MAX], what[CELL_MAX + 16];
	struct common_args a;
	int json, r;

	r = parse_common(argc, argv, "budget", ARGS_JSON | ARGS_CHANGE, &a);
	if (r >= 0)
		return r;
	json = a.json;
	if (optind >= argc)
		return usage_error("budget: expected 'get', 'set SIZE' or 'reset'");
	sub = argv[optind];

	if (strcmp(sub, "get") == 0) {
		if (argc - optind != 1)
			return usage_error("budget get: unexpected argument '%s'", argv[optind + 1]);
		r = get_status(&c, &st);
		if (r != EXIT_OK)
			return r;
		return emit("budget get", json ? budget_json : budget_table, st);
	}
	if (json)
		return usage_error("budget %s: --json is an option of 'budget get' only", sub);
	if ((a.dry_run || a.force) && strcmp(sub, "set") != 0)
		return usage_error("budget %s: --dry-run and --force are options of 'budget set'", sub);

	if (strcmp(sub, "set") == 0) {
		kvd_budget_params bp = { .size = sizeof(bp), .flags = a.force ? KVD_BUDGET_FORCE : 0 };

		if (argc - optind != 2)
			return usage_error("budget set: expected exactly one SIZE or N%%");
		if (parse_budget_arg(argv[optind + 1], &bp) != 0)
			return EXIT_USAGE;
		r = connect_admin(&c);
		if (r != EXIT_OK)
			return r;
		if (bp.percent)
			snprintf(what, sizeof(what), "budget set %u%%", bp.percent);
		else
			snprintf(what, sizeof(what), "budget set %s", size_format(bp.bytes, buf, sizeof(buf)));
		if (a.dry_run) {
			_cleanup_(kvd_evictions_freep) kvd_evictions *plan = NULL;

			r = kvd_budget_plan(c, &bp, &plan);
			if (r < 0)
				return request_error(c, r, what);
			return plan_print(plan, what);
		}
		r = kvd_budget_set_params(c, &bp);
		if (r == -ERANGE && !a.force) {
			r = request_error(c, r, what);
			fprintf(stderr, "kvdctl: add --force to set a budget below the floor anyway\n");
			return r;
		}
		if (r < 0)
			return request_error(c, r, what);
		change_warning(c, r, what);
		budget_report(c, "budget set");
		return output_flush();
	}
	if (strcmp(sub, "reset") == 0) {
		if (argc - optind != 1)
			return usage_error("budget reset: unexpected argument '%s'", argv[optind + 1]);
		r = connect_admin(&c);
		if (r != EXIT_OK)
			return r;
		r = kvd_budget_reset(c);
		if (r < 0)
			return request_error(c, r, "budget reset");
		change_warning(c, r, "budget reset");
		budget_report(c, "budget reset");
		return output_flush();
	}
	return usage_error("budget: unknown subcommand '%s' (get, set SIZE, reset)", sub);
}

/* ---- tenant ---- */

/* After a change, says what the tenant's values are now (with their sources, where the
 * daemon reports them); a failed look-up only loses that detail. */
static void tenant_report(kvd_client *c, const char *name, const char *done) {
	static const struct {
		const char *label, *key, *source;
		int size;
	} fields[] = {
		{ "min", "min_bytes", "min_source", 1 },
		{ "max", "max_bytes", "max_source", 1 },
		{ "weight", "weight", "weight_source", 0 },
	};
	const char *policy, *policy_source, *tier, *tier_source, *recall_source;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	uint32_t t;

	printf("tenant %s %s", name, done);
	if (kvd_status_get(c, &st) < 0 || tenant_find(st, name, &t) < 0) {
		printf("\n");
		return;
	}
	for (size_t i = 0; i < ELEMENTSOF(fields); i++) {
		const char *source;
		char buf[CELL_MAX];
		uint64_t v;

		if (status_tenant_u64(st, t, fields[i].key, &v) != 0)
			snprintf(buf, sizeof(buf), "-");
		else if (!fields[i].size)
			snprintf(buf, sizeof(buf), "%" PRIu64, v);
		else if (v == KVD_TENANT_NO_CAP)
			snprintf(buf, sizeof(buf), "none");
		else
			size_format(v, buf, sizeof(buf));
		printf("%s %s %s", i ? "," : ":", fields[i].label, buf);
		if (status_tenant_str(st, t, fields[i].source, &source) == 0)
			printf(" (%s)", source);
	}
	if (status_tenant_str(st, t, "policy", &policy) == 0) {
		printf(", policy %s", policy);
		if (status_tenant_str(st, t, "policy_source", &policy_source) == 0)
			printf(" (%s)", policy_source);
	}
	if (status_tenant_str(st, t, "tier", &tier) == 0) {
		printf(", tier %s", tier);
		if (status_tenant_str(st, t, "tier_source", &tier_source) == 0)
			printf(" (%s)", tier_source);
	}
	{
		uint64_t recall;

		if (status_tenant_u64(st, t, "recall", &recall) == 0) {
			printf(", recall %" PRIu64, recall);
			if (status_tenant_str(st, t, "recall_source", &recall_source) == 0)
				printf(" (%s)", recall_source);
		}
	}
	printf("\n");
}

static int cmd_tenant(int argc, char **argv) {
	static const struct option options[] = {
		{ "min", required_argument, NULL, 'm' },
		{ "max", required_argument, NULL, 'M' },
		{ "weight", required_argument, NULL, 'w' },
		{ "policy", required_argument, NULL, 'p' },
		{ "tier", required_argument, NULL, 't' },
		{ "recall", required_argument, NULL, 'r' },
		{ "dry-run", no_argument, NULL, 'n' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	kvd_tenant_params p = { .size = sizeof(p) };
	int dry_run = 0;
	const char *sub, *name;
	char what[128];
	int opt, r;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 'm':
			if (parse_size_arg("--min", optarg, &p.min_bytes) < 0)
				return EXIT_USAGE;
			if (p.min_bytes >= KVD_TENANT_KEEP)
				return usage_error("--min: too large");
			p.set |= KVD_TENANT_SET_MIN;
			break;
		case 'M':
			if (strcmp(optarg, "none") == 0)
				p.max_bytes = KVD_TENANT_NO_CAP;
			else if (parse_size_arg("--max", optarg, &p.max_bytes) < 0)
				return EXIT_USAGE;
			else if (p.max_bytes >= KVD_TENANT_KEEP)
				return usage_error("--max: too large (use none for no cap)");
			p.set |= KVD_TENANT_SET_MAX;
			break;
		case 'w':
			if (number_parse_u32(optarg, 1, KVD_TENANT_WEIGHT_MAX, &p.weight) < 0)
				return usage_error("--weight: '%s' must be a number in 1..%u", optarg,
						   KVD_TENANT_WEIGHT_MAX);
			p.set |= KVD_TENANT_SET_WEIGHT;
			break;
		case 'p':
			/* The daemon knows the names (kvd.conf(5)); it says which it does not. */
			p.policy = optarg;
			p.set |= KVD_TENANT_SET_POLICY;
			break;
		case 't':
			p.tier = optarg;
			p.set |= KVD_TENANT_SET_TIER;
			break;
		case 'r':
			/* The daemon says what it allows (its bound, a host tier). */
			if (number_parse_u32(optarg, 0, UINT32_MAX, &p.recall) < 0)
				return usage_error("--recall: '%s' is not a number of tokens", optarg);
			p.set |= KVD_TENANT_SET_RECALL;
			break;
		case 'n':
			dry_run = 1;
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
	if (optind >= argc)
		return usage_error("tenant: expected 'set NAME [--min SIZE] [--max SIZE|none] "
				   "[--weight N] [--policy NAME] [--tier WHERE] [--recall N]', 'reset NAME' or "
				   "'delete NAME'");
	sub = argv[optind];
	if (strcmp(sub, "set") != 0 && strcmp(sub, "reset") != 0 && strcmp(sub, "delete") != 0)
		return usage_error("tenant: unknown subcommand '%s' (set, reset, delete)", sub);
	if (argc - optind != 2)
		return usage_error("tenant %s: expected exactly one NAME", sub);
	name = argv[optind + 1];
	if (dry_run && strcmp(sub, "set") != 0)
		return usage_error("tenant %s: --dry-run is an option of 'tenant set'", sub);

	if (strcmp(sub, "delete") == 0) {
		if (p.set)
			return usage_error("tenant delete: --min, --max, --weight, --policy, --tier and --recall "
					   "to 'tenant set'");
		snprintf(what, sizeof(what), "tenant delete %s", name);
		r = connect_admin(&c);
		if (r != EXIT_OK)
			return r;
		r = kvd_tenant_delete(c, name);
		if (r < 0)
			return request_error(c, r, what);
		change_warning(c, r, what);
		printf("tenant %s deleted\n", name);
		return output_flush();
	}
	if (strcmp(sub, "reset") == 0) {
		if (p.set)
			return usage_error("tenant reset: --min, --max, --weight, --policy, --tier and --recall "
					   "to 'tenant set'");
		snprintf(what, sizeof(what), "tenant reset %s", name);
		r = connect_admin(&c);
		if (r != EXIT_OK)
			return r;
		r = kvd_tenant_reset(c, name);
		if (r < 0)
			return request_error(c, r, what);
		change_warning(c, r, what);
		tenant_report(c, name, "reset");
		return output_flush();
	}

	/* With no option this still does something: it creates the tenant with the defaults. */
	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	snprintf(what, sizeof(what), "tenant set %s", name);
	if (dry_run) {
		_cleanup_(kvd_evictions_freep) kvd_evictions *plan = NULL;

		r = kvd_tenant_plan(c, name, &p, &plan);
		if (r < 0)
			return request_error(c, r, what);
		return plan_print(plan, what);
	}
	r = kvd_tenant_set_params(c, name, &p);
	if (r < 0)
		return request_error(c, r, what);
	change_warning(c, r, what);
	tenant_report(c, name, "set");
	return output_flush();
}

/* ---- evict ---- */

static int cmd_evict(int argc, char **argv) {
	static const struct option options[] = {
		{ "tenant", required_argument, NULL, 't' },
		{ "bytes", required_argument, NULL, 'b' },
		{ "dry-run", no_argument, NULL, 'n' },
		{ "socket", required_argument, NULL, 's' },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	const char *tenant = NULL;
	uint64_t bytes = 0, freed = 0;
	char what[128], a[CELL_MAX], b[CELL_MAX];
	int opt, r, dry_run = 0;

	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case 't':
			tenant = optarg;
			break;
		case 'b':
			if (parse_size_arg("--bytes", optarg, &bytes) < 0)
				return EXIT_USAGE;
			/* 0 would mean the default to the library; say so rather than guess. */
			if (bytes == 0)
				return usage_error("--bytes: must be more than 0 (leave it out to evict "
						   "down to the low watermark)");
			break;
		case 'n':
			dry_run = 1;
			break;
		case 's':
			arg_socket = optarg;
			break;
		case 'h':
			help();
			return EXIT_OK;
		default:
			return usage_error("evict: bad option");
		}
	if (optind < argc)
		return usage_error("evict: unexpected argument '%s'", argv[optind]);

	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	snprintf(what, sizeof(what), "evict%s%s", tenant ? " --tenant " : "", tenant ? tenant : "");
	if (dry_run) {
		_cleanup_(kvd_evictions_freep) kvd_evictions *plan = NULL;

		r = kvd_evict_plan(c, tenant, bytes, &plan);
		if (r < 0)
			return request_error(c, r, what);
		return plan_print(plan, what);
	}
	r = kvd_evict(c, tenant, bytes, &freed);
	if (r < 0)
		return request_error(c, r, what);
	printf("freed %s", size_format(freed, a, sizeof(a)));
	if (bytes)
		printf(" of %s requested", size_format(bytes, b, sizeof(b)));
	else
		printf(" (down to the low watermark)");
	if (tenant)
		printf(" from tenant %s", tenant);
	printf("\n");
	/* Nothing freed: the round's note says why (the latest evict round is this one,
	 * unless another kvdctl evict ran at the same moment). */
	if (freed == 0) {
		_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;

		for (uint32_t i = kvd_evictions_get(c, &e) < 0 ? 0 : kvd_evictions_count(e); i-- > 0;) {
			const char *trigger, *note;

			if (kvd_evictions_str(e, i, "trigger", &trigger) < 0 || strcmp(trigger, "evict") != 0)
				continue;
			if (kvd_evictions_str(e, i, "note", &note) == 0)
				printf("why: %s\n", note);
			break;
		}
	}
	return output_flush();
}

/* ---- evictions ---- */

/* What the evictions writers need: the rounds, and the daemon's uptime for their age. */
struct evictions_view {
	const kvd_evictions *e;
	uint64_t uptime_ms;
	int have_uptime;
};

static int round_u64(const kvd_evictions *e, uint32_t i, const char *key, uint64_t *ret) {
	int r = kvd_evictions_u64(e, i, key, ret);

	return r == -ENOENT ? 1 : r;
}

/* A duration in microseconds as milliseconds ("12.3ms"), or "-" when not sent. */
static int cell_ms(const kvd_evictions *e, uint32_t i, const char *key, char *cell) {
	uint64_t v;
	int r;

	r = round_u64(e, i, key, &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cell, CELL_MAX, "-");
	else
		snprintf(cell, CELL_MAX, "%.2fms", (double)v / 1000.0);
	return 0;
}

static int cell_round_size(const kvd_evictions *e, uint32_t i, const char *key, char *cell) {
	uint64_t v;
	int r;

	r = round_u64(e, i, key, &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cell, CELL_MAX, "-");
	else
		size_format(v, cell, CELL_MAX);
	return 0;
}

static int cell_round_count(const kvd_evictions *e, uint32_t i, const char *key, char *cell) {
	uint64_t v;
	int r;

	r = round_u64(e, i, key, &v);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cell, CELL_MAX, "-");
	else
		snprintf(cell, CELL_MAX, "%" PRIu64, v);
	return 0;
}

enum {
	EV_ID,
	EV_TRIGGER,
	EV_STARTED,
	EV_TOOK,
	EV_SCORE,
	EV_SELECT,
	EV_COMPACT,
	EV_TARGET,
	EV_FREED,
	EV_SEQS,
	EV_UNITS,
	EV_PREDICTED,
	EV_COLS,
};

static const char *const ev_title[EV_COLS] = {
	"ID",     "TRIGGER", "STARTED", "TOOK", "SCORE", "SELECT",
	"COMPACT", "TARGET", "FREED",   "SEQS", "UNITS", "PREDICTED",
};
static const unsigned char ev_left[EV_COLS] = { [EV_TRIGGER] = 1 };

/* "failed: why; " then "llama -64.0 MiB (4096 tokens), ...", or "-" for neither. */
static int round_tenants_text(const kvd_evictions *e, uint32_t i, char **ret) {
	_cleanup_(freep) char *buf = NULL;
	uint32_t n = kvd_evictions_tenants(e, i);
	const char *err;
	size_t size = 0;
	FILE *f;
	int r;

	f = open_memstream(&buf, &size);
	if (!f)
		return negative_errno();
	if (kvd_evictions_str(e, i, "error", &err) == 0)
		fprintf(f, "failed: %s%s", err, n ? "; " : "");
	for (uint32_t t = 0; t < n; t++) {
		const char *name;
		uint64_t bytes, tokens;
		char sz[CELL_MAX];

		r = kvd_evictions_tenant(e, i, t, &name, &bytes, &tokens);
		if (r < 0) {
			fclose(f);
			return r;
		}
		fprintf(f, "%s%s -%s (%" PRIu64 " tokens)", t ? ", " : "", name,
			size_format(bytes, sz, sizeof(sz)), tokens);
	}
	/* What the round planned and did not apply (yet), and why it freed nothing. */
	{
		static const struct {
			const char *key, *what;
		} parts[] = { { "waiting_bytes", "waiting for unpins" },
			      { "dropped_bytes", "dropped (sequences released or rewritten)" } };
		const char *note;
		uint64_t v;

		for (size_t k = 0; k < ELEMENTSOF(parts); k++)
			if (kvd_evictions_u64(e, i, parts[k].key, &v) == 0 && v > 0) {
				char sz[CELL_MAX];

				fprintf(f, "%s%s %s", ftell(f) ? "; " : "", size_format(v, sz, sizeof(sz)),
					parts[k].what);
			}
		if (kvd_evictions_str(e, i, "note", &note) == 0)
			fprintf(f, "%s%s", ftell(f) ? "; " : "", note);
		/* A recall (docs/recall.md) frees nothing: it trades. */
		if (kvd_evictions_u64(e, i, "recalled_tokens", &v) == 0) {
			uint64_t scored = 0;

			(void)kvd_evictions_u64(e, i, "scored_tokens", &scored);
			fprintf(f, "%s%" PRIu64 " tokens back of %" PRIu64 " kept ones scored",
				ftell(f) ? "; " : "", v, scored);
		}
	}
	if (fclose(f) != 0)
		return -ENOMEM;
	if (size == 0) {
		free(buf);
		buf = strdup("-");
		if (!buf)
			return -ENOMEM;
	}
	*ret = TAKE_PTR(buf);
	return 0;
}

static int round_row(const struct evictions_view *v, uint32_t i, char (*cells)[CELL_MAX]) {
	const kvd_evictions *e = v->e;
	const char *s;
	uint64_t start;
	double x;
	int r;

	if ((r = cell_round_count(e, i, "id", cells[EV_ID])) < 0)
		return r;
	r = kvd_evictions_str(e, i, "trigger", &s);
	if (r < 0 && r != -ENOENT)
		return r;
	snprintf(cells[EV_TRIGGER], CELL_MAX, "%s", r == 0 && *s ? s : "-");

	/* How long ago, by the daemon's clock; without its uptime, when after its start. */
	r = round_u64(e, i, "start_ms", &start);
	if (r < 0)
		return r;
	if (r > 0)
		snprintf(cells[EV_STARTED], CELL_MAX, "-");
	else if (v->have_uptime && v->uptime_ms >= start) {
		char up[32];

		fmt_uptime(v->uptime_ms - start, up, sizeof(up));
		snprintf(cells[EV_STARTED], CELL_MAX, "%s ago", up);
	} else {
		char up[32];

		fmt_uptime(start, up, sizeof(up));
		snprintf(cells[EV_STARTED], CELL_MAX, "up %s", up);
	}

	if ((r = cell_ms(e, i, "duration_us", cells[EV_TOOK])) < 0 ||
	    (r = cell_ms(e, i, "score_us", cells[EV_SCORE])) < 0 ||
	    (r = cell_ms(e, i, "select_us", cells[EV_SELECT])) < 0 ||
	    (r = cell_ms(e, i, "compact_us", cells[EV_COMPACT])) < 0 ||
	    (r = cell_round_size(e, i, "target_bytes", cells[EV_TARGET])) < 0 ||
	    (r = cell_round_size(e, i, "freed_bytes", cells[EV_FREED])) < 0 ||
	    (r = cell_round_count(e, i, "sequences", cells[EV_SEQS])) < 0 ||
	    (r = cell_round_count(e, i, "units", cells[EV_UNITS])) < 0)
		return r;

	r = kvd_evictions_double(e, i, "predicted_error", &x);
	if (r < 0 && r != -ENOENT)
		return r;
	if (r == 0)
		snprintf(cells[EV_PREDICTED], CELL_MAX, "%.4g", x);
	else
		snprintf(cells[EV_PREDICTED], CELL_MAX, "-");
	return 0;
}

static void free_strv(char **v, uint32_t n) {
	for (uint32_t i = 0; v && i < n; i++)
		free(v[i]);
	free(v);
}

static int evictions_table(FILE *f, const void *userdata) {
	const struct evictions_view *v = userdata;
	_cleanup_(freep) char (*cells)[CELL_MAX] = NULL;
	uint32_t n = kvd_evictions_count(v->e), done = 0;
	char **tail = NULL;
	int r = 0;

	if (n == 0) {
		fprintf(f, "No eviction rounds.\n");
		return 0;
	}
	cells = calloc((size_t)n * EV_COLS, sizeof(*cells));
	tail = calloc(n, sizeof(*tail));
	if (!cells || !tail) {
		free(tail);
		return -ENOMEM;
	}
	for (; done < n; done++) {
		r = round_row(v, done, cells + (size_t)done * EV_COLS);
		if (r < 0)
			break;
		r = round_tenants_text(v->e, done, &tail[done]);
		if (r < 0)
			break;
	}
	if (r >= 0)
		table_print(f, &(struct table){
					.n_cols = EV_COLS,
					.n_rows = n,
					.titles = ev_title,
					.left = ev_left,
					.cells = cells,
					.tail_title = "TENANTS",
					.tail = tail,
				});
	free_strv(tail, n);
	return r;
}

/* Finite doubles as numbers, anything else as null (JSON has no NaN). */
static void json_double(FILE *f, double x) {
	if (isfinite(x))
		fprintf(f, "%.17g", x);
	else
		fputs("null", f);
}

static int evictions_json(FILE *f, const void *userdata) {
	static const char *const u64_keys[] = {
		"id",         "start_ms",     "duration_us", "score_us",  "select_us",
		"compact_us", "target_bytes", "freed_bytes", "sequences", "units",
		"planned_bytes", "waiting_bytes", "dropped_bytes", "recalled_tokens", "scored_tokens",
	};
	static const char *const str_keys[] = { "trigger", "error", "note" };
	const struct evictions_view *v = userdata;
	const kvd_evictions *e = v->e;
	uint32_t n = kvd_evictions_count(e);

	fputc('[', f);
	for (uint32_t i = 0; i < n; i++) {
		uint32_t n_tenants = kvd_evictions_tenants(e, i);
		const char *sep = "";
		double x;
		int r;

		fprintf(f, "%s\n  {", i ? "," : "");
		for (size_t k = 0; k < ELEMENTSOF(u64_keys); k++) {
			uint64_t val;

			r = round_u64(e, i, u64_keys[k], &val);
			if (r < 0)
				return r;
			if (r > 0)
				continue;
			fprintf(f, "%s\n    \"%s\": %" PRIu64, sep, u64_keys[k], val);
			sep = ",";
		}
		for (size_t k = 0; k < ELEMENTSOF(str_keys); k++) {
			const char *s;

			r = kvd_evictions_str(e, i, str_keys[k], &s);
			if (r == -ENOENT)
				continue;
			if (r < 0)
				return r;
			fprintf(f, "%s\n    \"%s\": ", sep, str_keys[k]);
			json_string(f, s);
			sep = ",";
		}
		r = kvd_evictions_double(e, i, "predicted_error", &x);
		if (r < 0 && r != -ENOENT)
			return r;
		if (r == 0) {
			fprintf(f, "%s\n    \"predicted_error\": ", sep);
			json_double(f, x);
			sep = ",";
		}
		fprintf(f, "%s\n    \"tenants\": [", sep);
		for (uint32_t t = 0; t < n_tenants; t++) {
			const char *name;
			uint64_t bytes, tokens;

			r = kvd_evictions_tenant(e, i, t, &name, &bytes, &tokens);
			if (r < 0)
				return r;
			fprintf(f, "%s\n      { \"name\": ", t ? "," : "");
			json_string(f, name);
			fprintf(f, ", \"freed_bytes\": %" PRIu64 ", \"evicted_tokens\": %" PRIu64 " }",
				bytes, tokens);
		}
		fprintf(f, "%s]\n  }", n_tenants ? "\n    " : "");
	}
	fprintf(f, "%s]\n", n ? "\n" : "");
	return 0;
}

static int cmd_evictions(int argc, char **argv) {
	_cleanup_(kvd_client_unrefp) kvd_client *c = NULL;
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	struct evictions_view v = {};
	struct common_args a;
	int json, r;

	r = parse_common(argc, argv, "evictions", ARGS_JSON, &a);
	if (r >= 0)
		return r;
	json = a.json;
	if (optind < argc)
		return usage_error("evictions: unexpected argument '%s'", argv[optind]);

	r = connect_admin(&c);
	if (r != EXIT_OK)
		return r;
	r = kvd_evictions_get(c, &e);
	if (r < 0)
		return request_error(c, r, "evictions");
	v.e = e;
	/* Only for the age column: without it the table says when after the daemon's start. */
	if (!json && kvd_status_get(c, &st) >= 0 && status_u64(st, "uptime_ms", &v.uptime_ms) == 0)
		v.have_uptime = 1;

	r = output_emit(json ? evictions_json : evictions_table, &v);
	if (r < 0) {
		fprintf(stderr, "kvdctl: evictions: cannot read the daemon's answer: %s\n",
			strerror(-r));
		return EXIT_FAIL;
	}
	return output_flush();
}

int main(int argc, char **argv) {
	static const struct option options[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "json", no_argument, NULL, 'j' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{},
	};
	static const struct {
		const char *name;
		int (*run)(int argc, char **argv);
		bool json; /* has --json */
	} commands[] = {
		{ "status", cmd_status, true },	  { "tenants", cmd_tenants, true },
		{ "budget", cmd_budget, true },	  { "tenant", cmd_tenant, false },
		{ "top", cmd_top, true },	  { "score", cmd_score, false },
		{ "evict", cmd_evict, false },	  { "evictions", cmd_evictions, true },
		{ "connections", cmd_connections, true }, { "seqs", cmd_seqs, true },
		{ "disconnect", cmd_disconnect, false }, { "reload", cmd_reload, false },
		{ "config", cmd_config, true },
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
		case 'j':
			arg_json = 1;
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
		return usage_error("missing command (status, tenants, budget, tenant, reload, "
				   "config, top, evict, evictions, connections, seqs, disconnect, "
				   "score)");

	for (size_t i = 0; i < ELEMENTSOF(commands); i++)
		if (strcmp(argv[optind], commands[i].name) == 0) {
			if (arg_json && !commands[i].json)
				return usage_error("%s: --json is not an option of this command",
						   commands[i].name);
			return commands[i].run(argc - optind, argv + optind);
		}
	return usage_error("unknown command '%s'", argv[optind]);
}
