/* SPDX-License-Identifier: MIT */
/* The AVX-512 path of simd.h: 16 lanes, a 4x4-vector (4x64) gemm micro-tile. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define SIMD_W 16
#define SIMD_MR 4
#define SIMD_MR2 8
#define SIMD_NV 4
#define SIMD_OPS kvd_simd_avx512
#define SIMD_NAME "avx512"
#include "simd-impl.h"
#endif
