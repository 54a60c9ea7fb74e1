/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench evict --socket PATH: one full eviction round against a running daemon, timed by
 * the daemon itself (bench.h).
 *
 * As the tenant "bench-round", it registers a slice of a Llama-3.1-8B-like model (32 query
 * heads, 8 kv heads, head_dim 128, f16, 16-token blocks; 4 layers by default) with eviction,
 * gives the daemon a random W_o per layer, opens sequences (4 of 32768 tokens by default),
 * fills them and publishes an observation window for every (sequence, layer). Then it asks
 * for one round on its own tenant (kvd_evict; by default half of what the tenant holds) and
 * prints the daemon's account of that round (kvd_evictions_get): duration and its score,
 * select and compact phases, units and sequences, bytes freed against the target, and the
 * scoring throughput. The set-up steps are timed here and printed apart.
 *
 * With --recall N the tenant has token recall on (N tokens per row; docs/recall.md): the
 * round keeps what it evicts in the host tier, then every sequence publishes a new window
 * and asks for a recall (kvd_seq_recall), a round of its own that scores the sequence's
 * resident and kept tokens together; their durations, summed, stand against the eviction
 * round's, which scored as many tokens (every token of every sequence once).
 *
 * K, V, queries and W_o are small random f16 numbers from a xorshift generator, made a
 * 64-bit word (four elements) at a time so that filling runs near memory speed: the
 * figures are of scoring work, not of what the numbers are. This is a benchmark: nothing
 * asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench.h"
#ifdef KVD_HAVE_CUDA
#include "basic/cuda-dl.h"
#endif
#include "basic/macro.h"
#include "basic/number.h"
#include "basic/size.h"
#include "kvd/kvd.h"
#include "basic/time-util.h"
#include "cli.h"

#define ROUND_TENANT "bench-round"
#define ROUND_Q_HEADS 32
#define ROUND_KV_HEADS 8
#define ROUND_HEAD_DIM 128
#define ROUND_BLOCK_TOKENS 16
#define ROUND_WINDOW 32
#define ROUND_SEQS_MAX 4096
#define ROUND_TOKENS_MAX (1u << 20)
/* One grow may need at most 253 new chunks (kvd_seq_grow): stay well below. */
#define ROUND_GROW_CHUNKS 128
#define ROUND_RECALL_MAX (1u << 20)  /* the daemon's bound (kvd.conf(5), recall) */

static uint32_t arg_tokens = 32768;
static uint32_t arg_seqs = 4;
static uint32_t arg_layers = 4;
static uint32_t arg_unit = KVD_UNIT_LAYER_TOKEN;
static uint64_t arg_bytes; /* 0: half of what the tenant holds */
static uint32_t arg_recall; /* tokens per row a recall may bring back; 0: no recall */


static double ms_since(uint64_t t0) {
	return (double)(now_ns() - t0) / 1e6;
}

