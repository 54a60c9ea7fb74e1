/* SPDX-License-Identifier: MIT */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "conn.h"
#include "departed.h"
#include "envelope.h"
#include "log.h"
#include "server.h"
#include "unmap.h"
#include "basic/time-util.h"

uint64_t unmap_due(const struct server *s, const struct chunk *ch) {
	if (ch->state != CHUNK_DRAINING || ch->unmap_asked_ms == 0 || s->limits.unmap_timeout_ms == 0)
		return 0;
	return ch->unmap_asked_ms + s->limits.unmap_timeout_ms;
}

/*
 * Enforces unmap-timeout: memfds and cuMem handles cannot be revoked, so a chunk a holder
 * does not unmap stays out of the pool until it does, or disconnects. A connection that
 * missed a deadline gets no new grants (it would only take more), and once unmap-grace
 * has passed too it is disconnected, which drops its holds. The scan walks every chunk,
 * but only while some drain, and looks holders up only past their deadline.
 */
void unmap_tick(struct server *s, uint64_t now) {
	struct pool *p = s->pool;

	for (struct conn *c = s->conns; c; c = c->next) {
		c->unmap_was_late = c->unmap_due_ms != 0;
		c->unmap_due_ms = 0;
		c->unmap_late = 0;
	}
	s->unmap_scan_ms = now;
	memset(s->draining_late, 0, sizeof(s->draining_late));
	for (uint32_t i = 0; i < p->n_chunks && p->chunks_draining > 0; i++) {
		const struct chunk *ch = &p->chunks[i];
		uint64_t due = unmap_due(s, ch);

		if (due == 0 || now < due)
			continue;
		s->draining_late[ch->mem.device]++;
		for (uint32_t h = 0; h < ch->n_holders; h++) {
			struct conn *c = registry_conn(s, ch->holders[h]);

			if (!c)
				continue;
			c->unmap_late++;
			if (c->unmap_due_ms == 0 || due < c->unmap_due_ms)
				c->unmap_due_ms = due;
		}
	}
	for (struct conn *c = s->conns, *next; c; c = next) {
		next = c->next;
		/* Closed by an earlier disconnect here: its holds are gone already. */
		if (c->closing || c->unmap_due_ms == 0)
			continue;
		if (!c->unmap_was_late) {
			s->unmap_timeouts++;
			log_warning("connection %llu (pid %d, tenant %s) did not unmap a chunk within "
			            "unmap-timeout (%llu ms): no new grants, and a disconnect in %llu ms "
			            "unless it does", (unsigned long long)c->id, (int)c->cred.pid,
			            c->tenant ? c->tenant->name : "-",
			            (unsigned long long)s->limits.unmap_timeout_ms,
			            (unsigned long long)s->limits.unmap_grace_ms);
		}
		if (now - c->unmap_due_ms >= s->limits.unmap_grace_ms) {
			s->unmap_disconnects++;
			conn_close(c, "did not unmap a chunk within unmap-timeout and unmap-grace");
		}
	}
}

bool unmap_slowest_holder(struct server *s, char *buf, size_t n) {
	const struct pool *p = s->pool;
	const struct chunk *oldest = NULL;
	const struct conn *c;

	buf[0] = '\0';
	for (uint32_t i = 0; i < p->n_chunks && p->chunks_draining > 0; i++) {
		const struct chunk *ch = &p->chunks[i];

		if (ch->state == CHUNK_DRAINING && ch->n_holders > 0 && ch->unmap_asked_ms > 0 &&
		    (!oldest || ch->unmap_asked_ms < oldest->unmap_asked_ms))
			oldest = ch;
	}
	if (!oldest)
		return false;
	c = registry_conn(s, oldest->holders[0]);
	if (c)
		snprintf(buf, n, "pid %d (tenant %s) for %llu ms", (int)c->cred.pid,
		         c->tenant ? c->tenant->name : "-",
		         (unsigned long long)(now_ms() - oldest->unmap_asked_ms));
	else
		snprintf(buf, n, "departed connection %llu for %llu ms",
		         (unsigned long long)oldest->holders[0],
		         (unsigned long long)(now_ms() - oldest->unmap_asked_ms));
	return true;
}

uint32_t unmap_reclaim(struct server *s, struct seq_emptied *emptied, struct conn *requester,
                        uint32_t *ret_ids) {
	uint32_t n_ids = 0, used = s->scratch_used;

	/* An unmap request that cannot be queued closes its connection, and closing frees its
	 * sequences, whose emptied chunks are reclaimed through here before this walk goes on:
	 * that list must start after this one in s->scratch, not overwrite it. Both fit: a
	 * chunk joins a list when its last block is freed, and nothing is allocated until the
	 * outermost reclaim returns, so no chunk is on two lists. */
	s->scratch_used = (uint32_t)(emptied->chunks - s->scratch) + emptied->n;
	for (uint32_t i = 0; i < emptied->n; i++) {
		struct chunk *ch = emptied->chunks[i];
		uint32_t id = ch->id;

		if (pool_chunk_reclaim(s->pool, ch) == 0)
			continue;
		/* Walk a copy of the holders: an event that cannot be queued closes its
		 * connection, which drops it from the list. */
		uint32_t n = ch->n_holders;
		_cleanup_(freep) uint64_t *holders = malloc(n * sizeof(uint64_t));

		if (!holders) {
			/* Without memory to ask the holders, the chunk stays DRAINING until they
			 * disconnect: safe, only slow. Holders never asked are not held to
			 * unmap-timeout. */
			ch->unmap_asked_ms = 0;
			log_error("out of memory reclaiming chunk %u; it stays draining", id);
			continue;
		}
		ch->unmap_asked_ms = now_ms();
		memcpy(holders, ch->holders, n * sizeof(uint64_t));
		for (uint32_t h = 0; h < n; h++) {
			struct conn *c = registry_conn(s, holders[h]);

			if (c == requester && ret_ids) {
				ret_ids[n_ids++] = id;
				continue;
			}
			if (!c) {
				/* A process that left without unmapping keeps its hold until it
				 * exits (departed.h). */
				if (!departed_find(s, holders[h]))
					pool_chunk_drop_holder(s->pool, ch, holders[h]);
				continue;
			}
			envelope_event_unmap(c, &id, 1);
		}
	}
	s->scratch_used = used;
	emptied->n = 0;
	return n_ids;
}
