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
 * Below it, the file tier (tier-file.h): where a tenant's tier is host+file, the oldest
 * entries a full host tier makes room from go to a file instead of being lost (a
 * demotion), and come back from there the same way. Its I/O failing loses the entry and
 * degrades the tenant (tenant.tier_degraded) to drop until its tier is set again.
 *
 * The tier's bytes never count against the pool budget or a tenant's min and max; its
 * entries' metadata counts against max-metadata-bytes (server.metadata_bytes). A
 * sequence released, or a tenant forgotten with it, drops its entry.
 *
 * The checksum is for corruption, not tampering: tier memory is the daemon's own, the file
 * kvd's (0600).
 *
 * Test hook (builds with -Dtest_hooks=true): with KVD_TEST_TIER_CORRUPT in the environment,
 * each sequence moved out gets one bit of its last block flipped after its checksum was
 * taken, so that its recall must find it.
 */

#include "mac.h"
#include <stdbool.h>
#include <stdint.h>

#include "pool.h"
#include "seq.h"

/* What memory pressure does with a tenant's KV (kvd.conf(5), tier): evict tokens, or move
 * idle sequences whole to the host tier first. */
enum tier_mode {
	TIER_DROP,
	TIER_HOST,
	TIER_HOST_FILE,               /* and from the host tier, when it is full, to the file */
	_TIER_MODE_MAX,
};

/* "drop", "host", "host+file"; NULL for other values. */
const char *tier_mode_to_string(int v);
/* The mode called name, or -EINVAL. */
int tier_mode_from_string(const char *name);

struct tier_seq;
struct tier_file;
struct tier_io;

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
	/* The file tier (tier-file.h; NULL: none): its segments held, and the sequences in it
	 * (which are on the list below too, in_file). */
	struct tier_file *file;
	struct mac_key file_key;      /* of the segments' MACs (mac.h), drawn with the file */
	uint64_t file_used_bytes;
	uint32_t file_seqs;
	/* Oldest moved out first: what a full tier drops. */
	struct tier_seq *oldest, *newest;
	uint64_t *metadata_bytes;     /* the server's count, which the entries' metadata joins */
	/* Since the start: sequences moved out and back, their bytes and the time it took. */
	uint64_t offloads, offload_bytes, offload_ns;
	uint64_t recalls, recall_bytes, recall_ns;
	/* Moved from the host tier to the file (segment bytes), and back from the file. */
	uint64_t demotes, demote_bytes, demote_ns;
	uint64_t file_recalls, file_recall_bytes, file_recall_ns;
	uint64_t file_read_ns;        /* of file_recall_ns, waiting for the file's reads */
	/* Sequences lost: dropped by a full tier, a block failing its checksum or a file
	 * segment its MAC (or a failing device write) at the recall, no pool memory for the
	 * recall within grant-wait. */
	uint64_t lost_full, lost_corrupt, lost_no_memory;
	uint64_t lost_io;             /* the file's I/O failed (writing it out, or reading it) */
	/* Token recall (recall.h): segments the sequences' kept tokens hold (in used_bytes
	 * too), the slots kept now, and since the start: slots not kept for want of room,
	 * recalls answered, slots brought back, kept slots scored. */
	uint64_t kept_bytes, kept_tokens, kept_lost;
	uint64_t token_recalls, tokens_recalled, tokens_scored, token_recall_us;
	bool corrupt;                 /* KVD_TEST_TIER_CORRUPT */
	uint32_t mark;                /* the last tenant.tier_mark given (tier.c, shares) */
	/* Token recall's stores, oldest first (recall.c). */
	struct recall_store *kept_oldest, *kept_newest;
	/* Frees the oldest store that no round holds, to make room for a sequence: returns
	 * false when there is none. Token recall's (recall_yield(), set by the server); NULL:
	 * the tier has no stores to give back. */
	bool (*yield)(struct tier *tr);
};

/* A tier of budget bytes in whole segments of segment_bytes (the pool's chunk size; below
 * one segment: none); metadata_bytes is the server's metadata count. Returns 0, -ENOMEM
 * (the mapping), -EINVAL (more than 2^32 segments). */
int tier_new(uint64_t budget, uint64_t segment_bytes, uint64_t *metadata_bytes,
             struct tier **ret);
/* After every sequence was freed (tier_forget). Returns NULL. */
struct tier *tier_free(struct tier *tr);

/* Adds the file tier: bytes in whole segments, the file in dir (tier-file.h). Returns 0, or
 * -EINVAL (less than a segment), or tier_file_open()'s -errno with *ret_what. */
