/* SPDX-License-Identifier: MIT */
/* The reference LaProx-style costs: the defining sums of laprox.h, in double, per token. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "dtype.h"
#include "laprox.h"

static void vrow(const struct kvd_attn_in *in, uint32_t g, uint32_t i, double *out) {
	const char *row = (const char *)in->v +
			  (g * in->v_head_stride + (size_t)i * in->v_row_stride) *
				  kvd_dtype_size(in->dtype);

	for (uint32_t j = 0; j < in->dim; j++)
		out[j] = kvd_load(row, in->dtype, j);
}

/* v G v^T with G the ld-strided d x d block at gram, or delta * I when gram is NULL. */
static double quad(const double *v, const float *gram, size_t ld, double delta, uint32_t d) {
	double s = 0;

	for (uint32_t a = 0; a < d; a++)
		for (uint32_t b = 0; b < d; b++)
			s += v[a] * (gram ? gram[a * ld + b] : (a == b) * delta) * v[b];
	return s;
}

int kvd_laprox_head_ref(const struct kvd_attn_in *in, uint32_t h, const float *probs,
			const float *gram, const float *vgv, float *cost) {
	uint32_t w, L, n, g;
	double *v;

	if (kvd_attn_in_check(in) < 0 || !in->v || h >= in->heads || !probs || !cost)
		return -EINVAL;
	w = in->window, L = in->len, n = L - w, g = kvd_attn_kv_head(in, h);
	v = malloc(in->dim * sizeof(double));
	if (!v)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		double col = 0, vn;

		for (uint32_t t = 0; t < w; t++)
			col += (double)probs[(size_t)t * L + i] * probs[(size_t)t * L + i];
		if (vgv)
			vn = vgv[i];
		else {
			vrow(in, g, i, v);
			vn = quad(v, gram, in->dim, 1, in->dim);
		}
		cost[i] = (float)(sqrt(col) * sqrt(vn > 0 ? vn : 0));
	}
	free(v);
	return 0;
}

int kvd_laprox_group_ref(const struct kvd_attn_in *in, uint32_t kv, const float *const *probs,
			 const float *gram_group, float *cost) {
	uint32_t w, L, n, g, d;
	size_t ld;
	double *v;

	if (kvd_attn_in_check(in) < 0 || !in->v || kv >= in->kv_heads || !probs || !cost)
		return -EINVAL;
	g = in->heads / in->kv_heads;
	for (uint32_t j = 0; j < g; j++)
		if (!probs[j])
			return -EINVAL;
	w = in->window, L = in->len, n = L - w, d = in->dim, ld = (size_t)g * d;
	v = malloc(d * sizeof(double));
	if (!v)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		double s = 0;

		vrow(in, kv, i, v);
		for (uint32_t a = 0; a < g; a++)
			for (uint32_t b = 0; b < g; b++) {
				double col = 0;

				for (uint32_t t = 0; t < w; t++)
					col += (double)probs[a][(size_t)t * L + i] * probs[b][(size_t)t * L + i];
				s += col * quad(v, gram_group ? gram_group + a * d * ld + b * d : NULL, ld,
						a == b, d);
			}
		cost[i] = (float)sqrt(s > 0 ? s : 0);
	}
	free(v);
	return 0;
}
