/* SPDX-License-Identifier: MIT */
/*
 * MomentKV's reference kernels (see moments.h): plain loops in the order the math is
 * written, double accumulation; and the parts with one implementation (the merge, the
 * online-softmax step).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "moments.h"

void kvd_moments_view(struct kvd_moments *m, uint32_t d, float *f) {
	*m = (struct kvd_moments){
		.dim = d,
		.mean_k = f,
		.mean_v = f + d,
		.var_k = f + 2 * (size_t)d,
		.cov_vk = f + 3 * (size_t)d,
	};
}

void kvd_moments_clear(struct kvd_moments *m) {
	size_t d = m->dim;

	m->count = 0;
	m->key_norm_max = m->key_radius = 0;
	memset(m->mean_k, 0, d * sizeof(float));
	memset(m->mean_v, 0, d * sizeof(float));
	memset(m->var_k, 0, d * sizeof(float));
	memset(m->cov_vk, 0, d * d * sizeof(float));
}

static int moments_check(const struct kvd_moments *m) {
	if (!m || m->dim == 0 || !m->mean_k || !m->mean_v || !m->var_k || !m->cov_vk)
		return -EINVAL;
	return 0;
}

int kvd_moments_batch_ref(const void *k, size_t k_stride, const void *v, size_t v_stride,
			  uint32_t dtype, uint32_t n, struct kvd_moments *out) {
	uint32_t d;
	size_t es = kvd_dtype_size(dtype);

	if (moments_check(out) < 0 || es == 0 || (n > 0 && (!k || !v)))
		return -EINVAL;
	d = out->dim;
	kvd_moments_clear(out);
	if (n == 0)
		return 0;
	for (uint32_t i = 0; i < n; i++) {
		double nk = 0;

		for (uint32_t a = 0; a < d; a++) {
			double x = kvd_load((const char *)k + i * k_stride * es, dtype, a);

			nk += x * x;
		}
		out->key_norm_max = fmaxf(out->key_norm_max, (float)sqrt(nk));
	}
	for (uint32_t a = 0; a < d; a++) {
		double sk = 0, sv = 0;

		for (uint32_t i = 0; i < n; i++) {
			sk += kvd_load((const char *)k + i * k_stride * es, dtype, a);
			sv += kvd_load((const char *)v + i * v_stride * es, dtype, a);
		}
		out->mean_k[a] = (float)(sk / n);
		out->mean_v[a] = (float)(sv / n);
	}
	for (uint32_t a = 0; a < d; a++) {
		double vk = 0;

		for (uint32_t i = 0; i < n; i++) {
			double x = kvd_load((const char *)k + i * k_stride * es, dtype, a) - out->mean_k[a];

			vk += x * x;
		}
		out->var_k[a] = (float)(vk / n);
		for (uint32_t b = 0; b < d; b++) {
			double c = 0;

			for (uint32_t i = 0; i < n; i++)
				c += (kvd_load((const char *)v + i * v_stride * es, dtype, a) - out->mean_v[a]) *
				     (double)(kvd_load((const char *)k + i * k_stride * es, dtype, b) -
					      out->mean_k[b]);
			out->cov_vk[(size_t)a * d + b] = (float)(c / n);
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		double rk = 0;

		for (uint32_t a = 0; a < d; a++) {
			double x = kvd_load((const char *)k + i * k_stride * es, dtype, a) - out->mean_k[a];

			rk += x * x;
		}
		out->key_radius = fmaxf(out->key_radius, (float)sqrt(rk));
	}
	out->count = n;
	return 0;
}

int kvd_moments_merge(struct kvd_moments *a, const struct kvd_moments *b) {
	uint32_t d;
	double na, nb, n, fa, fb, cross, move_a = 0, move_b = 0;

	if (moments_check(a) < 0 || moments_check(b) < 0 || a->dim != b->dim)
		return -EINVAL;
	if (b->count == 0)
		return 0;
	if (a->count > UINT64_MAX - b->count)
		return -EOVERFLOW;
	d = a->dim;
	na = (double)a->count, nb = (double)b->count, n = na + nb;
	if (a->count == 0) {
		a->key_norm_max = b->key_norm_max, a->key_radius = b->key_radius;
	} else {
		/* Each side's keys lie within its radius of its mean, and its mean moves to the
		 * union's by the other side's share of the means' difference. */
		for (uint32_t x = 0; x < d; x++) {
			double dk = (double)b->mean_k[x] - a->mean_k[x];

			move_a += dk * dk;
		}
		move_b = sqrt(move_a) * na / n, move_a = sqrt(move_a) * nb / n;
		a->key_radius = (float)fmax(a->key_radius + move_a, b->key_radius + move_b);
		a->key_norm_max = fmaxf(a->key_norm_max, b->key_norm_max);
	}
	/* The co-moments M = n C add, plus the term of the means' difference:
	 * M = M_a + M_b + (na nb / n) dv dk^T; in covariance form, divided by n. */
	fa = na / n, fb = nb / n, cross = na * nb / (n * n);
	for (uint32_t x = 0; x < d; x++) {
		double dv = (double)b->mean_v[x] - a->mean_v[x];

		for (uint32_t y = 0; y < d; y++) {
			double dk = (double)b->mean_k[y] - a->mean_k[y];
			size_t i = (size_t)x * d + y;

			a->cov_vk[i] = (float)(fa * a->cov_vk[i] + fb * b->cov_vk[i] + cross * dv * dk);
		}
	}
	for (uint32_t x = 0; x < d; x++) {
		double dk = (double)b->mean_k[x] - a->mean_k[x];
		double dv = (double)b->mean_v[x] - a->mean_v[x];

		a->var_k[x] = (float)(fa * a->var_k[x] + fb * b->var_k[x] + cross * dk * dk);
		a->mean_k[x] = (float)(a->mean_k[x] + fb * dk);
		a->mean_v[x] = (float)(a->mean_v[x] + fb * dv);
	}
	a->count += b->count;
	return 0;
}

