/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "log.h"
#include "pool.h"

/* ---- Free lists (pool.h, "Isolation") ---- */

/* Puts a FREE chunk on its device's free list: at the head without memory, at the tail (and
 * on its last owner's own list) with. */
static void free_push(struct pool *p, struct chunk *c) {
	uint32_t d = c->mem.device;

	if (!c->last_owner) {
		c->prev = NULL;
		c->next = p->free_list[d];
		if (c->next)
			c->next->prev = c;
		else
			p->free_tail[d] = c;
		p->free_list[d] = c;
		return;
	}
	c->next = NULL;
	c->prev = p->free_tail[d];
	if (c->prev)
		c->prev->next = c;
	else
		p->free_list[d] = c;
	p->free_tail[d] = c;
	c->own_prev = NULL;
	c->own_next = c->last_owner->free_chunks[d];
	if (c->own_next)
		c->own_next->own_prev = c;
	c->last_owner->free_chunks[d] = c;
}

/* Takes a FREE chunk off the free lists it is on. */
static void free_unlink(struct pool *p, struct chunk *c) {
	uint32_t d = c->mem.device;

	if (c->prev)
		c->prev->next = c->next;
	else
		p->free_list[d] = c->next;
	if (c->next)
		c->next->prev = c->prev;
	else
		p->free_tail[d] = c->prev;
	c->next = c->prev = NULL;
	if (!c->last_owner)
		return;
	if (c->own_prev)
		c->own_prev->own_next = c->own_next;
	else
		c->last_owner->free_chunks[d] = c->own_next;
	if (c->own_next)
		c->own_next->own_prev = c->own_prev;
	c->own_next = c->own_prev = NULL;
}

/* Keeps mem mapped until pool_readers_end(); returns false when it cannot (no memory). */
static bool keep_for_readers(struct pool *p, const struct backend_chunk *mem) {
	if (p->n_kept == p->cap_kept) {
		uint32_t cap = MAX(2 * p->cap_kept, 16u);
		struct backend_chunk *k = realloc(p->kept, cap * sizeof(*k));

		if (!k)
			return false;
		p->kept = k;
		p->cap_kept = cap;
	}
	p->kept[p->n_kept++] = *mem;
	return true;
}

/* Destroys a chunk's memory object (the fd store forgets it too); it is nobody's after.
 * While a round may read it, it is only taken from the chunk (pool_readers_begin()). */
static void chunk_drop_memory(struct pool *p, struct chunk *c) {
	/* Processes of its last owner may keep a mapping of it (pool.h, "Isolation"): the
	 * pages go back to the system rather than live on there (on the host backend). */
	if (c->dirty && c->mem.fd >= 0)
		(void)p->ops->chunk_scrub(&c->mem);
	c->dirty = false;
	if (c->mem.fd >= 0) {
		if (p->chunk_destroyed)
			p->chunk_destroyed(p->chunk_created_userdata, c);
		if (p->readers > 0 && keep_for_readers(p, &c->mem))
			c->mem = (struct backend_chunk){ .fd = -EBADF, .device = c->mem.device };
		else
			p->ops->chunk_destroy(&c->mem);
	}
	c->last_owner = NULL;
}

void pool_readers_begin(struct pool *p) {
	p->readers++;
}

void pool_readers_end(struct pool *p) {
	if (--p->readers > 0)
		return;
	for (uint32_t i = 0; i < p->n_kept; i++)
		p->ops->chunk_destroy(&p->kept[i]);
	p->n_kept = 0;
}

/* Takes c, FREE and off the free lists, out of the pool for t in state (OWNED, PINNED):
 * charged to t and to the budget. */
static void chunk_charge(struct pool *p, struct chunk *c, struct tenant *t,
                         enum chunk_state state) {
	p->chunks_free--;
	p->device_free[c->mem.device]--;
	p->used_bytes += p->chunk_bytes;
	t->used_bytes += p->chunk_bytes;
	t->chunks++;
	c->state = state;
	c->owner = t;
}

/* The reverse: c is FREE again, on the free lists, charged to nobody. */
static void chunk_uncharge(struct pool *p, struct chunk *c) {
	struct tenant *t = c->owner;

	p->used_bytes -= p->chunk_bytes;
	t->used_bytes -= p->chunk_bytes;
	t->chunks--;
	c->state = CHUNK_FREE;
	c->owner = NULL;
	free_push(p, c);
	p->chunks_free++;
	p->device_free[c->mem.device]++;
}

