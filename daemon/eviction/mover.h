/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Moves between the pool and the host tier (tier.h), copied off the loop: a sequence of
 * a whole model is gigabytes, which would stall every client for a second or more if the
 * loop copied it. One worker thread copies the moves in the order they were queued; the
 * loop sets each up and finishes it (tier.h's *_begin and *_end), and the worker holds
 * the pool's readers (pool_readers_begin) meanwhile.
 *
 * While a sequence is being moved out it stays resident and usable: a pin or a grow
 * meanwhile cancels the move at its end (its bytes may have changed). While one is being
 * brought back, requests for it (pins and grows) wait; at the end the chunks it took go to
 * its connection as grants, and each request runs again as if it came then. A sequence
 * that goes away meanwhile ends its move without it.
 *
 * Test hook (builds with -Dtest_hooks=true): with KVD_TEST_MOVE_GATE=PATH in the
 * environment, the worker opens PATH (a FIFO) and reads one byte after each copy, before
 * the loop learns it is done, so that a test can pin, release or disconnect in between.
 */

#include <stdint.h>

#include "evict.h"

struct server;
struct conn;
struct seq;
struct mover;

/* Moves out queued or copying at once; the idle tick and pressure wait for room. */
#define MOVES_OUT_MAX 16

int mover_new(struct server *s, struct mover **ret);
/* Waits for the copy running, drops every move (their sequences are gone first). */
struct mover *mover_free(struct mover *m);

/* Queues moving q out. Returns 0, -EBUSY (MOVES_OUT_MAX queued), or
 * tier_offload_begin()'s errors. */
int mover_out(struct mover *m, struct seq *q);

/*
 * Brings q back (in the tier) for request req of connection c, which retry answers at the
 * end: queues its recall, or joins the one queued. Returns 0 (req waits; c->outstanding
 * counts it), or tier_recall_begin()'s errors: -ENOSPC, -EDQUOT (*ret_short_bytes: what
 * it lacked), -ENOMEM.
 */
int mover_in(struct mover *m, struct conn *c, struct seq *q, const struct parked_grow *req,
             evict_grow_fn retry, uint64_t *ret_short_bytes);

/* q goes away: a move of it ends without it. Before tier_forget(). */
void mover_forget(struct mover *m, struct seq *q);

/* K/V bytes of the moves out queued or copying: memory on its way back to the pool. */
uint64_t mover_out_bytes(const struct mover *m);

/* Moves queued or copying, both ways. */
uint32_t mover_moves(const struct mover *m);
