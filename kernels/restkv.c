/* SPDX-License-Identifier: MIT */
/*
 * The optimised ReST-KV cost (see restkv.h for the contract), for the query heads that
 * read one kv head at once (GQA), so that each value tile is read and converted once for
 * all of them rather than once per head. Values are converted to fp32 in tiles of TOK_TILE
 * tokens: row-major where the outputs o = A V are accumulated (one gemm for all the heads),
 * transposed (d x tile, a token per column) where the per-token terms are formed, so that
 * (o G) . v is one gemm for all the heads and v G v^T (the d^2 term that dominates when no
 * cached vgv is given) is simd.h's quad_upper against G folded into its upper triangle:
 * d(d+1)/2 multiply-adds per token, vectorised across tokens. In "before" mode the
 * per-query cross terms (O G) V_tile^T are a gemm per head, aggregated over the window tile
 * by tile through smooth.h's temporal kernel so that no w x L score matrix is ever stored.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gram.h"
#include "restkv.h"
#include "simd.h"
#include "vtile.h"

#define TOK_TILE 64u

static int opts_ok(const struct kvd_restkv_opts *o) {
	if (!o || (int)o->metric < 0 || o->metric >= _KVD_RESTKV_METRIC_MAX || (int)o->temporal < 0 ||
	    o->temporal >= _KVD_TEMPORAL_MAX || !(o->tau > 0) || !isfinite(o->tau))
		return 0;
	return o->temporal != KVD_TEMPORAL_EMA || (o->alpha > 0 && o->alpha <= 1);
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

/*
 * (o - v_k) G (o - v_k)^T without expanding it, v_k column k of a transposed tile: the
 * cancellation guard of restkv.h. x, y [d] scratch.
 */
static float direct_sq(const struct kvd_simd_ops *ops, uint32_t d, const float *o, const float *vt,
		       uint32_t k, const float *gram, float *x, float *y) {
	for (uint32_t j = 0; j < d; j++)
		x[j] = o[j] - vt[(size_t)j * TOK_TILE + k];
	if (!gram)
		return ops->dot(d, x, x);
	ops->gemm(1, d, d, x, d, gram, d, y, d, 0);
	return ops->dot(d, y, x);
}

int kvd_restkv_vgv(const struct kvd_attn_in *in, uint32_t h, const float *gram, uint32_t n,
		   float *vgv) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d, g;
	float *vt, *gu;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || n > in->len || (n && !vgv))
		return -EINVAL;
	d = in->dim, g = kvd_attn_kv_head(in, h);
	vt = malloc(((size_t)TOK_TILE * d + (size_t)d * d) * sizeof(float));
	if (!vt)
		return -ENOMEM;
	gu = gram ? vt + (size_t)TOK_TILE * d : NULL;
	if (gu)
		kvd_gram_fold(d, gram, d, 1.0f, gu);
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		kvd_vtile_t(ops, in, g, i0, nt, vt, TOK_TILE);
		kvd_vtile_quad(ops, d, nt, vt, TOK_TILE, gu, vgv + i0);
	}
	free(vt);
	return 0;
}

/*
 * "after" for the nh heads of kv head g: each head's aggregated attention a (held in its cost
 * row until it becomes the cost), the outputs o = a V of all the heads in one pass over
 * row-major tiles, then one pass over transposed tiles for the per-token terms.
 */
