/* SPDX-License-Identifier: MIT */
/*
 * The body of one SIMD path (see simd.h), written once with GCC vector extensions and
 * instantiated by simd-avx512.c, simd-avx2.c and simd-generic.c, each of which sets the
 * target with a pragma and defines:
 *
 *   SIMD_W       fp32 lanes of the vector type
 *   SIMD_MR      rows of the gemm micro-tile
 *   SIMD_NV      vectors per row of the gemm micro-tile (SIMD_MR * SIMD_NV accumulators)
 *   SIMD_MR2     rows of the narrow (2-vector) gemm micro-tile
 *   SIMD_OPS     the name of the ops table to define
 *   SIMD_NAME    its name as a string
 *
 * Not a header: include it exactly once, from those files only.
 */

#include <math.h>
#include <string.h>

#include "dtype.h"
#include "simd.h"

typedef float vf __attribute__((vector_size(SIMD_W * 4)));
typedef int32_t vi __attribute__((vector_size(SIMD_W * 4)));
typedef uint16_t vh __attribute__((vector_size(SIMD_W * 2)));
/* Unaligned, aliasing views for loads and stores from plain float arrays. */
typedef float vfu __attribute__((vector_size(SIMD_W * 4), aligned(4), may_alias));
typedef uint16_t vhu __attribute__((vector_size(SIMD_W * 2), aligned(2), may_alias));

#define W SIMD_W

static inline vf vload(const float *p) {
	return *(const vfu *)p;
}

static inline void vstore(float *p, vf v) {
	*(vfu *)p = v;
}

/* x - 0 rather than 0 + x: only the former folds to a plain broadcast (signed zeros). */
static inline vf vset1(float x) {
	return x - (vf){};
}

