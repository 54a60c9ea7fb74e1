/* SPDX-License-Identifier: MIT */
/*
 * Temporal and spatial smoothing (smooth.h): hand-computed values for every mode and for
 * ReST-KV's adaptive window pooling rules (shift signs, exact negative multiples, the
 * widening, replicate padding), then the optimised paths against the references on seeded
 * random rows.
 */

#include <math.h>
#include <stdlib.h>

#include "ktest.h"
#include "smooth.h"
#include "test.h"

#define ASSERT_NEAR(a, b, tol)                                                                \
	do {                                                                                  \
		double _x = (a), _y = (b);                                                    \
		if (!(fabs(_x - _y) <= (tol)))                                                \
			test_fail(__FILE__, __LINE__, "%s = %.9g, expected %.9g (tol %g)", #a, \
				  _x, _y, (double)(tol));                                     \
	} while (0)

typedef int (*temporal_fn)(enum kvd_temporal_mode, float, const float *, uint32_t, size_t,
			   uint32_t, float *);
typedef int (*pool_fn)(enum kvd_pool_mode, uint32_t, int32_t, const float *, uint32_t, float *);
typedef int (*aws_fn)(const float *, uint32_t, size_t, uint32_t, uint32_t, uint32_t, double,
		      struct kvd_aws *);

static const temporal_fn temporal_fns[] = { kvd_temporal_agg_ref, kvd_temporal_agg };
static const pool_fn pool_fns[] = { kvd_pool_row_ref, kvd_pool_row };
static const aws_fn aws_fns[] = { kvd_aws_params_ref, kvd_aws_params };

/* ---- temporal ---- */

TEST(temporal_ema_weights) {
	/* Row t is one-hot at column t, so agg[t] is the weight of window query t. */
	enum { W = 32 };
	float *probs = kt_floats(W * W), agg[W];

	for (int t = 0; t < W; t++)
		probs[t * W + t] = 1;
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_EMA, 0.3f, probs, W, W, W, agg));
		ASSERT_NEAR(agg[W - 1], 0.3, 1e-7);
		ASSERT_NEAR(agg[W - 2], 0.21, 1e-7);
		ASSERT_NEAR(agg[W - 3], 0.147, 1e-7);
		ASSERT_NEAR(agg[0], pow(0.7, 31), 1e-5 * pow(0.7, 31));
		ASSERT_NEAR(agg[0], 1.57e-5, 0.01e-5);
		/* The weights sum to 1. */
		double s = 0;
		for (int i = 0; i < W; i++)
			s += agg[i];
		ASSERT_NEAR(s, 1.0, 1e-6);
		/* alpha = 1 is the last query only. */
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_EMA, 1.0f, probs, W, W, W, agg));
		for (int i = 0; i < W; i++)
			ASSERT_EQ(agg[i] == (i == W - 1 ? 1.0f : 0.0f), 1);
	}
	free(probs);
}

TEST(temporal_mean_last_sum) {
	/* 3 rows of 5 columns, stride 7 (only the first 5 columns are aggregated). */
	const float probs[3 * 7] = {
		1, 2, 3, 4, 5, 99, 99,
		2, 4, 6, 8, 10, 99, 99,
		0, 0, 0, 0, 1, 99, 99,
	};
	const float mean[5] = { 1, 2, 3, 4, 16.0f / 3 }, sum[5] = { 3, 6, 9, 12, 16 },
		    last[5] = { 0, 0, 0, 0, 1 };

	for (int f = 0; f < 2; f++) {
		float agg[6];

		agg[5] = -7;
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_MEAN, 0, probs, 3, 7, 5, agg));
		for (int i = 0; i < 5; i++)
			ASSERT_NEAR(agg[i], mean[i], 1e-6);
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_SUM, 0, probs, 3, 7, 5, agg));
		for (int i = 0; i < 5; i++)
			ASSERT_NEAR(agg[i], sum[i], 0);
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_LAST, 0, probs, 3, 7, 5, agg));
		for (int i = 0; i < 5; i++)
			ASSERT_NEAR(agg[i], last[i], 0);
		/* EMA over 3 rows, alpha 0.5: 0.5*x2 + 0.25*x1 + 0.25*x0. */
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_EMA, 0.5f, probs, 3, 7, 5, agg));
		ASSERT_NEAR(agg[4], 0.5 * 1 + 0.25 * 10 + 0.25 * 5, 1e-6);
		/* n = 5 of a 7-wide row: nothing past agg[4] is written. */
		ASSERT_EQ(agg[5] == -7.0f, 1);
		/* A single row: every mode copies it. */
		for (int m = 0; m < _KVD_TEMPORAL_MAX; m++) {
			ASSERT_OK(temporal_fns[f]((enum kvd_temporal_mode)m, 0.3f, probs + 7, 1, 7, 5,
						  agg));
			for (int i = 0; i < 5; i++)
				ASSERT_NEAR(agg[i], probs[7 + i], 0);
		}
	}
}

