/* SPDX-License-Identifier: MIT */
/*
 * MomentKV compensation end to end: a model registered with moments gets its moments
 * blocks with the first grow, counted against the tenant and freed with the sequence;
 * every eviction round folds exactly the K/V it drops into them (checked against the
 * moments of the evicted positions, computed here from the values written, and the key
 * bounds), on every unit and layout, with policies kvd and kvd-mi, across several rounds
 * and a plan that waits for an unpin.
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
#define MAX_TOKENS 4096

#define POOL "--pool-size=64MiB"
#define CHUNK "--chunk-size=256KiB"

/* The K or V value of (layer, kv head, position, element): smooth in the position, so
 * that keys have structure for the scores, distinct per head. */
static float kv_value(int is_v, uint32_t l, uint32_t h, uint32_t pos, uint32_t a) {
	return is_v ? cosf(0.11f * pos + 0.7f * a + 3.0f * l + h) + 0.2f * a
		    : sinf(0.37f * pos + 1.3f * a + l + 2.0f * h) + 0.5f;
}

static int register_model(kvd_client *c, uint32_t unit, uint32_t layout, uint32_t compensation) {
	kvd_model_spec spec = {
		.name = "moments-test",
		.layers = LAYERS,
		.q_heads = Q_HEADS,
		.kv_heads = KV_HEADS,
		.head_dim = HEAD_DIM,
		.dtype = KVD_DTYPE_F32,
		.block_tokens = BLOCK_TOKENS,
		.layout = layout,
	};
	kvd_eviction_spec ev = { .unit = unit, .window = WINDOW, .sinks = SINKS };

	return kvd_model_register_compensated(c, &spec, unit == KVD_UNIT_NONE ? NULL : &ev, compensation);
}

/* Grows s by n tokens and writes their K/V and a window of queries per layer. */
static void step(kvd_seq *s, uint32_t n, uint64_t *rng) {
	uint64_t from = kvd_seq_descriptor(s)->next_position;

	ASSERT_OK(kvd_seq_grow(s, n));
	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < LAYERS; l++) {
		float *q;

		for (uint32_t h = 0; h < KV_HEADS; h++) {
			int64_t tokens = kvd_seq_tokens(s, l, h);

			ASSERT_OK(tokens);
			for (uint32_t j = 0; j < (uint32_t)tokens; j++) {
				int64_t pos = kvd_seq_position(s, l, h, j);
				float *k, *v;

				if ((uint64_t)pos < from)
					continue;
				ASSERT_OK(kvd_seq_kv(s, l, h, j, (void **)&k, (void **)&v));
				for (uint32_t a = 0; a < HEAD_DIM; a++) {
					k[a] = kv_value(0, l, h, (uint32_t)pos, a);
					v[a] = kv_value(1, l, h, (uint32_t)pos, a);
				}
			}
		}
		ASSERT_OK(kvd_seq_observation(s, l, (void **)&q));
		for (uint32_t j = 0; j < Q_HEADS * WINDOW * HEAD_DIM; j++) {
			*rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
			q[j] = (float)((*rng >> 40) & 0xff) / 64.0f - 2.0f;
		}
		ASSERT_OK(kvd_seq_observe(s, l));
	}
	ASSERT_OK(kvd_seq_unpin(s));
}

/*
 * Pinned: each (layer, kv head)'s moments block holds the exact summary of the positions
 * that are no longer resident. Returns the tokens evicted, all heads together.
 */
