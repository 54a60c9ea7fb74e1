/* SPDX-License-Identifier: MIT */
/*
 * kvd_policy_scores() (policy.h): for every policy, values that are finite, >= 0 and sum to
 * the layer weight; the output-aware policies' values proportional to kvd_score_layer()'s
 * costs (kvd's to their union with KeyDiff's key novelty, counted here rank by rank); the
 * baselines' values the rank shares of kvd_baseline_scores() within each row; a key that
 * stands out kept by kvd where the window ignores it; non-finite inputs; the empty prefix;
 * bad parameters.
 */
#include <math.h>

#include "baselines.h"
#include "ktest.h"
#include "policy.h"
#include "score.h"

#define H 4
#define HKV 2
#define D 16
#define L 96
#define W 8
#define N (L - W)
#define WEIGHT 0.7f

static int output_aware(enum kvd_policy p) {
	return p == KVD_POLICY_RESTKV || p == KVD_POLICY_LAPROX || p == KVD_POLICY_KVD ||
	       p == KVD_POLICY_KVD_MI;
}

/* Finite, >= 0, and the layer sums to lambda within 1e-4 relative. */
static void check_shares(const char *what, const float *v, size_t n, float lambda) {
	double sum = 0;

	for (size_t i = 0; i < n; i++) {
		if (!isfinite(v[i]) || v[i] < 0) {
			fprintf(stderr, "%s: value %zu is %g\n", what, i, v[i]);
			ASSERT_TRUE(0);
		}
		sum += v[i];
	}
	if (!(fabs(sum - lambda) <= 1e-4 * lambda)) {
		fprintf(stderr, "%s: the values sum to %.9g, not %.9g\n", what, sum, (double)lambda);
		ASSERT_TRUE(0);
	}
}

/* The costs own_scores() asks kvd_score_layer() for, unnormalised. */
static void raw_costs(const struct kvd_policy_params *p, const struct kt_layer *f, float *ret) {
	struct kvd_score_params sp;

	kvd_score_params_default(p->policy == KVD_POLICY_LAPROX ? KVD_SCORE_LAPROX : KVD_SCORE_RESTKV,
				 &sp);
	sp.restkv = p->restkv;
	sp.restkv.temporal = p->temporal, sp.restkv.alpha = p->alpha;
	sp.per_query_head = p->per_query_head;
	sp.laprox_joint = p->laprox_joint;
	sp.pooling = p->pooling, sp.kernel = p->kernel, sp.aws_scale = p->aws_scale;
	sp.aws_topk = p->capacity > W ? p->capacity - W : (N + 1) / 2;
	ASSERT_OK(kvd_score_layer(&f->in, f->gram, f->ggram, &sp, ret));
}

/* N1 of the costs (non-finite and negative as 0; all equal if none is left), monotone in
 * them. */
static void check_proportional(const char *what, const float *cost, const float *v, size_t n,
			       float lambda) {
	double sum = 0;

	for (size_t i = 0; i < n; i++)
		sum += isfinite(cost[i]) && cost[i] > 0 ? cost[i] : 0;
	for (size_t i = 0; i < n; i++) {
		double c = isfinite(cost[i]) && cost[i] > 0 ? cost[i] : 0;
		double want = sum > 0 ? lambda * c / sum : (double)lambda / (double)n;

		if (!(fabs(v[i] - want) <= 1e-12 + 1e-5 * want)) {
			fprintf(stderr, "%s: value %zu is %.9g, want %.9g\n", what, i, v[i], want);
			ASSERT_TRUE(0);
		}
	}
	for (size_t i = 0; i < n; i++)
		for (size_t j = 0; j < n; j++)
			if (cost[i] < cost[j] && !(v[i] <= v[j])) {
				fprintf(stderr, "%s: costs %zu < %zu but values %.9g > %.9g\n", what, i, j,
					v[i], v[j]);
				ASSERT_TRUE(0);
			}
}

