/* SPDX-License-Identifier: MIT */
/*
 * Global eviction end to end: engines grow past the node budget and the daemon's rounds
 * hold it, ranking every tenant's tokens together; weights, guaranteed minimums, caps,
 * pins and protected tokens are honoured; survivors stay bit-exact at their original
 * positions; rounds racing a disconnect or an unpin are forced with the daemon's round
 * gate (KVD_TEST_ROUND_GATE), not timing.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
#define MAX_SEQS 4

/* K and V of one token of one layer (all kv heads), f16. */
#define TOKEN_LAYER_BYTES (2u * KV_HEADS * HEAD_DIM * 2)

struct eng {
	kvd_client *c;
	int model;
	kvd_seq *s[MAX_SEQS];
	uint32_t n, tag, grown, changed;
	uint64_t rng;
};

static uint16_t rand_f16(struct eng *e) {
	static const uint16_t v[] = { 0x3c00, 0xbc00, 0x3800, 0xb800, 0x3400, 0x0000, 0x4000, 0xc000 };

	e->rng = e->rng * 6364136223846793005ull + 1442695040888963407ull;
	return v[(e->rng >> 33) % 8];
}

static void eng_start(struct fixture *f, struct eng *e, const char *tenant, uint32_t unit,
                      uint32_t layout, uint32_t n, uint32_t tag) {
	kvd_model_spec spec = {
		.name = "evict-test",
		.layers = LAYERS,
		.q_heads = Q_HEADS,
		.kv_heads = KV_HEADS,
		.head_dim = HEAD_DIM,
		.dtype = KVD_DTYPE_F16,
		.block_tokens = BLOCK_TOKENS,
		.layout = layout,
	};
	kvd_eviction_spec ev = { .unit = unit, .window = WINDOW, .sinks = SINKS };

	*e = (struct eng){ .n = n, .tag = tag, .rng = tag };
	e->c = fixture_connect(f, tenant);
	e->model = kvd_model_register_evictable(e->c, &spec, &ev);
	ASSERT_OK(e->model);
	/* An output projection per layer, so that the output-aware costs use its Gram
	 * matrices: small random f16, hidden = q_heads * head_dim. */
	for (uint32_t l = 0; l < LAYERS; l++) {
		static uint16_t wo[Q_HEADS * HEAD_DIM * Q_HEADS * HEAD_DIM];

		for (size_t j = 0; j < ELEMENTSOF(wo); j++)
			wo[j] = rand_f16(e);
		ASSERT_OK(kvd_model_output_proj(e->c, e->model, l, KVD_DTYPE_F16, Q_HEADS * HEAD_DIM, wo));
	}
	for (uint32_t i = 0; i < n; i++)
		ASSERT_OK(kvd_seq_open(e->c, e->model, 1 << 16, &e->s[i]));
}

static void eng_drain(struct eng *e) {
	kvd_event ev;
	int r;

	while ((r = kvd_client_next_event(e->c, &ev)) > 0)
		e->changed += ev.type == KVD_EVENT_SEQ_CHANGED;
	ASSERT_OK(r);
}

/*
 * One step of sequence i, as an engine does it: grow (which may wait for a round), then
 * pin for the forward step: write the new K/V and a window per layer; unpin.
 */
static int eng_step(struct eng *e, uint32_t i, uint32_t tokens) {
	kvd_seq *s = e->s[i];
	uint64_t from = kvd_seq_descriptor(s)->next_position;
	int r;

	r = kvd_seq_grow(s, tokens);
	ASSERT_OK(kvd_seq_pin(s));
	if (r == 0) {
		fill_seq_from(s, e->tag, from);
		for (uint32_t l = 0; l < LAYERS; l++) {
			uint16_t *q;

			ASSERT_OK(kvd_seq_observation(s, l, (void **)&q));
			for (uint32_t j = 0; j < Q_HEADS * WINDOW * HEAD_DIM; j++)
				q[j] = rand_f16(e);
			ASSERT_OK(kvd_seq_observe(s, l));
		}
	}
	ASSERT_OK(kvd_seq_unpin(s));
	eng_drain(e);
	return r;
}

/* Grows every sequence by `tokens` in steps of `step`, round robin; all must succeed. */
static void eng_grow(struct eng *e, uint32_t tokens, uint32_t step) {
	for (uint32_t done = 0; done < tokens; done += step)
		for (uint32_t i = 0; i < e->n; i++)
			ASSERT_OK(eng_step(e, i, step));
	e->grown += tokens;
}

static uint64_t eng_resident(struct eng *e) {
	uint64_t n = 0;

	for (uint32_t i = 0; i < e->n; i++) {
		ASSERT_OK(kvd_seq_pin(e->s[i]));
		for (uint32_t l = 0; l < LAYERS; l++)
			n += (uint64_t)kvd_seq_tokens(e->s[i], l, 0);
		ASSERT_OK(kvd_seq_unpin(e->s[i]));
	}
	return n;
}

/* Survivors bit-exact at their original positions, positions ascending, protected kept. */
static void eng_check(struct eng *e) {
	for (uint32_t i = 0; i < e->n; i++) {
		kvd_seq *s = e->s[i];
		const struct kvd_seq_desc *d = kvd_seq_descriptor(s);

		/* Pinned, so that no round rewrites the tables while they are read. */
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_EQ(check_seq(s, e->tag), 0u);
		assert_digests_agree(s);
		for (uint32_t l = 0; l < LAYERS; l++)
			for (uint32_t h = 0; h < KV_HEADS; h++) {
				int64_t n = kvd_seq_tokens(s, l, h);
				int64_t prev = -1;

				ASSERT_OK(n);
				for (int64_t j = 0; j < n; j++) {
					int64_t pos = kvd_seq_position(s, l, h, (uint32_t)j);

					ASSERT_TRUE(pos > prev);
					/* The sinks are the first slots... */
					if (j < SINKS && (uint64_t)j < d->next_position)
						ASSERT_EQ(pos, j);
					prev = pos;
				}
				/* ...and the last window is whole. */
				ASSERT_TRUE(n >= WINDOW);
				ASSERT_EQ(kvd_seq_position(s, l, h, (uint32_t)(n - 1)), (int64_t)d->next_position - 1);
				ASSERT_EQ(kvd_seq_position(s, l, h, (uint32_t)(n - WINDOW)),
				          (int64_t)d->next_position - WINDOW);
			}
		ASSERT_OK(kvd_seq_unpin(s));
	}
}

static void eng_stop(struct eng *e) {
	for (uint32_t i = 0; i < e->n; i++)
		ASSERT_OK(kvd_seq_release(e->s[i]));
	kvd_client_unref(e->c);
}

#define POOL "--pool-size=64MiB"
#define CHUNK "--chunk-size=256KiB"

/* One tenant of budget_held_under_load: 2 sequences grown to 4096 tokens in steps of 128,
 * the node never past the budget. */
static void eng_grow_within(struct fixture *f, struct eng *e, const char *tenant,
                            uint64_t budget) {
	eng_start(f, e, tenant, KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 1);
	for (uint32_t k = 0; k < 16; k++) {
		eng_grow(e, 256, 128);
		ASSERT_TRUE(fixture_status(f, NULL, "used_bytes") <= budget);
	}
}

/* Answers e's unmap requests until fd (non-blocking) reads end of file. */
static void eng_drain_until(struct eng *e, int fd) {
	char x;

	while (read(fd, &x, 1) < 0) {
		eng_drain(e);
		usleep(10000);
	}
}

/* The last round of the history: a value of it (UINT64_MAX when absent), its note into
 * note (empty when none), and what its tenant entries say was applied to tenant. */
struct last_round {
	uint64_t id, planned, waiting, dropped, freed, applied, applied_tokens;
	char note[256];
};

