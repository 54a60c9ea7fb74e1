/* SPDX-License-Identifier: MIT */
/*
 * The pool on the real host backend (memfd chunks), model validation, and sequences grown
 * from the pool: accounting of chunks and blocks, the budget and tenant caps, reclaiming
 * and draining chunks, scrubbing, and the all-or-nothing contract of seq_grow().
 */

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "model.h"
#include "pool.h"
#include "seq.h"
#include "tenant.h"
#include "test.h"

static uint64_t page;

int test_setup(void) {
	page = (uint64_t)sysconf(_SC_PAGESIZE);
	return page > 0 ? 0 : -EINVAL;
}

/* A pool of n chunks of chunk bytes, a budget of budget chunks, and two tenants. */
struct fixture {
	struct pool *p;
	struct tenant_table tt;
	struct tenant *a, *b;
	struct seq_emptied emptied;
};

static void fixture_init(struct fixture *f, uint64_t chunk, uint32_t n, uint32_t budget) {
	ASSERT_OK(pool_new(&backend_host_ops, 1, chunk * n, chunk, chunk * budget, &f->p));
	ASSERT_OK(tenant_table_init(&f->tt, 4));
	ASSERT_OK(tenant_get(&f->tt, "a", &f->a));
	ASSERT_OK(tenant_get(&f->tt, "b", &f->b));
	f->emptied.chunks = calloc(n, sizeof(*f->emptied.chunks));
	ASSERT_NOT_NULL(f->emptied.chunks);
	f->emptied.n = 0;
}

static void fixture_done(struct fixture *f) {
	pool_free(f->p);
	tenant_table_done(&f->tt);
	free(f->emptied.chunks);
}

/* Reclaims every chunk in f->emptied, expecting none to have a holder. */
static void reclaim_emptied(struct fixture *f) {
	for (uint32_t i = 0; i < f->emptied.n; i++)
		ASSERT_EQ(pool_chunk_reclaim(f->p, f->emptied.chunks[i]), 0u);
	f->emptied.n = 0;
}

static struct kvd_block_ref ref_of(const struct chunk *c, uint32_t index) {
	return (struct kvd_block_ref){ .chunk_id = c->id, .index = index };
}

static int all_bytes(const void *p, uint8_t v, size_t n) {
	const uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		if (b[i] != v)
			return 0;
	return 1;
}

TEST(pool_new_checks) {
	struct pool *p = NULL;

	ASSERT_ERRNO(pool_new(&backend_host_ops, 1, 64 * page, 0, 64 * page, &p), -EINVAL);
	ASSERT_ERRNO(pool_new(&backend_host_ops, 1, 64 * page, page + 1, 64 * page, &p), -EINVAL);
	ASSERT_ERRNO(pool_new(&backend_host_ops, 1, 64 * page, page / 2, 64 * page, &p), -EINVAL);
	/* The pool must hold at least one chunk. */
	ASSERT_ERRNO(pool_new(&backend_host_ops, 1, 4 * page - 1, 4 * page, 0, &p), -EINVAL);
	/* The budget cannot promise more than there is. */
	ASSERT_ERRNO(pool_new(&backend_host_ops, 1, 8 * page, 4 * page, 8 * page + 1, &p), -EINVAL);
	ASSERT_NULL(p);

	/* An uneven pool size keeps whole chunks only, and the budget follows. */
	ASSERT_OK(pool_new(&backend_host_ops, 1, 10 * page, 4 * page, 10 * page, &p));
	ASSERT_EQ(p->n_chunks, 2u);
	ASSERT_EQ(p->pool_bytes, 8 * page);
	ASSERT_EQ(p->budget_bytes, 8 * page);
	ASSERT_EQ(p->chunks_free, 2u);
	ASSERT_EQ(p->used_bytes, 0u);
	ASSERT_EQ(p->block_bytes, 0u);
	ASSERT_EQ(pool_chunk(p, 0)->state, CHUNK_FREE);
	ASSERT_NULL(pool_chunk(p, 2));
	/* No memory is made before it is used. */
	ASSERT_LT(pool_chunk(p, 0)->mem.fd, 0);
	ASSERT_ERRNO(pool_set_budget(p, 8 * page + 1), -EINVAL);
	ASSERT_EQ(p->budget_bytes, 8 * page);
	pool_free(p);

	ASSERT_OK(pool_new(&backend_host_ops, 1, 4 * page, 4 * page, 0, &p));
	ASSERT_EQ(p->n_chunks, 1u);
	ASSERT_EQ(p->budget_bytes, 0u);
	ASSERT_NULL(pool_free(p));
	ASSERT_NULL(pool_free(NULL));

	/* Devices: 1 to BACKEND_DEVICES_MAX, the budget up to all of them. */
	ASSERT_ERRNO(pool_new(&backend_host_ops, 0, 8 * page, 4 * page, 0, &p), -EINVAL);
	ASSERT_ERRNO(pool_new(&backend_host_ops, BACKEND_DEVICES_MAX + 1, 8 * page, 4 * page, 0, &p),
	             -EINVAL);
	ASSERT_ERRNO(pool_new(&backend_host_ops, 3, 8 * page, 4 * page, 24 * page + 1, &p), -EINVAL);
	ASSERT_OK(pool_new(&backend_host_ops, 3, 10 * page, 4 * page, 24 * page, &p));
	ASSERT_EQ(p->n_chunks, 6u);
	ASSERT_EQ(p->device_chunks, 2u);
	ASSERT_EQ(p->pool_bytes, 24 * page);
	ASSERT_EQ(p->budget_bytes, 24 * page);
	for (uint32_t i = 0; i < 6; i++)
		ASSERT_EQ(pool_chunk(p, i)->mem.device, i / 2);
	pool_free(p);
}

/* Each device's chunks serve only its blocks: one device full refuses its grants while
 * the others still grant, and chunks given back return to their own device. */
TEST(devices_keep_their_chunks) {
	struct chunk *c[4], *x;
	uint32_t idx[4], ix;
	struct pool *p;
	struct tenant_table tt;
	struct tenant *a;

	ASSERT_OK(pool_new(&backend_host_ops, 2, 8 * page, 4 * page, 16 * page, &p));
	ASSERT_OK(tenant_table_init(&tt, 4));
	ASSERT_OK(tenant_get(&tt, "a", &a));
	/* Blocks of a whole chunk each: two per device. */
	for (uint32_t i = 0; i < 2; i++) {
		ASSERT_OK(pool_block_alloc(p, a, 1, 4 * page, &c[i], &idx[i]));
		ASSERT_EQ(c[i]->mem.device, 1u);
		ASSERT_TRUE(c[i]->id >= 2);
	}
	ASSERT_ERRNO(pool_block_alloc(p, a, 1, 4 * page, &x, &ix), -ENOSPC);
	ASSERT_EQ(p->refused[POOL_REFUSED_POOL], 1u);
	ASSERT_ERRNO(pool_block_alloc(p, a, 2, 4 * page, &x, &ix), -EINVAL);
	for (uint32_t i = 2; i < 4; i++) {
		ASSERT_OK(pool_block_alloc(p, a, 0, 4 * page, &c[i], &idx[i]));
		ASSERT_EQ(c[i]->mem.device, 0u);
		ASSERT_TRUE(c[i]->id < 2);
	}
	ASSERT_EQ(p->used_bytes, 16 * page);
	/* A chunk of device 1 comes back: device 1 grants again, device 0 still cannot. */
	ASSERT_TRUE(pool_block_free(p, c[0], idx[0]));
	ASSERT_EQ(pool_chunk_reclaim(p, c[0]), 0u);
	ASSERT_ERRNO(pool_block_alloc(p, a, 0, 4 * page, &x, &ix), -ENOSPC);
	ASSERT_OK(pool_block_alloc(p, a, 1, 4 * page, &x, &ix));
	ASSERT_EQ(x, c[0]);
	pool_free(p);
	tenant_table_done(&tt);
}

