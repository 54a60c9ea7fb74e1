/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "config.h"
#include "conn.h"
#include "envelope.h"
#include "log.h"
#include "mover.h"
#include "server.h"
#include "unmap.h"
#include "tier-file.h"
#include "tier.h"
#include "wire.h"

/* A request waiting for a recall. */
struct waiter {
	uint64_t conn_id;
	struct parked_grow req;
	evict_grow_fn retry;
};

struct job {
	struct job *next;
	struct tier_move *mv;
	enum tier_move_kind kind;
	struct seq *q;                /* NULL once it went away */
	uint64_t conn_id;             /* q's connection when it began */
	uint64_t seq_id;
	/* In: the chunks granted to the connection for the new blocks; in and demote: who
	 * waits for it. */
	struct seq_granted g;
	struct waiter *waiters;
	uint32_t n_waiters;
	bool done;                    /* the worker copied it (under the lock) */
};

struct mover {
	struct server *srv;
	pthread_t thread;
	bool started;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stop;
	/* Every move not yet finished, in the order queued; the worker takes the first not
	 * done. Only the loop links and unlinks. */
	struct job *jobs, *last;
	uint32_t n_jobs, n_out;
	uint64_t out_bytes;
	int efd;
	struct loop_op op;
	uint64_t buf;
	bool armed;
	struct tier_io *io;           /* the file tier's, used by the worker only */
	bool staging_pinned;          /* its staging is the backend's registered (host_register) */
	const char *gate;             /* KVD_TEST_MOVE_GATE */
};

static void *worker(void *userdata) {
	struct mover *m = userdata;
	uint64_t one = 1;

	pthread_mutex_lock(&m->lock);
	for (;;) {
		struct job *j = m->jobs;

		while (j && j->done)
			j = j->next;
		if (!j) {
			if (m->stop)
				break;
			pthread_cond_wait(&m->cond, &m->lock);
			continue;
		}
		/* The loop never frees a job that is not done, nor touches its move. */
		pthread_mutex_unlock(&m->lock);
		tier_move_run(j->mv, m->io);
		if (m->gate) {
			int fd = open(m->gate, O_RDONLY | O_CLOEXEC);
			char b;

			if (fd >= 0) {
				(void)!read(fd, &b, 1);
				close(fd);
			}
		}
		pthread_mutex_lock(&m->lock);
		j->done = true;
		(void)!write(m->efd, &one, sizeof(one));
	}
	pthread_mutex_unlock(&m->lock);
	return NULL;
}

static void on_done(struct loop_op *op, int res, bool more);

static int arm(struct mover *m) {
	int r;

	if (m->armed)
		return 0;
	m->op.handler = on_done;
	r = loop_read(m->srv->loop, &m->op, m->efd, &m->buf, sizeof(m->buf));
	if (r >= 0)
		m->armed = true;
	return r;
}

static void job_free(struct job *j) {
	free(j->g.chunks);
	free(j->waiters);
	free(j);
}

/* Queues j for the worker (started at the first move). */
static int queue(struct mover *m, struct job *j) {
	int r = arm(m);

	if (r >= 0 && !m->started) {
		r = -pthread_create(&m->thread, NULL, worker, m);
		m->started = r >= 0;
	}
	if (r < 0)
		return r;
	pool_readers_begin(m->srv->pool);
	pthread_mutex_lock(&m->lock);
	if (m->last)
		m->last->next = j;
	else
		m->jobs = j;
	m->last = j;
	m->n_jobs++;
	pthread_cond_signal(&m->cond);
	pthread_mutex_unlock(&m->lock);
	j->q->move = j;
	return 0;
}

/* Queues the demotions an offload's room took (tier_offload_begin), ahead of the offload:
 * the worker writes their host segments out before anything queued after fills them. A
 * demotion that cannot be queued loses its sequence at once (its segments are given). */
