/* SPDX-License-Identifier: MIT */
/*
 * Token recall (docs/recall.md) end to end: a tenant with recall keeps what rounds evict from
 * its sequences in the host tier; once its engine publishes a new window, kvd_seq_recall
 * brings back the kept tokens that window attends to, each in place of a resident one worth
 * less. Tables keep their token counts and blocks, the tenant and the pool their bytes (at
 * the round gate too, between scoring and trading), every slot its original position and
 * its K/V bytes; a second recall with the same window changes nothing; a sequence that goes
 * away during its recall takes its kept tokens along.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "basic/macro.h"
#include "fixture.h"
#include "test.h"

#define LAYERS 2
#define Q_HEADS 4
#define KV_HEADS 2
#define HEAD_DIM 32
#define BLOCK_TOKENS 16
#define WINDOW 8
#define SINKS 4
/* The context, its needles (keys every question query attends to), the question. */
#define CONTEXT 256
#define NEEDLE 40
#define NEEDLES 8
#define QUESTION 8
#define RECALL_MAX 4096              /* never binding here: recall_bounded_per_row binds it */
#define ONE 0x3c00                   /* 1.0 in f16 */

static uint64_t mix(uint64_t x) {
	x += UINT64_C(0x9e3779b97f4a7c15);
	x = (x ^ (x >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	x = (x ^ (x >> 27)) * UINT64_C(0x94d049bb133111eb);
	return x ^ (x >> 31);
}

/* A small f16 of mean 0, drawn from x. */
static uint16_t small(uint64_t x) {
	static const uint16_t v[] = { 0x3c00, 0xbc00, 0x3800, 0xb800, 0x3400, 0xb400, 0x0000 };

	return v[mix(x) % ELEMENTSOF(v)];
}

/* Element e of the K (kv 0) or V row of (layer, kv head) at position pos: the needles' keys
 * are all ones, everything else small noise. */
static uint16_t value(uint32_t layer, uint32_t head, uint32_t pos, uint32_t kv, uint32_t e) {
	if (kv == 0 && pos >= NEEDLE && pos < NEEDLE + NEEDLES)
		return ONE;
	return small(((((uint64_t)layer * 8 + head) * 4096 + pos) * 2 + kv) * 64 + e);
}

/* Writes (fill) or checks every resident slot of s at position from or later. */
static void slots(kvd_seq *s, uint32_t from, bool fill) {
	uint16_t want[HEAD_DIM], got[HEAD_DIM];

	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t kh = 0; kh < KV_HEADS; kh++) {
			int64_t n = kvd_seq_tokens(s, l, kh);

			ASSERT_OK(n);
			for (uint32_t i = 0; i < (uint32_t)n; i++) {
				int64_t pos = kvd_seq_position(s, l, kh, i);
				void *kv[2];

				ASSERT_OK(pos);
				if (i > 0)
					ASSERT_LT(kvd_seq_position(s, l, kh, i - 1), pos);
				if (pos < from)
					continue;
				ASSERT_OK(kvd_seq_kv(s, l, kh, i, &kv[0], &kv[1]));
				for (uint32_t v = 0; v < 2; v++) {
					for (uint32_t e = 0; e < HEAD_DIM; e++)
						want[e] = value(l, kh, (uint32_t)pos, v, e);
					if (fill) {
						kv_write(kv[v], want, sizeof(want));
						continue;
					}
					kv_read(kv[v], got, sizeof(got));
					ASSERT_EQ(memcmp(got, want, sizeof(want)), 0);
				}
			}
		}
}

/* Publishes a window per layer: the question's (all ones: it looks for the needles) or
 * noise that looks for nothing in particular. */
static void publish(kvd_seq *s, bool question, uint32_t tag) {
	for (uint32_t l = 0; l < LAYERS; l++) {
		uint16_t *q;

		ASSERT_OK(kvd_seq_observation(s, l, (void **)&q));
		for (uint32_t j = 0; j < Q_HEADS * WINDOW * HEAD_DIM; j++)
			q[j] = question ? ONE : small(((uint64_t)tag << 32) + l * 100000 + j);
		ASSERT_OK(kvd_seq_observe(s, l));
	}
}

/* One step: grow by n, write what came, publish a window. */
static void step(kvd_seq *s, uint32_t n, bool question) {
	uint32_t from = (uint32_t)kvd_seq_descriptor(s)->next_position;

	ASSERT_OK(kvd_seq_grow(s, n));
	ASSERT_OK(kvd_seq_pin(s));
	slots(s, from, true);
	publish(s, question, from);
	ASSERT_OK(kvd_seq_unpin(s));
}

/* A daemon with a host tier of tier_size, its rounds held at gate (NULL: none), its log
 * in a file with log. */
static void start_logged(struct fixture *f, const char *tier_size, const char *gate, bool log) {
	const char *args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", "--host-tier-size",
		               tier_size, "--high-watermark", "100", NULL };

	if (gate)
		ASSERT_OK(setenv("KVD_TEST_ROUND_GATE", gate, 1));
	fixture_setup(f, NULL, log);
	fixture_launch(f, args);
	if (gate)
		ASSERT_OK(unsetenv("KVD_TEST_ROUND_GATE"));
}