TEST(block_alloc_accounting) {
	const uint64_t chunk = 16 * page;
	struct fixture f;
	struct chunk *c[3];
	uint32_t idx[3];

	fixture_init(&f, chunk, 4, 4);
	for (int i = 0; i < 3; i++)
		ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1000, &c[i], &idx[i]));
	/* Whole chunks in use, blocks as granted. */
	ASSERT_EQ(f.p->used_bytes, chunk);
	ASSERT_EQ(f.p->block_bytes, 3000u);
	ASSERT_EQ(f.p->chunks_free, 3u);
	ASSERT_EQ(f.a->used_bytes, chunk);
	ASSERT_EQ(f.a->block_bytes, 3000u);
	ASSERT_EQ(f.a->chunks, 1u);
	ASSERT_EQ(f.b->used_bytes, 0u);
	ASSERT_EQ(f.b->chunks, 0u);
	ASSERT_TRUE(c[0] == c[1] && c[1] == c[2]);
	ASSERT_EQ(c[0]->state, CHUNK_OWNED);
	ASSERT_TRUE(c[0]->owner == f.a);
	ASSERT_EQ(c[0]->used_blocks, 3u);
	ASSERT_GE(c[0]->mem.fd, 0);
	ASSERT_EQ(c[0]->mem.bytes, chunk);

	/* Another tenant never shares a chunk. */
	{
		struct chunk *cb;
		uint32_t ib;

		ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1000, &cb, &ib));
		ASSERT_TRUE(cb != c[0]);
		ASSERT_EQ(f.b->used_bytes, chunk);
		ASSERT_EQ(f.b->block_bytes, 1000u);
		ASSERT_EQ(f.p->used_bytes, 2 * chunk);
		ASSERT_EQ(f.p->block_bytes, 4000u);
		ASSERT_TRUE(pool_block_free(f.p, cb, ib));
		ASSERT_EQ(pool_chunk_reclaim(f.p, cb), 0u);
		ASSERT_EQ(f.b->used_bytes, 0u);
		ASSERT_EQ(f.b->block_bytes, 0u);
	}

	/* Freeing a block that is not the last one keeps the chunk. */
	ASSERT_FALSE(pool_block_free(f.p, c[1], idx[1]));
	ASSERT_EQ(f.p->block_bytes, 2000u);
	ASSERT_EQ(f.a->block_bytes, 2000u);
	ASSERT_EQ(f.p->used_bytes, chunk);
	ASSERT_FALSE(pool_block_free(f.p, c[0], idx[0]));
	ASSERT_TRUE(pool_block_free(f.p, c[2], idx[2]));
	ASSERT_EQ(f.p->block_bytes, 0u);
	/* Empty but not reclaimed yet: still charged. */
	ASSERT_EQ(f.p->used_bytes, chunk);
	ASSERT_EQ(pool_chunk_reclaim(f.p, c[0]), 0u);
	ASSERT_EQ(f.p->used_bytes, 0u);
	ASSERT_EQ(f.p->chunks_free, 4u);
	ASSERT_EQ(f.a->used_bytes, 0u);
	ASSERT_EQ(f.a->chunks, 0u);
	ASSERT_EQ(c[0]->state, CHUNK_FREE);
	ASSERT_NULL(c[0]->owner);
	fixture_done(&f);
}

TEST(blocks_of_a_chunk_are_distinct) {
	const uint64_t chunk = 16 * page, bsz = 3000, stride = ALIGN_TO(bsz, LAYOUT_BLOCK_ALIGN);
	const uint32_t per = chunk / stride;
	struct fixture f;
	struct chunk *c0 = NULL, *c;
	uint8_t *seen;
	uint32_t idx;

	fixture_init(&f, chunk, 4, 4);
	seen = calloc(per, 1);
	ASSERT_NOT_NULL(seen);
	for (uint32_t i = 0; i < per; i++) {
		char *addr;

		ASSERT_OK(pool_block_alloc(f.p, f.a, 0, bsz, &c, &idx));
		if (!c0)
			c0 = c;
		ASSERT_TRUE(c == c0);
		ASSERT_LT(idx, per);
		ASSERT_FALSE(seen[idx]);
		seen[idx] = 1;
		addr = pool_block_addr(f.p, ref_of(c, idx));
		ASSERT_NOT_NULL(addr);
		/* Inside the chunk, aligned, and with room for the whole block. */
		ASSERT_EQ((uintptr_t)addr % LAYOUT_BLOCK_ALIGN, 0u);
		ASSERT_GE(addr, (char *)c->mem.addr);
		ASSERT_LE(addr + bsz, (char *)c->mem.addr + chunk);
		ASSERT_EQ((uint64_t)(addr - (char *)c->mem.addr), (uint64_t)idx * stride);
		/* Blocks do not overlap: each gets its own pattern, checked below. */
		memset(addr, (int)(idx + 1), bsz);
	}
	ASSERT_EQ(c0->n_blocks, per);
	ASSERT_EQ(c0->used_blocks, per);
	for (uint32_t i = 0; i < per; i++)
		ASSERT_TRUE(all_bytes(pool_block_addr(f.p, ref_of(c0, i)), (uint8_t)(i + 1), bsz));

	/* The chunk is full: the next block takes a new one. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, bsz, &c, &idx));
	ASSERT_TRUE(c != c0);
	ASSERT_EQ(f.a->chunks, 2u);
	ASSERT_TRUE(pool_block_free(f.p, c, idx));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);

	/* A freed block is the next one handed out, from the full chunk again. */
	ASSERT_FALSE(pool_block_free(f.p, c0, per / 2));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, bsz, &c, &idx));
	ASSERT_TRUE(c == c0);
	ASSERT_EQ(idx, per / 2);
	free(seen);
	fixture_done(&f);
}

/* Many blocks per chunk: the bitmap spans several words. */
TEST(bitmap_reuses_lowest_free_block) {
	const uint64_t chunk = 16 * page;
	const uint32_t per = chunk / 64;
	struct fixture f;
	struct chunk *c, *c0 = NULL;
	uint32_t idx;

	fixture_init(&f, chunk, 2, 2);
	for (uint32_t i = 0; i < per; i++) {
		ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 64, &c, &idx));
		if (!c0)
			c0 = c;
		ASSERT_TRUE(c == c0);
		ASSERT_EQ(idx, i);
	}
	ASSERT_FALSE(pool_block_free(f.p, c0, per - 3));
	ASSERT_FALSE(pool_block_free(f.p, c0, 70));
	ASSERT_FALSE(pool_block_free(f.p, c0, 5));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 64, &c, &idx));
	ASSERT_EQ(idx, 5u);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 64, &c, &idx));
	ASSERT_EQ(idx, 70u);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 64, &c, &idx));
	ASSERT_EQ(idx, per - 3);
	ASSERT_TRUE(c == c0);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 64, &c, &idx));
	ASSERT_TRUE(c != c0);
	ASSERT_EQ(idx, 0u);
	fixture_done(&f);
}