/* select.h's order: whether item i ranks below item j of the same row. */
static int ranks_below(const float *s, uint32_t i, uint32_t j) {
	if (isnan(s[i]) || isnan(s[j]))
		return isnan(s[i]) && (!isnan(s[j]) || i > j);
	return s[i] < s[j] || (s[i] == s[j] && i > j);
}

/* How many of the row's first N items rank below item i: its rank, 0 the lowest. */
static uint32_t rank_of(const float *s, uint32_t i) {
	uint32_t rank = 0;

	for (uint32_t j = 0; j < N; j++)
		rank += ranks_below(s, j, i);
	return rank;
}

/* The baseline's own scores, with the parameters baseline_scores() in policy.c passes. */
static void baseline_of(const struct kvd_policy_params *p, const struct kt_layer *f, float *ret) {
	enum kvd_baseline b = kvd_baseline_from_string(kvd_policy_to_string(p->policy));
	struct kvd_baseline_params bp;

	ASSERT_TRUE(b >= 0);
	kvd_baseline_params_init(b, &bp);
	bp.per_query_head = p->per_query_head;
	if (b == KVD_BASELINE_EXPECTED_ATTENTION) {
		bp.eq_q = f->in.q, bp.eq_rows = f->in.window, bp.eq_first = 0;
		bp.eq_row_stride = f->in.q_row_stride, bp.eq_head_stride = f->in.q_head_stride;
	}
	ASSERT_OK(kvd_baseline_scores(b, &bp, &f->in, ret));
}

/* Rank r (0 lowest) of each row, as r + 1, over rows * n(n+1)/2, times lambda. */
static void check_ranks(const char *what, const float *base, uint32_t rows, const float *v,
			float lambda) {
	double unit = lambda / (rows * (N * (N + 1.0) / 2));

	for (uint32_t r = 0; r < rows; r++) {
		const float *s = base + (size_t)r * L, *got = v + (size_t)r * N;

		for (uint32_t i = 0; i < N; i++) {
			uint32_t rank = rank_of(s, i);

			if (!(fabs(got[i] - (rank + 1) * unit) <= 1e-6 * (rank + 1) * unit)) {
				fprintf(stderr, "%s: row %u item %u (score %g): %.9g, want rank %u (%.9g)\n",
					what, r, i, s[i], got[i], rank, (rank + 1) * unit);
				ASSERT_TRUE(0);
			}
		}
	}
}

/*
 * kvd's costs (docs/algorithms.md §7.5): each token worth at least the cost of its row's
 * token whose rank among the costs is its key's rank among KeyDiff's novelty scores; ranks
 * counted pair by pair, independently of policy.c's sorts.
 */
static void union_costs(const struct kvd_policy_params *p, const struct kt_layer *f,
			uint32_t rows, float *cost) {
	float *plain = kt_floats((size_t)rows * N), *novelty = kt_floats((size_t)rows * L);
	struct kvd_baseline_params bp;
	uint32_t by_rank[N];

	raw_costs(p, f, plain);
	memcpy(cost, plain, (size_t)rows * N * sizeof(float));
	kvd_baseline_params_init(KVD_BASELINE_KEYDIFF, &bp);
	bp.per_query_head = p->per_query_head;
	ASSERT_OK(kvd_baseline_scores(KVD_BASELINE_KEYDIFF, &bp, &f->in, novelty));
	for (uint32_t r = 0; r < rows; r++) {
		const float *c = plain + (size_t)r * N, *s = novelty + (size_t)r * L;

		for (uint32_t t = 0; t < N; t++)
			by_rank[rank_of(c, t)] = t;
		for (uint32_t i = 0; i < N; i++) {
			float floor = c[by_rank[rank_of(s, i)]];

			if (isfinite(floor) && !(cost[(size_t)r * N + i] >= floor))
				cost[(size_t)r * N + i] = floor;
		}
	}
	free(plain), free(novelty);
}

