/* SPDX-License-Identifier: MIT */
/*
 * The optimised window attention (see attn.h): the queries are converted, pre-scaled and
 * transposed once (Q^T, d x w); keys are converted to fp32 in tiles of KT_TILE rows, kept
 * row-major, and K_tile Q^T is one gemm whose result (KT_TILE x w) is transposed into the
 * probability rows: transposing the small result rather than the d-wide key tile moves
 * d/w times fewer elements. Then each row gets a vectorised softmax over the keys it may
 * see. One head per call: threads over heads belong to the caller (score.c).
 */
#include <errno.h>
#include <stdlib.h>

#include "attn.h"
#include "dtype.h"
#include "simd.h"

/* Keys per tile: the converted tile (128 x d fp32, 64 KiB at d = 128) stays in L2. */
#define KT_TILE 128u

size_t kvd_attn_scratch_floats(const struct kvd_attn_in *in) {
	/* Q^T, the key tile, the tile's logits, one converted query row. */
	return (size_t)in->window * in->dim + (size_t)KT_TILE * in->dim +
	       (size_t)KT_TILE * in->window + in->dim;
}

int kvd_attn_head_buf(const struct kvd_attn_in *in, uint32_t h, float *probs, float *scratch) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t w, L, d, g;
	size_t es;
	float *qt, *kt, *st, *row;

	if (kvd_attn_in_check(in) < 0 || h >= in->heads || !probs || !scratch)
		return -EINVAL;
	w = in->window, L = in->len, d = in->dim, g = kvd_attn_kv_head(in, h);
	es = kvd_dtype_size(in->dtype);
	qt = scratch, kt = qt + (size_t)w * d, st = kt + (size_t)KT_TILE * d;
	row = st + (size_t)KT_TILE * w;

	for (uint32_t t = 0; t < w; t++) {
		ops->to_f32((const char *)in->q + (h * in->q_head_stride + t * in->q_row_stride) * es,
			    in->dtype, d, in->scale, row);
		for (uint32_t j = 0; j < d; j++)
			qt[(size_t)j * w + t] = row[j];
	}
	for (uint32_t i0 = 0; i0 < L; i0 += KT_TILE) {
		uint32_t n = L - i0 < KT_TILE ? L - i0 : KT_TILE;

		if (in->k_row_stride == d)
			/* Contiguous rows: one call; per-row calls cost as much as converting. */
			ops->to_f32((const char *)in->k + (g * in->k_head_stride + (size_t)i0 * d) * es,
				    in->dtype, (size_t)n * d, 1.0f, kt);
		else
			for (uint32_t r = 0; r < n; r++) {
				size_t off = g * in->k_head_stride + (size_t)(i0 + r) * in->k_row_stride;

				ops->to_f32((const char *)in->k + off * es, in->dtype, d, 1.0f,
					    kt + (size_t)r * d);
			}
		ops->gemm(n, w, d, kt, d, qt, w, st, w, 0);
		for (uint32_t t = 0; t < w; t++) {
			float *p = probs + (size_t)t * L + i0;

			for (uint32_t r = 0; r < n; r++)
				p[r] = st[(size_t)r * w + t];
		}
	}
	for (uint32_t t = 0; t < w; t++) {
		float *p = probs + (size_t)t * L, m, s;
		uint32_t visible = L - w + t + 1;

		m = ops->max(p, visible);
		s = ops->exp_sum(p, visible, m);
		ops->scale(p, visible, 1.0f / s);
		for (uint32_t i = visible; i < L; i++)
			p[i] = 0;
	}
	return 0;
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
