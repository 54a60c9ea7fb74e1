/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Sequences: block tables plus the shared descriptor (layout in kvd/kvd.h) that the daemon
 * writes and the owning client maps read-only. The descriptor is the only copy of the
 * tables: the daemon reads what it wrote there, so the two can never disagree.
 */

#include <stdbool.h>
#include <stdint.h>

#include "common/layout.h"
#include "kvd/kvd-abi.h"
#include "model.h"
#include "pool.h"
#include "group.h"
#include "prefix.h"

struct obs;
struct plan;
struct recall_store;

struct seq {
	uint64_t id;
	const struct model *model;
	struct tenant *tenant;
	uint64_t conn_id;             /* the owning connection */
	uint32_t device;              /* the pool's device its blocks come from (its connection's) */
	/* Its connection's events (bit i: SeqUnpin.event_id i + 1) the engine unpinned it with
	 * and that have not been seen complete: until they are, the daemon neither reads nor
	 * moves its K/V (evict_engine_done). */
	uint32_t wait_events;
	int desc_fd;                  /* kept until the open reply took a copy */
	struct kvd_seq_desc *desc;    /* the daemon's writable mapping */
	struct seq *next, *prev;      /* in the owning connection's list (conn_seq_add) */

	/* Eviction (model->unit != KVD_UNIT_NONE). */
	struct obs *obs;              /* observation buffer, shared with rounds (observe.h) */
	int obs_fd;                   /* kept until the open reply took a copy */
	uint32_t pins;                /* kvd_seq_pin nesting */
	/* Positions below it hold what the engine wrote: next_position at its last unpin (the
	 * engine writes pinned), or what an open, fork or restore brought written. Rounds
	 * and recalls take no slot above it: grown slots wait for the unpin after the step
	 * that writes them. */
	uint32_t written_pos;
	/* While pinned (pins.h): the bytes charged to its tenant's pinned_bytes, since when,
	 * and whether pin-report reported it. */
	uint64_t pin_charge, pinned_ms;
	bool pin_reported;
	uint64_t epoch;               /* bumped by every compaction: plans name the epoch they
	                               * were made for */
	/* Smoothed per-slot costs, one array per table (max_tokens floats, allocated at the
	 * first round; NULL before, and for tables that share another's: see round.h). */
	float **smooth;
	uint32_t *smooth_cap;         /* floats allocated in each smooth[] array */
	struct plan *pending;         /* a plan made while pinned, applied at the last unpin */
	/* Statistics for status. */
	uint64_t evicted_tokens, evicted_bytes;
	/* The host tier (tier.h): its entry while moved out, NULL when resident; what its next
	 * pin reports (KVD_RECALL_*, then back to NONE); when its engine last used it (open,
	 * grow, pin, unpin; CLOCK_MONOTONIC ms), for idle offloads (offload.h). */
	struct tier_seq *tiered;
	uint8_t recall;
	uint64_t used_ms;
	uint64_t pin_serial;          /* pins since it opened: a move out in flight sees one */
	struct job *move;             /* its move to or from the tier in flight (mover.h) */
	/* Its evicted tokens kept for recall (recall.h; NULL: none), and whether a recall of
	 * it runs (its round holds them meanwhile). */
	struct recall_store *kept;
	bool recalling;
	/* Kept across a restart (keep.h): 1 + its journal slot; 0: not kept. */
	uint32_t keep_slot;
	/* Content keys of its prompt's blocks, given at a prefix open (prefix.h). */
	struct prefix_keys prefix;
	/* Its tensor-parallel group and its rank there (group.h); NULL: none. */
	struct seq_group *group;
	uint32_t rank;
	/* What its metadata may take of the daemon's memory, at most: the descriptor, the
	 * observation buffer, the smoothed costs (a float per slot of each table, with an
	 * eviction unit) and this struct. Counted in server.metadata_bytes. */
	uint64_t meta_bytes;
};

/* Chunks a grow handed to a connection that had not mapped them yet. */
struct seq_grants {
	struct chunk *chunks[253];
	uint32_t n;
	uint64_t short_bytes;         /* -ENOSPC, -EDQUOT: bytes of new chunks it lacked */
};

