/* SPDX-License-Identifier: MIT */
/*
 * IndexMem end to end: a model registered with an indexer gets room for an index key per
 * slot in its blocks (counted against the tenant) and for index queries in its observation
 * buffer; rounds of policy indexmem keep the tokens the index queries favour, reading
 * nothing but index keys and queries, and compaction moves each index key with its token;
 * a model with latent memory gets its latent blocks with the first grow, and every round
 * adds exactly the K/V it drops into them, on every unit and layout.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basic/macro.h"
#include "fixture.h"
#include "test.h"

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 8
#define BLOCK_TOKENS 16
#define WINDOW 8
#define SINKS 4
#define INDEX_HEADS 2
#define INDEX_DIM 4
#define MAX_TOKENS 4096
/* Every IMPORTANT-th position is one the index queries point at. */
#define IMPORTANT 8

#define POOL "--pool-size=64MiB"
#define CHUNK "--chunk-size=256KiB"

static float kv_value(int is_v, uint32_t l, uint32_t h, uint32_t pos, uint32_t a) {
	return is_v ? cosf(0.11f * pos + 0.7f * a + 3.0f * l + h) + 0.2f * a
		    : sinf(0.37f * pos + 1.3f * a + l + 2.0f * h) + 0.5f;
}

/* Index key element a of a position: toward the queries' direction for the important
 * positions, away from it (relu: nothing) for the others; its position in element 1. */
static float index_value(uint32_t pos, uint32_t a) {
	if (a == 0)
		return pos % IMPORTANT == 0 ? 1.0f : -1.0f;
	return a == 1 ? (float)pos : 0.0f;
}

static int register_model(kvd_client *c, uint32_t unit, uint32_t layout, uint32_t compensation,
                          int indexed) {
	kvd_model_spec spec = {
		.name = "indexmem-test",
		.layers = LAYERS,
		.q_heads = Q_HEADS,
		.kv_heads = KV_HEADS,
		.head_dim = HEAD_DIM,
		.dtype = KVD_DTYPE_F32,
		.block_tokens = BLOCK_TOKENS,
		.layout = layout,
	};
	kvd_eviction_spec ev = { .unit = unit, .window = WINDOW, .sinks = SINKS };
	kvd_index_spec ix = { .heads = INDEX_HEADS, .dim = INDEX_DIM };

	return kvd_model_register_indexed(c, &spec, unit == KVD_UNIT_NONE ? NULL : &ev, compensation,
	                                  indexed ? &ix : NULL);
}

/* Grows s by n tokens, writes their K/V (and index keys) and a window per layer. */
static void step(kvd_seq *s, uint32_t n, int indexed) {
	uint64_t from = kvd_seq_descriptor(s)->next_position;

	ASSERT_OK(kvd_seq_grow(s, n));
	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < LAYERS; l++) {
		float *q, *iq;

		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t tokens = kvd_seq_tokens(s, l, h);

			ASSERT_OK(tokens);
			for (uint32_t j = 0; j < (uint32_t)tokens; j++) {
				int64_t pos = kvd_seq_position(s, l, h, j);
				float *k, *v, *ik;

				if ((uint64_t)pos < from)
					continue;
				ASSERT_OK(kvd_seq_kv(s, l, h, j, (void **)&k, (void **)&v));
				for (uint32_t a = 0; a < HEAD_DIM; a++) {
					k[a] = kv_value(0, l, h, (uint32_t)pos, a);
					v[a] = kv_value(1, l, h, (uint32_t)pos, a);
				}
				if (!indexed)
					continue;
				ASSERT_OK(kvd_seq_index_key(s, l, h, j, (void **)&ik));
				/* Not on the K/V: the key has rows of its own. */
				ASSERT_TRUE((char *)ik >= (char *)v + HEAD_DIM * 4 || (char *)ik < (char *)k);
				for (uint32_t a = 0; a < INDEX_DIM; a++)
					ik[a] = index_value((uint32_t)pos, a);
			}
		}
		ASSERT_OK(kvd_seq_observation(s, l, (void **)&q));
		for (uint32_t j = 0; j < Q_HEADS * WINDOW * HEAD_DIM; j++)
			q[j] = 0.25f * (float)(j % 7) - 0.75f;
		if (indexed) {
			ASSERT_OK(kvd_seq_index_observation(s, l, (void **)&iq));
			for (uint32_t j = 0; j < WINDOW * INDEX_HEADS * INDEX_DIM; j++)
				iq[j] = j % INDEX_DIM == 0 ? 5.0f : 0.0f;
		}
		ASSERT_OK(kvd_seq_observe(s, l));
	}
	ASSERT_OK(kvd_seq_unpin(s));
}

