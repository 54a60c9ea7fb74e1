/* SPDX-License-Identifier: MIT */
/*
 * The reference smoothing kernels: plain loops in the order the math is written, a full
 * sort for the AWS top-K. Also the shared, exact (kernel, shift) rule and the mode names.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "smooth.h"

static const char *const temporal_names[_KVD_TEMPORAL_MAX] = {
	[KVD_TEMPORAL_EMA] = "ema",
	[KVD_TEMPORAL_MEAN] = "mean",
	[KVD_TEMPORAL_LAST] = "last",
	[KVD_TEMPORAL_SUM] = "sum",
};

static const char *const pool_names[_KVD_POOL_MAX] = {
	[KVD_POOL_NONE] = "none",
	[KVD_POOL_AVG] = "avgpool",
	[KVD_POOL_MAX] = "maxpool",
	[KVD_POOL_ADAPTIVE] = "adaptive",
};

const char *kvd_temporal_mode_to_string(enum kvd_temporal_mode m) {
	if ((int)m < 0 || m >= _KVD_TEMPORAL_MAX)
		return NULL;
	return temporal_names[m];
}

enum kvd_temporal_mode kvd_temporal_mode_from_string(const char *s) {
	if (!s)
		return _KVD_TEMPORAL_INVALID;
	for (int i = 0; i < _KVD_TEMPORAL_MAX; i++)
		if (strcmp(s, temporal_names[i]) == 0)
			return (enum kvd_temporal_mode)i;
	if (strcmp(s, "none") == 0)
		return KVD_TEMPORAL_LAST;
	return _KVD_TEMPORAL_INVALID;
}

const char *kvd_pool_mode_to_string(enum kvd_pool_mode m) {
	if ((int)m < 0 || m >= _KVD_POOL_MAX)
		return NULL;
	return pool_names[m];
}

enum kvd_pool_mode kvd_pool_mode_from_string(const char *s) {
	if (!s)
		return _KVD_POOL_INVALID;
	for (int i = 0; i < _KVD_POOL_MAX; i++)
		if (strcmp(s, pool_names[i]) == 0)
			return (enum kvd_pool_mode)i;
	if (strcmp(s, "avg") == 0)
		return KVD_POOL_AVG;
	if (strcmp(s, "max") == 0)
		return KVD_POOL_MAX;
	return _KVD_POOL_INVALID;
}

int kvd_temporal_agg_ref(enum kvd_temporal_mode mode, float alpha, const float *probs,
			 uint32_t w, size_t stride, uint32_t n, float *agg) {
	if (w == 0 || stride < n || (n > 0 && (!probs || !agg)) || (int)mode < 0 ||
	    mode >= _KVD_TEMPORAL_MAX)
		return -EINVAL;
	/* !(alpha > 0) also refuses NaN. */
	if (mode == KVD_TEMPORAL_EMA && (!(alpha > 0) || alpha > 1))
		return -EINVAL;

	for (uint32_t i = 0; i < n; i++) {
		float acc;

		switch (mode) {
		case KVD_TEMPORAL_EMA:
			acc = probs[i];
			for (uint32_t t = 1; t < w; t++) {
				float x = probs[t * stride + i];

				acc = alpha * x + (1 - alpha) * acc;
			}
			break;
		case KVD_TEMPORAL_LAST:
			acc = probs[(w - 1) * stride + i];
			break;
		default:
			acc = 0;
			for (uint32_t t = 0; t < w; t++)
				acc += probs[t * stride + i];
			if (mode == KVD_TEMPORAL_MEAN)
				acc /= (float)w;
			break;
		}
		agg[i] = acc;
	}
	return 0;
}

static int64_t clamp_index(int64_t i, uint32_t n) {
	return i < 0 ? 0 : i >= (int64_t)n ? (int64_t)n - 1 : i;
}

