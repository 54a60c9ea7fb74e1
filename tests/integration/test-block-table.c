/* SPDX-License-Identifier: MIT */
/*
 * Paged block tables (kvd_model_block_pool, kvd_seq_block_table): int32 indices from one
 * base per connection name the same blocks as kvd_seq_block, writes through them are what
 * the daemon reads, the buffers' bounds are kept, and a stride that does not divide the
 * chunk size is refused. Runs on the host backend and, not strict, under the fake driver
 * (the test writes through device addresses with the CPU, which only the fake allows).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "common/layout.h"
#include "fixture.h"
#include "test.h"

/* Blocks of 8 KiB (per layer) and 4 KiB (per head): both divide the 1 MiB chunks. */
static const kvd_model_spec per_layer = { "l", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
static const kvd_model_spec per_head = { "h", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };
/* head_dim 80: blocks of 10240 bytes, which do not divide 1 MiB. */
static const kvd_model_spec odd = { "o", 2, 2, 2, 80, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };

static const char *const pool[] = { "--pool-size", "8MiB", "--chunk-size", "1MiB", NULL };

#define TOKENS 1000u
#define MAX_BLOCKS 128u

/* Two sequences grown in turns, so that each one's blocks are spread over chunks. */
static void open_two(kvd_client *c, int m, kvd_seq **a, kvd_seq **b) {
	ASSERT_OK(kvd_seq_open(c, m, 4096, a));
	ASSERT_OK(kvd_seq_open(c, m, 4096, b));
	for (uint32_t done = 0; done < TOKENS; done += 100) {
		ASSERT_OK(kvd_seq_grow(*a, 100));
		ASSERT_OK(kvd_seq_grow(*b, 100));
	}
}

/* A daemon of `pool`, a connection with a model registered, its block range, and two
 * sequences grown in turns (open_two). */
struct tables {
	struct fixture f;
	kvd_client *c;
	int m;
	char *base;
	uint64_t stride;
	uint32_t n_blocks;
	kvd_seq *a, *b;
};

static void tables_start(struct tables *t, const kvd_model_spec *spec) {
	fixture_start(&t->f, pool);
	t->c = fixture_connect(&t->f, "engine");
	t->m = kvd_model_register(t->c, spec);
	ASSERT_OK(t->m);
	ASSERT_OK(kvd_model_block_pool(t->c, t->m, (void **)&t->base, &t->stride, &t->n_blocks));
	open_two(t->c, t->m, &t->a, &t->b);
}

static void tables_stop(struct tables *t) {
	ASSERT_OK(kvd_seq_release(t->a));
	ASSERT_OK(kvd_seq_release(t->b));
	kvd_client_unref(t->c);
	ASSERT_EQ(fixture_stop(&t->f), 0);
}

/* Every table of s against kvd_seq_block and kvd_seq_position. */
static void assert_tables(kvd_seq *s, char *base, uint64_t stride) {
	const struct kvd_seq_desc *h = kvd_seq_header(s);
	int32_t blocks[MAX_BLOCKS];
	uint32_t positions[TOKENS];
	uint64_t gen = 0;

	for (uint32_t l = 0; l < h->layers; l++)
		for (uint32_t kh = 0; kh < (h->layout == KVD_LAYOUT_PER_HEAD ? h->kv_heads : 1); kh++) {
			uint32_t t = layout_table(h, l, kh), nb = DIV_ROUND_UP(TOKENS, h->block_tokens);
			int n = kvd_seq_block_table(s, l, kh, blocks, MAX_BLOCKS, positions, TOKENS, &gen);

			ASSERT_EQ(n, (int)TOKENS);
			ASSERT_EQ(gen, kvd_seq_descriptor(s)->generation);
			for (uint32_t i = 0; i < nb; i++) {
				void *b;

				ASSERT_OK(kvd_seq_block(s, t, i, &b));
				ASSERT_TRUE(blocks[i] >= 0);
				ASSERT_TRUE((char *)b == base + (uint64_t)blocks[i] * stride);
			}
			for (uint32_t j = 0; j < TOKENS; j++)
				ASSERT_EQ((int64_t)positions[j], kvd_seq_position(s, l, kh, j));
		}
}

TEST(table_names_the_blocks) {
	struct tables t;
	int32_t blocks[MAX_BLOCKS];
	uint32_t positions[TOKENS], nb = DIV_ROUND_UP(TOKENS, 16);
	void *base;
	uint64_t stride;

	tables_start(&t, &per_layer);
	ASSERT_EQ(t.stride, 8192u);
	ASSERT_EQ(t.n_blocks, (8u << 20) / 8192u);
	assert_tables(t.a, t.base, t.stride);
	assert_tables(t.b, t.base, t.stride);

	/* Exactly big enough, one short, positions optional. */
	ASSERT_EQ(kvd_seq_block_table(t.a, 1, 0, blocks, nb, NULL, 0, NULL), (int)TOKENS);
	ASSERT_ERRNO(kvd_seq_block_table(t.a, 1, 0, blocks, nb - 1, NULL, 0, NULL), -ENOBUFS);
	/* The message has the numbers: what the table holds, what the buffers have room for. */
	{
		char want[160];

		snprintf(want, sizeof(want), "the table holds %u tokens in %u blocks; the buffers "
		         "have room for %u blocks", TOKENS, nb, nb - 1);
		ASSERT_TRUE(strstr(kvd_client_last_error(t.c), want));
	}
	ASSERT_ERRNO(kvd_seq_block_table(t.a, 1, 0, blocks, nb, positions, TOKENS - 1, NULL), -ENOBUFS);
	/* Out of range, and a kv head with a per-layer layout, with the bounds. */
	ASSERT_ERRNO(kvd_seq_block_table(t.a, 2, 0, blocks, nb, NULL, 0, NULL), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(t.c), "layers 0..1 and kv heads 0..0"));
	ASSERT_ERRNO(kvd_seq_block_table(t.a, 0, 1, blocks, nb, NULL, 0, NULL), -EINVAL);
	ASSERT_ERRNO(kvd_seq_tokens(t.a, 5, 0), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(t.c), "layer 5, kv head 0: the sequence's model "
	                                                "has layers 0..1"));
	ASSERT_ERRNO(kvd_seq_block_table(t.a, 0, 0, NULL, nb, NULL, 0, NULL), -EINVAL);
	ASSERT_ERRNO(kvd_model_block_pool(t.c, t.m + 1, &base, &stride, NULL), -EINVAL);
	tables_stop(&t);
}

