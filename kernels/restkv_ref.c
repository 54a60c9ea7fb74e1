/* SPDX-License-Identifier: MIT */
/*
 * The reference ReST-KV cost: the Gram-form formulas of restkv.h written as plain loops,
 * in double, one token at a time (double needs no cancellation guard: its expanded square
 * keeps 1e-16 of v G v^T). The options and names live here too.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "restkv.h"

void kvd_restkv_opts_default(struct kvd_restkv_opts *o) {
	*o = (struct kvd_restkv_opts){
		.metric = KVD_RESTKV_AFTER,
		.temporal = KVD_TEMPORAL_EMA,
		.alpha = KVD_TEMPORAL_EMA_ALPHA,
		.tau = 1.0f,
	};
}

static const char *const metric_names[_KVD_RESTKV_METRIC_MAX] = {
	[KVD_RESTKV_AFTER] = "after",
	[KVD_RESTKV_BEFORE] = "before",
};

const char *kvd_restkv_metric_to_string(enum kvd_restkv_metric m) {
	return (int)m >= 0 && m < _KVD_RESTKV_METRIC_MAX ? metric_names[m] : NULL;
}

enum kvd_restkv_metric kvd_restkv_metric_from_string(const char *s) {
	for (int m = 0; s && m < _KVD_RESTKV_METRIC_MAX; m++)
		if (strcmp(s, metric_names[m]) == 0)
			return (enum kvd_restkv_metric)m;
	return _KVD_RESTKV_METRIC_INVALID;
}

static float elem(const void *base, uint32_t dtype, size_t off) {
	return kvd_load((const char *)base + off * kvd_dtype_size(dtype), dtype, 0);
}

static float vval(const struct kvd_attn_in *in, uint32_t g, uint32_t i, uint32_t j) {
	return elem(in->v, in->dtype, g * in->v_head_stride + (size_t)i * in->v_row_stride + j);
}

/* x G y^T with G the identity when gram is NULL. */
static double quad(const double *x, const float *gram, const double *y, uint32_t d) {
	double s = 0;

	for (uint32_t a = 0; a < d; a++)
		for (uint32_t b = 0; b < d; b++)
			s += x[a] * (gram ? gram[(size_t)a * d + b] : a == b) * y[b];
	return s;
}

static void vrow(const struct kvd_attn_in *in, uint32_t g, uint32_t i, double *out) {
	for (uint32_t j = 0; j < in->dim; j++)
		out[j] = vval(in, g, i, j);
}

int kvd_restkv_vgv_ref(const struct kvd_attn_in *in, uint32_t h, const float *gram, uint32_t n,
		       float *vgv) {
	uint32_t g;
	double *v;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || n > in->len || (n && !vgv))
		return -EINVAL;
	v = malloc(in->dim * sizeof(double));
	if (!v)
		return -ENOMEM;
	g = kvd_attn_kv_head(in, h);
	for (uint32_t i = 0; i < n; i++) {
		vrow(in, g, i, v);
		vgv[i] = (float)quad(v, gram, v, in->dim);
	}
	free(v);
	return 0;
}

static int opts_check(const struct kvd_restkv_opts *o) {
	if (!o || (int)o->metric < 0 || o->metric >= _KVD_RESTKV_METRIC_MAX || (int)o->temporal < 0 ||
	    o->temporal >= _KVD_TEMPORAL_MAX || !(o->tau > 0) || !isfinite(o->tau))
		return -EINVAL;
	if (o->temporal == KVD_TEMPORAL_EMA && (!(o->alpha > 0) || o->alpha > 1))
		return -EINVAL;
	return 0;
}

/* sqrt(max(0, oGo - 2 (oG).v + vGv)): the clamped expanded square of restkv.h. */
static double gram_norm(double ogo, double cross, double vgv) {
	double sq = ogo - 2 * cross + vgv;

	return sqrt(sq > 0 ? sq : 0);
}

int kvd_restkv_head_ref(const struct kvd_attn_in *in, uint32_t h, const float *probs,
			const float *gram, const float *vgv, const struct kvd_restkv_opts *o,
			float *cost) {
	uint32_t w, L, d, n, g;
	double *v, *ov, *og;
	float *score = NULL;
	int r = -ENOMEM;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || !probs || !cost ||
	    opts_check(o) < 0)
		return -EINVAL;
	w = in->window, L = in->len, d = in->dim, n = L - w, g = kvd_attn_kv_head(in, h);
	v = calloc(3 * (size_t)d, sizeof(double));
	if (!v)
		return -ENOMEM;
	ov = v + d, og = ov + d;

	if (o->metric == KVD_RESTKV_AFTER) {
		double ogo;

		r = kvd_temporal_agg_ref(o->temporal, o->alpha, probs, w, L, n, cost);
		if (r < 0)
			goto out;
		for (uint32_t i = 0; i < n; i++) {
			vrow(in, g, i, v);
			for (uint32_t j = 0; j < d; j++)
				ov[j] += (double)cost[i] * v[j];
		}
		for (uint32_t b = 0; b < d; b++)
			for (uint32_t a = 0; a < d; a++)
				og[b] += ov[a] * (gram ? gram[(size_t)a * d + b] : a == b);
		ogo = quad(ov, gram, ov, d);
		for (uint32_t i = 0; i < n; i++) {
			double cross = 0, norm;

			vrow(in, g, i, v);
			for (uint32_t j = 0; j < d; j++)
				cross += og[j] * v[j];
			norm = gram_norm(ogo, cross, vgv ? vgv[i] : quad(v, gram, v, d));
			cost[i] = kvd_restkv_cost(cost[i], (float)(o->tau == 1 ? norm : pow(norm, o->tau)));
		}
	} else {
		score = malloc((size_t)w * (n ? n : 1) * sizeof(float));
		if (!score)
			goto out;
		for (uint32_t t = 0; t < w; t++) {
			const float *p = probs + (size_t)t * L;
			double ogo, onorm;

			for (uint32_t j = 0; j < d; j++)
				ov[j] = og[j] = 0;
			for (uint32_t i = 0; i < L; i++) {
				vrow(in, g, i, v);
				for (uint32_t j = 0; j < d; j++)
					ov[j] += (double)p[i] * v[j];
			}
			for (uint32_t b = 0; b < d; b++)
				for (uint32_t a = 0; a < d; a++)
					og[b] += ov[a] * (gram ? gram[(size_t)a * d + b] : a == b);
			ogo = quad(ov, gram, ov, d);
			onorm = sqrt(ogo > 0 ? ogo : 0);
			for (uint32_t i = 0; i < n; i++) {
				double cross = 0, norm;

				vrow(in, g, i, v);
				for (uint32_t j = 0; j < d; j++)
					cross += og[j] * v[j];
				norm = gram_norm(ogo, cross, vgv ? vgv[i] : quad(v, gram, v, d));
				if (o->use_norm && onorm > 0)
					norm /= onorm;
				score[(size_t)t * n + i] = kvd_restkv_cost(p[i], (float)norm);
			}
		}
		r = kvd_temporal_agg_ref(o->temporal, o->alpha, score, w, n, n, cost);
		if (r < 0)
			goto out;
	}
	r = 0;
out:
	free(score);
	free(v);
	return r;
}
