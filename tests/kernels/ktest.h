/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Helpers shared by the kernel tests: a seeded generator, random tensors in any kernel
 * dtype, the atol + |ref|*rtol comparison, and a loop over the SIMD paths this CPU can
 * run, so that one test checks AVX-512, AVX2 and the generic path against the reference.
 * Header-only, static functions (each test is its own program).
 */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "dtype.h"
#include "gram.h"
#include "select.h"
#include "simd.h"
#include "test.h"

/* splitmix64: small, seedable, the same sequence everywhere. */
static inline uint64_t kt_next(uint64_t *s) {
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float kt_uniform(uint64_t *s) {
	return (float)((kt_next(s) >> 40) * (1.0 / (1ull << 23))) - 1.0f;
}

static inline uint16_t kt_f32_to_bf16(float f) {
	uint32_t u;

	memcpy(&u, &f, 4);
	return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* Stores f as element i of a dtype array. */
static inline void kt_store(void *base, uint32_t dtype, size_t i, float f) {
	if (dtype == KVD_DTYPE_F32)
		((float *)base)[i] = f;
	else if (dtype == KVD_DTYPE_F16)
		((uint16_t *)base)[i] = kvd_f32_to_f16(f);
	else
		((uint16_t *)base)[i] = kt_f32_to_bf16(f);
}

/* n random elements in [-amp, amp), as dtype; free() the result. */
static inline void *kt_random(uint64_t *s, uint32_t dtype, size_t n, float amp) {
	void *p = malloc(n * kvd_dtype_size(dtype) + 1);

	ASSERT_NOT_NULL(p);
	for (size_t i = 0; i < n; i++)
		kt_store(p, dtype, i, amp * kt_uniform(s));
	return p;
}

static inline float *kt_floats(size_t n) {
	float *p = calloc(n ? n : 1, sizeof(float));

	ASSERT_NOT_NULL(p);
	return p;
}

/*
 * Whether got matches ref within atol + |ref|*rtol everywhere (NaN matches NaN, inf the
 * same inf); prints the first mismatch under the given label.
 */
static inline int kt_close(const char *what, const float *ref, const float *got, size_t n,
			   double atol, double rtol) {
	for (size_t i = 0; i < n; i++) {
		double r = ref[i], g = got[i];

		if (isnan(r) && isnan(g))
			continue;
		if (isinf(r) || isinf(g)) {
			if (r == g)
				continue;
		} else if (fabs(g - r) <= atol + fabs(r) * rtol)
			continue;
		fprintf(stderr, "%s: element %zu: ref %.9g, got %.9g (atol %g, rtol %g)\n", what, i,
			r, g, atol, rtol);
		return 0;
	}
	return 1;
}

static inline int kt_selection_has(const uint32_t *s, uint32_t n, uint32_t x) {
	for (uint32_t i = 0; i < n; i++)
		if (s[i] == x)
			return 1;
	return 0;
}

/*
 * The selection rule for kernels that sum in other orders: the top-k of got and of ref
 * (select.h's kvd_topk) may differ only in items whose ref score lies within
 * atol + |cut|*rtol of ref's cut-off (its k-th highest score). Prints the first item that
 * breaks it.
 */
static inline int kt_selection_ok(const char *what, const float *ref, const float *got, uint32_t n,
				  uint32_t k, double atol, double rtol) {
	uint32_t *a = calloc(k + 1, sizeof(uint32_t)), *b = calloc(k + 1, sizeof(uint32_t));
	float cut = INFINITY;
	int ok = 1;

	ASSERT_TRUE(a && b);
	ASSERT_OK(kvd_topk(ref, n, k, a));
	ASSERT_OK(kvd_topk(got, n, k, b));
	for (uint32_t i = 0; i < k; i++)
		if (!(ref[a[i]] >= cut))
			cut = ref[a[i]];
	for (uint32_t i = 0; ok && i < k; i++) {
		uint32_t x[2] = { a[i], b[i] };

		for (int j = 0; ok && j < 2; j++)
			if (!kt_selection_has(j ? a : b, k, x[j]) &&
			    !(fabs(ref[x[j]] - cut) <= atol + fabs(cut) * rtol)) {
				fprintf(stderr, "%s: item %u (ref %.9g) differs, cut-off %.9g\n", what,
					x[j], ref[x[j]], cut);
				ok = 0;
			}
	}
	free(a), free(b);
	return ok;
}

static const char *const kt_paths[] = { "avx512", "avx2", "generic" };

/* Runs body once per SIMD path the CPU supports, with that path forced. */
#define KT_FOREACH_PATH(path_name)                                                            \
	for (size_t _kp = 0; _kp < sizeof(kt_paths) / sizeof(kt_paths[0]); _kp++)            \
		for (const char *path_name = kt_paths[_kp]; path_name;                        \
		     path_name = (kvd_simd_override(NULL), NULL))                             \
			if (kvd_simd_get(path_name) &&                                        \
			    (kvd_simd_override(kvd_simd_get(path_name)), 1))

/*
 * One layer of seeded random tensors (q [H][w][d] of amplitude qamp, k and v [Hkv][L][d],
 * wo [C][H*d]) with its per-head Gram matrices gram [H][d][d], the GQA group blocks
 * ggram [Hkv][g*d][g*d] and the reference attention probs [H][w][L]: the fixture of the
 * ReST-KV and LaProx tests.
 */
struct kt_layer {
	struct kvd_attn_in in;
	struct kvd_wo wo;
	void *q, *k, *v;
	float *w, *gram, *ggram, *probs;
};

static inline void kt_layer_init(struct kt_layer *f, uint32_t dtype, uint32_t H, uint32_t Hkv,
				 uint32_t w, uint32_t L, uint32_t d, uint32_t C, uint64_t seed,
				 float qamp) {
	uint32_t g = H / Hkv;

	*f = (struct kt_layer){ 0 };
	f->q = kt_random(&seed, dtype, (size_t)H * w * d, qamp);
	f->k = kt_random(&seed, dtype, (size_t)Hkv * L * d, 1.0f);
	f->v = kt_random(&seed, dtype, (size_t)Hkv * L * d, 1.0f);
	f->w = kt_random(&seed, KVD_DTYPE_F32, (size_t)C * H * d, 0.3f);
	f->in = (struct kvd_attn_in){
		.dtype = dtype, .heads = H, .kv_heads = Hkv, .window = w, .len = L, .dim = d,
		.scale = 1.0f / sqrtf((float)d), .q = f->q, .k = f->k, .v = f->v,
	};
	kvd_attn_in_contiguous(&f->in);
	f->wo = (struct kvd_wo){
		.dtype = KVD_DTYPE_F32, .c_out = C, .heads = H, .dim = d, .w = f->w,
		.row_stride = (size_t)H * d,
	};
	f->gram = kt_floats((size_t)H * d * d);
	f->ggram = kt_floats((size_t)Hkv * g * d * g * d);
	for (uint32_t h = 0; h < H; h++)
		ASSERT_OK(kvd_gram_ref(&f->wo, h, 1, f->gram + (size_t)h * d * d));
	for (uint32_t kv = 0; kv < Hkv; kv++)
		ASSERT_OK(kvd_gram_ref(&f->wo, kv * g, g, f->ggram + (size_t)kv * g * d * g * d));
	f->probs = kt_floats((size_t)H * w * L);
	for (uint32_t h = 0; h < H; h++)
		ASSERT_OK(kvd_attn_head_ref(&f->in, h, f->probs + (size_t)h * w * L));
}

static inline void kt_layer_done(struct kt_layer *f) {
	free(f->q), free(f->k), free(f->v), free(f->w), free(f->gram), free(f->ggram);
	free(f->probs);
}
