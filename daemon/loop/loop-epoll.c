/* SPDX-License-Identifier: MIT */
/*
 * The event loop without io_uring (loop-epoll.h): the same completions, made from readiness.
 * Each operation waits on its fd's queue (reads and accepts on one, writes on the other,
 * polls on a third); epoll (level-triggered) says when an fd may be ready, and the queue's
 * head is then tried without blocking, completing when the call does not say EAGAIN. Nops
 * and cancellations complete on the next turn, timeouts when epoll_wait's timeout says.
 * The fds stay the owners': the loop never changes their flags, so reads of fds that may
 * block (eventfds, signalfds) are checked with poll() first.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "loop-epoll.h"

#define EVENTS_PER_WAIT 64
/* Connections one turn accepts at most before their handlers run. */
#define ACCEPT_BATCH 64

enum op_kind { OP_ACCEPT, OP_RECVMSG, OP_RECV, OP_READ, OP_SENDMSG, OP_SEND, OP_POLL };

/* The operations waiting on one fd, each queue in submission order. */
struct watch {
	int fd;
	struct loop_op *in, *out, *polls;
	uint32_t registered;          /* the events epoll has for it; 0: not in epoll */
	bool dirty;                   /* on the dirty list: its queues changed */
	struct watch *next_dirty;
};

struct loop_epoll {
	int epfd;
	struct watch **watches;       /* by fd, made on first use, kept */
	size_t n_watches;
	struct watch *dirty, **dirty_tail;
	/* Completions to run on the next turn (nops, cancellations, regular files). */
	struct loop_op *ready, **ready_tail;
	struct loop_op *timers;       /* by deadline */
};

int loop_epoll_new(struct loop_epoll **ret) {
	struct loop_epoll *e = calloc(1, sizeof(*e));

	if (!e)
		return -ENOMEM;
	e->epfd = epoll_create1(EPOLL_CLOEXEC);
	if (e->epfd < 0) {
		free(e);
		return negative_errno();
	}
	e->ready_tail = &e->ready;
	e->dirty_tail = &e->dirty;
	*ret = e;
	return 0;
}

struct loop_epoll *loop_epoll_free(struct loop_epoll *e) {
	if (!e)
		return NULL;
	for (size_t i = 0; i < e->n_watches; i++)
		free(e->watches[i]);
	free(e->watches);
	safe_close(e->epfd);
	free(e);
	return NULL;
}

static struct watch *watch_get(struct loop_epoll *e, int fd) {
	if (fd < 0)
		return NULL;
	if ((size_t)fd >= e->n_watches) {
		size_t n = MAX((size_t)fd + 1, e->n_watches * 2);
		struct watch **w = realloc(e->watches, n * sizeof(*w));

		if (!w)
			return NULL;
		memset(w + e->n_watches, 0, (n - e->n_watches) * sizeof(*w));
		e->watches = w;
		e->n_watches = n;
	}
	if (!e->watches[fd]) {
		e->watches[fd] = calloc(1, sizeof(struct watch));
		if (!e->watches[fd])
			return NULL;
		e->watches[fd]->fd = fd;
	}
	return e->watches[fd];
}

/* In submission order, as io_uring tries new operations. */
static void mark_dirty(struct loop_epoll *e, struct watch *w) {
	if (w->dirty)
		return;
	w->dirty = true;
	w->next_dirty = NULL;
	*e->dirty_tail = w;
	e->dirty_tail = &w->next_dirty;
}

/*
 * After an op left w's queues: where none is left, w leaves epoll now, before any handler
 * runs, since its owner may close the fd in it. epoll forgets a closed fd only with its
 * last reference, and clients hold the eventfds kvd sends them: an entry left behind would
 * keep firing for an fd number that names another file by then. Other changes wait for
 * the next turn (apply_dirty).
 */
static void settle(struct loop_epoll *e, struct watch *w) {
	if (w->in || w->out || w->polls) {
		mark_dirty(e, w);
		return;
	}
	if (w->registered)
		(void)epoll_ctl(e->epfd, EPOLL_CTL_DEL, w->fd, NULL);
	w->registered = 0;
}

