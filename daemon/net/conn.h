/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A client connection: its socket, framing, outgoing queue, and session state (hello,
 * tenant, models, sequences). A connection is closed by conn_close(), which drops its
 * session state at once (so its memory comes back within the loop iteration) and frees the
 * struct itself only when its last io_uring operation has completed.
 */

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "loop.h"
#include "model.h"
#include "registry.h"
#include "seq.h"
#include "wire.h"

struct ring;
struct server;

struct tx {
	struct tx *next;
	uint8_t *frame;
	size_t size;
	int fds[WIRE_FDS_MAX];        /* dups, owned, closed once sent */
	uint32_t nfds;
};

struct conn {
	uint64_t id;
	int fd;
	struct server *srv;
	struct conn *next, *prev;
	/* On server.closed once closed. Separate links, so that a walk of server.conns that
	 * closes the connection it is about to visit still finds the live ones after it. */
	struct conn *closed_next, *closed_prev;

	struct ucred cred;            /* SO_PEERCRED at accept */
	/* The peer process, for a tenant's connection (conn_open_pidfd at hello): what
	 * departed.h watches when it closes still mapping chunks. -EBADF: none. */
	int pidfd;
	uint64_t accepted_ms;
	/* Since when a frame has been begun but not received in full without a byte more (0:
	 * none): the tick closes the connection past hello-timeout, so that a stalled frame
	 * does not hold its fds and buffer forever. An idle connection between frames is not
	 * timed. */
	uint64_t partial_since_ms;
	bool hello;
	uint32_t version;
	struct tenant *tenant;        /* NULL: administrative connection */
	uint32_t device;              /* the pool's device its chunks come from (pool.h) */
	char process_name[64];
	uint32_t violations;

	struct model *models;         /* limits.max_models entries, id = index + 1 */
	uint32_t n_models;
	struct seq *seqs;
	uint32_t n_seqs;
	/* Engines' interprocess events (RegisterEvent), opened on the connection's GPU; an
	 * engine has a stream or a few, each with its event. SeqUnpin.event_id i is
	 * events[i - 1]. */
	void *events[KVD_CONN_EVENTS_MAX];
	uint32_t n_events;
	uint32_t outstanding;         /* requests whose reply waits (evict.h, upload.h) */
	/* Requests that run a round (Evict, Plan, SeqRecall) of a tenant that is not an
	 * operator: a token bucket of ROUND_RATE_BURST, refilled at ROUND_RATE_PER_S
	 * (rounds.c). */
	uint32_t round_tokens;
	uint64_t round_refill_ms;
	struct ring *ring;            /* the per-step rings (ring.h), NULL without */
	uint64_t frames;              /* frames conn_send() took so far */
	/* The first unmap deadline (unmap_due()) it missed of the draining chunks it
	 * still holds, 0: none; while set it gets no grants, and unmap-grace after it, it is
	 * disconnected (server.c, unmap_tick()). unmap_late counts those chunks, as of the
	 * tick's scan, so that answering the last of them lifts the ban at once. */
	uint64_t unmap_due_ms;
	uint32_t unmap_late;
	bool unmap_was_late;          /* unmap_tick()'s scratch */

	unsigned inflight;
	uint64_t hot_ns;              /* read by the poller since then (conn_poll()); 0: not */
	bool closing;
	bool close_when_sent;

	struct loop_op recv_op;
	/* Frames left in rx when the turn's share ran out (CONN_FRAMES_PER_TURN): resume_op
	 * comes back for them, and nothing more is read meanwhile. */
	struct loop_op resume_op;
	bool yielded;
	struct wire_rx *rx;
	struct msghdr rx_msg;
	struct iovec rx_iov;
	_Alignas(struct cmsghdr) uint8_t rx_cmsg[WIRE_CMSG_SPACE];

	struct loop_op send_op;
	struct tx *tx_head, *tx_tail;
	uint64_t tx_bytes;
	size_t tx_off;                /* bytes of tx_head already sent */
	struct msghdr tx_msg;
	struct iovec tx_iov;
	_Alignas(struct cmsghdr) uint8_t tx_cmsg[WIRE_CMSG_SPACE];
};

