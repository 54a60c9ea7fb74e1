/* SPDX-License-Identifier: MIT */
/*
 * libkvd, the per-step rings (proto/common/ring.h has the layout and the protocol): mapping
 * the region the daemon sent with the HelloReply, submitting, and waiting for completions.
 *
 * Threads. Any number of threads may have requests in flight on one client's rings, and
 * none of them holds the client's lock. Submissions are serialised by sq_lock, held only to
 * fill an entry and publish it. Each request owns one of `entries` slots from submission to
 * completion, and its user_data names the slot (index and serial): at most `entries` are in
 * flight, so the daemon always has room for their completions, and when every slot is taken
 * the caller uses the socket instead. A thread then waits for its own slot: whoever finds
 * completions (cq_lock, only ever tried, never waited for) files each into its slot, in
 * whatever order they come, and wakes the threads that sleep. A thread spins for the client's
 * spin time, then sleeps on cq_wake (the doorbell protocol of ring.h). The daemon also rings
 * cq_wake when it sends the connection a frame, and a sleeper that wakes without its
 * completion looks at the socket (at least every RING_SOCKET_CHECK_NS, since a dead daemon
 * rings no bell): a hang-up breaks the rings, and frames are read and handled, so that a
 * grow waiting for an eviction round does not keep the chunks that round freed from going
 * back (the library answers unmap requests as it reads them), as a socket call that waits
 * reads on.
 *
 * The region is replaced only when kvd_client_reconnect() dials a new daemon: it takes the
 * write side of client.ring_lock, every request holds the read side. A request never takes
 * the client's lock while it holds ring_lock, since reconnect holds them the other way round.
 */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client-internal.h"
#include "basic/macro.h"
#include "basic/time-util.h"

/*
 * A slot passes from the thread that submits into it to the thread that reaps its
 * completion through the daemon, another process: the submitter's release of sq_tail and
 * the reaper's acquire of cq_tail order them, but ThreadSanitizer cannot see that chain and
 * reports the reaper's write of the completion as racing with the previous owner's read.
 * These tell it about the hand-over; they are nothing in other builds.
 */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define SLOT_HANDED_OVER(slot) __tsan_release(slot)
#define SLOT_TAKEN_OVER(slot) __tsan_acquire(slot)
#else
#define SLOT_HANDED_OVER(slot) ((void)(slot))
#define SLOT_TAKEN_OVER(slot) ((void)(slot))
#endif

/* A sleeping waiter looks at the socket at least this often: whether the daemon is still
 * there, and what it sent meanwhile (see client_ring_serve()). */
#define RING_SOCKET_CHECK_NS (UINT64_C(10) * 1000000)

struct client_ring {
	struct ring_shared *sh;
	struct kvd_ring_geometry geo;     /* checked once; the region's copy is not read again */
	int efd;                      /* KVD_RING_DOORBELL_EVENTFD: writing it wakes the daemon */
	pthread_mutex_t sq_lock;
	uint32_t sq_tail;             /* under sq_lock */
	uint32_t *free_slots;         /* under sq_lock */
	uint32_t n_free;
	pthread_mutex_t cq_lock;
	uint32_t cq_head;             /* under cq_lock */
	struct ring_slot *slots;      /* geo.entries */
	uint32_t sleepers;            /* threads asleep on cq_wake, or about to be (atomic) */
	int broken;                   /* 0, or why every request fails now (atomic) */
};

/* What a slot holds between submission and its waiter's return. serial, busy and done are
 * read by other threads, with atomics; cqe and msg are written before done is set to 1. */
struct ring_slot {
	uint32_t serial;
	uint32_t busy;
	uint32_t done;
	struct kvd_ring_cqe cqe;
	char msg[KVD_RING_MSG_BYTES];
};

