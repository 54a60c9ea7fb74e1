/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench table: what a paged block table costs to export (kvd_seq_block_table) for one
 * layer of a long sequence, against a running daemon: with the slots' positions and
 * without, and next to looking each block up with kvd_seq_block, the per-block call an
 * engine would otherwise loop over. The model is one layer of Llama-3.1-8B's KV (8 kv heads
 * of 128, f16) in blocks of 16 tokens: 64 KiB blocks, 8192 of them for 128k tokens.
 * Figures in docs/benchmarks.md. A benchmark: nothing asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/number.h"
#include "basic/time-util.h"
#include "bench.h"
#include "kvd/kvd.h"
#include "latency.h"

#define TOKENS_MAX (1u << 20)
#define ITERATIONS_MAX 1000000u

static const kvd_model_spec layer = { "table", 1, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

static int usage(FILE *f) {
	fprintf(f,
	        "Usage: kvd-bench table [OPTIONS]\n\n"
	        "Times kvd_seq_block_table for one layer of one sequence (8 kv heads of 128, f16,\n"
	        "blocks of 16 tokens: 64 KiB each) against the daemon at --socket, with and\n"
	        "without positions, and the same blocks looked up one by one with kvd_seq_block.\n"
	        "The daemon's pool must hold the sequence (8 GiB for 128k tokens) and its\n"
	        "chunk size be a multiple of 64 KiB (kvd's default is).\n\n"
	        "Options:\n"
	        "  --socket PATH     Daemon socket (default: $KVD_SOCKET if set, else %s)\n"
	        "  --tokens N        Tokens of the sequence, 1..%u (default: 131072)\n"
	        "  --iterations N    Exports timed of each kind, 1..%u (default: 1000)\n"
	        "  -h, --help        Show this help\n",
	        KVD_DEFAULT_SOCKET, TOKENS_MAX, ITERATIONS_MAX);
	return f == stdout ? 0 : 2;
}

static void print_row(const char *what, uint64_t *ns, uint32_t n, uint32_t blocks) {
	double p50;

	latency_sort(ns, n);
	p50 = latency_percentile_us(ns, n, 50);
	printf("%-28s p50 %9.1f us  p99 %9.1f us  (%.1f ns a block)\n", what, p50,
	       latency_percentile_us(ns, n, 99), p50 * 1000.0 / blocks);
}

int bench_table(int argc, char **argv) {
	enum { OPT_SOCKET = 256, OPT_TOKENS, OPT_ITERATIONS };
	static const struct option options[] = {
		{ "socket", required_argument, NULL, OPT_SOCKET },
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "iterations", required_argument, NULL, OPT_ITERATIONS },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	const char *socket = getenv("KVD_SOCKET");
	uint32_t tokens = 131072, iterations = 1000, n_blocks;
	_cleanup_(freep) uint64_t *ns = NULL;
	_cleanup_(freep) int32_t *blocks = NULL;
	_cleanup_(freep) uint32_t *positions = NULL;
	kvd_client *c = NULL;
	kvd_seq *s = NULL;
	uint64_t stride;
	void *base;
	int opt, m, r, rc = 1;

	if (!socket || !*socket)
		socket = KVD_DEFAULT_SOCKET;
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_SOCKET:
			socket = optarg;
			break;
		case OPT_TOKENS:
			if (number_parse_u32(optarg, 1, TOKENS_MAX, &tokens) < 0) {
				fprintf(stderr, "kvd-bench table: --tokens: '%s' is not in 1..%u\n", optarg,
				        TOKENS_MAX);
				return 2;
			}
			break;
		case OPT_ITERATIONS:
			if (number_parse_u32(optarg, 1, ITERATIONS_MAX, &iterations) < 0) {
				fprintf(stderr, "kvd-bench table: --iterations: '%s' is not in 1..%u\n",
				        optarg, ITERATIONS_MAX);
				return 2;
			}
			break;
		case 'h':
			return usage(stdout);
		default:
			return usage(stderr);
		}
	if (optind < argc) {
		fprintf(stderr, "kvd-bench table: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}

	n_blocks = DIV_ROUND_UP(tokens, layer.block_tokens);
	ns = calloc(iterations, sizeof(*ns));
	blocks = calloc(n_blocks, sizeof(*blocks));
	positions = calloc(tokens, sizeof(*positions));
	if (!ns || !blocks || !positions) {
		fprintf(stderr, "kvd-bench table: out of memory\n");
		return 1;
	}
	r = kvd_client_connect(socket, "bench-table", &c);
	if (r < 0) {
		fprintf(stderr, "kvd-bench table: connecting to %s: %s\n", socket, kvd_strerror(r));
		return 1;
	}
	m = kvd_model_register(c, &layer);
	r = m < 0 ? m : kvd_model_block_pool(c, m, &base, &stride, NULL);
	if (r < 0) {
		fprintf(stderr, "kvd-bench table: registering the model: %s %s\n", kvd_strerror(r),
		        kvd_client_last_error(c));
		goto out;
	}
	r = kvd_seq_open(c, m, tokens, &s);
	if (r >= 0)
		r = kvd_seq_grow(s, tokens);
	if (r < 0) {
		fprintf(stderr, "kvd-bench table: a sequence of %u tokens: %s %s\n", tokens,
		        kvd_strerror(r), kvd_client_last_error(c));
		goto out;
	}

	printf("block table of one layer, %u tokens, %u blocks of %" PRIu64 " bytes, %u exports each\n",
	       tokens, n_blocks, stride, iterations);
	for (int kind = 0; kind < 3; kind++) {
		for (uint32_t i = 0; i < iterations; i++) {
			uint64_t t0 = now_ns();

			if (kind < 2) {
				r = kvd_seq_block_table(s, 0, 0, blocks, n_blocks, kind ? positions : NULL,
				                        kind ? tokens : 0, NULL);
			} else {
				/* What an engine without block tables does: an address per block. */
				for (uint32_t b = 0; b < n_blocks && r >= 0; b++) {
					void *p;

					r = kvd_seq_block(s, 0, b, &p);
					blocks[b] = (int32_t)(((char *)p - (char *)base) / (int64_t)stride);
				}
			}
			ns[i] = now_ns() - t0;
			if (r < 0) {
				fprintf(stderr, "kvd-bench table: export failed: %s\n", kvd_strerror(r));
				goto out;
			}
		}
		print_row(kind == 0 ? "kvd_seq_block_table" :
		          kind == 1 ? "  with positions" : "kvd_seq_block per block", ns, iterations,
		          n_blocks);
	}
	rc = 0;
out:
	kvd_seq_release(s);
	kvd_client_unref(c);
	return rc;
}