/* Destroys the memory of a FREE chunk, which stays FREE, without memory. */
static void free_drop_memory(struct pool *p, struct chunk *c) {
	free_unlink(p, c);
	chunk_drop_memory(p, c);
	free_push(p, c);
}

int pool_new(const struct backend_ops *ops, uint32_t n_devices, uint64_t device_bytes,
             uint64_t chunk_bytes, uint64_t budget_bytes, struct pool **ret) {
	uint64_t gran = ops->granularity(), device_chunks;
	struct pool *p;

	if (n_devices == 0 || n_devices > BACKEND_DEVICES_MAX || chunk_bytes == 0 ||
	    chunk_bytes % gran != 0 || device_bytes < chunk_bytes)
		return -EINVAL;
	device_chunks = device_bytes / chunk_bytes;
	if (device_chunks * n_devices > UINT32_MAX || device_bytes > UINT64_MAX / n_devices ||
	    budget_bytes > device_bytes * n_devices)
		return -EINVAL;

	p = calloc(1, sizeof(*p));
	if (!p)
		return -ENOMEM;
	p->ops = ops;
	p->chunk_bytes = chunk_bytes;
	p->n_devices = n_devices;
	p->device_chunks = (uint32_t)device_chunks;
	p->n_chunks = (uint32_t)(device_chunks * n_devices);
	/* Whole chunks only: the remainder of an uneven pool size is never used. */
	p->pool_bytes = (uint64_t)p->n_chunks * chunk_bytes;
	p->budget_bytes = MIN(budget_bytes, p->pool_bytes);
	p->chunks = calloc(p->n_chunks, sizeof(*p->chunks));
	if (!p->chunks) {
		free(p);
		return -ENOMEM;
	}
	/* Lowest ids first off each device's free list; memory is made on first use. */
	for (uint32_t i = p->n_chunks; i-- > 0;) {
		struct chunk *c = &p->chunks[i];

		c->id = i;
		c->mem.fd = -EBADF;
		c->mem.device = i / p->device_chunks;
		free_push(p, c);
		p->device_free[c->mem.device]++;
	}
	p->chunks_free = p->n_chunks;
	*ret = p;
	return 0;
}

struct pool *pool_free(struct pool *p) {
	if (!p)
		return NULL;
	for (uint32_t i = 0; i < p->n_chunks; i++) {
		struct chunk *c = &p->chunks[i];

		if (c->mem.fd >= 0)
			p->ops->chunk_destroy(&c->mem);
		free(c->used);
		free(c->shares);
		free(c->holders);
	}
	for (uint32_t i = 0; i < p->n_kept; i++)
		p->ops->chunk_destroy(&p->kept[i]);
	free(p->kept);
	free(p->chunks);
	free(p);
	return NULL;
}

int pool_set_budget(struct pool *p, uint64_t bytes) {
	if (bytes > p->pool_bytes)
		return -EINVAL;
	p->budget_bytes = bytes;
	return 0;
}

struct chunk *pool_chunk(struct pool *p, uint32_t id) {
	return id < p->n_chunks ? &p->chunks[id] : NULL;
}

static void partial_add(struct tenant *t, struct chunk *c) {
	c->prev = NULL;
	c->next = t->partial;
	if (t->partial)
		t->partial->prev = c;
	t->partial = c;
	c->partial = true;
}

static void partial_remove(struct tenant *t, struct chunk *c) {
	if (c->prev)
		c->prev->next = c->next;
	else
		t->partial = c->next;
	if (c->next)
		c->next->prev = c->prev;
	c->next = c->prev = NULL;
	c->partial = false;
}

/* Takes a free chunk of device for t, carved for block_bytes: its own if it has one, else
 * one without memory, else another tenant's, renewed (pool.h, "Isolation"). */
