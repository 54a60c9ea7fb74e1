/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Gram matrices of the output projection (docs/algorithms.md §6). The attention output of a
 * layer is y = sum_h o_h W_o^h, where W_o^h (d x C) is the slice of the projection that
 * belongs to query head h. With HF's o_proj layout, wo is [C][H*d] and
 * W_o^h = wo[:, h*d:(h+1)*d]^T. Then ||x W_o^h||^2 = x G_h x^T with G_h = W_o^h W_o^h^T
 * (d x d), and across heads ||sum_h z_h W_o^h||^2 = sum_{h,h'} z_h G_{hh'} z_h'^T with the
 * cross blocks G_{hh'} = W_o^h W_o^h'^T. These are static per model and layer: computed
 * once (C*d^2 multiply-adds per block), they replace the d*C projection of every token by
 * d^2 (or d, with a cached v G v^T) work.
 *
 * The reference (gram_ref.c) accumulates in double; the optimised path is an fp32 gemm.
 * All functions are reentrant.
 */

#include <stddef.h>
#include <stdint.h>

/* A view of wo: element (c, j) is at w + (c * row_stride + j) * dtype_size. */
struct kvd_wo {
	uint32_t dtype;           /* KVD_DTYPE_F16, _BF16 or _F32 */
	uint32_t c_out;           /* C */
	uint32_t heads, dim;      /* H, d: wo has H*d columns */
	const void *w;
	size_t row_stride;        /* >= heads * dim */
};

/* Returns 0 if wo is consistent, else -EINVAL. */
int kvd_wo_check(const struct kvd_wo *wo);

/*
 * The Gram block matrix of the nh heads h0 .. h0+nh-1 into g[nh*d][nh*d], row-major:
 * g[(i*d + a) * nh*d + j*d + b] = (G_{h0+i, h0+j})[a][b] = sum_c wo[c][(h0+i)*d+a] *
 * wo[c][(h0+j)*d+b]. nh = 1 gives G_h; nh = g (a GQA group) gives the cross blocks the
 * joint forms need. Returns 0, -EINVAL (bad view or head range), or -ENOMEM (the optimised
 * path converts the C x nh*d slice to fp32 once).
 */
int kvd_gram_ref(const struct kvd_wo *wo, uint32_t h0, uint32_t nh, float *g);
int kvd_gram(const struct kvd_wo *wo, uint32_t h0, uint32_t nh, float *g);

/*
 * The fold of the d x d block at g (row stride ld) into an upper triangle, times scale:
 * u[a][b] = scale * (g[a][b] + g[b][a]) for a < b, scale * g[a][a] on the diagonal, 0
 * below. Then x u x^T = scale * x g x^T for every x, with half the products (simd.h's
 * quad_upper); for a cross block G_hh' also x G_h'h x^T = x G_hh' x^T, so one fold serves
 * both. scale multiplies each term before the sum: exact for a power of two, such as the
 * 1 and 2 the kernels use.
 */
void kvd_gram_fold(uint32_t d, const float *g, size_t ld, float scale, float *u);
