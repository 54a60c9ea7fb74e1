/* SPDX-License-Identifier: MIT */
/*
 * Fuzz target: the daemon's ring consumer (daemon/net/ring.c, the ring handler in dispatch.c), fed
 * by a client that writes whatever it likes into its rings.
 *
 * Each input gets a fresh daemon in process, set up like fuzz-dispatch.c's (a host pool of
 * 64 KiB chunks, the admin, a server with its real io_uring loop and no listening socket),
 * and one connection on a socketpair: the harness says hello with the ring feature,
 * registers a model (blocks of 512 bytes) and opens three sequences (ids 1, 2 and 3), all
 * through the request handler, then maps the rings the HelloReply carried. From there the input
 * drives the client side of the rings, and the harness runs the consumer (ring_poll(), as
 * the server's poller does) whenever the input publishes. Frames the daemon sends (grants,
 * unmap requests) are read back as libkvd would: fds closed, unmap requests answered.
 *
 * Input: a config byte, then records of an op byte and its arguments. Config: bits 0-1 the
 * entries of each ring, 2 << value; bit 2 the eventfd doorbell (else futex); bit 3 a pool of
 * two chunks (else eight), so that grows run out; bit 4 small socket buffers and a 2 KiB cap
 * on queued frames, so that a client that does not read overflows it. Op (low nibble):
 *   0 32 bytes            a submission, as is, at the client's tail
 *   1 op, seq, arg        a submission of operation op % 6, on sequence seq % 4 (3: an id
 *                         that does not exist), arg tokens; skipped when the submission
 *                         ring is full
 *   2                     publish the tail, then the daemon takes submissions
 *   3 u32le               publish that tail instead, then the daemon takes submissions
 *   4 n                   read up to n completions, checking each against what was sent
 *   5 u32le               store that completion head
 *   6 u16le off, n, bytes write n bytes into the region at off (anything: the geometry, the
 *                         indices, the wake words)
 *   7                     the loop turns and the client reads its socket
 *   8                     the daemon prepares to sleep and wakes up (doorbells armed)
 *   9                     the connection closes, and a new one is set up
 *   other                 nothing
 *
 * Checked after every step: every submission the daemon took is either completed or owed,
 * the completions it made and owes fit the completion ring (it never buffers one), the
 * pool's and the tenant's accounting agree; every completion read that the client did not
 * forge answers a submission, once. At the end, once the connection is closed: no chunk in
 * use and no fd left open. A failed check aborts.
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "admin.h"
#include "backend.h"
#include "common/ring.h"
#include "conn.h"
#include "evict.h"
#include "fuzz.h"
#include "log.h"
#include "pool.h"
#include "ring.h"
#include "dispatch.h"
#include "server.h"
#include "mover.h"
#include "tier.h"
#include "settings.h"
#include "upload.h"
#include "wire.h"

#define CHUNK_BYTES (UINT64_C(64) << 10)
#define STEPS_MAX 1024
#define SEQS 3
/* user_data of the harness's own submissions: a tag, then a serial. */
#define TAG (UINT64_C(0x6b76) << 48)

static struct {
	struct pool *pool;
	struct server *srv;
	struct admin *admin;
	struct settings flags;
	struct wire_rx *rx;
	int null_fd;
	/* The client. */
	uint64_t conn_id;
	int peer;
	struct ring_shared *sh;
	struct kvd_ring_geometry geo;
	uint32_t sq_tail, cq_head;
	uint64_t sent, answered;      /* serials of the harness's submissions */
	bool forged;                  /* indices or entries were overwritten: answers unknown */
	uint64_t seq_ids[SEQS];
	uint64_t next_id;
} h = { .null_fd = -1, .peer = -1 };

static struct conn *client_conn(void) {
	return h.conn_id ? registry_conn(h.srv, h.conn_id) : NULL;
}

/* ---- invariants ---- */