static int chunk_acquire(struct pool *p, struct tenant *t, uint32_t device, uint64_t block_bytes,
                         struct chunk **ret) {
	struct chunk *c = t->free_chunks[device] ? t->free_chunks[device] : p->free_list[device];
	uint64_t stride = ALIGN_TO(block_bytes, LAYOUT_BLOCK_ALIGN);
	uint32_t n_blocks, words;
	bool own = c && c->last_owner == t, renewed = false;
	struct tenant *old = NULL;
	int r;

	if (!pool_budget_has_room(p) || !c)
		return -ENOSPC;
	if (t->max_bytes != KVD_TENANT_NO_CAP && t->used_bytes + p->chunk_bytes > t->max_bytes)
		return -EDQUOT;

	if (c->last_owner && !own) {
		/* Another tenant's processes may still reach this memory: never give it on. */
		old = c->last_owner;
		snprintf(p->pinned_by, sizeof(p->pinned_by), "%s", old->name);
		free_drop_memory(p, c);
		renewed = true;
	}
	if (c->dirty && c->mem.fd >= 0) {
		/* Zeroed for its owner's next use (its memory stays its own: pool.h,
		 * "Isolation"). */
		r = p->ops->chunk_scrub(&c->mem);
		if (r < 0) {
			log_error_errno(r, "scrubbing chunk %u failed, destroying its memory", c->id);
			chunk_drop_memory(p, c);
		}
	}
	c->dirty = false;
	if (c->mem.fd < 0) {
		r = p->ops->chunk_create(c->id, c->mem.device, p->chunk_bytes, &c->mem);
		if (r == -ENOMEM && renewed) {
			/* The old allocation was released, and still the device has no room: on a
			 * GPU, processes of its tenant that imported it keep it allocated. That
			 * tenant pays: the chunk is charged to it until its memory can be made. */
			free_unlink(p, c);
			chunk_charge(p, c, old, CHUNK_PINNED);
			p->chunks_pinned++;
			return log_warning_errno(r, "no device memory for chunk %u, which was tenant "
			                         "%s's: processes of %s that still import its old "
			                         "allocation may keep it allocated; charged to %s until "
			                         "it can be made again", c->id, old->name, old->name,
			                         old->name);
		}
		p->pinned_by[0] = '\0';
		if (r < 0)
			return log_error_errno(r, "creating chunk %u failed", c->id);
		if (p->chunk_created)
			p->chunk_created(p->chunk_created_userdata, c);
	}
	n_blocks = p->chunk_bytes / stride;
	words = DIV_ROUND_UP(n_blocks, 64);
	free(c->used);
	free(c->shares);
	c->shares = NULL;
	c->used = calloc(words, sizeof(uint64_t));
	if (!c->used)
		return -ENOMEM;

	free_unlink(p, c);
	chunk_charge(p, c, t, CHUNK_OWNED);
	p->grants_own += own;
	p->grants_renewed += renewed;
	c->last_owner = t;
	c->block_bytes = block_bytes;
	c->stride = stride;
	c->n_blocks = n_blocks;
	c->used_blocks = 0;
	c->hint = 0;
	p->grants++;
	t->grants++;
	partial_add(t, c);
	*ret = c;
	return 0;
}

/* Puts a chunk back in the pool, zeroed, and stops charging its last owner. */
static void chunk_release(struct pool *p, struct chunk *c) {
	struct tenant *t = c->owner;

	if (c->partial)
		partial_remove(t, c);
	if (c->state == CHUNK_DRAINING) {
		p->chunks_draining--;
		p->device_draining[c->mem.device]--;
	}
	/* Zeroed when its owner takes it again (chunk_acquire), not here: a release that
	 * empties many chunks would wait for all of them, and a chunk that goes to another
	 * tenant gets new memory instead. */
	c->dirty = c->mem.fd >= 0;
	c->n_holders = 0;
	chunk_uncharge(p, c);
}

int pool_block_alloc(struct pool *p, struct tenant *t, uint32_t device, uint64_t block_bytes,
                     struct chunk **ret_chunk, uint32_t *ret_index) {
	struct chunk *c;
	uint32_t w, bit, index;
	int r;

	if (device >= p->n_devices)
		return -EINVAL;
	for (c = t->partial; c; c = c->next)
		if (c->block_bytes == block_bytes && c->mem.device == device)
			break;
	if (!c) {
		r = chunk_acquire(p, t, device, block_bytes, &c);
		if (r < 0) {
			p->grants_refused++;
			t->grants_refused++;
			/* The same tests, in the same order, as chunk_acquire's. */
			if (r == -EDQUOT)
				p->refused[POOL_REFUSED_TENANT_MAX]++;
			else if (r == -ENOSPC && !pool_budget_has_room(p))
				p->refused[POOL_REFUSED_BUDGET]++;
			else if (r == -ENOSPC)
				p->refused[POOL_REFUSED_POOL]++;
			else if (r == -ENOMEM && p->pinned_by[0])
				p->refused[POOL_REFUSED_PINNED]++;
			else
				p->refused[POOL_REFUSED_ERROR]++;
			return r;
		}
	}

	for (w = c->hint; c->used[w] == UINT64_MAX; w++)
		;
	bit = __builtin_ctzll(~c->used[w]);
	index = w * 64 + bit;
	c->used[w] |= UINT64_C(1) << bit;
	c->hint = w;
	c->used_blocks++;
	if (c->used_blocks == c->n_blocks)
		partial_remove(t, c);
	p->block_bytes += block_bytes;
	t->block_bytes += block_bytes;
	*ret_chunk = c;
	*ret_index = index;
	return 0;
}