TEST(block_sizes_get_their_own_chunks) {
	const uint64_t chunk = 16 * page;
	struct fixture f;
	struct chunk *c1, *c2, *c3;
	uint32_t i1, i2, i3;

	fixture_init(&f, chunk, 4, 4);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c1, &i1));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 2048, &c2, &i2));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c3, &i3));
	ASSERT_TRUE(c1 != c2);
	ASSERT_TRUE(c3 == c1);
	ASSERT_NE(i3, i1);
	ASSERT_EQ(c1->block_bytes, 1024u);
	ASSERT_EQ(c2->block_bytes, 2048u);
	ASSERT_EQ(c2->n_blocks, chunk / 2048);
	ASSERT_EQ(f.p->used_bytes, 2 * chunk);
	ASSERT_EQ(f.p->block_bytes, 4096u);
	ASSERT_EQ(f.a->chunks, 2u);
	fixture_done(&f);
}

TEST(budget_refuses) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c1, *c2, *c;
	uint32_t i1, i2, idx;

	fixture_init(&f, chunk, 4, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c1, &i1));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &c2, &i2));
	ASSERT_EQ(f.p->grants_refused, 0u);
	/* Two chunks are free in the pool, but the budget is spent. */
	ASSERT_ERRNO(pool_block_alloc(f.p, f.a, 0, 2048, &c, &idx), -ENOSPC);
	ASSERT_EQ(f.p->grants_refused, 1u);
	ASSERT_EQ(f.p->chunks_free, 2u);
	ASSERT_EQ(f.p->used_bytes, 2 * chunk);
	ASSERT_EQ(f.p->block_bytes, 2048u);
	ASSERT_EQ(f.a->used_bytes, chunk);
	ASSERT_EQ(f.a->block_bytes, 1024u);
	/* Blocks in chunks already held need no budget. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &idx));
	ASSERT_TRUE(c == c1);
	ASSERT_EQ(f.p->grants_refused, 1u);

	/* Raised to the pool: every chunk, then the pool itself is exhausted. */
	ASSERT_OK(pool_set_budget(f.p, 4 * chunk));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 2048, &c, &idx));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 4096, &c, &idx));
	ASSERT_EQ(f.p->chunks_free, 0u);
	ASSERT_ERRNO(pool_block_alloc(f.p, f.b, 0, 4096, &c, &idx), -ENOSPC);
	ASSERT_EQ(f.p->grants_refused, 2u);
	fixture_done(&f);
}

TEST(budget_lowered_below_use) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c1, *c2, *c;
	uint32_t i1, i2, idx;

	fixture_init(&f, chunk, 4, 4);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c1, &i1));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 2048, &c2, &i2));
	ASSERT_OK(pool_set_budget(f.p, chunk));
	ASSERT_EQ(f.p->budget_bytes, chunk);
	/* Nothing is taken away, but no new chunk is handed out. */
	ASSERT_EQ(f.p->used_bytes, 2 * chunk);
	ASSERT_ERRNO(pool_block_alloc(f.p, f.b, 0, 1024, &c, &idx), -ENOSPC);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 2048, &c, &idx));
	ASSERT_TRUE(c == c2);
	/* Giving one chunk back is not enough yet: use equals the budget. */
	ASSERT_TRUE(pool_block_free(f.p, c1, i1));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c1), 0u);
	ASSERT_ERRNO(pool_block_alloc(f.p, f.b, 0, 1024, &c, &idx), -ENOSPC);
	ASSERT_OK(pool_set_budget(f.p, 2 * chunk));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &c, &idx));
	ASSERT_EQ(f.p->grants_refused, 2u);
	fixture_done(&f);
}

TEST(tenant_max_refuses) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c;
	uint32_t idx;

	fixture_init(&f, chunk, 4, 4);
	f.a->max_bytes = chunk;
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &idx));
	ASSERT_ERRNO(pool_block_alloc(f.p, f.a, 0, 2048, &c, &idx), -EDQUOT);
	ASSERT_EQ(f.p->grants_refused, 1u);
	ASSERT_EQ(f.a->used_bytes, chunk);
	ASSERT_EQ(f.a->chunks, 1u);
	ASSERT_EQ(f.p->used_bytes, chunk);
	/* Its own chunk still serves it, and others are not limited by its cap. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &idx));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 2048, &c, &idx));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 4096, &c, &idx));
	/* A cap below one chunk refuses everything. */
	f.b->max_bytes = chunk - 1;
	ASSERT_ERRNO(pool_block_alloc(f.p, f.b, 0, 64, &c, &idx), -EDQUOT);
	ASSERT_EQ(f.p->grants_refused, 2u);
	fixture_done(&f);
}

/* Reclaimed at once, scrubbed when its owner takes it again (not on the way back: a
 * release that empties many chunks must not wait for all of them). */
TEST(reclaim_without_holder_scrubs_on_reuse) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c, *c2;
	uint32_t i1, i2;

	fixture_init(&f, chunk, 2, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i1));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i2));
	/* Through the daemon's mapping: the whole chunk, not only the blocks. */
	memset(c->mem.addr, 0xab, chunk);
	ASSERT_FALSE(pool_block_free(f.p, c, i1));
	ASSERT_TRUE(pool_block_free(f.p, c, i2));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_EQ(c->state, CHUNK_FREE);
	ASSERT_EQ(f.p->chunks_free, 2u);
	ASSERT_EQ(f.p->used_bytes, 0u);
	ASSERT_EQ(f.a->used_bytes, 0u);
	ASSERT_TRUE(c->dirty);
	ASSERT_TRUE(all_bytes(c->mem.addr, 0xab, chunk));

	/* Its owner gets it back, and reads zeros in all of it. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c2, &i1));
	ASSERT_TRUE(c2 == c);
	ASSERT_FALSE(c->dirty);
	ASSERT_TRUE(all_bytes(c->mem.addr, 0, chunk));
	fixture_done(&f);
}

/* A dirty chunk that goes to another tenant is scrubbed before its memory is dropped, so
 * that a mapping its last owner kept holds nothing of it. */
TEST(renewed_dirty_chunk_scrubbed_before_drop) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c, *c2;
	uint32_t i;
	char *kept;

	fixture_init(&f, chunk, 1, 1);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i));
	memset(c->mem.addr, 0xab, chunk);
	kept = mmap(NULL, chunk, PROT_READ, MAP_SHARED, c->mem.fd, 0);
	ASSERT_TRUE(kept != MAP_FAILED);
	ASSERT_TRUE(pool_block_free(f.p, c, i));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_TRUE(all_bytes(kept, 0xab, chunk));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &c2, &i));
	ASSERT_TRUE(c2 == c);
	ASSERT_TRUE(all_bytes(kept, 0, chunk));
	munmap(kept, chunk);
	fixture_done(&f);
}

static ino_t inode_of(int fd) {
	struct stat st;

	ASSERT_OK(fstat(fd, &st));
	return st.st_ino;
}

/*
 * A chunk's memory object serves one tenant only (pool.h, "Isolation"): freed, it comes
 * back to its tenant as it is; another tenant gets a chunk without memory first, and then
 * a new memory object in its place, never the old one, which its old holders may still map.
 */
