/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "memfd.h"
#include "seq.h"
#include "wire.h"

int seq_new(uint64_t id, const struct model *m, struct tenant *t, uint32_t max_tokens,
            uint64_t desc_max, struct seq **ret) {
	_cleanup_(closep) int fd = -EBADF;
	uint64_t tokens_off, positions_off, blocks_off, moments_off = 0, total, x;
	uint32_t max_blocks;
	struct kvd_seq_desc *d;
	struct seq *s;
	char name[40];
	void *map;
	int r;

	if (max_tokens == 0)
		return -EINVAL;
	max_blocks = DIV_ROUND_UP(max_tokens, m->block_tokens);
	tokens_off = ALIGN_TO(sizeof(struct kvd_seq_desc), 64);
	positions_off = ALIGN_TO(tokens_off + 4ull * m->n_tables, 64);
	/* n_tables <= 2^20 and max_tokens < 2^32: the products fit in 64 bits. */
	x = 4ull * m->n_tables * max_tokens;
	blocks_off = ALIGN_TO(positions_off + x, 64);
	x = sizeof(struct kvd_block_ref) * (uint64_t)m->n_tables * max_blocks;
	total = blocks_off + x;
	if (m->compensation != KVD_COMPENSATION_NONE) {
		moments_off = ALIGN_TO(total, 64);
		total = moments_off + sizeof(struct kvd_block_ref) * (uint64_t)m->layers * m->kv_heads;
	}
	total = ALIGN_TO(total, (uint64_t)sysconf(_SC_PAGESIZE));
	if (total > desc_max)
		return -EINVAL;

	snprintf(name, sizeof(name), "kvd-seq-%llu", (unsigned long long)id);
	/* The client may map it, but only read-only. */
	r = memfd_sealed(name, total, F_SEAL_FUTURE_WRITE, &fd, &map);
	if (r < 0)
		return r;
	d = map;
	s = calloc(1, sizeof(*s));
	if (!s) {
		munmap(d, total);
		return -ENOMEM;
	}
	*d = (struct kvd_seq_desc){
		.magic = KVD_SEQ_DESC_MAGIC,
		.version = KVD_SEQ_DESC_VERSION,
		.seq_id = id,
		.layers = m->layers,
		.kv_heads = m->kv_heads,
		.head_dim = m->head_dim,
		.dtype = m->dtype,
		.block_tokens = m->block_tokens,
		.layout = m->layout,
		.n_tables = m->n_tables,
		.max_tokens = max_tokens,
		.max_blocks = max_blocks,
		.block_bytes = m->block_bytes,
		.tokens_offset = tokens_off,
		.positions_offset = positions_off,
		.blocks_offset = blocks_off,
		.total_bytes = total,
		.compensation = m->compensation,
		.moments_offset = moments_off,
		.moments_bytes = m->moments_bytes,
		.index_heads = m->index_heads,
		.index_dim = m->index_dim,
		.index_offset = m->index_offset,
		.header_bytes = sizeof(*d),
	};
	s->id = id;
	s->model = m;
	s->meta_bytes = sizeof(*s) + total + m->obs_bytes +
	                (m->unit != KVD_UNIT_NONE ? 4ull * m->n_tables * max_tokens : 0);
	s->tenant = t;
	s->desc = d;
	s->desc_fd = TAKE_FD(fd);
	s->obs_fd = -EBADF;
	*ret = s;
	return 0;
}

void seq_blocks_free(struct pool *p, const struct kvd_block_ref *refs, uint64_t n,
                     struct seq_emptied *emptied) {
	for (uint64_t i = 0; i < n; i++) {
		struct chunk *c = pool_chunk(p, refs[i].chunk_id);

		if (pool_block_free(p, c, refs[i].index))
			emptied->chunks[emptied->n++] = c;
	}
}

/* Blocks a table that holds `tokens` takes to grow by n: it fills its last block first. */
static uint32_t table_grow_blocks(const struct kvd_seq_desc *d, uint32_t tokens, uint32_t n) {
	return (uint32_t)(DIV_ROUND_UP(tokens + (uint64_t)n, d->block_tokens) -
	                  DIV_ROUND_UP(tokens, d->block_tokens));
}

