/* SPDX-License-Identifier: MIT */
/*
 * The host tier (kvd.8, TIERS): sequences of a tenant whose tier is host leave the pool
 * whole when idle (tier-idle) or under memory pressure before any token is evicted, and come
 * back at their next pin or grow with every byte (digests, fill patterns), token count and
 * original position as before; the pin says so (kvd_seq_pin_recall). A full tier drops the
 * oldest, a block failing its checksum (KVD_TEST_TIER_CORRUPT) or a recall without memory
 * loses the sequence, and the pin says that too; a released sequence takes its entry along.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "fixture.h"
#include "test.h"

/* 2 layers x 2 kv heads x 64 dims, f16, 16 tokens a block: a table (a layer) takes 512 bytes
 * of K and V per token, 8 KiB per block. */
static const kvd_model_spec shape = { "t", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
#define BLOCK_BYTES 8192u
#define MAX_TOKENS 2048

static void pause_ms(long ms) {
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* An engine (on a GPU pool, with the fixture's CUDA context), its per-step calls through
 * the rings or over the socket. */
static kvd_client *connect_tenant(struct fixture *f, const char *tenant, bool ring) {
	kvd_client *c = fixture_connect(f, tenant);

	ASSERT_OK(kvd_client_set_ring(c, ring));
	ASSERT_EQ(kvd_client_get_ring(c), ring);
	return c;
}

static void set_tier(struct fixture *f, const char *tenant, const char *tier, int want) {
	kvd_client *admin = fixture_connect(f, NULL);
	kvd_tenant_params p = { .size = sizeof(p), .set = KVD_TENANT_SET_TIER, .tier = tier };

	ASSERT_EQ(kvd_tenant_set_params(admin, tenant, &p), want);
	kvd_client_unref(admin);
}

/* Tenant t's tier set to host, and an engine of it with the test model (*ret_model). */
static kvd_client *host_engine(struct fixture *f, bool ring, int *ret_model) {
	kvd_client *c;

	set_tier(f, "t", "host", 0);
	c = connect_tenant(f, "t", ring);
	*ret_model = kvd_model_register(c, &shape);
	ASSERT_OK(*ret_model);
	return c;
}

/* What a sequence looked like: every table's tokens and positions, and its digest. */
struct picture {
	int64_t tokens[2];
	int64_t pos[2][MAX_TOKENS];
	uint64_t digest;
};

static void take_picture(kvd_seq *s, struct picture *p) {
	for (uint32_t l = 0; l < 2; l++) {
		p->tokens[l] = kvd_seq_tokens(s, l, 0);
		ASSERT_TRUE(p->tokens[l] >= 0 && p->tokens[l] <= MAX_TOKENS);
		for (int64_t i = 0; i < p->tokens[l]; i++)
			p->pos[l][i] = kvd_seq_position(s, l, 0, (uint32_t)i);
	}
	p->digest = assert_digests_agree(s);
}

static void assert_same_picture(kvd_seq *s, const struct picture *want) {
	struct picture now;

	take_picture(s, &now);
	for (uint32_t l = 0; l < 2; l++) {
		ASSERT_EQ(now.tokens[l], want->tokens[l]);
		for (int64_t i = 0; i < now.tokens[l]; i++)
			ASSERT_EQ(now.pos[l][i], want->pos[l][i]);
	}
	ASSERT_EQ(now.digest, want->digest);
}

/* The one open sequence's place and tokens (kvd_sequences_get), as an operator sees them:
 * its tokens wherever they are, not the empty tables of a sequence moved out. */
static void assert_place(struct fixture *f, const char *want, uint64_t tokens) {
	kvd_client *admin = fixture_connect(f, NULL);
	kvd_table *t = NULL;
	const char *place;
	uint64_t n;

	ASSERT_OK(kvd_sequences_get(admin, NULL, &t));
	ASSERT_EQ(kvd_table_rows(t), 1);
	ASSERT_OK(kvd_table_str(t, 0, "place", &place));
	ASSERT_STREQ(place, want);
	ASSERT_OK(kvd_table_u64(t, 0, "tokens", &n));
	ASSERT_EQ(n, tokens);
	kvd_table_free(t);
	kvd_client_unref(admin);
}

static void start(struct fixture *f, const char *tier_size, const char *idle, const char *extra) {
	const char *args[] = { "--pool-size", "16MiB", "--chunk-size", "1MiB", "--host-tier-size",
		               tier_size, "--tier-idle", idle, "--grant-wait", "300",
		               extra ? extra : NULL, NULL };

	fixture_start(f, args);
}

/* One sequence of tokens, filled with tag; its engine then leaves it alone. */
static kvd_seq *filled_seq(kvd_client *c, int model, uint32_t tokens, uint32_t tag) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &s));
	ASSERT_OK(kvd_seq_grow(s, tokens));
	ASSERT_OK(kvd_seq_pin(s));
	fill_seq(s, tag);
	ASSERT_OK(kvd_seq_unpin(s));
	return s;
}

