/* SPDX-License-Identifier: MIT */
/* The AVX2 path of simd.h: 8 lanes, a 6x2-vector (6x16) gemm micro-tile (16 ymm registers). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define SIMD_W 8
#define SIMD_MR 6
#define SIMD_MR2 6
#define SIMD_NV 2
#define SIMD_OPS kvd_simd_avx2
#define SIMD_NAME "avx2"
#include "simd-impl.h"
#endif
