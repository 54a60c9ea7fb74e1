/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the request dispatcher, as the state machine a daemon is, driven by fuzzed
 * sequences of requests on several connections.
 *
 * Each input gets a fresh daemon in process: a pool of 64 KiB chunks on the host backend,
 * the tenant table, the admin (live settings; its state directory can never be created, so
 * every live change takes the "applied, not saved" path and nothing touches the disk) and a
 * server with its real io_uring loop, but no listening socket, signals or timer: the
 * harness is the accept and the tick. Connections are socketpairs: the daemon's end goes to
 * conn_new() as accept hands it over; the harness keeps the client's end. Requests are
 * decoded through a struct wire_rx (the arena bound of a connection) and handed to the
 * request handler (dispatch.h) directly, or written to the socket for the connection's own
 * receive handler.
 * After each step the harness turns the loop without waiting (loop_turn()) until nothing
 * moves, so replies really go through conn_send(), io_uring's sendmsg and the socket, and
 * it reads and decodes them as a client would, closing the fds they carry.
 *
 * Input: a config byte, then records of an op byte and its arguments. Config: bits 0-3 the
 * pool's chunks - 1; bit 4 small socket buffers and a 2 KiB cap on queued replies (so
 * that stalled clients overflow it); bit 5 a budget of half the pool; bit 6 tight limits
 * (2 models, 2 sequences per connection, 3 tenants); bit 7 a config-file tenant "cfg"
 * capped at two chunks. Op: bits 0-1 the client (0..3), bits 2-4 what it does:
 *   0 u16le len, len bytes     an Envelope, to the request handler directly
 *   1 n, u16le len, bytes      the same with n % 4 fds attached
 *   2 n, u16le len, bytes      a frame with n % 4 fds, written to the socket
 *   3                          the client disconnects
 *   4                          the client stops (or starts again) reading replies
 *   5                          the daemon closes the connection (as when hello is late)
 *   6                          the daemon stops (server_stop); the rest is ignored
 *   7                          nothing (the loop turns)
 * A client without a live connection (new, or its connection was closed) gets a new one.
 *
 * Checked after every step: the pool's accounting (chunk states, free list, bitmaps,
 * holders, used and block bytes against the tenants' sums, sequences and connections per
 * tenant); every frame the daemon sends decodes and carries the fds it announces; every
 * request with an id gets exactly one reply, in order (those answered after an eviction round,
 * Evict, Plan and ModelOutputProj, may come after later ones), unless its connection is dropped.
 * At the end, once every connection is closed: no chunk in use, no byte charged, and no fd
 * left open. A failed check aborts.
 *
 * KVD_FUZZ_LOG=1 in the environment logs everything; by default each log call site
 * prints once per process.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "backend.h"
#include "conn.h"
#include "departed.h"
#include "fuzz.h"
#include "log.h"
#include "pool.h"
#include "evict.h"
#include "dispatch.h"
#include "server.h"
#include "mover.h"
#include "tier.h"
#include "upload.h"
#include "settings.h"
#include "wire.h"

#define CLIENTS 4
#define CHUNK_BYTES (UINT64_C(64) << 10)
/* Steps per input: bounds the replies a client can wait for. */
#define STEPS_MAX 1024

struct client {
	uint64_t conn_id;             /* 0: none */
	int peer;                     /* the client's end of the socketpair, or -1 */
	bool stalled;                 /* not reading replies */
	struct wire_rx *rx;           /* replies and events */
	/* The requests not answered yet, in order: replies come in this order, but those of
	 * requests answered after an eviction round (late: Evict, Plan, ModelOutputProj) may
	 * come after later ones. */
	struct expected {
		uint64_t id;
		bool late, answered;
	} expect[STEPS_MAX];
	uint32_t head, tail;
};

