/* SPDX-License-Identifier: MIT */
/*
 * MomentKV's optimised CPU kernels (see moments.h), on simd.h. The batch summary converts
 * rows in tiles, centres them on the means of a first pass and accumulates the value-key
 * co-moment as one gemm per tile; the corrected attention is a tiled online softmax (one
 * gemm for the logits of every row against a transposed key tile, one for P V) closed by
 * the virtual entry; the misfit is the same logit gemm, centred on each query's logit of
 * the key mean.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "moments.h"
#include "simd.h"

/* Rows per tile: a tile of K, V and V^T at d = 128 is 384 KiB of fp32. */
#define MOMENTS_TILE 256u
/* Keys per attention tile, as in attn.c: the transposed tile stays in L1. */
#define KEYS_TILE 64u

int kvd_moments_batch(const void *k, size_t k_stride, const void *v, size_t v_stride,
		      uint32_t dtype, uint32_t n, struct kvd_moments *out) {
	const struct kvd_simd_ops *ops = kvd_simd();
	size_t es = kvd_dtype_size(dtype);
	uint32_t d;
	float *kt, *vt, *vtt, inv;

	if (!out || out->dim == 0 || !out->mean_k || !out->mean_v || !out->var_k || !out->cov_vk ||
	    es == 0 || (n > 0 && (!k || !v)))
		return -EINVAL;
	d = out->dim;
	kvd_moments_clear(out);
	if (n == 0)
		return 0;
	kt = malloc(3 * (size_t)MOMENTS_TILE * d * sizeof(float));
	if (!kt)
		return -ENOMEM;
	vt = kt + (size_t)MOMENTS_TILE * d, vtt = vt + (size_t)MOMENTS_TILE * d;
	inv = 1.0f / (float)n;

	/* Pass 1: the means. */
	for (uint32_t i0 = 0; i0 < n; i0 += MOMENTS_TILE) {
		uint32_t m = n - i0 < MOMENTS_TILE ? n - i0 : MOMENTS_TILE;

		for (uint32_t i = 0; i < m; i++) {
			ops->to_f32((const char *)k + (i0 + i) * k_stride * es, dtype, d, 1.0f, kt);
			ops->to_f32((const char *)v + (i0 + i) * v_stride * es, dtype, d, 1.0f, vt);
			ops->axpy(d, inv, kt, out->mean_k);
			out->key_norm_max = fmaxf(out->key_norm_max, ops->dot(d, kt, kt));
			ops->axpy(d, inv, vt, out->mean_v);
		}
	}
	/* Pass 2: centred rows; C_vk += Vc^T Kc / n, one gemm per tile. */
	for (uint32_t i0 = 0; i0 < n; i0 += MOMENTS_TILE) {
		uint32_t m = n - i0 < MOMENTS_TILE ? n - i0 : MOMENTS_TILE;

		for (uint32_t i = 0; i < m; i++) {
			float *kr = kt + (size_t)i * d, *vr = vt + (size_t)i * d;

			ops->to_f32((const char *)k + (i0 + i) * k_stride * es, dtype, d, 1.0f, kr);
			ops->to_f32((const char *)v + (i0 + i) * v_stride * es, dtype, d, 1.0f, vr);
			ops->axpy(d, -1.0f, out->mean_k, kr);
			ops->axpy(d, -1.0f, out->mean_v, vr);
			ops->sq_axpy(d, inv, kr, out->var_k);
			out->key_radius = fmaxf(out->key_radius, ops->dot(d, kr, kr));
		}
		/* vtt[a][i] = vr_i[a] / n */
		ops->to_f32_t(vt, KVD_DTYPE_F32, d, m, d, inv, vtt, m);
		ops->gemm(d, d, m, vtt, m, kt, d, out->cov_vk, d, 1);
	}
	out->key_norm_max = sqrtf(out->key_norm_max), out->key_radius = sqrtf(out->key_radius);
	out->count = n;
	free(kt);
	return 0;
}

