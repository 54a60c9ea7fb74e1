/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The file tier's file and its I/O (tier.h says what goes there and when). One file, "tier"
 * in the file tier's directory (file-tier-dir; under systemd the unit's CacheDirectory=),
 * mode 0600, cut into segments of the host tier's segment size. kvd keeps no index of it
 * anywhere but in its own memory, so a file found at start cannot be proven to hold what
 * it held: it is truncated (purged) at every start, and sparse, so that it takes disk space
 * only for what is written.
 *
 * The file is opened with O_DIRECT, so that gigabytes moved through it do not evict the
 * node's page cache; where the file system refuses O_DIRECT (tmpfs before Linux 6.6, some
 * network file systems), buffered (tier_file.direct false; the caller logs it once).
 *
 * The I/O runs on the mover's worker thread (mover.h) through io_uring, with the host
 * tier's mapping and TIER_IO_DEPTH staging segments (what reads land in) registered as
 * fixed buffers, a segment per request and up to TIER_IO_DEPTH in flight (half of that for
 * reads, which overlap with writing what the batch before brought into the pool); where io_uring or the registration is not allowed
 * (seccomp filters, RLIMIT_MEMLOCK), with plain requests, or pread(2)/pwrite(2), which
 * tier_io_describe() says.
 *
 * Test hooks (builds with -Dtest_hooks=true): with KVD_TEST_TIER_IO_ERROR=N in the
 * environment, the N-th segment read or written (from 1) fails with EIO; with
 * KVD_TEST_TIER_NO_DIRECT, the file is opened as if its file system refused O_DIRECT.
 */

#include <stdbool.h>
#include <stdint.h>

/* Segment requests in flight at once. */
#define TIER_IO_DEPTH 16u

struct tier_file {
	int fd;
	bool direct;                  /* O_DIRECT; else buffered */
	char path[4096];
	uint64_t seg_bytes;
	uint32_t n_segs;
	uint32_t *free_segs;          /* a stack of the free segments' indices */
	uint32_t n_free;
};

/*
 * Creates (or truncates) dir/tier for n_segs segments of seg_bytes (a multiple of 4096).
 * Returns 0, or -errno (the directory, the file, or memory), with the failing step in
 * *ret_what.
 */
int tier_file_open(const char *dir, uint32_t n_segs, uint64_t seg_bytes, struct tier_file **ret,
                   const char **ret_what);
/* Closes and removes the file. Returns NULL. */
struct tier_file *tier_file_close(struct tier_file *f);

struct tier_io;

/*
 * The worker's I/O on f, with [host, host + host_bytes) (the host tier's mapping: the
 * source of writes) registered where it can be. Returns 0 or -ENOMEM; it works whatever
 * io_uring allows.
 */
int tier_io_new(struct tier_file *f, void *host, uint64_t host_bytes, struct tier_io **ret);
struct tier_io *tier_io_free(struct tier_io *io);

/* The staging segments reads land in (TIER_IO_DEPTH of the file's segment size), for a
 * backend that pins them (backend.h, host_register). */
void *tier_io_staging(const struct tier_io *io, uint64_t *ret_bytes);

/* "io_uring, fixed buffers", "io_uring", or "pread/pwrite" (why), for the log. */
const char *tier_io_describe(const struct tier_io *io);

/* Writes the n segments at src[i] (in the host tier) to file segments seg[i]. Returns 0,
 * or the first -errno (a short write is -EIO). */
int tier_io_write(struct tier_io *io, unsigned char *const *src, const uint32_t *seg, uint32_t n);

/*
 * Reads in two halves of the staging, so that a recall checks and writes one batch while
 * the next is read: tier_io_read_start queues reading the n (at most TIER_IO_DEPTH / 2)
 * file segments seg[i] into staging half `half` (0 or 1), whose addresses it puts in
 * ret[i]; tier_io_read_finish waits for that batch (one at a time in flight). Return 0, or
 * the first -errno (a short read is -EIO); a started batch must be finished, even after an
 * error, before its half is used or the I/O freed.
 */
int tier_io_read_start(struct tier_io *io, const uint32_t *seg, uint32_t n, unsigned half,
                       unsigned char **ret);
int tier_io_read_finish(struct tier_io *io);
