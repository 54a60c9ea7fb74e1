/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "compact.h"
#include "round-gpu.h"

static void block_free(struct pool *p, struct kvd_block_ref ref, struct seq_emptied *emptied) {
	struct chunk *c = pool_chunk(p, ref.chunk_id);

	if (pool_block_free(p, c, ref.index))
		emptied->chunks[emptied->n++] = c;
}

static int drops_check(const struct kvd_seq_desc *d, const struct compact_drop *drops,
                       uint32_t n_drops) {
	_cleanup_(freep) uint64_t *seen = NULL;

	seen = calloc(DIV_ROUND_UP(d->n_tables, 64), sizeof(*seen));
	if (!seen)
		return -ENOMEM;
	for (uint32_t i = 0; i < n_drops; i++) {
		const struct compact_drop *x = &drops[i];
		uint64_t bit;
		uint32_t tokens;

		if (x->table >= d->n_tables)
			return -EINVAL;
		bit = UINT64_C(1) << (x->table % 64);
		if (seen[x->table / 64] & bit)
			return -EINVAL;
		seen[x->table / 64] |= bit;
		tokens = layout_tokens(d)[x->table];
		/* Strictly ascending and below tokens also bounds n by tokens. */
		for (uint32_t j = 0; j < x->n; j++)
			if (x->slots[j] >= tokens || (j > 0 && x->slots[j] <= x->slots[j - 1]))
				return -EINVAL;
	}
	return 0;
}

/* Survivors that move together: n consecutive rows of src from src_row, to consecutive
 * rows of dst from dst_row, ranges that do not overlap. */
struct row_run {
	char *dst;
	const char *src;
	uint32_t dst_row, src_row, n;
};

/* Copies a run's K and V rows (with the per-layer layout, the rows of every kv head) and
 * index keys, which belong to the tokens as much as their K and V do, through the backend.
 * A block holds its heads' K then their V at a pitch of block_tokens rows, so the run's rows
 * of every head and half are one copy_rows: a device pool (one driver call each) pays per
 * run, not per slot or head. Returns 0 or the backend's -errno. */
static int run_copy(const struct kvd_seq_desc *d, const struct pool *p, uint32_t device,
                    const struct row_run *u) {
	uint32_t heads = d->layout == KVD_LAYOUT_PER_HEAD ? 1 : d->kv_heads;
	uint64_t pitch = (uint64_t)d->block_tokens * layout_row_bytes(d);
	int r;

	/* layout_v_offset(h) is layout_k_offset(heads + h): K and V rows share the pitch. */
	r = p->ops->copy_rows(device, u->dst + layout_k_offset(d, 0, u->dst_row),
	                      u->src + layout_k_offset(d, 0, u->src_row), pitch,
	                      (uint64_t)u->n * layout_row_bytes(d), 2 * heads);
	if (r >= 0 && d->index_dim)
		r = p->ops->copy(device, u->dst + layout_index_offset(d, u->dst_row),
		                 u->src + layout_index_offset(d, u->src_row),
		                 (uint64_t)u->n * layout_index_row_bytes(d));
	return r;
}

/* Copies the pending run, if any, and empties it; the first failure goes to *copy_error. */
static void run_flush(const struct kvd_seq_desc *d, const struct pool *p, uint32_t device,
                      struct row_run *u, int *copy_error) {
	int e = u->n > 0 ? run_copy(d, p, device, u) : 0;

	if (e < 0 && *copy_error == 0)
		*copy_error = e;
	u->n = 0;
}

/* Adds the move of row src_row of src to row dst_row of dst to the pending run, copying
 * the run first when the row does not extend it. */
static void run_add(const struct kvd_seq_desc *d, const struct pool *p, uint32_t device,
                    struct row_run *run, char *dst, uint32_t dst_row, const char *src,
                    uint32_t src_row, int *copy_error) {
	if (run->n == 0 || run->src != src || run->dst != dst || run->src_row + run->n != src_row ||
	    run->dst_row + run->n != dst_row || (dst == src && run->dst_row + run->n >= run->src_row)) {
		run_flush(d, p, device, run, copy_error);
		*run = (struct row_run){ .dst = dst, .src = src, .dst_row = dst_row, .src_row = src_row };
	}
	run->n++;
}

/* Moves kept slots keep[0..n_keep) of blocks[0..nb) to slots 0..n_keep-1 with gpu's
 * gather (round-gpu.h), or, where the GPU could not start it (its memory), with runs of
 * copies in the same ascending order; the first failure goes to *copy_error. */
