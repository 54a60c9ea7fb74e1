/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
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
	struct departed *next;
};

static void departed_unlink(struct server *s, struct departed *d) {
	for (struct departed **l = &s->departed; *l; l = &(*l)->next)
		if (*l == d) {
			*l = d->next;
			s->n_departed--;
			return;
		}
}

static void on_exit_seen(struct loop_op *op, int res, bool more) {
	struct departed *d = container_of(op, struct departed, op);
	struct server *s = d->srv;
	uint32_t n;

	departed_unlink(s, d);
	/* An error polls nothing more: the holds go as if the process had exited, since
	 * nothing would ever end them otherwise. */
	if (res < 0)
		log_warning("cannot watch process %d any more (%s): the chunks it mapped are given "
		            "back now", (int)d->pid, strerror(-res));
	n = pool_drop_holder_everywhere(s->pool, d->conn_id);
	log_info("process %d (connection %" PRIu64 ", tenant %s) exited: the %" PRIu32 " chunks it "
	         "still mapped are no longer charged to it", (int)d->pid, d->conn_id, d->tenant, n);
	safe_close(d->pidfd);
	free(d);
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

bool departed_find(const struct server *s, uint64_t conn_id) {
	for (const struct departed *d = s->departed; d; d = d->next)
		if (d->conn_id == conn_id)
			return true;
	return false;
}

void departed_end_all(struct server *s) {
	while (s->departed) {
		struct departed *d = s->departed;

		s->departed = d->next;
		pool_drop_holder_everywhere(s->pool, d->conn_id);
		safe_close(d->pidfd);
		free(d);
	}
	s->n_departed = 0;
}