static uint64_t xorshift64(uint64_t *s) {
	uint64_t x = *s;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

/*
 * Four f16 numbers from one random word: each keeps its sign and mantissa bits, and two
 * bits pick an exponent from exp_lo .. exp_lo + 3 (bias 15), so values are finite and of
 * a known size. Lanes never carry into each other.
 */
static inline uint64_t f16_word(uint64_t w, uint64_t exp_lo) {
	return (w & UINT64_C(0x83ff83ff83ff83ff)) |
	       ((((w >> 10) & UINT64_C(0x0003000300030003)) + exp_lo * UINT64_C(0x0001000100010001)) << 10);
}

/* n bytes (a multiple of 2) of f16 numbers in +-[2^(exp_lo - 15), 2^(exp_lo - 11)). */
static void fill_f16(void *dst, size_t n, uint64_t *state, uint64_t exp_lo) {
	unsigned char *p = dst;
	size_t off;

	for (off = 0; off + 8 <= n; off += 8) {
		uint64_t w = f16_word(xorshift64(state), exp_lo);

		memcpy(p + off, &w, 8);
	}
	if (off < n) {
		uint64_t w = f16_word(xorshift64(state), exp_lo);

		memcpy(p + off, &w, n - off);
	}
}

static const char *unit_name(uint32_t u) {
	return u == KVD_UNIT_HEAD_TOKEN ? "head" : u == KVD_UNIT_LAYER_TOKEN ? "layer" : "block";
}

struct round {
	const char *socket;
	kvd_client *client;
	kvd_model_spec spec;
	int model_id;
	kvd_seq **seqs;
	uint32_t n_seqs;
	uint64_t events;
	/* A GPU pool: blocks are device pointers, filled from a host buffer by driver copies
	 * in the primary context of the daemon's GPU. */
	bool device;
	void *fill_buf;
#ifdef KVD_HAVE_CUDA
	const struct cuda_dl *cu;
#endif
};

static _printf_(3, 4) int round_fail(struct round *b, int r, const char *fmt, ...) {
	const char *msg = b->client ? kvd_client_last_error(b->client) : "";
	va_list ap;

	fputs("kvd-bench evict: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	if (msg && *msg)
		fprintf(stderr, ": %s: %s\n", strerror(-r), msg);
	else
		fprintf(stderr, ": %s\n", strerror(-r));
	return r;
}

/* Honours the daemon's chunk requests (inside kvd_client_next_event) and counts events. */
static int round_events(struct round *b) {
	kvd_event ev;
	int r;

	while ((r = kvd_client_next_event(b->client, &ev)) > 0)
		b->events++;
	if (r < 0)
		return round_fail(b, r, "kvd_client_next_event");
	return 0;
}

/* One W_o per layer, f16 [hidden][hidden] with entries of size about 1/sqrt(hidden). */
static int round_output_proj(struct round *b) {
	uint32_t hidden = b->spec.q_heads * b->spec.head_dim;
	size_t bytes = (size_t)hidden * hidden * 2;
	_cleanup_(freep) void *wo = malloc(bytes);
	uint64_t state = UINT64_C(0x6b76642d776f2d30);

	if (!wo)
		return round_fail(b, -ENOMEM, "allocating W_o (%u x %u)", hidden, hidden);
	for (uint32_t l = 0; l < b->spec.layers; l++) {
		int r;

		/* Exponents 7..10: +-[2^-8, 2^-4). */
		fill_f16(wo, bytes, &state, 7);
		r = kvd_model_output_proj(b->client, b->model_id, l, KVD_DTYPE_F16, hidden, wo);
		if (r < 0)
			return round_fail(b, r, "kvd_model_output_proj(layer %u)", l);
	}
	return 0;
}

static uint32_t round_tables(const struct round *b) {
	return b->spec.layout == KVD_LAYOUT_PER_HEAD ? b->spec.layers * b->spec.kv_heads : b->spec.layers;
}

/* On a GPU pool, makes the daemon's GPU current here and the fill buffer; else nothing. */
static int round_device_open(struct round *b, uint64_t block_bytes) {
	int32_t ordinal = -1;

	b->device = kvd_client_memory(b->client, &ordinal) == KVD_MEMORY_CUDA;
	if (!b->device)
		return 0;
#ifdef KVD_HAVE_CUDA
	CUcontext ctx;
	CUdevice dev;
	const char *why;
	int r = cuda_dl_load(&b->cu, &why);

	if (r < 0)
		return round_fail(b, r, "the daemon's pool is GPU memory, but %s", why);
	if (b->cu->cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS ||
	    b->cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    b->cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS)
		return round_fail(b, -ENODEV, "no context on GPU %d", (int)ordinal);
	b->fill_buf = malloc(block_bytes);
	if (!b->fill_buf)
		return round_fail(b, -ENOMEM, "allocating a block buffer");
	return 0;
#else
	(void)block_bytes;
	return round_fail(b, -EOPNOTSUPP, "the daemon's pool is GPU memory, and this kvd-bench "
	                  "was built without the CUDA headers");
#endif
}

/* On a GPU pool, copies the fill buffer to block; else the fill went there already. */
static int round_copy_to_device(struct round *b, void *block, uint64_t bytes) {
	if (!b->device)
		return 0;
#ifdef KVD_HAVE_CUDA
	if (b->cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)block, b->fill_buf, bytes) != CUDA_SUCCESS)
		return -EIO;
	return 0;
#else
	(void)block;
	(void)bytes;
	return -EOPNOTSUPP;
#endif
}