static void last_round(struct fixture *f, struct last_round *ret) {
	kvd_client *c = fixture_connect(f, NULL);
	kvd_evictions *e = NULL;
	const char *note;
	uint32_t i;

	ASSERT_OK(kvd_evictions_get(c, &e));
	ASSERT_TRUE(kvd_evictions_count(e) > 0);
	i = kvd_evictions_count(e) - 1;
	*ret = (struct last_round){};
	ASSERT_OK(kvd_evictions_u64(e, i, "id", &ret->id));
	ASSERT_OK(kvd_evictions_u64(e, i, "planned_bytes", &ret->planned));
	ASSERT_OK(kvd_evictions_u64(e, i, "waiting_bytes", &ret->waiting));
	ASSERT_OK(kvd_evictions_u64(e, i, "dropped_bytes", &ret->dropped));
	ASSERT_OK(kvd_evictions_u64(e, i, "freed_bytes", &ret->freed));
	if (kvd_evictions_str(e, i, "note", &note) == 0)
		snprintf(ret->note, sizeof(ret->note), "%s", note);
	for (uint32_t t = 0; t < kvd_evictions_tenants(e, i); t++) {
		uint64_t bytes, tokens;

		ASSERT_OK(kvd_evictions_tenant(e, i, t, NULL, &bytes, &tokens));
		ret->applied += bytes;
		ret->applied_tokens += tokens;
	}
	kvd_evictions_free(e);
	kvd_client_unref(c);
}

/* Two tenants, each its own process as engines are, grow 4 MiB each into a 4 MiB budget:
 * rounds hold it, nobody fails. (Both in one thread would not do: a holder must answer its
 * unmap requests while the other waits for what they give back, evict.h.) */
TEST(budget_held_under_load) {
	struct fixture f;
	struct eng e;
	uint64_t budget = 4u << 20;
	int grown[2], done[2], status;
	pid_t pid;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=4MiB", "--grant-wait=5000",
	                                          NULL });
	ASSERT_OK(pipe2(grown, O_NONBLOCK));
	ASSERT_OK(pipe2(done, O_NONBLOCK));
	/* 2 tenants x 2 sequences x 4096 tokens x 2 layers x 256 bytes = 8 MiB. */
	pid = fixture_fork();
	if (pid == 0) {
		close(grown[0]);
		close(done[1]);
		eng_grow_within(&f, &e, "beta", budget);
		close(grown[1]);
		/* Answers while alpha may still grow, until it has: under load, beta may have
		 * grown its 4 MiB before alpha began, and lost nothing yet. */
		eng_drain_until(&e, done[0]);
		eng_check(&e);
		ASSERT_TRUE(eng_resident(&e) < 2ull * LAYERS * e.grown);
		eng_stop(&e);
		_exit(0);
	}
	close(grown[1]);
	close(done[0]);
	eng_grow_within(&f, &e, "alpha", budget);
	eng_drain_until(&e, grown[0]);
	eng_check(&e);
	ASSERT_TRUE(eng_resident(&e) < 2ull * LAYERS * e.grown);
	ASSERT_TRUE(fixture_status(&f, NULL, "rounds_total") > 0);
	ASSERT_TRUE(fixture_status(&f, "alpha", "evicted_tokens") > 0);
	ASSERT_TRUE(fixture_status(&f, "beta", "evicted_tokens") > 0);
	close(done[1]);
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	eng_stop(&e);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Equal load, weight 2 against weight 1: one round ranking both takes from the lighter one.
 * The round is asked for explicitly (no budget pressure), so the outcome does not depend
 * on how many pressure rounds a given machine runs while the tenants grow. */
TEST(weight_keeps_more) {
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;
	uint64_t freed = 0, used;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "heavy", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 2));
	ASSERT_OK(kvd_tenant_set(admin, "light", KVD_TENANT_KEEP, KVD_TENANT_KEEP, 1));
	eng_start(&f, &a, "heavy", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 7);
	eng_start(&f, &b, "light", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 7);
	eng_grow(&a, 4096, 512);
	eng_grow(&b, 4096, 512);
	used = fixture_status(&f, NULL, "used_bytes");
	ASSERT_OK(kvd_evict(admin, NULL, used / 4, &freed));
	eng_drain(&a);
	eng_drain(&b);
	eng_check(&a);
	eng_check(&b);
	ASSERT_TRUE(fixture_status(&f, "light", "evicted_tokens") >
	            fixture_status(&f, "heavy", "evicted_tokens"));
	ASSERT_TRUE(eng_resident(&a) > eng_resident(&b));
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant within its guaranteed minimum loses nothing while another grows past the budget. */
TEST(minimum_guaranteed) {
	struct last_round lr;
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;
	uint64_t before, freed = 1;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=3MiB", "--grant-wait=5000",
	                                          NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "kept", 2u << 20, KVD_TENANT_KEEP, 0));
	eng_start(&f, &a, "kept", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 3);
	eng_start(&f, &b, "greedy", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 4);
	eng_grow(&a, 2048, 256);
	before = eng_resident(&a);
	ASSERT_TRUE(fixture_status(&f, "kept", "used_bytes") <= 2u << 20);
	eng_grow(&b, 8192, 256);
	ASSERT_EQ(fixture_status(&f, "kept", "evicted_tokens"), 0u);
	ASSERT_EQ(eng_resident(&a), before);
	ASSERT_TRUE(fixture_status(&f, "greedy", "evicted_tokens") > 0);
	/* Asked to evict from it, a round frees nothing and says why. */
	ASSERT_OK(kvd_evict(admin, "kept", 256u << 10, &freed));
	ASSERT_EQ(freed, 0u);
	last_round(&f, &lr);
	ASSERT_TRUE(strstr(lr.note, "at or below its guaranteed minimum"));
	ASSERT_EQ(eng_resident(&a), before);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A round across tenants leaves each its fair share of what they will hold. The big
 * tenant's sequence is pinned with a plan waiting for its unpin, so a second round cannot
 * take from it; the small tenant, under its share, then loses nothing (without the floor
 * it would pay for the big one), and the round takes less than asked.
 */
TEST(fair_share_kept) {
	struct last_round lr;
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;
	uint64_t used;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "big", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 8);
	eng_start(&f, &b, "small", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 9);
	eng_grow(&a, 4096, 512);
	eng_grow(&b, 1024, 512);
	used = fixture_status(&f, NULL, "used_bytes");
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	ASSERT_OK(kvd_evict(admin, NULL, used / 8, NULL));
	last_round(&f, &lr);
	ASSERT_TRUE(lr.waiting > 0);
	ASSERT_OK(kvd_evict(admin, NULL, used / 8, NULL));
	eng_drain(&b);
	ASSERT_EQ(fixture_status(&f, "small", "evicted_tokens"), 0u);
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	eng_drain(&a);
	ASSERT_TRUE(fixture_status(&f, "big", "evicted_bytes") >= used / 8);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A round across tenants meets its target although the tenants' shares end inside a unit:
 * three equal tenants, a target of 302 units plus half of one (a token of one layer, 256
 * bytes), so that each share leaves a fraction of a unit. Before, each tenant stopped a
 * unit short of it and the round planned 300 units.
 */
