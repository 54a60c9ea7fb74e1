/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench step: what kvd costs an engine per decode step, from C: grow the sequence by
 * one token, pin it, publish each layer's observation window (kvd_seq_observation, then
 * kvd_seq_observe), unpin. tools/bench/binding-step.py makes the same calls through the
 * Python binding against the same daemon and runs this for the ratio (docs/python.md). The
 * model: 4 layers of 8 kv heads of 128 (32 query heads), f16, 16-token blocks, evictable
 * by layer token with a window of 32. A benchmark: nothing asserts on timings.
 */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/time-util.h"
#include "bench.h"
#include "kvd/kvd.h"
#include "latency.h"

#define STEPS_MAX 1000000u
#define STEP_LAYERS 4u

static int usage(FILE *f) {
	fprintf(f,
	        "Usage: kvd-bench step [OPTIONS]\n\n"
	        "Times one decode step's kvd calls from C (grow by 1, pin, publish the\n"
	        "observation window of each of 4 layers, unpin) against the daemon at --socket,\n"
	        "after a prefill of 512 tokens.\n\n"
	        "Options:\n"
	        "  --socket PATH    Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	        "  --steps N        Steps timed, 1..%u (default: 2000)\n"
	        "  -h, --help       Show this help\n",
	        KVD_DEFAULT_SOCKET, STEPS_MAX);
	return f == stdout ? 0 : 2;
}

/* One step; returns 0 or the first error. */
static int step(kvd_seq *s) {
	int r = kvd_seq_grow(s, 1);

	if (r >= 0)
		r = kvd_seq_pin(s);
	for (uint32_t l = 0; r >= 0 && l < STEP_LAYERS; l++) {
		void *q;

		r = kvd_seq_observation(s, l, &q);
		if (r >= 0)
			r = kvd_seq_observe(s, l);
	}
	if (r >= 0)
		r = kvd_seq_unpin(s);
	return r < 0 ? r : 0;
}

int bench_step(int argc, char **argv) {
	enum { OPT_SOCKET = 256, OPT_STEPS };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "steps", required_argument, NULL, OPT_STEPS },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	static const kvd_model_spec spec = { "step", STEP_LAYERS, 32, 8, 128, KVD_DTYPE_F16, 16,
	                                      KVD_LAYOUT_PER_LAYER };
	static const kvd_eviction_spec ev = { KVD_UNIT_LAYER_TOKEN, 32, KVD_SINKS_DEFAULT, 0 };
	const char *socket = getenv("KVD_SOCKET");
	uint32_t steps = 2000;
	_cleanup_(freep) uint64_t *ns = NULL;
	kvd_client *c = NULL;
	kvd_seq *s = NULL;
	int opt, m, r, rc = 1;

	if (!socket || !*socket)
		socket = KVD_DEFAULT_SOCKET;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_SOCKET:
			socket = optarg;
			break;
		case OPT_STEPS:
			if (number_parse_u32(optarg, 1, STEPS_MAX, &steps) < 0) {
				fprintf(stderr, "kvd-bench step: --steps: '%s' is not in 1..%u\n", optarg,
				        STEPS_MAX);
				return 2;
			}
			break;
		case 'h':
			return usage(stdout);
		default:
			return usage(stderr);
		}
	if (optind < argc) {
		fprintf(stderr, "kvd-bench step: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	ns = calloc(steps, sizeof(*ns));
	if (!ns) {
		fprintf(stderr, "kvd-bench step: out of memory\n");
		return 1;
	}
	r = kvd_client_connect(socket, "bench-step", &c);
	if (r < 0) {
		fprintf(stderr, "kvd-bench step: connecting to %s: %s\n", socket, kvd_strerror(r));
		return 1;
	}
	m = kvd_model_register_evictable(c, &spec, &ev);
	r = m < 0 ? m : kvd_seq_open(c, m, 512 + steps + 100, &s);
	if (r >= 0)
		r = kvd_seq_grow(s, 512);
	/* Warm-up, untimed: the first steps map chunks and fault pages in. */
	for (uint32_t i = 0; r >= 0 && i < 100; i++)
		r = step(s);
	for (uint32_t i = 0; r >= 0 && i < steps; i++) {
		uint64_t t0 = now_ns();

		r = step(s);
		ns[i] = now_ns() - t0;
	}
	if (r < 0) {
		fprintf(stderr, "kvd-bench step: %s (%s)\n", kvd_strerror(r), kvd_client_last_error(c));
		goto out;
	}
	latency_sort(ns, steps);
	printf("C step (grow 1, pin, %u x observation + observe, unpin): p50 %.1f us  p99 %.1f us  "
	       "(%u steps)\n", STEP_LAYERS, latency_percentile_us(ns, steps, 50),
	       latency_percentile_us(ns, steps, 99), steps);
	rc = 0;
out:
	kvd_seq_release(s);
	kvd_client_unref(c);
	return rc;
}
