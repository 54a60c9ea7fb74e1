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
 * Moving a sequence between the pool and the tier takes three steps, so that the copy
 * runs off the loop (mover.h): *_begin on the loop sets the move up, tier_move_run on a
 * worker copies (and sums, or checks the sums), *_end on the loop finishes it. Between
 * begin and end the worker reads the pool through the daemon's mapping: the caller holds
 * pool_readers_begin() (pool.h) for it.
 */
struct tier_move;

/*
 * Sets up moving q (resident, unpinned, no plan waiting, its engine's events done: the
 * caller checks) out of the pool: takes its segments, dropping the oldest entries (never
 * one a recall reads) while the tier lacks room. Changes nothing of q. Returns 0, or
 * -ENODATA (q holds no block), -EFBIG (q is larger than the whole tier), -ENOSPC (the
 * room is held by recalls running), -ENOMEM (memory, or metadata past metadata_max).
 */
int tier_offload_begin(struct tier *tr, struct seq *q, struct pool *p, uint64_t metadata_max,
                       struct tier_move **ret);

/*
 * Finishes moving q out (q NULL: it went away meanwhile): when the copy worked and q was
 * neither pinned nor rewritten since the begin (its descriptor's generation), its blocks
 * go back to the pool (emptied chunks into *emptied) and its tables read empty (one
 * rewrite, an epoch bump); else nothing changes and the segments go back. Frees mv.
 * Returns 0, -ECANCELED (q gone, pinned or rewritten meanwhile), or the copy's -errno.
 */
int tier_offload_end(struct tier *tr, struct tier_move *mv, struct seq *q, struct pool *p,
                     struct seq_emptied *emptied);

/*
 * Sets up bringing q back: new blocks for it (seq_alloc_blocks: chunks that conn_id did
 * not hold are listed in *g, which has room for every chunk of the pool). Changes nothing
 * of q's tables. Returns 0, or -ENOSPC, -EDQUOT (g->short_bytes), -ENOMEM.
 */
int tier_recall_begin(struct tier *tr, struct seq *q, struct pool *p, uint64_t conn_id,
                      struct seq_granted *g, struct seq_emptied *emptied,
                      struct tier_move **ret);

/*
 * Finishes bringing q back (q NULL: it went away meanwhile, and tier_detach() gave its
 * entry to the move): when every block matched its sum and was written, q's tables are
 * its own again (one rewrite, an epoch bump) and its entry goes; else the new blocks go
 * back (conn_id stops holding the chunks of *g) and q is lost. Frees mv. Returns 0,
 * -ECANCELED (q gone), -EBADMSG (a block failed its sum) or the backend's -errno.
 */
int tier_recall_end(struct tier *tr, struct tier_move *mv, struct seq *q, struct pool *p,
                    uint64_t conn_id, struct seq_granted *g, struct seq_emptied *emptied);

/* The copy, on a worker thread: touches only what the move holds. */
void tier_move_run(struct tier_move *mv);

/* K/V bytes a move copies. */
uint64_t tier_move_bytes(const struct tier_move *mv);

/* Drops q's entry: q stays empty, lost (behaves as evicted, seq.recall KVD_RECALL_LOST);
 * counts it in lost_no_memory (the caller's reason: no memory for it in time). */
void tier_lose(struct tier *tr, struct seq *q);

/* Drops q's entry, if any, as q goes away (released, its connection closed). */
void tier_forget(struct tier *tr, struct seq *q);

/* Takes q's entry out of the tier's list and counts without freeing it, for a recall that
 * reads it while q goes away: tier_recall_end() frees it. Returns it (NULL: none). */
struct tier_seq *tier_detach(struct tier *tr, struct seq *q);