TEST(fair_shares_meet_the_target) {
	static const char *const names[] = { "t0", "t1", "t2" };
	struct last_round lr;
	struct fixture f;
	struct eng e[3];
	kvd_client *admin;
	uint64_t target = 302 * 256 + 128;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	for (int i = 0; i < 3; i++) {
		eng_start(&f, &e[i], names[i], KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 19 + i);
		eng_grow(&e[i], 1024, 512);
	}
	ASSERT_OK(kvd_evict(admin, NULL, target, NULL));
	last_round(&f, &lr);
	ASSERT_TRUE(lr.planned >= target);
	ASSERT_TRUE(lr.planned < target + 256);
	for (int i = 0; i < 3; i++) {
		eng_drain(&e[i]);
		ASSERT_TRUE(fixture_status(&f, names[i], "evicted_tokens") > 0);
		eng_check(&e[i]);
		eng_stop(&e[i]);
	}
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A grow that waits at its tenant's cap is served from that tenant's own tokens, although
 * the other tenant holds more than its fair share: no one else's bytes could serve it.
 */
TEST(grow_at_the_cap_served_from_its_own) {
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--grant-wait=30000", NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, 1u << 20, 0));
	eng_start(&f, &a, "capped", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 14);
	eng_start(&f, &b, "other", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 15);
	eng_grow(&b, 6144, 512);
	/* 2048 tokens x 2 layers x 256 bytes: the whole 1 MiB cap. */
	eng_grow(&a, 2048, 512);
	ASSERT_EQ(fixture_status(&f, "capped", "used_bytes"), 1u << 20);
	ASSERT_OK(eng_step(&a, 0, 512));
	ASSERT_TRUE(fixture_status(&f, "capped", "evicted_tokens") > 0);
	ASSERT_EQ(fixture_status(&f, "other", "evicted_tokens"), 0u);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A tenant over its cap gives up the excess first, and only it. */
TEST(cap_evicts_first) {
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;
	uint64_t freed = 0, used;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "capped", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 5);
	eng_start(&f, &b, "free", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 6);
	eng_grow(&a, 2048, 512);
	eng_grow(&b, 2048, 512);
	used = fixture_status(&f, "capped", "used_bytes");
	/* Lowering the cap starts a round at once. */
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, used / 2, 0));
	for (int i = 0; i < 500 && fixture_status(&f, "capped", "evicted_bytes") < used / 2; i++) {
		eng_drain(&a);
		usleep(10000);
	}
	/* The excess, in block bytes (chunks come free as the blocks left allow). */
	ASSERT_TRUE(fixture_status(&f, "capped", "evicted_bytes") >= used / 2);
	ASSERT_EQ(fixture_status(&f, "free", "evicted_tokens"), 0u);
	/* And a round ranked across all takes the excess of a tenant over its cap first. */
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, used / 4, 0));
	ASSERT_OK(kvd_evict(admin, NULL, 64u << 10, &freed));
	eng_drain(&a);
	ASSERT_EQ(fixture_status(&f, "free", "evicted_tokens"), 0u);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A pinned sequence is not rewritten; its plan applies at the unpin. The round's history
 * shows it waiting, then applied, as the tenant's counters do. */
TEST(pinned_untouched_until_unpinned) {
	struct last_round lr;
	struct fixture f;
	struct eng a;
	uint64_t gen, freed = 0, id;
	int64_t before;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	eng_start(&f, &a, "pinned", KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD, 1, 8);
	eng_grow(&a, 2048, 512);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	gen = __atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE);
	before = kvd_seq_tokens(a.s[0], 0, 0);
	ASSERT_OK(kvd_evict(a.c, "pinned", 256u << 10, &freed));
	ASSERT_EQ(__atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE), gen);
	ASSERT_EQ(kvd_seq_tokens(a.s[0], 0, 0), before);
	ASSERT_EQ(check_seq(a.s[0], a.tag), 0u);
	last_round(&f, &lr);
	ASSERT_TRUE(lr.planned > 0);
	ASSERT_EQ(lr.waiting, lr.planned);
	ASSERT_EQ(lr.applied, 0u);
	ASSERT_EQ(freed, 0u);
	ASSERT_TRUE(strstr(lr.note, "waits for pinned sequences to be unpinned"));
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	ASSERT_TRUE(__atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE) != gen);
	ASSERT_TRUE(fixture_status(&f, "pinned", "evicted_tokens") > 0);
	/* The same round, now applied: as much as the tenant's counters say. */
	id = lr.id;
	last_round(&f, &lr);
	ASSERT_EQ(lr.id, id);
	ASSERT_EQ(lr.waiting, 0u);
	ASSERT_EQ(lr.applied, lr.planned);
	ASSERT_EQ(lr.applied, fixture_status(&f, "pinned", "evicted_bytes"));
	ASSERT_EQ(lr.applied_tokens, fixture_status(&f, "pinned", "evicted_tokens"));
	/* Per-head units: the heads of a layer may now hold different numbers of tokens. */
	eng_check(&a);
	/* And the sequence still grows, each table from its own length. */
	eng_grow(&a, 64, 32);
	eng_check(&a);
	eng_stop(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Slots of table t of s at positions from `from` on. */
static uint32_t slots_from(kvd_seq *s, uint32_t layer, uint64_t from) {
	int64_t n = kvd_seq_tokens(s, layer, 0);
	uint32_t k = 0;

	for (int64_t i = 0; i < n; i++)
		k += (uint64_t)kvd_seq_position(s, layer, 0, (uint32_t)i) >= from;
	return k;
}

/*
 * Slots grown and not yet written (no unpin since the grow) are not a round's to take: an
 * engine writes them pinned, after its grow, and a round in between would rank their
 * unwritten K/V, not the model's. Without windows, recency ranks and would reach them once
 * the older tokens are gone; the unpin after their write makes them evictable.
 */
TEST(grown_slots_wait_for_their_write) {
	struct fixture f;
	struct eng a;
	uint64_t freed = 0;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	eng_start(&f, &a, "writer", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 9);
	for (uint32_t i = 0; i < 4; i++) {
		uint64_t from = kvd_seq_descriptor(a.s[0])->next_position;

		ASSERT_OK(kvd_seq_grow(a.s[0], 256));
		ASSERT_OK(kvd_seq_pin(a.s[0]));
		fill_seq_from(a.s[0], a.tag, from);
		ASSERT_OK(kvd_seq_unpin(a.s[0]));
	}
	/* The next step's grow; its round comes before the pin. */
	ASSERT_OK(kvd_seq_grow(a.s[0], 512));
	ASSERT_OK(kvd_evict(a.c, "writer", 64u << 20, &freed));
	ASSERT_TRUE(freed > 0);
	eng_drain(&a);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	for (uint32_t l = 0; l < LAYERS; l++) {
		ASSERT_EQ(slots_from(a.s[0], l, 1024), 512u);
		ASSERT_TRUE(kvd_seq_tokens(a.s[0], l, 0) < 1024 + 512);
	}
	fill_seq_from(a.s[0], a.tag, 1024);
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	/* Written: now the next round may reach them. */
	ASSERT_OK(kvd_evict(a.c, "writer", 64u << 20, &freed));
	ASSERT_TRUE(freed > 0);
	eng_drain(&a);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	ASSERT_TRUE(slots_from(a.s[0], 0, 1024) < 512u);
	ASSERT_EQ(check_seq(a.s[0], a.tag), 0u);
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	eng_stop(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The round gate: a FIFO the daemon's round worker reads one byte from before it finishes
 * (fixture_gate_wait: its snapshot is taken, its selection made, and the loop has not seen
 * the result yet). */
static void gate_make(struct fixture *f, char *path, size_t n) {
	fixture_gate_make(path, n);
	setenv("KVD_TEST_ROUND_GATE", path, 1);
	fixture_start(f, (const char *const[]){ POOL, CHUNK, NULL });
	unsetenv("KVD_TEST_ROUND_GATE");
}

/* Runs kvd_evict in a child (it blocks until the round is done); returns its pid. */
static pid_t evict_async(struct fixture *f, const char *tenant, uint64_t bytes) {
	pid_t pid = fixture_fork();

	if (pid == 0) {
		kvd_client *c;

		if (kvd_client_connect(f->socket, NULL, &c) < 0)
			_exit(3);
		_exit(kvd_evict(c, tenant, bytes, NULL) < 0 ? 1 : 0);
	}
	return pid;
}

static int wait_exit(pid_t pid) {
	int status;

	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status));
	return WEXITSTATUS(status);
}

/* Waits until a grow of tenant has waited for a round (the tenant exists only once its
 * process has connected: before, its status reads UINT64_MAX). */
static void wait_grant_waited(struct fixture *f, const char *tenant, pid_t pid) {
	for (int i = 0;; i++) {
		uint64_t v = fixture_status(f, tenant, "grants_waited");

		if (v != 0 && v != UINT64_MAX)
			return;
		ASSERT_TRUE(i < 3000);
		ASSERT_EQ(waitpid(pid, NULL, WNOHANG), 0);
		usleep(10000);
	}
}

/* Forks a process of tenant that grows one sequence by tokens in one step; 0 on success. */
static pid_t grow_async(struct fixture *f, const char *tenant, uint32_t tokens, uint32_t tag) {
	pid_t pid = fixture_fork();

	if (pid == 0) {
		struct eng e;

		eng_start(f, &e, tenant, KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, tag);
		_exit(eng_step(&e, 0, tokens) == 0 ? 0 : 1);
	}
	return pid;
}

/*
 * A grow waiting for a round is served before a grow asked later: the late one, which the
 * budget could meet at once, queues behind it, so that the chunks the round frees for the
 * first (here at the holder's unpin) are not taken by whoever asks next.
 */
TEST(waiting_grow_served_first) {
	struct fixture f;
	struct eng holder;
	pid_t first, late;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=4MiB", "--grant-wait=30000",
	                                          NULL });
	/* 14 of the budget's 16 chunks, pinned: a round's plan for them waits. */
	eng_start(&f, &holder, "holder", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 11);
	eng_grow(&holder, 3584, 512);
	ASSERT_OK(kvd_seq_pin(holder.s[0]));
	ASSERT_OK(kvd_seq_pin(holder.s[1]));
	/* Three chunks, two free: it waits. */
	first = grow_async(&f, "first", 1536, 12);
	wait_grant_waited(&f, "first", first);
	/* One chunk, which the budget has: it waits too. */
	late = grow_async(&f, "late", 512, 13);
	wait_grant_waited(&f, "late", late);
	/* Rounds end, their plans wait, the first grow is retried and parks again: the late
	 * one, retried after it, waits on behind it (it was served in that pass before). */
	{
		uint64_t rounds = fixture_status(&f, NULL, "rounds_total");

		for (int i = 0; fixture_status(&f, NULL, "rounds_total") < rounds + 2; i++) {
			ASSERT_TRUE(i < 3000);
			usleep(10000);
		}
		usleep(200000);
		ASSERT_EQ(waitpid(late, NULL, WNOHANG), 0);
		ASSERT_EQ(waitpid(first, NULL, WNOHANG), 0);
	}
	ASSERT_OK(kvd_seq_unpin(holder.s[0]));
	ASSERT_OK(kvd_seq_unpin(holder.s[1]));
	/* The holder unmaps what the round took from it; both grows are then served. */
	for (int i = 0, left = 2; left > 0; i++) {
		int status;
		pid_t done = waitpid(-1, &status, WNOHANG);

		ASSERT_TRUE(i < 3000);
		if (done == first || done == late) {
			ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
			left--;
		}
		eng_drain(&holder);
		usleep(10000);
	}
	eng_stop(&holder);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A grow waiting at its own tenant's cap holds no one back: it waits for its tenant's
 * memory, not the pool's, so another tenant's grow that the budget can meet is served at
 * once, not queued behind it until its deadline.
 */
