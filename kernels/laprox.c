/* SPDX-License-Identifier: MIT */
/*
 * The optimised LaProx-style costs (see laprox.h). Column norms and column products
 * stream over the window rows with vector multiply-adds. Values are converted in tiles of
 * TOK_TILE tokens, transposed (a token per column), and the v G v^T terms of a tile are
 * simd.h's quad_upper against the Gram blocks folded into upper triangles (gram.h): d(d+1)/2
 * multiply-adds per token and block, vectorised across the tokens. In the joint form only
 * the blocks h' >= h are used (v G_h'h v^T = v G_hh' v^T), the off-diagonal ones folded
 * with their factor 2: g(g+1)/2 quadratic forms per token instead of g^2.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gram.h"
#include "laprox.h"
#include "simd.h"
#include "vtile.h"

#define TOK_TILE 64u

int kvd_laprox_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, float *cost) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t w, L, n, d, g;
	float *vt, *q, *u;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || !probs || !cost)
		return -EINVAL;
	w = in->window, L = in->len, n = L - w, d = in->dim, g = kvd_attn_kv_head(in, h);
	/* vt [d][TOK_TILE], q [TOK_TILE], then G folded (d x d) when v G v^T is computed here. */
	vt = malloc(((size_t)(d + 1) * TOK_TILE + (gram && !vgv ? (size_t)d * d : 0)) *
		    sizeof(float));
	if (!vt)
		return -ENOMEM;
	q = vt + (size_t)d * TOK_TILE;
	u = gram && !vgv ? q + TOK_TILE : NULL;
	if (u)
		kvd_gram_fold(d, gram, d, 1.0f, u);
	memset(cost, 0, n * sizeof(float));
	for (uint32_t t = 0; t < w; t++)
		ops->sq_axpy(n, 1.0f, probs + (size_t)t * L, cost);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		if (!vgv) {
			kvd_vtile_t(ops, in, g, i0, nt, vt, TOK_TILE);
			kvd_vtile_quad(ops, d, nt, vt, TOK_TILE, u, q);
		}
		for (uint32_t k = 0; k < nt; k++) {
			float vn = vgv ? vgv[i0 + k] : q[k];

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
	size_t ld, dd;
	float *vt, *q, *col, *u;

	if (kvd_attn_in_check(in) < 0 || !in->v || kv >= in->kv_heads || !probs || !cost)
		return -EINVAL;
	g = in->heads / in->kv_heads;
	for (uint32_t j = 0; j < g; j++)
		if (!probs[j])
			return -EINVAL;
	w = in->window, L = in->len, n = L - w, d = in->dim, ld = (size_t)g * d, dd = (size_t)d * d;
	npair = g * (g + 1) / 2;
	/* vt [d][T], q [T], col [npair][T] (the column products of the tile per pair), then the
	 * folded blocks [npair][d][d] in pair order (a, b >= a). */
	vt = malloc(((size_t)(d + 1 + npair) * TOK_TILE + (gram_group ? npair * dd : 0)) *
		    sizeof(float));
	if (!vt)
		return -ENOMEM;
	q = vt + (size_t)d * TOK_TILE, col = q + TOK_TILE;
	u = gram_group ? col + (size_t)npair * TOK_TILE : NULL;
	for (uint32_t a = 0, p = 0; u && a < g; a++)
		for (uint32_t b = a; b < g; b++, p++)
			kvd_gram_fold(d, gram_group + a * d * ld + b * d, ld, a == b ? 1.0f : 2.0f,
				      u + p * dd);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE, p = 0;

		memset(col, 0, (size_t)npair * TOK_TILE * sizeof(float));
		for (uint32_t a = 0; a < g; a++)
			for (uint32_t b = a; b < g; b++, p++)
				for (uint32_t t = 0; t < w; t++)
					ops->mul_add(nt, probs[a] + (size_t)t * L + i0,
						     probs[b] + (size_t)t * L + i0,
						     col + (size_t)p * TOK_TILE);
		kvd_vtile_t(ops, in, kv, i0, nt, vt, TOK_TILE);
		memset(cost + i0, 0, nt * sizeof(float));
		if (u)
			for (p = 0; p < npair; p++) {
				kvd_vtile_quad(ops, d, nt, vt, TOK_TILE, u + p * dd, q);
				ops->mul_add(nt, col + (size_t)p * TOK_TILE, q, cost + i0);
			}
		else {
			/* Value space: only the diagonal pairs (a, a), each with ||v||^2. */
			kvd_vtile_quad(ops, d, nt, vt, TOK_TILE, NULL, q);
			for (uint32_t a = 0; a < g; a++)
				ops->mul_add(nt, col + (size_t)(a * g - a * (a - 1) / 2) * TOK_TILE, q,
					     cost + i0);
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
