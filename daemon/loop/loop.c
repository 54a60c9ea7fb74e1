/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "common/ring.h"
#include "loop-epoll.h"
#include "loop.h"
#include "basic/time-util.h"

#define LOOP_ENTRIES 256
/* liburing 2.3 knows neither the opcode (Linux 6.7) nor the futex2 flags. */
#define LOOP_OP_FUTEX_WAIT 51
#define LOOP_FUTEX2_SIZE_U32 0x02
#define LOOP_FUTEX_BITSET_MATCH_ANY 0xffffffffu
/* Without IORING_SETUP_TASKRUN_FLAG (kernels before 6.1, where the loop also goes without
 * DEFER_TASKRUN), the spinning loop cannot tell whether io_uring has completions for it
 * without entering the kernel, which costs more than a ring's whole round trip: while the
 * poller finds work it enters at most this often, and once the poller has been idle this
 * long, on every turn. */
#define LOOP_SPIN_ENTER_NS 2000

struct loop {
	struct io_uring ring;
	struct loop_epoll *epoll;     /* instead of ring, where io_uring is not allowed */
	char describe[160];
	bool exit;
	bool taskrun_flag;            /* the kernel flags pending completions (see loop_pending()) */
	const struct loop_poller *poller;
	/* The kernel copies timespecs only at submission on old kernels; keep them stable. */
	struct __kernel_timespec timeouts[8];
	unsigned next_timeout;
};

const char *loop_setup_to_string(int v) {
	static const char *const names[_LOOP_SETUP_MAX] = {
		[LOOP_SETUP_AUTO] = "auto",
		[LOOP_SETUP_BASIC] = "basic",
		[LOOP_SETUP_EPOLL] = "epoll",
	};

	return v >= 0 && v < _LOOP_SETUP_MAX ? names[v] : NULL;
}

int loop_new(enum loop_setup setup, struct loop **ret) {
	static const unsigned flags[] = {
		IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG,
		/* Kernels before 6.1 lack DEFER_TASKRUN; the loop works without it. */
		0,
	};
	struct io_uring_params p;
	struct loop *l;
	int r = -EINVAL;

	if (setup < 0 || setup >= _LOOP_SETUP_MAX)
		return -EINVAL;
	l = calloc(1, sizeof(*l));
	if (!l)
		return -ENOMEM;
	for (size_t i = setup == LOOP_SETUP_BASIC ? 1 : 0;
	     setup != LOOP_SETUP_EPOLL && i < ELEMENTSOF(flags) && r == -EINVAL; i++) {
		memset(&p, 0, sizeof(p));
		p.flags = flags[i];
		r = io_uring_queue_init_params(LOOP_ENTRIES, &l->ring, &p);
	}
	if (r >= 0) {
		l->taskrun_flag = p.flags & IORING_SETUP_TASKRUN_FLAG;
		snprintf(l->describe, sizeof(l->describe), "io_uring, %s", l->taskrun_flag ?
		         "deferred task running (Linux 6.1 and later)" : setup == LOOP_SETUP_BASIC ?
		         "basic setup, as configured (--uring-setup=basic)" :
		         "basic setup (the kernel has no DEFER_TASKRUN)");
		*ret = l;
		return 0;
	}
	/* Refused, not failed: a seccomp profile (Docker's, containerd's), the
	 * kernel.io_uring_disabled sysctl, a kernel or sandbox without io_uring. */
	if (setup == LOOP_SETUP_EPOLL)
		snprintf(l->describe, sizeof(l->describe), "epoll, as configured (--uring-setup=epoll)");
	else if (r == -EPERM || r == -ENOSYS || r == -EACCES)
		snprintf(l->describe, sizeof(l->describe), "epoll: io_uring is not allowed here (%s: a "
		         "seccomp profile, kernel.io_uring_disabled, or a kernel without it)",
		         strerror(-r));
	else {
		free(l);
		return r;
	}
	r = loop_epoll_new(&l->epoll);
	if (r < 0) {
		free(l);
		return r;
	}
	*ret = l;
	return 0;
}

const char *loop_describe(const struct loop *l) {
	return l->describe;
}

bool loop_deferred(const struct loop *l) {
	return l->taskrun_flag;
}

struct loop *loop_free(struct loop *l) {
	if (!l)
		return NULL;
	if (l->epoll)
		loop_epoll_free(l->epoll);
	else
		io_uring_queue_exit(&l->ring);
	free(l);
	return NULL;
}

