/* SPDX-License-Identifier: MIT */
/*
 * IndexMem's reference kernels (see indexmem.h): plain loops in the order the math is
 * written, double accumulation; and the parts with one implementation (views, the merge).
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "dtype.h"
#include "indexmem.h"

int kvd_indexer_layer_check(const struct kvd_indexer_layer *w) {
	if (!w || w->dim == 0 || w->heads == 0 || w->heads > KVD_INDEX_HEADS_MAX ||
	    w->index_dim == 0 || w->index_dim > KVD_INDEX_DIM_MAX || !w->wq || !w->wk || !w->ww ||
	    !w->bw)
		return -EINVAL;
	return 0;
}

static double softplus(double x) {
	return x > 20 ? x : log1p(exp(x));
}

/* y[i] = x[i] / |x| (0 stays 0). */
static void l2norm_d(double *x, uint32_t n) {
	double s = 0;

	for (uint32_t i = 0; i < n; i++)
		s += x[i] * x[i];
	s = 1 / sqrt(s + 1e-12);
	for (uint32_t i = 0; i < n; i++)
		x[i] *= s;
}

int kvd_indexer_project_ref(const struct kvd_indexer_layer *w, const float *a, size_t lda,
			    uint32_t n, float *iq, float *ik) {
	uint32_t D, H, I;
	double buf[KVD_INDEX_DIM_MAX];

	if (kvd_indexer_layer_check(w) < 0 || (n > 0 && (!a || !iq || !ik)))
		return -EINVAL;
	D = w->dim, H = w->heads, I = w->index_dim;
	for (uint32_t t = 0; t < n; t++) {
		const float *x = a + t * lda;

		for (uint32_t j = 0; j < H; j++) {
			double g = w->bw[j];

			for (uint32_t c = 0; c < D; c++)
				g += (double)w->ww[(size_t)j * D + c] * x[c];
			for (uint32_t i = 0; i < I; i++) {
				double s = 0;

				for (uint32_t c = 0; c < D; c++)
					s += (double)w->wq[((size_t)j * I + i) * D + c] * x[c];
				buf[i] = s;
			}
			l2norm_d(buf, I);
			for (uint32_t i = 0; i < I; i++)
				iq[((size_t)t * H + j) * I + i] = (float)(softplus(g) * buf[i]);
		}
		for (uint32_t i = 0; i < I; i++) {
			double s = 0;

			for (uint32_t c = 0; c < D; c++)
				s += (double)w->wk[(size_t)i * D + c] * x[c];
			buf[i] = s;
		}
		l2norm_d(buf, I);
		for (uint32_t i = 0; i < I; i++)
			ik[(size_t)t * I + i] = (float)buf[i];
	}
	return 0;
}

int kvd_indexer_scores_ref(const void *iq, uint32_t window, uint32_t heads, const void *ik,
			   size_t ik_stride, uint32_t dtype, uint32_t n, uint32_t index_dim,
			   float *out) {
	size_t es = kvd_dtype_size(dtype), rows = (size_t)window * heads;

	if (es == 0 || window == 0 || heads == 0 || index_dim == 0 ||
	    (n > 0 && (!iq || !ik || !out)))
		return -EINVAL;
	for (uint32_t s = 0; s < n; s++) {
		const char *k = (const char *)ik + s * ik_stride * es;
		double sum = 0;

		for (size_t r = 0; r < rows; r++) {
			const char *q = (const char *)iq + r * index_dim * es;
			double z = 0;

			for (uint32_t i = 0; i < index_dim; i++)
				z += (double)kvd_load(q, dtype, i) * kvd_load(k, dtype, i);
			sum += z > 0 ? z : 0;
		}
		out[s] = (float)(sum / window);
	}
	return 0;
}

void kvd_latent_view(struct kvd_latent *m, uint32_t d, float *f) {
	*m = (struct kvd_latent){ .dim = d, .z = f, .s = f + d };
}

