/* SPDX-License-Identifier: MIT */
/*
 * Forks (kvd_seq_fork, docs/engines.md "Fork"): the fork starts with its parent's tokens
 * and K/V, sharing the full blocks (counted once) and copying the partly filled ones; both
 * then grow, write, truncate and release independently without ever changing the other's
 * bytes; nobody but the sequence's connection can fork it. Rounds and forks are in
 * test-daemon-evict (fork_shared_blocks_never_evicted), restarts in test-daemon-keep.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define LAYERS 2
#define BLOCK_TOKENS 16

static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };

/* 2 layers of 2 kv heads x 64 f16: 8 KiB blocks of 16 tokens, per layer. */
static const kvd_model_spec spec = { "fork", LAYERS, 2, 2, 64, KVD_DTYPE_F16, BLOCK_TOKENS,
	                             KVD_LAYOUT_PER_LAYER };

/* Resident bytes of s whose original position is at least from. */
static uint64_t bytes_from(kvd_seq *s, uint32_t from) {
	const struct kvd_seq_desc *d = kvd_seq_descriptor(s);
	uint64_t per_token = 2ull * d->kv_heads * d->head_dim * 2;
	uint64_t n = 0;

	for (uint32_t l = 0; l < LAYERS; l++)
		for (int64_t j = 0; j < kvd_seq_tokens(s, l, 0); j++)
			n += kvd_seq_position(s, l, 0, (uint32_t)j) >= from ? per_token : 0;
	return n;
}

TEST(fork_shares_full_blocks) {
	struct fixture f;
	uint64_t per, digest;
	kvd_seq *parent, *child;
	kvd_client *c;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "sampler");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &parent));
	ASSERT_OK(kvd_seq_grow(parent, 40));
	fill_seq(parent, 1);
	per = kvd_seq_descriptor(parent)->block_bytes;

	/* 40 tokens a layer: 2 full blocks shared, the third copied. */
	ASSERT_OK(kvd_seq_fork(parent, &child));
	assert_positions_upto(child, 40);
	ASSERT_EQ(check_seq(child, 1), 0u);
	assert_digests_agree(child);
	ASSERT_EQ(fixture_status(&f, "sampler", "block_bytes"), (3 + 1) * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 2 * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, NULL, "forks"), 1u);
	/* kvdctl seqs: each holds 3 blocks a layer, 2 of them shared. */
	{
		kvd_client *admin = fixture_connect(&f, NULL);
		kvd_table *t = NULL;
		uint64_t v;

		ASSERT_OK(kvd_sequences_get(admin, "sampler", &t));
		ASSERT_EQ(kvd_table_rows(t), 2u);
		for (uint32_t row = 0; row < 2; row++) {
			ASSERT_OK(kvd_table_u64(t, row, "shared_bytes", &v));
			ASSERT_EQ(v, 2 * LAYERS * per);
			ASSERT_OK(kvd_table_u64(t, row, "bytes", &v));
			ASSERT_EQ(v, 3 * LAYERS * per);
		}
		kvd_table_free(t);
		kvd_client_unref(admin);
	}

	/* Each grows and writes its own next slots: the other's bytes do not change. */
	ASSERT_OK(kvd_seq_grow(parent, 10));
	fill_seq_from(parent, 1, 40);
	ASSERT_OK(kvd_seq_grow(child, 20));
	fill_seq_from(child, 2, 40);
	assert_positions_upto(parent, 50);
	assert_positions_upto(child, 60);
	ASSERT_EQ(check_seq(parent, 1), 0u);
	ASSERT_EQ(check_seq(child, 1), bytes_from(child, 40));
	ASSERT_EQ(check_seq(child, 2), bytes_from(child, 0) - bytes_from(child, 40));
	assert_digests_agree(parent);
	digest = assert_digests_agree(child);

	/* Releasing the parent leaves the child's bytes as they were, and the shared blocks
	 * now the child's alone. */
	ASSERT_OK(kvd_seq_release(parent));
	ASSERT_EQ(assert_digests_agree(child), digest);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(child));
	ASSERT_EQ(fixture_status(&f, "sampler", "block_bytes"), 0u);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* n forks of one prompt hold one copy of its full blocks, and the child released first
 * leaves the parent intact too. */