TEST(temporal_rejects) {
	float p[4] = { 0 }, a[4];

	for (int f = 0; f < 2; f++) {
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_EMA, 0.0f, p, 1, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_EMA, 1.5f, p, 1, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_EMA, NAN, p, 1, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_MEAN, 0, p, 0, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_MEAN, 0, p, 1, 3, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](KVD_TEMPORAL_MEAN, 0, NULL, 1, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](_KVD_TEMPORAL_MAX, 0, p, 1, 4, 4, a), -EINVAL);
		ASSERT_ERRNO(temporal_fns[f](_KVD_TEMPORAL_INVALID, 0, p, 1, 4, 4, a), -EINVAL);
		ASSERT_OK(temporal_fns[f](KVD_TEMPORAL_MEAN, 0, NULL, 1, 0, 0, NULL));
	}
}

TEST(mode_names) {
	ASSERT_EQ(kvd_temporal_mode_from_string("ema"), KVD_TEMPORAL_EMA);
	ASSERT_EQ(kvd_temporal_mode_from_string("none"), KVD_TEMPORAL_LAST);
	ASSERT_EQ(kvd_temporal_mode_from_string("sum"), KVD_TEMPORAL_SUM);
	ASSERT_EQ(kvd_temporal_mode_from_string("bogus"), _KVD_TEMPORAL_INVALID);
	ASSERT_STREQ(kvd_temporal_mode_to_string(KVD_TEMPORAL_MEAN), "mean");
	ASSERT_NULL(kvd_temporal_mode_to_string(_KVD_TEMPORAL_MAX));
	ASSERT_EQ(kvd_pool_mode_from_string("avgpool"), KVD_POOL_AVG);
	ASSERT_EQ(kvd_pool_mode_from_string("max"), KVD_POOL_MAX);
	ASSERT_EQ(kvd_pool_mode_from_string("adaptive"), KVD_POOL_ADAPTIVE);
	ASSERT_EQ(kvd_pool_mode_from_string(NULL), _KVD_POOL_INVALID);
	ASSERT_STREQ(kvd_pool_mode_to_string(KVD_POOL_NONE), "none");
	ASSERT_NULL(kvd_pool_mode_to_string(_KVD_POOL_INVALID));
}

/* ---- pooling ---- */

static void pool_expect(enum kvd_pool_mode mode, uint32_t k, int32_t shift, const float *in,
			uint32_t n, const float *want, double tol) {
	float out[32];

	for (int f = 0; f < 2; f++) {
		ASSERT_OK(pool_fns[f](mode, k, shift, in, n, out));
		for (uint32_t j = 0; j < n; j++) {
			if (isnan(want[j])) {
				ASSERT_TRUE(isnan(out[j]));
				continue;
			}
			if (isinf(want[j])) {
				ASSERT_TRUE(out[j] == want[j]);
				continue;
			}
			ASSERT_NEAR(out[j], want[j], tol);
		}
	}
}

TEST(pool_avg_zero_padding) {
	const float ones[10] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 };
	const float want5[10] = { 0.6f, 0.8f, 1, 1, 1, 1, 1, 1, 0.8f, 0.6f };
	const float ramp[6] = { 1, 2, 3, 4, 5, 6 };
	const float want3[6] = { 1, 2, 3, 4, 5, 11.0f / 3 };

	/* Position 0 of a constant row gets 3/5 with k = 5: the zero padding counts. */
	pool_expect(KVD_POOL_AVG, 5, 0, ones, 10, want5, 1e-7);
	pool_expect(KVD_POOL_AVG, 3, 0, ramp, 6, want3, 1e-6);
	pool_expect(KVD_POOL_AVG, 1, 0, ramp, 6, ramp, 0);
	/* A kernel wider than the row: every output is sum/k. */
	const float three[3] = { 1, 2, 3 }, wide[3] = { 6.0f / 9, 6.0f / 9, 6.0f / 9 };
	pool_expect(KVD_POOL_AVG, 9, 0, three, 3, wide, 1e-7);
}