bool pool_block_free(struct pool *p, struct chunk *c, uint32_t index) {
	struct tenant *t = c->owner;
	uint32_t w = index / 64;

	if (c->shares && c->shares[index] > 0) {
		c->shares[index]--;
		p->shared_bytes -= c->block_bytes;
		t->shared_bytes -= c->block_bytes;
		return false;
	}
	c->used[w] &= ~(UINT64_C(1) << (index % 64));
	c->hint = MIN(c->hint, w);
	c->used_blocks--;
	p->block_bytes -= c->block_bytes;
	t->block_bytes -= c->block_bytes;
	if (c->used_blocks == 0)
		return true;
	if (!c->partial)
		partial_add(t, c);
	return false;
}

int pool_block_share(struct pool *p, struct kvd_block_ref ref) {
	struct chunk *c = pool_chunk(p, ref.chunk_id);

	if (!c->shares) {
		c->shares = calloc(c->n_blocks, sizeof(*c->shares));
		if (!c->shares)
			return -ENOMEM;
	}
	if (c->shares[ref.index] == UINT16_MAX)
		return -EMLINK;
	c->shares[ref.index]++;
	p->shared_bytes += c->block_bytes;
	c->owner->shared_bytes += c->block_bytes;
	return 0;
}

bool pool_block_shared(const struct pool *p, struct kvd_block_ref ref) {
	const struct chunk *c = &p->chunks[ref.chunk_id];

	return c->shares && c->shares[ref.index] > 0;
}

uint32_t pool_chunk_reclaim(struct pool *p, struct chunk *c) {
	if (c->n_holders == 0) {
		chunk_release(p, c);
		return 0;
	}
	/* No new blocks come from a draining chunk: a holder that has not yet processed its
	 * unmap request would otherwise unmap memory it was just given. */
	if (c->partial)
		partial_remove(c->owner, c);
	c->state = CHUNK_DRAINING;
	p->chunks_draining++;
	p->device_draining[c->mem.device]++;
	return c->n_holders;
}

void *pool_block_addr(struct pool *p, struct kvd_block_ref ref) {
	struct chunk *c = pool_chunk(p, ref.chunk_id);

	if (!c || c->state != CHUNK_OWNED || ref.index >= c->n_blocks ||
	    !(c->used[ref.index / 64] & (UINT64_C(1) << (ref.index % 64))))
		return NULL;
	return (char *)c->mem.addr + (uint64_t)ref.index * c->stride;
}

int pool_block_read(struct pool *p, struct kvd_block_ref ref, void *dst) {
	const void *src = pool_block_addr(p, ref);
	const struct chunk *c = pool_chunk(p, ref.chunk_id);

	if (!src)
		return -EFAULT;
	return p->ops->read(c->mem.device, src, dst, c->block_bytes);
}

bool chunk_has_holder(const struct chunk *c, uint64_t conn_id) {
	for (uint32_t i = 0; i < c->n_holders; i++)
		if (c->holders[i] == conn_id)
			return true;
	return false;
}

int chunk_add_holder(struct chunk *c, uint64_t conn_id) {
	if (c->n_holders == c->cap_holders) {
		uint32_t cap = MAX(4u, c->cap_holders * 2);
		uint64_t *h = realloc(c->holders, cap * sizeof(*h));

		if (!h)
			return -ENOMEM;
		c->holders = h;
		c->cap_holders = cap;
	}
	c->holders[c->n_holders++] = conn_id;
	return 0;
}

bool pool_chunk_drop_holder(struct pool *p, struct chunk *c, uint64_t conn_id) {
	for (uint32_t i = 0; i < c->n_holders; i++) {
		if (c->holders[i] != conn_id)
			continue;
		c->holders[i] = c->holders[--c->n_holders];
		if (c->state == CHUNK_DRAINING && c->n_holders == 0)
			chunk_release(p, c);
		return true;
	}
	return false;
}

