/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Pins (kvd_seq_pin): while a sequence is pinned no round may compact it or take its blocks,
 * so what a tenant holds pinned is memory nobody can take back. It is bounded and watched:
 *
 * - a tenant holds at most max-pinned-percent of the budget pinned (tenant.pinned_bytes: the
 *   resident block bytes of its pinned sequences, charged at a sequence's first pin and at
 *   its grows while pinned, given back at its last unpin or its end); a first pin or a
 *   grow of a pinned sequence past it is refused (-EDQUOT, counted as the limit "pinned");
 * - a sequence pinned for pin-report is reported once (a warning naming the holder, the
 *   counter pins_overdue, the tenant's overdue pins in status);
 * - with pin-timeout set (0 by default: long decodes and live Python views are never cut
 *   short unless an operator says so), a connection holding a pin that long is treated as
 *   a stuck holder: disconnected (pin_disconnects), which drops its pins.
 */

#include <stdint.h>

#include "basic/macro.h"

struct server;
struct seq;

/* Before q's pin count goes up: charges q's bytes to its tenant at its first pin. Returns
 * 0, or -EDQUOT past max-pinned-percent, with why (counted). */
int pins_take(struct server *s, struct seq *q, char *why, size_t n);
/* After q's pin count went to 0, or as q ends: gives back what it charged. */
void pins_release(struct seq *q);
/* Before a grow of need bytes of pinned q: -EDQUOT past the bound, with why (counted). */
int pins_may_grow(struct server *s, struct seq *q, uint64_t need, char *why, size_t n);
/* After a grow or a truncate of pinned q: charges what it holds now. */
void pins_recharge(struct seq *q);
/* Once per tick: reports pins past pin-report, disconnects holders past pin-timeout. */
void pins_tick(struct server *s, uint64_t now);