int kvd_pool_row_ref(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift, const float *in,
		     uint32_t n, float *out) {
	int64_t half = kernel / 2;

	if ((n > 0 && (!in || !out)) || (int)mode < 0 || mode >= _KVD_POOL_MAX)
		return -EINVAL;
	if (mode != KVD_POOL_ADAPTIVE && shift != 0)
		return -EINVAL;
	if (mode != KVD_POOL_NONE && kernel % 2 == 0)
		return -EINVAL;
	if (mode == KVD_POOL_NONE) {
		if (n > 0 && in != out)
			memmove(out, in, (size_t)n * sizeof(float));
		return 0;
	}

	for (int64_t j = 0; j < (int64_t)n; j++) {
		double sum = 0;
		float max = -INFINITY;
		int any_nan = 0;

		for (int64_t m = -half; m <= half; m++) {
			int64_t i = j + m;

			switch (mode) {
			case KVD_POOL_AVG:
				if (i >= 0 && i < (int64_t)n)
					sum += in[i];
				break;
			case KVD_POOL_MAX:
				if (i >= 0 && i < (int64_t)n) {
					if (isnan(in[i]))
						any_nan = 1;
					else if (in[i] > max)
						max = in[i];
				}
				break;
			default:
				sum += in[clamp_index(i + shift, n)];
				break;
			}
		}
		if (mode == KVD_POOL_MAX)
			out[j] = any_nan ? NAN : max;
		else
			out[j] = (float)(sum / (double)kernel);
	}
	return 0;
}

/*
 * CPython's float floor division (Objects/floatobject.c, _float_div_mod), which PyTorch's
 * floor_divide also follows: the quotient of the exact fmod remainder, so that exact
 * multiples come out exact rather than one off.
 */
static double py_floordiv(double vx, double wx) {
	double mod = fmod(vx, wx), div = (vx - mod) / wx, floordiv;

	if (mod != 0) {
		if ((wx < 0) != (mod < 0))
			div -= 1.0;
	}
	if (div != 0) {
		floordiv = floor(div);
		if (div - floordiv > 0.5)
			floordiv += 1.0;
	} else
		floordiv = copysign(0.0, vx / wx);
	return floordiv;
}

int kvd_aws_from_t(double t, uint32_t k_min, double scale, struct kvd_aws *ret) {
	double q, s, k;

	if (!ret || !isfinite(t) || k_min % 2 == 0 || !isfinite(scale) || !(scale > 0))
		return -EINVAL;
	q = py_floordiv(fabs(t), scale);
	s = py_floordiv(t, scale);
	if (!(t > 0))
		s += 1;
	k = 2 * q + 1;
	if (!(k <= INT32_MAX))
		return -ERANGE;
	ret->kernel = k > k_min ? (uint32_t)k : k_min;
	ret->shift = (int32_t)s;
	ret->t = t;
	return 0;
}

struct ranked {
	float v;
	uint32_t pos;
};

/* Descending by value, NaN last, -0 == +0, then ascending by position: a total order. */
static int ranked_cmp(const void *a, const void *b) {
	const struct ranked *x = a, *y = b;
	int xn = isnan(x->v), yn = isnan(y->v);

	if (xn != yn)
		return xn - yn;
	if (!xn && x->v != y->v)
		return x->v > y->v ? -1 : 1;
	return x->pos < y->pos ? -1 : x->pos > y->pos;
}

int kvd_aws_params_ref(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		       uint32_t k_min, double scale, struct kvd_aws *ret) {
	uint32_t half = w / 2, K = topk < L ? topk : L;
	struct ranked *row;
	int64_t diff = 0;
	double t = 0;

	if (!probs || !ret || w == 0 || L == 0 || stride < L || topk == 0 || k_min % 2 == 0 ||
	    !isfinite(scale) || !(scale > 0))
		return -EINVAL;
	row = malloc((size_t)L * sizeof(*row));
	if (!row)
		return -ENOMEM;
	for (uint32_t r = 0; r < 2 * half; r++) {
		uint64_t sum = 0;

		for (uint32_t i = 0; i < L; i++)
			row[i] = (struct ranked){ probs[r * stride + i], i };
		qsort(row, L, sizeof(*row), ranked_cmp);
		for (uint32_t i = 0; i < K; i++)
			sum += row[i].pos;
		if (r < half)
			diff += (int64_t)sum;
		else
			diff -= (int64_t)sum;
	}
	free(row);
	if (half > 0)
		t = (double)diff / ((double)half * K);
	return kvd_aws_from_t(t, k_min, scale, ret);
}