/* Chunks an allocation handed to a connection that had not mapped them yet: room for max
 * in chunks (the caller's); short_bytes as in struct seq_grants. */
struct seq_granted {
	struct chunk **chunks;
	uint32_t n, max;
	uint64_t short_bytes;
};

/* Chunks whose last block an operation freed; the caller reclaims them. chunks has room
 * for every chunk of the pool (a chunk empties at most once per operation), so adding
 * never fails. */
struct seq_emptied {
	struct chunk **chunks;
	uint32_t n;
};

/* Creates an empty sequence able to hold max_tokens per table. Returns 0, or -EINVAL
 * (max_tokens 0, or the descriptor would exceed desc_max bytes), -ENOMEM, -errno. */
int seq_new(uint64_t id, const struct model *m, struct tenant *t, uint32_t max_tokens,
            uint64_t desc_max, struct seq **ret);

/*
 * Appends n tokens to every table, each from its own token count (tables may differ after
 * an eviction), taking blocks from the pool for the tenant; the new slots get positions
 * next_position onwards; the first grow of a model with moments also allocates the
 * sequence's moments blocks (empty summaries). Chunks that conn_id does not hold yet are listed in *grants and
 * conn_id is made their holder. All or nothing. Returns 0, or -EINVAL (n is 0), -EFBIG
 * (some table would pass max_tokens), -E2BIG (more new chunks than one frame can carry),
 * -ENOSPC, -EDQUOT (grants->short_bytes: what it lacked), -ENOMEM; on failure the chunks
 * the attempt emptied are in *emptied.
 */
int seq_grow(struct seq *s, struct pool *p, uint64_t conn_id, uint32_t n,
             struct seq_grants *grants, struct seq_emptied *emptied);

/*
 * Allocates `total` blocks for s from the pool on its device, the first n_moments of its
 * compensation block size and the rest of its model's block size, into refs; chunks that
 * conn_id does not hold yet are listed in *g (at most g->max) and conn_id is made their
 * holder. All or nothing: returns 0, or -E2BIG (more than g->max new chunks), -ENOSPC,
 * -EDQUOT (g->short_bytes: what it lacked), -ENOMEM, with the chunks the attempt emptied in
 * *emptied. What seq_grow and a recall from a tier (tier.h) take blocks with.
 */
int seq_alloc_blocks(struct seq *s, struct pool *p, uint64_t conn_id, uint64_t n_moments,
                     uint64_t total, struct kvd_block_ref *refs, struct seq_granted *g,
                     struct seq_emptied *emptied);

/* Undoes a seq_alloc_blocks that succeeded: conn_id stops holding the chunks of g, and the
 * n blocks of refs are freed (emptied chunks into *emptied). */
void seq_alloc_undo(struct pool *p, uint64_t conn_id, const struct kvd_block_ref *refs,
                    uint64_t n, struct seq_granted *g, struct seq_emptied *emptied);

/* Frees the n blocks of refs (chunks left empty into *emptied). */
void seq_blocks_free(struct pool *p, const struct kvd_block_ref *refs, uint64_t n,
                     struct seq_emptied *emptied);

/* Bytes of the new blocks a grow by n would take (with the moments blocks of a first
 * grow): 0 when its tokens fit in the blocks the tables hold. n must not pass max_tokens. */
uint64_t seq_grow_bytes(const struct seq *s, const struct pool *p, uint32_t n);
/* Whether s may grow by n tokens: 0, -EINVAL (n is 0) or -EFBIG (past max_tokens). */
int seq_grow_check(const struct seq *s, uint32_t n);

/*
 * Makes s, new and empty (seq_new() with parent's model), a fork of parent: every full
 * block of parent's tables is shared (pool_block_share(): counted once, written and moved
 * by neither, freed by the last to let go), each partly filled last block and the moments
 * blocks are copied into new blocks (chunks that conn_id does not hold yet are listed in
 * *grants and conn_id is made their holder), positions and next_position are parent's.
 * All or nothing. Returns 0, or -EINVAL (another model), -EFBIG (a table of parent holds
 * more than s's max_tokens), -E2BIG, -ENOSPC, -EDQUOT (grants->short_bytes), -ENOMEM,
 * -EMLINK (a block is shared by too many), the backend's copy error; on failure the chunks
 * the attempt emptied are in *emptied.
 */
