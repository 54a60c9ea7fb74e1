/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Internal to baselines_ref.c and baselines.c: the O(H*L) glue that both paths share
 * (argument checks, the group mean, protections and NaN clean-up, ExpectedAttention's
 * RoPE mean and rotation, AdaKV's rounding), so that the paths differ only in the heavy
 * kernels that the tests compare. Not part of any API.
 */

#include <stdint.h>

#include "baselines.h"

/* Which inputs baseline b reads. */
int kvd_bl_needs_q(enum kvd_baseline b);
/* 1 for the per-kv-head baselines (KNorm, KeyDiff), whose work items are kv heads. */
int kvd_bl_per_kv_head(enum kvd_baseline b);

/* All argument checks of kvd_baseline_scores*(): 0 or -EINVAL. */
int kvd_bl_check(enum kvd_baseline b, const struct kvd_baseline_params *p,
		 const struct kvd_attn_in *in, const float *scores);

/* A pooling of one row (kvd_pool_row or kvd_pool_row_ref, smooth.h). */
typedef int (*kvd_bl_pool_fn)(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift,
			      const float *in, uint32_t n, float *out);

/*
 * Whether the snap pipeline pools after the group mean (kvd_bl_finish) rather than per
 * query head before it: AdaKV over a GQA group, whose published code (FFY0/AdaKV, GQA
 * support) averages the group's window scores and then max-pools them. SnapKV and PyramidKV
 * pool per query head, as kvpress does (with average pooling the order does not matter).
 */
static inline int kvd_bl_pool_after_mean(enum kvd_baseline b, const struct kvd_baseline_params *p,
					 const struct kvd_attn_in *in) {
	return b == KVD_BASELINE_ADAKV && !p->per_query_head && in->heads != in->kv_heads &&
	       p->pool != KVD_POOL_NONE;
}

/*
 * From per-item rows (qrows: [H][L] per query head, or [Hkv][L] per kv head for
 * kvd_bl_per_kv_head() baselines; TOVA: one layer row) to scores[rows][L]: the group mean
 * (fp32, head order) or a copy, pooled over the prefix with pool when
 * kvd_bl_pool_after_mean(), then ExpectedAttention's (x + eps) * ||v|| (vnorm [Hkv][L], or
 * NULL), then NaN -> -inf and the protected tokens -> +inf. Returns 0 or -ENOMEM.
 */
int kvd_bl_finish(enum kvd_baseline b, const struct kvd_baseline_params *p,
		  const struct kvd_attn_in *in, const float *qrows, const float *vnorm,
		  kvd_bl_pool_fn pool, float *scores);

/* The view of rows [t0, t1) of in's window as a window of its own (keys 0..L-w+t1-1). */
void kvd_bl_window_rows(const struct kvd_attn_in *in, uint32_t t0, uint32_t t1,
			struct kvd_attn_in *ret);

/* H2O's divisor for key i: how many of the w window rows see it. */
static inline uint32_t kvd_bl_h2o_count(const struct kvd_attn_in *in, uint32_t i) {
	uint32_t first = in->len - in->window;

	return i <= first ? in->window : in->window - (i - first);
}

/*
 * ExpectedAttention's mean RoPE rotation: cbar[j], sbar[j] (j < d/2) = the means of
 * cos(t f_j), sin(t f_j) over the n_future positions, in double.
 */
int kvd_bl_rope_mean(const struct kvd_baseline_params *p, const struct kvd_attn_in *in,
		     double *cbar, double *sbar);

/* mu <- R mu and sigma <- R sigma R^T ([d][d], may be NULL) for R = diag(cbar) + diag(sbar) P. */
void kvd_bl_rotate(uint32_t d, const double *cbar, const double *sbar, double *mu, double *sigma);

/* AdaKV's published budget from head h's share n_h of the global top-k. */
uint32_t kvd_bl_adakv_round(uint32_t n_h, uint32_t budget, double floor_alpha);
