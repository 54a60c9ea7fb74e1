/* SPDX-License-Identifier: MIT */
/*
 * ReST-KV cost: the Gram form against the direct projection through W_o (docs/algorithms.md
 * §1.4), "before" against a per-query brute force, the odds clamp, the
 * optimised path against the reference, and the Gram blocks of gram.h.
 */
#include <math.h>

#include "gram.h"
#include "ktest.h"
#include "restkv.h"

static double vget(const struct kt_layer *f, uint32_t h, uint32_t i, uint32_t j) {
	uint32_t g = kvd_attn_kv_head(&f->in, h);
	size_t off = ((size_t)g * f->in.len + i) * f->in.dim + j;

	return kvd_load(f->v, f->in.dtype, off);
}

/* ||x W_o^h||, directly: W_o^h[a][c] = wo[c][h*d + a]; use_wo 0 gives ||x||. */
static double proj_norm(const struct kt_layer *f, uint32_t h, const double *x, int use_wo) {
	uint32_t d = f->in.dim;
	double s = 0;

	if (!use_wo) {
		for (uint32_t a = 0; a < d; a++)
			s += x[a] * x[a];
		return sqrt(s);
	}
	for (uint32_t c = 0; c < f->wo.c_out; c++) {
		double y = 0;

		for (uint32_t a = 0; a < d; a++)
			y += x[a] * f->w[(size_t)c * f->wo.row_stride + (size_t)h * d + a];
		s += y * y;
	}
	return sqrt(s);
}

static double odds(double a) {
	if (a > KVD_RESTKV_A_MAX)
		a = KVD_RESTKV_A_MAX;
	return a / (1 - a);
}

/* docs/algorithms.md §1.4 "after", by the book: EMA recursion, o over the prefix, projection. */
static void naive_after(const struct kt_layer *f, uint32_t h, float alpha, float tau, int use_wo,
			double *out) {
	uint32_t w = f->in.window, L = f->in.len, n = L - w, d = f->in.dim;
	const float *P = f->probs + (size_t)h * w * L;
	double *a = calloc(n, sizeof(double)), *o = calloc(d, sizeof(double)),
	       *x = calloc(d, sizeof(double));

	ASSERT_TRUE(a && o && x);
	for (uint32_t i = 0; i < n; i++) {
		float acc = P[i];

		for (uint32_t t = 1; t < w; t++)
			acc = alpha * P[(size_t)t * L + i] + (1 - alpha) * acc;
		a[i] = acc;
		for (uint32_t j = 0; j < d; j++)
			o[j] += a[i] * vget(f, h, i, j);
	}
	for (uint32_t i = 0; i < n; i++) {
		for (uint32_t j = 0; j < d; j++)
			x[j] = o[j] - vget(f, h, i, j);
		out[i] = odds(a[i]) * pow(proj_norm(f, h, x, use_wo), tau);
	}
	free(a), free(o), free(x);
}

/* "before", by the book: per query t its own output over all keys, then the EMA over t. */
static void naive_before(const struct kt_layer *f, uint32_t h, float alpha, int use_wo, int use_norm,
			 double *out) {
	uint32_t w = f->in.window, L = f->in.len, n = L - w, d = f->in.dim;
	const float *P = f->probs + (size_t)h * w * L;
	double *o = calloc(d, sizeof(double)), *x = calloc(d, sizeof(double));
	float *s = kt_floats((size_t)w * n);

	ASSERT_TRUE(o && x);
	for (uint32_t t = 0; t < w; t++) {
		double on;

		for (uint32_t j = 0; j < d; j++) {
			o[j] = 0;
			for (uint32_t i = 0; i < L; i++)
				o[j] += (double)P[(size_t)t * L + i] * vget(f, h, i, j);
		}
		on = proj_norm(f, h, o, use_wo);
		for (uint32_t i = 0; i < n; i++) {
			double e;

			for (uint32_t j = 0; j < d; j++)
				x[j] = o[j] - vget(f, h, i, j);
			e = proj_norm(f, h, x, use_wo);
			if (use_norm && on > 0)
				e /= on;
			s[(size_t)t * n + i] = (float)(odds(P[(size_t)t * L + i]) * e);
		}
	}
	for (uint32_t i = 0; i < n; i++) {
		float acc = s[i];

		for (uint32_t t = 1; t < w; t++)
			acc = alpha * s[(size_t)t * n + i] + (1 - alpha) * acc;
		out[i] = acc;
	}
	free(o), free(x), free(s);
}

