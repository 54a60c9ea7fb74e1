/* SPDX-License-Identifier: MIT */
/*
 * MomentKV's kernels (moments.h): the optimised batch summary, entries, corrected attention
 * and misfit against the references on every SIMD path; the merge against the summary of
 * the union; the correction against full attention where it is exact (one evicted token;
 * the direction for jointly Gaussian keys and values), the mass-corrected form against
 * the plain one, and the bounded form's caps against the exact mass of keys that are not
 * Gaussian.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>

#include "ktest.h"
#include "moments.h"
#include "policy.h"
#include "select.h"

#define N_OF(x) (sizeof(x) / sizeof((x)[0]))

static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };

struct owned {
	struct kvd_moments m;
	float *f;
};

static void owned_new(struct owned *o, uint32_t d) {
	o->f = kt_floats(kvd_moments_floats(d));
	kvd_moments_view(&o->m, d, o->f);
}

static int moments_close(const char *what, const struct kvd_moments *a, const struct kvd_moments *b,
			 double atol, double rtol) {
	if (a->count != b->count) {
		fprintf(stderr, "%s: count %llu vs %llu\n", what, (unsigned long long)a->count,
			(unsigned long long)b->count);
		return 0;
	}
	return kt_close(what, a->mean_k, b->mean_k, a->dim, atol, rtol) &&
	       kt_close(what, a->mean_v, b->mean_v, a->dim, atol, rtol) &&
	       kt_close(what, a->var_k, b->var_k, a->dim, atol, rtol) &&
	       kt_close(what, a->cov_vk, b->cov_vk, (size_t)a->dim * a->dim, atol, rtol);
}

/* Standard normal (Box-Muller). */
static double gauss(uint64_t *s) {
	double u1 = (kt_next(s) >> 11) * (1.0 / 9007199254740992.0) + 1e-300;
	double u2 = (kt_next(s) >> 11) * (1.0 / 9007199254740992.0);

	return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

TEST(batch_matches_reference) {
	static const uint32_t ns[] = { 0, 1, 2, 255, 256, 257, 700 };
	static const uint32_t ds[] = { 1, 7, 64, 96 };
	uint64_t seed = 11;

	KT_FOREACH_PATH(path)
		for (size_t di = 0; di < N_OF(ds); di++)
			for (size_t ni = 0; ni < N_OF(ns); ni++)
				for (size_t t = 0; t < N_OF(dtypes); t++) {
					uint32_t d = ds[di], n = ns[ni], stride = d + 3;
					void *k = kt_random(&seed, dtypes[t], (size_t)(n + 1) * stride, 2.0f);
					void *v = kt_random(&seed, dtypes[t], (size_t)(n + 1) * stride, 1.0f);
					struct owned ref, got;
					char what[128];

					/* A common offset: the centred second pass must not lose it. */
					for (size_t i = 0; dtypes[t] == KVD_DTYPE_F32 && i < (size_t)n * stride; i++)
						((float *)k)[i] += 3.0f;
					owned_new(&ref, d), owned_new(&got, d);
					ASSERT_OK(kvd_moments_batch_ref(k, stride, v, stride, dtypes[t], n, &ref.m));
					ASSERT_OK(kvd_moments_batch(k, stride, v, stride, dtypes[t], n, &got.m));
					snprintf(what, sizeof(what), "%s d %u n %u dtype %u", path, d, n, dtypes[t]);
					ASSERT_TRUE(moments_close(what, &ref.m, &got.m, 2e-6, 2e-4));
					ASSERT_TRUE(kt_close(what, &ref.m.key_norm_max, &got.m.key_norm_max, 1,
							     1e-5, 1e-5));
					ASSERT_TRUE(kt_close(what, &ref.m.key_radius, &got.m.key_radius, 1,
							     1e-4, 1e-4));
					ASSERT_TRUE(n > 0 || ref.m.key_norm_max + ref.m.key_radius == 0);
					free(k), free(v), free(ref.f), free(got.f);
				}
}

TEST(merge_is_the_union) {
	uint32_t d = 24, n = 1000;
	uint64_t seed = 5;
	float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)n * d, 1.0f);
	float *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)n * d, 1.0f);
	/* Batches of uneven sizes, an empty one included, folded one after the other. */
	static const uint32_t cuts[] = { 0, 1, 1, 40, 333, 334, 900, 1000 };
	struct owned all, acc, part;

	for (size_t i = 0; i < (size_t)n * d; i++)
		k[i] += (i / d) < 500 ? 2.0f : -1.0f; /* two clusters: the means' term matters */
	owned_new(&all, d), owned_new(&acc, d), owned_new(&part, d);
	ASSERT_OK(kvd_moments_batch_ref(k, d, v, d, KVD_DTYPE_F32, n, &all.m));
	for (size_t c = 0; c + 1 < N_OF(cuts); c++) {
		ASSERT_OK(kvd_moments_batch(k + (size_t)cuts[c] * d, d, v + (size_t)cuts[c] * d, d,
					    KVD_DTYPE_F32, cuts[c + 1] - cuts[c], &part.m));
		ASSERT_OK(kvd_moments_merge(&acc.m, &part.m));
	}
	ASSERT_TRUE(moments_close("merged", &all.m, &acc.m, 1e-5, 1e-4));
	/* The largest key norm is the union's; the radius bounds the union's. */
	ASSERT_TRUE(kt_close("norm", &all.m.key_norm_max, &acc.m.key_norm_max, 1, 1e-6, 1e-6));
	fprintf(stderr, "radius: union %.4f, merged bound %.4f\n", all.m.key_radius,
		acc.m.key_radius);
	ASSERT_TRUE(acc.m.key_radius >= all.m.key_radius * (1 - 1e-6));
	/* Merging the empty summary changes nothing; dims must agree; counts must not wrap. */
	kvd_moments_clear(&part.m);
	ASSERT_OK(kvd_moments_merge(&acc.m, &part.m));
	ASSERT_TRUE(moments_close("empty", &all.m, &acc.m, 1e-5, 1e-4));
	part.m.count = UINT64_MAX;
	ASSERT_ERRNO(kvd_moments_merge(&acc.m, &part.m), -EOVERFLOW);
	ASSERT_EQ(acc.m.count, (uint64_t)n);
	part.m.dim = d - 1;
	ASSERT_ERRNO(kvd_moments_merge(&acc.m, &part.m), -EINVAL);
	free(k), free(v), free(all.f), free(acc.f), free(part.f);
}

