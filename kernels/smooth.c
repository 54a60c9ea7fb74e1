/* SPDX-License-Identifier: MIT */
/*
 * The optimised smoothing kernels. Temporal aggregation and pooling are O(w*n) and O(k*n)
 * streaming loops: row-major over column blocks (cache-friendly), the EMA step on simd.h's
 * axpby, and pooling split into an unclamped interior and clamped edges. Their per-element
 * operation order is the reference's, so they agree with it to the bit unless the compiler
 * contracts a*b+c (the EMA's axpby does, on the FMA paths). The AWS top-K, the one
 * super-linear step of the reference (a sort per row), is one vector pass per row here
 * while a band around the previous row's K-th largest holds the row's own, else three
 * (a histogram, then two scans): they read each of the w rows of L entries, which costs as
 * much as the softmax that made them, so the passes are simd.h's rank ops.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"
#include "smooth.h"

/* Columns per block: the accumulator block stays in L1 while the w rows stream past. */
#define TEMPORAL_BLOCK 2048u

int kvd_temporal_agg(enum kvd_temporal_mode mode, float alpha, const float *probs, uint32_t w,
		     size_t stride, uint32_t n, float *agg) {
	const struct kvd_simd_ops *ops = kvd_simd();
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
				ops->axpby(nc, alpha, x, beta, acc);
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

/* The top bits of the keys that the histogram of row_topk_position_sum() counts. */
#define TOPK_BUCKET_BITS 12u
#define TOPK_BUCKETS (1u << TOPK_BUCKET_BITS)
/* The least half-width of the band that row_topk_position_sum() tries first: 2^19 keys,
 * 1/16 of an octave (a key step is an ulp). */
#define TOPK_GUESS_HALF (1u << 19)

/*
 * What the rows of one head tell the next: the last row's K-th largest key, and the
 * half-width of the band around it to try first, which grows to twice the largest step
 * the K-th largest has made between rows so far (0: no row seen yet).
 */
struct topk_guess {
	uint32_t kth, half;
};

/*
 * The sum of pos[i] over the K largest of key[0..n), ties toward lower i, 0 < K <= n, every
 * key within [lo, hi]; returns the K-th largest key T in *kth. An MSB-first radix selection
 * of T, 8 bits at a time below the top bits that lo and hi (so every key) share: each pass
 * counts the digits, adds the positions of the keys whose digit is above T's, and keeps
 * the keys whose digit is T's (in order, in place), so the passes shrink. The keys left at
 * the end all equal T, and the first of them that are needed are taken.
 */
static uint64_t select_sum(uint32_t *key, uint32_t *pos, uint32_t n, uint32_t K, uint32_t lo,
			   uint32_t hi, uint32_t *kth) {
	uint32_t prefix = lo, need = K;
	uint64_t sum = 0;
	int shift = 24;

	while (shift >= 0 && lo >> shift == hi >> shift)
		shift -= 8;
	for (; shift >= 0; shift -= 8) {
		uint32_t hist[256] = { 0 }, b = 255, m = 0;

		for (uint32_t i = 0; i < n; i++)
			hist[(key[i] >> shift) & 0xff]++;
		for (; b > 0 && hist[b] < need; b--)
			need -= hist[b];
		/* Branch-free: every key is written at m, which only those with digit b advance. */
		for (uint32_t i = 0; i < n; i++) {
			uint32_t digit = (key[i] >> shift) & 0xff;

			sum += digit > b ? pos[i] : 0;
			key[m] = key[i];
			pos[m] = pos[i];
			m += digit == b;
		}
		n = m;
		prefix = (prefix & ~(0xffu << shift)) | b << shift;
	}
	for (uint32_t i = 0; i < need; i++)
		sum += pos[i];
	*kth = prefix;
	return sum;
}

/*
 * The sum of the positions of the K largest entries of row[0..L) in the ranking order
 * of kvd_aws_params(), 0 < K <= L, updating the guess. Vector passes (simd.h's rank ops)
 * do the work: a scan sums the positions above a band of keys and collects the keys inside
 * it (a small share of the row), among which select_sum() finishes. The band comes first
 * from the guess: the rows of one head rank much alike, so it mostly holds this row's K-th
 * largest too, which the scan's counts prove. Else a histogram of the keys' top
 * TOPK_BUCKET_BITS bits finds the bucket that holds it, for a second scan. hist holds
 * TOPK_BUCKETS, key and pos L each.
 */
static uint64_t row_topk_position_sum(const struct kvd_simd_ops *ops, const float *row,
				      uint32_t L, uint32_t K, struct topk_guess *guess,
				      uint32_t *hist, uint32_t *key, uint32_t *pos) {
	const uint32_t shift = 32 - TOPK_BUCKET_BITS;
	uint32_t need = K, b = TOPK_BUCKETS - 1, lo, hi, n = 0, above = K, kth, step;
	uint64_t sum = 0;

	if (guess->half) {
		lo = guess->kth > guess->half ? guess->kth - guess->half : 0;
		hi = guess->kth < UINT32_MAX - guess->half ? guess->kth + guess->half : UINT32_MAX;
		sum = ops->rank_scan(row, L, lo, hi, key, pos, &n, &above);
	}
	if (above < K && K - above <= n)
		sum += select_sum(key, pos, n, K - above, lo, hi, &kth);
	else {
		memset(hist, 0, TOPK_BUCKETS * sizeof(*hist));
		ops->rank_hist(row, L, shift, hist);
		for (; hist[b] < need; b--)
			need -= hist[b];
		lo = b << shift, hi = lo | ((1u << shift) - 1);
		sum = ops->rank_scan(row, L, lo, hi, key, pos, &n, &above);
		sum += select_sum(key, pos, n, need, lo, hi, &kth);
	}
	step = kth > guess->kth ? kth - guess->kth : guess->kth - kth;
	if (!guess->half)
		guess->half = TOPK_GUESS_HALF;
	else if (step > guess->half / 2)
		guess->half = step < UINT32_MAX / 2 ? 2 * step : UINT32_MAX;
	guess->kth = kth;
	return sum;
}

int kvd_aws_params(const float *probs, uint32_t w, size_t stride, uint32_t L, uint32_t topk,
		   uint32_t k_min, double scale, struct kvd_aws *ret) {
	const struct kvd_simd_ops *ops = kvd_simd();
	uint32_t half = w / 2, K = topk < L ? topk : L, *buf;
	struct topk_guess guess = { 0, 0 };
	int64_t diff = 0;
	double t = 0;

	if (!probs || !ret || w == 0 || L == 0 || stride < L || topk == 0 || k_min % 2 == 0 ||
	    !isfinite(scale) || !(scale > 0))
		return -EINVAL;
	/* The histogram, then the keys and positions of the band. */
	buf = malloc((TOPK_BUCKETS + 2 * (size_t)L) * sizeof(*buf));
	if (!buf)
		return -ENOMEM;
	for (uint32_t r = 0; r < 2 * half; r++) {
		uint64_t sum = row_topk_position_sum(ops, probs + (size_t)r * stride, L, K, &guess,
						     buf, buf + TOPK_BUCKETS, buf + TOPK_BUCKETS + L);

		if (r < half)
			diff += (int64_t)sum;
		else
			diff -= (int64_t)sum;
	}
	free(buf);
	if (half > 0)
		t = (double)diff / ((double)half * K);
	return kvd_aws_from_t(t, k_min, scale, ret);
}
