/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Compaction: how an eviction plan becomes free memory. Evicted slots leave their tables
 * and the survivors move down (seq_compact), so that a table's last blocks come free; then
 * a tenant's blocks move out of its emptiest chunks into free blocks of its others
 * (compact_chunks), so that whole chunks come free and go back to the pool.
 *
 * Both run on the event loop, only on sequences that are not pinned, move K/V through the
 * pool backend's copy (device memory on cuda), and rewrite each descriptor they touch
 * under its sequence lock (one generation step per call), so a client reading it sees
 * either the old tables or the new ones. Surviving K/V bytes and
 * their original positions are copied bit for bit.
 */

#include <stdint.h>

#include "pool.h"
#include "seq.h"

struct round_gpu;

/* The slots one table gives up, ascending and below the table's token count. */
struct compact_drop {
	uint32_t table;
	uint32_t n;
	const uint32_t *slots;
};

/*
 * Removes the slots of drops[0..n_drops) (at most one entry per table) from s. In each
 * table the survivors keep their order and move to the lowest slots: K and V rows (with
 * the per-layer layout a slot is the rows of every kv head), positions, and side[table][]
 * (one float per slot, when side and side[table] are not NULL) move together. A block
 * whose slots are all dropped is unlinked from the table's list and freed rather than
 * copied, wherever it lies; the blocks after it keep their memory and their rows. Blocks
 * past a table's new end (DIV_ROUND_UP(tokens, block_tokens)) are freed; chunks this
 * empties are added to *emptied. *ret_freed_blocks (may be NULL) receives the number of
 * blocks freed. With n_drops > 0, one generation step and one s->epoch bump; n_drops 0
 * changes nothing. Returns 0, or, before changing anything, -EINVAL (a table out of range
 * or named twice, slots not strictly ascending or not below the table's tokens), -ENOMEM.
 * With gpu (the rounds' GPU of s's device, round-gpu.h; NULL: none), the survivors of a
 * table move in one device gather instead of runs of copies.
 * A K/V copy that failed (only a failing device does that) does not stop the pass, which
 * keeps the tables consistent: its -errno goes to *ret_copy_error (may be NULL; 0 when
 * every copy succeeded), and the sequence's K/V are then not to be trusted.
 */
int seq_compact(struct seq *s, struct pool *p, struct round_gpu *gpu, const struct compact_drop *drops,
                uint32_t n_drops, float *const *side, struct seq_emptied *emptied,
                uint64_t *ret_freed_blocks, int *ret_copy_error);

/*
 * Moves blocks of tenant t out of its chunks with the fewest used blocks into free blocks of
 * its fuller chunks of the same block size, until no further chunk can be emptied: seqs
 * (n_seqs of them, all of t, none pinned) are the sequences whose blocks may move; a block
 * of another sequence keeps its chunk where it is. A block moves only into a chunk that
 * the sequence's connection (seq->conn_id) already holds, so no client ever needs a new
 * fd for it. Each sequence touched gets one descriptor rewrite and an epoch bump. Chunks
 * emptied are added to *emptied (the caller reclaims them). Returns the number of blocks
 * moved, or -ENOMEM.
 *
 * Sources are tried once each, emptiest first (ties: lower chunk id), and only whole: a
 * chunk is emptied when every one of its blocks finds a place, or left as it was. Its
 * blocks go to the fullest chunks with room that hold as many blocks as it does or more
 * (a tie still empties one of the two); a chunk that took blocks in is not a source
 * later in the same call.
 */
int compact_chunks(struct pool *p, struct tenant *t, struct seq *const *seqs, uint32_t n_seqs,
                   struct seq_emptied *emptied);