TEST(entries_and_attention_match_reference) {
	static const uint32_t shapes[][3] = { /* d, len, rows */
		{ 1, 1, 1 }, { 8, 63, 3 }, { 16, 65, 5 }, { 64, 300, 8 }, { 96, 129, 17 },
	};
	uint64_t seed = 21;

	KT_FOREACH_PATH(path)
		for (size_t si = 0; si < N_OF(shapes); si++)
			for (int form = 0; form < _KVD_MOMENTS_FORM_MAX; form++)
				for (int with_m = 0; with_m < 2; with_m++) {
					uint32_t d = shapes[si][0], L = shapes[si][1], R = shapes[si][2];
					size_t ldq = d + 1, ks = d + 2;
					float *q = kt_random(&seed, KVD_DTYPE_F32, R * ldq, 2.0f);
					float *k = kt_random(&seed, KVD_DTYPE_F32, L * ks, 1.0f);
					float *v = kt_random(&seed, KVD_DTYPE_F32, L * ks, 1.0f);
					float *ev = kt_random(&seed, KVD_DTYPE_F32, 50 * d, 1.0f);
					float *ref = kt_floats((size_t)R * d), *got = kt_floats((size_t)R * d);
					float *lr = kt_floats(R), *lg = kt_floats(R);
					uint32_t *vis = calloc(R, sizeof(uint32_t));
					struct owned m;
					struct kvd_attn_moments_in in = {
						.dim = d, .len = L, .rows = R, .scale = 1.0f / sqrtf((float)d),
						.q = q, .ldq = ldq, .k = k, .v = v, .k_stride = ks, .v_stride = ks,
						.visible = vis, .form = form,
					};
					char what[128];

					owned_new(&m, d);
					ASSERT_OK(kvd_moments_batch_ref(ev, d, ev + 25 * d, d, KVD_DTYPE_F32, 25, &m.m));
					in.m = with_m ? &m.m : NULL;
					/* Causal rows: each sees a different prefix, the first row maybe none. */
					for (uint32_t r = 0; r < R; r++)
						vis[r] = L - (R - 1 - r) * L / R;
					snprintf(what, sizeof(what), "%s d %u L %u R %u form %d m %d", path, d, L, R,
						 form, with_m);
					ASSERT_OK(kvd_attn_moments_ref(&in, ref));
					ASSERT_OK(kvd_attn_moments(&in, got));
					ASSERT_TRUE(kt_close(what, ref, got, (size_t)R * d, 1e-6, 1e-4));
					ASSERT_OK(kvd_moments_entries_ref(&m.m, form, in.scale, q, ldq, R, lr, ref));
					ASSERT_OK(kvd_moments_entries(&m.m, form, in.scale, q, ldq, R, lg, got));
					ASSERT_TRUE(kt_close(what, lr, lg, R, 1e-5, 1e-5));
					ASSERT_TRUE(kt_close(what, ref, got, (size_t)R * d, 1e-6, 1e-4));
					free(q), free(k), free(v), free(ev), free(ref), free(got), free(lr),
						free(lg), free(vis), free(m.f);
				}
}

