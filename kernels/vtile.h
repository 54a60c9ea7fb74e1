/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Value tiles of the optimised output-aware kernels (restkv.c, laprox.c; internal): rows
 * of one kv head of in->v converted to fp32, row-major where they are summed with weights
 * (o = a V), or transposed, a token per column, where per-token quadratic forms and dots
 * are formed across tokens at once.
 */

#include <string.h>

#include "attn.h"
#include "dtype.h"
#include "simd.h"

static inline const char *kvd_vrow_at(const struct kvd_attn_in *in, uint32_t g, uint32_t i) {
	return (const char *)in->v +
	       (g * in->v_head_stride + (size_t)i * in->v_row_stride) * kvd_dtype_size(in->dtype);
}

/* Rows i0 .. i0+nt-1 of kv head g into vt[nt][d]: one call when the rows are contiguous,
 * since per-row calls cost as much as the conversion itself at d = 128. */
static inline void kvd_vtile(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in,
			     uint32_t g, uint32_t i0, uint32_t nt, float *vt) {
	if (in->v_row_stride == in->dim) {
		ops->to_f32(kvd_vrow_at(in, g, i0), in->dtype, (size_t)nt * in->dim, 1.0f, vt);
		return;
	}
	for (uint32_t r = 0; r < nt; r++)
		ops->to_f32(kvd_vrow_at(in, g, i0 + r), in->dtype, in->dim, 1.0f,
			    vt + (size_t)r * in->dim);
}

/* The same rows transposed into vt[d][ld]: column k is the value of token i0 + k. */
static inline void kvd_vtile_t(const struct kvd_simd_ops *ops, const struct kvd_attn_in *in,
			       uint32_t g, uint32_t i0, uint32_t nt, float *vt, size_t ld) {
	ops->to_f32_t(kvd_vrow_at(in, g, i0), in->dtype, in->v_row_stride, nt, in->dim, 1.0f, vt,
		      ld);
}

/*
 * q[k] = v_k U v_k^T for the nt columns of a transposed tile (vt[d][ld]), with U a folded
 * Gram block (kvd_gram_fold()), or ||v_k||^2 when u is NULL (G the identity).
 */
static inline void kvd_vtile_quad(const struct kvd_simd_ops *ops, uint32_t d, uint32_t nt,
				  const float *vt, size_t ld, const float *u, float *q) {
	if (u) {
		ops->quad_upper(d, u, vt, ld, nt, q);
		return;
	}
	memset(q, 0, nt * sizeof(float));
	for (uint32_t a = 0; a < d; a++)
		ops->sq_axpy(nt, 1.0f, vt + (size_t)a * ld, q);
}