static void idle_round_trip(bool ring) {
	struct fixture f;
	static struct picture before;
	kvd_client *c;
	kvd_seq *s;
	int model, recall = -1;

	start(&f, "8MiB", "200", NULL);
	c = host_engine(&f, ring, &model);
	ASSERT_OK(model);
	s = filled_seq(c, model, 300, 7);
	take_picture(s, &before);
	ASSERT_EQ(fixture_status(&f, "t", "tier_sequences"), 0);

	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	/* 19 blocks of each of 2 tables, in one segment of the chunk size. */
	ASSERT_EQ(fixture_status(&f, NULL, "tier_offload_bytes"), 19ull * 2 * BLOCK_BYTES);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 1 << 20);
	ASSERT_EQ(fixture_status(&f, "t", "tier_bytes"), fixture_status(&f, NULL, "host_tier_used_bytes"));
	ASSERT_EQ(fixture_status(&f, "t", "block_bytes"), 0);
	/* Out of the pool, the tables are empty, and the listing says where it is. */
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	assert_place(&f, "host", 300);

	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	assert_place(&f, "pool", 300);
	ASSERT_EQ(check_seq(s, 7), 0);
	assert_same_picture(s, &before);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_sequences"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_recalls"), 1);
	ASSERT_EQ(fixture_status(&f, "t", "evicted_tokens"), 0);
	/* Told once. */
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_NONE);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(idle_sequence_comes_back_exact_through_the_ring) {
	idle_round_trip(true);
}

TEST(idle_sequence_comes_back_exact_through_the_socket) {
	idle_round_trip(false);
}

