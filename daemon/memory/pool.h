/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The pool: the node's KV memory, cut into chunks by the backend, and the budget that
 * bounds how much of it tenants hold.
 *
 * A chunk is FREE (in the pool, zeroed), OWNED (held by one tenant and carved into blocks
 * of one block size) or DRAINING (empty, but some connection of its last owner still has
 * it mapped; it comes back only when every holder says it unmapped it, or disconnects:
 * the server disconnects holders late past unmap-timeout and unmap-grace).
 * The budget counts the bytes of OWNED and DRAINING chunks: that is what the device
 * really spends. Block bytes are counted too, so fragmentation is visible.
 *
 * A pool spans the backend's devices (one on host; each GPU of --devices on cuda), with
 * the same number of chunks on each, numbered device by device: chunk id i lives on
 * device i / device_chunks (backend_chunk.device). Blocks are allocated on a device (the
 * one its sequence's connection uses); the budget and tenants' caps count every device.
 *
 * Invariants: an OWNED chunk has at least one block in use (a chunk whose last block is
 * freed is reclaimed at once); only connections of the owner are holders; a chunk is
 * scrubbed when it leaves FREE (or gets new memory), so whoever gets it next reads zeros.
 *
 * Isolation against a hostile tenant: memfds and cuMem handles cannot be revoked, so a
 * process that was ever given a chunk's fd may keep it (or a mapping of it, or a copy it
 * passed on) whatever it acknowledged. A chunk's memory object therefore only ever serves
 * one tenant: a FREE chunk keeps its memory tagged with the tenant that last held it
 * (chunk.last_owner), comes back to that tenant as it is (scrubbed), and is given to
 * another tenant only as a new memory object (a fresh memfd, a fresh cuMem allocation): the
 * old one is destroyed by the daemon and dropped from the fd store, and lives on only in
 * the processes that kept it. FREE chunks count as free pool whatever their tag: the budget
 * counts OWNED and DRAINING chunks only. A grant takes, in this order, a FREE chunk of the
 * tenant's own, one without memory, and then the one of another tenant freed longest ago.
 */

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "kvd/kvd-abi.h"
#include "tenant.h"

enum chunk_state {
	CHUNK_FREE,
	CHUNK_OWNED,
	CHUNK_DRAINING,
	/* Without memory: its new allocation found no device memory when it was renewed from
	 * its owner, whose processes may still hold the old one (pinned_by). Charged to that
	 * owner, on no list, made again by pool_retry_pinned(). */
	CHUNK_PINNED,
};

struct chunk {
	uint32_t id;
	enum chunk_state state;
	struct backend_chunk mem;     /* fd -EBADF until first used */
	struct tenant *owner;         /* NULL when FREE */
	uint64_t block_bytes;         /* block size it is carved for */
	uint64_t stride;              /* block_bytes rounded up to LAYOUT_BLOCK_ALIGN */
	uint32_t n_blocks, used_blocks;
	uint64_t *used;               /* bitmap of blocks in use */
	/* Per block, the sequences past the first that hold it (a fork shares its parent's
	 * full blocks): freed when the last lets go. NULL until one of its blocks is shared. */
	uint16_t *shares;
	uint32_t hint;                /* first bitmap word that may have a free block */
	uint64_t *holders;            /* ids of the connections that have it mapped */
	uint32_t n_holders, cap_holders;
	struct chunk *next, *prev;    /* free list, or the owner's partial list */
	bool partial;
	/* Whose its memory object is (NULL: none yet, or nobody's); FREE chunks with memory
	 * are also on last_owner->free_chunks (own_next, own_prev). */
	struct tenant *last_owner;
	struct chunk *own_next, *own_prev;
	uint64_t grant_serial;        /* last grow that granted it (see seq_grow) */
	bool dirty;                   /* FREE with its last owner's data: scrubbed when taken */
	/* DRAINING: when its holders were asked to unmap it (unmap_reclaim()), where
	 * unmap-timeout starts; 0: they could not be asked, and no deadline runs. */
	uint64_t unmap_asked_ms;
};

/* Why a grant of a new chunk was refused; counted for the metrics endpoint. */
enum pool_refusal {
	POOL_REFUSED_BUDGET,          /* the node budget is spent */
	POOL_REFUSED_POOL,            /* no free chunk left within the budget */
	POOL_REFUSED_TENANT_MAX,      /* the tenant's cap */
	POOL_REFUSED_ERROR,           /* the backend or memory failed */
	POOL_REFUSED_PINNED,          /* no device memory for a renewed chunk (pinned_by) */
	_POOL_REFUSED_MAX,
};

