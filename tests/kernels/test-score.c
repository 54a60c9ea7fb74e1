/* SPDX-License-Identifier: MIT */
/*
 * The per-layer pipeline (score.h) and the policy table (policy.h): optimised against
 * reference, independence from the thread count, selections identical except for items
 * whose scores lie within the tolerance of the cut-off, budgets and windows of every
 * policy, and non-finite inputs.
 */
#include <math.h>

#include "gram.h"
#include "ktest.h"
#include "policy.h"
#include "score.h"
#include "select.h"

#define ATOL 1e-7
#define RTOL 1e-4

struct fix {
	struct kvd_attn_in in;
	void *q, *k, *v;
	float *w, *gram, *ggram;
};

static void fix_init(struct fix *f, uint32_t dtype, uint32_t H, uint32_t Hkv, uint32_t w,
		     uint32_t L, uint32_t d, uint64_t seed) {
	uint32_t g = H / Hkv, C = 24;
	struct kvd_wo wo;

	*f = (struct fix){};
	f->q = kt_random(&seed, dtype, (size_t)H * w * d, 3.0f);
	f->k = kt_random(&seed, dtype, (size_t)Hkv * L * d, 1.0f);
	f->v = kt_random(&seed, dtype, (size_t)Hkv * L * d, 1.0f);
	f->w = kt_random(&seed, KVD_DTYPE_F32, (size_t)C * H * d, 0.3f);
	f->in = (struct kvd_attn_in){
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = w, .len = L, .dim = d,
		.scale = 1.0f / sqrtf((float)d), .q = f->q, .k = f->k, .v = f->v,
	};
	kvd_attn_in_contiguous(&f->in);
	wo = (struct kvd_wo){
		.dtype = KVD_DTYPE_F32, .c_out = C, .heads = H, .dim = d, .w = f->w,
		.row_stride = (size_t)H * d,
	};
	f->gram = kt_floats((size_t)H * d * d);
	f->ggram = kt_floats((size_t)Hkv * g * d * g * d);
	for (uint32_t h = 0; h < H; h++)
		ASSERT_OK(kvd_gram(&wo, h, 1, f->gram + (size_t)h * d * d));
	for (uint32_t kv = 0; kv < Hkv; kv++)
		ASSERT_OK(kvd_gram(&wo, kv * g, g, f->ggram + (size_t)kv * g * d * g * d));
}

static void fix_done(struct fix *f) {
	free(f->q), free(f->k), free(f->v), free(f->w), free(f->gram), free(f->ggram);
}

TEST(pipeline_matches_reference) {
	static const struct {
		enum kvd_score_kind kind;
		uint32_t per_query_head, joint, normalize;
		enum kvd_pool_mode pool;
	} cfgs[] = {
		{ KVD_SCORE_RESTKV, 0, 0, 0, KVD_POOL_ADAPTIVE },
		{ KVD_SCORE_RESTKV, 1, 0, 0, KVD_POOL_ADAPTIVE },
		{ KVD_SCORE_RESTKV, 0, 0, 1, KVD_POOL_AVG },
		{ KVD_SCORE_LAPROX, 0, 1, 1, KVD_POOL_NONE },
		{ KVD_SCORE_LAPROX, 0, 0, 1, KVD_POOL_MAX },
		{ KVD_SCORE_LAPROX, 0, 1, 0, KVD_POOL_ADAPTIVE },
		{ KVD_SCORE_LAPROX, 1, 1, 0, KVD_POOL_NONE },
	};
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_BF16 };

	KT_FOREACH_PATH(path)
		for (size_t t = 0; t < 2; t++)
			for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++)
				for (int use_wo = 0; use_wo < 2; use_wo++) {
					struct fix f;
					struct kvd_score_params p;
					uint32_t n, rows;
					float *ref, *got, *got3;
					char what[160];

					fix_init(&f, dtypes[t], 8, 2, 8, 300, 16, 900 + c);
					kvd_score_params_default(cfgs[c].kind, &p);
					p.per_query_head = cfgs[c].per_query_head;
					p.laprox_joint = cfgs[c].joint;
					p.normalize = cfgs[c].normalize;
					p.pooling = cfgs[c].pool;
					p.aws_topk = 40;
					p.aws_scale = 20; /* small enough that kernels and shifts vary */
					p.layer_weight = 0.5f;
					n = f.in.len - f.in.window, rows = kvd_score_rows(&p, &f.in);
					ref = kt_floats((size_t)rows * n), got = kt_floats((size_t)rows * n);
					got3 = kt_floats((size_t)rows * n);
					ASSERT_OK(kvd_score_layer_ref(&f.in, use_wo ? f.gram : NULL,
								      use_wo ? f.ggram : NULL, &p, ref));
					p.threads = 1;
					ASSERT_OK(kvd_score_layer(&f.in, use_wo ? f.gram : NULL,
								  use_wo ? f.ggram : NULL, &p, got));
					p.threads = 3;
					ASSERT_OK(kvd_score_layer(&f.in, use_wo ? f.gram : NULL,
								  use_wo ? f.ggram : NULL, &p, got3));
					snprintf(what, sizeof(what), "%s dtype %u cfg %zu wo %d", path,
						 dtypes[t], c, use_wo);
					ASSERT_TRUE(kt_close(what, ref, got, (size_t)rows * n, ATOL, RTOL));
					/* Bit-identical whatever the thread count. */
					ASSERT_EQ(memcmp(got, got3, (size_t)rows * n * sizeof(float)), 0);
					for (uint32_t r = 0; r < rows; r++)
						ASSERT_TRUE(kt_selection_ok(what, ref + (size_t)r * n, got + (size_t)r * n,
									    n, 60, ATOL, RTOL));
					/* Layer-wide selection (laprox, kvd) over all rows at once. */
					ASSERT_TRUE(kt_selection_ok(what, ref, got, rows * n, rows * 60, ATOL, RTOL));
					free(ref), free(got), free(got3);
					fix_done(&f);
				}
}