TEST(freed_memory_stays_its_tenants) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c, *x, *y;
	uint32_t i, j;
	ino_t ino_a;
	int kept_fd;
	uint8_t *kept;

	fixture_init(&f, chunk, 2, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i));
	ASSERT_EQ(c->id, 0u);
	ino_a = inode_of(c->mem.fd);
	/* What a hostile holder of a keeps: its own fd and mapping of the memfd. */
	kept_fd = fcntl(c->mem.fd, F_DUPFD_CLOEXEC, 3);
	ASSERT_GE(kept_fd, 0);
	kept = mmap(NULL, chunk, PROT_READ | PROT_WRITE, MAP_SHARED, kept_fd, 0);
	ASSERT_TRUE(kept != MAP_FAILED);
	memset(kept, 0xab, chunk);
	ASSERT_TRUE(pool_block_free(f.p, c, i));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_TRUE(c->last_owner == f.a);
	ASSERT_TRUE(f.a->free_chunks[0] == c);

	/* b: the chunk without memory, not a's. */
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &x, &j));
	ASSERT_EQ(x->id, 1u);
	/* a: its own, the same memory object, scrubbed. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &y, &i));
	ASSERT_TRUE(y == c);
	ASSERT_EQ(inode_of(y->mem.fd), ino_a);
	ASSERT_TRUE(all_bytes(c->mem.addr, 0, chunk));
	ASSERT_EQ(f.p->grants_own, 1u);
	ASSERT_EQ(f.p->grants_renewed, 0u);

	/* Both free again; then b takes both: a's chunk as a new memory object. */
	ASSERT_TRUE(pool_block_free(f.p, x, j));
	ASSERT_EQ(pool_chunk_reclaim(f.p, x), 0u);
	ASSERT_TRUE(pool_block_free(f.p, y, i));
	ASSERT_EQ(pool_chunk_reclaim(f.p, y), 0u);
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &x, &j));
	ASSERT_EQ(x->id, 1u); /* its own first */
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 2048, &y, &j));
	ASSERT_TRUE(y == c);
	ASSERT_TRUE(y->last_owner == f.b);
	ASSERT_NE(inode_of(y->mem.fd), ino_a);
	ASSERT_EQ(f.p->grants_renewed, 1u);
	ASSERT_TRUE(f.a->free_chunks[0] == NULL);
	/* b's bytes and a's kept memory never meet, either way. */
	memset(y->mem.addr, 0x5a, chunk);
	ASSERT_TRUE(all_bytes(kept, 0, chunk));
	memset(kept, 0xcd, chunk);
	ASSERT_EQ(pwrite(kept_fd, "x", 1, 0), 1);
	ASSERT_TRUE(all_bytes(y->mem.addr, 0x5a, chunk));
	ASSERT_OK(munmap(kept, chunk));
	safe_close(kept_fd);
	fixture_done(&f);
}

/* A tenant that goes away takes its free chunks' memory with it. */
TEST(forgotten_tenant_leaves_no_memory) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c;
	uint32_t i;

	fixture_init(&f, chunk, 2, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i));
	ASSERT_TRUE(pool_block_free(f.p, c, i));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_GE(c->mem.fd, 0);
	ASSERT_EQ(pool_forget_tenant(f.p, f.b), 0u);
	ASSERT_EQ(pool_forget_tenant(f.p, f.a), 1u);
	ASSERT_LT(c->mem.fd, 0);
	ASSERT_NULL(c->last_owner);
	ASSERT_NULL(f.a->free_chunks[0]);
	ASSERT_EQ(f.p->chunks_free, 2u);
	/* Without memory, it is first on the free list again (lowest id). */
	ASSERT_TRUE(f.p->free_list[0] == c);
	fixture_done(&f);
}

/* Whether addr..addr+n is mapped in this process (mincore fails with ENOMEM where not). */
static bool mapped(const void *addr, size_t n) {
	unsigned char vec[64];

	return n / page <= sizeof(vec) && mincore((void *)addr, n, vec) == 0;
}

/* While a round's worker may read blocks at its snapshot's addresses, memory a chunk gives
 * up (renewed for another tenant, or its tenant forgotten) stays mapped until the round
 * ends; the chunk itself gets new memory at once. */
TEST(memory_kept_while_a_round_reads) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c, *x, *y;
	const uint8_t *old;
	uint32_t i, j;

	fixture_init(&f, chunk, 2, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i));
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 1024, &x, &j));
	old = c->mem.addr;
	pool_readers_begin(f.p);
	/* a releases during the round; b takes a's chunk: a new memory object. */
	ASSERT_TRUE(pool_block_free(f.p, c, i));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_OK(pool_block_alloc(f.p, f.b, 0, 2048, &y, &j));
	ASSERT_TRUE(y == c);
	ASSERT_EQ(f.p->grants_renewed, 1u);
	ASSERT_TRUE(y->mem.addr != old);
	ASSERT_EQ(f.p->n_kept, 1u);
	/* What the worker would read: a's old, scrubbed memory, still mapped. */
	ASSERT_TRUE(mapped(old, chunk));
	ASSERT_TRUE(all_bytes(old, 0, chunk));
	/* Nested readers keep it until the last one ends. */
	pool_readers_begin(f.p);
	pool_readers_end(f.p);
	ASSERT_TRUE(mapped(old, chunk));
	pool_readers_end(f.p);
	ASSERT_EQ(f.p->n_kept, 0u);
	ASSERT_FALSE(mapped(old, chunk));

	/* Without a round, memory goes at once. */
	old = x->mem.addr;
	ASSERT_TRUE(pool_block_free(f.p, x, 0));
	ASSERT_EQ(pool_chunk_reclaim(f.p, x), 0u);
	ASSERT_EQ(pool_forget_tenant(f.p, f.b), 1u);
	ASSERT_FALSE(mapped(old, chunk));
	fixture_done(&f);
}

TEST(reclaim_with_holders_drains) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c, *c2, *x;
	uint32_t idx, i2, ix;

	fixture_init(&f, chunk, 4, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &idx));
	ASSERT_OK(chunk_add_holder(c, 1));
	ASSERT_OK(chunk_add_holder(c, 2));
	ASSERT_TRUE(chunk_has_holder(c, 1));
	ASSERT_TRUE(chunk_has_holder(c, 2));
	ASSERT_FALSE(chunk_has_holder(c, 3));
	memset(c->mem.addr, 0x5a, chunk);

	ASSERT_TRUE(pool_block_free(f.p, c, idx));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 2u);
	ASSERT_EQ(c->state, CHUNK_DRAINING);
	ASSERT_EQ(f.p->chunks_draining, 1u);
	ASSERT_EQ(f.p->chunks_free, 3u);
	/* Still charged to the pool and the tenant: the memory is still mapped. */
	ASSERT_EQ(f.p->used_bytes, chunk);
	ASSERT_EQ(f.a->used_bytes, chunk);
	ASSERT_EQ(f.a->chunks, 1u);
	ASSERT_EQ(f.p->block_bytes, 0u);
	ASSERT_NULL(pool_block_addr(f.p, ref_of(c, idx)));

	/* It hands out no block: the same size takes a new chunk... */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c2, &i2));
	ASSERT_TRUE(c2 != c);
	ASSERT_EQ(c->used_blocks, 0u);
	/* ...and with it the budget of two chunks is spent. */
	ASSERT_ERRNO(pool_block_alloc(f.p, f.b, 0, 1024, &x, &ix), -ENOSPC);

	ASSERT_FALSE(pool_chunk_drop_holder(f.p, c, 3));
	ASSERT_TRUE(pool_chunk_drop_holder(f.p, c, 1));
	ASSERT_EQ(c->state, CHUNK_DRAINING);
	ASSERT_FALSE(pool_chunk_drop_holder(f.p, c, 1));
	ASSERT_TRUE(pool_chunk_drop_holder(f.p, c, 2));
	ASSERT_EQ(c->state, CHUNK_FREE);
	ASSERT_EQ(f.p->chunks_draining, 0u);
	ASSERT_EQ(f.p->chunks_free, 3u);
	ASSERT_EQ(f.p->used_bytes, chunk);
	ASSERT_EQ(f.a->used_bytes, chunk);
	ASSERT_EQ(f.a->chunks, 1u);
	ASSERT_EQ(c->n_holders, 0u);
	ASSERT_TRUE(c->dirty);
	/* Back to a: its own memory first, scrubbed. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 2048, &x, &ix));
	ASSERT_TRUE(x == c);
	ASSERT_TRUE(all_bytes(c->mem.addr, 0, chunk));

	/* Dropping a holder of an owned chunk just forgets it. */
	ASSERT_OK(chunk_add_holder(c2, 7));
	ASSERT_TRUE(pool_chunk_drop_holder(f.p, c2, 7));
	ASSERT_EQ(c2->state, CHUNK_OWNED);
	ASSERT_NOT_NULL(pool_block_addr(f.p, ref_of(c2, i2)));
	fixture_done(&f);
}

