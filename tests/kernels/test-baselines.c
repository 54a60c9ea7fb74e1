/* SPDX-License-Identifier: MIT */
/*
 * The baselines (baselines.h): hand-checked small cases for each, budgets for PyramidKV and
 * AdaKV, non-finite inputs, then the optimised path against the reference on seeded random
 * inputs for every baseline, dtype, SIMD path and a few shapes and thread counts.
 */

#include <math.h>
#include <stdlib.h>

#include "attn.h"
#include "baselines.h"
#include "ktest.h"
#include "test.h"

#define ASSERT_NEAR(a, b, tol)                                                                \
	do {                                                                                  \
		double _x = (a), _y = (b);                                                    \
		if (!(fabs(_x - _y) <= (tol)))                                                \
			test_fail(__FILE__, __LINE__, "%s = %.9g, expected %.9g (tol %g)", #a, \
				  _x, _y, (double)(tol));                                     \
	} while (0)

typedef int (*scores_fn)(enum kvd_baseline, const struct kvd_baseline_params *,
			 const struct kvd_attn_in *, float *);
static const scores_fn paths[] = { kvd_baseline_scores_ref, kvd_baseline_scores };
static const char *const path_names[] = { "ref", "opt" };

static struct kvd_attn_in f32_in(uint32_t H, uint32_t Hkv, uint32_t w, uint32_t L, uint32_t d,
				 const float *q, const float *k, const float *v) {
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = H, .kv_heads = Hkv, .window = w, .len = L,
		.dim = d, .scale = 1.0f / sqrtf((float)d), .q = q, .k = k, .v = v,
	};

	kvd_attn_in_contiguous(&in);
	return in;
}

static void no_nan(const float *s, size_t n) {
	for (size_t i = 0; i < n; i++)
		if (isnan(s[i]))
			test_fail(__FILE__, __LINE__, "score %zu is NaN", i);
}

TEST(names_and_defaults) {
	struct kvd_baseline_params p;

	for (int b = 0; b < _KVD_BASELINE_MAX; b++)
		ASSERT_EQ(kvd_baseline_from_string(kvd_baseline_to_string(b)), b);
	ASSERT_EQ(kvd_baseline_from_string("expected_attention"), KVD_BASELINE_EXPECTED_ATTENTION);
	ASSERT_EQ(kvd_baseline_from_string("restkv"), _KVD_BASELINE_INVALID);
	ASSERT_EQ(kvd_baseline_from_string(NULL), _KVD_BASELINE_INVALID);
	ASSERT_NULL(kvd_baseline_to_string(_KVD_BASELINE_MAX));
	kvd_baseline_params_init(KVD_BASELINE_SNAPKV, &p);
	ASSERT_EQ(p.temporal, KVD_TEMPORAL_SUM);
	ASSERT_EQ(p.pool, KVD_POOL_AVG);
	ASSERT_EQ(p.kernel, 5u);
	ASSERT_EQ(p.n_sink, 4u);
	kvd_baseline_params_init(KVD_BASELINE_ADAKV, &p);
	ASSERT_EQ(p.temporal, KVD_TEMPORAL_MEAN);
	ASSERT_EQ(p.pool, KVD_POOL_MAX);
	ASSERT_EQ(p.kernel, 7u);
	kvd_baseline_params_init(KVD_BASELINE_EXPECTED_ATTENTION, &p);
	ASSERT_EQ(p.n_future, 512u);
	ASSERT_TRUE(p.rope_theta == 10000.0f && p.use_covariance && p.use_vnorm && p.epsilon == 0);
}

TEST(streamingllm_positions) {
	struct kvd_baseline_params p;
	struct kvd_attn_in in = { .heads = 4, .kv_heads = 2, .window = 1, .len = 10 };
	float s[4 * 10];

	kvd_baseline_params_init(KVD_BASELINE_STREAMINGLLM, &p);
	for (int f = 0; f < 2; f++)
		for (p.per_query_head = 0; p.per_query_head < 2; p.per_query_head++) {
			uint32_t rows = kvd_baseline_rows(&p, &in);

			ASSERT_EQ(rows, p.per_query_head ? 4u : 2u);
			ASSERT_OK(paths[f](KVD_BASELINE_STREAMINGLLM, &p, &in, s));
			for (uint32_t r = 0; r < rows; r++)
				for (uint32_t i = 0; i < 10; i++)
					ASSERT_TRUE(s[r * 10 + i] == (i < 4 ? INFINITY : (float)i));
		}
	/* Fewer tokens than sinks: all kept. */
	in.len = 3;
	p.per_query_head = 0;
	ASSERT_OK(kvd_baseline_scores(KVD_BASELINE_STREAMINGLLM, &p, &in, s));
	for (int i = 0; i < 6; i++)
		ASSERT_TRUE(s[i] == INFINITY);
}