struct pool {
	const struct backend_ops *ops;
	uint64_t pool_bytes, chunk_bytes, budget_bytes; /* pool_bytes: every device's */
	uint32_t n_chunks, n_devices, device_chunks;
	struct chunk *chunks;
	/* FREE chunks, per device: those without memory first, then those with memory, the one
	 * freed longest ago first (what a grant takes from another tenant). */
	struct chunk *free_list[BACKEND_DEVICES_MAX], *free_tail[BACKEND_DEVICES_MAX];
	uint32_t chunks_free, chunks_draining, chunks_pinned;
	uint32_t device_free[BACKEND_DEVICES_MAX]; /* chunks_free, per device */
	uint32_t device_draining[BACKEND_DEVICES_MAX]; /* chunks_draining, per device */
	uint64_t used_bytes, block_bytes;
	/* Bytes of the holds of shared blocks past each block's first (pool_block_share()):
	 * held without being taken again. */
	uint64_t shared_bytes;
	uint64_t grants_refused;
	uint64_t grants;              /* chunks handed to a tenant from the free list */
	uint64_t grants_own;          /* of which its own memory object, as it was */
	uint64_t grants_renewed;      /* of which another tenant's, as a new memory object */
	/* The tenant whose chunk the last refused renewal destroyed, when the new memory could
	 * not be made for want of device memory: on a GPU, processes of that tenant that still
	 * import its old allocation keep it allocated. "" once a renewal works again. */
	char pinned_by[KVD_TENANT_NAME_MAX + 1];
	uint64_t refused[_POOL_REFUSED_MAX]; /* grants_refused, by reason */
	/* Called when a chunk's memory is created (keep.h stores its fd), and before it is
	 * destroyed (keep.h drops it from the store); may be NULL. */
	void (*chunk_created)(void *userdata, struct chunk *c);
	void (*chunk_destroyed)(void *userdata, struct chunk *c);
	void *chunk_created_userdata;
	/* Memory given up while a round's worker may read it (pool_readers_begin()): kept,
	 * mapped, until pool_readers_end(). */
	uint32_t readers;
	struct backend_chunk *kept;
	uint32_t n_kept, cap_kept;
};

/* A pool of device_bytes on each of n_devices devices (1..BACKEND_DEVICES_MAX). Returns 0,
 * or -EINVAL (sizes not multiples of the backend granularity, a device's share smaller
 * than a chunk, budget above the pool, no device or too many), -ENOMEM. */
int pool_new(const struct backend_ops *ops, uint32_t n_devices, uint64_t device_bytes,
             uint64_t chunk_bytes, uint64_t budget_bytes, struct pool **ret);
struct pool *pool_free(struct pool *p);

/*
 * An eviction round's worker reads blocks at the addresses its snapshot took, while the
 * loop goes on: a chunk may meanwhile lose its memory (renewed for another tenant, or its
 * tenant forgotten). Between pool_readers_begin() and pool_readers_end() such memory is
 * taken from its chunk at once (the chunk can get new memory, and the fd store forgets the
 * old) but stays mapped in the daemon until the end, when it is destroyed: the worker reads
 * stale bytes of a sequence that is gone, never an unmapped page.
 */
void pool_readers_begin(struct pool *p);
void pool_readers_end(struct pool *p);

/* Whether the budget has room for one more chunk (the test every grant makes first). */
static inline bool pool_budget_has_room(const struct pool *p) {
	return p->used_bytes + p->chunk_bytes <= p->budget_bytes;
}

/* FREE chunks of device d, and bytes of its chunks held (OWNED, DRAINING or PINNED). */
static inline uint32_t pool_device_free_chunks(const struct pool *p, uint32_t d) {
	return p->device_free[d];
}

static inline uint64_t pool_device_used_bytes(const struct pool *p, uint32_t d) {
	return (uint64_t)(p->device_chunks - p->device_free[d]) * p->chunk_bytes;
}

/* Sets the budget; may be below what is in use. Returns 0 or -EINVAL (above the pool). */
int pool_set_budget(struct pool *p, uint64_t bytes);

