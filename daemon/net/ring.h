/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A connection's shared-memory rings, the daemon's side (the layout and the protocol are
 * proto/common/ring.h's). Created at hello for a tenant's connection whose client offers
 * the ring feature; freed with the connection.
 *
 * The daemon reads submissions in ring_poll(), from the loop's poller (server.c), and hands
 * each, copied out of shared memory, to the server's ring handler (conn.h, struct
 * conn_handlers), which answers it with
 * ring_complete(), at once or later (a grow that waits for an eviction round). Completions
 * made in one pass are published together; one made outside a pass is published at once.
 *
 * What the client writes is checked, never trusted: corrupted indices close the connection,
 * a bad submission gets an error completion. A completion queue the client leaves full
 * makes the daemon stop taking its submissions (counted once per episode as the
 * ring_completions limit) rather than buffer anything.
 *
 * Doorbells: before the loop sleeps, ring_sleep_prepare() announces it on every ring and,
 * with the futex doorbell, arms an IORING_OP_FUTEX_WAIT on the ring's sq_wake word; with the
 * eventfd doorbell a read of the connection's eventfd is always armed. Either completion
 * only wakes the loop. Both count as operations of the connection (conn.h, inflight), and
 * closing the connection cancels them (ring_close()) so that it can be freed. A client
 * rings only when it submitted, so a doorbell that finds nothing to take, with nothing
 * taken since the doorbell before, is abuse (a loop on FUTEX_WAKE or the eventfd, or a
 * wake word kept at 0, each costing the daemon a turn):
 * past RING_EMPTY_WAKES_MAX of them in RING_WAKE_WINDOW_MS, the ring's doorbell is not
 * armed for a back-off (1 ms, doubling while the abuse goes on, at most
 * RING_BACKOFF_MAX_MS; a clean window resets it) and a timer looks at the ring instead, so
 * one client cannot take a core; each back-off is counted (the ring_doorbell limit).
 *
 * The socket: every frame the connection is sent is counted in the rings' frames word
 * (ring_sent()), before the completions that follow it are published (ring.h, "Socket").
 */

#include <stdbool.h>
#include <stdint.h>

#include "common/ring.h"
#include "loop.h"

struct conn;

enum ring_doorbell {
	RING_BELL_AUTO,               /* futex when the kernel has IORING_OP_FUTEX_WAIT, else eventfd */
	RING_BELL_FUTEX,
	RING_BELL_EVENTFD,
	_RING_BELL_MAX,
	_RING_BELL_INVALID = -EINVAL,
};

const char *ring_doorbell_to_string(int v);

struct ring {
	struct conn *conn;
	struct ring_shared *sh;       /* the daemon's mapping */
	struct kvd_ring_geometry geo;     /* what the daemon wrote; never read back */
	int memfd;                    /* kept until the hello reply took a copy */
	int efd;                      /* KVD_RING_DOORBELL_EVENTFD: the doorbell, read by the loop */
	uint32_t sq_head;             /* the next submission to take */
	uint32_t cq_tail;             /* the next completion slot to fill */
	uint32_t cq_head;             /* the client's cq_head, as last read */
	uint32_t owed;                /* submissions taken, completion not yet made */
	bool dirty;                   /* completions made but not published */
	bool polling;                 /* inside ring_poll(): it publishes at the end */
	bool stalled;                 /* the completion queue was full at the last pass */
	bool bell_armed;              /* the futex wait or eventfd read is in flight */
	struct loop_op bell_op;
	uint64_t efd_buf;
	/* Doorbells that found nothing to take (see "Doorbells" above): how many in the window
	 * that began at window_ms, whether a pass took submissions since the last doorbell
	 * (which then explains one found empty: it rang for them), and the back-off: no
	 * doorbell armed before backoff_until_ms (0: none), a timer instead. */
	bool took;
	uint32_t empty_wakes;
	uint64_t window_ms;
	uint32_t backoff_ms;
	uint64_t backoff_until_ms;
	bool timer_armed;
	struct loop_op timer_op;
};

/*
 * Creates the rings of connection c: `entries` of each (a power of two), with the given
 * doorbell (KVD_RING_DOORBELL_FUTEX or _EVENTFD). With the eventfd doorbell, its read is armed
 * at once. Returns 0, or -EINVAL, -ENOMEM, -errno.
 */
int ring_new(struct conn *c, uint32_t entries, uint32_t doorbell, struct ring **ret);
/* Frees r; only once no operation of it is in flight (ring_close() and then the loop). */
struct ring *ring_free(struct ring *r);
/* Fires the doorbell operation in flight, if any, so that it completes. */
void ring_close(struct ring *r);

/*
 * Takes and dispatches the connection's pending submissions, as many as the completion
 * queue has room for, then publishes the completions. Returns how many it took, or -EPROTO
 * when the indices are corrupted (the caller closes the connection).
 */
int ring_poll(struct ring *r);

/*
 * Makes the completion of the submission with user_data (res 0 or a negative errno; flags,
 * KVD_RING_CQE_F_* beyond the message's; msg, the refusal's text, or NULL). Inside ring_poll() it is published with the pass; outside (a
 * grow that waited for a round), at once. Frames the request queued on the socket (grants,
 * unmap requests, the events of a plan applied at an unpin) were counted in the frames word
 * before (ring_sent()), so the client reads them before it goes on.
 */
void ring_complete(struct ring *r, uint64_t user_data, int res, uint64_t generation,
                   uint32_t tokens, uint32_t flags, const char *msg);

/* The connection was sent a frame (conn.h's frames counts it): tells the client, and wakes
 * its threads asleep on the completion ring, if any, to read it (unless a submission of the
 * current pass sent it: its completion says so, and the client reads it after that). */
void ring_sent(struct ring *r);

/* The loop is about to sleep: announces it, arms the doorbell; returns false when a
 * submission came in meanwhile (then the loop must not sleep). */
bool ring_sleep_prepare(struct ring *r);
/* The loop woke up: the client need not ring any more. */
void ring_sleep_done(struct ring *r);

