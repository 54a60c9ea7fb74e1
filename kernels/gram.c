/* SPDX-License-Identifier: MIT */
/*
 * The optimised Gram blocks: the C x nh*d slice X of wo is converted to fp32 once (read in
 * place when it is fp32), transposed once, and G = X^T X is its upper part in gemms, then
 * mirrored.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "gram.h"
#include "simd.h"

/* Rows of G per gemm (a multiple of every micro-tile's rows). */
#define GRAM_PANEL 32u

int kvd_gram(const struct kvd_wo *wo, uint32_t h0, uint32_t nh, float *g) {
	const struct kvd_simd_ops *ops = kvd_simd();
	bool f32 = wo && wo->dtype == KVD_DTYPE_F32;
	const float *b;
	uint32_t C, n;
	size_t es, ldb;
	float *x, *xt;

	if (kvd_wo_check(wo) < 0 || !g || nh == 0 || h0 >= wo->heads || nh > wo->heads - h0)
		return -EINVAL;
	C = wo->c_out, n = nh * wo->dim, es = kvd_dtype_size(wo->dtype);
	/* fp32 input is read where it is (the gemm takes its row stride); others converted. */
	x = malloc((size_t)C * n * sizeof(float) * (f32 ? 1 : 2));
	if (!x)
		return -ENOMEM;
	xt = f32 ? x : x + (size_t)C * n;
	b = f32 ? (const float *)wo->w + (size_t)h0 * wo->dim : x;
	ldb = f32 ? wo->row_stride : n;
	if (!f32)
		for (uint32_t c = 0; c < C; c++)
			ops->to_f32((const char *)wo->w + (c * wo->row_stride + (size_t)h0 * wo->dim) * es,
			            wo->dtype, n, 1.0f, x + (size_t)c * n);
	/* X^T in register blocks: element by element, its writes a row apart missed the cache
	 * at every one (two thirds of a Gram's time, with C 4096). */
	ops->to_f32_t(b, KVD_DTYPE_F32, ldb, C, n, 1.0f, xt, C);
	/* G is symmetric: each panel of GRAM_PANEL rows from its diagonal on (5/8 of the
	 * products at d 128), then the rest mirrored. g[r][c] and g[c][r] are the same products
	 * summed in the same order, so the mirror is what the full product would give. */
	for (uint32_t i = 0; i < n; i += GRAM_PANEL) {
		uint32_t m = n - i < GRAM_PANEL ? n - i : GRAM_PANEL;

		ops->gemm(m, n - i, C, xt + (size_t)i * C, C, b + i, ldb, g + (size_t)i * n + i, n, 0);
	}
	for (uint32_t r = GRAM_PANEL; r < n; r++)
		for (uint32_t c = 0; c < r / GRAM_PANEL * GRAM_PANEL; c++)
			g[(size_t)r * n + c] = g[(size_t)c * n + r];
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