static uint64_t check_moments(kvd_seq *s) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint32_t next = d->next_position;
	uint64_t total = 0;
	bool *resident = calloc(next, sizeof(bool));

	ASSERT_NOT_NULL(resident);
	ASSERT_OK(kvd_seq_pin(s));
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			const struct kvd_moments_header *m;
			const float *mk, *mv, *var, *cov;
			double sk[HEAD_DIM] = { 0 }, sv[HEAD_DIM] = { 0 };
			int64_t tokens = kvd_seq_tokens(s, l, h);
			uint64_t n = 0;

			ASSERT_OK(kvd_seq_moments(s, l, h, &m));
			ASSERT_EQ(m->head_dim, (uint32_t)HEAD_DIM);
			mk = (const float *)((const char *)m + KVD_MOMENTS_HEADER_BYTES);
			mv = mk + HEAD_DIM, var = mv + HEAD_DIM, cov = var + HEAD_DIM;
			memset(resident, 0, next * sizeof(bool));
			for (uint32_t j = 0; j < (uint32_t)tokens; j++)
				resident[kvd_seq_position(s, l, h, j)] = true;
			for (uint32_t pos = 0; pos < next; pos++)
				if (!resident[pos]) {
					n++;
					for (uint32_t a = 0; a < HEAD_DIM; a++) {
						sk[a] += kv_value(0, l, h, pos, a);
						sv[a] += kv_value(1, l, h, pos, a);
					}
				}
			ASSERT_EQ(m->count, n);
			total += n;
			if (n == 0)
				continue;
			for (uint32_t a = 0; a < HEAD_DIM; a++) {
				sk[a] /= n, sv[a] /= n;
				ASSERT_TRUE(fabs(mk[a] - sk[a]) < 1e-5 && fabs(mv[a] - sv[a]) < 1e-5);
			}
			/* The key bounds: the largest norm exactly, a radius at least the largest
			 * distance from the mean (rounds merged in several folds). */
			{
				double norm_max = 0, radius = 0;

				for (uint32_t pos = 0; pos < next; pos++) {
					double nn = 0, rr = 0;

					if (resident[pos])
						continue;
					for (uint32_t a = 0; a < HEAD_DIM; a++) {
						double x = kv_value(0, l, h, pos, a);

						nn += x * x, rr += (x - sk[a]) * (x - sk[a]);
					}
					norm_max = fmax(norm_max, sqrt(nn)), radius = fmax(radius, sqrt(rr));
				}
				ASSERT_TRUE(fabs(m->key_norm_max - norm_max) < 1e-5 * (1 + norm_max));
				ASSERT_TRUE(m->key_radius >= radius * (1 - 1e-5));
			}
			for (uint32_t a = 0; a < HEAD_DIM; a++) {
				double vk = 0;

				for (uint32_t pos = 0; pos < next; pos++)
					if (!resident[pos]) {
						double x = kv_value(0, l, h, pos, a) - sk[a];

						vk += x * x;
					}
				ASSERT_TRUE(fabs(var[a] - vk / n) < 1e-5);
				for (uint32_t b = 0; b < HEAD_DIM; b++) {
					double c = 0;

					for (uint32_t pos = 0; pos < next; pos++)
						if (!resident[pos])
							c += (kv_value(1, l, h, pos, a) - sv[a]) *
							     (kv_value(0, l, h, pos, b) - sk[b]);
					if (!(fabs(cov[a * HEAD_DIM + b] - c / n) < 1e-5)) {
						fprintf(stderr, "layer %u head %u cov[%u][%u]: %g, want %g\n", l, h, a,
						        b, cov[a * HEAD_DIM + b], c / n);
						ASSERT_TRUE(false);
					}
				}
			}
		}
	ASSERT_OK(kvd_seq_unpin(s));
	free(resident);
	return total;
}

