/* SPDX-License-Identifier: MIT */
/*
 * KV events through the daemon's publisher, from C (so that the sanitizer build runs the
 * publisher thread, its queue and its replay): a prefix published is announced block by
 * block, the tenant's cache dropped is announced as removed, the replay from 0 has the
 * start's AllBlocksCleared and ends with -1, and the daemon with a publisher still stops on
 * SIGTERM. tests/python/test_kv_events.py decodes every field as a router would.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zmq.h>

#include "fixture.h"
#include "test.h"

#define BLOCK_TOKENS 16
#define KEYS 6

static const kvd_model_spec spec = { "events", 2, 2, 2, 64, KVD_DTYPE_F16, BLOCK_TOKENS,
	                             KVD_LAYOUT_PER_LAYER };

/* How often the msgpack string s (fixstr) occurs in the n bytes at p. */
static unsigned count_str(const uint8_t *p, size_t n, const char *s) {
	size_t len = strlen(s);
	unsigned k = 0;

	for (size_t i = 0; i + 1 + len <= n; i++)
		k += p[i] == (0xa0 | len) && memcmp(p + i + 1, s, len) == 0;
	return k;
}

/* Reads messages from sub for up to timeout_ms until `want` events of tag arrived;
 * returns how many did. */
static unsigned receive(void *sub, const char *tag, unsigned want, int timeout_ms) {
	unsigned got = 0;

	for (int waited = 0; got < want && waited < timeout_ms; waited += 50) {
		zmq_pollitem_t item = { .socket = sub, .events = ZMQ_POLLIN };

		if (zmq_poll(&item, 1, 50) <= 0)
			continue;
		for (int part = 0;; part++) {
			zmq_msg_t m;
			int more;
			size_t sz = sizeof(more);

			zmq_msg_init(&m);
			ASSERT_TRUE(zmq_msg_recv(&m, sub, 0) >= 0);
			if (part == 1)
				ASSERT_EQ(zmq_msg_size(&m), 8u);
			if (part == 2)
				got += count_str(zmq_msg_data(&m), zmq_msg_size(&m), tag);
			zmq_msg_close(&m);
			ASSERT_OK(zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &sz));
			if (!more) {
				ASSERT_EQ(part, 2);
				break;
			}
		}
	}
	return got;
}

TEST(events_published_and_replayed) {
	char pub[160], replay[160];
	const char *args[] = { "--kv-events", pub, "--kv-events-replay", replay, NULL };
	uint8_t keys[KEYS][KVD_KEY_BYTES], root[KVD_KEY_BYTES];
	uint32_t tokens[KEYS * BLOCK_TOKENS];
	struct fixture f;
	kvd_client *c, *admin;
	void *ctx = zmq_ctx_new(), *sub, *dealer;
	kvd_seq *s;
	int m;

	for (uint32_t i = 0; i < KEYS * BLOCK_TOKENS; i++)
		tokens[i] = 7 * i + 3;
	ASSERT_OK(kvd_key_root("0", root));
	ASSERT_EQ(kvd_prefix_keys(root, tokens, KEYS * BLOCK_TOKENS, BLOCK_TOKENS, NULL, &keys[0][0],
	                          KEYS), KEYS);
	fixture_setup(&f, NULL, false);
	snprintf(pub, sizeof(pub), "ipc://%s/events", f.dir);
	snprintf(replay, sizeof(replay), "ipc://%s/replay", f.dir);
	fixture_launch(&f, args);
	sub = zmq_socket(ctx, ZMQ_SUB);
	ASSERT_OK(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0));
	ASSERT_OK(zmq_connect(sub, pub));
	/* A subscriber joins a moment after it connects. */
	usleep(200000);

	c = fixture_connect(&f, "events");
	m = kvd_model_register(c, &spec);
	ASSERT_OK(m);
	{
		kvd_open_params p = { .size = sizeof(p), .model_id = m, .max_tokens = 1024,
			              .n_prefix_keys = KEYS, .prefix_keys = &keys[0][0],
			              .prefix_tokens = tokens };

		ASSERT_OK(kvd_seq_open_params(c, &p, &s));
	}
	ASSERT_OK(kvd_seq_grow(s, KEYS * BLOCK_TOKENS));
	ASSERT_OK(kvd_seq_publish(s, KEYS));
	ASSERT_EQ(receive(sub, "BlockStored", KEYS, 10000), (unsigned)KEYS);
	/* Released, the blocks stay cached: nothing is removed. */
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(receive(sub, "BlockRemoved", 1, 300), 0u);
	kvd_client_unref(c);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_delete(admin, "events"));
	ASSERT_EQ(receive(sub, "BlockRemoved", KEYS, 10000), (unsigned)KEYS);
	ASSERT_EQ(fixture_status(&f, NULL, "kv_events"), 1u + 2 * KEYS);
	ASSERT_EQ(fixture_status(&f, NULL, "kv_events_dropped"), 0u);

	/* The replay from 0: the AllBlocksCleared missed before connecting first, -1 last. */
	dealer = zmq_socket(ctx, ZMQ_DEALER);
	ASSERT_OK(zmq_connect(dealer, replay));
	{
		uint8_t start[8] = { 0 }, buf[65536];
		unsigned cleared = 0, stored = 0, batches = 0;
		bool end = false;

		ASSERT_EQ(zmq_send(dealer, "", 0, ZMQ_SNDMORE), 0);
		ASSERT_EQ(zmq_send(dealer, start, sizeof(start), 0), 8);
		while (!end) {
			zmq_pollitem_t item = { .socket = dealer, .events = ZMQ_POLLIN };
			uint8_t seq[8];
			int n;

			ASSERT_EQ(zmq_poll(&item, 1, 5000), 1);
			ASSERT_EQ(zmq_recv(dealer, buf, sizeof(buf), 0), 0);
			ASSERT_EQ(zmq_recv(dealer, seq, sizeof(seq), 0), 8);
			n = zmq_recv(dealer, buf, sizeof(buf), 0);
			ASSERT_TRUE(n >= 0 && n <= (int)sizeof(buf));
			end = memcmp(seq, "\xff\xff\xff\xff\xff\xff\xff\xff", 8) == 0;
			if (end) {
				ASSERT_EQ(n, 0);
				break;
			}
			/* Sequence numbers from 0, one per batch. */
			ASSERT_EQ(seq[7], (uint8_t)batches);
			batches++;
			cleared += count_str(buf, (size_t)n, "AllBlocksCleared");
			stored += count_str(buf, (size_t)n, "BlockStored");
		}
		ASSERT_EQ(cleared, 1u);
		ASSERT_EQ(stored, (unsigned)KEYS);
		ASSERT_EQ(fixture_status(&f, NULL, "kv_event_batches"), (uint64_t)batches);
	}
	zmq_close(dealer);
	zmq_close(sub);
	zmq_ctx_term(ctx);
	kvd_client_unref(admin);
	/* SIGTERM reaches the loop, not a publisher thread. */
	ASSERT_EQ(fixture_stop(&f), 0);
}
