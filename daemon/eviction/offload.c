/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "conn.h"
#include "evict.h"
#include "log.h"
#include "mover.h"
#include "offload.h"
#include "server.h"
#include "tier.h"

/* A sequence that may move out. Queuing moves sends nothing, so none goes away meanwhile. */
struct candidate {
	uint64_t used_ms;
	struct seq *q;
};

static int by_use(const void *a, const void *b) {
	const struct candidate *x = a, *y = b;

	return x->used_ms < y->used_ms ? -1 : x->used_ms > y->used_ms;
}

static bool qualifies(struct server *s, struct seq *q, uint64_t now, uint64_t idle_ms,
                      int device) {
	return q->tenant->tier != TIER_DROP && !q->tenant->tier_degraded && !q->tiered && !q->move &&
	       !q->recalling &&
	       q->pins == 0 && !q->pending &&
	       now - q->used_ms >= idle_ms && (device < 0 || q->device == (uint32_t)device) &&
	       seq_resident_bytes(q) > 0 && evict_engine_done(s, q) && !seq_shares(q, s->pool) &&
	       !q->group;
}

/* Starts moving out the sequences that qualify with idle_ms, least recently used first,
 * until their bytes reach need_bytes (0: every one). Returns their bytes. */
static uint64_t offload(struct server *s, uint64_t idle_ms, uint64_t need_bytes, int device) {
	_cleanup_(freep) struct candidate *cand = NULL;
	uint64_t now = now_ms(), started = 0;
	uint32_t n = 0, done = 0;
	bool any = false;

	/* Every tick: nothing to look at unless some tenant takes part. */
	for (uint32_t i = 0; i < s->tenants.n && !any; i++)
		any = s->tenants.tenants[i]->tier != TIER_DROP && !s->tenants.tenants[i]->tier_degraded;
	if (!any || s->tier->budget_bytes == 0 || s->sequences == 0)
		return 0;
	cand = malloc(s->sequences * sizeof(*cand));
	if (!cand) {
		log_warning("cannot move sequences to the host tier: out of memory");
		return 0;
	}
	for (struct conn *c = s->conns; c; c = c->next)
		if (!c->closing)
			for (struct seq *q = c->seqs; q && n < s->sequences; q = q->next)
				if (qualifies(s, q, now, idle_ms, device))
					cand[n++] = (struct candidate){ q->used_ms, q };
	qsort(cand, n, sizeof(*cand), by_use);
	for (uint32_t i = 0; i < n && (need_bytes == 0 || started < need_bytes); i++) {
		struct seq *q = cand[i].q;
		uint64_t bytes = seq_resident_bytes(q);
		int r;

		r = mover_out(s->mover, q);
		if (r == -EBUSY)
			break;
		if (r < 0) {
			/* Too large for the tier, or no room or memory for it now: it stays. */
			log_debug("sequence %llu (tenant %s): not moved to the host tier: %s",
			          (unsigned long long)q->id, q->tenant->name, strerror(-r));
			continue;
		}
		started += bytes;
		done++;
	}
	if (done > 0)
		log_info("moving %u sequences (%llu bytes) to the host tier: %s", done,
		         (unsigned long long)started, need_bytes ? "memory pressure" : "idle");
	return started;
}

void offload_tick(struct server *s) {
	if (s->limits.tier_idle_ms > 0)
		(void)offload(s, s->limits.tier_idle_ms, 0, -1);
}

uint64_t offload_for_pressure(struct server *s, uint64_t need_bytes, int device) {
	if (need_bytes == 0)
		return 0;
	return offload(s, OFFLOAD_PRESSURE_IDLE_MS, need_bytes, device);
}
