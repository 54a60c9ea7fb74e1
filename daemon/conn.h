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
#include "seq.h"
#include "wire.h"

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
	uint64_t accepted_ms;
	bool hello;
	uint32_t version;
	struct tenant *tenant;        /* NULL: administrative connection */
	char process_name[64];
	uint32_t violations;

	struct model *models;         /* limits.max_models entries, id = index + 1 */
	uint32_t n_models;
	struct seq *seqs;
	uint32_t n_seqs;
	uint32_t outstanding;         /* requests whose reply waits (evict.h, upload.h) */

	unsigned inflight;
	bool closing;
	bool close_when_sent;

	struct loop_op recv_op;
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

/* Sends a reply with only a status. */
int conn_reply_status(struct conn *c, uint64_t id, int code, const char *message);

/* Counts a protocol violation; past the limit the connection is closed. */
void conn_violation(struct conn *c, const char *what);

void conn_close(struct conn *c, const char *why);

/* Closes and frees at once; only once the loop is gone and no operation can complete. */
void conn_destroy(struct conn *c);

/* Defined in dispatch.c: handles one decoded request. fds are owned by the callee. */
void dispatch(struct conn *c, const Envelope *env, int *fds, uint32_t nfds);
/*
 * Defined in dispatch.c: grows sequence seq_id of c by tokens and replies to request id;
 * when the budget cannot meet it and wait_until_ms (CLOCK_MONOTONIC ms) is in the future,
 * parks it for an eviction round instead (evict.h) and replies later.
 */
void dispatch_grow(struct conn *c, uint64_t id, uint64_t seq_id, uint32_t tokens,
                   uint64_t wait_until_ms);
/* Defined in dispatch.c: drops the session state of a closing connection. */
void dispatch_disconnect(struct conn *c);
