/* SPDX-License-Identifier: MIT */
/*
 * Prefix sharing (kvd_seq_open_params with keys, kvd_seq_publish; docs/engines.md "Prefix
 * sharing"): an open finds the longest leading run of its prompt's blocks that sequences of
 * its tenant published for a model of the same name and layout, across connections, and
 * shares them; nothing of it is found by another tenant, another model, after a truncate,
 * or before the publish; a sharer's writes and releases never change another's bytes.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

#define LAYERS 2
#define BLOCK_TOKENS 16
#define PROMPT 100        /* tokens: 6 full blocks and 4 */
#define KEYS (PROMPT / BLOCK_TOKENS)

static const char *const args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", NULL };

/* 2 layers of 2 kv heads x 64 f16: 8 KiB blocks of 16 tokens, per layer. */
static const kvd_model_spec spec = { "prefix-model", LAYERS, 2, 2, 64, KVD_DTYPE_F16,
	                             BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };

/* The prompt's token ids and its keys, from the root of seed "0". */
static uint32_t prompt[PROMPT];
static uint8_t keys[KEYS][KVD_KEY_BYTES];

/* The prompt from token id base on, with the tokens from first_changed on one higher. */
static void make_keys_from(uint32_t base, uint32_t first_changed) {
	uint8_t root[KVD_KEY_BYTES];

	for (uint32_t i = 0; i < PROMPT; i++)
		prompt[i] = base + 7 * i + (i >= first_changed);
	ASSERT_OK(kvd_key_root("0", root));
	ASSERT_EQ(kvd_prefix_keys(root, prompt, PROMPT, BLOCK_TOKENS, NULL, &keys[0][0], KEYS),
	          (int64_t)KEYS);
}

static void make_keys(uint32_t first_changed) {
	make_keys_from(1000, first_changed);
}

static int open_prefix(kvd_client *c, int m, uint32_t n_keys, kvd_seq **ret) {
	kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = 1024,
		              .n_prefix_keys = n_keys, .prefix_keys = &keys[0][0] };

	return kvd_seq_open_params(c, &p, ret);
}