TEST(every_policy) {
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16 };
	static const uint32_t capacities[] = { 40, 0 };

	for (size_t t = 0; t < sizeof(dtypes) / sizeof(dtypes[0]); t++) {
		struct kt_layer f;

		kt_layer_init(&f, dtypes[t], H, HKV, W, L, D, 24, 70 + t, 3.0f);
		for (int pol = 0; pol < _KVD_POLICY_MAX; pol++)
			/* indexmem reads index keys, not these: test-indexmem.c. */
			if (pol != KVD_POLICY_INDEXMEM)
			for (uint32_t pqh = 0; pqh < 2; pqh++)
				for (size_t c = 0; c < sizeof(capacities) / sizeof(capacities[0]); c++) {
					enum kvd_policy policy =
						kvd_policy_from_string(kvd_policy_to_string((enum kvd_policy)pol));
					struct kvd_policy_params p;
					float *v = kt_floats((size_t)H * N), *again = kt_floats((size_t)H * N);
					uint32_t rows;
					char what[128];

					ASSERT_EQ((int)policy, pol);
					kvd_policy_params_default(policy, &p);
					p.capacity = capacities[c];
					p.per_query_head = pqh;
					p.layer_weight = WEIGHT;
					rows = kvd_policy_score_rows(&p, &f.in);
					ASSERT_EQ(rows, pqh ? H : HKV);
					snprintf(what, sizeof(what), "%s %s pqh %u capacity %u",
						 kvd_policy_to_string(policy), t ? "f16" : "f32", pqh,
						 capacities[c]);
					ASSERT_OK(kvd_policy_scores(&p, &f.in, f.gram, f.ggram, v));
					check_shares(what, v, (size_t)rows * N, WEIGHT);
					ASSERT_OK(kvd_policy_scores(&p, &f.in, f.gram, f.ggram, again));
					ASSERT_EQ(memcmp(v, again, (size_t)rows * N * sizeof(float)), 0);

					if (policy == KVD_POLICY_FULL) {
						for (size_t i = 0; i < (size_t)rows * N; i++)
							ASSERT_TRUE(v[i] == v[0]);
					} else if (output_aware(policy)) {
						float *cost = kt_floats((size_t)rows * N);

						if (policy == KVD_POLICY_KVD)
							union_costs(&p, &f, rows, cost);
						else
							raw_costs(&p, &f, cost);
						check_proportional(what, cost, v, (size_t)rows * N, WEIGHT);
						free(cost);
					} else {
						float *base = kt_floats((size_t)rows * L);

						baseline_of(&p, &f, base);
						check_ranks(what, base, rows, v, WEIGHT);
						free(base);
					}
					free(v), free(again);
				}
		kt_layer_done(&f);
	}
}

/* Equal scores rank by position (the lower one higher), NaN lowest, +inf highest. */
TEST(rank_ties) {
	struct kt_layer f;
	struct kvd_policy_params p;
	float v[HKV * N];
	double unit = 1.0 / (HKV * (N * (N + 1.0) / 2));

	kt_layer_init(&f, KVD_DTYPE_F32, H, HKV, W, L, D, 24, 5, 3.0f);
	/* StreamingLLM: the 4 sinks +inf, then the position: already all distinct, ascending. */
	kvd_policy_params_default(KVD_POLICY_STREAMINGLLM, &p);
	ASSERT_OK(kvd_policy_scores(&p, &f.in, NULL, NULL, v));
	for (uint32_t r = 0; r < HKV; r++) {
		for (uint32_t i = 0; i < 4; i++)
			ASSERT_TRUE(fabs(v[r * N + i] - (N - i) * unit) <= 1e-6 * (N - i) * unit);
		for (uint32_t i = 4; i < N; i++)
			ASSERT_TRUE(fabs(v[r * N + i] - (i - 3) * unit) <= 1e-6 * (i - 3) * unit);
	}
	/* KNorm with every key equal: all tie, the lowest position highest. */
	for (size_t i = 0; i < (size_t)HKV * L * D; i++)
		((float *)f.k)[i] = (float)(i % D) * 0.01f;
	kvd_policy_params_default(KVD_POLICY_KNORM, &p);
	ASSERT_OK(kvd_policy_scores(&p, &f.in, NULL, NULL, v));
	for (uint32_t r = 0; r < HKV; r++)
		for (uint32_t i = 0; i < N; i++)
			ASSERT_TRUE(fabs(v[r * N + i] - (N - i) * unit) <= 1e-6 * (N - i) * unit);
	kt_layer_done(&f);
}