static int heads_after(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
		       uint32_t nh, const float *probs, const float *gram, const float *gu,
		       const float *vgv, const struct kvd_restkv_opts *o, float *cost, float *buf) {
	uint32_t w = in->window, L = in->len, d = in->dim, n = L - w;
	size_t wl = (size_t)w * L;
	float *vt = buf, *ov = vt + (size_t)TOK_TILE * d, *og = ov + (size_t)nh * d,
	      *ogo = og + (size_t)nh * d, *dots = ogo + nh, *tv = dots + (size_t)nh * TOK_TILE,
	      *x = tv + TOK_TILE, *y = x + d;
	int r;

	for (uint32_t j = 0; j < nh; j++) {
		r = kvd_temporal_agg(o->temporal, o->alpha, probs + j * wl, w, L, n,
				     cost + (size_t)j * n);
		if (r < 0)
			return r;
	}
	memset(ov, 0, (size_t)nh * d * sizeof(float));
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		kvd_vtile(ops, in, g, i0, nt, vt);
		ops->gemm(nh, d, nt, cost + i0, n, vt, d, ov, d, 1);
	}
	for (uint32_t j = 0; j < nh; j++) {
		times_gram(ops, 1, d, ov + (size_t)j * d, gram ? gram + (size_t)j * d * d : NULL,
			   og + (size_t)j * d);
		ogo[j] = ops->dot(d, og + (size_t)j * d, ov + (size_t)j * d);
	}
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		kvd_vtile_t(ops, in, g, i0, nt, vt, TOK_TILE);
		ops->gemm(nh, nt, d, og, d, vt, TOK_TILE, dots, TOK_TILE, 0);
		for (uint32_t j = 0; j < nh; j++) {
			const float *gj = gram ? gram + (size_t)j * d * d : NULL;
			float *c = cost + (size_t)j * n + i0;

			if (!vgv)
				kvd_vtile_quad(ops, d, nt, vt, TOK_TILE,
					       gu ? gu + (size_t)j * d * d : NULL, tv);
			for (uint32_t k = 0; k < nt; k++) {
				float a = c[k], sq, norm;

				if (a >= KVD_RESTKV_A_DIRECT)
					sq = direct_sq(ops, d, ov + (size_t)j * d, vt, k, gj, x, y);
				else
					sq = ogo[j] - 2 * dots[(size_t)j * TOK_TILE + k] +
					     (vgv ? vgv[(size_t)j * n + i0 + k] : tv[k]);
				norm = clamped_root(sq);
				c[k] = kvd_restkv_cost(a, o->tau == 1 ? norm : powf(norm, o->tau));
			}
		}
	}
	return 0;
}

/*
 * "before" for the nh heads of kv head g: each head's per-query outputs O = A V over every
 * key (one pass over row-major tiles), then per transposed tile and head the cross terms
 * (O G) V_tile^T, the per-query scores and their fold over the window.
 */
