/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Which sequences move to the host tier whole (tier.h), and when. A sequence qualifies when
 * its tenant's tier is host, it holds blocks, it is not pinned, not moving already, no
 * eviction plan waits for it and its engine's events are done. Those its engine left
 * unused (not opened, grown, pinned or unpinned) for tier-idle go on the tick. Under memory
 * pressure, before a round evicts any token, those unused for OFFLOAD_PRESSURE_IDLE_MS go,
 * least recently used first, until what was short is on its way: a sequence waiting for
 * its user's next turn costs a recall, where evicting tokens of running ones would cost
 * answers. The copies run off the loop (mover.h), which packs the blocks of each tenant
 * touched as a round does, reclaims the chunks that empty and tells each owner with an
 * EVENT_SEQ_CHANGED.
 */

#include <stdint.h>

struct server;

/* A sequence used within this time is not idle, whatever the pressure: its engine is
 * between two steps. */
#define OFFLOAD_PRESSURE_IDLE_MS 1000

/* Moves out what tier-idle says is idle; on every tick. */
void offload_tick(struct server *s);

/* Starts moving out idle sequences (of device's pool; device -1: any) until their bytes
 * reach need_bytes, or none is left. Returns their bytes (mover_out_bytes() counts them
 * until they are out). */
uint64_t offload_for_pressure(struct server *s, uint64_t need_bytes, int device);