TEST(registration) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	const struct kvd_moments_header *m;
	int plain, mom;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	c = fixture_connect(&f, "reg");
	/* Moments summarise evictions: without an eviction unit there are none. */
	ASSERT_ERRNO(register_model(c, KVD_UNIT_NONE, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_MOMENTS),
	             -EINVAL);
	ASSERT_ERRNO(register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, 7), -EINVAL);
	plain = register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_NONE);
	mom = register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_MOMENTS);
	ASSERT_OK(plain);
	ASSERT_OK(mom);

	ASSERT_OK(kvd_seq_open(c, plain, MAX_TOKENS, &s));
	ASSERT_ERRNO(kvd_seq_moments(s, 0, 0, &m), -EOPNOTSUPP);
	ASSERT_OK(kvd_seq_release(s));

	ASSERT_OK(kvd_seq_open(c, mom, MAX_TOKENS, &s));
	ASSERT_EQ(kvd_seq_descriptor(s)->moments_bytes, KVD_MOMENTS_BYTES(HEAD_DIM));
	ASSERT_ERRNO(kvd_seq_moments(s, 0, 0, &m), -ENODATA);
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_ERRNO(kvd_seq_moments(s, LAYERS, 0, &m), -EINVAL);
	ASSERT_ERRNO(kvd_seq_moments(s, 0, KV_HEADS, &m), -EINVAL);
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t h = 0; h < KV_HEADS; h++) {
			ASSERT_OK(kvd_seq_moments(s, l, h, &m));
			ASSERT_EQ(m->count, 0u);
			ASSERT_EQ(m->head_dim, (uint32_t)HEAD_DIM);
		}
	/* Counted against the tenant like K/V: one block per table and the moments. */
	ASSERT_EQ(fixture_status(&f, "reg", "block_bytes"),
	          LAYERS * KV_HEADS * (2ull * BLOCK_TOKENS * HEAD_DIM * 4 + KVD_MOMENTS_BYTES(HEAD_DIM)));
	/* A second grow allocates no more moments. */
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_EQ(fixture_status(&f, "reg", "block_bytes"),
	          LAYERS * KV_HEADS * (2ull * BLOCK_TOKENS * HEAD_DIM * 4 + KVD_MOMENTS_BYTES(HEAD_DIM)));
	/* Freed with the sequence. */
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(fixture_status(&f, "reg", "block_bytes"), 0u);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant whose cap leaves no room for the moments cannot grow: they are bounded. */
TEST(moments_count_against_the_cap) {
	struct fixture f;
	kvd_client *c, *admin;
	kvd_seq *s;
	int mom;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	/* One chunk: the K/V blocks fit in it, the moments (their own block size) do not. */
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, 256u << 10, 0));
	c = fixture_connect(&f, "capped");
	mom = register_model(c, KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, KVD_COMPENSATION_MOMENTS);
	ASSERT_OK(mom);
	ASSERT_OK(kvd_seq_open(c, mom, MAX_TOKENS, &s));
	ASSERT_ERRNO(kvd_seq_grow(s, 1), -EDQUOT);
	ASSERT_EQ(fixture_status(&f, "capped", "block_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Every unit and layout, kvd and kvd-mi: rounds fold exactly what they drop. */
TEST(rounds_fold_what_they_drop) {
	static const struct {
		uint32_t unit, layout;
	} cases[] = {
		{ KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER },
		{ KVD_UNIT_BLOCK, KVD_LAYOUT_PER_LAYER },
	};
	static const char *const policies[] = { "kvd", "kvd-mi" };
	char config[512] = "";
	struct fixture f;

	for (size_t i = 0; i < ELEMENTSOF(policies); i++) {
		size_t n = strlen(config);

		snprintf(config + n, sizeof(config) - n, "[tenant t-%s]\npolicy = %s\n", policies[i],
		         policies[i]);
	}
	fixture_setup(&f, config, false);
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, NULL });
	for (size_t p = 0; p < ELEMENTSOF(policies); p++)
		for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
			char tenant[32];
			kvd_client *c;
			kvd_seq *s;
			uint64_t rng = 7 + i, freed, before;
			int model;

			snprintf(tenant, sizeof(tenant), "t-%s", policies[p]);
			c = fixture_connect(&f, tenant);
			model = register_model(c, cases[i].unit, cases[i].layout, KVD_COMPENSATION_MOMENTS);
			ASSERT_OK(model);
			ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
			for (int j = 0; j < 4; j++)
				step(s, 128, &rng);
			ASSERT_EQ(check_moments(s), 0u);
			/* Two rounds: the second merges into what the first left. */
			ASSERT_OK(kvd_evict(c, tenant, 16u << 10, &freed));
			before = check_moments(s);
			ASSERT_TRUE(before > 0);
			step(s, 128, &rng);
			ASSERT_OK(kvd_evict(c, tenant, 16u << 10, &freed));
			ASSERT_TRUE(check_moments(s) > before);
			/* A plan made while pinned folds when it is applied, at the unpin. */
			step(s, 128, &rng);
			before = check_moments(s);
			ASSERT_OK(kvd_seq_pin(s));
			ASSERT_OK(kvd_evict(c, tenant, 16u << 10, &freed));
			ASSERT_OK(kvd_seq_unpin(s));
			ASSERT_TRUE(check_moments(s) > before);
			ASSERT_OK(kvd_seq_release(s));
			kvd_client_unref(c);
		}
	ASSERT_EQ(fixture_stop(&f), 0);
}
