/* SPDX-License-Identifier: MIT */
/*
 * IndexMem's kernels (indexmem.h): the optimised projection, scores, latent fold and
 * readout against the references on every SIMD path; the scores and the readout against
 * hand-computed values; the fold of batches against the fold of their union; attention
 * with the latent entries (moments.h's kernel) against its reference, and without any
 * entry equal to plain attention; policy indexmem's shares.
 */
#include <errno.h>
#include <math.h>

#include "indexmem.h"
#include "ktest.h"
#include "moments.h"
#include "policy.h"

#define N_OF(x) (sizeof(x) / sizeof((x)[0]))

static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };

TEST(project_matches_reference) {
	static const uint32_t shapes[][4] = { /* dim, heads, index_dim, n */
		{ 1, 1, 1, 1 }, { 16, 2, 8, 5 }, { 128, 4, 16, 33 }, { 130, 3, 20, 300 },
	};
	uint64_t seed = 7;

	KT_FOREACH_PATH(path)
		for (size_t si = 0; si < N_OF(shapes); si++) {
			uint32_t D = shapes[si][0], H = shapes[si][1], I = shapes[si][2], n = shapes[si][3];
			float *wq = kt_random(&seed, KVD_DTYPE_F32, (size_t)H * I * D, 1.0f);
			float *wk = kt_random(&seed, KVD_DTYPE_F32, (size_t)I * D, 1.0f);
			float *ww = kt_random(&seed, KVD_DTYPE_F32, (size_t)H * D, 0.3f);
			float *bw = kt_random(&seed, KVD_DTYPE_F32, H, 2.0f);
			float *a = kt_random(&seed, KVD_DTYPE_F32, (size_t)n * (D + 1), 1.0f);
			float *q0 = kt_floats((size_t)n * H * I), *q1 = kt_floats((size_t)n * H * I);
			float *k0 = kt_floats((size_t)n * I), *k1 = kt_floats((size_t)n * I);
			struct kvd_indexer_layer w = { D, H, I, wq, wk, ww, bw };
			char what[96];

			snprintf(what, sizeof(what), "%s D %u H %u I %u n %u", path, D, H, I, n);
			ASSERT_OK(kvd_indexer_project_ref(&w, a, D + 1, n, q0, k0));
			ASSERT_OK(kvd_indexer_project(&w, a, D + 1, n, q1, k1));
			ASSERT_TRUE(kt_close(what, q0, q1, (size_t)n * H * I, 1e-5, 1e-4));
			ASSERT_TRUE(kt_close(what, k0, k1, (size_t)n * I, 1e-5, 1e-4));
			/* Index keys are unit vectors; a query's norm is its head weight. */
			for (uint32_t t = 0; t < n && I > 1; t++) {
				double s = 0;

				for (uint32_t i = 0; i < I; i++)
					s += (double)k0[(size_t)t * I + i] * k0[(size_t)t * I + i];
				ASSERT_TRUE(fabs(s - 1) < 1e-5);
			}
			w.heads = 0;
			ASSERT_ERRNO(kvd_indexer_project(&w, a, D, n, q1, k1), -EINVAL);
			free(wq), free(wk), free(ww), free(bw), free(a), free(q0), free(q1), free(k0), free(k1);
		}
}

TEST(scores_match_reference) {
	static const uint32_t ns[] = { 0, 1, 255, 256, 257, 700 };
	uint64_t seed = 9;

	KT_FOREACH_PATH(path)
		for (size_t ni = 0; ni < N_OF(ns); ni++)
			for (size_t t = 0; t < N_OF(dtypes); t++) {
				uint32_t W = 32, H = 4, I = 16, n = ns[ni], stride = I + 5;
				void *iq = kt_random(&seed, dtypes[t], (size_t)W * H * I, 1.0f);
				void *ik = kt_random(&seed, dtypes[t], (size_t)(n + 1) * stride, 1.0f);
				float *ref = kt_floats(n), *got = kt_floats(n);
				char what[96];

				snprintf(what, sizeof(what), "%s n %u dtype %u", path, n, dtypes[t]);
				ASSERT_OK(kvd_indexer_scores_ref(iq, W, H, ik, stride, dtypes[t], n, I, ref));
				ASSERT_OK(kvd_indexer_scores(iq, W, H, ik, stride, dtypes[t], n, I, got));
				ASSERT_TRUE(kt_close(what, ref, got, n, 1e-5, 1e-4));
				free(iq), free(ik), free(ref), free(got);
			}
}

