/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Window attention: the building block of every attention-based score. For query head h,
 * A_h = softmax(scale * Q_h K_g^T) over all L resident keys, for the last w queries
 * (oldest first), where g = h / (heads / kv_heads) is the kv head h reads (GQA). The
 * window queries sit at the last w positions: row t (0..w-1) may see keys 0..L-w+t, so
 * the mask is causal inside the window only. Accumulation and the softmax are fp32
 * whatever the input dtype.
 *
 * Tensors are views with element strides, so that npy arrays, daemon scratch buffers and
 * sub-blocks all fit: element j of row i of head h of q is at
 * q + (h * q_head_stride + i * q_row_stride + j) * dtype_size. k and v likewise, indexed by
 * kv head.
 *
 * Non-finite inputs: a NaN or inf in q or k makes the logits of its row non-finite; the
 * softmax then follows IEEE arithmetic (a row with a NaN logit is all NaN). Callers that
 * select on these probabilities treat NaN as described in select.h.
 */

#include <stddef.h>
#include <stdint.h>

struct kvd_attn_in {
	uint32_t dtype;              /* KVD_DTYPE_F16, _BF16 or _F32, for q, k and v */
	uint32_t heads, kv_heads;    /* H, Hkv; H % Hkv == 0 */
	uint32_t window, len, dim;   /* w, L, d; 1 <= w <= L */
	float scale;                 /* softmax temperature, usually 1/sqrt(d) */
	const void *q;               /* [H][w][d] */
	size_t q_head_stride, q_row_stride;
	const void *k;               /* [Hkv][L][d] */
	size_t k_head_stride, k_row_stride;
	const void *v;               /* [Hkv][L][d]; may be NULL for kernels that do not read it */
	size_t v_head_stride, v_row_stride;
};

/* Fills the strides of a contiguous [H][w][d] q and [Hkv][L][d] k and v. */
void kvd_attn_in_contiguous(struct kvd_attn_in *in);

/* Returns 0 if in is consistent (shapes, dtype, non-NULL q and k), else -EINVAL. */
int kvd_attn_in_check(const struct kvd_attn_in *in);

/* The kv head that query head h reads. */
static inline uint32_t kvd_attn_kv_head(const struct kvd_attn_in *in, uint32_t h) {
	return h / (in->heads / in->kv_heads);
}

/*
 * A_h for query head h into probs[w][L] (row-major, fp32); entries a row may not see are 0.
 * _ref is the plain-C reference: an obvious loop nest. The other is the optimised path.
 * Both return 0 or -EINVAL; kvd_attn_head also -ENOMEM (its scratch).
 */
int kvd_attn_head_ref(const struct kvd_attn_in *in, uint32_t h, float *probs);
int kvd_attn_head(const struct kvd_attn_in *in, uint32_t h, float *probs);

/*
 * kvd_attn_head with caller-provided scratch, for loops over heads that should not
 * allocate: scratch holds kvd_attn_scratch_floats(in) floats (64-byte alignment helps).
 * Same results and errors as kvd_attn_head.
 */
size_t kvd_attn_scratch_floats(const struct kvd_attn_in *in);
int kvd_attn_head_buf(const struct kvd_attn_in *in, uint32_t h, float *probs, float *scratch);

/*
 * A_h of the nh query heads h0 .. h0+nh-1, which must read the same kv head (at most
 * H/Hkv of them), into probs[nh][w][L] (the map of head h0 + j at probs + j * w * L): the
 * keys are read and converted once for all of them, so a whole GQA group costs little more
 * than one head in memory traffic. Each map is exactly what kvd_attn_head_buf writes for
 * its head; scratch as there. Returns 0 or -EINVAL.
 */
int kvd_attn_heads_buf(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, float *probs,
		       float *scratch);
