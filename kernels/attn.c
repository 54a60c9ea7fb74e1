/* SPDX-License-Identifier: MIT */
/*
 * The optimised window attention (see attn.h), for the query heads that share one kv head
 * (GQA) at once: their queries are converted and pre-scaled once, row-major; keys are
 * converted to fp32 in tiles of KT_TILE rows, transposed as they are converted (d x tile),
 * and Q K_tile^T for all the heads' rows is one gemm that writes the logits straight into
 * the probability rows. So each key tile is converted once per kv head rather than once per
 * query head, and the results need no transpose. Then each row gets a vectorised softmax
 * over the keys it may see. Threads over heads or kv heads belong to the caller (score.c).
 */
#include <errno.h>
#include <stdlib.h>

#include "attn.h"
#include "dtype.h"
#include "simd.h"

/* Keys per tile: the transposed tile (d x 64 fp32, 32 KiB at d = 128) stays in L1 while every
 * head's gemm sweeps it. */
#define KT_TILE 64u

size_t kvd_attn_scratch_floats(const struct kvd_attn_in *in) {
	/* The queries of every head of a group, the transposed key tile. */
	return (size_t)(in->heads / in->kv_heads) * in->window * in->dim +
	       (size_t)in->dim * KT_TILE;
}

int kvd_attn_heads_buf(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, float *probs,
		       float *scratch) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t w, L, d, g;
	size_t es;
	float *qs, *kt;

	if (kvd_attn_in_check(in) < 0 || nh == 0 || h0 >= in->heads || nh > in->heads - h0 ||
	    kvd_attn_kv_head(in, h0) != kvd_attn_kv_head(in, h0 + nh - 1) || !probs || !scratch)
		return -EINVAL;
	w = in->window, L = in->len, d = in->dim, g = kvd_attn_kv_head(in, h0);
	es = kvd_dtype_size(in->dtype);
	qs = scratch, kt = qs + (size_t)nh * w * d;

	for (uint32_t j = 0; j < nh; j++)
		for (uint32_t t = 0; t < w; t++)
			ops->to_f32((const char *)in->q +
					    ((h0 + j) * in->q_head_stride + t * in->q_row_stride) * es,
				    in->dtype, d, in->scale, qs + ((size_t)j * w + t) * d);
	for (uint32_t i0 = 0; i0 < L; i0 += KT_TILE) {
		uint32_t n = L - i0 < KT_TILE ? L - i0 : KT_TILE;

		ops->to_f32_t((const char *)in->k +
				      (g * in->k_head_stride + (size_t)i0 * in->k_row_stride) * es,
			      in->dtype, in->k_row_stride, n, d, 1.0f, kt, KT_TILE);
		/* The maps are consecutive: one gemm covers every row of every head. */
		ops->gemm(nh * w, n, d, qs, d, kt, KT_TILE, probs + i0, L, 0);
	}
	for (uint32_t j = 0; j < nh; j++)
		for (uint32_t t = 0; t < w; t++) {
			float *p = probs + ((size_t)j * w + t) * L, m, s;
			uint32_t visible = L - w + t + 1;

			m = ops->max(p, visible);
			s = ops->exp_sum(p, visible, m);
			ops->scale(p, visible, 1.0f / s);
			for (uint32_t i = visible; i < L; i++)
				p[i] = 0;
		}
	return 0;
}

int kvd_attn_head_buf(const struct kvd_attn_in *in, uint32_t h, float *probs, float *scratch) {
	return kvd_attn_heads_buf(in, h, 1, probs, scratch);
}

int kvd_attn_head(const struct kvd_attn_in *in, uint32_t h, float *probs) {
	float *scratch;
	int r;

	if (kvd_attn_in_check(in) < 0)
		return -EINVAL;
	scratch = malloc(kvd_attn_scratch_floats(in) * sizeof(float));
	if (!scratch)
		return -ENOMEM;
	r = kvd_attn_head_buf(in, h, probs, scratch);
	free(scratch);
	return r;
}
