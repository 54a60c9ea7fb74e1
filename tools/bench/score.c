/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench score: time per layer of every eviction policy (kernels/policy.h) and of the
 * kernels under them (window attention, selection), optimised and reference, on a
 * Llama-3.1-8B-like layer (32 query heads, 8 kv heads, d 128, C 4096, w 32) with seeded
 * random tensors, next to this machine's own ceilings measured in the same run: the fp32
 * FMA peak on all threads and the memory stream bandwidth.
 *
 * Each entry states its FLOP and byte model (docs/algorithms.md §6): FLOPs are the useful
 * multiply-adds times two of one cold round (nothing cached across rounds: v G v^T is
 * computed in the round), where a quadratic form x G x^T with a symmetric d x d G counts
 * d(d+1)/2 + d, its upper triangle and then a dot, since the lower half repeats the upper;
 * bytes are the inputs read once at their dtype plus the fp32 attention maps written once.
 * An entry is compute-bound when its FLOP per byte exceeds the machine balance
 * (peak / bandwidth), else memory-bound, and its ratio is to that ceiling. The models are lower bounds on the work; a kernel that does more shows a lower
 * ratio, never a higher one.
 *
 * Adding a policy to kernels/policy.h adds it here (the table is walked by enum); its
 * model is one case in policy_model(). Adding a kernel entry is one line in kernel_entries[].
 *
 * This is a benchmark, not a test: nothing here asserts on timings.
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "attn.h"
#include "baselines.h"
#include "bench.h"
#include "basic/macro.h"
#include "basic/number.h"
#include "dtype.h"
#include "policy.h"
#include "select.h"
#include "simd.h"
#include "cli.h"

#define SIZES_MAX 16
#define TOKENS_MIN 64
#define TOKENS_MAX (1u << 20)
#define THREADS_MAX 256
#define REPS_MAX 1000

/* The reference runs by default only up to this many tokens: it is slow. */
#define REF_TOKENS_DEFAULT 4096

/* H2O over every prompt query is quadratic: about L/(2w) times the window attention
 * (64x at 4096). On 2 cores that is ~0.25 s per layer at 4096 and ~4 s at 16384 (four
 * runs per row), but ~16 s at 32768 and ~4 min at 131072, so larger sizes print a
 * skipped row with an estimate instead. Its reference (~23 s per run at 4096) runs by
 * default only up to H2O_PROMPT_REF_TOKENS, and at other sizes only with --ref. */
#define H2O_PROMPT_TOKENS_MAX 16384
#define H2O_PROMPT_REF_TOKENS 1024

/* The layer shape: Llama-3.1-8B. */
#define SHAPE_HEADS 32
#define SHAPE_KV_HEADS 8
#define SHAPE_DIM 128
#define SHAPE_C 4096
#define SHAPE_WINDOW 32
/* Tokens per block for the block-level entries; layers of the node-wide eviction entry. */
#define BLOCK_TOKENS 16
#define EVICT_LAYERS 32

static uint32_t arg_tokens[SIZES_MAX] = { 4096, 32768, 131072 };
static unsigned arg_n_tokens = 3;
static char *arg_policies;
static unsigned arg_reps = 3;
static unsigned arg_threads;
static int arg_ref = -1; /* -1: up to REF_TOKENS_DEFAULT; 0: never; 1: at every size */
static uint32_t arg_dtype = KVD_DTYPE_BF16;
static uint32_t arg_capacity = 1024;
static uint64_t arg_copy_mib;
static unsigned arg_fma_ms = 200;

static double now_s(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- Threads ---- */

/* Threads start behind a gate, so that a failed start runs nobody (barriers inside fn
 * would otherwise wait forever for the missing thread). */
struct par_gate {
	pthread_mutex_t lock;
	pthread_cond_t cond;
	int state; /* 0: wait, 1: run, -1: give up */
};

struct par {
	unsigned n;
	void (*fn)(void *ctx, unsigned tid, unsigned n);
	void *ctx;
	unsigned tid;
	struct par_gate *gate;
};

static void *par_main(void *p) {
	struct par *a = p;
	int state;

	pthread_mutex_lock(&a->gate->lock);
	while (a->gate->state == 0)
		pthread_cond_wait(&a->gate->cond, &a->gate->lock);
	state = a->gate->state;
	pthread_mutex_unlock(&a->gate->lock);
	if (state > 0)
		a->fn(a->ctx, a->tid, a->n);
	return NULL;
}

/* Runs fn(ctx, tid, n) for tid 0..n-1, each on its own thread (0 on the caller's), all or
 * none: returns 0, or -EAGAIN if a thread could not be started (then fn did not run). */
static int par_run(unsigned n, void (*fn)(void *, unsigned, unsigned), void *ctx) {
	struct par_gate gate = { PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0 };
	pthread_t tid[THREADS_MAX];
	struct par a[THREADS_MAX];
	unsigned started = 1;

	for (unsigned t = 0; t < n; t++)
		a[t] = (struct par){ n, fn, ctx, t, &gate };
	while (started < n && pthread_create(&tid[started], NULL, par_main, &a[started]) == 0)
		started++;
	pthread_mutex_lock(&gate.lock);
	gate.state = started == n ? 1 : -1;
	pthread_cond_broadcast(&gate.cond);
	pthread_mutex_unlock(&gate.lock);
	if (started == n)
		fn(ctx, 0, n);
	for (unsigned t = 1; t < started; t++)
		pthread_join(tid[t], NULL);
	return started == n ? 0 : -EAGAIN;
}

/* ---- Ceilings: the FMA peak ---- */

struct fma_job {
	int isa; /* 2: AVX-512, 1: AVX2+FMA, 0: portable C */
	uint64_t iters;
	pthread_barrier_t *barrier;
	double t0, t1;
	float sink[THREADS_MAX];
};

/* The FMA latency is 4 cycles and there are two FMA pipes, so at least 8 independent
 * accumulators keep them busy; more hide the loop overhead. The constants keep every
 * accumulator bounded (it converges to 1), so no input or denormal slows the loop. */
#if defined(__x86_64__)
__attribute__((target("avx512f"))) static float fma_loop_avx512(uint64_t iters) {
	const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
	__m512 a0 = _mm512_set1_ps(0.1f), a1 = _mm512_set1_ps(0.2f), a2 = _mm512_set1_ps(0.3f),
	       a3 = _mm512_set1_ps(0.4f), a4 = _mm512_set1_ps(0.5f), a5 = _mm512_set1_ps(0.6f),
	       a6 = _mm512_set1_ps(0.7f), a7 = _mm512_set1_ps(0.8f), a8 = _mm512_set1_ps(0.9f),
	       a9 = _mm512_set1_ps(1.0f), a10 = _mm512_set1_ps(1.1f), a11 = _mm512_set1_ps(1.2f),
	       a12 = _mm512_set1_ps(1.3f), a13 = _mm512_set1_ps(1.4f), a14 = _mm512_set1_ps(1.5f),
	       a15 = _mm512_set1_ps(1.6f);

	for (uint64_t i = 0; i < iters; i++) {
		a0 = _mm512_fmadd_ps(a0, m, c);
		a1 = _mm512_fmadd_ps(a1, m, c);
		a2 = _mm512_fmadd_ps(a2, m, c);
		a3 = _mm512_fmadd_ps(a3, m, c);
		a4 = _mm512_fmadd_ps(a4, m, c);
		a5 = _mm512_fmadd_ps(a5, m, c);
		a6 = _mm512_fmadd_ps(a6, m, c);
		a7 = _mm512_fmadd_ps(a7, m, c);
		a8 = _mm512_fmadd_ps(a8, m, c);
		a9 = _mm512_fmadd_ps(a9, m, c);
		a10 = _mm512_fmadd_ps(a10, m, c);
		a11 = _mm512_fmadd_ps(a11, m, c);
		a12 = _mm512_fmadd_ps(a12, m, c);
		a13 = _mm512_fmadd_ps(a13, m, c);
		a14 = _mm512_fmadd_ps(a14, m, c);
		a15 = _mm512_fmadd_ps(a15, m, c);
	}
	a0 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
			   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
	a8 = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)),
			   _mm512_add_ps(_mm512_add_ps(a12, a13), _mm512_add_ps(a14, a15)));
	return _mm512_reduce_add_ps(_mm512_add_ps(a0, a8));
}