/* Fills every block of sequence i with K/V numbers, block by block. */
static int round_fill(struct round *b, uint32_t i, uint64_t *state, uint64_t block_bytes) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(b->seqs[i]);
	uint32_t tables = round_tables(b);

	if (!d)
		return round_fail(b, -EINVAL, "kvd_seq_descriptor(seq %u)", i);
	for (uint32_t t = 0; t < tables; t++) {
		uint32_t l = b->spec.layout == KVD_LAYOUT_PER_HEAD ? t / b->spec.kv_heads : t;
		uint32_t h = b->spec.layout == KVD_LAYOUT_PER_HEAD ? t % b->spec.kv_heads : 0;
		int64_t n = kvd_seq_tokens(b->seqs[i], l, h);

		if (n < 0)
			return round_fail(b, (int)n, "kvd_seq_tokens(seq %u, layer %u, head %u)", i, l, h);
		for (uint32_t x = 0; x < DIV_ROUND_UP((uint64_t)n, b->spec.block_tokens); x++) {
			void *block;
			int r;

			r = kvd_seq_block(b->seqs[i], t, x, &block);
			if (r < 0)
				return round_fail(b, r, "kvd_seq_block(seq %u, table %u, block %u)", i, t, x);
			/* Exponents 11..14: +-[1/16, 1). */
			fill_f16(b->device ? b->fill_buf : block, block_bytes, state, 11);
			r = round_copy_to_device(b, block, block_bytes);
			if (r < 0)
				return round_fail(b, r, "copying block %u of seq %u to the GPU", x, i);
		}
	}
	return 0;
}

/* Writes and publishes a window of random queries for every layer of sequence i. */
static int round_observe(struct round *b, uint32_t i, uint64_t *state) {
	size_t bytes = (size_t)b->spec.q_heads * ROUND_WINDOW * b->spec.head_dim * 2;

	for (uint32_t l = 0; l < b->spec.layers; l++) {
		void *q;
		int r;

		r = kvd_seq_observation(b->seqs[i], l, &q);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_observation(seq %u, layer %u)", i, l);
		/* Exponents 12..15: +-[1/8, 2). */
		fill_f16(q, bytes, state, 12);
		r = kvd_seq_observe(b->seqs[i], l);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_observe(seq %u, layer %u)", i, l);
	}
	return 0;
}

/* A node or tenant value from status; *ret stays as it was if absent. */
static int round_status(struct round *b, uint64_t *ret_used, uint64_t *ret_budget,
			uint64_t *ret_node_used, uint64_t *ret_rounds) {
	_cleanup_(kvd_status_freep) kvd_status *st = NULL;
	int r;

	r = kvd_status_get(b->client, &st);
	if (r < 0)
		return round_fail(b, r, "kvd_status_get");
	if (ret_budget)
		(void)kvd_status_u64(st, "budget_bytes", ret_budget);
	if (ret_node_used)
		(void)kvd_status_u64(st, "used_bytes", ret_node_used);
	if (ret_rounds)
		(void)kvd_status_u64(st, "rounds_total", ret_rounds);
	for (uint32_t t = 0; ret_used && t < kvd_status_tenants(st); t++) {
		const char *name;

		if (kvd_status_tenant_name(st, t, &name) < 0 || strcmp(name, ROUND_TENANT) != 0)
			continue;
		r = kvd_status_tenant_u64(st, t, "used_bytes", ret_used);
		if (r < 0)
			return round_fail(b, r, "kvd_status_tenant_u64(%s, used_bytes)", ROUND_TENANT);
		return 0;
	}
	if (ret_used)
		return round_fail(b, -ENOENT, "status lists no tenant %s", ROUND_TENANT);
	return 0;
}

static void print_u64(const kvd_evictions *e, uint32_t round, const char *key, const char *label,
		      uint64_t *ret) {
	uint64_t v = 0;

	if (kvd_evictions_u64(e, round, key, &v) < 0) {
		printf("  %-12s -\n", label);
		v = 0;
	} else if (strcmp(key + strlen(key) - 3, "_us") == 0)
		printf("  %-12s %10.3f ms\n", label, (double)v / 1e3);
	else
		printf("  %-12s %10" PRIu64 "\n", label, v);
	if (ret)
		*ret = v;
}