TEST(grow_at_a_cap_holds_no_one_back) {
	struct fixture f;
	struct eng a;
	kvd_client *admin;
	pid_t capped, other;
	int status;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--grant-wait=30000", NULL });
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set(admin, "capped", KVD_TENANT_KEEP, 1u << 20, 0));
	eng_start(&f, &a, "capped", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 16);
	/* The whole 1 MiB cap, pinned: the tenant's next grow waits for its unpin. */
	eng_grow(&a, 2048, 512);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	capped = grow_async(&f, "capped", 512, 17);
	wait_grant_waited(&f, "capped", capped);
	other = grow_async(&f, "other", 512, 18);
	for (int i = 0; waitpid(other, &status, WNOHANG) == 0; i++) {
		ASSERT_TRUE(i < 1000);
		usleep(10000);
	}
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ASSERT_EQ(fixture_status(&f, "other", "grants_waited"), 0u);
	ASSERT_EQ(waitpid(capped, NULL, WNOHANG), 0);
	/* At the unpin the round's plan frees the capped tenant's own tokens for its grow. */
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	for (int i = 0; waitpid(capped, &status, WNOHANG) == 0; i++) {
		ASSERT_TRUE(i < 3000);
		eng_drain(&a);
		usleep(10000);
	}
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	eng_stop(&a);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The owner disconnects while the round scores its sequences: nothing is applied to what
 * is gone, every chunk comes back, another tenant is unaffected. */
