/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "basic/macro.h"
#include "config.h"
#include "tier-file.h"

/* The most one registered buffer may span. */
#define FIXED_MAX (UINT64_C(1) << 30)

/*
 * Opens a file of its own in dir_fd, with flags (O_DIRECT or not): unlinked from the start
 * (O_TMPFILE), so that nobody can open it by a name; where the file system has no
 * O_TMPFILE, created exclusively under a name and unlinked at once.
 */
static int open_unlinked(int dir_fd, int flags) {
	int fd = openat(dir_fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC | flags, 0600);

	if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR))
		return fd;
	(void)unlinkat(dir_fd, TIER_FILE_NAME, 0);
	fd = openat(dir_fd, TIER_FILE_NAME, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | flags,
	            0600);
	if (fd >= 0)
		(void)unlinkat(dir_fd, TIER_FILE_NAME, 0);
	return fd;
}

int tier_file_open(const char *dir, uint32_t n_segs, uint64_t seg_bytes, struct tier_file **ret,
                   const char **ret_what) {
	struct tier_file *f = calloc(1, sizeof(*f));
	_cleanup_(closep) int dir_fd = -EBADF;
	struct stat sb;
	int r;

	*ret_what = "memory";
	if (!f)
		return -ENOMEM;
	f->fd = -EBADF;
	f->seg_bytes = seg_bytes;
	f->n_segs = n_segs;
	*ret_what = "the directory's name";
	if ((size_t)snprintf(f->dir, sizeof(f->dir), "%s", dir) >= sizeof(f->dir)) {
		r = -ENAMETOOLONG;
		goto fail;
	}
	*ret_what = "the directory";
	dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dir_fd < 0 || fstat(dir_fd, &sb) < 0) {
		r = -errno;
		goto fail;
	}
	/* Whoever may write the directory could swap what kvd writes for files of their own. */
	*ret_what = "the directory: it must be kvd's user's or root's, writable by no one else";
	if ((sb.st_uid != geteuid() && sb.st_uid != 0) || (sb.st_mode & (S_IWGRP | S_IWOTH))) {
		r = -EPERM;
		goto fail;
	}
	/* A file an earlier kvd left under the name it once used. */
	(void)unlinkat(dir_fd, TIER_FILE_NAME, 0);
	*ret_what = "creating the file";
	f->fd = open_unlinked(dir_fd, O_DIRECT);
#if KVD_TEST_HOOKS
	if (f->fd >= 0 && getenv("KVD_TEST_TIER_NO_DIRECT")) {
		close(f->fd);
		f->fd = -1;
		errno = EINVAL;
	}
#endif
	f->direct = f->fd >= 0;
	if (f->fd < 0 && errno == EINVAL)
		f->fd = open_unlinked(dir_fd, 0);
	if (f->fd < 0) {
		r = -errno;
		goto fail;
	}
	*ret_what = "the file: it must be kvd's own, with no name";
	if (fstat(f->fd, &sb) < 0 || sb.st_uid != geteuid() || sb.st_nlink != 0) {
		r = -EPERM;
		goto fail;
	}
	*ret_what = "its size";
	if (ftruncate(f->fd, (off_t)((uint64_t)n_segs * seg_bytes)) < 0) {
		r = -errno;
		goto fail;
	}
	*ret_what = "memory";
	f->free_segs = malloc((n_segs ? n_segs : 1) * sizeof(*f->free_segs));
	if (!f->free_segs) {
		r = -ENOMEM;
		goto fail;
	}
	for (uint32_t i = 0; i < n_segs; i++)
		f->free_segs[i] = n_segs - 1 - i;
	f->n_free = n_segs;
	*ret = f;
	return 0;
fail:
	tier_file_close(f);
	return r;
}

struct tier_file *tier_file_close(struct tier_file *f) {
	if (!f)
		return NULL;
	if (f->fd >= 0)
		close(f->fd);
	free(f->free_segs);
	free(f);
	return NULL;
}