TEST(scores_by_hand) {
	/* Two window queries of two heads, 2-d keys: relu keeps only the agreeing parts. */
	const float iq[] = { 2, 0, /* t0 h0 */ 0, -1, /* t0 h1 */ 1, 1, /* t1 h0 */ 0, 0 };
	const float ik[] = { 1, 0, /* s0 */ 0, 1, /* s1 */ -1, 0 /* s2 */ };
	float out[3];

	KT_FOREACH_PATH(path) {
		ASSERT_OK(kvd_indexer_scores(iq, 2, 2, ik, 2, KVD_DTYPE_F32, 3, 2, out));
		/* s0: (2 + 0 + 1 + 0) / 2; s1: (0 + 0 + 1 + 0) / 2; s2: (0 + 0 + 0 + 0) / 2. */
		ASSERT_TRUE(fabsf(out[0] - 1.5f) < 1e-6f);
		ASSERT_TRUE(fabsf(out[1] - 0.5f) < 1e-6f);
		ASSERT_TRUE(out[2] == 0.0f);
	}
	ASSERT_ERRNO(kvd_indexer_scores(iq, 0, 2, ik, 2, KVD_DTYPE_F32, 3, 2, out), -EINVAL);
}

struct owned {
	struct kvd_latent m;
	float *f;
};

static void owned_new(struct owned *o, uint32_t d) {
	o->f = kt_floats(kvd_latent_floats(d));
	kvd_latent_view(&o->m, d, o->f);
}

static int latent_close(const char *what, const struct kvd_latent *a, const struct kvd_latent *b,
			double atol, double rtol) {
	if (a->count != b->count)
		return 0;
	return kt_close(what, a->z, b->z, a->dim, atol, rtol) &&
	       kt_close(what, a->s, b->s, (size_t)a->dim * a->dim, atol, rtol);
}

TEST(latent_batch_and_merge) {
	static const uint32_t ns[] = { 0, 1, 255, 256, 257, 700 };
	static const uint32_t ds[] = { 1, 7, 32, 64 };
	static const uint32_t cuts[] = { 0, 1, 1, 40, 333, 700 };
	uint64_t seed = 13;

	KT_FOREACH_PATH(path)
		for (size_t di = 0; di < N_OF(ds); di++)
			for (size_t ni = 0; ni < N_OF(ns); ni++)
				for (size_t t = 0; t < N_OF(dtypes); t++) {
					uint32_t d = ds[di], n = ns[ni], stride = d + 3;
					void *k = kt_random(&seed, dtypes[t], (size_t)(n + 1) * stride, 2.0f);
					void *v = kt_random(&seed, dtypes[t], (size_t)(n + 1) * stride, 1.0f);
					struct owned ref, got;
					char what[96];

					owned_new(&ref, d), owned_new(&got, d);
					snprintf(what, sizeof(what), "%s d %u n %u dtype %u", path, d, n, dtypes[t]);
					ASSERT_OK(kvd_latent_batch_ref(k, stride, v, stride, dtypes[t], n, &ref.m));
					ASSERT_OK(kvd_latent_batch(k, stride, v, stride, dtypes[t], n, &got.m));
					ASSERT_TRUE(latent_close(what, &ref.m, &got.m, 1e-4, 1e-4));
					free(k), free(v), free(ref.f), free(got.f);
				}
	{
		uint32_t d = 16, n = 700;
		float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)n * d, 2.0f);
		float *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)n * d, 1.0f);
		struct owned all, acc, part;

		owned_new(&all, d), owned_new(&acc, d), owned_new(&part, d);
		ASSERT_OK(kvd_latent_batch_ref(k, d, v, d, KVD_DTYPE_F32, n, &all.m));
		for (size_t c = 0; c + 1 < N_OF(cuts); c++) {
			ASSERT_OK(kvd_latent_batch(k + (size_t)cuts[c] * d, d, v + (size_t)cuts[c] * d, d,
						   KVD_DTYPE_F32, cuts[c + 1] - cuts[c], &part.m));
			ASSERT_OK(kvd_latent_merge(&acc.m, &part.m));
		}
		ASSERT_TRUE(latent_close("merged", &all.m, &acc.m, 1e-3, 1e-4));
		part.m.count = UINT64_MAX;
		ASSERT_ERRNO(kvd_latent_merge(&acc.m, &part.m), -EOVERFLOW);
		ASSERT_EQ(acc.m.count, (uint64_t)n);
		part.m.dim = d - 1;
		ASSERT_ERRNO(kvd_latent_merge(&acc.m, &part.m), -EINVAL);
		free(k), free(v), free(all.f), free(acc.f), free(part.f);
	}
}

