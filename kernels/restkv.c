/* SPDX-License-Identifier: MIT */
/*
 * The optimised ReST-KV cost (see restkv.h for the contract). Values are converted to fp32
 * in tiles of TOK_TILE tokens; v G v^T of a tile (the d^2 per-token term that dominates
 * when no cached vgv is given) is a block-triangular gemm against G's folded upper
 * triangle, about half of d^2, plus a dot per row; in "before" mode the
 * per-query outputs are O = A V (a gemm over all L keys) and the cross terms of a tile are
 * (O G) V_tile^T, another gemm, aggregated over the window tile by tile through
 * smooth.h's temporal kernel so that no w x L score matrix is ever stored.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "dtype.h"
#include "restkv.h"
#include "simd.h"

#define TOK_TILE 64u

static int opts_ok(const struct kvd_restkv_opts *o) {
	if (!o || (int)o->metric < 0 || o->metric >= _KVD_RESTKV_METRIC_MAX || (int)o->temporal < 0 ||
	    o->temporal >= _KVD_TEMPORAL_MAX || !(o->tau > 0) || !isfinite(o->tau))
		return 0;
	return o->temporal != KVD_TEMPORAL_EMA || (o->alpha > 0 && o->alpha <= 1);
}

static const char *vrow_at(const struct kvd_attn_in *in, uint32_t g, uint32_t i) {
	return (const char *)in->v +
	       (g * in->v_head_stride + (size_t)i * in->v_row_stride) * kvd_dtype_size(in->dtype);
}

/* Rows i0 .. i0+nt-1 of kv head g as fp32 into vt[nt][d]: one call when the rows are
 * contiguous, since per-row calls cost as much as the conversion itself at d = 128. */
static void load_tile(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
		      uint32_t i0, uint32_t nt, float *vt) {
	if (in->v_row_stride == in->dim) {
		ops->to_f32(vrow_at(in, g, i0), in->dtype, (size_t)nt * in->dim, 1.0f, vt);
		return;
	}
	for (uint32_t r = 0; r < nt; r++)
		ops->to_f32(vrow_at(in, g, i0 + r), in->dtype, in->dim, 1.0f, vt + (size_t)r * in->dim);
}

/* Columns per chunk of the triangular product below. */
#define TRI_CHUNK 32u

/*
 * gu = the upper triangle of G with the off-diagonal pairs folded in (G_ab + G_ba above
 * the diagonal, G_aa on it, 0 below), so that v G v^T = v gu v^T with half the products.
 */
static void gram_upper(uint32_t d, const float *gram, float *gu) {
	for (uint32_t a = 0; a < d; a++)
		for (uint32_t b = 0; b < d; b++)
			gu[(size_t)a * d + b] = b < a ? 0 :
						b == a ? gram[(size_t)a * d + a] :
							 gram[(size_t)a * d + b] + gram[(size_t)b * d + a];
}

/*
 * vgv[r] = vt_r G vt_r^T for a loaded tile (gu from gram_upper(), or NULL for the identity);
 * ut is [nt][d] scratch. Column chunk j of vt gu only needs the rows a < j + TRI_CHUNK of gu,
 * so each chunk's gemm stops there: about (d/2 + TRI_CHUNK/2) d instead of d^2 per token.
 */
static void tile_vgv(const struct kvd_simd_ops *ops, uint32_t nt, uint32_t d, const float *vt,
		     const float *gu, float *ut, float *vgv) {
	if (gu)
		for (uint32_t j = 0; j < d; j += TRI_CHUNK) {
			uint32_t nc = d - j < TRI_CHUNK ? d - j : TRI_CHUNK;

			ops->gemm(nt, nc, j + nc, vt, d, gu + j, d, ut + j, d, 0);
		}
	for (uint32_t r = 0; r < nt; r++)
		vgv[r] = ops->dot(d, gu ? ut + (size_t)r * d : vt + (size_t)r * d, vt + (size_t)r * d);
}