static int close_d(const char *what, const double *ref, const float *got, size_t n, double atol,
		   double rtol) {
	for (size_t i = 0; i < n; i++)
		if (!(fabs(got[i] - ref[i]) <= atol + fabs(ref[i]) * rtol)) {
			fprintf(stderr, "%s: token %zu: direct %.9g, got %.9g\n", what, i, ref[i], got[i]);
			return 0;
		}
	return 1;
}

TEST(gram_form_matches_direct_projection) {
	struct kt_layer f;

	kt_layer_init(&f, KVD_DTYPE_F32, 4, 2, 8, 90, 16, 40, 11, 3.0f);
	for (uint32_t h = 0; h < 4; h++)
		for (int use_wo = 0; use_wo < 2; use_wo++)
			for (int ti = 0; ti < 2; ti++) {
				uint32_t n = f.in.len - f.in.window, w = f.in.window, L = f.in.len;
				const float *gram = use_wo ? f.gram + (size_t)h * 16 * 16 : NULL;
				float tau = ti ? 0.5f : 1.0f, *ref = kt_floats(n), *opt = kt_floats(n);
				double *direct = calloc(n, sizeof(double));
				struct kvd_restkv_opts o;

				ASSERT_NOT_NULL(direct);
				kvd_restkv_opts_default(&o);
				o.tau = tau;
				naive_after(&f, h, o.alpha, tau, use_wo, direct);
				ASSERT_OK(kvd_restkv_head_ref(&f.in, h, f.probs + (size_t)h * w * L, gram,
							      NULL, &o, ref));
				ASSERT_OK(kvd_restkv_head(&f.in, h, f.probs + (size_t)h * w * L, gram,
							  NULL, &o, opt));
				ASSERT_TRUE(close_d("after ref", direct, ref, n, 1e-9, 1e-4));
				ASSERT_TRUE(close_d("after opt", direct, opt, n, 1e-9, 1e-4));
				free(ref), free(opt), free(direct);
			}
	kt_layer_done(&f);
}

TEST(before_matches_per_query_brute_force) {
	struct kt_layer f;

	kt_layer_init(&f, KVD_DTYPE_F32, 2, 1, 6, 70, 8, 24, 12, 3.0f);
	for (uint32_t h = 0; h < 2; h++)
		for (int use_wo = 0; use_wo < 2; use_wo++)
			for (int use_norm = 0; use_norm < 2; use_norm++) {
				uint32_t n = f.in.len - f.in.window, w = f.in.window, L = f.in.len;
				const float *gram = use_wo ? f.gram + (size_t)h * 8 * 8 : NULL;
				float *ref = kt_floats(n), *opt = kt_floats(n);
				double *direct = calloc(n, sizeof(double));
				struct kvd_restkv_opts o;

				ASSERT_NOT_NULL(direct);
				kvd_restkv_opts_default(&o);
				o.metric = KVD_RESTKV_BEFORE;
				o.use_norm = use_norm;
				naive_before(&f, h, o.alpha, use_wo, use_norm, direct);
				ASSERT_OK(kvd_restkv_head_ref(&f.in, h, f.probs + (size_t)h * w * L, gram,
							      NULL, &o, ref));
				ASSERT_OK(kvd_restkv_head(&f.in, h, f.probs + (size_t)h * w * L, gram,
							  NULL, &o, opt));
				ASSERT_TRUE(close_d("before ref", direct, ref, n, 1e-9, 1e-4));
				ASSERT_TRUE(close_d("before opt", direct, opt, n, 1e-9, 1e-4));
				free(ref), free(opt), free(direct);
			}
	kt_layer_done(&f);
}

