/* SPDX-License-Identifier: MIT */
/* The kvd-lm forward pass; see forward.h. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basic/macro.h"
#include "dtype.h"
#include "forward.h"
#include "simd.h"

/* ---- the thread pool ---- */

/*
 * A job is `tasks` calls of fn(arg, task, worker) that the caller and the workers claim
 * one by one. The claim word holds the job's task count and the next task, so that one
 * compare-and-swap claims a task of the job the word describes: a worker that wakes up
 * late can only claim tasks of the current job (and then reads that job's fn and arg,
 * published before the word), never of one that is over. The caller waits for the job's
 * tasks to be done, not for every worker to show up, so a worker the scheduler keeps off a
 * CPU does not hold a step back.
 *
 * Between jobs the workers spin on the job generation for a while before they sleep on a
 * condition variable: a decode step runs a dozen short jobs per layer, and a futex
 * wake-up for each would cost more than the work.
 */
typedef void (*task_fn)(void *arg, uint32_t task, uint32_t worker);

struct pool;

/* What a worker thread starts with: its pool and its index (1..; the caller is 0). */
struct pool_worker {
	struct pool *p;
	uint32_t id;
};

struct pool {
	uint32_t n;          /* threads, the caller's included */
	uint32_t started;    /* workers running */
	pthread_t *tids;     /* [n - 1] */
	struct pool_worker *workers; /* [n - 1] */
	pthread_mutex_t mu;
	pthread_cond_t wake, idle;
	uint64_t gen;        /* bumped (under mu) for each job and at stop */
	bool stop;
	task_fn fn;
	void *arg;
	uint64_t claim;      /* tasks << 32 | next task */
	uint32_t done;       /* tasks of the current job finished */
};

/* Spins before sleeping: about 0.1-0.5 ms, longer than the gaps inside a decode step. */
#define POOL_SPINS (1u << 14)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#endif
}

/* Claims and runs tasks of the current job until none is left. */
static void pool_work(struct pool *p, uint32_t worker) {
	uint64_t c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);

	for (;;) {
		uint32_t tasks = (uint32_t)(c >> 32), t = (uint32_t)c;

		if (t >= tasks)
			return;
		if (!__atomic_compare_exchange_n(&p->claim, &c, c + 1, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			continue;
		/* The task is ours and unfinished, so the caller has not moved on: fn and arg
		 * are this job's. */
		p->fn(p->arg, t, worker);
		if (__atomic_add_fetch(&p->done, 1, __ATOMIC_ACQ_REL) == tasks) {
			/* Under the lock, so that a caller between its check and its wait hears it. */
			pthread_mutex_lock(&p->mu);
			pthread_cond_signal(&p->idle);
			pthread_mutex_unlock(&p->mu);
		}
		c = __atomic_load_n(&p->claim, __ATOMIC_ACQUIRE);
	}
}

static void *pool_main(void *userdata) {
	const struct pool_worker *w = userdata;
	struct pool *p = w->p;
	uint64_t seen = 0, g = 0;

	for (;;) {
		for (uint32_t i = 0; i < POOL_SPINS; i++) {
			g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
			if (g != seen)
				break;
			cpu_relax();
		}
		if (g == seen) {
			pthread_mutex_lock(&p->mu);
			while ((g = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE)) == seen)
				pthread_cond_wait(&p->wake, &p->mu);
			pthread_mutex_unlock(&p->mu);
		}
		seen = g;
		if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
			return NULL;
		pool_work(p, w->id);
	}
}

static void pool_run(struct pool *p, task_fn fn, void *arg, uint32_t tasks) {
	if (p->n == 1 || tasks <= 1) {
		for (uint32_t t = 0; t < tasks; t++)
			fn(arg, t, 0);
		return;
	}
	/* Every task of the last job is done, so no worker reads these now. */
	p->fn = fn;
	p->arg = arg;
	__atomic_store_n(&p->done, 0, __ATOMIC_RELAXED);
	__atomic_store_n(&p->claim, (uint64_t)tasks << 32, __ATOMIC_RELEASE);
	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&p->wake);
	pthread_mutex_unlock(&p->mu);
	pool_work(p, 0);
	for (uint32_t i = 0; i < POOL_SPINS; i++) {
		if (__atomic_load_n(&p->done, __ATOMIC_ACQUIRE) == tasks)
			return;
		cpu_relax();
	}
	pthread_mutex_lock(&p->mu);
	while (__atomic_load_n(&p->done, __ATOMIC_ACQUIRE) != tasks)
		pthread_cond_wait(&p->idle, &p->mu);
	pthread_mutex_unlock(&p->mu);
}

static void pool_free(struct pool *p) {
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	__atomic_store_n(&p->stop, true, __ATOMIC_RELEASE);
	__atomic_store_n(&p->gen, p->gen + 1, __ATOMIC_RELEASE);
	pthread_cond_broadcast(&p->wake);
	pthread_mutex_unlock(&p->mu);
	for (uint32_t i = 0; i < p->started; i++)
		pthread_join(p->tids[i], NULL);
	pthread_cond_destroy(&p->wake);
	pthread_cond_destroy(&p->idle);
	pthread_mutex_destroy(&p->mu);
	free(p->tids);
	free(p->workers);
	free(p);
}