int seq_fork(struct seq *s, const struct seq *parent, struct pool *p, uint64_t conn_id,
             struct seq_grants *grants, struct seq_emptied *emptied);

/*
 * Makes s, new and empty, start with the leading blocks of its prompt that other
 * sequences published (prefix.h): for each of s's keys in turn, a block found in the index
 * is shared (pool_block_share(), as a fork's), until the first key not found or `max`
 * blocks. Chunks of those blocks that conn_id does not hold yet go into list (room for
 * every chunk of the pool), at *n, and conn_id is made their holder. Then s holds
 * found * block_tokens tokens at positions 0 onwards, and those blocks are published as
 * its own too. All or nothing; returns 0 with the blocks found in *ret_found (of them
 * cached ones, held by no sequence, in *ret_cached), or -ENOMEM, -EMLINK (a block is shared
 * by too many).
 */
int seq_attach_prefix(struct seq *s, struct prefix_index *x, struct pool *p, uint64_t conn_id,
                      uint32_t max, struct chunk **list, uint32_t *n, uint32_t *ret_found,
                      uint32_t *ret_cached);

/*
 * Drops the last n positions of s: each table keeps its slots of positions below
 * next_position - n, the blocks past them are freed (chunks left empty into *emptied),
 * next_position goes back by n, and the epoch moves on. Returns 0, or -EINVAL (n is 0 or
 * more than next_position).
 */
int seq_truncate(struct seq *s, struct pool *p, uint32_t n, struct seq_emptied *emptied);

/* Frees every block of the sequence and the sequence itself; chunks left empty are added
 * to *emptied. */
void seq_free(struct seq *s, struct pool *p, struct seq_emptied *emptied);

/* Slots of table t up to the end of its last shared block (pool_block_shared()): what no
 * round may evict nor move, since another sequence reads those blocks too. */
uint32_t seq_shared_slots(const struct seq *s, const struct pool *p, uint32_t t);

/* Bytes of the blocks of s that other sequences hold too. */
uint64_t seq_shared_bytes(const struct seq *s, const struct pool *p);

/* Whether s holds a block another sequence holds too: such a sequence is never moved to a
 * tier (a move frees nothing the sharers hold, and the recall would copy the shared part). */
bool seq_shares(const struct seq *s, const struct pool *p);

/* Bytes of the blocks that hold the sequence's resident tokens (and its moments). */
uint64_t seq_resident_bytes(const struct seq *s);

/* Digest of the resident K/V through the daemon's mapping (see kvd_seq_digest). */
int seq_digest(const struct seq *s, struct pool *p, uint64_t *ret_digest, uint64_t *ret_bytes);

/* Writable views of the descriptor's arrays, for the modules that rewrite tables. */
static inline uint32_t *desc_tokens(struct kvd_seq_desc *d) {
	return (uint32_t *)layout_tokens(d);
}

static inline uint32_t *desc_positions(struct kvd_seq_desc *d, uint32_t t) {
	return (uint32_t *)layout_positions(d, t);
}

static inline struct kvd_block_ref *desc_blocks(struct kvd_seq_desc *d, uint32_t t) {
	return (struct kvd_block_ref *)layout_blocks(d, t);
}

/* The moments blocks, [layers][kv_heads] (models with compensation; see kvd.h). */
static inline struct kvd_block_ref *desc_moments(struct kvd_seq_desc *d) {
	return (struct kvd_block_ref *)((char *)d + d->moments_offset);
}

/* Sequence lock around every rewrite: odd while writing (see kvd.h). Single writer: the
 * event loop. */
static inline void desc_write_begin(struct kvd_seq_desc *d) {
	__atomic_store_n(&d->generation, d->generation + 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void desc_write_end(struct kvd_seq_desc *d) {
	__atomic_store_n(&d->generation, d->generation + 1, __ATOMIC_RELEASE);
}
