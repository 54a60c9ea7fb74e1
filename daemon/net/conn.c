/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "basic/macro.h"
#include "common/ring.h"
#include "conn.h"
#include "envelope.h"
#include "observe.h"
#include "log.h"
#include "ring.h"
#include "server.h"
#include "basic/time-util.h"

static void conn_recv_done(struct loop_op *op, int res, bool more);
static void conn_send_done(struct loop_op *op, int res, bool more);
static void conn_resumed(struct loop_op *op, int res, bool more);
static void conn_unhot(struct conn *c);

static void conn_free(struct conn *c) {
	struct tx *t;

	if (c->closing) {
		if (c->closed_prev)
			c->closed_prev->closed_next = c->closed_next;
		else
			c->srv->closed = c->closed_next;
		if (c->closed_next)
			c->closed_next->closed_prev = c->closed_prev;
	}
	while ((t = c->tx_head)) {
		c->tx_head = t->next;
		for (uint32_t i = 0; i < t->nfds; i++)
			safe_close(t->fds[i]);
		free(t->frame);
		free(t);
	}
	if (c->rx)
		wire_rx_done(c->rx);
	free(c->rx);
	ring_free(c->ring);
	/* Its sequences are gone: nothing waits for these any more. */
	for (uint32_t i = 0; i < c->n_events; i++)
		c->srv->pool->ops->event_close(c->device, c->events[i]);
	for (uint32_t i = 0; c->models && i < c->n_models; i++)
		grams_free(&c->models[i]);
	free(c->models);
	safe_close(c->fd);
	safe_close(c->pidfd);
	free(c);
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif

int conn_open_pidfd(struct conn *c) {
	socklen_t len = sizeof(int);
	int fd = -1;

	if (!c->srv->pidfd_by_pid &&
	    getsockopt(c->fd, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) == 0 && fd >= 0) {
		c->pidfd = fd;
		return 0;
	}
	fd = (int)syscall(SYS_pidfd_open, c->cred.pid, 0);
	if (fd < 0)
		return negative_errno();
	c->pidfd = fd;
	return 0;
}

/* Frees a closing connection once no operation refers to it any more. */
bool conn_maybe_free(struct conn *c) {
	if (!c->closing || c->inflight > 0)
		return false;
	conn_free(c);
	return true;
}

static int conn_arm_recv(struct conn *c) {
	size_t n;
	int r;

	c->rx_iov.iov_base = wire_rx_space(c->rx, &n);
	c->rx_iov.iov_len = n;
	c->rx_msg = (struct msghdr){
		.msg_iov = &c->rx_iov,
		.msg_iovlen = 1,
		.msg_control = c->rx_cmsg,
		.msg_controllen = sizeof(c->rx_cmsg),
	};
	r = loop_recvmsg(c->srv->loop, &c->recv_op, c->fd, &c->rx_msg);
	if (r < 0)
		return r;
	c->inflight++;
	return 0;
}

int conn_new(struct server *s, int fd, struct conn **ret) {
	socklen_t len = sizeof(struct ucred);
	struct conn *c;
	int r;

	c = calloc(1, sizeof(*c));
	if (!c) {
		safe_close(fd);
		return -ENOMEM;
	}
	c->fd = fd;
	c->pidfd = -EBADF;
	c->srv = s;
	c->id = ++s->next_conn_id;
	c->accepted_ms = now_ms();
	c->recv_op.handler = conn_recv_done;
	c->send_op.handler = conn_send_done;
	c->resume_op.handler = conn_resumed;
	c->rx = malloc(sizeof(*c->rx));
	c->models = calloc(s->limits.max_models, sizeof(*c->models));
	if (!c->rx || !c->models) {
		r = -ENOMEM;
		goto fail;
	}
	wire_rx_init(c->rx);
	c->rx->max_fds = CONN_FDS_QUEUED_MAX;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &c->cred, &len) < 0) {
		r = negative_errno();
		goto fail;
	}
	r = idmap_put(&s->conn_ids, c->id, c);
	if (r < 0)
		goto fail;
	r = conn_arm_recv(c);
	if (r < 0) {
		idmap_del(&s->conn_ids, c->id);
		goto fail;
	}
	*ret = c;
	return 0;
fail:
	conn_free(c);
	return r;
}