TEST(grow_brings_it_back_and_the_pin_tells) {
	struct fixture f;
	struct picture before;
	kvd_client *c;
	kvd_seq *s;
	int model, recall = -1;

	start(&f, "8MiB", "200", NULL);
	c = host_engine(&f, true, &model);
	s = filled_seq(c, model, 40, 3);
	take_picture(s, &before);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_OK(kvd_seq_grow(s, 1));
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	ASSERT_EQ(kvd_seq_tokens(s, 1, 0), 41);
	ASSERT_EQ(kvd_seq_position(s, 1, 0, 40), 40);
	/* The first 40 are as they were. */
	for (uint32_t l = 0; l < 2; l++)
		for (uint32_t i = 0; i < 40; i++)
			ASSERT_EQ(kvd_seq_position(s, l, 0, i), before.pos[l][i]);
	fill_seq_from(s, 3, 40);
	ASSERT_EQ(check_seq(s, 3), 0);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(drop_tenants_stay_in_the_pool) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int model;

	start(&f, "8MiB", "100", NULL);
	c = connect_tenant(&f, "t", true);
	model = kvd_model_register(c, &shape);
	s = filled_seq(c, model, 64, 1);
	pause_ms(600);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_offloads"), 0);
	ASSERT_TRUE(fixture_status(&f, "t", "block_bytes") > 0);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(full_tier_drops_the_oldest_and_the_pin_says_lost) {
	struct fixture f;
	struct picture before;
	kvd_client *c;
	kvd_seq *a, *b;
	int model, recall = -1;

	/* Each sequence takes 2 x 7 blocks of 8 KiB, in a segment of 1 MiB: the tier holds
	 * one. */
	start(&f, "1MiB", "300", NULL);
	c = host_engine(&f, true, &model);
	a = filled_seq(c, model, 100, 1);
	pause_ms(50);
	b = filled_seq(c, model, 100, 2);
	take_picture(b, &before);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "tier_lost_full", 1));
	/* a is lost when b's move begins; b counts in the tier once its copy lands. */
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_EQ(fixture_status(&f, "t", "tier_lost"), 1);

	ASSERT_OK(kvd_seq_pin_recall(a, &recall));
	ASSERT_EQ(recall, KVD_RECALL_LOST);
	ASSERT_EQ(kvd_seq_tokens(a, 0, 0), 0);
	ASSERT_EQ(kvd_seq_tokens(a, 1, 0), 0);
	ASSERT_OK(kvd_seq_unpin(a));
	ASSERT_OK(kvd_seq_pin_recall(b, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	assert_same_picture(b, &before);
	ASSERT_EQ(check_seq(b, 2), 0);
	ASSERT_OK(kvd_seq_unpin(b));
	ASSERT_EQ(fixture_status(&f, "t", "evicted_tokens"), 0);
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(release_while_out_frees_its_entry) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	pid_t pid;
	int model;

	start(&f, "8MiB", "100", NULL);
	c = host_engine(&f, true, &model);
	s = filled_seq(c, model, 200, 1);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_sequences"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0);
	ASSERT_EQ(fixture_status(&f, "t", "tier_bytes"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_recalls"), 0);
	kvd_client_unref(c);
	/* So does a process that exits with one out. */
	pid = fixture_fork();
	if (pid == 0) {
		c = connect_tenant(&f, "t", true);
		(void)filled_seq(c, kvd_model_register(c, &shape), 200, 1);
		pause_ms(60000);
		_exit(0);
	}
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(no_memory_for_the_recall_loses_it) {
	struct fixture f;
	kvd_client *c, *admin;
	kvd_seq *s;
	kvd_tenant_params cap = { .size = sizeof(cap), .set = KVD_TENANT_SET_MAX, .max_bytes = 0 };
	int model, recall = -1;

	start(&f, "8MiB", "100", NULL);
	c = host_engine(&f, true, &model);
	s = filled_seq(c, model, 200, 1);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	/* Its cap leaves no room: the recall waits grant-wait (300 ms), then gives up. */
	admin = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_tenant_set_params(admin, "t", &cap));
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_LOST);
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_lost_no_memory"), 1);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_sequences"), 0);
	ASSERT_EQ(fixture_status(&f, "t", "evicted_tokens"), 0);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(admin);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(corrupt_block_is_never_served) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int model, recall = -1;

	TEST_NEEDS_HOOKS();
	setenv("KVD_TEST_TIER_CORRUPT", "1", 1);
	start(&f, "8MiB", "100", NULL);
	unsetenv("KVD_TEST_TIER_CORRUPT");
	c = host_engine(&f, true, &model);
	s = filled_seq(c, model, 200, 1);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_LOST);
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_lost_corrupt"), 1);
	/* Nothing it took for the recall stays taken. */
	ASSERT_EQ(fixture_status(&f, "t", "block_bytes"), 0);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(pressure_moves_idle_sequences_before_evicting_tokens) {
	struct fixture f;
	struct picture before;
	kvd_client *c;
	kvd_seq *idle, *busy;
	int model, recall = -1;
	kvd_model_spec spec = shape;
	kvd_eviction_spec ev = { .unit = KVD_UNIT_LAYER_TOKEN, .window = 4, .sinks = 4 };

	/* A budget of 4 chunks, no idle time: only pressure moves anything. */
	start(&f, "8MiB", "0", "--budget=4MiB");
	set_tier(&f, "t", "host", 0);
	c = connect_tenant(&f, "t", true);
	model = kvd_model_register_evictable(c, &spec, &ev);
	ASSERT_OK(model);
	/* 2 MiB, then idle for more than a second. */
	idle = filled_seq(c, model, 2048, 5);
	ASSERT_OK(kvd_seq_open(c, model, MAX_TOKENS, &busy));
	take_picture(idle, &before);
	pause_ms(1300);
	/* Another 2 MiB: past the budget's high watermark. */
	ASSERT_OK(kvd_seq_grow(busy, 2048));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_EQ(fixture_status(&f, "t", "evicted_tokens"), 0);
	ASSERT_OK(kvd_seq_release(busy));

	ASSERT_OK(kvd_seq_pin_recall(idle, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	assert_same_picture(idle, &before);
	ASSERT_EQ(check_seq(idle, 5), 0);
	ASSERT_OK(kvd_seq_unpin(idle));
	ASSERT_EQ(fixture_status(&f, "t", "evicted_tokens"), 0);
	ASSERT_OK(kvd_seq_release(idle));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(tier_host_needs_a_host_tier) {
	struct fixture f;
	char out[4096], args[256];

	start(&f, "0", "100", NULL);
	set_tier(&f, "t", "host", -EINVAL);
	set_tier(&f, "t", "disk", -EINVAL);
	set_tier(&f, "t", "drop", 0);
	ASSERT_EQ(fixture_stop(&f), 0);

	fixture_setup(&f, "[tenant t]\ntier = host\n", false);
	snprintf(args, sizeof(args), "--check-config %s --backend host", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "tenant t: tier host needs a host tier (host-tier-size)"));
	snprintf(args, sizeof(args), "--check-config %s --backend host --host-tier-size 1GiB", f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 0);
	ASSERT_TRUE(strstr(out, "policy kvd, tier host"));
	/* The tier holds whole chunks. */
	snprintf(args, sizeof(args), "--check-config %s --backend host --host-tier-size 1MiB",
	         f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "--host-tier-size must be 0 or at least chunk-size (4.0 MiB)"));
	fixture_cleanup(&f);
}

/* The move gate: a FIFO the daemon's mover reads one byte from after each copy, before the
 * loop finishes the move (fixture_gate_wait returns then: the worker must have let go of
 * the gate since the last one, so the caller waits for that move's end first). */
static void gate_start(struct fixture *f, char *path, size_t n, const char *idle) {
	fixture_gate_make(path, n);
	setenv("KVD_TEST_MOVE_GATE", path, 1);
	start(f, "8MiB", idle, NULL);
	unsetenv("KVD_TEST_MOVE_GATE");
}

/* Lets the next copy through from another thread, for a call that waits for it. */
static void *gate_pass(void *path) {
	fixture_gate_release(fixture_gate_wait(path));
	return NULL;
}

TEST(pin_during_a_move_out_keeps_it_in_the_pool) {
	char gate[64];
	struct fixture f;
	pthread_t passer;
	kvd_client *c;
	kvd_seq *s;
	int model, recall = -1, fd;

	TEST_NEEDS_HOOKS();
	gate_start(&f, gate, sizeof(gate), "200");
	c = host_engine(&f, true, &model);
	s = filled_seq(c, model, 100, 4);
	/* Copied, not yet finished: the engine pins and rewrites it now. */
	fd = fixture_gate_wait(gate);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_moves"), 1);
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	ASSERT_EQ(recall, KVD_RECALL_NONE);
	fill_seq(s, 9);
	ASSERT_OK(kvd_seq_unpin(s));
	fixture_gate_release(fd);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_moves", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "tier_offloads"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0);
	/* Idle again, it moves out with what it holds now, and comes back so. */
	fd = fixture_gate_wait(gate);
	fixture_gate_release(fd);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_OK(-pthread_create(&passer, NULL, gate_pass, gate));
	ASSERT_OK(kvd_seq_pin_recall(s, &recall));
	pthread_join(passer, NULL);
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	ASSERT_EQ(check_seq(s, 9), 0);
	ASSERT_OK(kvd_seq_unpin(s));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	unlink(gate);
}

TEST(engine_gone_during_a_recall) {
	char gate[64];
	struct fixture f;
	pid_t pid;
	int fd;

	TEST_NEEDS_HOOKS();
	gate_start(&f, gate, sizeof(gate), "100");
	set_tier(&f, "t", "host", 0);
	pid = fixture_fork();
	if (pid == 0) {
		kvd_client *c = connect_tenant(&f, "t", true);
		kvd_seq *s = filled_seq(c, kvd_model_register(c, &shape), 300, 1);

		/* Out (the parent lets the copy through), then back: the pin waits. */
		while (fixture_status(&f, NULL, "host_tier_sequences") != 1)
			pause_ms(10);
		(void)kvd_seq_pin(s);
		_exit(0);
	}
	fixture_gate_release(fixture_gate_wait(gate));
	/* Once it is out, the worker has let go of the gate: the next to open it is the
	 * recall's copy, which waits there while its engine goes. */
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	fd = fixture_gate_wait(gate);
	ASSERT_TRUE(fixture_status(&f, "t", "block_bytes") > 0);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	ASSERT_TRUE(fixture_wait_status(&f, "t", "connections", 0));
	fixture_gate_release(fd);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_moves", 0));
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_sequences"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 0);
	ASSERT_EQ(fixture_status(&f, "t", "block_bytes"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_recalls"), 0);
	ASSERT_EQ(fixture_stop(&f), 0);
	unlink(gate);
}

/* ---- The file tier ---- */

/*
 * The daemon's file tier file, opened through /proc/PID/fd (it has no name): the fd whose
 * link is a deleted file in dir (or dir/tier, the name kvd 1.8 gave it). A non-dumpable
 * daemon's fds take root to open: -1 (the caller skips) without.
 */
static int open_tier_file(struct fixture *f, const char *dir, int flags) {
	static const char deleted[] = " (deleted)";
	char path[128], link[512], named[512];
	int fd = -1;

	snprintf(named, sizeof(named), "%s/tier", dir);
	for (int i = 0; i < 1024 && fd < 0; i++) {
		ssize_t n;

		snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)f->pid, i);
		n = readlink(path, link, sizeof(link) - 1);
		if (n < 0)
			continue;
		link[n] = '\0';
		if (strcmp(link, named) == 0 ||
		    (strncmp(link, dir, strlen(dir)) == 0 && link[strlen(dir)] == '/' &&
		     (size_t)n > sizeof(deleted) && strcmp(link + n - strlen(deleted), deleted) == 0))
			fd = open(path, flags | O_CLOEXEC);
	}
	if (fd < 0 && geteuid() == 0)
		test_fail(__FILE__, __LINE__, "no tier file among kvd's fds");
	return fd;
}

/* A daemon with a host tier of one 1 MiB segment and a file tier of file_size in dir (NULL:
 * the fixture's directory), tenant t's tier host+file, and an engine of t. */
static kvd_client *file_engine(struct fixture *f, const char *dir, const char *file_size,
                               const char *idle, int *ret_model) {
	char dir_arg[256];
	kvd_client *c;

	fixture_setup(f, NULL, true);
	snprintf(dir_arg, sizeof(dir_arg), "--file-tier-dir=%s", dir ? dir : f->dir);
	fixture_launch(f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--host-tier-size", "1MiB", "--file-tier-size",
	                                         file_size, dir_arg, "--tier-idle", idle,
	                                         "--grant-wait", "300", NULL });
	set_tier(f, "t", "host+file", 0);
	c = connect_tenant(f, "t", true);
	*ret_model = kvd_model_register(c, &shape);
	ASSERT_OK(*ret_model);
	return c;
}