int tier_file_add(struct tier *tr, const char *dir, uint64_t bytes, const char **ret_what);

/*
 * Moving a sequence between the pool and the tier takes three steps, so that the copy
 * runs off the loop (mover.h): *_begin on the loop sets the move up, tier_move_run on a
 * worker copies (and sums, or checks the sums), *_end on the loop finishes it. Between
 * begin and end the worker reads the pool through the daemon's mapping: the caller holds
 * pool_readers_begin() (pool.h) for it.
 */
struct tier_move;

enum tier_move_kind {
	TIER_MOVE_OUT,                /* pool to host tier */
	TIER_MOVE_IN,                 /* host tier or file to pool */
	TIER_MOVE_DEMOTE,             /* host tier to file */
};

/*
 * Sets up moving q (resident, unpinned, no plan waiting, its engine's events done: the
 * caller checks) out of the pool: takes its segments, making room in the host tier (never
 * from an entry a move reads), by shares: each tenant's share of a tier is an equal part of
 * it among the tenants holding entries there (q's counted), and room comes first from the
 * oldest entry of a tenant over its share; where none is, from q's tenant's own oldest when
 * q would take it over its share, else from the oldest; and a tenant never holds more than
 * max_pct percent of a tier (tier-max-percent): past it, its own oldest make the room.
 * Each entry that makes room goes to the file where its tenant's tier is host+file and the
 * file has room or can make it the same way (a demotion, which *ret_demotes lists,
 * allocated, *ret_n_demotes of them: they must run before this move), else is lost. Changes nothing of q. Returns 0, or -ENODATA (q holds no block), -EFBIG (q
 * is larger than the whole tier), -ENOSPC (the room is held by moves running), -ENOMEM
 * (memory, or metadata past metadata_max); demotions may be listed on failure too.
 */
int tier_offload_begin(struct tier *tr, struct seq *q, struct pool *p, uint64_t metadata_max,
                       uint32_t max_pct, struct tier_move **ret, struct tier_move ***ret_demotes,
                       uint32_t *ret_n_demotes);

/* Finishes a demotion of q's entry (q NULL: it went away, and tier_detach() gave the entry
 * to the move). On an I/O error q is lost. Frees mv. Returns 0 or the write's -errno. */
int tier_demote_end(struct tier *tr, struct tier_move *mv, struct seq *q);

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
 * back (conn_id stops holding the chunks of *g) and q is lost, unless the move failed with
 * -ECANCELED (tier_move_fail: it never ran), which leaves q in the tier. Frees mv. Returns
 * 0, -ECANCELED (q gone, or never run), -EBADMSG (a block failed its sum), or the
 * backend's or the file's -errno.
 */
int tier_recall_end(struct tier *tr, struct tier_move *mv, struct seq *q, struct pool *p,
                    uint64_t conn_id, struct seq_granted *g, struct seq_emptied *emptied);

/* The copy, on a worker thread: touches only what the move holds, and the file through io
 * (the worker's: NULL without a file tier). */
void tier_move_run(struct tier_move *mv, struct tier_io *io);

/* The sequence whose entry a demotion moves (tier_offload_begin's list). */
struct seq *tier_move_seq(const struct tier_move *mv);

/* Marks a move failed with error without running it (one that could not be queued). */
void tier_move_fail(struct tier_move *mv, int error);

/* K/V bytes a move copies (a demotion: its segments'). */
uint64_t tier_move_bytes(const struct tier_move *mv);

/* Drops q's entry: q stays empty, lost (behaves as evicted, seq.recall KVD_RECALL_LOST);
 * counts it in lost_no_memory (the caller's reason: no memory for it in time). */
void tier_lose(struct tier *tr, struct seq *q);

/* Where q's K/V are, for listings: "pool", "host", "file" (on its way there too),
 * "leaving" (moving out) or "returning" (being brought back). */
const char *tier_place(const struct seq *q);
/* q's tokens in its first table, wherever they are: the pool's, or those moved out with
 * it (its descriptor shows 0 until the recall). */
uint32_t tier_seq_tokens(const struct seq *q);

/* Drops q's entry, if any, as q goes away (released, its connection closed). */
void tier_forget(struct tier *tr, struct seq *q);

/* Takes q's entry out of the tier's list and counts without freeing it, for a recall that
 * reads it while q goes away: tier_recall_end() frees it. Returns it (NULL: none). */
struct tier_seq *tier_detach(struct tier *tr, struct seq *q);