static void start(struct fixture *f, const char *tier_size, const char *gate) {
	start_logged(f, tier_size, gate, false);
}

/* Tenant r: evicts by recency (so that the needles go first), recall on. */
static void tenant_recall(struct fixture *f, const char *name, uint32_t recall) {
	kvd_client *admin = fixture_connect(f, NULL);
	kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_POLICY | KVD_TENANT_SET_RECALL,
		                .policy = "streamingllm", .recall = recall };

	ASSERT_OK(kvd_tenant_set_params(admin, name, &p));
	kvd_client_unref(admin);
}

static kvd_client *engine(struct fixture *f, const char *tenant, uint32_t layout, uint32_t unit,
                          kvd_seq **ret) {
	kvd_model_spec spec = { "recall-test", LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, KVD_DTYPE_F16,
		                BLOCK_TOKENS, layout };
	kvd_eviction_spec ev = { .unit = unit, .window = WINDOW, .sinks = SINKS };
	kvd_client *c = fixture_connect(f, tenant);
	int model = kvd_model_register_evictable(c, &spec, &ev);

	ASSERT_OK(model);
	ASSERT_OK(kvd_seq_open(c, model, 4096, ret));
	return c;
}

/* Whether every table holds the needles. */
static bool needles_resident(kvd_seq *s) {
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t kh = 0; kh < KV_HEADS; kh++) {
			uint32_t found = 0;

			for (int64_t i = 0; i < kvd_seq_tokens(s, l, kh); i++) {
				int64_t pos = kvd_seq_position(s, l, kh, (uint32_t)i);

				found += pos >= NEEDLE && pos < NEEDLE + NEEDLES;
			}
			if (found != NEEDLES)
				return false;
		}
	return true;
}

/* The context evicted down to half by recency (the needles among what leaves), then the
 * question's step. Returns the tokens each table held before the recall. */
static void context_then_question(struct fixture *f, kvd_client *c, kvd_seq *s, const char *tenant,
                                  int64_t *tokens) {
	kvd_client *admin = fixture_connect(f, NULL);
	uint64_t freed;

	step(s, CONTEXT, false);
	ASSERT_OK(kvd_evict(admin, tenant, LAYERS * CONTEXT / 2 * 2 * KV_HEADS * HEAD_DIM * 2, &freed));
	ASSERT_FALSE(needles_resident(s));
	ASSERT_GT(fixture_status(f, NULL, "recall_kept_tokens"), 0u);
	step(s, QUESTION, true);
	for (uint32_t l = 0; l < LAYERS; l++)
		for (uint32_t kh = 0; kh < KV_HEADS; kh++)
			tokens[l * KV_HEADS + kh] = kvd_seq_tokens(s, l, kh);
	kvd_client_unref(admin);
	(void)c;
}

