/* SPDX-License-Identifier: MIT */
/*
 * LaProx-style costs: the diagonal form against ||A[:, i]|| * ||v W_o^h|| computed
 * directly, the GQA-joint form against the Frobenius norm of the group's contribution
 * built explicitly, the optimised path against the reference, and N1/N2.
 */
#include <math.h>

#include "gram.h"
#include "ktest.h"
#include "laprox.h"

/* LaProx's layers: queries of amplitude 3, for peaky attention. */
static void fix_init(struct kt_layer *f, uint32_t dtype, uint32_t H, uint32_t Hkv, uint32_t w,
		     uint32_t L, uint32_t d, uint32_t C, uint64_t seed) {
	kt_layer_init(f, dtype, H, Hkv, w, L, d, C, seed, 3.0f);
}

/* (v_i W_o^h)[c], directly; use_wo 0: the head's block of the concatenation (v itself). */
static double vproj(const struct kt_layer *f, uint32_t h, uint32_t i, uint32_t c) {
	uint32_t d = f->in.dim, g = kvd_attn_kv_head(&f->in, h);
	double y = 0;

	for (uint32_t a = 0; a < d; a++)
		y += kvd_load(f->v, f->in.dtype, ((size_t)g * f->in.len + i) * d + a) *
		     (double)f->w[(size_t)c * f->wo.row_stride + (size_t)h * d + a];
	return y;
}

static double vval(const struct kt_layer *f, uint32_t h, uint32_t i, uint32_t a) {
	uint32_t g = kvd_attn_kv_head(&f->in, h);

	return kvd_load(f->v, f->in.dtype, ((size_t)g * f->in.len + i) * f->in.dim + a);
}

static double col(const struct kt_layer *f, uint32_t h, uint32_t t, uint32_t i) {
	return f->probs[((size_t)h * f->in.window + t) * f->in.len + i];
}

TEST(diagonal_matches_direct) {
	struct kt_layer f;
	uint32_t n;

	fix_init(&f, KVD_DTYPE_F32, 4, 2, 6, 60, 8, 20, 3);
	n = f.in.len - f.in.window;
	for (uint32_t h = 0; h < 4; h++)
		for (int use_wo = 0; use_wo < 2; use_wo++) {
			float *ref = kt_floats(n), *opt = kt_floats(n);
			const float *P = f.probs + (size_t)h * f.in.window * f.in.len;
			const float *gram = use_wo ? f.gram + (size_t)h * 64 : NULL;

			ASSERT_OK(kvd_laprox_head_ref(&f.in, h, P, gram, NULL, ref));
			ASSERT_OK(kvd_laprox_head(&f.in, h, P, gram, NULL, opt));
			for (uint32_t i = 0; i < n; i++) {
				double c2 = 0, v2 = 0, direct;

				for (uint32_t t = 0; t < f.in.window; t++)
					c2 += col(&f, h, t, i) * col(&f, h, t, i);
				for (uint32_t c = 0; c < (use_wo ? 20u : 8u); c++) {
					double y = use_wo ? vproj(&f, h, i, c) : vval(&f, h, i, c);

					v2 += y * y;
				}
				direct = sqrt(c2) * sqrt(v2);
				ASSERT_TRUE(fabs(ref[i] - direct) <= 1e-9 + 1e-5 * direct);
				ASSERT_TRUE(fabs(opt[i] - direct) <= 1e-9 + 1e-4 * direct);
			}
			free(ref), free(opt);
		}
	kt_layer_done(&f);
}

