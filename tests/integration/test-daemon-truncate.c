/* SPDX-License-Identifier: MIT */
/*
 * Rollback (kvd_seq_truncate, docs/engines.md "Rollback"): the last positions go, every
 * table keeps the slots before them with their K/V intact, blocks and chunks left empty go
 * back, the next grow continues where the truncate left it; pins stay and are charged
 * again; nobody but the sequence's connection can truncate it. Races with rounds are in
 * test-daemon-evict (round_races_truncate).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)
#define LAYERS 2
#define BLOCK_TOKENS 16

static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };

/* 2 layers of 2 kv heads x 64 f16: 8 KiB blocks of 16 tokens, per layer. */
static const kvd_model_spec spec = { "truncate", LAYERS, 2, 2, 64, KVD_DTYPE_F16, BLOCK_TOKENS,
	                             KVD_LAYOUT_PER_LAYER };

static uint64_t block_bytes(const kvd_seq *s) {
	return kvd_seq_descriptor(s)->block_bytes;
}

TEST(truncate_drops_the_last_positions) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	uint64_t per;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "drafter");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 40));
	fill_seq(s, 1);
	per = block_bytes(s);
	/* 40 tokens: 3 blocks a layer. */
	ASSERT_EQ(fixture_status(&f, "drafter", "block_bytes"), 3 * LAYERS * per);

	/* Back to 30: still 2 blocks a layer, the rest intact. */
	ASSERT_OK(kvd_seq_truncate(s, 10));
	assert_positions_upto(s, 30);
	ASSERT_EQ(check_seq(s, 1), 0u);
	assert_digests_agree(s);
	ASSERT_EQ(fixture_status(&f, "drafter", "block_bytes"), 2 * LAYERS * per);

	/* The next grow continues at 30, and the new slots are the caller's to write. */
	ASSERT_OK(kvd_seq_grow(s, 5));
	assert_positions_upto(s, 35);
	fill_seq_from(s, 1, 30);
	ASSERT_EQ(check_seq(s, 1), 0u);
	assert_digests_agree(s);

	/* Nothing, or more than it has, is refused and changes nothing. */
	ASSERT_EQ(kvd_seq_truncate(s, 0), -EINVAL);
	ASSERT_EQ(kvd_seq_truncate(s, 36), -EINVAL);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "1..35"));
	assert_positions_upto(s, 35);

	/* All of it: the tables are empty, the chunk goes back once this process unmapped it
	 * (the call answered the daemon's request), and the sequence grows again from 0. */
	ASSERT_OK(kvd_seq_truncate(s, 35));
	assert_positions_upto(s, 0);
	ASSERT_EQ(fixture_status(&f, "drafter", "block_bytes"), 0u);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "truncates"), 2u);
	ASSERT_EQ(fixture_status(&f, NULL, "truncated_tokens"), 45u);
	ASSERT_OK(kvd_seq_grow(s, 20));
	assert_positions_upto(s, 20);
	fill_seq(s, 2);
	ASSERT_EQ(check_seq(s, 2), 0u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The engine's own change while it holds the sequence pinned: the pin stays, and what the
 * tenant has pinned follows what the sequence holds. */
TEST(truncate_pinned_keeps_the_pin) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	uint64_t per;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "drafter");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 64));
	per = block_bytes(s);
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_EQ(fixture_status(&f, "drafter", "pinned_bytes"), 4 * LAYERS * per);
	ASSERT_OK(kvd_seq_truncate(s, 17));
	assert_positions_upto(s, 47);
	ASSERT_EQ(fixture_status(&f, "drafter", "pinned_bytes"), 3 * LAYERS * per);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_EQ(fixture_status(&f, "drafter", "pinned_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Sends SeqTruncate of seq_id on a raw connection of tenant; returns the reply's code. */
static int raw_truncate(struct fixture *f, const char *tenant, uint64_t seq_id, uint32_t n) {
	Kvd__V1__SeqTruncate req = KVD__V1__SEQ_TRUNCATE__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	int fd = raw_connect(f), code;

	ASSERT_NOT_NULL(rx);
	wire_rx_init(rx);
	ASSERT_EQ(raw_hello(fd, rx, tenant, 1, 1), 0);
	req.has_seq_id = req.has_tokens = true;
	req.seq_id = seq_id;
	req.tokens = n;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_TRUNCATE;
	env.seq_truncate = &req;
	code = raw_call(fd, rx, &env, 7);
	wire_rx_done(rx);
	free(rx);
	close(fd);
	return code;
}

/* Only the sequence's own connection reaches it: another tenant, and another connection of
 * the same tenant, get -ENOENT, as for a sequence that does not exist, and it is untouched. */
TEST(truncate_of_another_connections_sequence_refused) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int m;

	fixture_start(&f, args);
	c = fixture_connect(&f, "victim");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 40));
	fill_seq(s, 3);
	ASSERT_EQ(raw_truncate(&f, "attacker", kvd_seq_id(s), 10), -ENOENT);
	ASSERT_EQ(raw_truncate(&f, "victim", kvd_seq_id(s), 10), -ENOENT);
	ASSERT_EQ(raw_truncate(&f, NULL, kvd_seq_id(s), 10), -EPERM);
	assert_positions_upto(s, 40);
	ASSERT_EQ(check_seq(s, 3), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "truncates"), 0u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