static struct {
	struct pool *pool;
	struct server *srv;
	struct admin *admin;
	struct settings flags;
	struct client clients[CLIENTS];
	struct wire_rx *req;          /* decodes the requests */
	int null_fd;
	bool small_buffers;
	bool stopped;
	/* The clients' process, as the daemon sees them (conn.cred.pid): a child that lives
	 * until teardown, so that connections that close still mapping chunks leave holds
	 * that last until it exits (departed.h). */
	pid_t clients_pid;
} h = { .null_fd = -1 };

static void pump(void);

/* ---- invariants ---- */

static struct tenant *conn_tenant_of(uint64_t conn_id) {
	struct conn *c = registry_conn(h.srv, conn_id);

	return c ? c->tenant : NULL;
}

/* Every block a sequence names is in use, and held as often as sequences name it: once, or
 * once more per share (forks). */
static void check_block_holds(void) {
	struct pool *p = h.pool;
	uint32_t per_chunk = (uint32_t)(CHUNK_BYTES / 64);
	uint32_t *named = NULL;
	uint64_t shared = 0;
	bool any = false;

	/* Only where something was ever shared: the walk costs a step of every input. */
	for (uint32_t i = 0; i < p->n_chunks && !any; i++)
		any = p->chunks[i].shares != NULL;
	if (!any) {
		FUZZ_CHECK(p->shared_bytes == 0, "%llu shared bytes, no block shared",
		           (unsigned long long)p->shared_bytes);
		return;
	}
	named = calloc((size_t)p->n_chunks * per_chunk, sizeof(*named));
	FUZZ_CHECK(named);
	for (struct conn *c = h.srv->conns; c; c = c->next)
		for (struct seq *q = c->seqs; q; q = q->next) {
			const struct kvd_seq_desc *d = q->desc;

			for (uint32_t t = 0; t < d->n_tables; t++)
				for (uint32_t b = 0; b < DIV_ROUND_UP(layout_tokens(d)[t], d->block_tokens); b++) {
					struct kvd_block_ref ref = layout_blocks(d, t)[b];

					FUZZ_CHECK(pool_block_addr(p, ref), "sequence %llu names a block not "
					           "in use", (unsigned long long)q->id);
					named[(size_t)ref.chunk_id * per_chunk + ref.index]++;
				}
		}
	for (uint32_t i = 0; i < p->n_chunks; i++) {
		const struct chunk *c = &p->chunks[i];

		for (uint32_t b = 0; c->state == CHUNK_OWNED && b < c->n_blocks; b++) {
			uint32_t shares = c->shares ? c->shares[b] : 0, n = named[(size_t)i * per_chunk + b];

			/* Blocks no open sequence names: a kept one's (keep.h) or the moments'. */
			if (n > 0)
				FUZZ_CHECK(n == 1 + shares, "block (%u, %u): named %u times, %u shares", i, b,
				           n, shares);
			shared += (uint64_t)shares * c->block_bytes;
		}
	}
	FUZZ_CHECK(shared == p->shared_bytes, "%llu shared bytes, the pool counts %llu",
	           (unsigned long long)shared, (unsigned long long)p->shared_bytes);
	free(named);
}

