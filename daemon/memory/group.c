/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdlib.h>

#include "group.h"
#include "seq.h"

int group_new(struct seq *q, uint32_t size) {
	struct seq_group *g;

	if (size < 2 || size > SEQ_GROUP_MAX)
		return -EINVAL;
	g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	g->id = q->id;
	g->size = size;
	g->members[g->n++] = q;
	q->group = g;
	q->rank = 0;
	return 0;
}

/* Whether a member of g has grown since it opened: then the members' tables are steps
 * apart no longer, and a newcomer would start behind. */
static bool group_started(const struct seq_group *g) {
	for (uint32_t i = 0; i < g->n; i++)
		if (g->members[i]->desc->next_position > 0)
			return true;
	return false;
}

int group_join(struct seq_group *g, struct seq *q) {
	if (g->broken || g->n == g->size || group_started(g))
		return -EBUSY;
	q->group = g;
	q->rank = g->n;
	g->members[g->n++] = q;
	return 0;
}

void group_leave(struct seq *q) {
	struct seq_group *g = q->group;
	uint32_t left = 0;

	if (!g)
		return;
	g->members[q->rank] = NULL;
	g->broken = true;
	q->group = NULL;
	for (uint32_t i = 0; i < g->n; i++)
		left += g->members[i] != NULL;
	if (left == 0)
		free(g);
}

uint64_t group_grow_bytes(const struct seq *q, const struct pool *p, uint32_t n) {
	const struct seq_group *g = q->group;
	uint64_t bytes = 0;

	for (uint32_t i = 0; i < g->n; i++)
		if (g->members[i] && seq_grow_check(g->members[i], n) == 0)
			bytes += seq_grow_bytes(g->members[i], p, n);
	return bytes;
}

int group_grow(struct seq *q, struct pool *p, uint32_t n, struct seq_grants *grants,
               struct seq_emptied *emptied, bool *ret_grown) {
	struct seq_group *g = q->group;
	uint32_t done = 0;
	int r = 0;

	*ret_grown = false;
	if (g->broken)
		return -EPIPE;
	if (g->n < g->size)
		return -EAGAIN;
	if (g->pending[q->rank] > 0) {
		if (g->pending[q->rank] != n)
			return -EINVAL;
		g->pending[q->rank] = 0;
		grants[q->rank].n = 0;
		return 0;
	}
	/* A step no member has claimed yet: check every member first, so that what fails
	 * for one fails before anything changes. */
	for (uint32_t i = 0; i < g->n; i++) {
		if (g->pending[i] > 0)
			return -EINVAL;
		r = seq_grow_check(g->members[i], n);
		if (r < 0)
			return r;
	}
	for (; done < g->n; done++) {
		struct seq *m = g->members[done];

		r = seq_grow(m, p, m->conn_id, n, &grants[done], emptied);
		if (r < 0)
			break;
	}
	if (r < 0) {
		grants[q->rank].short_bytes = grants[done].short_bytes;
		/* Undoes the members grown: their new slots go, and their new chunks' holds. */
		while (done-- > 0) {
			struct seq *m = g->members[done];

			for (uint32_t k = 0; k < grants[done].n; k++)
				pool_chunk_drop_holder(p, grants[done].chunks[k], m->conn_id);
			grants[done].n = 0;
			(void)seq_truncate(m, p, n, emptied);
		}
		return r;
	}
	for (uint32_t i = 0; i < g->n; i++)
		g->pending[i] = i == q->rank ? 0 : n;
	*ret_grown = true;
	return 0;
}
