/* SPDX-License-Identifier: MIT */
/*
 * Compaction on the host backend: seq_compact() over random drops in both layouts, both
 * element sizes and several block sizes, checked row by row against a pattern keyed by each
 * slot's original position; whole blocks unlinked rather than copied; refused input that
 * changes nothing; growing tables of unequal length; and compact_chunks() packing blocks
 * into fewer chunks without ever handing a connection a chunk it does not hold; and token
 * recall's store and trades (recall.h): what rounds drop kept bit for bit with its
 * positions, traded back in position order with nothing allocated or freed.
 */

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "common/layout.h"
#include "basic/macro.h"
#include "compact.h"
#include "model.h"
#include "pool.h"
#include "recall.h"
#include "seq.h"
#include "tenant.h"
#include "test.h"
#include "tier.h"

#define DESC_MAX (UINT64_C(64) << 20)
/* Connection ids the tests use: 1 .. N_CONNS. */
#define N_CONNS 2

static uint64_t page, rng_state;

int test_setup(void) {
	page = (uint64_t)sysconf(_SC_PAGESIZE);
	return page > 0 ? 0 : -EINVAL;
}

/* splitmix64: seeded, so a failure replays. */
static uint64_t mix(uint64_t x) {
	x += UINT64_C(0x9e3779b97f4a7c15);
	x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
	return x ^ (x >> 31);
}

static uint32_t rng_below(uint32_t n) {
	rng_state = mix(rng_state);
	return (uint32_t)(rng_state % n);
}

struct fixture {
	struct pool *p;
	struct tenant_table tt;
	struct tenant *a;
	struct seq_emptied emptied;
};

static void fixture_init(struct fixture *f, uint64_t chunk, uint32_t n) {
	ASSERT_OK(pool_new(&backend_host_ops, 1, chunk * n, chunk, chunk * n, &f->p));
	ASSERT_OK(tenant_table_init(&f->tt, 4));
	ASSERT_OK(tenant_get(&f->tt, "a", &f->a));
	f->emptied.chunks = calloc(n, sizeof(*f->emptied.chunks));
	ASSERT_NOT_NULL(f->emptied.chunks);
	f->emptied.n = 0;
}

static void fixture_done(struct fixture *f) {
	pool_free(f->p);
	tenant_table_done(&f->tt);
	free(f->emptied.chunks);
}

/* Gives back the chunks in f->emptied; those still mapped drain until the test's
 * connections let go of them. */
static void reclaim_emptied(struct fixture *f) {
	for (uint32_t i = 0; i < f->emptied.n; i++) {
		struct chunk *c = f->emptied.chunks[i];

		ASSERT_EQ(c->used_blocks, 0u);
		if (pool_chunk_reclaim(f->p, c) > 0)
			for (uint64_t conn = 1; conn <= N_CONNS; conn++)
				pool_chunk_drop_holder(f->p, c, conn);
		ASSERT_EQ(c->state, CHUNK_FREE);
	}
	f->emptied.n = 0;
}

static struct model model_of(uint32_t layers, uint32_t kv, uint32_t hd, uint32_t dtype,
                             uint32_t bt, uint32_t layout) {
	uint64_t bytes = 2ull * bt * hd * layout_dtype_bytes(dtype);

	return (struct model){
		.layers = layers,
		.q_heads = kv,
		.kv_heads = kv,
		.head_dim = hd,
		.dtype = dtype,
		.block_tokens = bt,
		.layout = layout,
		.block_bytes = layout == KVD_LAYOUT_PER_HEAD ? bytes : bytes * kv,
		.n_tables = layout == KVD_LAYOUT_PER_HEAD ? layers * kv : layers,
	};
}

/* A sequence and what it should hold: expected positions and token counts per table, and
 * the side arrays handed to seq_compact (NULL for odd tables). */
struct tseq {
	struct seq *s;
	uint32_t n_tables, max_tokens;
	uint32_t *pos, *n;
	float **side;
};

static void tseq_new(struct fixture *f, struct tseq *q, uint64_t id, const struct model *m,
                     uint32_t max_tokens, uint64_t conn) {
	ASSERT_OK(seq_new(id, m, f->a, max_tokens, DESC_MAX, &q->s));
	q->s->conn_id = conn;
	q->n_tables = m->n_tables;
	q->max_tokens = max_tokens;
	q->pos = calloc((uint64_t)m->n_tables * max_tokens, sizeof(*q->pos));
	q->n = calloc(m->n_tables, sizeof(*q->n));
	q->side = calloc(m->n_tables, sizeof(*q->side));
	ASSERT_TRUE(q->pos && q->n && q->side);
	for (uint32_t t = 0; t < m->n_tables; t += 2) {
		q->side[t] = calloc(max_tokens, sizeof(float));
		ASSERT_NOT_NULL(q->side[t]);
	}
}

static void tseq_free(struct fixture *f, struct tseq *q) {
	seq_free(q->s, f->p, &f->emptied);
	for (uint32_t t = 0; t < q->n_tables; t++)
		free(q->side[t]);
	free(q->side);
	free(q->pos);
	free(q->n);
}

static uint32_t *tseq_pos(const struct tseq *q, uint32_t t) {
	return q->pos + (uint64_t)t * q->max_tokens;
}

static uint64_t tseq_blocks(const struct tseq *q) {
	uint64_t n = 0;

	for (uint32_t t = 0; t < q->n_tables; t++)
		n += DIV_ROUND_UP(q->n[t], q->s->desc->block_tokens);
	return n;
}

static uint64_t pattern(uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos, uint32_t kv,
                        uint32_t e) {
	uint64_t x = mix(seq);

	x = mix(x ^ layer);
	x = mix(x ^ head);
	x = mix(x ^ pos);
	x = mix(x ^ kv);
	return mix(x ^ e);
}

