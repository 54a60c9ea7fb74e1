/* SPDX-License-Identifier: MIT */
/*
 * The per-step rings (proto/common/ring.h) against a real daemon: libkvd uses them when the
 * daemon offers them and falls back to the socket when it does not; both doorbells wake a
 * sleeping daemon; rings wrap around and fill up under many threads on many connections;
 * grants and unmaps travel on the socket around a ring request; a grow that waits for an
 * eviction round does not hold up other requests; a client that dies mid-request is
 * noticed; and a raw client that writes garbage into its rings, lets its completion ring
 * fill up or corrupts its indices gets errors or a disconnect, while the daemon and other
 * clients go on.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/ring.h"
#include "fixture.h"
#include "test.h"
#include "basic/time-util.h"

#define MiB (UINT64_C(1) << 20)

/* Blocks of 4 KiB (2 x 16 rows x 64 x f16), 4 tables: 16 KiB per 16 tokens. */
static const kvd_model_spec shape = { "ring", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };

/* ---- libkvd over the rings ---- */

/* Grows, pins, writes and checks one sequence through whatever path c uses. */
static void step_through(kvd_client *c, int m, uint32_t tag) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	for (int i = 0; i < 8; i++) {
		ASSERT_OK(kvd_seq_grow(s, 100));
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_OK(kvd_seq_unpin(s));
		ASSERT_OK(kvd_seq_unpin(s));
		ASSERT_EQ(kvd_seq_tokens(s, 1, 1), (i + 1) * 100);
	}
	ASSERT_ERRNO(kvd_seq_unpin(s), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "not pinned"));
	ASSERT_ERRNO(kvd_seq_grow(s, 4096), -EFBIG);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "at most 4096 tokens"));
	fill_seq(s, tag);
	ASSERT_EQ(check_seq(s, tag), 0u);
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
}

TEST(rings_used_when_offered) {
	struct fixture f;
	kvd_client *c, *admin;
	uint32_t mapped;
	int m;

	fixture_start(&f, (const char *const[]){ "--pool-size", "64MiB", "--chunk-size", "1MiB",
	                                         "--poll-us=50", NULL });
	c = fixture_connect(&f, "ring");
	admin = fixture_connect(&f, NULL);
	/* An administrative connection has no per-step requests, hence no rings. */
	ASSERT_EQ(kvd_client_get_ring(admin), 0);
	ASSERT_ERRNO(kvd_client_set_ring(admin, 1), -EOPNOTSUPP);
	ASSERT_EQ(kvd_client_get_ring(c), 1);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	step_through(c, m, 1);
	/* The release gave its chunks back before it returned, as on the socket. */
	ASSERT_OK(kvd_client_mapped_chunks(c, NULL, 0, &mapped));
	ASSERT_EQ(mapped, 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);

	/* The same calls over the socket, on the same connection, and back. */
	ASSERT_OK(kvd_client_set_ring(c, 0));
	ASSERT_EQ(kvd_client_get_ring(c), 0);
	step_through(c, m, 2);
	ASSERT_OK(kvd_client_set_ring(c, 1));
	ASSERT_OK(kvd_client_set_spin(c, 0));
	step_through(c, m, 3);
	ASSERT_ERRNO(kvd_client_set_spin(c, 1000001), -EINVAL);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	kvd_client_unref(c);

	/* A client that does not ask for rings (as an older libkvd) gets none. */
	setenv("KVD_NO_RING", "1", 1);
	c = fixture_connect(&f, "ring");
	unsetenv("KVD_NO_RING");
	ASSERT_EQ(kvd_client_get_ring(c), 0);
	ASSERT_ERRNO(kvd_client_set_ring(c, 1), -EOPNOTSUPP);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	step_through(c, m, 4);
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);

	/* A daemon without rings: the socket serves. */
	fixture_start(&f, (const char *const[]){ "--ring-entries", "0", NULL });
	c = fixture_connect(&f, "ring");
	ASSERT_EQ(kvd_client_get_ring(c), 0);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	step_through(c, m, 5);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* More sequences than a ring batch (64): kvd_seqs_* submit them in several. */
#define BATCH 70