TEST(recall_brings_back_what_the_question_needs) {
	static const uint32_t shapes[][2] = {
		{ KVD_LAYOUT_PER_LAYER, KVD_UNIT_LAYER_TOKEN },
		{ KVD_LAYOUT_PER_HEAD, KVD_UNIT_HEAD_TOKEN },
		{ KVD_LAYOUT_PER_HEAD, KVD_UNIT_LAYER_TOKEN },
	};

	for (uint32_t i = 0; i < ELEMENTSOF(shapes); i++) {
		struct fixture f;
		kvd_client *c, *admin;
		kvd_evictions *ev = NULL;
		int64_t before[LAYERS * KV_HEADS];
		uint64_t tokens, bytes, block_bytes, used, n, rounds;
		const char *trigger;
		kvd_seq *s;

		start(&f, "8MiB", NULL);
		tenant_recall(&f, "r", RECALL_MAX);
		c = engine(&f, "r", shapes[i][0], shapes[i][1], &s);
		context_then_question(&f, c, s, "r", before);
		block_bytes = fixture_status(&f, "r", "block_bytes");
		used = fixture_status(&f, NULL, "used_bytes");
		ASSERT_OK(kvd_seq_recall(s, &tokens, &bytes));
		/* Every table has its needles back, in place of as many resident slots. */
		ASSERT_GE(tokens, (uint64_t)NEEDLES * LAYERS * KV_HEADS / (shapes[i][0] == KVD_LAYOUT_PER_LAYER ? KV_HEADS : 1));
		ASSERT_EQ(bytes, tokens * (shapes[i][0] == KVD_LAYOUT_PER_LAYER ? KV_HEADS : 1) *
		                         2 * HEAD_DIM * 2);
		ASSERT_TRUE(needles_resident(s));
		for (uint32_t l = 0; l < LAYERS; l++)
			for (uint32_t kh = 0; kh < KV_HEADS; kh++)
				ASSERT_EQ(kvd_seq_tokens(s, l, kh), before[l * KV_HEADS + kh]);
		slots(s, 0, false);
		(void)assert_digests_agree(s);
		ASSERT_EQ(fixture_status(&f, "r", "block_bytes"), block_bytes);
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), used);
		ASSERT_EQ(fixture_status(&f, NULL, "recalls"), 1u);
		ASSERT_EQ(fixture_status(&f, NULL, "recalled_tokens"), tokens);
		/* kvdctl evictions: the recall is a round of its own. */
		admin = fixture_connect(&f, NULL);
		ASSERT_OK(kvd_evictions_get(admin, &ev));
		rounds = kvd_evictions_count(ev);
		ASSERT_OK(kvd_evictions_str(ev, (uint32_t)rounds - 1, "trigger", &trigger));
		ASSERT_STREQ(trigger, "recall");
		ASSERT_OK(kvd_evictions_u64(ev, (uint32_t)rounds - 1, "recalled_tokens", &n));
		ASSERT_EQ(n, tokens);
		ASSERT_OK(kvd_evictions_u64(ev, (uint32_t)rounds - 1, "scored_tokens", &n));
		ASSERT_GE(n, tokens);
		kvd_evictions_free(ev);
		/* The same window again: what it wants is resident already. */
		ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
		ASSERT_EQ(tokens, 0u);
		slots(s, 0, false);
		/* Releasing the sequence gives its kept tokens' segments back. */
		ASSERT_OK(kvd_seq_release(s));
		ASSERT_TRUE(fixture_wait_status(&f, NULL, "recall_kept_tokens", 0));
		ASSERT_EQ(fixture_status(&f, NULL, "recall_kept_bytes"), 0u);
		ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0u);
		kvd_client_unref(admin);
		kvd_client_unref(c);
		ASSERT_OK(fixture_stop(&f));
	}
}

/* A blocking call on a thread of its own, so that the test can hold the round gate. */
struct call {
	pthread_t thread;
	struct fixture *f;
	kvd_seq *s;                   /* a recall of s; NULL: an eviction from tenant r */
	uint64_t tokens;
	int r;
};

static void *call_run(void *userdata) {
	struct call *k = userdata;

	if (k->s) {
		k->r = kvd_seq_recall(k->s, &k->tokens, NULL);
	} else {
		kvd_client *admin = fixture_connect(k->f, NULL);

		k->r = kvd_evict(admin, "r", LAYERS * CONTEXT / 2 * 2 * KV_HEADS * HEAD_DIM * 2, NULL);
		kvd_client_unref(admin);
	}
	return NULL;
}

static void call_start(struct call *k, struct fixture *f, kvd_seq *s) {
	*k = (struct call){ .f = f, .s = s, .r = 1 };
	ASSERT_EQ(pthread_create(&k->thread, NULL, call_run, k), 0);
}

static int call_end(struct call *k) {
	ASSERT_EQ(pthread_join(k->thread, NULL), 0);
	return k->r;
}

/*
 * A daemon whose rounds wait at gate (its log in a file with log), tenant r with recall, and
 * its engine (*ret_c, *ret_s) through the context, evicted by a round let through the gate,
 * and the question's step: ready for a recall.
 */
