/* SPDX-License-Identifier: MIT */
/*
 * IndexMem's optimised CPU kernels (see indexmem.h): every product as simd.h's gemm over
 * fp32 tiles, the element-wise parts as plain loops the compiler vectorises.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "indexmem.h"
#include "simd.h"

/* Keys converted per tile. */
#define TILE 256u
/* Fewer rows than this project by dot products, more by a gemm. */
#define GEMM_ROWS_MIN 4u

static float elu1(float x) {
	return x > 0 ? x + 1 : expf(x);
}

static float softplus(float x) {
	return x > 20 ? x : log1pf(expf(x));
}

static void l2norm(float *x, uint32_t n) {
	float s = 0;

	for (uint32_t i = 0; i < n; i++)
		s += x[i] * x[i];
	s = 1 / sqrtf(s + 1e-12f);
	for (uint32_t i = 0; i < n; i++)
		x[i] *= s;
}

int kvd_indexer_project(const struct kvd_indexer_layer *w, const float *a, size_t lda, uint32_t n,
			float *iq, float *ik) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t D, H, I, O;
	float *wt, *y;

	if (kvd_indexer_layer_check(w) < 0 || (n > 0 && (!a || !iq || !ik)))
		return -EINVAL;
	if (n == 0)
		return 0;
	D = w->dim, H = w->heads, I = w->index_dim;
	/* All three projections at once, O outputs a row: [wq; wk; ww]. */
	O = H * I + I + H;
	wt = malloc(((n < GEMM_ROWS_MIN ? 0 : (size_t)D * O) + (size_t)n * O) * sizeof(float));
	if (!wt)
		return -ENOMEM;
	if (n < GEMM_ROWS_MIN) {
		/* A decoding step: dot products along the weights' rows, which a gemm would
		 * first have to transpose, for far more than the product costs. */
		y = wt;
		for (uint32_t t = 0; t < n; t++)
			for (uint32_t o = 0; o < O; o++) {
				const float *row = o < H * I ? w->wq + (size_t)o * D
						   : o < H * I + I ? w->wk + (size_t)(o - H * I) * D
								   : w->ww + (size_t)(o - H * I - I) * D;

				y[(size_t)t * O + o] = ops->dot(D, row, a + t * lda);
			}
	} else {
		y = wt + (size_t)D * O;
		ops->to_f32_t(w->wq, KVD_DTYPE_F32, D, H * I, D, 1.0f, wt, O);
		ops->to_f32_t(w->wk, KVD_DTYPE_F32, D, I, D, 1.0f, wt + H * I, O);
		ops->to_f32_t(w->ww, KVD_DTYPE_F32, D, H, D, 1.0f, wt + H * I + I, O);
		ops->gemm(n, O, D, a, lda, wt, O, y, O, 0);
	}
	for (uint32_t t = 0; t < n; t++) {
		float *row = y + (size_t)t * O;

		for (uint32_t j = 0; j < H; j++) {
			float *q = iq + ((size_t)t * H + j) * I;

			memcpy(q, row + j * I, I * sizeof(float));
			l2norm(q, I);
			ops->scale(q, I, softplus(row[H * I + I + j] + w->bw[j]));
		}
		memcpy(ik + (size_t)t * I, row + H * I, I * sizeof(float));
		l2norm(ik + (size_t)t * I, I);
	}
	free(wt);
	return 0;
}

int kvd_indexer_scores(const void *iq, uint32_t window, uint32_t heads, const void *ik,
		       size_t ik_stride, uint32_t dtype, uint32_t n, uint32_t index_dim, float *out) {
	const struct kvd_simd_ops *ops = kvd_simd();
	size_t es = kvd_dtype_size(dtype);
	uint32_t R = window * heads, I = index_dim;
	float *qf, *kt, *s;

	if (es == 0 || window == 0 || heads == 0 || index_dim == 0 ||
	    (n > 0 && (!iq || !ik || !out)))
		return -EINVAL;
	if (n == 0)
		return 0;
	qf = malloc(((size_t)R * I + (size_t)I * TILE + (size_t)R * TILE) * sizeof(float));
	if (!qf)
		return -ENOMEM;
	kt = qf + (size_t)R * I, s = kt + (size_t)I * TILE;
	ops->to_f32(iq, dtype, (size_t)R * I, 1.0f, qf);
	for (uint32_t c = 0; c < n; c += TILE) {
		uint32_t nk = n - c < TILE ? n - c : TILE;

		ops->to_f32_t((const char *)ik + (size_t)c * ik_stride * es, dtype, ik_stride, nk, I,
			      1.0f, kt, TILE);
		ops->gemm(R, nk, I, qf, I, kt, TILE, s, TILE, 0);
		for (uint32_t i = 0; i < nk; i++)
			out[c + i] = 0;
		for (uint32_t r = 0; r < R; r++) {
			const float *row = s + (size_t)r * TILE;

			for (uint32_t i = 0; i < nk; i++)
				out[c + i] += row[i] > 0 ? row[i] : 0;
		}
		ops->scale(out + c, nk, 1.0f / (float)window);
	}
	free(qf);
	return 0;
}