TEST(optimised_matches_reference) {
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };
	static const struct {
		uint32_t H, Hkv, w, L, d, C;
	} shapes[] = {
		{ 1, 1, 1, 2, 1, 3 }, { 4, 2, 5, 133, 17, 20 }, { 4, 2, 16, 200, 32, 48 },
		{ 2, 2, 7, 7, 8, 8 }, /* w = L: no prefix */
	};

	KT_FOREACH_PATH(path)
		for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
			for (size_t t = 0; t < sizeof(dtypes) / sizeof(dtypes[0]); t++) {
				struct kt_layer f;
				uint32_t n = shapes[s].L - shapes[s].w, d = shapes[s].d;

				kt_layer_init(&f, dtypes[t], shapes[s].H, shapes[s].Hkv, shapes[s].w,
					 shapes[s].L, d, shapes[s].C, 100 + s * 3 + t, 2.0f);
				for (uint32_t h = 0; h < shapes[s].H; h++)
					for (int mode = 0; mode < 8; mode++) {
						struct kvd_restkv_opts o;
						const float *gram = mode & 1 ? NULL : f.gram + (size_t)h * d * d;
						const float *P = f.probs + (size_t)h * shapes[s].w * shapes[s].L;
						float *ref = kt_floats(n), *opt = kt_floats(n),
						      *vgv = kt_floats(n);
						char what[128];

						kvd_restkv_opts_default(&o);
						o.metric = mode & 2 ? KVD_RESTKV_BEFORE : KVD_RESTKV_AFTER;
						o.temporal = mode & 4 ? KVD_TEMPORAL_MEAN : KVD_TEMPORAL_EMA;
						o.use_norm = mode == 7;
						ASSERT_OK(kvd_restkv_head_ref(&f.in, h, P, gram, NULL, &o, ref));
						ASSERT_OK(kvd_restkv_head(&f.in, h, P, gram, NULL, &o, opt));
						snprintf(what, sizeof(what), "%s dtype %u shape %zu head %u mode %d",
							 path, dtypes[t], s, h, mode);
						ASSERT_TRUE(kt_close(what, ref, opt, n, 1e-7, 1e-4));
						/* A cached v G v^T gives the same costs. */
						ASSERT_OK(kvd_restkv_vgv(&f.in, h, gram, n, vgv));
						ASSERT_OK(kvd_restkv_head(&f.in, h, P, gram, vgv, &o, opt));
						ASSERT_TRUE(kt_close(what, ref, opt, n, 1e-7, 1e-4));
						ASSERT_OK(kvd_restkv_vgv_ref(&f.in, h, gram, n, opt));
						ASSERT_TRUE(kt_close("vgv", opt, vgv, n, 1e-6, 1e-4));
						free(ref), free(opt), free(vgv);
					}
				kt_layer_done(&f);
			}
}

/* The heads of a GQA group at once (values converted once) give each head's costs exactly. */
TEST(heads_match_one_by_one) {
	static const struct {
		uint32_t H, Hkv, w, L, d, C;
	} shapes[] = {
		{ 4, 2, 5, 133, 17, 20 }, { 8, 2, 16, 300, 32, 48 }, { 3, 1, 7, 7, 8, 8 },
	};

	KT_FOREACH_PATH(path)
		for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
			uint32_t H = shapes[s].H, Hkv = shapes[s].Hkv, g = H / Hkv, d = shapes[s].d;
			uint32_t n = shapes[s].L - shapes[s].w;
			size_t wl = (size_t)shapes[s].w * shapes[s].L, dd = (size_t)d * d;
			float *one = kt_floats((size_t)H * n), *grp = kt_floats((size_t)g * n);
			float *vgv = kt_floats((size_t)H * n);
			struct kvd_restkv_opts o;
			struct kt_layer f;

			kt_layer_init(&f, KVD_DTYPE_BF16, H, Hkv, shapes[s].w, shapes[s].L, d, shapes[s].C,
				 700 + s, 2.0f);
			for (int mode = 0; mode < 16; mode++) {
				const float *gram = mode & 1 ? NULL : f.gram;

				kvd_restkv_opts_default(&o);
				o.metric = mode & 2 ? KVD_RESTKV_BEFORE : KVD_RESTKV_AFTER;
				o.temporal = mode & 4 ? KVD_TEMPORAL_MEAN : KVD_TEMPORAL_EMA;
				for (uint32_t h = 0; h < H; h++) {
					ASSERT_OK(kvd_restkv_vgv(&f.in, h, gram ? gram + h * dd : NULL, n,
								 vgv + (size_t)h * n));
					ASSERT_OK(kvd_restkv_head(&f.in, h, f.probs + h * wl,
								  gram ? gram + h * dd : NULL,
								  mode & 8 ? vgv + (size_t)h * n : NULL, &o,
								  one + (size_t)h * n));
				}
				for (uint32_t kv = 0; kv < Hkv; kv++) {
					uint32_t h0 = kv * g;

					ASSERT_OK(kvd_restkv_heads(&f.in, h0, g, f.probs + h0 * wl,
								   gram ? gram + h0 * dd : NULL,
								   mode & 8 ? vgv + (size_t)h0 * n : NULL,
								   &o, grp));
					if (memcmp(grp, one + (size_t)h0 * n, (size_t)g * n * sizeof(float))) {
						fprintf(stderr, "%s shape %zu mode %d kv %u differs\n", path,
							s, mode, kv);
						ASSERT_TRUE(0);
					}
				}
			}
			/* Heads of two kv heads at once are refused. */
			if (g < H)
				ASSERT_ERRNO(kvd_restkv_heads(&f.in, g - 1, 2, f.probs, NULL, NULL, &o, grp),
					     -EINVAL);
			free(one), free(grp), free(vgv);
			kt_layer_done(&f);
		}
}