/* Full attention of one query over the n rows of k/v (fp32, d each), in double. */
static void full_attention(const float *q, const float *k, const float *v, uint32_t n, uint32_t d,
			   float scale, float *out) {
	struct kvd_attn_moments_in in = {
		.dim = d, .len = n, .rows = 1, .scale = scale, .q = q, .ldq = d, .k = k, .v = v,
		.k_stride = d, .v_stride = d,
	};

	ASSERT_OK(kvd_attn_moments_ref(&in, out));
}

TEST(one_evicted_token_is_exact) {
	uint32_t d = 32, L = 50, R = 4;
	uint64_t seed = 3;
	float *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)R * d, 3.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)L * d, 1.0f);
	float *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)L * d, 1.0f);
	float *want = kt_floats(d), *got = kt_floats((size_t)R * d);
	struct owned m;

	owned_new(&m, d);
	/* Token 0 evicted: its summary is itself (n 1, no spread), the kept set 1..L-1. */
	ASSERT_OK(kvd_moments_batch(k, d, v, d, KVD_DTYPE_F32, 1, &m.m));
	KT_FOREACH_PATH(path)
		for (int form = 0; form < _KVD_MOMENTS_FORM_MAX; form++)
			for (int opt = 0; opt < 2; opt++) {
				struct kvd_attn_moments_in in = {
					.dim = d, .len = L - 1, .rows = R, .scale = 0.3f, .q = q, .ldq = d,
					.k = k + d, .v = v + d, .k_stride = d, .v_stride = d, .m = &m.m,
					.form = form,
				};

				ASSERT_OK(opt ? kvd_attn_moments(&in, got) : kvd_attn_moments_ref(&in, got));
				for (uint32_t r = 0; r < R; r++) {
					full_attention(q + (size_t)r * d, k, v, L, d, 0.3f, want);
					ASSERT_TRUE(kt_close(path, want, got + (size_t)r * d, d, 1e-6, 1e-4));
				}
			}
	free(q), free(k), free(v), free(want), free(got), free(m.f);
}

/*
 * Jointly Gaussian keys and values (docs/algorithms.md §4.2's check, d = 6): the first-order
 * direction N_E / Z_E = mu_v + s C_vk q matches the exact one to a few percent where the
 * mean alone is far off; the first-order mass never exceeds Z_E (Jensen) and the Gaussian
 * mass with diag(var_k) is close. Then whole outputs: the corrected attention is closer to
 * full attention than dropping the evicted set, and the mass form closer than the plain one.
 */