/* Prints the round that kvd_evict ran: the first listed with an id above `last_id`. */
static int round_report(struct round *b, uint64_t last_id, double call_ms) {
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	uint64_t id = 0, duration = 0, score = 0, target = 0, freed = 0;
	uint64_t tokens = (uint64_t)b->n_seqs * arg_tokens;
	uint32_t n, round = UINT32_MAX;
	const char *s;
	double d;
	char x[32], y[32];
	int r;

	r = kvd_evictions_get(b->client, &e);
	if (r < 0)
		return round_fail(b, r, "kvd_evictions_get");
	n = kvd_evictions_count(e);
	for (uint32_t k = 0; k < n; k++)
		if (kvd_evictions_u64(e, k, "id", &id) >= 0 && id > last_id) {
			round = k;
			break;
		}
	if (round == UINT32_MAX)
		return round_fail(b, -ENOENT, "kvd_evictions_get lists no round after #%" PRIu64 " (%u listed)",
				  last_id, n);

	printf("\nround #%" PRIu64 " (the daemon's figures; kvd_evict returned after %.3f ms):\n", id, call_ms);
	if (kvd_evictions_str(e, round, "trigger", &s) >= 0)
		printf("  %-12s %10s\n", "trigger", s);
	print_u64(e, round, "duration_us", "duration", &duration);
	print_u64(e, round, "score_us", "score", &score);
	print_u64(e, round, "select_us", "select", NULL);
	print_u64(e, round, "compact_us", "compact", NULL);
	print_u64(e, round, "units", "units", NULL);
	print_u64(e, round, "sequences", "sequences", NULL);
	print_u64(e, round, "target_bytes", "target", &target);
	print_u64(e, round, "freed_bytes", "freed", &freed);
	printf("  %-12s %s of %s (%.1f%%)\n", "freed/target", size_format(freed, x, sizeof(x)),
	       size_format(target, y, sizeof(y)), target ? 100.0 * (double)freed / (double)target : 0.0);
	if (kvd_evictions_double(e, round, "predicted_error", &d) >= 0)
		printf("  %-12s %10.4g\n", "pred. error", d);
	for (uint32_t t = 0; t < kvd_evictions_tenants(e, round); t++) {
		uint64_t tb, tt;
		const char *name;

		if (kvd_evictions_tenant(e, round, t, &name, &tb, &tt) >= 0)
			printf("  tenant %s: freed %s, evicted %" PRIu64 " tokens\n", name,
			       size_format(tb, x, sizeof(x)), tt);
	}
	/* Per microsecond is per second in millions. */
	if (score > 0)
		printf("throughput: %" PRIu64 " tokens (x %u layers x %u kv heads) scored in %.3f ms: "
		       "%.0f tokens/s, %.2f M (token, layer, kv head)/s; the whole round %.0f tokens/s\n",
		       tokens, b->spec.layers, b->spec.kv_heads, (double)score / 1e3,
		       1e6 * (double)tokens / (double)score,
		       (double)tokens * b->spec.layers * b->spec.kv_heads / (double)score,
		       duration ? 1e6 * (double)tokens / (double)duration : 0.0);
	if (kvd_evictions_str(e, round, "error", &s) >= 0) {
		fprintf(stderr, "kvd-bench evict: round #%" PRIu64 " failed: %s\n", id, s);
		return -EIO;
	}
	return 0;
}

/* The id of the last round the daemon lists (0: none yet). */
static int round_last_id(struct round *b, uint64_t *ret) {
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	uint32_t n;
	int r;

	r = kvd_evictions_get(b->client, &e);
	if (r < 0)
		return round_fail(b, r, "kvd_evictions_get");
	*ret = 0;
	n = kvd_evictions_count(e);
	for (uint32_t k = 0; k < n; k++) {
		uint64_t id;

		if (kvd_evictions_u64(e, k, "id", &id) >= 0)
			*ret = MAX(*ret, id);
	}
	return 0;
}

/* One value of round `id` in the daemon's list (0 where absent). */
static uint64_t round_value(struct round *b, uint64_t id, const char *key) {
	_cleanup_(kvd_evictions_freep) kvd_evictions *e = NULL;
	uint64_t v = 0, x;

	if (kvd_evictions_get(b->client, &e) < 0)
		return 0;
	for (uint32_t k = 0; k < kvd_evictions_count(e); k++)
		if (kvd_evictions_u64(e, k, "id", &x) >= 0 && x == id)
			(void)kvd_evictions_u64(e, k, key, &v);
	return v;
}

