/* SPDX-License-Identifier: MIT */
/*
 * libkvd, paged block tables (kvd_model_block_pool, kvd_seq_block_table): a sequence's
 * blocks as int32 indices from one base per connection, the shape paged-attention kernels
 * take. The base is the connection's range (range.h on host pools, cuda-import.h on GPU
 * pools), where chunk id i sits at base + i * chunk_bytes: with a block stride that divides
 * the chunk size, block `index` of chunk `id` is index id * (chunk_bytes / stride) + index.
 */

#include <errno.h>

#include "basic/macro.h"
#include "client-internal.h"
#include "common/layout.h"
#include "cuda-import.h"
#include "kvd/kvd.h"
#include "range.h"

/* How often a table is read again while the daemon rewrites the descriptor before the
 * caller is told to pin the sequence: a rewrite takes microseconds, so this is plenty. */
#define TABLE_READ_TRIES 1000

/* The connection's range: its base and bytes, or NULL when it has none. */
static char *client_range(const kvd_client *c, uint64_t *ret_bytes) {
	if (c->cuda) {
		*ret_bytes = c->pool_bytes;
		return client_cuda_base(c->cuda);
	}
	if (c->range) {
		*ret_bytes = c->pool_bytes;
		return client_range_base(c->range);
	}
	return NULL;
}

/* The index geometry of blocks of stride bytes: chunk id's block `index` is id * per_chunk +
 * index. Returns 0, -EOPNOTSUPP (no range, or a stride that does not divide the chunk
 * size), -EOVERFLOW (more indices than an int32 holds). */
static int pool_geometry(const kvd_client *c, uint64_t stride, char **ret_base,
                         uint64_t *ret_per_chunk, uint32_t *ret_blocks) {
	uint64_t bytes = 0;
	char *base = client_range(c, &bytes);

	if (!base)
		return client_refuse(c, -EOPNOTSUPP, "this client maps no contiguous range of the "
		                    "pool (a daemon without one, or a GPU pool without a libkvd "
		                    "range): no block indices");
	if (stride == 0 || c->chunk_bytes % stride != 0)
		return client_refuse(c, -EOPNOTSUPP, "blocks of %llu bytes (the model's, aligned to "
		                    "%d) do not divide the chunk size of %llu bytes, so the pool is "
		                    "no array of equal blocks: register a shape whose aligned block "
		                    "size divides it (powers of two do)", (unsigned long long)stride,
		                    LAYOUT_BLOCK_ALIGN, (unsigned long long)c->chunk_bytes);
	if (bytes / stride > INT32_MAX)
		return -EOVERFLOW;
	*ret_base = base;
	*ret_per_chunk = c->chunk_bytes / stride;
	if (ret_blocks)
		*ret_blocks = (uint32_t)(bytes / stride);
	return 0;
}

static int do_model_block_pool(kvd_client *c, int model_id, void **ret_base, uint64_t *ret_stride,
                         uint32_t *ret_blocks) {
	const struct model *m;
	uint64_t stride, per_chunk;
	char *base;
	int r;

	if (!c || !ret_base || !ret_stride)
		return -EINVAL;
	if (client_forked(c))
		return -ECHILD;
	m = model_find(c, model_id);
	if (!m)
		return -EINVAL;
	/* A daemon that did not say its block size lays blocks out some way we cannot know. */
	if (m->block_bytes == 0)
		return -EOPNOTSUPP;
	stride = ALIGN_TO(m->block_bytes, LAYOUT_BLOCK_ALIGN);
	r = pool_geometry(c, stride, &base, &per_chunk, ret_blocks);
	if (r < 0)
		return r;
	*ret_base = base;
	*ret_stride = stride;
	return 0;
}

int kvd_model_block_pool(kvd_client *c, int model_id, void **ret_base, uint64_t *ret_stride,
                         uint32_t *ret_blocks) {
	return (int)call_result(client_key(c), do_model_block_pool(c, model_id, ret_base, ret_stride, ret_blocks), __func__);
}

/* One reading of the table, which the caller checks against the generation. */
static int table_read(const kvd_seq *s, uint32_t t, const char *base, uint64_t per_chunk,
                      int32_t *blocks, uint32_t max_blocks, uint32_t *positions,
                      uint32_t max_positions) {
	const struct kvd_seq_desc *d = &s->hdr;
	const kvd_client *c = s->client;
	const struct kvd_block_ref *refs = layout_blocks_at(d, s->desc, t);
	uint32_t n = __atomic_load_n(&layout_tokens_at(d, s->desc)[t], __ATOMIC_RELAXED), nb;
	uint32_t last_chunk = UINT32_MAX;

	if (n > d->max_tokens)
		return -EPROTO;
	nb = DIV_ROUND_UP(n, d->block_tokens);
	if (nb > max_blocks || (positions && n > max_positions))
		return -ENOBUFS;
	for (uint32_t i = 0; i < nb; i++) {
		struct kvd_block_ref ref = refs[i];

		if (ref.index >= per_chunk)
			return -EPROTO;
		/* Each chunk once per run of its blocks: it must sit at its place in the range
		 * (not a chunk mapped elsewhere after a hole, range.h). */
		if (ref.chunk_id != last_chunk) {
			uint64_t at = (uint64_t)ref.chunk_id * c->chunk_bytes;

			if (chunk_addr(c, ref.chunk_id, NULL) != base + at)
				return -EFAULT;
			last_chunk = ref.chunk_id;
		}
		blocks[i] = (int32_t)(ref.chunk_id * per_chunk + ref.index);
	}
	if (positions)
		memcpy(positions, layout_positions_at(d, s->desc, t), (size_t)n * sizeof(*positions));
	return (int)n;
}