TEST(gaussian_direction_and_mass) {
	enum { D = 6, N = 200000, KEPT = 20 };
	uint64_t seed = 99;
	float *k = kt_floats((size_t)N * D), *v = kt_floats((size_t)N * D);
	float q[D], val[D], logit[2], want[D], got[3][D];
	float *kk = kt_floats((size_t)(N + KEPT) * D), *vv = kt_floats((size_t)(N + KEPT) * D);
	double B[D][D], z_e = 0, n_e[D] = { 0 }, err_first = 0, err_mean = 0, norm = 0;
	float s = 1.0f / sqrtf(D);
	struct owned m;

	/* Keys N(0.5, 1) per dimension; values a linear map of the keys plus noise. */
	for (int a = 0; a < D; a++)
		for (int b = 0; b < D; b++)
			B[a][b] = 0.8 * gauss(&seed) / sqrt(D);
	for (int i = 0; i < N; i++)
		for (int a = 0; a < D; a++)
			k[(size_t)i * D + a] = (float)(0.5 + gauss(&seed));
	for (int i = 0; i < N; i++)
		for (int a = 0; a < D; a++) {
			double x = 0.3 * gauss(&seed);

			for (int b = 0; b < D; b++)
				x += B[a][b] * k[(size_t)i * D + b];
			v[(size_t)i * D + a] = (float)x;
		}
	for (int a = 0; a < D; a++)
		q[a] = (float)gauss(&seed);
	owned_new(&m, D);
	ASSERT_OK(kvd_moments_batch(k, D, v, D, KVD_DTYPE_F32, N, &m.m));

	for (int i = 0; i < N; i++) {
		double x = 0, w;

		for (int a = 0; a < D; a++)
			x += (double)q[a] * k[(size_t)i * D + a];
		w = exp(s * x);
		z_e += w;
		for (int a = 0; a < D; a++)
			n_e[a] += w * v[(size_t)i * D + a];
	}
	ASSERT_OK(kvd_moments_entries(&m.m, KVD_MOMENTS_PLAIN, s, q, D, 1, &logit[0], val));
	for (int a = 0; a < D; a++) {
		double exact = n_e[a] / z_e;

		err_first += (val[a] - exact) * (val[a] - exact);
		err_mean += (m.m.mean_v[a] - exact) * (m.m.mean_v[a] - exact);
		norm += exact * exact;
	}
	err_first = sqrt(err_first / norm), err_mean = sqrt(err_mean / norm);
	fprintf(stderr, "direction error: first order %.4f, mean only %.4f\n", err_first, err_mean);
	ASSERT_TRUE(err_first < 0.05);
	ASSERT_TRUE(err_mean > 4 * err_first);
	ASSERT_OK(kvd_moments_entries(&m.m, KVD_MOMENTS_MASS, s, q, D, 1, &logit[1], val));
	fprintf(stderr, "mass vs exact: first order %.3f, gaussian %.3f\n", exp(logit[0]) / z_e,
		exp(logit[1]) / z_e);
	ASSERT_TRUE(exp(logit[0]) <= z_e * (1 + 1e-5));
	ASSERT_TRUE(fabs(exp(logit[1]) / z_e - 1) < 0.1);
	ASSERT_TRUE(fabs(exp(logit[1]) / z_e - 1) < fabs(exp(logit[0]) / z_e - 1));

	/* A kept set of KEPT tokens with the evicted ones behind it, its keys shifted along q
	 * so that both sets weigh about the same: then the mass decides the mix. */
	memcpy(kk, k, (size_t)N * D * sizeof(float));
	memcpy(vv, v, (size_t)N * D * sizeof(float));
	{
		double qq = 0, shift;

		for (int a = 0; a < D; a++)
			qq += (double)q[a] * q[a];
		shift = (log(z_e / KEPT) / s) / qq;
		for (int i = N; i < N + KEPT; i++)
			for (int a = 0; a < D; a++) {
				kk[(size_t)i * D + a] = (float)(0.3 * gauss(&seed) + shift * q[a]);
				vv[(size_t)i * D + a] = (float)gauss(&seed);
			}
	}
	full_attention(q, kk, vv, N + KEPT, D, s, want);
	for (int variant = 0; variant < 3; variant++) {
		struct kvd_attn_moments_in in = {
			.dim = D, .len = KEPT, .rows = 1, .scale = s, .q = q, .ldq = D,
			.k = kk + (size_t)N * D, .v = vv + (size_t)N * D, .k_stride = D, .v_stride = D,
			.m = variant ? &m.m : NULL,
			.form = variant == 2 ? KVD_MOMENTS_MASS : KVD_MOMENTS_PLAIN,
		};

		ASSERT_OK(kvd_attn_moments(&in, got[variant]));
	}
	{
		double e[3] = { 0 };

		for (int variant = 0; variant < 3; variant++)
			for (int a = 0; a < D; a++)
				e[variant] += (got[variant][a] - want[a]) * (got[variant][a] - want[a]);
		fprintf(stderr, "output error: dropped %.4g, plain %.4g, mass %.4g\n", sqrt(e[0]),
			sqrt(e[1]), sqrt(e[2]));
		ASSERT_TRUE(e[1] < e[0] / 4);
		ASSERT_TRUE(e[2] < e[1]);
	}
	free(k), free(v), free(kk), free(vv), free(m.f);
}

