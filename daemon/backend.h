/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Memory backends behind one ops table. A backend makes chunks: fixed-size pieces of pool
 * memory, each exported as one file descriptor that clients map (a sealed memfd on the
 * host backend, a cuMem allocation exported as a POSIX fd on the CUDA backend) and mapped
 * by the daemon itself so that it can read and move K/V.
 */

#include <stdint.h>

struct backend_chunk {
	int fd;        /* the exportable handle; -EBADF when not created */
	void *addr;    /* the daemon's own mapping */
	uint64_t bytes;
};

struct backend_ops {
	const char *name;
	/* Granularity chunk sizes must be a multiple of. */
	uint64_t (*granularity)(void);
	/* Creates chunk `id` of `bytes` bytes, zero-filled. */
	int (*chunk_create)(uint32_t id, uint64_t bytes, struct backend_chunk *ret);
	/* Zeroes the chunk before it can change owner; returns 0 or -errno. */
	int (*chunk_scrub)(struct backend_chunk *c);
	void (*chunk_destroy)(struct backend_chunk *c);
};

extern const struct backend_ops backend_host_ops;

/* Looks a backend up by name ("host"); "auto" picks the best one available. */
const struct backend_ops *backend_find(const char *name);