/*
 * After the eviction round (round id evict_id + 1): a new window and a recall for every
 * sequence; prints each recall round's figures and their sum against the eviction round.
 */
static int round_recalls(struct round *b, uint64_t evict_id) {
	uint64_t state = UINT64_C(0x6b76642d72656361), sum = 0, sum_score = 0, back = 0, scored = 0;
	uint64_t round_us = round_value(b, evict_id + 1, "duration_us");
	uint64_t round_score = round_value(b, evict_id + 1, "score_us"), id = evict_id + 1;

	printf("\nrecalls: a new window per sequence, then kvd_seq_recall (at most %u tokens per "
	       "row):\n", arg_recall);
	for (uint32_t i = 0; i < b->n_seqs; i++) {
		uint64_t tokens = 0, t0, us, score;
		int r;

		r = kvd_seq_pin(b->seqs[i]);
		if (r >= 0)
			r = round_observe(b, i, &state);
		if (r >= 0)
			r = kvd_seq_unpin(b->seqs[i]);
		if (r < 0)
			return round_fail(b, r, "publishing a new window (seq %u)", i);
		t0 = now_ns();
		r = kvd_seq_recall(b->seqs[i], &tokens, NULL);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_recall(seq %u)", i);
		r = round_events(b);
		if (r < 0)
			return r;
		r = round_last_id(b, &id);
		if (r < 0)
			return r;
		us = round_value(b, id, "duration_us");
		score = round_value(b, id, "score_us");
		printf("  seq %u: round #%" PRIu64 ", %" PRIu64 " kept tokens scored, %" PRIu64
		       " back; %.3f ms (score %.3f, trade %.3f); the call %.3f ms\n", i, id,
		       round_value(b, id, "scored_tokens"), tokens, us / 1e3, score / 1e3,
		       round_value(b, id, "compact_us") / 1e3, ms_since(t0));
		sum += us;
		sum_score += score;
		back += tokens;
		scored += round_value(b, id, "scored_tokens");
	}
	printf("recall rounds: %.3f ms together (score %.3f) for %" PRIu64 " kept tokens scored, %" PRIu64
	       " back; the eviction round %.3f ms (score %.3f) for as many tokens: ratio %.2f (score "
	       "%.2f)\n", sum / 1e3, sum_score / 1e3, scored, back, round_us / 1e3, round_score / 1e3,
	       round_us ? (double)sum / (double)round_us : 0.0,
	       round_score ? (double)sum_score / (double)round_score : 0.0);
	return 0;
}