/*
 * Allocates one block of block_bytes on device (below n_devices) for tenant t, from a chunk
 * t owns there or a new one. Returns 0 and the block in *ret_chunk and *ret_index, or
 * -ENOSPC (node budget or the device's chunks exhausted), -EDQUOT (t's max reached), or a
 * backend error creating the chunk: -ENOMEM with pinned_by set when the chunk was another
 * tenant's and its new memory does not fit (pool.h, "Isolation"); that chunk is then
 * PINNED, charged to that tenant.
 */
int pool_block_alloc(struct pool *p, struct tenant *t, uint32_t device, uint64_t block_bytes,
                     struct chunk **ret_chunk, uint32_t *ret_index);

/* Frees a block, or one sequence's hold of a shared one. Returns true when it was the
 * chunk's last block: the caller must then reclaim the chunk with pool_chunk_reclaim(). */
bool pool_block_free(struct pool *p, struct chunk *c, uint32_t index);

/* One more sequence holds block ref (in use): it is freed when the last one lets go, and
 * counted once. Returns 0, -ENOMEM, or -EMLINK (UINT16_MAX holders already). */
int pool_block_share(struct pool *p, struct kvd_block_ref ref);

/* Whether more than one sequence holds block ref. Shared blocks are never written, moved
 * or evicted: every sharer reads them as they were (docs/engines.md, "Fork"). */
bool pool_block_shared(const struct pool *p, struct kvd_block_ref ref);

/*
 * Starts giving back an empty chunk: with no holder it is FREE at once (returns 0);
 * otherwise it becomes DRAINING and the number of holders is returned, each of which must
 * be asked to unmap it.
 */
uint32_t pool_chunk_reclaim(struct pool *p, struct chunk *c);

/* Chunk by id, or NULL when out of range. */
struct chunk *pool_chunk(struct pool *p, uint32_t id);

/* Address of a block in the daemon's own mapping, or NULL when ref is not a block in use. */
void *pool_block_addr(struct pool *p, struct kvd_block_ref ref);

/* Copies a block in use (its chunk's block_bytes) into dst, through the backend: for
 * readers on the CPU when the daemon's mapping is device memory. Returns 0, -EFAULT (ref is
 * not a block in use), or the backend's -errno. */
int pool_block_read(struct pool *p, struct kvd_block_ref ref, void *dst);

bool chunk_has_holder(const struct chunk *c, uint64_t conn_id);
int chunk_add_holder(struct chunk *c, uint64_t conn_id);
/* Removes a holder; a DRAINING chunk left without holders goes back to FREE. Returns
 * whether conn_id was a holder. */
bool pool_chunk_drop_holder(struct pool *p, struct chunk *c, uint64_t conn_id);
/* pool_chunk_drop_holder() on every chunk. Returns how many conn_id held. With renew, a
 * chunk that goes back to FREE loses its memory object (the next owner gets a new one): a
 * holder that may still map it, alive, must never see what is put there next. */
uint32_t pool_drop_holder_everywhere(struct pool *p, uint64_t conn_id, bool renew);

/*
 * Allocates a free block of chunk c for its owner, as pool_block_alloc does, for callers
 * that must choose the chunk themselves (compaction moves blocks into chunks that a given
 * connection already holds). Returns 0 and the block's index in *ret_index, or -ENOSPC
 * (c is not OWNED, or has no free block).
 */
int pool_block_alloc_in(struct pool *p, struct chunk *c, uint32_t *ret_index);

/*
 * Restoring after a restart (keep.h): chunk c, FREE and with its memory already set, becomes
 * t's, carved for block_bytes, with the blocks whose bits are set in used (allocated, one
 * bit per block, taken over) in use, shared as shares says (NULL: none; taken over),
 * and charged as pool_block_alloc() would have. Unknown
 * processes of t may still map it: its memory is t's, as any chunk's is its last owner's.
 * Once every chunk is restored, pool_restore_done() rebuilds the free list.
 */
void pool_chunk_restore(struct pool *p, struct chunk *c, struct tenant *t, uint64_t block_bytes,
                        uint64_t *used, uint16_t *shares);
void pool_restore_done(struct pool *p);

/* Tries to make the memory of PINNED chunks again: each that gets it is FREE, and no
 * longer charged to its owner. Returns how many did. */
uint32_t pool_retry_pinned(struct pool *p);

/* Destroys the memory of t's FREE chunks (t is going away: nobody may be given it again).
 * Returns how many. */
uint32_t pool_forget_tenant(struct pool *p, struct tenant *t);