/* An element of esz bytes: write (fill) or read it back. */
static uint32_t element(char *at, uint32_t esz, uint64_t v, bool fill) {
	uint16_t h = (uint16_t)v;
	uint32_t w = (uint32_t)v;

	if (fill)
		memcpy(at, esz == 2 ? (void *)&h : (void *)&w, esz);
	memcpy(esz == 2 ? (void *)&h : (void *)&w, at, esz);
	return esz == 2 ? h : w;
}

/* Fills (fill) or checks the K and V rows of slot i of table t with the pattern of the
 * slot's original position. */
static void slot_rows(struct fixture *f, const struct seq *s, uint32_t t, uint32_t i, bool fill) {
	const struct kvd_seq_desc *d = s->desc;
	uint32_t bt = d->block_tokens, pos = layout_positions(d, t)[i];
	uint32_t esz = layout_dtype_bytes(d->dtype), per_head = d->layout == KVD_LAYOUT_PER_HEAD;
	uint32_t layer = per_head ? t / d->kv_heads : t;
	char *b = pool_block_addr(f->p, layout_blocks(d, t)[i / bt]);

	ASSERT_NOT_NULL(b);
	for (uint32_t h = 0; h < (per_head ? 1 : d->kv_heads); h++) {
		uint32_t head = per_head ? t % d->kv_heads : h;

		for (uint32_t kv = 0; kv < 2; kv++) {
			char *row = b + (kv ? layout_v_offset(d, h, i % bt) : layout_k_offset(d, h, i % bt));

			for (uint32_t e = 0; e < d->head_dim; e++) {
				uint64_t v = pattern(s->id, layer, head, pos, kv, e);
				uint32_t want = esz == 2 ? (uint16_t)v : (uint32_t)v;

				ASSERT_EQ(element(row + (uint64_t)e * esz, esz, v, fill), want);
			}
		}
	}
}

static void tseq_grow(struct fixture *f, struct tseq *q, uint32_t n) {
	struct kvd_seq_desc *d = q->s->desc;
	uint64_t gen = d->generation;
	uint32_t next = d->next_position;
	struct seq_grants g;

	ASSERT_OK(seq_grow(q->s, f->p, q->s->conn_id, n, &g, &f->emptied));
	ASSERT_EQ(d->generation, gen + 2);
	for (uint32_t t = 0; t < q->n_tables; t++) {
		for (uint32_t i = q->n[t]; i < q->n[t] + n; i++) {
			tseq_pos(q, t)[i] = next + (i - q->n[t]);
			if (q->side[t])
				q->side[t][i] = (float)tseq_pos(q, t)[i] + 0.5f;
			slot_rows(f, q->s, t, i, true);
		}
		q->n[t] += n;
	}
}

/* Everything the sequence holds is what it should: tokens, positions, side arrays, K/V
 * bytes, and blocks that are the tenant's, of the right size, in chunks its connection
 * holds, never two slots in one block. */
static void tseq_check(struct fixture *f, const struct tseq *q) {
	const struct kvd_seq_desc *d = q->s->desc;

	ASSERT_EQ(d->generation % 2, 0u);
	for (uint32_t t = 0; t < q->n_tables; t++) {
		uint32_t nb = DIV_ROUND_UP(q->n[t], d->block_tokens);

		ASSERT_EQ(layout_tokens(d)[t], q->n[t]);
		for (uint32_t i = 0; i < q->n[t]; i++) {
			ASSERT_EQ(layout_positions(d, t)[i], tseq_pos(q, t)[i]);
			if (i > 0)
				ASSERT_LT(layout_positions(d, t)[i - 1], layout_positions(d, t)[i]);
			if (q->side[t])
				ASSERT_TRUE(q->side[t][i] == (float)tseq_pos(q, t)[i] + 0.5f);
			slot_rows(f, q->s, t, i, false);
		}
		for (uint32_t b = 0; b < nb; b++) {
			struct kvd_block_ref r = layout_blocks(d, t)[b];
			const struct chunk *c = pool_chunk(f->p, r.chunk_id);

			ASSERT_NOT_NULL(pool_block_addr(f->p, r));
			ASSERT_TRUE(c->owner == q->s->tenant);
			ASSERT_EQ(c->block_bytes, d->block_bytes);
			ASSERT_TRUE(chunk_has_holder(c, q->s->conn_id));
			for (uint32_t b2 = 0; b2 < b; b2++) {
				struct kvd_block_ref o = layout_blocks(d, t)[b2];

				ASSERT_FALSE(o.chunk_id == r.chunk_id && o.index == r.index);
			}
		}
	}
}

/* The pool and the tenant account for exactly the blocks the sequences hold. */
static void check_accounting(struct fixture *f, struct tseq *const *qs, uint32_t n) {
	uint64_t bytes = 0;

	for (uint32_t i = 0; i < n; i++)
		bytes += tseq_blocks(qs[i]) * qs[i]->s->desc->block_bytes;
	ASSERT_EQ(f->p->block_bytes, bytes);
	ASSERT_EQ(f->a->block_bytes, bytes);
}

/* Removes the dropped slots from the expected state, as seq_compact should. */
static void tseq_apply(struct tseq *q, const struct compact_drop *drops, uint32_t n_drops) {
	for (uint32_t i = 0; i < n_drops; i++) {
		const struct compact_drop *x = &drops[i];
		uint32_t *pos = tseq_pos(q, x->table), w = 0, k = 0;

		for (uint32_t r = 0; r < q->n[x->table]; r++) {
			if (k < x->n && x->slots[k] == r) {
				k++;
				continue;
			}
			pos[w++] = pos[r];
		}
		q->n[x->table] = w;
	}
}