/* Random readout weights of dimension d, in one array that the caller frees. */
static float *readout_random(uint64_t *seed, uint32_t d, struct kvd_latent_readout *ret) {
	float *f = kt_random(seed, KVD_DTYPE_F32, 2 * (size_t)d * d + d, 0.5f);

	*ret = (struct kvd_latent_readout){ d, f, f + (size_t)d * d, f + (size_t)d * d + d };
	return f;
}

TEST(latent_entries_match_reference_and_hand) {
	static const uint32_t shapes[][2] = { { 1, 1 }, { 8, 3 }, { 32, 8 }, { 64, 17 } };
	uint64_t seed = 17;

	KT_FOREACH_PATH(path)
		for (size_t si = 0; si < N_OF(shapes); si++)
			for (int empty = 0; empty < 2; empty++) {
				uint32_t d = shapes[si][0], R = shapes[si][1], n = empty ? 0 : 50;
				float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)50 * d, 1.0f);
				float *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)50 * d, 1.0f);
				float *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)R * (d + 2), 2.0f);
				float *bias = kt_random(&seed, KVD_DTYPE_F32, R, 1.0f);
				float *l0 = kt_floats(R), *l1 = kt_floats(R);
				float *v0 = kt_floats((size_t)R * d), *v1 = kt_floats((size_t)R * d);
				struct kvd_latent_readout w;
				struct owned m;
				char what[96];

				float *wf = readout_random(&seed, d, &w);

				owned_new(&m, d);
				ASSERT_OK(kvd_latent_batch(k, d, v, d, KVD_DTYPE_F32, n, &m.m));
				snprintf(what, sizeof(what), "%s d %u R %u n %u", path, d, R, n);
				ASSERT_OK(kvd_latent_entries_ref(&m.m, &w, q, d + 2, R, bias, l0, v0));
				ASSERT_OK(kvd_latent_entries(&m.m, &w, q, d + 2, R, bias, l1, v1));
				ASSERT_TRUE(kt_close(what, l0, l1, R, 1e-5, 1e-4));
				ASSERT_TRUE(kt_close(what, v0, v1, (size_t)R * d, 1e-5, 1e-4));
				for (uint32_t r = 0; empty && r < R; r++)
					ASSERT_TRUE(l1[r] == -INFINITY && v1[(size_t)r * d] == 0.0f);
				free(k), free(v), free(q), free(bias), free(l0), free(l1), free(v0), free(v1),
					free(wf), free(m.f);
			}
	{
		/* n copies of one token: the readout is lr v whatever the query, and the logit
		 * ln(n psi . phi(k) + eps) + bias. */
		const uint32_t d = 2, n = 5;
		const float k[] = { 0.5f, -1.0f }, v[] = { 3.0f, -2.0f }, q[] = { 1.0f, 2.0f };
		const float lq[] = { 1, 0, 0, 1 }, lb[] = { 0, 0 }, lr[] = { 0, 1, 2, 0 }, bias = 0.25f;
		struct kvd_latent_readout w = { d, lq, lb, lr };
		float kk[10], vv[10], logit, val[2];
		double den = KVD_LATENT_EPS + n * ((1.0 + 1.0) * (0.5 + 1.0) + (2.0 + 1.0) * exp(-1.0));
		struct owned m;

		for (uint32_t i = 0; i < n; i++)
			kk[2 * i] = k[0], kk[2 * i + 1] = k[1], vv[2 * i] = v[0], vv[2 * i + 1] = v[1];
		owned_new(&m, d);
		ASSERT_OK(kvd_latent_batch(kk, d, vv, d, KVD_DTYPE_F32, n, &m.m));
		ASSERT_OK(kvd_latent_entries(&m.m, &w, q, d, 1, &bias, &logit, val));
		ASSERT_TRUE(fabs(val[0] - -2.0) < 1e-5 && fabs(val[1] - 6.0) < 1e-5);
		ASSERT_TRUE(fabs(logit - (log(den) + bias)) < 1e-5);
		free(m.f);
	}
}