TEST(round_races_disconnect) {
	struct last_round lr;
	struct fixture f;
	struct eng a, b;
	char gate[64];
	pid_t pid;
	int fd;

	TEST_NEEDS_HOOKS();
	gate_make(&f, gate, sizeof(gate));
	eng_start(&f, &a, "leaving", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 9);
	eng_start(&f, &b, "staying", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 10);
	eng_grow(&a, 1024, 512);
	eng_grow(&b, 1024, 512);
	pid = evict_async(&f, "leaving", 128u << 10);
	fd = fixture_gate_wait(gate);
	/* The round has its plan for "leaving": the owner goes away before it lands. */
	for (uint32_t i = 0; i < a.n; i++)
		kvd_seq_release(a.s[i]);
	kvd_client_unref(a.c);
	ASSERT_TRUE(fixture_wait_status(&f, "leaving", "used_bytes", 0));
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	ASSERT_EQ(fixture_status(&f, "leaving", "evicted_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, "staying", "evicted_tokens"), 0u);
	/* The history says the plan was dropped, not that it took anything. */
	last_round(&f, &lr);
	ASSERT_TRUE(lr.planned > 0);
	ASSERT_EQ(lr.dropped, lr.planned);
	ASSERT_EQ(lr.applied, 0u);
	ASSERT_TRUE(strstr(lr.note, "plan was dropped"));
	eng_check(&b);
	eng_stop(&b);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_free"), fixture_status(&f, NULL, "chunks_total"));
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The engine pins while the round runs: the plan waits for the unpin. And the other way
 * round: pinned at the snapshot, unpinned before the round ends, applied at once. */
TEST(round_races_unpin) {
	struct fixture f;
	struct eng a;
	char gate[64];
	uint64_t gen;
	pid_t pid;
	int fd;

	TEST_NEEDS_HOOKS();
	gate_make(&f, gate, sizeof(gate));
	eng_start(&f, &a, "racer", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 11);
	eng_grow(&a, 2048, 512);

	/* Unpinned at the snapshot, pinned when the round ends: the plan waits. */
	pid = evict_async(&f, "racer", 128u << 10);
	fd = fixture_gate_wait(gate);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	gen = __atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE);
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	ASSERT_EQ(__atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE), gen);
	ASSERT_EQ(fixture_status(&f, "racer", "evicted_tokens"), 0u);
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	ASSERT_TRUE(fixture_status(&f, "racer", "evicted_tokens") > 0);
	eng_check(&a);

	/* Pinned at the snapshot, unpinned before the round ends: applied when it ends. */
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	pid = evict_async(&f, "racer", 128u << 10);
	fd = fixture_gate_wait(gate);
	gen = __atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE);
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	eng_drain(&a);
	ASSERT_TRUE(__atomic_load_n(&kvd_seq_descriptor(a.s[0])->generation, __ATOMIC_ACQUIRE) != gen);
	eng_check(&a);
	eng_stop(&a);
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The engine rolls back while the round scores its sequence: the round's plan no longer
 * fits and is dropped, the truncate stands, and what is left is intact. Then again with
 * the plan waiting for an unpin: the truncate drops it. */
TEST(round_races_truncate) {
	struct last_round lr;
	struct fixture f;
	struct eng a;
	char gate[64];
	pid_t pid;
	int fd;

	TEST_NEEDS_HOOKS();
	gate_make(&f, gate, sizeof(gate));
	eng_start(&f, &a, "drafter", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 12);
	eng_grow(&a, 2048, 512);
	pid = evict_async(&f, "drafter", 128u << 10);
	fd = fixture_gate_wait(gate);
	ASSERT_OK(kvd_seq_truncate(a.s[0], 100));
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	ASSERT_EQ(fixture_status(&f, "drafter", "evicted_tokens"), 0u);
	last_round(&f, &lr);
	ASSERT_TRUE(lr.planned > 0);
	ASSERT_EQ(lr.dropped, lr.planned);
	ASSERT_EQ(kvd_seq_descriptor(a.s[0])->next_position, 1948u);
	for (uint32_t l = 0; l < LAYERS; l++)
		ASSERT_EQ(kvd_seq_tokens(a.s[0], l, 0), 1948);
	eng_check(&a);

	/* Pinned when the round ends: its plan waits for the unpin, and the truncate in
	 * between drops it. */
	pid = evict_async(&f, "drafter", 128u << 10);
	fd = fixture_gate_wait(gate);
	ASSERT_OK(kvd_seq_pin(a.s[0]));
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	last_round(&f, &lr);
	ASSERT_TRUE(lr.waiting > 0);
	ASSERT_OK(kvd_seq_truncate(a.s[0], 48));
	ASSERT_OK(kvd_seq_unpin(a.s[0]));
	ASSERT_EQ(fixture_status(&f, "drafter", "evicted_tokens"), 0u);
	for (uint32_t l = 0; l < LAYERS; l++)
		ASSERT_EQ(kvd_seq_tokens(a.s[0], l, 0), 1900);
	eng_check(&a);
	ASSERT_EQ(fixture_status(&f, NULL, "truncates"), 2u);
	ASSERT_EQ(fixture_status(&f, NULL, "truncated_tokens"), 148u);
	eng_stop(&a);
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The engine forks while a round scores the parent: the round's plan predates the shared
 * blocks and is dropped, and parent and fork keep their bytes. */
TEST(round_races_fork) {
	struct last_round lr;
	struct fixture f;
	struct eng a;
	char gate[64];
	pid_t pid;
	int fd;

	TEST_NEEDS_HOOKS();
	gate_make(&f, gate, sizeof(gate));
	eng_start(&f, &a, "sampler", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 14);
	eng_grow(&a, 2048, 512);
	pid = evict_async(&f, "sampler", 128u << 10);
	fd = fixture_gate_wait(gate);
	ASSERT_OK(kvd_seq_fork(a.s[0], &a.s[1]));
	a.n = 2;
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	ASSERT_EQ(fixture_status(&f, "sampler", "evicted_tokens"), 0u);
	last_round(&f, &lr);
	ASSERT_TRUE(lr.planned > 0);
	ASSERT_EQ(lr.dropped, lr.planned);
	for (uint32_t i = 0; i < 2; i++)
		for (uint32_t l = 0; l < LAYERS; l++)
			ASSERT_EQ(kvd_seq_tokens(a.s[i], l, 0), 2048);
	eng_check(&a);
	eng_stop(&a);
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A fork shares its parent's full blocks: rounds take nothing from them (each sharer would
 * lose it), only from what the fork grew itself; both keep their bytes. */
TEST(fork_shared_blocks_never_evicted) {
	struct fixture f;
	kvd_client *admin;
	struct eng a;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "sampler", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 13);
	eng_grow(&a, 1024, 512);
	ASSERT_OK(kvd_seq_fork(a.s[0], &a.s[1]));
	a.n = 2;
	ASSERT_OK(eng_step(&a, 1, 512));
	ASSERT_OK(eng_step(&a, 1, 512));
	ASSERT_OK(kvd_evict(admin, "sampler", 128u << 10, NULL));
	eng_drain(&a);
	ASSERT_TRUE(fixture_status(&f, "sampler", "evicted_tokens") > 0);
	for (uint32_t i = 0; i < 2; i++) {
		ASSERT_OK(kvd_seq_pin(a.s[i]));
		for (uint32_t l = 0; l < LAYERS; l++) {
			ASSERT_TRUE(kvd_seq_tokens(a.s[i], l, 0) >= 1024);
			for (uint32_t j = 0; j < 1024; j++)
				ASSERT_EQ(kvd_seq_position(a.s[i], l, 0, j), (int64_t)j);
		}
		ASSERT_OK(kvd_seq_unpin(a.s[i]));
	}
	/* The parent lost nothing at all; the fork, some of its own. */
	for (uint32_t l = 0; l < LAYERS; l++) {
		ASSERT_EQ(kvd_seq_tokens(a.s[0], l, 0), 1024);
		ASSERT_TRUE(kvd_seq_tokens(a.s[1], l, 0) < 2048);
	}
	eng_check(&a);
	eng_stop(&a);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A published block that nobody shares is evicted like any: once a round took tokens of
 * it, a prefix open no longer finds it (nor those after it), while the blocks of a
 * sequence sharing them are never evicted. */
TEST(prefix_published_blocks_evicted_then_not_found) {
	static uint8_t keys[2048 / BLOCK_TOKENS][KVD_KEY_BYTES];
	kvd_open_params p = { .size = sizeof(p), .max_tokens = 1 << 16,
		              .n_prefix_keys = 2048 / BLOCK_TOKENS, .prefix_keys = &keys[0][0] };
	uint32_t tokens[2048];
	uint8_t root[KVD_KEY_BYTES];
	struct fixture f;
	kvd_client *admin;
	kvd_seq *probe;
	struct eng a;

	for (uint32_t i = 0; i < 2048; i++)
		tokens[i] = i * 3;
	ASSERT_OK(kvd_key_root("0", root));
	ASSERT_EQ(kvd_prefix_keys(root, tokens, 2048, BLOCK_TOKENS, NULL, &keys[0][0], 2048 / BLOCK_TOKENS),
	          2048 / BLOCK_TOKENS);
	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "chat", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 0, 17);
	p.model_id = a.model;
	ASSERT_OK(kvd_seq_open_params(a.c, &p, &a.s[0]));
	a.n = 1;
	eng_grow(&a, 2048, 512);
	ASSERT_OK(kvd_seq_publish(a.s[0], 2048 / BLOCK_TOKENS));
	ASSERT_OK(kvd_seq_open_params(a.c, &p, &probe));
	ASSERT_EQ(kvd_seq_tokens(probe, 0, 0), 2048);
	ASSERT_OK(kvd_seq_release(probe));
	/* Nothing shares them now: a round evicts from them. */
	ASSERT_OK(kvd_evict(admin, "chat", 256u << 10, NULL));
	eng_drain(&a);
	ASSERT_TRUE(fixture_status(&f, "chat", "evicted_tokens") > 0);
	ASSERT_OK(kvd_seq_open_params(a.c, &p, &probe));
	ASSERT_TRUE(kvd_seq_tokens(probe, 0, 0) < 2048);
	/* What it found is the prompt's, every byte (positions from 0, the first sequence's
	 * bytes), and shared: a second round leaves it whole in both. */
	for (int64_t j = 0; j < kvd_seq_tokens(probe, 0, 0); j++)
		ASSERT_EQ(kvd_seq_position(probe, 0, 0, (uint32_t)j), j);
	ASSERT_EQ(check_seq(probe, a.tag), 0u);
	{
		int64_t found = kvd_seq_tokens(probe, 0, 0);

		ASSERT_OK(kvd_evict(admin, "chat", 128u << 10, NULL));
		eng_drain(&a);
		ASSERT_EQ(kvd_seq_tokens(probe, 0, 0), found);
		ASSERT_EQ(check_seq(probe, a.tag), 0u);
	}
	ASSERT_OK(kvd_seq_release(probe));
	eng_check(&a);
	eng_stop(&a);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A dry run asked for while a round runs is planned after it, on what it left: not on use
 * as it was when asked. */
TEST(plan_waits_for_the_running_round) {
	struct fixture f;
	struct eng a;
	char gate[64];
	uint64_t used, budget, low, target = 0;
	int fd, out[2];
	pid_t pid, planner;

	TEST_NEEDS_HOOKS();
	gate_make(&f, gate, sizeof(gate));
	eng_start(&f, &a, "a", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 31);
	eng_grow(&a, 2048, 512);
	used = fixture_status(&f, NULL, "used_bytes");
	budget = used / 10 * 9;
	low = budget / 100 * 85 + budget % 100 * 85 / 100; /* the daemon's low watermark */
	pid = evict_async(&f, "a", 512u << 10);
	fd = fixture_gate_wait(gate);
	ASSERT_OK(pipe(out));
	planner = fixture_fork();
	if (planner == 0) {
		kvd_budget_params bp = { .size = sizeof(bp), .bytes = budget };
		kvd_evictions *plan = NULL;
		kvd_client *c;

		if (kvd_client_connect(f.socket, NULL, &c) < 0 || kvd_budget_plan(c, &bp, &plan) < 0 ||
		    kvd_evictions_u64(plan, 0, "target_bytes", &target) < 0)
			_exit(1);
		_exit(write(out[1], &target, sizeof(target)) == sizeof(target) ? 0 : 2);
	}
	close(out[1]);
	/* The plan reaches the daemon while the round waits at the gate. */
	usleep(200000);
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(pid), 0);
	/* The plan's own round, at the gate in its turn. */
	fixture_gate_release(fixture_gate_wait(gate));
	ASSERT_EQ(wait_exit(planner), 0);
	ASSERT_EQ(read(out[0], &target, sizeof(target)), (ssize_t)sizeof(target));
	close(out[0]);
	/* Planned on use as the round left it, which took something. */
	ASSERT_TRUE(target > 0);
	ASSERT_TRUE(target < used - low);
	eng_drain(&a);
	eng_check(&a);
	eng_stop(&a);
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Runs kvd_evict_plan of tenant as an operator in a child (it waits for the plan's round);
 * returns its pid. */
static pid_t plan_async(struct fixture *f, const char *tenant) {
	pid_t pid = fixture_fork();

	if (pid == 0) {
		kvd_evictions *plan = NULL;
		kvd_client *c;

		if (kvd_client_connect(f->socket, NULL, &c) < 0)
			_exit(3);
		_exit(kvd_evict_plan(c, tenant, 64u << 10, &plan) < 0 ? 1 : 0);
	}
	return pid;
}

/* Replies the daemon's connections wait for, all together. */
static uint64_t outstanding(struct fixture *f) {
	kvd_client *c = fixture_connect(f, NULL);
	kvd_table *t = NULL;
	uint64_t n = 0, v;

	ASSERT_OK(kvd_connections_get(c, &t));
	for (uint32_t i = 0; i < kvd_table_rows(t); i++)
		if (kvd_table_u64(t, i, "outstanding", &v) == 0)
			n += v;
	kvd_table_free(t);
	kvd_client_unref(c);
	return n;
}

/* Opens the gate for every round from now on (the FIFO stays open with bytes for them,
 * and is gone for rounds after those); returns the fd to close at the end. */
static int gate_open(const char *gate) {
	char x[64];
	int fd = open(gate, O_RDWR | O_CLOEXEC);

	ASSERT_OK(fd);
	memset(x, 'x', sizeof(x));
	ASSERT_EQ(write(fd, x, sizeof(x)), (ssize_t)sizeof(x));
	ASSERT_OK(unlink(gate));
	return fd;
}

/* A daemon whose rounds wait at the gate, with a 4 MiB budget that grows fill without a
 * watermark round, and tenant "a" in 14 of its 16 chunks. */
static void gated_full(struct fixture *f, struct eng *a, char *gate, size_t n, const char *wait) {
	fixture_gate_make(gate, n);
	setenv("KVD_TEST_ROUND_GATE", gate, 1);
	fixture_start(f, (const char *const[]){ POOL, CHUNK, "--budget=4MiB", "--high-watermark=100",
	                                         wait, NULL });
	unsetenv("KVD_TEST_ROUND_GATE");
	eng_start(f, a, "a", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 41);
	eng_grow(a, 3584, 512);
}

/*
 * Grows come before requests: with dry runs queued behind the one whose round runs, the
 * round after it is the one for a grow that parked later, not the next plan (a tenant's
 * flood of plans once starved every grow on the node).
 */
TEST(grant_round_before_queued_plans) {
	struct fixture f;
	struct eng a;
	kvd_client *admin;
	kvd_evictions *ev = NULL;
	const char *trigger;
	char gate[64];
	pid_t plans[4], grow;
	int fd, status;

	TEST_NEEDS_HOOKS();
	gated_full(&f, &a, gate, sizeof(gate), "--grant-wait=30000");
	plans[0] = plan_async(&f, "a");
	fd = fixture_gate_wait(gate);
	for (int i = 1; i < 4; i++)
		plans[i] = plan_async(&f, "a");
	for (int i = 0; outstanding(&f) < 4; i++) {
		ASSERT_TRUE(i < 3000);
		usleep(10000);
	}
	/* Three chunks, two free: it waits for a round. */
	grow = grow_async(&f, "b", 1536, 42);
	wait_grant_waited(&f, "b", grow);
	/* The first plan's round ends; the one after it must be the grow's. */
	fixture_gate_release(fd);
	fixture_gate_release(fixture_gate_wait(gate));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "rounds_total", 1));
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_evictions_get(admin, &ev));
	ASSERT_EQ(kvd_evictions_count(ev), 1u);
	ASSERT_OK(kvd_evictions_str(ev, 0, "trigger", &trigger));
	ASSERT_STREQ(trigger, "grant");
	kvd_evictions_free(ev);
	fd = gate_open(gate);
	/* The grow gets what the round took from "a" once "a" unmaps it; every plan is
	 * answered. */
	for (int i = 0; waitpid(grow, &status, WNOHANG) == 0; i++) {
		ASSERT_TRUE(i < 3000);
		eng_drain(&a);
		usleep(10000);
	}
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	for (int i = 0; i < 4; i++)
		ASSERT_EQ(wait_exit(plans[i]), 0);
	close(fd);
	eng_stop(&a);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* grant-wait holds whatever runs: a grow is refused at its deadline while a round (here a
 * plan's, held at the gate) has the worker. */
TEST(grant_wait_holds_while_a_round_runs) {
	struct fixture f;
	struct eng a;
	char gate[64];
	pid_t plan, grow;
	int fd, status;

	TEST_NEEDS_HOOKS();
	gated_full(&f, &a, gate, sizeof(gate), "--grant-wait=500");
	plan = plan_async(&f, "a");
	fd = fixture_gate_wait(gate);
	grow = grow_async(&f, "b", 1536, 43);
	for (int i = 0; waitpid(grow, &status, WNOHANG) == 0; i++) {
		ASSERT_TRUE(i < 3000);
		usleep(10000);
	}
	/* Refused (-ENOSPC), while the plan's round still waits. */
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1);
	ASSERT_EQ(waitpid(plan, NULL, WNOHANG), 0);
	fixture_gate_release(fd);
	ASSERT_EQ(wait_exit(plan), 0);
	unlink(gate);
	eng_stop(&a);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Lowering the budget below use starts a round that brings use under it. */
TEST(budget_set_below_use) {
	struct fixture f;
	struct eng a;
	kvd_client *admin;
	uint64_t used;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "shrunk", KVD_UNIT_BLOCK, KVD_LAYOUT_PER_LAYER, 2, 12);
	eng_grow(&a, 4096, 512);
	used = fixture_status(&f, NULL, "used_bytes");
	ASSERT_OK(kvd_budget_set(admin, used / 2));
	for (int i = 0; i < 100 && fixture_status(&f, NULL, "used_bytes") > used / 2; i++) {
		eng_drain(&a);
		usleep(20000);
	}
	ASSERT_TRUE(fixture_status(&f, NULL, "used_bytes") <= used / 2);
	eng_check(&a);
	eng_stop(&a);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* The history once it holds more than `count` rounds (waits up to 10 s). */
static kvd_evictions *rounds_after(kvd_client *admin, uint32_t count) {
	kvd_evictions *e = NULL;

	for (int i = 0; i < 500; i++) {
		ASSERT_OK(kvd_evictions_get(admin, &e));
		if (kvd_evictions_count(e) > count)
			return e;
		e = kvd_evictions_free(e);
		usleep(20000);
	}
	test_fail(__FILE__, __LINE__, "no round after %u", count);
	return NULL;
}

static uint32_t rounds_now(kvd_client *admin) {
	kvd_evictions *e = NULL;
	uint32_t n;

	ASSERT_OK(kvd_evictions_get(admin, &e));
	n = kvd_evictions_count(e);
	kvd_evictions_free(e);
	return n;
}

/* The plan (a dry run's one round) took from each tenant what round i of hist applied. */
static void assert_same_take(const kvd_evictions *plan, const kvd_evictions *hist, uint32_t i,
                             const char *trigger) {
	uint64_t planned, bytes = 0;
	const char *s;

	ASSERT_OK(kvd_evictions_str(hist, i, "trigger", &s));
	ASSERT_STREQ(s, trigger);
	ASSERT_OK(kvd_evictions_u64(plan, 0, "planned_bytes", &planned));
	ASSERT_TRUE(planned > 0);
	ASSERT_EQ(kvd_evictions_tenants(plan, 0), kvd_evictions_tenants(hist, i));
	for (uint32_t t = 0; t < kvd_evictions_tenants(plan, 0); t++) {
		const char *name, *hname;
		uint64_t pb, pt, hb, ht;
		double x;

		ASSERT_OK(kvd_evictions_tenant(plan, 0, t, &name, &pb, &pt));
		ASSERT_OK(kvd_evictions_tenant_double(plan, 0, t, "predicted_error", &x));
		ASSERT_TRUE(x >= 0);
		for (uint32_t h = 0; h < kvd_evictions_tenants(hist, i); h++) {
			ASSERT_OK(kvd_evictions_tenant(hist, i, h, &hname, &hb, &ht));
			if (strcmp(name, hname) != 0)
				continue;
			ASSERT_EQ(hb, pb);
			ASSERT_EQ(ht, pt);
			bytes += hb;
		}
	}
	ASSERT_EQ(bytes, planned);
}

/* The node at rest: no chunk waiting for the engines to unmap it, and no round started for
 * 20 looks in a row (a round may follow another, a watermark one after a budget one), so
 * that the next plan and change see the same node. */
static void settle(struct fixture *f, struct eng *a, struct eng *b) {
	uint64_t rounds = fixture_status(f, NULL, "rounds_total");
	int quiet = 0;

	for (int i = 0; i < 1000 && quiet < 20; i++) {
		uint64_t now;

		eng_drain(a);
		eng_drain(b);
		now = fixture_status(f, NULL, "rounds_total");
		quiet = now == rounds && fixture_status(f, NULL, "chunks_draining") == 0 ? quiet + 1 : 0;
		rounds = now;
		usleep(10000);
	}
	ASSERT_EQ(quiet, 20);
}

/* A dry run says what the change then takes, tenant by tenant, and changes nothing; a
 * budget below the floor needs force. */
TEST(dry_runs_match_the_changes) {
	kvd_evictions *plan = NULL, *hist;
	struct fixture f;
	struct eng a, b;
	kvd_client *admin;
	uint64_t used, pool, freed = 0;
	uint32_t n;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	admin = fixture_connect(&f, NULL);
	eng_start(&f, &a, "a", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 21);
	eng_start(&f, &b, "b", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 22);
	eng_grow(&a, 2048, 512);
	eng_grow(&b, 2048, 512);
	used = fixture_status(&f, NULL, "used_bytes");
	pool = fixture_status(&f, NULL, "pool_bytes");

	/* A budget of half of what is used. */
	{
		kvd_budget_params bp = { .size = sizeof(bp), .bytes = used / 2 };

		ASSERT_OK(kvd_budget_plan(admin, &bp, &plan));
		ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), pool);
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), used);
		n = rounds_now(admin);
		ASSERT_TRUE(kvd_budget_set_params(admin, &bp) >= 0);
		hist = rounds_after(admin, n);
		assert_same_take(plan, hist, n, "budget");
		plan = kvd_evictions_free(plan);
		kvd_evictions_free(hist);
	}
	settle(&f, &a, &b);

	/* A cap of half of what tenant a holds. */
	{
		kvd_tenant_params tp = { .size = sizeof(tp), .set = KVD_TENANT_SET_MAX,
			                 .max_bytes = fixture_status(&f, "a", "used_bytes") / 2 };

		ASSERT_OK(kvd_tenant_plan(admin, "a", &tp, &plan));
		ASSERT_EQ(fixture_status(&f, "a", "max_bytes"), KVD_TENANT_NO_CAP);
		n = rounds_now(admin);
		ASSERT_TRUE(kvd_tenant_set_params(admin, "a", &tp) >= 0);
		hist = rounds_after(admin, n);
		assert_same_take(plan, hist, n, "cap");
		plan = kvd_evictions_free(plan);
		kvd_evictions_free(hist);
	}
	settle(&f, &a, &b);

	/* An eviction from b. */
	ASSERT_OK(kvd_evict_plan(admin, "b", 256u << 10, &plan));
	n = rounds_now(admin);
	ASSERT_OK(kvd_evict(admin, "b", 256u << 10, &freed));
	hist = rounds_after(admin, n);
	assert_same_take(plan, hist, n, "evict");
	plan = kvd_evictions_free(plan);
	kvd_evictions_free(hist);

	/* A change that evicts nothing plans nothing. */
	{
		kvd_budget_params bp = { .size = sizeof(bp), .percent = 100 };
		uint64_t target;

		ASSERT_OK(kvd_budget_plan(admin, &bp, &plan));
		ASSERT_OK(kvd_evictions_u64(plan, 0, "target_bytes", &target));
		ASSERT_EQ(target, 0u);
		ASSERT_EQ(kvd_evictions_tenants(plan, 0), 0u);
		plan = kvd_evictions_free(plan);
	}

	/* The floor: the guaranteed minimums together, or one chunk. */
	{
		kvd_budget_params bp = { .size = sizeof(bp), .bytes = 1u << 20 };

		ASSERT_TRUE(kvd_tenant_set(admin, "b", 2u << 20, KVD_TENANT_KEEP, 0) >= 0);
		ASSERT_ERRNO(kvd_budget_set_params(admin, &bp), -ERANGE);
		ASSERT_TRUE(strstr(kvd_client_last_error(admin), "guaranteed minimums"));
		ASSERT_ERRNO(kvd_budget_plan(admin, &bp, &plan), -ERANGE);
		ASSERT_ERRNO(kvd_budget_set(admin, 0), -ERANGE);
		bp.flags = KVD_BUDGET_FORCE;
		ASSERT_TRUE(kvd_budget_set_params(admin, &bp) >= 0);
		ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), 1u << 20);
		bp = (kvd_budget_params){ .size = sizeof(bp), .percent = 50 };
		ASSERT_TRUE(kvd_budget_set_params(admin, &bp) >= 0);
		ASSERT_EQ(fixture_status(&f, NULL, "budget_bytes"), pool / 2);
	}
	settle(&f, &a, &b);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	kvd_client_unref(admin);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Every policy name runs through the same rounds, end to end. */