/*
 * Keys at +-c on the first axis (and noise on the others), q mostly along it: the exact
 * log-mass is ln n + about s c q_0 - ln 2, the Gaussian estimate passes it by about
 * (s c q_0)^2 / 2, and the bounded one stays within 1 of it, never below the plain logit and
 * never above either cap. Then the same after a merge of two parts, whose radius is a bound
 * only.
 */
TEST(bounded_mass_caps_the_gaussian) {
	enum { N = 400, D = 16 };
	static float k[N * D], v[N * D], q[D];
	uint64_t seed = 17;
	float s = 0.25f, logit[3], val[D];
	double qn = 0, c, exact = 0, plain, gauss_t = 0;
	struct owned m, half[2];

	for (int a = 0; a < D; a++)
		q[a] = a ? (float)(0.1 * gauss(&seed)) : 3.0f, qn += (double)q[a] * q[a];
	qn = sqrt(qn);
	c = 10.0 / (s * q[0]); /* s c q_0 = 10 */
	for (int i = 0; i < N; i++) {
		double z = 0;

		for (int a = 0; a < D; a++) {
			k[i * D + a] = (float)(a ? 0.01 * gauss(&seed) : i % 2 ? c : -c);
			v[i * D + a] = (float)gauss(&seed);
			z += (double)q[a] * k[i * D + a];
		}
		exact += exp(s * z);
	}
	exact = log(exact);
	owned_new(&m, D), owned_new(&half[0], D), owned_new(&half[1], D);
	for (int merged = 0; merged < 2; merged++) {
		struct owned *mm = merged ? &half[0] : &m;

		if (!merged)
			ASSERT_OK(kvd_moments_batch(k, D, v, D, KVD_DTYPE_F32, N, &m.m));
		else {
			/* Halves with different means: the first 100 and the other 300 keys. */
			ASSERT_OK(kvd_moments_batch(k, D, v, D, KVD_DTYPE_F32, 100, &half[0].m));
			ASSERT_OK(kvd_moments_batch(k + 100 * D, D, v + 100 * D, D, KVD_DTYPE_F32, 300,
						    &half[1].m));
			ASSERT_OK(kvd_moments_merge(&half[0].m, &half[1].m));
		}
		for (int form = 0; form < 3; form++)
			ASSERT_OK(kvd_moments_entries(&mm->m, form, s, q, D, 1, &logit[form], val));
		plain = logit[KVD_MOMENTS_PLAIN];
		gauss_t = logit[KVD_MOMENTS_MASS] - plain;
		fprintf(stderr, "%s: exact %.3f, plain %.3f, gaussian %.3f, bounded %.3f\n",
			merged ? "merged" : "batch", exact, plain, logit[KVD_MOMENTS_MASS],
			logit[KVD_MOMENTS_BOUNDED]);
		/* Both caps hold for the exact mass. */
		ASSERT_TRUE(exact <= log((double)N) + s * qn * mm->m.key_norm_max + 1e-3);
		ASSERT_TRUE(exact <= plain + s * qn * mm->m.key_radius + 1e-3);
		ASSERT_TRUE(gauss_t > 40);
		ASSERT_TRUE(logit[KVD_MOMENTS_BOUNDED] >= plain);
		ASSERT_TRUE(logit[KVD_MOMENTS_BOUNDED] <= logit[KVD_MOMENTS_MASS]);
		ASSERT_TRUE(logit[KVD_MOMENTS_BOUNDED] >= exact - 1e-3);
		ASSERT_TRUE(logit[KVD_MOMENTS_BOUNDED] - exact < (merged ? 3.0 : 1.0));
	}
	/* Bounds of 0 (a daemon that does not keep them) give the plain logit. */
	m.m.key_norm_max = m.m.key_radius = 0;
	ASSERT_OK(kvd_moments_entries(&m.m, KVD_MOMENTS_BOUNDED, s, q, D, 1, &logit[2], val));
	ASSERT_OK(kvd_moments_entries(&m.m, KVD_MOMENTS_PLAIN, s, q, D, 1, &logit[0], val));
	ASSERT_TRUE(logit[2] == logit[0]);
	free(m.f), free(half[0].f), free(half[1].f);
}