/* Compacts, expecting success: one generation step, one epoch, the freed blocks counted. */
static uint64_t tseq_compact(struct fixture *f, struct tseq *q, const struct compact_drop *drops,
                             uint32_t n_drops) {
	uint64_t gen = q->s->desc->generation, epoch = q->s->epoch, before = tseq_blocks(q), freed;
	uint64_t block_bytes = f->p->block_bytes;
	int copy_error = -1;

	ASSERT_OK(seq_compact(q->s, f->p, NULL, drops, n_drops, q->side, &f->emptied, &freed,
	                      &copy_error));
	ASSERT_EQ(copy_error, 0);
	ASSERT_EQ(q->s->desc->generation, gen + 2);
	ASSERT_EQ(q->s->epoch, epoch + 1);
	tseq_apply(q, drops, n_drops);
	ASSERT_EQ(freed, before - tseq_blocks(q));
	ASSERT_EQ(f->p->block_bytes, block_bytes - freed * q->s->desc->block_bytes);
	return freed;
}

/*
 * Random drops for q: some tables get no entry, some an empty one, some lose everything,
 * whole blocks, or a random share of their slots; entries come in random table order.
 * slots has room for n_tables * max_tokens.
 */
static uint32_t drops_random(const struct tseq *q, struct compact_drop *drops, uint32_t *slots) {
	uint32_t bt = q->s->desc->block_tokens, nd = 0;

	for (uint32_t t = 0; t < q->n_tables; t++) {
		uint32_t *sl = slots + (uint64_t)t * q->max_tokens, k = 0, share = rng_below(9) + 1;
		uint32_t mode = rng_below(6);

		if (mode == 0)
			continue;
		for (uint32_t i = 0; i < q->n[t]; i++) {
			bool drop = mode == 2 ||
			            (mode == 3 && mix(rng_state ^ (i / bt)) % 2 == 0) ||
			            (mode >= 4 && rng_below(10) < share);

			if (drop)
				sl[k++] = i;
		}
		drops[nd++] = (struct compact_drop){ .table = t, .n = k, .slots = sl };
	}
	for (uint32_t i = nd; i > 1; i--) {
		uint32_t j = rng_below(i);
		struct compact_drop x = drops[i - 1];

		drops[i - 1] = drops[j];
		drops[j] = x;
	}
	return nd;
}

TEST(compact_random_drops) {
	static const uint32_t layouts[] = { KVD_LAYOUT_PER_LAYER, KVD_LAYOUT_PER_HEAD };
	static const uint32_t dtypes[] = { KVD_DTYPE_F16, KVD_DTYPE_F32 };
	static const uint32_t bts[] = { 1, 4, 16 };
	const uint32_t max_tokens = 48;

	rng_state = 1;
	for (uint32_t li = 0; li < ELEMENTSOF(layouts); li++)
		for (uint32_t di = 0; di < ELEMENTSOF(dtypes); di++)
			for (uint32_t bi = 0; bi < ELEMENTSOF(bts); bi++) {
				struct model m = model_of(3, 2, 8, dtypes[di], bts[bi], layouts[li]);
				struct fixture f;
				struct tseq q[2];
				struct tseq *qs[2] = { &q[0], &q[1] };
				struct compact_drop *drops = calloc(m.n_tables, sizeof(*drops));
				uint32_t *slots = calloc(m.n_tables * max_tokens, sizeof(*slots));

				ASSERT_TRUE(drops && slots);
				fixture_init(&f, 4 * page, 16);
				for (uint32_t i = 0; i < 2; i++) {
					tseq_new(&f, &q[i], 10 + i, &m, max_tokens, 1);
					tseq_grow(&f, &q[i], 20);
					tseq_grow(&f, &q[i], 17);
				}
				for (uint32_t round = 0; round < 6; round++)
					for (uint32_t i = 0; i < 2; i++) {
						uint32_t nd = drops_random(&q[i], drops, slots), most = 0;

						if (nd > 0)
							tseq_compact(&f, &q[i], drops, nd);
						reclaim_emptied(&f);
						tseq_check(&f, &q[i]);
						check_accounting(&f, qs, 2);
						for (uint32_t t = 0; t < m.n_tables; t++)
							most = MAX(most, q[i].n[t]);
						if (most < max_tokens)
							tseq_grow(&f, &q[i], 1 + rng_below(max_tokens - most));
						tseq_check(&f, &q[i]);
						check_accounting(&f, qs, 2);
					}
				for (uint32_t i = 0; i < 2; i++)
					tseq_free(&f, &q[i]);
				reclaim_emptied(&f);
				ASSERT_EQ(f.p->block_bytes, 0u);
				ASSERT_EQ(f.p->used_bytes, 0u);
				free(drops);
				free(slots);
				fixture_done(&f);
			}
}