TEST(block_addr_only_for_blocks_in_use) {
	const uint64_t chunk = 4 * page;
	struct fixture f;
	struct chunk *c;
	uint32_t i1, i2;

	fixture_init(&f, chunk, 2, 2);
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i1));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, 1024, &c, &i2));
	ASSERT_NOT_NULL(pool_block_addr(f.p, ref_of(c, i1)));
	ASSERT_FALSE(pool_block_free(f.p, c, i1));
	ASSERT_NULL(pool_block_addr(f.p, ref_of(c, i1)));
	ASSERT_NOT_NULL(pool_block_addr(f.p, ref_of(c, i2)));
	ASSERT_NULL(pool_block_addr(f.p, ref_of(c, c->n_blocks)));
	ASSERT_NULL(pool_block_addr(f.p, ref_of(c, UINT32_MAX)));
	ASSERT_NULL(pool_block_addr(f.p, (struct kvd_block_ref){ .chunk_id = 1, .index = 0 }));
	ASSERT_NULL(pool_block_addr(f.p, (struct kvd_block_ref){ .chunk_id = 2, .index = 0 }));
	ASSERT_NULL(pool_block_addr(f.p, (struct kvd_block_ref){ .chunk_id = UINT32_MAX }));
	ASSERT_TRUE(pool_block_free(f.p, c, i2));
	ASSERT_EQ(pool_chunk_reclaim(f.p, c), 0u);
	ASSERT_NULL(pool_block_addr(f.p, ref_of(c, i2)));
	fixture_done(&f);
}

/* ---- Models ---- */

static Kvd__V1__RegisterModel model_req(uint32_t layers, uint32_t q, uint32_t kv, uint32_t hd,
                                        uint32_t dtype, uint32_t bt, uint32_t layout) {
	Kvd__V1__RegisterModel r = KVD__V1__REGISTER_MODEL__INIT;

	r.has_layers = r.has_q_heads = r.has_kv_heads = r.has_head_dim = 1;
	r.has_dtype = r.has_block_tokens = r.has_layout = 1;
	r.layers = layers;
	r.q_heads = q;
	r.kv_heads = kv;
	r.head_dim = hd;
	r.dtype = dtype;
	r.block_tokens = bt;
	r.layout = layout;
	return r;
}

static void model_make(struct model *m, Kvd__V1__RegisterModel req, uint64_t chunk) {
	const char *why = NULL;

	ASSERT_OK(model_from_request(&req, chunk, UINT64_MAX, m, &why));
}

static void model_refused(Kvd__V1__RegisterModel req, uint64_t chunk, const char *why_want) {
	struct model m;
	const char *why = NULL;

	ASSERT_ERRNO(model_from_request(&req, chunk, UINT64_MAX, &m, &why), -EINVAL);
	ASSERT_NOT_NULL(why);
	ASSERT_TRUE(strstr(why, why_want) != NULL);
}

TEST(model_valid) {
	Kvd__V1__RegisterModel req;
	struct model m;

	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	req.name = (char *)"llama-3-8b";
	model_make(&m, req, 2 << 20);
	ASSERT_STREQ(m.name, "llama-3-8b");
	/* K and V, 16 tokens, 8 heads, 128 dims, 2 bytes. */
	ASSERT_EQ(m.block_bytes, 2u * 16 * 8 * 128 * 2);
	ASSERT_EQ(m.n_tables, 32u);
	ASSERT_EQ(m.layers, 32u);
	ASSERT_EQ(m.q_heads, 32u);
	ASSERT_EQ(m.kv_heads, 8u);
	ASSERT_EQ(m.dtype, (uint32_t)KVD_DTYPE_F16);

	req = model_req(32, 32, 8, 128, KVD_DTYPE_F32, 16, KVD_LAYOUT_PER_HEAD);
	model_make(&m, req, 2 << 20);
	ASSERT_STREQ(m.name, "");
	ASSERT_EQ(m.block_bytes, 2u * 16 * 128 * 4);
	ASSERT_EQ(m.n_tables, 32u * 8);
	ASSERT_EQ(m.layout, (uint32_t)KVD_LAYOUT_PER_HEAD);

	/* A block exactly the size of the chunk fits. */
	req = model_req(1, 1, 1, 64, KVD_DTYPE_BF16, 16, KVD_LAYOUT_PER_LAYER);
	model_make(&m, req, 2 * 16 * 64 * 2);
	ASSERT_EQ(m.block_bytes, 2u * 16 * 64 * 2);

	/* Every limit at its maximum still computes (per head: no overflow). */
	req = model_req(1024, 1024, 1024, 4096, KVD_DTYPE_F32, 65536, KVD_LAYOUT_PER_HEAD);
	model_make(&m, req, UINT64_C(1) << 40);
	ASSERT_EQ(m.block_bytes, UINT64_C(2) * 65536 * 4096 * 4);
	ASSERT_EQ(m.n_tables, 1024u * 1024);
}

TEST(model_refused) {
	const uint64_t chunk = 2 << 20;
	Kvd__V1__RegisterModel req;
	char name[80];

	req = model_req(32, 32, 8, 128, 0, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "dtype");
	req = model_req(32, 32, 8, 128, 4, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "dtype");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	req.has_dtype = 0;
	model_refused(req, chunk, "dtype");

	req = model_req(32, 12, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "multiple of kv_heads");
	req = model_req(32, 4, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "multiple of kv_heads");

	/* 2 * 16 * 8 * 128 * 2 = 64 KiB per block. */
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, 64 * 1024 - 1, "fit in one chunk");
	req = model_req(1024, 1024, 1024, 4096, KVD_DTYPE_F32, 65536, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "fit in one chunk");

	req = model_req(0, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "layers");
	req = model_req(1025, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "layers");
	req = model_req(UINT32_MAX, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "layers");
	req = model_req(32, 2048, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "q_heads");
	req = model_req(32, 32, 0, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "kv_heads");
	req = model_req(32, UINT32_MAX, UINT32_MAX, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "q_heads");
	req = model_req(32, 32, 8, 0, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "head_dim");
	req = model_req(32, 32, 8, 4097, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "head_dim");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 0, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "block_tokens");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 65537, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "block_tokens");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, UINT32_MAX, KVD_LAYOUT_PER_LAYER);
	model_refused(req, chunk, "block_tokens");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, 0);
	model_refused(req, chunk, "layout");
	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, 3);
	model_refused(req, chunk, "layout");

	req = model_req(32, 32, 8, 128, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER);
	memset(name, 'n', sizeof(name));
	name[MODEL_NAME_MAX + 1] = 0;
	req.name = name;
	model_refused(req, chunk, "name");
	name[MODEL_NAME_MAX] = 0;
	{
		struct model m;

		model_make(&m, req, chunk);
		ASSERT_EQ(strlen(m.name), (size_t)MODEL_NAME_MAX);
	}
}

