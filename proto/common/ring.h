/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The hot path's shared-memory rings (docs/architecture.md §4), written down once for the daemon
 * (daemon/net/ring.c), libkvd (client/ring.c) and the floor that kvd-bench ipc measures them
 * against.
 *
 * Region. Per connection, the daemon creates a memfd, seals it against resizing, maps it,
 * and sends it with the HelloReply (kvd.proto, feature bit KVD_FEATURE_RING). In the style of
 * io_uring it holds:
 *   - struct kvd_ring_geometry, written once by the daemon: magic, version, entries, offsets;
 *   - seven 32-bit words, each alone on KVD_RING_LINE bytes so that the two sides never write
 *     the same cache line: sq_tail (written by the client), sq_head (daemon), sq_wake,
 *     cq_tail (daemon), cq_head (client), cq_wake, and frames (daemon; see "Socket");
 *   - the submission queue, `entries` struct kvd_ring_sqe, written by the client;
 *   - the completion queue, `entries` struct kvd_ring_cqe, written by the daemon;
 *   - `entries` refusal messages of KVD_RING_MSG_BYTES, one per completion slot.
 * Indices are free-running u32 counters; entry i lives at i & (entries - 1), entries being a
 * power of two. Only ids, counts and offsets are stored, never a pointer.
 *
 * Queues. Each queue has one producer and one consumer (libkvd serialises its threads'
 * submissions). The producer writes an entry, then publishes its index with a release
 * store; the consumer loads the index with acquire, copies the entry out, then publishes its
 * own index with a release store. A submission's user_data comes back in its completion,
 * and completions may come out of order: a grow that waits for an eviction round completes
 * after requests submitted later. Every submission gets exactly one completion. The daemon
 * takes a submission only when the completion queue has room for every completion it owes,
 * so it never buffers one: a client that leaves its completion queue full has its
 * submissions wait (the ring_completions limit counts it) until it makes room and rings the
 * doorbell again. libkvd never gets there, since it has at most `entries` requests in
 * flight.
 *
 * Socket. fds cannot travel in a ring, so a grow's new chunks come on the socket
 * (EVENT_CHUNKS_GRANT), as do a release's unmap requests (EVENT_CHUNKS_UNMAP) and whatever
 * an eviction round sends. The frames word counts (mod 2^32) every frame the daemon has
 * sent or queued on the connection's socket, and is stored before any completion that
 * follows those frames is published: a client that has read fewer frames than the word
 * said when it found a completion reads the socket up to there before it acts on the
 * completion, so that it sees them in the order a client of the socket alone would, and
 * without a system call when it has nothing to catch up on.
 *
 * Doorbells. A side that runs out of work spins for a while (the daemon's --poll-us, the
 * client's spin time), then announces that it is going to sleep by storing 1 in its wake
 * word (sq_wake for the daemon, cq_wake for client threads), issues a full fence, looks at
 * its queue once more, and sleeps while the word is 1: the client with FUTEX_WAIT, the
 * daemon inside its io_uring loop, with IORING_OP_FUTEX_WAIT, or, on kernels before 6.7,
 * reading the connection's eventfd. A producer, after publishing its index, issues a full
 * fence and loads the peer's wake word; only when it is 1 does it exchange it for 0 and wake
 * the peer (FUTEX_WAKE, or a write to the eventfd). Each side stores, fences, then loads what
 * the other stores, so at least one of them sees the other: no wake-up is lost, and a
 * producer whose peer is awake makes no system call.
 *
 * Trust. The client can write the whole region at any time. The daemon keeps its own copy
 * of the geometry and of its own indices and never reads them back; it reads the client's
 * indices once per pass and checks them (a tail more than `entries` ahead of the head is a
 * corrupted ring, and the connection is closed); it copies each submission out before
 * checking it, and answers a bad one with an error completion, as it answers a bad request
 * on the socket. What a client scribbles reaches only its own rings. libkvd checks the
 * geometry once, when it maps the region, and every completion's user_data against its own
 * table.
 */

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvd/kvd-abi.h"

struct ring_word {
	_Alignas(KVD_RING_LINE) uint32_t v;
};

/* The region's head as it is laid out: the geometry, then each word alone on its lines
 * (kvd-abi.h gives the offsets). */
struct ring_shared {
	struct kvd_ring_geometry geo;
	struct ring_word sq_tail, sq_head, sq_wake;
	struct ring_word cq_tail, cq_head, cq_wake;
	struct ring_word frames;
};

_Static_assert(offsetof(struct ring_shared, sq_tail) == KVD_RING_LINE, "kvd-abi.h: word 0");
_Static_assert(offsetof(struct ring_shared, frames) == 7 * KVD_RING_LINE, "kvd-abi.h: word 6");

static inline bool ring_entries_valid(uint32_t n) {
	return n >= KVD_RING_ENTRIES_MIN && n <= KVD_RING_ENTRIES_MAX && (n & (n - 1)) == 0;
}

/* The geometry of a region of `entries` entries. Returns 0, or -EINVAL for a bad count or
 * doorbell. */
static inline int ring_layout(uint32_t entries, uint32_t doorbell, struct kvd_ring_geometry *ret) {
	uint64_t off = (sizeof(struct ring_shared) + KVD_RING_LINE - 1) / KVD_RING_LINE * KVD_RING_LINE;

	if (!ring_entries_valid(entries) ||
	    (doorbell != KVD_RING_DOORBELL_FUTEX && doorbell != KVD_RING_DOORBELL_EVENTFD))
		return -EINVAL;
	*ret = (struct kvd_ring_geometry){
		.magic = KVD_RING_MAGIC,
		.version = KVD_RING_VERSION,
		.entries = entries,
		.doorbell = doorbell,
		.sq_offset = off,
		.cq_offset = off + (uint64_t)entries * sizeof(struct kvd_ring_sqe),
		.msg_offset = off + (uint64_t)entries * (sizeof(struct kvd_ring_sqe) + sizeof(struct kvd_ring_cqe)),
	};
	ret->total_bytes = (ret->msg_offset + (uint64_t)entries * KVD_RING_MSG_BYTES + 4095) / 4096 * 4096;
	return 0;
}

/* Checks a copy of the geometry found in a region of `size` bytes: it must be exactly what
 * ring_layout() makes for its entries and doorbell. Returns 0 or -EPROTO. */
static inline int ring_geometry_check(const struct kvd_ring_geometry *g, uint64_t size) {
	struct kvd_ring_geometry want;

	if (g->magic != KVD_RING_MAGIC || g->version != KVD_RING_VERSION ||
	    ring_layout(g->entries, g->doorbell, &want) < 0)
		return -EPROTO;
	if (g->total_bytes != size || want.total_bytes != size || g->sq_offset != want.sq_offset ||
	    g->cq_offset != want.cq_offset || g->msg_offset != want.msg_offset)
		return -EPROTO;
	return 0;
}

/* Entry i of each array; g is the caller's own (checked) copy of the geometry. */
static inline struct kvd_ring_sqe *ring_sqe_at(struct ring_shared *sh, const struct kvd_ring_geometry *g,
                                           uint32_t i) {
	return (struct kvd_ring_sqe *)((char *)sh + g->sq_offset) + (i & (g->entries - 1));
}

static inline struct kvd_ring_cqe *ring_cqe_at(struct ring_shared *sh, const struct kvd_ring_geometry *g,
                                           uint32_t i) {
	return (struct kvd_ring_cqe *)((char *)sh + g->cq_offset) + (i & (g->entries - 1));
}

static inline char *ring_msg_at(struct ring_shared *sh, const struct kvd_ring_geometry *g, uint32_t i) {
	return (char *)sh + g->msg_offset + (uint64_t)(i & (g->entries - 1)) * KVD_RING_MSG_BYTES;
}

static inline uint32_t ring_load_acquire(const struct ring_word *w) {
	return __atomic_load_n(&w->v, __ATOMIC_ACQUIRE);
}

static inline void ring_store_release(struct ring_word *w, uint32_t v) {
	__atomic_store_n(&w->v, v, __ATOMIC_RELEASE);
}

/* The consumer, before its last look at the queue and sleeping (see "Doorbells"). */
static inline void ring_sleep_announce(struct ring_word *wake) {
	__atomic_store_n(&wake->v, 1, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* The producer, after publishing its index: whether the consumer sleeps, in which case the
 * caller, and only it, wakes it. The plain load first keeps the line shared while the peer
 * is awake. */
static inline bool ring_wake_needed(struct ring_word *wake) {
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	return __atomic_load_n(&wake->v, __ATOMIC_RELAXED) == 1 &&
	       __atomic_exchange_n(&wake->v, 0, __ATOMIC_ACQ_REL) == 1;
}

/* Not FUTEX_PRIVATE_FLAG: the word is shared with another process. Returns 0 or -errno. */
static inline int ring_futex_wake(struct ring_word *w) {
	return syscall(SYS_futex, &w->v, FUTEX_WAKE, INT_MAX, NULL, NULL, 0) < 0 ? -errno : 0;
}

/* Sleeps while the word is val, at most timeout_ns. Returns 0 (woken), -EAGAIN (the word was
 * not val), -ETIMEDOUT, -EINTR. */
static inline int ring_futex_wait(struct ring_word *w, uint32_t val, uint64_t timeout_ns) {
	struct timespec ts = { .tv_sec = (time_t)(timeout_ns / 1000000000),
		               .tv_nsec = (long)(timeout_ns % 1000000000) };

	return syscall(SYS_futex, &w->v, FUTEX_WAIT, val, &ts, NULL, 0) < 0 ? -errno : 0;
}

/* How long a spin only pauses before it yields the CPU for the first time. */
#define RING_SPIN_PAUSE_NS 2000

/*
 * A bounded spin (its caller decides when to stop): pause instructions, and a sched_yield()
 * RING_SPIN_PAUSE_NS after the start, then each time the spin has lasted twice as long as at
 * the last yield. On one core the first yield lets a peer that waits for this very CPU
 * run, which is what the spinner waits for; across cores a yield finds nobody to run and
 * only costs a system call, hence ever rarer ones.
 */
struct ring_spin {
	uint64_t start, next_yield;
};

static inline void ring_spin_start(struct ring_spin *s, uint64_t now) {
	s->start = now;
	s->next_yield = now + RING_SPIN_PAUSE_NS;
}

static inline void ring_spin_step(struct ring_spin *s, uint64_t now) {
	if (now >= s->next_yield) {
		sched_yield();
		s->next_yield = now + (now - s->start);
		return;
	}
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