static int pool_new(uint32_t n, struct pool **ret) {
	struct pool *p = calloc(1, sizeof(*p));
	int r;

	if (!p)
		return -ENOMEM;
	p->n = n;
	pthread_mutex_init(&p->mu, NULL);
	pthread_cond_init(&p->wake, NULL);
	pthread_cond_init(&p->idle, NULL);
	p->tids = calloc(MAX(n - 1, 1u), sizeof(pthread_t));
	p->workers = calloc(MAX(n - 1, 1u), sizeof(struct pool_worker));
	if (!p->tids || !p->workers) {
		pool_free(p);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i + 1 < n; i++) {
		p->workers[i] = (struct pool_worker){ .p = p, .id = i + 1 };
		r = -pthread_create(&p->tids[i], NULL, pool_main, &p->workers[i]);
		if (r < 0) {
			pool_free(p);
			return r;
		}
		p->started++;
	}
	*ret = p;
	return 0;
}

/* ---- the session ---- */

/* The sgemm's blocking: a KB x NB panel of transposed weights (64 KiB) per thread, reused
 * by up to MB rows of activations. */
#define GEMM_KB 256u
#define GEMM_NB 64u
#define GEMM_MB 64u
/* Fewer rows than this go through dot products along the weight rows (a gemv). */
#define GEMM_MIN_ROWS 4u
/* Attention: query rows (token x head of a GQA group) per tile, keys per inner block, and
 * the fewest key blocks one split of a long context gets. */
#define ATTN_ROWS 64u
#define ATTN_KEYS 64u
#define ATTN_SPLIT_MIN_BLOCKS 4u

struct scratch {
	float *pack; /* [GEMM_KB][GEMM_NB] */
	float *q;    /* [rows][head_dim]: a tile's queries */
	float *s;    /* [rows][ATTN_KEYS]: scores, then probabilities */
	float *kt;   /* [head_dim][ATTN_KEYS]: keys, transposed */
	float *o;    /* [rows][head_dim]: unnormalised outputs */
	float *m, *l; /* [rows]: running max and sum */
	uint32_t *vis; /* [rows]: keys each row may see */
	float *ml, *mv; /* [rows], [rows][head_dim]: the moments or latent entry of each row */
	float *bias;    /* [rows]: each row's latent logit bias */
};

struct kvdlm_session {
	const struct kvdlm_model *m;
	struct kvdlm_cache *cache;
	const struct kvd_simd_ops *simd;
	struct pool *pool;
	uint32_t threads, chunk;
	uint32_t qd, kd, qkv_ld, attn_rows;
	float *inv_freq;         /* [head_dim / 2] */
	float *cos, *sin;        /* [chunk][head_dim / 2] */
	float *h, *a;            /* [chunk][dim] */
	float *qkv;              /* [chunk][qkv_ld]: q, k, v of each token */
	float *o;                /* [chunk][qd] */
	const struct kvdlm_indexmem *im; /* IndexMem weights, or NULL */
	float *iq, *ik;          /* [chunk][index_heads * index_dim], [chunk][index_dim] */
	float *gu;               /* [chunk][2 * ffn]: gate, then up; the product lands in gate */
	float *parts;            /* attention partials of split contexts */
	size_t parts_floats;
	struct scratch *scratch; /* [threads] */
	float *arena;
	const struct kvdlm_kv_view **views; /* [kv_heads] of the layer being computed */
};

const char *kvdlm_simd_name(void) {
	return kvd_simd()->name;
}

uint32_t kvdlm_argmax(const float *x, uint32_t n) {
	uint32_t best = 0;

	for (uint32_t i = 1; i < n; i++)
		if (x[i] > x[best])
			best = i;
	return best;
}

struct kvdlm_session *kvdlm_session_free(struct kvdlm_session *s) {
	if (!s)
		return NULL;
	pool_free(s->pool);
	free(s->arena);
	free(s->parts);
	free(s->scratch);
	free(s->views);
	free(s->inv_freq);
	free(s->iq);
	free(s->ik);
	free(s);
	return NULL;
}

static uint32_t online_cpus(void) {
	long n = sysconf(_SC_NPROCESSORS_ONLN);

	return n < 1 ? 1 : (uint32_t)MIN(n, (long)KVDLM_THREADS_MAX);
}

/* Carves n floats, 64-byte aligned, out of *p. */
static float *carve(float **p, size_t n) {
	float *r = *p;

	*p += ALIGN_TO(n, 16);
	return r;
}