TEST(registration) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	const struct kvd_latent_header *lat;
	const struct kvd_moments_header *mom;
	kvd_index_spec bad = { .heads = 65, .dim = 4 };
	kvd_model_spec spec = {
		.layers = LAYERS, .q_heads = Q_HEADS, .kv_heads = KV_HEADS, .head_dim = HEAD_DIM,
		.dtype = KVD_DTYPE_F32, .block_tokens = BLOCK_TOKENS, .layout = KVD_LAYOUT_PER_HEAD,
	};
	kvd_eviction_spec ev = { .unit = KVD_UNIT_HEAD_TOKEN, .window = WINDOW };
	void *p;
	int plain, both;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "reg");
	/* An indexer and a latent memory serve eviction: without a unit there is none. */
	ASSERT_ERRNO(register_model(c, KVD_UNIT_NONE, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_NONE, 1),
	             -EINVAL);
	ASSERT_ERRNO(register_model(c, KVD_UNIT_NONE, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_LATENT, 0),
	             -EINVAL);
	ASSERT_ERRNO(kvd_model_register_indexed(c, &spec, &ev, KVD_COMPENSATION_NONE, &bad), -EINVAL);
	bad = (kvd_index_spec){ .heads = 1, .dim = 1, .reserved = { 1 } };
	ASSERT_ERRNO(kvd_model_register_indexed(c, &spec, &ev, KVD_COMPENSATION_NONE, &bad), -EINVAL);
	plain = register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_NONE, 0);
	both = register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_LATENT, 1);
	ASSERT_OK(plain);
	ASSERT_OK(both);

	ASSERT_OK(kvd_seq_open(c, plain, MAX_TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_ERRNO(kvd_seq_index_key(s, 0, 0, 0, &p), -EOPNOTSUPP);
	ASSERT_ERRNO(kvd_seq_index_observation(s, 0, &p), -EOPNOTSUPP);
	ASSERT_ERRNO(kvd_seq_latent(s, 0, 0, &lat), -EOPNOTSUPP);
	ASSERT_EQ(kvd_seq_descriptor(s)->index_dim, 0u);
	ASSERT_OK(kvd_seq_release(s));

	ASSERT_OK(kvd_seq_open(c, both, MAX_TOKENS, &s));
	ASSERT_EQ(kvd_seq_descriptor(s)->index_dim, (uint32_t)INDEX_DIM);
	ASSERT_EQ(kvd_seq_descriptor(s)->index_heads, (uint32_t)INDEX_HEADS);
	ASSERT_EQ(kvd_seq_descriptor(s)->index_offset, 2ull * BLOCK_TOKENS * HEAD_DIM * 4);
	ASSERT_EQ(kvd_seq_descriptor(s)->moments_bytes, KVD_LATENT_BYTES(HEAD_DIM));
	ASSERT_ERRNO(kvd_seq_latent(s, 0, 0, &lat), -ENODATA);
	ASSERT_ERRNO(kvd_seq_moments(s, 0, 0, &mom), -EOPNOTSUPP);
	ASSERT_ERRNO(kvd_seq_index_observation(s, LAYERS, &p), -EINVAL);
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_ERRNO(kvd_seq_index_key(s, 0, 0, 1, &p), -EINVAL);
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			ASSERT_OK(kvd_seq_latent(s, l, h, &lat));
			ASSERT_EQ(lat->count, 0u);
			ASSERT_EQ(lat->head_dim, (uint32_t)HEAD_DIM);
		}
	/* Counted against the tenant: K, V and index keys of one block per table, and the
	 * latent blocks. */
	ASSERT_EQ(fixture_status(&f, "reg", "block_bytes"),
	          LAYERS * KV_HEADS *
	                  (2ull * BLOCK_TOKENS * HEAD_DIM * 4 + BLOCK_TOKENS * INDEX_DIM * 4 +
	                   KVD_LATENT_BYTES(HEAD_DIM)));
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(fixture_status(&f, "reg", "block_bytes"), 0u);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Pinned: every resident slot's index key is its position's; returns the resident
 * important positions before the protected end and, in *ret_others, the other ones. */
static uint64_t check_index(kvd_seq *s, uint64_t *ret_others) {
	uint64_t important = 0, others = 0, next;

	ASSERT_OK(kvd_seq_pin(s));
	next = kvd_seq_descriptor(s)->next_position;
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t tokens = kvd_seq_tokens(s, l, h);

			for (uint32_t j = 0; j < (uint32_t)tokens; j++) {
				uint32_t pos = (uint32_t)kvd_seq_position(s, l, h, j);
				float *ik;

				ASSERT_OK(kvd_seq_index_key(s, l, h, j, (void **)&ik));
				for (uint32_t a = 0; a < INDEX_DIM; a++)
					ASSERT_TRUE(ik[a] == index_value(pos, a));
				/* By position: the slots of the protected end move as tokens go. */
				if (pos < SINKS || pos + WINDOW + BLOCK_TOKENS >= next)
					continue;
				if (pos % IMPORTANT == 0)
					important++;
				else
					others++;
			}
		}
	ASSERT_OK(kvd_seq_unpin(s));
	*ret_others = others;
	return important;
}

/* Policy indexmem keeps what the index queries point at, and compaction keeps each
 * index key with its token, on every unit and layout. */