static int conn_arm_send(struct conn *c) {
	struct tx *t = c->tx_head;
	int r;

	c->tx_iov.iov_base = t->frame + c->tx_off;
	c->tx_iov.iov_len = t->size - c->tx_off;
	c->tx_msg = (struct msghdr){ .msg_iov = &c->tx_iov, .msg_iovlen = 1 };
	/* fds go with the first byte of the frame only. */
	if (t->nfds > 0 && c->tx_off == 0) {
		struct cmsghdr *cm;

		c->tx_msg.msg_control = c->tx_cmsg;
		c->tx_msg.msg_controllen = CMSG_SPACE(t->nfds * sizeof(int));
		cm = CMSG_FIRSTHDR(&c->tx_msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(t->nfds * sizeof(int));
		memcpy(CMSG_DATA(cm), t->fds, t->nfds * sizeof(int));
	}
	r = loop_sendmsg(c->srv->loop, &c->send_op, c->fd, &c->tx_msg);
	if (r < 0)
		return r;
	c->inflight++;
	return 0;
}

/* One non-blocking sendmsg() of buf, fds with it. Returns the bytes sent or -errno. */
static ssize_t conn_send_now(struct conn *c, const uint8_t *buf, size_t n, const int *fds,
                             uint32_t nfds) {
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = n };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
	ssize_t k;

	if (nfds > 0) {
		struct cmsghdr *cm;

		msg.msg_control = c->tx_cmsg;
		msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
		cm = CMSG_FIRSTHDR(&msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
		memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
	}
	do
		k = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
	while (k < 0 && errno == EINTR);
	return k < 0 ? negative_errno() : k;
}

int conn_send(struct conn *c, const Envelope *env, const int *fds, uint32_t nfds) {
	size_t sent = 0;
	struct tx *t;
	int r;

	if (c->closing)
		return -ECONNRESET;
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	r = wire_encode(env, nfds, &t->frame, &t->size);
	if (r < 0) {
		free(t);
		return r;
	}
	c->frames++;
	/* With nothing queued, the frame goes out at once: a round through io_uring would add
	 * two of its turns to the reply's latency, while a client spins for it. What does not
	 * fit in the socket waits in the queue, as does everything behind it. */
	if (!c->tx_head) {
		ssize_t k = conn_send_now(c, t->frame, t->size, fds, nfds);

		if (k < 0 && k != -EAGAIN) {
			free(t->frame);
			free(t);
			conn_close(c, k == -EPIPE || k == -ECONNRESET ? "client went away" : "send failed");
			return -ECONNRESET;
		}
		if (k > 0)
			sent = (size_t)k;
		if (sent == t->size) {
			free(t->frame);
			free(t);
			if (c->ring)
				ring_sent(c->ring);
			return 0;
		}
		/* The fds went with the first byte. */
		if (sent > 0)
			nfds = 0;
	}
	if (c->tx_bytes + t->size > c->srv->limits.max_tx_bytes) {
		/* A client that does not read what it is sent would make us buffer forever. */
		free(t->frame);
		free(t);
		conn_refused(c, LIMIT_SEND_QUEUE);
		conn_close(c, "client does not read its replies (send queue full)");
		return -ENOBUFS;
	}
	for (; t->nfds < nfds; t->nfds++) {
		t->fds[t->nfds] = fcntl(fds[t->nfds], F_DUPFD_CLOEXEC, 3);
		if (t->fds[t->nfds] < 0) {
			r = negative_errno();
			for (uint32_t i = 0; i < t->nfds; i++)
				safe_close(t->fds[i]);
			free(t->frame);
			free(t);
			return r;
		}
	}
	c->tx_bytes += t->size;
	if (c->tx_tail)
		c->tx_tail->next = t;
	else
		c->tx_head = t;
	c->tx_tail = t;
	if (c->tx_head == t) {
		c->tx_off = sent;
		r = conn_arm_send(c);
		if (r < 0) {
			conn_close(c, "cannot submit a send");
			return r;
		}
	}
	if (c->ring)
		ring_sent(c->ring);
	return 0;
}

static void conn_send_done(struct loop_op *op, int res, bool more) {
	struct conn *c = (struct conn *)((char *)op - offsetof(struct conn, send_op));
	struct tx *t = c->tx_head;

	c->inflight--;
	if (conn_maybe_free(c))
		return;
	if (c->closing)
		return;
	if (res < 0) {
		conn_close(c, res == -EPIPE || res == -ECONNRESET ? "client went away" : "send failed");
		conn_maybe_free(c);
		return;
	}
	c->tx_off += res;
	if (c->tx_off == t->size) {
		c->tx_head = t->next;
		if (!c->tx_head)
			c->tx_tail = NULL;
		c->tx_bytes -= t->size;
		for (uint32_t i = 0; i < t->nfds; i++)
			safe_close(t->fds[i]);
		free(t->frame);
		free(t);
		c->tx_off = 0;
	} else if (c->tx_off > 0 && t->nfds > 0) {
		/* The fds went with the first part; never send them twice. */
		for (uint32_t i = 0; i < t->nfds; i++)
			t->fds[i] = safe_close(t->fds[i]);
		t->nfds = 0;
	}
	if (c->tx_head) {
		if (conn_arm_send(c) < 0)
			conn_close(c, "cannot submit a send");
	} else if (c->close_when_sent)
		conn_close(c, NULL);
	conn_maybe_free(c);
}

/*
 * Decodes and dispatches the complete frames in rx, for CONN_FRAMES_PER_TURN frames or
 * CONN_TURN_NS at most: a client that pipelines thousands of requests then yields the loop
 * to the others (resume_op comes back for the rest on the next turn, counted in
 * server.turns_yielded). Returns whether it yielded.
 */
static bool conn_dispatch_frames(struct conn *c) {
	uint64_t start = now_ns();
	int fds[WIRE_FDS_MAX];
	uint32_t nfds, n = 0;
	Envelope *env;
	int r = 0;

	while (!c->closing && !c->close_when_sent) {
		/* Another frame buffered first: a lone request costs no second clock read. */
		if (n > 0 && wire_rx_frame_begun(c->rx) &&
		    (n == CONN_FRAMES_PER_TURN || now_ns() - start >= CONN_TURN_NS)) {
			if (loop_nop(c->srv->loop, &c->resume_op) < 0) {
				conn_close(c, "cannot submit a resumption");
				return true;
			}
			c->inflight++;
			c->yielded = true;
			c->srv->turns_yielded++;
			return true;
		}
		r = wire_rx_next(c->rx, &env, fds, &nfds);
		if (r == 0)
			break;
		if (r == -EBADMSG) {
			/* The framing is intact, but we cannot know what was asked: answer with
			 * id 0 and count it against the client. */
			(void)envelope_reply_status(c, 0, -EBADMSG, "undecodable message");
			conn_violation(c, "undecodable message");
			continue;
		}
		if (r < 0) {
			c->srv->protocol_errors++;
			if (r == -EMSGSIZE)
				conn_refused(c, LIMIT_FRAME);
			(void)envelope_reply_status(c, 0, r,
			                  r == -EMSGSIZE ? "frame larger than 64 KiB" : "bad frame header");
			c->close_when_sent = true;
			if (!c->tx_head)
				conn_close(c, NULL);
			log_warning("connection %llu (pid %d): %s, disconnecting",
			            (unsigned long long)c->id, (int)c->cred.pid,
			            r == -EMSGSIZE ? "frame over the size cap" : "bad frame header");
			return false;
		}
		c->srv->handlers.request(c, env, fds, nfds);
		n++;
	}
	/* fds no frame announced would stay queued, held by the daemon, until it closes. */
	if (r == 0 && !c->closing && !c->close_when_sent && wire_rx_drop_unannounced(c->rx) > 0)
		conn_violation(c, "fds that no frame announced");
	/* A frame begun starts or restarts its clock: bytes came. */
	c->partial_since_ms = wire_rx_frame_begun(c->rx) ? now_ms() : 0;
	return false;
}

/* Handles res bytes received into rx (or the end of the stream, or an error). Returns
 * whether frames wait for a later turn. */
static bool conn_received(struct conn *c, int res) {
	int r;

	if (res <= 0) {
		conn_close(c, res == 0 || res == -ECONNRESET ? NULL : "receive failed");
		return false;
	}
	r = wire_rx_take_cmsg(c->rx, &c->rx_msg);
	wire_rx_commit(c->rx, res);
	if (r < 0) {
		c->srv->protocol_errors++;
		conn_close(c, r == -EMFILE ? "too many fds in flight" : "fds lost (control data truncated)");
		return false;
	}
	return conn_dispatch_frames(c);
}

/* Stops reading c directly (see conn_poll()). */
static void conn_unhot(struct conn *c) {
	if (c->hot_ns == 0)
		return;
	c->hot_ns = 0;
	c->srv->n_hot--;
}

/*
 * After a request: reads on. While the loop spins (a poller, server.c), the connection
 * turns hot and the poller reads it itself (conn_poll()); else, and past CONN_HOT_MAX hot
 * connections, a receive goes to io_uring.
 */
static void conn_read_on(struct conn *c) {
	struct server *s = c->srv;

	if (c->closing || c->close_when_sent) {
		conn_unhot(c);
		/* Its last frames may have gone out at once (conn_send()): then it is done. */
		if (!c->closing && !c->tx_head)
			conn_close(c, NULL);
		return;
	}
	if (s->poller.spin_ns > 0 && (c->hot_ns || s->n_hot < CONN_HOT_MAX)) {
		if (c->hot_ns == 0)
			s->n_hot++;
		c->hot_ns = now_ns();
		return;
	}
	/* Never both: the poller's reads would take the data an armed receive was woken for. */
	conn_unhot(c);
	if (conn_arm_recv(c) < 0)
		conn_close(c, "cannot submit a receive");
}

static void conn_recv_done(struct loop_op *op, int res, bool more) {
	struct conn *c = (struct conn *)((char *)op - offsetof(struct conn, recv_op));

	c->inflight--;
	if (conn_maybe_free(c) || c->closing)
		return;
	if (!conn_received(c, res))
		conn_read_on(c);
	conn_maybe_free(c);
}

static void conn_resumed(struct loop_op *op, int res, bool more) {
	struct conn *c = (struct conn *)((char *)op - offsetof(struct conn, resume_op));

	(void)res;
	(void)more;
	c->inflight--;
	c->yielded = false;
	if (conn_maybe_free(c) || c->closing)
		return;
	if (!conn_dispatch_frames(c))
		conn_read_on(c);
	conn_maybe_free(c);
}

int conn_poll(struct conn *c, uint64_t now_ns) {
	ssize_t n;

	if (c->hot_ns == 0 || c->yielded)
		return 0;
	if (c->closing || c->close_when_sent) {
		conn_unhot(c);
		return 0;
	}
	c->rx_iov.iov_base = wire_rx_space(c->rx, &c->rx_iov.iov_len);
	c->rx_msg = (struct msghdr){
		.msg_iov = &c->rx_iov,
		.msg_iovlen = 1,
		.msg_control = c->rx_cmsg,
		.msg_controllen = sizeof(c->rx_cmsg),
	};
	n = recvmsg(c->fd, &c->rx_msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
		if (now_ns - c->hot_ns >= CONN_HOT_NS)
			conn_cool(c);
		return 0;
	}
	if (!conn_received(c, n < 0 ? negative_errno() : (int)n))
		conn_read_on(c);
	return 1;
}

void conn_cool(struct conn *c) {
	if (c->hot_ns == 0)
		return;
	conn_unhot(c);
	/* A connection that yielded reads on once it resumed. */
	if (!c->closing && !c->close_when_sent && !c->yielded && conn_arm_recv(c) < 0)
		conn_close(c, "cannot submit a receive");
}

void conn_violation(struct conn *c, const char *what) {
	c->srv->protocol_errors++;
	if (++c->violations < c->srv->limits.max_violations)
		return;
	log_warning("connection %llu (pid %d): %u protocol errors (last: %s), disconnecting",
	            (unsigned long long)c->id, (int)c->cred.pid, c->violations, what);
	c->close_when_sent = true;
	if (!c->tx_head)
		conn_close(c, NULL);
}

void conn_close(struct conn *c, const char *why) {
	struct server *s = c->srv;

	if (c->closing)
		return;
	if (why)
		log_info("connection %llu (pid %d, uid %u, tenant %s): closing: %s",
		         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
		         c->tenant ? c->tenant->name : "-", why);
	c->closing = true;
	/* A hot connection has no receive in flight: the server's sweep frees it. */
	conn_unhot(c);
	c->srv->handlers.disconnect(c);
	/* Makes the pending receive and send complete, so that the struct can go. */
	shutdown(c->fd, SHUT_RDWR);
	if (c->ring)
		ring_close(c->ring);
	if (c->prev)
		c->prev->next = c->next;
	else
		s->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	idmap_del(&s->conn_ids, c->id);
	s->n_conns--;
	/* An fd comes free (once the connection's last operation completes). */
	s->handlers.closed(s);
	/* Its pending operations still refer to it; listed so that a stop which ends the
	 * loop before they complete can still free it. */
	c->closed_next = s->closed;
	if (s->closed)
		s->closed->closed_prev = c;
	s->closed = c;
	if (s->stopping && s->n_conns == 0)
		loop_exit(s->loop);
}

void conn_destroy(struct conn *c) {
	conn_close(c, NULL);
	conn_free(c);
}

int conn_seq_add(struct conn *c, struct seq *q) {
	int r = idmap_put(&c->srv->seq_ids, q->id, q);

	if (r < 0)
		return r;
	q->prev = NULL;
	q->next = c->seqs;
	if (c->seqs)
		c->seqs->prev = q;
	c->seqs = q;
	c->n_seqs++;
	return 0;
}

void conn_seq_remove(struct conn *c, struct seq *q) {
	idmap_del(&c->srv->seq_ids, q->id);
	if (q->prev)
		q->prev->next = q->next;
	else
		c->seqs = q->next;
	if (q->next)
		q->next->prev = q->prev;
	q->next = q->prev = NULL;
	c->n_seqs--;
}

struct seq *conn_seq(const struct conn *c, uint64_t id) {
	struct seq *q = idmap_get(&c->srv->seq_ids, id);

	return q && q->conn_id == c->id ? q : NULL;
}

void conn_refused(const struct conn *c, enum server_limit l) {
	c->srv->refused[l]++;
	log_info("connection %llu (pid %d, uid %u, tenant %s): refused at limit %s (kvd(8), LIMITS)",
	         (unsigned long long)c->id, (int)c->cred.pid, (unsigned)c->cred.uid,
	         c->tenant ? c->tenant->name : "-", limit_to_string(l));
}