static void gated_question(struct fixture *f, const char *gate, bool log, kvd_client **ret_c,
                           kvd_seq **ret_s) {
	struct call k;

	start_logged(f, "8MiB", gate, log);
	tenant_recall(f, "r", RECALL_MAX);
	*ret_c = engine(f, "r", KVD_LAYOUT_PER_LAYER, KVD_UNIT_LAYER_TOKEN, ret_s);
	step(*ret_s, CONTEXT, false);
	call_start(&k, f, NULL);
	fixture_gate_release(fixture_gate_wait(gate));
	ASSERT_OK(call_end(&k));
	ASSERT_FALSE(needles_resident(*ret_s));
	step(*ret_s, QUESTION, true);
}

/* Between its scoring and its trade (the round gate), the pool and the tenant hold what
 * they held, and after it too: a trade allocates nothing and frees nothing; the sequence's
 * digest changes only by the trade, every slot's bytes matching its position. */
TEST(recall_never_passes_the_budget) {
	char gate[128];
	struct fixture f;
	struct call k;
	kvd_client *c;
	uint64_t block_bytes, used, digest;
	kvd_seq *s;

	TEST_NEEDS_HOOKS();
	fixture_gate_make(gate, sizeof(gate));
	gated_question(&f, gate, false, &c, &s);
	block_bytes = fixture_status(&f, "r", "block_bytes");
	used = fixture_status(&f, NULL, "used_bytes");
	digest = assert_digests_agree(s);
	call_start(&k, &f, s);
	{
		int fd = fixture_gate_wait(gate);

		ASSERT_EQ(fixture_status(&f, "r", "block_bytes"), block_bytes);
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), used);
		/* (The engine's connection waits for the recall's reply: nothing of the
		 * sequence is asked through it here.) */
		fixture_gate_release(fd);
	}
	ASSERT_OK(call_end(&k));
	ASSERT_GE(k.tokens, (uint64_t)NEEDLES * LAYERS);
	ASSERT_TRUE(needles_resident(s));
	slots(s, 0, false);
	ASSERT_NE(assert_digests_agree(s), digest);
	ASSERT_EQ(fixture_status(&f, "r", "block_bytes"), block_bytes);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), used);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_OK(fixture_stop(&f));
	unlink(gate);
}

/* The daemon stopped while a recall round waits at the gate: it exits cleanly, the round's
 * kept tokens freed with it (the sanitizer build checks for leaks), the engine's call
 * failing instead of hanging. */
TEST(recall_daemon_stops_during_its_round) {
	char gate[128];
	struct fixture f;
	struct call k;
	kvd_client *c;
	kvd_seq *s;
	int fd;

	TEST_NEEDS_HOOKS();
	fixture_gate_make(gate, sizeof(gate));
	gated_question(&f, gate, true, &c, &s);
	call_start(&k, &f, s);
	fd = fixture_gate_wait(gate);
	ASSERT_EQ(kill(f.pid, SIGTERM), 0);
	ASSERT_TRUE(fixture_wait_log(&f, "stopping", 1));
	fixture_gate_release(fd);
	ASSERT_LT(call_end(&k), 0);
	/* The daemon is gone: the handle is freed all the same. */
	(void)kvd_seq_release(s);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	unlink(gate);
}

/* An engine killed while its recall waits at the gate: the round ends without its sequence,
 * whose kept tokens go back to the tier. */