static void queue_demotes(struct mover *m, struct tier_move **demotes, uint32_t n) {
	struct server *s = m->srv;

	for (uint32_t i = 0; i < n; i++) {
		struct seq *q = tier_move_seq(demotes[i]);
		struct job *j = calloc(1, sizeof(*j));
		int r = j ? 0 : -ENOMEM;

		if (j) {
			*j = (struct job){ .mv = demotes[i], .kind = TIER_MOVE_DEMOTE, .q = q,
				           .conn_id = q->conn_id, .seq_id = q->id };
			r = queue(m, j);
		}
		if (r < 0) {
			log_error_errno(r, "sequence %llu: cannot move it to the file tier, lost",
			                (unsigned long long)q->id);
			tier_move_fail(demotes[i], r);
			(void)tier_demote_end(s->tier, demotes[i], q);
			free(j);
		}
	}
	free(demotes);
}

int mover_out(struct mover *m, struct seq *q) {
	struct server *s = m->srv;
	struct tier_move **demotes;
	uint32_t n_demotes;
	struct job *j;
	int r;

	if (m->n_out >= MOVES_OUT_MAX)
		return -EBUSY;
	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	*j = (struct job){ .kind = TIER_MOVE_OUT, .q = q, .conn_id = q->conn_id, .seq_id = q->id };
	r = tier_offload_begin(s->tier, q, s->pool, registry_metadata_max(s), s->limits.tier_max_percent,
	                       &j->mv, &demotes, &n_demotes);
	queue_demotes(m, demotes, n_demotes);
	if (r >= 0) {
		r = queue(m, j);
		if (r < 0)
			(void)tier_offload_end(s->tier, j->mv, NULL, s->pool, NULL);
	}
	if (r < 0) {
		job_free(j);
		return r;
	}
	m->n_out++;
	m->out_bytes += tier_move_bytes(j->mv);
	return 0;
}

static int add_waiter(struct job *j, struct conn *c, const struct parked_grow *req,
                      evict_grow_fn retry) {
	struct waiter *w = realloc(j->waiters, (j->n_waiters + 1) * sizeof(*w));

	if (!w)
		return -ENOMEM;
	j->waiters = w;
	w[j->n_waiters++] = (struct waiter){ c->id, *req, retry };
	c->outstanding++;
	return 0;
}

int mover_in(struct mover *m, struct conn *c, struct seq *q, const struct parked_grow *req,
             evict_grow_fn retry, uint64_t *ret_short_bytes) {
	struct server *s = m->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	struct job *j = q->move;
	int r;

	*ret_short_bytes = 0;
	if (j && j->kind != TIER_MOVE_OUT)
		return add_waiter(j, c, req, retry);
	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	*j = (struct job){ .kind = TIER_MOVE_IN, .q = q, .conn_id = c->id, .seq_id = q->id };
	/* Every chunk of the pool, at most, each granted once. */
	j->g.chunks = malloc(s->pool->n_chunks * sizeof(*j->g.chunks));
	j->g.max = s->pool->n_chunks;
	r = j->g.chunks ? add_waiter(j, c, req, retry) : -ENOMEM;
	if (r >= 0) {
		r = tier_recall_begin(s->tier, q, s->pool, c->id, &j->g, &emptied, &j->mv);
		*ret_short_bytes = j->g.short_bytes;
		unmap_reclaim(s, &emptied, NULL, NULL);
		if (r < 0)
			c->outstanding--;
	}
	if (r >= 0) {
		r = queue(m, j);
		if (r < 0) {
			/* Never run: q stays in the tier, its new blocks go back. */
			c->outstanding--;
			emptied = (struct seq_emptied){ .chunks = s->scratch + s->scratch_used };
			tier_move_fail(j->mv, -ECANCELED);
			(void)tier_recall_end(s->tier, j->mv, q, s->pool, c->id, &j->g, &emptied);
			unmap_reclaim(s, &emptied, NULL, NULL);
		}
	}
	if (r < 0) {
		job_free(j);
		return r;
	}
	return 0;
}

void mover_forget(struct mover *m, struct seq *q) {
	struct job *j = q->move;

	if (!j)
		return;
	/* A recall or a demotion reads q's entry until its end, which frees it. */
	if (j->kind != TIER_MOVE_OUT)
		(void)tier_detach(m->srv->tier, q);
	j->q = NULL;
	q->move = NULL;
}

uint64_t mover_out_bytes(const struct mover *m) {
	return m->out_bytes;
}