static void check_state(bool all_closed) {
	struct pool *p = h.pool;
	struct server *s = h.srv;
	uint32_t owned = 0, draining = 0;
	struct conn *c = client_conn();

	for (uint32_t i = 0; i < p->n_chunks; i++) {
		owned += p->chunks[i].state == CHUNK_OWNED;
		draining += p->chunks[i].state == CHUNK_DRAINING;
	}
	FUZZ_CHECK(p->used_bytes == (uint64_t)(owned + draining) * CHUNK_BYTES);
	FUZZ_CHECK(p->chunks_free == p->n_chunks - owned - draining);
	for (uint32_t i = 0; i < s->tenants.n; i++) {
		const struct tenant *t = s->tenants.tenants[i];

		FUZZ_CHECK(t->used_bytes == (uint64_t)t->chunks * CHUNK_BYTES);
		FUZZ_CHECK(t->used_bytes <= p->used_bytes);
	}
	if (c && c->ring && !c->closing) {
		struct ring *r = c->ring;

		/* Taken = completed + owed, and both fit what the client may not have read. */
		FUZZ_CHECK(r->sq_head == r->cq_tail + r->owed, "took %u, completed %u, owes %u",
		           r->sq_head, r->cq_tail, r->owed);
		FUZZ_CHECK(r->owed <= r->geo.entries);
		FUZZ_CHECK(r->cq_tail - r->cq_head + r->owed <= r->geo.entries,
		           "%u completions unread, %u owed, ring of %u", r->cq_tail - r->cq_head,
		           r->owed, r->geo.entries);
		FUZZ_CHECK(memcmp(&r->geo, &h.geo, sizeof(h.geo)) == 0 || h.forged);
	}
	if (all_closed) {
		FUZZ_CHECK(!s->conns && p->used_bytes == 0 && p->block_bytes == 0);
		FUZZ_CHECK(p->chunks_free == p->n_chunks);
	}
}

/* ---- the client's socket ---- */

static void request(struct conn *c, Envelope *env) {
	env->has_id = true;
	env->id = ++h.next_id;
	dispatch_handlers.request(c, env, NULL, 0);
}

