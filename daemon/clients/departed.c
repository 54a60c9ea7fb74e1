/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "departed.h"
#include "log.h"
#include "loop.h"
#include "pool.h"
#include "server.h"
#include "tenant.h"

struct departed {
	struct loop_op op;
	struct server *srv;
	uint64_t conn_id;
	int pidfd;
	pid_t pid;
	char tenant[KVD_TENANT_NAME_MAX + 1];
	uint64_t since_ms;
	/* An operator ended its holds (departed_end): its pidfd's poll, cancelled, has yet
	 * to complete; nothing is left to do but free it then. */
	bool ended;
	struct departed *next;
};

static void departed_unlink(struct server *s, struct departed *d) {
	for (struct departed **l = &s->departed; *l; l = &(*l)->next)
		if (*l == d) {
			*l = d->next;
			/* One an operator ended was no longer counted. */
			s->n_departed -= !d->ended;
			return;
		}
}

static void departed_free(struct departed *d) {
	safe_close(d->pidfd);
	free(d);
}

static void on_exit_seen(struct loop_op *op, int res, bool more) {
	struct departed *d = container_of(op, struct departed, op);
	struct server *s = d->srv;
	uint32_t n;

	(void)more;
	departed_unlink(s, d);
	if (d->ended) {
		departed_free(d);
		return;
	}
	/* An error polls nothing more: the holds go as if the process had exited, since
	 * nothing would ever end them otherwise. */
	if (res < 0)
		log_warning("cannot watch process %d any more (%s): the chunks it mapped are given "
		            "back now", (int)d->pid, strerror(-res));
	n = pool_drop_holder_everywhere(s->pool, d->conn_id, false);
	log_info("process %d (connection %" PRIu64 ", tenant %s) exited: the %" PRIu32 " chunks it "
	         "still mapped are no longer charged to it", (int)d->pid, d->conn_id, d->tenant, n);
	departed_free(d);
}

int departed_watch(struct server *s, uint64_t conn_id, int pidfd, pid_t pid, const char *tenant,
                   uint32_t n_chunks) {
	struct departed *d = calloc(1, sizeof(*d));
	int r;

	if (!d)
		return -ENOMEM;
	d->op.handler = on_exit_seen;
	d->srv = s;
	d->conn_id = conn_id;
	d->pidfd = pidfd;
	d->pid = pid;
	d->since_ms = now_ms();
	snprintf(d->tenant, sizeof(d->tenant), "%s", tenant);
	r = loop_poll(s->loop, &d->op, pidfd, POLLIN);
	if (r < 0) {
		free(d);
		return r;
	}
	d->next = s->departed;
	s->departed = d;
	s->n_departed++;
	log_notice("connection %" PRIu64 " (pid %d, tenant %s) closed without unmapping %" PRIu32
	           " chunks: they stay charged to tenant %s until the process exits", conn_id,
	           (int)pid, tenant, n_chunks, tenant);
	return 0;
}

static struct departed *find(const struct server *s, uint64_t conn_id) {
	for (struct departed *d = s->departed; d; d = d->next)
		if (d->conn_id == conn_id && !d->ended)
			return d;
	return NULL;
}

bool departed_find(const struct server *s, uint64_t conn_id) {
	return find(s, conn_id) != NULL;
}

const char *departed_tenant(const struct server *s, uint64_t conn_id) {
	const struct departed *d = find(s, conn_id);

	return d ? d->tenant : NULL;
}

uint32_t departed_list(const struct server *s, uint64_t after, struct departed_info *out,
                       uint32_t max) {
	uint32_t n = 0;

	for (const struct departed *d = s->departed; d && n < max; d = d->next) {
		uint32_t chunks = 0;

		if (d->ended || d->conn_id <= after)
			continue;
		for (uint32_t i = 0; i < s->pool->n_chunks; i++)
			chunks += s->pool->chunks[i].n_holders > 0 &&
			          chunk_has_holder(&s->pool->chunks[i], d->conn_id);
		out[n++] = (struct departed_info){ d->conn_id, d->pid, d->tenant, d->since_ms, chunks };
	}
	return n;
}

int departed_end(struct server *s, uint64_t conn_id, const char *by) {
	struct departed *d = find(s, conn_id);
	uint32_t n;

	if (!d)
		return -ENOENT;
	n = pool_drop_holder_everywhere(s->pool, d->conn_id, true);
	log_notice("departed connection %" PRIu64 " (pid %d, tenant %s): charge of its %" PRIu32
	           " chunks ended by %s; those it still maps get new memory objects before anyone "
	           "takes them again", conn_id, (int)d->pid, d->tenant, n, by);
	d->ended = true;
	s->n_departed--;
	/* Freed when the cancelled poll completes: the loop still holds its op. */
	if (loop_cancel(s->loop, &d->op) < 0)
		log_warning("departed connection %" PRIu64 ": cannot cancel the watch of pid %d; "
		            "it ends when the process exits", conn_id, (int)d->pid);
	return 0;
}

void departed_end_all(struct server *s) {
	while (s->departed) {
		struct departed *d = s->departed;

		s->departed = d->next;
		if (!d->ended)
			pool_drop_holder_everywhere(s->pool, d->conn_id, false);
		departed_free(d);
	}
	s->n_departed = 0;
}
