/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * ReST-KV output-reconstruction cost (docs/algorithms.md §1.4), in the exact Gram form (§6).
 *
 * For query head h (reading kv head g = h / (H/Hkv)) and every prefix token i < L - w
 * (the w window tokens are never scored: policies always keep them):
 *
 *   "after" (the published headline mode):
 *     a_i  = temporal aggregate over the window rows of A_h[:, i] (EMA, alpha 0.3)
 *     o    = sum_{j < L-w} a_j v_j                      (prefix only, not renormalised)
 *     cost = a_i / (1 - a_i) * ||(o - v_i) W_o^h||^tau
 *   "before":
 *     for each window row t: o_t = sum_j A_h[t, j] v_j over every key row t sees, and
 *     s_t,i = p/(1-p) * ||(o_t - v_i) W_o^h|| with p = A_h[t, i], divided by ||o_t W_o^h||
 *     when use_norm is set (a relative error; left undivided when that norm is 0);
 *     cost = temporal aggregate over t of s_t,i (tau is not used, as published).
 *
 * Gram form: ||(o - v) W_o^h||^2 = o G o^T - 2 (o G) . v + v G v^T with G = G_h
 * (gram.h). o G and o G o^T are per head and round; v G v^T is static per (token, head),
 * so callers that keep it (the daemon, at insertion) pass it as vgv and the per-token work
 * drops from d^2 to d. Without W_o (gram NULL) the norm is the value-space ||o - v||: G is
 * the identity.
 *
 * Numerics (deviations from the published fp16 code, docs/algorithms.md §1.8, on purpose):
 *   - everything is fp32 (the reference accumulates in double), never fp16;
 *   - the expanded square is clamped at >= 0 before the root, since cancellation can
 *     make it slightly negative when v_i is close to o;
 *   - the odds use a clamped a <= KVD_RESTKV_A_MAX (1 - 1e-6): published fp16 rounds
 *     a >= 1 - 2^-12 to 1 and gives +inf (and inf * 0 = NaN), fp32 without a clamp would
 *     divide by zero at a == 1. The clamp keeps the odds finite and keeps the order of all
 *     a below 1 - 1e-6 unchanged;
 *   - sinks: a token whose a exceeds KVD_RESTKV_A_MAX takes (all but 1e-6 of) the
 *     attention, so o - v_i cancels to ~0 and odds * norm would collapse toward 0 and
 *     evict it first. Its cost is +inf instead: kept first, as the published inf or NaN
 *     is by torch.topk (which ranks NaN highest). AWS pooling then spreads the inf to its
 *     neighbours, as published;
 *   - cancellation guard: the expanded square loses its absolute accuracy (about 1e-7 of
 *     v G v^T) exactly where the odds are large, so tokens with a >= KVD_RESTKV_A_DIRECT
 *     (1/64; at most 64 per row, since the a of a row sum to at most 1) get
 *     (o - v_i) G (o - v_i)^T computed directly, d^2 each. Only costs change, within
 *     rounding of the exact value; a cached vgv is not used for them.
 * Non-finite inputs propagate by IEEE rules (NaN stays NaN through the clamp); selection
 * ranks NaN lowest (select.h).
 *
 * GQA. The published code repeat_kv's K/V and scores, selects and stores per query head
 * (docs/algorithms.md §1.7): the kernels here are per query head for that reason, and a
 * per-query-head policy reproduces the published selection exactly. kvd's cache is per kv
 * head, so the per-layer pipeline (score.h) adds the costs of the g query heads that read
 * one kv head into one per-(kv head, token) cost: the diagonal sum, which is the triangle
 * upper bound of the joint change of the layer output when that kv entry goes
 * (docs/algorithms.md §6, §7.1). Each head's own AWS pooling is applied before the sum.
 *
 * Each kernel has a plain-C reference (restkv_ref.c, double accumulation) and an optimised
 * path (restkv.c: fp32 gemm tiles) with the same contract; tests/kernels/test-restkv.c
 * compares them, and the Gram form against the direct projection through W_o.
 */

#include <errno.h>
#include <math.h>
#include <stdint.h>

#include "attn.h"
#include "smooth.h"

