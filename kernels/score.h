/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The per-layer scoring pipeline of the output-aware policies: window attention, the
 * ReST-KV or LaProx-style cost, spatial pooling, GQA aggregation and normalisation, for
 * every head of one layer, threaded across heads. policy.h turns the scores into keep
 * sets; the daemon calls the same function per (sequence, layer) in a round.
 *
 * Steps, for each query head h (work items are kv heads, each with the g query heads that
 * read it; items are shared by `threads` threads):
 *   1. A_h = window attention (attn.h);
 *   2. the cost of each prefix token i < L - w: ReST-KV (restkv.h, with its options) or
 *      the LaProx-style diagonal cost (laprox.h);
 *   3. pooling along the prefix (smooth.h): none, avg, max, or ReST-KV's adaptive window
 *      pooling with the head's own (kernel, shift) from A_h (topk = aws_topk, normally the
 *      capacity minus the window, minimum kernel `kernel`, scale aws_scale).
 * Then, unless rows are query heads (per_query_head, the published ReST-KV layout), the
 * g = H/Hkv query-head rows of each kv head are summed into one per-(kv head, token) row:
 * the diagonal sum, the triangle upper bound of the joint cost (docs/algorithms.md §6, §7.1),
 * so that the cache stays per kv head. The sum is taken after each head's own pooling, so
 * that each head's AWS shift follows its own attention drift.
 *
 * LaProx with laprox_joint and kv-head rows uses the exact GQA-joint cost of the group
 * instead (all g attention maps at once); its adaptive pooling
 * uses the mean of the g heads' t_h (kvd_aws_from_t()), since the joint row has no single
 * head.
 *
 * Finally, with normalize, every score of the layer (all rows together: one
 * (sequence, layer)) becomes its share of the layer's total times layer_weight (N1, N2:
 * laprox.h's kvd_laprox_normalize()).
 *
 * kvd_score_layer_ref() runs the same steps with every kernel's plain-C reference, one head
 * after the other; kvd_score_layer() uses the optimised kernels and threads. Their results
 * agree within atol + |ref|*rtol (tests/kernels/test-score.c) and the optimised results do
 * not depend on the thread count (each item writes its own rows; sums run in head order).
 */

#include <errno.h>
#include <stdint.h>

#include "attn.h"
#include "restkv.h"
#include "smooth.h"

enum kvd_score_kind {
	KVD_SCORE_RESTKV,
	KVD_SCORE_LAPROX,
	_KVD_SCORE_KIND_MAX,
	_KVD_SCORE_KIND_INVALID = -EINVAL,
};

struct kvd_score_params {
	enum kvd_score_kind kind;
	struct kvd_restkv_opts restkv; /* RESTKV */
	uint32_t per_query_head;       /* rows = H (published ReST-KV) instead of Hkv */
	uint32_t laprox_joint;         /* LAPROX with kv-head rows: the exact joint form */
	enum kvd_pool_mode pooling;
	uint32_t kernel;               /* avg/max kernel, or AWS minimum kernel (odd) */
	double aws_scale;              /* AWS scale (KVD_AWS_SCALE) */
	uint32_t aws_topk;             /* AWS top-K per row: capacity - window */
	uint32_t normalize;            /* N1 shares of the layer's total */
	float layer_weight;            /* N2 lambda (1) */
	uint32_t threads;              /* 0: the online CPUs; the reference uses 1 */
};

/*
 * The kvd defaults for kind: ReST-KV's headline options (after, EMA 0.3, tau 1), adaptive
 * pooling with kernel 5 and scale 2000 for both kinds (LAPROX joint), kv-head rows, no
 * normalisation, weight 1, automatic threads. aws_topk is left 0: set it.
 */
void kvd_score_params_default(enum kvd_score_kind kind, struct kvd_score_params *p);

/* The number of score rows: in->heads with per_query_head, else in->kv_heads. */
uint32_t kvd_score_rows(const struct kvd_score_params *p, const struct kvd_attn_in *in);

/*
 * Scores of one layer into scores[rows][L - w] (row stride L - w): the prefix tokens only,
 * higher means keep; the window tokens are not scored (policies always keep them).
 *
 * gram: G_h of every query head, [H][d][d] (kvd_gram() per head), or NULL for the
 * value-space norm (ReST-KV without W_o). gram_group: [Hkv][g*d][g*d] (kvd_gram() per
 * group), needed only by LAPROX with laprox_joint and kv-head rows with W_o; NULL there
 * means value space as well. in->v must be set.
 *
 * Returns 0, -EINVAL (bad in or params: kind, options, an even or zero kernel when pooling,
 * aws_topk 0 with adaptive pooling, a scale not > 0, a weight not finite and >= 0), or
 * -ENOMEM; -EAGAIN if threads could not be started.
 */
int kvd_score_layer_ref(const struct kvd_attn_in *in, const float *gram, const float *gram_group,
			const struct kvd_score_params *p, float *scores);
int kvd_score_layer(const struct kvd_attn_in *in, const float *gram, const float *gram_group,
		    const struct kvd_score_params *p, float *scores);

/*
 * Threads for a parallel loop: threads, or the online CPUs when threads is 0, at most
 * items, at least 1.
 */
uint32_t kvd_score_threads(uint32_t threads, uint32_t items);
