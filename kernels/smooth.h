/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Temporal and spatial smoothing of attention-derived scores (docs/algorithms.md §1.3, §1.5).
 *
 * Temporal: one head's window probabilities probs[w][L] (as kvd_attn_head() writes them,
 * row 0 the oldest window query) are folded over the w rows into one value per column.
 * Spatial: a score row of n entries is pooled along the token axis, by plain avg/max
 * pooling (SnapKV, PyramidKV, AdaKV) or by ReST-KV's adaptive window pooling (AWS), whose
 * kernel size and shift come from the head's own window attention.
 *
 * Who slices the prefix: ReST-KV and the SnapKV family score only the prefix columns
 * [0, L-w) and pool that prefix alone, so that its edges (position L-w-1 included) get the
 * padding. These functions never slice on their own: the caller passes n = L - w (and the
 * row stride L) to kvd_temporal_agg() and the resulting n-entry row to kvd_pool_row().
 * Passing n = L scores and pools every column instead. kvd_aws_params() is the exception:
 * it ranks all L positions of each row, as published.
 *
 * Each kernel has a plain-C reference (_ref, smooth_ref.c: obvious loops, a sort for the
 * top-K) and a second path (smooth.c) with the same signature and semantics, compared by
 * tests/kernels/test-smooth.c. Temporal aggregation (O(w*n)) and pooling (O(k*n)) take
 * one clean implementation each: row-major over column blocks for the temporal fold, an
 * unclamped interior plus clamped edges for pooling, in the reference's per-element
 * operation order (the results agree to the bit unless a compiler contracts a*b+c into an
 * fma). The AWS parameters, whose reference sorts every row (O(w*L log L)), use one vector
 * pass per row (the positions above a band of values that holds the K-th largest, and a
 * selection inside the band), two more when the band taken from the previous row misses;
 * both agree exactly.
 *
 * Non-finite inputs follow IEEE arithmetic, as the PyTorch originals do: a NaN in a column
 * makes that column's temporal aggregate NaN, and average or max pooling spreads a NaN or
 * an inf to the k/2 neighbours on each side (max pooling propagates NaN like
 * torch.max_pool1d). kvd_aws_params() never returns a non-finite t: it ranks positions
 * only, with NaN below every number (see there). Callers that select on the results
 * sanitise them (baselines.h turns NaN scores into -inf).
 *
 * All functions are reentrant and thread-safe; they allocate only in kvd_aws_params*()
 * (one scratch row). out must not overlap in unless stated.
 */

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

/* ---- Temporal aggregation over the window rows ---- */

enum kvd_temporal_mode {
	KVD_TEMPORAL_EMA,  /* ReST-KV: acc = x_0; acc = alpha*x_t + (1-alpha)*acc for t = 1..w-1 */
	KVD_TEMPORAL_MEAN, /* mean over the w rows (AdaKV, kvpress SnapKV, ReST ablation "mean") */
	KVD_TEMPORAL_LAST, /* the newest row only (ReST ablation "none", TOVA) */
	KVD_TEMPORAL_SUM,  /* sum over the w rows (SnapKV, PyramidKV as published) */
	_KVD_TEMPORAL_MAX,
	_KVD_TEMPORAL_INVALID = -EINVAL,
};

/* ReST-KV's headline EMA weight (every published script passes 0.3). */
#define KVD_TEMPORAL_EMA_ALPHA 0.3f

/* "ema", "mean", "last", "sum"; NULL for an invalid mode. */
const char *kvd_temporal_mode_to_string(enum kvd_temporal_mode m);
/* The inverse of the above (also accepts ReST's "none" for LAST); _KVD_TEMPORAL_INVALID. */
enum kvd_temporal_mode kvd_temporal_mode_from_string(const char *s);

/*
 * Folds rows 0..w-1 of probs (row t at probs + t * stride, columns 0..n-1) into agg[n].
 *
 * EMA walks from the oldest row to the newest, so the newest row weighs alpha, the one
 * before alpha*(1-alpha), ..., the oldest (1-alpha)^(w-1); the weights sum to 1. alpha is
 * read only in EMA mode and must lie in (0, 1] there (alpha = 1 is LAST). MEAN sums in
 * fp32 row by row and divides by w; SUM is the same sum without the division. w == 1 makes
 * every mode a copy of row 0. All arithmetic is fp32, row by row, as ReST's ema() does.
 *
 * Returns 0, or -EINVAL for a NULL pointer with n > 0, w == 0, stride < n, an invalid mode
 * or (EMA) an alpha outside (0, 1].
 */
int kvd_temporal_agg_ref(enum kvd_temporal_mode mode, float alpha, const float *probs,
			 uint32_t w, size_t stride, uint32_t n, float *agg);
int kvd_temporal_agg(enum kvd_temporal_mode mode, float alpha, const float *probs, uint32_t w,
		     size_t stride, uint32_t n, float *agg);

/* ---- Spatial pooling along the token axis ---- */

enum kvd_pool_mode {
	KVD_POOL_NONE,     /* copy */
	KVD_POOL_AVG,      /* torch avg_pool1d(k, stride 1, padding k/2, count_include_pad) */
	KVD_POOL_MAX,      /* torch max_pool1d(k, stride 1, padding k/2) */
	KVD_POOL_ADAPTIVE, /* ReST-KV AWS: replicate padding, kernel k, shift sigma */
	_KVD_POOL_MAX,
	_KVD_POOL_INVALID = -EINVAL,
};