void kvd_moments_softmax_add(float *mx, float *l, float *o, uint32_t d, float logit,
			     const float *value) {
	float nm, alpha, beta;

	if (logit == -INFINITY)
		return;
	nm = *mx > logit ? *mx : logit;
	alpha = *mx == -INFINITY ? 0.0f : expf(*mx - nm);
	beta = expf(logit - nm);
	for (uint32_t i = 0; i < d; i++)
		o[i] = o[i] * alpha + beta * value[i];
	*l = *l * alpha + beta;
	*mx = nm;
}

double kvd_moments_bounded_logit(const struct kvd_moments *m, float scale, double plain,
				 double gauss, double q_norm) {
	double z = plain + gauss, ln_n = log((double)m->count);

	z = fmin(z, ln_n + scale * q_norm * m->key_norm_max);
	z = fmin(z, plain + scale * q_norm * m->key_radius);
	/* The plain logit is a lower bound; bounds of 0 (a daemon that does not write them)
	 * leave the plain form. */
	return fmax(z, plain);
}

static int entries_check(const struct kvd_moments *m, enum kvd_moments_form form, const float *q,
			 uint32_t rows, const float *logit, const float *value) {
	if (moments_check(m) < 0 || (int)form < 0 || form >= _KVD_MOMENTS_FORM_MAX ||
	    (rows > 0 && (!q || !logit || !value)))
		return -EINVAL;
	return 0;
}

int kvd_moments_entries_ref(const struct kvd_moments *m, enum kvd_moments_form form, float scale,
			    const float *q, size_t ldq, uint32_t rows, float *logit, float *value) {
	uint32_t d;

	if (entries_check(m, form, q, rows, logit, value) < 0)
		return -EINVAL;
	d = m->dim;
	for (uint32_t r = 0; r < rows; r++) {
		const float *x = q + r * ldq;
		float *val = value + (size_t)r * d;
		double z = 0, mass = 0, qq = 0;

		if (m->count == 0) {
			logit[r] = -INFINITY;
			memset(val, 0, d * sizeof(float));
			continue;
		}
		for (uint32_t a = 0; a < d; a++) {
			double c = 0;

			z += (double)x[a] * m->mean_k[a];
			mass += (double)m->var_k[a] * x[a] * x[a];
			qq += (double)x[a] * x[a];
			for (uint32_t b = 0; b < d; b++)
				c += (double)m->cov_vk[(size_t)a * d + b] * x[b];
			val[a] = (float)(m->mean_v[a] + scale * c);
		}
		z = scale * z + log((double)m->count);
		if (form == KVD_MOMENTS_MASS)
			z += (double)scale * scale * mass / 2;
		if (form == KVD_MOMENTS_BOUNDED)
			z = kvd_moments_bounded_logit(m, scale, z, (double)scale * scale * mass / 2,
						      sqrt(qq));
		logit[r] = (float)z;
	}
	return 0;
}