TEST(pool_max) {
	const float neg[5] = { -1, -5, -2, -7, -3 }, want[5] = { -1, -1, -2, -2, -3 };
	const float infs[3] = { -INFINITY, -INFINITY, 1 }, want_inf[3] = { -INFINITY, 1, 1 };
	const float nan[5] = { 1, NAN, 2, 3, 4 }, want_nan[5] = { NAN, NAN, NAN, 4, 4 };
	const float ramp[6] = { 1, 2, 3, 4, 5, 6 }, want5[6] = { 3, 4, 5, 6, 6, 6 };

	/* The padding never wins, not even over negative or -inf entries. */
	pool_expect(KVD_POOL_MAX, 3, 0, neg, 5, want, 0);
	pool_expect(KVD_POOL_MAX, 3, 0, infs, 3, want_inf, 0);
	pool_expect(KVD_POOL_MAX, 3, 0, nan, 5, want_nan, 0);
	pool_expect(KVD_POOL_MAX, 5, 0, ramp, 6, want5, 0);
}

TEST(pool_none_and_rejects) {
	float x[4] = { 1, 2, 3, 4 }, out[4];

	for (int f = 0; f < 2; f++) {
		ASSERT_OK(pool_fns[f](KVD_POOL_NONE, 0, 0, x, 4, out));
		ASSERT_EQ(memcmp(x, out, sizeof(x)), 0);
		ASSERT_OK(pool_fns[f](KVD_POOL_NONE, 0, 0, x, 4, x));
		ASSERT_ERRNO(pool_fns[f](KVD_POOL_AVG, 4, 0, x, 4, out), -EINVAL);
		ASSERT_ERRNO(pool_fns[f](KVD_POOL_MAX, 0, 0, x, 4, out), -EINVAL);
		ASSERT_ERRNO(pool_fns[f](KVD_POOL_AVG, 5, 1, x, 4, out), -EINVAL);
		ASSERT_ERRNO(pool_fns[f](KVD_POOL_ADAPTIVE, 2, 0, x, 4, out), -EINVAL);
		ASSERT_ERRNO(pool_fns[f](_KVD_POOL_MAX, 5, 0, x, 4, out), -EINVAL);
		ASSERT_ERRNO(pool_fns[f](KVD_POOL_AVG, 5, 0, NULL, 4, out), -EINVAL);
		ASSERT_OK(pool_fns[f](KVD_POOL_AVG, 5, 0, NULL, 0, NULL));
	}
}

