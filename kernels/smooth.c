/* SPDX-License-Identifier: MIT */
/*
 * The optimised smoothing kernels. Temporal aggregation and pooling are O(w*n) and O(k*n)
 * streaming loops, negligible next to the O(w*L*d) window attention that feeds them, so
 * they are one clean implementation each: row-major over column blocks (cache-friendly,
 * auto-vectorisable), and pooling split into an unclamped interior and clamped edges. Their
 * per-element operation order is the reference's, so they agree with it to the bit unless
 * the compiler contracts a*b+c. The AWS top-K, the one super-linear step of the reference
 * (a sort per row), is an O(L) radix selection here.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "smooth.h"

/* Columns per block: the accumulator block stays in L1 while the w rows stream past. */
#define TEMPORAL_BLOCK 2048u

int kvd_temporal_agg(enum kvd_temporal_mode mode, float alpha, const float *probs, uint32_t w,
		     size_t stride, uint32_t n, float *agg) {
	float beta = 1 - alpha;

	if (w == 0 || stride < n || (n > 0 && (!probs || !agg)) || (int)mode < 0 ||
	    mode >= _KVD_TEMPORAL_MAX)
		return -EINVAL;
	if (mode == KVD_TEMPORAL_EMA && (!(alpha > 0) || alpha > 1))
		return -EINVAL;

	for (uint32_t c0 = 0; c0 < n; c0 += TEMPORAL_BLOCK) {
		uint32_t nc = n - c0 < TEMPORAL_BLOCK ? n - c0 : TEMPORAL_BLOCK;
		float *restrict acc = agg + c0;

		if (mode == KVD_TEMPORAL_LAST) {
			memcpy(acc, probs + (size_t)(w - 1) * stride + c0, nc * sizeof(float));
			continue;
		}
		memcpy(acc, probs + c0, nc * sizeof(float));
		for (uint32_t t = 1; t < w; t++) {
			const float *restrict x = probs + (size_t)t * stride + c0;

			if (mode == KVD_TEMPORAL_EMA)
				for (uint32_t i = 0; i < nc; i++)
					acc[i] = alpha * x[i] + beta * acc[i];
			else
				for (uint32_t i = 0; i < nc; i++)
					acc[i] += x[i];
		}
		if (mode == KVD_TEMPORAL_MEAN)
			for (uint32_t i = 0; i < nc; i++)
				acc[i] /= (float)w;
	}
	return 0;
}

static int64_t clamp_index(int64_t i, uint32_t n) {
	return i < 0 ? 0 : i >= (int64_t)n ? (int64_t)n - 1 : i;
}

/* One output of the pooling, for the edges: out-of-range handling as in the reference. */
static float pool_one(enum kvd_pool_mode mode, int64_t half, int32_t shift, const float *in,
		      uint32_t n, int64_t j) {
	double sum = 0;
	float max = -INFINITY;
	int any_nan = 0;

	for (int64_t i = j - half; i <= j + half; i++) {
		if (mode == KVD_POOL_ADAPTIVE)
			sum += in[clamp_index(i + shift, n)];
		else if (i < 0 || i >= (int64_t)n)
			continue;
		else if (mode == KVD_POOL_AVG)
			sum += in[i];
		else if (isnan(in[i]))
			any_nan = 1;
		else if (in[i] > max)
			max = in[i];
	}
	if (mode == KVD_POOL_MAX)
		return any_nan ? NAN : max;
	return (float)(sum / (double)(2 * half + 1));
}

int kvd_pool_row(enum kvd_pool_mode mode, uint32_t kernel, int32_t shift, const float *in,
		 uint32_t n, float *out) {
	int64_t half = kernel / 2, lo, hi;

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

	/* The interior [lo, hi): outputs whose whole (shifted) window is in range. */
	lo = half - shift;
	hi = (int64_t)n - half - shift;
	if (lo < 0)
		lo = 0;
	if (hi > (int64_t)n)
		hi = n;
	if (hi < lo)
		hi = lo = n;

	for (int64_t j = 0; j < lo; j++)
		out[j] = pool_one(mode, half, shift, in, n, j);
	if (mode == KVD_POOL_MAX) {
		for (int64_t j = lo; j < hi; j++) {
			const float *x = in + j - half;
			float max = -INFINITY;
			int any_nan = 0;

			for (int64_t m = 0; m < kernel; m++) {
				any_nan |= isnan(x[m]);
				max = x[m] > max ? x[m] : max;
			}
			out[j] = any_nan ? NAN : max;
		}
	} else {
		for (int64_t j = lo; j < hi; j++) {
			const float *x = in + j + shift - half;
			double sum = 0;

			for (int64_t m = 0; m < kernel; m++)
				sum += x[m];
			out[j] = (float)(sum / (double)kernel);
		}
	}
	for (int64_t j = hi; j < (int64_t)n; j++)
		out[j] = pool_one(mode, half, shift, in, n, j);
	return 0;
}

/*
 * An unsigned key whose order is the ranking order of kvd_aws_params(): larger value,
 * larger key; -0 and +0 one key; NaN the smallest key of all (0, which no number maps to).
 */
static uint32_t rank_key(float v) {
	uint32_t u;

	if (isnan(v))
		return 0;
	if (v == 0)
		v = 0;
	memcpy(&u, &v, sizeof(u));
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/*
 * The sum of the positions of the K largest keys (ties toward lower positions), K <= L:
 * an MSB-first radix selection of the K-th largest key T, then one pass taking every key
 * above T and the first (lowest-position) keys equal to T.
 */
static uint64_t topk_position_sum(const uint32_t *key, uint32_t L, uint32_t K) {
	uint32_t prefix = 0, mask = 0, need = K;
	uint64_t sum = 0;

	for (int shift = 24; shift >= 0; shift -= 8) {
		uint32_t hist[256] = { 0 };
		int b;

		for (uint32_t i = 0; i < L; i++)
			if ((key[i] & mask) == prefix)
				hist[(key[i] >> shift) & 0xff]++;
		for (b = 255; b > 0 && hist[b] < need; b--)
			need -= hist[b];
		prefix |= (uint32_t)b << shift;
		mask |= 0xffu << shift;
	}
	/* Now exactly K - need keys are > prefix, and need of those == prefix are taken. */
	for (uint32_t i = 0; i < L; i++) {
		if (key[i] > prefix)
			sum += i;
		else if (key[i] == prefix && need > 0) {
			sum += i;
			need--;
		}
	}
	return sum;
}

int kvd_aws_params(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		   uint32_t k_min, double scale, struct kvd_aws *ret) {
	uint32_t half = w / 2, K = topk < L ? topk : L, *key;
	int64_t diff = 0;
	double t = 0;

	if (!probs || !ret || w == 0 || L == 0 || stride < L || topk == 0 || k_min % 2 == 0 ||
	    !isfinite(scale) || !(scale > 0))
		return -EINVAL;
	key = malloc((size_t)L * sizeof(*key));
	if (!key)
		return -ENOMEM;
	for (uint32_t r = 0; r < 2 * half; r++) {
		const float *row = probs + (size_t)r * stride;
		uint64_t sum;

		for (uint32_t i = 0; i < L; i++)
			key[i] = rank_key(row[i]);
		sum = topk_position_sum(key, L, K);
		if (r < half)
			diff += (int64_t)sum;
		else
			diff -= (int64_t)sum;
	}
	free(key);
	if (half > 0)
		t = (double)diff / ((double)half * K);
	return kvd_aws_from_t(t, k_min, scale, ret);
}
