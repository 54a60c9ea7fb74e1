/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "basic/macro.h"
#include "conn.h"
#include "log.h"
#include "memfd.h"
#include "ring.h"
#include "server.h"

const char *ring_doorbell_to_string(int v) {
	static const char *const names[_RING_BELL_MAX] = {
		[RING_BELL_AUTO] = "auto",
		[RING_BELL_FUTEX] = "futex",
		[RING_BELL_EVENTFD] = "eventfd",
	};

	return v >= 0 && v < _RING_BELL_MAX ? names[v] : NULL;
}

/* Doorbells that find nothing (ring.h, "Doorbells"): the most a window may have. */
#define RING_WAKE_WINDOW_MS 100
#define RING_EMPTY_WAKES_MAX 32u
#define RING_BACKOFF_MAX_MS 1000u

static void ring_bell_done(struct loop_op *op, int res, bool more);
static void ring_timer_done(struct loop_op *op, int res, bool more);

/* With the eventfd doorbell, a read of it is always in flight. */
static int ring_arm_eventfd(struct ring *r) {
	int k = loop_read(r->conn->srv->loop, &r->bell_op, r->efd, &r->efd_buf, sizeof(r->efd_buf));

	if (k < 0)
		return k;
	r->bell_armed = true;
	r->conn->inflight++;
	return 0;
}

int ring_new(struct conn *c, uint32_t entries, uint32_t doorbell, struct ring **ret) {
	struct ring *r;
	void *sh;
	int k;

	r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	r->conn = c;
	r->memfd = r->efd = -EBADF;
	r->bell_op.handler = ring_bell_done;
	r->timer_op.handler = ring_timer_done;
	k = ring_layout(entries, doorbell, &r->geo);
	if (k < 0)
		goto fail;
	/* The client writes the rings too. */
	k = memfd_sealed("kvd-ring", r->geo.total_bytes, 0, &r->memfd, &sh);
	if (k < 0)
		goto fail;
	r->sh = sh;
	r->sh->geo = r->geo;
	if (doorbell == KVD_RING_DOORBELL_EVENTFD) {
		r->efd = eventfd(0, EFD_CLOEXEC);
		if (r->efd < 0) {
			k = negative_errno();
			goto fail;
		}
		k = ring_arm_eventfd(r);
		if (k < 0)
			goto fail;
	}
	*ret = r;
	return 0;
fail:
	ring_free(r);
	return k;
}

struct ring *ring_free(struct ring *r) {
	if (!r)
		return NULL;
	if (r->sh)
		munmap(r->sh, r->geo.total_bytes);
	safe_close(r->memfd);
	safe_close(r->efd);
	free(r);
	return NULL;
}

void ring_close(struct ring *r) {
	/* Without a loop (the daemon exits), io_uring_queue_exit() already cancelled it. */
	if (r->bell_armed && r->conn->srv->loop && loop_cancel(r->conn->srv->loop, &r->bell_op) < 0)
		log_error("connection %llu: cannot cancel its ring's doorbell; it stays until exit",
		          (unsigned long long)r->conn->id);
	if (r->timer_armed && r->conn->srv->loop && loop_cancel(r->conn->srv->loop, &r->timer_op) < 0)
		log_error("connection %llu: cannot cancel its ring's timer; it stays until exit",
		          (unsigned long long)r->conn->id);
}

/* Whether r's doorbell is off for a back-off now. */
static bool backing_off(struct ring *r) {
	if (r->backoff_until_ms == 0)
		return false;
	if (now_ms() < r->backoff_until_ms)
		return true;
	r->backoff_until_ms = 0;
	return false;
}

/* A doorbell found nothing to take: counted, and past the window's bound, a back-off. */
static void ring_empty_wake(struct ring *r) {
	uint64_t now = now_ms();

	if (now >= r->window_ms + RING_WAKE_WINDOW_MS) {
		if (r->empty_wakes < RING_EMPTY_WAKES_MAX)
			r->backoff_ms = 0;
		r->window_ms = now;
		r->empty_wakes = 0;
	}
	if (++r->empty_wakes < RING_EMPTY_WAKES_MAX)
		return;
	r->backoff_ms = r->backoff_ms ? MIN(2 * r->backoff_ms, RING_BACKOFF_MAX_MS) : 1;
	r->backoff_until_ms = now + r->backoff_ms;
	/* The next window begins when the back-off ends: another full one doubles it, a
	 * clean one ends the episode. */
	r->window_ms = r->backoff_until_ms;
	r->empty_wakes = 0;
	conn_refused(r->conn, LIMIT_RING_DOORBELL);
}

