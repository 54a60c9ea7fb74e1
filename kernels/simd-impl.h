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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "dtype.h"
#include "simd.h"

typedef float vf __attribute__((vector_size(SIMD_W * 4)));
typedef int32_t vi __attribute__((vector_size(SIMD_W * 4)));
typedef uint32_t vu __attribute__((vector_size(SIMD_W * 4)));
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

/*
 * Rows of b (the k of a block) a pass of gemm_block() runs over: its KC x NV*W panel of b
 * (32 KiB on AVX-512) stays in L1 for all rows of a. A longer k (the Gram matrices' C,
 * thousands) streamed the whole k x NV*W panel from memory for every MR rows.
 */
#define GEMM_KC 128u

static void gemm_block(uint32_t m, uint32_t n, uint32_t k, const float *a, size_t lda,
		       const float *b, size_t ldb, float *c, size_t ldc, int accumulate) {
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

/* c = a b (+ c), in passes over GEMM_KC rows of b: each element's sum runs over p in the
 * same order as in one pass (a pass ends by storing it, the next starts from it), so the
 * result is the same to the bit. */
static void gemm(uint32_t m, uint32_t n, uint32_t k, const float *a, size_t lda, const float *b,
		 size_t ldb, float *c, size_t ldc, int accumulate) {
	for (uint32_t p0 = 0; p0 < k || p0 == 0; p0 += GEMM_KC)
		gemm_block(m, n, k - p0 < GEMM_KC ? k - p0 : GEMM_KC, a + p0, lda, b + p0 * ldb, ldb,
			   c, ldc, accumulate || p0 > 0);
}

/* ---- quadratic forms ---- */

/*
 * An MR x NV*W tile of quad_upper() below: the rows a0 .. a0+MR-1 of U xt for NV*W columns
 * (only rows b >= a0 of xt meet non-zero entries of those rows of U), folded into out[NV]
 * with the same rows of xt, without being stored.
 */
#define QUAD_TILE(name, MR, NV)                                                              \
	static inline void name(uint32_t d, uint32_t a0, const float *u, const float *xt,     \
				size_t ldx, vf *out) {                                        \
		vf acc[MR][NV];                                                               \
                                                                                              \
		UNROLL for (int r = 0; r < MR; r++)                                           \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				acc[r][v] = (vf){};                                           \
		for (uint32_t b = a0; b < d; b++) {                                           \
			vf xv[NV];                                                            \
                                                                                              \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				xv[v] = vload(xt + b * ldx + v * W);                          \
			UNROLL for (int r = 0; r < MR; r++) {                                 \
				vf uv = vset1(u[(a0 + r) * d + b]);                           \
                                                                                              \
				UNROLL for (int v = 0; v < NV; v++)                           \
					acc[r][v] += uv * xv[v];                              \
			}                                                                     \
		}                                                                             \
		UNROLL for (int r = 0; r < MR; r++)                                           \
			UNROLL for (int v = 0; v < NV; v++)                                   \
				out[v] += acc[r][v] * vload(xt + (a0 + r) * ldx + v * W);    \
	}

QUAD_TILE(quad_tile, SIMD_MR, SIMD_NV)
QUAD_TILE(quad_tile_row, 1, SIMD_NV)
QUAD_TILE(quad_tile_vec, SIMD_MR, 1)
QUAD_TILE(quad_tile_one, 1, 1)

/* NV*W (or W) columns of quad_upper(): the row blocks of U, then its last rows one by one. */
#define QUAD_COLUMNS(name, tile, row, NV)                                                    \
	static inline void name(uint32_t d, const float *u, const float *xt, size_t ldx,      \
				float *out) {                                                 \
		vf o[NV] = {};                                                                \
		uint32_t a0 = 0;                                                              \
                                                                                              \
		for (; a0 + SIMD_MR <= d; a0 += SIMD_MR)                                      \
			tile(d, a0, u, xt, ldx, o);                                           \
		for (; a0 < d; a0++)                                                          \
			row(d, a0, u, xt, ldx, o);                                            \
		UNROLL for (int v = 0; v < NV; v++)                                           \
			vstore(out + v * W, o[v]);                                            \
	}

QUAD_COLUMNS(quad_panel, quad_tile, quad_tile_row, SIMD_NV)
QUAD_COLUMNS(quad_vec, quad_tile_vec, quad_tile_one, 1)

static void quad_upper(uint32_t d, const float *u, const float *xt, size_t ldx, uint32_t n,
		       float *out) {
	uint32_t j = 0;

	for (; j + SIMD_NV * W <= n; j += SIMD_NV * W)
		quad_panel(d, u, xt + j, ldx, out + j);
	for (; j + W <= n; j += W)
		quad_vec(d, u, xt + j, ldx, out + j);
	for (; j < n; j++) {
		float s = 0;

		for (uint32_t a = 0; a < d; a++) {
			float ux = 0;

			for (uint32_t b = a; b < d; b++)
				ux += u[a * d + b] * xt[b * ldx + j];
			s += ux * xt[a * ldx + j];
		}
		out[j] = s;
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
	case KVD_DTYPE_F16:
		for (; i + W <= n; i += W)
			vstore(dst + i, f16_vec((const uint16_t *)src + i) * s);
		break;
	case KVD_DTYPE_BF16:
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

/*
 * Lanes of the two-source shuffles of one transpose stage at distance D, a power of two
 * below W, applied to rows a = i and b = i + D (bit D of i clear): T_LO keeps a's lanes whose
 * bit D is clear and fills the others from b, moved up by D; T_HI is the mirror. Each stage
 * swaps bit D between the row and the lane index of every element, so the log2(W) stages
 * transpose a W x W block in registers.
 */
#define T_LO(D, l) (((l) & (D)) ? W + (l) - (D) : (l))
#define T_HI(D, l) (((l) & (D)) ? W + (l) : (l) + (D))
#if W == 16
#define LANES(f, D)                                                                          \
	f(D, 0), f(D, 1), f(D, 2), f(D, 3), f(D, 4), f(D, 5), f(D, 6), f(D, 7), f(D, 8),     \
		f(D, 9), f(D, 10), f(D, 11), f(D, 12), f(D, 13), f(D, 14), f(D, 15)
#elif W == 8
#define LANES(f, D) f(D, 0), f(D, 1), f(D, 2), f(D, 3), f(D, 4), f(D, 5), f(D, 6), f(D, 7)
#elif W == 4
#define LANES(f, D) f(D, 0), f(D, 1), f(D, 2), f(D, 3)
#else
#error "SIMD_W must be 4, 8 or 16"
#endif
#define T_STAGE(r, D)                                                                        \
	UNROLL for (int i = 0; i < W; i++)                                                    \
		if (!(i & (D))) {                                                             \
			vf a = r[i], b = r[i + (D)];                                          \
                                                                                              \
			r[i] = __builtin_shufflevector(a, b, LANES(T_LO, D));                 \
			r[i + (D)] = __builtin_shufflevector(a, b, LANES(T_HI, D));           \
		}

static inline void transpose(vf r[W]) {
#if W >= 16
	T_STAGE(r, 8)
#endif
#if W >= 8
	T_STAGE(r, 4)
#endif
	T_STAGE(r, 2)
	T_STAGE(r, 1)
}

/* W elements of dtype from src + i, as fp32. */
static inline vf load_f32(const void *src, uint32_t dtype, size_t i) {
	switch (dtype) {
	case KVD_DTYPE_F16:
		return f16_vec((const uint16_t *)src + i);
	case KVD_DTYPE_BF16:
		return bf16_vec((const uint16_t *)src + i);
	default:
		return vload((const float *)src + i);
	}
}

/* to_f32_t() for one dtype: inlined per dtype, so that the switch above folds away. */
static inline __attribute__((always_inline)) void
to_f32_t_as(const void *src, uint32_t dtype, size_t stride, uint32_t rows, uint32_t cols,
	    float scale, float *dst, size_t ldd) {
	vf s = vset1(scale);
	uint32_t r0 = 0, c0;

	for (; r0 + W <= rows; r0 += W) {
		for (c0 = 0; c0 + W <= cols; c0 += W) {
			vf v[W];

			UNROLL for (int i = 0; i < W; i++)
				v[i] = load_f32(src, dtype, (r0 + i) * stride + c0) * s;
			transpose(v);
			UNROLL for (int i = 0; i < W; i++)
				vstore(dst + (c0 + i) * ldd + r0, v[i]);
		}
		for (; c0 < cols; c0++)
			for (uint32_t i = 0; i < W; i++)
				dst[c0 * ldd + r0 + i] =
					kvd_load(src, dtype, (r0 + i) * stride + c0) * scale;
	}
	for (; r0 < rows; r0++)
		for (c0 = 0; c0 < cols; c0++)
			dst[c0 * ldd + r0] = kvd_load(src, dtype, r0 * stride + c0) * scale;
}

static void to_f32_t(const void *src, uint32_t dtype, size_t stride, uint32_t rows, uint32_t cols,
		     float scale, float *dst, size_t ldd) {
	switch (dtype) {
	case KVD_DTYPE_F16:
		to_f32_t_as(src, KVD_DTYPE_F16, stride, rows, cols, scale, dst, ldd);
		break;
	case KVD_DTYPE_BF16:
		to_f32_t_as(src, KVD_DTYPE_BF16, stride, rows, cols, scale, dst, ldd);
		break;
	default:
		to_f32_t_as(src, KVD_DTYPE_F32, stride, rows, cols, scale, dst, ldd);
	}
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
	/* |n| <= 127 after the clamp, so e is a valid exponent field; a NaN x is NaN in r and
	 * p already, and stays NaN through the selects below. */
	e = (__builtin_convertvector(n, vi) + 127) << 23;
	p = p * (vf)e;
	p = vsel(x < vset1(-87.33654f), vset1(0.0f), p);
	return vsel(x > vset1(88.72283f), vset1(INFINITY), p);
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

static void axpby(size_t n, float a, const float *x, float b, float *y) {
	vf av = vset1(a), bv = vset1(b);
	size_t i = 0;

	for (; i + W <= n; i += W)
		vstore(y + i, av * vload(x + i) + bv * vload(y + i));
	for (; i < n; i++)
		y[i] = a * x[i] + b * y[i];
}

/* ---- ranking keys ---- */

/* Whether any lane of a mask (lanes all ones or all zeros) is set. */
static inline int vany(vu m) {
#if W == 16 && defined(__AVX512F__)
	return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif W == 8 && defined(__AVX2__)
	return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#elif W == 4 && defined(__SSE2__)
	return _mm_movemask_epi8((__m128i)m) != 0;
#else
	uint32_t any = 0;

	for (int l = 0; l < W; l++)
		any |= m[l];
	return any != 0;
#endif
}

/*
 * Keys in the ranking order of simd.h's rank ops: sign-magnitude to offset binary
 * (2^31 + x for x >= 0, 2^31 - |x| below), so that -0 and +0 share one key, then every NaN
 * to 0, below -inf's 2^23.
 */
static inline vu rank_keys(vf x) {
	vu u = (vu)x, a = u & 0x7fffffffu, neg = (vu)((vi)u >> 31);

	return (0x80000000u + ((a ^ neg) - neg)) & ~(vu)(a > 0x7f800000u);
}

/* W elements from x + i, or the n - i < W left padded with NaN, and a mask of the real ones. */
static inline vf load_tail(const float *x, size_t i, size_t n, vu *valid) {
	float buf[W];
	vu lane;

	for (int l = 0; l < W; l++) {
		lane[l] = l;
		buf[l] = i + l < n ? x[i + l] : NAN;
	}
	*valid = (vu)(lane < (vu){} + (uint32_t)(n - i));
	return vload(buf);
}

static void rank_hist(const float *x, size_t n, uint32_t shift, uint32_t *hist) {
	size_t i = 0;
	vu b, valid;

	for (; i + W <= n; i += W) {
		b = rank_keys(vload(x + i)) >> shift;
		UNROLL for (int l = 0; l < W; l++)
			hist[b[l]]++;
	}
	if (i < n) {
		b = rank_keys(load_tail(x, i, n, &valid)) >> shift;
		for (int l = 0; i + l < n; l++)
			hist[b[l]]++;
	}
}

/*
 * Appends the lanes of k that are set in m (a mask), with their positions i + lane, to
 * key[c ..] and pos[c ..] in lane order; returns the new count. Only the first `valid`
 * lanes may be set, and nothing is written past the appended entries. Branch-free where
 * the ISA compresses (AVX-512): whether a vector holds any wanted lane is a coin toss near
 * the K-th largest, and mispredicted branches cost more than the compress.
 */
static inline uint32_t append_lanes(vu k, vu m, uint32_t i, size_t valid, uint32_t *key,
				    uint32_t *pos, uint32_t c) {
#if W == 16 && defined(__AVX512F__)
	__mmask16 mk = _mm512_test_epi32_mask((__m512i)m, (__m512i)m);
	uint32_t nm = (uint32_t)__builtin_popcount(mk);
	__mmask16 head = (__mmask16)((1u << nm) - 1);
	__m512i p = _mm512_add_epi32(_mm512_set1_epi32((int)i),
				     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
						       14, 15));

	(void)valid;
	_mm512_mask_storeu_epi32(key + c, head, _mm512_maskz_compress_epi32(mk, (__m512i)k));
	_mm512_mask_storeu_epi32(pos + c, head, _mm512_maskz_compress_epi32(mk, p));
	return c + nm;
#else
	/* Every lane is written at c, which only the set ones advance; c stays below the
	 * number of elements before lane l, so the writes stay in bounds. */
	if (!vany(m))
		return c;
	for (int l = 0; l < W && (size_t)l < valid; l++) {
		key[c] = k[l];
		pos[c] = i + l;
		c += m[l] & 1;
	}
	return c;
#endif
}

/* Elements per chunk of rank_scan(): its per-lane position sums, relative to the chunk's
 * start, stay below 2^32 (W lanes share the chunk). */
#define SCAN_CHUNK 65536u

static uint64_t rank_scan(const float *x, size_t n, uint32_t lo, uint32_t hi, uint32_t *key,
			  uint32_t *pos, uint32_t *n_band, uint32_t *n_above) {
	uint64_t sum = 0;
	uint32_t c = 0, above_total = 0;
	vu lane;

	for (int l = 0; l < W; l++)
		lane[l] = l;
	for (size_t c0 = 0; c0 < n; c0 += SCAN_CHUNK) {
		size_t c1 = n - c0 < SCAN_CHUNK ? n : c0 + SCAN_CHUNK;
		vu psum = {}, cnt = {}, rel = lane;

		for (size_t i = c0; i < c1; i += W, rel += W) {
			vu valid = ~(vu){}, k, above, in;

			k = rank_keys(i + W <= c1 ? vload(x + i) : load_tail(x, i, c1, &valid));
			above = (vu)(k > hi) & valid;
			in = (vu)(k >= lo) & ~above & valid;
			psum += rel & above;
			cnt -= above;
			c = append_lanes(k, in, (uint32_t)i, c1 - i, key, pos, c);
		}
		for (int l = 0; l < W; l++) {
			sum += psum[l] + (uint64_t)c0 * cnt[l];
			above_total += cnt[l];
		}
	}
	*n_band = c;
	*n_above = above_total;
	return sum;
}

const struct kvd_simd_ops SIMD_OPS = {
	.name = SIMD_NAME,
	.width = W,
	.gemm = gemm,
	.to_f32 = to_f32,
	.to_f32_t = to_f32_t,
	.quad_upper = quad_upper,
	.max = vmax,
	.exp_sum = exp_sum,
	.scale = vscale,
	.axpy = axpy,
	.sq_axpy = sq_axpy,
	.mul_add = mul_add,
	.dot = dot,
	.axpby = axpby,
	.rank_hist = rank_hist,
	.rank_scan = rank_scan,
};
