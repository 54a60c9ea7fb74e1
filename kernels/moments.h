/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * MomentKV (docs/algorithms.md §4): moment statistics of the evicted set of one (sequence,
 * layer, kv head), and what they are used for.
 *
 * The summary of n evicted tokens (k_j, v_j) is n, mu_k = mean k_j, mu_v = mean v_j, the
 * value-key covariance C_vk = (1/n) sum (v_j - mu_v)(k_j - mu_k)^T and the diagonal of the
 * key covariance var_k = (1/n) sum (k_j - mu_k)^2, all fp32 (n is exact). Summaries merge
 * exactly (Chan/Welford, §4.3), so folding tokens in batches, in any grouping, gives the
 * summary of the union up to fp32 rounding.
 *
 * Use 1, inference (§4.2): for a query q, the evicted keys contribute to attention as one
 * virtual entry with logit s q.mu_k + ln n and the query-dependent value mu_v + s C_vk q,
 * merged into the online softmax like any key (the first-order, "plain" form; its value is
 * exact for jointly Gaussian keys and values, its mass a Jensen underestimate). The
 * mass-corrected form adds s^2 q^T diag(var_k) q / 2 to the logit, the Gaussian mass with
 * the diagonal of the key covariance; keys are not Gaussian, and on kvd-lm that estimate
 * passes the exact log-mass by up to 490 (docs/algorithms.md §4.2). The bounded form caps
 * the Gaussian log-mass by two upper bounds of the exact one, from two scalars the summary
 * also keeps: ln n + s ||q|| max_j ||k_j|| and ln n + s q.mu_k + s ||q|| R, R >= max_j
 * ||k_j - mu_k||; every form's logit is at least the plain one, which is a lower bound.
 *
 * Use 2, eviction (§4.4, kvd-mi): the misfit of a resident token j for the window queries,
 * mean over the queries of x_j(q)^2 with x_j(q) = s q.(k_j - mu_k), the linearisation error
 * the summary would make if j joined it.
 *
 * Each computing kernel has a plain-C reference (*_ref, moments_ref.c: the obvious loops,
 * double accumulation) and an optimised CPU path (moments.c, on simd.h's gemm), compared by
 * tests/kernels/test-moments.c. Everything is reentrant; nothing allocates but where said.
 */

#include <stddef.h>
#include <stdint.h>

#include "attn.h"

/* A summary: views of caller-owned arrays (in the pool, for the daemon and engines). */
struct kvd_moments {
	uint64_t count;        /* n: tokens folded in; 0 is the empty summary */
	uint32_t dim;          /* d */
	float key_norm_max;    /* max_j ||k_j|| (exact, through merges too) */
	float key_radius;      /* R >= max_j ||k_j - mu_k||: exact after a batch, a bound after
	                        * a merge (the two radii plus each mean's move) */
	float *mean_k;         /* [d] */
	float *mean_v;         /* [d] */
	float *var_k;          /* [d] */
	float *cov_vk;         /* [d][d], row-major: cov_vk[a * d + b] = C_vk(v_a, k_b) */
};

/* Floats a summary of dimension d holds (its four arrays, in the order above; the scalars
 * live apart, e.g. in kvd_moments_header). */
static inline size_t kvd_moments_floats(uint32_t d) {
	return (size_t)d * (3 + (size_t)d);
}

/* Points m's arrays into f (kvd_moments_floats(d) floats, in that order); count and the
 * key bounds 0. */
void kvd_moments_view(struct kvd_moments *m, uint32_t d, float *f);

/* Sets m to the empty summary (count, bounds and arrays 0). */
void kvd_moments_clear(struct kvd_moments *m);

/*
 * The summary of the n rows k[i * k_stride], v[i * v_stride] (elements, dtype KVD_KERNEL_*,
 * d = out->dim each) into out, which it overwrites (n 0: the empty summary). Two passes
 * (means, then centred sums), so that large means cost no precision. Returns 0 or -EINVAL;
 * kvd_moments_batch also -ENOMEM (its scratch).
 */
int kvd_moments_batch_ref(const void *k, size_t k_stride, const void *v, size_t v_stride,
			  uint32_t dtype, uint32_t n, struct kvd_moments *out);
int kvd_moments_batch(const void *k, size_t k_stride, const void *v, size_t v_stride,
		      uint32_t dtype, uint32_t n, struct kvd_moments *out);

/*
 * Folds summary b into a (same dim): a becomes the summary of both sets (§4.3). O(d^2),
 * one implementation. Returns 0, or -EINVAL (dims differ), -EOVERFLOW (the count would
 * wrap; a is unchanged).
 */
int kvd_moments_merge(struct kvd_moments *a, const struct kvd_moments *b);

/* Forms of the correction. */
enum kvd_moments_form {
	KVD_MOMENTS_PLAIN,     /* first order: logit s q.mu_k + ln n */
	KVD_MOMENTS_MASS,      /* + s^2 q^T diag(var_k) q / 2: the Gaussian mass */
	KVD_MOMENTS_BOUNDED,   /* the Gaussian mass capped by the key bounds (above) */
	_KVD_MOMENTS_FORM_MAX,
	_KVD_MOMENTS_FORM_INVALID = -1,
};

/*
 * The bounded form's logit (one implementation, used by both paths): from the plain logit,
 * the Gaussian term s^2 q^T diag(var_k) q / 2 and ||q||, for a summary with count > 0.
 */
double kvd_moments_bounded_logit(const struct kvd_moments *m, float scale, double plain,
				 double gauss, double q_norm);

/*
 * The virtual entries of the queries q[r * ldq] (r < rows, fp32, d = m->dim each): logit[r]
 * and value[r * d ..] = mu_v + scale C_vk q_r. For an empty summary every logit is -inf
 * (the entry weighs nothing) and the values are 0. Returns 0 or -EINVAL.
 */
int kvd_moments_entries_ref(const struct kvd_moments *m, enum kvd_moments_form form, float scale,
			    const float *q, size_t ldq, uint32_t rows, float *logit, float *value);
int kvd_moments_entries(const struct kvd_moments *m, enum kvd_moments_form form, float scale,
			const float *q, size_t ldq, uint32_t rows, float *logit, float *value);

/*
 * Merges one entry (logit, value[d]) into an online-softmax state: running max *mx, sum of
 * weights *l and unnormalised output o[d] (o = sum e^{z - mx} v). A state with *mx = -inf
 * is empty; an entry with logit -inf changes nothing.
 */
void kvd_moments_softmax_add(float *mx, float *l, float *o, uint32_t d, float logit,
			     const float *value);

/*
 * Attention over kept tokens plus the correction: for each query row r (q[r * ldq], fp32),
 * softmax over the first visible[r] keys (all len when visible is NULL) of k/v (fp32 rows
 * of d at k_stride/v_stride floats) and the virtual entry of m (NULL or empty: none), times
 * the values, into out[r * d ..]. Without m, the rows' entries may be given instead:
 * ent_logit[r] and ent_value[r * d ..] (another summary's, e.g. IndexMem's latent memory,
 * indexmem.h; NULL: none). A row that sees nothing gets 0. Returns 0, -EINVAL (also both m
 * and entries given) or -ENOMEM (scratch).
 */
struct kvd_attn_moments_in {
	uint32_t dim, len, rows;
	float scale;
	const float *q;
	size_t ldq;
	const float *k, *v;
	size_t k_stride, v_stride;
	const uint32_t *visible;
	const struct kvd_moments *m;
	enum kvd_moments_form form;
	const float *ent_logit, *ent_value;
};

/* Returns 0 if in and out are consistent, else -EINVAL (what both paths check). */
int kvd_attn_moments_in_check(const struct kvd_attn_moments_in *in, const float *out);

int kvd_attn_moments_ref(const struct kvd_attn_moments_in *in, float *out);
int kvd_attn_moments(const struct kvd_attn_moments_in *in, float *out);

/*
 * The kvd-mi misfit of one kv head's prefix: for every key i < in->len - in->window of kv
 * head kv_head, out[i] = mean over the window queries of the group's query heads of
 * (in->scale q.(k_i - mean_k))^2, where mean_k[in->dim] is the summary's key mean. Returns
 * 0 or -EINVAL; kvd_moments_misfit also -ENOMEM.
 */
int kvd_moments_misfit_ref(const struct kvd_attn_in *in, uint32_t kv_head, const float *mean_k,
			   float *out);
int kvd_moments_misfit(const struct kvd_attn_in *in, uint32_t kv_head, const float *mean_k,
		       float *out);
