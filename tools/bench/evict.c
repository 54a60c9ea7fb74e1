/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench evict: time of the node-wide selection (kvd_evict_greedy(), kernels/select.h)
 * over the units of a whole node, next to its target of 10M units in 50 ms on one
 * core (5 ns per unit; smaller sizes are held to the same rate).
 *
 * The units stand in for a node's: seeded random values (shares, > 0), sizes drawn from
 * head-token (256 B), layer-token (4 KiB) and block (64 KiB) units, 2% pinned (sinks,
 * windows, tails), and groups of about GROUP_UNITS units (one per (sequence, layer)), each
 * of which may give up at most 90% of its units (the floor). Every round frees 30% of all
 * the bytes. The reference (a full sort) runs at sizes up to REF_UNITS_MAX and must choose
 * the same units.
 *
 * Two calls are timed: kvd_evict_greedy(), which allocates its scratch per call (and pays
 * its page faults), and kvd_evict_greedy_buf() in a scratch allocated and faulted in
 * once, ahead of the timings, as the daemon keeps it across rounds. Both must choose the
 * same units.
 *
 * With --socket, the full-round benchmark against a running daemon (round.c) follows.
 * This is a benchmark, not a test: nothing here asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "select.h"
#include "cli.h"

#define SIZES_MAX 16
#define UNITS_MAX 100000000u
#define REPS_MAX 1000
#define GROUP_UNITS 1000u
/* Per group, at most this share of its units may go (per mille): a floor of 10%. */
#define GROUP_EVICT_PERMILLE 900u
#define PINNED_PERMILLE 20u
#define TARGET_PERMILLE 300u
#define SEED UINT64_C(0x6b76642d65766963)
/* The reference sorts: it runs by default only up to this size. */
#define REF_UNITS_MAX 1000000u
/* The target: 10M units in 50 ms on one core. */
#define TARGET_UNITS 10000000.0
#define TARGET_MS 50.0

static const uint32_t unit_sizes[] = { 256, 4096, 65536 };

static uint32_t arg_units[SIZES_MAX] = { 1000000, 10000000 };
static unsigned arg_n_units = 2;
static int64_t arg_groups = -1; /* -1: one per GROUP_UNITS units */
static unsigned arg_reps = 5;
static const char *arg_socket;

struct units {
	uint32_t n, n_groups;
	float *value;
	uint32_t *bytes;
	uint8_t *pinned;
	uint32_t *group_start, *group_max_units;
	uint64_t total;
	uint32_t *ids, *ids_buf, *ids_ref;
	void *scratch; /* kvd_evict_greedy_buf()'s, faulted in */
	size_t scratch_bytes;
};

static void units_done(struct units *u) {
	free(u->value);
	free(u->bytes);
	free(u->pinned);
	free(u->group_start);
	free(u->group_max_units);
	free(u->ids);
	free(u->ids_buf);
	free(u->ids_ref);
	free(u->scratch);
}

static double now_s(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* splitmix64: seedable, the same sequence everywhere. */
static uint64_t rng_next(uint64_t *s) {
	uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));

	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static int units_init(struct units *u, uint32_t n) {
	uint64_t s = SEED;
	uint32_t g;

	*u = (struct units){ .n = n };
	u->n_groups = arg_groups < 0 ? MAX(n / GROUP_UNITS, 1u) : (uint32_t)arg_groups;
	u->value = malloc(n * sizeof(float));
	u->bytes = malloc(n * sizeof(uint32_t));
	u->pinned = malloc(n);
	u->group_start = malloc(((size_t)u->n_groups + 1) * sizeof(uint32_t));
	u->group_max_units = malloc((u->n_groups ? u->n_groups : 1) * sizeof(uint32_t));
	u->ids = malloc(n * sizeof(uint32_t));
	u->ids_buf = malloc(n * sizeof(uint32_t));
	u->scratch_bytes = kvd_evict_greedy_scratch_bytes(n);
	u->scratch = malloc(u->scratch_bytes);
	if (!u->value || !u->bytes || !u->pinned || !u->group_start || !u->group_max_units ||
	    !u->ids || !u->ids_buf || !u->scratch)
		return -ENOMEM;
	/* What the daemon does once: later rounds find the pages mapped. */
	memset(u->scratch, 0, u->scratch_bytes);
	for (uint32_t i = 0; i < n; i++) {
		uint64_t r = rng_next(&s);

		/* Shares in (0, 1], 24 bits: exact in a float, and ties are rare but occur. */
		u->value[i] = (float)((r >> 40) + 1) * (1.0f / (1u << 24));
		u->bytes[i] = unit_sizes[(r & 0xffff) % ELEMENTSOF(unit_sizes)];
		u->pinned[i] = (r >> 16 & 0xffff) % 1000 < PINNED_PERMILLE;
		u->total += u->bytes[i];
	}
	for (g = 0; g <= u->n_groups; g++)
		u->group_start[g] = (uint32_t)((uint64_t)g * n / MAX(u->n_groups, 1u));
	for (g = 0; g < u->n_groups; g++)
		u->group_max_units[g] =
			(u->group_start[g + 1] - u->group_start[g]) * GROUP_EVICT_PERMILLE / 1000;
	return 0;
}