TEST(joint_matches_frobenius) {
	struct kt_layer f;
	uint32_t n, H = 6, Hkv = 2, g = 3, w = 5, d = 8, C = 20;

	fix_init(&f, KVD_DTYPE_F32, H, Hkv, w, 50, d, C, 4);
	n = f.in.len - f.in.window;
	for (uint32_t kv = 0; kv < Hkv; kv++)
		for (int use_wo = 0; use_wo < 2; use_wo++) {
			const float *P[3];
			float *ref = kt_floats(n), *opt = kt_floats(n), *diag = kt_floats(n);
			const float *gg = use_wo ? f.ggram + (size_t)kv * g * d * g * d : NULL;

			for (uint32_t a = 0; a < g; a++)
				P[a] = f.probs + (size_t)(kv * g + a) * w * f.in.len;
			ASSERT_OK(kvd_laprox_group_ref(&f.in, kv, P, gg, ref));
			ASSERT_OK(kvd_laprox_group(&f.in, kv, P, gg, opt));
			for (uint32_t i = 0; i < n; i++) {
				/* M = sum_h A_h[:, i] (x) z_h: [w][C] with W_o, [w][g*d] without. */
				double fro = 0, tri = 0;

				for (uint32_t t = 0; t < w; t++)
					for (uint32_t c = 0; c < (use_wo ? C : g * d); c++) {
						double m = 0;

						for (uint32_t a = 0; a < g; a++) {
							uint32_t h = kv * g + a;

							if (use_wo)
								m += col(&f, h, t, i) * vproj(&f, h, i, c);
							else if (c / d == a)
								m += col(&f, h, t, i) * vval(&f, h, i, c % d);
						}
						fro += m * m;
					}
				fro = sqrt(fro);
				ASSERT_TRUE(fabs(ref[i] - fro) <= 1e-9 + 1e-5 * fro);
				ASSERT_TRUE(fabs(opt[i] - fro) <= 1e-9 + 1e-4 * fro);
				/* The sum of the diagonal costs bounds it (triangle inequality). */
				for (uint32_t a = 0; a < g; a++) {
					ASSERT_OK(kvd_laprox_head_ref(&f.in, kv * g + a, P[a],
								      use_wo ? f.gram + (size_t)(kv * g + a) * d * d :
									       NULL,
								      NULL, diag));
					tri += diag[i];
				}
				ASSERT_TRUE(fro <= tri * (1 + 1e-5) + 1e-12);
			}
			free(ref), free(opt), free(diag);
		}
	kt_layer_done(&f);
}

TEST(optimised_matches_reference) {
	static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };
	static const struct {
		uint32_t H, Hkv, w, L, d, C;
	} shapes[] = {
		{ 1, 1, 1, 2, 1, 3 }, { 4, 1, 5, 133, 17, 20 }, { 8, 2, 16, 200, 32, 48 },
		{ 2, 2, 7, 7, 8, 8 },
	};

	KT_FOREACH_PATH(path)
		for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
			for (size_t t = 0; t < 3; t++) {
				struct kt_layer f;
				uint32_t n = shapes[s].L - shapes[s].w, d = shapes[s].d;
				uint32_t g = shapes[s].H / shapes[s].Hkv, wl = shapes[s].w * shapes[s].L;
				float *ref = kt_floats(n), *opt = kt_floats(n);
				const float *P[8];
				char what[128];

				fix_init(&f, dtypes[t], shapes[s].H, shapes[s].Hkv, shapes[s].w,
					 shapes[s].L, d, shapes[s].C, 50 + s * 3 + t);
				snprintf(what, sizeof(what), "%s dtype %u shape %zu", path, dtypes[t], s);
				for (uint32_t h = 0; h < shapes[s].H; h++)
					for (int use_wo = 0; use_wo < 2; use_wo++) {
						const float *gram = use_wo ? f.gram + (size_t)h * d * d : NULL;

						ASSERT_OK(kvd_laprox_head_ref(&f.in, h, f.probs + (size_t)h * wl,
									      gram, NULL, ref));
						ASSERT_OK(kvd_laprox_head(&f.in, h, f.probs + (size_t)h * wl,
									  gram, NULL, opt));
						ASSERT_TRUE(kt_close(what, ref, opt, n, 1e-7, 1e-4));
					}
				for (uint32_t kv = 0; kv < shapes[s].Hkv; kv++)
					for (int use_wo = 0; use_wo < 2; use_wo++) {
						const float *gg = use_wo ? f.ggram + (size_t)kv * g * d * g * d :
									   NULL;

						for (uint32_t a = 0; a < g; a++)
							P[a] = f.probs + (size_t)(kv * g + a) * wl;
						ASSERT_OK(kvd_laprox_group_ref(&f.in, kv, P, gg, ref));
						ASSERT_OK(kvd_laprox_group(&f.in, kv, P, gg, opt));
						ASSERT_TRUE(kt_close(what, ref, opt, n, 1e-7, 1e-4));
					}
				free(ref), free(opt);
				kt_layer_done(&f);
			}
}

TEST(normalize) {
	float c[6] = { 1, 2, 3, 4, NAN, INFINITY }, z[3] = { 0, 0, 0 };

	ASSERT_OK(kvd_laprox_normalize(c, 6, 2.0f));
	ASSERT_TRUE(fabsf(c[0] - 0.2f) < 1e-6f && fabsf(c[3] - 0.8f) < 1e-6f);
	ASSERT_TRUE(isnan(c[4]) && c[5] == INFINITY);
	ASSERT_OK(kvd_laprox_normalize(z, 3, 1.0f));
	ASSERT_TRUE(z[0] == 0 && z[2] == 0);
	ASSERT_ERRNO(kvd_laprox_normalize(z, 3, -1.0f), -EINVAL);
	ASSERT_ERRNO(kvd_laprox_normalize(NULL, 3, 1.0f), -EINVAL);
	ASSERT_OK(kvd_laprox_normalize(NULL, 0, 1.0f));
}