TEST(knorm_known_keys) {
	/* kv head 0: (3,4), (0,0), (1,0); kv head 1: (-6,8), (0,-2), (0.5,0) */
	const float k[12] = { 3, 4, 0, 0, 1, 0, -6, 8, 0, -2, 0.5f, 0 };
	const float want[6] = { -5, 0, -1, -10, -2, -0.5f };
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };
	struct kvd_baseline_params p;
	float s[12];

	kvd_baseline_params_init(KVD_BASELINE_KNORM, &p);
	for (size_t t = 0; t < 3; t++) {
		uint16_t kh[12];
		struct kvd_attn_in in = f32_in(2, 2, 1, 3, 2, NULL, k, NULL);

		in.dtype = dtypes[t];
		if (dtypes[t] != KVD_DTYPE_F32) {
			for (int i = 0; i < 12; i++)
				kt_store(kh, dtypes[t], i, k[i]);
			in.k = kh;
		}
		for (int f = 0; f < 2; f++) {
			ASSERT_OK(paths[f](KVD_BASELINE_KNORM, &p, &in, s));
			for (int i = 0; i < 6; i++)
				ASSERT_NEAR(s[i], want[i], 1e-6);
		}
	}
	/* Per query head with GQA 2: each kv row twice. */
	struct kvd_attn_in in = f32_in(4, 2, 1, 3, 2, NULL, k, NULL);
	p.per_query_head = 1;
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_KNORM, &p, &in, s));
		for (int r = 0; r < 4; r++)
			for (int i = 0; i < 3; i++)
				ASSERT_NEAR(s[r * 3 + i], want[(r / 2) * 3 + i], 1e-6);
	}
}

TEST(keydiff_sign) {
	/* Two keys along x, one along y: the mean normalised key is (2/3, 1/3), so the odd one
	 * out is the most distinctive: -cos = -1/sqrt(5) against -2/sqrt(5). A zero key has
	 * cos 0 (torch's eps). */
	const float k[8] = { 1, 0, 2, 0, 0, 1, 0, 0 };
	struct kvd_baseline_params p;
	struct kvd_attn_in in = f32_in(1, 1, 1, 4, 2, NULL, k, NULL);
	float s[4];

	kvd_baseline_params_init(KVD_BASELINE_KEYDIFF, &p);
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_KEYDIFF, &p, &in, s));
		ASSERT_NEAR(s[0], -2 / sqrt(5), 1e-6);
		ASSERT_NEAR(s[1], -2 / sqrt(5), 1e-6);
		ASSERT_NEAR(s[2], -1 / sqrt(5), 1e-6);
		ASSERT_NEAR(s[3], 0, 1e-7);
		ASSERT_TRUE(s[2] > s[0]);
	}
}

/* How many of the w window queries (at positions L-w..L-1) see key i. */
static double seen_by(uint32_t L, uint32_t w, uint32_t i) {
	return i > L - w ? w - (i - (L - w)) : w;
}

/* Brute-force H2O: every query row's causal softmax in double, summed per key. */
static void h2o_brute(const struct kvd_attn_in *in, int normalize, double *out /* [H][L] */) {
	uint32_t H = in->heads, L = in->len, w = in->window, d = in->dim;
	const float *q = in->q, *k = in->k;

	for (uint32_t h = 0; h < H; h++) {
		uint32_t g = kvd_attn_kv_head(in, h);

		for (uint32_t i = 0; i < L; i++)
			out[h * L + i] = 0;
		for (uint32_t t = 0; t < w; t++) {
			uint32_t pos = L - w + t; /* the query's own position */
			double z[64], max = -INFINITY, sum = 0;

			for (uint32_t i = 0; i <= pos; i++) {
				z[i] = 0;
				for (uint32_t a = 0; a < d; a++)
					z[i] += (double)q[(h * w + t) * d + a] * k[(g * L + i) * d + a];
				z[i] *= in->scale;
				max = fmax(max, z[i]);
			}
			for (uint32_t i = 0; i <= pos; i++)
				sum += exp(z[i] - max);
			for (uint32_t i = 0; i <= pos; i++)
				out[h * L + i] += exp(z[i] - max) / sum /
						  (normalize ? seen_by(L, w, i) : 1);
		}
	}
}

TEST(h2o_brute_force) {
	static const uint32_t shapes[][3] = { { 9, 9, 4 }, { 5, 12, 8 } }; /* w, L, d */
	uint64_t seed = 42;

	for (int c = 0; c < 2; c++) {
		uint32_t H = 4, Hkv = 2, w = shapes[c][0], L = shapes[c][1], d = shapes[c][2];
		float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 2.0f);
		float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 2.0f);
		struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, NULL);
		struct kvd_baseline_params p;
		double brute[4 * 12];
		float s[4 * 12];

		kvd_baseline_params_init(KVD_BASELINE_H2O, &p);
		p.h2o_block = 2; /* several blocks, the last one partial */
		for (p.h2o_normalize = 0; p.h2o_normalize < 2; p.h2o_normalize++) {
			h2o_brute(&in, (int)p.h2o_normalize, brute);
			for (int f = 0; f < 2; f++) {
				p.per_query_head = 1;
				p.recent = 0;
				ASSERT_OK(paths[f](KVD_BASELINE_H2O, &p, &in, s));
				for (uint32_t i = 0; i < H * L; i++)
					ASSERT_NEAR(s[i], brute[i], 1e-5);
				/* kv-head rows: the group mean; the last 3 tokens protected. */
				p.per_query_head = 0;
				p.recent = 3;
				ASSERT_OK(paths[f](KVD_BASELINE_H2O, &p, &in, s));
				for (uint32_t g = 0; g < Hkv; g++)
					for (uint32_t i = 0; i < L; i++) {
						double want = (brute[(2 * g) * L + i] +
							       brute[(2 * g + 1) * L + i]) / 2;

						if (i >= L - 3)
							ASSERT_TRUE(s[g * L + i] == INFINITY);
						else
							ASSERT_NEAR(s[g * L + i], want, 1e-5);
					}
			}
		}
		/* With the whole prompt as the window, unnormalised column sums add up to w. */
		if (w == L) {
			double total = 0;

			p.h2o_normalize = 0, p.recent = 0, p.per_query_head = 1;
			ASSERT_OK(kvd_baseline_scores(KVD_BASELINE_H2O, &p, &in, s));
			for (uint32_t i = 0; i < L; i++)
				total += s[i];
			ASSERT_NEAR(total, w, 1e-4);
		}
		free(q), free(k);
	}
}

