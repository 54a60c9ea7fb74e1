/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <liburing.h>
#include <stdlib.h>
#include <string.h>

#include "common/macro.h"
#include "loop.h"

#define LOOP_ENTRIES 256

struct loop {
	struct io_uring ring;
	bool exit;
	/* The kernel copies timespecs only at submission on old kernels; keep them stable. */
	struct __kernel_timespec timeouts[8];
	unsigned next_timeout;
};

int loop_new(struct loop **ret) {
	struct io_uring_params p = {
		.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
	};
	struct loop *l;
	int r;

	l = calloc(1, sizeof(*l));
	if (!l)
		return -ENOMEM;
	r = io_uring_queue_init_params(LOOP_ENTRIES, &l->ring, &p);
	if (r == -EINVAL) {
		/* Kernels before 6.1 lack DEFER_TASKRUN; the loop works without it. */
		memset(&p, 0, sizeof(p));
		r = io_uring_queue_init_params(LOOP_ENTRIES, &l->ring, &p);
	}
	if (r < 0) {
		free(l);
		return r;
	}
	*ret = l;
	return 0;
}

struct loop *loop_free(struct loop *l) {
	if (!l)
		return NULL;
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
	PREP(l, op, sqe);
	io_uring_prep_multishot_accept(sqe, fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
	return 0;
}

int loop_recvmsg(struct loop *l, struct loop_op *op, int fd, struct msghdr *msg) {
	PREP(l, op, sqe);
	io_uring_prep_recvmsg(sqe, fd, msg, MSG_CMSG_CLOEXEC);
	return 0;
}

int loop_sendmsg(struct loop *l, struct loop_op *op, int fd, const struct msghdr *msg) {
	PREP(l, op, sqe);
	io_uring_prep_sendmsg(sqe, fd, msg, MSG_NOSIGNAL);
	return 0;
}

int loop_recv(struct loop *l, struct loop_op *op, int fd, void *buf, size_t n) {
	PREP(l, op, sqe);
	io_uring_prep_recv(sqe, fd, buf, n, 0);
	return 0;
}

int loop_send(struct loop *l, struct loop_op *op, int fd, const void *buf, size_t n) {
	PREP(l, op, sqe);
	io_uring_prep_send(sqe, fd, buf, n, MSG_NOSIGNAL);
	return 0;
}

int loop_read(struct loop *l, struct loop_op *op, int fd, void *buf, unsigned n) {
	PREP(l, op, sqe);
	io_uring_prep_read(sqe, fd, buf, n, 0);
	return 0;
}

int loop_timeout(struct loop *l, struct loop_op *op, uint64_t ms) {
	struct __kernel_timespec *ts = &l->timeouts[l->next_timeout++ % ELEMENTSOF(l->timeouts)];

	ts->tv_sec = ms / 1000;
	ts->tv_nsec = (ms % 1000) * 1000000;
	PREP(l, op, sqe);
	io_uring_prep_timeout(sqe, ts, 0, 0);
	return 0;
}

void loop_exit(struct loop *l) {
	l->exit = true;
}

int loop_turn(struct loop *l, bool wait) {
	struct io_uring_cqe *cqe;
	int r, n = 0;

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

int loop_run(struct loop *l) {
	while (!l->exit) {
		int r = loop_turn(l, true);

		if (r < 0)
			return r;
	}
	return 0;
}