/* NaN and inf in K, V or the Gram matrices: still finite shares summing to the weight, and
 * the output-aware policies' finite costs keep their shares. */
TEST(nonfinite_inputs) {
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16 };
	size_t nonfinite = 0;

	for (size_t t = 0; t < sizeof(dtypes) / sizeof(dtypes[0]); t++) {
		struct kt_layer f;

		kt_layer_init(&f, dtypes[t], H, HKV, W, L, D, 24, 9, 3.0f);
		/* All in kv head 0 (query heads 0 and 1): kv head 1's costs stay finite. */
		kt_store(f.k, dtypes[t], 10 * D + 3, NAN);
		kt_store(f.k, dtypes[t], 30 * D + 1, INFINITY);
		kt_store(f.v, dtypes[t], 40 * D + 2, NAN);
		f.gram[7] = NAN;
		for (int pol = 0; pol < _KVD_POLICY_MAX; pol++)
			/* indexmem reads index keys, not these: test-indexmem.c. */
			if (pol != KVD_POLICY_INDEXMEM)
			for (uint32_t pqh = 0; pqh < 2; pqh++) {
				struct kvd_policy_params p;
				float v[H * N];
				char what[96];

				kvd_policy_params_default((enum kvd_policy)pol, &p);
				p.capacity = 30;
				p.per_query_head = pqh;
				p.layer_weight = WEIGHT;
				snprintf(what, sizeof(what), "nonfinite %s %s pqh %u",
					 kvd_policy_to_string((enum kvd_policy)pol), t ? "f16" : "f32", pqh);
				ASSERT_OK(kvd_policy_scores(&p, &f.in, f.gram, f.ggram, v));
				check_shares(what, v, (size_t)kvd_policy_score_rows(&p, &f.in) * N, WEIGHT);
				if (output_aware((enum kvd_policy)pol)) {
					/* The non-finite costs count as 0, the others keep their shares. */
					float cost[H * N];
					size_t n = (size_t)kvd_policy_score_rows(&p, &f.in) * N;

					raw_costs(&p, &f, cost);
					for (size_t i = 0; i < n; i++)
						nonfinite += !isfinite(cost[i]);
					if (pol == KVD_POLICY_KVD)
						union_costs(&p, &f, kvd_policy_score_rows(&p, &f.in), cost);
					check_proportional(what, cost, v, n, WEIGHT);
				} else if (pol != KVD_POLICY_FULL) {
					/* -inf (a score that met a NaN) ranks lowest. */
					float base[H * L];

					baseline_of(&p, &f, base);
					check_ranks(what, base, kvd_policy_score_rows(&p, &f.in), v, WEIGHT);
				}
			}
		kt_layer_done(&f);
	}
	/* Or the test would not test the cleaning. */
	ASSERT_GT(nonfinite, 0u);
}

/* L == w: no prefix, nothing written. A zero weight: all values 0. */
TEST(empty_prefix_and_zero_weight) {
	struct kt_layer f;
	struct kvd_attn_in in;
	float v[H * N];
	uint64_t seed = 12;
	void *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)H * L * D, 1.0f);

	kt_layer_init(&f, KVD_DTYPE_F32, H, HKV, W, L, D, 24, 11, 3.0f);
	in = f.in;
	in.window = in.len;
	in.q = q;
	kvd_attn_in_contiguous(&in);
	for (int pol = 0; pol < _KVD_POLICY_MAX; pol++) {
		/* indexmem reads index keys, not these: test-indexmem.c. */
		if (pol == KVD_POLICY_INDEXMEM)
			continue;
		struct kvd_policy_params p;

		kvd_policy_params_default((enum kvd_policy)pol, &p);
		for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
			v[i] = -1;
		ASSERT_OK(kvd_policy_scores(&p, &in, f.gram, f.ggram, v));
		for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
			ASSERT_TRUE(v[i] == -1);
		ASSERT_OK(kvd_policy_scores(&p, &in, f.gram, f.ggram, NULL));

		p.layer_weight = 0;
		ASSERT_OK(kvd_policy_scores(&p, &f.in, f.gram, f.ggram, v));
		for (size_t i = 0; i < (size_t)HKV * N; i++)
			ASSERT_TRUE(v[i] == 0);
	}
	free(q);
	kt_layer_done(&f);
}