TEST(snapkv_uniform_attention) {
	/*
	 * d = 1 and q = 0: every visible key gets the same weight. L = 6, w = 2: row 0 sees 5
	 * keys (1/5 each), row 1 sees 6 (1/6). SUM over the prefix (4 columns): 11/30 each;
	 * avg pool k = 5 with zero padding over those 4 entries: 3, 4, 4, 3 of them in range.
	 */
	const float q[2] = { 0, 0 }, k[6] = { 1, -2, 3, 0.5f, 7, -1 };
	struct kvd_attn_in in = f32_in(1, 1, 2, 6, 1, q, k, NULL);
	struct kvd_baseline_params p;
	const double c = 11.0 / 30 / 5, want[4] = { 3 * c, 4 * c, 4 * c, 3 * c };
	float s[6];

	for (int b = KVD_BASELINE_SNAPKV; b <= KVD_BASELINE_PYRAMIDKV; b++) {
		kvd_baseline_params_init(b, &p);
		for (int f = 0; f < 2; f++) {
			ASSERT_OK(paths[f](b, &p, &in, s));
			for (int i = 0; i < 4; i++)
				ASSERT_NEAR(s[i], want[i], 1e-7);
			ASSERT_TRUE(s[4] == INFINITY && s[5] == INFINITY);
		}
	}
	/* AdaKV: MEAN then MAX 7: every prefix entry is the mean 11/60. */
	kvd_baseline_params_init(KVD_BASELINE_ADAKV, &p);
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_ADAKV, &p, &in, s));
		for (int i = 0; i < 4; i++)
			ASSERT_NEAR(s[i], 11.0 / 60, 1e-7);
	}
	/* EMA, no pooling: 0.3 * 1/6 + 0.7 * 1/5. */
	kvd_baseline_params_init(KVD_BASELINE_SNAPKV, &p);
	p.temporal = KVD_TEMPORAL_EMA;
	p.pool = KVD_POOL_NONE;
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_SNAPKV, &p, &in, s));
		for (int i = 0; i < 4; i++)
			ASSERT_NEAR(s[i], 0.3 / 6 + 0.7 / 5, 1e-7);
	}
	p.pool = KVD_POOL_ADAPTIVE;
	ASSERT_ERRNO(kvd_baseline_scores(KVD_BASELINE_SNAPKV, &p, &in, s), -EINVAL);
	ASSERT_ERRNO(kvd_baseline_scores_ref(KVD_BASELINE_SNAPKV, &p, &in, s), -EINVAL);
	p.pool = KVD_POOL_AVG;
	p.kernel = 4;
	ASSERT_ERRNO(kvd_baseline_scores(KVD_BASELINE_SNAPKV, &p, &in, s), -EINVAL);
}

TEST(snapkv_matches_composition) {
	/* GQA 4: scores = group mean of (pool(sum over window rows of A_h on the prefix)). */
	enum { H = 4, Hkv = 1, w = 4, L = 30, d = 8 };
	uint64_t seed = 9;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 2.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 2.0f);
	struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, NULL);
	struct kvd_baseline_params p;
	float probs[w * L], agg[L], pooled[L], s[L];
	double want[L] = { 0 };

	kvd_baseline_params_init(KVD_BASELINE_SNAPKV, &p);
	for (uint32_t h = 0; h < H; h++) {
		ASSERT_OK(kvd_attn_head_ref(&in, h, probs));
		ASSERT_OK(kvd_temporal_agg_ref(KVD_TEMPORAL_SUM, 0, probs, w, L, L - w, agg));
		ASSERT_OK(kvd_pool_row_ref(KVD_POOL_AVG, 5, 0, agg, L - w, pooled));
		for (uint32_t i = 0; i < L - w; i++)
			want[i] += pooled[i] / H;
	}
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_SNAPKV, &p, &in, s));
		for (uint32_t i = 0; i < L - w; i++)
			ASSERT_NEAR(s[i], want[i], 1e-6);
		for (uint32_t i = L - w; i < L; i++)
			ASSERT_TRUE(s[i] == INFINITY);
	}
	free(q), free(k);
}

/* AdaKV over a GQA group, as its published code does it: the group's window scores
 * averaged first, then max-pooled (not pooled per query head, then averaged). */