int kvd_moments_entries(const struct kvd_moments *m, enum kvd_moments_form form, float scale,
			const float *q, size_t ldq, uint32_t rows, float *logit, float *value) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d;
	float ln_n;

	if (!m || m->dim == 0 || !m->mean_k || !m->mean_v || !m->var_k || !m->cov_vk ||
	    (int)form < 0 || form >= _KVD_MOMENTS_FORM_MAX || (rows > 0 && (!q || !logit || !value)))
		return -EINVAL;
	d = m->dim;
	ln_n = m->count ? (float)log((double)m->count) : 0.0f;
	for (uint32_t r = 0; r < rows; r++) {
		const float *x = q + r * ldq;
		float *val = value + (size_t)r * d;

		if (m->count == 0) {
			logit[r] = -INFINITY;
			memset(val, 0, d * sizeof(float));
			continue;
		}
		logit[r] = scale * ops->dot(d, x, m->mean_k) + ln_n;
		if (form != KVD_MOMENTS_PLAIN) {
			float mass = 0;

			for (uint32_t a = 0; a < d; a++)
				mass += m->var_k[a] * x[a] * x[a];
			if (form == KVD_MOMENTS_MASS)
				logit[r] += scale * scale * mass / 2;
			else
				logit[r] = (float)kvd_moments_bounded_logit(
					m, scale, logit[r], scale * scale * mass / 2,
					sqrt(ops->dot(d, x, x)));
		}
		/* A few rows (decoding) per call: d dot products along C_vk's rows beat a gemm
		 * that would need C_vk transposed first. */
		for (uint32_t a = 0; a < d; a++)
			val[a] = m->mean_v[a] + scale * ops->dot(d, m->cov_vk + (size_t)a * d, x);
	}
	return 0;
}

int kvd_attn_moments(const struct kvd_attn_moments_in *in, float *out) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d, R, hi = 0;
	float *kt, *s, *mx, *l, *ent, *ent_logit;
	int r = -ENOMEM;

	if (kvd_attn_moments_in_check(in, out) < 0)
		return -EINVAL;
	d = in->dim, R = in->rows;
	if (R == 0)
		return 0;
	kt = malloc(((size_t)d * KEYS_TILE + (size_t)R * KEYS_TILE + 3 * (size_t)R + (size_t)R * d) *
		    sizeof(float));
	if (!kt)
		return r;
	s = kt + (size_t)d * KEYS_TILE, mx = s + (size_t)R * KEYS_TILE, l = mx + R;
	ent_logit = l + R, ent = ent_logit + R;
	memset(out, 0, (size_t)R * d * sizeof(float));
	for (uint32_t i = 0; i < R; i++) {
		mx[i] = -INFINITY, l[i] = 0;
		hi = in->visible ? (in->visible[i] > hi ? in->visible[i] : hi) : in->len;
	}

	for (uint32_t c = 0; c < hi; c += KEYS_TILE) {
		uint32_t nk = hi - c < KEYS_TILE ? hi - c : KEYS_TILE;

		ops->to_f32_t(in->k + (size_t)c * in->k_stride, KVD_DTYPE_F32, in->k_stride, nk, d, 1.0f,
			      kt, KEYS_TILE);
		ops->gemm(R, nk, d, in->q, in->ldq, kt, KEYS_TILE, s, KEYS_TILE, 0);
		for (uint32_t i = 0; i < R; i++) {
			float *row = s + (size_t)i * KEYS_TILE, m, nm, alpha, sum;
			uint32_t vis = in->visible ? in->visible[i] : in->len;
			uint32_t valid = vis > c ? (vis - c < nk ? vis - c : nk) : 0;

			if (valid == 0) {
				memset(row, 0, nk * sizeof(float));
				continue;
			}
			ops->scale(row, valid, in->scale);
			m = ops->max(row, valid);
			nm = mx[i] > m ? mx[i] : m;
			alpha = mx[i] == -INFINITY ? 0.0f : expf(mx[i] - nm);
			sum = ops->exp_sum(row, valid, nm);
			memset(row + valid, 0, (nk - valid) * sizeof(float));
			if (alpha != 1.0f)
				ops->scale(out + (size_t)i * d, d, alpha);
			l[i] = l[i] * alpha + sum;
			mx[i] = nm;
		}
		ops->gemm(R, d, nk, s, KEYS_TILE, in->v + (size_t)c * in->v_stride, in->v_stride, out, d,
			  1);
	}
	if (in->m) {
		r = kvd_moments_entries(in->m, in->form, in->scale, in->q, in->ldq, R, ent_logit, ent);
		if (r < 0)
			goto out;
	}
	if (in->m || in->ent_logit) {
		const float *el = in->m ? ent_logit : in->ent_logit, *ev = in->m ? ent : in->ent_value;

		for (uint32_t i = 0; i < R; i++)
			kvd_moments_softmax_add(mx + i, l + i, out + (size_t)i * d, d, el[i],
						ev + (size_t)i * d);
	}
	for (uint32_t i = 0; i < R; i++) {
		if (l[i] > 0)
			ops->scale(out + (size_t)i * d, d, 1.0f / l[i]);
		else
			memset(out + (size_t)i * d, 0, d * sizeof(float));
	}
	r = 0;
