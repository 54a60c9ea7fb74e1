/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Chunks whose last block was freed go back to the pool once every process that maps them
 * unmapped them: their holders are asked (EVENT_CHUNKS_UNMAP), held to unmap-timeout and
 * unmap-grace by the tick, and named while they keep a chunk waiting.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct chunk;
struct conn;
struct seq_emptied;
struct server;

/*
 * Gives back chunks whose last block was freed: free at once when nobody maps them, else
 * every holder is asked to unmap; `requester`, when not NULL, collects the ids it holds
 * into ret_ids (room for n_chunks) instead of getting an event. Returns how many ids it put
 * in ret_ids.
 */
uint32_t unmap_reclaim(struct server *s, struct seq_emptied *emptied, struct conn *requester,
                        uint32_t *ret_ids);

/*
 * When a draining chunk's holders must have unmapped it (unmap-timeout after they were
 * asked); 0 when no deadline runs: the chunk does not drain, its holders could not be
 * asked, or unmap-timeout is 0. The tick enforces it (struct conn, unmap_due_ms).
 */
uint64_t unmap_due(const struct server *s, const struct chunk *ch);

/*
 * Names, in buf, the holder that has kept a draining chunk waiting longest (the first
 * holder of the chunk asked to unmap longest ago): "pid P (tenant T) for M ms"; a process
 * that left without unmapping is named by its connection. Returns false,
 * with buf empty, when nothing drains.
 */
bool unmap_slowest_holder(struct server *s, char *buf, size_t n);

/* Enforces unmap-timeout and unmap-grace at the tick (now, in ms). */
void unmap_tick(struct server *s, uint64_t now);