/* Lane-wise mask ? a : b, where mask lanes are all ones or all zeros (vector compares). */
static inline vf vsel(vi mask, vf a, vf b) {
	return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

static inline float vsum(vf v) {
	float s = 0;

	for (int i = 0; i < W; i++)
		s += v[i];
	return s;
}

/* ---- gemm ---- */

/*
 * An MR x NV*W micro-tile: c = a * b over k, with every accumulator in a register. Two
 * shapes: the wide one (SIMD_MR x SIMD_NV vectors) for the bulk, and a narrow one
 * (SIMD_MR2 x 2 vectors) for panels narrower than the wide tile, such as the w = 32
 * queries of the window attention on AVX-512.
 */
#define UNROLL _Pragma("GCC unroll 16")
#define GEMM_TILE(name, MR, NV)                                                              \
	static inline void name(uint32_t k, const float *a, size_t lda, const float *b,       \
				size_t ldb, float *c, size_t ldc, int accumulate) {           \
		vf acc[MR][NV];                                                               \
                                                                                              \
		UNROLL for (int r = 0; r < MR; r++)                                           \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				acc[r][v] = accumulate ? vload(c + r * ldc + v * W) : (vf){}; \
		for (uint32_t p = 0; p < k; p++) {                                            \
			vf bv[NV];                                                            \
                                                                                              \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				bv[v] = vload(b + p * ldb + v * W);                           \
			UNROLL for (int r = 0; r < MR; r++) {                                 \
				vf av = vset1(a[r * lda + p]);                                \
                                                                                              \
				UNROLL for (int v = 0; v < NV; v++)                           \
					acc[r][v] += av * bv[v];                              \
			}                                                                     \
		}                                                                             \
		UNROLL for (int r = 0; r < MR; r++)                                           \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				vstore(c + r * ldc + v * W, acc[r][v]);                       \
	}

GEMM_TILE(gemm_tile, SIMD_MR, SIMD_NV)
GEMM_TILE(gemm_tile2, SIMD_MR2, 2)

/* One row by one vector, for the edges. */
static inline void gemm_vec(uint32_t k, const float *a, const float *b, size_t ldb, float *c,
			    int accumulate) {
	vf acc = accumulate ? vload(c) : (vf){};

	for (uint32_t p = 0; p < k; p++)
		acc += vset1(a[p]) * vload(b + p * ldb);
	vstore(c, acc);
}

static void gemm(uint32_t m, uint32_t n, uint32_t k, const float *a, size_t lda, const float *b,
		 size_t ldb, float *c, size_t ldc, int accumulate) {
	uint32_t nt = n / (SIMD_NV * W) * (SIMD_NV * W), n2 = nt + (n - nt) / (2 * W) * (2 * W);
	uint32_t nv = n / W * W, i = 0;

	/* Column panels outside, so that a k x NV*W panel of b stays in L1 for all rows. */
	for (uint32_t j = 0; j < nt; j += SIMD_NV * W) {
		for (i = 0; i + SIMD_MR <= m; i += SIMD_MR)
			gemm_tile(k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
		for (; i < m; i++)
			for (uint32_t v = 0; v < SIMD_NV; v++)
				gemm_vec(k, a + i * lda, b + j + v * W, ldb, c + i * ldc + j + v * W,
					 accumulate);
	}
	for (uint32_t j = nt; j < n2; j += 2 * W) {
		for (i = 0; i + SIMD_MR2 <= m; i += SIMD_MR2)
			gemm_tile2(k, a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, accumulate);
		for (; i < m; i++)
			for (uint32_t v = 0; v < 2; v++)
				gemm_vec(k, a + i * lda, b + j + v * W, ldb, c + i * ldc + j + v * W,
					 accumulate);
	}
	for (i = 0; i < m; i++) {
		for (uint32_t j = n2; j < nv; j += W)
			gemm_vec(k, a + i * lda, b + j, ldb, c + i * ldc + j, accumulate);
		for (uint32_t j = nv; j < n; j++) {
			float s = accumulate ? c[i * ldc + j] : 0;

			for (uint32_t p = 0; p < k; p++)
				s += a[i * lda + p] * b[p * ldb + j];
			c[i * ldc + j] = s;
		}
	}
}

/* ---- conversion ---- */

static inline vf f16_vec(const uint16_t *p) {
#if W == 16 && defined(__AVX512F__)
	__m256i h;

	memcpy(&h, p, sizeof(h));
	return (vf)_mm512_cvtph_ps(h);
#elif W == 8 && defined(__F16C__)
	__m128i h;

	memcpy(&h, p, sizeof(h));
	return (vf)_mm256_cvtph_ps(h);
#else
	vf r;

	for (int i = 0; i < W; i++)
		r[i] = kvd_f16_to_f32(p[i]);
	return r;
#endif
}

static inline vf bf16_vec(const uint16_t *p) {
	vh h = *(const vhu *)p;
	vi u = __builtin_convertvector(h, vi) << 16;

	return (vf)u;
}

static void to_f32(const void *src, uint32_t dtype, size_t n, float scale, float *dst) {
	size_t i = 0;
	vf s = vset1(scale);

	switch (dtype) {
	case KVD_KERNEL_F16:
		for (; i + W <= n; i += W)
			vstore(dst + i, f16_vec((const uint16_t *)src + i) * s);
		break;
	case KVD_KERNEL_BF16:
		for (; i + W <= n; i += W)
			vstore(dst + i, bf16_vec((const uint16_t *)src + i) * s);
		break;
	default:
		for (; i + W <= n; i += W)
			vstore(dst + i, vload((const float *)src + i) * s);
	}
	for (; i < n; i++)
		dst[i] = kvd_load(src, dtype, i) * scale;
}

/* ---- softmax rows ---- */

static float vmax(const float *x, size_t n) {
	vf m = vset1(-INFINITY);
	vi nan = {};
	float r = -INFINITY;
	size_t i = 0;

	for (; i + W <= n; i += W) {
		vf v = vload(x + i);

		nan |= v != v;
		m = vsel(v > m, v, m);
	}
	for (int l = 0; l < W; l++) {
		if (nan[l])
			return NAN;
		r = m[l] > r ? m[l] : r;
	}
	for (; i < n; i++) {
		if (isnan(x[i]))
			return NAN;
		r = x[i] > r ? x[i] : r;
	}
	return r;
}

/*
 * exp(x) to about 2 ulp: x = n*ln2 + r with |r| <= ln2/2 (Cody-Waite, two-part ln2), a
 * degree-6 polynomial for exp(r), and 2^n put into the exponent. Results that would be
 * subnormal (x < -87.3) are flushed to 0, which changes a softmax probability by less than
 * 1e-38; +inf and NaN propagate, -inf gives 0.
 */
static inline vf vexp(vf x) {
	const vf log2e = vset1(1.44269504088896341f), ln2_hi = vset1(0.693359375f),
		 ln2_lo = vset1(-2.12194440e-4f), round = vset1(12582912.0f);
	vf xc = vsel(x > vset1(88.0f), vset1(88.0f), x);
	vf n, r, p;
	vi e;

	xc = vsel(xc < vset1(-88.0f), vset1(-88.0f), xc);
	n = (xc * log2e + round) - round;
	r = xc - n * ln2_hi - n * ln2_lo;
	p = vset1(1.3981999507e-3f);
	p = p * r + vset1(8.3334519073e-3f);
	p = p * r + vset1(4.1665795894e-2f);
	p = p * r + vset1(1.6666665459e-1f);
	p = p * r + vset1(5.0000001201e-1f);
	p = p * r * r + r + vset1(1.0f);
	e = (__builtin_convertvector(n, vi) + 127) << 23;
	p = p * (vf)(e & (e > 0));
	p = vsel(x < vset1(-87.33654f), vset1(0.0f), p);
	p = vsel(x > vset1(88.72283f), vset1(INFINITY), p);
	return vsel(x != x, x, p);
}

static float exp_sum(float *x, size_t n, float sub) {
	vf acc = {}, s = vset1(sub);
	float tail = 0;
	size_t i = 0;

	for (; i + W <= n; i += W) {
		vf e = vexp(vload(x + i) - s);

		vstore(x + i, e);
		acc += e;
	}
	if (i < n) {
		/* The tail through the same polynomial, so that every element rounds alike. */
		float buf[W];
		vf e;

		for (int l = 0; l < W; l++)
			buf[l] = i + l < n ? x[i + l] - sub : -INFINITY;
		e = vexp(vload(buf));
		for (size_t l = 0; i + l < n; l++) {
			x[i + l] = e[l];
			tail += e[l];
		}
	}
	return vsum(acc) + tail;
}

static void vscale(float *x, size_t n, float s) {
	size_t i = 0;

	for (; i + W <= n; i += W)
		vstore(x + i, vload(x + i) * vset1(s));
	for (; i < n; i++)
		x[i] *= s;
}

static void axpy(size_t n, float a, const float *x, float *y) {
	vf av = vset1(a);
	size_t i = 0;

	for (; i + W <= n; i += W)
		vstore(y + i, vload(y + i) + av * vload(x + i));
	for (; i < n; i++)
		y[i] += a * x[i];
}

static void sq_axpy(size_t n, float a, const float *x, float *y) {
	vf av = vset1(a);
	size_t i = 0;

	for (; i + W <= n; i += W) {
		vf v = vload(x + i);

		vstore(y + i, vload(y + i) + av * v * v);
	}
	for (; i < n; i++)
		y[i] += a * x[i] * x[i];
}

static void mul_add(size_t n, const float *x, const float *y, float *acc) {
	size_t i = 0;

	for (; i + W <= n; i += W)
		vstore(acc + i, vload(acc + i) + vload(x + i) * vload(y + i));
	for (; i < n; i++)
		acc[i] += x[i] * y[i];
}

static float dot(size_t n, const float *x, const float *y) {
	vf a0 = {}, a1 = {};
	float s = 0;
	size_t i = 0;

	for (; i + 2 * W <= n; i += 2 * W) {
		a0 += vload(x + i) * vload(y + i);
		a1 += vload(x + i + W) * vload(y + i + W);
	}
	for (; i + W <= n; i += W)
		a0 += vload(x + i) * vload(y + i);
	for (; i < n; i++)
		s += x[i] * y[i];
	return vsum(a0 + a1) + s;
}

const struct kvd_simd_ops SIMD_OPS = {
	.name = SIMD_NAME,
	.width = W,
	.gemm = gemm,
	.to_f32 = to_f32,
	.max = vmax,
	.exp_sum = exp_sum,
	.scale = vscale,
	.axpy = axpy,
	.sq_axpy = sq_axpy,
	.mul_add = mul_add,
	.dot = dot,
};