struct client_ring *client_ring_free(struct client_ring *r, bool forked) {
	if (!r)
		return NULL;
	/* A fork() child has no mapping (MADV_DONTFORK), and maybe locks another thread held. */
	if (!forked) {
		if (r->sh)
			munmap(r->sh, r->geo.total_bytes);
		pthread_mutex_destroy(&r->sq_lock);
		pthread_mutex_destroy(&r->cq_lock);
	}
	safe_close(r->efd);
	free(r->slots);
	free(r->free_slots);
	free(r);
	return NULL;
}

int client_ring_map(int memfd, int efd, uint64_t bytes, uint32_t doorbell,
                    struct client_ring **ret) {
	_cleanup_(closep) int fd = memfd, bell = efd;
	struct client_ring *r;
	struct stat st;
	void *p;
	int seals, k;

	if (fstat(fd, &st) < 0)
		return negative_errno();
	if (bytes < sizeof(struct ring_shared) || bytes > SIZE_MAX || (uint64_t)st.st_size != bytes)
		return -EPROTO;
	/* We write into it: a region the daemon could shrink would turn writes into SIGBUS. */
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0 || !(seals & F_SEAL_SHRINK))
		return -EPROTO;
	if ((doorbell == KVD_RING_DOORBELL_EVENTFD) != (bell >= 0))
		return -EPROTO;
	r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	r->efd = -EBADF;
	if (pthread_mutex_init(&r->sq_lock, NULL) != 0) {
		free(r);
		return -ENOMEM;
	}
	if (pthread_mutex_init(&r->cq_lock, NULL) != 0) {
		pthread_mutex_destroy(&r->sq_lock);
		free(r);
		return -ENOMEM;
	}
	p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		k = negative_errno();
		goto fail;
	}
	r->sh = p;
	r->geo.total_bytes = bytes;
	/* Like the chunks: a fork() child holds nothing of the parent's connection. */
	if (madvise(p, bytes, MADV_DONTFORK) < 0) {
		k = negative_errno();
		goto fail;
	}
	/* A copy: the daemon wrote it once, but only the copy is checked and used. */
	memcpy(&r->geo, &r->sh->geo, sizeof(r->geo));
	k = ring_geometry_check(&r->geo, bytes);
	if (k < 0 || r->geo.doorbell != doorbell) {
		k = -EPROTO;
		r->geo.total_bytes = bytes;
		goto fail;
	}
	r->slots = calloc(r->geo.entries, sizeof(*r->slots));
	r->free_slots = calloc(r->geo.entries, sizeof(*r->free_slots));
	if (!r->slots || !r->free_slots) {
		k = -ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i < r->geo.entries; i++)
		r->free_slots[i] = r->geo.entries - 1 - i;
	r->n_free = r->geo.entries;
	r->sq_tail = ring_load_acquire(&r->sh->sq_tail);
	r->cq_head = ring_load_acquire(&r->sh->cq_head);
	r->efd = TAKE_FD(bell);
	*ret = r;
	return 0;
fail:
	client_ring_free(r, false);
	return k;
}

void client_ring_break(struct client_ring *r, int why) {
	int zero = 0;

	if (__atomic_compare_exchange_n(&r->broken, &zero, why, false, __ATOMIC_SEQ_CST,
	                                __ATOMIC_SEQ_CST))
		/* Sleepers look at `broken` before every sleep and after every wake-up. */
		(void)ring_futex_wake(&r->sh->cq_wake);
}

static void ring_bell(struct client_ring *r) {
	uint64_t one = 1;

	if (r->efd >= 0)
		(void)!write(r->efd, &one, sizeof(one));
	else
		(void)ring_futex_wake(&r->sh->sq_wake);
}

/* Files the completions that arrived into their slots; does nothing if another thread is
 * at it. */
