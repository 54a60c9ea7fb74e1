/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The published eviction baselines (docs/algorithms.md §5) as score kernels: each turns one
 * layer's K/V (and queries, where it needs them) into one score per (head, token), higher
 * meaning keep, so that every policy ends in the same selection (select.h). Budgets are
 * separate helpers: PyramidKV's per-layer schedule and AdaKV's per-head allocation.
 *
 * Layout and GQA. scores is [rows][L] with row stride L, where rows is the number of kv
 * heads by default: the cache stays GQA-native, and a quantity defined per query head
 * (attention, expected attention) is averaged over the g = H/Hkv query heads that read
 * one kv head, as kvpress does (mean over the group, fp32). With per_query_head set,
 * rows is H and nothing is averaged: the layout of the ReST-KV harness, which repeat_kv's
 * K/V and selects per query head (docs/algorithms.md §1.7); per-kv-head quantities (KNorm,
 * KeyDiff, positions) are then repeated for the g query heads of their kv head.
 *
 * Protected tokens get +inf: StreamingLLM's and ExpectedAttention's n_sink first tokens,
 * the w window tokens of SnapKV/PyramidKV/AdaKV, H2O's `recent` last tokens and TOVA's last
 * token. A top-k of a row therefore keeps them first (k must cover them to keep them all).
 *
 * Non-finite inputs. The scores written are never NaN, and never crash anything:
 *   - a score whose computation meets a NaN (a NaN or inf in q, k or v: attention rows
 *     turn NaN, attn.h) becomes -inf, i.e. it is evicted first. One NaN key makes the
 *     whole window attention of the heads that see it NaN, so all those heads' unprotected
 *     tokens get -inf and tie (ties go to the lower position, select.h);
 *   - KNorm and KeyDiff look at each key alone: a key with a non-finite element gets -inf
 *     and is left out of KeyDiff's mean key, so it cannot disturb the other tokens' scores;
 *     a finite key whose norm overflows fp32 also gets -inf (KNorm);
 *   - protected tokens stay +inf whatever their inputs.
 *
 * The two paths. kvd_baseline_scores_ref() (baselines_ref.c) is plain loops over
 * kvd_attn_head_ref() and the smooth.h references, one head after the other, accumulating
 * in double where a sum runs over tokens. kvd_baseline_scores() (baselines.c) uses
 * kvd_attn_head_buf(), the smooth.h optimised kernels and the SIMD ops (simd.h), with
 * plain pthreads over query heads (or kv heads) when params->threads allows; its results
 * match the reference within atol + |ref|*rtol (tests/kernels/test-baselines.c) and do not
 * depend on the thread count. Both are reentrant; they allocate their scratch per call.
 *
 * Costs (per layer, docs/algorithms.md §6): StreamingLLM O(H*L); KNorm, KeyDiff O(Hkv*L*d);
 * TOVA O(H*L*d) (one query row); SnapKV/PyramidKV/AdaKV O(H*w*L*d); ExpectedAttention
 * O(H*(N+L)*d^2) for N statistics queries; H2O O(H*w*L*d) with w = L for the whole prompt:
 * quadratic in the prompt length, so its benchmarks stop where that bites.
 */

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "attn.h"
#include "smooth.h"

enum kvd_baseline {
	KVD_BASELINE_STREAMINGLLM,
	KVD_BASELINE_H2O,
	KVD_BASELINE_SNAPKV,
	KVD_BASELINE_PYRAMIDKV,
	KVD_BASELINE_ADAKV,
	KVD_BASELINE_TOVA,
	KVD_BASELINE_KNORM,
	KVD_BASELINE_KEYDIFF,
	KVD_BASELINE_EXPECTED_ATTENTION,
	_KVD_BASELINE_MAX,
	_KVD_BASELINE_INVALID = -EINVAL,
};

/* The policy names (kernels/policy.c): "streamingllm", "h2o", "snapkv", "pyramidkv", "adakv",
 * "tova", "knorm", "keydiff", "expected_attention"; NULL if invalid. */
const char *kvd_baseline_to_string(enum kvd_baseline b);
/* The inverse; _KVD_BASELINE_INVALID for anything else (including "full", "restkv"...). */
enum kvd_baseline kvd_baseline_from_string(const char *s);

struct kvd_baseline_params {
	/* All. */
	uint32_t threads;        /* optimised path: at most this many threads; 0 = online CPUs */
	uint32_t per_query_head; /* 1: rows = H, no group mean (see above); default 0 */
	uint32_t n_sink;         /* StreamingLLM, ExpectedAttention: leading tokens kept; 4 */

	/*
	 * SnapKV, PyramidKV, AdaKV: per query head, the window attention A_h [w][L] is folded
	 * over its w rows on the prefix columns [0, L-w) only (temporal), pooled along those
	 * L-w entries (pool, kernel; zero padding for AVG; ADAPTIVE is ReST's and refused
	 * here), then averaged over the group; the w window tokens get +inf.
	 * Defaults: SnapKV and PyramidKV SUM, AVG, 5 (FasterDecoding/SnapKV, PyramidKV);
	 * AdaKV MEAN, MAX, 7 (FFY0/AdaKV). kvpress's SnapKV is MEAN, AVG, 5: the same ranking
	 * as SUM within a head.
	 */
	enum kvd_temporal_mode temporal;
	float alpha;             /* EMA weight if temporal is EMA; KVD_TEMPORAL_EMA_ALPHA */
	enum kvd_pool_mode pool;
	uint32_t kernel;         /* odd */