static void append(struct loop_op **head, struct loop_op *op) {
	op->next = NULL;
	while (*head)
		head = &(*head)->next;
	*head = op;
}

static bool unlink_op(struct loop_op **head, struct loop_op *op) {
	for (; *head; head = &(*head)->next)
		if (*head == op) {
			*head = op->next;
			return true;
		}
	return false;
}

static void complete_later(struct loop_epoll *e, struct loop_op *op, int res) {
	op->res = res;
	op->next = NULL;
	*e->ready_tail = op;
	e->ready_tail = &op->next;
}

static int submit(struct loop_epoll *e, struct loop_op *op, enum op_kind kind, int fd, void *buf,
                  size_t n, unsigned events) {
	struct watch *w = watch_get(e, fd);

	if (!w)
		return fd < 0 ? -EBADF : -ENOMEM;
	op->kind = (uint8_t)kind;
	op->fd = fd;
	op->buf = buf;
	op->n = n;
	op->events = events;
	append(kind == OP_POLL ? &w->polls : kind >= OP_SENDMSG ? &w->out : &w->in, op);
	mark_dirty(e, w);
	return 0;
}

int loop_epoll_accept(struct loop_epoll *e, struct loop_op *op, int fd) {
	return submit(e, op, OP_ACCEPT, fd, NULL, 0, 0);
}

int loop_epoll_recvmsg(struct loop_epoll *e, struct loop_op *op, int fd, struct msghdr *msg) {
	return submit(e, op, OP_RECVMSG, fd, msg, 0, 0);
}

int loop_epoll_sendmsg(struct loop_epoll *e, struct loop_op *op, int fd, const struct msghdr *msg) {
	return submit(e, op, OP_SENDMSG, fd, (void *)msg, 0, 0);
}

int loop_epoll_recv(struct loop_epoll *e, struct loop_op *op, int fd, void *buf, size_t n) {
	return submit(e, op, OP_RECV, fd, buf, n, 0);
}

int loop_epoll_send(struct loop_epoll *e, struct loop_op *op, int fd, const void *buf, size_t n) {
	return submit(e, op, OP_SEND, fd, (void *)buf, n, 0);
}

int loop_epoll_read(struct loop_epoll *e, struct loop_op *op, int fd, void *buf, size_t n) {
	return submit(e, op, OP_READ, fd, buf, n, 0);
}

int loop_epoll_poll(struct loop_epoll *e, struct loop_op *op, int fd, unsigned events) {
	return submit(e, op, OP_POLL, fd, NULL, 0, events);
}

int loop_epoll_nop(struct loop_epoll *e, struct loop_op *op) {
	op->kind = OP_POLL;
	op->fd = -1;
	complete_later(e, op, 0);
	return 0;
}

int loop_epoll_timeout(struct loop_epoll *e, struct loop_op *op, uint64_t ms) {
	struct loop_op **p = &e->timers;

	op->fd = -1;
	op->deadline_ns = now_ns() + ms * UINT64_C(1000000);
	while (*p && (*p)->deadline_ns <= op->deadline_ns)
		p = &(*p)->next;
	op->next = *p;
	*p = op;
	return 0;
}

int loop_epoll_cancel(struct loop_epoll *e, struct loop_op *op) {
	struct watch *w = op->fd >= 0 && (size_t)op->fd < e->n_watches ? e->watches[op->fd] : NULL;
	bool found = unlink_op(&e->timers, op);

	if (!found && w) {
		found = unlink_op(&w->in, op) || unlink_op(&w->out, op) || unlink_op(&w->polls, op);
		if (found)
			settle(e, w);
	}
	/* Not waiting (already completed, or on the ready list): nothing to cancel. */
	if (found)
		complete_later(e, op, -ECANCELED);
	return 0;
}