TEST(odds_clamp) {
	struct kt_layer f;
	uint32_t L = 50, w = 4, d = 8, n = L - w;
	float *q, *k, *cost = kt_floats(n);
	struct kvd_restkv_opts o;

	ASSERT_TRUE(kvd_restkv_odds(1.0f) == KVD_RESTKV_A_MAX / (1.0f - KVD_RESTKV_A_MAX));
	ASSERT_TRUE(isfinite(kvd_restkv_odds(1.0f)) && kvd_restkv_odds(1.0f) > 9e5f);
	ASSERT_TRUE(kvd_restkv_odds(0.5f) == 1.0f);
	ASSERT_TRUE(kvd_restkv_odds(0.0f) == 0.0f);
	ASSERT_TRUE(isnan(kvd_restkv_odds(NAN)));

	/* A sink: every window query puts all its weight on token 3, so a_3 rounds to 1 in
	 * fp32; published fp16 would give +inf. Here the cost is finite and ranks first. */
	kt_layer_init(&f, KVD_DTYPE_F32, 1, 1, w, L, d, 12, 5, 1.0f);
	q = f.q, k = f.k;
	for (uint32_t j = 0; j < d; j++) {
		k[3 * d + j] = j == 0 ? 100.0f : 0.0f;
		for (uint32_t t = 0; t < w; t++)
			q[t * d + j] = j == 0 ? 100.0f : 0.0f;
	}
	for (uint32_t i = 0; i < L; i++)
		if (i != 3)
			k[i * d] = 0;
	ASSERT_OK(kvd_attn_head_ref(&f.in, 0, f.probs));
	ASSERT_TRUE(f.probs[3] == 1.0f);
	kvd_restkv_opts_default(&o);
	KT_FOREACH_PATH(path)
		for (int ref = 0; ref < 2; ref++) {
			ASSERT_OK((ref ? kvd_restkv_head_ref : kvd_restkv_head)(&f.in, 0, f.probs, f.gram,
										 NULL, &o, cost));
			/* The sink rule: +inf, kept first; everything else finite. */
			ASSERT_TRUE(cost[3] == INFINITY);
			for (uint32_t i = 0; i < n; i++)
				if (i != 3)
					ASSERT_TRUE(isfinite(cost[i]) && cost[i] >= 0);
		}
	ASSERT_TRUE(kvd_restkv_cost(1.0f, 0.0f) == INFINITY);
	ASSERT_TRUE(kvd_restkv_cost(0.5f, 2.0f) == 2.0f);
	free(cost);
	kt_layer_done(&f);
}

