/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * IndexMem (docs/algorithms.md §3): a learned indexer that predicts each token's importance, and
 * a latent memory of the evicted tokens whose readout goes back into attention.
 *
 * Indexer. Per layer, from the attention input a (the RMS-normed hidden state, [dim]):
 * index_heads query heads iq_j = softplus(ww_j . a + bw_j) * l2norm(wq_j a) and one index key
 * ik = l2norm(wk a), both of index_dim. The head weight is folded into the query (it is
 * positive, so relu(w q.k) = w relu(q.k)), which makes an index query self-contained: the
 * engine stores ik next to the token's K/V and publishes the iq of its recent queries; the
 * daemon scores resident token s against a window of W queries as
 *     I(s) = (1/W) sum_{t, j} relu(iq_{t,j} . ik_s),
 * and the softmax of I over a layer's tokens is the indexer's estimate of the share of
 * attention each gets (eval/kvd-lm/train-indexmem.py distils it from head-summed
 * attention, block by block). No key of the model is read.
 *
 * Latent memory. Per (sequence, layer, kv head): z = sum phi(k_j), S = sum phi(k_j) v_j^T
 * over the evicted tokens (count n), with the fixed feature map phi(x) = elu(x) + 1, so
 * that the daemon folds evicted K/V without weights and in any grouping (the state is a
 * sum). A query q of head h reads it through learned weights of its layer (lq, lb, lr and
 * a bias per query head):
 *     psi = elu(lq q + lb) + 1,  den = psi . z + KVD_LATENT_EPS,  m = psi^T S / den,
 * as one more softmax entry with logit ln den + bias_h and value lr m: the gate of the
 * residual readout is that entry's share of the softmax. With nothing evicted there is
 * no entry (logit -inf), so attention is the full cache's exactly.
 *
 * Each computing kernel has a plain-C reference (*_ref, indexmem_ref.c: the obvious loops,
 * double accumulation) and an optimised CPU path (indexmem.c, on simd.h's gemm), compared
 * by tests/kernels/test-indexmem.c. Everything is reentrant.
 */

#include <stddef.h>
#include <stdint.h>

#include "kvd/kvd-abi.h"            /* KVD_INDEX_HEADS_MAX, KVD_INDEX_DIM_MAX */

/* One layer's indexer weights (views, fp32, row-major as torch Linear). */
struct kvd_indexer_layer {
	uint32_t dim, heads, index_dim;
	const float *wq;  /* [heads * index_dim][dim] */
	const float *wk;  /* [index_dim][dim] */
	const float *ww;  /* [heads][dim] */
	const float *bw;  /* [heads] */
};

/* 0 if w is complete and its sizes in range, else -EINVAL (what both paths check). */
int kvd_indexer_layer_check(const struct kvd_indexer_layer *w);

/*
 * The index queries iq[n][heads][index_dim] (head weights folded in) and index keys
 * ik[n][index_dim] of the n attention inputs a[i * lda] ([dim] each). Returns 0 or
 * -EINVAL; kvd_indexer_project also -ENOMEM.
 */
int kvd_indexer_project_ref(const struct kvd_indexer_layer *w, const float *a, size_t lda,
			    uint32_t n, float *iq, float *ik);
int kvd_indexer_project(const struct kvd_indexer_layer *w, const float *a, size_t lda, uint32_t n,
			float *iq, float *ik);

/*
 * I(s) of the keys ik[s * ik_stride] (s < n, index_dim elements of dtype KVD_KERNEL_*) for
 * the window's queries iq (W * heads rows of index_dim, contiguous, same dtype) into
 * out[n]: the mean over the window of the sum over rows of relu(iq_r . ik_s). Returns 0 or
 * -EINVAL; kvd_indexer_scores also -ENOMEM.
 */
int kvd_indexer_scores_ref(const void *iq, uint32_t window, uint32_t heads, const void *ik,
			   size_t ik_stride, uint32_t dtype, uint32_t n, uint32_t index_dim,
			   float *out);
int kvd_indexer_scores(const void *iq, uint32_t window, uint32_t heads, const void *ik,
		       size_t ik_stride, uint32_t dtype, uint32_t n, uint32_t index_dim, float *out);

/* The epsilon of the readout's denominator (the training script's). */
#define KVD_LATENT_EPS 1e-6f
/* The largest head dimension a readout takes (kvd.h's head_dim limit). */
#define KVD_LATENT_DIM_MAX 4096u

/* A latent state: views of caller-owned arrays (in the pool, for the daemon and engines). */
struct kvd_latent {
	uint64_t count;  /* tokens folded in; 0 is the empty state */
	uint32_t dim;    /* d, the head dimension */
	float *z;        /* [d]: sum phi(k) */
	float *s;        /* [d][d]: s[a * d + b] = sum phi(k)_a v_b */
};

/* Floats a state of dimension d holds (z, then s). */
static inline size_t kvd_latent_floats(uint32_t d) {
	return (size_t)d * (1 + (size_t)d);
}

/* Points m's arrays into f (kvd_latent_floats(d) floats); count 0. */
void kvd_latent_view(struct kvd_latent *m, uint32_t d, float *f);

/*
 * The state of the n rows k[i * k_stride], v[i * v_stride] (elements of dtype
 * KVD_KERNEL_*, d = out->dim each) into out, which it overwrites. Returns 0 or -EINVAL;
 * kvd_latent_batch also -ENOMEM.
 */
int kvd_latent_batch_ref(const void *k, size_t k_stride, const void *v, size_t v_stride,
			 uint32_t dtype, uint32_t n, struct kvd_latent *out);
int kvd_latent_batch(const void *k, size_t k_stride, const void *v, size_t v_stride,
		     uint32_t dtype, uint32_t n, struct kvd_latent *out);

/* Adds b into a (same dim): the state of both sets. Returns 0, or -EINVAL (dims differ),
 * -EOVERFLOW (the count would wrap; a is unchanged). */
int kvd_latent_merge(struct kvd_latent *a, const struct kvd_latent *b);

/* One layer's readout weights (views, fp32). */
struct kvd_latent_readout {
	uint32_t dim;
	const float *lq;  /* [d][d] */
	const float *lb;  /* [d] */
	const float *lr;  /* [d][d] */
};

/*
 * The entries of the queries q[r * ldq] (r < rows, fp32, d each), whose heads have the
 * biases bias[r]: logit[r] and value[r * d ..]. An empty state gives logit -inf and value
 * 0. Returns 0 or -EINVAL; kvd_latent_entries also -ENOMEM.
 */
/* 0 if the arguments of kvd_latent_entries are consistent, else -EINVAL (what both paths
 * check; the state's dim at most KVD_LATENT_DIM_MAX). */
int kvd_latent_entries_check(const struct kvd_latent *m, const struct kvd_latent_readout *w,
			     const float *q, uint32_t rows, const float *bias, const float *logit,
			     const float *value);

int kvd_latent_entries_ref(const struct kvd_latent *m, const struct kvd_latent_readout *w,
			   const float *q, size_t ldq, uint32_t rows, const float *bias,
			   float *logit, float *value);
int kvd_latent_entries(const struct kvd_latent *m, const struct kvd_latent_readout *w,
		       const float *q, size_t ldq, uint32_t rows, const float *bias, float *logit,
		       float *value);