/* ---- Sequences ---- */

#define DESC_MAX (UINT64_C(64) << 20)

static const struct kvd_block_ref *blocks_of(const struct seq *s, uint32_t t) {
	return layout_blocks(s->desc, t);
}

static uint32_t tokens_of(const struct seq *s, uint32_t t) {
	return layout_tokens(s->desc)[t];
}

TEST(seq_descriptor) {
	const uint64_t chunk = 16 * page;
	struct fixture f;
	struct model m;
	struct seq *s = NULL;
	struct kvd_seq_desc *d;
	struct stat st;

	fixture_init(&f, chunk, 2, 2);
	model_make(&m, model_req(3, 8, 2, 64, KVD_DTYPE_BF16, 4, KVD_LAYOUT_PER_HEAD), chunk);
	ASSERT_ERRNO(seq_new(1, &m, f.a, 0, DESC_MAX, &s), -EINVAL);
	ASSERT_ERRNO(seq_new(1, &m, f.a, 10, page - 1, &s), -EINVAL);
	ASSERT_NULL(s);

	ASSERT_OK(seq_new(42, &m, f.a, 10, DESC_MAX, &s));
	d = s->desc;
	ASSERT_TRUE(s->model == &m);
	ASSERT_TRUE(s->tenant == f.a);
	ASSERT_EQ(s->id, 42u);
	ASSERT_EQ(d->magic, KVD_SEQ_DESC_MAGIC);
	ASSERT_EQ(d->version, (uint32_t)KVD_SEQ_DESC_VERSION);
	ASSERT_EQ(d->generation, 0u);
	ASSERT_EQ(d->seq_id, 42u);
	ASSERT_EQ(d->layers, 3u);
	ASSERT_EQ(d->kv_heads, 2u);
	ASSERT_EQ(d->head_dim, 64u);
	ASSERT_EQ(d->dtype, (uint32_t)KVD_DTYPE_BF16);
	ASSERT_EQ(d->block_tokens, 4u);
	ASSERT_EQ(d->layout, (uint32_t)KVD_LAYOUT_PER_HEAD);
	ASSERT_EQ(d->n_tables, 6u);
	ASSERT_EQ(d->max_tokens, 10u);
	ASSERT_EQ(d->max_blocks, 3u);
	ASSERT_EQ(d->next_position, 0u);
	ASSERT_EQ(d->block_bytes, m.block_bytes);
	/* The arrays follow the head in order, 64-byte aligned, without overlap. */
	ASSERT_GE(d->tokens_offset, sizeof(*d));
	ASSERT_EQ(d->tokens_offset % 64, 0u);
	ASSERT_EQ(d->positions_offset % 64, 0u);
	ASSERT_EQ(d->blocks_offset % 64, 0u);
	ASSERT_GE(d->positions_offset, d->tokens_offset + 4 * 6);
	ASSERT_GE(d->blocks_offset, d->positions_offset + 4 * 6 * 10);
	ASSERT_GE(d->total_bytes, d->blocks_offset + sizeof(struct kvd_block_ref) * 6 * 3);
	ASSERT_EQ(d->total_bytes % page, 0u);
	for (uint32_t t = 0; t < 6; t++)
		ASSERT_EQ(tokens_of(s, t), 0u);

	ASSERT_GE(s->desc_fd, 0);
	ASSERT_OK(fstat(s->desc_fd, &st));
	ASSERT_EQ((uint64_t)st.st_size, d->total_bytes);
	/* No pool memory is taken by an empty sequence. */
	ASSERT_EQ(f.p->used_bytes, 0u);
	seq_free(s, f.p, &f.emptied);
	ASSERT_EQ(f.emptied.n, 0u);

	/* A desc_max of exactly the size needed is enough. */
	ASSERT_OK(seq_new(43, &m, f.a, 10, page, &s));
	ASSERT_EQ(s->desc->total_bytes, page);
	seq_free(s, f.p, &f.emptied);
	fixture_done(&f);
}

TEST(seq_descriptor_is_sealed) {
	const uint64_t chunk = 16 * page;
	struct seq_grants g;
	struct fixture f;
	struct model m;
	struct seq *s;
	const struct kvd_seq_desc *ro;
	void *w;
	int seals;
	char byte = 1;

	fixture_init(&f, chunk, 2, 2);
	model_make(&m, model_req(2, 2, 1, 64, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_LAYER), chunk);
	ASSERT_OK(seq_new(1, &m, f.a, 16, DESC_MAX, &s));

	seals = fcntl(s->desc_fd, F_GET_SEALS);
	ASSERT_GE(seals, 0);
	ASSERT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL),
	          F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);

	w = mmap(NULL, s->desc->total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->desc_fd, 0);
	ASSERT_TRUE(w == MAP_FAILED);
	ASSERT_EQ(errno, EPERM);
	ASSERT_EQ(pwrite(s->desc_fd, &byte, 1, 0), -1);
	ASSERT_EQ(errno, EPERM);
	ASSERT_EQ(ftruncate(s->desc_fd, 0), -1);
	ASSERT_ERRNO(fcntl(s->desc_fd, F_ADD_SEALS, 0) < 0 ? -errno : 0, -EPERM);

	ro = mmap(NULL, s->desc->total_bytes, PROT_READ, MAP_SHARED, s->desc_fd, 0);
	ASSERT_TRUE(ro != MAP_FAILED);
	ASSERT_EQ(ro->magic, KVD_SEQ_DESC_MAGIC);
	/* A read-only mapping cannot be made writable afterwards. */
	ASSERT_EQ(mprotect((void *)ro, s->desc->total_bytes, PROT_READ | PROT_WRITE), -1);
	ASSERT_EQ(errno, EACCES);

	/* The daemon's own mapping stays writable, and the client sees what it writes. */
	ASSERT_OK(seq_grow(s, f.p, 1, 5, &g, &f.emptied));
	ASSERT_EQ(layout_tokens(ro)[0], 5u);
	ASSERT_EQ(layout_tokens(ro)[1], 5u);
	ASSERT_EQ(ro->generation, 2u);
	ASSERT_EQ(layout_blocks(ro, 1)[1].chunk_id, blocks_of(s, 1)[1].chunk_id);
	ASSERT_OK(munmap((void *)ro, s->desc->total_bytes));

	seq_free(s, f.p, &f.emptied);
	fixture_done(&f);
}

/* Every block of the sequence, all tables: resolvable, in the tenant's chunks of the
 * model's block size, and never shared between two slots. */
static void check_blocks_unique(struct fixture *f, const struct seq *s) {
	const struct kvd_seq_desc *d = s->desc;
	uint32_t n = 0, cap = d->n_tables * d->max_blocks;
	struct kvd_block_ref *all = calloc(cap, sizeof(*all));

	ASSERT_NOT_NULL(all);
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t nb = DIV_ROUND_UP(tokens_of(s, t), d->block_tokens);

		for (uint32_t i = 0; i < nb; i++) {
			struct kvd_block_ref r = blocks_of(s, t)[i];
			struct chunk *c = pool_chunk(f->p, r.chunk_id);

			ASSERT_NOT_NULL(pool_block_addr(f->p, r));
			ASSERT_TRUE(c->owner == s->tenant);
			ASSERT_EQ(c->block_bytes, d->block_bytes);
			for (uint32_t j = 0; j < n; j++) {
				bool same = all[j].chunk_id == r.chunk_id && all[j].index == r.index;

				ASSERT_FALSE(same);
			}
			all[n++] = r;
		}
	}
	free(all);
}