TEST(nonfinite_inputs) {
	struct kt_layer f;
	uint32_t n;

	kt_layer_init(&f, KVD_DTYPE_F32, 2, 1, 4, 40, 8, 10, 9, 1.0f);
	n = f.in.len - f.in.window;
	((float *)f.v)[5 * 8 + 2] = NAN;
	((float *)f.v)[7 * 8 + 1] = INFINITY;
	KT_FOREACH_PATH(path)
		for (int mode = 0; mode < 2; mode++) {
			struct kvd_restkv_opts o;
			float *ref = kt_floats(n), *opt = kt_floats(n);

			kvd_restkv_opts_default(&o);
			o.metric = mode ? KVD_RESTKV_BEFORE : KVD_RESTKV_AFTER;
			ASSERT_OK(kvd_restkv_head_ref(&f.in, 0, f.probs, f.gram, NULL, &o, ref));
			ASSERT_OK(kvd_restkv_head(&f.in, 0, f.probs, f.gram, NULL, &o, opt));
			for (uint32_t i = 0; i < n; i++)
				ASSERT_EQ(isnan(ref[i]) != 0, isnan(opt[i]) != 0);
			free(ref), free(opt);
		}
	kt_layer_done(&f);
}

TEST(bad_arguments) {
	struct kt_layer f;
	struct kvd_restkv_opts o;
	float cost[64];

	kt_layer_init(&f, KVD_DTYPE_F32, 2, 1, 4, 40, 8, 10, 9, 1.0f);
	kvd_restkv_opts_default(&o);
	ASSERT_ERRNO(kvd_restkv_head(&f.in, 2, f.probs, NULL, NULL, &o, cost), -EINVAL);
	ASSERT_ERRNO(kvd_restkv_head(&f.in, 0, NULL, NULL, NULL, &o, cost), -EINVAL);
	o.alpha = 0;
	ASSERT_ERRNO(kvd_restkv_head(&f.in, 0, f.probs, NULL, NULL, &o, cost), -EINVAL);
	ASSERT_ERRNO(kvd_restkv_head_ref(&f.in, 0, f.probs, NULL, NULL, &o, cost), -EINVAL);
	kvd_restkv_opts_default(&o);
	o.tau = 0;
	ASSERT_ERRNO(kvd_restkv_head(&f.in, 0, f.probs, NULL, NULL, &o, cost), -EINVAL);
	o.tau = 1;
	f.in.v = NULL;
	ASSERT_ERRNO(kvd_restkv_head(&f.in, 0, f.probs, NULL, NULL, &o, cost), -EINVAL);
	ASSERT_STREQ(kvd_restkv_metric_to_string(KVD_RESTKV_BEFORE), "before");
	ASSERT_EQ((int)kvd_restkv_metric_from_string("after"), (int)KVD_RESTKV_AFTER);
	ASSERT_EQ((int)kvd_restkv_metric_from_string("x"), -EINVAL);
	kt_layer_done(&f);
}

TEST(gram_matches_reference) {
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };

	/* C over the gemm's passes of 128 rows too (GEMM_KC), with a rest. */
	KT_FOREACH_PATH(path)
		for (size_t t = 0; t < 6; t++) {
			uint64_t seed = 77 + t;
			uint32_t H = 4, d = 12, C = t < 3 ? 37 : 300;
			void *w = kt_random(&seed, dtypes[t % 3], (size_t)C * (H * d + 3), 0.5f);
			struct kvd_wo wo = {
				.dtype = dtypes[t % 3], .c_out = C, .heads = H, .dim = d, .w = w,
				.row_stride = H * d + 3,
			};
			float *ref = kt_floats((size_t)4 * d * 4 * d), *opt = kt_floats((size_t)4 * d * 4 * d);

			for (uint32_t nh = 1; nh <= 2; nh++)
				for (uint32_t h0 = 0; h0 + nh <= H; h0++) {
					ASSERT_OK(kvd_gram_ref(&wo, h0, nh, ref));
					ASSERT_OK(kvd_gram(&wo, h0, nh, opt));
					ASSERT_TRUE(kt_close(path, ref, opt, (size_t)nh * d * nh * d, 1e-6,
							     1e-5));
				}
			ASSERT_ERRNO(kvd_gram(&wo, 3, 2, opt), -EINVAL);
			wo.row_stride = 5;
			ASSERT_ERRNO(kvd_gram_ref(&wo, 0, 1, opt), -EINVAL);
			free(w), free(ref), free(opt);
		}
}
