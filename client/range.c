/* SPDX-License-Identifier: MIT */
/* libkvd's address range for a host pool; see range.h. */

#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "basic/macro.h"
#include "range.h"

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define HUGE_PAGE_BYTES (UINT64_C(2) << 20)

struct client_range {
	char *base;
	uint64_t bytes, chunk_bytes;
};

/* PROT_NONE memory at addr (MAP_FIXED: over what is there) or anywhere (NULL), never
 * inherited by fork() children, like the chunks. */
static void *reserve(void *addr, uint64_t bytes) {
	void *p = mmap(addr, bytes, PROT_NONE,
	               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (addr ? MAP_FIXED : 0), -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	/* Flags that differ from the neighbours' would keep the kernel from merging them. */
	(void)madvise(p, bytes, MADV_DONTFORK);
	return p;
}

int client_range_new(uint64_t pool_bytes, uint64_t chunk_bytes, struct client_range **ret) {
	_cleanup_(freep) struct client_range *r = NULL;
	char *raw;

	if (chunk_bytes == 0 || pool_bytes == 0 || pool_bytes % chunk_bytes != 0 ||
	    pool_bytes > CLIENT_RANGE_MAX)
		return -EINVAL;
	r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	/* Aligned for huge pages, so that a chunk of a multiple of their size is mapped with
	 * them where the kernel gives them to shared memory (docs/operating.md, "Huge
	 * pages"): then unmapping a chunk, and each access, walks 512 times fewer entries. */
	raw = reserve(NULL, pool_bytes + HUGE_PAGE_BYTES);
	if (!raw)
		return -ENOMEM;
	r->base = (char *)ALIGN_TO((uintptr_t)raw, HUGE_PAGE_BYTES);
	if (r->base > raw)
		munmap(raw, (size_t)(r->base - raw));
	munmap(r->base + pool_bytes, (size_t)(raw + HUGE_PAGE_BYTES - r->base));
	r->bytes = pool_bytes;
	r->chunk_bytes = chunk_bytes;
	*ret = TAKE_PTR(r);
	return 0;
}

struct client_range *client_range_free(struct client_range *r, bool child) {
	if (!r)
		return NULL;
	if (!child)
		munmap(r->base, r->bytes);
	free(r);
	return NULL;
}

void *client_range_base(const struct client_range *r) {
	return r->base;
}

int client_range_map(struct client_range *r, uint32_t id, int fd, uint64_t bytes, bool hole,
                     void **ret_addr) {
	char *want;
	void *p;

	if (bytes != r->chunk_bytes || id >= r->bytes / r->chunk_bytes)
		return -EPROTO;
	want = r->base + (uint64_t)id * r->chunk_bytes;
	p = mmap(want, bytes, PROT_READ | PROT_WRITE,
	         MAP_SHARED | (hole ? MAP_FIXED_NOREPLACE : MAP_FIXED), fd, 0);
	/* A hole someone else took (or a kernel without MAP_FIXED_NOREPLACE, which takes
	 * the address as a hint): anywhere is still a mapping. */
	if (hole && p != MAP_FAILED && p != want) {
		munmap(p, bytes);
		p = MAP_FAILED;
		errno = EEXIST;
	}
	if (hole && p == MAP_FAILED && errno == EEXIST)
		p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		int k = negative_errno();

		/* A failed MAP_FIXED may have removed the reservation already. */
		if (!hole)
			(void)reserve(want, bytes);
		return k;
	}
	/* Only a hint: kernels where shared memory has no huge pages ignore it. */
	(void)madvise(p, bytes, MADV_HUGEPAGE);
	/* KV memory must not leak into fork() children (see kvd.h). */
	if (madvise(p, bytes, MADV_DONTFORK) < 0) {
		int k = negative_errno();

		(void)client_range_unmap(r, p, bytes);
		return k;
	}
	*ret_addr = p;
	return 0;
}

bool client_range_unmap(struct client_range *r, void *addr, uint64_t bytes) {
	char *p = addr;

	if (p < r->base || p >= r->base + r->bytes) {
		munmap(addr, bytes);
		return true;
	}
	if (reserve(addr, bytes))
		return true;
	munmap(addr, bytes);
	return false;
}