static void check_state(bool all_closed) {
	struct pool *p = h.pool;
	struct server *s = h.srv;
	uint32_t owned = 0, draining = 0, pinned = 0, free_n = 0, listed = 0;
	uint64_t block_bytes = 0, t_used = 0, t_blocks = 0, t_chunks = 0;

	for (uint32_t i = 0; i < p->n_chunks; i++) {
		const struct chunk *c = &p->chunks[i];

		FUZZ_CHECK(c->id == i);
		switch (c->state) {
		case CHUNK_FREE:
			free_n++;
			FUZZ_CHECK(!c->owner && c->n_holders == 0 && !c->partial, "free chunk %u in use", i);
			break;
		case CHUNK_OWNED: {
			uint32_t bits = 0;

			owned++;
			FUZZ_CHECK(c->owner && c->used && c->n_blocks > 0);
			for (uint32_t w = 0; w < DIV_ROUND_UP(c->n_blocks, 64); w++)
				bits += __builtin_popcountll(c->used[w]);
			FUZZ_CHECK(bits == c->used_blocks, "chunk %u: %u bits, %u blocks", i, bits,
			           c->used_blocks);
			FUZZ_CHECK(c->used_blocks > 0, "owned chunk %u has no block in use", i);
			FUZZ_CHECK(c->used_blocks <= c->n_blocks);
			FUZZ_CHECK(c->partial == (c->used_blocks < c->n_blocks), "chunk %u partial %d", i,
			           c->partial);
			FUZZ_CHECK(c->n_blocks == CHUNK_BYTES / c->stride);
			block_bytes += (uint64_t)c->used_blocks * c->block_bytes;
			break;
		}
		case CHUNK_DRAINING:
			draining++;
			FUZZ_CHECK(c->owner && c->used_blocks == 0 && c->n_holders > 0 && !c->partial,
			           "draining chunk %u: %u blocks, %u holders", i, c->used_blocks, c->n_holders);
			break;
		case CHUNK_PINNED:
			pinned++;
			FUZZ_CHECK(c->owner && c->mem.fd < 0 && c->used_blocks == 0 && !c->partial,
			           "pinned chunk %u", i);
			break;
		default:
			FUZZ_CHECK(false, "chunk %u in state %d", i, c->state);
		}
		/* Holders are live connections of the owner, or connections that left without
		 * unmapping (departed.h), each once. */
		for (uint32_t j = 0; j < c->n_holders; j++) {
			FUZZ_CHECK(conn_tenant_of(c->holders[j]) == c->owner ||
			           departed_find(s, c->holders[j]),
			           "chunk %u held by connection %llu, not of its owner", i,
			           (unsigned long long)c->holders[j]);
			for (uint32_t k = 0; k < j; k++)
				FUZZ_CHECK(c->holders[k] != c->holders[j]);
		}
	}
	for (uint32_t dev = 0; dev < p->n_devices; dev++)
		for (const struct chunk *c = p->free_list[dev]; c; c = c->next) {
			FUZZ_CHECK(c->state == CHUNK_FREE && c->mem.device == dev && listed < p->n_chunks);
			listed++;
		}
	FUZZ_CHECK(listed == free_n && p->chunks_free == free_n, "free: %u listed, %u counted, %u",
	           listed, p->chunks_free, free_n);
	FUZZ_CHECK(p->chunks_draining == draining && p->chunks_pinned == pinned);
	FUZZ_CHECK(p->used_bytes == (uint64_t)(owned + draining + pinned) * CHUNK_BYTES,
	           "used %llu bytes, %u chunks owned and %u draining",
	           (unsigned long long)p->used_bytes, owned, draining);
	FUZZ_CHECK(p->block_bytes == block_bytes);

	for (uint32_t i = 0; i < s->tenants.n; i++) {
		const struct tenant *t = s->tenants.tenants[i];
		uint32_t chunks = 0, seqs = 0, conns = 0;

		for (uint32_t j = 0; j < p->n_chunks; j++)
			chunks += p->chunks[j].state != CHUNK_FREE && p->chunks[j].owner == t;
		for (struct conn *c = s->conns; c; c = c->next)
			if (c->tenant == t) {
				uint32_t n = 0;

				for (struct seq *q = c->seqs; q; q = q->next)
					n++;
				FUZZ_CHECK(n == c->n_seqs);
				seqs += n;
				conns++;
			}
		FUZZ_CHECK(t->chunks == chunks && t->used_bytes == chunks * CHUNK_BYTES,
		           "tenant %s: %u chunks, %llu bytes, %u chunks found", t->name, t->chunks,
		           (unsigned long long)t->used_bytes, chunks);
		FUZZ_CHECK(t->sequences == seqs, "tenant %s: %u sequences, %u open", t->name,
		           t->sequences, seqs);
		FUZZ_CHECK(t->connections == conns, "tenant %s: %u connections, %u live", t->name,
		           t->connections, conns);
		for (const struct chunk *c = t->partial; c; c = c->next)
			FUZZ_CHECK(c->owner == t && c->state == CHUNK_OWNED && c->partial);
		t_used += t->used_bytes;
		t_blocks += t->block_bytes;
		t_chunks += t->chunks;
	}
	FUZZ_CHECK(t_used == p->used_bytes && t_chunks == owned + draining && t_blocks == p->block_bytes,
	           "tenants hold %llu bytes, the pool counts %llu", (unsigned long long)t_used,
	           (unsigned long long)p->used_bytes);
	check_block_holds();
	if (all_closed) {
		FUZZ_CHECK(!s->conns && s->n_conns == 0);
		FUZZ_CHECK(p->used_bytes == 0 && p->block_bytes == 0, "%llu bytes leaked",
		           (unsigned long long)p->used_bytes);
		FUZZ_CHECK(p->chunks_free == p->n_chunks && p->chunks_draining == 0);
	}
}