TEST(forks_hold_one_copy) {
	struct fixture f;
	kvd_seq *parent, *kids[4];
	kvd_client *c;
	uint64_t per;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "sampler");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &parent));
	ASSERT_OK(kvd_seq_grow(parent, 256));
	fill_seq(parent, 5);
	per = kvd_seq_descriptor(parent)->block_bytes;
	for (int i = 0; i < 4; i++) {
		ASSERT_OK(kvd_seq_fork(parent, &kids[i]));
		ASSERT_EQ(check_seq(kids[i], 5), 0u);
	}
	/* 256 tokens: 16 full blocks a layer, none copied. */
	ASSERT_EQ(fixture_status(&f, "sampler", "block_bytes"), 16 * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 4 * 16 * LAYERS * per);
	for (int i = 0; i < 4; i++) {
		ASSERT_OK(kvd_seq_grow(kids[i], 1));
		fill_seq_from(kids[i], 10 + (uint32_t)i, 256);
	}
	for (int i = 0; i < 4; i++)
		ASSERT_OK(kvd_seq_release(kids[i]));
	ASSERT_EQ(check_seq(parent, 5), 0u);
	assert_digests_agree(parent);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(parent));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A truncate back into the shared blocks, then a grow: the grow copies the shared last
 * block before writing the next slots into it (copy on write), so the parent keeps its
 * bytes. */
TEST(grow_after_truncate_into_shared_copies) {
	struct fixture f;
	kvd_seq *parent, *child;
	kvd_client *c;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "drafter");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &parent));
	ASSERT_OK(kvd_seq_grow(parent, 40));
	fill_seq(parent, 1);
	ASSERT_OK(kvd_seq_fork(parent, &child));
	ASSERT_OK(kvd_seq_truncate(child, 30));
	assert_positions_upto(child, 10);
	ASSERT_OK(kvd_seq_grow(child, 5));
	fill_seq_from(child, 2, 10);
	assert_positions_upto(child, 15);
	ASSERT_EQ(check_seq(parent, 1), 0u);
	assert_digests_agree(parent);
	ASSERT_EQ(check_seq(child, 2), bytes_from(child, 0) - bytes_from(child, 10));
	assert_digests_agree(child);
	ASSERT_OK(kvd_seq_release(child));
	ASSERT_EQ(check_seq(parent, 1), 0u);
	ASSERT_OK(kvd_seq_release(parent));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Opens on a raw connection of tenant a fork of seq_id with model 1; returns the code. */
static int raw_fork(struct fixture *f, const char *tenant, uint64_t seq_id) {
	Kvd__V1__SeqOpen req = KVD__V1__SEQ_OPEN__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	int fd = raw_connect(f), code;

	ASSERT_NOT_NULL(rx);
	wire_rx_init(rx);
	ASSERT_EQ(raw_hello(fd, rx, tenant, 1, 1), 0);
	ASSERT_EQ(raw_register_model(fd, rx, &spec, 6), 0);
	req.has_model_id = req.has_max_tokens = req.has_fork_of = true;
	req.model_id = 1;
	req.max_tokens = 1024;
	req.fork_of = seq_id;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN;
	env.seq_open = &req;
	code = raw_call(fd, rx, &env, 7);
	wire_rx_done(rx);
	free(rx);
	close(fd);
	return code;
}

/* Only the sequence's own connection forks it: another tenant's, and another connection
 * of the same tenant, get -ENOENT as for no sequence at all, and share nothing. */
TEST(fork_of_another_connections_sequence_refused) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "victim");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 64));
	fill_seq(s, 3);
	ASSERT_EQ(raw_fork(&f, "attacker", kvd_seq_id(s)), -ENOENT);
	ASSERT_EQ(raw_fork(&f, "victim", kvd_seq_id(s)), -ENOENT);
	ASSERT_EQ(fixture_status(&f, NULL, "forks"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	ASSERT_EQ(check_seq(s, 3), 0u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