int kvd_attn_moments_in_check(const struct kvd_attn_moments_in *in, const float *out) {
	if (!in || !out || in->dim == 0 || (in->rows > 0 && !in->q) ||
	    (in->len > 0 && (!in->k || !in->v)) || (int)in->form < 0 ||
	    in->form >= _KVD_MOMENTS_FORM_MAX || (in->m && (moments_check(in->m) < 0 || in->m->dim != in->dim)) ||
	    (!in->ent_logit != !in->ent_value) || (in->m && in->ent_logit))
		return -EINVAL;
	for (uint32_t r = 0; in->visible && r < in->rows; r++)
		if (in->visible[r] > in->len)
			return -EINVAL;
	return 0;
}

int kvd_attn_moments_ref(const struct kvd_attn_moments_in *in, float *out) {
	uint32_t d;
	float *vval;
	double *acc;

	if (kvd_attn_moments_in_check(in, out) < 0)
		return -EINVAL;
	d = in->dim;
	vval = malloc(d * sizeof(float));
	acc = malloc(d * sizeof(double));
	if (!vval || !acc) {
		free(vval), free(acc);
		return -ENOMEM;
	}
	for (uint32_t r = 0; r < in->rows; r++) {
		const float *q = in->q + r * in->ldq;
		uint32_t n = in->visible ? in->visible[r] : in->len;
		float *o = out + (size_t)r * d, vlogit = -INFINITY;
		double max = -INFINITY, sum = 0;

		if (in->m)
			kvd_moments_entries_ref(in->m, in->form, in->scale, q, 0, 1, &vlogit, vval);
		else if (in->ent_logit) {
			vlogit = in->ent_logit[r];
			memcpy(vval, in->ent_value + (size_t)r * d, d * sizeof(float));
		}
		for (uint32_t i = 0; i < n; i++) {
			double z = 0;

			for (uint32_t a = 0; a < d; a++)
				z += (double)q[a] * in->k[i * in->k_stride + a];
			max = fmax(max, in->scale * z);
		}
		max = fmax(max, vlogit);
		memset(acc, 0, d * sizeof(double));
		for (uint32_t i = 0; i < n; i++) {
			double z = 0, w;

			for (uint32_t a = 0; a < d; a++)
				z += (double)q[a] * in->k[i * in->k_stride + a];
			w = exp(in->scale * z - max);
			sum += w;
			for (uint32_t a = 0; a < d; a++)
				acc[a] += w * in->v[i * in->v_stride + a];
		}
		if (vlogit != -INFINITY) {
			double w = exp(vlogit - max);

			sum += w;
			for (uint32_t a = 0; a < d; a++)
				acc[a] += w * vval[a];
		}
		for (uint32_t a = 0; a < d; a++)
			o[a] = sum > 0 ? (float)(acc[a] / sum) : 0.0f;
	}
	free(vval), free(acc);
	return 0;
}

int kvd_moments_misfit_ref(const struct kvd_attn_in *in, uint32_t kv_head, const float *mean_k,
			   float *out) {
	uint32_t g, w, d, n;
	size_t es;

	if (kvd_attn_in_check(in) < 0 || kv_head >= in->kv_heads || !mean_k ||
	    (in->len > in->window && !out))
		return -EINVAL;
	g = in->heads / in->kv_heads, w = in->window, d = in->dim, n = in->len - in->window;
	es = kvd_dtype_size(in->dtype);
	for (uint32_t i = 0; i < n; i++) {
		const char *k = (const char *)in->k + (kv_head * in->k_head_stride + i * in->k_row_stride) * es;
		double sum = 0;

		for (uint32_t h = kv_head * g; h < (kv_head + 1) * g; h++)
			for (uint32_t t = 0; t < w; t++) {
				const char *q = (const char *)in->q +
						(h * in->q_head_stride + t * in->q_row_stride) * es;
				double x = 0;

				for (uint32_t a = 0; a < d; a++)
					x += (double)kvd_load(q, in->dtype, a) *
					     (kvd_load(k, in->dtype, a) - (double)mean_k[a]);
				x *= in->scale;
				sum += x * x;
			}
		out[i] = (float)(sum / ((double)g * w));
	}
	return 0;
}
