/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The event loop on epoll, for where io_uring is not allowed (container runtimes' default
 * seccomp profiles, kernel.io_uring_disabled, sandboxes that do not implement it): loop.c
 * hands every operation here when loop_new() chose it. Same operations and completions as
 * io_uring's, but no futex waits (loop_has_futex_wait() is false). Single-threaded.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "loop.h"

struct loop_epoll;

int loop_epoll_new(struct loop_epoll **ret);
struct loop_epoll *loop_epoll_free(struct loop_epoll *e);

int loop_epoll_accept(struct loop_epoll *e, struct loop_op *op, int fd);
int loop_epoll_recvmsg(struct loop_epoll *e, struct loop_op *op, int fd, struct msghdr *msg);
int loop_epoll_sendmsg(struct loop_epoll *e, struct loop_op *op, int fd, const struct msghdr *msg);
int loop_epoll_recv(struct loop_epoll *e, struct loop_op *op, int fd, void *buf, size_t n);
int loop_epoll_send(struct loop_epoll *e, struct loop_op *op, int fd, const void *buf, size_t n);
int loop_epoll_read(struct loop_epoll *e, struct loop_op *op, int fd, void *buf, size_t n);
int loop_epoll_poll(struct loop_epoll *e, struct loop_op *op, int fd, unsigned events);
int loop_epoll_nop(struct loop_epoll *e, struct loop_op *op);
int loop_epoll_timeout(struct loop_epoll *e, struct loop_op *op, uint64_t ms);
int loop_epoll_cancel(struct loop_epoll *e, struct loop_op *op);

/* Whether a turn has work without waiting: completions queued, or epoll to update. */
bool loop_epoll_queued(const struct loop_epoll *e);
/* One turn (loop_turn()); stops running handlers once *exit is set. */
int loop_epoll_turn(struct loop_epoll *e, bool wait, const bool *exit);
