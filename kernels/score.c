/* SPDX-License-Identifier: MIT */
/*
 * The per-layer scoring pipeline (see score.h). One implementation of the steps, run
 * either with the reference kernels on the caller's thread or with the optimised kernels
 * on a few pthreads that take work items from a shared counter. An item is a kv head with
 * the g query heads that read it, so that the optimised attention and ReST-KV kernels read
 * and convert its keys and values once for all g (GQA). Each item writes only its own rows,
 * and the GQA sums run afterwards in head order, so the result does not depend on the
 * number of threads or on scheduling.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "laprox.h"
#include "score.h"

/* The kernels of one path. Work items are kv heads: attn and restkv take the g query heads
 * of one at once; the per-head kernels run on each in turn. */
struct kset {
	int (*attn)(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, float *probs,
		    float *scratch);
	int (*restkv)(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, const float *probs,
		      const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		      float *cost);
	int (*laprox)(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		      const float *gram, const float *vgv, float *cost);
	int (*laprox_group)(const struct kvd_attn_in *in, uint32_t kv, const float *const *probs,
			    const float *gram_group, float *cost);
	int (*aws)(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		   uint32_t k_min, double scale, struct kvd_aws *ret);
	int (*pool)(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift, const float *in,
		    uint32_t n, float *out);
};

/* The reference kernels are per head: these run them on the nh heads one after the other. */
static int attn_ref(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, float *probs,
		    float *scratch) {
	for (uint32_t j = 0; j < nh; j++) {
		int r = kvd_attn_head_ref(in, h0 + j, probs + (size_t)j * in->window * in->len);

		if (r < 0)
			return r;
	}
	return 0;
}

static int restkv_ref(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, const float *probs,
		      const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		      float *cost) {
	size_t n = in->len - in->window, dd = (size_t)in->dim * in->dim;

	for (uint32_t j = 0; j < nh; j++) {
		int r = kvd_restkv_head_ref(in, h0 + j, probs + (size_t)j * in->window * in->len,
					    gram ? gram + j * dd : NULL, vgv ? vgv + j * n : NULL, o,
					    cost + j * n);

		if (r < 0)
			return r;
	}
	return 0;
}

static const struct kset kernels_ref = {
	.attn = attn_ref,
	.restkv = restkv_ref,
	.laprox = kvd_laprox_head_ref,
	.laprox_group = kvd_laprox_group_ref,
	.aws = kvd_aws_params_ref,
	.pool = kvd_pool_row_ref,
};

static const struct kset kernels_opt = {
	.attn = kvd_attn_heads_buf,
	.restkv = kvd_restkv_heads,
	.laprox = kvd_laprox_head,
	.laprox_group = kvd_laprox_group,
	.aws = kvd_aws_params,
	.pool = kvd_pool_row,
};

void kvd_score_params_default(enum kvd_score_kind kind, struct kvd_score_params *p) {
	*p = (struct kvd_score_params){
		.kind = kind,
		.laprox_joint = 1,
		.pooling = KVD_POOL_ADAPTIVE,
		.kernel = KVD_POOL_KERNEL,
		.aws_scale = KVD_AWS_SCALE,
		.layer_weight = 1.0f,
	};
	kvd_restkv_opts_default(&p->restkv);
}

uint32_t kvd_score_rows(const struct kvd_score_params *p, const struct kvd_attn_in *in) {
	return p->per_query_head ? in->heads : in->kv_heads;
}

uint32_t kvd_score_threads(uint32_t threads, uint32_t items) {
	if (threads == 0) {
		long n = sysconf(_SC_NPROCESSORS_ONLN);

		threads = n > 0 ? (uint32_t)n : 1;
	}
	if (threads > items)
		threads = items;
	return threads ? threads : 1;
}

static int params_check(const struct kvd_attn_in *in, const struct kvd_score_params *p) {
	if (kvd_attn_in_check(in) < 0 || !in->v || !p || (int)p->kind < 0 ||
	    p->kind >= _KVD_SCORE_KIND_MAX || (int)p->pooling < 0 || p->pooling >= _KVD_POOL_MAX)
		return -EINVAL;
	if (p->pooling != KVD_POOL_NONE && (p->kernel == 0 || p->kernel % 2 == 0))
		return -EINVAL;
	if (p->pooling == KVD_POOL_ADAPTIVE &&
	    (p->aws_topk == 0 || !(p->aws_scale > 0) || !isfinite(p->aws_scale)))
		return -EINVAL;
	if (!isfinite(p->layer_weight) || p->layer_weight < 0)
		return -EINVAL;
	return 0;
}