TEST(adakv_group_mean_then_max_pool) {
	enum { H = 4, Hkv = 1, w = 4, L = 40, d = 8 };
	uint64_t seed = 21;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 3.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 3.0f);
	struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, NULL);
	struct kvd_baseline_params p;
	float probs[w * L], agg[L], pooled[L], mean[L] = { 0 }, want[L], s[L];
	double other[L] = { 0 };
	int differs = 0;

	kvd_baseline_params_init(KVD_BASELINE_ADAKV, &p);
	for (uint32_t h = 0; h < H; h++) {
		ASSERT_OK(kvd_attn_head_ref(&in, h, probs));
		ASSERT_OK(kvd_temporal_agg_ref(KVD_TEMPORAL_MEAN, 0, probs, w, L, L - w, agg));
		for (uint32_t i = 0; i < L - w; i++)
			mean[i] += agg[i];
		/* The other order, pooled per head: what the test tells apart. */
		ASSERT_OK(kvd_pool_row_ref(KVD_POOL_MAX, 7, 0, agg, L - w, pooled));
		for (uint32_t i = 0; i < L - w; i++)
			other[i] += pooled[i] / H;
	}
	for (uint32_t i = 0; i < L - w; i++)
		mean[i] /= H;
	ASSERT_OK(kvd_pool_row_ref(KVD_POOL_MAX, 7, 0, mean, L - w, want));
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_ADAKV, &p, &in, s));
		for (uint32_t i = 0; i < L - w; i++) {
			ASSERT_NEAR(s[i], want[i], 1e-6);
			differs += fabs(s[i] - other[i]) > 1e-4;
		}
		for (uint32_t i = L - w; i < L; i++)
			ASSERT_TRUE(s[i] == INFINITY);
	}
	ASSERT_GT(differs, 0);
	/* Per query head, each head's own max pooling, as before. */
	p.per_query_head = 1;
	{
		float sq[H * L];

		ASSERT_OK(paths[1](KVD_BASELINE_ADAKV, &p, &in, sq));
		ASSERT_OK(kvd_attn_head_ref(&in, 2, probs));
		ASSERT_OK(kvd_temporal_agg_ref(KVD_TEMPORAL_MEAN, 0, probs, w, L, L - w, agg));
		ASSERT_OK(kvd_pool_row_ref(KVD_POOL_MAX, 7, 0, agg, L - w, pooled));
		for (uint32_t i = 0; i < L - w; i++)
			ASSERT_NEAR(sq[2 * L + i], pooled[i], 1e-6);
	}
	free(q), free(k);
}

TEST(tova_layer_mean) {
	enum { H = 4, Hkv = 2, w = 3, L = 20, d = 8 };
	uint64_t seed = 11;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 2.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 2.0f);
	struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, NULL);
	struct kvd_baseline_params p;
	float probs[w * L], s[H * L];
	double want[L] = { 0 };

	for (uint32_t h = 0; h < H; h++) {
		ASSERT_OK(kvd_attn_head_ref(&in, h, probs));
		for (uint32_t i = 0; i < L; i++)
			want[i] += probs[(w - 1) * L + i] / H;
	}
	kvd_baseline_params_init(KVD_BASELINE_TOVA, &p);
	for (int f = 0; f < 2; f++)
		for (p.per_query_head = 0; p.per_query_head < 2; p.per_query_head++) {
			uint32_t rows = kvd_baseline_rows(&p, &in);

			ASSERT_OK(paths[f](KVD_BASELINE_TOVA, &p, &in, s));
			/* Layer-wide: every row the same. */
			for (uint32_t r = 0; r < rows; r++) {
				for (uint32_t i = 0; i < L - 1; i++)
					ASSERT_NEAR(s[r * L + i], want[i], 1e-6);
				ASSERT_TRUE(s[r * L + L - 1] == INFINITY);
			}
		}
	free(q), free(k);
}

/* ExpectedAttention: d = 2, one kv head; queries, keys and values chosen by hand. */
static void ea_case(uint32_t H, const float *eq, uint32_t eq_rows, const float *k, const float *v,
		    float inv_freq, uint32_t n_future, uint32_t position, uint32_t use_cov,
		    const double *want /* [L], probabilities times ||v|| */) {
	enum { L = 4 };
	struct kvd_attn_in in = f32_in(H, 1, 1, L, 2, NULL, k, v);
	struct kvd_baseline_params p;
	float s[L];

	in.scale = 1;
	kvd_baseline_params_init(KVD_BASELINE_EXPECTED_ATTENTION, &p);
	p.n_sink = p.eq_first = 1;
	p.eq_q = eq, p.eq_rows = eq_rows;
	p.eq_row_stride = 2, p.eq_head_stride = 2 * eq_rows;
	p.rope_inv_freq = &inv_freq;
	p.n_future = n_future, p.position = position, p.use_covariance = use_cov;
	for (int f = 0; f < 2; f++) {
		ASSERT_OK(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s));
		ASSERT_TRUE(s[0] == INFINITY);
		for (int i = 1; i < L; i++)
			ASSERT_NEAR(s[i], want[i], 2e-6);
	}
}

static void softmax3(double a, double b, double c, const double *vn, double *out) {
	double m = fmax(a, fmax(b, c)), s = exp(a - m) + exp(b - m) + exp(c - m);

	out[1] = exp(a - m) / s * vn[0];
	out[2] = exp(b - m) / s * vn[1];
	out[3] = exp(c - m) / s * vn[2];
}

