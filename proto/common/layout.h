/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Geometry of blocks and sequence descriptors, written down once for both sides: the daemon
 * lays blocks out and fills descriptors with it, libkvd resolves addresses with it. The
 * layouts themselves are described at the top of kvd/kvd.h.
 */

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

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

/* The descriptor's arrays, in the descriptor at base, where its header g says they are: g
 * is base itself (layout_tokens() and co.), or a reader's checked copy of base's header. */
static inline const uint32_t *layout_tokens_at(const struct kvd_seq_desc *g, const void *base) {
	return (const uint32_t *)((const char *)base + g->tokens_offset);
}

static inline const uint32_t *layout_positions_at(const struct kvd_seq_desc *g, const void *base,
                                                  uint32_t table) {
	return (const uint32_t *)((const char *)base + g->positions_offset) +
	       (uint64_t)table * g->max_tokens;
}

static inline const struct kvd_block_ref *layout_blocks_at(const struct kvd_seq_desc *g,
                                                           const void *base, uint32_t table) {
	return (const struct kvd_block_ref *)((const char *)base + g->blocks_offset) +
	       (uint64_t)table * g->max_blocks;
}

static inline const uint32_t *layout_tokens(const struct kvd_seq_desc *d) {
	return layout_tokens_at(d, d);
}

static inline const uint32_t *layout_positions(const struct kvd_seq_desc *d, uint32_t table) {
	return layout_positions_at(d, d, table);
}

/* How many of the n ascending positions pos are below x: the slot of the first at x or
 * later. */
static inline uint32_t layout_slots_below(const uint32_t *pos, uint32_t n, uint64_t x) {
	uint32_t lo = 0, hi = n;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (pos[mid] < x)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static inline const struct kvd_block_ref *layout_blocks(const struct kvd_seq_desc *d, uint32_t table) {
	return layout_blocks_at(d, d, table);
}

/*
 * Copies the header of the descriptor of size bytes at d into *h, zero-extended (kvd-abi.h,
 * "How the shared headers grow"), with h->header_bytes set to the daemon's header size:
 * read from the descriptor when the daemon writes it (sized: KVD_FEATURE_SEQ_HEADER in its
 * HelloReply), else the lowest array offset, at most KVD_SEQ_DESC_HEADER_LEGACY_MAX. The
 * arrays must start at or after it (the caller checks). Returns 0, or -EPROTO.
 */
static inline int layout_desc_header(const void *d, uint64_t size, bool sized,
                                     struct kvd_seq_desc *h) {
	uint64_t n;

	if (size < KVD_SEQ_DESC_HEADER_MIN)
		return -EPROTO;
	memset(h, 0, sizeof(*h));
	memcpy(h, d, KVD_SEQ_DESC_HEADER_MIN);
	if (sized) {
		uint32_t w;

		if (size < sizeof(*h))
			return -EPROTO;
		memcpy(&w, (const char *)d + offsetof(struct kvd_seq_desc, header_bytes), sizeof(w));
		/* The field came with the header of this size; a larger one is a newer daemon's. */
		if (w < sizeof(*h) || w > size || w % 8 != 0)
			return -EPROTO;
		n = w;
	} else {
		n = h->tokens_offset;
		n = h->positions_offset < n ? h->positions_offset : n;
		n = h->blocks_offset < n ? h->blocks_offset : n;
		if (n < KVD_SEQ_DESC_HEADER_MIN)
			return -EPROTO;
		n = n < KVD_SEQ_DESC_HEADER_LEGACY_MAX ? n : KVD_SEQ_DESC_HEADER_LEGACY_MAX;
	}
	/* Read again, whole: the copy and its checks are what counts from here on. */
	memcpy(h, d, n < sizeof(*h) ? n : sizeof(*h));
	h->header_bytes = (uint32_t)n;
	return 0;
}

/*
 * The same for an observation buffer's header (size bytes at p): header_bytes 0 is a daemon
 * from before the field, whose header ends at the lower of stamps_offset and q_offset, at
 * most KVD_OBS_HEADER_LEGACY_MAX. Returns 0, or -EPROTO.
 */
static inline int layout_obs_header(const void *p, uint64_t size, struct kvd_obs_header *h) {
	uint64_t n;

	if (size < KVD_OBS_HEADER_MIN)
		return -EPROTO;
	memset(h, 0, sizeof(*h));
	memcpy(h, p, KVD_OBS_HEADER_MIN);
	if (h->header_bytes != 0) {
		if (h->header_bytes < sizeof(*h) || h->header_bytes > size || h->header_bytes % 8 != 0)
			return -EPROTO;
		n = h->header_bytes;
	} else {
		n = h->stamps_offset < h->q_offset ? h->stamps_offset : h->q_offset;
		if (n < KVD_OBS_HEADER_MIN)
			return -EPROTO;
		n = n < KVD_OBS_HEADER_LEGACY_MAX ? n : KVD_OBS_HEADER_LEGACY_MAX;
	}
	memcpy(h, p, n < sizeof(*h) ? n : sizeof(*h));
	h->header_bytes = (uint32_t)n;
	return 0;
}

/*
 * Digest of a sequence's resident K/V (see kvd_seq_digest): for each layer, kv head and
 * resident slot, the K row then the V row. g is the descriptor's header (geometry), d the
 * descriptor itself (its arrays): the same pointer where the header is the caller's own.
 * block_addr resolves a block to an address in the calling process, or NULL, which makes
 * the digest fail with -EFAULT.
 */
typedef const void *(*layout_block_addr_fn)(void *userdata, struct kvd_block_ref ref);

static inline int layout_digest(const struct kvd_seq_desc *g, const void *d,
                                layout_block_addr_fn block_addr, void *userdata,
                                uint64_t *ret_digest, uint64_t *ret_bytes) {
	uint64_t h = DIGEST_INIT, bytes = 0, row = layout_row_bytes(g);

	for (uint32_t l = 0; l < g->layers; l++)
		for (uint32_t kh = 0; kh < g->kv_heads; kh++) {
			uint32_t t = layout_table(g, l, kh), n = layout_tokens_at(g, d)[t];
			const struct kvd_block_ref *blocks = layout_blocks_at(g, d, t);

			for (uint32_t i = 0; i < n; i++) {
				const char *b = block_addr(userdata, blocks[i / g->block_tokens]);
				uint32_t r = i % g->block_tokens;

				if (!b)
					return -EFAULT;
				h = digest_update(h, b + layout_k_offset(g, kh, r), row);
				h = digest_update(h, b + layout_v_offset(g, kh, r), row);
				bytes += 2 * row;
			}
		}
	*ret_digest = h;
	if (ret_bytes)
		*ret_bytes = bytes;
	return 0;
}