/* A batch's tables for every layer in one call: each row what kvd_seq_block_table gives,
 * zero-padded to the width, with its tokens. */
TEST(batch_tables_in_one_call) {
	static int32_t tables[2 * 3 * MAX_BLOCKS], row[MAX_BLOCKS];
	int32_t lens[2 * 3];
	struct tables t;
	kvd_seq *c3, *seqs[3];

	tables_start(&t, &per_layer);
	ASSERT_OK(kvd_seq_open(t.c, t.m, 4096, &c3));
	ASSERT_OK(kvd_seq_grow(c3, 17));
	seqs[0] = t.a, seqs[1] = c3, seqs[2] = t.b;
	memset(tables, 0x7f, sizeof(tables));
	ASSERT_EQ(kvd_seq_block_tables(seqs, 3, 0, 2, 0, tables, MAX_BLOCKS, lens),
	          (int)DIV_ROUND_UP(TOKENS, 16));
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t i = 0; i < 3; i++) {
			const int32_t *got = tables + ((size_t)l * 3 + i) * MAX_BLOCKS;
			int n = kvd_seq_block_table(seqs[i], l, 0, row, MAX_BLOCKS, NULL, 0, NULL);
			uint32_t nb = DIV_ROUND_UP((uint32_t)n, 16);

			ASSERT_EQ(lens[l * 3 + i], n);
			ASSERT_TRUE(memcmp(got, row, nb * sizeof(*row)) == 0);
			for (uint32_t j = nb; j < MAX_BLOCKS; j++)
				ASSERT_EQ(got[j], 0);
		}
	ASSERT_EQ(lens[1], 17);
	/* One layer from the second; too narrow; nothing to do. */
	ASSERT_EQ(kvd_seq_block_tables(seqs, 3, 1, 1, 0, tables, MAX_BLOCKS, lens),
	          (int)DIV_ROUND_UP(TOKENS, 16));
	ASSERT_ERRNO(kvd_seq_block_tables(seqs, 3, 0, 2, 0, tables, DIV_ROUND_UP(TOKENS, 16) - 1,
	                                  lens), -ENOBUFS);
	ASSERT_ERRNO(kvd_seq_block_tables(seqs, 3, 1, 2, 0, tables, MAX_BLOCKS, lens), -EINVAL);
	ASSERT_ERRNO(kvd_seq_block_tables(seqs, 0, 0, 1, 0, tables, MAX_BLOCKS, lens), -EINVAL);
	ASSERT_ERRNO(kvd_seq_block_tables(seqs, 3, 0, 1, 0, NULL, MAX_BLOCKS, lens), -EINVAL);
	ASSERT_OK(kvd_seq_release(c3));
	tables_stop(&t);
}

TEST(per_head_tables) {
	struct tables t;

	tables_start(&t, &per_head);
	ASSERT_EQ(t.stride, 4096u);
	assert_tables(t.a, t.base, t.stride);
	assert_tables(t.b, t.base, t.stride);
	tables_stop(&t);
}