/* Reads what the daemon sent: fds are closed, unmap requests answered as libkvd does. */
static void drain(void) {
	while (h.peer >= 0) {
		_Alignas(struct cmsghdr) uint8_t control[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
			              .msg_controllen = sizeof(control) };
		int fds[WIRE_FDS_MAX];
		uint32_t nfds;
		Envelope *env;
		ssize_t n;
		int r;

		iov.iov_base = wire_rx_space(h.rx, &iov.iov_len);
		n = recvmsg(h.peer, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		FUZZ_CHECK(wire_rx_take_cmsg(h.rx, &msg) == 0, "fds lost");
		wire_rx_commit(h.rx, (size_t)n);
		while ((r = wire_rx_next(h.rx, &env, fds, &nfds)) != 0) {
			struct conn *c = client_conn();

			FUZZ_CHECK(r == 1, "the daemon sent a bad frame: %d", r);
			for (uint32_t i = 0; i < nfds; i++)
				close(fds[i]);
			if (env->body_case != KVD__V1__ENVELOPE__BODY_EVENT || !c || c->closing)
				continue;
			if (env->event->type == KVD__V1__EVENT_TYPE__EVENT_CHUNKS_GRANT)
				FUZZ_CHECK(env->event->n_grants == nfds && nfds > 0);
			if (env->event->type == KVD__V1__EVENT_TYPE__EVENT_CHUNKS_UNMAP) {
				Kvd__V1__ChunksUnmapped done = KVD__V1__CHUNKS_UNMAPPED__INIT;
				Envelope reply = KVD__V1__ENVELOPE__INIT;

				done.n_chunk_ids = env->event->n_chunk_ids;
				done.chunk_ids = env->event->chunk_ids;
				reply.body_case = KVD__V1__ENVELOPE__BODY_CHUNKS_UNMAPPED;
				reply.chunks_unmapped = &done;
				request(c, &reply);
			}
		}
	}
}

/* Turns the loop and reads the socket until nothing moves. */
static void pump(void) {
	for (unsigned round = 0, idle = 0; round < 1000 && idle < 2; round++) {
		int n = loop_turn(h.srv->loop, false);

		FUZZ_CHECK(n >= 0, "loop_turn: %d", n);
		drain();
		idle = n == 0 ? idle + 1 : 0;
	}
}

/* ---- the connection ---- */

static void client_drop(void) {
	if (h.sh)
		munmap(h.sh, h.geo.total_bytes);
	h.sh = NULL;
	if (h.peer >= 0)
		close(h.peer);
	h.peer = -1;
	h.conn_id = 0;
	wire_rx_done(h.rx);
	wire_rx_init(h.rx);
	pump();
}

/* Reads the socket until the HelloReply; returns the rings' memfd it carries. */
static int hello_reply_fd(void) {
	for (unsigned tries = 0; tries < 1000; tries++) {
		_Alignas(struct cmsghdr) uint8_t control[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
			              .msg_controllen = sizeof(control) };
		int fds[WIRE_FDS_MAX];
		uint32_t nfds;
		Envelope *env;
		ssize_t n;

		FUZZ_CHECK(loop_turn(h.srv->loop, false) >= 0);
		iov.iov_base = wire_rx_space(h.rx, &iov.iov_len);
		n = recvmsg(h.peer, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (n <= 0)
			continue;
		FUZZ_CHECK(wire_rx_take_cmsg(h.rx, &msg) == 0, "fds lost");
		wire_rx_commit(h.rx, (size_t)n);
		if (wire_rx_next(h.rx, &env, fds, &nfds) != 1)
			continue;
		FUZZ_CHECK(env->body_case == KVD__V1__ENVELOPE__BODY_HELLO_REPLY && nfds >= 1);
		for (uint32_t i = 1; i < nfds; i++)
			close(fds[i]);
		return fds[0];
	}
	FUZZ_CHECK(false, "no HelloReply");
}

/* A connection with rings, a model and SEQS sequences, as libkvd sets one up. */
static void client_connect(bool small_buffers) {
	Kvd__V1__Hello hello = KVD__V1__HELLO__INIT;
	Kvd__V1__RegisterModel model = KVD__V1__REGISTER_MODEL__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct server *s = h.srv;
	struct conn *c;
	int sv[2], fd;

	FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) == 0);
	if (small_buffers) {
		int n = 4096;

		FUZZ_CHECK(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &n, sizeof(n)) == 0);
	}
	FUZZ_CHECK(conn_new(s, sv[0], &c) == 0);
	c->next = s->conns;
	if (s->conns)
		s->conns->prev = c;
	s->conns = c;
	s->n_conns++;
	h.conn_id = c->id;
	h.peer = sv[1];

	hello.has_min_version = hello.has_max_version = hello.has_features = true;
	hello.min_version = hello.max_version = 1;
	hello.features = KVD_FEATURE_RING;
	hello.tenant = (char *)"fz";
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	request(c, &env);
	FUZZ_CHECK(c->ring, "no rings after hello");
	/* Its peer is this process, which never exits: without the pidfd the daemon took at
	 * hello, chunks it still maps are given back when it disconnects (as where no pidfd
	 * can be had; departed.h has a target of its own in fuzz-dispatch.c). */
	c->pidfd = safe_close(c->pidfd);
	h.geo = c->ring->geo;
	/* The client's own mapping of the region, through the fd the HelloReply carries. */
	fd = hello_reply_fd();
	h.sh = mmap(NULL, h.geo.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	FUZZ_CHECK(h.sh != MAP_FAILED);
	FUZZ_CHECK(ring_geometry_check(&h.sh->geo, h.geo.total_bytes) == 0);
	h.sq_tail = h.cq_head = 0;
	h.sent = h.answered = 0;
	h.forged = false;

	model.has_layers = model.has_q_heads = model.has_kv_heads = model.has_head_dim = true;
	model.layers = model.q_heads = model.kv_heads = 1;
	model.head_dim = 8;
	model.has_dtype = model.has_block_tokens = model.has_layout = true;
	model.dtype = KVD__V1__DTYPE__DTYPE_F16;
	model.block_tokens = 16;
	model.layout = KVD__V1__LAYOUT__LAYOUT_PER_LAYER;
	env = (Envelope)KVD__V1__ENVELOPE__INIT;
	env.body_case = KVD__V1__ENVELOPE__BODY_REGISTER_MODEL;
	env.register_model = &model;
	request(c, &env);
	FUZZ_CHECK(c->n_models == 1);
	for (int i = 0; i < SEQS; i++) {
		Kvd__V1__SeqOpen open = KVD__V1__SEQ_OPEN__INIT;

		open.has_model_id = open.has_max_tokens = true;
		open.model_id = 1;
		open.max_tokens = 4096;
		env = (Envelope)KVD__V1__ENVELOPE__INIT;
		env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN;
		env.seq_open = &open;
		request(c, &env);
		FUZZ_CHECK(c->seqs, "cannot open a sequence");
		h.seq_ids[i] = c->seqs->id;
	}
	pump();
}