/* Tries op without blocking: its result, or -EAGAIN to wait on. */
static int attempt(struct loop_op *op, unsigned revents) {
	ssize_t k;

	switch ((enum op_kind)op->kind) {
	case OP_ACCEPT:
		k = accept4(op->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		break;
	case OP_RECVMSG:
		k = recvmsg(op->fd, op->buf, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
		break;
	case OP_RECV:
		k = recv(op->fd, op->buf, op->n, MSG_DONTWAIT);
		break;
	case OP_READ: {
		struct pollfd p = { .fd = op->fd, .events = POLLIN };

		if (poll(&p, 1, 0) == 0)
			return -EAGAIN;
		k = read(op->fd, op->buf, op->n);
		break;
	}
	case OP_SENDMSG:
		k = sendmsg(op->fd, op->buf, MSG_NOSIGNAL | MSG_DONTWAIT);
		break;
	case OP_SEND:
		k = send(op->fd, op->buf, op->n, MSG_NOSIGNAL | MSG_DONTWAIT);
		break;
	case OP_POLL:
		k = revents & (op->events | EPOLLERR | EPOLLHUP);
		return k ? (int)k : -EAGAIN;
	default:
		return -EINVAL;
	}
	if (k < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : negative_errno();
	return (int)MIN(k, (ssize_t)INT32_MAX);
}

/*
 * A multishot accept's turn, as io_uring's: the connections waiting are taken in one batch
 * before any handler runs (so a flood meets the fd limit as it would there), each handed
 * over with more, the op staying; an error other than EAGAIN ends it, handed over last.
 */
static int accept_batch(struct loop_epoll *e, struct watch *w, struct loop_op **q,
                        struct loop_op *op) {
	int fds[ACCEPT_BATCH], k = 0, err = -EAGAIN, n = 0;

	while (k < ACCEPT_BATCH) {
		int fd = attempt(op, 0);

		if (fd < 0) {
			err = fd;
			break;
		}
		fds[k++] = fd;
	}
	if (err != -EAGAIN && *q == op) {
		*q = op->next;
		settle(e, w);
	}
	for (int i = 0; i < k; i++, n++)
		op->handler(op, fds[i], true);
	if (err != -EAGAIN) {
		op->handler(op, err, false);
		n++;
	}
	return n;
}

/* Completes the ops of queue *q that are ready, in order, until one would block. Handlers
 * may submit to, and cancel from, this very queue. Returns how many handlers ran. */
static int run_queue(struct loop_epoll *e, struct watch *w, struct loop_op **q, unsigned revents) {
	int n = 0;

	while (*q) {
		struct loop_op *op = *q;
		int res;

		if (op->kind == OP_ACCEPT) {
			n += accept_batch(e, w, q, op);
			break;
		}
		res = attempt(op, revents);
		if (res == -EAGAIN)
			break;
		*q = op->next;
		settle(e, w);
		op->handler(op, res, false);
		n++;
	}
	return n;
}

/*
 * Brings epoll in line with the queues that changed, first trying their new operations,
 * as io_uring does when it is handed them: what can complete at once does, in submission
 * order (a peer's data, or its close, seen before what was submitted after). Returns how
 * many handlers ran.
 */
static int apply_dirty(struct loop_epoll *e) {
	struct watch *w;
	int n = 0;

	while ((w = e->dirty)) {
		uint32_t want;
		struct epoll_event ev = { .data.ptr = w };
		int r = 0;

		e->dirty = w->next_dirty;
		if (!e->dirty)
			e->dirty_tail = &e->dirty;
		w->dirty = false;
		n += run_queue(e, w, &w->in, EPOLLIN);
		n += run_queue(e, w, &w->out, EPOLLOUT);
		if (w->dirty)
			continue;     /* a handler queued more here: tried again in its turn */
		want = (w->in ? EPOLLIN : 0) | (w->out ? EPOLLOUT : 0);
		for (struct loop_op *op = w->polls; op; op = op->next)
			want |= op->events;
		if (want == w->registered)
			continue;
		ev.events = want;
		/* settle() took w out of epoll when its queues emptied; should an owner close an
		 * fd with an op still waiting and open another under its number, ADD and MOD each
		 * try the other. */
		if (want == 0)
			(void)epoll_ctl(e->epfd, EPOLL_CTL_DEL, w->fd, NULL);
		else if (epoll_ctl(e->epfd, w->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, w->fd, &ev) < 0)
			r = epoll_ctl(e->epfd, w->registered ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, w->fd, &ev) < 0 ?
			    negative_errno() : 0;
		w->registered = want;
		if (r == -EPERM) {
			/* A regular file: always ready, as io_uring reads it. */
			w->registered = 0;
			while (w->in) {
				struct loop_op *op = w->in;
				ssize_t k = read(w->fd, op->buf, op->n);

				w->in = op->next;
				complete_later(e, op, k < 0 ? negative_errno() : (int)MIN(k, (ssize_t)INT32_MAX));
			}
		} else if (r < 0) {
			/* Nothing will ever say it is ready: fail what waits on it. */
			struct loop_op **queues[] = { &w->in, &w->out, &w->polls };

			w->registered = 0;
			for (size_t i = 0; i < ELEMENTSOF(queues); i++)
				while (*queues[i]) {
					struct loop_op *op = *queues[i];

					*queues[i] = op->next;
					complete_later(e, op, r);
				}
		}
	}
	return n;
}

/* The polls of w that revents satisfies, each once. */
static int run_polls(struct loop_epoll *e, struct watch *w, unsigned revents) {
	struct loop_op **q = &w->polls;
	int n = 0;

	while (*q) {
		struct loop_op *op = *q;
		int res = attempt(op, revents);

		if (res == -EAGAIN) {
			q = &op->next;
			continue;
		}
		*q = op->next;
		settle(e, w);
		op->handler(op, res, false);
		n++;
		/* The handler may have changed the queue: start over (each op runs once). */
		q = &w->polls;
		revents &= ~(unsigned)res;
	}
	return n;
}

bool loop_epoll_queued(const struct loop_epoll *e) {
	return e->ready || e->dirty;
}

int loop_epoll_turn(struct loop_epoll *e, bool wait, const bool *exit) {
	struct epoll_event events[EVENTS_PER_WAIT];
	struct loop_op *ready;
	int timeout = 0, k, n = 0;

	n = apply_dirty(e);
	if (wait && !e->ready && n == 0) {
		timeout = -1;
		if (e->timers) {
			uint64_t now = now_ns(), at = e->timers->deadline_ns;

			timeout = at <= now ? 0 : (int)MIN(DIV_ROUND_UP(at - now, UINT64_C(1000000)), INT32_MAX);
		}
	}
	k = epoll_wait(e->epfd, events, EVENTS_PER_WAIT, timeout);
	if (k < 0 && errno != EINTR)
		return negative_errno();
	for (int i = 0; i < k && !*exit; i++) {
		struct watch *w = events[i].data.ptr;
		unsigned rev = events[i].events;

		if (rev & (EPOLLIN | EPOLLERR | EPOLLHUP))
			n += run_queue(e, w, &w->in, rev);
		if (rev & (EPOLLOUT | EPOLLERR | EPOLLHUP))
			n += run_queue(e, w, &w->out, rev);
		if (w->polls)
			n += run_polls(e, w, rev);
	}
	while (!*exit && e->timers && e->timers->deadline_ns <= now_ns()) {
		struct loop_op *op = e->timers;

		e->timers = op->next;
		op->handler(op, -ETIME, false);
		n++;
	}
	/* What was ready before this turn's handlers ran: what they queue waits a turn. */
	ready = e->ready;
	e->ready = NULL;
	e->ready_tail = &e->ready;
	while (ready) {
		struct loop_op *op = ready;

		ready = op->next;
		if (*exit) {
			/* Back on the list, for loop_free's caller to find nothing lost. */
			complete_later(e, op, op->res);
			continue;
		}
		op->handler(op, op->res, false);
		n++;
	}
	return n;
}
