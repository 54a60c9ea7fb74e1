/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The file tier's file and its I/O (tier.h says what goes there and when). One file in the
 * file tier's directory (file-tier-dir; under systemd the unit's CacheDirectory=), which
 * must be kvd's user's or root's and writable by no one else; the file is kvd's, mode
 * 0600, and has no name (O_TMPFILE; where the file system lacks it, made exclusively as
 * TIER_FILE_NAME and unlinked at once), so that no other process can open it, and it is
 * gone when kvd exits, however it exits. It is cut into segments of the host tier's segment
 * size, and sparse, so that it takes disk space only for what is written. What is read
 * back is checked against MACs kept in kvd's memory (mac.h, tier.c).
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

/* The name under which the file is made where O_TMPFILE is missing (and which kvd before
 * 1.9 left in the directory: removed at start). */
#define TIER_FILE_NAME "tier"

struct tier_file {
	int fd;
	bool direct;                  /* O_DIRECT; else buffered */
	char dir[4096];
	uint64_t seg_bytes;
	uint32_t n_segs;
	uint32_t *free_segs;          /* a stack of the free segments' indices */
	uint32_t n_free;
};

/*
 * Creates the file in dir for n_segs segments of seg_bytes (a multiple of 4096). Returns
 * 0, or -errno (the directory, -EPERM for one others may write, the file, or memory), with
 * the failing step in *ret_what.
 */
int tier_file_open(const char *dir, uint32_t n_segs, uint64_t seg_bytes, struct tier_file **ret,
                   const char **ret_what);
/* Closes the file, which goes with it. Returns NULL. */
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

/*
 * A batch of I/O in flight while the caller works on something else, one batch at a time.
 * tier_io_write_start queues writing the n (at most TIER_IO_DEPTH) segments at src[i] (in
 * the host tier) to file segments seg[i]. Reads go in two halves of the staging, so that a
 * recall checks and writes one batch while the next is read: tier_io_read_start queues
 * reading the n (at most TIER_IO_DEPTH / 2) file segments seg[i] into staging half `half`
 * (0 or 1), whose addresses it puts in ret[i]. tier_io_finish waits for the batch. Return
 * 0, or the first -errno (a short read or write is -EIO); a started batch must be
 * finished, even after an error, before its memory is used or the I/O freed.
 */
int tier_io_write_start(struct tier_io *io, unsigned char *const *src, const uint32_t *seg,
                        uint32_t n);
int tier_io_read_start(struct tier_io *io, const uint32_t *seg, uint32_t n, unsigned half,
                       unsigned char **ret);
int tier_io_finish(struct tier_io *io);