TEST(pool_adaptive_replicate) {
	/*
	 * ReST-KV: F.pad(x, (k//2 - s, k//2 + s), 'replicate') then avg_pool1d(k, stride 1).
	 * Each expected row below is that, worked out by hand for x = 10, 20, ..., 70.
	 */
	const float x[7] = { 10, 20, 30, 40, 50, 60, 70 };
	/* s = 0: pads 2, 2 -> 10 10 [10 .. 70] 70 70 */
	const float s0[7] = { 16, 22, 30, 40, 50, 58, 64 };
	/* s = +1: pads 1, 3 -> 10 [10 .. 70] 70 70 70 */
	const float sp1[7] = { 22, 30, 40, 50, 58, 64, 68 };
	/* s = -1: pads 3, 1 -> 10 10 10 [10 .. 70] 70 */
	const float sm1[7] = { 12, 16, 22, 30, 40, 50, 58 };
	/* s = +2 = k//2: pads 0, 4 */
	const float sp2[7] = { 30, 40, 50, 58, 64, 68, 70 };
	/* s = -2: pads 4, 0 */
	const float sm2[7] = { 10, 12, 16, 22, 30, 40, 50 };
	/* k = 1, s = +1 (t = 0 with k_min 1): pads -1, 1 (F.pad crops one on the left). */
	const float k1[7] = { 20, 30, 40, 50, 60, 70, 70 };
	/* k = 7, s = -3 on a 3-entry row: windows [j-6, j], clamped at 0. */
	const float y[3] = { 1, 2, 4 };
	const float k7[3] = { 1, 8.0f / 7, 11.0f / 7 };

	pool_expect(KVD_POOL_ADAPTIVE, 5, 0, x, 7, s0, 1e-5);
	pool_expect(KVD_POOL_ADAPTIVE, 5, 1, x, 7, sp1, 1e-5);
	pool_expect(KVD_POOL_ADAPTIVE, 5, -1, x, 7, sm1, 1e-5);
	pool_expect(KVD_POOL_ADAPTIVE, 5, 2, x, 7, sp2, 1e-5);
	pool_expect(KVD_POOL_ADAPTIVE, 5, -2, x, 7, sm2, 1e-5);
	pool_expect(KVD_POOL_ADAPTIVE, 1, 1, x, 7, k1, 0);
	pool_expect(KVD_POOL_ADAPTIVE, 7, -3, y, 3, k7, 1e-6);
	/* Replicate padding keeps a constant row constant at both ends, unlike AVG. */
	const float ones[6] = { 1, 1, 1, 1, 1, 1 };
	pool_expect(KVD_POOL_ADAPTIVE, 5, 1, ones, 6, ones, 0);
	pool_expect(KVD_POOL_ADAPTIVE, 5, -2, ones, 6, ones, 0);
}

/* ---- AWS parameters ---- */

static void from_t(double t, uint32_t k_min, double scale, uint32_t kernel, int32_t shift) {
	struct kvd_aws a;

	ASSERT_OK(kvd_aws_from_t(t, k_min, scale, &a));
	if (a.kernel != kernel || a.shift != shift)
		test_fail(__FILE__, __LINE__, "t = %g, scale %g, k_min %u: got k %u shift %d, "
			  "expected k %u shift %d", t, scale, k_min, a.kernel, a.shift, kernel, shift);
}

TEST(aws_rule) {
	/* Positive t: truncation. */
	from_t(1, 5, 2000, 5, 0);
	from_t(1999, 5, 2000, 5, 0);
	from_t(2000, 5, 2000, 5, 1);
	from_t(2500, 5, 2000, 5, 1);
	from_t(4000, 5, 2000, 5, 2);
	/* Negative t, not a multiple: truncation toward zero. */
	from_t(-1, 5, 2000, 5, 0);
	from_t(-1999, 5, 2000, 5, 0);
	from_t(-2001, 5, 2000, 5, -1);
	from_t(-4001, 5, 2000, 5, -2);
	/* Exact negative multiples: one step smaller in magnitude. */
	from_t(-2000, 5, 2000, 5, 0);
	from_t(-4000, 5, 2000, 5, -1);
	from_t(-6000, 5, 2000, 7, -2);
	/* t == 0 exactly: floor(0) + 1 = +1 under the published rule. */
	from_t(0, 5, 2000, 5, 1);
	/* Widening: |t| >= 3*scale gives k = 7 over k_min 5, 4*scale... 9, and so on. */
	from_t(5999, 5, 2000, 5, 2);
	from_t(6000, 5, 2000, 7, 3);
	from_t(-6001, 5, 2000, 7, -3);
	from_t(7999, 5, 2000, 7, 3);
	from_t(8000, 5, 2000, 9, 4);
	from_t(12000, 5, 2000, 13, 6);
	from_t(-12000.5, 5, 2000, 13, -6);
	/* The RULER script's k_min 21 dominates until |t| >= 10*scale. */
	from_t(6000, 21, 2000, 21, 3);
	from_t(-20000, 21, 2000, 21, -9);
	from_t(20000, 21, 2000, 21, 10);
	from_t(22000, 21, 2000, 23, 11);
	/*
	 * Python float floor division, not floor(a/b): 1/0.1 rounds to 10.0 but 0.1 is a
	 * little above 1/10, so 1 // 0.1 == 9.0 and -1 // 0.1 == -10.0.
	 */
	from_t(1, 5, 0.1, 19, 9);
	from_t(-1, 5, 0.1, 19, -9);
	/* |sigma| <= k//2 always holds for k_min >= 3. */
	for (double t = -9000; t <= 9000; t += 250) {
		struct kvd_aws a;

		ASSERT_OK(kvd_aws_from_t(t, 5, 2000, &a));
		ASSERT_LE(abs(a.shift), (int)(a.kernel / 2));
		ASSERT_EQ(a.kernel % 2, 1u);
	}
	struct kvd_aws a;
	ASSERT_ERRNO(kvd_aws_from_t(1, 4, 2000, &a), -EINVAL);
	ASSERT_ERRNO(kvd_aws_from_t(1, 5, 0, &a), -EINVAL);
	ASSERT_ERRNO(kvd_aws_from_t(1, 5, -1, &a), -EINVAL);
	ASSERT_ERRNO(kvd_aws_from_t(NAN, 5, 2000, &a), -EINVAL);
	ASSERT_ERRNO(kvd_aws_from_t(1, 5, INFINITY, &a), -EINVAL);
	ASSERT_ERRNO(kvd_aws_from_t(1e30, 5, 1e-30, &a), -ERANGE);
}