struct tier_io {
	struct tier_file *f;
	bool uring, fixed;
	struct io_uring ring;
	unsigned char *host;
	uint64_t host_bytes;
	unsigned char *staging;       /* TIER_IO_DEPTH segments */
	unsigned host_bufs;           /* registered buffers of host, FIXED_MAX each but the last */
	char why[128];
	uint64_t fail_at, count;      /* KVD_TEST_TIER_IO_ERROR */
	uint32_t in_flight;           /* requests submitted, not yet reaped */
	int sync_error;               /* without io_uring: the started batch's result */
};

int tier_io_new(struct tier_file *f, void *host, uint64_t host_bytes, struct tier_io **ret) {
	struct tier_io *io = calloc(1, sizeof(*io));
	struct iovec *iov;
	unsigned n;
	int r;

	if (!io)
		return -ENOMEM;
	io->f = f;
	io->host = host;
	io->host_bytes = host_bytes;
	/* Aligned for O_DIRECT. */
	if (posix_memalign((void **)&io->staging, 4096, TIER_IO_DEPTH * f->seg_bytes) != 0) {
		free(io);
		return -ENOMEM;
	}
#if KVD_TEST_HOOKS
	{
		const char *e = getenv("KVD_TEST_TIER_IO_ERROR");

		io->fail_at = e ? strtoull(e, NULL, 10) : 0;
	}
#endif
	r = io_uring_queue_init(TIER_IO_DEPTH, &io->ring, 0);
	if (r < 0) {
		snprintf(io->why, sizeof(io->why), "pread/pwrite (io_uring: %s)", strerror(-r));
		*ret = io;
		return 0;
	}
	io->uring = true;
	io->host_bufs = (unsigned)DIV_ROUND_UP(host_bytes, FIXED_MAX);
	n = io->host_bufs + 1;
	iov = calloc(n, sizeof(*iov));
	if (!iov) {
		io_uring_queue_exit(&io->ring);
		free(io->staging);
		free(io);
		return -ENOMEM;
	}
	for (unsigned i = 0; i < io->host_bufs; i++)
		iov[i] = (struct iovec){ io->host + (uint64_t)i * FIXED_MAX,
			                 MIN(FIXED_MAX, host_bytes - (uint64_t)i * FIXED_MAX) };
	iov[io->host_bufs] = (struct iovec){ io->staging, TIER_IO_DEPTH * f->seg_bytes };
	/* Pinned, and counted against RLIMIT_MEMLOCK: where that refuses, plain requests. */
	r = io_uring_register_buffers(&io->ring, iov, n);
	free(iov);
	io->fixed = r >= 0;
	if (io->fixed)
		snprintf(io->why, sizeof(io->why), "io_uring, fixed buffers");
	else
		snprintf(io->why, sizeof(io->why), "io_uring (fixed buffers: %s)", strerror(-r));
	*ret = io;
	return 0;
}

struct tier_io *tier_io_free(struct tier_io *io) {
	if (!io)
		return NULL;
	if (io->uring)
		io_uring_queue_exit(&io->ring);
	free(io->staging);
	free(io);
	return NULL;
}

void *tier_io_staging(const struct tier_io *io, uint64_t *ret_bytes) {
	*ret_bytes = TIER_IO_DEPTH * io->f->seg_bytes;
	return io->staging;
}

const char *tier_io_describe(const struct tier_io *io) {
	return io->why;
}

/* Whether the test hook fails this request. */
static bool injected(struct tier_io *io) {
	return io->fail_at && ++io->count == io->fail_at;
}

/* The registered buffer p lies in (p is in the host tier or the staging area). */
static unsigned buf_index(const struct tier_io *io, const unsigned char *p) {
	if (p >= io->host && p < io->host + io->host_bytes)
		return (unsigned)((uint64_t)(p - io->host) / FIXED_MAX);
	return io->host_bufs;
}

/* Queues and submits n (at most TIER_IO_DEPTH) requests of a segment each, addr[i] to or
 * from file segment seg[i]; io->in_flight counts what reap() must wait for. */