/* Whether table t's last block is partly filled and shared: a grow would write the next
 * slots into another sequence's block, so it copies the block first (copy on write). Only
 * a truncate into a fork's shared blocks leaves one so. */
static bool table_cow(const struct seq *s, const struct pool *p, uint32_t t) {
	const struct kvd_seq_desc *d = s->desc;
	uint32_t tokens = layout_tokens(d)[t];

	return p->shared_bytes > 0 && tokens % d->block_tokens != 0 &&
	       pool_block_shared(p, layout_blocks(d, t)[tokens / d->block_tokens]);
}

/* The compensation blocks come with the first grow, so that their chunks reach the client
 * the way every chunk does. */
static uint32_t first_grow_moments(const struct kvd_seq_desc *d) {
	return d->compensation && d->moments_blocks == 0 ? d->layers * d->kv_heads : 0;
}

int seq_grow_check(const struct seq *s, uint32_t n) {
	const struct kvd_seq_desc *d = s->desc;

	if (n == 0)
		return -EINVAL;
	for (uint32_t t = 0; t < d->n_tables; t++)
		if (n > d->max_tokens - layout_tokens(d)[t])
			return -EFBIG;
	return 0;
}

uint64_t seq_grow_bytes(const struct seq *s, const struct pool *p, uint32_t n) {
	const struct kvd_seq_desc *d = s->desc;
	uint64_t blocks = 0;

	for (uint32_t t = 0; t < d->n_tables; t++)
		blocks += table_grow_blocks(d, layout_tokens(d)[t], n) + table_cow(s, p, t);
	return blocks * s->model->block_bytes + (uint64_t)first_grow_moments(d) * d->moments_bytes;
}

int seq_alloc_blocks(struct seq *s, struct pool *p, uint64_t conn_id, uint64_t n_moments,
                     uint64_t total, struct kvd_block_ref *refs, struct seq_granted *g,
                     struct seq_emptied *emptied) {
	static uint64_t serial;
	uint64_t done = 0;
	int r;

	g->n = 0;
	g->short_bytes = 0;
	/* Chunks handed out by one call are marked with its serial, so that each is granted
	 * once however many of its blocks the call takes. */
	serial++;
	for (; done < total; done++) {
		struct chunk *c;
		uint32_t index;

		r = pool_block_alloc(p, s->tenant, s->device,
		                     done < n_moments ? s->desc->moments_bytes : s->model->block_bytes,
		                     &c, &index);
		if (r < 0)
			goto rollback;
		refs[done] = (struct kvd_block_ref){ .chunk_id = c->id, .index = index };
		if (c->grant_serial == serial || chunk_has_holder(c, conn_id))
			continue;
		c->grant_serial = serial;
		if (g->n == g->max) {
			r = -E2BIG;
			done++;
			goto rollback;
		}
		g->chunks[g->n++] = c;
	}
	for (uint32_t i = 0; i < g->n; i++) {
		r = chunk_add_holder(g->chunks[i], conn_id);
		if (r < 0) {
			while (i-- > 0)
				pool_chunk_drop_holder(p, g->chunks[i], conn_id);
			goto rollback;
		}
	}
	return 0;

rollback:
	g->n = 0;
	/* What a round must free for it: every block still lacking comes from a new chunk
	 * (pool_block_alloc took the tenant's partial ones first). */
	if (r == -ENOSPC || r == -EDQUOT)
		g->short_bytes = DIV_ROUND_UP(total - done, p->chunk_bytes /
		                                   ALIGN_TO(s->model->block_bytes, LAYOUT_BLOCK_ALIGN)) *
		                      p->chunk_bytes;
	seq_blocks_free(p, refs, done, emptied);
	return r;
}