static struct kvd_evict_in units_in(const struct units *u) {
	return (struct kvd_evict_in){
		.n = u->n, .value = u->value, .bytes = u->bytes, .pinned = u->pinned,
		.n_groups = u->n_groups, .group_start = u->group_start,
		.group_max_units = u->group_max_units,
		.target = u->total * TARGET_PERMILLE / 1000,
	};
}

static int cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* The calls timed, on u's units into ids. */
typedef int (*greedy_fn)(const struct units *u, const struct kvd_evict_in *in, uint32_t *ids,
			 uint32_t *ret_n_ids, uint64_t *ret_freed);

static int greedy_alloc(const struct units *u, const struct kvd_evict_in *in, uint32_t *ids,
			uint32_t *ret_n_ids, uint64_t *ret_freed) {
	(void)u;
	return kvd_evict_greedy(in, ids, ret_n_ids, ret_freed);
}

static int greedy_buf(const struct units *u, const struct kvd_evict_in *in, uint32_t *ids,
		      uint32_t *ret_n_ids, uint64_t *ret_freed) {
	return kvd_evict_greedy_buf(in, u->scratch, u->scratch_bytes, ids, ret_n_ids, ret_freed);
}

static int greedy_ref(const struct units *u, const struct kvd_evict_in *in, uint32_t *ids,
		      uint32_t *ret_n_ids, uint64_t *ret_freed) {
	(void)u;
	return kvd_evict_greedy_ref(in, ids, ret_n_ids, ret_freed);
}

/*
 * Runs greedy on u arg_reps times after one warm-up (when there is more than one), and
 * returns the median time in *ret_s and the last run's result.
 */
static int time_greedy(greedy_fn greedy, const struct units *u, uint32_t *ids, double *ret_s,
		       uint32_t *ret_n_ids, uint64_t *ret_freed) {
	struct kvd_evict_in in = units_in(u);
	double t[REPS_MAX];
	int r;

	if (arg_reps > 1) {
		r = greedy(u, &in, ids, ret_n_ids, ret_freed);
		if (r < 0)
			return r;
	}
	for (unsigned k = 0; k < arg_reps; k++) {
		double t0 = now_s();

		r = greedy(u, &in, ids, ret_n_ids, ret_freed);
		t[k] = now_s() - t0;
		if (r < 0)
			return r;
	}
	qsort(t, arg_reps, sizeof(double), cmp_double);
	*ret_s = arg_reps % 2 ? t[arg_reps / 2] : (t[arg_reps / 2 - 1] + t[arg_reps / 2]) / 2;
	return 0;
}

/* Prints one row of the table: call's median s for n units, and what it chose. */
static void print_row(const struct units *u, const char *call, double s, uint32_t n_ids,
		      uint64_t freed) {
	double budget_ms = TARGET_MS * u->n / TARGET_UNITS;
	uint64_t target = units_in(u).target;

	printf("%10u %8u %-7s %10.3f %8.2f %10u %10.3f %8.3f %7.3f  %s\n", u->n, u->n_groups, call,
	       s * 1e3, s * 1e9 / u->n, n_ids, (double)freed / (double)target, budget_ms,
	       s * 1e3 / budget_ms, s * 1e3 <= budget_ms ? "PASS" : "over target");
}