int kvdlm_session_new(const struct kvdlm_model *m, struct kvdlm_cache *cache,
                      const struct kvdlm_session_opts *opts, struct kvdlm_session **ret) {
	_cleanup_(kvdlm_session_freep) struct kvdlm_session *s = NULL;
	const struct kvdlm_config *c;
	size_t per_thread, total, hd2;
	uint32_t g;
	float *p;
	int r;

	if (!m || !cache || !ret)
		return -EINVAL;
	if (opts && (opts->threads > KVDLM_THREADS_MAX || opts->chunk > KVDLM_CHUNK_MAX))
		return -EINVAL;
	c = &m->cfg;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	s->m = m;
	s->cache = cache;
	s->simd = kvd_simd();
	s->threads = opts && opts->threads ? opts->threads : online_cpus();
	s->chunk = opts && opts->chunk ? opts->chunk : KVDLM_CHUNK_DEFAULT;
	s->im = opts ? opts->indexmem : NULL;
	if (s->im && s->im->layers != c->layers)
		return -EINVAL;
	if (s->im) {
		s->iq = malloc((size_t)s->chunk * s->im->index_heads * s->im->index_dim * sizeof(float));
		s->ik = malloc((size_t)s->chunk * s->im->index_dim * sizeof(float));
		if (!s->iq || !s->ik)
			return -ENOMEM;
	}
	s->qd = c->q_heads * c->head_dim;
	s->kd = c->kv_heads * c->head_dim;
	s->qkv_ld = s->qd + 2 * s->kd;
	g = c->q_heads / c->kv_heads;
	/* Whole tokens per tile: all heads of a group, as many tokens as fit in ATTN_ROWS. */
	s->attn_rows = MAX(ATTN_ROWS / g, 1u) * g;
	hd2 = c->head_dim / 2;

	s->inv_freq = malloc(hd2 * sizeof(float));
	s->views = calloc(c->kv_heads, sizeof(*s->views));
	s->scratch = calloc(s->threads, sizeof(*s->scratch));
	if (!s->inv_freq || !s->views || !s->scratch)
		return -ENOMEM;
	/* As kvdlm.py: in double from the file's fp32 theta, rounded once to fp32. */
	for (size_t i = 0; i < hd2; i++)
		s->inv_freq[i] = (float)pow((double)c->rope_theta, -2.0 * (double)i / (double)c->head_dim);

	per_thread = ALIGN_TO((size_t)GEMM_KB * GEMM_NB, 16) +
	             2 * ALIGN_TO((size_t)s->attn_rows * c->head_dim, 16) +
	             ALIGN_TO((size_t)s->attn_rows * ATTN_KEYS, 16) +
	             ALIGN_TO((size_t)c->head_dim * ATTN_KEYS, 16) + 4 * ALIGN_TO(s->attn_rows, 16) +
	             ALIGN_TO((size_t)s->attn_rows * c->head_dim, 16) + ALIGN_TO(s->attn_rows, 16);
	total = 2 * ALIGN_TO(s->chunk * hd2, 16) + 2 * ALIGN_TO((size_t)s->chunk * c->dim, 16) +
	        ALIGN_TO((size_t)s->chunk * s->qkv_ld, 16) + ALIGN_TO((size_t)s->chunk * s->qd, 16) +
	        ALIGN_TO((size_t)s->chunk * 2 * c->ffn, 16) + s->threads * per_thread;
	if (posix_memalign((void **)&s->arena, 64, total * sizeof(float)) != 0)
		return -ENOMEM;
	p = s->arena;
	s->cos = carve(&p, s->chunk * hd2);
	s->sin = carve(&p, s->chunk * hd2);
	s->h = carve(&p, (size_t)s->chunk * c->dim);
	s->a = carve(&p, (size_t)s->chunk * c->dim);
	s->qkv = carve(&p, (size_t)s->chunk * s->qkv_ld);
	s->o = carve(&p, (size_t)s->chunk * s->qd);
	s->gu = carve(&p, (size_t)s->chunk * 2 * c->ffn);
	for (uint32_t t = 0; t < s->threads; t++) {
		struct scratch *w = &s->scratch[t];

		w->pack = carve(&p, (size_t)GEMM_KB * GEMM_NB);
		w->q = carve(&p, (size_t)s->attn_rows * c->head_dim);
		w->o = carve(&p, (size_t)s->attn_rows * c->head_dim);
		w->s = carve(&p, (size_t)s->attn_rows * ATTN_KEYS);
		w->kt = carve(&p, (size_t)c->head_dim * ATTN_KEYS);
		w->m = carve(&p, s->attn_rows);
		w->l = carve(&p, s->attn_rows);
		w->vis = (uint32_t *)carve(&p, s->attn_rows);
		w->ml = carve(&p, s->attn_rows);
		w->mv = carve(&p, (size_t)s->attn_rows * c->head_dim);
		w->bias = carve(&p, s->attn_rows);
	}
	r = pool_new(s->threads, &s->pool);
	if (r < 0)
		return r;
	*ret = TAKE_PTR(s);
	return 0;
}

int kvdlm_session_reset(struct kvdlm_session *s, struct kvdlm_cache *cache) {
	if (!s || !cache)
		return -EINVAL;
	s->cache = cache;
	return 0;
}