static int round_run(struct round *b) {
	kvd_eviction_spec ev = { .unit = arg_unit, .window = ROUND_WINDOW, .sinks = KVD_SINKS_DEFAULT };
	uint64_t kv_bytes = (uint64_t)arg_seqs * arg_tokens * arg_layers * ROUND_KV_HEADS * ROUND_HEAD_DIM * 2 * 2;
	uint64_t state = UINT64_C(0x6b76642d726f756e), t0, budget = 0, node_used = 0, used = 0;
	uint64_t bytes, freed = 0, last_id = 0, chunk, block_bytes, rounds_before = 0, rounds_after = 0;
	uint32_t step;
	char a[32], c[32];
	double call_ms;
	int r;

	b->spec = (kvd_model_spec){
		.name = "bench-round-llama-3.1-8b",
		.layers = arg_layers,
		.q_heads = ROUND_Q_HEADS,
		.kv_heads = ROUND_KV_HEADS,
		.head_dim = ROUND_HEAD_DIM,
		.dtype = KVD_DTYPE_F16,
		.block_tokens = ROUND_BLOCK_TOKENS,
		.layout = arg_unit == KVD_UNIT_HEAD_TOKEN ? KVD_LAYOUT_PER_HEAD : KVD_LAYOUT_PER_LAYER,
	};
	block_bytes = (uint64_t)ROUND_BLOCK_TOKENS * ROUND_HEAD_DIM * 2 * 2 *
		      (b->spec.layout == KVD_LAYOUT_PER_HEAD ? 1 : ROUND_KV_HEADS);

	printf("\nkvd-bench evict: full round against %s: %u sequence%s x %u tokens, %u layer%s of "
	       "32 q heads, 8 kv heads, head_dim 128, f16, %s, unit %s; %s of K/V\n",
	       b->socket, arg_seqs, arg_seqs == 1 ? "" : "s", arg_tokens, arg_layers, arg_layers == 1 ? "" : "s",
	       b->spec.layout == KVD_LAYOUT_PER_HEAD ? "per_head" : "per_layer", unit_name(arg_unit),
	       size_format(kv_bytes, a, sizeof(a)));

	t0 = now_ns();
	r = kvd_client_connect(b->socket, ROUND_TENANT, &b->client);
	if (r < 0)
		return round_fail(b, r, "connect to %s as %s", b->socket, ROUND_TENANT);
	r = round_status(b, NULL, &budget, &node_used, &rounds_before);
	if (r < 0)
		return r;
	if (budget > 0 && (budget < node_used || budget - node_used < kv_bytes))
		return round_fail(b, -ENOSPC, "the daemon has %s of its budget free and this needs %s; start "
				  "it with a bigger pool (kvd --pool-size 3GiB for the defaults)",
				  size_format(budget > node_used ? budget - node_used : 0, a, sizeof(a)),
				  size_format(kv_bytes, c, sizeof(c)));
	r = round_device_open(b, block_bytes);
	if (r < 0)
		return r;
	if (arg_recall) {
		kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_RECALL,
			                .recall = arg_recall };

		r = kvd_tenant_set_params(b->client, ROUND_TENANT, &p);
		if (r < 0)
			return round_fail(b, r, "turning recall on for %s (needs root or admin-group, "
			                  "and a host tier: kvd --host-tier-size)", ROUND_TENANT);
	}
	b->model_id = kvd_model_register_evictable(b->client, &b->spec, &ev);
	if (b->model_id < 0)
		return round_fail(b, b->model_id, "kvd_model_register_evictable");
	printf("setup: connect and register %.1f ms", ms_since(t0));

	t0 = now_ns();
	r = round_output_proj(b);
	if (r < 0)
		return r;
	printf(", W_o (%u layers of %u x %u f16) %.1f ms", arg_layers, ROUND_Q_HEADS * ROUND_HEAD_DIM,
	       ROUND_Q_HEADS * ROUND_HEAD_DIM, ms_since(t0));

	t0 = now_ns();
	for (uint32_t i = 0; i < arg_seqs; i++) {
		r = kvd_seq_open(b->client, b->model_id, arg_tokens, &b->seqs[i]);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_open(seq %u, max_tokens %u)", i, arg_tokens);
		b->n_seqs++;
	}
	printf(", open %.1f ms\n", ms_since(t0));

	/* Grow in steps that need at most ROUND_GROW_CHUNKS chunks, whole blocks each. */
	chunk = kvd_client_chunk_bytes(b->client);
	step = (uint32_t)MIN((uint64_t)arg_tokens,
			     MAX((uint64_t)ROUND_BLOCK_TOKENS,
				 ROUND_GROW_CHUNKS * chunk / (kv_bytes / arg_seqs / arg_tokens) /
					 ROUND_BLOCK_TOKENS * ROUND_BLOCK_TOKENS));
	t0 = now_ns();
	for (uint32_t i = 0; i < b->n_seqs; i++) {
		/* Pinned while filled: a round must not move blocks under the writes. */
		r = kvd_seq_pin(b->seqs[i]);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_pin(seq %u)", i);
		for (uint32_t done = 0; done < arg_tokens;) {
			uint32_t n = MIN(step, arg_tokens - done);

			r = kvd_seq_grow(b->seqs[i], n);
			if (r < 0)
				return round_fail(b, r, "kvd_seq_grow(seq %u, +%u tokens at %u)", i, n, done);
			done += n;
		}
		r = round_fill(b, i, &state, block_bytes);
		if (r < 0)
			return r;
		r = round_observe(b, i, &state);
		if (r < 0)
			return r;
		r = kvd_seq_unpin(b->seqs[i]);
		if (r < 0)
			return round_fail(b, r, "kvd_seq_unpin(seq %u)", i);
		r = round_events(b);
		if (r < 0)
			return r;
	}
	{
		double ms = ms_since(t0);

		printf("fill: grow (steps of %u tokens), write K/V and publish the windows: %.1f ms, %.0f MiB/s\n",
		       step, ms, (double)kv_bytes / (1024.0 * 1024.0) / (ms / 1e3));
	}

	r = round_status(b, &used, NULL, NULL, NULL);
	if (r < 0)
		return r;
	bytes = arg_bytes ? arg_bytes : used / 2;
	r = round_last_id(b, &last_id);
	if (r < 0)
		return r;
	printf("evict: %s of the tenant's %s\n", size_format(bytes, a, sizeof(a)), size_format(used, c, sizeof(c)));

	t0 = now_ns();
	r = kvd_evict(b->client, ROUND_TENANT, bytes, &freed);
	call_ms = ms_since(t0);
	if (r < 0)
		return round_fail(b, r, "kvd_evict(%s, %" PRIu64 " bytes)", ROUND_TENANT, bytes);
	r = round_events(b);
	if (r < 0)
		return r;
	r = round_report(b, last_id, call_ms);
	if (r < 0)
		return r;
	r = round_status(b, &used, NULL, NULL, &rounds_after);
	if (r < 0)
		return r;
	printf("after: kvd_evict freed %s; the tenant holds %s; %" PRIu64 " events; rounds on the node %" PRIu64
	       " before, %" PRIu64 " after\n",
	       size_format(freed, a, sizeof(a)), size_format(used, c, sizeof(c)), b->events, rounds_before,
	       rounds_after);
	if (arg_recall) {
		r = round_recalls(b, last_id);
		if (r < 0)
			return r;
	}

	t0 = now_ns();
	for (uint32_t i = 0; i < b->n_seqs; i++) {
		r = kvd_seq_release(b->seqs[i]);
		b->seqs[i] = NULL;
		if (r < 0)
			return round_fail(b, r, "kvd_seq_release(seq %u)", i);
	}
	b->n_seqs = 0;
	printf("release: %.1f ms\n", ms_since(t0));
	return 0;
}

