/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Vector building blocks of the optimised CPU kernels (internal to kernels/): a small
 * row-major sgemm, dtype conversion, and the row operations of a softmax. One source
 * (simd-impl.h) is compiled for AVX-512, for AVX2+FMA+F16C and for baseline x86-64 (SSE2,
 * or whatever the target's generic vectors are), and kvd_simd() picks the widest the CPU
 * and the OS support, once, so that the binary runs on any x86-64.
 *
 * All accumulation is fp32. Results differ from the plain loops of the *_ref.c kernels by
 * rounding only (FMA contraction, summation order, the polynomial exp), which is what the
 * atol + |ref|*rtol comparisons of the kernel tests allow for.
 *
 * Thread-safety: the table is immutable once chosen; every function is reentrant.
 */

#include <stddef.h>
#include <stdint.h>

struct kvd_simd_ops {
	const char *name;
	uint32_t width; /* fp32 lanes */
	/*
	 * c[m][n] = a[m][k] * b[k][n] (accumulate 0) or c += a * b (accumulate 1); row-major
	 * with leading dimensions.
	 */
	void (*gemm)(uint32_t m, uint32_t n, uint32_t k, const float *a, size_t lda,
		     const float *b, size_t ldb, float *c, size_t ldc, int accumulate);
	/*
	 * out[j] = x_j U x_j^T for the n vectors x_j stored as the columns of xt (element a of
	 * x_j at xt[a * ldx + j]) and U [d][d] upper triangular (entries below the diagonal
	 * must be 0): d(d+1)/2 + d multiply-adds per vector (and a few more on the diagonal
	 * blocks of the micro-tiles), what a quadratic form with a symmetric matrix needs.
	 * gram.h's kvd_gram_fold() makes U from such a matrix.
	 */
	void (*quad_upper)(uint32_t d, const float *u, const float *xt, size_t ldx, uint32_t n,
			   float *out);
	/* n elements of dtype (KVD_KERNEL_*) to fp32, times scale. */
	void (*to_f32)(const void *src, uint32_t dtype, size_t n, float scale, float *dst);
	/*
	 * The transpose: dst[c * ldd + r] = src[r * stride + c] * scale for rows r < rows and
	 * columns c < cols of src (strides in elements), W x W blocks at a time in registers.
	 */
	void (*to_f32_t)(const void *src, uint32_t dtype, size_t stride, uint32_t rows,
			 uint32_t cols, float scale, float *dst, size_t ldd);
	/* The largest element (NaN if any element is NaN; -inf for n == 0). */
	float (*max)(const float *x, size_t n);
	/* x[i] = exp(x[i] - sub); returns the fp32 sum of the results. */
	float (*exp_sum)(float *x, size_t n, float sub);
	/* x[i] *= s */
	void (*scale)(float *x, size_t n, float s);
	/* y[i] += a * x[i] */
	void (*axpy)(size_t n, float a, const float *x, float *y);
	/* y[i] += a * x[i] * x[i] */
	void (*sq_axpy)(size_t n, float a, const float *x, float *y);
	/* acc[i] += x[i] * y[i] */
	void (*mul_add)(size_t n, const float *x, const float *y, float *acc);
	/* sum x[i] * y[i] */
	float (*dot)(size_t n, const float *x, const float *y);
	/* y[i] = a * x[i] + b * y[i] */
	void (*axpby)(size_t n, float a, const float *x, float b, float *y);
	/*
	 * Ranking by value (smooth.h's top-K order): each element has a 32-bit key, larger for
	 * larger values, one key for -0 and +0, key 0 (the lowest) for every NaN.
	 * rank_hist adds one to hist[key >> shift] per element. rank_scan returns the sum of
	 * the positions i (0-based) whose key exceeds hi, their number in *n_above, and
	 * appends the key and position of every element with lo <= key <= hi, in position
	 * order, to key[] and pos[] (room for n each), their number in *n_band.
	 */
	void (*rank_hist)(const float *x, size_t n, uint32_t shift, uint32_t *hist);
	uint64_t (*rank_scan)(const float *x, size_t n, uint32_t lo, uint32_t hi, uint32_t *key,
			      uint32_t *pos, uint32_t *n_band, uint32_t *n_above);
};

/*
 * The ops for this CPU: AVX-512 when the CPU and the OS support it, else AVX2+FMA+F16C,
 * else generic. The environment variable KVD_SIMD (avx512, avx2, generic) caps the choice,
 * so that tests and benchmarks can run every path on one machine; a name the CPU cannot
 * run falls back to the best it can.
 */
const struct kvd_simd_ops *kvd_simd(void);

/* The ops of one path by name, or NULL if unknown or unsupported here (for tests). */
const struct kvd_simd_ops *kvd_simd_get(const char *name);

/* Makes kvd_simd() return ops (for tests); NULL restores the automatic choice. */
void kvd_simd_override(const struct kvd_simd_ops *ops);

/* The paths, defined by simd-*.c (the x86 ones only on x86). */
extern const struct kvd_simd_ops kvd_simd_avx512, kvd_simd_avx2, kvd_simd_generic;