/* Two sequences out in turn: the first leaves the one-segment host tier for the file. */
static void two_out(struct fixture *f, kvd_client *c, int model, kvd_seq **a, kvd_seq **b,
                    struct picture *pa, struct picture *pb) {
	*a = filled_seq(c, model, 100, 1);
	take_picture(*a, pa);
	ASSERT_TRUE(fixture_wait_status(f, NULL, "host_tier_sequences", 1));
	*b = filled_seq(c, model, 100, 2);
	take_picture(*b, pb);
	ASSERT_TRUE(fixture_wait_status(f, NULL, "file_tier_sequences", 1));
	ASSERT_TRUE(fixture_wait_status(f, NULL, "host_tier_sequences", 1));
	ASSERT_TRUE(fixture_wait_status(f, NULL, "host_tier_moves", 0));
}

TEST(full_host_tier_moves_the_oldest_to_the_file) {
	static struct picture pa, pb;
	struct fixture f;
	char path[300];
	struct stat st;
	kvd_client *c;
	kvd_seq *a, *b;
	int model, recall = -1, fd;

	c = file_engine(&f, NULL, "8MiB", "100", &model);
	/* The file has no name: nobody can open it but through kvd's fd. */
	snprintf(path, sizeof(path), "%s/tier", f.dir);
	ASSERT_TRUE(access(path, F_OK) < 0);
	fd = open_tier_file(&f, f.dir, O_RDONLY);
	if (fd >= 0) {
		ASSERT_OK(fstat(fd, &st));
		ASSERT_EQ(st.st_mode & 07777, 0600);
		ASSERT_EQ(st.st_nlink, 0u);
		ASSERT_EQ((uint64_t)st.st_size, 8u << 20);
		close(fd);
	}
	ASSERT_TRUE(fixture_wait_log(&f, "file tier: an unlinked file in", 1));
	two_out(&f, c, model, &a, &b, &pa, &pb);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_demotes"), 1);
	ASSERT_EQ(fixture_status(&f, NULL, "file_tier_used_bytes"), 1u << 20);
	ASSERT_EQ(fixture_status(&f, "t", "tier_file_bytes"), 1u << 20);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_lost_full"), 0);

	ASSERT_OK(kvd_seq_pin_recall(a, &recall));
	ASSERT_EQ(recall, KVD_RECALL_FILE);
	assert_same_picture(a, &pa);
	ASSERT_EQ(check_seq(a, 1), 0);
	ASSERT_OK(kvd_seq_unpin(a));
	ASSERT_OK(kvd_seq_pin_recall(b, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	assert_same_picture(b, &pb);
	ASSERT_OK(kvd_seq_unpin(b));
	ASSERT_EQ(fixture_status(&f, NULL, "tier_file_recalls"), 1);
	ASSERT_EQ(fixture_status(&f, NULL, "file_tier_sequences"), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "file_tier_used_bytes"), 0);
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * What is read back from the file is checked with a keyed MAC: junk, and a change made to
 * keep the blocks' (unkeyed) checksums (+1, -2, +1 to one lane's words of three 32-byte
 * groups leaves both Fletcher sums as they were), are never served.
 */
static void corrupt_file_block(bool keep_sums) {
	static struct picture pa, pb;
	struct fixture f;
	char junk[4096];
	kvd_client *c;
	kvd_seq *a, *b;
	int model, recall = -1, fd;

	c = file_engine(&f, NULL, "8MiB", "100", &model);
	two_out(&f, c, model, &a, &b, &pa, &pb);
	/* Its one segment is the file's first. */
	fd = open_tier_file(&f, f.dir, O_RDWR);
	if (fd < 0) {
		fixture_stop(&f);
		TEST_SKIP("needs root to open a non-dumpable kvd's file");
	}
	if (keep_sums) {
		uint64_t w[9];

		ASSERT_EQ(pread(fd, w, sizeof(w), 0), (ssize_t)sizeof(w));
		w[0] += 1;
		w[4] -= 2;
		w[8] += 1;
		ASSERT_EQ(pwrite(fd, w, sizeof(w), 0), (ssize_t)sizeof(w));
	} else {
		memset(junk, 0x5a, sizeof(junk));
		ASSERT_EQ(pwrite(fd, junk, sizeof(junk), 0), (ssize_t)sizeof(junk));
	}
	ASSERT_OK(fsync(fd));
	close(fd);
	ASSERT_OK(kvd_seq_pin_recall(a, &recall));
	ASSERT_EQ(recall, KVD_RECALL_LOST);
	ASSERT_EQ(kvd_seq_tokens(a, 0, 0), 0);
	ASSERT_EQ(fixture_status(&f, NULL, "tier_lost_corrupt"), 1);
	/* A corrupt block is the tier's word against the disk's: the tenant keeps its tier. */
	ASSERT_EQ(fixture_status(&f, "t", "tier_degraded"), 0);
	ASSERT_OK(kvd_seq_unpin(a));
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(corrupt_file_block_is_never_served) {
	corrupt_file_block(false);
}

TEST(forged_file_block_is_never_served) {
	corrupt_file_block(true);
}

/* A file tier directory others may write is refused: they could swap the file for theirs. */
TEST(file_tier_dir_others_may_write_refused) {
	struct fixture f;
	char dir[200], args[768], out[4096];

	fixture_setup(&f, NULL, false);
	snprintf(dir, sizeof(dir), "%s/open", f.dir);
	ASSERT_OK(mkdir(dir, 0700));
	ASSERT_OK(chmod(dir, 01777));
	snprintf(args, sizeof(args), "--socket %s/s --config /dev/null --state-dir %s/state "
	         "--backend host --pool-size 16MiB --chunk-size 1MiB --host-tier-size 1MiB "
	         "--file-tier-size 4MiB --file-tier-dir %s", f.dir, f.dir, dir);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 1);
	ASSERT_TRUE(strstr(out, "writable by no one else"));
	fixture_cleanup(&f);
}

TEST(file_io_error_degrades_the_tenant_to_drop) {
	static struct picture pa, pb;
	struct fixture f;
	kvd_client *c;
	kvd_seq *a, *b, *d;
	int model, recall = -1;

	TEST_NEEDS_HOOKS();
	/* The first segment written fails: the demotion of a. */
	setenv("KVD_TEST_TIER_IO_ERROR", "1", 1);
	c = file_engine(&f, NULL, "8MiB", "100", &model);
	unsetenv("KVD_TEST_TIER_IO_ERROR");
	a = filled_seq(c, model, 100, 1);
	take_picture(a, &pa);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	b = filled_seq(c, model, 100, 2);
	take_picture(b, &pb);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "tier_lost_io", 1));
	ASSERT_TRUE(fixture_wait_log(&f, "the file tier failed", 1));
	ASSERT_EQ(fixture_status(&f, "t", "tier_degraded"), 1);
	ASSERT_EQ(fixture_status(&f, NULL, "file_tier_sequences"), 0);
	ASSERT_OK(kvd_seq_pin_recall(a, &recall));
	ASSERT_EQ(recall, KVD_RECALL_LOST);
	ASSERT_OK(kvd_seq_unpin(a));
	/* b made it to the host tier before; from now on nothing of t leaves the pool. */
	ASSERT_OK(kvd_seq_pin_recall(b, &recall));
	ASSERT_EQ(recall, KVD_RECALL_HOST);
	assert_same_picture(b, &pb);
	ASSERT_OK(kvd_seq_unpin(b));
	d = filled_seq(c, model, 50, 3);
	pause_ms(500);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_sequences"), 0);
	/* Setting its tier again takes it back. */
	set_tier(&f, "t", "host+file", 0);
	ASSERT_EQ(fixture_status(&f, "t", "tier_degraded"), 0);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "file_tier_sequences", 1));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "host_tier_sequences", 1));
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_OK(kvd_seq_release(d));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Where the file system refuses O_DIRECT (tmpfs before Linux 6.6): buffered, and said so. */
TEST(buffered_where_o_direct_is_refused) {
	static struct picture pa, pb;
	struct fixture f;
	kvd_client *c;
	kvd_seq *a, *b;
	int model, recall = -1;

	TEST_NEEDS_HOOKS();
	setenv("KVD_TEST_TIER_NO_DIRECT", "1", 1);
	c = file_engine(&f, NULL, "8MiB", "100", &model);
	unsetenv("KVD_TEST_TIER_NO_DIRECT");
	ASSERT_TRUE(fixture_wait_log(&f, "refuses O_DIRECT: buffered I/O", 1));
	two_out(&f, c, model, &a, &b, &pa, &pb);
	ASSERT_OK(kvd_seq_pin_recall(a, &recall));
	ASSERT_EQ(recall, KVD_RECALL_FILE);
	assert_same_picture(a, &pa);
	ASSERT_EQ(check_seq(a, 1), 0);
	ASSERT_OK(kvd_seq_unpin(a));
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* What is in the file at a start cannot be proven to be what it was: purged. */
TEST(file_tier_purged_at_start_and_checked) {
	struct fixture f;
	char path[300], out[4096], args[512];
	struct stat st;
	int fd;

	fixture_setup(&f, NULL, false);
	snprintf(path, sizeof(path), "%s/tier", f.dir);
	fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
	ASSERT_OK(fd);
	ASSERT_EQ(pwrite(fd, "stale", 5, 0), 5);
	close(fd);
	snprintf(args, sizeof(args), "--file-tier-dir=%s", f.dir);
	fixture_launch(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                          "--host-tier-size", "1MiB", "--file-tier-size",
	                                          "4MiB", args, NULL });
	/* The name an earlier kvd used is gone; the new file has none, and nothing in it. */
	ASSERT_TRUE(access(path, F_OK) < 0);
	fd = open_tier_file(&f, f.dir, O_RDONLY);
	if (fd >= 0) {
		ASSERT_OK(fstat(fd, &st));
		ASSERT_EQ(st.st_mode & 07777, 0600);
		ASSERT_EQ(st.st_blocks, 0);
		close(fd);
	}
	ASSERT_EQ(fixture_status(&f, NULL, "file_tier_bytes"), 4u << 20);
	set_tier(&f, "t", "host+file", 0);
	ASSERT_EQ(fixture_halt(&f), 0);
	ASSERT_TRUE(access(path, F_OK) < 0);
	fixture_cleanup(&f);

	/* A file tier needs a host tier, and host+file a file tier. */
	fixture_setup(&f, "[tenant t]\ntier = host+file\n", false);
	snprintf(args, sizeof(args), "--check-config %s --backend host --host-tier-size 4MiB",
	         f.config);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "tenant t: tier host+file needs a file tier (file-tier-size)"));
	snprintf(args, sizeof(args), "--check-config /dev/null --backend host --file-tier-size 4MiB");
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "--file-tier-size needs a host tier"));
	fixture_cleanup(&f);
	start(&f, "4MiB", "100", NULL);
	set_tier(&f, "t", "host+file", -EINVAL);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A full disk: a file tier larger than the small file system it is on (an ext4 on a loop
 * device the test makes), so that writing sequences to it runs out of space. Needs root and
 * loop devices: skipped without them.
 */