static void device_gather(const struct kvd_seq_desc *d, struct pool *p, uint32_t device,
                          struct round_gpu *gpu, const struct kvd_block_ref *blocks, uint32_t nb,
                          const uint32_t *keep, uint32_t n_keep, int *copy_error) {
	const struct kvd_gather_table t = {
		.block_tokens = d->block_tokens,
		.heads = d->layout == KVD_LAYOUT_PER_HEAD ? 1 : d->kv_heads,
		.row_bytes = layout_row_bytes(d),
		.v_offset = layout_kv_bytes(d) / 2,
	};
	uint32_t bt = d->block_tokens;
	_cleanup_(freep) uint8_t **addr = malloc(MAX(nb, 1u) * sizeof(*addr));
	struct row_run run = {};
	bool launched = false;
	int e = -ENOMEM;

	if (addr) {
		for (uint32_t b = 0; b < nb; b++)
			addr[b] = pool_block_addr(p, blocks[b]);
		e = round_gpu_gather(gpu, &t, addr, nb, keep, n_keep, &launched);
	}
	if (e >= 0)
		return;
	if (launched || !addr) {
		if (*copy_error == 0)
			*copy_error = e;
		return;
	}
	for (uint32_t j = 0; j < n_keep; j++)
		if (keep[j] != j)
			run_add(d, p, device, &run, (char *)addr[j / bt], j % bt,
			        (const char *)addr[keep[j] / bt], keep[j] % bt, copy_error);
	run_flush(d, p, device, &run, copy_error);
}

/*
 * Compacts one table in place, in one forward pass over its blocks. A block whose slots
 * are all dropped is unlinked from the list and freed: the later blocks move up one entry,
 * so their slots renumber down by a whole block with rows unchanged, and no byte moves for
 * it. Within the kept blocks, survivor r (the i-th surviving slot) goes to slot w = i.
 * w never passes r's slot in the shortened list (each unlinked block held block_tokens
 * dropped slots, since only the last block can be short), so every write lands on a row
 * already read, in a list entry already final: the pass is safe in place. Moves are
 * gathered into runs of consecutive rows, each copied before any later row is written (and
 * cut where source and destination would overlap), which keeps that order. Blocks past the
 * new end are freed last. Returns the number of blocks freed; the first copy that failed,
 * if any, in *copy_error (the pass goes on, so that the tables stay consistent).
 */
static uint64_t table_compact(struct kvd_seq_desc *d, struct pool *p, uint32_t device,
                              struct round_gpu *gpu, const struct compact_drop *x, float *side,
                              struct seq_emptied *emptied, int *copy_error) {
	uint32_t bt = d->block_tokens, tokens = desc_tokens(d)[x->table];
	uint32_t nb = DIV_ROUND_UP(tokens, bt), kept = 0, w = 0, j = 0, new_nb;
	uint32_t *pos = desc_positions(d, x->table);
	struct kvd_block_ref *blocks = desc_blocks(d, x->table);
	struct row_run run = {};
	uint64_t freed = 0;
	/* With gpu the pass only lists where each survivor was (keep, numbered in the
	 * shortened list), and one gather on the device moves them all after it; index keys,
	 * which the kernel does not move, keep the runs. */
	_cleanup_(freep) uint32_t *keep = gpu && !d->index_dim ? malloc(tokens * sizeof(uint32_t))
	                                                       : NULL;

	if (x->n == 0)
		return 0;
	for (uint32_t b = 0; b < nb; b++) {
		uint32_t lo = b * bt, hi = lo + MIN(bt, tokens - lo), first = j;
		const char *src;

		while (j < x->n && x->slots[j] < hi)
			j++;
		if (j - first == hi - lo) {
			block_free(p, blocks[b], emptied);
			freed++;
			continue;
		}
		blocks[kept] = blocks[b];
		src = pool_block_addr(p, blocks[kept]);
		for (uint32_t r = lo, k = first; r < hi; r++) {
			if (k < j && x->slots[k] == r) {
				k++;
				continue;
			}
			if (keep) {
				keep[w] = kept * bt + (r - lo);
			} else if (w != kept * bt + (r - lo)) {
				run_add(d, p, device, &run, pool_block_addr(p, blocks[w / bt]), w % bt,
				        src, r - lo, copy_error);
			}
			pos[w] = pos[r];
			if (side)
				side[w] = side[r];
			w++;
		}
		kept++;
	}
	run_flush(d, p, device, &run, copy_error);
	if (keep)
		device_gather(d, p, device, gpu, blocks, kept, keep, w, copy_error);
	new_nb = DIV_ROUND_UP(w, bt);
	for (uint32_t b = new_nb; b < kept; b++)
		block_free(p, blocks[b], emptied);
	freed += kept - new_nb;
	desc_tokens(d)[x->table] = w;
	return freed;
}

