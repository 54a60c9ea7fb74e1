/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdio.h>

#include "basic/size.h"
#include "basic/time-util.h"
#include "conn.h"
#include "log.h"
#include "pins.h"
#include "pool.h"
#include "seq.h"
#include "server.h"
#include "tenant.h"

/* What a tenant may hold pinned (below 100 percent: at 100, a tenant's pins are bounded
 * by what it holds, and the budget may be below use after a lowering). */
static uint64_t bound(const struct server *s) {
	return size_percent(s->pool->budget_bytes, s->limits.max_pinned_percent);
}

static int refuse_over(struct server *s, struct seq *q, uint64_t more, char *why, size_t n) {
	const struct conn *c = registry_conn(s, q->conn_id);
	char held[32], lim[32];

	if (c)
		conn_refused(c, LIMIT_PINNED);
	snprintf(why, n, "tenant %s holds %s pinned, and %llu bytes more would pass "
	         "max-pinned-percent (%u%% of the budget: %s)", q->tenant->name,
	         size_format(q->tenant->pinned_bytes, held, sizeof(held)), (unsigned long long)more,
	         s->limits.max_pinned_percent, size_format(bound(s), lim, sizeof(lim)));
	return -EDQUOT;
}

int pins_take(struct server *s, struct seq *q, char *why, size_t n) {
	uint64_t bytes;

	if (q->pins > 0)
		return 0;
	bytes = seq_resident_bytes(q);
	if (s->limits.max_pinned_percent < 100 && q->tenant->pinned_bytes + bytes > bound(s))
		return refuse_over(s, q, bytes, why, n);
	q->pin_charge = bytes;
	q->tenant->pinned_bytes += bytes;
	q->pinned_ms = now_ms();
	q->pin_reported = false;
	return 0;
}

void pins_release(struct seq *q) {
	q->tenant->pinned_bytes -= q->pin_charge;
	q->pin_charge = 0;
}

int pins_may_grow(struct server *s, struct seq *q, uint64_t need, char *why, size_t n) {
	if (q->pins == 0 || s->limits.max_pinned_percent == 100 ||
	    q->tenant->pinned_bytes + need <= bound(s))
		return 0;
	return refuse_over(s, q, need, why, n);
}

void pins_recharge(struct seq *q) {
	uint64_t bytes;

	if (q->pins == 0)
		return;
	bytes = seq_resident_bytes(q);
	q->tenant->pinned_bytes += bytes - q->pin_charge;
	q->pin_charge = bytes;
}

void pins_tick(struct server *s, uint64_t now) {
	uint64_t report = s->limits.pin_report_ms, timeout = s->limits.pin_timeout_ms;

	if (report == 0 && timeout == 0)
		return;
	for (struct conn *c = s->conns, *next; c; c = next) {
		const struct seq *stuck = NULL;

		next = c->next;
		for (struct seq *q = c->closing ? NULL : c->seqs; q; q = q->next) {
			if (q->pins == 0)
				continue;
			if (report && !q->pin_reported && now - q->pinned_ms >= report) {
				q->pin_reported = true;
				q->tenant->pins_overdue++;
				s->pins_overdue++;
				log_warning("connection %llu (pid %d, uid %u, tenant %s) has held sequence "
				            "%llu pinned for %llu s (pin-report): nothing of it can be "
				            "evicted meanwhile", (unsigned long long)c->id, (int)c->cred.pid,
				            (unsigned)c->cred.uid, c->tenant ? c->tenant->name : "-",
				            (unsigned long long)q->id,
				            (unsigned long long)((now - q->pinned_ms) / 1000));
			}
			if (timeout && now - q->pinned_ms >= timeout)
				stuck = q;
		}
		if (stuck) {
			char reason[128];

			s->pin_disconnects++;
			snprintf(reason, sizeof(reason), "held sequence %llu pinned past pin-timeout",
			         (unsigned long long)stuck->id);
			conn_close(c, reason);
		}
	}
}
