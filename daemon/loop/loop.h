/* SPDX-License-Identifier: MIT */
#pragma once

#include <errno.h>

/*
 * The daemon's one event loop, on io_uring, or on epoll where io_uring is not allowed
 * (loop-epoll.h). loop.c is the only file that knows io_uring: everything else submits
 * operations described by a struct loop_op embedded in the object that owns the operation,
 * and gets its handler called with the result (a byte count, an fd, or a negative errno)
 * when it completes. Buffers, msghdrs and the owner itself must stay alive until the
 * handler ran: owners count their operations in flight and free themselves only when none
 * is left (see conn.c).
 *
 * Single-threaded: the loop, every handler and every submission run on one thread.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

struct loop;
struct loop_op;

/* res: the operation's result; more: a multishot operation will complete again. */
typedef void (*loop_handler)(struct loop_op *op, int res, bool more);

struct loop_op {
	loop_handler handler;
	/* The epoll loop's record of the operation while it waits (io_uring keeps its own). */
	struct loop_op *next;
	uint8_t kind;
	int fd;
	int res;
	unsigned events;
	void *buf;
	size_t n;
	uint64_t deadline_ns;
};

/*
 * The loop's setup (--uring-setup): LOOP_SETUP_AUTO asks io_uring for DEFER_TASKRUN and the
 * taskrun flag (Linux 6.1) and goes without them on older kernels, and on epoll where
 * io_uring is not allowed (EPERM, ENOSYS: a seccomp profile, kernel.io_uring_disabled, a
 * sandbox without it); LOOP_SETUP_BASIC goes without them anyway, so that the older
 * kernels' path can be run on a newer one; LOOP_SETUP_EPOLL goes without io_uring.
 */
enum loop_setup {
	LOOP_SETUP_AUTO,
	LOOP_SETUP_BASIC,
	LOOP_SETUP_EPOLL,
	_LOOP_SETUP_MAX,
	_LOOP_SETUP_INVALID = -EINVAL,
};

const char *loop_setup_to_string(int v);

int loop_new(enum loop_setup setup, struct loop **ret);
/* Whether the loop got DEFER_TASKRUN and the taskrun flag. */
bool loop_deferred(const struct loop *l);
/* What the loop runs on, and why, in a sentence for the log: io_uring (deferred or
 * basic), or epoll (configured, or why io_uring was refused). */
const char *loop_describe(const struct loop *l);
struct loop *loop_free(struct loop *l);

int loop_accept(struct loop *l, struct loop_op *op, int fd);  /* multishot */
int loop_recvmsg(struct loop *l, struct loop_op *op, int fd, struct msghdr *msg);
int loop_sendmsg(struct loop *l, struct loop_op *op, int fd, const struct msghdr *msg);
int loop_read(struct loop *l, struct loop_op *op, int fd, void *buf, unsigned n);
/* Plain stream reads and writes on a socket, for byte protocols with no fds (metrics). */
int loop_recv(struct loop *l, struct loop_op *op, int fd, void *buf, size_t n);
int loop_send(struct loop *l, struct loop_op *op, int fd, const void *buf, size_t n);
/* Completes (once) when fd is ready for one of the poll(2) events; res is what is ready. */
int loop_poll(struct loop *l, struct loop_op *op, int fd, unsigned events);
/* Completes (res 0) on the next turn, after what completed meanwhile: how a handler
 * yields to the others and comes back. */
int loop_nop(struct loop *l, struct loop_op *op);
/* Completes with -ETIME after ms milliseconds. */
int loop_timeout(struct loop *l, struct loop_op *op, uint64_t ms);
/*
 * Completes when *word, a u32 in memory shared with another process, is woken with
 * FUTEX_WAKE (res 0), or at once with -EAGAIN when it does not hold val when the kernel looks.
 * Needs IORING_OP_FUTEX_WAIT (Linux 6.7): see loop_has_futex_wait().
 */
int loop_futex_wait(struct loop *l, struct loop_op *op, uint32_t *word, uint32_t val);
/* Cancels op, which then completes with -ECANCELED (unless it completes first). */
int loop_cancel(struct loop *l, struct loop_op *op);
/* Whether the kernel runs loop_futex_wait(). */
bool loop_has_futex_wait(struct loop *l);

/*
 * Work the loop looks for outside io_uring (the connections' rings, ring.h). With a poller,
 * loop_run() does not sleep as soon as nothing completes: it calls poll() and checks
 * io_uring without waiting, over and over, until spin_ns passed without work; then it calls
 * sleep(userdata, true), which arms whatever must wake the loop and returns false if work
 * came in meanwhile, sleeps in io_uring, and calls sleep(userdata, false) once awake.
 */
struct loop_poller {
	uint64_t spin_ns;                       /* read on every turn: it may change */
	bool (*poll)(void *userdata);           /* returns whether it did any work */
	bool (*sleep)(void *userdata, bool sleeping);
	void *userdata;
};

/* Installs p (NULL: none); p must outlive the loop's use of it. */
void loop_set_poller(struct loop *l, const struct loop_poller *p);

/* Runs until loop_exit(); returns 0 or a negative errno from io_uring itself. */
int loop_run(struct loop *l);
/*
 * One turn of loop_run(): submits what is queued, then runs the handler of every operation
 * that completed, first waiting for one when wait is true. Returns how many handlers ran, or
 * a negative errno from io_uring itself. The daemon only calls loop_run(); the dispatcher's
 * fuzz target (tests/fuzz/fuzz-dispatch.c) turns the loop itself, without waiting.
 */
int loop_turn(struct loop *l, bool wait);
void loop_exit(struct loop *l);