/* Row r of probs[w][L]: zeros with 1s at the given positions (a top-K of exactly those). */
static void peaks(float *probs, uint32_t L, uint32_t r, const uint32_t *pos, int n) {
	for (uint32_t i = 0; i < L; i++)
		probs[(size_t)r * L + i] = 0.001f * (float)(i % 7) / 7;
	for (int i = 0; i < n; i++)
		probs[(size_t)r * L + pos[i]] = 1.0f - 0.01f * (float)i;
}

static void aws_expect(const float *probs, uint32_t w, uint32_t L, uint32_t topk, uint32_t k_min,
		       double scale, double t, uint32_t kernel, int32_t shift) {
	for (int f = 0; f < 2; f++) {
		struct kvd_aws a = { 0 };

		ASSERT_OK(aws_fns[f](probs, w, L, L, topk, k_min, scale, &a));
		if (a.t != t || a.kernel != kernel || a.shift != shift)
			test_fail(__FILE__, __LINE__, "%s: got t %g k %u shift %d, expected t %g k %u "
				  "shift %d", f ? "opt" : "ref", a.t, a.kernel, a.shift, t, kernel,
				  shift);
	}
}

TEST(aws_params_shifts) {
	enum { L = 16 };
	const uint32_t late[2] = { 10, 12 }, late2[2] = { 12, 10 }, early[2] = { 2, 4 },
		       early2[2] = { 4, 2 };
	float probs[4 * L];

	/* First half looks at 10..12, second half at 2..4: t = 11 - 3 = 8 (looking back). */
	peaks(probs, L, 0, late, 2);
	peaks(probs, L, 1, late2, 2);
	peaks(probs, L, 2, early, 2);
	peaks(probs, L, 3, early2, 2);
	aws_expect(probs, 4, L, 2, 5, 2, 8, 9, 4);
	aws_expect(probs, 4, L, 2, 5, 3, 8, 5, 2);
	aws_expect(probs, 4, L, 2, 5, 9, 8, 5, 0);
	/* Swapped halves: t = -8; an exact negative multiple of 2 and 4, not of 3. */
	peaks(probs, L, 0, early, 2);
	peaks(probs, L, 1, early2, 2);
	peaks(probs, L, 2, late, 2);
	peaks(probs, L, 3, late2, 2);
	aws_expect(probs, 4, L, 2, 5, 2, -8, 9, -3);
	aws_expect(probs, 4, L, 2, 5, 4, -8, 5, -1);
	aws_expect(probs, 4, L, 2, 5, 3, -8, 5, -2);
	aws_expect(probs, 4, L, 2, 5, 9, -8, 5, 0);
	/* The same positions in both halves: t = 0, so shift +1. */
	peaks(probs, L, 2, early, 2);
	peaks(probs, L, 3, early2, 2);
	aws_expect(probs, 4, L, 2, 5, 2, 0, 5, 1);
	/* Odd w: the newest row (here looking at 10..12) is not paired, so t stays 0. */
	peaks(probs, L, 2, late, 2);
	aws_expect(probs, 3, L, 2, 5, 2, 0, 5, 1);
	/* w = 1: no pairs, t = 0. */
	aws_expect(probs, 1, L, 2, 5, 2, 0, 5, 1);
	/* Unequal per-row means: rows 0/1 average 3 and 6, rows 2/3 both 11: t = 4.5 - 11. */
	const uint32_t a[2] = { 2, 4 }, b[2] = { 5, 7 };
	peaks(probs, L, 0, a, 2);
	peaks(probs, L, 1, b, 2);
	peaks(probs, L, 2, late, 2);
	peaks(probs, L, 3, late, 2);
	aws_expect(probs, 4, L, 2, 3, 2, -6.5, 7, -3);
}

