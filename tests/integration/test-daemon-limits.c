/* SPDX-License-Identifier: MIT */
/*
 * Every limit a client can run into says so clearly and is counted: status's refused_NAME
 * (kvd_status_u64) goes up by exactly one per refusal, and the other limits' counters stay.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "basic/macro.h"
#include "basic/time-util.h"
#include "fixture.h"
#include "test.h"

static const kvd_model_spec small = {
	.name = "limits",
	.layers = 2,
	.q_heads = 4,
	.kv_heads = 2,
	.head_dim = 16,
	.dtype = KVD_DTYPE_F16,
	.block_tokens = 16,
	.layout = KVD_LAYOUT_PER_HEAD,
};

static uint64_t refused(struct fixture *f, const char *limit) {
	char key[64];

	snprintf(key, sizeof(key), "refused_%s", limit);
	return fixture_status(f, NULL, key);
}

/* Every counter the daemon keeps, all zero on a fresh daemon, listed by the library. */
TEST(every_limit_listed) {
	static const char *const names[] = {
		"connections", "connections_per_uid", "tenants", "tenants_per_uid", "models",
		"models_per_tenant",
		"seqs", "seqs_per_tenant", "seqs_node", "metadata", "seq_tokens", "descriptor",
		"frame", "send_queue",
		"outstanding", "observation", "uploads", "evict_requests", "evict_rate", "grant_waiters",
		"ring_completions", "unmap_timeout", "pinned", "ring_doorbell",
	};
	struct fixture f;
	kvd_client *c;
	kvd_status *st;

	fixture_start(&f, NULL);
	c = fixture_connect(&f, NULL);
	ASSERT_OK(kvd_status_get(c, &st));
	ASSERT_EQ(kvd_status_refusals(st), (uint32_t)(sizeof(names) / sizeof(names[0])));
	for (uint32_t i = 0; i < kvd_status_refusals(st); i++) {
		const char *name;
		uint64_t v = 1;

		ASSERT_OK(kvd_status_refusal(st, i, &name, &v));
		ASSERT_STREQ(name, names[i]);
		ASSERT_EQ(v, 0u);
	}
	ASSERT_ERRNO(kvd_status_refusal(st, kvd_status_refusals(st), NULL, NULL), -EINVAL);
	kvd_status_free(st);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(models_per_connection_and_tenant) {
	struct fixture f;
	kvd_client *a, *b;

	fixture_start(&f, (const char *const[]){ "--max-models=2", "--max-models-per-tenant=3", NULL });
	a = fixture_connect(&f, "t");
	b = fixture_connect(&f, "t");
	ASSERT_OK(kvd_model_register(a, &small));
	ASSERT_OK(kvd_model_register(a, &small));
	ASSERT_ERRNO(kvd_model_register(a, &small), -EMFILE);
	ASSERT_TRUE(strstr(kvd_client_last_error(a), "per connection"));
	ASSERT_EQ(refused(&f, "models"), 1u);
	ASSERT_OK(kvd_model_register(b, &small));
	ASSERT_ERRNO(kvd_model_register(b, &small), -EMFILE);
	ASSERT_TRUE(strstr(kvd_client_last_error(b), "max-models-per-tenant"));
	ASSERT_EQ(refused(&f, "models_per_tenant"), 1u);
	/* A connection's models go with it. */
	kvd_client_unref(a);
	ASSERT_TRUE(fixture_wait_status(&f, "t", "connections", 1));
	ASSERT_OK(kvd_model_register(b, &small));
	kvd_client_unref(b);
	ASSERT_EQ(refused(&f, "models"), 1u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(sequences_and_tokens) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s[3];
	int m;

	fixture_start(&f, (const char *const[]){ "--max-seqs=2", "--max-seq-tokens=1000", NULL });
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &small);
	ASSERT_OK(m);
	ASSERT_ERRNO(kvd_seq_open(c, m, 1001, &s[0]), -EINVAL);
	ASSERT_EQ(refused(&f, "seq_tokens"), 1u);
	ASSERT_OK(kvd_seq_open(c, m, 1000, &s[0]));
	ASSERT_OK(kvd_seq_open(c, m, 10, &s[1]));
	ASSERT_ERRNO(kvd_seq_open(c, m, 10, &s[2]), -EMFILE);
	ASSERT_EQ(refused(&f, "seqs"), 1u);
	ASSERT_OK(kvd_seq_release(s[0]));
	ASSERT_OK(kvd_seq_release(s[1]));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A grow that can never be served says why, with its size: more new chunks than one grow
 * maps (-E2BIG, as kvd.h documents), or more than the whole budget (-ENOSPC, not "node
 * budget exhausted"). */
TEST(grows_too_large_say_so) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int m;

	fixture_start(&f, (const char *const[]){ "--pool-size", "16MiB", "--chunk-size", "1MiB",
	                                         "--max-seq-tokens=2100000", NULL });
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &small);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 2100000, &s));
	/* 256 bytes a token (4 tables of 1 KiB blocks of 16 tokens): 2M tokens are 512 chunks. */
	ASSERT_ERRNO(kvd_seq_grow(s, 2000000), -E2BIG);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "needs about 489 chunks"));
	/* 100k tokens: 25 MiB, more than the 16 MiB budget, in fewer chunks than a grow maps. */
	ASSERT_ERRNO(kvd_seq_grow(s, 100000), -ENOSPC);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "more than the whole node budget"));
	ASSERT_EQ(kvd_seq_tokens(s, 0, 0), 0);
	/* What fits still grows. */
	ASSERT_OK(kvd_seq_grow(s, 1000));
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * The node's sequences, every tenant's together, stop short of what kvd can map: 16
 * connections x 4096 sequences used to reach vm.max_map_count (65,530) in 2.4 s, after
 * which every new connection failed, kvdctl status included. Here the bound is set low
 * (max-seqs-node); the derived default is checked below.
 */