/* SnapKV's and ReST-KV's default kernel, and AWS's default scale (docs/algorithms.md §1.5). */
#define KVD_POOL_KERNEL 5u
#define KVD_AWS_SCALE 2000.0

/* "none", "avgpool", "maxpool", "adaptive" (ReST-KV's --pooling names); NULL if invalid. */
const char *kvd_pool_mode_to_string(enum kvd_pool_mode m);
/* The inverse (also accepts "avg" and "max"); _KVD_POOL_INVALID for anything else. */
enum kvd_pool_mode kvd_pool_mode_from_string(const char *s);

/*
 * Pools in[n] into out[n] with an odd kernel k (k = 1 is the identity for AVG and MAX).
 *
 * AVG:      out[j] = (1/k) * sum_{m=-k/2..k/2} in[j+m], out-of-range terms 0: the zero
 *           padding counts, so the first and last k/2 entries are attenuated (position 0 of
 *           a constant row gets (k/2+1)/k of it: 3/5 for k = 5). Summed in double.
 * MAX:      out[j] = max over the in-range in[j+m]: the padding never wins, even over -inf
 *           entries; a NaN in the window gives NaN (torch.max_pool1d).
 * ADAPTIVE: out[j] = (1/k) * sum_{m=-k/2..k/2} in[clamp(j+shift+m, 0, n-1)]: ReST-KV's
 *           replicate padding of k/2-shift on the left and k/2+shift on the right followed
 *           by an average pool with kernel k and stride 1 (a negative pad, possible only
 *           for k = 1, crops as F.pad does; the clamp gives the same result). Summed in
 *           double. Take (kernel, shift) from kvd_aws_params().
 * NONE:     out = in (in == out allowed).
 * shift must be 0 unless mode is ADAPTIVE.
 *
 * Returns 0, or -EINVAL for a NULL pointer with n > 0, an even or zero kernel (AVG, MAX,
 * ADAPTIVE), a non-zero shift outside ADAPTIVE, or an invalid mode.
 */
int kvd_pool_row_ref(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift, const float *in,
		     uint32_t n, float *out);
int kvd_pool_row(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift, const float *in,
		 uint32_t n, float *out);

/*
 * ReST-KV adaptive window pooling parameters of one head (docs/algorithms.md §1.5), exactly as
 * published:
 *
 *   half = floor(w/2); rows 0..half-1 are the first half and row q+half is paired with row q
 *   (for odd w the newest row is left out, as in the published pairing);
 *   P(t) = the mean position of the top-K entries of row t over ALL L positions, K = topk
 *   (the capacity minus the window; clamped to L);
 *   t_h  = mean_{q<half} P(q) - mean_{q<half} P(q+half)   (> 0: later queries look back);
 *   k_h  = max(k_min, 2*floor(|t_h|/scale) + 1);
 *   sigma_h = floor(t_h/scale) if t_h > 0, else floor(t_h/scale) + 1,
 *
 * with floor(a/b) Python's float floor division (CPython's float_floor_div: fmod-based, so
 * exact multiples land exactly). Consequences of the literal rule: sigma is truncation toward
 * zero for t_h > 0 and for non-multiples below 0; an exact negative multiple -m*scale gives
 * -m+1 (one step smaller in magnitude); and t_h == 0 exactly gives sigma = +1, as the
 * published formula says, although its prose says the shift is non-zero only when
 * t >= scale or t < -scale; we follow the formula (docs/algorithms.md §1.5).
 *
 * Ranking: positions are ordered by value, descending, with ties broken toward the lower
 * position (a stable descending sort); -0 equals +0 and NaN ranks below every number,
 * -inf included. So the top-K set, and t_h, are deterministic whatever the input. t_h is
 * computed exactly from integer position sums (then one rounding to double), where PyTorch
 * computes fp32 means; the two differ only when t_h is within fp32 rounding of a multiple
 * of scale. w < 2 gives t_h = 0 (no pairs).
 *
 * probs: [w][L], row t at probs + t * stride (kvd_attn_head() output: stride = L).
 * The _ref path sorts each row; the optimised path makes one to three vector passes per row.
 *
 * Returns 0, or -EINVAL for NULL pointers, w == 0, L == 0, stride < L, topk == 0, an even or
 * zero k_min, or a scale that is not finite and > 0; -ERANGE if k_h would not fit in 31 bits
 * (a tiny scale); -ENOMEM.
 */
struct kvd_aws {
	uint32_t kernel; /* k_h, odd, >= k_min */
	int32_t shift;   /* sigma_h */
	double t;        /* t_h, in positions */
};

int kvd_aws_params_ref(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		       uint32_t k_min, double scale, struct kvd_aws *ret);
int kvd_aws_params(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		   uint32_t k_min, double scale, struct kvd_aws *ret);

/*
 * The (kernel, shift) rule alone, from a given t (used by both paths above, and by the
 * tests to check the published rounding at chosen t). Same errors as above for k_min and
 * scale, -EINVAL for a non-finite t, -ERANGE on overflow.
 */
int kvd_aws_from_t(double t, uint32_t k_min, double scale, struct kvd_aws *ret);