TEST(seq_grow_fills_tables) {
	const uint64_t chunk = 16 * page;
	struct seq_grants g;
	struct fixture f;
	struct model m;
	struct seq *s;
	struct kvd_seq_desc *d;

	fixture_init(&f, chunk, 4, 4);
	model_make(&m, model_req(3, 4, 2, 32, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_LAYER), chunk);
	ASSERT_OK(seq_new(7, &m, f.a, 10, DESC_MAX, &s));
	d = s->desc;

	ASSERT_ERRNO(seq_grow(s, f.p, 1, 0, &g, &f.emptied), -EINVAL);
	ASSERT_ERRNO(seq_grow(s, f.p, 1, 11, &g, &f.emptied), -EFBIG);
	ASSERT_ERRNO(seq_grow(s, f.p, 1, UINT32_MAX, &g, &f.emptied), -EFBIG);
	ASSERT_EQ(d->generation, 0u);
	ASSERT_EQ(f.p->used_bytes, 0u);

	ASSERT_OK(seq_grow(s, f.p, 1, 3, &g, &f.emptied));
	ASSERT_EQ(d->generation, 2u);
	ASSERT_EQ(d->next_position, 3u);
	ASSERT_EQ(f.p->block_bytes, 3 * m.block_bytes);
	check_blocks_unique(&f, s);
	/* Within the last block: no new block. */
	ASSERT_OK(seq_grow(s, f.p, 1, 1, &g, &f.emptied));
	ASSERT_EQ(g.n, 0u);
	ASSERT_EQ(f.p->block_bytes, 3 * m.block_bytes);
	ASSERT_EQ(d->generation, 4u);
	ASSERT_OK(seq_grow(s, f.p, 1, 2, &g, &f.emptied));
	ASSERT_EQ(f.p->block_bytes, 6 * m.block_bytes);
	for (uint32_t t = 0; t < 3; t++) {
		ASSERT_EQ(tokens_of(s, t), 6u);
		for (uint32_t i = 0; i < 6; i++)
			ASSERT_EQ(layout_positions(d, t)[i], i);
	}
	check_blocks_unique(&f, s);

	ASSERT_ERRNO(seq_grow(s, f.p, 1, 5, &g, &f.emptied), -EFBIG);
	ASSERT_EQ(tokens_of(s, 0), 6u);
	ASSERT_EQ(d->generation, 6u);
	ASSERT_OK(seq_grow(s, f.p, 1, 4, &g, &f.emptied));
	ASSERT_EQ(d->generation, 8u);
	ASSERT_EQ(d->next_position, 10u);
	for (uint32_t t = 0; t < 3; t++) {
		ASSERT_EQ(tokens_of(s, t), 10u);
		ASSERT_EQ(layout_positions(d, t)[9], 9u);
	}
	ASSERT_EQ(f.p->block_bytes, 9 * m.block_bytes);
	check_blocks_unique(&f, s);
	ASSERT_ERRNO(seq_grow(s, f.p, 1, 1, &g, &f.emptied), -EFBIG);
	ASSERT_EQ(f.emptied.n, 0u);

	/* Freeing gives every block back; the chunks are held by connection 1 and drain. */
	seq_free(s, f.p, &f.emptied);
	ASSERT_EQ(f.p->block_bytes, 0u);
	ASSERT_EQ(f.a->block_bytes, 0u);
	ASSERT_EQ(f.emptied.n, 1u);
	ASSERT_EQ(pool_chunk_reclaim(f.p, f.emptied.chunks[0]), 1u);
	ASSERT_TRUE(pool_chunk_drop_holder(f.p, f.emptied.chunks[0], 1));
	ASSERT_EQ(f.p->used_bytes, 0u);
	ASSERT_EQ(f.p->chunks_free, 4u);
	ASSERT_EQ(f.p->chunks_draining, 0u);
	ASSERT_EQ(f.a->used_bytes, 0u);
	ASSERT_EQ(f.a->chunks, 0u);
	fixture_done(&f);
}

/*
 * A model whose blocks are a quarter of a page, whatever the page size: with one-page
 * chunks a chunk holds four blocks. Per head, 2 layers x 2 kv heads: four tables.
 */
static void model_quarter_page(struct model *m) {
	model_make(m, model_req(2, 2, 2, page / 64, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD), page);
	ASSERT_EQ(m->block_bytes, page / 4);
	ASSERT_EQ(m->n_tables, 4u);
}

static int in_grants(const struct seq_grants *g, const struct chunk *c) {
	int n = 0;

	for (uint32_t i = 0; i < g->n; i++)
		n += g->chunks[i] == c;
	return n;
}

TEST(seq_grow_grants_each_chunk_once) {
	struct seq_grants g;
	struct fixture f;
	struct model m;
	struct seq *s, *s2;
	struct chunk *w, *v;
	uint32_t wi;

	fixture_init(&f, page, 32, 32);
	model_quarter_page(&m);
	ASSERT_OK(seq_new(1, &m, f.a, 64, DESC_MAX, &s));

	/* 10 blocks per table, 40 blocks: ten new chunks, each granted once. */
	ASSERT_OK(seq_grow(s, f.p, 100, 40, &g, &f.emptied));
	ASSERT_EQ(g.n, 10u);
	for (uint32_t i = 0; i < g.n; i++) {
		ASSERT_EQ(in_grants(&g, g.chunks[i]), 1);
		ASSERT_TRUE(chunk_has_holder(g.chunks[i], 100));
		ASSERT_EQ(g.chunks[i]->n_holders, 1u);
	}
	for (uint32_t t = 0; t < 4; t++)
		for (uint32_t i = 0; i < 10; i++)
			ASSERT_EQ(in_grants(&g, pool_chunk(f.p, blocks_of(s, t)[i].chunk_id)), 1);
	check_blocks_unique(&f, s);

	/* The ten chunks are full: 4 more blocks take one new chunk, granted once. */
	ASSERT_OK(seq_grow(s, f.p, 100, 4, &g, &f.emptied));
	ASSERT_EQ(g.n, 1u);
	ASSERT_EQ(f.a->chunks, 11u);
	ASSERT_EQ(in_grants(&g, pool_chunk(f.p, blocks_of(s, 0)[10].chunk_id)), 1);

	/* A block of the tenant's taken elsewhere (another sequence of connection 100) leaves
	 * chunk W with three free blocks. Another connection of the same tenant that grows
	 * into W gets it granted, since it has not mapped it: W and one new chunk V. */
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, m.block_bytes, &w, &wi));
	ASSERT_OK(chunk_add_holder(w, 100));
	ASSERT_OK(seq_new(2, &m, f.a, 64, DESC_MAX, &s2));
	ASSERT_OK(seq_grow(s2, f.p, 200, 4, &g, &f.emptied));
	ASSERT_EQ(g.n, 2u);
	ASSERT_EQ(in_grants(&g, w), 1);
	v = g.chunks[0] == w ? g.chunks[1] : g.chunks[0];
	ASSERT_EQ(v->used_blocks, 1u);
	for (uint32_t i = 0; i < g.n; i++)
		ASSERT_TRUE(chunk_has_holder(g.chunks[i], 200));
	ASSERT_EQ(w->n_holders, 2u);
	ASSERT_EQ(v->n_holders, 1u);
	for (uint32_t t = 0; t < 4; t++)
		ASSERT_EQ(in_grants(&g, pool_chunk(f.p, blocks_of(s2, t)[0].chunk_id)), 1);
	check_blocks_unique(&f, s2);

	/* And back: connection 100 grows into V (3 blocks), which it has not mapped, and one
	 * new chunk. */
	ASSERT_OK(seq_grow(s, f.p, 100, 4, &g, &f.emptied));
	ASSERT_EQ(g.n, 2u);
	ASSERT_EQ(in_grants(&g, v), 1);
	ASSERT_EQ(in_grants(&g, w), 0);
	ASSERT_EQ(v->used_blocks, 4u);
	ASSERT_EQ(f.a->chunks, 14u);
	ASSERT_EQ(f.p->block_bytes, (48u + 4 + 1) * m.block_bytes);

	seq_free(s2, f.p, &f.emptied);
	seq_free(s, f.p, &f.emptied);
	ASSERT_TRUE(pool_block_free(f.p, w, wi));
	ASSERT_EQ(f.p->block_bytes, 0u);
	fixture_done(&f);
}