void seq_alloc_undo(struct pool *p, uint64_t conn_id, const struct kvd_block_ref *refs,
                    uint64_t n, struct seq_granted *g, struct seq_emptied *emptied) {
	for (uint32_t i = 0; i < g->n; i++)
		pool_chunk_drop_holder(p, g->chunks[i], conn_id);
	g->n = 0;
	seq_blocks_free(p, refs, n, emptied);
}

int seq_grow(struct seq *s, struct pool *p, uint64_t conn_id, uint32_t n,
             struct seq_grants *grants, struct seq_emptied *emptied) {
	struct kvd_seq_desc *d = s->desc;
	uint32_t bt = d->block_tokens;
	_cleanup_(freep) struct kvd_block_ref *refs = NULL;
	/* The compensation blocks are the first `moments` of refs. */
	uint32_t moments = first_grow_moments(d);
	uint64_t total = moments, done;
	struct seq_granted g = { .chunks = grants->chunks, .max = ELEMENTSOF(grants->chunks) };
	int r;

	grants->n = 0;
	grants->short_bytes = 0;
	r = seq_grow_check(s, n);
	if (r < 0)
		return r;
	/* After an eviction the tables may hold different numbers of tokens: each grows from
	 * its own count, so each may need a different number of blocks, and one more for a
	 * shared last block it copies. */
	for (uint32_t t = 0; t < d->n_tables; t++)
		total += table_grow_blocks(d, desc_tokens(d)[t], n) + table_cow(s, p, t);
	if (total > 0) {
		refs = malloc(total * sizeof(*refs));
		if (!refs)
			return -ENOMEM;
	}
	r = seq_alloc_blocks(s, p, conn_id, moments, total, refs, &g, emptied);
	grants->short_bytes = g.short_bytes;
	if (r < 0)
		return r;
	/* A block may come from a chunk the tenant already used: the empty summary is 0
	 * (moments and latent headers alike start with count and head_dim). Written through
	 * the backend: on cuda the block is device memory. */
	if (moments > 0) {
		_cleanup_(freep) struct kvd_moments_header *empty = calloc(1, d->moments_bytes);

		r = empty ? 0 : -ENOMEM;
		if (empty)
			empty->head_dim = d->head_dim;
		for (uint32_t i = 0; r == 0 && i < moments; i++)
			r = p->ops->write(s->device, pool_block_addr(p, refs[i]), empty, d->moments_bytes);
		if (r < 0) {
			seq_alloc_undo(p, conn_id, refs, total, &g, emptied);
			return r;
		}
	}
	/* The copies of shared last blocks, each the first block a table takes. */
	done = moments;
	for (uint32_t t = 0; r == 0 && t < d->n_tables; t++) {
		uint32_t tokens = desc_tokens(d)[t];
		bool cow = table_cow(s, p, t);

		if (cow)
			r = p->ops->copy(s->device, pool_block_addr(p, refs[done]),
			                 pool_block_addr(p, desc_blocks(d, t)[tokens / bt]),
			                 s->model->block_bytes);
		done += cow + table_grow_blocks(d, tokens, n);
	}
	if (r < 0) {
		seq_alloc_undo(p, conn_id, refs, total, &g, emptied);
		return r;
	}
	grants->n = g.n;

	desc_write_begin(d);
	if (moments > 0) {
		memcpy(desc_moments(d), refs, moments * sizeof(*refs));
		d->moments_blocks = moments;
	}
	done = moments;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t *pos = desc_positions(d, t), tokens = desc_tokens(d)[t];
		uint32_t old_blocks = DIV_ROUND_UP(tokens, bt);
		uint32_t per = table_grow_blocks(d, tokens, n);

		/* Still what the copies found: each table's last block is its own to let go. */
		if (table_cow(s, p, t)) {
			struct kvd_block_ref *last = &desc_blocks(d, t)[old_blocks - 1];

			/* Lets go of the shared block (never its last holder: nothing empties). */
			pool_block_free(p, pool_chunk(p, last->chunk_id), last->index);
			*last = refs[done++];
		}
		/* A grow that stays inside the last blocks takes none, and refs may be NULL. */
		if (per > 0)
			memcpy(desc_blocks(d, t) + old_blocks, refs + done, per * sizeof(*refs));
		done += per;
		for (uint32_t i = 0; i < n; i++)
			pos[tokens + i] = d->next_position + i;
		desc_tokens(d)[t] = tokens + n;
	}
	d->next_position += n;
	desc_write_end(d);
	return 0;
}