enum kvd_restkv_metric {
	KVD_RESTKV_AFTER,  /* aggregate the attention first, then one cost (headline) */
	KVD_RESTKV_BEFORE, /* one cost per window query, then aggregate */
	_KVD_RESTKV_METRIC_MAX,
	_KVD_RESTKV_METRIC_INVALID = -EINVAL,
};

/* The largest attention weight the odds see: a / (1 - a) <= about 1e6; above it, +inf. */
#define KVD_RESTKV_A_MAX (1.0f - 1e-6f)
/* From this attention weight on, the norm is computed directly (cancellation guard). */
#define KVD_RESTKV_A_DIRECT (1.0f / 64)

struct kvd_restkv_opts {
	enum kvd_restkv_metric metric;   /* default KVD_RESTKV_AFTER */
	enum kvd_temporal_mode temporal; /* over window rows; default KVD_TEMPORAL_EMA */
	float alpha;                     /* EMA weight; default KVD_TEMPORAL_EMA_ALPHA (0.3) */
	float tau;                       /* after mode: exponent of the norm; default 1 */
	int use_norm;                    /* before mode: divide by ||o_t W_o^h|| */
};

/* The published headline settings: after, EMA 0.3, tau 1, no use_norm. */
void kvd_restkv_opts_default(struct kvd_restkv_opts *o);

/* "after", "before"; NULL if invalid. And the inverse, _KVD_RESTKV_METRIC_INVALID if unknown. */
const char *kvd_restkv_metric_to_string(enum kvd_restkv_metric m);
enum kvd_restkv_metric kvd_restkv_metric_from_string(const char *s);

/*
 * vgv[i] = v_i G v_i^T for the first n value rows of kv head kvd_attn_kv_head(in, h), with
 * G = gram ([d][d], G_h of query head h) or the identity when gram is NULL. in->v must be
 * set; n <= L. Returns 0, -EINVAL or -ENOMEM.
 */
int kvd_restkv_vgv_ref(const struct kvd_attn_in *in, uint32_t h, const float *gram, uint32_t n,
		       float *vgv);
int kvd_restkv_vgv(const struct kvd_attn_in *in, uint32_t h, const float *gram, uint32_t n,
		   float *vgv);

/*
 * The cost of query head h for the L - w prefix tokens into cost[L - w].
 *
 * probs: A_h, [w][L] as kvd_attn_head() writes it. gram: G_h ([d][d]) or NULL for the
 * value-space norm. vgv: the cached v G v^T of the prefix tokens ([L - w], as
 * kvd_restkv_vgv() computes with the same gram), or NULL to compute it here. in->v must
 * be set. Returns 0, -EINVAL (bad in, h, options, NULL probs or cost) or -ENOMEM.
 */
int kvd_restkv_head_ref(const struct kvd_attn_in *in, uint32_t h, const float *probs,
			const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
			float *cost);
int kvd_restkv_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		    float *cost);

/*
 * kvd_restkv_head for the nh query heads h0 .. h0+nh-1, which must read the same kv head
 * (at most H/Hkv of them), at once: the values are read and converted once for all of
 * them. probs is [nh][w][L] (kvd_attn_heads_buf()), gram [nh][d][d] (G of those heads, in
 * order) or NULL, vgv [nh][L - w] or NULL, cost [nh][L - w]. Each cost row is exactly what
 * kvd_restkv_head gives for its head. Same errors.
 */
int kvd_restkv_heads(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, const float *probs,
		     const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		     float *cost);

/* The clamped odds a/(1-a) of the cost (exposed for tests; NaN stays NaN). Costs of
 * tokens with a > KVD_RESTKV_A_MAX are +inf whatever this returns (sinks, above). */
static inline float kvd_restkv_odds(float a) {
	if (a > KVD_RESTKV_A_MAX)
		a = KVD_RESTKV_A_MAX;
	return a / (1.0f - a);
}

/* odds(a) * norm, with the sink rule above. */
static inline float kvd_restkv_cost(float a, float norm) {
	return a > KVD_RESTKV_A_MAX ? INFINITY : kvd_restkv_odds(a) * norm;
}
