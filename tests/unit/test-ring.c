/* SPDX-License-Identifier: MIT */
/*
 * The ring layout and protocol of proto/common/ring.h, without the daemon: the geometry and
 * its check, and two processes passing messages both ways through small rings, far more of
 * them than there are entries (wrap-around), with a producer that finds the ring full, and
 * the doorbells: spinning, sleeping at once, and a mix, so that a lost wake-up would hang
 * the test (meson's timeout).
 */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ring.h"
#include "test.h"
#include "basic/time-util.h"

TEST(entries) {
	ASSERT_FALSE(ring_entries_valid(0));
	ASSERT_FALSE(ring_entries_valid(1));
	ASSERT_FALSE(ring_entries_valid(3));
	ASSERT_FALSE(ring_entries_valid(96));
	ASSERT_FALSE(ring_entries_valid(KVD_RING_ENTRIES_MAX * 2));
	for (uint32_t n = KVD_RING_ENTRIES_MIN; n <= KVD_RING_ENTRIES_MAX; n *= 2)
		ASSERT_TRUE(ring_entries_valid(n));
}

TEST(layout) {
	for (uint32_t n = KVD_RING_ENTRIES_MIN; n <= KVD_RING_ENTRIES_MAX; n *= 2) {
		struct kvd_ring_geometry g;

		ASSERT_OK(ring_layout(n, KVD_RING_DOORBELL_FUTEX, &g));
		ASSERT_EQ(g.entries, n);
		/* Nothing the two sides write shares a line with anything else. */
		ASSERT_EQ(sizeof(struct ring_word), (size_t)KVD_RING_LINE);
		ASSERT_EQ(offsetof(struct ring_shared, sq_tail) % KVD_RING_LINE, 0u);
		ASSERT_GE(g.sq_offset, sizeof(struct ring_shared));
		ASSERT_EQ(g.sq_offset % KVD_RING_LINE, 0u);
		ASSERT_EQ(g.cq_offset, g.sq_offset + (uint64_t)n * sizeof(struct kvd_ring_sqe));
		ASSERT_EQ(g.msg_offset, g.cq_offset + (uint64_t)n * sizeof(struct kvd_ring_cqe));
		ASSERT_GE(g.total_bytes, g.msg_offset + (uint64_t)n * KVD_RING_MSG_BYTES);
		ASSERT_EQ(g.total_bytes % 4096, 0u);
		ASSERT_OK(ring_geometry_check(&g, g.total_bytes));
	}
	{
		struct kvd_ring_geometry g;

		ASSERT_ERRNO(ring_layout(3, KVD_RING_DOORBELL_FUTEX, &g), -EINVAL);
		ASSERT_ERRNO(ring_layout(8, 0, &g), -EINVAL);
		ASSERT_ERRNO(ring_layout(8, 3, &g), -EINVAL);
		ASSERT_OK(ring_layout(8, KVD_RING_DOORBELL_EVENTFD, &g));
		ASSERT_OK(ring_geometry_check(&g, g.total_bytes));
	}
}

/* Every field of a geometry a client reads is checked against the formula and the size. */
TEST(geometry_check) {
	struct kvd_ring_geometry good, g;

	ASSERT_OK(ring_layout(64, KVD_RING_DOORBELL_FUTEX, &good));
	ASSERT_ERRNO(ring_geometry_check(&good, good.total_bytes + 4096), -EPROTO);
	ASSERT_ERRNO(ring_geometry_check(&good, good.total_bytes - 1), -EPROTO);
#define BAD(field, value)                                                                     \
	do {                                                                                  \
		g = good;                                                                     \
		g.field = (value);                                                            \
		ASSERT_ERRNO(ring_geometry_check(&g, good.total_bytes), -EPROTO);             \
	} while (0)
	BAD(magic, KVD_RING_MAGIC + 1);
	BAD(version, KVD_RING_VERSION + 1);
	BAD(entries, 128);
	BAD(entries, 63);
	BAD(entries, 0);
	BAD(doorbell, 7);
	BAD(total_bytes, good.total_bytes * 2);
	BAD(sq_offset, 0);
	BAD(cq_offset, good.sq_offset);
	BAD(msg_offset, good.total_bytes);
#undef BAD
}

/* ---- two processes ---- */

struct pair {
	struct ring_shared *sh;
	struct kvd_ring_geometry g;
};