uint32_t mover_moves(const struct mover *m) {
	return m->n_jobs;
}

static void finish_out(struct mover *m, struct job *j) {
	struct server *s = m->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	struct tenant *t = j->q ? j->q->tenant : NULL;
	uint64_t bytes = tier_move_bytes(j->mv);
	struct seq *q = j->q;
	int r;

	m->n_out--;
	m->out_bytes -= bytes;
	if (q)
		q->move = NULL;
	r = tier_offload_end(s->tier, j->mv, q, s->pool, &emptied);
	if (r < 0) {
		if (r != -ECANCELED)
			log_warning("sequence %llu: moving it to the host tier failed: %s",
			            (unsigned long long)j->seq_id, strerror(-r));
		return;
	}
	log_debug("sequence %llu (tenant %s): moved to the host tier, %llu bytes",
	          (unsigned long long)q->id, t->name, (unsigned long long)bytes);
	unmap_reclaim(s, &emptied, NULL, NULL);
	/* What the blocks moved out leave scattered comes free by packing, as after a
	 * round. Tenants are never forgotten while they hold a sequence. */
	emptied = (struct seq_emptied){ .chunks = s->scratch + s->scratch_used };
	(void)evict_settle_tenant(s->evictor, t, &emptied);
	{
		struct conn *c = registry_conn(s, j->conn_id);

		if (c && !c->closing)
			envelope_event_seq_changed(c, j->seq_id, q->desc->generation);
	}
	/* Grows waiting for memory may have it now. */
	evict_chunks_back(s->evictor);
}

/* The file tier failed tenant t (an I/O error, a full disk): its sequences are dropped from
 * now on, as with tier drop, until an operator sets its tier again. */
static void degrade(struct tenant *t, int error) {
	if (t->tier_degraded)
		return;
	t->tier_degraded = true;
	log_error("tenant %s: the file tier failed (%s): its sequences are evicted as with tier "
	          "drop from now on, until its tier is set again (kvdctl tenant set --tier)",
	          t->name, strerror(-error));
}

/* The requests that waited for j run again, as if they came now. */
static void run_waiters(struct mover *m, struct job *j) {
	struct server *s = m->srv;

	for (uint32_t i = 0; i < j->n_waiters; i++) {
		struct waiter *w = &j->waiters[i];
		uint64_t wait = s->limits.grant_wait_ms;
		struct conn *c = registry_conn(s, w->conn_id);

		if (!c || c->closing)
			continue;
		c->outstanding--;
		w->retry(c, &w->req, wait ? now_ms() + wait : 0);
	}
}

static void finish_in(struct mover *m, struct job *j) {
	struct server *s = m->srv;
	struct seq_emptied emptied = { .chunks = s->scratch + s->scratch_used };
	struct conn *c = registry_conn(s, j->conn_id);
	struct envelope_grants grants;
	struct seq *q = j->q;
	int r;

	if (q)
		q->move = NULL;
	r = tier_recall_end(s->tier, j->mv, q, s->pool, j->conn_id, &j->g, &emptied);
	unmap_reclaim(s, &emptied, NULL, NULL);
	if (r < 0 && r != -ECANCELED)
		log_warning("sequence %llu (tenant %s): %s at its recall from the tier: lost, as "
		            "if evicted, never served", (unsigned long long)j->seq_id,
		            q ? q->tenant->name : "?",
		            r == -EBADMSG ? "a block failed its checksum" : strerror(-r));
	/* Only the file's I/O fails otherwise (or a failing device). */
	if (r < 0 && r != -ECANCELED && r != -EBADMSG && q && s->tier->file)
		degrade(q->tenant, r);
	/* Its chunks first, as a grow's (ring.h, "Socket"). */
	for (uint32_t i = 0; r == 0 && c && !c->closing && i < j->g.n; i += WIRE_FDS_MAX) {
		envelope_grants(&grants, s->pool, c->device, j->g.chunks + i,
		                MIN(j->g.n - i, WIRE_FDS_MAX));
		envelope_event_grants(c, &grants);
	}
	run_waiters(m, j);
}

