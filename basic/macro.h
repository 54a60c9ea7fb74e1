/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Small helpers shared by the daemon, the client library and the tools: ownership through
 * __attribute__((cleanup)) in the style of systemd, and overflow-checked arithmetic.
 * Header-only; nothing here allocates or logs.
 */

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define _cleanup_(f) __attribute__((cleanup(f)))
#define _unused_ __attribute__((unused))
#define _printf_(a, b) __attribute__((format(printf, a, b)))
#define _likely_(x) __builtin_expect(!!(x), 1)
#define _unlikely_(x) __builtin_expect(!!(x), 0)

#define ELEMENTSOF(x) (sizeof(x) / sizeof((x)[0]))
/* The struct of type whose member ptr points to (a loop_op embedded in its owner). */
#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define DIV_ROUND_UP(a, b) (((a) + (b) - 1) / (b))
#define ALIGN_TO(x, a) (((x) + (a) - 1) / (a) * (a))

/* Moves ownership out of a variable that has a cleanup attribute. */
#define TAKE_PTR(p)                                                                           \
	({                                                                                    \
		__typeof__(p) _p = (p);                                                       \
		(p) = NULL;                                                                   \
		_p;                                                                           \
	})
#define TAKE_FD(fd)                                                                           \
	({                                                                                    \
		int _fd = (fd);                                                               \
		(fd) = -EBADF;                                                                \
		_fd;                                                                          \
	})

static inline void freep(void *p) {
	free(*(void **)p);
}

/* Closes fd if it is valid and returns -EBADF, so that `fd = safe_close(fd);` resets it. */
static inline int safe_close(int fd) {
	if (fd >= 0) {
		int saved = errno;
		close(fd);
		errno = saved;
	}
	return -EBADF;
}

static inline void closep(int *fd) {
	safe_close(*fd);
}

static inline void fclosep(FILE **f) {
	if (*f)
		fclose(*f);
}

/* Returns 0 and a*b in *ret, or -EOVERFLOW. */
static inline int mul_u64(uint64_t a, uint64_t b, uint64_t *ret) {
	if (__builtin_mul_overflow(a, b, ret))
		return -EOVERFLOW;
	return 0;
}

/* Returns -errno from a libc call that failed with -1/errno (never 0). */
static inline int negative_errno(void) {
	return errno > 0 ? -errno : -EIO;
}
