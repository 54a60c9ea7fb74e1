/* SPDX-License-Identifier: MIT */
/*
 * The optimised Gram blocks: the C x nh*d slice X of wo is converted to fp32 once, in both
 * orientations, and G = X^T X is one gemm. Only the upper triangle is needed in principle,
 * but this runs once per model and layer, so the simpler full product is kept.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "gram.h"
#include "simd.h"

int kvd_gram(const struct kvd_wo *wo, uint32_t h0, uint32_t nh, float *g) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t C, n;
	size_t es;
	float *x, *xt;

	if (kvd_wo_check(wo) < 0 || !g || nh == 0 || h0 >= wo->heads || nh > wo->heads - h0)
		return -EINVAL;
	C = wo->c_out, n = nh * wo->dim, es = kvd_dtype_size(wo->dtype);
	x = malloc((size_t)C * n * sizeof(float) * 2);
	if (!x)
		return -ENOMEM;
	xt = x + (size_t)C * n;
	for (uint32_t c = 0; c < C; c++) {
		const char *row = (const char *)wo->w + (c * wo->row_stride + (size_t)h0 * wo->dim) * es;

		ops->to_f32(row, wo->dtype, n, 1.0f, x + (size_t)c * n);
		for (uint32_t a = 0; a < n; a++)
			xt[(size_t)a * C + c] = x[(size_t)c * n + a];
	}
	ops->gemm(n, n, C, xt, C, x, n, g, n, 0);
	free(x);
	return 0;
}

void kvd_gram_fold(uint32_t d, const float *g, size_t ld, float scale, float *u) {
	/* u = scale g^T first (simd.h's transpose, W x W blocks in registers), so that the sums
	 * below read both operands along rows. */
	kvd_simd()->to_f32_t(g, KVD_DTYPE_F32, ld, d, d, scale, u, d);
	for (uint32_t a = 0; a < d; a++) {
		float *row = u + (size_t)a * d;
		const float *ga = g + a * ld;

		memset(row, 0, a * sizeof(float));
		row[a] = scale * ga[a];
		for (uint32_t b = a + 1; b < d; b++)
			row[b] += scale * ga[b];
	}
}