TEST(misfit_matches_reference) {
	static const uint32_t shapes[][5] = { /* H, Hkv, w, L, d */
		{ 1, 1, 1, 2, 1 }, { 4, 2, 5, 70, 16 }, { 8, 2, 32, 300, 64 }, { 3, 1, 7, 129, 96 },
	};
	uint64_t seed = 8;

	KT_FOREACH_PATH(path)
		for (size_t si = 0; si < N_OF(shapes); si++)
			for (size_t t = 0; t < N_OF(dtypes); t++) {
				const uint32_t *sh = shapes[si];
				void *q = kt_random(&seed, dtypes[t], (size_t)sh[0] * sh[2] * sh[4], 2.0f);
				void *k = kt_random(&seed, dtypes[t], (size_t)sh[1] * sh[3] * sh[4], 1.0f);
				float *mean = kt_random(&seed, KVD_DTYPE_F32, sh[4], 0.5f);
				uint32_t n = sh[3] - sh[2];
				float *ref = kt_floats(n), *got = kt_floats(n);
				struct kvd_attn_in in = {
					.dtype = dtypes[t], .heads = sh[0], .kv_heads = sh[1], .window = sh[2],
					.len = sh[3], .dim = sh[4], .scale = 1.0f / sqrtf((float)sh[4]),
					.q = q, .k = k,
				};
				char what[96];

				kvd_attn_in_contiguous(&in);
				snprintf(what, sizeof(what), "%s shape %zu dtype %u", path, si, dtypes[t]);
				for (uint32_t kv = 0; kv < sh[1]; kv++) {
					ASSERT_OK(kvd_moments_misfit_ref(&in, kv, mean, ref));
					ASSERT_OK(kvd_moments_misfit(&in, kv, mean, got));
					ASSERT_TRUE(kt_close(what, ref, got, n, 1e-5, 1e-4));
				}
				free(q), free(k), free(mean), free(ref), free(got);
			}
}

TEST(misfit_is_zero_on_the_mean) {
	uint32_t d = 8, L = 20, w = 4;
	uint64_t seed = 1;
	float *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)2 * w * d, 1.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)L * d, 1.0f);
	float out[16], out_ref[16];
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = 2, .kv_heads = 1, .window = w, .len = L, .dim = d,
		.scale = 0.5f, .q = q, .k = k,
	};

	kvd_attn_in_contiguous(&in);
	/* Key 3 is the mean: it fits perfectly; key 5 is far: it does not. */
	for (uint32_t a = 0; a < d; a++)
		k[5 * d + a] = 10.0f;
	ASSERT_OK(kvd_moments_misfit(&in, 0, k + 3 * d, out));
	ASSERT_OK(kvd_moments_misfit_ref(&in, 0, k + 3 * d, out_ref));
	ASSERT_TRUE(out[3] < 1e-10f && out_ref[3] < 1e-12f);
	for (uint32_t i = 0; i < L - w; i++)
		ASSERT_TRUE(i == 5 || out[5] > out[i]);
	ASSERT_ERRNO(kvd_moments_misfit(&in, 1, k, out), -EINVAL);
	free(q), free(k);
}

/*
 * kvd-mi through the policy table: with a summary on kv head 0 only, its shares are the
 * ReST-KV costs' (kvd's before the key novelty, §7.5) times 1 + eta * misfit on head 0, and
 * on head 1 (empty summary) times 1 + eta * misfit against the provisional summary (the key
 * mean of the half of the prefix those costs would drop), renormalised over the layer;
 * without summaries it is restkv's shares up to rounding; both paths agree.
 */
