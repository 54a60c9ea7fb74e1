/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Element types of K/V and query tensors (KVD_DTYPE_*, kvd-abi.h, the numbers of the wire
 * protocol, so that a model's dtype passes straight through), and their conversions. Every
 * kernel accumulates in fp32 whatever its inputs are.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvd/kvd-abi.h"

static inline float kvd_bf16_to_f32(uint16_t h) {
	uint32_t u = (uint32_t)h << 16;
	float f;

	memcpy(&f, &u, 4);
	return f;
}

/* binary32 to IEEE binary16, rounded to nearest even: NaN stays NaN, what is past the
 * largest finite value becomes infinity, and what is below the smallest normal one becomes
 * a signed zero (K/V and queries never need binary16's subnormals). */
static inline uint16_t kvd_f32_to_f16(float f) {
	uint32_t u, sign, e;
	int32_t exp;

	memcpy(&u, &f, 4);
	sign = (u >> 16) & 0x8000;
	if (isnan(f))
		return (uint16_t)(sign | 0x7e00);
	exp = (int32_t)((u >> 23) & 0xff) - 127 + 15;
	if (exp >= 31)
		return (uint16_t)(sign | 0x7c00);
	if (exp <= 0)
		return (uint16_t)sign;
	e = ((uint32_t)exp << 10) | ((u >> 13) & 0x3ff);
	/* Rounding may carry into the exponent, and from the largest finite to infinity. */
	if ((u & 0x1fff) > 0x1000 || ((u & 0x1fff) == 0x1000 && (e & 1)))
		e++;
	return (uint16_t)(sign | e);
}

/* IEEE binary16 to binary32, subnormals, infinities and NaN included. */
static inline float kvd_f16_to_f32(uint16_t h) {
	uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
	float f;

	if (exp == 0x1f)
		u = sign | 0x7f800000u | (man << 13);
	else if (exp != 0)
		u = sign | ((exp + 112) << 23) | (man << 13);
	else if (man == 0)
		u = sign;
	else {
		/* Subnormal: normalise the mantissa. */
		exp = 113;
		while (!(man & 0x400)) {
			man <<= 1;
			exp--;
		}
		u = sign | (exp << 23) | ((man & 0x3ff) << 13);
	}
	memcpy(&f, &u, 4);
	return f;
}

/* Element i of a row of the given dtype, as fp32. */
static inline float kvd_load(const void *row, uint32_t dtype, size_t i) {
	switch (dtype) {
	case KVD_DTYPE_F16:
		return kvd_f16_to_f32(((const uint16_t *)row)[i]);
	case KVD_DTYPE_BF16:
		return kvd_bf16_to_f32(((const uint16_t *)row)[i]);
	default:
		return ((const float *)row)[i];
	}
}

static inline size_t kvd_dtype_size(uint32_t dtype) {
	return dtype == KVD_DTYPE_F32 ? 4 : dtype == KVD_DTYPE_F16 || dtype == KVD_DTYPE_BF16 ? 2 : 0;
}

/* Converts n elements of a row to fp32. */
static inline void kvd_row_to_f32(const void *row, uint32_t dtype, size_t n, float *out) {
	if (dtype == KVD_DTYPE_F32) {
		memcpy(out, row, n * sizeof(float));
		return;
	}
	for (size_t i = 0; i < n; i++)
		out[i] = kvd_load(row, dtype, i);
}