/* ---- the rings, the client's side ---- */

/* Runs the consumer as the server's poller does, closing the connection on corruption. */
static void consume(void) {
	struct conn *c = client_conn();
	int r;

	if (!c || !c->ring || c->closing || c->close_when_sent)
		return;
	r = ring_poll(c->ring);
	if (r == -EPROTO) {
		FUZZ_CHECK(h.forged, "a ring the client never corrupted was called corrupted");
		conn_close(c, NULL);
		return;
	}
	FUZZ_CHECK(r >= 0);
}

static void read_completions(uint32_t n) {
	uint32_t tail = ring_load_acquire(&h.sh->cq_tail);

	for (uint32_t i = 0; i < n && h.cq_head != tail; i++, h.cq_head++) {
		const struct kvd_ring_cqe *e = ring_cqe_at(h.sh, &h.geo, h.cq_head);

		/* Once the client wrote over its rings, what it reads there may be its own. */
		if (h.forged)
			continue;
		FUZZ_CHECK(e->res <= 0, "completion with result %d", e->res);
		FUZZ_CHECK(!(e->flags & ~KVD_RING_CQE_F_MESSAGE));
		if (e->flags & KVD_RING_CQE_F_MESSAGE)
			FUZZ_CHECK(memchr(ring_msg_at(h.sh, &h.geo, h.cq_head), 0, KVD_RING_MSG_BYTES),
			           "message without its NUL");
		/* Each of our own submissions is answered once, and nothing we did not send. */
		if ((e->user_data & ~UINT64_C(0xffffffffffff)) == TAG) {
			FUZZ_CHECK((e->user_data & UINT64_C(0xffffffffffff)) < h.sent);
			h.answered++;
			FUZZ_CHECK(h.answered <= h.sent);
		}
	}
	ring_store_release(&h.sh->cq_head, h.cq_head);
}

static void submit(const struct kvd_ring_sqe *e) {
	*ring_sqe_at(h.sh, &h.geo, h.sq_tail++) = *e;
}

static void publish(uint32_t tail) {
	ring_store_release(&h.sh->sq_tail, tail);
	/* A client would ring: clear the word as it would; the loop is awake here anyway. */
	(void)ring_wake_needed(&h.sh->sq_wake);
	consume();
}

/* ---- one input ---- */

static void setup(uint8_t config) {
	struct server_limits limits;
	struct settings cfg;
	struct server *s;
	uint32_t n_chunks = config & 8 ? 2 : 8;

	FUZZ_CHECK(pool_new(&backend_host_ops, 1, n_chunks * CHUNK_BYTES, CHUNK_BYTES,
	                    n_chunks * CHUNK_BYTES, &h.pool) == 0);
	FUZZ_CHECK(settings_init(&cfg) == 0 && settings_init(&h.flags) == 0);
	free(cfg.state_dir);
	cfg.state_dir = strdup("/dev/null/kvd-fuzz");
	FUZZ_CHECK(cfg.state_dir);
	cfg.max_tenants = 4;
	cfg.max_seq_tokens = 1u << 16;
	cfg.ring_entries = 2u << (config & 3);
	cfg.grant_wait_ms = 0;
	admin_limits(&cfg, &limits);
	limits.max_descriptor_bytes = UINT64_C(256) << 10;
	if (config & 16)
		limits.max_tx_bytes = 2048;
	limits.metrics_listen = NULL;

	/* The daemon in process: server_new() less the sockets, signals, timer and poller. */
	FUZZ_CHECK(server_new_local(h.pool, &limits, &s) == 0);
	s->socket_path = "(fuzz)";
	/* The node's bounds derived from the machine: low enough to be met here. */
	s->conns_by_fds = UINT32_MAX;
	s->seqs_node_derived = 24;
	s->metadata_derived = UINT64_C(8) << 20;
	s->ring_doorbell = config & 4 ? KVD_RING_DOORBELL_EVENTFD : KVD_RING_DOORBELL_FUTEX;
	h.srv = s;
	FUZZ_CHECK(admin_new(s, &cfg, &h.flags, &h.admin) == 0);
	settings_done(&cfg);
	s->admin = h.admin;
	h.next_id = 0;
	client_connect(config & 16);
}

