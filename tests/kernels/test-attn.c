/* SPDX-License-Identifier: MIT */
/*
 * The optimised window attention against the reference: every dtype, SIMD path and shape;
 * a GQA group at once against its heads one by one.
 */
#include <errno.h>
#include <math.h>

#include "attn.h"
#include "ktest.h"

struct shape {
	uint32_t heads, kv_heads, window, len, dim;
};

static const struct shape shapes[] = {
	{ 1, 1, 1, 1, 1 },       /* w = L = 1 */
	{ 2, 1, 1, 37, 16 },     /* w = 1, GQA 2 */
	{ 4, 2, 5, 5, 8 },       /* w = L */
	{ 4, 4, 8, 129, 17 },    /* L one past a key tile, odd d */
	{ 8, 2, 32, 300, 64 },   /* GQA 4, L not a multiple of any tile */
	{ 3, 1, 7, 257, 128 },   /* MQA, odd w */
	{ 2, 2, 32, 1000, 96 },
};

static const uint32_t dtypes[] = { KVD_DTYPE_F32, KVD_DTYPE_F16, KVD_DTYPE_BF16 };

static void check(const struct shape *s, uint32_t dtype, const char *path, uint64_t seed,
		  int strided) {
	struct kvd_attn_in in = {
		.dtype = dtype, .heads = s->heads, .kv_heads = s->kv_heads, .window = s->window,
		.len = s->len, .dim = s->dim, .scale = 1.0f / sqrtf((float)s->dim),
	};
	/* Strided views: each row padded by 3 elements, each head by 5 rows' worth. */
	size_t pad = strided ? 3 : 0, qrow = s->dim + pad, krow = s->dim + pad;
	size_t qhead = qrow * s->window + (strided ? 5 : 0), khead = krow * s->len + (strided ? 5 : 0);
	void *q = kt_random(&seed, dtype, qhead * s->heads, 2.0f);
	void *k = kt_random(&seed, dtype, khead * s->kv_heads, 2.0f);
	size_t wl = (size_t)s->window * s->len;
	uint32_t g = s->heads / s->kv_heads;
	float *ref = kt_floats(wl), *got = kt_floats(wl), *all = kt_floats(s->heads * wl);
	float *grp = kt_floats(g * wl), *scratch;
	char what[160];

	in.q = q, in.k = k, in.v = k;
	in.q_row_stride = qrow, in.q_head_stride = qhead;
	in.k_row_stride = in.v_row_stride = krow, in.k_head_stride = in.v_head_stride = khead;
	for (uint32_t h = 0; h < s->heads; h++) {
		ASSERT_OK(kvd_attn_head_ref(&in, h, ref));
		ASSERT_OK(kvd_attn_head(&in, h, got));
		snprintf(what, sizeof(what), "%s dtype %u H %u Hkv %u w %u L %u d %u head %u%s", path,
			 dtype, s->heads, s->kv_heads, s->window, s->len, s->dim, h,
			 strided ? " strided" : "");
		ASSERT_TRUE(kt_close(what, ref, got, (size_t)s->window * s->len, 1e-7, 2e-5));
		memcpy(all + h * wl, got, wl * sizeof(float));
	}
	/* A GQA group at once, and any run of its heads, gives each head's map to the bit. */
	scratch = kt_floats(kvd_attn_scratch_floats(&in));
	for (uint32_t kv = 0; kv < s->kv_heads; kv++)
		for (uint32_t nh = 1; nh <= g; nh++) {
			uint32_t h0 = kv * g + g - nh;

			ASSERT_OK(kvd_attn_heads_buf(&in, h0, nh, grp, scratch));
			ASSERT_EQ(memcmp(grp, all + h0 * wl, nh * wl * sizeof(float)), 0);
		}
	if (g < s->heads)
		ASSERT_ERRNO(kvd_attn_heads_buf(&in, g - 1, 2, grp, scratch), -EINVAL);
	free(q), free(k), free(ref), free(got), free(all), free(grp), free(scratch);
}

TEST(attn_matches_reference) {
	KT_FOREACH_PATH(path)
		for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
			for (size_t t = 0; t < sizeof(dtypes) / sizeof(dtypes[0]); t++)
				for (int strided = 0; strided < 2; strided++)
					check(&shapes[i], dtypes[t], path, 1000 + i * 7 + t, strided);
}

TEST(attn_contiguous_helper) {
	struct kvd_attn_in in = { .heads = 4, .kv_heads = 2, .window = 3, .len = 10, .dim = 8 };

	kvd_attn_in_contiguous(&in);
	ASSERT_EQ(in.q_row_stride, 8u);
	ASSERT_EQ(in.q_head_stride, 24u);
	ASSERT_EQ(in.k_head_stride, 80u);
}

TEST(attn_rejects_bad_input) {
	float q[8] = {}, k[8] = {}, p[8];
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = 1, .kv_heads = 1, .window = 2, .len = 1, .dim = 4,
		.q = q, .k = k,
	};

	kvd_attn_in_contiguous(&in);
	ASSERT_ERRNO(kvd_attn_head(&in, 0, p), -EINVAL); /* w > L */
	in.len = 2;
	ASSERT_ERRNO(kvd_attn_head(&in, 1, p), -EINVAL); /* no head 1 */
	ASSERT_ERRNO(kvd_attn_head(&in, 0, NULL), -EINVAL);
	in.dtype = 9;
	ASSERT_ERRNO(kvd_attn_head(&in, 0, p), -EINVAL);
}

/* NaN and inf in q or k: no crash, rows without them unchanged, and the same as the reference. */
TEST(attn_nonfinite) {
	enum { H = 2, w = 4, L = 70, d = 16 };
	uint64_t seed = 7;
	float *q = kt_random(&seed, KVD_DTYPE_F32, H * w * d, 1.0f);
	float *k = kt_random(&seed, KVD_DTYPE_F32, H * L * d, 1.0f);
	float *ref = kt_floats(w * L), *got = kt_floats(w * L);
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_F32, .heads = H, .kv_heads = H, .window = w, .len = L,
		.dim = d, .scale = 0.25f, .q = q, .k = k,
	};

	kvd_attn_in_contiguous(&in);
	q[1 * d + 3] = NAN;        /* head 0, row 1 */
	k[1 * L * d + 20 * d] = INFINITY; /* head 1, key 20: every row of head 1 sees it */
	q[(w + 2) * d] = -INFINITY;
	KT_FOREACH_PATH(path)
		for (uint32_t h = 0; h < H; h++) {
			ASSERT_OK(kvd_attn_head_ref(&in, h, ref));
			ASSERT_OK(kvd_attn_head(&in, h, got));
			ASSERT_TRUE(kt_close(path, ref, got, w * L, 1e-7, 2e-5));
		}
	/* Row 0 of head 0 has no non-finite input: still a proper distribution. */
	ASSERT_OK(kvd_attn_head(&in, 0, got));
	{
		double sum = 0;

		for (uint32_t i = 0; i < L; i++) {
			ASSERT_TRUE(isfinite(got[i]));
			sum += got[i];
		}
		ASSERT_TRUE(fabs(sum - 1) < 1e-5);
	}
	free(q), free(k), free(ref), free(got);
}