TEST(compact_unlinks_whole_blocks) {
	struct model m = model_of(1, 2, 16, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	static const uint32_t drop0[] = { 4, 5, 6, 7, 12, 13, 14, 15 };
	static const uint32_t drop1[] = { 0, 1, 2, 3, 16, 17 };
	static const uint32_t drop2[] = { 0, 4, 5, 6, 7 };
	struct kvd_block_ref old[2][5];
	struct compact_drop drops[2];
	struct fixture f;
	struct tseq q;
	struct tseq *qs[1] = { &q };
	const struct kvd_seq_desc *d;

	fixture_init(&f, 4 * page, 4);
	tseq_new(&f, &q, 1, &m, 32, 1);
	tseq_grow(&f, &q, 18);
	d = q.s->desc;
	for (uint32_t t = 0; t < 2; t++)
		memcpy(old[t], layout_blocks(d, t), sizeof(old[t]));

	/* Blocks 1 and 3 of table 0; block 0 and the short last block of table 1. */
	drops[0] = (struct compact_drop){ .table = 1, .n = ELEMENTSOF(drop1), .slots = drop1 };
	drops[1] = (struct compact_drop){ .table = 0, .n = ELEMENTSOF(drop0), .slots = drop0 };
	ASSERT_EQ(tseq_compact(&f, &q, drops, 2), 4u);
	/* The survivors kept their blocks, in order, rows untouched. */
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 0)[0], &old[0][0], sizeof(old[0][0])));
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 0)[1], &old[0][2], sizeof(old[0][0])));
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 0)[2], &old[0][4], sizeof(old[0][0])));
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 1)[0], &old[1][1], 3 * sizeof(old[1][0])));
	ASSERT_EQ(layout_tokens(d)[0], 10u);
	ASSERT_EQ(layout_tokens(d)[1], 12u);
	for (uint32_t t = 0; t < 2; t++)
		for (uint32_t i = 0; i < 5; i++) {
			bool kept = false;

			for (uint32_t b = 0; b < DIV_ROUND_UP(q.n[t], 4u); b++)
				kept |= !memcmp(&layout_blocks(d, t)[b], &old[t][i], sizeof(old[t][i]));
			ASSERT_EQ(pool_block_addr(f.p, old[t][i]) != NULL, kept);
		}
	tseq_check(&f, &q);
	check_accounting(&f, qs, 1);

	/* A whole block is unlinked even where the write cursor is not at a block boundary
	 * (slot 0 went first): the list is the old one without it. */
	tseq_grow(&f, &q, 6);
	memcpy(old[0], layout_blocks(d, 0), sizeof(old[0]));
	drops[0] = (struct compact_drop){ .table = 0, .n = ELEMENTSOF(drop2), .slots = drop2 };
	ASSERT_EQ(tseq_compact(&f, &q, drops, 1), 1u);
	ASSERT_EQ(layout_tokens(d)[0], 11u);
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 0)[0], &old[0][0], sizeof(old[0][0])));
	ASSERT_TRUE(!memcmp(&layout_blocks(d, 0)[1], &old[0][2], 2 * sizeof(old[0][0])));
	ASSERT_NULL(pool_block_addr(f.p, old[0][1]));
	tseq_check(&f, &q);
	check_accounting(&f, qs, 1);

	/* Dropping every slot empties the table. */
	{
		uint32_t all[32];

		for (uint32_t i = 0; i < q.n[1]; i++)
			all[i] = i;
		drops[0] = (struct compact_drop){ .table = 1, .n = q.n[1], .slots = all };
		ASSERT_EQ(tseq_compact(&f, &q, drops, 1), 5u);
		ASSERT_EQ(layout_tokens(d)[1], 0u);
	}
	tseq_check(&f, &q);
	check_accounting(&f, qs, 1);
	tseq_free(&f, &q);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->block_bytes, 0u);
	fixture_done(&f);
}

TEST(compact_refuses_bad_drops) {
	struct model m = model_of(2, 2, 8, KVD_DTYPE_F32, 4, KVD_LAYOUT_PER_LAYER);
	static const uint32_t ok[] = { 1, 2 }, unsorted[] = { 2, 1 }, twice[] = { 3, 3 };
	static const uint32_t past[] = { 2, 10 }, last[] = { 9 };
	const struct compact_drop bad[][2] = {
		{ { .table = 2, .n = 2, .slots = ok } },
		{ { .table = 0, .n = 2, .slots = unsorted } },
		{ { .table = 1, .n = 2, .slots = twice } },
		{ { .table = 0, .n = 2, .slots = past } },
		{ { .table = 0, .n = 2, .slots = ok }, { .table = 0, .n = 1, .slots = last } },
		{ { .table = 0, .n = 2, .slots = ok }, { .table = 1, .n = 2, .slots = past } },
	};
	const uint32_t n_bad[] = { 1, 1, 1, 1, 2, 2 };
	uint64_t digest, digest2, bytes, freed = 77;
	struct fixture f;
	struct tseq q;
	struct kvd_seq_desc *copy;

	fixture_init(&f, 4 * page, 4);
	tseq_new(&f, &q, 1, &m, 16, 1);
	tseq_grow(&f, &q, 10);
	copy = malloc(q.s->desc->total_bytes);
	ASSERT_NOT_NULL(copy);
	memcpy(copy, q.s->desc, q.s->desc->total_bytes);
	ASSERT_OK(seq_digest(q.s, f.p, &digest, NULL));
	bytes = f.p->block_bytes;

	for (uint32_t i = 0; i < ELEMENTSOF(bad); i++) {
		ASSERT_ERRNO(seq_compact(q.s, f.p, NULL, bad[i], n_bad[i], q.side, &f.emptied, &freed,
		                         NULL),
		             -EINVAL);
		ASSERT_EQ(freed, 77u);
		ASSERT_EQ(q.s->epoch, 0u);
		ASSERT_EQ(f.emptied.n, 0u);
		ASSERT_EQ(f.p->block_bytes, bytes);
		ASSERT_TRUE(!memcmp(copy, q.s->desc, q.s->desc->total_bytes));
		ASSERT_OK(seq_digest(q.s, f.p, &digest2, NULL));
		ASSERT_EQ(digest2, digest);
	}
	/* Nothing to drop: nothing changes, not even the generation. */
	ASSERT_OK(seq_compact(q.s, f.p, NULL, NULL, 0, NULL, &f.emptied, &freed, NULL));
	ASSERT_EQ(freed, 0u);
	ASSERT_EQ(q.s->epoch, 0u);
	ASSERT_TRUE(!memcmp(copy, q.s->desc, q.s->desc->total_bytes));
	tseq_check(&f, &q);

	free(copy);
	tseq_free(&f, &q);
	fixture_done(&f);
}