	/*
	 * H2O: per query head, the sum over all w given query rows of the attention each key
	 * receives, causally (row t sees keys 0..L-w+t, attn.h), accumulated in blocks of
	 * h2o_block rows so that memory stays O(h2o_block * L) per thread. Pass the whole
	 * prompt as the window (in->window == in->len) for the published H2O; a shorter window
	 * accumulates over those queries only. h2o_normalize divides each key's sum by the
	 * number of given rows that see it (kvpress ObservedAttention, which removes the bias
	 * toward early tokens). The last `recent` tokens get +inf (H2O's recent window).
	 * Defaults: normalize 0, block 64, recent 0 (set it to the recent share of the budget).
	 */
	uint32_t h2o_normalize;
	uint32_t h2o_block;
	uint32_t recent;

	/*
	 * ExpectedAttention (kvpress expected_attention_press.py): per query head h, the mean
	 * mu and covariance Sigma (biased, 1/N) of the PRE-RoPE queries eq_q rows
	 * [eq_first, eq_rows) are rotated by the mean RoPE matrix R = mean_t R(t) over the
	 * n_future positions t = position .. position + n_future - 1 (mu <- R mu,
	 * Sigma <- R Sigma R^T); then z_i = s k_i.mu + s^2/2 k_i^T Sigma k_i for the tokens
	 * i >= n_sink (s = in->scale; with s = 1/sqrt(d) this is
	 * k.mu/sqrt(d) + k^T Sigma k/(2d), docs/algorithms.md §5.9), softmax over those tokens, mean over the group,
	 * and (score + epsilon) * ||v_i||. Sinks get +inf.
	 *
	 * RoPE: the HF "rotate_half" layout over the whole head (dims j and j + d/2 form a
	 * pair with frequency inv_freq[j]; d even). rope_inv_freq ([d/2]) gives the
	 * frequencies; NULL means the default theta^(-2j/d) with rope_theta. Llama 3.1's
	 * scaled frequencies (theta 500000 plus "llama3" scaling) come from
	 * kvd_rope_inv_freq_llama3(). Partial rotary dimensions, the GPT-J interleaved layout
	 * and attention-factor scalings (YaRN) are not supported. Each angle t*f is rounded to
	 * fp32 as HF forms it; cos, sin and their mean are then computed in double (HF: fp32).
	 *
	 * eq_q: [H][eq_rows][d] of in->dtype with element strides like in->q. position 0
	 * means in->len (the prompt's next position, as kvpress). use_covariance 0 drops the
	 * Sigma term; use_vnorm 0 drops the ||v|| factor (and epsilon). Defaults: n_future 512,
	 * theta 10000, use_covariance 1, use_vnorm 1, epsilon 0. in->v is needed with use_vnorm.
	 */
	const void *eq_q;
	size_t eq_head_stride, eq_row_stride;
	uint32_t eq_rows;
	/* The first row of eq_q the statistics take: n_sink (the default, kvpress's) when eq_q
	 * are a prompt's queries from position 0, whose first rows are the sinks'; 0 when they
	 * are a later window's, whose first rows are ordinary queries. */
	uint32_t eq_first;
	uint32_t n_future;
	uint32_t position;
	float rope_theta;
	const float *rope_inv_freq;
	uint32_t use_covariance, use_vnorm;
	float epsilon;
};

/* Fills p with b's published defaults (above); fields b does not read are zero/defaults. */
void kvd_baseline_params_init(enum kvd_baseline b, struct kvd_baseline_params *p);

/* The number of score rows: in->heads with p->per_query_head, else in->kv_heads. */
uint32_t kvd_baseline_rows(const struct kvd_baseline_params *p, const struct kvd_attn_in *in);

/*
 * Scores of baseline b for one layer into scores[rows][in->len] (row stride in->len):
 *
 *   STREAMINGLLM  i < n_sink: +inf; else i (newer is kept first; positions are exact in
 *                 fp32 up to 2^24). Reads only in->heads, kv_heads, len.
 *   H2O           accumulated (optionally normalised) attention, see above; needs q, k.
 *   SNAPKV        window-aggregated, pooled attention on the prefix; window +inf.
 *   PYRAMIDKV     the same scores as SNAPKV; the budgets come from kvd_pyramidkv_budgets().
 *   ADAKV         the same pipeline with AdaKV's defaults; the budgets come from
 *                 kvd_adakv_budgets() over the prefix columns [0, L-w) of these rows.
 *   TOVA          the last window query's attention averaged over ALL H heads of the layer
 *                 (a layer-wide decision: every row is the same); token L-1 +inf. Needs q
 *                 (only its last row is used), k.
 *   KNORM         -||k_i|| (keep the lowest norms; no protection). Needs k.
 *   KEYDIFF       -cos(k_i, mean_j k_j/||k_j||) per kv head, torch eps (normalize 1e-12,
 *                 cosine 1e-8); keys with non-finite elements are left out of the mean.
 *   EXPECTED_ATTENTION  see above; needs k, eq_q, and v with use_vnorm.
 *
 * q and w are read only where stated (in->q may be NULL otherwise, and in->window is
 * then only checked to lie in 1..L).
 *
 * Returns 0, -EINVAL (an invalid baseline, params or in: shapes, a needed pointer NULL, an
 * even kernel, ADAPTIVE pooling, eq_rows <= eq_first, an odd d for ExpectedAttention,
 * h2o_block 0), or -ENOMEM.
 */