static void teardown(void) {
	struct server *s = h.srv;

	check_state(false);
	client_drop();
	for (unsigned i = 0; i < 100 && s->closed; i++)
		FUZZ_CHECK(loop_turn(s->loop, true) >= 0);
	FUZZ_CHECK(!s->closed, "a connection's operations never completed");
	check_state(true);
	h.srv = server_free(s);
	h.admin = admin_free(h.admin);
	settings_done(&h.flags);
	h.pool = pool_free(h.pool);
}

static void init_once(void) {
	if (h.rx)
		return;
	h.rx = malloc(sizeof(*h.rx));
	FUZZ_CHECK(h.rx);
	wire_rx_init(h.rx);
	log_setup();
	log_set_max_level(LOG_DEBUG);
	if (!getenv("KVD_FUZZ_LOG"))
		log_set_ratelimit(UINT64_C(1) << 40, 1);
}

static uint32_t get32(const uint8_t *p) {
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
	size_t pos = 1;
	unsigned fds_before;

	if (size < 1)
		return 0;
	init_once();
	fds_before = fuzz_fd_count();
	setup(data[0]);

	for (unsigned step = 0; step < STEPS_MAX && pos < size; step++) {
		uint8_t op = data[pos++];
		struct conn *c = client_conn();

		/* A connection the daemon closed (corrupted rings, a full send queue) is gone
		 * for the client too; it starts again. */
		if (!c || c->closing || c->close_when_sent) {
			client_drop();
			client_connect(data[0] & 16);
		}
		switch (op & 15) {
		case 0: {
			struct kvd_ring_sqe e;

			if (size - pos < sizeof(e))
				break;
			memcpy(&e, data + pos, sizeof(e));
			submit(&e);
			pos += sizeof(e);
			h.forged = true;
			break;
		}
		case 1: {
			struct kvd_ring_sqe e = {};

			if (size - pos < 3)
				break;
			/* An honest client does not overwrite what the daemon has not taken. */
			if (h.sq_tail - ring_load_acquire(&h.sh->sq_head) >= h.geo.entries) {
				pos += 3;
				break;
			}
			e.op = data[pos] % 6;
			e.seq_id = data[pos + 1] % 4 < SEQS ? h.seq_ids[data[pos + 1] % 4] : 77;
			e.arg = e.op == KVD_RING_OP_GROW ? data[pos + 2] : 0;
			e.user_data = TAG | h.sent++;
			submit(&e);
			pos += 3;
			break;
		}
		case 2:
			publish(h.sq_tail);
			break;
		case 3:
			if (size - pos < 4)
				break;
			h.sq_tail = get32(data + pos);
			pos += 4;
			h.forged = true;
			publish(h.sq_tail);
			break;
		case 4:
			if (pos >= size)
				break;
			read_completions(data[pos++]);
			break;
		case 5:
			if (size - pos < 4)
				break;
			h.cq_head = get32(data + pos);
			pos += 4;
			h.forged = true;
			ring_store_release(&h.sh->cq_head, h.cq_head);
			break;
		case 6: {
			uint32_t off, n;

			if (size - pos < 3)
				break;
			off = (uint32_t)(data[pos] | data[pos + 1] << 8) % h.geo.total_bytes;
			n = MIN((uint32_t)data[pos + 2], h.geo.total_bytes - off);
			pos += 3;
			n = (uint32_t)MIN((size_t)n, size - pos);
			memcpy((char *)h.sh + off, data + pos, n);
			pos += n;
			h.forged = true;
			break;
		}
		case 7:
			pump();
			break;
		case 8:
			if (c && c->ring && !c->closing) {
				if (ring_sleep_prepare(c->ring))
					FUZZ_CHECK(loop_turn(h.srv->loop, false) >= 0);
				ring_sleep_done(c->ring);
			}
			pump();
			break;
		case 9:
			client_drop();
			client_connect(data[0] & 16);
			break;
		default:
			break;
		}
		check_state(false);
	}

	teardown();
	FUZZ_CHECK(fuzz_fd_count() == fds_before, "fds leaked: %u before, %u after", fds_before,
	           fuzz_fd_count());
	return 0;
}