static int do_seq_block_table(kvd_seq *s, uint32_t layer, uint32_t kv_head, int32_t *blocks,
                        uint32_t max_blocks, uint32_t *positions, uint32_t max_positions,
                        uint64_t *ret_generation) {
	const struct kvd_seq_desc *d;
	uint64_t per_chunk;
	char *base;
	int r;

	if (!s || (!blocks && max_blocks > 0) || (!positions && max_positions > 0))
		return -EINVAL;
	if (seq_forked(s))
		return -ECHILD;
	if (seq_stale(s))
		return -ESTALE;
	d = &s->hdr;
	if (layer >= d->layers || kv_head >= d->kv_heads ||
	    (d->layout == KVD_LAYOUT_PER_LAYER && kv_head != 0))
		return client_refuse(s->client, -EINVAL, "layer %u, kv head %u: the sequence's "
		                    "tables are of layers 0..%u and kv heads 0..%u", layer, kv_head,
		                    d->layers - 1,
		                    d->layout == KVD_LAYOUT_PER_LAYER ? 0 : d->kv_heads - 1);
	r = pool_geometry(s->client, s->block_stride, &base, &per_chunk, NULL);
	if (r < 0)
		return r;
	/* A sequence lock (see the descriptor): a copy made while the generation is even and
	 * unchanged is one the daemon did not touch. */
	for (unsigned try = 0; try < TABLE_READ_TRIES; try++) {
		uint64_t g = __atomic_load_n(&s->desc->generation, __ATOMIC_ACQUIRE);

		if (g % 2 != 0)
			continue;
		r = table_read(s, layout_table(d, layer, kv_head), base, per_chunk, blocks,
		               max_blocks, positions, max_positions);
		__atomic_thread_fence(__ATOMIC_ACQUIRE);
		if (__atomic_load_n(&s->desc->generation, __ATOMIC_RELAXED) != g)
			continue;
		if (r >= 0 && ret_generation)
			*ret_generation = g;
		if (r == -ENOBUFS) {
			uint32_t n = layout_tokens_at(d, s->desc)[layout_table(d, layer, kv_head)];

			return client_refuse(s->client, r, "the table holds %u tokens in %u blocks; the "
			                    "buffers have room for %u blocks%s", n,
			                    DIV_ROUND_UP(n, d->block_tokens), max_blocks,
			                    positions ? " and a position per token" : "");
		}
		return r;
	}
	return -EAGAIN;
}

int kvd_seq_block_table(kvd_seq *s, uint32_t layer, uint32_t kv_head, int32_t *blocks,
                        uint32_t max_blocks, uint32_t *positions, uint32_t max_positions,
                        uint64_t *ret_generation) {
	uint64_t key = s ? client_key(s->client) : 0;

	return (int)call_result(key, do_seq_block_table(s, layer, kv_head, blocks, max_blocks, positions, max_positions, ret_generation), __func__);
}

static int do_seq_block_tables(kvd_seq *const *seqs, uint32_t n, uint32_t first_layer,
                               uint32_t layers, uint32_t kv_head, int32_t *tables,
                               uint32_t width, int32_t *seq_lens) {
	int widest = 0;

	if (!seqs || n == 0 || layers == 0 || !tables || width == 0 || !seq_lens ||
	    first_layer + (uint64_t)layers > UINT32_MAX)
		return -EINVAL;
	for (uint32_t l = 0; l < layers; l++)
		for (uint32_t i = 0; i < n; i++) {
			int32_t *row = tables + ((size_t)l * n + i) * width;
			int r = do_seq_block_table(seqs[i], first_layer + l, kv_head, row, width, NULL,
			                           0, NULL);
			uint32_t nb;

			if (r < 0)
				return r;
			nb = DIV_ROUND_UP((uint32_t)r, seqs[i]->hdr.block_tokens);
			memset(row + nb, 0, (size_t)(width - nb) * sizeof(*row));
			seq_lens[(size_t)l * n + i] = r;
			widest = MAX(widest, (int)nb);
		}
	return widest;
}

int kvd_seq_block_tables(kvd_seq *const *seqs, uint32_t n, uint32_t first_layer, uint32_t layers,
                         uint32_t kv_head, int32_t *tables, uint32_t width, int32_t *seq_lens) {
	uint64_t key = seqs && n > 0 && seqs[0] ? client_key(seqs[0]->client) : 0;

	return (int)call_result(key, do_seq_block_tables(seqs, n, first_layer, layers, kv_head, tables,
	                                                 width, seq_lens), __func__);
}