int kvd_latent_batch(const void *k, size_t k_stride, const void *v, size_t v_stride,
		     uint32_t dtype, uint32_t n, struct kvd_latent *out) {
	const struct kvd_simd_ops *ops = kvd_simd();
	size_t es = kvd_dtype_size(dtype);
	uint32_t d;
	float *pt, *vf;

	if (!out || out->dim == 0 || !out->z || !out->s || es == 0 || (n > 0 && (!k || !v)))
		return -EINVAL;
	d = out->dim;
	memset(out->z, 0, d * sizeof(float));
	memset(out->s, 0, (size_t)d * d * sizeof(float));
	out->count = n;
	if (n == 0)
		return 0;
	pt = malloc(((size_t)d * TILE + (size_t)TILE * d) * sizeof(float));
	if (!pt)
		return -ENOMEM;
	vf = pt + (size_t)d * TILE;
	for (uint32_t c = 0; c < n; c += TILE) {
		uint32_t nk = n - c < TILE ? n - c : TILE;

		/* phi(K)^T [d][nk], then S += phi(K)^T V and z += its row sums. */
		ops->to_f32_t((const char *)k + (size_t)c * k_stride * es, dtype, k_stride, nk, d, 1.0f,
			      pt, TILE);
		for (uint32_t i = 0; i < nk; i++)
			ops->to_f32((const char *)v + (size_t)(c + i) * v_stride * es, dtype, d, 1.0f,
				    vf + (size_t)i * d);
		for (uint32_t a = 0; a < d; a++) {
			float *row = pt + (size_t)a * TILE, sum = 0;

			for (uint32_t i = 0; i < nk; i++) {
				row[i] = elu1(row[i]);
				sum += row[i];
			}
			out->z[a] += sum;
		}
		ops->gemm(d, d, nk, pt, TILE, vf, d, out->s, d, 1);
	}
	free(pt);
	return 0;
}

int kvd_latent_entries(const struct kvd_latent *m, const struct kvd_latent_readout *w,
		       const float *q, size_t ldq, uint32_t rows, const float *bias, float *logit,
		       float *value) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t d;
	float *lqt, *lrt, *psi, *mv;

	if (kvd_latent_entries_check(m, w, q, rows, bias, logit, value) < 0)
		return -EINVAL;
	d = m->dim;
	if (rows == 0)
		return 0;
	if (m->count == 0) {
		for (uint32_t r = 0; r < rows; r++)
			logit[r] = -INFINITY;
		memset(value, 0, (size_t)rows * d * sizeof(float));
		return 0;
	}
	lqt = malloc((2 * (size_t)d * d + 2 * (size_t)rows * d) * sizeof(float));
	if (!lqt)
		return -ENOMEM;
	lrt = lqt + (size_t)d * d, psi = lrt + (size_t)d * d, mv = psi + (size_t)rows * d;
	ops->to_f32_t(w->lq, KVD_DTYPE_F32, d, d, d, 1.0f, lqt, d);
	ops->to_f32_t(w->lr, KVD_DTYPE_F32, d, d, d, 1.0f, lrt, d);
	ops->gemm(rows, d, d, q, ldq, lqt, d, psi, d, 0);
	for (uint32_t r = 0; r < rows; r++) {
		float *p = psi + (size_t)r * d;

		for (uint32_t a = 0; a < d; a++)
			p[a] = elu1(p[a] + w->lb[a]);
	}
	ops->gemm(rows, d, d, psi, d, m->s, d, mv, d, 0);
	for (uint32_t r = 0; r < rows; r++) {
		float den = ops->dot(d, psi + (size_t)r * d, m->z) + KVD_LATENT_EPS;

		ops->scale(mv + (size_t)r * d, d, 1.0f / den);
		logit[r] = logf(den) + bias[r];
	}
	ops->gemm(rows, d, d, mv, d, lrt, d, value, d, 0);
	free(lqt);
	return 0;
}
