/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * LaProx-style output-aware scores (docs/algorithms.md §2.2, §6, §7.1). The layer output over
 * the window is Y = sum_h A_h V_h W_o^h: one matrix product whose inner index is (query
 * head, token), and evicting a kv entry deletes inner indices: column-row subset selection.
 * The published method's exact formulas are unknown (§9); these are the note's
 * reconstruction:
 *
 *   per head (diagonal):  c_h,i = ||A_h[:, i]||_2 * ||v_i W_o^h||_2
 *                               = ||A_h[:, i]||_2 * sqrt(v_i G_h v_i^T)
 *   GQA-joint (one kv entry serves the g query heads of its group, deleted together):
 *     c_i^2 = || sum_{h in group} A_h[:, i] (x) v_i W_o^h ||_F^2
 *           = sum_{h,h'} (A_h[:, i] . A_h'[:, i]) * v_i G_hh' v_i^T
 *     the exact Frobenius norm of the group's contribution (clamped at >= 0 before the
 *     root against rounding); the sum of the diagonal costs is its triangle upper bound.
 *
 * Only the prefix tokens i < L - w are scored (policies keep the window). A_h[:, i] is the
 * column over the w window rows, as kvd_attn_head() writes it. Without W_o (gram NULL)
 * G_hh' is the identity for h = h' and 0 otherwise (the heads' outputs occupy disjoint
 * coordinates of the concatenation), so ||v_i||_2 takes the place of ||v_i W_o^h||_2.
 *
 * Normalisation (§7.1): N1 turns a (sequence, layer)'s costs into shares of its total,
 * p = c / sum c, so that a global top-k across layers, sequences and models compares like
 * with like; N2 multiplies the shares by a per-layer weight lambda (calibrated sensitivity).
 *
 * Each kernel has a reference (laprox_ref.c, double) and an optimised path (laprox.c),
 * compared by tests/kernels/test-laprox.c.
 */

#include <stddef.h>
#include <stdint.h>

#include "attn.h"

/*
 * Diagonal cost of query head h into cost[L - w]: probs is A_h ([w][L]), gram G_h
 * ([d][d]) or NULL, vgv the cached v G_h v^T of the prefix ([L - w]) or NULL to compute
 * it. in->v must be set. Returns 0, -EINVAL or -ENOMEM.
 */
int kvd_laprox_head_ref(const struct kvd_attn_in *in, uint32_t h, const float *probs,
			const float *gram, const float *vgv, float *cost);
int kvd_laprox_head(const struct kvd_attn_in *in, uint32_t h, const float *probs,
		    const float *gram, const float *vgv, float *cost);

/*
 * Joint cost of kv head kv into cost[L - w]: probs[j] is A_h of the group's j-th query
 * head h = kv*g + j (g = H/Hkv), gram_group the group's Gram block matrix
 * ([g*d][g*d], kvd_gram(wo, kv*g, g, ...)) or NULL. Returns 0, -EINVAL or -ENOMEM.
 */
int kvd_laprox_group_ref(const struct kvd_attn_in *in, uint32_t kv, const float *const *probs,
			 const float *gram_group, float *cost);
int kvd_laprox_group(const struct kvd_attn_in *in, uint32_t kv, const float *const *probs,
		     const float *gram_group, float *cost);

/*
 * N1 (and N2): c[i] = lambda * c[i] / sum c over the n costs of one (sequence, layer), in
 * place. The sum (double) runs over the finite entries; when it is not positive the costs
 * are only multiplied by lambda. NaN stays NaN and +inf stays +inf (a share cannot make
 * them finite without hiding them). Returns 0, or -EINVAL for a NULL c with n > 0 or a
 * lambda that is not finite and >= 0.
 */
int kvd_laprox_normalize(float *c, size_t n, float lambda);