/* ---- clients ---- */

static int fd_new(void) {
	int fd = fcntl(h.null_fd, F_DUPFD_CLOEXEC, 3);

	FUZZ_CHECK(fd >= 0);
	return fd;
}

/* Forgets the client's connection, closing its end: the daemon sees the hangup. */
static void client_drop(struct client *cl) {
	if (cl->peer >= 0)
		close(cl->peer);
	cl->peer = -1;
	cl->conn_id = 0;
	cl->stalled = false;
	cl->head = cl->tail = 0;
	wire_rx_done(cl->rx);
	wire_rx_init(cl->rx);
}

static void client_connect(struct client *cl) {
	struct server *s = h.srv;
	struct conn *c;
	int sv[2];

	FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0);
	if (h.small_buffers) {
		int n = 4096;

		FUZZ_CHECK(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &n, sizeof(n)) == 0);
	}
	FUZZ_CHECK(conn_new(s, sv[0], &c) == 0);
	c->cred.pid = h.clients_pid;
	/* What on_accept() does with a new connection. */
	c->next = s->conns;
	if (s->conns)
		s->conns->prev = c;
	s->conns = c;
	s->n_conns++;
	cl->conn_id = c->id;
	cl->peer = sv[1];
	cl->stalled = false;
	cl->head = cl->tail = 0;
}

/* The client's connection if requests can go to it: live and not about to close. */
static struct conn *client_conn(struct client *cl) {
	struct conn *c = cl->conn_id ? registry_conn(h.srv, cl->conn_id) : NULL;

	return c && !c->close_when_sent ? c : NULL;
}

/* Its connection, a new one when it has none that takes requests. */
static struct conn *client_conn_new(struct client *cl) {
	struct conn *c = client_conn(cl);

	if (c)
		return c;
	if (cl->conn_id || cl->peer >= 0) {
		client_drop(cl);
		pump();
	}
	client_connect(cl);
	c = client_conn(cl);
	FUZZ_CHECK(c);
	return c;
}

static void check_reply(struct client *cl, const Envelope *env, uint32_t nfds) {
	uint32_t want = 0, i;

	if (env->body_case == KVD__V1__ENVELOPE__BODY_EVENT) {
		FUZZ_CHECK(env->id == 0 && nfds == 0);
		return;
	}
	/* Replies to requests without an id, or that did not decode, have id 0. */
	if (!env->has_id || env->id == 0)
		return;
	for (i = cl->head; i != cl->tail; i++) {
		const struct expected *x = &cl->expect[i % STEPS_MAX];

		if (x->answered)
			continue;
		if (x->id == env->id)
			break;
		FUZZ_CHECK(x->late, "reply %llu, expected %llu first", (unsigned long long)env->id,
		           (unsigned long long)x->id);
	}
	FUZZ_CHECK(i != cl->tail, "reply %llu to no request", (unsigned long long)env->id);
	cl->expect[i % STEPS_MAX].answered = true;
	while (cl->head != cl->tail && cl->expect[cl->head % STEPS_MAX].answered)
		cl->head++;
	FUZZ_CHECK(env->status && env->status->has_code, "reply without a status");
	if (env->status->code == 0 && env->body_case == KVD__V1__ENVELOPE__BODY_SEQ_OPEN_REPLY)
		want = 1;
	if (env->status->code == 0 && env->body_case == KVD__V1__ENVELOPE__BODY_SEQ_GROW_REPLY)
		want = env->seq_grow_reply->n_grants;
	FUZZ_CHECK(nfds == want, "reply with %u fds, expected %u", nfds, want);
}