/* layerwide: 0 every row keeps cap; 1 rows vary, cap per row on average; 2 no budget check. */
static void check_keep(const char *what, const struct kvd_keep *k, uint32_t rows, uint32_t L,
		       uint32_t w, uint32_t cap, int layerwide) {
	size_t total = 0;

	ASSERT_EQ(k->rows, rows);
	for (uint32_t r = 0; r < rows; r++) {
		uint32_t n = k->off[r + 1] - k->off[r];
		const uint32_t *p = k->pos + k->off[r];

		if (!layerwide && L > cap && n != cap) {
			fprintf(stderr, "%s: row %u keeps %u, capacity %u\n", what, r, n, cap);
			ASSERT_TRUE(0);
		}
		ASSERT_GE(n, w);
		for (uint32_t i = 1; i < n; i++)
			ASSERT_LT(p[i - 1], p[i]);
		for (uint32_t i = 0; i < w; i++) /* the window, always */
			ASSERT_EQ(p[n - w + i], L - w + i);
		ASSERT_LT(p[n - 1], L);
		total += n;
	}
	if (L <= cap)
		ASSERT_EQ(total, (size_t)rows * L);
	else if (layerwide < 2)
		ASSERT_LE(total, (size_t)rows * cap);
}

static int same_keep(const struct kvd_keep *a, const struct kvd_keep *b) {
	if (a->rows != b->rows || memcmp(a->off, b->off, (a->rows + 1) * sizeof(uint32_t)) != 0)
		return 0;
	return memcmp(a->pos, b->pos, a->off[a->rows] * sizeof(uint32_t)) == 0;
}

TEST(every_policy) {
	struct fix f;

	fix_init(&f, KVD_DTYPE_F32, 8, 2, 8, 200, 16, 5);
	for (int pol = 0; pol < _KVD_POLICY_MAX; pol++)
		/* indexmem reads index keys, not these: test-indexmem.c. */
		if (pol != KVD_POLICY_INDEXMEM)
		for (int gran = 0; gran < 2; gran++)
			for (int pqh = 0; pqh < 2; pqh++) {
				struct kvd_policy_params p;
				struct kvd_keep *opt = NULL, *ref = NULL;
				uint32_t rows = gran ? 1 : pqh ? 8 : 2;
				char what[128];
				int layerwide = pol == KVD_POLICY_LAPROX || pol == KVD_POLICY_KVD ||
						pol == KVD_POLICY_KVD_MI || pol == KVD_POLICY_ADAKV;

				kvd_policy_params_default((enum kvd_policy)pol, &p);
				p.capacity = 40;
				p.granularity = (enum kvd_granularity)gran;
				p.per_query_head = pqh;
				if (pol == KVD_POLICY_PYRAMIDKV)
					p.layer = 1, p.n_layers = 4;
				snprintf(what, sizeof(what), "%s gran %d pqh %d",
					 kvd_policy_to_string((enum kvd_policy)pol), gran, pqh);
				ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, f.ggram, &opt));
				p.reference = 1;
				ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, f.ggram, &ref));
				check_keep(what, opt, rows, 200, 8, pol == KVD_POLICY_FULL ? 200 : 40,
					   pol == KVD_POLICY_PYRAMIDKV ? 2 : layerwide && !gran);
				/* Random inputs: no near-ties at this seed, so the sets are identical. */
				if (!same_keep(opt, ref)) {
					fprintf(stderr, "%s: optimised and reference keep sets differ\n", what);
					ASSERT_TRUE(0);
				}
				kvd_keep_free(opt), kvd_keep_free(ref);
			}
	fix_done(&f);
}