static int bench_units(uint32_t n) {
	_cleanup_(units_done) struct units u = {};
	uint32_t n_ids, n_ids_buf, n_ids_ref;
	uint64_t freed, freed_buf, freed_ref;
	double s, s_buf, s_ref;
	int r, same;

	r = units_init(&u, n);
	if (r < 0) {
		fprintf(stderr, "kvd-bench evict: %u units: %s\n", n, strerror(-r));
		return r;
	}
	r = time_greedy(greedy_alloc, &u, u.ids, &s, &n_ids, &freed);
	if (r < 0) {
		fprintf(stderr, "kvd-bench evict: kvd_evict_greedy(%u units): %s\n", n, strerror(-r));
		return r;
	}
	print_row(&u, "greedy", s, n_ids, freed);
	r = time_greedy(greedy_buf, &u, u.ids_buf, &s_buf, &n_ids_buf, &freed_buf);
	if (r < 0) {
		fprintf(stderr, "kvd-bench evict: kvd_evict_greedy_buf(%u units): %s\n", n,
			strerror(-r));
		return r;
	}
	print_row(&u, "buf", s_buf, n_ids_buf, freed_buf);
	if (n_ids != n_ids_buf || freed != freed_buf ||
	    memcmp(u.ids, u.ids_buf, n_ids * sizeof(uint32_t)) != 0) {
		fprintf(stderr, "kvd-bench evict: %u units: kvd_evict_greedy and "
				"kvd_evict_greedy_buf chose different units (%u and %u)\n",
			n, n_ids, n_ids_buf);
		return -EIO;
	}
	if (n > REF_UNITS_MAX)
		return 0;

	u.ids_ref = malloc(n * sizeof(uint32_t));
	if (!u.ids_ref) {
		fprintf(stderr, "kvd-bench evict: %u units: %s\n", n, strerror(ENOMEM));
		return -ENOMEM;
	}
	r = time_greedy(greedy_ref, &u, u.ids_ref, &s_ref, &n_ids_ref, &freed_ref);
	if (r < 0) {
		fprintf(stderr, "kvd-bench evict: kvd_evict_greedy_ref(%u units): %s\n", n,
			strerror(-r));
		return r;
	}
	same = n_ids == n_ids_ref && freed == freed_ref &&
	       memcmp(u.ids, u.ids_ref, n_ids * sizeof(uint32_t)) == 0;
	printf("%10s %8s %-7s %10.3f %8.2f   the optimised path is %.1fx faster (buf: %.1fx); "
	       "%s\n", "", "", "ref", s_ref * 1e3, s_ref * 1e9 / n, s_ref / s, s_ref / s_buf,
	       same ? "same units" : "DIFFERENT units");
	if (!same) {
		fprintf(stderr, "kvd-bench evict: %u units: the optimised path and the reference "
				"chose different units (%u and %u)\n", n, n_ids, n_ids_ref);
		return -EIO;
	}
	return 0;
}

/* ---- Options ---- */

static void help(void) {
	printf("Usage: kvd-bench evict [OPTIONS]\n"
	       "\n"
	       "Times the node-wide eviction selection, kvd_evict_greedy() (greedy by value\n"
	       "per byte with per-group floors, kernels/select.h), on one thread pinned to one\n"
	       "CPU, against the target of 10M units in %.0f ms on one core. The units have\n"
	       "seeded random values and sizes of 256 B, 4 KiB or 64 KiB (head-token,\n"
	       "layer-token and block units); %u.%u%% are pinned; each group (a (sequence,\n"
	       "layer)) may give up at most %u%% of its units; each round frees %u%% of all the\n"
	       "bytes. Prints per size and call the median time, ns per unit, units evicted,\n"
	       "bytes freed over the target, and the time over the target scaled to the size\n"
	       "(5 ns per unit). Calls: kvd_evict_greedy() (allocates its scratch per call),\n"
	       "kvd_evict_greedy_buf() (in a scratch allocated and faulted in once, as the\n"
	       "daemon keeps it); they must agree. The reference (a sort) runs up to %u units\n"
	       "and must agree too.\n"
	       "\n"
	       "Options:\n"
	       "  --units LIST   Units per round, comma-separated, 1..%u\n"
	       "                 (default: 1000000,10000000)\n"
	       "  --groups N     Groups the units are split into evenly, 0 for none (no floors)\n"
	       "                 (default: one per %u units)\n"
	       "  --reps N       Timed repetitions, after one warm-up if N > 1 (default: 5)\n"
	       "  --socket PATH  Then run the full-round benchmark against the daemon there\n"
	       "  -h --help      Show this help and exit\n",
	       TARGET_MS, PINNED_PERMILLE / 10, PINNED_PERMILLE % 10, GROUP_EVICT_PERMILLE / 10,
	       TARGET_PERMILLE / 10, REF_UNITS_MAX, UNITS_MAX, GROUP_UNITS);
}

#define usage_error(...) cli_usage_error("kvd-bench evict", __VA_ARGS__)

static int item_units(const char *s, unsigned i, void *userdata _unused_) {
	return number_parse_u32(s, 1, UNITS_MAX, &arg_units[i]);
}

static int parse_units(const char *s) {
	int n = cli_parse_list(s, SIZES_MAX, item_units, NULL);

	if (n < 0)
		return n;
	arg_n_units = n;
	return 0;
}

/* The selection is single-threaded: one CPU keeps migrations out of the timings. Returns
 * the CPU, or -1 if pinning failed (the figures are then only noisier). */