static void ring_timer_done(struct loop_op *op, int res, bool more) {
	struct ring *r = container_of(op, struct ring, timer_op);
	struct conn *c = r->conn;

	(void)res;
	(void)more;
	/* The loop is awake and looks at the ring; the doorbell is armed again before it
	 * sleeps (ring_sleep_prepare). */
	r->timer_armed = false;
	c->inflight--;
	conn_maybe_free(c);
}

static void ring_bell_done(struct loop_op *op, int res, bool more) {
	struct ring *r = container_of(op, struct ring, bell_op);
	struct conn *c = r->conn;

	r->bell_armed = false;
	c->inflight--;
	if (conn_maybe_free(c) || c->closing)
		return;
	/* Rung with nothing submitted, and nothing a pass took since the doorbell before
	 * (which it would have rung for): abuse, counted here, at each completion, as a loop
	 * may complete several before it looks at the rings. */
	if (ring_load_acquire(&r->sh->sq_tail) == r->sq_head && !r->took)
		ring_empty_wake(r);
	r->took = false;
	/* Woken (0), or the word was no longer 1 when the wait was armed (-EAGAIN): the loop
	 * is awake either way, and looks at the rings. */
	if (res < 0 && res != -EAGAIN && res != -EINTR) {
		log_error_errno(res, "connection %llu: its ring's doorbell failed, disconnecting",
		                (unsigned long long)c->id);
		conn_close(c, "ring doorbell failed");
		conn_maybe_free(c);
		return;
	}
	/* Backing off, the timer armed before the loop sleeps re-arms it. */
	if (r->efd >= 0 && !backing_off(r) && ring_arm_eventfd(r) < 0)
		conn_close(c, "cannot re-arm the ring's doorbell");
}

/* Publishes the completions made since the last time, and wakes the client if one of its
 * threads sleeps. */
static void ring_publish(struct ring *r) {
	if (!r->dirty)
		return;
	r->dirty = false;
	ring_store_release(&r->sh->cq_tail, r->cq_tail);
	if (ring_wake_needed(&r->sh->cq_wake))
		(void)ring_futex_wake(&r->sh->cq_wake);
}

/*
 * Whether a submission can be taken: the completion queue must keep room for it and for
 * every completion owed. The client's head is read again only when the last one read says
 * there is no room. Returns 1, 0, or -EPROTO for a head the tail cannot be at.
 */
static int ring_room(struct ring *r) {
	uint32_t head;

	if (r->cq_tail - r->cq_head + r->owed < r->geo.entries)
		return 1;
	head = ring_load_acquire(&r->sh->cq_head);
	if (r->cq_tail - head > r->geo.entries)
		return -EPROTO;
	r->cq_head = head;
	return r->cq_tail - r->cq_head + r->owed < r->geo.entries;
}

/* Copies submission i out of shared memory, field by field, so that what is checked is
 * what is used even if the client rewrites it meanwhile. */
static void ring_take(struct ring *r, uint32_t i, struct kvd_ring_sqe *ret) {
	const struct kvd_ring_sqe *e = ring_sqe_at(r->sh, &r->geo, i);

	ret->op = __atomic_load_n(&e->op, __ATOMIC_RELAXED);
	ret->flags = __atomic_load_n(&e->flags, __ATOMIC_RELAXED);
	ret->reserved = __atomic_load_n(&e->reserved, __ATOMIC_RELAXED);
	ret->arg = __atomic_load_n(&e->arg, __ATOMIC_RELAXED);
	ret->seq_id = __atomic_load_n(&e->seq_id, __ATOMIC_RELAXED);
	ret->user_data = __atomic_load_n(&e->user_data, __ATOMIC_RELAXED);
	ret->reserved2 = __atomic_load_n(&e->reserved2, __ATOMIC_RELAXED);
}