TEST(bad_params) {
	struct kt_layer f;
	struct kvd_policy_params p;
	struct kvd_attn_in in;
	float v[H * N];

	kt_layer_init(&f, KVD_DTYPE_F32, H, HKV, W, L, D, 24, 13, 3.0f);
	kvd_policy_params_default(KVD_POLICY_KVD, &p);
	ASSERT_ERRNO(kvd_policy_scores(NULL, &f.in, f.gram, NULL, v), -EINVAL);
	ASSERT_ERRNO(kvd_policy_scores(&p, NULL, f.gram, NULL, v), -EINVAL);
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, NULL), -EINVAL);
	p.policy = _KVD_POLICY_MAX;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.policy = KVD_POLICY_KVD;
	p.granularity = _KVD_GRANULARITY_MAX;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.granularity = KVD_GRANULARITY_HEAD;
	p.layer_weight = -1;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.layer_weight = NAN;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.layer_weight = INFINITY;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.layer_weight = 1;
	p.kernel = 4; /* even */
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	p.kernel = 5;
	in = f.in;
	in.v = NULL;
	ASSERT_ERRNO(kvd_policy_scores(&p, &in, f.gram, NULL, v), -EINVAL);
	in = f.in;
	in.kv_heads = 3;
	ASSERT_ERRNO(kvd_policy_scores(&p, &in, f.gram, NULL, v), -EINVAL);
	/* LaProx's joint form with W_o needs the group Gram matrices. */
	kvd_policy_params_default(KVD_POLICY_LAPROX, &p);
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, f.gram, NULL, v), -EINVAL);
	ASSERT_OK(kvd_policy_scores(&p, &f.in, f.gram, f.ggram, v));
	kvd_policy_params_default(KVD_POLICY_PYRAMIDKV, &p);
	p.layer = 1;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, NULL, NULL, v), -EINVAL);
	kvd_policy_params_default(KVD_POLICY_SNAPKV, &p);
	p.pooling = KVD_POOL_ADAPTIVE;
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, NULL, NULL, v), -EINVAL);
	kt_layer_done(&f);
}

/* The policy table: every policy named once and found by its name; what the daemon asks of
 * an entry agrees with what the kernels do with it. */
TEST(policy_table) {
	for (int p = 0; p < _KVD_POLICY_MAX; p++) {
		const struct kvd_policy_info *info = kvd_policy_info(p);

		ASSERT_NOT_NULL(info);
		ASSERT_NOT_NULL(info->name);
		ASSERT_EQ((int)kvd_policy_from_string(info->name), p);
		ASSERT_EQ(kvd_policy_scores_via_layer(p), (info->flags & KVD_POLICY_LAYER_PIPELINE) != 0);
		/* A fallback ranks without what the policy needed. */
		if (info->flags & KVD_POLICY_NEEDS_INDEX) {
			ASSERT_NE((int)info->fallback, p);
			ASSERT_FALSE(kvd_policy_info(info->fallback)->flags & KVD_POLICY_NEEDS_INDEX);
		} else
			ASSERT_EQ((int)info->fallback, p);
	}
	ASSERT_NULL(kvd_policy_info(_KVD_POLICY_MAX));
	ASSERT_NULL(kvd_policy_info(_KVD_POLICY_INVALID));
	ASSERT_TRUE(kvd_policy_info(KVD_POLICY_KVD_MI)->flags & KVD_POLICY_NEEDS_MOMENTS);
	ASSERT_FALSE(kvd_policy_info(KVD_POLICY_KVD)->flags & KVD_POLICY_NEEDS_MOMENTS);
}

/* Every policy scores a window of 1 to 4 queries, as a round does: expected_attention took
 * its statistics from the window's rows past the 4 sinks, so a short window failed, and
 * with it the daemon's whole round. */