/* Reads what the daemon sent; returns whether anything came. */
static bool client_drain(struct client *cl) {
	bool got = false;

	while (cl->peer >= 0 && !cl->stalled) {
		_Alignas(struct cmsghdr) uint8_t control[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = {
			.msg_iov = &iov,
			.msg_iovlen = 1,
			.msg_control = control,
			.msg_controllen = sizeof(control),
		};
		int fds[WIRE_FDS_MAX];
		uint32_t nfds;
		Envelope *env;
		ssize_t n;
		int r;

		iov.iov_base = wire_rx_space(cl->rx, &iov.iov_len);
		FUZZ_CHECK(iov.iov_len > 0);
		n = recvmsg(cl->peer, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		got = true;
		if (n <= 0) {
			/* The daemon closed it; replies it had not sent yet are gone. */
			client_drop(cl);
			break;
		}
		FUZZ_CHECK(wire_rx_take_cmsg(cl->rx, &msg) == 0, "fds lost");
		wire_rx_commit(cl->rx, (size_t)n);
		while ((r = wire_rx_next(cl->rx, &env, fds, &nfds)) != 0) {
			FUZZ_CHECK(r == 1, "the daemon sent a bad frame: %d", r);
			for (uint32_t i = 0; i < nfds; i++) {
				FUZZ_CHECK(fds[i] >= 0);
				close(fds[i]);
			}
			check_reply(cl, env, nfds);
		}
	}
	return got;
}

/* Turns the loop and reads replies until nothing moves. */
static void pump(void) {
	for (unsigned round = 0, idle = 0; round < 1000 && idle < 2; round++) {
		bool got = false;
		int n;

		n = loop_turn(h.srv->loop, false);
		FUZZ_CHECK(n >= 0, "loop_turn: %d", n);
		for (unsigned i = 0; i < CLIENTS; i++)
			got |= client_drain(&h.clients[i]);
		idle = n == 0 && !got ? idle + 1 : 0;
	}
}

/* ---- requests ---- */

/* Decodes payload[len] with nfds new fds as a connection does. Returns the envelope (valid
 * until the next call) or NULL, with the frame's fds in fds. */
static Envelope *decode(const uint8_t *payload, uint16_t len, uint32_t nfds, int *fds) {
	uint8_t *p;
	size_t space;
	Envelope *env;
	uint32_t got;
	int r;

	wire_rx_init(h.req);
	p = wire_rx_space(h.req, &space);
	for (int i = 0; i < 4; i++) {
		p[i] = (uint8_t)(len >> (8 * i));
		p[4 + i] = (uint8_t)(nfds >> (8 * i));
	}
	memcpy(p + WIRE_HEADER_BYTES, payload, len);
	wire_rx_commit(h.req, WIRE_HEADER_BYTES + len);
	for (uint32_t i = 0; i < nfds; i++)
		fds[i] = fd_new();
	FUZZ_CHECK(wire_rx_push_fds(h.req, fds, nfds) == 0);
	r = wire_rx_next(h.req, &env, fds, &got);
	wire_rx_done(h.req);
	if (r == -EBADMSG)
		return NULL;
	FUZZ_CHECK(r == 1 && got == nfds, "wire_rx_next: %d", r);
	return env;
}

static void expect_reply(struct client *cl, const Envelope *env) {
	if (env->has_id && env->id != 0)
		cl->expect[cl->tail++ % STEPS_MAX] = (struct expected){
			.id = env->id,
			.late = env->body_case == KVD__V1__ENVELOPE__BODY_EVICT ||
			        env->body_case == KVD__V1__ENVELOPE__BODY_PLAN ||
			        env->body_case == KVD__V1__ENVELOPE__BODY_MODEL_OUTPUT_PROJ,
		};
}

static void request_direct(struct client *cl, const uint8_t *payload, uint16_t len, uint32_t nfds) {
	int fds[4];
	struct conn *c = client_conn_new(cl);
	Envelope *env = decode(payload, len, nfds, fds);

	if (!env)
		return;
	expect_reply(cl, env);
	dispatch_handlers.request(c, env, fds, nfds);
}

/* Sends all of buf on the client's socket, fds with the first byte; false when the daemon
 * hung up. */
static bool client_send(struct client *cl, const uint8_t *buf, size_t n, const int *fds,
                        uint32_t nfds) {
	size_t off = 0;

	for (unsigned tries = 0; off < n && tries < 1000; tries++) {
		_Alignas(struct cmsghdr) uint8_t control[CMSG_SPACE(4 * sizeof(int))];
		struct iovec iov = { .iov_base = (void *)(buf + off), .iov_len = n - off };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
		ssize_t k;

		if (off == 0 && nfds > 0) {
			struct cmsghdr *cm;

			msg.msg_control = control;
			msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
			cm = CMSG_FIRSTHDR(&msg);
			cm->cmsg_level = SOL_SOCKET;
			cm->cmsg_type = SCM_RIGHTS;
			cm->cmsg_len = CMSG_LEN(nfds * sizeof(int));
			memcpy(CMSG_DATA(cm), fds, nfds * sizeof(int));
		}
		k = sendmsg(cl->peer, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (k < 0 && errno == EPIPE)
			return false;
		FUZZ_CHECK(k >= 0 || errno == EAGAIN || errno == EINTR, "sendmsg: %m");
		if (k > 0)
			off += (size_t)k;
		pump();
		if (cl->peer < 0)
			return false;
	}
	FUZZ_CHECK(off == n, "the daemon does not read");
	return true;
}

static void request_socket(struct client *cl, const uint8_t *payload, uint16_t len, uint32_t nfds) {
	uint8_t frame[WIRE_HEADER_BYTES + UINT16_MAX];
	int fds[4], sent[4];
	Envelope *env;

	client_conn_new(cl);
	/* The daemon decodes it as we do: same bytes, same arena. */
	env = decode(payload, len, nfds, fds);
	if (env)
		expect_reply(cl, env);
	for (uint32_t i = 0; i < nfds; i++) {
		if (env)
			close(fds[i]);
		sent[i] = fd_new();
	}
	for (int i = 0; i < 4; i++) {
		frame[i] = (uint8_t)(len >> (8 * i));
		frame[4 + i] = (uint8_t)(nfds >> (8 * i));
	}
	memcpy(frame + WIRE_HEADER_BYTES, payload, len);
	client_send(cl, frame, WIRE_HEADER_BYTES + len, sent, nfds);
	for (uint32_t i = 0; i < nfds; i++)
		close(sent[i]);
}

/* ---- one input ---- */

static void setup(uint8_t config) {
	struct server_limits limits;
	struct settings cfg;
	struct server *s;
	uint32_t n_chunks = (config & 15) + 1;

	FUZZ_CHECK(pool_new(&backend_host_ops, 1, n_chunks * CHUNK_BYTES, CHUNK_BYTES,
	                    n_chunks * CHUNK_BYTES, &h.pool) == 0);
	FUZZ_CHECK(settings_init(&cfg) == 0 && settings_init(&h.flags) == 0);
	free(cfg.state_dir);
	cfg.state_dir = strdup("/dev/null/kvd-fuzz");
	FUZZ_CHECK(cfg.state_dir);
	cfg.max_tenants = config & 64 ? 3 : 16;
	cfg.max_models = config & 64 ? 2 : 8;
	cfg.max_seqs = config & 64 ? 2 : 16;
	cfg.max_seq_tokens = 1u << 16;
	if (config & 32)
		cfg.budget = n_chunks / 2 * CHUNK_BYTES;
	if (config & 128) {
		cfg.tenants = calloc(1, sizeof(*cfg.tenants));
		FUZZ_CHECK(cfg.tenants);
		cfg.n_tenants = 1;
		strcpy(cfg.tenants[0].name, "cfg");
		cfg.tenants[0].max_bytes = 2 * CHUNK_BYTES;
		cfg.tenants[0].weight = 2;
		cfg.tenants[0].source[SETTINGS_TENANT_MAX] = SOURCE_CONFIG;
		cfg.tenants[0].source[SETTINGS_TENANT_WEIGHT] = SOURCE_CONFIG;
	}
	admin_limits(&cfg, &limits);
	limits.max_connections = 2 * CLIENTS;
	/* Descriptors of a few pages keep each step fast. */
	limits.max_descriptor_bytes = UINT64_C(256) << 10;
	h.small_buffers = config & 16;
	if (h.small_buffers)
		limits.max_tx_bytes = 2048;
	limits.metrics_listen = NULL;
	/* The rings have a target of their own, fuzz-ring.c. */
	limits.ring_entries = 0;

	/* The clients' process, forked first: it inherits none of the daemon's fds. */
	h.clients_pid = fork();
	FUZZ_CHECK(h.clients_pid >= 0);
	if (h.clients_pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		pause();
		_exit(0);
	}
	/* The daemon in process: server_new() less the sockets, signals and timer. */
	FUZZ_CHECK(server_new_local(h.pool, &limits, &s) == 0);
	s->socket_path = "(fuzz)";
	/* The pidfd of the clients' process, not of this one (the socketpair's peer). */
	s->pidfd_by_pid = true;
	/* The node's bounds derived from the machine: low enough to be met here. */
	s->conns_by_fds = UINT32_MAX;
	s->seqs_node_derived = 24;
	s->metadata_derived = UINT64_C(8) << 20;
	h.srv = s;
	FUZZ_CHECK(admin_new(s, &cfg, &h.flags, &h.admin) == 0);
	settings_done(&cfg);
	s->admin = h.admin;
	h.stopped = false;
	for (unsigned i = 0; i < CLIENTS; i++) {
		h.clients[i].conn_id = 0;
		h.clients[i].peer = -1;
		h.clients[i].stalled = false;
		h.clients[i].head = h.clients[i].tail = 0;
		wire_rx_init(h.clients[i].rx);
	}
}

static void teardown(void) {
	struct server *s = h.srv;
	pid_t pid;

	if (!h.stopped) {
		/* Everyone reads what is left: every request must have had its answer, those
		 * waiting for eviction rounds once the rounds are done (on their worker thread:
		 * pump() does not wait for them). */
		for (unsigned i = 0; i < CLIENTS; i++)
			h.clients[i].stalled = false;
		pump();
		for (unsigned i = 0; i < 10000 && evict_running(s->evictor); i++) {
			usleep(1000);
			pump();
		}
		for (unsigned i = 0; i < CLIENTS; i++) {
			struct client *cl = &h.clients[i];

			if (client_conn(cl))
				FUZZ_CHECK(cl->head == cl->tail, "client %u: %u requests unanswered", i,
				           cl->tail - cl->head);
		}
	}
	check_state(false);

	/* Every client hangs up; the daemon's receives see it and close their connections. */
	for (unsigned i = 0; i < CLIENTS; i++)
		client_drop(&h.clients[i]);
	pump();
	if (!h.stopped)
		for (unsigned i = 0; i < 100 && s->closed; i++)
			FUZZ_CHECK(loop_turn(s->loop, true) >= 0);
	/* After a stop the loop has exited: the daemon closes what is left, as it does at exit. */
	while (s->conns) {
		FUZZ_CHECK(h.stopped, "connection %llu still open after its client hung up",
		           (unsigned long long)s->conns->id);
		conn_close(s->conns, NULL);
	}
	/* The clients' process exits: the holds of connections that left without unmapping
	 * end (the loop sees its pidfd). */
	FUZZ_CHECK(kill(h.clients_pid, SIGKILL) == 0);
	/* libFuzzer's timer (-timeout) interrupts the wait with SIGALRM now and then. */
	while ((pid = waitpid(h.clients_pid, NULL, 0)) < 0 && errno == EINTR)
		;
	FUZZ_CHECK(pid == h.clients_pid, "waitpid: %s", pid < 0 ? strerror(errno) : "another child");
	for (unsigned i = 0; i < 100 && !h.stopped && s->n_departed > 0; i++)
		FUZZ_CHECK(loop_turn(s->loop, true) >= 0);
	FUZZ_CHECK(h.stopped || s->n_departed == 0, "%u departed holders after their process "
	           "exited", s->n_departed);
	/* After a stop the loop runs no more: as the daemon's exit does. */
	departed_end_all(s);
	check_state(true);
	for (uint32_t i = 0; i < s->tenants.n; i++) {
		const struct tenant *t = s->tenants.tenants[i];

		FUZZ_CHECK(t->used_bytes == 0 && t->block_bytes == 0 && t->chunks == 0 &&
		           t->sequences == 0 && t->connections == 0 && !t->partial,
		           "tenant %s still holds something", t->name);
	}
	FUZZ_CHECK(h.stopped || !s->closed, "a connection's operations never completed");

	h.srv = server_free(s);
	h.admin = admin_free(h.admin);
	settings_done(&h.flags);
	h.pool = pool_free(h.pool);
}

static void init_once(void) {
	if (h.req)
		return;
	/* Each over 300 KiB: allocated once. */
	h.req = malloc(sizeof(*h.req));
	FUZZ_CHECK(h.req);
	for (unsigned i = 0; i < CLIENTS; i++) {
		h.clients[i].rx = malloc(sizeof(*h.clients[i].rx));
		FUZZ_CHECK(h.clients[i].rx);
	}
	h.null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	FUZZ_CHECK(h.null_fd >= 0);
	log_setup();
	log_set_max_level(LOG_DEBUG);
	if (!getenv("KVD_FUZZ_LOG"))
		log_set_ratelimit(UINT64_C(1) << 40, 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	size_t pos = 1;
	unsigned fds_before;

	if (size < 1)
		return 0;
	init_once();
	fds_before = fuzz_fd_count();
	setup(data[0]);

	for (unsigned step = 0; step < STEPS_MAX && pos < size && !h.stopped; step++) {
		uint8_t op = data[pos++];
		struct client *cl = &h.clients[op & 3];
		uint32_t nfds = 0;
		uint16_t len;

		switch ((op >> 2) & 7) {
		case 1:
		case 2:
			if (pos >= size)
				break;
			nfds = data[pos++] % 4;
			/* fall through */
		case 0:
			if (size - pos < 2)
				break;
			len = (uint16_t)(data[pos] | data[pos + 1] << 8);
			pos += 2;
			len = (uint16_t)MIN((size_t)len, size - pos);
			if (((op >> 2) & 7) == 2)
				request_socket(cl, data + pos, len, nfds);
			else
				request_direct(cl, data + pos, len, nfds);
			pos += len;
			break;
		case 3:
			client_drop(cl);
			break;
		case 4:
			cl->stalled = !cl->stalled;
			break;
		case 5: {
			struct conn *c = client_conn(cl);

			if (c)
				conn_close(c, "no hello in time");
			break;
		}
		case 6:
			server_stop(h.srv);
			h.stopped = true;
			break;
		default:
			break;
		}
		pump();
		check_state(false);
	}

	teardown();
	FUZZ_CHECK(fuzz_fd_count() == fds_before, "fds leaked: %u before, %u after", fds_before,
	           fuzz_fd_count());
	return 0;
}
