/* SPDX-License-Identifier: MIT */
/*
 * The optimised LaProx-style costs (see laprox.h). Column norms and column products
 * stream over the window rows with vector multiply-adds; the v G v^T terms of a tile of
 * TOK_TILE tokens are gemms against the Gram blocks. In the joint form only the blocks
 * h' >= h are multiplied (G_h'h = G_hh'^T, so v G_h'h v^T = v G_hh' v^T): g(g+1)/2 d^2
 * per token instead of g^2 d^2.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "laprox.h"
#include "simd.h"

#define TOK_TILE 64u

static void load_tile(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
		      uint32_t i0, uint32_t nt, float *vt) {
	size_t es = kvd_dtype_size(in->dtype);

	if (in->v_row_stride == in->dim) {
		/* Contiguous rows: one call (per-row calls cost as much as the conversion). */
		ops->to_f32((const char *)in->v + (g * in->v_head_stride + (size_t)i0 * in->dim) * es,
			    in->dtype, (size_t)nt * in->dim, 1.0f, vt);
		return;
	}
	for (uint32_t r = 0; r < nt; r++)
		ops->to_f32((const char *)in->v +
				    (g * in->v_head_stride + (size_t)(i0 + r) * in->v_row_stride) * es,
			    in->dtype, in->dim, 1.0f, vt + (size_t)r * in->dim);
}

int kvd_laprox_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, float *cost) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t w, L, n, d, g;
	float *vt, *ut;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || !probs || !cost)
		return -EINVAL;
	w = in->window, L = in->len, n = L - w, d = in->dim, g = kvd_attn_kv_head(in, h);
	vt = malloc((size_t)2 * TOK_TILE * d * sizeof(float));
	if (!vt)
		return -ENOMEM;
	ut = vt + (size_t)TOK_TILE * d;
	memset(cost, 0, n * sizeof(float));
	for (uint32_t t = 0; t < w; t++)
		ops->sq_axpy(n, 1.0f, probs + (size_t)t * L, cost);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		if (!vgv) {
			load_tile(ops, in, g, i0, nt, vt);
			if (gram)
				ops->gemm(nt, d, d, vt, d, gram, d, ut, d, 0);
		}
		for (uint32_t k = 0; k < nt; k++) {
			float vn = vgv ? vgv[i0 + k] :
					 ops->dot(d, gram ? ut + (size_t)k * d : vt + (size_t)k * d,
						  vt + (size_t)k * d);

			cost[i0 + k] = sqrtf(cost[i0 + k]) * sqrtf(vn > 0 ? vn : 0);
		}
	}
	free(vt);
	return 0;
}

int kvd_laprox_group(const struct kvd_attn_in *in, uint32_t kv, const float *const *probs,
		     const float *gram_group, float *cost) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t w, L, n, d, g, npair;
	size_t ld;
	float *vt, *ut, *col;

	if (kvd_attn_in_check(in) < 0 || !in->v || kv >= in->kv_heads || !probs || !cost)
		return -EINVAL;
	g = in->heads / in->kv_heads;
	for (uint32_t j = 0; j < g; j++)
		if (!probs[j])
			return -EINVAL;
	w = in->window, L = in->len, n = L - w, d = in->dim, ld = (size_t)g * d;
	npair = g * (g + 1) / 2;
	/* vt [T][d], ut [T][g*d], col [npair][T]: the column products of the tile per pair. */
	vt = malloc(((size_t)TOK_TILE * d + (size_t)TOK_TILE * ld + (size_t)npair * TOK_TILE) *
		    sizeof(float));
	if (!vt)
		return -ENOMEM;
	ut = vt + (size_t)TOK_TILE * d, col = ut + (size_t)TOK_TILE * ld;
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE, p = 0;

		memset(col, 0, (size_t)npair * TOK_TILE * sizeof(float));
		for (uint32_t a = 0; a < g; a++)
			for (uint32_t b = a; b < g; b++, p++)
				for (uint32_t t = 0; t < w; t++)
					ops->mul_add(nt, probs[a] + (size_t)t * L + i0,
						     probs[b] + (size_t)t * L + i0, col + (size_t)p * TOK_TILE);
		load_tile(ops, in, kv, i0, nt, vt);
		for (uint32_t k = 0; k < nt; k++)
			cost[i0 + k] = 0;
		p = 0;
		for (uint32_t a = 0; a < g; a++) {
			/* ut = vt [G_aa G_a,a+1 ... G_a,g-1]: the blocks right of the diagonal. */
			if (gram_group)
				ops->gemm(nt, (g - a) * d, d, vt, d, gram_group + a * d * ld + a * d, ld,
					  ut, ld, 0);
			for (uint32_t b = a; b < g; b++, p++) {
				float f = a == b ? 1.0f : 2.0f;

				if (!gram_group && a != b)
					continue;
				for (uint32_t k = 0; k < nt; k++) {
					const float *x = vt + (size_t)k * d;
					float q = gram_group ?
							  ops->dot(d, ut + k * ld + (size_t)(b - a) * d, x) :
							  ops->dot(d, x, x);

					cost[i0 + k] += f * col[(size_t)p * TOK_TILE + k] * q;
				}
			}
		}
		for (uint32_t k = 0; k < nt; k++)
			cost[i0 + k] = sqrtf(cost[i0 + k] > 0 ? cost[i0 + k] : 0);
	}
	free(vt);
	return 0;
}

int kvd_laprox_normalize(float *c, size_t n, float lambda) {
	double sum = 0;

	if ((n && !c) || !isfinite(lambda) || lambda < 0)
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if (isfinite(c[i]))
			sum += c[i];
	for (size_t i = 0; i < n; i++)
		c[i] = sum > 0 ? (float)(lambda * (c[i] / sum)) : lambda * c[i];
	return 0;
}
