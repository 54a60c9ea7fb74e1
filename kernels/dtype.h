/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Element types of K/V and query tensors, and their conversion to fp32. Every kernel
 * accumulates in fp32 whatever its inputs are. The numbers are those of the wire protocol
 * and of kvd.h (KVD_DTYPE_*), so that a model's dtype passes straight through.
 */

#include <stdint.h>
#include <string.h>

#define KVD_KERNEL_F16 1
#define KVD_KERNEL_BF16 2
#define KVD_KERNEL_F32 3

static inline float kvd_bf16_to_f32(uint16_t h) {
	uint32_t u = (uint32_t)h << 16;
	float f;

	memcpy(&f, &u, 4);
	return f;
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
	case KVD_KERNEL_F16:
		return kvd_f16_to_f32(((const uint16_t *)row)[i]);
	case KVD_KERNEL_BF16:
		return kvd_bf16_to_f32(((const uint16_t *)row)[i]);
	default:
		return ((const float *)row)[i];
	}
}

static inline size_t kvd_dtype_size(uint32_t dtype) {
	return dtype == KVD_KERNEL_F32 ? 4 : dtype == KVD_KERNEL_F16 || dtype == KVD_KERNEL_BF16 ? 2 : 0;
}

/* Converts n elements of a row to fp32. */
static inline void kvd_row_to_f32(const void *row, uint32_t dtype, size_t n, float *out) {
	if (dtype == KVD_KERNEL_F32) {
		memcpy(out, row, n * sizeof(float));
		return;
	}
	for (size_t i = 0; i < n; i++)
		out[i] = kvd_load(row, dtype, i);
}