TEST(expected_attention_hand) {
	/* Keys: a sink, (1,0), (2,0), (0,3); values with norms 1, 2, 3 for the non-sinks. */
	const float k[8] = { 9, 9, 1, 0, 2, 0, 0, 3 }, v[8] = { 0, 0, 1, 0, 0, 2, 3, 0 };
	const double vn[3] = { 1, 2, 3 };
	double want[4];

	/* Identical queries (1,0) after a skipped sink row: mu = (1,0), Sigma = 0. Frequency 0:
	 * no rotation. z = k.mu = 1, 2, 0. */
	const float same[6] = { 100, 100, 1, 0, 1, 0 };
	softmax3(1, 2, 0, vn, want);
	ea_case(1, same, 3, k, v, 0, 512, 0, 1, want);
	/* Rotation: frequency 1, one future position 3: mu = (cos 3, sin 3). */
	softmax3(cos(3), 2 * cos(3), 3 * sin(3), vn, want);
	ea_case(1, same, 3, k, v, 1, 1, 3, 1, want);
	/* The mean over two positions 1 and 2 (cos and sin averaged). */
	double cb = (cos(1) + cos(2)) / 2, sb = (sin(1) + sin(2)) / 2;
	softmax3(cb, 2 * cb, 3 * sb, vn, want);
	ea_case(1, same, 3, k, v, 1, 2, 1, 1, want);
	/* Covariance: queries (1,0), (-1,0): mu = 0, Sigma = diag(1, 0) (1/N). z = k_x^2 / 2. */
	const float spread[6] = { 100, 100, 1, 0, -1, 0 };
	softmax3(0.5, 2, 0, vn, want);
	ea_case(1, spread, 3, k, v, 0, 512, 0, 1, want);
	softmax3(0, 0, 0, vn, want);
	ea_case(1, spread, 3, k, v, 0, 512, 0, 0, want);
	/* GQA 2: head 0 has mu (1,0), head 1 has mu (0,1); the scores are the mean of the two
	 * softmaxes, times ||v||. */
	const float two[12] = { 100, 100, 1, 0, 1, 0, 100, 100, 0, 1, 0, 1 };
	double a[4], b[4];
	const double one[3] = { 1, 1, 1 };
	softmax3(1, 2, 0, one, a);
	softmax3(0, 0, 3, one, b);
	for (int i = 1; i < 4; i++)
		want[i] = (a[i] + b[i]) / 2 * vn[i - 1];
	ea_case(2, two, 3, k, v, 0, 512, 0, 1, want);
}

TEST(expected_attention_rejects) {
	const float k[8] = { 0 }, eq[6] = { 0 };
	struct kvd_attn_in in = f32_in(1, 1, 1, 4, 2, NULL, k, k);
	struct kvd_baseline_params p;
	float s[4];

	kvd_baseline_params_init(KVD_BASELINE_EXPECTED_ATTENTION, &p);
	p.eq_q = eq, p.eq_rows = 3, p.eq_row_stride = 2, p.eq_head_stride = 6;
	for (int f = 0; f < 2; f++) {
		/* eq_rows <= eq_first */
		ASSERT_ERRNO(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s), -EINVAL);
		p.n_sink = p.eq_first = 1;
		ASSERT_OK(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s));
		in.v = NULL;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s), -EINVAL);
		p.use_vnorm = 0;
		ASSERT_OK(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s));
		/* Uniform: z = 0 everywhere. */
		for (int i = 1; i < 4; i++)
			ASSERT_NEAR(s[i], 1.0 / 3, 1e-7);
		in.dim = 1;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_EXPECTED_ATTENTION, &p, &in, s), -EINVAL);
		in.dim = 2, in.v = k, p.use_vnorm = 1, p.n_sink = p.eq_first = 4;
	}
}

TEST(rope_llama3) {
	float inv[64], plain[64];

	ASSERT_OK(kvd_rope_inv_freq_llama3(128, 500000, 8, 1, 4, 8192, inv));
	ASSERT_OK(kvd_rope_inv_freq_llama3(128, 500000, 0, 0, 0, 0, plain));
	for (int j = 0; j < 64; j++) {
		double wl = 2 * M_PI / plain[j];

		ASSERT_NEAR(plain[j], 1 / pow(500000, j / 64.0), 1e-6 * plain[j]);
		if (wl < 2048)
			ASSERT_TRUE(inv[j] == plain[j]);
		else if (wl > 8192)
			ASSERT_NEAR(inv[j], plain[j] / 8, 1e-7 * plain[j]);
		else
			ASSERT_TRUE(inv[j] <= plain[j] && inv[j] >= plain[j] / 8);
	}
	ASSERT_TRUE(inv[0] == 1.0f);
	ASSERT_ERRNO(kvd_rope_inv_freq_llama3(127, 500000, 8, 1, 4, 8192, inv), -EINVAL);
	ASSERT_ERRNO(kvd_rope_inv_freq_llama3(128, 500000, 8, 4, 1, 8192, inv), -EINVAL);
}

/* ---- budgets ---- */

TEST(pyramidkv_budgets) {
	uint32_t b[32];

	/* cap 128, w 32: B = 96, min = 96 // 20 = 4, max = 188; step = 184 // 31 = 5. */
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 4096, 32, KVD_PYRAMIDKV_BETA, b));
	for (uint32_t l = 0; l < 32; l++)
		ASSERT_EQ(b[l], 188 - 5 * l);
	ASSERT_EQ(b[31], 33u);
	/* capacity <= L < 2B (192): as published, B at every layer, not the pyramid clamped by
	 * L - w (which would be 128 - 2l). */
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 160, 32, 20, b));
	for (uint32_t l = 0; l < 32; l++)
		ASSERT_EQ(b[l], 96u);
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 191, 32, 20, b));
	ASSERT_EQ(b[0], 96u);
	ASSERT_EQ(b[31], 96u);
	/* From 2B on, the pyramid: max = L - w = 160, min = 192 - 160 = 32, step = 128 // 31. */
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 192, 32, 20, b));
	for (uint32_t l = 0; l < 32; l++)
		ASSERT_EQ(b[l], 160 - 4 * l);
	/* Exactly the capacity: max = 96 = min, step 0. */
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 128, 32, 20, b));
	for (uint32_t l = 0; l < 32; l++)
		ASSERT_EQ(b[l], 96u);
	/* Shorter than the capacity: not compressed. */
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 100, 4, 20, b));
	for (uint32_t l = 0; l < 4; l++)
		ASSERT_EQ(b[l], 68u);
	/* cap 2048 + 32, 32 layers, L 32k: min 102, max 3994, step 3892 // 31 = 125. */
	ASSERT_OK(kvd_pyramidkv_budgets(2080, 32, 32768, 32, 20, b));
	ASSERT_EQ(b[0], 3994u);
	ASSERT_EQ(b[1], 3994u - 3892 / 31);
	ASSERT_OK(kvd_pyramidkv_budgets(128, 32, 4096, 1, 20, b));
	ASSERT_EQ(b[0], 96u);
	ASSERT_ERRNO(kvd_pyramidkv_budgets(32, 32, 4096, 32, 20, b), -EINVAL);
	ASSERT_ERRNO(kvd_pyramidkv_budgets(128, 32, 16, 32, 20, b), -EINVAL);
	ASSERT_ERRNO(kvd_pyramidkv_budgets(128, 32, 4096, 0, 20, b), -EINVAL);
	ASSERT_ERRNO(kvd_pyramidkv_budgets(128, 32, 4096, 32, 0, b), -EINVAL);
	ASSERT_ERRNO(kvd_pyramidkv_budgets(128, 32, 4096, 32, 20, NULL), -EINVAL);
}