int kvd_baseline_scores_ref(enum kvd_baseline b, const struct kvd_baseline_params *p,
			    const struct kvd_attn_in *in, float *scores);
int kvd_baseline_scores(enum kvd_baseline b, const struct kvd_baseline_params *p,
			const struct kvd_attn_in *in, float *scores);

/*
 * PyramidKV's per-layer budgets (docs/algorithms.md §1.6; Zefan-Cai/PyramidKV and
 * FFY0/AdaKV pyram_mode), in prefix tokens kept per head, the w window tokens not
 * included. With B = capacity - window and Python floor division:
 *
 *   min = B // beta, max = 2B - min;
 *   if max >= len - window: max = len - window, min = 2B - max;
 *   step = (max - min) // (n_layers - 1);  budget[l] = max - l*step.
 *
 * As published, a prompt shorter than capacity is not compressed: every layer keeps all
 * len - window prefix tokens, and one shorter than 2B (capacity <= len < 2B) keeps B at
 * every layer, as SnapKV. With len >= capacity every budget lies in [0, len - window].
 * Deviation: n_layers == 1 (a division by zero in the published code) gives B.
 * Published totals exceed n_layers*B by the rounding of step.
 *
 * Returns 0 or -EINVAL (capacity <= window, window > len, beta == 0, n_layers == 0, NULL).
 */
int kvd_pyramidkv_budgets(uint32_t capacity, uint32_t window, uint32_t len, uint32_t n_layers,
			  uint32_t beta, uint32_t *ret_budgets);

#define KVD_PYRAMIDKV_BETA 20u
#define KVD_ADAKV_FLOOR_ALPHA 0.2

/*
 * AdaKV's per-head budgets for one layer (FFY0/AdaKV AdaptiveSnapKVCluster):
 *
 *   over the flattened scores of all heads (rows[h][0..n), row h at scores + h*stride, the
 *   prefix scores of ADAKV, n = L - w), take the global top heads*budget; n_h = how many
 *   of head h's are in it; then
 *   ret_budgets[h] = round(n_h * (1 - f) + floor_budget),  floor_budget = int(budget * f)
 *
 * with f = floor_alpha (0.2), exactly as published: floor_budget is truncated in double
 * (Python int()), the sum is computed in fp32 and round() is round-half-to-even (torch).
 * The floor is truncated, not f*B (19 for B = 96, not 19.2).
 * The budgets sum to about heads*budget, not exactly (rounding). With normalize, each
 * head's scores are first multiplied (fp32) by its top-budget mass over its total mass
 * (AdaKV's `normalize`). Ties in the global top-k go to the lower head, then the lower
 * position (select.h's order; NaN lowest), so n_h is deterministic. As published, when
 * budget > n nothing is compressed: every head gets n. Each head then keeps its own
 * top-budget[h] prefix tokens plus the window.
 *
 * Returns 0, -EINVAL (NULL, stride < n, f outside [0, 1]) or -ENOMEM. The reference sorts;
 * the optimised path uses radix selection (kvd_topk_rows()); the results are identical.
 */
int kvd_adakv_budgets_ref(const float *scores, size_t stride, uint32_t heads, uint32_t n,
			  uint32_t budget, double floor_alpha, int normalize, uint32_t *ret_budgets);
int kvd_adakv_budgets(const float *scores, size_t stride, uint32_t heads, uint32_t n,
		      uint32_t budget, double floor_alpha, int normalize, uint32_t *ret_budgets);

/*
 * Llama 3.x RoPE frequencies (HF rope_type "llama3") for ExpectedAttention's
 * rope_inv_freq: the default theta^(-2j/d), divided by factor where the wavelength
 * exceeds original_max/low_freq_factor, unchanged below original_max/high_freq_factor,
 * and interpolated between. Llama 3.1: theta 500000, factor 8, low 1, high 4,
 * original_max 8192. factor 0 gives the unscaled frequencies. Writes dim/2 values.
 * Returns 0 or -EINVAL (odd or zero dim, non-positive theta, low >= high with factor > 0).
 */
int kvd_rope_inv_freq_llama3(uint32_t dim, double theta, double factor, double low_freq_factor,
			     double high_freq_factor, double original_max, float *ret_inv_freq);