TEST(short_windows) {
	for (uint32_t w = 1; w <= 4; w++) {
		struct kt_layer f;

		kt_layer_init(&f, KVD_DTYPE_F32, H, HKV, w, L, D, 24, 90 + w, 3.0f);
		for (int pol = 0; pol < _KVD_POLICY_MAX; pol++) {
			struct kvd_policy_params p;
			float *v;

			if (kvd_policy_info(pol)->flags & KVD_POLICY_NEEDS_INDEX)
				continue;
			v = kt_floats((size_t)H * (L - w));
			kvd_policy_params_default(pol, &p);
			/* As the daemon's rounds score (daemon/eviction/round.c). */
			p.capacity = w + (L - w) / 2;
			p.laprox_joint = 0;
			if (kvd_policy_scores(&p, &f.in, output_aware(pol) ? f.gram : NULL, NULL, v) < 0)
				test_fail(__FILE__, __LINE__, "%s with a window of %u failed",
				          kvd_policy_to_string(pol), w);
			free(v);
		}
		kt_layer_done(&f);
	}
}

/*
 * A key that stands out from its head's keys, which the window's queries ignore: ReST-KV
 * alone drops it, kvd keeps it (a question not yet asked may look for it), and both keep
 * the token the window attends to most.
 */
TEST(kvd_keeps_a_key_that_stands_out) {
	enum { KD = 8, KL = 64, KW = 8, NOVEL = 20, LOOKED_AT = 40 };
	float *q = kt_floats((size_t)2 * KW * KD), *k = kt_floats((size_t)KL * KD);
	float *v = kt_floats((size_t)KL * KD);
	uint64_t seed = 5;
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = 2, .kv_heads = 1, .window = KW, .len = KL,
		.dim = KD, .scale = 0.35f, .q = q, .k = k, .v = v,
	};
	enum kvd_policy policies[] = { KVD_POLICY_RESTKV, KVD_POLICY_KVD };
	bool kept[2][2] = {};

	kvd_attn_in_contiguous(&in);
	/* Keys along e0 with noise in the next three coordinates; the novel key along e7, which
	 * no query has a component on; the looked-at key three times as long along e0. */
	for (uint32_t i = 0; i < KL; i++) {
		k[i * KD] = i == NOVEL ? 0.0f : i == LOOKED_AT ? 3.0f : 1.0f;
		for (uint32_t c = 1; c < 4; c++)
			k[i * KD + c] = 0.3f * (kt_uniform(&seed) - 0.5f);
		k[i * KD + 7] = i == NOVEL ? 1.5f : 0.0f;
		for (uint32_t c = 0; c < KD; c++)
			v[i * KD + c] = kt_uniform(&seed) - 0.5f;
	}
	for (uint32_t r = 0; r < 2 * KW; r++) {
		q[r * KD] = 4.0f;
		for (uint32_t c = 1; c < 4; c++)
			q[r * KD + c] = kt_uniform(&seed) - 0.5f;
	}
	for (size_t t = 0; t < 2; t++) {
		struct kvd_policy_params p;
		struct kvd_keep *keep = NULL;

		kvd_policy_params_default(policies[t], &p);
		/* ReST-KV's pooling spreads the looked-at token's cost over its 5 neighbours; the
		 * union keeps about the top 6 of each ranking. */
		p.capacity = KW + 12;
		ASSERT_OK(kvd_policy_keep(&p, &in, NULL, NULL, &keep));
		ASSERT_EQ(keep->off[1], (size_t)p.capacity);
		for (size_t j = 0; j < keep->off[1]; j++) {
			kept[t][0] |= keep->pos[j] == NOVEL;
			kept[t][1] |= keep->pos[j] == LOOKED_AT;
		}
		kvd_keep_free(keep);
	}
	ASSERT_FALSE(kept[0][0]);
	ASSERT_TRUE(kept[1][0]);
	ASSERT_TRUE(kept[0][1]);
	ASSERT_TRUE(kept[1][1]);
	free(q), free(k), free(v);
}