/* What an engine does with a prompt it found nothing of: grow, prefill (fill), publish. */
static kvd_seq *prefill(kvd_client *c, int m, uint32_t tag) {
	kvd_seq *s;

	ASSERT_OK(open_prefix(c, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_OK(kvd_seq_grow(s, PROMPT));
	fill_seq(s, tag);
	ASSERT_OK(kvd_seq_publish(s, KEYS));
	return s;
}

TEST(prefix_shared_across_connections) {
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *sa, *sb, *sc;
	uint64_t per, digest;
	int ma, mb;

	make_keys(PROMPT);
	fixture_start(&f, args);
	a = fixture_connect(&f, "chat");
	b = fixture_connect(&f, "chat");
	ma = kvd_model_register(a, &spec);
	mb = kvd_model_register(b, &spec);
	ASSERT_OK(ma);
	ASSERT_OK(mb);
	sa = prefill(a, ma, 1);
	per = kvd_seq_descriptor(sa)->block_bytes;

	/* A lookup says so without opening, and counts nothing; of another model, nothing. */
	{
		uint32_t cached = 7;

		ASSERT_EQ(kvd_prefix_lookup(b, mb, &keys[0][0], KEYS, &cached), (int64_t)KEYS);
		ASSERT_EQ(cached, 0u);
		ASSERT_EQ(kvd_prefix_lookup(b, mb, &keys[1][0], KEYS - 1, NULL), 0);
		ASSERT_EQ(kvd_prefix_lookup(b, mb, &keys[0][0], 0, NULL), -EINVAL);
		ASSERT_EQ(fixture_status(&f, "chat", "prefix_hits"), 0u);
	}
	/* Another engine of the tenant finds the 6 full blocks: 96 tokens, the same bytes. */
	ASSERT_OK(open_prefix(b, mb, KEYS, &sb));
	assert_positions_upto(sb, KEYS * BLOCK_TOKENS);
	ASSERT_EQ(check_seq(sb, 1), 0u);
	assert_digests_agree(sb);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), KEYS * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, "chat", "shared_bytes"), KEYS * LAYERS * per);
	/* Counted once: a's 7 blocks a layer, and nothing more for b's. */
	ASSERT_EQ(fixture_status(&f, "chat", "block_bytes"), (KEYS + 1) * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, "chat", "prefix_hits"), 1u);
	ASSERT_EQ(fixture_status(&f, "chat", "prefix_misses"), 1u);
	ASSERT_EQ(fixture_status(&f, "chat", "prefix_tokens"), (uint64_t)KEYS * BLOCK_TOKENS);
	ASSERT_EQ(fixture_status(&f, NULL, "prefix_tokens"), (uint64_t)KEYS * BLOCK_TOKENS);

	/* b prefills the rest of its prompt and decodes; a's bytes stay a's. */
	ASSERT_OK(kvd_seq_grow(sb, PROMPT - KEYS * BLOCK_TOKENS + 20));
	fill_seq_from(sb, 2, KEYS * BLOCK_TOKENS);
	ASSERT_EQ(check_seq(sa, 1), 0u);
	assert_digests_agree(sa);
	digest = assert_digests_agree(sb);

	/* a goes: b keeps its bytes, and a third open finds the prompt through b, which
	 * published what it attached. */
	ASSERT_OK(kvd_seq_release(sa));
	ASSERT_EQ(assert_digests_agree(sb), digest);
	ASSERT_OK(open_prefix(a, ma, KEYS, &sc));
	ASSERT_EQ(kvd_seq_tokens(sc, 1, 0), KEYS * BLOCK_TOKENS);
	ASSERT_EQ(check_seq(sc, 1), 0u);
	ASSERT_OK(kvd_seq_release(sb));
	ASSERT_OK(kvd_seq_release(sc));
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	/* The prompt's 6 blocks outlive their last sequence, in the prefix cache, and a later
	 * open finds them there: the same bytes. */
	ASSERT_EQ(fixture_status(&f, "chat", "block_bytes"), KEYS * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, "chat", "cached_bytes"), KEYS * LAYERS * per);
	ASSERT_EQ(fixture_status(&f, NULL, "cached_blocks"), (uint64_t)KEYS);
	{
		uint32_t cached = 0;

		ASSERT_EQ(kvd_prefix_lookup(a, ma, &keys[0][0], KEYS, &cached), (int64_t)KEYS);
		ASSERT_EQ(cached, (uint32_t)KEYS);
	}
	ASSERT_OK(open_prefix(b, mb, KEYS, &sb));
	ASSERT_EQ(kvd_seq_tokens(sb, 0, 0), KEYS * BLOCK_TOKENS);
	ASSERT_EQ(check_seq(sb, 1), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "cache_hits"), (uint64_t)KEYS);
	ASSERT_EQ(fixture_status(&f, "chat", "block_bytes"), KEYS * LAYERS * per);
	ASSERT_OK(kvd_seq_release(sb));
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The prefix cache: kept within a tenant's max-cached-percent, shed (least recently used
 * first) for a grow that needs the memory before anything live goes, and dropped with a
 * tenant that left. */
TEST(prefix_cache_kept_and_shed) {
	static const char *const cache_args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB",
		                                  "--max-cached-percent", "10", "--grant-wait", "0",
		                                  "--tenant-forget", "100", NULL };
	struct fixture f;
	kvd_client *a, *admin;
	kvd_seq *s, *big;
	uint64_t per;
	int m;

	make_keys(PROMPT);
	fixture_start(&f, cache_args);
	admin = fixture_connect(&f, NULL);
	a = fixture_connect(&f, "chat");
	m = kvd_model_register(a, &spec);
	ASSERT_OK(m);
	s = prefill(a, m, 1);
	per = kvd_seq_descriptor(s)->block_bytes;
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(fixture_status(&f, "chat", "cached_bytes"), KEYS * LAYERS * per);
	/* A tenant at its max: the cache makes room for its grow, nothing live is touched. */
	ASSERT_OK(kvd_tenant_set(admin, "chat", 0, fixture_status(&f, "chat", "used_bytes"), 0));
	ASSERT_OK(kvd_seq_open(a, m, 8192, &big));
	/* The tenant's chunk: 128 blocks of 8 KiB, 12 of them cached (6 a layer). 60 blocks a
	 * layer take 4 of those: the 2 oldest entries go, the rest stays. */
	ASSERT_OK(kvd_seq_grow(big, 60 * BLOCK_TOKENS));
	ASSERT_TRUE(fixture_status(&f, "chat", "cached_bytes") < KEYS * LAYERS * per);
	ASSERT_TRUE(fixture_status(&f, "chat", "cached_bytes") > 0);
	ASSERT_TRUE(fixture_status(&f, NULL, "cache_dropped") > 0);
	ASSERT_EQ(fixture_status(&f, "chat", "used_bytes"), 1u << 20);
	ASSERT_OK(kvd_seq_release(big));
	/* Settings of its own would keep the tenant (and its cache) past tenant-forget. */
	ASSERT_OK(kvd_tenant_reset(admin, "chat"));
	/* Past the cap (10% of 16 MiB: 1.6 MiB), the oldest go: 40 prompts' worth of blocks
	 * are offered, the cache keeps what fits. */
	for (uint32_t k = 0; k < 40; k++) {
		make_keys_from(100000 + 1000 * k, PROMPT);
		s = prefill(a, m, 2);
		ASSERT_OK(kvd_seq_release(s));
		ASSERT_TRUE(fixture_status(&f, "chat", "cached_bytes") <= (16u << 20) / 10);
	}
	/* The newest prompt is still there, the oldest not. */
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), KEYS * BLOCK_TOKENS);
	ASSERT_OK(kvd_seq_release(s));
	make_keys_from(100000, PROMPT);
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_OK(kvd_seq_release(s));
	/* The tenant leaves: after tenant-forget its cache goes, then the tenant. */
	kvd_client_unref(a);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "cached_bytes", 0));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A grow of another tenant waiting for memory gets it from the cache first: a cached
 * prompt goes before any round. */