uint32_t kvdlm_session_position(const struct kvdlm_session *s) {
	return s ? kvdlm_cache_position(s->cache) : 0;
}

uint32_t kvdlm_session_threads(const struct kvdlm_session *s) {
	return s ? s->threads : 0;
}

/* ---- linear layers: y = x W^T (or y += x W^T) ---- */

/* Up to three weight matrices W [n][k] whose outputs sit side by side in the rows of y. */
struct lin_seg {
	const float *w;
	uint32_t n;
	float *y; /* the segment's first column */
};

struct lin_job {
	struct kvdlm_session *s;
	const float *x;
	size_t ldx, ldy;
	uint32_t m, k;
	bool accumulate, gemm;
	uint32_t cols, rblocks; /* columns per task; blocks of rows */
	uint32_t n_seg;
	struct lin_seg seg[3];
	uint32_t first[4];       /* the first task of each segment */
};

static void lin_task(void *arg, uint32_t task, uint32_t worker) {
	const struct lin_job *j = arg;
	const struct kvd_simd_ops *simd = j->s->simd;
	const struct lin_seg *sg;
	uint32_t si = 0, local, c0, c1, r0, r1;

	while (task >= j->first[si + 1])
		si++;
	sg = &j->seg[si];
	local = task - j->first[si];
	c0 = local / j->rblocks * j->cols;
	c1 = MIN(c0 + j->cols, sg->n);
	r0 = local % j->rblocks * GEMM_MB;
	r1 = MIN(r0 + GEMM_MB, j->m);

	if (!j->gemm) {
		for (uint32_t o = c0; o < c1; o++)
			for (uint32_t i = 0; i < j->m; i++) {
				float v = simd->dot(j->k, j->x + i * j->ldx, sg->w + (size_t)o * j->k);
				float *y = sg->y + i * j->ldy + o;

				*y = j->accumulate ? *y + v : v;
			}
		return;
	}
	for (uint32_t kb = 0; kb < j->k; kb += GEMM_KB) {
		uint32_t kn = MIN(GEMM_KB, j->k - kb);
		float *pack = j->s->scratch[worker].pack;

		/* pack[kk][c] = W[c0 + c][kb + kk]: the panel of W^T this task multiplies by. */
		simd->to_f32_t(sg->w + (size_t)c0 * j->k + kb, KVD_DTYPE_F32, j->k, c1 - c0, kn, 1.0f,
		               pack, GEMM_NB);
		simd->gemm(r1 - r0, c1 - c0, kn, j->x + r0 * j->ldx + kb, j->ldx, pack, GEMM_NB,
		           sg->y + r0 * j->ldy + c0, j->ldy, j->accumulate || kb > 0);
	}
}

/* Runs y (+)= x W^T for the segments over the pool. */
static void linear(struct kvdlm_session *s, const float *x, size_t ldx, uint32_t m, uint32_t k,
                   size_t ldy, bool accumulate, const struct lin_seg *seg, uint32_t n_seg) {
	struct lin_job j = {
		.s = s, .x = x, .ldx = ldx, .ldy = ldy, .m = m, .k = k,
		.accumulate = accumulate, .gemm = m >= GEMM_MIN_ROWS, .n_seg = n_seg,
	};
	uint32_t total = 0;

	for (uint32_t i = 0; i < n_seg; i++) {
		j.seg[i] = seg[i];
		total += seg[i].n;
	}
	if (j.gemm) {
		j.cols = GEMM_NB;
		j.rblocks = DIV_ROUND_UP(m, GEMM_MB);
	} else {
		/* A gemv is memory-bound: one even share of the rows per thread, in whole cache
		 * lines of the outputs. */
		j.cols = (uint32_t)ALIGN_TO(DIV_ROUND_UP(total, s->threads), 16u);
		j.rblocks = 1;
	}
	for (uint32_t i = 0; i < n_seg; i++)
		j.first[i + 1] = j.first[i] + DIV_ROUND_UP(seg[i].n, j.cols) * j.rblocks;
	pool_run(s->pool, lin_task, &j, j.first[n_seg]);
}

/* ---- attention ---- */

struct attn_job {
	struct kvdlm_session *s;
	uint32_t layer, T, pos0;
	uint32_t group, tokens_per_tile, tiles, splits;
	float scale;
	float *parts; /* [tasks][rows][2 + head_dim]: m, l, o of each split */
};