static void pair_new(struct pair *p, uint32_t entries) {
	ASSERT_OK(ring_layout(entries, KVD_RING_DOORBELL_FUTEX, &p->g));
	p->sh = mmap(NULL, p->g.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ASSERT_TRUE(p->sh != MAP_FAILED);
	p->sh->geo = p->g;
}

/* Waits until *index moves past seen: spin for spin_ns, then sleep, as both sides do. */
static void wait_for(struct ring_word *index, struct ring_word *wake, uint32_t seen,
                     uint64_t spin_ns) {
	struct ring_spin spin;

	ring_spin_start(&spin, now_ns());
	while (ring_load_acquire(index) == seen) {
		uint64_t now = now_ns();

		if (now - spin.start < spin_ns) {
			ring_spin_step(&spin, now);
			continue;
		}
		ring_sleep_announce(wake);
		if (ring_load_acquire(index) == seen)
			(void)ring_futex_wait(wake, 1, UINT64_C(10) * 1000000000);
		__atomic_store_n(&wake->v, 0, __ATOMIC_RELAXED);
	}
}

static void ring_bell(struct ring_word *wake) {
	if (ring_wake_needed(wake))
		ASSERT_OK(ring_futex_wake(wake));
}

/* The server: takes each submission, answers with its arg + 1 in `tokens`, in order. */
static void serve(struct pair *p, uint32_t n, uint64_t spin_ns) {
	uint32_t head = 0, tail = 0;

	while (head < n) {
		uint32_t end;

		wait_for(&p->sh->sq_tail, &p->sh->sq_wake, head, spin_ns);
		end = ring_load_acquire(&p->sh->sq_tail);
		/* A producer never runs more than a ring ahead. */
		if (end - head > p->g.entries)
			_exit(3);
		for (; head != end; head++) {
			struct kvd_ring_sqe e = *ring_sqe_at(p->sh, &p->g, head);

			if (e.arg != head || e.user_data != ~(uint64_t)head)
				_exit(4);
			/* The completion ring has room: the client never has more in flight. */
			*ring_cqe_at(p->sh, &p->g, tail++) = (struct kvd_ring_cqe){
				.user_data = e.user_data,
				.tokens = e.arg + 1,
			};
		}
		ring_store_release(&p->sh->sq_head, head);
		ring_store_release(&p->sh->cq_tail, tail);
		if (ring_wake_needed(&p->sh->cq_wake) && ring_futex_wake(&p->sh->cq_wake) < 0)
			_exit(5);
	}
	_exit(0);
}

/*
 * n messages through rings of `entries`, keeping up to `window` (at most entries) in flight,
 * each side spinning client_spin_ns or server_spin_ns before it sleeps.
 */
static void exchange(uint32_t entries, uint32_t n, uint32_t window, uint64_t client_spin_ns,
                     uint64_t server_spin_ns) {
	struct pair p;
	uint32_t sent = 0, got = 0;
	pid_t pid;
	int status;

	ASSERT_LE(window, entries);
	pair_new(&p, entries);
	pid = fork();
	ASSERT_OK(pid);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		serve(&p, n, server_spin_ns);
	}
	while (got < n) {
		/* Submit while the window allows; at most `entries` in flight, as libkvd, so
		 * that neither ring can overflow. */
		while (sent < n && sent - got < window) {
			*ring_sqe_at(p.sh, &p.g, sent) = (struct kvd_ring_sqe){
				.op = KVD_RING_OP_PIN,
				.arg = sent,
				.user_data = ~(uint64_t)sent,
			};
			sent++;
			ring_store_release(&p.sh->sq_tail, sent);
			ring_bell(&p.sh->sq_wake);
		}
		wait_for(&p.sh->cq_tail, &p.sh->cq_wake, got, client_spin_ns);
		for (uint32_t end = ring_load_acquire(&p.sh->cq_tail); got != end; got++) {
			const struct kvd_ring_cqe *e = ring_cqe_at(p.sh, &p.g, got);

			ASSERT_EQ(e->user_data, ~(uint64_t)got);
			ASSERT_EQ(e->tokens, got + 1);
		}
		ring_store_release(&p.sh->cq_head, got);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status));
	ASSERT_EQ(WEXITSTATUS(status), 0);
	munmap(p.sh, p.g.total_bytes);
}

TEST(wrap_around_spinning) {
	exchange(2, 200000, 1, 1000000000, 1000000000);
	exchange(8, 200000, 8, 1000000000, 1000000000);
}

TEST(every_request_sleeps) {
	exchange(4, 5000, 1, 0, 0);
	exchange(4, 10000, 4, 0, 0);
}

TEST(spin_then_sleep) {
	exchange(16, 100000, 16, 20000, 20000);
	exchange(2, 50000, 2, 0, 50000);
	exchange(2, 50000, 2, 50000, 0);
}

/* Every entry in flight: the client fills the ring before the sleeping server even wakes,
 * then waits for completions before it submits again. */
TEST(full_ring) {
	exchange(2, 10000, 2, 0, 0);
	exchange(4, 10000, 4, 1000000, 0);
}