static void round_help(void) {
	printf("Usage: kvd-bench evict --socket PATH [--tokens N] [--seqs N] [--layers N]\n"
	       "                       [--unit head|layer|block] [--bytes SIZE] [--recall N]\n"
	       "\n"
	       "The full-round benchmark against the running daemon at PATH: as the tenant\n"
	       "%s, fills sequences of a Llama-3.1-8B-like slice (32 q heads, 8 kv heads,\n"
	       "head_dim 128, f16, %u-token blocks) with random K/V, gives the daemon a random\n"
	       "W_o per layer and a window of %u queries per (sequence, layer), runs one round\n"
	       "on its own tenant (kvd_evict) and prints the daemon's figures for it: duration,\n"
	       "score, select and compact times, units, sequences, bytes freed against the\n"
	       "target, and tokens scored per second. Set-up and fill times come apart.\n"
	       "The defaults hold 4 x 32768 tokens x 4 layers x 8 heads x 128 x 2 (K, V) x 2 B\n"
	       "= 2 GiB: start the daemon with a pool to match, e.g.\n"
	       "  kvd --socket PATH --pool-size 3GiB\n"
	       "The figures are those of the daemon's backend and the tenant's policy (host:\n"
	       "CPU threads; cuda: the GPU for policies restkv and laprox where the kernels\n"
	       "load, else, and for the default kvd, CPU threads with the K/V copied from the\n"
	       "GPU). On a GPU pool the K/V are written with driver copies\n"
	       "(built with the CUDA headers; the driver is loaded at run time).\n"
	       "\n"
	       "Options:\n"
	       "  --tokens N       Tokens per sequence, 1..%u (default: 32768)\n"
	       "  --seqs N         Sequences, 1..%u (default: 4)\n"
	       "  --layers N       Layers, 1..%u (default: 4)\n"
	       "  --unit U         What one eviction frees: head (per_head layout), layer or\n"
	       "                   block (per_layer layout) (default: layer)\n"
	       "  --bytes SIZE     Bytes the round frees (default: half the tenant's chunk\n"
	       "                   bytes)\n"
	       "  --recall N       Token recall on (N tokens per row, 1..%u): the round keeps\n"
	       "                   what it evicts in the host tier (kvd --host-tier-size), then\n"
	       "                   each sequence publishes a new window and recalls; prints the\n"
	       "                   recall rounds against the eviction round\n",
	       ROUND_TENANT, ROUND_BLOCK_TOKENS, ROUND_WINDOW, ROUND_TOKENS_MAX, ROUND_SEQS_MAX,
	       KVD_LAYERS_MAX, ROUND_RECALL_MAX);
}