struct job {
	const struct kvd_attn_in *in;
	const float *gram, *gram_group;
	const struct kvd_score_params *p;
	const struct kset *k;
	int joint;       /* one cost row per kv head (LaProx joint) rather than per query head */
	uint32_t items;  /* kv heads */
	float *rows;     /* [H][n], or [Hkv][n] when joint */
	atomic_uint next;
	atomic_int error;
};

/* Pools cost[n] into out[n] with (kernel, shift) from A_h when adaptive. */
static int pool(const struct job *j, const float *probs, uint32_t heads_in_probs,
		const float *const *pp, const float *cost, float *out) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_score_params *p = j->p;
	uint32_t n = in->len - in->window;
	struct kvd_aws aws = { .kernel = p->kernel };
	int r;

	if (p->pooling == KVD_POOL_NONE) {
		memcpy(out, cost, n * sizeof(float));
		return 0;
	}
	if (p->pooling == KVD_POOL_ADAPTIVE) {
		double t = 0;

		for (uint32_t a = 0; a < heads_in_probs; a++) {
			r = j->k->aws(pp ? pp[a] : probs, in->window, in->len, in->len, p->aws_topk,
				      p->kernel, p->aws_scale, &aws);
			if (r < 0)
				return r;
			t += aws.t;
		}
		if (heads_in_probs > 1) {
			r = kvd_aws_from_t(t / heads_in_probs, p->kernel, p->aws_scale, &aws);
			if (r < 0)
				return r;
		}
	}
	return j->k->pool(p->pooling, aws.kernel, p->pooling == KVD_POOL_ADAPTIVE ? aws.shift : 0,
			  cost, n, out);
}

/* One kv head: the attention of its g query heads, their costs, and the pooled rows. */
static int run_item(struct job *j, uint32_t item, float **P, float *scratch, float *cost) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_score_params *p = j->p;
	uint32_t n = in->len - in->window, d = in->dim;
	uint32_t g = in->heads / in->kv_heads, h0 = item * g;
	float *rows = j->rows + (size_t)item * (j->joint ? 1 : g) * n;
	int r;

	r = j->k->attn(in, h0, g, P[0], scratch);
	if (r < 0)
		return r;
	if (j->joint) {
		r = j->k->laprox_group(in, item, (const float *const *)P,
				       j->gram_group ? j->gram_group + (size_t)item * g * d * g * d :
						       NULL,
				       cost);
		if (r < 0)
			return r;
		return pool(j, NULL, g, (const float *const *)P, cost, rows);
	}
	if (p->kind == KVD_SCORE_RESTKV)
		r = j->k->restkv(in, h0, g, P[0], j->gram ? j->gram + (size_t)h0 * d * d : NULL, NULL,
				 &p->restkv, cost);
	else
		for (uint32_t a = 0; r >= 0 && a < g; a++)
			r = j->k->laprox(in, h0 + a, P[a],
					 j->gram ? j->gram + (size_t)(h0 + a) * d * d : NULL, NULL,
					 cost + (size_t)a * n);
	for (uint32_t a = 0; r >= 0 && a < g; a++)
		r = pool(j, P[a], 1, NULL, cost + (size_t)a * n, rows + (size_t)a * n);
	return r;
}

/* Transparent huge pages: 2 MiB. */
#define HUGE_PAGE ((size_t)2 << 20)

/*
 * The large per-call buffers (a worker's g attention maps: 64 MiB at 128k tokens) are
 * touched once per call, and faulting them in 4 KiB pages took about 6% of a ReST-KV layer
 * at 128k tokens: aligned to huge pages and advised for them, they fault 512 times less
 * often. The advice is only a hint; without it the buffers work the same.
 */