TEST(aws_params_ties_nan) {
	enum { L = 10 };
	float probs[2 * L];

	/* All equal: ties go to the lower positions, so the top-3 is 0, 1, 2 in both rows. */
	for (int i = 0; i < 2 * L; i++)
		probs[i] = 0.1f;
	aws_expect(probs, 2, L, 3, 5, 1, 0, 5, 1);
	/* Row 1: NaN everywhere except two small numbers at 8 and 9, which outrank the NaNs;
	 * the third place goes to the lowest NaN position, 0. Top-3 = {8, 9, 0}: mean 17/3. */
	for (int i = 0; i < L; i++)
		probs[L + i] = NAN;
	probs[L + 8] = -INFINITY;
	probs[L + 9] = -1;
	aws_expect(probs, 2, L, 3, 5, 1, -14.0 / 3, 9, -4);
	/* -0 ties with +0: row 0 = +0 everywhere but -0 at 0, so top-1 is position 0. */
	for (int i = 0; i < L; i++)
		probs[i] = 0.0f, probs[L + i] = 0.0f;
	probs[0] = -0.0f;
	probs[L + 5] = 1e-30f;
	aws_expect(probs, 2, L, 1, 5, 1, -5, 11, -4);
	/* topk beyond L clamps to L: every position, both halves equal. */
	aws_expect(probs, 2, L, 99, 5, 1, 0, 5, 1);
}

TEST(aws_params_published_scale) {
	/* w = 2, top-1: row 0 peaks at 100, row 1 at 2100, so t = -2000 = -scale: shift 0. */
	enum { L = 4200 };
	float *probs = kt_floats(2 * L);
	const uint32_t p0 = 100, p1 = 2100;

	peaks(probs, L, 0, &p0, 1);
	peaks(probs, L, 1, &p1, 1);
	aws_expect(probs, 2, L, 1, 5, KVD_AWS_SCALE, -2000, 5, 0);
	/* Row 0 at 4100, row 1 at 100: t = 4000, shift 2, k 5. */
	const uint32_t p3 = 4100;
	peaks(probs, L, 0, &p3, 1);
	peaks(probs, L, 1, &p0, 1);
	aws_expect(probs, 2, L, 1, 5, KVD_AWS_SCALE, 4000, 5, 2);
	free(probs);
}

TEST(aws_params_rejects) {
	float p[8] = { 0 };
	struct kvd_aws a;

	for (int f = 0; f < 2; f++) {
		ASSERT_ERRNO(aws_fns[f](NULL, 2, 4, 4, 1, 5, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 4, 1, 5, 1, NULL), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 0, 4, 4, 1, 5, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 3, 4, 1, 5, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 0, 1, 5, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 4, 0, 5, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 4, 1, 6, 1, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 4, 1, 5, 0, &a), -EINVAL);
		ASSERT_ERRNO(aws_fns[f](p, 2, 4, 4, 1, 5, NAN, &a), -EINVAL);
	}
}

/* ---- optimised against reference ---- */