TEST(recall_engine_killed_during_its_round) {
	char gate[128];
	struct fixture f;
	/* to_child: the parent's go-aheads; to_parent: the child's "done". */
	int status, to_child[2], to_parent[2];
	pid_t pid;
	char b;

	TEST_NEEDS_HOOKS();
	fixture_gate_make(gate, sizeof(gate));
	start(&f, "8MiB", gate);
	tenant_recall(&f, "r", RECALL_MAX);
	ASSERT_OK(pipe(to_child));
	ASSERT_OK(pipe(to_parent));
	pid = fixture_fork();
	if (pid == 0) {
		kvd_seq *s;
		kvd_client *c = engine(&f, "r", KVD_LAYOUT_PER_LAYER, KVD_UNIT_LAYER_TOKEN, &s);
		struct call k;

		step(s, CONTEXT, false);
		ASSERT_EQ(write(to_parent[1], "c", 1), 1);
		/* The parent passes the eviction's round through the gate. */
		ASSERT_EQ(read(to_child[0], &b, 1), 1);
		step(s, QUESTION, true);
		call_start(&k, &f, s);
		ASSERT_EQ(write(to_parent[1], "q", 1), 1);
		pause();
		kvd_client_unref(c);
		_exit(0);
	}
	ASSERT_EQ(read(to_parent[0], &b, 1), 1);
	{
		struct call k;

		call_start(&k, &f, NULL);
		fixture_gate_release(fixture_gate_wait(gate));
		ASSERT_OK(call_end(&k));
	}
	ASSERT_GT(fixture_status(&f, NULL, "recall_kept_tokens"), 0u);
	ASSERT_EQ(write(to_child[1], "e", 1), 1);
	ASSERT_EQ(read(to_parent[0], &b, 1), 1);
	{
		int fd = fixture_gate_wait(gate);

		ASSERT_EQ(kill(pid, SIGKILL), 0);
		ASSERT_EQ(waitpid(pid, &status, 0), pid);
		ASSERT_TRUE(fixture_wait_status(&f, NULL, "sequences", 0));
		fixture_gate_release(fd);
	}
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "recall_kept_tokens", 0));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_used_bytes", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "recalled_tokens"), 0u);
	for (uint32_t i = 0; i < 2; i++) {
		close(to_child[i]);
		close(to_parent[i]);
	}
	ASSERT_OK(fixture_stop(&f));
	unlink(gate);
}

/* The tenant's recall bounds a recall per row: 4 slots of each row come back, 4 more at
 * the next recall; raised live, the next brings back the rest the window wants; turned off,
 * the kept tokens are gone. */
TEST(recall_bounded_per_row) {
	struct fixture f;
	kvd_client *c;
	int64_t before[LAYERS * KV_HEADS];
	uint64_t tokens;
	kvd_seq *s;

	start(&f, "8MiB", NULL);
	tenant_recall(&f, "r", 4);
	c = engine(&f, "r", KVD_LAYOUT_PER_HEAD, KVD_UNIT_HEAD_TOKEN, &s);
	context_then_question(&f, c, s, "r", before);
	ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
	ASSERT_EQ(tokens, 4u * LAYERS * KV_HEADS);
	ASSERT_FALSE(needles_resident(s));
	ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
	ASSERT_EQ(tokens, 4u * LAYERS * KV_HEADS);
	tenant_recall(&f, "r", RECALL_MAX);
	ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
	ASSERT_GT(tokens, 0u);
	ASSERT_TRUE(needles_resident(s));
	slots(s, 0, false);
	/* Turned off, the tenant keeps nothing: its kept tokens go back to the host tier. */
	ASSERT_GT(fixture_status(&f, NULL, "recall_kept_tokens"), 0u);
	tenant_recall(&f, "r", 0);
	ASSERT_EQ(fixture_status(&f, NULL, "recall_kept_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0u);
	ASSERT_EQ(kvd_seq_recall(s, &tokens, NULL), -EOPNOTSUPP);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_OK(fixture_stop(&f));
}

/* Refused: a tenant with recall off, a pinned sequence; answered with nothing: a sequence
 * with nothing kept. A host tier too small keeps nothing and counts the loss. */
TEST(recall_refusals_and_nothing_kept) {
	struct fixture f;
	kvd_client *c, *o;
	int64_t before[LAYERS * KV_HEADS];
	uint64_t tokens = 99;
	kvd_seq *s, *t;

	start(&f, "1MiB", NULL);
	tenant_recall(&f, "r", RECALL_MAX);
	c = engine(&f, "r", KVD_LAYOUT_PER_LAYER, KVD_UNIT_LAYER_TOKEN, &s);
	ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
	ASSERT_EQ(tokens, 0u);
	step(s, 64, false);
	ASSERT_OK(kvd_seq_pin(s));
	ASSERT_EQ(kvd_seq_recall(s, &tokens, NULL), -EBUSY);
	ASSERT_OK(kvd_seq_unpin(s));
	o = engine(&f, "off", KVD_LAYOUT_PER_LAYER, KVD_UNIT_LAYER_TOKEN, &t);
	ASSERT_EQ(kvd_seq_recall(t, &tokens, NULL), -EOPNOTSUPP);
	ASSERT_OK(kvd_seq_release(t));
	kvd_client_unref(o);
	/* 2 x 2900 evicted slots of 256 bytes do not fit in the one 1 MiB segment: none is
	 * kept, all are counted lost, and a recall finds nothing. */
	step(s, 2900 - 64, false);
	{
		kvd_client *admin = fixture_connect(&f, NULL);

		ASSERT_OK(kvd_evict(admin, "r", 2u * 2900 * 256, NULL));
		kvd_client_unref(admin);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "recall_kept_tokens"), 0u);
	ASSERT_GT(fixture_status(&f, NULL, "recall_lost_tokens"), 4096u);
	ASSERT_EQ(fixture_status(&f, NULL, "recall_lost_tokens"),
	          fixture_status(&f, "r", "evicted_tokens"));
	ASSERT_OK(kvd_seq_recall(s, &tokens, NULL));
	ASSERT_EQ(tokens, 0u);
	(void)before;
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_OK(fixture_stop(&f));

	/* Without a host tier, recall cannot be set. */
	start(&f, "0", NULL);
	{
		kvd_client *admin = fixture_connect(&f, NULL);
		kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_RECALL, .recall = 1 };

		ASSERT_EQ(kvd_tenant_set_params(admin, "r", &p), -EINVAL);
		p.recall = 0;
		ASSERT_OK(kvd_tenant_set_params(admin, "r", &p));
		kvd_client_unref(admin);
	}
	ASSERT_OK(fixture_stop(&f));
}