TEST(disk_full_degrades_the_tenant_to_drop) {
	char img[] = "/tmp/kvd-test-fs-XXXXXX", mnt[] = "/tmp/kvd-test-mnt-XXXXXX", cmd[512];
	struct fixture f;
	kvd_seq *s[12];
	kvd_client *c;
	int model, fd, n = 0;

	if (geteuid() != 0)
		TEST_SKIP("needs root to mount a file system");
	fd = mkstemp(img);
	ASSERT_OK(fd);
	ASSERT_OK(ftruncate(fd, 6 << 20));
	close(fd);
	ASSERT_TRUE(mkdtemp(mnt));
	snprintf(cmd, sizeof(cmd), "mkfs.ext4 -q -F %s >/dev/null 2>&1 && mount -o loop %s %s "
	         ">/dev/null 2>&1", img, img, mnt);
	if (system(cmd) != 0) {
		unlink(img);
		rmdir(mnt);
		TEST_SKIP("cannot make and mount a loop file system here");
	}
	c = file_engine(&f, mnt, "64MiB", "50", &model);
	/* Each sequence fills the one host segment and pushes the one before to the file,
	 * until the 6 MiB file system is full. */
	while (n < 12 && fixture_status(&f, NULL, "tier_lost_io") == 0) {
		s[n] = filled_seq(c, model, 100, (uint32_t)n);
		n++;
		fixture_wait_status(&f, NULL, "tier_offloads", (uint64_t)n);
	}
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "tier_lost_io", 1));
	ASSERT_TRUE(fixture_wait_log(&f, "No space left on device", 1));
	ASSERT_EQ(fixture_status(&f, "t", "tier_degraded"), 1);
	for (int i = 0; i < n; i++)
		ASSERT_OK(kvd_seq_release(s[i]));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
	snprintf(cmd, sizeof(cmd), "umount %s", mnt);
	ASSERT_EQ(system(cmd), 0);
	rmdir(mnt);
	unlink(img);
}