TEST(attention_with_latent_entries) {
	uint32_t d = 32, L = 120, R = 6, n = 40;
	uint64_t seed = 23;
	float *q = kt_random(&seed, KVD_DTYPE_F32, (size_t)R * d, 2.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, (size_t)(L + n) * d, 1.0f);
	float *v = kt_random(&seed, KVD_DTYPE_F32, (size_t)(L + n) * d, 1.0f);
	float *bias = kt_random(&seed, KVD_DTYPE_F32, R, 1.0f);
	float *el = kt_floats(R), *ev = kt_floats((size_t)R * d);
	float *ref = kt_floats((size_t)R * d), *got = kt_floats((size_t)R * d);
	float *plain = kt_floats((size_t)R * d);
	uint32_t vis[6];
	struct kvd_latent_readout w;
	struct owned m;
	struct kvd_attn_moments_in in = {
		.dim = d, .len = L, .rows = R, .scale = 1.0f / sqrtf((float)d), .q = q, .ldq = d,
		.k = k + (size_t)n * d, .v = v + (size_t)n * d, .k_stride = d, .v_stride = d,
		.visible = vis,
	};

	for (uint32_t r = 0; r < R; r++)
		vis[r] = L - (R - 1 - r) * 10;
	float *wf = readout_random(&seed, d, &w);

	owned_new(&m, d);
	ASSERT_OK(kvd_attn_moments_ref(&in, plain));
	ASSERT_OK(kvd_latent_batch(k, d, v, d, KVD_DTYPE_F32, n, &m.m));
	ASSERT_OK(kvd_latent_entries(&m.m, &w, q, d, R, bias, el, ev));
	in.ent_logit = el, in.ent_value = ev;
	ASSERT_OK(kvd_attn_moments_ref(&in, ref));
	KT_FOREACH_PATH(path) {
		ASSERT_OK(kvd_attn_moments(&in, got));
		ASSERT_TRUE(kt_close(path, ref, got, (size_t)R * d, 1e-6, 1e-4));
	}
	/* The entry moves every row, toward its value by its softmax share. */
	for (uint32_t r = 0; r < R; r++) {
		double a = 0;

		for (uint32_t c = 0; c < d; c++)
			a += fabs(ref[(size_t)r * d + c] - plain[(size_t)r * d + c]);
		ASSERT_TRUE(a > 1e-4);
	}
	/* An empty state adds nothing: the very same output as without entries. */
	m.m.count = 0;
	ASSERT_OK(kvd_latent_entries(&m.m, &w, q, d, R, bias, el, ev));
	ASSERT_OK(kvd_attn_moments(&in, got));
	in.ent_logit = NULL, in.ent_value = NULL;
	ASSERT_OK(kvd_attn_moments(&in, ref));
	ASSERT_TRUE(memcmp(ref, got, (size_t)R * d * sizeof(float)) == 0);
	in.ent_logit = el;
	ASSERT_ERRNO(kvd_attn_moments(&in, got), -EINVAL);
	free(q), free(k), free(v), free(bias), free(el), free(ev), free(ref), free(got), free(plain),
		free(wf), free(m.f);
}