/* One decode step's calls for BATCH sequences at once, through whatever path c uses: each
 * sequence's result as its own call's, a refusal of one leaving the others done. */
static void batch_through(kvd_client *c, kvd_client *other, int m, uint32_t tag) {
	kvd_seq *s[BATCH], *mixed[2];
	int codes[BATCH];

	for (int i = 0; i < BATCH; i++)
		ASSERT_OK(kvd_seq_open(c, m, i == 5 ? 64 : 4096, &s[i]));
	ASSERT_OK(kvd_seqs_grow(s, BATCH, 40, codes));
	for (int i = 0; i < BATCH; i++)
		ASSERT_EQ(codes[i], 0);
	/* Sequence 5 holds at most 64 tokens: refused alone. */
	ASSERT_ERRNO(kvd_seqs_grow(s, BATCH, 40, codes), -EFBIG);
	for (int i = 0; i < BATCH; i++) {
		ASSERT_EQ(codes[i], i == 5 ? -EFBIG : 0);
		ASSERT_EQ(kvd_seq_tokens(s[i], 1, 1), i == 5 ? 40 : 80);
	}
	ASSERT_OK(kvd_seqs_pin(s, BATCH, codes));
	for (int i = 0; i < BATCH; i++) {
		ASSERT_EQ(codes[i], KVD_RECALL_NONE);
		fill_seq(s[i], tag + (uint32_t)i);
	}
	ASSERT_OK(kvd_seqs_unpin(s, BATCH, NULL));
	ASSERT_ERRNO(kvd_seqs_unpin(s, BATCH, codes), -EINVAL);
	for (int i = 0; i < BATCH; i++)
		ASSERT_EQ(codes[i], -EINVAL);
	/* Nothing is sent for a batch of two clients' sequences, or none at all. */
	mixed[0] = s[0];
	ASSERT_OK(kvd_seq_open(other, kvd_model_register(other, &shape), 64, &mixed[1]));
	ASSERT_ERRNO(kvd_seqs_pin(mixed, 2, NULL), -EINVAL);
	ASSERT_ERRNO(kvd_seqs_grow(s, 0, 1, NULL), -EINVAL);
	ASSERT_ERRNO(kvd_seqs_grow(s, BATCH, 0, NULL), -EINVAL);
	ASSERT_OK(kvd_seq_release(mixed[1]));
	for (int i = 0; i < BATCH; i++) {
		ASSERT_EQ(check_seq(s[i], tag + (uint32_t)i), 0u);
		assert_digests_agree(s[i]);
		ASSERT_OK(kvd_seq_release(s[i]));
	}
}