out:
	free(kt);
	return r;
}

int kvd_moments_misfit(const struct kvd_attn_in *in, uint32_t kv_head, const float *mean_k,
		       float *out) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t g, w, d, n, R;
	size_t es;
	float *qs, *kt, *s, *a;

	if (kvd_attn_in_check(in) < 0 || kv_head >= in->kv_heads || !mean_k ||
	    (in->len > in->window && !out))
		return -EINVAL;
	g = in->heads / in->kv_heads, w = in->window, d = in->dim, n = in->len - in->window;
	if (n == 0)
		return 0;
	R = g * w;
	es = kvd_dtype_size(in->dtype);
	qs = malloc(((size_t)R * d + (size_t)d * KEYS_TILE + (size_t)R * KEYS_TILE + R) * sizeof(float));
	if (!qs)
		return -ENOMEM;
	kt = qs + (size_t)R * d, s = kt + (size_t)d * KEYS_TILE, a = s + (size_t)R * KEYS_TILE;
	for (uint32_t j = 0; j < g; j++)
		for (uint32_t t = 0; t < w; t++) {
			float *row = qs + ((size_t)j * w + t) * d;

			ops->to_f32((const char *)in->q +
					    ((kv_head * g + j) * in->q_head_stride + t * in->q_row_stride) * es,
				    in->dtype, d, in->scale, row);
			a[j * w + t] = ops->dot(d, row, mean_k);
		}
	for (uint32_t c = 0; c < n; c += KEYS_TILE) {
		uint32_t nk = n - c < KEYS_TILE ? n - c : KEYS_TILE;

		ops->to_f32_t((const char *)in->k + (kv_head * in->k_head_stride + (size_t)c * in->k_row_stride) * es,
			      in->dtype, in->k_row_stride, nk, d, 1.0f, kt, KEYS_TILE);
		ops->gemm(R, nk, d, qs, d, kt, KEYS_TILE, s, KEYS_TILE, 0);
		for (uint32_t i = 0; i < nk; i++)
			out[c + i] = 0;
		for (uint32_t rr = 0; rr < R; rr++) {
			const float *row = s + (size_t)rr * KEYS_TILE;

			for (uint32_t i = 0; i < nk; i++) {
				float x = row[i] - a[rr];

				out[c + i] += x * x;
			}
		}
		ops->scale(out + c, nk, 1.0f / (float)R);
	}
	free(qs);
	return 0;
}