static void finish_demote(struct mover *m, struct job *j) {
	struct server *s = m->srv;
	struct seq *q = j->q;
	int r;

	if (q)
		q->move = NULL;
	r = tier_demote_end(s->tier, j->mv, q);
	if (r < 0 && q) {
		log_warning("sequence %llu (tenant %s): writing it to the file tier failed: %s; lost, "
		            "as if evicted", (unsigned long long)j->seq_id, q->tenant->name,
		            strerror(-r));
		degrade(q->tenant, r);
	}
	run_waiters(m, j);
}

static void on_done(struct loop_op *op, int res, bool more) {
	struct mover *m = container_of(op, struct mover, op);

	(void)res, (void)more;
	m->armed = false;
	for (;;) {
		struct job *j;
		bool done;

		pthread_mutex_lock(&m->lock);
		j = m->jobs;
		done = j && j->done;
		if (done) {
			m->n_jobs--;
			m->jobs = j->next;
			if (!m->jobs)
				m->last = NULL;
		}
		pthread_mutex_unlock(&m->lock);
		if (!done)
			break;
		if (j->kind == TIER_MOVE_OUT)
			finish_out(m, j);
		else if (j->kind == TIER_MOVE_IN)
			finish_in(m, j);
		else
			finish_demote(m, j);
		job_free(j);
		/* After the finish, which may free blocks the worker read. */
		pool_readers_end(m->srv->pool);
	}
	if (m->jobs && arm(m) < 0)
		log_error("cannot wait for moves to the host tier: the loop refused");
}

int mover_new(struct server *s, struct mover **ret) {
	struct mover *m = calloc(1, sizeof(*m));

	if (!m)
		return -ENOMEM;
	m->srv = s;
	m->efd = eventfd(0, EFD_CLOEXEC);
	if (m->efd < 0) {
		int r = negative_errno();

		free(m);
		return r;
	}
	pthread_mutex_init(&m->lock, NULL);
	pthread_cond_init(&m->cond, NULL);
#if KVD_TEST_HOOKS
	m->gate = getenv("KVD_TEST_MOVE_GATE");
#endif
	if (s->tier->file) {
		int r = tier_io_new(s->tier->file, s->tier->base, s->tier->budget_bytes, &m->io);

		if (r < 0) {
			mover_free(m);
			return r;
		}
		log_info("file tier: an unlinked file in %s, %s", s->tier->file->dir,
		         tier_io_describe(m->io));
		/* On a GPU pool a recall from the file writes device memory from staging. */
		if (s->pool->ops->host_register) {
			uint64_t bytes;
			void *staging = tier_io_staging(m->io, &bytes);

			m->staging_pinned = s->pool->ops->host_register(staging, bytes) >= 0;
		}
	}
	*ret = m;
	return 0;
}

struct mover *mover_free(struct mover *m) {
	if (!m)
		return NULL;
	if (m->started) {
		pthread_mutex_lock(&m->lock);
		m->stop = true;
		pthread_cond_signal(&m->cond);
		pthread_mutex_unlock(&m->lock);
		pthread_join(m->thread, NULL);
	}
	/* Their sequences went with the connections: only the moves' own state is left. */
	while (m->jobs) {
		struct job *j = m->jobs;
		struct seq_emptied emptied = { .chunks = m->srv->scratch };

		m->jobs = j->next;
		if (j->kind == TIER_MOVE_OUT)
			(void)tier_offload_end(m->srv->tier, j->mv, NULL, m->srv->pool, &emptied);
		else if (j->kind == TIER_MOVE_IN)
			(void)tier_recall_end(m->srv->tier, j->mv, NULL, m->srv->pool, j->conn_id,
			                      &j->g, &emptied);
		else
			(void)tier_demote_end(m->srv->tier, j->mv, NULL);
		job_free(j);
		pool_readers_end(m->srv->pool);
	}
	if (m->staging_pinned) {
		uint64_t bytes;

		m->srv->pool->ops->host_unregister(tier_io_staging(m->io, &bytes));
	}
	m->io = tier_io_free(m->io);
	safe_close(m->efd);
	pthread_cond_destroy(&m->cond);
	pthread_mutex_destroy(&m->lock);
	free(m);
	return NULL;
}