typedef int (*adakv_fn)(const float *, size_t, uint32_t, uint32_t, uint32_t, double, int,
			uint32_t *);
static const adakv_fn adakv_fns[] = { kvd_adakv_budgets_ref, kvd_adakv_budgets };

static void adakv_expect(const float *s, size_t stride, uint32_t heads, uint32_t n, uint32_t B,
			 double f, int normalize, const uint32_t *want) {
	for (int p = 0; p < 2; p++) {
		uint32_t got[8];

		ASSERT_OK(adakv_fns[p](s, stride, heads, n, B, f, normalize, got));
		for (uint32_t h = 0; h < heads; h++)
			if (got[h] != want[h])
				test_fail(__FILE__, __LINE__, "%s: head %u budget %u, expected %u",
					  path_names[p], h, got[h], want[h]);
	}
}

TEST(adakv_budgets) {
	/* Global top-6 of two heads: head 0's 10 9 8 7 and head 1's two 1s: n = 4, 2;
	 * floor int(3 * 0.2) = 0; round(3.2) = 3, round(1.6) = 2. */
	const float a[2 * 6] = { 10, 9, 8, 7, 0, 0, 1, 1, 0.5f, 0, 0, 0 };
	adakv_expect(a, 6, 2, 6, 3, 0.2, 0, (const uint32_t[]){ 3, 2 });
	/* A budget above the prefix: nothing is compressed. */
	adakv_expect(a, 6, 2, 6, 7, 0.2, 0, (const uint32_t[]){ 6, 6 });

	/* B = 96, f = 0.2: the floor is int(19.200000000000003) = 19, not 19.2: head 1 with
	 * n = 3 gets round(2.4 + 19) = 21 (22 with 19.2); head 0, n = 189: round(170.2) = 170. */
	enum { N = 200 };
	float *big = kt_floats(2 * N);
	for (int i = 0; i < N; i++) {
		big[i] = i < 189 ? 10 : 0;
		big[N + i] = i < 3 ? 5 : -1;
	}
	adakv_expect(big, N, 2, N, 96, 0.2, 0, (const uint32_t[]){ 170, 21 });
	free(big);

	/* Round half to even: f = 0.5, B = 4, floor 2: n = 5 -> 4.5 -> 4, n = 3 -> 3.5 -> 4. */
	const float c[2 * 8] = { 10, 10, 10, 10, 10, 0, 0, 0, 5, 5, 5, -1, -1, -1, -1, -1 };
	adakv_expect(c, 8, 2, 8, 4, 0.5, 0, (const uint32_t[]){ 4, 4 });

	/* normalize: head 0 (0.4 0.3 0.2 0.1) keeps 0.4 of its mass in its top-1, so it is
	 * scaled by 0.4 and head 1's lone 0.25 outranks its 0.3: n = 1, 1 instead of 2, 0. */
	const float d[2 * 4] = { 0.4f, 0.3f, 0.2f, 0.1f, 0.25f, 0, 0, 0 };
	adakv_expect(d, 4, 2, 4, 1, 0, 0, (const uint32_t[]){ 2, 0 });
	adakv_expect(d, 4, 2, 4, 1, 0, 1, (const uint32_t[]){ 1, 1 });

	/* Ties go to the lower head; NaN ranks below -inf; a row stride wider than n. */
	const float t[2 * 3] = { 1, 1, 99, 1, 1, 99 };
	adakv_expect(t, 3, 2, 2, 1, 0, 0, (const uint32_t[]){ 2, 0 });
	const float nan[2 * 2] = { NAN, NAN, -INFINITY, -INFINITY };
	adakv_expect(nan, 2, 2, 2, 1, 0, 0, (const uint32_t[]){ 0, 2 });

	uint32_t out[2];
	for (int p = 0; p < 2; p++) {
		ASSERT_ERRNO(adakv_fns[p](a, 5, 2, 6, 3, 0.2, 0, out), -EINVAL);
		ASSERT_ERRNO(adakv_fns[p](a, 6, 2, 6, 3, 1.5, 0, out), -EINVAL);
		ASSERT_ERRNO(adakv_fns[p](NULL, 6, 2, 6, 3, 0.2, 0, out), -EINVAL);
	}
}