TEST(batch_steps) {
	struct fixture f;
	kvd_client *c, *other;
	int m;

	fixture_start(&f, (const char *const[]){ "--pool-size", "64MiB", "--chunk-size", "1MiB", NULL });
	c = fixture_connect(&f, "ring");
	other = fixture_connect(&f, "ring");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_EQ(kvd_client_get_ring(c), 1);
	batch_through(c, other, m, 10);
	/* The same on the socket. */
	ASSERT_OK(kvd_client_set_ring(c, 0));
	batch_through(c, other, m, 100);
	kvd_client_unref(c);
	kvd_client_unref(other);
	ASSERT_EQ(fixture_stop(&f), 0);

	/* A ring smaller than a batch: what it has room for at a time. */
	fixture_start(&f, (const char *const[]){ "--pool-size", "64MiB", "--chunk-size", "1MiB",
	                                         "--ring-entries", "8", NULL });
	c = fixture_connect(&f, "ring");
	other = fixture_connect(&f, "ring");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	batch_through(c, other, m, 200);
	kvd_client_unref(c);
	kvd_client_unref(other);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(ring_entries_checked) {
	char out[4096];

	ASSERT_EQ(fixture_run_daemon("--ring-entries 3 --check-config /dev/null", out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "ring-entries"));
	ASSERT_EQ(fixture_run_daemon("--ring-entries 8192 --check-config /dev/null", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--ring-doorbell bell --check-config /dev/null", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--ring-entries 2 --ring-doorbell eventfd --check-config /dev/null",
	                             out, sizeof(out)), 0);
}

/* ---- concurrency ---- */

struct worker {
	kvd_client *c;
	int model;
	unsigned index, rounds;
	uint64_t tokens;
};

/* One thread's loop: its own sequences, grown, pinned and unpinned many times (the rings
 * wrap around again and again), checked, and released. */
static void *worker_main(void *userdata) {
	struct worker *w = userdata;
	kvd_seq *s[2];

	for (int i = 0; i < 2; i++)
		ASSERT_OK(kvd_seq_open(w->c, w->model, 8192, &s[i]));
	for (unsigned r = 0; r < w->rounds; r++) {
		kvd_seq *q = s[r % 2];

		ASSERT_OK(kvd_seq_pin(q));
		ASSERT_OK(kvd_seq_grow(q, 3));
		/* The new slots' chunk is mapped by the time the grow returns, even when another
		 * thread's grow brought it (its grant travels on the socket). */
		ASSERT_OK(kvd_seq_kv(q, 1, 1, (r / 2 + 1) * 3 - 1, NULL, NULL));
		ASSERT_OK(kvd_seq_unpin(q));
		ASSERT_EQ(kvd_seq_tokens(q, 0, 0), (r / 2 + 1) * 3);
	}
	for (int i = 0; i < 2; i++) {
		fill_seq(s[i], 100 + w->index * 2 + i);
		ASSERT_EQ(check_seq(s[i], 100 + w->index * 2 + i), 0u);
		assert_digests_agree(s[i]);
		w->tokens += (uint64_t)kvd_seq_tokens(s[i], 1, 1);
		ASSERT_OK(kvd_seq_release(s[i]));
	}
	return NULL;
}

/* conns connections, threads threads on each, rounds requests per thread (three per round). */
static void hammer(struct fixture *f, unsigned conns, unsigned threads, unsigned rounds,
                   uint32_t spin_us) {
	struct worker w[64];
	pthread_t t[64];
	kvd_client *c[16];
	int m[16];

	ASSERT_LE(conns * threads, 64u);
	for (unsigned i = 0; i < conns; i++) {
		char tenant[16];

		snprintf(tenant, sizeof(tenant), "t%u", i % 3);
		c[i] = fixture_connect(f, tenant);
		ASSERT_EQ(kvd_client_get_ring(c[i]), 1);
		ASSERT_OK(kvd_client_set_spin(c[i], spin_us));
		m[i] = kvd_model_register(c[i], &shape);
		ASSERT_OK(m[i]);
	}
	for (unsigned i = 0; i < conns * threads; i++) {
		w[i] = (struct worker){ .c = c[i / threads], .model = m[i / threads], .index = i,
			                .rounds = rounds };
		ASSERT_EQ(pthread_create(&t[i], NULL, worker_main, &w[i]), 0);
	}
	for (unsigned i = 0; i < conns * threads; i++) {
		ASSERT_EQ(pthread_join(t[i], NULL), 0);
		ASSERT_EQ(w[i].tokens, (uint64_t)rounds / 2 * 3 * 2);
	}
	for (unsigned i = 0; i < conns; i++)
		kvd_client_unref(c[i]);
	for (unsigned i = 0; i < conns && i < 3; i++) {
		char tenant[16];

		snprintf(tenant, sizeof(tenant), "t%u", i);
		ASSERT_TRUE(fixture_wait_status(f, tenant, "connections", 0));
	}
	ASSERT_EQ(fixture_status(f, NULL, "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(f, NULL, "protocol_errors"), 0u);
	ASSERT_EQ(fixture_status(f, NULL, "refused_ring_completions"), 0u);
}

/*
 * The daemon sleeps between requests (--poll-us 0) and clients do not spin, so that every
 * request rings the doorbell: futex, then eventfd.
 */
static void doorbell(const char *kind) {
	struct fixture f;

	fixture_start(&f, (const char *const[]){ "--pool-size", "256MiB", "--chunk-size", "1MiB",
	                                         "--poll-us", "0", "--ring-doorbell", kind, NULL });
	hammer(&f, 3, 3, 300, 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(doorbell_futex) {
	/* Futex waits are io_uring's (IORING_OP_FUTEX_WAIT): not on the epoll loop. */
	if (getenv("KVD_TEST_LOOP") && strcmp(getenv("KVD_TEST_LOOP"), "epoll") == 0)
		TEST_SKIP("the futex doorbell needs io_uring");
	doorbell("futex");
}

TEST(doorbell_eventfd) {
	doorbell("eventfd");
}

/*
 * The paths of kernels older than this one, forced: io_uring without deferred task running
 * (before 6.1), so the polling loop has to enter the kernel to learn of completions, and
 * the eventfd doorbell (before 6.7); once with the loop polling, once asleep.
 */
static void old_kernel(const char *poll_us) {
	struct fixture f;

	fixture_setup(&f, NULL, true);
	fixture_launch(&f, (const char *const[]){ "--pool-size", "256MiB", "--chunk-size", "1MiB",
	                                          "--uring-setup", "basic", "--ring-doorbell", "eventfd",
	                                          "--poll-us", poll_us, NULL });
	ASSERT_TRUE(fixture_wait_log(&f, "event loop: io_uring, basic setup, as configured", 1));
	hammer(&f, 2, 3, 300, 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(old_kernel_polling) {
	old_kernel("50");
}

TEST(old_kernel_sleeping) {
	old_kernel("0");
}

/* Rings of 2 entries under 8 threads: they wrap around thousands of times, and requests
 * that find every slot in flight go on the socket. */
TEST(small_rings_many_threads) {
	struct fixture f;

	fixture_start(&f, (const char *const[]){ "--pool-size", "256MiB", "--chunk-size", "1MiB",
	                                         "--ring-entries", "2", "--poll-us=50", NULL });
	hammer(&f, 1, 8, 400, 20);
	hammer(&f, 4, 4, 200, 20);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* ---- a grow that waits ---- */

struct parked {
	kvd_seq *s;
	int r;
	uint64_t ms;
};

static void *parked_grow(void *userdata) {
	struct parked *p = userdata;
	uint64_t start = now_ms();

	p->r = kvd_seq_grow(p->s, 16);
	p->ms = now_ms() - start;
	return NULL;
}

TEST(waiting_grow_does_not_block_the_ring) {
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_BLOCK };
	struct fixture f;
	kvd_client *c, *admin, *pinner;
	kvd_seq *held, *a, *b, *extra;
	struct parked p;
	pthread_t t;
	int m, me;

	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--grant-wait", "1500", "--max-outstanding", "1",
	                                         NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_budget_set(admin, 2 * MiB));
	/* Something evictable exists, so a grow the budget cannot meet waits for rounds; it is
	 * pinned, so the rounds free nothing and the grow waits until grant-wait. */
	pinner = fixture_connect(&f, "evictable");
	me = kvd_model_register_evictable(pinner, &shape, &ev);
	ASSERT_OK(me);
	ASSERT_OK(kvd_seq_open(pinner, me, 4096, &held));
	ASSERT_OK(kvd_seq_pin(held));
	ASSERT_OK(kvd_seq_grow(held, 64));

	c = fixture_connect(&f, "waiter");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 4096, &a));
	ASSERT_OK(kvd_seq_open(c, m, 4096, &b));
	ASSERT_OK(kvd_seq_open(c, m, 4096, &extra));
	/* b fills the budget's second chunk: 64 blocks of 16 KiB. */
	ASSERT_OK(kvd_seq_grow(b, 1024));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 2 * MiB);

	p = (struct parked){ .s = a };
	ASSERT_EQ(pthread_create(&t, NULL, parked_grow, &p), 0);
	/* Once a's grow waits (it has 1.5 s to), this connection's next one is over
	 * max-outstanding (1): refused at once, and counted. */
	usleep(300 * 1000);
	{
		uint64_t start = now_ms();

		ASSERT_ERRNO(kvd_seq_grow(extra, 16), -ENOSPC);
		ASSERT_LT(now_ms() - start, 500u);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "refused_outstanding"), 1u);
	/* Meanwhile the same connection's other requests come and go through the ring. */
	for (int i = 0; i < 100; i++) {
		uint64_t start = now_ms();

		ASSERT_OK(kvd_seq_pin(b));
		ASSERT_OK(kvd_seq_unpin(b));
		ASSERT_LT(now_ms() - start, 500u);
	}
	ASSERT_EQ(pthread_join(t, NULL), 0);
	ASSERT_ERRNO(p.r, -ENOSPC);
	ASSERT_GE(p.ms, 1000u);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "budget"));
	ASSERT_EQ(kvd_seq_tokens(a, 0, 0), 0);

	ASSERT_OK(kvd_seq_unpin(held));
	ASSERT_OK(kvd_seq_release(held));
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_OK(kvd_seq_release(extra));
	kvd_client_unref(c);
	kvd_client_unref(pinner);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A daemon that dies while a ring request waits: the request returns, and the client
 * reports the loss like any other. */
TEST(daemon_dies_under_a_waiting_request) {
	static const kvd_eviction_spec ev = { .unit = KVD_UNIT_BLOCK };
	struct fixture f;
	kvd_client *c, *admin;
	kvd_seq *held, *a;
	struct parked p;
	kvd_event e;
	pthread_t t;
	int m;

	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--grant-wait", "60000", NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_budget_set(admin, 1 * MiB));
	c = fixture_connect(&f, "victim");
	m = kvd_model_register_evictable(c, &shape, &ev);
	ASSERT_OK(m);
	/* Pinned before it fills the budget, so that no round takes anything from it. */
	ASSERT_OK(kvd_seq_open(c, m, 8192, &held));
	ASSERT_OK(kvd_seq_pin(held));
	ASSERT_OK(kvd_seq_grow(held, 1024));
	ASSERT_OK(kvd_seq_open(c, m, 8192, &a));
	p = (struct parked){ .s = a };
	ASSERT_EQ(pthread_create(&t, NULL, parked_grow, &p), 0);
	usleep(200 * 1000);
	ASSERT_OK(kill(f.pid, SIGKILL));
	ASSERT_EQ(pthread_join(t, NULL), 0);
	ASSERT_ERRNO(p.r, -ECONNRESET);
	ASSERT_LT(p.ms, 2000u);
	ASSERT_ERRNO(kvd_seq_pin(a), -ECONNRESET);
	ASSERT_EQ(kvd_client_next_event(c, &e), 1);
	ASSERT_EQ(e.type, (uint32_t)KVD_EVENT_DISCONNECTED);
	/* Released on our side only, as on a lost socket. */
	ASSERT_ERRNO(kvd_seq_release(held), -ECONNRESET);
	ASSERT_ERRNO(kvd_seq_release(a), -ECONNRESET);
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 128 + SIGKILL);
}