TEST(grow_unequal_tables) {
	/* Eight blocks to a chunk. */
	struct model m = model_of(2, 4, page / 128, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	struct compact_drop drops[8];
	uint32_t slots[8][8];
	struct seq_grants g;
	struct fixture f;
	struct tseq q;
	struct tseq *qs[1] = { &q };
	uint64_t bytes;

	/* Five chunks: room for 40 blocks, so that a grow can run out midway. */
	fixture_init(&f, page, 5);
	tseq_new(&f, &q, 3, &m, 32, 1);
	tseq_grow(&f, &q, 10);
	/* Table t loses its first t slots: tables of every length from 10 down to 3. */
	for (uint32_t t = 0; t < 8; t++) {
		for (uint32_t i = 0; i < t; i++)
			slots[t][i] = i;
		drops[t] = (struct compact_drop){ .table = t, .n = t, .slots = slots[t] };
	}
	tseq_compact(&f, &q, drops, 8);
	reclaim_emptied(&f);
	tseq_check(&f, &q);

	/* Each table grows from its own count, and positions continue from 10. */
	tseq_grow(&f, &q, 5);
	for (uint32_t t = 0; t < 8; t++) {
		ASSERT_EQ(q.n[t], 15 - t);
		ASSERT_EQ(layout_positions(q.s->desc, t)[q.n[t] - 1], 14u);
	}
	tseq_check(&f, &q);
	check_accounting(&f, qs, 1);

	/* The longest table bounds the grow. */
	bytes = f.p->block_bytes;
	ASSERT_ERRNO(seq_grow(q.s, f.p, 1, 18, &g, &f.emptied), -EFBIG);
	ASSERT_EQ(f.p->block_bytes, bytes);
	/* All or nothing when the pool runs dry partway: 17 more tokens make tables of 32 down
	 * to 25 tokens, 56 blocks. */
	ASSERT_EQ(page / m.block_bytes, 8u);
	ASSERT_ERRNO(seq_grow(q.s, f.p, 1, 17, &g, &f.emptied), -ENOSPC);
	ASSERT_EQ(f.p->block_bytes, bytes);
	reclaim_emptied(&f);
	tseq_check(&f, &q);
	check_accounting(&f, qs, 1);

	tseq_free(&f, &q);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->block_bytes, 0u);
	fixture_done(&f);
}

/* Drops every slot of table t but those of block keep, and, at random, some of those. */
static void drops_keep_block(const struct tseq *q, uint32_t t, uint32_t keep,
                             struct compact_drop *x, uint32_t *slots) {
	uint32_t bt = q->s->desc->block_tokens, k = 0, spared = rng_below(bt);

	for (uint32_t i = 0; i < q->n[t]; i++)
		if (i / bt != keep || (i % bt != spared && rng_below(2)))
			slots[k++] = i;
	*x = (struct compact_drop){ .table = t, .n = k, .slots = slots };
}

TEST(compact_chunks_packs) {
	/* Four blocks to a chunk for m1, two for m2. */
	struct model m1 = model_of(1, 2, page / 64, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	struct model m2 = model_of(1, 2, page / 32, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	/* Which block each table keeps: A's first chunk alone, A and B sharing the second,
	 * B alone in the third; C keeps blocks in two of m2's chunks. */
	static const uint32_t keep[3][2] = { { 0, 1 }, { 1, 2 }, { 0, 3 } };
	struct compact_drop drops[2];
	uint32_t slots[2][16];
	struct fixture f;
	struct tseq q[3];
	struct tseq *qs[3] = { &q[0], &q[1], &q[2] };
	struct seq *ss[3];
	struct kvd_seq_desc *copy;
	uint64_t gen[3];

	rng_state = 7;
	fixture_init(&f, page, 12);
	tseq_new(&f, &q[0], 1, &m1, 16, 1);
	tseq_new(&f, &q[1], 2, &m1, 16, 2);
	tseq_new(&f, &q[2], 3, &m2, 16, 1);
	/* Interleaved: each m1 chunk gets a block of each table of A and of B. */
	for (uint32_t round = 0; round < 4; round++)
		for (uint32_t i = 0; i < 3; i++)
			tseq_grow(&f, &q[i], 4);
	ASSERT_EQ(f.p->used_bytes, 8 * page);
	for (uint32_t i = 0; i < 3; i++) {
		for (uint32_t t = 0; t < 2; t++)
			drops_keep_block(&q[i], t, keep[i][t], &drops[t], slots[t]);
		tseq_compact(&f, &q[i], drops, 2);
		ss[i] = q[i].s;
	}
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->used_bytes, 5 * page);
	for (uint32_t i = 0; i < 3; i++)
		tseq_check(&f, &q[i]);
	check_accounting(&f, qs, 3);

	/* B is not movable: the chunk A shares with B stays, A's lone block joins it. */
	copy = malloc(ss[1]->desc->total_bytes);
	ASSERT_NOT_NULL(copy);
	memcpy(copy, ss[1]->desc, ss[1]->desc->total_bytes);
	gen[0] = ss[0]->desc->generation;
	ASSERT_EQ(compact_chunks(f.p, f.a, ss, 1, &f.emptied), 1);
	ASSERT_EQ(f.emptied.n, 1u);
	ASSERT_TRUE(!memcmp(copy, ss[1]->desc, ss[1]->desc->total_bytes));
	ASSERT_EQ(ss[1]->epoch, 1u);
	ASSERT_EQ(ss[0]->desc->generation, gen[0] + 2);
	ASSERT_EQ(ss[0]->epoch, 2u);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->used_bytes, 4 * page);
	for (uint32_t i = 0; i < 3; i++)
		tseq_check(&f, &q[i]);
	check_accounting(&f, qs, 3);

	/* All three: B's lone block fills the shared chunk, C's two blocks share a chunk. */
	for (uint32_t i = 0; i < 3; i++)
		gen[i] = ss[i]->desc->generation;
	ASSERT_EQ(compact_chunks(f.p, f.a, ss, 3, &f.emptied), 2);
	ASSERT_EQ(f.emptied.n, 2u);
	ASSERT_EQ(ss[0]->desc->generation, gen[0]);
	ASSERT_EQ(ss[1]->desc->generation, gen[1] + 2);
	ASSERT_EQ(ss[2]->desc->generation, gen[2] + 2);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->used_bytes, 2 * page);
	for (uint32_t i = 0; i < 3; i++)
		tseq_check(&f, &q[i]);
	check_accounting(&f, qs, 3);

	/* Nothing left to empty. */
	ASSERT_EQ(compact_chunks(f.p, f.a, ss, 3, &f.emptied), 0);
	ASSERT_EQ(f.emptied.n, 0u);

	free(copy);
	for (uint32_t i = 0; i < 3; i++)
		tseq_free(&f, &q[i]);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->block_bytes, 0u);
	ASSERT_EQ(f.a->block_bytes, 0u);
	ASSERT_EQ(f.p->used_bytes, 0u);
	ASSERT_EQ(f.p->chunks_free, f.p->n_chunks);
	fixture_done(&f);
}

