/* SPDX-License-Identifier: MIT */
/* The reference window attention: plain loops, in the order the math is written. */
#include <errno.h>
#include <math.h>

#include "attn.h"
#include "dtype.h"

void kvd_attn_in_contiguous(struct kvd_attn_in *in) {
	in->q_row_stride = in->dim;
	in->q_head_stride = (size_t)in->window * in->dim;
	in->k_row_stride = in->v_row_stride = in->dim;
	in->k_head_stride = in->v_head_stride = (size_t)in->len * in->dim;
}

int kvd_attn_in_check(const struct kvd_attn_in *in) {
	if (!in || !in->q || !in->k || kvd_dtype_size(in->dtype) == 0 || in->heads == 0 ||
	    in->kv_heads == 0 || in->heads % in->kv_heads != 0 || in->dim == 0 || in->window == 0 ||
	    in->window > in->len)
		return -EINVAL;
	return 0;
}

static const void *row_at(const void *base, uint32_t dtype, size_t off) {
	return (const char *)base + off * kvd_dtype_size(dtype);
}

int kvd_attn_head_ref(const struct kvd_attn_in *in, uint32_t h, float *probs) {
	uint32_t w = in->window, L = in->len, d = in->dim, g;

	if (kvd_attn_in_check(in) < 0 || h >= in->heads || !probs)
		return -EINVAL;
	g = kvd_attn_kv_head(in, h);
	for (uint32_t t = 0; t < w; t++) {
		const void *q = row_at(in->q, in->dtype, h * in->q_head_stride + t * in->q_row_stride);
		uint32_t visible = L - w + t + 1;
		float *p = probs + (size_t)t * L, max = -INFINITY;
		double sum = 0;

		for (uint32_t i = 0; i < visible; i++) {
			const void *k = row_at(in->k, in->dtype, g * in->k_head_stride + i * in->k_row_stride);
			float dot = 0;

			for (uint32_t j = 0; j < d; j++)
				dot += kvd_load(q, in->dtype, j) * kvd_load(k, in->dtype, j);
			p[i] = dot * in->scale;
			if (p[i] > max)
				max = p[i];
		}
		for (uint32_t i = 0; i < visible; i++) {
			p[i] = expf(p[i] - max);
			sum += p[i];
		}
		for (uint32_t i = 0; i < visible; i++)
			p[i] = (float)(p[i] / sum);
		for (uint32_t i = visible; i < L; i++)
			p[i] = 0;
	}
	return 0;
}