/* kvd-bench tier end to end on a small shape, both tiers: it runs and measures (timings
 * are not checked: a benchmark). A 2-layer sequence of 512 tokens takes 4 one-MiB
 * segments: the host tier of 6 holds one, and the next sends it to the file. */
TEST(bench_runs) {
	const char *bench = getenv("KVD_BENCH");
	char cmd[1024], out[8192], dir_arg[256];
	struct fixture f;
	size_t n;
	FILE *p;
	int status;

	if (!bench)
		TEST_SKIP("KVD_BENCH is not set (run the test through meson)");
	/* The fake driver's device memory is only the CPU's to touch in the fake. */
	if (fixture_backend_cuda())
		TEST_SKIP("the bench's own figures on a GPU pool come from tools/gpu-check");
	fixture_setup(&f, NULL, false);
	snprintf(dir_arg, sizeof(dir_arg), "--file-tier-dir=%s", f.dir);
	fixture_launch(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                          "--host-tier-size", "6MiB", "--file-tier-size",
	                                          "16MiB", dir_arg, "--tier-idle", "50", NULL });
	snprintf(cmd, sizeof(cmd), "%s tier --socket %s --tokens 512 --layers 2 --file-dir %s 2>&1",
	         bench, f.socket, f.dir);
	p = popen(cmd, "re");
	ASSERT_NOT_NULL(p);
	n = fread(out, 1, sizeof(out) - 1, p);
	out[n] = 0;
	status = pclose(p);
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		fprintf(stderr, "%s", out);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ASSERT_TRUE(strstr(out, "2 layers x 512 tokens: 4.0 MiB"));
	ASSERT_TRUE(strstr(out, "recall (kvd)"));
	ASSERT_TRUE(strstr(out, "2 layers x 512 tokens through the file tier"));
	ASSERT_TRUE(strstr(out, "of which waiting"));
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Waits until tenant's sequences are all out of the pool: in the tier or lost. */
static void wait_all_out(struct fixture *f, const char *tenant, uint64_t n) {
	for (int i = 0; fixture_status(f, tenant, "tier_sequences") + fixture_status(f, tenant, "tier_lost") < n; i++) {
		ASSERT_TRUE(i < 1000);
		pause_ms(10);
	}
	ASSERT_TRUE(fixture_wait_status(f, NULL, "host_tier_moves", 0));
}