static struct io_uring_sqe *get_sqe(struct loop *l) {
	struct io_uring_sqe *sqe = io_uring_get_sqe(&l->ring);

	if (!sqe) {
		/* The submission queue is full: hand it to the kernel and try once more. */
		io_uring_submit(&l->ring);
		sqe = io_uring_get_sqe(&l->ring);
	}
	return sqe;
}

#define PREP(l, op, sqe)                                                                      \
	struct io_uring_sqe *sqe = get_sqe(l);                                                \
	if (!sqe)                                                                             \
		return -EBUSY;                                                                \
	io_uring_sqe_set_data(sqe, op)

int loop_accept(struct loop *l, struct loop_op *op, int fd) {
	if (l->epoll)
		return loop_epoll_accept(l->epoll, op, fd);
	PREP(l, op, sqe);
	io_uring_prep_multishot_accept(sqe, fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
	return 0;
}

int loop_recvmsg(struct loop *l, struct loop_op *op, int fd, struct msghdr *msg) {
	if (l->epoll)
		return loop_epoll_recvmsg(l->epoll, op, fd, msg);
	PREP(l, op, sqe);
	io_uring_prep_recvmsg(sqe, fd, msg, MSG_CMSG_CLOEXEC);
	return 0;
}

int loop_sendmsg(struct loop *l, struct loop_op *op, int fd, const struct msghdr *msg) {
	if (l->epoll)
		return loop_epoll_sendmsg(l->epoll, op, fd, msg);
	PREP(l, op, sqe);
	io_uring_prep_sendmsg(sqe, fd, msg, MSG_NOSIGNAL);
	return 0;
}

int loop_recv(struct loop *l, struct loop_op *op, int fd, void *buf, size_t n) {
	if (l->epoll)
		return loop_epoll_recv(l->epoll, op, fd, buf, n);
	PREP(l, op, sqe);
	io_uring_prep_recv(sqe, fd, buf, n, 0);
	return 0;
}

int loop_poll(struct loop *l, struct loop_op *op, int fd, unsigned events) {
	if (l->epoll)
		return loop_epoll_poll(l->epoll, op, fd, events);
	PREP(l, op, sqe);
	io_uring_prep_poll_add(sqe, fd, events);
	return 0;
}

int loop_send(struct loop *l, struct loop_op *op, int fd, const void *buf, size_t n) {
	if (l->epoll)
		return loop_epoll_send(l->epoll, op, fd, buf, n);
	PREP(l, op, sqe);
	io_uring_prep_send(sqe, fd, buf, n, MSG_NOSIGNAL);
	return 0;
}

int loop_read(struct loop *l, struct loop_op *op, int fd, void *buf, unsigned n) {
	if (l->epoll)
		return loop_epoll_read(l->epoll, op, fd, buf, n);
	PREP(l, op, sqe);
	io_uring_prep_read(sqe, fd, buf, n, 0);
	return 0;
}

int loop_timeout(struct loop *l, struct loop_op *op, uint64_t ms) {
	struct __kernel_timespec *ts;

	if (l->epoll)
		return loop_epoll_timeout(l->epoll, op, ms);
	ts = &l->timeouts[l->next_timeout++ % ELEMENTSOF(l->timeouts)];
	ts->tv_sec = ms / 1000;
	ts->tv_nsec = (ms % 1000) * 1000000;
	PREP(l, op, sqe);
	io_uring_prep_timeout(sqe, ts, 0, 0);
	return 0;
}

int loop_nop(struct loop *l, struct loop_op *op) {
	if (l->epoll)
		return loop_epoll_nop(l->epoll, op);
	PREP(l, op, sqe);
	io_uring_prep_nop(sqe);
	return 0;
}

int loop_futex_wait(struct loop *l, struct loop_op *op, uint32_t *word, uint32_t val) {
	if (l->epoll)
		return -EOPNOTSUPP;
	PREP(l, op, sqe);
	/* Shared, not FUTEX2_PRIVATE: the word is in a memfd mapped by the client too. */
	io_uring_prep_rw(LOOP_OP_FUTEX_WAIT, sqe, LOOP_FUTEX2_SIZE_U32, word, 0, val);
	sqe->addr3 = LOOP_FUTEX_BITSET_MATCH_ANY;
	return 0;
}

int loop_cancel(struct loop *l, struct loop_op *op) {
	if (l->epoll)
		return loop_epoll_cancel(l->epoll, op);
	/* The cancellation's own completion carries no op: loop_turn() skips it. */
	PREP(l, NULL, sqe);
	io_uring_prep_cancel(sqe, op, 0);
	return 0;
}

bool loop_has_futex_wait(struct loop *l) {
	struct io_uring_probe *p;
	bool ok;

	if (l->epoll)
		return false;
	p = io_uring_get_probe_ring(&l->ring);
	if (!p)
		return false;
	ok = p->last_op >= LOOP_OP_FUTEX_WAIT && io_uring_opcode_supported(p, LOOP_OP_FUTEX_WAIT);
	io_uring_free_probe(p);
	return ok;
}

void loop_set_poller(struct loop *l, const struct loop_poller *p) {
	l->poller = p;
}

void loop_exit(struct loop *l) {
	l->exit = true;
}

int loop_turn(struct loop *l, bool wait) {
	struct io_uring_cqe *cqe;
	int r, n = 0;

	if (l->epoll)
		return loop_epoll_turn(l->epoll, wait, &l->exit);
	/* Even without waiting, enter the kernel: with DEFER_TASKRUN, completions are posted
	 * only when the ring asks for events. */
	r = wait ? io_uring_submit_and_wait(&l->ring, 1) : io_uring_submit_and_get_events(&l->ring);
	if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY)
		return r;
	while (!l->exit && io_uring_peek_cqe(&l->ring, &cqe) == 0) {
		struct loop_op *op = io_uring_cqe_get_data(cqe);
		int res = cqe->res;
		bool more = cqe->flags & IORING_CQE_F_MORE;

		/* Mark the entry seen before the handler runs: handlers submit new work. */
		io_uring_cqe_seen(&l->ring, cqe);
		if (op)
			op->handler(op, res, more);
		n++;
	}
	return n;
}