/* og = o G (G the identity when gram is NULL). */
static void times_gram(const struct kvd_simd_ops *ops, uint32_t m, uint32_t d, const float *o,
		       const float *gram, float *og) {
	if (gram)
		ops->gemm(m, d, d, o, d, gram, d, og, d, 0);
	else
		for (size_t i = 0; i < (size_t)m * d; i++)
			og[i] = o[i];
}

static inline float clamped_root(float sq) {
	return sqrtf(sq > 0 ? sq : 0);
}

/* (o - v) G (o - v)^T without expanding it: the cancellation guard of restkv.h. x, y [d]. */
static float direct_sq(const struct kvd_simd_ops *ops, uint32_t d, const float *o, const float *v,
		       const float *gram, float *x, float *y) {
	for (uint32_t j = 0; j < d; j++)
		x[j] = o[j] - v[j];
	if (!gram)
		return ops->dot(d, x, x);
	ops->gemm(1, d, d, x, d, gram, d, y, d, 0);
	return ops->dot(d, y, x);
}

int kvd_restkv_vgv(const struct kvd_attn_in *in, uint32_t h, const float *gram, uint32_t n,
		   float *vgv) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d, g;
	float *vt;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || n > in->len || (n && !vgv))
		return -EINVAL;
	d = in->dim, g = kvd_attn_kv_head(in, h);
	vt = malloc(((size_t)2 * TOK_TILE * d + (size_t)d * d) * sizeof(float));
	if (!vt)
		return -ENOMEM;
	if (gram)
		gram_upper(d, gram, vt + (size_t)2 * TOK_TILE * d);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		load_tile(ops, in, g, i0, nt, vt);
		tile_vgv(ops, nt, d, vt, gram ? vt + (size_t)2 * TOK_TILE * d : NULL,
			 vt + (size_t)TOK_TILE * d, vgv + i0);
	}
	free(vt);
	return 0;
}

static int head_after(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
		      const float *probs, const float *gram, const float *gu, const float *vgv,
		      const struct kvd_restkv_opts *o, float *cost, float *buf) {
	uint32_t w = in->window, L = in->len, d = in->dim, n = L - w;
	float *vt = buf, *ut = vt + (size_t)TOK_TILE * d, *ov = ut + (size_t)TOK_TILE * d,
	      *og = ov + d, *x = og + d, *y = x + d, *tv = y + d, ogo;
	int r;

	/* cost holds the aggregated attention a_i until it is replaced by the cost. */
	r = kvd_temporal_agg(o->temporal, o->alpha, probs, w, L, n, cost);
	if (r < 0)
		return r;
	for (uint32_t j = 0; j < d; j++)
		ov[j] = 0;
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		load_tile(ops, in, g, i0, nt, vt);
		ops->gemm(1, d, nt, cost + i0, nt, vt, d, ov, d, 1);
	}
	times_gram(ops, 1, d, ov, gram, og);
	ogo = ops->dot(d, og, ov);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		load_tile(ops, in, g, i0, nt, vt);
		if (!vgv)
			tile_vgv(ops, nt, d, vt, gu, ut, tv);
		for (uint32_t k = 0; k < nt; k++) {
			const float *v = vt + (size_t)k * d;
			float a = cost[i0 + k], sq, norm;

			if (a >= KVD_RESTKV_A_DIRECT)
				sq = direct_sq(ops, d, ov, v, gram, x, y);
			else
				sq = ogo - 2 * ops->dot(d, og, v) + (vgv ? vgv[i0 + k] : tv[k]);
			norm = clamped_root(sq);
			cost[i0 + k] = kvd_restkv_cost(a, o->tau == 1 ? norm : powf(norm, o->tau));
		}
	}
	return 0;
}

