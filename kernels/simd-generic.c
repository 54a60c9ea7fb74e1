/* SPDX-License-Identifier: MIT */
/* The baseline path of simd.h: 4 lanes (SSE2 on x86-64, or the target's generic vectors). */
#define SIMD_W 4
#define SIMD_MR 4
#define SIMD_MR2 4
#define SIMD_NV 2
#define SIMD_OPS kvd_simd_generic
#define SIMD_NAME "generic"
#include "simd-impl.h"