TEST(compact_chunks_respects_holders) {
	/* One table, four blocks to a chunk. */
	struct model m = model_of(1, 1, page / 64, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	static const uint32_t tail[] = { 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 };
	struct compact_drop drop = { .table = 0, .n = ELEMENTSOF(tail), .slots = tail };
	struct chunk *x, *z, *filler_c[3];
	uint32_t filler_i[3];
	struct kvd_block_ref before;
	struct fixture f;
	struct tseq q;
	uint64_t gen;

	fixture_init(&f, page, 4);
	tseq_new(&f, &q, 1, &m, 16, 1);
	/* A fills chunk x, then blocks of no sequence start chunk z. */
	tseq_grow(&f, &q, 16);
	x = pool_chunk(f.p, layout_blocks(q.s->desc, 0)[0].chunk_id);
	for (uint32_t i = 0; i < 3; i++)
		ASSERT_OK(pool_block_alloc(f.p, f.a, 0, m.block_bytes, &filler_c[i], &filler_i[i]));
	z = filler_c[0];
	ASSERT_TRUE(z != x && filler_c[1] == z && filler_c[2] == z);
	/* z has room for one block and only connection 2 has it mapped. */
	ASSERT_OK(chunk_add_holder(z, 2));
	tseq_compact(&f, &q, &drop, 1);
	ASSERT_EQ(x->used_blocks, 1u);
	before = layout_blocks(q.s->desc, 0)[0];
	gen = q.s->desc->generation;

	/* z is fuller and has room, but A's connection does not hold it. */
	ASSERT_EQ(compact_chunks(f.p, f.a, &q.s, 1, &f.emptied), 0);
	ASSERT_EQ(f.emptied.n, 0u);
	ASSERT_EQ(q.s->desc->generation, gen);
	ASSERT_EQ(q.s->epoch, 1u);
	ASSERT_TRUE(!memcmp(&before, &layout_blocks(q.s->desc, 0)[0], sizeof(before)));

	/* Once it does, the block moves and x empties. */
	ASSERT_OK(chunk_add_holder(z, 1));
	ASSERT_EQ(compact_chunks(f.p, f.a, &q.s, 1, &f.emptied), 1);
	ASSERT_EQ(f.emptied.n, 1u);
	ASSERT_TRUE(f.emptied.chunks[0] == x);
	ASSERT_EQ(layout_blocks(q.s->desc, 0)[0].chunk_id, z->id);
	ASSERT_EQ(z->used_blocks, 4u);
	ASSERT_EQ(q.s->desc->generation, gen + 2);
	ASSERT_EQ(q.s->epoch, 2u);
	reclaim_emptied(&f);
	tseq_check(&f, &q);

	/* A chunk is emptied whole or not at all: A's two blocks in a new chunk, and z with
	 * room for one only after a filler goes. */
	tseq_grow(&f, &q, 8);
	ASSERT_FALSE(pool_block_free(f.p, z, filler_i[0]));
	x = pool_chunk(f.p, layout_blocks(q.s->desc, 0)[1].chunk_id);
	ASSERT_TRUE(x != z);
	ASSERT_EQ(x->used_blocks, 2u);
	ASSERT_EQ(z->used_blocks, 3u);
	gen = q.s->desc->generation;
	ASSERT_EQ(compact_chunks(f.p, f.a, &q.s, 1, &f.emptied), 0);
	ASSERT_EQ(q.s->desc->generation, gen);
	ASSERT_EQ(x->used_blocks, 2u);
	ASSERT_EQ(z->used_blocks, 3u);
	tseq_check(&f, &q);
	/* f.a->block_bytes counts the two fillers too. */
	ASSERT_EQ(f.p->block_bytes, (tseq_blocks(&q) + 2) * m.block_bytes);

	/* A's block keeps z from emptying until A goes. */
	for (uint32_t i = 1; i < 3; i++)
		ASSERT_FALSE(pool_block_free(f.p, z, filler_i[i]));
	tseq_free(&f, &q);
	reclaim_emptied(&f);
	ASSERT_EQ(f.p->block_bytes, 0u);
	ASSERT_EQ(f.p->used_bytes, 0u);
	fixture_done(&f);
}

TEST(seq_free_releases_eviction_state) {
	struct model m = model_of(1, 2, 8, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	struct fixture f;
	struct seq *s;
	int fd;

	fixture_init(&f, 4 * page, 2);
	ASSERT_OK(seq_new(1, &m, f.a, 16, DESC_MAX, &s));
	ASSERT_EQ(s->obs_fd, -EBADF);
	ASSERT_NULL(s->obs);
	ASSERT_NULL(s->smooth);
	ASSERT_NULL(s->pending);
	ASSERT_EQ(s->epoch, 0u);
	ASSERT_EQ(s->pins, 0u);
	/* Smoothed costs for one table of two, and an observation fd not yet handed over:
	 * seq_free releases both (the sanitizer build reports a leak otherwise). */
	s->smooth = calloc(m.n_tables, sizeof(*s->smooth));
	s->smooth_cap = calloc(m.n_tables, sizeof(*s->smooth_cap));
	ASSERT_TRUE(s->smooth && s->smooth_cap);
	s->smooth[1] = calloc(16, sizeof(float));
	ASSERT_NOT_NULL(s->smooth[1]);
	s->smooth_cap[1] = 16;
	fd = dup(s->desc_fd);
	ASSERT_GE(fd, 0);
	s->obs_fd = fd;
	seq_free(s, f.p, &f.emptied);
	ASSERT_EQ(fcntl(fd, F_GETFD), -1);
	ASSERT_EQ(errno, EBADF);
	fixture_done(&f);
}

/* The kept slots of table t hold, bit for bit, the pattern of their positions, which are
 * those of want[0..n) (ascending). */
static void kept_check(const struct recall_store *st, const struct seq *s, uint32_t t,
                       const uint32_t *want, uint32_t n) {
	const struct kvd_seq_desc *d = s->desc;
	uint32_t esz = layout_dtype_bytes(d->dtype), per_head = d->layout == KVD_LAYOUT_PER_HEAD;
	uint32_t heads = per_head ? 1 : d->kv_heads, layer = per_head ? t / d->kv_heads : t;
	uint64_t row = layout_row_bytes(d);

	ASSERT_EQ(recall_kept(st, t), n);
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *rec = recall_record(st, t, i);

		ASSERT_EQ(recall_positions(st, t)[i], want[i]);
		for (uint32_t h = 0; h < heads; h++)
			for (uint32_t kv = 0; kv < 2; kv++)
				for (uint32_t e = 0; e < d->head_dim; e++) {
					uint64_t v = pattern(s->id, layer, per_head ? t % d->kv_heads : h, want[i],
					                     kv, e);
					uint32_t got = 0;

					memcpy(&got, rec + (kv * heads + h) * row + (uint64_t)e * esz, esz);
					ASSERT_EQ(got, esz == 2 ? (uint16_t)v : (uint32_t)v);
				}
	}
}

static int cmp_u32(const void *a, const void *b) {
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return (x > y) - (x < y);
}

/* n distinct values below m, ascending, into out. */
static void pick_sorted(uint32_t m, uint32_t n, uint32_t *out) {
	for (uint32_t k = 0, i = 0; i < m && k < n; i++)
		if (rng_below(m - i) < n - k)
			out[k++] = i;
}

TEST(recall_keeps_and_trades) {
	static const uint32_t layouts[] = { KVD_LAYOUT_PER_LAYER, KVD_LAYOUT_PER_HEAD };
	static const uint32_t dtypes[] = { KVD_DTYPE_F16, KVD_DTYPE_F32 };
	static const uint32_t bts[] = { 1, 4, 16 };
	/* Positions ever given out stay below 4 x max_tokens: room for each table's kept. */
	const uint32_t max_tokens = 64, kstride = 4 * max_tokens;

	rng_state = 7;
	for (uint32_t li = 0; li < ELEMENTSOF(layouts); li++)
		for (uint32_t di = 0; di < ELEMENTSOF(dtypes); di++)
			for (uint32_t bi = 0; bi < ELEMENTSOF(bts); bi++) {
				struct model m = model_of(3, 2, 8, dtypes[di], bts[bi], layouts[li]);
				uint32_t nt = m.n_tables;
				uint64_t meta = 0;
				struct tier *tr;
				struct fixture f;
				struct tseq q;
				struct compact_drop *drops = calloc(nt, sizeof(*drops));
				uint32_t *slots = calloc(nt * max_tokens, sizeof(*slots));
				uint32_t *kept = calloc(nt * kstride, sizeof(*kept)), *nk = calloc(nt, 4);
				struct recall_trade *trades = calloc(nt, sizeof(*trades));
				uint32_t *drop = calloc(nt * max_tokens, 4), *take = calloc(nt * max_tokens, 4);
				float *take_s = calloc(nt * max_tokens, sizeof(float));

				ASSERT_TRUE(drops && slots && kept && nk && trades && drop && take && take_s);
				fixture_init(&f, 4 * page, 16);
				ASSERT_OK(tier_new(64 * page, 4 * page, &meta, &tr));
				tseq_new(&f, &q, 5, &m, max_tokens, 1);
				tseq_grow(&f, &q, 40);
				/* recall_swap moves the sequence's own side arrays: the test's. */
				q.s->smooth = q.side;
				q.s->smooth_cap = calloc(nt, sizeof(uint32_t));
				ASSERT_NOT_NULL(q.s->smooth_cap);
				for (uint32_t t = 0; t < nt; t += 2)
					q.s->smooth_cap[t] = max_tokens;
				for (uint32_t round = 0; round < 5; round++) {
					uint32_t nd = drops_random(&q, drops, slots);
					uint64_t block_bytes = f.p->block_bytes, gen, epoch, traded = 0;
					uint32_t most = 0;
					int copy_error = -1;
					int64_t total = 0;

					/* Drop, keeping what leaves: the expected kept sets gain their
					 * positions. */
					for (uint32_t i = 0; i < nd; i++) {
						uint32_t t = drops[i].table, *kp = kept + t * kstride;

						total += drops[i].n;
						for (uint32_t j = 0; j < drops[i].n; j++)
							kp[nk[t]++] = tseq_pos(&q, t)[drops[i].slots[j]];
						qsort(kp, nk[t], sizeof(*kp), cmp_u32);
					}
					ASSERT_EQ(recall_keep(tr, q.s, f.p, drops, nd), total);
					if (nd > 0)
						tseq_compact(&f, &q, drops, nd);
					reclaim_emptied(&f);
					tseq_check(&f, &q);
					for (uint32_t t = 0; t < nt; t++)
						kept_check(q.s->kept, q.s, t, kept + t * kstride, nk[t]);
					ASSERT_EQ(recall_kept_total(q.s->kept), tr->kept_tokens);

					/* Trade a random number of slots of each table back. */
					block_bytes = f.p->block_bytes;
					for (uint32_t t = 0; t < nt; t++) {
						uint32_t n = MIN(q.n[t], nk[t]), *dp = drop + t * max_tokens;
						uint32_t *tk = take + t * max_tokens, *kp = kept + t * kstride;
						uint32_t *pos = tseq_pos(&q, t), w = 0, a = 0;
						_cleanup_(freep) uint32_t *np = calloc(q.n[t] + 1, 4);
						_cleanup_(freep) uint32_t *nkp = calloc(nk[t] + 1, 4);

						ASSERT_TRUE(np && nkp);
						n = n ? rng_below(n + 1) : 0;
						pick_sorted(q.n[t], n, dp);
						pick_sorted(nk[t], n, tk);
						for (uint32_t j = 0; j < n; j++)
							take_s[t * max_tokens + j] = (float)kp[tk[j]] + 0.5f;
						trades[t] = (struct recall_trade){ n, dp, tk, take_s + t * max_tokens };
						traded += n;
						/* Expected: residents without the dropped, with the taken, by
						 * position; kept ones the other way round. */
						for (uint32_t i = 0, j = 0; i < q.n[t]; i++)
							if (j < n && dp[j] == i)
								nkp[a++] = pos[i], j++;
							else
								np[w++] = pos[i];
						for (uint32_t i = 0, j = 0; i < nk[t]; i++)
							if (j < n && tk[j] == i)
								np[w++] = kp[i], j++;
							else
								nkp[a++] = kp[i];
						ASSERT_EQ(w, q.n[t]);
						ASSERT_EQ(a, nk[t]);
						qsort(np, w, 4, cmp_u32);
						qsort(nkp, a, 4, cmp_u32);
						memcpy(pos, np, w * 4);
						memcpy(kp, nkp, a * 4);
					}
					gen = q.s->desc->generation;
					epoch = q.s->epoch;
					ASSERT_OK(recall_swap(q.s, f.p, q.s->kept, trades, &copy_error));
					ASSERT_EQ(copy_error, 0);
					/* Nothing allocated or freed: the budget cannot pass. */
					ASSERT_EQ(f.p->block_bytes, block_bytes);
					ASSERT_EQ(f.emptied.n, 0u);
					/* One rewrite, where any table traded. */
					ASSERT_EQ(q.s->desc->generation, gen + (traded ? 2 : 0));
					ASSERT_EQ(q.s->epoch, epoch + (traded ? 1 : 0));
					tseq_check(&f, &q);
					for (uint32_t t = 0; t < nt; t++)
						kept_check(q.s->kept, q.s, t, kept + t * kstride, nk[t]);
					/* Room for what comes next. */
					for (uint32_t t = 0; t < nt; t++)
						most = MAX(most, q.n[t]);
					if (most + 8 <= max_tokens)
						tseq_grow(&f, &q, 8);
				}
				/* A trade out of range changes nothing. */
				memset(trades, 0, nt * sizeof(*trades));
				drop[0] = q.n[0];
				take[0] = 0;
				trades[0] = (struct recall_trade){ 1, drop, take, NULL };
				{
					uint64_t gen = q.s->desc->generation;
					int copy_error;

					ASSERT_EQ(recall_swap(q.s, f.p, q.s->kept, trades, &copy_error), -EINVAL);
					ASSERT_EQ(q.s->desc->generation, gen);
				}
				ASSERT_GT(meta, 0u);
				q.s->kept = recall_store_free(tr, q.s->kept);
				ASSERT_EQ(meta, 0u);
				ASSERT_EQ(tr->kept_tokens, 0u);
				ASSERT_EQ(tr->kept_bytes, 0u);
				ASSERT_EQ(tr->used_bytes, 0u);
				ASSERT_EQ(tr->n_free, tr->n_segs);
				q.s->smooth = NULL;
				free(q.s->smooth_cap);
				q.s->smooth_cap = NULL;
				tseq_free(&f, &q);
				tier_free(tr);
				reclaim_emptied(&f);
				fixture_done(&f);
				free(drops);
				free(slots);
				free(kept);
				free(nk);
				free(trades);
				free(drop);
				free(take);
				free(take_s);
			}
}

TEST(recall_keeps_all_or_nothing) {
	/* Records of 2 x 32 f16 elements: 128 bytes, 128 of them in a segment of 4 pages of
	 * 4 KiB (the test's page; more on larger pages, then scaled). */
	struct model m = model_of(2, 2, 32, KVD_DTYPE_F16, 4, KVD_LAYOUT_PER_HEAD);
	uint32_t per_seg = (uint32_t)(4 * page / 128), each = per_seg / 4 - 2, slots[64];
	struct compact_drop drops[4];
	uint64_t meta = 0;
	struct tier *tr;
	struct fixture f;
	struct tseq q;

	fixture_init(&f, 4 * page, 64);
	ASSERT_OK(tier_new(4 * page, 4 * page, &meta, &tr));
	tseq_new(&f, &q, 9, &m, MAX(64u, each + 2), 1);
	tseq_grow(&f, &q, each + 2);
	for (uint32_t i = 0; i < MIN(each, 64u); i++)
		slots[i] = i;
	each = MIN(each, 64u);
	for (uint32_t t = 0; t < 4; t++)
		drops[t] = (struct compact_drop){ .table = t, .n = each, .slots = slots };
	/* 4 x each fit in the one segment; twice that does not: none of it is kept. */
	ASSERT_EQ(recall_keep(tr, q.s, f.p, drops, 4), (int64_t)(4 * each));
	ASSERT_EQ(tr->n_free, 0u);
	if (8 * each > per_seg) {
		ASSERT_EQ(recall_keep(tr, q.s, f.p, drops, 4), 0);
		ASSERT_EQ(tr->kept_lost, 4u * each);
	}
	ASSERT_EQ(recall_kept_total(q.s->kept), 4u * each);
	for (uint32_t t = 0; t < 4; t++)
		ASSERT_EQ(recall_kept(q.s->kept, t), each);
	q.s->kept = recall_store_free(tr, q.s->kept);
	ASSERT_EQ(meta, 0u);
	ASSERT_EQ(tr->n_free, 1u);
	tseq_free(&f, &q);
	tier_free(tr);
	reclaim_emptied(&f);
	fixture_done(&f);
}