int seq_fork(struct seq *s, const struct seq *parent, struct pool *p, uint64_t conn_id,
             struct seq_grants *grants, struct seq_emptied *emptied) {
	struct kvd_seq_desc *d = s->desc;
	const struct kvd_seq_desc *pd = parent->desc;
	const struct kvd_block_ref *pm = (const void *)((const char *)pd + pd->moments_offset);
	uint32_t bt = d->block_tokens, moments = pd->moments_blocks, shared = 0;
	struct seq_granted g = { .chunks = grants->chunks, .max = ELEMENTSOF(grants->chunks) };
	_cleanup_(freep) struct kvd_block_ref *refs = NULL;
	uint64_t total = moments, done;
	int r = 0;

	grants->n = 0;
	grants->short_bytes = 0;
	if (s->model != parent->model)
		return -EINVAL;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		if (layout_tokens(pd)[t] > d->max_tokens)
			return -EFBIG;
		total += layout_tokens(pd)[t] % bt != 0;
	}
	refs = malloc(MAX(total, 1u) * sizeof(*refs));
	if (!refs)
		return -ENOMEM;
	/* The new blocks: copies of the moments and of each table's partly filled last block,
	 * which both sequences' next grows write. */
	r = seq_alloc_blocks(s, p, conn_id, moments, total, refs, &g, emptied);
	grants->short_bytes = g.short_bytes;
	if (r < 0)
		return r;
	for (uint32_t i = 0; r == 0 && i < moments; i++)
		r = p->ops->copy(s->device, pool_block_addr(p, refs[i]),
		                 pool_block_addr(p, pm[i]), d->moments_bytes);
	done = moments;
	for (uint32_t t = 0; r == 0 && t < d->n_tables; t++) {
		uint32_t tokens = layout_tokens(pd)[t];

		if (tokens % bt != 0)
			r = p->ops->copy(s->device, pool_block_addr(p, refs[done++]),
			                 pool_block_addr(p, layout_blocks(pd, t)[tokens / bt]),
			                 s->model->block_bytes);
	}
	/* The full blocks are shared: held by both, written by neither. */
	for (uint32_t t = 0; r == 0 && t < d->n_tables; t++)
		for (uint32_t b = 0; r == 0 && b < layout_tokens(pd)[t] / bt; b++, shared++)
			r = pool_block_share(p, layout_blocks(pd, t)[b]);
	if (r < 0) {
		/* Gives back the holds taken, table by table in the same order. */
		for (uint32_t t = 0; shared > 0 && t < d->n_tables; t++)
			for (uint32_t b = 0; shared > 0 && b < layout_tokens(pd)[t] / bt; b++, shared--) {
				struct kvd_block_ref ref = layout_blocks(pd, t)[b];

				pool_block_free(p, pool_chunk(p, ref.chunk_id), ref.index);
			}
		seq_alloc_undo(p, conn_id, refs, total, &g, emptied);
		return r;
	}
	grants->n = g.n;

	desc_write_begin(d);
	memcpy(desc_moments(d), refs, moments * sizeof(*refs));
	d->moments_blocks = moments;
	done = moments;
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t tokens = layout_tokens(pd)[t], full = tokens / bt;

		memcpy(desc_blocks(d, t), layout_blocks(pd, t), full * sizeof(*refs));
		if (tokens % bt != 0)
			desc_blocks(d, t)[full] = refs[done++];
		memcpy(desc_positions(d, t), layout_positions(pd, t), tokens * sizeof(uint32_t));
		desc_tokens(d)[t] = tokens;
	}
	d->next_position = pd->next_position;
	s->written_pos = parent->written_pos;
	desc_write_end(d);
	return 0;
}