TEST(kvd_mi_weighs_kvd_by_misfit) {
	enum { H = 4, HKV = 2, W = 8, L = 120, D = 16, N = L - W };
	uint64_t seed = 17;
	void *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)H * W * D, 2.0f);
	void *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)HKV * L * D, 1.0f);
	void *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)HKV * L * D, 1.0f);
	float *mean = kt_random(&seed, KVD_DTYPE_F32, (size_t)HKV * D, 0.5f);
	float *base = kt_floats((size_t)HKV * N), *mi = kt_floats((size_t)HKV * N);
	float *mi_ref = kt_floats((size_t)HKV * N), *misfit = kt_floats(N), *misfit1 = kt_floats(N);
	float provisional[D];
	double acc[D] = { 0 };
	uint32_t kept[N / 2];
	bool is_kept[N] = { false };
	uint64_t count[HKV] = { 10, 0 };
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = H, .kv_heads = HKV, .window = W, .len = L, .dim = D,
		.scale = 0.25f, .q = q, .k = k, .v = v,
	};
	struct kvd_policy_params p;
	double ratio0 = 0, ratio1 = 0;

	kvd_attn_in_contiguous(&in);
	kvd_policy_params_default(KVD_POLICY_RESTKV, &p);
	p.capacity = W + N / 2;
	ASSERT_OK(kvd_policy_scores(&p, &in, NULL, NULL, mi));
	kvd_policy_params_default(KVD_POLICY_KVD_MI, &p);
	p.capacity = W + N / 2;
	ASSERT_OK(kvd_policy_scores(&p, &in, NULL, NULL, base));
	ASSERT_TRUE(kt_close("kvd-mi without summaries, restkv", mi, base, (size_t)HKV * N, 1e-9, 1e-5));

	p.mi_mean_k = mean, p.mi_count = count;
	ASSERT_OK(kvd_policy_scores(&p, &in, NULL, NULL, mi));
	p.reference = 1;
	ASSERT_OK(kvd_policy_scores(&p, &in, NULL, NULL, mi_ref));
	ASSERT_TRUE(kt_close("kvd-mi paths", mi_ref, mi, (size_t)HKV * N, 1e-7, 1e-3));
	ASSERT_OK(kvd_moments_misfit_ref(&in, 0, mean, misfit));
	/* Head 1's provisional summary, from its kvd shares (the renormalisation does not
	 * change their order): the mean key of the N / 2 it would drop. */
	ASSERT_OK(kvd_topk_ref(base + N, N, N / 2, kept));
	for (uint32_t j = 0; j < N / 2; j++)
		is_kept[kept[j]] = true;
	for (uint32_t i = 0; i < N; i++)
		for (uint32_t c = 0; !is_kept[i] && c < D; c++)
			acc[c] += ((const float *)k)[((size_t)L + i) * D + c];
	for (uint32_t c = 0; c < D; c++)
		provisional[c] = (float)(acc[c] / (N - N / 2));
	ASSERT_OK(kvd_moments_misfit_ref(&in, 1, provisional, misfit1));
	/* One common factor (the renormalisation) links every token's two shares. */
	for (uint32_t i = 0; i < N; i++) {
		double r0 = mi[i] / (base[i] * (1 + KVD_MI_ETA * misfit[i]));
		double r1 = mi[N + i] / (base[N + i] * (1 + KVD_MI_ETA * misfit1[i]));

		if (i == 0)
			ratio0 = r0, ratio1 = r1;
		ASSERT_TRUE(fabs(r0 / ratio0 - 1) < 1e-3 && fabs(r1 / ratio1 - 1) < 1e-3);
	}
	ASSERT_TRUE(fabs(ratio0 / ratio1 - 1) < 1e-3);
	p.mi_eta = -1;
	ASSERT_ERRNO(kvd_policy_scores(&p, &in, NULL, NULL, mi), -EINVAL);
	free(q), free(k), free(v), free(mean), free(base), free(mi), free(mi_ref), free(misfit), free(misfit1);
}