TEST(random_equivalence) {
	static const uint32_t sizes[][2] = { { 1, 1 }, { 2, 7 }, { 8, 100 }, { 32, 1000 },
					      { 5, 4099 }, { 32, 5000 } };

	KT_FOREACH_PATH(path)
		for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
			uint64_t seed = 0x5eed + c;
			uint32_t w = sizes[c][0], L = sizes[c][1], n = L > w ? L - w : L;
			size_t stride = L + 3;
			float *probs = kt_floats(w * stride), *a = kt_floats(L), *b = kt_floats(L);

			for (size_t i = 0; i < w * stride; i++) {
				float u = kt_uniform(&seed);

				/* Quantised values make ties common; a few NaN and inf. */
				probs[i] = c % 2 ? floorf((u + 1) * 8) / 16 : (u + 1) / 2;
				if (kt_next(&seed) % 97 == 0)
					probs[i] = kt_next(&seed) % 2 ? NAN : INFINITY;
			}
			for (int m = 0; m < _KVD_TEMPORAL_MAX; m++) {
				ASSERT_OK(kvd_temporal_agg_ref(m, 0.3f, probs, w, stride, n, a));
				ASSERT_OK(kvd_temporal_agg(m, 0.3f, probs, w, stride, n, b));
				ASSERT_TRUE(kt_close("temporal", a, b, n, 1e-7, 1e-5));
			}
			for (int m = 0; m < _KVD_POOL_MAX; m++) {
				static const uint32_t ks[] = { 1, 3, 5, 7, 21, 129 };

				for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
					int32_t shifts[] = { 0, 1, -1, (int32_t)ks[ki] / 2, -(int32_t)ks[ki] / 2,
							     (int32_t)ks[ki] / 2 + 3 };

					for (size_t si = 0; si < 6; si++) {
						int32_t s = m == KVD_POOL_ADAPTIVE ? shifts[si] : 0;

						if (m != KVD_POOL_ADAPTIVE && si > 0)
							break;
						ASSERT_OK(kvd_pool_row_ref(m, ks[ki], s, probs, L, a));
						ASSERT_OK(kvd_pool_row(m, ks[ki], s, probs, L, b));
						ASSERT_TRUE(kt_close("pool", a, b, L, 0, 0));
					}
				}
			}
			for (uint32_t k = 1; k <= L; k = k * 3 + 1) {
				struct kvd_aws x, y;

				ASSERT_OK(kvd_aws_params_ref(probs, w, stride, L, k, 5, 2.5, &x));
				ASSERT_OK(kvd_aws_params(probs, w, stride, L, k, 5, 2.5, &y));
				ASSERT_TRUE(x.t == y.t && x.kernel == y.kernel && x.shift == y.shift);
			}
			free(probs);
			free(a);
			free(b);
		}
}

/*
 * The optimised top-K first tries a band around the previous row's K-th largest: rows whose
 * K-th largest jumps (the band misses), creeps (the band must widen) or stays; negative
 * values, both zeros, infinities and NaN; a row longer than the scan's 65536-entry chunks.
 */
TEST(aws_rows_that_move) {
	static const uint32_t sizes[][2] = { { 8, 3000 }, { 32, 300 }, { 4, 70000 } };

	KT_FOREACH_PATH(path)
		for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
			uint32_t w = sizes[c][0], L = sizes[c][1];
			uint64_t seed = 0xa5 + c;
			float *probs = kt_floats((size_t)w * L);

			for (uint32_t r = 0; r < w; r++) {
				/* Jumps by 1000x on every third row, creeps by 2% on the others. */
				float scale = (r % 3 == 1 ? 1000.0f : 1.0f) * (1.0f + 0.02f * (float)r);

				for (uint32_t i = 0; i < L; i++) {
					float u = kt_uniform(&seed), *x = probs + (size_t)r * L + i;

					*x = scale * (c == 1 ? floorf(u * 8) / 8 : u);
					switch (kt_next(&seed) % 211) {
					case 0: *x = NAN; break;
					case 1: *x = -0.0f; break;
					case 2: *x = 0.0f; break;
					case 3: *x = INFINITY; break;
					case 4: *x = -INFINITY; break;
					}
				}
			}
			for (uint32_t k = 1; k <= L; k = k * 7 + 3) {
				struct kvd_aws x, y;

				ASSERT_OK(kvd_aws_params_ref(probs, w, L, L, k, 5, 0.5, &x));
				ASSERT_OK(kvd_aws_params(probs, w, L, L, k, 5, 0.5, &y));
				if (!(x.t == y.t && x.kernel == y.kernel && x.shift == y.shift))
					test_fail(__FILE__, __LINE__, "%s w %u L %u K %u: t %.17g, expected %.17g",
						  path, w, L, k, y.t, x.t);
			}
			free(probs);
		}
}