/* Lets go of the first `shared` blocks that seq_attach_prefix took, block by block over
 * the tables, and of the holds of list[from, *n). */
static void attach_undo(struct pool *p, const struct prefix_hit *hits, uint32_t n_tables,
                        uint64_t shared, uint64_t conn_id, struct chunk **list, uint32_t from,
                        uint32_t *n) {
	for (uint32_t b = 0; shared > 0; b++)
		for (uint32_t t = 0; shared > 0 && t < n_tables; t++, shared--) {
			struct kvd_block_ref ref = prefix_hit_ref(&hits[b], t, b);

			pool_block_free(p, pool_chunk(p, ref.chunk_id), ref.index);
		}
	while (*n > from)
		pool_chunk_drop_holder(p, list[--*n], conn_id);
}

int seq_attach_prefix(struct seq *s, struct prefix_index *x, struct pool *p, uint64_t conn_id,
                      uint32_t max, struct chunk **list, uint32_t *n, uint32_t *ret_found,
                      uint32_t *ret_cached) {
	struct kvd_seq_desc *d = s->desc;
	uint32_t bt = d->block_tokens, found = 0, from = *n, cached = 0;
	_cleanup_(freep) struct prefix_hit *hits = NULL;
	struct prefix_who who = prefix_who_of(s);
	uint64_t shared = 0;
	int r = 0;

	*ret_found = *ret_cached = 0;
	max = MIN(max, s->prefix.n);
	if (max == 0)
		return 0;
	hits = malloc(max * sizeof(*hits));
	if (!hits)
		return -ENOMEM;
	/* Keys chain: past the first miss nothing can match. */
	while (found < max && prefix_find(x, &who, found, s->prefix.keys[found],
	                                  found ? &hits[found - 1] : NULL, &hits[found]))
		cached += hits[found++].cached != NULL;
	for (uint32_t b = 0; r == 0 && b < found; b++)
		for (uint32_t t = 0; r == 0 && t < d->n_tables; t++) {
			struct kvd_block_ref ref = prefix_hit_ref(&hits[b], t, b);
			struct chunk *c = pool_chunk(p, ref.chunk_id);

			r = pool_block_share(p, ref);
			if (r < 0)
				break;
			shared++;
			if (chunk_has_holder(c, conn_id))
				continue;
			r = chunk_add_holder(c, conn_id);
			if (r == 0)
				list[(*n)++] = c;
		}
	if (r < 0) {
		attach_undo(p, hits, d->n_tables, shared, conn_id, list, from, n);
		return r;
	}
	for (uint32_t b = found; b-- > 0;)
		prefix_used(x, &hits[b]);

	desc_write_begin(d);
	for (uint32_t t = 0; t < d->n_tables; t++) {
		uint32_t *pos = desc_positions(d, t);

		for (uint32_t b = 0; b < found; b++)
			desc_blocks(d, t)[b] = prefix_hit_ref(&hits[b], t, b);
		for (uint32_t i = 0; i < found * bt; i++)
			pos[i] = i;
		desc_tokens(d)[t] = found * bt;
	}
	d->next_position = found * bt;
	s->written_pos = found * bt;
	desc_write_end(d);
	/* Its own entries, so that the blocks stay found when the sequences it found them in
	 * go; without memory for them they are found there only, which costs no correctness. */
	(void)prefix_publish(x, s, found);
	*ret_found = found;
	*ret_cached = cached;
	return 0;
}