/* Takes ownership of fd (an accepted socket) and starts reading. */
int conn_new(struct server *s, int fd, struct conn **ret);

/* Queues env, with dups of fds attached. Returns 0, or -ENOBUFS (queue over its limit: the
 * connection is being closed), -EMSGSIZE, -ENOMEM. */
int conn_send(struct conn *c, const Envelope *env, const int *fds, uint32_t nfds);

/* Counts a protocol violation; past the limit the connection is closed. */
void conn_violation(struct conn *c, const char *what);

/* Counts a refusal at limit l of a request of c (registry.h), and logs it (info, with the
 * peer's pid, uid and tenant; rate-limited like every message). */
void conn_refused(const struct conn *c, enum server_limit l);

/*
 * fds a client's connection may have sent that no frame has taken yet: a client request
 * carries one at most (an upload's memfd), so this leaves room for a pipeline of them; past
 * it the connection is closed ("too many fds in flight").
 */
#define CONN_FDS_QUEUED_MAX 32u
/* fds of the daemon's own a connection may take: its socket, its peer's pidfd, its rings'
 * memfd and doorbell, an upload in progress. */
#define CONN_FDS_OWN 5u

/*
 * Opens c->pidfd: SO_PEERPIDFD where the kernel has it (Linux 6.5; the process that
 * connected, whatever became of its pid), else pidfd_open() of the pid SO_PEERCRED gave at
 * connect (the process is alive while it talks to us, so the pid is its own unless it died
 * since, in which case its pidfd is ready at once or pidfd_open() fails). Returns 0 or
 * -errno.
 */
int conn_open_pidfd(struct conn *c);
void conn_close(struct conn *c, const char *why);

/* c's sequences, in its list and the server's registry (server.h, seq_ids): adds q (0 or
 * -ENOMEM, nothing added), removes q, finds id among them (NULL: not c's). */
int conn_seq_add(struct conn *c, struct seq *q);
void conn_seq_remove(struct conn *c, struct seq *q);
struct seq *conn_seq(const struct conn *c, uint64_t id);

/* Frees c if it is closing and none of its operations is in flight any more; returns
 * whether it did. Handlers of c's operations call it after counting theirs done, and the
 * server's poller for closed connections that have none (hot ones, see conn_poll()). */
bool conn_maybe_free(struct conn *c);

/*
 * While the loop spins (loop.h's poller), a connection that sent a request is "hot": no
 * receive waits in io_uring for it, and the poller reads its socket itself, which spares
 * the next request the detour through io_uring's task work (about a microsecond and a
 * half). It cools down, a receive armed again, after CONN_HOT_NS without a request, before
 * the loop sleeps (conn_cool()), or when closed. At most CONN_HOT_MAX are hot, since each
 * costs the spinning loop a system call per turn.
 */
#define CONN_HOT_NS (UINT64_C(20) * 1000)
/* What a connection's frames may take of one turn of the loop, at most (conn.c): the
 * other clients wait for no more than one such share of a client that floods. */
#define CONN_FRAMES_PER_TURN 64u
#define CONN_TURN_NS (UINT64_C(50) * 1000)
#define CONN_HOT_MAX 8u
/* Reads a hot connection once; returns 1 if it got anything (or lost the connection). */
int conn_poll(struct conn *c, uint64_t now_ns);
void conn_cool(struct conn *c);

/* Closes and frees at once; only once the loop is gone and no operation can complete. */
void conn_destroy(struct conn *c);

struct kvd_ring_sqe;

/* What the server does with a connection's traffic: the transport (conn.c, ring.c) calls
 * up through this table, which the server installs (server.handlers; dispatch.h's), and
 * knows no handler by name. */
struct conn_handlers {
	/* One decoded request; fds are owned by the callee. */
	void (*request)(struct conn *c, const Envelope *env, int *fds, uint32_t nfds);
	/* One ring submission, copied out of shared memory and ready to check. */
	void (*ring)(struct conn *c, const struct kvd_ring_sqe *sqe);
	/* Drops the session state of a closing connection. */
	void (*disconnect)(struct conn *c);
	/* After a connection closed, with the server's state updated. */
	void (*closed)(struct server *s);
};