TEST(prefix_cache_gives_way_to_grows) {
	struct fixture f;
	kvd_client *a, *b, *admin;
	kvd_seq *s, *big;
	int ma, mb;

	make_keys(PROMPT);
	fixture_start(&f, args);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_budget_set(admin, 4u << 20));
	a = fixture_connect(&f, "chat");
	ma = kvd_model_register(a, &spec);
	ASSERT_OK(ma);
	s = prefill(a, ma, 1);
	ASSERT_OK(kvd_seq_release(s));
	/* Nobody maps its chunk once its engine is gone: dropping its blocks frees it. */
	kvd_client_unref(a);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 1u << 20);
	ASSERT_TRUE(fixture_status(&f, NULL, "cached_bytes") > 0);
	b = fixture_connect(&f, "batch");
	mb = kvd_model_register(b, &spec);
	ASSERT_OK(mb);
	ASSERT_OK(kvd_seq_open(b, mb, 8192, &big));
	/* 1024 tokens a chunk (2 tables of 8 KiB blocks): 3 chunks fit beside the cache, the
	 * 4th only in its place. */
	ASSERT_OK(kvd_seq_grow(big, 3 * 1024));
	ASSERT_OK(kvd_seq_grow(big, 1024));
	ASSERT_EQ(fixture_status(&f, NULL, "cached_bytes"), 0u);
	ASSERT_TRUE(fixture_status(&f, NULL, "cache_dropped") > 0);
	ASSERT_EQ(fixture_status(&f, "batch", "evicted_tokens"), 0u);
	ASSERT_OK(kvd_seq_release(big));
	kvd_client_unref(b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Only the leading run of keys the tenant published for this model is found. */
TEST(prefix_found_only_where_it_should) {
	static const kvd_model_spec other_name = { "other-model", LAYERS, 2, 2, 64, KVD_DTYPE_F16,
		                                   BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };
	static const kvd_model_spec no_name = { NULL, LAYERS, 2, 2, 64, KVD_DTYPE_F16,
		                                BLOCK_TOKENS, KVD_LAYOUT_PER_LAYER };
	static const kvd_model_spec other_layout = { "prefix-model", LAYERS, 2, 2, 64, KVD_DTYPE_F16,
		                                     8, KVD_LAYOUT_PER_LAYER };
	struct fixture f;
	kvd_client *a, *hostile;
	kvd_seq *sa, *s;
	int m, m2;

	make_keys(PROMPT);
	fixture_start(&f, args);
	a = fixture_connect(&f, "chat");
	m = kvd_model_register(a, &spec);
	ASSERT_OK(m);

	/* Before the publish: nothing. */
	ASSERT_OK(open_prefix(a, m, KEYS, &sa));
	ASSERT_OK(kvd_seq_grow(sa, PROMPT));
	fill_seq(sa, 1);
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_OK(kvd_seq_release(s));
	/* Publishing what it has no key for, or has not grown, is refused. */
	ASSERT_EQ(kvd_seq_publish(sa, KEYS + 1), -EINVAL);
	ASSERT_OK(kvd_seq_publish(sa, 2));
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 2 * BLOCK_TOKENS);
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_OK(kvd_seq_publish(sa, KEYS));

	/* A prompt that differs from token 50 on (block 3) finds blocks 0..2. */
	make_keys(50);
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 3 * BLOCK_TOKENS);
	ASSERT_EQ(check_seq(s, 1), 0u);
	ASSERT_OK(kvd_seq_release(s));
	make_keys(PROMPT);

	/* Another model name of the same shape, or another block layout under the name, finds
	 * nothing; a model without a name cannot use keys. */
	m2 = kvd_model_register(a, &other_name);
	ASSERT_OK(m2);
	ASSERT_OK(open_prefix(a, m2, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_OK(kvd_seq_release(s));
	m2 = kvd_model_register(a, &other_layout);
	ASSERT_OK(m2);
	ASSERT_OK(open_prefix(a, m2, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_OK(kvd_seq_release(s));
	m2 = kvd_model_register(a, &no_name);
	ASSERT_OK(m2);
	ASSERT_EQ(open_prefix(a, m2, KEYS, &s), -EINVAL);
	/* More keys than max_tokens holds blocks. */
	{
		kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = 5 * BLOCK_TOKENS,
			              .n_prefix_keys = KEYS, .prefix_keys = &keys[0][0] };

		ASSERT_EQ(kvd_seq_open_params(a, &p, &s), -EINVAL);
	}

	/* Another tenant with the same keys and model finds nothing: it cannot even tell that
	 * the prompt is on the node. */
	hostile = fixture_connect(&f, "other");
	m2 = kvd_model_register(hostile, &spec);
	ASSERT_OK(m2);
	ASSERT_EQ(kvd_prefix_lookup(hostile, m2, &keys[0][0], KEYS, NULL), 0);
	ASSERT_OK(open_prefix(hostile, m2, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_EQ(fixture_status(&f, "other", "prefix_misses"), 1u);
	ASSERT_OK(kvd_seq_release(s));

	/* A truncate to 60 tokens, into block 3, unpublishes blocks 3 onwards. */
	ASSERT_OK(kvd_seq_truncate(sa, PROMPT - 60));
	ASSERT_OK(open_prefix(a, m, KEYS, &s));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 3 * BLOCK_TOKENS);
	ASSERT_OK(kvd_seq_release(s));
	/* Grown again with other tokens, the blocks cannot be published under the old keys. */
	ASSERT_OK(kvd_seq_grow(sa, 60));
	ASSERT_EQ(kvd_seq_publish(sa, KEYS), -EINVAL);

	ASSERT_OK(kvd_seq_release(sa));
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	kvd_client_unref(hostile);
	kvd_client_unref(a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The keys travel in a sealed memfd: anything else is refused with the reason. */
TEST(prefix_keys_fd_checked) {
	struct fixture f;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	int fd, memfd;

	ASSERT_NOT_NULL(rx);
	wire_rx_init(rx);
	fixture_start(&f, args);
	fd = raw_connect(&f);
	ASSERT_EQ(raw_hello(fd, rx, "chat", 1, 1), 0);
	ASSERT_EQ(raw_register_model(fd, rx, &spec, 1), 0);
	memfd = memfd_create("keys", MFD_ALLOW_SEALING);
	ASSERT_GE(memfd, 0);
	ASSERT_EQ(write(memfd, keys, sizeof(keys)), (ssize_t)sizeof(keys));
	for (int i = 0; i < 4; i++) {
		Kvd__V1__SeqOpen req = KVD__V1__SEQ_OPEN__INIT;
		Envelope env = KVD__V1__ENVELOPE__INIT;
		int fds[WIRE_FDS_MAX];
		Envelope *rep;
		uint32_t nfds;

		req.has_model_id = req.has_max_tokens = req.has_prefix_blocks = true;
		req.model_id = 1;
		req.max_tokens = 1024;
		req.prefix_blocks = i == 3 ? KEYS + 1 : KEYS;
		env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_OPEN;
		env.seq_open = &req;
		env.has_id = true;
		env.id = 2 + i;
		/* No fd; an unsealed memfd; then sealed (0); then more keys than it holds. */
		if (i == 2)
			ASSERT_EQ(fcntl(memfd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK), 0);
		ASSERT_OK(raw_send_fds(fd, &env, &memfd, i == 0 ? 0 : 1));
		ASSERT_EQ(raw_recv_fds(fd, rx, 5000, &rep, fds, &nfds), 1);
		ASSERT_EQ(rep->id, env.id);
		ASSERT_EQ(rep->status ? rep->status->code : 0, i == 2 ? 0 : -EINVAL);
		/* The opened sequence's descriptor. */
		ASSERT_EQ(nfds, i == 2 ? 1u : 0u);
		while (nfds > 0)
			close(fds[--nfds]);
	}
	close(memfd);
	close(fd);
	wire_rx_done(rx);
	free(rx);
	ASSERT_EQ(fixture_stop(&f), 0);
}