#define round_usage_error(...) cli_usage_error("kvd-bench evict", __VA_ARGS__)

int bench_evict_round(const char *socket, int argc, char **argv) {
	enum { OPT_TOKENS = 0x100, OPT_SEQS, OPT_LAYERS, OPT_UNIT, OPT_BYTES, OPT_RECALL, OPT_IGNORED };
	/* evict.c's own options come along in argv: they are known here and skipped. */
	static const struct option options[] = {
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "seqs", required_argument, NULL, OPT_SEQS },
		{ "layers", required_argument, NULL, OPT_LAYERS },
		{ "unit", required_argument, NULL, OPT_UNIT },
		{ "bytes", required_argument, NULL, OPT_BYTES },
		{ "recall", required_argument, NULL, OPT_RECALL },
		{ "socket", required_argument, NULL, OPT_IGNORED },
		{ "units", required_argument, NULL, OPT_IGNORED },
		{ "groups", required_argument, NULL, OPT_IGNORED },
		{ "reps", required_argument, NULL, OPT_IGNORED },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	struct round b = { .socket = socket };
	int opt, r;

	/* glibc: 0 starts the scan over, the evict command's having run through argv. */
	optind = 0;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_TOKENS:
			if (number_parse_u32(optarg, 1, ROUND_TOKENS_MAX, &arg_tokens) < 0)
				return round_usage_error("--tokens: '%s' is not in 1..%u", optarg, ROUND_TOKENS_MAX);
			break;
		case OPT_SEQS:
			if (number_parse_u32(optarg, 1, ROUND_SEQS_MAX, &arg_seqs) < 0)
				return round_usage_error("--seqs: '%s' is not in 1..%u", optarg, ROUND_SEQS_MAX);
			break;
		case OPT_LAYERS:
			if (number_parse_u32(optarg, 1, KVD_LAYERS_MAX, &arg_layers) < 0)
				return round_usage_error("--layers: '%s' is not in 1..%u", optarg, KVD_LAYERS_MAX);
			break;
		case OPT_UNIT:
			if (strcmp(optarg, "head") == 0)
				arg_unit = KVD_UNIT_HEAD_TOKEN;
			else if (strcmp(optarg, "layer") == 0)
				arg_unit = KVD_UNIT_LAYER_TOKEN;
			else if (strcmp(optarg, "block") == 0)
				arg_unit = KVD_UNIT_BLOCK;
			else
				return round_usage_error("--unit: '%s' is not head, layer or block", optarg);
			break;
		case OPT_BYTES:
			if (size_parse(optarg, &arg_bytes) < 0 || arg_bytes == 0)
				return round_usage_error("--bytes: '%s' is not a size above 0", optarg);
			break;
		case OPT_RECALL:
			if (number_parse_u32(optarg, 1, ROUND_RECALL_MAX, &arg_recall) < 0)
				return round_usage_error("--recall: '%s' is not in 1..%u", optarg,
				                         ROUND_RECALL_MAX);
			break;
		case OPT_IGNORED:
			break;
		case 'h':
			round_help();
			return EXIT_SUCCESS;
		default:
			return round_usage_error("bad option");
		}
	if (optind < argc)
		return round_usage_error("unexpected argument '%s'", argv[optind]);
	if (!socket)
		return round_usage_error("--socket is missing");

	b.seqs = calloc(arg_seqs, sizeof(*b.seqs));
	if (!b.seqs) {
		fprintf(stderr, "kvd-bench evict: out of memory\n");
		return EXIT_FAILURE;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	r = round_run(&b);
	for (uint32_t i = 0; i < b.n_seqs; i++)
		kvd_seq_release(b.seqs[i]);
	free(b.seqs);
	free(b.fill_buf);
	kvd_client_unref(b.client);
	return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
