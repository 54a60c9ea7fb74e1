/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Token recall (docs/recall.md): the tokens rounds evict from a sequence of a tenant with
 * recall on are kept in the host tier instead of dropped, per table with their original
 * positions, and a SeqRecall brings back those its newly published window needs most,
 * each in place of a resident token worth less.
 *
 * A sequence's store ("kept tokens") holds records of one table slot each: the K rows of
 * the heads the table covers, their V rows, and the slot's index key, bit for bit as they
 * were in the pool. Records live in host tier segments (tier.h) that the store takes from
 * the tier's free ones, never by displacing a sequence moved out whole; an eviction whose
 * slots do not all find a record keeps none of them (so that the tables of a layer row stay
 * alike) and counts them lost.
 *
 * A recall is a round (round.h, ROUND_RECALL) of one sequence: the worker scores the
 * resident slots before the window and the kept ones together against the window, and
 * pairs the best kept ones with the worst resident ones; on the loop recall_swap() trades
 * each pair: the kept slot takes the resident's place in its table, at its own position
 * in position order, and the resident's K/V go to the record the kept one leaves. Tables
 * keep their token counts and blocks: a swap allocates nothing, so it can never take the
 * pool or the tenant past a budget, not even for a moment.
 */

#include <stdint.h>

#include "compact.h"
#include "seq.h"

struct tier;
struct recall_store;

/*
 * Keeps the slots drops[0..n) name of q (their K/V still in the pool: before seq_compact
 * removes them) in q's store, creating it. All or nothing. Returns the slots kept (0 when
 * the tier lacked room: they are counted lost), or -ENOMEM, or the backend's -errno (none
 * kept).
 */
int64_t recall_keep(struct tier *tr, struct seq *q, struct pool *p, const struct compact_drop *drops,
                    uint32_t n);

/* Frees a store, its segments back to the tier. Accepts NULL. Returns NULL. */
struct recall_store *recall_store_free(struct tier *tr, struct recall_store *st);

/* Forgets the kept tokens of positions at or past end (a truncated sequence's next
 * position), their records free for later keeps. */
void recall_truncate(struct recall_store *st, uint32_t end);

/* Marks st held by a recall round (off its sequence, which may go meanwhile), or back. */
void recall_store_hold(struct recall_store *st, bool held);

/*
 * Kept tokens yield to whole sequences: frees the oldest store no recall round holds, its
 * slots counted lost (kept_lost), for a sequence moving out that needs the room. Evicted
 * tokens kept on the chance of a question go before a whole sequence an engine will come
 * back to. Returns whether one was freed.
 */
bool recall_yield(struct tier *tr);

/* Slots kept in table t, their positions (ascending), and the record of the i-th. */
uint32_t recall_kept(const struct recall_store *st, uint32_t t);
const uint32_t *recall_positions(const struct recall_store *st, uint32_t t);
const uint8_t *recall_record(const struct recall_store *st, uint32_t t, uint32_t i);

/* Slots kept in all tables together. */
uint64_t recall_kept_total(const struct recall_store *st);

/* What one table trades: n resident slots (drop, ascending) for n kept ones (take: indices
 * into the table's kept slots, ascending), with the smoothed cost each kept one comes back
 * with (take_s, or NULL: unscored). */
struct recall_trade {
	uint32_t n;
	const uint32_t *drop, *take;
	const float *take_s;
};

/*
 * Trades trades[t] in every table t of q (not pinned, its engine's events done, st its
 * store, taken off it for the round: q->kept is NULL): each table's slots stay in position
 * order, its count and blocks as they were; the side arrays (q->smooth, may be NULL) move
 * with their slots. One descriptor rewrite (one generation step, an epoch bump) when any
 * table trades. Returns 0, or -EINVAL (a trade out of range, before changing anything),
 * -ENOMEM; a K/V copy that failed (only a failing device does that) goes to
 * *ret_copy_error and leaves the tables consistent, the K/V not to be trusted.
 */
int recall_swap(struct seq *q, struct pool *p, struct recall_store *st,
                const struct recall_trade *trades, int *ret_copy_error);