static int heads_before(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in, uint32_t g,
			uint32_t nh, const float *probs, const float *gram, const float *gu,
			const float *vgv, const struct kvd_restkv_opts *o, float *cost, float *buf) {
	uint32_t w = in->window, L = in->len, d = in->dim, n = L - w;
	size_t wd = (size_t)w * d, wl = (size_t)w * L;
	float *vt = buf, *O = vt + (size_t)TOK_TILE * d, *Y = O + nh * wd, *ogo = Y + nh * wd,
	      *onorm = ogo + (size_t)nh * w, *cross = onorm + (size_t)nh * w,
	      *tv = cross + (size_t)w * TOK_TILE, *x = tv + TOK_TILE, *y = x + d;
	int r;

	for (uint32_t i0 = 0; i0 < L; i0 += TOK_TILE) {
		uint32_t nt = L - i0 < TOK_TILE ? L - i0 : TOK_TILE;

		kvd_vtile(ops, in, g, i0, nt, vt);
		for (uint32_t j = 0; j < nh; j++)
			ops->gemm(w, d, nt, probs + j * wl + i0, L, vt, d, O + j * wd, d, i0 > 0);
	}
	for (uint32_t j = 0; j < nh; j++) {
		times_gram(ops, w, d, O + j * wd, gram ? gram + (size_t)j * d * d : NULL,
			   Y + j * wd);
		for (uint32_t t = 0; t < w; t++) {
			float *q = ogo + (size_t)j * w + t;

			*q = ops->dot(d, Y + j * wd + (size_t)t * d, O + j * wd + (size_t)t * d);
			onorm[(size_t)j * w + t] = o->use_norm && *q > 0 ? 1.0f / sqrtf(*q) : 1.0f;
		}
	}
	for (uint32_t i0 = 0; i0 < n; i0 += TOK_TILE) {
		uint32_t nt = n - i0 < TOK_TILE ? n - i0 : TOK_TILE;

		kvd_vtile_t(ops, in, g, i0, nt, vt, TOK_TILE);
		for (uint32_t j = 0; j < nh; j++) {
			const float *gj = gram ? gram + (size_t)j * d * d : NULL, *Oj = O + j * wd;
			const float *ogoj = ogo + (size_t)j * w, *onj = onorm + (size_t)j * w;

			if (!vgv)
				kvd_vtile_quad(ops, d, nt, vt, TOK_TILE,
					       gu ? gu + (size_t)j * d * d : NULL, tv);
			else
				memcpy(tv, vgv + (size_t)j * n + i0, nt * sizeof(float));
			ops->gemm(w, nt, d, Y + j * wd, d, vt, TOK_TILE, cross, TOK_TILE, 0);
			/* The per-query scores overwrite the cross terms, then fold over the window. */
			for (uint32_t t = 0; t < w; t++) {
				const float *p = probs + j * wl + (size_t)t * L + i0;
				float *c = cross + (size_t)t * TOK_TILE;

				for (uint32_t k = 0; k < nt; k++) {
					float sq = p[k] >= KVD_RESTKV_A_DIRECT ?
							   direct_sq(ops, d, Oj + (size_t)t * d, vt, k,
								     gj, x, y) :
							   ogoj[t] - 2 * c[k] + tv[k];

					c[k] = kvd_restkv_cost(p[k], clamped_root(sq) * onj[t]);
				}
			}
			r = kvd_temporal_agg(o->temporal, o->alpha, cross, w, TOK_TILE, nt,
					     cost + (size_t)j * n + i0);
			if (r < 0)
				return r;
		}
	}
	return 0;
}

int kvd_restkv_heads(const struct kvd_attn_in *in, uint32_t h0, uint32_t nh, const float *probs,
		     const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		     float *cost) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d, w;
	size_t need;
	float *buf, *gu;
	int r;

	if (kvd_attn_in_check(in) < 0 || !in->v || nh == 0 || h0 >= in->heads ||
	    nh > in->heads - h0 || kvd_attn_kv_head(in, h0) != kvd_attn_kv_head(in, h0 + nh - 1) ||
	    !probs || !cost || !opts_ok(o))
		return -EINVAL;
	d = in->dim, w = in->window;
	/* The larger of the two modes' scratch (see their pointer carving). */
	need = (size_t)TOK_TILE * d + 2 * TOK_TILE + 2 * (size_t)d +
	       (o->metric == KVD_RESTKV_AFTER ?
			(size_t)nh * (2 * d + 1 + TOK_TILE) :
			(size_t)nh * (2 * (size_t)w * d + 2 * w) + (size_t)w * TOK_TILE);
	/* Plus the heads' folded G, nh d x d, at the end (only when v G v^T is computed here). */
	buf = malloc((need + (gram && !vgv ? (size_t)nh * d * d : 0)) * sizeof(float));
	if (!buf)
		return -ENOMEM;
	gu = gram && !vgv ? buf + need : NULL;
	for (uint32_t j = 0; gu && j < nh; j++)
		kvd_gram_fold(d, gram + (size_t)j * d * d, d, 1.0f, gu + (size_t)j * d * d);
	if (o->metric == KVD_RESTKV_AFTER)
		r = heads_after(ops, in, kvd_attn_kv_head(in, h0), nh, probs, gram, gu, vgv, o, cost,
				buf);
	else
		r = heads_before(ops, in, kvd_attn_kv_head(in, h0), nh, probs, gram, gu, vgv, o,
				 cost, buf);
	free(buf);
	return r;
}

int kvd_restkv_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
		    float *cost) {
	return kvd_restkv_heads(in, h, 1, probs, gram, vgv, o, cost);
}