TEST(policy_indexmem_shares) {
	uint32_t H = 4, HKV = 2, W = 8, L = 60, D = 16, IH = 2, ID = 8, n = L - W;
	uint64_t seed = 29;
	struct kt_layer f;
	float *iq = kt_random(&seed, KVD_DTYPE_F32, (size_t)W * IH * ID, 1.0f);
	float *ik = kt_random(&seed, KVD_DTYPE_F32, (size_t)L * (ID + 1), 1.0f);
	float *I = kt_floats(n), *v = kt_floats((size_t)HKV * n), *vr = kt_floats((size_t)HKV * n);
	struct kvd_policy_params p;
	struct kvd_keep *keep = NULL;
	double sum = 0, z = 0;

	kt_layer_init(&f, KVD_DTYPE_F32, H, HKV, W, L, D, 24, 3, 3.0f);
	kvd_policy_params_default(KVD_POLICY_INDEXMEM, &p);
	ASSERT_STREQ(kvd_policy_to_string(KVD_POLICY_INDEXMEM), "indexmem");
	ASSERT_EQ(kvd_policy_from_string("indexmem"), KVD_POLICY_INDEXMEM);
	ASSERT_ERRNO(kvd_policy_scores(&p, &f.in, NULL, NULL, v), -EINVAL);
	p.index_q = iq, p.index_k = ik, p.index_k_stride = ID + 1, p.index_heads = IH, p.index_dim = ID;
	p.layer_weight = 2.0f;
	ASSERT_OK(kvd_policy_scores(&p, &f.in, NULL, NULL, v));
	p.reference = 1;
	ASSERT_OK(kvd_policy_scores(&p, &f.in, NULL, NULL, vr));
	ASSERT_TRUE(kt_close("ref", vr, v, (size_t)HKV * n, 1e-7, 1e-4));
	/* The softmax of I over the prefix, split evenly over the rows. */
	ASSERT_OK(kvd_indexer_scores_ref(iq, W, IH, ik, ID + 1, KVD_DTYPE_F32, n, ID, I));
	for (uint32_t i = 0; i < n; i++)
		z += exp(I[i]);
	for (uint32_t i = 0; i < n; i++) {
		ASSERT_TRUE(fabs(v[i] - 2.0 / HKV * exp(I[i]) / z) < 1e-6);
		ASSERT_TRUE(v[n + i] == v[i]);
		sum += v[i] + v[n + i];
	}
	ASSERT_TRUE(fabs(sum - 2.0) < 1e-5);
	/* Hostile keys and queries (the pool and the window are shared with the engine): the
	 * shares stay finite shares. */
	ik[5 * (ID + 1)] = NAN;
	for (uint32_t i = 0; i < ID; i++)
		ik[7 * (ID + 1) + i] = INFINITY;
	iq[3] = -INFINITY;
	p.reference = 0;
	ASSERT_OK(kvd_policy_scores(&p, &f.in, NULL, NULL, v));
	sum = 0;
	for (uint32_t i = 0; i < HKV * n; i++) {
		ASSERT_TRUE(isfinite(v[i]) && v[i] >= 0);
		sum += v[i];
	}
	ASSERT_TRUE(fabs(sum - 2.0) < 1e-5);
	p.capacity = 30;
	ASSERT_ERRNO(kvd_policy_keep(&p, &f.in, NULL, NULL, &keep), -EOPNOTSUPP);
	free(iq), free(ik), free(I), free(v), free(vr);
	kt_layer_done(&f);
}
