/* SPDX-License-Identifier: MIT */
/*
 * The per-layer scoring pipeline (see score.h). One implementation of the steps, run
 * either with the reference kernels on the caller's thread or with the optimised kernels
 * on a few pthreads that take work items (heads, or kv groups) from a shared counter.
 * Each item writes only its own rows, and the GQA sums run afterwards in head order, so
 * the result does not depend on the number of threads or on scheduling.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "laprox.h"
#include "score.h"

struct kset {
	int (*attn)(const struct kvd_attn_in *in, uint32_t h, float *probs, float *scratch);
	int (*restkv)(const struct kvd_attn_in *in, uint32_t h, const float *probs,
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

static int attn_ref(const struct kvd_attn_in *in, uint32_t h, float *probs, float *scratch) {
	return kvd_attn_head_ref(in, h, probs);
}

static const struct kset kernels_ref = {
	.attn = attn_ref,
	.restkv = kvd_restkv_head_ref,
	.laprox = kvd_laprox_head_ref,
	.laprox_group = kvd_laprox_group_ref,
	.aws = kvd_aws_params_ref,
	.pool = kvd_pool_row_ref,
};

static const struct kset kernels_opt = {
	.attn = kvd_attn_head_buf,
	.restkv = kvd_restkv_head,
	.laprox = kvd_laprox_head,
	.laprox_group = kvd_laprox_group,
	.aws = kvd_aws_params,
	.pool = kvd_pool_row,
};

void kvd_score_params_default(enum kvd_score_kind kind, struct kvd_score_params *p) {
	*p = (struct kvd_score_params){
		.kind = kind,
		.laprox_joint = 1,
		.pooling = kind == KVD_SCORE_RESTKV ? KVD_POOL_ADAPTIVE : KVD_POOL_NONE,
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
	int joint;       /* items are kv groups (LaProx joint) rather than query heads */
	uint32_t items;
	float *rows;     /* [items][n]: per query head, or per group when joint */
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

static int run_item(struct job *j, uint32_t item, float **P, float *scratch, float *cost) {
	const struct kvd_attn_in *in = j->in;
	const struct kvd_score_params *p = j->p;
	uint32_t n = in->len - in->window, d = in->dim;
	uint32_t g = in->heads / in->kv_heads;
	float *row = j->rows + (size_t)item * n;
	int r;

	if (j->joint) {
		for (uint32_t a = 0; a < g; a++) {
			r = j->k->attn(in, item * g + a, P[a], scratch);
			if (r < 0)
				return r;
		}
		r = j->k->laprox_group(in, item, (const float *const *)P,
				       j->gram_group ? j->gram_group + (size_t)item * g * d * g * d :
						       NULL,
				       cost);
		if (r < 0)
			return r;
		return pool(j, NULL, g, (const float *const *)P, cost, row);
	}

	r = j->k->attn(in, item, P[0], scratch);
	if (r < 0)
		return r;
	if (p->kind == KVD_SCORE_RESTKV)
		r = j->k->restkv(in, item, P[0], j->gram ? j->gram + (size_t)item * d * d : NULL, NULL,
				 &p->restkv, cost);
	else
		r = j->k->laprox(in, item, P[0], j->gram ? j->gram + (size_t)item * d * d : NULL, NULL,
				 cost);
	if (r < 0)
		return r;
	return pool(j, P[0], 1, NULL, cost, row);
}

static void *worker(void *arg) {
	struct job *j = arg;
	const struct kvd_attn_in *in = j->in;
	uint32_t nP = j->joint ? in->heads / in->kv_heads : 1, n = in->len - in->window;
	size_t wl = (size_t)in->window * in->len;
	float *P[64] = {}, *mem;
	int r = 0;

	/* nP attention maps, the attention scratch, one cost row. */
	mem = malloc((nP * wl + kvd_attn_scratch_floats(in) + n + 1) * sizeof(float));
	if (!mem) {
		atomic_store(&j->error, -ENOMEM);
		return NULL;
	}
	for (uint32_t a = 0; a < nP; a++)
		P[a] = mem + a * wl;
	for (;;) {
		uint32_t item = atomic_fetch_add(&j->next, 1);

		if (item >= j->items || atomic_load(&j->error) < 0)
			break;
		r = run_item(j, item, P, mem + nP * wl, mem + nP * wl + kvd_attn_scratch_floats(in));
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
	j.items = j.joint ? in->kv_heads : in->heads;
	if (j.items == rows)
		j.rows = scores;
	else {
		tmp = malloc(((size_t)j.items * n + 1) * sizeof(float));
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