static int head_before(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
		       const float *probs, const float *gram, const float *gu, const float *vgv,
		       const struct kvd_restkv_opts *o, float *cost, float *buf) {
	uint32_t w = in->window, L = in->len, d = in->dim, n = L - w;
	float *vt = buf, *ut = vt + (size_t)TOK_TILE * d, *tv = ut + (size_t)TOK_TILE * d,
	      *O = tv + TOK_TILE, *Y = O + (size_t)w * d, *ogo = Y + (size_t)w * d,
	      *onorm = ogo + w, *vtt = onorm + w, *cross = vtt + (size_t)d * TOK_TILE,
	      *x = cross + (size_t)w * TOK_TILE, *y = x + d;
	int r;

	/* O = A V over every key (the true per-query outputs), then Y = O G. */
	for (uint32_t i0 = 0; i0 < L; i0 += TOK_TILE) {
		uint32_t nt = L - i0 < TOK_TILE ? L - i0 : TOK_TILE;

		load_tile(ops, in, g, i0, nt, vt);
		ops->gemm(w, d, nt, probs + i0, L, vt, d, O, d, i0 > 0);
	}
	times_gram(ops, w, d, O, gram, Y);
	for (uint32_t t = 0; t < w; t++) {
		ogo[t] = ops->dot(d, Y + (size_t)t * d, O + (size_t)t * d);
		onorm[t] = o->use_norm && ogo[t] > 0 ? 1.0f / sqrtf(ogo[t]) : 1.0f;
	}
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		load_tile(ops, in, g, i0, nt, vt);
		if (!vgv)
			tile_vgv(ops, nt, d, vt, gu, ut, tv);
		else
			for (uint32_t k = 0; k < nt; k++)
				tv[k] = vgv[i0 + k];
		for (uint32_t k = 0; k < nt; k++)
			for (uint32_t j = 0; j < d; j++)
				vtt[(size_t)j * TOK_TILE + k] = vt[(size_t)k * d + j];
		ops->gemm(w, nt, d, Y, d, vtt, TOK_TILE, cross, TOK_TILE, 0);
		/* The per-query scores overwrite the cross terms, then fold over the window. */
		for (uint32_t t = 0; t < w; t++) {
			const float *p = probs + (size_t)t * L + i0;
			float *c = cross + (size_t)t * TOK_TILE;

			for (uint32_t k = 0; k < nt; k++) {
				float sq = p[k] >= KVD_RESTKV_A_DIRECT ?
						   direct_sq(ops, d, O + (size_t)t * d, vt + (size_t)k * d,
							     gram, x, y) :
						   ogo[t] - 2 * c[k] + tv[k];

				c[k] = kvd_restkv_cost(p[k], clamped_root(sq) * onorm[t]);
			}
		}
		r = kvd_temporal_agg(o->temporal, o->alpha, cross, w, TOK_TILE, nt, cost + i0);
		if (r < 0)
			return r;
	}
	return 0;
}

int kvd_restkv_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		    float *cost) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d, w;
	size_t need;
	float *buf, *gu;
	int r;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || !probs || !cost || !opts_ok(o))
		return -EINVAL;
	d = in->dim, w = in->window;
	/* The larger of the two modes' scratch (see their pointer carving). */
	need = (size_t)3 * TOK_TILE * d + TOK_TILE + 2 * (size_t)w * d + 2 * w +
	       (size_t)w * TOK_TILE + 4 * (size_t)d;
	/* Plus gu, d x d, at the end (only needed when v G v^T is computed here). */
	buf = malloc((need + (size_t)d * d) * sizeof(float));
	if (!buf)
		return -ENOMEM;
	gu = gram && !vgv ? buf + need : NULL;
	if (gu)
		gram_upper(d, gram, gu);
	if (o->metric == KVD_RESTKV_AFTER)
		r = head_after(ops, in, kvd_attn_kv_head(in, h), probs, gram, gu, vgv, o, cost, buf);
	else
		r = head_before(ops, in, kvd_attn_kv_head(in, h), probs, gram, gu, vgv, o, cost,
				buf);
	free(buf);
	return r;
}