TEST(indexmem_keeps_what_the_indexer_favours) {
	static const struct {
		uint32_t unit, layout;
	} cases[] = {
		{ KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER },
	};
	struct fixture f;

	fixture_setup(&f, "[tenant t-indexmem]\npolicy = indexmem\n", false);
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, NULL });
	for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
		kvd_client *c = fixture_connect(&f, "t-indexmem");
		uint64_t important0, others0, important1, others1, freed;
		kvd_seq *s;
		int model = register_model(c, cases[i].unit, cases[i].layout, KVD_COMPENSATION_NONE, 1);

		ASSERT_OK(model);
		ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
		for (int j = 0; j < 4; j++)
			step(s, 128, 1);
		important0 = check_index(s, &others0);
		/* Fewer bytes than the unimportant tokens hold: only they may go. */
		ASSERT_OK(kvd_evict(c, "t-indexmem", 16u << 10, &freed));
		important1 = check_index(s, &others1);
		ASSERT_EQ(important1, important0);
		ASSERT_TRUE(others1 + 100 < others0);
		/* Later tokens get their keys in the slots the compaction left. */
		step(s, 64, 1);
		(void)check_index(s, &others1);
		ASSERT_OK(kvd_seq_release(s));
		kvd_client_unref(c);
	}
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * Pinned: each (layer, kv head)'s latent block holds z and s of the positions that are no
 * longer resident (phi = elu + 1). Returns the tokens evicted, all heads together.
 */
static uint64_t check_latent(kvd_seq *s) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint32_t next = d->next_position;
	uint64_t total = 0;
	bool *resident = calloc(next, sizeof(bool));

	ASSERT_NOT_NULL(resident);
	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			const struct kvd_latent_header *m;
			const float *z, *sm;
			double wz[HEAD_DIM] = { 0 }, ws[HEAD_DIM][HEAD_DIM] = { { 0 } };
			int64_t tokens = kvd_seq_tokens(s, l, h);
			uint64_t n = 0;

			ASSERT_OK(kvd_seq_latent(s, l, h, &m));
			z = (const float *)((const char *)m + KVD_LATENT_HEADER_BYTES);
			sm = z + HEAD_DIM;
			memset(resident, 0, next * sizeof(bool));
			for (uint32_t j = 0; j < (uint32_t)tokens; j++)
				resident[kvd_seq_position(s, l, h, j)] = true;
			for (uint32_t pos = 0; pos < next; pos++) {
				if (resident[pos])
					continue;
				n++;
				for (uint32_t a = 0; a < HEAD_DIM; a++) {
					double k = kv_value(0, l, h, pos, a), phi = k > 0 ? k + 1 : exp(k);

					wz[a] += phi;
					for (uint32_t b = 0; b < HEAD_DIM; b++)
						ws[a][b] += phi * kv_value(1, l, h, pos, b);
				}
			}
			ASSERT_EQ(m->count, n);
			total += n;
			for (uint32_t a = 0; a < HEAD_DIM; a++) {
				ASSERT_TRUE(fabs(z[a] - wz[a]) < 1e-3 * (1 + fabs(wz[a])));
				for (uint32_t b = 0; b < HEAD_DIM; b++)
					ASSERT_TRUE(fabs(sm[a * HEAD_DIM + b] - ws[a][b]) <
					            1e-3 * (1 + fabs(ws[a][b])));
			}
		}
	ASSERT_OK(kvd_seq_unpin(s));
	free(resident);
	return total;
}

/* Every unit and layout, kvd and indexmem: rounds add exactly what they drop. */
TEST(rounds_fold_what_they_drop_into_the_latent_memory) {
	static const struct {
		uint32_t unit, layout;
	} cases[] = {
		{ KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER },
		{ KVD_UNIT_BLOCK, KVD_LAYOUT_PER_LAYER },
	};
	static const char *const policies[] = { "kvd", "indexmem" };
	struct fixture f;

	fixture_setup(&f, "[tenant t-kvd]\npolicy = kvd\n[tenant t-indexmem]\npolicy = indexmem\n",
	              false);
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, NULL });
	for (size_t p = 0; p < ELEMENTSOF(policies); p++)
		for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
			char tenant[32];
			kvd_client *c;
			kvd_seq *s;
			uint64_t freed, before;
			int model;

			snprintf(tenant, sizeof(tenant), "t-%s", policies[p]);
			c = fixture_connect(&f, tenant);
			model = register_model(c, cases[i].unit, cases[i].layout, KVD_COMPENSATION_LATENT, 1);
			ASSERT_OK(model);
			ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
			for (int j = 0; j < 4; j++)
				step(s, 128, 1);
			ASSERT_EQ(check_latent(s), 0u);
			ASSERT_OK(kvd_evict(c, tenant, 16u << 10, &freed));
			before = check_latent(s);
			ASSERT_TRUE(before > 0);
			/* A plan made while pinned folds when it is applied, at the unpin. */
			step(s, 128, 1);
			ASSERT_OK(kvd_seq_pin(s));
			ASSERT_OK(kvd_evict(c, tenant, 16u << 10, &freed));
			ASSERT_OK(kvd_seq_unpin(s));
			ASSERT_TRUE(check_latent(s) > before);
			ASSERT_OK(kvd_seq_release(s));
			kvd_client_unref(c);
		}
	ASSERT_EQ(fixture_stop(&f), 0);
}