/* ---- a raw client that does what libkvd never would ---- */

struct raw_ring {
	int fd;
	int efd;                      /* the eventfd doorbell, or -1 (futex) */
	struct wire_rx *rx;
	struct ring_shared *sh;
	struct kvd_ring_geometry geo;
	uint32_t sq_tail, cq_head;
};

/* Hello with the ring feature, keeping the fds of the reply. */
static void raw_ring_open(struct fixture *f, const char *tenant, struct raw_ring *rr) {
	Kvd__V1__Hello h = KVD__V1__HELLO__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *rep;
	int fds[WIRE_FDS_MAX];
	uint32_t nfds = 0;
	struct stat st;

	rr->fd = raw_connect(f);
	rr->rx = malloc(sizeof(*rr->rx));
	ASSERT_TRUE(rr->rx);
	wire_rx_init(rr->rx);
	h.has_min_version = h.has_max_version = h.has_features = true;
	h.min_version = h.max_version = 1;
	h.features = KVD_FEATURE_RING;
	h.tenant = (char *)tenant;
	env.has_id = true;
	env.id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_HELLO;
	env.hello = &h;
	ASSERT_OK(raw_send(rr->fd, &env));
	for (;;) {
		uint8_t cmsg[WIRE_CMSG_SPACE];
		struct iovec iov;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cmsg,
			              .msg_controllen = sizeof(cmsg) };
		ssize_t n;
		int r = wire_rx_next(rr->rx, &rep, fds, &nfds);

		ASSERT_OK(r);
		if (r > 0)
			break;
		iov.iov_base = wire_rx_space(rr->rx, &iov.iov_len);
		n = recvmsg(rr->fd, &msg, MSG_CMSG_CLOEXEC);
		ASSERT_GT(n, 0);
		ASSERT_OK(wire_rx_take_cmsg(rr->rx, &msg));
		wire_rx_commit(rr->rx, (size_t)n);
	}
	ASSERT_EQ(rep->status->code, 0);
	ASSERT_TRUE(rep->hello_reply->features & KVD_FEATURE_RING);
	ASSERT_GE(nfds, 1u);
	ASSERT_OK(fstat(fds[0], &st));
	ASSERT_EQ((uint64_t)st.st_size, rep->hello_reply->ring_bytes);
	rr->sh = mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
	ASSERT_TRUE(rr->sh != MAP_FAILED);
	/* Sealed: the client cannot pull the region from under the daemon. */
	ASSERT_ERRNO(ftruncate(fds[0], 0) < 0 ? -errno : 0, -EPERM);
	ASSERT_ERRNO(ftruncate(fds[0], st.st_size + 4096) < 0 ? -errno : 0, -EPERM);
	rr->geo = rr->sh->geo;
	ASSERT_OK(ring_geometry_check(&rr->geo, (uint64_t)st.st_size));
	/* The doorbell is futex or eventfd, as the daemon's loop allows (kvd.proto). */
	rr->efd = -1;
	if (rr->geo.doorbell == KVD_RING_DOORBELL_EVENTFD) {
		ASSERT_GE(nfds, 2u);
		rr->efd = fds[1];
		fds[1] = -1;
	}
	for (uint32_t i = 0; i < nfds; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	rr->sq_tail = rr->cq_head = 0;
}