TEST(node_sequences_bounded) {
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *s[7];
	int ma, mb;

	fixture_start(&f, (const char *const[]){ "--max-seqs-node=6", NULL });
	a = fixture_connect(&f, "alpha");
	b = fixture_connect(&f, "beta");
	ma = kvd_model_register(a, &small);
	mb = kvd_model_register(b, &small);
	ASSERT_OK(ma);
	ASSERT_OK(mb);
	for (int i = 0; i < 4; i++)
		ASSERT_OK(kvd_seq_open(a, ma, 64, &s[i]));
	ASSERT_OK(kvd_seq_open(b, mb, 64, &s[4]));
	ASSERT_OK(kvd_seq_open(b, mb, 64, &s[5]));
	ASSERT_ERRNO(kvd_seq_open(b, mb, 64, &s[6]), -EMFILE);
	ASSERT_TRUE(strstr(kvd_client_last_error(b), "max-seqs-node") != NULL);
	ASSERT_EQ(refused(&f, "seqs_node"), 1u);
	/* An operator still gets in and sees it. */
	ASSERT_EQ(fixture_status(&f, NULL, "sequences"), 6u);
	ASSERT_EQ(fixture_status(&f, NULL, "sequences_max"), 6u);
	ASSERT_EQ(fixture_status(&f, "beta", "sequences"), 2u);
	/* Room again once one is released, whoever's it was. */
	ASSERT_OK(kvd_seq_release(s[0]));
	ASSERT_OK(kvd_seq_open(b, mb, 64, &s[6]));
	for (int i = 1; i < 7; i++)
		ASSERT_OK(kvd_seq_release(s[i]));
	ASSERT_EQ(fixture_status(&f, NULL, "sequences"), 0u);
	kvd_client_unref(a);
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* By default the bounds come from the machine: what vm.max_map_count leaves at two
 * mappings a sequence, and a quarter of memory for their metadata, which status counts. */
TEST(node_bounds_derived) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	FILE *mc = fopen("/proc/sys/vm/max_map_count", "re");
	unsigned long long maps = 0;
	uint64_t meta, phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
	int m;

	ASSERT_TRUE(mc != NULL);
	ASSERT_EQ(fscanf(mc, "%llu", &maps), 1);
	fclose(mc);
	fixture_start(&f, NULL);
	ASSERT_GT(fixture_status(&f, NULL, "sequences_max"), 0u);
	ASSERT_TRUE(fixture_status(&f, NULL, "sequences_max") < maps / 2);
	ASSERT_EQ(fixture_status(&f, NULL, "metadata_max_bytes"), phys / 4);
	ASSERT_EQ(fixture_status(&f, NULL, "metadata_bytes"), 0u);
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &small);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	/* At least the descriptor's position table: 4 tables x 4096 slots x 4 bytes. */
	meta = fixture_status(&f, NULL, "metadata_bytes");
	ASSERT_TRUE(meta >= 4u * 4096 * 4 && meta < (1u << 20));
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_EQ(fixture_status(&f, NULL, "metadata_bytes"), 0u);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Sequences' metadata is bounded as a whole: large descriptors run out before memory. */
TEST(metadata_bounded) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s[16];
	int m, n = 0, r;

	fixture_start(&f, (const char *const[]){ "--max-metadata-bytes=4MiB", NULL });
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &small);
	ASSERT_OK(m);
	/* About 1 MiB each: 4 tables x 65536 slots x 4 bytes of positions, and block refs. */
	while (n < 16 && (r = kvd_seq_open(c, m, 65536, &s[n])) == 0)
		n++;
	ASSERT_ERRNO(r, -ENOMEM);
	ASSERT_TRUE(n >= 2 && n < 4);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "max-metadata-bytes") != NULL);
	ASSERT_EQ(refused(&f, "metadata"), 1u);
	ASSERT_TRUE(fixture_status(&f, NULL, "metadata_bytes") <= 4u << 20);
	/* Small ones still fit. */
	ASSERT_OK(kvd_seq_open(c, m, 64, &s[n]));
	n++;
	while (n > 0)
		ASSERT_OK(kvd_seq_release(s[--n]));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(observation_buffer) {
	kvd_eviction_spec ev = { .unit = KVD_UNIT_HEAD_TOKEN, .window = 256 };
	struct fixture f;
	kvd_client *c;

	/* 2 layers x 4 heads x 256 x 16 x 2 bytes = 64 KiB of queries: over 16 KiB. */
	fixture_start(&f, (const char *const[]){ "--max-observation-bytes=16KiB", NULL });
	c = fixture_connect(&f, "t");
	ASSERT_ERRNO(kvd_model_register_evictable(c, &small, &ev), -EFBIG);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "max-observation-bytes"));
	ASSERT_EQ(refused(&f, "observation"), 1u);
	ev.window = 8;
	ASSERT_OK(kvd_model_register_evictable(c, &small, &ev));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Replies a connection waits for are bounded: with max-outstanding 1, a second eviction
 * request while the first waits for its round (held at the round gate) is refused. */
