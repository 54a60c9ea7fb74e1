/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Gather: the data movement of compaction. A table (one layer's, or one (layer, kv head)'s,
 * depending on the pool layout) is a list of blocks of block_tokens slots; slot s lives in
 * block s / block_tokens at row s % block_tokens. A slot is the K row and the V row of each
 * of the table's `heads` kv heads, laid out as proto/common/layout.h does: the K row of
 * (head h, row r) at (h * block_tokens + r) * row_bytes from the block's start, its V row
 * v_offset (half a block) further on.
 *
 * Gathering keep[0..n_keep) (ascending slot indices) writes kept slot keep[j] to slot j:
 * the survivors move down and keep their order, bit for bit, as daemon/eviction/compact.c does on
 * the CPU. Positions and other per-slot host metadata are the caller's (they live in the
 * sequence descriptor, not in pool memory).
 *
 * In place (dst_blocks NULL) the result is that of the sequential copy in ascending j:
 * since keep[j] >= j, every slot is read before it is overwritten. The CUDA version
 * (cuda-kernels.h) gets the same result in parallel through a staging buffer.
 */

#include <stdint.h>

struct kvd_gather_table {
	uint32_t block_tokens; /* slots per block */
	uint32_t heads;        /* kv heads per slot: kv_heads (per-layer layout) or 1 (per head) */
	uint64_t row_bytes;    /* one K or V row: head_dim * dtype size */
	uint64_t v_offset;     /* from a K row to its V row: block_bytes / 2 */
};

/* Returns 0 if t is consistent (non-zero sizes, V rows past the K rows), else -EINVAL. */
int kvd_gather_table_check(const struct kvd_gather_table *t);

/*
 * The reference gather in host memory: blocks[b] is the address of block b. keep must be
 * strictly ascending. Slots of src_blocks are copied to slots 0..n_keep-1 of dst_blocks, or
 * of src_blocks themselves when dst_blocks is NULL. Returns 0 or -EINVAL (bad table, NULL
 * arrays with n_keep > 0, keep not strictly ascending).
 */
int kvd_gather_ref(const struct kvd_gather_table *t, char *const *src_blocks,
		   char *const *dst_blocks, const uint32_t *keep, uint32_t n_keep);