/* Whether entering io_uring would find something: submissions to make, completions posted,
 * or (with the flag) work the kernel deferred until we enter, such as a receive whose data
 * came. Memory loads only, so that the spinning loop enters the kernel only when useful. */
static bool loop_pending(struct loop *l) {
	return io_uring_sq_ready(&l->ring) > 0 || io_uring_cq_ready(&l->ring) > 0 ||
	       (IO_URING_READ_ONCE(*l->ring.sq.kflags) & IORING_SQ_TASKRUN);
}

/* Whether there is work queued for the kernel or for the next turn. */
static bool loop_queued(struct loop *l) {
	return l->epoll ? loop_epoll_queued(l->epoll) : io_uring_sq_ready(&l->ring) > 0;
}

/* loop_run() with a poller: spin, then sleep (see loop_poller). */
static int loop_run_polling(struct loop *l) {
	const struct loop_poller *p = l->poller;
	uint64_t idle_since = now_ns(), entered = 0, polled = 0;
	struct ring_spin spin;

	ring_spin_start(&spin, idle_since);
	while (!l->exit) {
		uint64_t now = now_ns();
		bool busy = false;
		int r;

		/* Submissions the poller queued (replies, events) go out at once. */
		if (l->taskrun_flag ? loop_pending(l) :
		    loop_queued(l) || now - entered >= LOOP_SPIN_ENTER_NS ||
		    now - polled >= LOOP_SPIN_ENTER_NS) {
			r = loop_turn(l, false);
			if (r < 0)
				return r;
			entered = now;
			busy = r > 0;
		}
		if (l->exit)
			break;
		if (p->poll(p->userdata)) {
			polled = now;
			busy = true;
		}
		if (busy) {
			idle_since = now;
			ring_spin_start(&spin, now);
			continue;
		}
		if (now - idle_since < p->spin_ns) {
			ring_spin_step(&spin, now);
			continue;
		}
		if (!p->sleep(p->userdata, true)) {
			idle_since = now;
			ring_spin_start(&spin, now);
			continue;
		}
		r = loop_turn(l, true);
		p->sleep(p->userdata, false);
		if (r < 0)
			return r;
		idle_since = entered = now_ns();
		ring_spin_start(&spin, idle_since);
	}
	return 0;
}

int loop_run(struct loop *l) {
	if (l->poller)
		return loop_run_polling(l);
	while (!l->exit) {
		int r = loop_turn(l, true);

		if (r < 0)
			return r;
	}
	return 0;
}
