/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Geometry of blocks and sequence descriptors, written down once for both sides: the daemon
 * lays blocks out and fills descriptors with it, libkvd resolves addresses with it. The
 * layouts themselves are described at the top of kvd/kvd.h.
 */

#include <errno.h>
#include <stdint.h>

#include "digest.h"
#include "kvd/kvd-abi.h"

/* Blocks start at multiples of this many bytes inside a chunk. */
#define LAYOUT_BLOCK_ALIGN 64

static inline uint32_t layout_dtype_bytes(uint32_t dtype) {
	switch (dtype) {
	case KVD_DTYPE_F16:
	case KVD_DTYPE_BF16:
		return 2;
	case KVD_DTYPE_F32:
		return 4;
	default:
		return 0;
	}
}

static inline uint64_t layout_row_bytes(const struct kvd_seq_desc *d) {
	return (uint64_t)d->head_dim * layout_dtype_bytes(d->dtype);
}

static inline uint32_t layout_table(const struct kvd_seq_desc *d, uint32_t layer, uint32_t head) {
	return d->layout == KVD_LAYOUT_PER_HEAD ? layer * d->kv_heads + head : layer;
}

/* Bytes of a block's K and V: the whole block, or what precedes its index keys. */
static inline uint64_t layout_kv_bytes(const struct kvd_seq_desc *d) {
	return d->index_dim ? d->index_offset : d->block_bytes;
}

/* Byte offset of the K row of (head, row) inside its block; the V row is half the K and V
 * bytes on. */
static inline uint64_t layout_k_offset(const struct kvd_seq_desc *d, uint32_t head, uint32_t row) {
	uint64_t h = d->layout == KVD_LAYOUT_PER_HEAD ? 0 : head;
	return (h * d->block_tokens + row) * layout_row_bytes(d);
}

static inline uint64_t layout_v_offset(const struct kvd_seq_desc *d, uint32_t head, uint32_t row) {
	return layout_kv_bytes(d) / 2 + layout_k_offset(d, head, row);
}

/* Bytes of one index key, and the byte offset of row's inside its block (indexer only). */
static inline uint64_t layout_index_row_bytes(const struct kvd_seq_desc *d) {
	return (uint64_t)d->index_dim * layout_dtype_bytes(d->dtype);
}

static inline uint64_t layout_index_offset(const struct kvd_seq_desc *d, uint32_t row) {
	return d->index_offset + row * layout_index_row_bytes(d);
}

static inline const uint32_t *layout_tokens(const struct kvd_seq_desc *d) {
	return (const uint32_t *)((const char *)d + d->tokens_offset);
}

static inline const uint32_t *layout_positions(const struct kvd_seq_desc *d, uint32_t table) {
	return (const uint32_t *)((const char *)d + d->positions_offset) + (uint64_t)table * d->max_tokens;
}

static inline const struct kvd_block_ref *layout_blocks(const struct kvd_seq_desc *d, uint32_t table) {
	return (const struct kvd_block_ref *)((const char *)d + d->blocks_offset) +
	       (uint64_t)table * d->max_blocks;
}

/*
 * Digest of a sequence's resident K/V (see kvd_seq_digest): for each layer, kv head and
 * resident slot, the K row then the V row. block_addr resolves a block to an address in the
 * calling process, or NULL, which makes the digest fail with -EFAULT.
 */
typedef const void *(*layout_block_addr_fn)(void *userdata, struct kvd_block_ref ref);

static inline int layout_digest(const struct kvd_seq_desc *d, layout_block_addr_fn block_addr,
                                void *userdata, uint64_t *ret_digest, uint64_t *ret_bytes) {
	uint64_t h = DIGEST_INIT, bytes = 0, row = layout_row_bytes(d);

	for (uint32_t l = 0; l < d->layers; l++)
		for (uint32_t kh = 0; kh < d->kv_heads; kh++) {
			uint32_t t = layout_table(d, l, kh), n = layout_tokens(d)[t];
			const struct kvd_block_ref *blocks = layout_blocks(d, t);

			for (uint32_t i = 0; i < n; i++) {
				const char *b = block_addr(userdata, blocks[i / d->block_tokens]);
				uint32_t r = i % d->block_tokens;

				if (!b)
					return -EFAULT;
				h = digest_update(h, b + layout_k_offset(d, kh, r), row);
				h = digest_update(h, b + layout_v_offset(d, kh, r), row);
				bytes += 2 * row;
			}
		}
	*ret_digest = h;
	if (ret_bytes)
		*ret_bytes = bytes;
	return 0;
}