static float *alloc_big(size_t floats) {
	size_t bytes = floats * sizeof(float);
	void *p;

	if (bytes < HUGE_PAGE)
		return malloc(bytes);
	if (posix_memalign(&p, HUGE_PAGE, bytes) != 0)
		return NULL;
#ifdef MADV_HUGEPAGE
	madvise(p, bytes, MADV_HUGEPAGE);
#endif
	return p;
}

static void *worker(void *arg) {
	struct job *j = arg;
	const struct kvd_attn_in *in = j->in;
	uint32_t g = in->heads / in->kv_heads, n = in->len - in->window;
	size_t wl = (size_t)in->window * in->len;
	float *P[64] = {}, *mem;
	int r = 0;

	/* The g attention maps (consecutive: P[a] = P[0] + a * w * L), the attention scratch,
	 * g cost rows. */
	mem = alloc_big(g * wl + kvd_attn_scratch_floats(in) + (size_t)g * n + 1);
	if (!mem) {
		atomic_store(&j->error, -ENOMEM);
		return NULL;
	}
	for (uint32_t a = 0; a < g; a++)
		P[a] = mem + a * wl;
	for (;;) {
		uint32_t item = atomic_fetch_add(&j->next, 1);

		if (item >= j->items || atomic_load(&j->error) < 0)
			break;
		r = run_item(j, item, P, mem + g * wl, mem + g * wl + kvd_attn_scratch_floats(in));
		if (r < 0) {
			int zero = 0;

			atomic_compare_exchange_strong(&j->error, &zero, r);
			break;
		}
	}
	free(mem);
	return NULL;
}

static int score_layer(const struct kset *k, uint32_t threads, const struct kvd_attn_in *in,
		       const float *gram, const float *gram_group, const struct kvd_score_params *p,
		       float *scores) {
	struct job j = { .in = in, .gram = gram, .gram_group = gram_group, .p = p, .k = k };
	uint32_t n, rows, g;
	pthread_t tid[64];
	uint32_t started = 0;
	float *tmp = NULL;
	int r;

	r = params_check(in, p);
	if (r < 0 || !scores)
		return -EINVAL;
	n = in->len - in->window, rows = kvd_score_rows(p, in), g = in->heads / in->kv_heads;
	if (g > 64)
		return -EINVAL;
	j.joint = p->kind == KVD_SCORE_LAPROX && p->laprox_joint && !p->per_query_head;
	j.items = in->kv_heads;
	if (j.joint || rows == in->heads)
		j.rows = scores;
	else {
		tmp = alloc_big((size_t)in->heads * n + 1);
		if (!tmp)
			return -ENOMEM;
		j.rows = tmp;
	}
	atomic_init(&j.next, 0);
	atomic_init(&j.error, 0);

	threads = kvd_score_threads(threads, j.items);
	if (threads > 64)
		threads = 64;
	for (; started + 1 < threads; started++)
		if (pthread_create(&tid[started], NULL, worker, &j) != 0) {
			atomic_store(&j.error, -EAGAIN);
			break;
		}
	worker(&j);
	for (uint32_t t = 0; t < started; t++)
		pthread_join(tid[t], NULL);
	r = atomic_load(&j.error);
	if (r < 0)
		goto out;

	if (tmp)
		/* The diagonal GQA sum, in head order. */
		for (uint32_t kv = 0; kv < in->kv_heads; kv++) {
			float *dst = scores + (size_t)kv * n;

			memcpy(dst, tmp + (size_t)kv * g * n, n * sizeof(float));
			for (uint32_t a = 1; a < g; a++) {
				const float *src = tmp + (size_t)(kv * g + a) * n;

				for (uint32_t i = 0; i < n; i++)
					dst[i] += src[i];
			}
		}
	if (p->normalize)
		r = kvd_laprox_normalize(scores, (size_t)rows * n, p->layer_weight);
out:
	free(tmp);
	return r;
}

int kvd_score_layer_ref(const struct kvd_attn_in *in, const float *gram, const float *gram_group,
			const struct kvd_score_params *p, float *scores) {
	return score_layer(&kernels_ref, 1, in, gram, gram_group, p, scores);
}

int kvd_score_layer(const struct kvd_attn_in *in, const float *gram, const float *gram_group,
		    const struct kvd_score_params *p, float *scores) {
	return score_layer(&kernels_opt, p ? p->threads : 1, in, gram, gram_group, p, scores);
}