/* Pool state that a failed grow must leave as it was. */
struct snapshot {
	uint64_t used, blocks, t_used, t_blocks, gen;
	uint32_t free, draining, t_chunks, tokens;
	struct kvd_block_ref first;
};

static struct snapshot snap(const struct fixture *f, const struct seq *s) {
	return (struct snapshot){
		.used = f->p->used_bytes,
		.blocks = f->p->block_bytes,
		.t_used = s->tenant->used_bytes,
		.t_blocks = s->tenant->block_bytes,
		.gen = s->desc->generation,
		.free = f->p->chunks_free,
		.draining = f->p->chunks_draining,
		.t_chunks = s->tenant->chunks,
		.tokens = tokens_of(s, 0),
		.first = blocks_of(s, 0)[0],
	};
}

static void snap_equal(const struct snapshot *a, const struct snapshot *b) {
	ASSERT_EQ(a->used, b->used);
	ASSERT_EQ(a->blocks, b->blocks);
	ASSERT_EQ(a->t_used, b->t_used);
	ASSERT_EQ(a->t_blocks, b->t_blocks);
	ASSERT_EQ(a->gen, b->gen);
	ASSERT_EQ(a->free, b->free);
	ASSERT_EQ(a->draining, b->draining);
	ASSERT_EQ(a->t_chunks, b->t_chunks);
	ASSERT_EQ(a->tokens, b->tokens);
	ASSERT_EQ(a->first.chunk_id, b->first.chunk_id);
	ASSERT_EQ(a->first.index, b->first.index);
}

/*
 * Chunk X holds one foreign block and three of the sequence's, Y one of the sequence's.
 * Growing by 8 blocks fills Y (3), a new Z (4) and needs one more: a fourth chunk, which
 * the limit forbids. Everything taken must be given back, Z emptied.
 */
static void grow_all_or_nothing(bool quota, int want) {
	struct seq_grants g;
	struct fixture f;
	struct snapshot before, after;
	struct model m;
	struct seq *s;
	struct chunk *x, *z;
	uint32_t xi;

	fixture_init(&f, page, 8, quota ? 8 : 3);
	if (quota)
		f.a->max_bytes = 3 * page;
	model_quarter_page(&m);
	ASSERT_OK(seq_new(1, &m, f.a, 64, DESC_MAX, &s));
	ASSERT_OK(pool_block_alloc(f.p, f.a, 0, m.block_bytes, &x, &xi));
	ASSERT_OK(seq_grow(s, f.p, 5, 4, &g, &f.emptied));
	ASSERT_EQ(g.n, 2u);
	ASSERT_EQ(f.a->chunks, 2u);
	ASSERT_EQ(f.p->grants_refused, 0u);

	before = snap(&f, s);
	ASSERT_ERRNO(seq_grow(s, f.p, 5, 8, &g, &f.emptied), want);
	ASSERT_EQ(g.n, 0u);
	ASSERT_EQ(f.p->grants_refused, 1u);
	ASSERT_EQ(f.emptied.n, 1u);
	z = f.emptied.chunks[0];
	ASSERT_EQ(z->used_blocks, 0u);
	ASSERT_EQ(z->n_holders, 0u);
	ASSERT_FALSE(chunk_has_holder(z, 5));
	reclaim_emptied(&f);
	ASSERT_EQ(z->state, CHUNK_FREE);
	after = snap(&f, s);
	snap_equal(&before, &after);
	for (uint32_t t = 0; t < 4; t++)
		ASSERT_EQ(tokens_of(s, t), 4u);
	ASSERT_EQ(x->used_blocks, 4u);
	/* Tables 0-2 took X's free blocks, table 3 opened Y. */
	ASSERT_EQ(blocks_of(s, 2)[0].chunk_id, x->id);
	ASSERT_EQ(pool_chunk(f.p, blocks_of(s, 3)[0].chunk_id)->used_blocks, 1u);
	check_blocks_unique(&f, s);

	/* A grow that fits still works afterwards: Y (3) and a new chunk (1). */
	ASSERT_OK(seq_grow(s, f.p, 5, 4, &g, &f.emptied));
	ASSERT_EQ(g.n, 1u);
	ASSERT_EQ(f.a->chunks, 3u);
	ASSERT_EQ(tokens_of(s, 3), 8u);
	check_blocks_unique(&f, s);

	seq_free(s, f.p, &f.emptied);
	ASSERT_TRUE(pool_block_free(f.p, x, xi));
	ASSERT_EQ(f.p->block_bytes, 0u);
	fixture_done(&f);
}

TEST(seq_grow_all_or_nothing_budget) {
	grow_all_or_nothing(false, -ENOSPC);
}

TEST(seq_grow_all_or_nothing_quota) {
	grow_all_or_nothing(true, -EDQUOT);
}

/* More new chunks than one reply frame can carry fds for. */
TEST(seq_grow_too_many_grants) {
	const uint32_t n_chunks = ELEMENTSOF(((struct seq_grants *)0)->chunks) + 8;
	struct seq_grants g;
	struct fixture f;
	struct model m;
	struct seq *s;
	struct rlimit rl;
	uint32_t bt = page / 512;

	ASSERT_OK(getrlimit(RLIMIT_NOFILE, &rl));
	if (rl.rlim_cur < n_chunks + 64)
		TEST_SKIP("RLIMIT_NOFILE too low for one memfd per chunk");
	/* One block per one-page chunk, one table. */
	fixture_init(&f, page, n_chunks, n_chunks);
	model_make(&m, model_req(1, 1, 1, 64, KVD_DTYPE_F32, bt, KVD_LAYOUT_PER_LAYER), page);
	ASSERT_EQ(m.block_bytes, page);
	ASSERT_OK(seq_new(1, &m, f.a, 1000 * bt, DESC_MAX, &s));

	ASSERT_ERRNO(seq_grow(s, f.p, 9, (ELEMENTSOF(g.chunks) + 1) * bt, &g, &f.emptied), -E2BIG);
	ASSERT_EQ(g.n, 0u);
	ASSERT_EQ(f.emptied.n, ELEMENTSOF(g.chunks) + 1);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->used_bytes, 0u);
	ASSERT_EQ(f.p->block_bytes, 0u);
	ASSERT_EQ(f.p->chunks_free, n_chunks);
	ASSERT_EQ(tokens_of(s, 0), 0u);
	ASSERT_EQ(s->desc->generation, 0u);

	/* Exactly as many as fit is fine. */
	ASSERT_OK(seq_grow(s, f.p, 9, ELEMENTSOF(g.chunks) * bt, &g, &f.emptied));
	ASSERT_EQ(g.n, ELEMENTSOF(g.chunks));
	ASSERT_EQ(f.p->used_bytes, ELEMENTSOF(g.chunks) * page);
	seq_free(s, f.p, &f.emptied);
	fixture_done(&f);
}