TEST(policy_keeps_everything_when_short) {
	struct fix f;
	struct kvd_policy_params p;
	struct kvd_keep *k = NULL;

	fix_init(&f, KVD_DTYPE_F32, 4, 4, 4, 30, 8, 6);
	kvd_policy_params_default(KVD_POLICY_KVD, &p);
	p.capacity = 30;
	ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, NULL, &k));
	check_keep("short", k, 4, 30, 4, 30, 0);
	k = kvd_keep_free(k);
	/* capacity == window: the window only. */
	kvd_policy_params_default(KVD_POLICY_RESTKV, &p);
	p.capacity = 4;
	ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, NULL, &k));
	check_keep("window only", k, 4, 30, 4, 4, 0);
	k = kvd_keep_free(k);
	p.capacity = 3;
	ASSERT_ERRNO(kvd_policy_keep(&p, &f.in, f.gram, NULL, &k), -EINVAL);
	ASSERT_STREQ(kvd_policy_to_string(KVD_POLICY_EXPECTED_ATTENTION), "expected_attention");
	ASSERT_EQ((int)kvd_policy_from_string("kvd"), (int)KVD_POLICY_KVD);
	ASSERT_EQ((int)kvd_policy_from_string("kvd-mi"), (int)KVD_POLICY_KVD_MI);
	ASSERT_EQ((int)kvd_policy_from_string("kvd+moments"), -EINVAL);
	ASSERT_EQ((int)kvd_granularity_from_string("layer"), (int)KVD_GRANULARITY_LAYER);
	fix_done(&f);
}

/* The layer-wide policies spend rows * (capacity - w) prefix tokens in all. */
TEST(layerwide_budget) {
	struct fix f;

	fix_init(&f, KVD_DTYPE_F32, 8, 4, 8, 120, 16, 8);
	for (int pol = KVD_POLICY_LAPROX; pol <= KVD_POLICY_KVD_MI; pol++) {
		struct kvd_policy_params p;
		struct kvd_keep *k = NULL;

		kvd_policy_params_default((enum kvd_policy)pol, &p);
		p.capacity = 30;
		ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, f.ggram, &k));
		ASSERT_EQ(k->off[k->rows], 4u * 30u);
		kvd_keep_free(k);
	}
	fix_done(&f);
}

/* NaN and inf anywhere: every policy still returns well-formed keep sets. */
TEST(nonfinite_inputs_never_crash) {
	struct fix f;

	fix_init(&f, KVD_DTYPE_F32, 4, 2, 6, 80, 8, 9);
	((float *)f.q)[3] = NAN;
	((float *)f.k)[8 * 10 + 1] = INFINITY;
	((float *)f.k)[80 * 8 + 8 * 20] = -INFINITY;
	((float *)f.v)[8 * 30 + 2] = NAN;
	((float *)f.v)[80 * 8 + 8 * 40] = INFINITY;
	f.gram[5] = NAN;
	KT_FOREACH_PATH(path)
		for (int pol = 0; pol < _KVD_POLICY_MAX; pol++)
			/* indexmem reads index keys, not these: test-indexmem.c. */
			if (pol != KVD_POLICY_INDEXMEM)
			for (int gran = 0; gran < 2; gran++) {
				struct kvd_policy_params p;
				struct kvd_keep *k = NULL;
				int layerwide = pol == KVD_POLICY_LAPROX || pol == KVD_POLICY_KVD ||
						pol == KVD_POLICY_KVD_MI || pol == KVD_POLICY_ADAKV;

				kvd_policy_params_default((enum kvd_policy)pol, &p);
				p.capacity = 20;
				p.granularity = (enum kvd_granularity)gran;
				ASSERT_OK(kvd_policy_keep(&p, &f.in, f.gram, f.ggram, &k));
				check_keep(path, k, gran ? 1 : 2, 80, 6, pol == KVD_POLICY_FULL ? 80 : 20,
					   layerwide && !gran);
				kvd_keep_free(k);
			}
	fix_done(&f);
}

TEST(bad_params) {
	struct fix f;
	struct kvd_score_params p;
	float out[1000];

	fix_init(&f, KVD_DTYPE_F32, 4, 2, 6, 80, 8, 9);
	kvd_score_params_default(KVD_SCORE_RESTKV, &p);
	ASSERT_ERRNO(kvd_score_layer(&f.in, f.gram, NULL, &p, out), -EINVAL); /* aws_topk 0 */
	p.aws_topk = 10;
	p.kernel = 4;
	ASSERT_ERRNO(kvd_score_layer(&f.in, f.gram, NULL, &p, out), -EINVAL);
	p.kernel = 5;
	p.layer_weight = -1;
	ASSERT_ERRNO(kvd_score_layer_ref(&f.in, f.gram, NULL, &p, out), -EINVAL);
	p.layer_weight = 1;
	f.in.v = NULL;
	ASSERT_ERRNO(kvd_score_layer(&f.in, f.gram, NULL, &p, out), -EINVAL);
	ASSERT_EQ(kvd_score_threads(0, 1), 1u);
	ASSERT_EQ(kvd_score_threads(5, 3), 3u);
	fix_done(&f);
}