/* AdaKV on real scores: budgets from the ADAKV scores' prefix columns, both paths equal. */
TEST(adakv_pipeline) {
	enum { H = 8, Hkv = 4, w = 8, L = 200, d = 16 };
	uint64_t seed = 77;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 3.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 3.0f);
	struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, NULL);
	struct kvd_baseline_params p;
	float s[Hkv * L];
	uint32_t b0[Hkv], b1[Hkv], sum = 0;

	kvd_baseline_params_init(KVD_BASELINE_ADAKV, &p);
	ASSERT_OK(kvd_baseline_scores(KVD_BASELINE_ADAKV, &p, &in, s));
	ASSERT_OK(kvd_adakv_budgets_ref(s, L, Hkv, L - w, 40, KVD_ADAKV_FLOOR_ALPHA, 1, b0));
	ASSERT_OK(kvd_adakv_budgets(s, L, Hkv, L - w, 40, KVD_ADAKV_FLOOR_ALPHA, 1, b1));
	for (int h = 0; h < Hkv; h++) {
		ASSERT_EQ(b0[h], b1[h]);
		ASSERT_GE(b0[h], 8u); /* the floor int(40 * 0.2) */
		sum += b0[h];
	}
	ASSERT_TRUE(sum >= 4 * 40 - 2 && sum <= 4 * 40 + 2);
	free(q), free(k);
}

/* ---- non-finite inputs ---- */

TEST(nonfinite_inputs) {
	enum { H = 4, Hkv = 2, w = 4, L = 40, d = 8 };
	uint64_t seed = 5;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 1.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 1.0f);
	float *v = kt_random(&seed, KVD_DTYPE_F32, Hkv * L * d, 1.0f);
	float *eq = kt_random(&seed, KVD_DTYPE_F32, H * L * d, 1.0f);
	struct kvd_attn_in in = f32_in(H, Hkv, w, L, d, q, k, v);
	float s[H * L], clean[H * L];

	q[1 * w * d + 2 * d + 1] = NAN;      /* head 1, window row 2 */
	k[(1 * L + 7) * d + 3] = INFINITY;   /* kv head 1, key 7 */
	k[(0 * L + 12) * d] = NAN;           /* kv head 0, key 12 */
	v[(0 * L + 20) * d + 2] = -INFINITY; /* kv head 0, value 20 */
	eq[(2 * L + 9) * d] = NAN;           /* query statistics of head 2 */
	for (int b = 0; b < _KVD_BASELINE_MAX; b++)
		for (int f = 0; f < 2; f++)
			for (uint32_t pq = 0; pq < 2; pq++) {
				struct kvd_baseline_params p;
				uint32_t rows;

				kvd_baseline_params_init(b, &p);
				p.per_query_head = pq;
				p.recent = 2;
				p.eq_q = eq, p.eq_rows = L;
				p.eq_row_stride = d, p.eq_head_stride = L * d;
				rows = kvd_baseline_rows(&p, &in);
				ASSERT_OK(paths[f](b, &p, &in, s));
				no_nan(s, rows * L);
				/* Protected tokens stay +inf whatever their inputs. */
				for (uint32_t r = 0; r < rows; r++) {
					if (b == KVD_BASELINE_SNAPKV || b == KVD_BASELINE_ADAKV)
						for (uint32_t i = L - w; i < L; i++)
							ASSERT_TRUE(s[r * L + i] == INFINITY);
					if (b == KVD_BASELINE_EXPECTED_ATTENTION ||
					    b == KVD_BASELINE_STREAMINGLLM)
						for (uint32_t i = 0; i < 4; i++)
							ASSERT_TRUE(s[r * L + i] == INFINITY);
					if (b == KVD_BASELINE_TOVA || b == KVD_BASELINE_H2O)
						ASSERT_TRUE(s[r * L + L - 1] == INFINITY);
				}
			}

	/* KNorm and KeyDiff: the bad keys get -inf, the others are untouched. */
	for (int f = 0; f < 2; f++) {
		struct kvd_baseline_params p;

		kvd_baseline_params_init(KVD_BASELINE_KNORM, &p);
		ASSERT_OK(paths[f](KVD_BASELINE_KNORM, &p, &in, s));
		ASSERT_TRUE(s[12] == -INFINITY && s[L + 7] == -INFINITY);
		ASSERT_TRUE(isfinite(s[11]) && isfinite(s[L + 8]));
		kvd_baseline_params_init(KVD_BASELINE_KEYDIFF, &p);
		ASSERT_OK(paths[f](KVD_BASELINE_KEYDIFF, &p, &in, s));
		ASSERT_TRUE(s[12] == -INFINITY && s[L + 7] == -INFINITY);
		/* Key 12 is left out of kv head 0's mean key: the other keys score exactly as
		 * they do in a clean copy of the head without it. */
		float *k2 = malloc((size_t)(L - 1) * d * sizeof(float));
		ASSERT_NOT_NULL(k2);
		memcpy(k2, k, 12 * d * sizeof(float));
		memcpy(k2 + 12 * d, k + 13 * d, (L - 13) * d * sizeof(float));
		struct kvd_attn_in one = f32_in(1, 1, 1, L - 1, d, NULL, k2, NULL);
		ASSERT_OK(paths[f](KVD_BASELINE_KEYDIFF, &p, &one, clean));
		for (uint32_t i = 0; i < L - 1; i++)
			ASSERT_NEAR(s[i < 12 ? i : i + 1], clean[i], 1e-6);
		free(k2);
	}
	free(q), free(k), free(v), free(eq);
}