int ring_poll(struct ring *r) {
	struct conn *c = r->conn;
	uint32_t tail, n, taken = 0;
	int k = 0;

	tail = ring_load_acquire(&r->sh->sq_tail);
	n = tail - r->sq_head;
	if (n == 0)
		return 0;
	if (n > r->geo.entries)
		return -EPROTO;
	r->polling = true;
	for (; taken < n && !c->closing && !c->close_when_sent; taken++) {
		struct kvd_ring_sqe sqe;

		k = ring_room(r);
		if (k <= 0)
			break;
		ring_take(r, r->sq_head, &sqe);
		r->sq_head++;
		r->owed++;
		c->srv->handlers.ring(c, &sqe);
	}
	r->polling = false;
	r->took |= taken > 0;
	if (k == 0 && !r->stalled) {
		/* Counted once per episode: a client that does not read its completions. */
		r->stalled = true;
		conn_refused(c, LIMIT_RING_COMPLETIONS);
	} else if (k > 0)
		r->stalled = false;
	ring_store_release(&r->sh->sq_head, r->sq_head);
	ring_publish(r);
	return k < 0 ? k : (int)taken;
}

void ring_complete(struct ring *r, uint64_t user_data, int res, uint64_t generation,
                   uint32_t tokens, uint32_t flags, const char *msg) {
	struct kvd_ring_cqe *e;

	if (r->conn->closing)
		return;
	/* Room was reserved when the submission was taken: never write past the client's head. */
	if (r->owed == 0) {
		log_error("connection %llu: a ring completion nobody waits for, ignoring",
		          (unsigned long long)r->conn->id);
		return;
	}
	if (msg) {
		char *m = ring_msg_at(r->sh, &r->geo, r->cq_tail);
		size_t len = strnlen(msg, KVD_RING_MSG_BYTES - 1);

		memcpy(m, msg, len);
		m[len] = '\0';
		flags |= KVD_RING_CQE_F_MESSAGE;
	}
	e = ring_cqe_at(r->sh, &r->geo, r->cq_tail);
	*e = (struct kvd_ring_cqe){
		.user_data = user_data,
		.res = res,
		.flags = flags,
		.generation = generation,
		.tokens = tokens,
	};
	r->cq_tail++;
	r->owed--;
	r->dirty = true;
	/* Inside ring_poll() the pass publishes; a late completion (a grow that waited) goes
	 * out now. */
	if (!r->polling)
		ring_publish(r);
}

void ring_sent(struct ring *r) {
	__atomic_store_n(&r->sh->frames.v, (uint32_t)r->conn->frames, __ATOMIC_RELEASE);
	/* Frames a submission of this pass queued are announced by its completion, which the
	 * pass publishes: the client must see that first, and read them after it. */
	if (r->polling)
		return;
	if (ring_wake_needed(&r->sh->cq_wake))
		(void)ring_futex_wake(&r->sh->cq_wake);
}

bool ring_sleep_prepare(struct ring *r) {
	uint32_t tail;

	if (r->conn->closing)
		return true;
	ring_sleep_announce(&r->sh->sq_wake);
	tail = ring_load_acquire(&r->sh->sq_tail);
	/* Work, unless the completion queue has no room for it (then the client rings again
	 * when it submits); a corrupted ring counts as work, for ring_poll() to find. */
	if (tail != r->sq_head && (tail - r->sq_head > r->geo.entries || ring_room(r) != 0))
		return false;
	if (backing_off(r)) {
		/* No doorbell: the ring is looked at when the back-off ends. */
		if (!r->timer_armed) {
			if (loop_timeout(r->conn->srv->loop, &r->timer_op,
			                 r->backoff_until_ms - now_ms() + 1) < 0)
				return false;
			r->timer_armed = true;
			r->conn->inflight++;
		}
		return true;
	}
	if (r->bell_armed)
		return true;
	/* The eventfd doorbell after a back-off (else always armed: ring_bell_done). */
	if (r->efd >= 0)
		return ring_arm_eventfd(r) >= 0;
	if (loop_futex_wait(r->conn->srv->loop, &r->bell_op, &r->sh->sq_wake.v, 1) < 0)
		return false; /* the loop's queue is full: spin once more instead */
	r->bell_armed = true;
	r->conn->inflight++;
	return true;
}

void ring_sleep_done(struct ring *r) {
	/* A plain load first: while it is 0 the line stays shared with the client. */
	if (__atomic_load_n(&r->sh->sq_wake.v, __ATOMIC_RELAXED) != 0)
		__atomic_store_n(&r->sh->sq_wake.v, 0, __ATOMIC_RELAXED);
}