TEST(every_policy_end_to_end) {
	static const char *const policies[] = {
		"full", "streamingllm", "h2o", "snapkv", "pyramidkv", "adakv", "tova", "knorm",
		"keydiff", "expected_attention", "restkv", "laprox", "kvd", "kvd-mi",
	};
	char config[2048] = "";
	struct fixture f;

	for (size_t i = 0; i < ELEMENTSOF(policies); i++) {
		size_t n = strlen(config);

		snprintf(config + n, sizeof(config) - n, "[tenant p-%s]\npolicy = %s\n", policies[i],
		         policies[i]);
	}
	fixture_setup(&f, config, false);
	fixture_launch(&f, (const char *const[]){ POOL, CHUNK, NULL });
	for (size_t i = 0; i < ELEMENTSOF(policies); i++) {
		char tenant[64];
		struct eng a;
		uint64_t freed = 0;

		snprintf(tenant, sizeof(tenant), "p-%s", policies[i]);
		eng_start(&f, &a, tenant, KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 13);
		eng_grow(&a, 1024, 512);
		ASSERT_OK(kvd_evict(a.c, tenant, 64u << 10, &freed));
		eng_drain(&a);
		if (fixture_status(&f, tenant, "evicted_tokens") == 0) {
			fprintf(stderr, "policy %s evicted nothing\n", policies[i]);
			ASSERT_TRUE(false);
		}
		eng_check(&a);
		eng_stop(&a);
	}
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Every unit on every layout it allows: evicted, compacted, still growing, bit-exact. */
TEST(every_unit_and_layout) {
	static const struct {
		uint32_t unit, layout;
	} cases[] = {
		{ KVD_UNIT_HEAD_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER },
		{ KVD_UNIT_BLOCK, KVD_LAYOUT_PER_HEAD },
		{ KVD_UNIT_BLOCK, KVD_LAYOUT_PER_LAYER },
	};
	struct fixture f;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
		char tenant[32];
		struct eng a;
		uint64_t freed = 0;

		snprintf(tenant, sizeof(tenant), "unit-%zu", i);
		eng_start(&f, &a, tenant, cases[i].unit, cases[i].layout, 2, 20 + (uint32_t)i);
		eng_grow(&a, 1024, 256);
		ASSERT_OK(kvd_evict(a.c, tenant, 128u << 10, &freed));
		eng_drain(&a);
		ASSERT_TRUE(fixture_status(&f, tenant, "evicted_tokens") > 0);
		ASSERT_TRUE(a.changed > 0);
		eng_check(&a);
		eng_grow(&a, 256, 128);
		eng_check(&a);
		eng_stop(&a);
	}
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A round for one tenant scores that tenant's sequences only: a tenant that loops
 * kvd_evict on itself makes no work of the others' sequences, nor changes their scores
 * (before, every such round scored every tenant's sequences).
 */
TEST(own_round_scores_only_its_own) {
	struct fixture f;
	struct eng a, b;
	kvd_evictions *ev;
	uint64_t freed = 0, seqs = 0;
	uint32_t n;

	fixture_start(&f, (const char *const[]){ POOL, CHUNK, NULL });
	eng_start(&f, &a, "self", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 31);
	eng_start(&f, &b, "bystander", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 3, 32);
	eng_grow(&a, 1024, 512);
	eng_grow(&b, 1024, 512);
	ASSERT_OK(kvd_evict(a.c, "self", 64u << 10, &freed));
	ASSERT_OK(kvd_evictions_get(a.c, &ev));
	n = kvd_evictions_count(ev);
	ASSERT_GT(n, 0u);
	ASSERT_OK(kvd_evictions_u64(ev, n - 1, "sequences", &seqs));
	kvd_evictions_free(ev);
	/* self's one sequence, not the bystander's three. */
	ASSERT_EQ(seqs, 1u);
	eng_drain(&a);
	ASSERT_GT(fixture_status(&f, "self", "evicted_tokens"), 0u);
	ASSERT_EQ(fixture_status(&f, "bystander", "evicted_tokens"), 0u);
	eng_check(&a);
	eng_check(&b);
	eng_stop(&a);
	eng_stop(&b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A holder that cannot answer (SIGSTOPped) keeps what a round took from it mapped: those
 * bytes count as freed. Before, every later round for the same waiting grow evicted from
 * it again (six rounds in 0.1 s took 98.7% of such a tenant). Here the stopped tenant
 * fills 15 of the 16 chunks of the budget; another grows past the budget; one round
 * evicts, and while the stopped process holds the evicted chunks no further round runs
 * and nothing more is taken from it. Its grow then waits: with grant_wait_ms long enough
 * it is served once the stopped process resumes and unmaps; otherwise it is refused with a
 * reason naming the holder.
 */
static void stuck_holder(uint32_t grant_wait_ms) {
	struct fixture f;
	struct eng quiet, busy;
	char wait_arg[64];
	int ready[2], done[2], status;
	uint64_t used, evicted, target = 0;
	kvd_evictions *ev;
	kvd_client *admin;
	pid_t pid, waiter;
	char x;

	snprintf(wait_arg, sizeof(wait_arg), "--grant-wait=%u", grant_wait_ms);
	fixture_start(&f, (const char *const[]){ POOL, CHUNK, "--budget=4MiB", wait_arg,
	                                          "--unmap-timeout=0", NULL });
	ASSERT_OK(pipe(ready));
	ASSERT_OK(pipe(done));
	pid = fixture_fork();
	if (pid == 0) {
		close(done[1]);
		/* 2 sequences x 3584 tokens x 2 layers x 256 bytes: 14 chunks of 16, below the
		 * high watermark (95%). */
		eng_start(&f, &quiet, "quiet", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 2, 41);
		eng_grow(&quiet, 3584, 512);
		ASSERT_EQ(write(ready[1], "x", 1), 1);
		raise(SIGSTOP);
		/* Resumed: answers the unmap requests, then holds on until the test ends. */
		eng_drain(&quiet);
		ASSERT_EQ(read(done[0], &x, 1), 0);
		_exit(0);
	}
	close(done[0]);
	ASSERT_EQ(read(ready[0], &x, 1), 1);
	ASSERT_EQ(waitpid(pid, &status, WUNTRACED), pid);
	ASSERT_TRUE(WIFSTOPPED(status));
	used = fixture_status(&f, "quiet", "used_bytes");
	ASSERT_TRUE(used >= 14u * 256 << 10 && used <= 15u * 256 << 10);
	ASSERT_EQ(fixture_status(&f, NULL, "rounds_total"), 0u);

	waiter = fixture_fork();
	if (waiter == 0) {
		/* Two chunks fill the budget and start a round (past the high watermark); the
		 * next grow must wait for what that round took from the stopped tenant. */
		eng_start(&f, &busy, "busy", KVD_UNIT_LAYER_TOKEN, KVD_LAYOUT_PER_LAYER, 1, 42);
		eng_grow(&busy, 1024, 1024);
		if (grant_wait_ms > 5000) {
			ASSERT_OK(eng_step(&busy, 0, 512));
		} else {
			ASSERT_EQ(eng_step(&busy, 0, 512), -ENOSPC);
			ASSERT_TRUE(strstr(kvd_client_last_error(busy.c), "tenant quiet") != NULL);
			ASSERT_TRUE(strstr(kvd_client_last_error(busy.c), "unmap") != NULL);
		}
		_exit(0);
	}
	for (int i = 0; fixture_status(&f, NULL, "chunks_draining") == 0; i++) {
		ASSERT_TRUE(i < 3000);
		usleep(10000);
	}
	/* Rounds follow each other within milliseconds when they repeat: a second is plenty. */
	usleep(grant_wait_ms > 5000 ? 1000000 : 0);
	if (grant_wait_ms <= 5000) {
		ASSERT_EQ(waitpid(waiter, &status, 0), waiter);
		ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "rounds_total"), 1u);
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_evictions_get(admin, &ev));
	ASSERT_EQ(kvd_evictions_count(ev), 1u);
	ASSERT_OK(kvd_evictions_u64(ev, 0, "target_bytes", &target));
	kvd_evictions_free(ev);
	kvd_client_unref(admin);
	/* Still charged to it (it maps them), but evicted: no more than the one round's,
	 * which it gives alone (busy holds less than its fair share), and the greedy frees
	 * less than one unit (a token of one layer: 256 bytes) past its target. */
	ASSERT_EQ(fixture_status(&f, "quiet", "used_bytes"), used);
	evicted = fixture_status(&f, "quiet", "evicted_bytes");
	ASSERT_GT(evicted, 0u);
	ASSERT_TRUE(evicted < target + 256);

	ASSERT_OK(kill(pid, SIGCONT));
	if (grant_wait_ms > 5000) {
		/* The stopped tenant unmaps what it was asked to: the waiting grow is served. */
		ASSERT_EQ(waitpid(waiter, &status, 0), waiter);
		ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	close(done[1]);
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(stuck_holder_loses_one_rounds_share_and_is_waited_for) {
	stuck_holder(30000);
}

TEST(stuck_holder_named_when_the_wait_ends) {
	stuck_holder(1000);
}