/* Keys of a view that the query at position pos may see: positions ascend. */
static uint32_t visible(const struct kvdlm_kv_view *v, uint32_t pos) {
	uint32_t lo = 0, hi = v->n;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (v->pos[mid] <= pos)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* The task's (kv head, tile, split); the tiles of the latest tokens, which see the most
 * keys, are handed out first. */
static void attn_coords(const struct attn_job *j, uint32_t task, uint32_t *kvh, uint32_t *tile, uint32_t *split) {
	uint32_t kv_heads = j->s->m->cfg.kv_heads, rest = task / j->splits;

	*split = task % j->splits;
	*kvh = rest % kv_heads;
	*tile = j->tiles - 1 - rest / kv_heads;
}

static void attn_task(void *arg, uint32_t task, uint32_t worker) {
	const struct attn_job *j = arg;
	struct kvdlm_session *s = j->s;
	const struct kvd_simd_ops *simd = s->simd;
	struct scratch *w = &s->scratch[worker];
	uint32_t hd = s->m->cfg.head_dim, g = j->group, kvh, tile, split;
	uint32_t t0, t1, rows, hi, blocks, per, b0, b1;
	const struct kvdlm_kv_view *v;

	attn_coords(j, task, &kvh, &tile, &split);
	v = s->views[kvh];
	t0 = tile * j->tokens_per_tile;
	t1 = MIN(t0 + j->tokens_per_tile, j->T);
	rows = (t1 - t0) * g;
	for (uint32_t r = 0; r < rows; r++) {
		uint32_t t = t0 + r / g, h = kvh * g + r % g;

		memcpy(w->q + r * hd, s->qkv + (size_t)t * s->qkv_ld + h * hd, hd * sizeof(float));
		w->vis[r] = visible(v, j->pos0 + t);
		w->m[r] = -INFINITY;
		w->l[r] = 0;
	}
	memset(w->o, 0, (size_t)rows * hd * sizeof(float));
	/* This split's blocks of keys, out of those the tile's last token sees. */
	hi = w->vis[rows - 1];
	blocks = DIV_ROUND_UP(hi, ATTN_KEYS);
	per = DIV_ROUND_UP(blocks, j->splits);
	b0 = MIN(split * per, blocks);
	b1 = MIN(b0 + per, blocks);

	for (uint32_t b = b0; b < b1; b++) {
		uint32_t kc = b * ATTN_KEYS, nk = MIN(ATTN_KEYS, hi - kc);

		/* Kt[d][i] = K row kc + i, gathered across cache blocks. */
		for (uint32_t i = 0; i < nk;) {
			uint32_t jj = kc + i, blk = jj / v->block_tokens, row = jj % v->block_tokens;
			uint32_t seg = MIN(v->block_tokens - row, nk - i);

			simd->to_f32_t(v->k[blk] + (size_t)row * hd, KVD_DTYPE_F32, hd, seg, hd, 1.0f,
			               w->kt + i, ATTN_KEYS);
			i += seg;
		}
		simd->gemm(rows, nk, hd, w->q, hd, w->kt, ATTN_KEYS, w->s, ATTN_KEYS, 0);
		/* Online softmax: each row's visible keys are a prefix of the block. */
		for (uint32_t r = 0; r < rows; r++) {
			float *row = w->s + r * ATTN_KEYS, mx, nm, alpha, sum;
			uint32_t valid = w->vis[r] > kc ? MIN(w->vis[r] - kc, nk) : 0;

			if (valid == 0) {
				memset(row, 0, nk * sizeof(float));
				continue;
			}
			simd->scale(row, valid, j->scale);
			mx = simd->max(row, valid);
			nm = MAX(w->m[r], mx);
			alpha = w->m[r] == -INFINITY ? 0.0f : expf(w->m[r] - nm);
			sum = simd->exp_sum(row, valid, nm);
			memset(row + valid, 0, (nk - valid) * sizeof(float));
			if (alpha != 1.0f)
				simd->scale(w->o + r * hd, hd, alpha);
			w->l[r] = w->l[r] * alpha + sum;
			w->m[r] = nm;
		}
		/* O += P V, one contiguous run of V rows at a time. */
		for (uint32_t i = 0; i < nk;) {
			uint32_t jj = kc + i, blk = jj / v->block_tokens, row = jj % v->block_tokens;
			uint32_t seg = MIN(v->block_tokens - row, nk - i);

			simd->gemm(rows, hd, seg, w->s + i, ATTN_KEYS, v->v[blk] + (size_t)row * hd, hd, w->o, hd, 1);
			i += seg;
		}
	}

	/* The summary of the evicted tokens, one more entry of every row's softmax: they all
	 * precede the step's queries. Split 0 carries it, so that the merge counts it once. The
	 * view was checked when the step began, so the call cannot fail. */
	if (v->moments && split == 0) {
		(void)kvd_moments_entries(v->moments, v->form, j->scale, w->q, hd, rows, w->ml, w->mv);
		for (uint32_t r = 0; r < rows; r++)
			kvd_moments_softmax_add(&w->m[r], &w->l[r], w->o + r * hd, hd, w->ml[r],
			                        w->mv + (size_t)r * hd);
	}
	/* IndexMem's latent memory, the same way, through the layer's learned readout (the
	 * step checked that the weights are there). */
	if (v->latent && split == 0) {
		for (uint32_t r = 0; r < rows; r++)
			w->bias[r] = s->im->bias[j->layer][kvh * g + r % g];
		if (kvd_latent_entries(v->latent, &s->im->readout[j->layer], w->q, hd, rows, w->bias,
		                       w->ml, w->mv) == 0)
			for (uint32_t r = 0; r < rows; r++)
				kvd_moments_softmax_add(&w->m[r], &w->l[r], w->o + r * hd, hd, w->ml[r],
				                        w->mv + (size_t)r * hd);
	}

	if (j->splits == 1) {
		for (uint32_t r = 0; r < rows; r++) {
			uint32_t t = t0 + r / g, h = kvh * g + r % g;
			float *out = s->o + (size_t)t * s->qd + h * hd;

			/* A row that sees nothing (impossible while position 0 is a sink) gives 0. */
			if (w->l[r] > 0) {
				for (uint32_t d = 0; d < hd; d++)
					out[d] = w->o[r * hd + d] / w->l[r];
			} else {
				memset(out, 0, hd * sizeof(float));
			}
		}
		return;
	}
	float *part = j->parts + (size_t)task * s->attn_rows * (2 + hd);

	for (uint32_t r = 0; r < rows; r++) {
		part[r * (2 + hd)] = w->m[r];
		part[r * (2 + hd) + 1] = w->l[r];
		memcpy(part + r * (2 + hd) + 2, w->o + r * hd, hd * sizeof(float));
	}
}

/* Folds the splits of (kv head, tile) `task` into the output. */
static void attn_merge(void *arg, uint32_t task, uint32_t worker) {
	const struct attn_job *j = arg;
	struct kvdlm_session *s = j->s;
	uint32_t hd = s->m->cfg.head_dim, g = j->group, kv_heads = s->m->cfg.kv_heads;
	uint32_t kvh = task % kv_heads, tile = j->tiles - 1 - task / kv_heads;
	uint32_t t0 = tile * j->tokens_per_tile, t1 = MIN(t0 + j->tokens_per_tile, j->T);
	size_t stride = (size_t)s->attn_rows * (2 + hd);
	const float *base = j->parts + (size_t)task * j->splits * stride;

	for (uint32_t r = 0; r < (t1 - t0) * g; r++) {
		uint32_t t = t0 + r / g, h = kvh * g + r % g;
		float *out = s->o + (size_t)t * s->qd + h * hd, mx = -INFINITY, l = 0;

		for (uint32_t sp = 0; sp < j->splits; sp++)
			mx = MAX(mx, base[sp * stride + r * (2 + hd)]);
		memset(out, 0, hd * sizeof(float));
		if (mx == -INFINITY)
			continue;
		for (uint32_t sp = 0; sp < j->splits; sp++) {
			const float *p = base + sp * stride + r * (2 + hd);
			float f;

			if (p[0] == -INFINITY)
				continue;
			f = expf(p[0] - mx);
			l += p[1] * f;
			s->simd->axpy(hd, f, p + 2, out);
		}
		if (l > 0)
			s->simd->scale(out, hd, 1.0f / l);
	}
}

/* The step's attention over s->views, into s->o. */
static int attention(struct kvdlm_session *s, uint32_t layer, uint32_t T, uint32_t pos0) {
	const struct kvdlm_config *c = &s->m->cfg;
	struct attn_job j = {
		.s = s,
		.layer = layer,
		.T = T,
		.pos0 = pos0,
		.group = c->q_heads / c->kv_heads,
		.splits = 1,
		.scale = 1.0f / sqrtf((float)c->head_dim),
	};
	uint32_t base, most = 0;

	for (uint32_t h = 0; h < c->kv_heads; h++)
		most = MAX(most, s->views[h]->n);
	j.tokens_per_tile = s->attn_rows / j.group;
	j.tiles = DIV_ROUND_UP(T, j.tokens_per_tile);
	base = c->kv_heads * j.tiles;
	if (base < s->threads) {
		/* Few queries over a long context (decoding): split the keys too, so that every
		 * thread has work, each split at least ATTN_SPLIT_MIN_BLOCKS blocks long. */
		uint32_t by_threads = DIV_ROUND_UP(2 * s->threads, base);
		uint32_t by_keys = DIV_ROUND_UP(most, ATTN_KEYS) / ATTN_SPLIT_MIN_BLOCKS;

		j.splits = MAX(MIN(by_threads, by_keys), 1u);
	}
	if (j.splits > 1) {
		size_t need = (size_t)base * j.splits * s->attn_rows * (2 + c->head_dim);

		if (need > s->parts_floats) {
			float *p = realloc(s->parts, need * sizeof(float));

			if (!p)
				return -ENOMEM;
			s->parts = p;
			s->parts_floats = need;
		}
		j.parts = s->parts;
	}
	pool_run(s->pool, attn_task, &j, base * j.splits);
	if (j.splits > 1)
		pool_run(s->pool, attn_merge, &j, base);
	return 0;
}

/* ---- the rest of a layer ---- */

static void rmsnorm(const float *x, const float *w, uint32_t dim, float eps, float *y) {
	double ss = 0;
	float r;

	for (uint32_t i = 0; i < dim; i++)
		ss += (double)x[i] * x[i];
	r = 1.0f / sqrtf((float)(ss / dim) + eps);
	for (uint32_t i = 0; i < dim; i++)
		y[i] = x[i] * r * w[i];
}

static void rmsnorm_rows(struct kvdlm_session *s, const float *x, const float *w, uint32_t rows, float *y) {
	const struct kvdlm_config *c = &s->m->cfg;

	for (uint32_t t = 0; t < rows; t++)
		rmsnorm(x + (size_t)t * c->dim, w, c->dim, c->norm_eps, y + (size_t)t * c->dim);
}

/* cos and sin of (float)pos * inv_freq[i] in fp32, for the chunk's positions. */
static void rope_tables(struct kvdlm_session *s, uint32_t T, uint32_t pos0) {
	uint32_t hd2 = s->m->cfg.head_dim / 2;

	for (uint32_t t = 0; t < T; t++)
		for (uint32_t i = 0; i < hd2; i++) {
			float ang = (float)(pos0 + t) * s->inv_freq[i];

			s->cos[t * hd2 + i] = cosf(ang);
			s->sin[t * hd2 + i] = sinf(ang);
		}
}

/* Rotates the pairs (i, i + head_dim/2) of the q and k heads of every token. */
static void rope_apply(struct kvdlm_session *s, uint32_t T) {
	const struct kvdlm_config *c = &s->m->cfg;
	uint32_t hd2 = c->head_dim / 2;

	for (uint32_t t = 0; t < T; t++) {
		const float *cs = s->cos + t * hd2, *sn = s->sin + t * hd2;

		for (uint32_t h = 0; h < c->q_heads + c->kv_heads; h++) {
			float *x = s->qkv + (size_t)t * s->qkv_ld + h * c->head_dim;

			for (uint32_t i = 0; i < hd2; i++) {
				float x1 = x[i], x2 = x[i + hd2];

				x[i] = x1 * cs[i] - x2 * sn[i];
				x[i + hd2] = x2 * cs[i] + x1 * sn[i];
			}
		}
	}
}

/*
 * Fetches the layer's views and writes the step's K and V rows into their slots, found by
 * position. Returns 0 or -EINVAL.
 */
static int kv_store(struct kvdlm_session *s, uint32_t layer, uint32_t pos0) {
	const struct kvdlm_config *c = &s->m->cfg;
	size_t bytes = c->head_dim * sizeof(float);

	for (uint32_t h = 0; h < c->kv_heads; h++) {
		const struct kvdlm_kv_view *v = kvdlm_cache_view(s->cache, layer, h);

		if (!v || (v->latent && !s->im))
			return -EINVAL;
		s->views[h] = v;

		for (uint32_t jj = v->first_new; jj < v->n; jj++) {
			const float *src = s->qkv + (size_t)(v->pos[jj] - pos0) * s->qkv_ld + s->qd + h * c->head_dim;
			size_t row = (size_t)(jj % v->block_tokens) * c->head_dim;

			memcpy(v->k[jj / v->block_tokens] + row, src, bytes);
			memcpy(v->v[jj / v->block_tokens] + row, src + s->kd, bytes);
			if (v->ik)
				memcpy(v->ik[jj / v->block_tokens] + (size_t)(jj % v->block_tokens) * s->im->index_dim,
				       s->ik + (size_t)(v->pos[jj] - pos0) * s->im->index_dim,
				       s->im->index_dim * sizeof(float));
		}
	}
	return 0;
}

/*
 * When the layer's tables have index keys: the step's index queries and keys from the
 * attention input s->a, into s->iq and s->ik. Returns 1 when computed, 0 when the cache has
 * no indexer, -EINVAL when it has one the session's weights do not fit.
 */
static int index_project(struct kvdlm_session *s, uint32_t layer, uint32_t T) {
	const struct kvdlm_kv_view *v = kvdlm_cache_view(s->cache, layer, 0);
	const struct kvdlm_config *c = &s->m->cfg;

	if (!v || !v->ik)
		return 0;
	if (!s->im || kvdlm_cache_index_dim(s->cache) != s->im->index_dim ||
	    kvdlm_cache_index_heads(s->cache) != s->im->index_heads)
		return -EINVAL;
	return kvd_indexer_project(&s->im->indexer[layer], s->a, c->dim, T, s->iq, s->ik) < 0 ? -ENOMEM : 1;
}

struct swiglu_job {
	struct kvdlm_session *s;
	uint32_t T, per;
};

/* gate[i] = silu(gate[i]) * up[i] for the task's rows. */
static void swiglu_task(void *arg, uint32_t task, uint32_t worker) {
	const struct swiglu_job *j = arg;
	uint32_t ffn = j->s->m->cfg.ffn, t1 = MIN((task + 1) * j->per, j->T);

	for (uint32_t t = task * j->per; t < t1; t++) {
		float *gate = j->s->gu + (size_t)t * 2 * ffn, *up = gate + ffn;

		for (uint32_t i = 0; i < ffn; i++)
			gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
	}
}

static int layer_forward(struct kvdlm_session *s, uint32_t l, uint32_t T, uint32_t pos0) {
	const struct kvdlm_config *c = &s->m->cfg;
	const struct kvdlm_layer *L = &s->m->layers[l];
	struct swiglu_job sj = { .s = s, .T = T, .per = DIV_ROUND_UP(T, MIN(T, s->threads)) };
	int r, indexed;

	rmsnorm_rows(s, s->h, L->attn_norm, T, s->a);
	linear(s, s->a, c->dim, T, c->dim, s->qkv_ld, false,
	       (const struct lin_seg[]){ { L->wq, s->qd, s->qkv },
	                                 { L->wk, s->kd, s->qkv + s->qd },
	                                 { L->wv, s->kd, s->qkv + s->qd + s->kd } },
	       3);
	rope_apply(s, T);
	/* The indexer reads the attention input too; its keys are stored with K and V. */
	indexed = index_project(s, l, T);
	if (indexed < 0)
		return indexed;
	/* K and V go into the cache before attention: a token sees itself. */
	r = kv_store(s, l, pos0);
	if (r < 0)
		return r;
	r = attention(s, l, T, pos0);
	if (r < 0)
		return r;
	r = kvdlm_cache_observe(s->cache, l, s->qkv, s->qkv_ld, T, indexed ? s->iq : NULL);
	if (r < 0)
		return r;
	linear(s, s->o, s->qd, T, s->qd, c->dim, true, &(struct lin_seg){ L->wo, c->dim, s->h }, 1);

	rmsnorm_rows(s, s->h, L->ffn_norm, T, s->a);
	linear(s, s->a, c->dim, T, c->dim, 2 * (size_t)c->ffn, false,
	       (const struct lin_seg[]){ { L->w_gate, c->ffn, s->gu }, { L->w_up, c->ffn, s->gu + c->ffn } },
	       2);
	pool_run(s->pool, swiglu_task, &sj, DIV_ROUND_UP(T, sj.per));
	linear(s, s->gu, 2 * (size_t)c->ffn, T, c->ffn, c->dim, true,
	       &(struct lin_seg){ L->w_down, c->dim, s->h }, 1);
	return 0;
}

/*
 * One forward step over T <= chunk tokens. Logits: none (logits NULL), of the last token
 * (all false) or of every token ([T][vocab]).
 */
static int forward_step(struct kvdlm_session *s, const uint32_t *tokens, uint32_t T, float *logits, bool all) {
	const struct kvdlm_config *c = &s->m->cfg;
	uint32_t pos0, first;
	int r, k;

	r = kvdlm_cache_begin(s->cache, T, &pos0);
	if (r < 0)
		return r;
	rope_tables(s, T, pos0);
	for (uint32_t t = 0; t < T; t++)
		memcpy(s->h + (size_t)t * c->dim, s->m->tok_emb + (size_t)tokens[t] * c->dim, c->dim * sizeof(float));
	for (uint32_t l = 0; l < c->layers && r >= 0; l++)
		r = layer_forward(s, l, T, pos0);
	/* The step ends (kvd: unpins) whatever happened, and before the logits, which do not
	 * read the cache. */
	k = kvdlm_cache_end(s->cache);
	if (r < 0)
		return r;
	if (k < 0)
		return k;
	if (!logits)
		return 0;
	first = all ? 0 : T - 1;
	rmsnorm_rows(s, s->h + (size_t)first * c->dim, s->m->final_norm, T - first, s->a);
	linear(s, s->a, c->dim, T - first, c->dim, c->vocab, false,
	       &(struct lin_seg){ s->m->lm_head, c->vocab, logits }, 1);
	return 0;
}

int kvdlm_prefill(struct kvdlm_session *s, const uint32_t *tokens, uint32_t n, enum kvdlm_logits which,
                  float *logits) {
	uint32_t vocab;

	if (!s || !tokens || n == 0 || which < 0 || which >= _KVDLM_LOGITS_MAX ||
	    (which != KVDLM_LOGITS_NONE && !logits))
		return -EINVAL;
	vocab = s->m->cfg.vocab;
	for (uint32_t i = 0; i < n; i++)
		if (tokens[i] >= vocab)
			return -EINVAL;
	for (uint32_t i = 0; i < n; i += s->chunk) {
		uint32_t T = MIN(s->chunk, n - i);
		float *out = NULL;
		int r;

		if (which == KVDLM_LOGITS_ALL)
			out = logits + (size_t)i * vocab;
		else if (which == KVDLM_LOGITS_LAST && i + T == n)
			out = logits;
		r = forward_step(s, tokens + i, T, out, which == KVDLM_LOGITS_ALL);
		if (r < 0)
			return r;
	}
	return 0;
}

int kvdlm_decode(struct kvdlm_session *s, uint32_t token, float *logits) {
	if (!s || token >= s->m->cfg.vocab)
		return -EINVAL;
	return forward_step(s, &token, 1, logits, false);
}