static int latent_check(const struct kvd_latent *m) {
	return !m || m->dim == 0 || !m->z || !m->s ? -EINVAL : 0;
}

static double elu1(double x) {
	return x > 0 ? x + 1 : exp(x);
}

int kvd_latent_batch_ref(const void *k, size_t k_stride, const void *v, size_t v_stride,
			 uint32_t dtype, uint32_t n, struct kvd_latent *out) {
	size_t es = kvd_dtype_size(dtype);
	uint32_t d;

	if (latent_check(out) < 0 || es == 0 || (n > 0 && (!k || !v)))
		return -EINVAL;
	d = out->dim;
	for (uint32_t a = 0; a < d; a++) {
		double z = 0;

		for (uint32_t i = 0; i < n; i++)
			z += elu1(kvd_load((const char *)k + i * k_stride * es, dtype, a));
		out->z[a] = (float)z;
		for (uint32_t b = 0; b < d; b++) {
			double s = 0;

			for (uint32_t i = 0; i < n; i++)
				s += elu1(kvd_load((const char *)k + i * k_stride * es, dtype, a)) *
				     kvd_load((const char *)v + i * v_stride * es, dtype, b);
			out->s[(size_t)a * d + b] = (float)s;
		}
	}
	out->count = n;
	return 0;
}

int kvd_latent_merge(struct kvd_latent *a, const struct kvd_latent *b) {
	size_t d;

	if (latent_check(a) < 0 || latent_check(b) < 0 || a->dim != b->dim)
		return -EINVAL;
	if (b->count > UINT64_MAX - a->count)
		return -EOVERFLOW;
	d = a->dim;
	for (size_t i = 0; i < d; i++)
		a->z[i] += b->z[i];
	for (size_t i = 0; i < d * d; i++)
		a->s[i] += b->s[i];
	a->count += b->count;
	return 0;
}

int kvd_latent_entries_check(const struct kvd_latent *m, const struct kvd_latent_readout *w,
			     const float *q, uint32_t rows, const float *bias, const float *logit,
			     const float *value) {
	if (latent_check(m) < 0 || m->dim > KVD_LATENT_DIM_MAX || !w || w->dim != m->dim || !w->lq || !w->lb || !w->lr ||
	    (rows > 0 && (!q || !bias || !logit || !value)))
		return -EINVAL;
	return 0;
}

int kvd_latent_entries_ref(const struct kvd_latent *m, const struct kvd_latent_readout *w,
			   const float *q, size_t ldq, uint32_t rows, const float *bias,
			   float *logit, float *value) {
	double psi[KVD_LATENT_DIM_MAX], mv[KVD_LATENT_DIM_MAX];
	uint32_t d;

	if (kvd_latent_entries_check(m, w, q, rows, bias, logit, value) < 0)
		return -EINVAL;
	d = m->dim;
	for (uint32_t r = 0; r < rows; r++) {
		const float *x = q + r * ldq;
		float *val = value + (size_t)r * d;
		double den = KVD_LATENT_EPS;

		if (m->count == 0) {
			logit[r] = -INFINITY;
			memset(val, 0, d * sizeof(float));
			continue;
		}
		for (uint32_t a = 0; a < d; a++) {
			double s = w->lb[a];

			for (uint32_t b = 0; b < d; b++)
				s += (double)w->lq[(size_t)a * d + b] * x[b];
			psi[a] = elu1(s);
			den += psi[a] * m->z[a];
		}
		for (uint32_t b = 0; b < d; b++) {
			double s = 0;

			for (uint32_t a = 0; a < d; a++)
				s += psi[a] * m->s[(size_t)a * d + b];
			mv[b] = s / den;
		}
		for (uint32_t a = 0; a < d; a++) {
			double s = 0;

			for (uint32_t b = 0; b < d; b++)
				s += (double)w->lr[(size_t)a * d + b] * mv[b];
			val[a] = (float)s;
		}
		logit[r] = (float)(log(den) + bias[r]);
	}
	return 0;
}
