/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Compensation (docs/architecture.md §5): what the daemon keeps, per (sequence, layer,
 * kv head), of the K/V its evictions drop, in the pool blocks the descriptor lists. One
 * interface over the kinds, so that rounds and compaction do not care which:
 *   KVD_COMPENSATION_MOMENTS  MomentKV's moments (kernels/moments.h), merged exactly;
 *   KVD_COMPENSATION_LATENT   IndexMem's latent memory (kernels/indexmem.h), a sum.
 * A round summarises what it drops into a "fold" on its worker (compensate_batch), and the
 * compaction that drops the tokens merges the fold into the blocks (compensate_merge), so
 * that a plan that is never applied changes nothing. Pure functions; any thread.
 */

#include <stddef.h>
#include <stdint.h>

/* Floats of one (layer, kv head)'s fold of dimension d: 0 for KVD_COMPENSATION_NONE. */
size_t compensate_floats(uint32_t compensation, uint32_t d);

/*
 * Summarises the n rows k[i * d], v[i * d] (dtype KVD_DTYPE_*, d elements each) into fold
 * (compensate_floats() floats). Returns 0, or -EINVAL (no compensation), -ENOMEM.
 */
int compensate_batch(uint32_t compensation, const void *k, const void *v, uint32_t dtype,
                     uint32_t n, uint32_t d, float *fold);

/*
 * Merges a fold of n tokens into a compensation block (its header and arrays, as kvd.h
 * lays them out for head dimension d). Returns 0, or -EINVAL, -EOVERFLOW (the count would
 * wrap: the block is unchanged).
 */
int compensate_merge(uint32_t compensation, void *block, uint32_t d, const float *fold, uint64_t n);