uint32_t pool_drop_holder_everywhere(struct pool *p, uint64_t conn_id, bool renew) {
	uint32_t n = 0;

	for (uint32_t i = 0; i < p->n_chunks; i++) {
		struct chunk *c = &p->chunks[i];

		if (c->n_holders == 0 || !pool_chunk_drop_holder(p, c, conn_id))
			continue;
		n++;
		if (renew && c->state == CHUNK_FREE && c->mem.fd >= 0)
			free_drop_memory(p, c);
	}
	return n;
}

int pool_block_alloc_in(struct pool *p, struct chunk *c, uint32_t *ret_index) {
	uint32_t w, bit;

	if (c->state != CHUNK_OWNED || c->used_blocks == c->n_blocks)
		return -ENOSPC;
	/* Words below the hint are full, and a free block exists: the scan stops inside the
	 * bitmap, at a bit below n_blocks. */
	for (w = c->hint; c->used[w] == UINT64_MAX; w++)
		;
	bit = __builtin_ctzll(~c->used[w]);
	c->used[w] |= UINT64_C(1) << bit;
	c->hint = w;
	c->used_blocks++;
	if (c->used_blocks == c->n_blocks)
		partial_remove(c->owner, c);
	p->block_bytes += c->block_bytes;
	c->owner->block_bytes += c->block_bytes;
	*ret_index = w * 64 + bit;
	return 0;
}

void pool_chunk_restore(struct pool *p, struct chunk *c, struct tenant *t, uint64_t block_bytes,
                        uint64_t *used, uint16_t *shares) {
	uint64_t stride = ALIGN_TO(block_bytes, LAYOUT_BLOCK_ALIGN);
	uint32_t n_blocks = p->chunk_bytes / stride, used_blocks = 0;

	for (uint32_t w = 0; w < DIV_ROUND_UP(n_blocks, 64); w++)
		used_blocks += __builtin_popcountll(used[w]);
	free(c->used);
	free(c->shares);
	c->used = used;
	c->shares = shares;
	/* Still on the free lists: pool_restore_done() makes them anew. */
	chunk_charge(p, c, t, CHUNK_OWNED);
	c->last_owner = t;
	c->block_bytes = block_bytes;
	c->stride = stride;
	c->n_blocks = n_blocks;
	c->used_blocks = used_blocks;
	c->hint = 0;
	p->block_bytes += (uint64_t)used_blocks * block_bytes;
	t->block_bytes += (uint64_t)used_blocks * block_bytes;
	for (uint32_t i = 0; shares && i < n_blocks; i++) {
		p->shared_bytes += (uint64_t)shares[i] * block_bytes;
		t->shared_bytes += (uint64_t)shares[i] * block_bytes;
	}
	c->next = c->prev = NULL;
	c->partial = false;
	if (used_blocks < n_blocks)
		partial_add(t, c);
}

void pool_restore_done(struct pool *p) {
	/* The free lists as pool_new() makes them, lowest ids first, of what stayed free: with
	 * no memory (a FREE chunk's memory from the last life would be nobody's). */
	memset(p->free_list, 0, sizeof(p->free_list));
	memset(p->free_tail, 0, sizeof(p->free_tail));
	for (uint32_t i = p->n_chunks; i-- > 0;) {
		struct chunk *c = &p->chunks[i];

		if (c->state != CHUNK_FREE)
			continue;
		chunk_drop_memory(p, c);
		free_push(p, c);
	}
}

uint32_t pool_retry_pinned(struct pool *p) {
	uint32_t n = 0;

	for (uint32_t i = 0; i < p->n_chunks && p->chunks_pinned > 0; i++) {
		struct chunk *c = &p->chunks[i];
		struct tenant *t = c->owner;

		if (c->state != CHUNK_PINNED ||
		    p->ops->chunk_create(c->id, c->mem.device, p->chunk_bytes, &c->mem) < 0)
			continue;
		if (p->chunk_created)
			p->chunk_created(p->chunk_created_userdata, c);
		log_info("chunk %u has memory again: no longer charged to tenant %s", c->id, t->name);
		p->chunks_pinned--;
		/* New memory: nobody's yet. */
		c->last_owner = NULL;
		chunk_uncharge(p, c);
		n++;
	}
	if (n > 0)
		p->pinned_by[0] = '\0';
	return n;
}

uint32_t pool_forget_tenant(struct pool *p, struct tenant *t) {
	uint32_t n = 0;

	for (uint32_t d = 0; d < p->n_devices; d++)
		for (; t->free_chunks[d]; n++)
			free_drop_memory(p, t->free_chunks[d]);
	return n;
}
