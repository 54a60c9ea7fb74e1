/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The host tier: host memory the daemon owns, with a budget of its own (host-tier-size),
 * that holds sequences moved out of the pool whole (offload.h says which and when) until
 * their engine needs them again: the next pin or grow brings them back (a recall), into
 * new blocks, with the same bytes, token counts and original positions.
 *
 * A sequence moved out keeps its descriptor, which shows every table empty (tokens 0, no
 * compensation blocks) until the recall; its blocks go back to the pool. Every block's
 * bytes carry a checksum, taken when they leave the pool and verified before they go
 * back: a block that does not match is never served, and the sequence is then lost, as is
 * one that a full tier drops to make room (oldest moved out first) or whose recall found
 * no memory in time. A lost sequence behaves as evicted whole: its tables stay empty and
 * its engine, told at its next pin (KVD_RECALL_LOST), prefills it again.
 *
 * The tier's bytes never count against the pool budget or a tenant's min and max; its
 * entries' metadata counts against max-metadata-bytes (server.metadata_bytes). A
 * sequence released, or a tenant forgotten with it, drops its entry.
 *
 * The checksum is for corruption, not tampering: tier memory is the daemon's own and
 * never leaves it.
 *
 * Test hook (builds with -Dtest_hooks=true): with KVD_TEST_TIER_CORRUPT in the environment,
 * each sequence moved out gets one bit of its last block flipped after its checksum was
 * taken, so that its recall must find it.
 */

#include <stdbool.h>
#include <stdint.h>

#include "pool.h"
#include "seq.h"

/* What memory pressure does with a tenant's KV (kvd.conf(5), tier): evict tokens, or move
 * idle sequences whole to the host tier first. */
enum tier_mode {
	TIER_DROP,
	TIER_HOST,
	_TIER_MODE_MAX,
};

/* "drop", "host"; NULL for other values. */
const char *tier_mode_to_string(int v);
/* The mode called name, or -EINVAL. */
int tier_mode_from_string(const char *name);

struct tier_seq;

struct tier {
	/* host-tier-size in whole segments of the pool's chunk size, one mapping made at
	 * start and touched all through; 0: no host tier. A segment holds blocks of one
	 * sequence. */
	uint64_t budget_bytes;
	uint64_t seg_bytes;
	unsigned char *base;
	uint32_t n_segs;
	uint32_t *free_segs;          /* a stack of the free segments' indices */
	uint32_t n_free;
	uint64_t used_bytes;          /* of the segments held */
	uint32_t n_seqs;
	/* Oldest moved out first: what a full tier drops. */
	struct tier_seq *oldest, *newest;
	uint64_t *metadata_bytes;     /* the server's count, which the entries' metadata joins */
	uint64_t meta_bytes;          /* of which the tier's */
	/* Since the start: sequences moved out and back, their bytes and the time it took. */
	uint64_t offloads, offload_bytes, offload_ns;
	uint64_t recalls, recall_bytes, recall_ns;
	/* Sequences lost: dropped by a full tier, a block failing its checksum (or a failing
	 * device write) at the recall, no pool memory for the recall within grant-wait. */
	uint64_t lost_full, lost_corrupt, lost_no_memory;
	bool corrupt;                 /* KVD_TEST_TIER_CORRUPT */
};

/* A tier of budget bytes in whole segments of segment_bytes (the pool's chunk size; below
 * one segment: none); metadata_bytes is the server's metadata count. Returns 0, -ENOMEM
 * (the mapping), -EINVAL (more than 2^32 segments). */
int tier_new(uint64_t budget, uint64_t segment_bytes, uint64_t *metadata_bytes,
             struct tier **ret);
/* After every sequence was freed (tier_forget). Returns NULL. */
struct tier *tier_free(struct tier *tr);

/*
 * Moves q (unpinned, no plan waiting, its engine's events done: the caller checks) out of
 * the pool into the tier, dropping the oldest entries while the tier lacks room; its
 * freed blocks' chunks, when emptied, go to *emptied. One descriptor rewrite and an epoch
 * bump. Returns 0, or, with nothing changed: -ENODATA (q holds no block), -EFBIG (q is
 * larger than the whole tier), -ENOMEM (host memory, or metadata past metadata_max), or
 * the backend's -errno reading a block.
 */
int tier_offload(struct tier *tr, struct seq *q, struct pool *p, uint64_t metadata_max,
                 struct seq_emptied *emptied);

/*
 * Brings q back from the tier into new blocks of the pool (seq_alloc_blocks: chunks that
 * conn_id did not hold are listed in *g, which has room for every chunk of the pool). One
 * descriptor rewrite and an epoch bump. Returns 0, or: -ENOSPC, -EDQUOT (g->short_bytes),
 * -ENOMEM, with q still in the tier; -EBADMSG (a block failed its checksum) or the
 * backend's -errno writing a block, with q lost (tier_lose).
 */
int tier_recall(struct tier *tr, struct seq *q, struct pool *p, uint64_t conn_id,
                struct seq_granted *g, struct seq_emptied *emptied);

/* Drops q's entry: q stays empty, lost (behaves as evicted, seq.recall KVD_RECALL_LOST);
 * counts it in lost_no_memory (the caller's reason: no memory for it in time). */
void tier_lose(struct tier *tr, struct seq *q);

/* Drops q's entry, if any, as q goes away (released, its connection closed). */
void tier_forget(struct tier *tr, struct seq *q);