TEST(outstanding_replies) {
	/* First: the receive state below is allocated. */
	TEST_NEEDS_HOOKS();
	Kvd__V1__Evict req = KVD__V1__EVICT__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT, *rep;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	struct fixture f;
	char gate[64];
	int fd, g;

	ASSERT_TRUE(rx);
	snprintf(gate, sizeof(gate), "/tmp/kvd-limits-gate-%d", (int)getpid());
	unlink(gate);
	ASSERT_OK(mkfifo(gate, 0600));
	setenv("KVD_TEST_ROUND_GATE", gate, 1);
	fixture_start(&f, (const char *const[]){ "--max-outstanding=1", NULL });
	unsetenv("KVD_TEST_ROUND_GATE");
	fd = raw_connect(&f);
	wire_rx_init(rx);
	ASSERT_EQ(raw_hello(fd, rx, NULL, 1, 1), 0);
	req.has_bytes = true;
	req.bytes = 1 << 20;
	env.has_id = true;
	env.body_case = KVD__V1__ENVELOPE__BODY_EVICT;
	env.evict = &req;
	env.id = 2;
	ASSERT_OK(raw_send(fd, &env));
	g = open(gate, O_WRONLY | O_CLOEXEC); /* the round waits at the gate now */
	ASSERT_OK(g);
	env.id = 3;
	ASSERT_OK(raw_send(fd, &env));
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, 3u);
	ASSERT_EQ(rep->status->code, -EBUSY);
	ASSERT_TRUE(strstr(rep->status->message, "max-outstanding"));
	ASSERT_EQ(write(g, "x", 1), 1);
	close(g);
	ASSERT_EQ(raw_recv(fd, rx, 5000, &rep), 1);
	ASSERT_EQ(rep->id, 2u);
	ASSERT_EQ(rep->status->code, 0);
	ASSERT_EQ(refused(&f, "outstanding"), 1u);
	close(fd);
	free(rx);
	unlink(gate);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A frame over the cap: the connection goes, the counter says why. */