/* K/V written only through base + index * stride is what the daemon digests. */
TEST(writes_through_the_table_reach_the_daemon) {
	const struct kvd_seq_desc *h;
	struct tables t;
	int32_t blocks[MAX_BLOCKS];
	uint64_t before = 0, after = 0, local = 0;

	tables_start(&t, &per_layer);
	h = kvd_seq_header(t.a);
	ASSERT_OK(kvd_seq_digest(t.a, &before, NULL));
	for (uint32_t l = 0; l < h->layers; l++) {
		ASSERT_EQ(kvd_seq_block_table(t.a, l, 0, blocks, MAX_BLOCKS, NULL, 0, NULL), (int)TOKENS);
		for (uint32_t slot = 0; slot < TOKENS; slot++) {
			char *blk = t.base + (uint64_t)blocks[slot / h->block_tokens] * t.stride;
			uint32_t row = slot % h->block_tokens;

			for (uint32_t kh = 0; kh < h->kv_heads; kh++) {
				memset(blk + layout_k_offset(h, kh, row), (int)(1 + l + slot % 200),
				       layout_row_bytes(h));
				memset(blk + layout_v_offset(h, kh, row), (int)(7 + kh + slot % 100),
				       layout_row_bytes(h));
			}
		}
	}
	/* The daemon's digest (this process's only on host: on a GPU pool the library does
	 * not read device memory). */
	ASSERT_OK(kvd_seq_digest(t.a, &after, fixture_backend_cuda() ? NULL : &local));
	ASSERT_TRUE(fixture_backend_cuda() || after == local);
	ASSERT_TRUE(after != before);
	/* And kvd_seq_kv sees the same bytes. */
	for (uint32_t slot = 0; slot < TOKENS; slot += 37) {
		void *k, *v;

		ASSERT_OK(kvd_seq_kv(t.a, 1, 1, slot, &k, &v));
		ASSERT_EQ(*(uint8_t *)k, (uint8_t)(2 + slot % 200));
		ASSERT_EQ(*(uint8_t *)v, (uint8_t)(8 + slot % 100));
	}
	tables_stop(&t);
}

TEST(stride_that_does_not_divide_the_chunk_is_refused) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int32_t blocks[MAX_BLOCKS];
	uint64_t stride = 0;
	void *base = NULL;
	int m;

	fixture_start(&f, pool);
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &odd);
	ASSERT_OK(m);
	ASSERT_ERRNO(kvd_model_block_pool(c, m, &base, &stride, NULL), -EOPNOTSUPP);
	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	ASSERT_ERRNO(kvd_seq_block_table(s, 0, 0, blocks, MAX_BLOCKS, NULL, 0, NULL), -EOPNOTSUPP);
	/* The other calls serve it as before. */
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 100);
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Whether the mapping that holds addr in this process is inaccessible (---p). */
static bool mapped_none(const void *addr) {
	FILE *maps = fopen("/proc/self/maps", "re");
	char line[512];
	bool none = false;

	ASSERT_NOT_NULL(maps);
	while (fgets(line, sizeof(line), maps)) {
		unsigned long lo, hi;
		char perms[8];

		if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && (uintptr_t)addr >= lo &&
		    (uintptr_t)addr < hi) {
			none = strcmp(perms, "---p") == 0;
			break;
		}
	}
	fclose(maps);
	return none;
}

/* A chunk taken back leaves its place in the range reserved, not free for other mappings;
 * the next grant maps at the same place again. Host pools only. */
TEST(released_chunks_stay_reserved) {
	struct tables t;
	int32_t blocks[MAX_BLOCKS];
	char *first;

	if (fixture_backend_cuda())
		return;
	tables_start(&t, &per_layer);
	ASSERT_EQ(kvd_seq_block_table(t.a, 0, 0, blocks, MAX_BLOCKS, NULL, 0, NULL), (int)TOKENS);
	first = t.base + (uint64_t)blocks[0] * t.stride;
	ASSERT_FALSE(mapped_none(first));
	ASSERT_OK(kvd_seq_release(t.a));
	ASSERT_OK(kvd_seq_release(t.b));
	ASSERT_TRUE(mapped_none(first));

	open_two(t.c, t.m, &t.a, &t.b);
	assert_tables(t.a, t.base, t.stride);
	tables_stop(&t);
}

/* Refusals say their numbers: a block size that does not divide the chunk (head_dim 80:
 * 10240-byte blocks), and a connect that fails before any client exists, whose message
 * kvd_client_last_error(NULL) keeps. */
TEST(refusals_say_their_numbers) {
	static const kvd_model_spec wide = { "wide", 2, 4, 2, 80, KVD_DTYPE_F16, 16,
		                            KVD_LAYOUT_PER_LAYER };
	struct fixture f;
	kvd_client *c, *none = NULL;
	uint64_t stride;
	void *base;
	int m;

	fixture_start(&f, (const char *const[]){ "--pool-size", "8MiB", "--chunk-size", "1MiB", NULL });
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &wide);
	ASSERT_OK(m);
	ASSERT_ERRNO(kvd_model_block_pool(c, m, &base, &stride, NULL), -EOPNOTSUPP);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "blocks of 10240 bytes"));
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "chunk size of 1048576 bytes"));
	ASSERT_ERRNO(kvd_client_connect(f.socket, "no spaces", &none), -EINVAL);
	ASSERT_NULL(none);
	ASSERT_TRUE(strstr(kvd_client_last_error(NULL), "tenant name 'no spaces' is not valid"));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