int seq_truncate(struct seq *s, struct pool *p, uint32_t n, struct seq_emptied *emptied) {
	struct kvd_seq_desc *d = s->desc;
	uint32_t bt = d->block_tokens, end;

	if (n == 0 || n > d->next_position)
		return -EINVAL;
	end = d->next_position - n;
	desc_write_begin(d);
	for (uint32_t t = 0; t < d->n_tables; t++) {
		const uint32_t *pos = desc_positions(d, t);
		uint32_t tokens = desc_tokens(d)[t], keep = tokens;

		/* A table's slots are in position order: the dropped ones are its last. */
		while (keep > 0 && pos[keep - 1] >= end)
			keep--;
		seq_blocks_free(p, desc_blocks(d, t) + DIV_ROUND_UP(keep, bt),
		                DIV_ROUND_UP(tokens, bt) - DIV_ROUND_UP(keep, bt), emptied);
		desc_tokens(d)[t] = keep;
	}
	d->next_position = end;
	s->written_pos = MIN(s->written_pos, end);
	desc_write_end(d);
	/* The blocks from the first one the truncate reaches into will hold other tokens. */
	prefix_forget(s, end / bt);
	/* Plans and rounds made before no longer fit its tables (evict.h). */
	s->epoch++;
	return 0;
}

void seq_free(struct seq *s, struct pool *p, struct seq_emptied *emptied) {
	struct kvd_seq_desc *d;

	if (!s)
		return;
	d = s->desc;
	if (s->prefix.index)
		prefix_retire(s->prefix.index, s, p, emptied);
	prefix_forget(s, 0);
	group_leave(s);
	for (uint32_t t = 0; t < d->n_tables; t++)
		seq_blocks_free(p, desc_blocks(d, t), DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens),
		            emptied);
	seq_blocks_free(p, desc_moments(d), d->moments_blocks, emptied);
	/* One smooth[] entry per table; read n_tables before the descriptor goes. */
	if (s->smooth) {
		for (uint32_t t = 0; t < d->n_tables; t++)
			free(s->smooth[t]);
		free(s->smooth);
	}
	free(s->smooth_cap);
	munmap(d, d->total_bytes);
	safe_close(s->desc_fd);
	safe_close(s->obs_fd);
	free(s);
}

static const void *daemon_block_addr(void *userdata, struct kvd_block_ref ref) {
	return pool_block_addr(userdata, ref);
}

int seq_digest(const struct seq *s, struct pool *p, uint64_t *ret_digest, uint64_t *ret_bytes) {
	return layout_digest(s->desc, s->desc, daemon_block_addr, p, ret_digest, ret_bytes);
}

uint32_t seq_shared_slots(const struct seq *s, const struct pool *p, uint32_t t) {
	const struct kvd_seq_desc *d = s->desc;
	const struct kvd_block_ref *blocks = layout_blocks(d, t);
	uint32_t tokens = layout_tokens(d)[t];

	/* Each round's snapshot and each tick's offload ask: without a fork, no walk. */
	if (p->shared_bytes == 0)
		return 0;
	for (uint32_t b = DIV_ROUND_UP(tokens, d->block_tokens); b > 0; b--)
		if (pool_block_shared(p, blocks[b - 1]))
			return MIN(b * d->block_tokens, tokens);
	return 0;
}

uint64_t seq_shared_bytes(const struct seq *s, const struct pool *p) {
	const struct kvd_seq_desc *d = s->desc;
	uint64_t n = 0;

	for (uint32_t t = 0; t < d->n_tables; t++)
		for (uint32_t b = 0; b < DIV_ROUND_UP(layout_tokens(d)[t], d->block_tokens); b++)
			n += pool_block_shared(p, layout_blocks(d, t)[b]);
	return n * s->model->block_bytes;
}

bool seq_shares(const struct seq *s, const struct pool *p) {
	for (uint32_t t = 0; t < s->desc->n_tables; t++)
		if (seq_shared_slots(s, p, t) > 0)
			return true;
	return false;
}

uint64_t seq_resident_bytes(const struct seq *s) {
	struct kvd_seq_desc *d = s->desc;
	uint64_t blocks = d->moments_blocks ? (uint64_t)d->moments_blocks * d->moments_bytes : 0;

	for (uint32_t t = 0; t < d->n_tables; t++)
		blocks += (uint64_t)DIV_ROUND_UP(desc_tokens(d)[t], d->block_tokens) * d->block_bytes;
	return blocks;
}