/* The settings: a tenant's recall needs a host tier (check-config says so), the
 * recall-policy is auto or a policy that ranks (not full). */
TEST(recall_settings_checked) {
	struct fixture f;
	char out[4096], args[512];

	fixture_setup(&f, "[kvd]\nrecall-policy = snapkv\n[tenant t]\nrecall = 64\n", false);
	snprintf(args, sizeof(args), "--check-config %s --backend host", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_NOT_NULL(strstr(out, "tenant t: recall needs a host tier (host-tier-size)"));
	snprintf(args, sizeof(args), "--check-config %s --backend host --host-tier-size 1GiB", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	ASSERT_NOT_NULL(strstr(out, "tier drop, recall 64"));
	snprintf(args, sizeof(args), "--check-config %s --backend host --host-tier-size 1GiB "
	         "--recall-policy full", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_NOT_NULL(strstr(out, "unknown recall-policy 'full'"));
	fixture_cleanup(&f);
}

/*
 * Kept tokens yield to whole sequences: tenant r's kept tokens hold the whole host tier
 * (one segment); another tenant's idle sequence moving out takes their room, and they are
 * counted lost, rather than the sequence staying in the pool for want of a tier. Kept
 * bytes count in r's share of the tier (tier.c).
 */
TEST(kept_tokens_yield_to_whole_sequences) {
	const char *args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", "--host-tier-size",
		               "1MiB", "--high-watermark", "100", "--tier-idle", "100", NULL };
	kvd_client *c, *t, *admin;
	int64_t before[LAYERS * KV_HEADS];
	kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_TIER, .tier = "host" };
	uint64_t kept;
	struct fixture f;
	kvd_seq *s, *idle;

	fixture_setup(&f, NULL, false);
	fixture_launch(&f, args);
	tenant_recall(&f, "r", 64);
	c = engine(&f, "r", KVD_LAYOUT_PER_HEAD, KVD_UNIT_HEAD_TOKEN, &s);
	context_then_question(&f, c, s, "r", before);
	kept = fixture_status(&f, NULL, "recall_kept_tokens");
	ASSERT_GT(kept, 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 1u << 20);
	/* Tenant t's sequence goes idle: it takes the segment. */
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set_params(admin, "t", &p));
	kvd_client_unref(admin);
	t = engine(&f, "t", KVD_LAYOUT_PER_HEAD, KVD_UNIT_NONE, &idle);
	ASSERT_OK(kvd_seq_grow(idle, 32));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_EQ(fixture_status(&f, NULL, "recall_kept_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "recall_lost_tokens"), kept);
	ASSERT_EQ(fixture_status(&f, "t", "tier_lost"), 0u);
	/* r's sequence goes on, without its kept tokens. */
	ASSERT_EQ(kvd_seq_recall(s, NULL, NULL), 0);
	ASSERT_OK(kvd_seq_release(idle));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(t);
	kvd_client_unref(c);
	ASSERT_OK(fixture_stop(&f));
}