/*
 * Tenants share the tiers: one that floods the host tier with small idle sequences (each
 * takes a whole segment) loses its own oldest once past its share (an equal part among the
 * tenants in the tier), never another's within its share; and tier-max-percent caps what
 * one tenant holds, however much is free.
 */
TEST(tiers_shared_by_tenants) {
	struct fixture f;
	kvd_client *v, *h;
	kvd_seq *vs[2], *hs[10];
	int mv, mh, recall = -1;

	/* 8 segments: the victim's 2 sequences take 2, the flood wants 10. */
	start(&f, "8MiB", "100", NULL);
	set_tier(&f, "v", "host", 0);
	set_tier(&f, "h", "host", 0);
	v = connect_tenant(&f, "v", true);
	h = connect_tenant(&f, "h", true);
	mv = kvd_model_register(v, &shape);
	mh = kvd_model_register(h, &shape);
	ASSERT_OK(mv);
	ASSERT_OK(mh);
	for (int i = 0; i < 2; i++)
		vs[i] = filled_seq(v, mv, 100, 1 + i);
	wait_all_out(&f, "v", 2);
	for (int i = 0; i < 10; i++)
		hs[i] = filled_seq(h, mh, 16, 10 + i);
	wait_all_out(&f, "h", 10);
	/* The flood's share is 4 of the 8 segments while the tier is full: 6 stay (it took
	 * what was free), 4 lost; the victim keeps both. */
	ASSERT_EQ(fixture_status(&f, "v", "tier_lost"), 0u);
	ASSERT_EQ(fixture_status(&f, "v", "tier_sequences"), 2u);
	ASSERT_EQ(fixture_status(&f, "h", "tier_lost"), 4u);
	ASSERT_EQ(fixture_status(&f, "h", "tier_sequences"), 6u);
	for (int i = 0; i < 2; i++) {
		ASSERT_OK(kvd_seq_pin_recall(vs[i], &recall));
		ASSERT_EQ(recall, KVD_RECALL_HOST);
		ASSERT_EQ(check_seq(vs[i], 1 + i), 0);
		ASSERT_OK(kvd_seq_unpin(vs[i]));
		ASSERT_OK(kvd_seq_release(vs[i]));
	}
	for (int i = 0; i < 10; i++)
		ASSERT_OK(kvd_seq_release(hs[i]));
	kvd_client_unref(v);
	kvd_client_unref(h);
	ASSERT_EQ(fixture_stop(&f), 0);

	/* Capped at 25%: 2 segments, with 6 free. */
	start(&f, "8MiB", "100", "--tier-max-percent=25");
	set_tier(&f, "h", "host", 0);
	h = connect_tenant(&f, "h", true);
	mh = kvd_model_register(h, &shape);
	ASSERT_OK(mh);
	for (int i = 0; i < 4; i++)
		hs[i] = filled_seq(h, mh, 16, 10 + i);
	wait_all_out(&f, "h", 4);
	ASSERT_EQ(fixture_status(&f, "h", "tier_sequences"), 2u);
	ASSERT_EQ(fixture_status(&f, "h", "tier_lost"), 2u);
	ASSERT_EQ(fixture_status(&f, NULL, "host_tier_used_bytes"), 2u << 20);
	for (int i = 0; i < 4; i++)
		ASSERT_OK(kvd_seq_release(hs[i]));
	kvd_client_unref(h);
	ASSERT_EQ(fixture_stop(&f), 0);
}