TEST(frame_over_the_cap) {
	uint8_t header[8] = { 0, 0, 2, 0, 0, 0, 0, 0 }; /* 128 KiB */
	struct fixture f;
	int fd;

	fixture_start(&f, NULL);
	fd = raw_connect(&f);
	ASSERT_OK(raw_send_bytes(fd, header, sizeof(header)));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "refused_frame", 1));
	close(fd);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A daemon out of file descriptors pauses accepting: it neither spins on EMFILE (which
 * took a core, with millions of suppressed log lines) nor stops serving; it says so once,
 * and accepts again once connections close. The daemon runs with a limit of 48 fds.
 */
/*
 * The fd limit bounds the connections: each may take 37 of the daemon's fds (its own 5 and
 * 32 its client sent), the pool one a chunk, and 64 go to the rest; with 256 fds and 16
 * chunks, 4 connections (and root's 4 more), whatever max-connections says.
 */
TEST(fd_limit_bounds_connections) {
	kvd_client *c[8], *extra = NULL, *st = NULL;
	uint64_t retried = 0, v;
	kvd_status *s = NULL;
	struct fixture f;
	int r;

	fixture_setup(&f, NULL, true);
	f.fd_limit = 256;
	fixture_launch(&f, (const char *const[]){ "--pool-size=16MiB", "--chunk-size=1MiB", NULL });
	ASSERT_TRUE(fixture_wait_log(&f, "allows 4 connections besides 16 chunks", 1));
	/* The start-up probe's connection may not be gone from the daemon's count yet: a
	 * refusal within the first second is retried (and counted). */
	for (int i = 0; i < 8; i++) {
		for (int k = 0; (r = kvd_client_connect(f.socket, NULL, &c[i])) == -EUSERS && k < 100; k++) {
			retried++;
			usleep(10 * 1000);
		}
		ASSERT_OK(r);
	}
	ASSERT_ERRNO(kvd_client_connect(f.socket, NULL, &extra), -EUSERS);
	/* A place for the status queries, held while they run: the daemon sees c[0] go a
	 * moment later (seconds on a loaded machine under ASan), and a connection per query
	 * would race each close with the next connect. */
	kvd_client_unref(c[0]);
	for (int k = 0; (r = kvd_client_connect(f.socket, NULL, &st)) == -EUSERS && k < 1000; k++) {
		retried++;
		usleep(10 * 1000);
	}
	ASSERT_OK(r);
	ASSERT_OK(kvd_status_get(st, &s));
	ASSERT_OK(kvd_status_u64(s, "connections", &v));
	ASSERT_EQ(v, 8u);
	ASSERT_OK(kvd_status_u64(s, "refused_connections", &v));
	ASSERT_EQ(v, 1u + retried);
	kvd_status_free(s);
	kvd_client_unref(st);
	for (int i = 1; i < 8; i++)
		kvd_client_unref(c[i]);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(out_of_fds_pauses_accepting) {
	int fds[64];
	unsigned long long t0;
	unsigned logged;
	struct fixture f;

	fixture_setup(&f, NULL, true);
	f.fd_limit = 48;
	fixture_launch(&f, (const char *const[]){ "--hello-timeout=60000", NULL });

	/*
	 * More connections than the daemon has fds: the last ones wait in the backlog. They
	 * arrive while the daemon is stopped, so that it accepts them in one batch, as a flood
	 * would meet it: a daemon that took each as it came, refusing it (max-connections) and
	 * closing it before the next, would not run out. Whether the batch outruns the
	 * refusals is the scheduler's to say: a flood that did not is closed and sent again,
	 * a few times.
	 */
	for (unsigned attempt = 0;; attempt++) {
		ASSERT_OK(kill(f.pid, SIGSTOP));
		for (unsigned i = 0; i < 64; i++)
			fds[i] = raw_connect(&f);
		ASSERT_OK(kill(f.pid, SIGCONT));
		for (unsigned w = 0; w < 100 && fixture_log_count(&f, "accepting paused") == 0; w++)
			usleep(10 * 1000);
		if (fixture_log_count(&f, "accepting paused") > 0 || attempt == 4)
			break;
		for (unsigned i = 0; i < 64; i++)
			close(fds[i]);
	}
	usleep(300 * 1000);
	t0 = fixture_cpu_ticks(f.pid);
	logged = fixture_log_count(&f, "accepting paused");
	usleep(1000 * 1000);
	/* Not spinning: well under a tenth of a core (a spinning loop takes all of one), and
	 * not a line more while nothing changes (one when a pause begins). */
	ASSERT_LT(fixture_cpu_ticks(f.pid) - t0, (unsigned long long)sysconf(_SC_CLK_TCK) / 10);
	ASSERT_TRUE(fixture_wait_log(&f, "accepting paused", 1));
	ASSERT_EQ(fixture_log_count(&f, "accepting paused"), logged);
	ASSERT_LE(logged, 3u);

	for (unsigned i = 0; i < 64; i++)
		close(fds[i]);
	/* It serves again: this status connection is accepted. */
	ASSERT_EQ(fixture_status(&f, NULL, "connections") < 64, true);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A daemon that does not answer (stopped here; or out of fds with its backlog full) makes
 * kvd_client_connect give ETIMEDOUT after KVD_CONNECT_TIMEOUT_MS, and kvdctl exit 1
 * saying so, instead of both blocking forever.
 */
TEST(connect_times_out) {
	char *argv[] = { getenv("KVDCTL"), "--socket", NULL, "status", NULL };
	struct fixture f;
	kvd_client *c;
	uint64_t t0;
	int status;
	pid_t p;

	fixture_start(&f, NULL);
	ASSERT_OK(kill(f.pid, SIGSTOP));
	ASSERT_OK(setenv("KVD_CONNECT_TIMEOUT_MS", "300", 1));
	t0 = now_ms();
	ASSERT_EQ(kvd_client_connect(f.socket, "t", &c), -ETIMEDOUT);
	ASSERT_GE(now_ms() - t0, 250u);
	ASSERT_LT(now_ms() - t0, 5000u);
	argv[2] = f.socket;
	p = fixture_fork();
	if (p == 0) {
		int null = open("/dev/null", O_WRONLY | O_CLOEXEC);

		dup2(null, STDOUT_FILENO);
		dup2(null, STDERR_FILENO);
		execv(argv[0], argv);
		_exit(127);
	}
	ASSERT_EQ(waitpid(p, &status, 0), p);
	ASSERT_TRUE(WIFEXITED(status));
	ASSERT_EQ(WEXITSTATUS(status), 1);
	ASSERT_OK(unsetenv("KVD_CONNECT_TIMEOUT_MS"));
	ASSERT_OK(kill(f.pid, SIGCONT));
	/* Served again once it runs. */
	ASSERT_OK(kvd_client_connect(f.socket, "t", &c));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A release of more chunks than one message carries (WIRE_IDS_MAX, 2048): the ids that do
 * not fit the reply come ahead of it as unmap requests, on the socket and through the ring
 * alike, and every chunk is back when release returns. A model of 32 layers whose blocks
 * are 64 KiB each fills one 64 KiB chunk per layer and block; sizes at the limit, one past
 * it, and past what a message once decoded (4080).
 */
TEST(release_of_many_chunks) {
	static const kvd_model_spec big = { "many", 32, 8, 8, 128, KVD_DTYPE_F16, 16,
	                                    KVD_LAYOUT_PER_LAYER };
	static const uint32_t blocks[] = { 64, 65, 128 };
	struct fixture f;

	fixture_start(&f, (const char *const[]){ "--chunk-size=64KiB", "--pool-size=272MiB", NULL });
	for (int ring = 0; ring < 2; ring++)
		for (size_t i = 0; i < ELEMENTSOF(blocks); i++) {
			kvd_connect_params p = { .size = sizeof(p), .socket_path = f.socket,
			                         .tenant = "many",
			                         .flags = ring ? 0 : KVD_CONNECT_NO_RING };
			kvd_client *c;
			kvd_seq *s;
			int model;

			ASSERT_OK(kvd_client_connect_params(&p, &c));
			model = kvd_model_register(c, &big);
			ASSERT_OK(model);
			ASSERT_OK(kvd_seq_open(c, model, blocks[i] * 16, &s));
			/* 7 blocks a grow: 224 new chunks, within the fds one message carries. */
			for (uint32_t b = 0; b < blocks[i]; b += 7)
				ASSERT_OK(kvd_seq_grow(s, MIN(7u, blocks[i] - b) * 16));
			ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), blocks[i] * 32ull << 16);
			ASSERT_OK(kvd_seq_release(s));
			ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
			ASSERT_EQ(fixture_status(&f, NULL, "chunks_free"),
			          fixture_status(&f, NULL, "chunks_total"));
			kvd_client_unref(c);
		}
	ASSERT_EQ(fixture_status(&f, NULL, "protocol_errors"), 0u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * Pins (kvd(8), PINS): a tenant holds at most max-pinned-percent of the budget pinned (a
 * first pin, or a grow of a pinned sequence, past it is refused, -EDQUOT, counted); a pin
 * held past pin-report is reported, once; with pin-timeout, its holder is disconnected.
 */
TEST(pins_bounded_reported_and_timed_out) {
	/* 4 layers x 4 kv heads x 128, f16, 16-token blocks: 8 KiB a token. */
	static const kvd_model_spec wide = { "pins", 4, 4, 4, 128, KVD_DTYPE_F16, 16,
	                                     KVD_LAYOUT_PER_LAYER };
	struct fixture f;
	kvd_client *c;
	kvd_seq *a, *b;
	int model;

	fixture_setup(&f, NULL, true);
	fixture_launch(&f, (const char *const[]){ "--pool-size=64MiB", "--chunk-size=1MiB",
	                                          "--max-pinned-percent=50", "--pin-report=300",
	                                          "--grant-wait=0", NULL });
	c = fixture_connect(&f, "holder");
	model = kvd_model_register(c, &wide);
	ASSERT_OK(model);
	ASSERT_OK(kvd_seq_open(c, model, 8192, &a));
	ASSERT_OK(kvd_seq_open(c, model, 8192, &b));
	/* 20 MiB each: one may be pinned, not both (32 MiB). */
	ASSERT_OK(kvd_seq_grow(a, 2560));
	ASSERT_OK(kvd_seq_grow(b, 2560));
	ASSERT_OK(kvd_seq_pin(a));
	ASSERT_EQ(fixture_status(&f, "holder", "pinned_bytes"), 20u << 20);
	ASSERT_EQ(kvd_seq_pin(b), -EDQUOT);
	ASSERT_TRUE(strstr(kvd_client_last_error(c), "max-pinned-percent"));
	ASSERT_EQ(refused(&f, "pinned"), 1u);
	/* Pins nest: a second pin of a charges nothing more. */
	ASSERT_OK(kvd_seq_pin(a));
	ASSERT_OK(kvd_seq_unpin(a));
	/* Pinned, it may grow up to the bound, not past it. */
	ASSERT_OK(kvd_seq_grow(a, 1024));
	ASSERT_EQ(fixture_status(&f, "holder", "pinned_bytes"), 28u << 20);
	ASSERT_EQ(kvd_seq_grow(a, 1024), -EDQUOT);
	ASSERT_EQ(refused(&f, "pinned"), 2u);
	/* Held past pin-report: reported once, the holder named. */
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "pins_overdue", 1));
	ASSERT_EQ(fixture_status(&f, "holder", "pins_overdue"), 1u);
	ASSERT_TRUE(fixture_wait_log(&f, "pinned for", 1));
	ASSERT_OK(kvd_seq_unpin(a));
	ASSERT_EQ(fixture_status(&f, "holder", "pinned_bytes"), 0u);
	ASSERT_OK(kvd_seq_pin(b));
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_EQ(fixture_status(&f, "holder", "pinned_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(a));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);

	/* With pin-timeout, a holder that keeps its pin is disconnected, and its pins go. */
	fixture_launch(&f, (const char *const[]){ "--pool-size=64MiB", "--chunk-size=1MiB",
	                                          "--pin-timeout=300", NULL });
	c = fixture_connect(&f, "holder");
	model = kvd_model_register(c, &wide);
	ASSERT_OK(model);
	ASSERT_OK(kvd_seq_open(c, model, 8192, &a));
	ASSERT_OK(kvd_seq_grow(a, 256));
	ASSERT_OK(kvd_seq_pin(a));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "pin_disconnects", 1));
	ASSERT_TRUE(fixture_wait_status(&f, "holder", "pinned_bytes", 0));
	ASSERT_TRUE(fixture_wait_log(&f, "pinned past pin-timeout", 1));
	ASSERT_TRUE(kvd_seq_unpin(a) < 0);
	kvd_seq_release(a);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