/* ---- optimised against reference ---- */

struct shape {
	uint32_t heads, kv_heads, window, len, dim;
};

static const struct shape shapes[] = {
	{ 1, 1, 1, 1, 2 },       /* a single token */
	{ 2, 1, 1, 37, 16 },     /* w = 1, GQA 2 */
	{ 4, 2, 5, 5, 8 },       /* w = L: no prefix */
	{ 4, 4, 8, 129, 18 },    /* MHA */
	{ 8, 2, 32, 300, 64 },   /* GQA 4 */
	{ 3, 1, 7, 257, 17 },    /* MQA, odd d (ExpectedAttention refuses it) */
	{ 2, 1, 130, 130, 32 },  /* the whole prompt as the window (H2O as published) */
};

static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };

static void equivalence(const struct shape *sh, uint32_t dtype, uint64_t seed) {
	uint32_t H = sh->heads, Hkv = sh->kv_heads, w = sh->window, L = sh->len, d = sh->dim;
	void *q = kt_random(&seed, dtype, (size_t)H * w * d, 2.0f);
	void *k = kt_random(&seed, dtype, (size_t)Hkv * L * d, 2.0f);
	void *v = kt_random(&seed, dtype, (size_t)Hkv * L * d, 2.0f);
	void *eq = kt_random(&seed, dtype, (size_t)H * (L + 5) * d, 2.0f);
	float *ref = kt_floats((size_t)H * L), *got = kt_floats((size_t)H * L);
	float *got3 = kt_floats((size_t)H * L);
	struct kvd_attn_in in = {
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = w, .len = L, .dim = d,
		.scale = 1.0f / sqrtf((float)d), .q = q, .k = k, .v = v,
	};
	char what[200];

	kvd_attn_in_contiguous(&in);
	for (int b = 0; b < _KVD_BASELINE_MAX; b++)
		for (uint32_t pq = 0; pq < 2; pq++) {
			struct kvd_baseline_params p;
			size_t n;
			int r;

			kvd_baseline_params_init(b, &p);
			p.per_query_head = pq;
			p.h2o_block = 16;
			p.h2o_normalize = pq;
			p.recent = 3;
			p.eq_q = eq, p.eq_rows = L + 5, p.eq_row_stride = d;
			p.eq_head_stride = (size_t)(L + 5) * d;
			n = (size_t)kvd_baseline_rows(&p, &in) * L;
			r = kvd_baseline_scores_ref(b, &p, &in, ref);
			if (b == KVD_BASELINE_EXPECTED_ATTENTION && d % 2) {
				ASSERT_ERRNO(r, -EINVAL);
				ASSERT_ERRNO(kvd_baseline_scores(b, &p, &in, got), -EINVAL);
				continue;
			}
			ASSERT_OK(r);
			no_nan(ref, n);
			KT_FOREACH_PATH(path) {
				p.threads = 1;
				ASSERT_OK(kvd_baseline_scores(b, &p, &in, got));
				snprintf(what, sizeof(what), "%s %s dtype %u H %u Hkv %u w %u L %u d %u%s",
					 kvd_baseline_to_string(b), path, dtype, H, Hkv, w, L, d,
					 pq ? " per-query-head" : "");
				ASSERT_TRUE(kt_close(what, ref, got, n, 1e-6, 1e-5));
				/* The thread count changes nothing, to the bit. */
				p.threads = 3;
				ASSERT_OK(kvd_baseline_scores(b, &p, &in, got3));
				ASSERT_EQ(memcmp(got, got3, n * sizeof(float)), 0);
			}
		}
	free(q), free(k), free(v), free(eq), free(ref), free(got), free(got3);
}

TEST(optimised_matches_reference) {
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
		for (size_t t = 0; t < sizeof(dtypes) / sizeof(dtypes[0]); t++)
			equivalence(&shapes[i], dtypes[t], 100 + i * 3 + t);
}

TEST(rejects_bad_input) {
	const float x[16] = { 0 };
	struct kvd_attn_in in = f32_in(2, 1, 1, 4, 2, x, x, x);
	struct kvd_baseline_params p;
	float s[8];

	kvd_baseline_params_init(KVD_BASELINE_SNAPKV, &p);
	for (int f = 0; f < 2; f++) {
		ASSERT_ERRNO(paths[f](_KVD_BASELINE_MAX, &p, &in, s), -EINVAL);
		ASSERT_ERRNO(paths[f](KVD_BASELINE_SNAPKV, NULL, &in, s), -EINVAL);
		ASSERT_ERRNO(paths[f](KVD_BASELINE_SNAPKV, &p, NULL, s), -EINVAL);
		ASSERT_ERRNO(paths[f](KVD_BASELINE_SNAPKV, &p, &in, NULL), -EINVAL);
		in.q = NULL;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_SNAPKV, &p, &in, s), -EINVAL);
		/* KNorm needs no queries. */
		ASSERT_OK(paths[f](KVD_BASELINE_KNORM, &p, &in, s));
		in.q = x;
		in.kv_heads = 3;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_KNORM, &p, &in, s), -EINVAL);
		in.kv_heads = 1;
		in.window = 5;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_STREAMINGLLM, &p, &in, s), -EINVAL);
		in.window = 1;
		p.h2o_block = 0;
		ASSERT_ERRNO(paths[f](KVD_BASELINE_H2O, &p, &in, s), -EINVAL);
		p.h2o_block = 64;
	}
}