__attribute__((target("avx2,fma"))) static float fma_loop_avx2(uint64_t iters) {
	const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
	__m256 a0 = _mm256_set1_ps(0.1f), a1 = _mm256_set1_ps(0.2f), a2 = _mm256_set1_ps(0.3f),
	       a3 = _mm256_set1_ps(0.4f), a4 = _mm256_set1_ps(0.5f), a5 = _mm256_set1_ps(0.6f),
	       a6 = _mm256_set1_ps(0.7f), a7 = _mm256_set1_ps(0.8f), a8 = _mm256_set1_ps(0.9f),
	       a9 = _mm256_set1_ps(1.0f), a10 = _mm256_set1_ps(1.1f), a11 = _mm256_set1_ps(1.2f);
	float out[8];

	for (uint64_t i = 0; i < iters; i++) {
		a0 = _mm256_fmadd_ps(a0, m, c);
		a1 = _mm256_fmadd_ps(a1, m, c);
		a2 = _mm256_fmadd_ps(a2, m, c);
		a3 = _mm256_fmadd_ps(a3, m, c);
		a4 = _mm256_fmadd_ps(a4, m, c);
		a5 = _mm256_fmadd_ps(a5, m, c);
		a6 = _mm256_fmadd_ps(a6, m, c);
		a7 = _mm256_fmadd_ps(a7, m, c);
		a8 = _mm256_fmadd_ps(a8, m, c);
		a9 = _mm256_fmadd_ps(a9, m, c);
		a10 = _mm256_fmadd_ps(a10, m, c);
		a11 = _mm256_fmadd_ps(a11, m, c);
	}
	a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
			   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
	a8 = _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11));
	_mm256_storeu_ps(out, _mm256_add_ps(a0, a8));
	return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

static float fma_loop_c(uint64_t iters) {
	float a[16];

	for (int j = 0; j < 16; j++)
		a[j] = 0.1f * (float)(j + 1);
	for (uint64_t i = 0; i < iters; i++)
		for (int j = 0; j < 16; j++)
			a[j] = fmaf(a[j], 0.999999f, 1e-6f);
	for (int j = 1; j < 16; j++)
		a[0] += a[j];
	return a[0];
}

/* FLOPs of one iteration of each loop: accumulators x lanes x 2. */
static double fma_flops_per_iter(int isa) {
	return isa == 2 ? 16 * 16 * 2 : isa == 1 ? 12 * 8 * 2 : 16 * 2;
}

static float fma_loop(int isa, uint64_t iters) {
#if defined(__x86_64__)
	if (isa == 2)
		return fma_loop_avx512(iters);
	if (isa == 1)
		return fma_loop_avx2(iters);
#endif
	return fma_loop_c(iters);
}

static void fma_thread(void *p, unsigned tid, unsigned n) {
	struct fma_job *j = p;

	pthread_barrier_wait(j->barrier);
	if (tid == 0)
		j->t0 = now_s();
	j->sink[tid] = fma_loop(j->isa, j->iters);
	pthread_barrier_wait(j->barrier);
	if (tid == 0)
		j->t1 = now_s();
}

/* GFLOP/s of the isa's loop on `threads` threads at once, each running about ms. */
static double fma_peak(int isa, unsigned threads, unsigned ms) {
	struct fma_job j = { .isa = isa };
	pthread_barrier_t barrier;
	double t, rate;
	uint64_t iters = 1u << 16;

	/* Calibrate on one thread: grow the count until a run takes 20 ms. */
	for (;;) {
		t = now_s();
		j.sink[0] += fma_loop(isa, iters);
		t = now_s() - t;
		if (t > 0.02 || iters > (UINT64_C(1) << 40))
			break;
		iters *= 4;
	}
	rate = (double)iters / t;
	j.iters = (uint64_t)(rate * ms / 1000.0) + 1;
	if (pthread_barrier_init(&barrier, NULL, threads) != 0)
		return 0;
	j.barrier = &barrier;
	if (par_run(threads, fma_thread, &j) < 0) {
		pthread_barrier_destroy(&barrier);
		return 0;
	}
	pthread_barrier_destroy(&barrier);
	return (double)threads * (double)j.iters * fma_flops_per_iter(isa) / (j.t1 - j.t0) / 1e9;
}

/* ---- Ceilings: memory bandwidth ---- */

