/* SPDX-License-Identifier: MIT */
/*
 * The host backend: chunks are memfds in ordinary memory. Useful on its own for CPU
 * inference, and what every test runs on.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "basic/macro.h"
#include "memfd.h"

static uint64_t host_granularity(void) {
	return (uint64_t)sysconf(_SC_PAGESIZE);
}

static int host_chunk_create(uint32_t id, uint32_t device, uint64_t bytes,
                             struct backend_chunk *ret) {
	char name[32];
	void *addr;
	int fd, r;

	snprintf(name, sizeof(name), "kvd-chunk-%u", id);
	/* Clients get this fd and write through it: that is the point. */
	r = memfd_sealed(name, bytes, 0, &fd, &addr);
	if (r < 0)
		return r;
	/* Huge pages where the kernel gives them to shared memory (docs/operating.md, "Huge
	 * pages"); clients ask the same of their mappings. */
	(void)madvise(addr, bytes, MADV_HUGEPAGE);
	ret->fd = fd;
	ret->addr = addr;
	ret->device = device;
	ret->bytes = bytes;
	return 0;
}

static int host_chunk_adopt(uint32_t id, uint32_t device, int fd, uint64_t bytes,
                            struct backend_chunk *ret) {
	int seals = fcntl(fd, F_GET_SEALS);
	struct stat st;
	void *addr;

	(void)id;
	/* A memfd sealed against resizing, of exactly the chunk size: what chunk_create made.
	 * Anything else could shrink under the daemon's mapping. */
	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size != bytes || seals < 0 ||
	    (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
		return -EINVAL;
	addr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (addr == MAP_FAILED)
		return negative_errno();
	(void)madvise(addr, bytes, MADV_HUGEPAGE);
	*ret = (struct backend_chunk){ .fd = -EBADF, .addr = addr, .bytes = bytes, .device = device };
	return 0;
}

static int host_chunk_scrub(struct backend_chunk *c) {
	/* Punching the whole range both zeroes the chunk and gives its pages back to the
	 * system until the next owner touches them. */
	if (fallocate(c->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)c->bytes) == 0)
		return 0;
	memset(c->addr, 0, c->bytes);
	return 0;
}

static int host_read(uint32_t device, const void *src, void *dst, uint64_t bytes) {
	(void)device;
	memcpy(dst, src, bytes);
	return 0;
}

static int host_read_rows(uint32_t device, const void *src, uint64_t src_pitch, void *dst,
                          uint64_t width, uint64_t rows) {
	(void)device;
	for (uint64_t i = 0; i < rows; i++)
		memcpy((char *)dst + i * width, (const char *)src + i * src_pitch, width);
	return 0;
}

static int host_copy_rows(uint32_t device, void *dst, const void *src, uint64_t pitch,
                          uint64_t width, uint64_t rows) {
	(void)device;
	for (uint64_t i = 0; i < rows; i++)
		memcpy((char *)dst + i * pitch, (const char *)src + i * pitch, width);
	return 0;
}

static int host_write(uint32_t device, void *dst, const void *src, uint64_t bytes) {
	(void)device;
	memcpy(dst, src, bytes);
	return 0;
}

static void host_chunk_destroy(struct backend_chunk *c) {
	if (c->addr)
		munmap(c->addr, c->bytes);
	c->addr = NULL;
	c->fd = safe_close(c->fd);
}

const struct backend_ops backend_host_ops = {
	.name = "host",
	.memory = BACKEND_MEMORY_HOST,
	.host_access = true,
	.granularity = host_granularity,
	.chunk_create = host_chunk_create,
	.chunk_adopt = host_chunk_adopt,
	.chunk_scrub = host_chunk_scrub,
	.read = host_read,
	.read_rows = host_read_rows,
	.write = host_write,
	.copy = host_write,
	.copy_rows = host_copy_rows,
	.chunk_destroy = host_chunk_destroy,
};