static int pin_to_one_cpu(void) {
	int cpu = sched_getcpu();
	cpu_set_t set;

	if (cpu < 0)
		return -1;
	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	return sched_setaffinity(0, sizeof(set), &set) < 0 ? -1 : cpu;
}

int bench_evict(int argc, char **argv) {
	enum { OPT_UNITS = 0x100, OPT_GROUPS, OPT_REPS, OPT_SOCKET, OPT_ROUND };
	/* The full round's options (round.c parses them again) are listed here so that they
	 * are not mistaken for abbreviations of ours (--unit for --units). */
	static const struct option options[] = {
		{ "units", required_argument, NULL, OPT_UNITS },
		{ "groups", required_argument, NULL, OPT_GROUPS },
		{ "reps", required_argument, NULL, OPT_REPS },
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tokens", required_argument, NULL, OPT_ROUND },
		{ "seqs", required_argument, NULL, OPT_ROUND },
		{ "layers", required_argument, NULL, OPT_ROUND },
		{ "unit", required_argument, NULL, OPT_ROUND },
		{ "bytes", required_argument, NULL, OPT_ROUND },
		{ "recall", required_argument, NULL, OPT_ROUND },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	bool round_options = false;
	cpu_set_t saved;
	int opt, failed = 0, cpu, have_saved;
	char where[32] = "not pinned";
	uint64_t v;

	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_UNITS:
			if (parse_units(optarg) < 0)
				return usage_error("--units: '%s' is not a list of 1..%u, at most %u",
						   optarg, UNITS_MAX, SIZES_MAX);
			break;
		case OPT_GROUPS:
			if (number_parse_u64(optarg, 0, UNITS_MAX, &v) < 0)
				return usage_error("--groups: '%s' is not in 0..%u", optarg, UNITS_MAX);
			arg_groups = (int64_t)v;
			break;
		case OPT_REPS:
			if (number_parse_u64(optarg, 1, REPS_MAX, &v) < 0)
				return usage_error("--reps: '%s' is not in 1..%u", optarg, REPS_MAX);
			arg_reps = (unsigned)v;
			break;
		case OPT_SOCKET:
			arg_socket = optarg;
			break;
		case OPT_ROUND:
			round_options = true;
			break;
		case 'h': {
			char *round_help[] = { (char *)"evict", (char *)"--help", NULL };

			help();
			putchar('\n');
			return bench_evict_round(NULL, 2, round_help);
		}
		default:
			return usage_error("bad option");
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (round_options && !arg_socket)
		return usage_error("--tokens, --seqs, --layers, --unit and --bytes need --socket");

	setvbuf(stdout, NULL, _IOLBF, 0);
	/* Only the selection is pinned: the full round (--socket) gets the CPUs back. */
	have_saved = sched_getaffinity(0, sizeof(saved), &saved) == 0;
	cpu = pin_to_one_cpu();
	if (cpu >= 0)
		snprintf(where, sizeof(where), "on CPU %d", cpu);
	printf("kvd-bench evict: kvd_evict_greedy, one thread (%s); units of 256 B, 4 KiB, "
	       "64 KiB; %u.%u%% pinned; groups may give up %u%% of their units; target %u%% of "
	       "the bytes; median of %u rep%s\n",
	       where, PINNED_PERMILLE / 10, PINNED_PERMILLE % 10,
	       GROUP_EVICT_PERMILLE / 10, TARGET_PERMILLE / 10, arg_reps, arg_reps == 1 ? "" : "s");
	printf("\n%10s %8s %-7s %10s %8s %10s %10s %8s %7s  %s\n", "UNITS", "GROUPS", "CALL", "MS",
	       "NS/UNIT", "EVICTED", "FREED/TGT", "TGT_MS", "RATIO", "TARGET");
	for (unsigned i = 0; i < arg_n_units; i++)
		failed |= bench_units(arg_units[i]) < 0;
	printf("\nCALL: greedy is kvd_evict_greedy() (scratch allocated per call), buf "
	       "kvd_evict_greedy_buf()\n(scratch kept and faulted in, as the daemon does), ref "
	       "the reference (a sort).\nMS is the median; FREED/TGT the bytes freed over the "
	       "bytes asked for; TGT_MS the target\n(10M units in %.0f ms on one core) "
	       "scaled to the size, RATIO = MS / TGT_MS, PASS when <= 1.\n",
	       TARGET_MS);
	if (have_saved)
		sched_setaffinity(0, sizeof(saved), &saved);

	if (arg_socket) {
		int r = bench_evict_round(arg_socket, argc, argv);

		return failed ? EXIT_FAILURE : r;
	}
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