static void raw_ring_close(struct raw_ring *rr) {
	munmap(rr->sh, rr->geo.total_bytes);
	close(rr->fd);
	if (rr->efd >= 0)
		close(rr->efd);
	wire_rx_done(rr->rx);
	free(rr->rx);
}

/* Publishes what was written up to tail, and rings if the daemon sleeps. */
static void raw_ring_publish(struct raw_ring *rr) {
	ring_store_release(&rr->sh->sq_tail, rr->sq_tail);
	if (ring_wake_needed(&rr->sh->sq_wake)) {
		if (rr->efd >= 0)
			ASSERT_EQ(write(rr->efd, &(uint64_t){ 1 }, sizeof(uint64_t)), (ssize_t)sizeof(uint64_t));
		else
			ASSERT_OK(ring_futex_wake(&rr->sh->sq_wake));
	}
}

/* Waits until at least n completions are there; returns how many. */
static uint32_t raw_ring_wait(struct raw_ring *rr, uint32_t n, int timeout_ms) {
	uint64_t deadline = now_ms() + timeout_ms;
	uint32_t k;

	while ((k = ring_load_acquire(&rr->sh->cq_tail) - rr->cq_head) < n && now_ms() < deadline)
		usleep(1000);
	return k;
}

TEST(garbage_submissions_get_errors) {
	struct fixture f;
	struct raw_ring rr;
	kvd_client *good;
	uint64_t seed = 42;
	int m;

	fixture_start(&f, (const char *const[]){ "--ring-entries", "16", NULL });
	good = fixture_connect(&f, "good");
	m = kvd_model_register(good, &shape);
	ASSERT_OK(m);
	raw_ring_open(&f, "evil", &rr);
	for (int round = 0; round < 64; round++) {
		uint32_t n = 1 + round % rr.geo.entries;

		for (uint32_t i = 0; i < n; i++) {
			struct kvd_ring_sqe *e = ring_sqe_at(rr.sh, &rr.geo, rr.sq_tail++);
			uint64_t w[4];

			for (int k = 0; k < 4; k++) {
				seed = seed * 6364136223846793005u + 1442695040888963407u;
				w[k] = seed;
			}
			memcpy(e, w, sizeof(*e));
			/* Every other one a known operation, to get past the first check. */
			if (i % 2) {
				e->op = 1 + (uint8_t)(w[0] % 5);
				e->flags = e->reserved = 0;
				e->reserved2 = 0;
				if (e->op != KVD_RING_OP_GROW)
					e->arg = 0;
			}
			e->user_data = ((uint64_t)round << 32) | i;
		}
		raw_ring_publish(&rr);
		ASSERT_EQ(raw_ring_wait(&rr, n, 5000), n);
		for (uint32_t i = 0; i < n; i++) {
			const struct kvd_ring_cqe *e = ring_cqe_at(rr.sh, &rr.geo, rr.cq_head++);

			/* No sequence of this connection exists: every answer is an error. */
			ASSERT_LT(e->res, 0);
			ASSERT_TRUE(e->flags & KVD_RING_CQE_F_MESSAGE);
			ASSERT_EQ(e->user_data >> 32, (uint64_t)round);
		}
		ring_store_release(&rr.sh->cq_head, rr.cq_head);
		/* The well-behaved client next door never notices. */
		step_through(good, m, (uint32_t)round);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "protocol_errors"), 0u);
	raw_ring_close(&rr);
	kvd_client_unref(good);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(full_completion_ring_stalls_only_its_client) {
	struct fixture f;
	struct raw_ring rr;
	kvd_client *good;
	uint32_t entries;
	int m;

	fixture_start(&f, (const char *const[]){ "--ring-entries", "4", NULL });
	good = fixture_connect(&f, "good");
	m = kvd_model_register(good, &shape);
	ASSERT_OK(m);
	raw_ring_open(&f, "lazy", &rr);
	entries = rr.geo.entries;
	/* A full ring's worth, never read; then as many more. */
	for (uint32_t i = 0; i < 2 * entries; i++) {
		struct kvd_ring_sqe *e = ring_sqe_at(rr.sh, &rr.geo, rr.sq_tail++);

		*e = (struct kvd_ring_sqe){ .op = KVD_RING_OP_PIN, .seq_id = 999, .user_data = i };
		if (i == entries - 1 || i == 2 * entries - 1)
			raw_ring_publish(&rr);
		if (i == entries - 1)
			ASSERT_EQ(raw_ring_wait(&rr, entries, 5000), entries);
	}
	/* The daemon takes none of the second batch and buffers nothing. */
	ASSERT_EQ(raw_ring_wait(&rr, entries + 1, 300), entries);
	ASSERT_EQ(ring_load_acquire(&rr.sh->sq_head), entries);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_ring_completions"), 1u);
	step_through(good, m, 1);

	/* Reading the completions and ringing again (it sleeps by now) lets the rest through. */
	rr.cq_head += entries;
	ring_store_release(&rr.sh->cq_head, rr.cq_head);
	raw_ring_publish(&rr);
	ASSERT_EQ(raw_ring_wait(&rr, entries, 5000), entries);
	for (uint32_t i = 0; i < entries; i++)
		ASSERT_EQ(ring_cqe_at(rr.sh, &rr.geo, rr.cq_head + i)->res, -ENOENT);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_ring_completions"), 1u);
	raw_ring_close(&rr);
	kvd_client_unref(good);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Indices no producer could have written: the daemon disconnects, and goes on. */
static void corrupt(struct fixture *f, bool completion_side) {
	struct raw_ring rr;
	uint64_t errors = fixture_status(f, NULL, "protocol_errors");
	char b;

	raw_ring_open(f, "corrupt", &rr);
	if (completion_side) {
		/* Fill the completion ring, claim to have read 1000 completions, and ask for
		 * one more: looking for room, the daemon finds the head where no tail can be. */
		rr.sq_tail = rr.geo.entries;
		raw_ring_publish(&rr);
		ASSERT_EQ(raw_ring_wait(&rr, rr.geo.entries, 5000), rr.geo.entries);
		ring_store_release(&rr.sh->cq_head, 1000);
		rr.sq_tail++;
	} else
		rr.sq_tail = rr.geo.entries + 5;
	raw_ring_publish(&rr);
	ASSERT_EQ(poll(&(struct pollfd){ .fd = rr.fd, .events = POLLIN }, 1, 5000), 1);
	ASSERT_EQ(read(rr.fd, &b, 1), 0);
	ASSERT_EQ(fixture_status(f, NULL, "protocol_errors"), errors + 1);
	raw_ring_close(&rr);
}

TEST(corrupted_indices_disconnect) {
	struct fixture f;
	kvd_client *good;
	int m;

	fixture_start(&f, (const char *const[]){ "--ring-entries", "8", NULL });
	good = fixture_connect(&f, "good");
	m = kvd_model_register(good, &shape);
	ASSERT_OK(m);
	corrupt(&f, false);
	step_through(good, m, 1);
	corrupt(&f, true);
	step_through(good, m, 2);
	kvd_client_unref(good);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * Doorbells as a CPU sink: a client rings in a loop with nothing submitted (and keeps the
 * futex doorbell's word at 0, so that every wait ends at once). The daemon backs off its
 * doorbell (counted as ring_doorbell) and stays far from a core; another client's ring
 * works after, and the abuser's too once it submits.
 */
static void doorbell_abuse(const char *kind) {
	struct fixture f;
	struct raw_ring rr;
	kvd_client *good;
	unsigned long long t0, used;
	uint64_t start, wall;
	long hz = sysconf(_SC_CLK_TCK);
	pid_t noisy;
	int m, status;

	fixture_start(&f, (const char *const[]){ "--ring-doorbell", kind, "--poll-us", "0", NULL });
	good = fixture_connect(&f, "good");
	m = kvd_model_register(good, &shape);
	ASSERT_OK(m);
	raw_ring_open(&f, "noisy", &rr);
	/* What a start leaves to do (the first tick's work) is done by then. */
	usleep(300 * 1000);
	t0 = fixture_cpu_ticks(f.pid);
	start = now_ms();
	/* The abuser rings as fast as it can, in a process of its own. */
	noisy = fixture_fork();
	if (noisy == 0) {
		while (now_ms() - start < 1000)
			if (rr.efd >= 0) {
				if (write(rr.efd, &(uint64_t){ 1 }, sizeof(uint64_t)) < 0)
					_exit(1);
			} else {
				__atomic_store_n(&rr.sh->sq_wake.v, 0, __ATOMIC_RELAXED);
				(void)ring_futex_wake(&rr.sh->sq_wake);
			}
		_exit(0);
	}
	ASSERT_EQ(waitpid(noisy, &status, 0), noisy);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	wall = now_ms() - start;
	used = fixture_cpu_ticks(f.pid) - t0;
	fprintf(stderr, "doorbell (%s): the daemon used %llu ms of CPU in %llu ms, %llu back-offs\n",
	        kind, used * 1000 / (unsigned long long)hz, (unsigned long long)wall,
	        (unsigned long long)fixture_status(&f, NULL, "refused_ring_doorbell"));
	/* Before the back-off it took 40 to 80% of a core here (docs/security.md). */
	ASSERT_LT(used * 1000 / (unsigned long long)hz, wall / 10);
	ASSERT_GE(fixture_status(&f, NULL, "refused_ring_doorbell"), 1u);
	step_through(good, m, 1);
	/* The abuser's own submission is still served. */
	*ring_sqe_at(rr.sh, &rr.geo, rr.sq_tail++) =
		(struct kvd_ring_sqe){ .op = KVD_RING_OP_PIN, .seq_id = 999, .user_data = 1 };
	raw_ring_publish(&rr);
	ASSERT_EQ(raw_ring_wait(&rr, 1, 5000), 1u);
	ASSERT_EQ(ring_cqe_at(rr.sh, &rr.geo, rr.cq_head)->res, -ENOENT);
	raw_ring_close(&rr);
	kvd_client_unref(good);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(doorbell_abuse_futex) {
	if (getenv("KVD_TEST_LOOP") && strcmp(getenv("KVD_TEST_LOOP"), "epoll") == 0)
		TEST_SKIP("the futex doorbell needs io_uring");
	doorbell_abuse("futex");
}

TEST(doorbell_abuse_eventfd) {
	doorbell_abuse("eventfd");
}