static void ring_reap(struct client_ring *r) {
	uint32_t tail, head, filed = 0;

	if (pthread_mutex_trylock(&r->cq_lock) != 0)
		return;
	tail = ring_load_acquire(&r->sh->cq_tail);
	head = r->cq_head;
	if (tail - head > r->geo.entries) {
		client_ring_break(r, -EPROTO);
		tail = head;
	}
	for (; head != tail; head++) {
		const struct kvd_ring_cqe *e = ring_cqe_at(r->sh, &r->geo, head);
		struct kvd_ring_cqe cqe;
		struct ring_slot *slot;
		uint32_t index;

		memcpy(&cqe, e, sizeof(cqe));
		index = (uint32_t)cqe.user_data;
		slot = index < r->geo.entries ? &r->slots[index] : NULL;
		/* A completion for no request in flight is a broken daemon: stop here. */
		if (!slot || __atomic_load_n(&slot->serial, __ATOMIC_RELAXED) != cqe.user_data >> 32 ||
		    !__atomic_load_n(&slot->busy, __ATOMIC_RELAXED) ||
		    __atomic_load_n(&slot->done, __ATOMIC_RELAXED)) {
			client_ring_break(r, -EPROTO);
			break;
		}
		SLOT_TAKEN_OVER(slot);
		slot->cqe = cqe;
		if (cqe.flags & KVD_RING_CQE_F_MESSAGE) {
			memcpy(slot->msg, ring_msg_at(r->sh, &r->geo, head), KVD_RING_MSG_BYTES);
			slot->msg[KVD_RING_MSG_BYTES - 1] = '\0';
		}
		__atomic_store_n(&slot->done, 1, __ATOMIC_RELEASE);
		filed++;
	}
	r->cq_head = head;
	ring_store_release(&r->sh->cq_head, head);
	pthread_mutex_unlock(&r->cq_lock);
	/* A thread whose completion we filed may be asleep: the same store-fence-load pairing
	 * as the doorbells, with `sleepers` for the wake word. */
	if (filed > 0) {
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
		if (__atomic_load_n(&r->sleepers, __ATOMIC_RELAXED) > 0)
			(void)ring_futex_wake(&r->sh->cq_wake);
	}
}

/* After a sleep that brought no completion: a daemon that hung up breaks the rings; one that
 * sent something gets it read, if the client's lock is free (client_ring_serve()). */
static void ring_check_socket(kvd_client *c, struct client_ring *r) {
	struct pollfd p = { .fd = c->fd, .events = POLLIN | POLLRDHUP };

	if (poll(&p, 1, 0) <= 0)
		return;
	if (p.revents & (POLLRDHUP | POLLHUP | POLLERR))
		client_ring_break(r, -ECONNRESET);
	else
		client_ring_serve(c);
}

static int ring_wait(kvd_client *c, struct client_ring *r, struct ring_slot *slot,
                     uint64_t spin_ns) {
	uint64_t start = now_ns();
	struct ring_spin spin;

	ring_spin_start(&spin, start);
	for (;;) {
		uint64_t now;
		int k;

		if (__atomic_load_n(&slot->done, __ATOMIC_ACQUIRE))
			return 0;
		ring_reap(r);
		if (__atomic_load_n(&slot->done, __ATOMIC_ACQUIRE))
			return 0;
		k = __atomic_load_n(&r->broken, __ATOMIC_ACQUIRE);
		if (k < 0)
			return k;
		now = now_ns();
		if (now - start < spin_ns) {
			ring_spin_step(&spin, now);
			continue;
		}
		__atomic_add_fetch(&r->sleepers, 1, __ATOMIC_SEQ_CST);
		ring_sleep_announce(&r->sh->cq_wake);
		if (__atomic_load_n(&slot->done, __ATOMIC_ACQUIRE) ||
		    ring_load_acquire(&r->sh->cq_tail) != ring_load_acquire(&r->sh->cq_head) ||
		    __atomic_load_n(&r->broken, __ATOMIC_ACQUIRE) < 0)
			k = 1;
		else
			k = ring_futex_wait(&r->sh->cq_wake, 1, RING_SOCKET_CHECK_NS);
		__atomic_sub_fetch(&r->sleepers, 1, __ATOMIC_SEQ_CST);
		/* Completions come first: the frames sent before one are read after it is
		 * found (client_ring_finish()), so that a test stopping in between sees them
		 * unread, as on the socket. */
		ring_reap(r);
		if (k <= 0 && !__atomic_load_n(&slot->done, __ATOMIC_ACQUIRE) &&
		    ring_load_acquire(&r->sh->cq_tail) == ring_load_acquire(&r->sh->cq_head))
			ring_check_socket(c, r);
	}
}