struct mem_job {
	unsigned char *src, *dst;
	size_t bytes;
	unsigned passes;
	int read_avx2;
	pthread_barrier_t *barrier;
	double best_copy, best_read;
	uint64_t sink[THREADS_MAX];
};

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_avx2(const unsigned char *p, size_t n) {
	__m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
	uint64_t out[4];
	size_t i;

	for (i = 0; i + 128 <= n; i += 128) {
		a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
		a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
		a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
		a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
	}
	_mm256_storeu_si256((__m256i *)out,
			    _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
	return out[0] ^ out[1] ^ out[2] ^ out[3];
}
#endif

static uint64_t read_c(const unsigned char *p, size_t n) {
	uint64_t a = 0, b = 0, x, y;

	for (size_t i = 0; i + 16 <= n; i += 16) {
		memcpy(&x, p + i, 8);
		memcpy(&y, p + i + 8, 8);
		a ^= x;
		b ^= y;
	}
	return a ^ b;
}

static void mem_thread(void *p, unsigned tid, unsigned n) {
	struct mem_job *j = p;
	size_t slice = j->bytes / n / 4096 * 4096, off = slice * tid;

	/* First touch from the thread that streams the slice: its pages land on its node. */
	memset(j->src + off, (int)tid + 1, slice);
	memset(j->dst + off, 0, slice);
	for (int kind = 0; kind < 2; kind++)
		for (unsigned pass = 0; pass < j->passes; pass++) {
			double t0 = 0;

			pthread_barrier_wait(j->barrier);
			if (tid == 0)
				t0 = now_s();
			if (kind == 0)
				memcpy(j->dst + off, j->src + off, slice);
			else {
#if defined(__x86_64__)
				if (j->read_avx2)
					j->sink[tid] ^= read_avx2(j->src + off, slice);
				else
#endif
					j->sink[tid] ^= read_c(j->src + off, slice);
			}
			pthread_barrier_wait(j->barrier);
			if (tid == 0) {
				double dt = now_s() - t0;
				double *best = kind == 0 ? &j->best_copy : &j->best_read;

				if (*best == 0 || dt < *best)
					*best = dt;
			}
		}
}

/* Copy (read + write bytes counted) and read bandwidth, GB/s, over `bytes` per buffer. */
static int mem_bandwidth(unsigned threads, size_t bytes, double *ret_copy, double *ret_read) {
	struct mem_job j = { .bytes = bytes, .passes = 4 };
	pthread_barrier_t barrier;
	size_t slice = bytes / threads / 4096 * 4096;
	int r = 0;

	if (slice == 0)
		return -EINVAL;
	j.src = aligned_alloc(4096, bytes / 4096 * 4096);
	j.dst = aligned_alloc(4096, bytes / 4096 * 4096);
#if defined(__x86_64__)
	j.read_avx2 = __builtin_cpu_supports("avx2");
#endif
	if (!j.src || !j.dst || pthread_barrier_init(&barrier, NULL, threads) != 0) {
		free(j.src);
		free(j.dst);
		return -ENOMEM;
	}
	j.barrier = &barrier;
	r = par_run(threads, mem_thread, &j);
	pthread_barrier_destroy(&barrier);
	free(j.src);
	free(j.dst);
	if (r < 0)
		return r;
	*ret_copy = 2.0 * (double)slice * threads / j.best_copy / 1e9;
	*ret_read = (double)slice * threads / j.best_read / 1e9;
	return 0;
}

/* ---- The layer ---- */

struct layer {
	uint32_t tokens, capacity, dtype;
	struct kvd_attn_in in;
	void *q, *k, *v;
	float *gram, *gram_group; /* [H][d][d]; [Hkv][g*d][g*d] */
	/* Selection inputs: per-head prefix scores; one layer's per-token scores. */
	float *scores;            /* [H][L - w] */
	float *token_scores;      /* [L] */
	/* h2o-prompt: a query at every prompt position, its scores. */
	struct kvd_attn_in in_prompt;
	void *q_prompt;           /* [H][L][d] */
	float *prompt_scores;     /* [Hkv][L] */
	/* Node-wide eviction: EVICT_LAYERS layers of blocks, one group per layer. */
	uint32_t n_units, *unit_bytes, *group_start, *group_max_units;
	float *unit_value;
	uint8_t *unit_pinned;
	uint32_t *ids;
	/* Per-thread outputs and scratch. */
	unsigned threads;
	float *probs[THREADS_MAX], *scratch[THREADS_MAX];
	uint32_t *keep[THREADS_MAX];
	float *blocks;
	uint8_t *needle;
	uint32_t *counts;
	int ref;
	int error;
};

static uint64_t rng_next(uint64_t *s) {
	uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));

	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static float rng_uniform(uint64_t *s) {
	return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static uint16_t f32_to_bf16(float f) {
	uint32_t u;

	memcpy(&u, &f, 4);
	return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void *random_tensor(uint64_t *s, uint32_t dtype, size_t n, float amp) {
	size_t es = kvd_dtype_size(dtype);
	unsigned char *p = malloc(n * es + 64);

	if (!p)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		float f = amp * rng_uniform(s);

		if (dtype == KVD_DTYPE_F32)
			memcpy(p + i * 4, &f, 4);
		else {
			uint16_t h = dtype == KVD_DTYPE_F16 ? kvd_f32_to_f16(f) : f32_to_bf16(f);

			memcpy(p + i * 2, &h, 2);
		}
	}
	return p;
}

static void layer_free(struct layer *l) {
	free(l->q);
	free(l->k);
	free(l->v);
	free(l->gram);
	free(l->gram_group);
	free(l->scores);
	free(l->token_scores);
	free(l->q_prompt);
	free(l->prompt_scores);
	free(l->unit_bytes);
	free(l->group_start);
	free(l->group_max_units);
	free(l->unit_value);
	free(l->unit_pinned);
	free(l->ids);
	for (unsigned t = 0; t < THREADS_MAX; t++) {
		free(l->probs[t]);
		free(l->scratch[t]);
		free(l->keep[t]);
	}
	free(l->blocks);
	free(l->needle);
	free(l->counts);
	memset(l, 0, sizeof(*l));
}

/*
 * Random Gram matrices of a rank-r W_o: the group's G = B B^T / r with B [g*d][r] random,
 * and each head's G_h its diagonal block, so that the two are those of one W_o.
 */
static int layer_gram(struct layer *l, uint64_t *s) {
	const uint32_t H = SHAPE_HEADS, Hkv = SHAPE_KV_HEADS, d = SHAPE_DIM, g = H / Hkv, gd = g * d;
	const uint32_t r = 16;
	float *b = malloc((size_t)gd * r * sizeof(float));

	l->gram = malloc((size_t)H * d * d * sizeof(float));
	l->gram_group = malloc((size_t)Hkv * gd * gd * sizeof(float));
	if (!b || !l->gram || !l->gram_group) {
		free(b);
		return -ENOMEM;
	}
	for (uint32_t kv = 0; kv < Hkv; kv++) {
		float *gg = l->gram_group + (size_t)kv * gd * gd;

		for (size_t i = 0; i < (size_t)gd * r; i++)
			b[i] = rng_uniform(s);
		for (uint32_t i = 0; i < gd; i++)
			for (uint32_t j = 0; j < gd; j++) {
				float acc = 0;

				for (uint32_t c = 0; c < r; c++)
					acc += b[(size_t)i * r + c] * b[(size_t)j * r + c];
				gg[(size_t)i * gd + j] = acc / (float)r;
			}
		for (uint32_t a = 0; a < g; a++)
			for (uint32_t i = 0; i < d; i++)
				memcpy(l->gram + ((size_t)(kv * g + a) * d + i) * d,
				       gg + (size_t)(a * d + i) * gd + a * d, d * sizeof(float));
	}
	free(b);
	return 0;
}

/*
 * The prompt's queries for h2o-prompt, [H][L][d] at the window queries' amplitude, whose
 * last w rows are the window queries: then its last block is what h2o observes.
 */
static int layer_prompt(struct layer *l, uint64_t *s) {
	const uint32_t H = SHAPE_HEADS, d = SHAPE_DIM, w = SHAPE_WINDOW, L = l->tokens;
	size_t es = kvd_dtype_size(l->dtype);

	l->q_prompt = random_tensor(s, l->dtype, (size_t)H * L * d, 1.0f);
	l->prompt_scores = malloc((size_t)SHAPE_KV_HEADS * L * sizeof(float));
	if (!l->q_prompt || !l->prompt_scores)
		return -ENOMEM;
	for (uint32_t h = 0; h < H; h++)
		memcpy((char *)l->q_prompt + ((size_t)h * L + L - w) * d * es,
		       (const char *)l->q + (size_t)h * w * d * es, (size_t)w * d * es);
	l->in_prompt = l->in;
	l->in_prompt.q = l->q_prompt;
	l->in_prompt.window = L;
	kvd_attn_in_contiguous(&l->in_prompt);
	return 0;
}

/* prompt: set up h2o-prompt's queries too (H*L*d elements: only where it runs). */
static int layer_init(struct layer *l, uint32_t tokens, uint32_t dtype, unsigned threads,
		      int prompt) {
	const uint32_t H = SHAPE_HEADS, Hkv = SHAPE_KV_HEADS, d = SHAPE_DIM, w = SHAPE_WINDOW;
	uint32_t prefix = tokens - w, n_blocks = DIV_ROUND_UP(tokens, BLOCK_TOKENS);
	uint64_t s = UINT64_C(0x6b76642d73636f72) ^ tokens;
	size_t probs_floats = (size_t)H / Hkv * w * tokens;

	memset(l, 0, sizeof(*l));
	l->tokens = tokens;
	l->dtype = dtype;
	l->threads = threads;
	/* When the prompt fits the budget nothing is scored; keep a quarter of it instead. */
	l->capacity = arg_capacity < tokens ? arg_capacity : MAX(w + 1, tokens / 4);
	l->in = (struct kvd_attn_in){
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = w, .len = tokens, .dim = d,
		.scale = 1.0f / sqrtf((float)d),
	};
	/* Keys a little larger than queries make the attention peaky, as real attention is. */
	l->q = random_tensor(&s, dtype, (size_t)H * w * d, 1.0f);
	l->k = random_tensor(&s, dtype, (size_t)Hkv * tokens * d, 2.0f);
	l->v = random_tensor(&s, dtype, (size_t)Hkv * tokens * d, 1.0f);
	if (!l->q || !l->k || !l->v)
		return -ENOMEM;
	l->in.q = l->q;
	l->in.k = l->k;
	l->in.v = l->v;
	kvd_attn_in_contiguous(&l->in);
	if (layer_gram(l, &s) < 0)
		return -ENOMEM;

	/* Softmax-like scores: a few exponents, many near-ties, as attention gives. */
	l->scores = malloc((size_t)H * prefix * sizeof(float));
	l->token_scores = malloc((size_t)tokens * sizeof(float));
	if (!l->scores || !l->token_scores)
		return -ENOMEM;
	for (size_t i = 0; i < (size_t)H * prefix; i++)
		l->scores[i] = expf(-8.0f * (rng_uniform(&s) + 1.0f)) / (float)tokens;
	for (uint32_t i = 0; i < tokens; i++)
		l->token_scores[i] = expf(-8.0f * (rng_uniform(&s) + 1.0f)) / (float)tokens;

	l->n_units = n_blocks * EVICT_LAYERS;
	l->unit_bytes = malloc((size_t)l->n_units * sizeof(uint32_t));
	l->unit_value = malloc((size_t)l->n_units * sizeof(float));
	l->unit_pinned = malloc(l->n_units);
	l->group_start = malloc((EVICT_LAYERS + 1) * sizeof(uint32_t));
	l->group_max_units = malloc(EVICT_LAYERS * sizeof(uint32_t));
	l->ids = malloc((size_t)l->n_units * sizeof(uint32_t));
	if (!l->unit_bytes || !l->unit_value || !l->unit_pinned || !l->group_start ||
	    !l->group_max_units || !l->ids)
		return -ENOMEM;
	for (uint32_t u = 0; u < l->n_units; u++) {
		uint32_t b = u % n_blocks;
		/* Blocks of Hkv * d * 2 (K and V) * 2 bytes per token; the tail block partial. */
		uint32_t t = b == n_blocks - 1 && tokens % BLOCK_TOKENS ? tokens % BLOCK_TOKENS : BLOCK_TOKENS;

		l->unit_bytes[u] = t * Hkv * d * 2 * 2;
		l->unit_value[u] = expf(-8.0f * (rng_uniform(&s) + 1.0f));
		/* The sinks, the window and the tail are pinned (docs/algorithms.md §7.1). */
		l->unit_pinned[u] = b == 0 || b + DIV_ROUND_UP(w, BLOCK_TOKENS) >= n_blocks;
	}
	for (uint32_t g = 0; g <= EVICT_LAYERS; g++)
		l->group_start[g] = g * n_blocks;
	/* A floor of 20% of each layer's blocks (AdaKV's alpha). */
	for (uint32_t g = 0; g < EVICT_LAYERS; g++)
		l->group_max_units[g] = n_blocks - n_blocks / 5;
	/* Last from the stream, so that the other tensors do not depend on it. */
	if (prompt && layer_prompt(l, &s) < 0)
		return -ENOMEM;

	for (unsigned t = 0; t < threads; t++) {
		l->probs[t] = malloc(probs_floats * sizeof(float));
		l->scratch[t] = malloc((kvd_attn_scratch_floats(&l->in) + 16) * sizeof(float));
		l->keep[t] = malloc((size_t)H * prefix * sizeof(uint32_t));
		if (!l->probs[t] || !l->scratch[t] || !l->keep[t])
			return -ENOMEM;
	}
	l->blocks = malloc((size_t)n_blocks * sizeof(float));
	l->needle = malloc(n_blocks);
	l->counts = malloc(H * sizeof(uint32_t));
	if (!l->blocks || !l->needle || !l->counts)
		return -ENOMEM;
	return 0;
}

/* ---- Models: FLOPs and bytes of one layer, one cold round ---- */

struct model {
	double flops, bytes;
};

/* Attention terms: visible keys summed over the window rows (causal inside the window). */
static double visible_keys(const struct layer *l) {
	double w = SHAPE_WINDOW, L = l->tokens;

	return w * (L - w) + w * (w + 1) / 2;
}

/* Window attention for every query head: Q K^T over the visible keys (exp, max and the
 * normalisation are a few per element and not counted); reads Q and K, writes A_h. */
static struct model attn_model(const struct layer *l) {
	double es = (double)kvd_dtype_size(l->dtype), H = SHAPE_HEADS, Hkv = SHAPE_KV_HEADS,
	       d = SHAPE_DIM, w = SHAPE_WINDOW, L = l->tokens;

	return (struct model){
		.flops = 2 * H * d * visible_keys(l),
		.bytes = H * w * d * es + Hkv * L * d * es + H * w * L * 4,
	};
}

/* H2O over the whole prompt: Q K^T over the causal triangle, L(L+1)/2 keys per query head
 * (softmax and the column sums, a few per element, not counted, as for attn); reads Q
 * [H][L][d] and K once and writes the [Hkv][L] scores. The maps live in per-thread blocks
 * of h2o_block rows that stay in cache, so they are not counted as traffic. */
static struct model h2o_prompt_model(const struct layer *l) {
	double es = (double)kvd_dtype_size(l->dtype), H = SHAPE_HEADS, Hkv = SHAPE_KV_HEADS,
	       d = SHAPE_DIM, L = l->tokens;

	return (struct model){
		.flops = 2 * H * d * L * (L + 1) / 2,
		.bytes = H * L * d * es + Hkv * L * d * es + Hkv * L * 4,
	};
}

static struct model policy_model(enum kvd_policy p, const struct layer *l) {
	double es = (double)kvd_dtype_size(l->dtype), H = SHAPE_HEADS, Hkv = SHAPE_KV_HEADS,
	       d = SHAPE_DIM, w = SHAPE_WINDOW, L = l->tokens, P = L - w, g = H / Hkv;
	struct model m = attn_model(l);
	double v_bytes = Hkv * L * d * es;
	/* One quadratic form x G x^T, G symmetric (or symmetrised: x M x^T = x (M + M^T)/2 x^T). */
	double quad = d * (d + 1) / 2 + d;

	switch (p) {
	case KVD_POLICY_FULL:
	case KVD_POLICY_STREAMINGLLM:
		/* Positions only. */
		return (struct model){ 0, 0 };
	case KVD_POLICY_H2O:
	case KVD_POLICY_SNAPKV:
	case KVD_POLICY_PYRAMIDKV:
	case KVD_POLICY_ADAKV:
		/* Attention, then sums and pooling over w*H*L and k*H*L (adds, not counted). */
		return m;
	case KVD_POLICY_TOVA:
		/* One query per head. */
		return (struct model){ 2 * H * d * L, H * d * es + Hkv * L * d * es + H * L * 4 };
	case KVD_POLICY_KNORM:
		/* ||k|| per kv entry: reads K once. */
		return (struct model){ 2 * Hkv * L * d, Hkv * L * d * es };
	case KVD_POLICY_KEYDIFF:
		/* Normalised keys, their mean, a cosine each: about two passes of d. */
		return (struct model){ 6 * Hkv * L * d, Hkv * L * d * es };
	case KVD_POLICY_EXPECTED_ATTENTION:
		/* Query covariance (its upper triangle, w*H*d(d+1)/2), k Sigma k^T per query head
		 * (H*L quadratic forms, §6), mean and ||v||: reads Q, K, V. */
		return (struct model){ 2 * (w * H * d * (d + 1) / 2 + H * L * quad + H * L * d +
					    Hkv * L * d),
				       H * w * d * es + 2 * Hkv * L * d * es };
	case KVD_POLICY_RESTKV:
	case KVD_POLICY_KVD:
		/* Gram form per query head (§6): v G_h v^T (one quadratic form per token, cold),
		 * o = A V over the prefix (d per token), o G_h (d^2), (o G_h) . v (d per token),
		 * the EMA (w per token); reads V and the H Gram matrices too. */
		m.flops += 2 * (H * P * quad + 2 * H * P * d + H * d * d + H * w * P);
		m.bytes += v_bytes + H * d * d * 4;
		return m;
	case KVD_POLICY_LAPROX:
		/* GQA-joint CR cost (§2.2, §6) per kv head: the g(g+1)/2 column products of the
		 * maps (w per token each) and v G_hh' v^T for the blocks h' >= h (one quadratic
		 * form each, cold); reads V and the group Gram matrices. */
		m.flops += 2 * (Hkv * P * g * (g + 1) / 2 * (w + quad));
		m.bytes += v_bytes + Hkv * g * d * g * d * 4;
		return m;
	default:
		/* A policy this file does not know yet: attention only, a lower bound. */
		return m;
	}
}

/* ---- Entries ---- */

/* Threads over kv heads, each computing the maps of its g query heads, as the pipelines do. */
static void attn_thread(void *p, unsigned tid, unsigned n) {
	struct layer *l = p;
	const uint32_t g = SHAPE_HEADS / SHAPE_KV_HEADS;
	size_t wl = (size_t)SHAPE_WINDOW * l->tokens;

	for (uint32_t kv = tid; kv < SHAPE_KV_HEADS; kv += n) {
		int r = 0;

		if (l->ref)
			for (uint32_t a = 0; r >= 0 && a < g; a++)
				r = kvd_attn_head_ref(&l->in, kv * g + a, l->probs[tid] + a * wl);
		else
			r = kvd_attn_heads_buf(&l->in, kv * g, g, l->probs[tid], l->scratch[tid]);
		if (r < 0)
			l->error = r;
	}
}

static int run_attn(struct layer *l) {
	return par_run(l->threads, attn_thread, l);
}

/* H2O as published (baselines.h): every prompt query, accumulated causally in blocks of
 * h2o_block rows, threads over query heads. Scores only: its top-k is the topk entry's. */
static int run_h2o_prompt(struct layer *l) {
	struct kvd_baseline_params p;

	kvd_baseline_params_init(KVD_BASELINE_H2O, &p);
	p.threads = l->threads;
	return (l->ref ? kvd_baseline_scores_ref : kvd_baseline_scores)(KVD_BASELINE_H2O, &p,
									&l->in_prompt,
									l->prompt_scores);
}

/* The per-head selection a ReST-KV layer ends with: top-(capacity - w) of each row. */
static void topk_thread(void *p, unsigned tid, unsigned n) {
	struct layer *l = p;
	uint32_t prefix = l->tokens - SHAPE_WINDOW, k = l->capacity - SHAPE_WINDOW;

	for (uint32_t h = tid; h < SHAPE_HEADS; h += n) {
		const float *row = l->scores + (size_t)h * prefix;
		int r = l->ref ? kvd_topk_ref(row, prefix, k, l->keep[tid]) :
				 kvd_topk(row, prefix, k, l->keep[tid]);

		if (r < 0)
			l->error = r;
	}
}

static int run_topk(struct layer *l) {
	return par_run(l->threads, topk_thread, l);
}

/* The layer-wide selection of laprox and kvd: one top-k over all H rows at once. */
static int run_topk_layer(struct layer *l) {
	const float *rows[SHAPE_HEADS];
	uint32_t lens[SHAPE_HEADS], prefix = l->tokens - SHAPE_WINDOW;
	uint64_t k = (uint64_t)SHAPE_HEADS * (l->capacity - SHAPE_WINDOW);

	for (uint32_t h = 0; h < SHAPE_HEADS; h++) {
		rows[h] = l->scores + (size_t)h * prefix;
		lens[h] = prefix;
	}
	return (l->ref ? kvd_topk_rows_ref : kvd_topk_rows)(rows, lens, SHAPE_HEADS, k, l->threads,
							   l->counts, l->keep[0]);
}

static int run_blocks(struct layer *l) {
	return (l->ref ? kvd_block_scores_ref : kvd_block_scores)(
		l->token_scores, l->tokens, BLOCK_TOKENS, KVD_NEEDLE_PPM_DEFAULT, l->blocks, l->needle);
}

/* Node-wide greedy over the blocks of EVICT_LAYERS layers: free a quarter of the bytes. */
static int run_evict(struct layer *l) {
	struct kvd_evict_in in = {
		.n = l->n_units, .value = l->unit_value, .bytes = l->unit_bytes,
		.pinned = l->unit_pinned, .n_groups = EVICT_LAYERS, .group_start = l->group_start,
		.group_max_units = l->group_max_units,
		.target = (uint64_t)l->tokens * SHAPE_KV_HEADS * SHAPE_DIM * 4 * EVICT_LAYERS / 4,
	};
	uint32_t n_ids;
	uint64_t freed;

	return (l->ref ? kvd_evict_greedy_ref : kvd_evict_greedy)(&in, l->ids, &n_ids, &freed);
}

static struct model topk_model(const struct layer *l) {
	/* Reads the scores once (the radix passes re-read them from cache). */
	return (struct model){ 0, (double)SHAPE_HEADS * (l->tokens - SHAPE_WINDOW) * 4 };
}

static struct model blocks_model(const struct layer *l) {
	/* One add per token; reads the scores, writes a float and a flag per block. */
	double L = l->tokens;

	return (struct model){ L, L * 4 + L / BLOCK_TOKENS * 5 };
}

static struct model evict_model(const struct layer *l) {
	/* One division per unit; reads value, bytes and pin, writes at most an id. Per layer:
	 * the run covers EVICT_LAYERS layers and is reported divided by them. */
	double n = (double)l->n_units / EVICT_LAYERS;

	return (struct model){ n, n * 13 };
}

struct kernel_entry {
	const char *name;
	int (*run)(struct layer *l);
	struct model (*model)(const struct layer *l);
	unsigned per;        /* the run covers this many layers */
	uint32_t max_tokens; /* 0, or skipped above this many tokens (quadratic entries) */
	uint32_t ref_tokens; /* 0, or its reference runs by default only up to this many */
};

static const struct kernel_entry kernel_entries[] = {
	{ "attn", run_attn, attn_model, 1, 0, 0 },
	{ "h2o-prompt", run_h2o_prompt, h2o_prompt_model, 1, H2O_PROMPT_TOKENS_MAX,
	  H2O_PROMPT_REF_TOKENS },
	{ "topk", run_topk, topk_model, 1, 0, 0 },
	{ "topk-layer", run_topk_layer, topk_model, 1, 0, 0 },
	{ "blocks", run_blocks, blocks_model, 1, 0, 0 },
	{ "evict", run_evict, evict_model, EVICT_LAYERS, 0, 0 },
};

/* Per kernel entry and path (opt, ref): the GFLOP/s of its latest timed size in this run,
 * the rate a skipped size's time is estimated at. */
static struct {
	uint32_t tokens;
	double gflops;
} entry_rate[ELEMENTSOF(kernel_entries)][2];

static int run_policy(struct layer *l, enum kvd_policy policy) {
	struct kvd_policy_params p;
	struct kvd_keep *keep = NULL;
	int r;

	kvd_policy_params_default(policy, &p);
	p.capacity = l->capacity;
	p.threads = l->threads;
	p.reference = l->ref;
	p.layer = 0;
	p.n_layers = 32;
	r = kvd_policy_keep(&p, &l->in, l->gram, l->gram_group, &keep);
	kvd_keep_free(keep);
	return r;
}

/* ---- The table ---- */

struct ceilings {
	double peak, peak_avx512, peak_avx2, copy, read, bw;
};

static int name_selected(const char *name) {
	const char *p = arg_policies;
	size_t n = strlen(name);

	if (!p)
		return 1;
	while (*p) {
		const char *e = strchr(p, ',');
		size_t len = e ? (size_t)(e - p) : strlen(p);

		if (len == n && strncmp(p, name, n) == 0)
			return 1;
		p += len + (e != NULL);
	}
	return 0;
}

static void print_row(const struct layer *l, const char *name, int ref, const double *t,
		      unsigned reps, unsigned per, struct model m, const struct ceilings *c, int r) {
	double best = t[0], median, gflops, gbs, intensity, ratio;
	double sorted[REPS_MAX];
	const char *bound;

	if (r < 0) {
		printf("%7u  %-19s %-4s  error: %s\n", l->tokens, name, ref ? "ref" : "opt", strerror(-r));
		return;
	}
	memcpy(sorted, t, reps * sizeof(double));
	for (unsigned i = 1; i < reps; i++)
		for (unsigned j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) {
			double x = sorted[j];

			sorted[j] = sorted[j - 1];
			sorted[j - 1] = x;
		}
	best = sorted[0] / per;
	median = sorted[reps / 2] / per;
	gflops = m.flops / best / 1e9;
	gbs = m.bytes / best / 1e9;
	intensity = m.bytes > 0 ? m.flops / m.bytes : 0;
	if (m.flops == 0 && m.bytes == 0) {
		printf("%7u  %-19s %-4s %10.3f %10.3f %9s %8s %7s  %-7s %6s\n", l->tokens, name,
		       ref ? "ref" : "opt", best * 1e3, median * 1e3, "-", "-", "-", "-", "-");
		return;
	}
	if (intensity > c->peak / c->bw) {
		bound = "compute";
		ratio = gflops / c->peak;
	} else {
		bound = "memory";
		ratio = gbs / c->bw;
	}
	printf("%7u  %-19s %-4s %10.3f %10.3f %9.1f %8.2f %7.1f  %-7s %5.1f%%\n", l->tokens, name,
	       ref ? "ref" : "opt", best * 1e3, median * 1e3, gflops, gbs, intensity, bound,
	       ratio * 100);
}

/* Runs one entry reps times (after a warm-up when reps > 1); returns 0 or the error. */
static int time_entry(struct layer *l, int (*run)(struct layer *, const void *), const void *arg,
		      unsigned reps, double *t) {
	int r;

	l->error = 0;
	if (reps > 1) {
		r = run(l, arg);
		if (r < 0 || l->error < 0)
			return r < 0 ? r : l->error;
	}
	for (unsigned i = 0; i < reps; i++) {
		double t0 = now_s();

		r = run(l, arg);
		t[i] = now_s() - t0;
		if (r < 0 || l->error < 0)
			return r < 0 ? r : l->error;
	}
	return 0;
}

/* Kernel entry i does not run at this size: says so, with the time it would take at the
 * rate of its latest timed size, or at the FMA peak (a lower bound) if none was timed. */
static void print_skipped(const struct layer *l, size_t i, int ref, const struct ceilings *c) {
	const struct kernel_entry *e = &kernel_entries[i];
	double flops = e->model(l).flops / 1e9;

	printf("%7u  %-19s %-4s  skipped: quadratic, ", l->tokens, e->name, ref ? "ref" : "opt");
	if (entry_rate[i][ref].gflops > 0)
		printf("~%.1f s/layer at its %u-token rate", flops / entry_rate[i][ref].gflops,
		       entry_rate[i][ref].tokens);
	else
		printf(">= %.1f s/layer at the FMA peak", flops / c->peak);
	printf(" (runs up to %u tokens)\n", e->max_tokens);
}

static int run_kernel_entry(struct layer *l, const void *arg) {
	return ((const struct kernel_entry *)arg)->run(l);
}

static int run_policy_entry(struct layer *l, const void *arg) {
	return run_policy(l, *(const enum kvd_policy *)arg);
}

static int bench_size(uint32_t tokens, const struct ceilings *c) {
	struct layer l;
	double t[REPS_MAX];
	int failed = 0, r;

	r = layer_init(&l, tokens, arg_dtype, arg_threads,
		       tokens <= H2O_PROMPT_TOKENS_MAX && name_selected("h2o-prompt"));
	if (r < 0) {
		fprintf(stderr, "kvd-bench: %u tokens: cannot set up the layer: %s\n", tokens, strerror(-r));
		layer_free(&l);
		return -1;
	}
	for (int ref = 0; ref <= 1; ref++) {
		if (ref && (arg_ref == 0 || (arg_ref < 0 && tokens > REF_TOKENS_DEFAULT)))
			continue;
		l.ref = ref;
		for (size_t i = 0; i < ELEMENTSOF(kernel_entries); i++) {
			const struct kernel_entry *e = &kernel_entries[i];

			if (!name_selected(e->name))
				continue;
			if (ref && arg_ref < 0 && e->ref_tokens && tokens > e->ref_tokens)
				continue;
			if (e->max_tokens && tokens > e->max_tokens) {
				print_skipped(&l, i, ref, c);
				continue;
			}
			r = time_entry(&l, run_kernel_entry, e, arg_reps, t);
			print_row(&l, e->name, ref, t, arg_reps, e->per, e->model(&l), c, r);
			failed |= r < 0;
			if (r >= 0) {
				double best = t[0];

				for (unsigned k = 1; k < arg_reps; k++)
					best = MIN(best, t[k]);
				entry_rate[i][ref].tokens = tokens;
				entry_rate[i][ref].gflops = e->model(&l).flops / (best / e->per) / 1e9;
			}
		}
		for (int p = 0; p < _KVD_POLICY_MAX; p++) {
			enum kvd_policy policy = (enum kvd_policy)p;
			const char *name = kvd_policy_to_string(policy);

			if (!name || !name_selected(name))
				continue;
			r = time_entry(&l, run_policy_entry, &policy, arg_reps, t);
			print_row(&l, name, ref, t, arg_reps, 1, policy_model(policy, &l), c, r);
			failed |= r < 0;
		}
		fflush(stdout);
	}
	layer_free(&l);
	return failed ? -1 : 0;
}

static int measure_ceilings(struct ceilings *c) {
	size_t bytes;
	long llc;
	int r;

	memset(c, 0, sizeof(*c));
#if defined(__x86_64__)
	if (__builtin_cpu_supports("avx512f"))
		c->peak_avx512 = fma_peak(2, arg_threads, arg_fma_ms);
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
		c->peak_avx2 = fma_peak(1, arg_threads, arg_fma_ms);
#endif
	c->peak = MAX(c->peak_avx512, c->peak_avx2);
	if (c->peak == 0)
		c->peak = fma_peak(0, arg_threads, arg_fma_ms);

	/* Buffers well past the last-level cache, so that the stream comes from DRAM. */
	llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
	if (llc <= 0)
		llc = 32L << 20;
	bytes = arg_copy_mib ? (size_t)arg_copy_mib << 20 : MAX((size_t)llc * 2, (size_t)256 << 20);
	r = mem_bandwidth(arg_threads, bytes, &c->copy, &c->read);
	if (r < 0) {
		fprintf(stderr, "kvd-bench: memory bandwidth: %s\n", strerror(-r));
		return r;
	}
	c->bw = MAX(c->copy, c->read);
	printf("ceilings, measured now on %u thread%s:\n", arg_threads, arg_threads == 1 ? "" : "s");
	printf("  fp32 FMA peak: %.1f GFLOP/s (AVX-512 16 acc: %.1f, AVX2+FMA 12 acc: %.1f)\n", c->peak,
	       c->peak_avx512, c->peak_avx2);
	printf("  memory: copy %.1f GB/s (read + write bytes), read %.1f GB/s, over 2 x %zu MiB "
	       "(last-level cache %ld MiB)\n", c->copy, c->read, bytes >> 20, llc >> 20);
	printf("  machine balance: %.1f FLOP/byte (peak / best bandwidth)\n", c->peak / c->bw);
	return 0;
}

/* ---- Options ---- */

static void help(void) {
	printf("Usage: kvd-bench score [OPTIONS]\n"
	       "\n"
	       "Times every eviction policy (kernels/policy.h) and the kernels under them on one\n"
	       "Llama-3.1-8B-like layer: %u query heads, %u kv heads, d %u, C %u, window %u, with\n"
	       "seeded random Q, K, V and W_o Gram matrices (d x d per head whatever C is: C\n"
	       "only sizes their one-off computation, not timed). Prints time per layer (best\n"
	       "and median of the repetitions), achieved GFLOP/s and GB/s by each entry's\n"
	       "model, and the ratio to this machine's ceiling for the bound that applies (an\n"
	       "FMA loop and a memory stream on all threads, measured first).\n"
	       "\n"
	       "Kernel entries: attn (window attention over all heads), h2o-prompt (H2O over\n"
	       "every prompt query, causal, in blocks; the h2o policy sees only the window's),\n"
	       "topk (per-head top-k), topk-layer (one top-k over all heads), blocks (block sums\n"
	       "+ needle guard), evict (greedy by value per byte over %u layers of %u-token\n"
	       "blocks, per layer). h2o-prompt is quadratic in the tokens: above %u it prints a\n"
	       "skipped row with its estimated time instead, and its reference runs only up to\n"
	       "%u tokens unless --ref is given.\n"
	       "\n"
	       "Options:\n"
	       "  --tokens LIST     Resident tokens per layer, comma-separated, %u..%u\n"
	       "                    (default: 4096,32768,131072)\n"
	       "  --policies LIST   Entries to run, comma-separated: kernel entries and policy\n"
	       "                    names (default: all)\n"
	       "  --reps N          Timed repetitions, after one warm-up if N > 1 (default: 3)\n"
	       "  --threads N       Threads for the kernels and the ceilings (default: online CPUs)\n"
	       "  --ref             Run the reference at every size (default: up to %u tokens)\n"
	       "  --no-ref          Never run the reference\n"
	       "  --dtype T         f16, bf16 or f32 for Q, K and V (default: bf16)\n"
	       "  --capacity N      Tokens kept per row, window included (default: 1024; a\n"
	       "                    quarter of the tokens when they do not exceed it)\n"
	       "  --copy-mib N      Memory ceiling buffer size per buffer (default: twice the\n"
	       "                    last-level cache, at least 256)\n"
	       "  --fma-ms N        Duration of each FMA ceiling run (default: 200)\n"
	       "  -h --help         Show this help and exit\n",
	       SHAPE_HEADS, SHAPE_KV_HEADS, SHAPE_DIM, SHAPE_C, SHAPE_WINDOW, EVICT_LAYERS, BLOCK_TOKENS,
	       H2O_PROMPT_TOKENS_MAX, H2O_PROMPT_REF_TOKENS, TOKENS_MIN, TOKENS_MAX, REF_TOKENS_DEFAULT);
}

#define usage_error(...) cli_usage_error("kvd-bench score", __VA_ARGS__)

static int item_tokens(const char *s, unsigned i, void *userdata _unused_) {
	uint64_t v;

	if (number_parse_u64(s, TOKENS_MIN, TOKENS_MAX, &v) < 0)
		return -EINVAL;
	arg_tokens[i] = (uint32_t)v;
	return 0;
}

static int parse_tokens(const char *s) {
	int n = cli_parse_list(s, SIZES_MAX, item_tokens, NULL);

	if (n < 0)
		return n;
	arg_n_tokens = n;
	return 0;
}

static int item_policy(const char *s, unsigned i _unused_, void *userdata _unused_) {
	int found = kvd_policy_from_string(s) >= 0;

	for (size_t k = 0; k < ELEMENTSOF(kernel_entries); k++)
		found |= strcmp(s, kernel_entries[k].name) == 0;
	if (!found) {
		usage_error("--policies: unknown entry '%s'", s);
		return -EINVAL;
	}
	return 0;
}

/* Every name in --policies must exist: a typo would otherwise time nothing, silently. */
static int check_policies(void) {
	if (!arg_policies || !*arg_policies)
		return 0;
	return cli_parse_list(arg_policies, UINT32_MAX, item_policy, NULL) < 0 ? 2 : 0;
}

int bench_score(int argc, char **argv) {
	enum { OPT_TOKENS = 0x100, OPT_POLICIES, OPT_REPS, OPT_THREADS, OPT_REF, OPT_NO_REF,
	       OPT_DTYPE, OPT_CAPACITY, OPT_COPY_MIB, OPT_FMA_MS };
	static const struct option options[] = {
		{ "tokens", required_argument, NULL, OPT_TOKENS },
		{ "policies", required_argument, NULL, OPT_POLICIES },
		{ "reps", required_argument, NULL, OPT_REPS },
		{ "threads", required_argument, NULL, OPT_THREADS },
		{ "ref", no_argument, NULL, OPT_REF },
		{ "no-ref", no_argument, NULL, OPT_NO_REF },
		{ "dtype", required_argument, NULL, OPT_DTYPE },
		{ "capacity", required_argument, NULL, OPT_CAPACITY },
		{ "copy-mib", required_argument, NULL, OPT_COPY_MIB },
		{ "fma-ms", required_argument, NULL, OPT_FMA_MS },
		{ "help", no_argument, NULL, 'h' },
		{},
	};
	struct ceilings c;
	int opt, failed = 0, r;
	long cpus;
	uint64_t v;

	cpus = sysconf(_SC_NPROCESSORS_ONLN);
	arg_threads = cpus > 0 ? (unsigned)MIN(cpus, THREADS_MAX) : 1;
	while ((opt = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (opt) {
		case OPT_TOKENS:
			if (parse_tokens(optarg) < 0)
				return usage_error("--tokens: '%s' is not a list of %u..%u, at most %u",
						   optarg, TOKENS_MIN, TOKENS_MAX, SIZES_MAX);
			break;
		case OPT_POLICIES:
			arg_policies = optarg;
			break;
		case OPT_REPS:
			if (number_parse_u64(optarg, 1, REPS_MAX, &v) < 0)
				return usage_error("--reps: '%s' is not in 1..%u", optarg, REPS_MAX);
			arg_reps = (unsigned)v;
			break;
		case OPT_THREADS:
			if (number_parse_u64(optarg, 1, THREADS_MAX, &v) < 0)
				return usage_error("--threads: '%s' is not in 1..%u", optarg, THREADS_MAX);
			arg_threads = (unsigned)v;
			break;
		case OPT_REF:
			arg_ref = 1;
			break;
		case OPT_NO_REF:
			arg_ref = 0;
			break;
		case OPT_DTYPE:
			if (strcmp(optarg, "f16") == 0)
				arg_dtype = KVD_DTYPE_F16;
			else if (strcmp(optarg, "bf16") == 0)
				arg_dtype = KVD_DTYPE_BF16;
			else if (strcmp(optarg, "f32") == 0)
				arg_dtype = KVD_DTYPE_F32;
			else
				return usage_error("--dtype: '%s' is not f16, bf16 or f32", optarg);
			break;
		case OPT_CAPACITY:
			if (number_parse_u64(optarg, SHAPE_WINDOW + 1, TOKENS_MAX, &v) < 0)
				return usage_error("--capacity: '%s' is not in %u..%u", optarg,
						   SHAPE_WINDOW + 1, TOKENS_MAX);
			arg_capacity = (uint32_t)v;
			break;
		case OPT_COPY_MIB:
			if (number_parse_u64(optarg, 1, 1u << 20, &v) < 0)
				return usage_error("--copy-mib: '%s' is not in 1..%u", optarg, 1u << 20);
			arg_copy_mib = v;
			break;
		case OPT_FMA_MS:
			if (number_parse_u64(optarg, 1, 60000, &v) < 0)
				return usage_error("--fma-ms: '%s' is not in 1..60000", optarg);
			arg_fma_ms = (unsigned)v;
			break;
		case 'h':
			help();
			return EXIT_SUCCESS;
		default:
			return usage_error("bad option");
		}
	if (optind < argc)
		return usage_error("unexpected argument '%s'", argv[optind]);
	if (check_policies() != 0)
		return 2;

	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("kvd-bench score: Llama-3.1-8B-like layer: %u query heads, %u kv heads, d %u, C %u, "
	       "window %u; %s Q/K/V, fp32 W_o Gram matrices; %u thread%s, %u rep%s; kernels: %s\n",
	       SHAPE_HEADS, SHAPE_KV_HEADS, SHAPE_DIM, SHAPE_C, SHAPE_WINDOW,
	       arg_dtype == KVD_DTYPE_F16 ? "f16" : arg_dtype == KVD_DTYPE_BF16 ? "bf16" : "f32",
	       arg_threads, arg_threads == 1 ? "" : "s", arg_reps, arg_reps == 1 ? "" : "s",
	       kvd_simd()->name);
	if (measure_ceilings(&c) < 0)
		return EXIT_FAILURE;
	printf("\n%7s  %-19s %-4s %10s %10s %9s %8s %7s  %-7s %6s\n", "TOKENS", "ENTRY", "PATH",
	       "MS/LAYER", "MEDIAN", "GFLOP/S", "GB/S", "FLOP/B", "BOUND", "CEIL");
	for (unsigned i = 0; i < arg_n_tokens; i++)
		failed |= bench_size(arg_tokens[i], &c) < 0;
	printf("\nMS/LAYER is the best repetition, MEDIAN the median; GFLOP/s and GB/s are each "
	       "entry's model\n(see score.c) over the best time; CEIL is the achieved share of the "
	       "ceiling of its bound.\n");
	r = failed ? EXIT_FAILURE : EXIT_SUCCESS;
	return r;
}