static int submit(struct tier_io *io, bool write, unsigned char *const *addr, const uint32_t *seg,
                  uint32_t n) {
	uint64_t len = io->f->seg_bytes;
	uint32_t queued = 0;
	int r;

	for (uint32_t i = 0; i < n; i++) {
		struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
		uint64_t off = (uint64_t)seg[i] * len;

		if (write && io->fixed)
			io_uring_prep_write_fixed(sqe, io->f->fd, addr[i], (unsigned)len, off,
			                          (int)buf_index(io, addr[i]));
		else if (io->fixed)
			io_uring_prep_read_fixed(sqe, io->f->fd, addr[i], (unsigned)len, off,
			                         (int)buf_index(io, addr[i]));
		else if (write)
			io_uring_prep_write(sqe, io->f->fd, addr[i], (unsigned)len, off);
		else
			io_uring_prep_read(sqe, io->f->fd, addr[i], (unsigned)len, off);
	}
	while (queued < n) {
		r = io_uring_submit(&io->ring);
		if (r <= 0)
			return r < 0 ? r : -EIO;
		queued += (uint32_t)r;
		io->in_flight += (uint32_t)r;
	}
	return 0;
}

/* Waits for every request in flight. Returns 0, or the first -errno (a short transfer is
 * -EIO). */
static int reap(struct tier_io *io) {
	int r = 0;

	for (; io->in_flight > 0; io->in_flight--) {
		struct io_uring_cqe *cqe;
		int k = io_uring_wait_cqe(&io->ring, &cqe);

		if (k < 0)
			return k;
		k = cqe->res;
		io_uring_cqe_seen(&io->ring, cqe);
		if (injected(io))
			k = -EIO;
		if (r == 0 && k < 0)
			r = k;
		else if (r == 0 && (uint64_t)k != io->f->seg_bytes)
			r = -EIO;
	}
	return r;
}

/* Without io_uring: n segments, addr[i] to or from file segment seg[i], with pwrite(2) or
 * pread(2), done when it returns. */
static int transfer(struct tier_io *io, bool write, unsigned char *const *addr, const uint32_t *seg,
                    uint32_t n) {
	uint64_t len = io->f->seg_bytes;
	int r = 0;

	for (uint32_t i = 0; i < n && r == 0; i++) {
		off_t off = (off_t)((uint64_t)seg[i] * len);
		ssize_t k = write ? pwrite(io->f->fd, addr[i], len, off) :
		                    pread(io->f->fd, addr[i], len, off);

		if (injected(io))
			r = -EIO;
		else if (k < 0)
			r = -errno;
		else if ((uint64_t)k != len)
			r = -EIO;
	}
	return r;
}

/* Without io_uring there is nothing to overlap: the I/O runs now, and tier_io_finish()
 * says how it went. */
static int start(struct tier_io *io, bool write, unsigned char *const *addr, const uint32_t *seg,
                 uint32_t n) {
	if (!io->uring) {
		io->sync_error = transfer(io, write, addr, seg, n);
		return 0;
	}
	return submit(io, write, addr, seg, n);
}

int tier_io_write_start(struct tier_io *io, unsigned char *const *src, const uint32_t *seg,
                        uint32_t n) {
	if (n > TIER_IO_DEPTH || io->in_flight > 0)
		return -EINVAL;
	return start(io, true, src, seg, n);
}

int tier_io_read_start(struct tier_io *io, const uint32_t *seg, uint32_t n, unsigned half,
                       unsigned char **ret) {
	if (n > TIER_IO_DEPTH / 2 || half > 1 || io->in_flight > 0)
		return -EINVAL;
	for (uint32_t i = 0; i < n; i++)
		ret[i] = io->staging + ((uint64_t)half * (TIER_IO_DEPTH / 2) + i) * io->f->seg_bytes;
	return start(io, false, ret, seg, n);
}

int tier_io_finish(struct tier_io *io) {
	int r;

	if (!io->uring) {
		r = io->sync_error;
		io->sync_error = 0;
		return r;
	}
	return reap(io);
}