int client_ring_calls(kvd_client *c, const struct kvd_ring_sqe *reqs, uint32_t n,
                      bool stop_after_submit, struct ring_done *rets) {
	uint32_t index[RING_BATCH_MAX], m;
	struct client_ring *r;
	int k = 0;

	if (!__atomic_load_n(&c->want_ring, __ATOMIC_RELAXED))
		return -EAGAIN;
	pthread_rwlock_rdlock(&c->ring_lock);
	r = c->ring;
	if (!r) {
		pthread_rwlock_unlock(&c->ring_lock);
		return -EAGAIN;
	}

	pthread_mutex_lock(&r->sq_lock);
	k = __atomic_load_n(&r->broken, __ATOMIC_ACQUIRE);
	if (k < 0 || r->n_free == 0 || n == 0) {
		pthread_mutex_unlock(&r->sq_lock);
		pthread_rwlock_unlock(&c->ring_lock);
		return k < 0 ? k : -EAGAIN;
	}
	m = MIN(MIN(n, r->n_free), (uint32_t)RING_BATCH_MAX);
	for (uint32_t i = 0; i < m; i++) {
		struct ring_slot *slot;
		struct kvd_ring_sqe *e;

		index[i] = r->free_slots[--r->n_free];
		slot = &r->slots[index[i]];
		__atomic_store_n(&slot->serial, slot->serial + 1, __ATOMIC_RELAXED);
		__atomic_store_n(&slot->done, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&slot->busy, 1, __ATOMIC_RELAXED);
		SLOT_HANDED_OVER(slot);
		e = ring_sqe_at(r->sh, &r->geo, r->sq_tail);
		*e = reqs[i];
		e->user_data = (uint64_t)slot->serial << 32 | index[i];
		r->sq_tail++;
	}
	/* One store publishes them all: the daemon wakes once for the batch. */
	ring_store_release(&r->sh->sq_tail, r->sq_tail);
	pthread_mutex_unlock(&r->sq_lock);
	if (ring_wake_needed(&r->sh->sq_wake))
		ring_bell(r);

	if (stop_after_submit)
		raise(SIGSTOP);
	for (uint32_t i = 0; i < m && k >= 0; i++) {
		struct ring_slot *slot = &r->slots[index[i]];
		struct ring_done *ret = &rets[i];

		k = ring_wait(c, r, slot, __atomic_load_n(&c->spin_ns, __ATOMIC_RELAXED));
		if (k < 0)
			break;
		/* Stored before the completion was published, loaded after it was found. */
		ret->frames = __atomic_load_n(&r->sh->frames.v, __ATOMIC_ACQUIRE);
		ret->cqe = slot->cqe;
		if (slot->cqe.flags & KVD_RING_CQE_F_MESSAGE)
			memcpy(ret->msg, slot->msg, KVD_RING_MSG_BYTES);
		else
			ret->msg[0] = '\0';
		pthread_mutex_lock(&r->sq_lock);
		__atomic_store_n(&slot->busy, 0, __ATOMIC_RELAXED);
		r->free_slots[r->n_free++] = index[i];
		pthread_mutex_unlock(&r->sq_lock);
	}
	/* On failure the slots stay taken: the ring is broken and goes with the connection. */
	pthread_rwlock_unlock(&c->ring_lock);
	return k < 0 ? k : (int)m;
}