int seq_compact(struct seq *s, struct pool *p, struct round_gpu *gpu, const struct compact_drop *drops,
                uint32_t n_drops, float *const *side, struct seq_emptied *emptied,
                uint64_t *ret_freed_blocks, int *ret_copy_error) {
	struct kvd_seq_desc *d = s->desc;
	uint64_t freed = 0;
	int r, copy_error = 0;

	if (ret_copy_error)
		*ret_copy_error = 0;
	if (n_drops == 0) {
		if (ret_freed_blocks)
			*ret_freed_blocks = 0;
		return 0;
	}
	r = drops_check(d, drops, n_drops);
	if (r < 0)
		return r;

	desc_write_begin(d);
	for (uint32_t i = 0; i < n_drops; i++)
		freed += table_compact(d, p, s->device, gpu, &drops[i],
		                       side ? side[drops[i].table] : NULL, emptied, &copy_error);
	desc_write_end(d);
	s->epoch++;
	if (ret_freed_blocks)
		*ret_freed_blocks = freed;
	if (ret_copy_error)
		*ret_copy_error = copy_error;
	return 0;
}

/* Where a block of a movable sequence is listed: seqs[seq]'s table `table`, entry `entry`. */
struct block_owner {
	uint32_t seq, table, entry;
};

struct block_move {
	struct chunk *dest;
	uint32_t index;
};

static int chunk_cmp_emptiest(const void *a, const void *b) {
	const struct chunk *x = *(struct chunk *const *)a, *y = *(struct chunk *const *)b;

	if (x->used_blocks != y->used_blocks)
		return x->used_blocks < y->used_blocks ? -1 : 1;
	return x->id < y->id ? -1 : x->id > y->id;
}

static int chunk_cmp_fullest(const void *a, const void *b) {
	const struct chunk *x = *(struct chunk *const *)a, *y = *(struct chunk *const *)b;

	if (x->used_blocks != y->used_blocks)
		return x->used_blocks > y->used_blocks ? -1 : 1;
	return x->id < y->id ? -1 : x->id > y->id;
}

/*
 * Walks the blocks of seqs that lie in chunks of t, but for shared ones, which never move
 * (a chunk holding one is never emptied here). Without owners, counts them per chunk
 * id into count[]. With owners, files each block of a source chunk (one with entries
 * start[id] to start[id + 1]) there, with count[] (zeroed by the caller) as the cursor.
 */
static void blocks_walk(struct pool *p, const struct tenant *t, struct seq *const *seqs,
                        uint32_t n_seqs, uint32_t *count, const uint64_t *start,
                        struct block_owner *owners) {
	for (uint32_t i = 0; i < n_seqs; i++) {
		const struct kvd_seq_desc *d = seqs[i]->desc;

		for (uint32_t tab = 0; tab < d->n_tables; tab++) {
			const struct kvd_block_ref *blocks = layout_blocks(d, tab);
			uint32_t nb = DIV_ROUND_UP(layout_tokens(d)[tab], d->block_tokens);

			for (uint32_t e = 0; e < nb; e++) {
				const struct chunk *c = pool_chunk(p, blocks[e].chunk_id);

				if (c->owner != t || pool_block_shared(p, blocks[e]))
					continue;
				if (owners) {
					if (start[c->id] == start[c->id + 1])
						continue;
					owners[start[c->id] + count[c->id]] =
						(struct block_owner){ .seq = i, .table = tab, .entry = e };
				}
				count[c->id]++;
			}
		}
	}
}

/*
 * Reserves a block in dests (fullest first) for each of the n blocks of a source chunk,
 * in a chunk that the block's connection holds. All or nothing: on failure what was
 * reserved is given back, and since every destination keeps blocks of its own, none of
 * them empties.
 */
static bool moves_reserve(struct pool *p, struct seq *const *seqs, const struct block_owner *o,
                          uint32_t n, struct chunk *const *dests, uint32_t n_dests,
                          struct block_move *moves) {
	for (uint32_t i = 0; i < n; i++) {
		uint64_t conn = seqs[o[i].seq]->conn_id;
		uint32_t k;

		for (k = 0; k < n_dests; k++)
			if (chunk_has_holder(dests[k], conn) &&
			    pool_block_alloc_in(p, dests[k], &moves[i].index) == 0)
				break;
		if (k == n_dests) {
			while (i-- > 0)
				pool_block_free(p, moves[i].dest, moves[i].index);
			return false;
		}
		moves[i].dest = dests[k];
	}
	return true;
}

int compact_chunks(struct pool *p, struct tenant *t, struct seq *const *seqs, uint32_t n_seqs,
                   struct seq_emptied *emptied) {
	_cleanup_(freep) uint32_t *count = NULL;
	_cleanup_(freep) uint64_t *start = NULL;
	_cleanup_(freep) struct block_owner *owners = NULL;
	_cleanup_(freep) struct chunk **sources = NULL, **owned = NULL, **dests = NULL;
	_cleanup_(freep) struct block_move *moves = NULL;
	_cleanup_(freep) bool *received = NULL, *touched = NULL;
	uint32_t n_sources = 0, n_owned = 0, max_source = 0;
	int moved = 0;

	count = calloc(p->n_chunks, sizeof(*count));
	start = calloc((uint64_t)p->n_chunks + 1, sizeof(*start));
	if (!count || !start)
		return -ENOMEM;
	blocks_walk(p, t, seqs, n_seqs, count, NULL, NULL);
	/* A chunk can be emptied only if every block in it belongs to seqs. */
	for (uint32_t id = 0; id < p->n_chunks; id++) {
		const struct chunk *c = &p->chunks[id];
		bool source = count[id] > 0 && count[id] == c->used_blocks;

		if (c->state == CHUNK_OWNED && c->owner == t)
			n_owned++;
		if (source) {
			n_sources++;
			max_source = MAX(max_source, count[id]);
		}
		start[id + 1] = start[id] + (source ? count[id] : 0);
	}
	if (n_sources == 0)
		return 0;

	owners = malloc(start[p->n_chunks] * sizeof(*owners));
	sources = malloc(n_sources * sizeof(*sources));
	owned = malloc(n_owned * sizeof(*owned));
	dests = malloc(n_owned * sizeof(*dests));
	moves = malloc(max_source * sizeof(*moves));
	received = calloc(p->n_chunks, sizeof(*received));
	touched = calloc(n_seqs, sizeof(*touched));
	if (!owners || !sources || !owned || !dests || !moves || !received || !touched)
		return -ENOMEM;
	n_sources = n_owned = 0;
	for (uint32_t id = 0; id < p->n_chunks; id++) {
		struct chunk *c = &p->chunks[id];

		if (c->state == CHUNK_OWNED && c->owner == t)
			owned[n_owned++] = c;
		if (start[id] < start[id + 1])
			sources[n_sources++] = c;
	}
	memset(count, 0, p->n_chunks * sizeof(*count));
	blocks_walk(p, t, seqs, n_seqs, count, start, owners);

	qsort(sources, n_sources, sizeof(*sources), chunk_cmp_emptiest);
	for (uint32_t i = 0; i < n_sources; i++) {
		struct chunk *src = sources[i];
		const struct block_owner *o = owners + start[src->id];
		uint32_t n = start[src->id + 1] - start[src->id], n_dests = 0;

		/* A chunk that took blocks in is a source no more: its owner list predates them,
		 * and it was no emptier than the chunk they came from. */
		if (received[src->id])
			continue;
		/* No emptier than the source: the emptiest chunks are the ones to give back.
		 * Ties count, since moving either way empties one of the two. */
		for (uint32_t k = 0; k < n_owned; k++) {
			struct chunk *c = owned[k];

			if (c != src && c->block_bytes == src->block_bytes &&
			    c->mem.device == src->mem.device && c->used_blocks >= n &&
			    c->used_blocks < c->n_blocks)
				dests[n_dests++] = c;
		}
		qsort(dests, n_dests, sizeof(*dests), chunk_cmp_fullest);
		if (!moves_reserve(p, seqs, o, n, dests, n_dests, moves))
			continue;

		for (uint32_t k = 0; k < n; k++) {
			struct kvd_seq_desc *d = seqs[o[k].seq]->desc;
			struct kvd_block_ref *ref = &desc_blocks(d, o[k].table)[o[k].entry];
			struct kvd_block_ref to = { .chunk_id = moves[k].dest->id, .index = moves[k].index };

			/* One rewrite per sequence for the whole call: a reader retries until the
			 * last move is in. */
			if (!touched[o[k].seq]) {
				touched[o[k].seq] = true;
				desc_write_begin(d);
			}
			if (p->ops->copy(src->mem.device, pool_block_addr(p, to), pool_block_addr(p, *ref),
			                 src->block_bytes) < 0) {
				/* The block stays where it is (the source chunk is then not
				 * emptied); only a failing device copies nothing. */
				block_free(p, to, emptied);
				moved--;
				continue;
			}
			received[to.chunk_id] = true;
			block_free(p, *ref, emptied);
			*ref = to;
		}
		moved += n;
	}

	for (uint32_t i = 0; i < n_seqs; i++)
		if (touched[i]) {
			desc_write_end(seqs[i]->desc);
			seqs[i]->epoch++;
		}
	return moved;
}
