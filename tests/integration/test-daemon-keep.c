/* SPDX-License-Identifier: MIT */
/*
 * KV kept across a crash (keep.h). The test plays systemd's part: a datagram NOTIFY_SOCKET
 * whose FDSTORE=1 / FDSTOREREMOVE=1 messages it keeps as a name -> fd store, as
 * FileDescriptorStoreMax= does, and a restart that passes the stored fds to the next daemon
 * on fd 3 onwards with LISTEN_FDS, LISTEN_FDNAMES and LISTEN_PID, which is what
 * sd_listen_fds_with_names() reads.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "basic/time-util.h"
#ifdef KVD_HAVE_CUDA
#include "basic/cuda-dl.h"
#endif
#include "fixture.h"
#include "test.h"

#define STORE_MAX 512

static const kvd_model_spec shape = { "k", 2, 4, 2, 32, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
static const kvd_model_spec heads = { "h", 3, 4, 2, 16, KVD_DTYPE_BF16, 8, KVD_LAYOUT_PER_HEAD };

struct store {
	int sock;
	char path[128];
	pthread_t thread;
	pthread_mutex_t lock;
	int stop;
	unsigned n;
	char names[STORE_MAX][64];
	int fds[STORE_MAX];
	uint64_t last_ms;             /* when the last message came */
};

static const char *field(const char *msg, const char *key, char *buf, size_t n) {
	const char *p = msg;
	size_t k = strlen(key);

	for (; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
		if (strncmp(p, key, k) == 0) {
			size_t len = strcspn(p + k, "\n");

			snprintf(buf, n, "%.*s", (int)len, p + k);
			return buf;
		}
	return NULL;
}

static void store_message(struct store *st, const char *msg, const int *fds, unsigned nfds) {
	char name[64], flag[8];

	if (!field(msg, "FDNAME=", name, sizeof(name)))
		snprintf(name, sizeof(name), "stored");
	pthread_mutex_lock(&st->lock);
	if (field(msg, "FDSTORE=", flag, sizeof(flag)) && strcmp(flag, "1") == 0)
		for (unsigned i = 0; i < nfds; i++) {
			ASSERT_TRUE(st->n < STORE_MAX);
			snprintf(st->names[st->n], sizeof(st->names[0]), "%s", name);
			st->fds[st->n++] = fds[i];
		}
	else
		for (unsigned i = 0; i < nfds; i++)
			close(fds[i]);
	if (field(msg, "FDSTOREREMOVE=", flag, sizeof(flag)) && strcmp(flag, "1") == 0) {
		for (unsigned i = 0; i < st->n;) {
			if (strcmp(st->names[i], name) != 0) {
				i++;
				continue;
			}
			close(st->fds[i]);
			st->fds[i] = st->fds[--st->n];
			memcpy(st->names[i], st->names[st->n], sizeof(st->names[0]));
		}
	}
	st->last_ms = now_ms();
	pthread_mutex_unlock(&st->lock);
}

static void *store_thread(void *userdata) {
	struct store *st = userdata;

	while (!__atomic_load_n(&st->stop, __ATOMIC_RELAXED)) {
		struct pollfd p = { .fd = st->sock, .events = POLLIN };
		char buf[4096], cmsg[CMSG_SPACE(sizeof(int) * 16)];
		struct iovec iov = { .iov_base = buf, .iov_len = sizeof(buf) - 1 };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cmsg,
			             .msg_controllen = sizeof(cmsg) };
		int fds[16];
		unsigned nfds = 0;
		ssize_t k;

		if (poll(&p, 1, 20) <= 0)
			continue;
		k = recvmsg(st->sock, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
		if (k < 0)
			continue;
		buf[k] = 0;
		for (struct cmsghdr *ch = CMSG_FIRSTHDR(&mh); ch; ch = CMSG_NXTHDR(&mh, ch))
			if (ch->cmsg_level == SOL_SOCKET && ch->cmsg_type == SCM_RIGHTS) {
				unsigned n = (ch->cmsg_len - CMSG_LEN(0)) / sizeof(int);

				memcpy(fds + nfds, CMSG_DATA(ch), n * sizeof(int));
				nfds += n;
			}
		store_message(st, buf, fds, nfds);
	}
	return NULL;
}

static void store_start(struct store *st, struct fixture *f) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	memset(st, 0, sizeof(*st));
	pthread_mutex_init(&st->lock, NULL);
	snprintf(st->path, sizeof(st->path), "%s/notify", f->dir);
	strcpy(sa.sun_path, st->path);
	st->sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ASSERT_OK(st->sock);
	ASSERT_OK(bind(st->sock, (struct sockaddr *)&sa, sizeof(sa)));
	ASSERT_EQ(pthread_create(&st->thread, NULL, store_thread, st), 0);
}

/* Waits until nothing is queued and the store heard nothing for 200 ms: what a dead daemon
 * sent is all in. */
static void store_settle(struct store *st) {
	for (;;) {
		struct pollfd p = { .fd = st->sock, .events = POLLIN };
		uint64_t last;

		pthread_mutex_lock(&st->lock);
		last = st->last_ms;
		pthread_mutex_unlock(&st->lock);
		if (poll(&p, 1, 0) == 0 && now_ms() - last >= 200)
			return;
		usleep(50 * 1000);
	}
}

static void store_dump(struct store *st) {
	pthread_mutex_lock(&st->lock);
	for (unsigned i = 0; i < st->n; i++)
		fprintf(stderr, "store: %s fd %d\n", st->names[i], st->fds[i]);
	pthread_mutex_unlock(&st->lock);
}

static int store_find(struct store *st, const char *name) {
	int fd = -1;

	pthread_mutex_lock(&st->lock);
	for (unsigned i = 0; i < st->n; i++)
		if (strcmp(st->names[i], name) == 0)
			fd = st->fds[i];
	pthread_mutex_unlock(&st->lock);
	return fd;
}

static unsigned store_count(struct store *st) {
	unsigned n;

	pthread_mutex_lock(&st->lock);
	n = st->n;
	pthread_mutex_unlock(&st->lock);
	return n;
}

static void store_stop(struct store *st) {
	__atomic_store_n(&st->stop, 1, __ATOMIC_RELAXED);
	pthread_join(st->thread, NULL);
	for (unsigned i = 0; i < st->n; i++)
		close(st->fds[i]);
	close(st->sock);
}

/* fixture_launch(), under the store: NOTIFY_SOCKET, and the stored fds passed on. */
/* Starts the daemon with the store's fds, a pool of pool chunks of 1 MiB. */
static void launch_pool(struct fixture *f, struct store *st, const char *claim, unsigned pool) {
	const char *daemon = getenv("KVD_DAEMON");
	char pool_size[32];
	const char *argv[] = { daemon, "--socket", f->socket, "--config", f->config, "--state-dir",
		               f->state_dir, "--poll-us=0",
		               fixture_backend_cuda() ? "--backend=cuda" : "--backend=host",
		               pool_size, "--chunk-size=1MiB", claim, NULL };
	char names[STORE_MAX * 64] = "", num[32];
	int fds[STORE_MAX];
	unsigned n;

	snprintf(pool_size, sizeof(pool_size), "--pool-size=%uMiB", pool);
	ASSERT_TRUE(daemon);
	pthread_mutex_lock(&st->lock);
	n = st->n;
	memcpy(fds, st->fds, n * sizeof(int));
	for (unsigned i = 0; i < n; i++) {
		strcat(names, i ? ":" : "");
		strcat(names, st->names[i]);
	}
	pthread_mutex_unlock(&st->lock);

	f->pid = fixture_fork();
	if (f->pid == 0) {
		int log = open(f->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);

		if (log < 0 || dup2(log, STDERR_FILENO) < 0)
			_exit(126);
		/* Out of the way first, so that no dup2() below overwrites one not moved yet. */
		for (unsigned i = 0; i < n; i++)
			if ((fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 1000)) < 0)
				_exit(126);
		for (unsigned i = 0; i < n; i++)
			if (dup2(fds[i], 3 + (int)i) < 0)
				_exit(126);
		setenv("NOTIFY_SOCKET", st->path, 1);
		if (n > 0) {
			snprintf(num, sizeof(num), "%u", n);
			setenv("LISTEN_FDS", num, 1);
			setenv("LISTEN_FDNAMES", names, 1);
			snprintf(num, sizeof(num), "%d", (int)getpid());
			setenv("LISTEN_PID", num, 1);
		}
		execv(daemon, (char *const *)argv);
		_exit(127);
	}
	for (int i = 0; i < 500; i++) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), status;

		strcpy(sa.sun_path, f->socket);
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
			close(fd);
			return;
		}
		close(fd);
		if (waitpid(f->pid, &status, WNOHANG) == f->pid)
			test_fail(__FILE__, __LINE__, "the daemon exited during start-up (status %d)", status);
		usleep(10 * 1000);
	}
	test_fail(__FILE__, __LINE__, "the daemon did not listen within 5 s");
}

static void launch(struct fixture *f, struct store *st, const char *claim) {
	launch_pool(f, st, claim, 64);
}

static void crash(struct fixture *f, struct store *st) {
	int status;

	ASSERT_OK(kill(f->pid, SIGKILL));
	ASSERT_EQ(waitpid(f->pid, &status, 0), f->pid);
	f->pid = 0;
	store_settle(st);
}

static uint32_t next_event(kvd_client *c) {
	struct pollfd p = { .fd = kvd_client_get_event_fd(c), .events = POLLIN };
	kvd_event ev;

	for (int i = 0; i < 50; i++) {
		if (kvd_client_next_event(c, &ev) == 1)
			return ev.type;
		(void)poll(&p, 1, 100);
	}
	return 0;
}

static void lose(kvd_client *c) {
	ASSERT_EQ(next_event(c), (uint32_t)KVD_EVENT_DISCONNECTED);
	ASSERT_OK(kvd_client_reconnect(c, 5000));
}

static kvd_seq *open_filled(kvd_client *c, int m, uint32_t max, uint32_t tokens, uint32_t tag) {
	kvd_seq *s;

	ASSERT_OK(kvd_seq_open(c, m, max, &s));
	ASSERT_OK(kvd_seq_grow(s, tokens));
	fill_seq(s, tag);
	assert_digests_agree(s);
	return s;
}

static uint64_t digest(kvd_seq *s) {
	return assert_digests_agree(s);
}

/* SeqClaim over a raw connection, for a tenant that holds no handle: its status code. */
static int raw_claim(struct fixture *f, const char *tenant, uint64_t seq_id) {
	Kvd__V1__SeqClaim cl = KVD__V1__SEQ_CLAIM__INIT;
	Envelope env = KVD__V1__ENVELOPE__INIT;
	struct wire_rx *rx = calloc(1, sizeof(*rx));
	int fd = raw_connect(f), code;

	ASSERT_TRUE(rx);
	wire_rx_init(rx);
	ASSERT_EQ(raw_hello(fd, rx, tenant, 1, 1), 0);
	ASSERT_EQ(raw_register_model(fd, rx, &shape, 2), 0);
	cl.has_seq_id = cl.has_model_id = true;
	cl.seq_id = seq_id;
	cl.model_id = 1;
	env.body_case = KVD__V1__ENVELOPE__BODY_SEQ_CLAIM;
	env.seq_claim = &cl;
	code = raw_call(fd, rx, &env, 3);
	wire_rx_done(rx);
	free(rx);
	close(fd);
	return code;
}

TEST(kept_across_a_crash) {
	struct fixture f;
	struct store st;
	kvd_client *c, *o;
	kvd_seq *a, *b, *x;
	uint64_t used, engine_used, engine_blocks, other_used, da, db, t0, t1;
	int m, mh, mo;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=1500");
	c = fixture_connect(&f, "engine");
	o = fixture_connect(&f, "other");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	mh = kvd_model_register(c, &heads);
	ASSERT_OK(mh);
	mo = kvd_model_register(o, &shape);
	ASSERT_OK(mo);
	a = open_filled(c, m, 1024, 100, 1);
	b = open_filled(c, mh, 4096, 700, 2);
	x = open_filled(o, mo, 256, 50, 3);
	da = digest(a);
	db = digest(b);
	used = fixture_status(&f, NULL, "used_bytes");
	engine_used = fixture_status(&f, "engine", "used_bytes");
	engine_blocks = fixture_status(&f, "engine", "block_bytes");
	other_used = fixture_status(&f, "other", "used_bytes");
	ASSERT_EQ(used, engine_used + other_used);

	crash(&f, &st);
	if (store_find(&st, "kvd-journal") < 0)
		store_dump(&st);
	ASSERT_TRUE(store_find(&st, "kvd-journal") >= 0);
	t0 = now_ms();
	launch(&f, &st, "--restore-claim=1500");
	/* Back before anyone reconnects: owned, charged, waiting. */
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), used);
	ASSERT_EQ(fixture_status(&f, "engine", "used_bytes"), engine_used);
	ASSERT_EQ(fixture_status(&f, "engine", "block_bytes"), engine_blocks);
	ASSERT_EQ(fixture_status(&f, "engine", "sequences"), 2u);
	ASSERT_EQ(fixture_status(&f, "other", "sequences"), 1u);

	lose(c);
	ASSERT_ERRNO(kvd_seq_grow(a, 1), -ESTALE);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	/* The wrong shape is refused, and the sequence still waits. */
	ASSERT_ERRNO(kvd_seq_claim(a, m + 100), -EINVAL);
	mh = kvd_model_register(c, &heads);
	ASSERT_OK(mh);
	ASSERT_ERRNO(kvd_seq_claim(a, mh), -EINVAL);
	ASSERT_OK(kvd_seq_claim(a, m));
	t1 = now_ms();
	fprintf(stderr, "restart to first sequence claimed: %llu ms\n", (unsigned long long)(t1 - t0));
	ASSERT_EQ(check_seq(a, 1), 0u);
	ASSERT_EQ(digest(a), da);
	ASSERT_OK(kvd_seq_claim(b, mh));
	ASSERT_EQ(check_seq(b, 2), 0u);
	ASSERT_EQ(digest(b), db);
	ASSERT_OK(kvd_seq_claim(b, mh)); /* not stale: nothing to do */
	/* It goes on where it was. */
	ASSERT_OK(kvd_seq_grow(a, 40));
	ASSERT_EQ(kvd_seq_tokens(a, 1, 1), 140);
	fill_seq_from(a, 1, 100);
	ASSERT_EQ(check_seq(a, 1), 0u);
	assert_digests_agree(a);
	/* Another tenant cannot take the other's, nor a claimed one. */
	ASSERT_EQ(raw_claim(&f, "thief", kvd_seq_descriptor(x)->seq_id), -ENOENT);
	ASSERT_EQ(raw_claim(&f, "engine", kvd_seq_descriptor(a)->seq_id), -ENOENT);

	/* other comes back but claims nothing: its sequence goes at the deadline. */
	lose(o);
	ASSERT_TRUE(fixture_wait_log(&f, "were not claimed within", 1));
	ASSERT_TRUE(fixture_wait_status(&f, "other", "sequences", 0));
	ASSERT_EQ(fixture_status(&f, "other", "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), fixture_status(&f, "engine", "used_bytes"));
	mo = kvd_model_register(o, &shape);
	ASSERT_OK(mo);
	ASSERT_ERRNO(kvd_seq_claim(x, mo), -ENOENT);
	ASSERT_OK(kvd_seq_release(x));

	ASSERT_OK(kvd_seq_release(a));
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	kvd_client_unref(c);
	kvd_client_unref(o);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

/* A claimed sequence is kept again: its new descriptor took the old one's place. */
TEST(kept_across_two_crashes) {
	struct fixture f;
	struct store st;
	kvd_client *c;
	kvd_seq *a;
	int m;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=10000");
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 512, 200, 7);
	for (int round = 0; round < 2; round++) {
		crash(&f, &st);
		launch(&f, &st, "--restore-claim=10000");
		lose(c);
		m = kvd_model_register(c, &shape);
		ASSERT_OK(m);
		ASSERT_OK(kvd_seq_claim(a, m));
		ASSERT_EQ(check_seq(a, 7), 0u);
		assert_digests_agree(a);
	}
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

/* A fork and its parent share blocks: both come back after a crash, still sharing (the
 * blocks counted once), and each keeps its bytes when the other goes. */
TEST(kept_forks_share_across_a_crash) {
	struct fixture f;
	struct store st;
	uint64_t blocks, shared, da, db;
	kvd_client *c;
	kvd_seq *a, *b;
	int m;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=10000");
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 1024, 300, 8);
	ASSERT_OK(kvd_seq_fork(a, &b));
	ASSERT_OK(kvd_seq_grow(b, 40));
	fill_seq_from(b, 9, 300);
	da = digest(a);
	db = digest(b);
	blocks = fixture_status(&f, "engine", "block_bytes");
	shared = fixture_status(&f, NULL, "shared_bytes");
	ASSERT_TRUE(shared > 0);

	crash(&f, &st);
	launch(&f, &st, "--restore-claim=10000");
	ASSERT_EQ(fixture_status(&f, "engine", "block_bytes"), blocks);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), shared);
	lose(c);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_claim(a, m));
	ASSERT_OK(kvd_seq_claim(b, m));
	ASSERT_EQ(digest(a), da);
	ASSERT_EQ(digest(b), db);
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_EQ(digest(b), db);
	ASSERT_EQ(fixture_status(&f, NULL, "shared_bytes"), 0u);
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

/* A damaged journal: an empty start, never a crash, and nothing of the old K/V shows. */
static void damaged(off_t offset) {
	struct fixture f;
	struct store st;
	kvd_client *c;
	kvd_seq *a, *s;
	uint8_t byte;
	int m, fd;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=10000");
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 512, 200, 9);
	crash(&f, &st);
	fd = store_find(&st, "kvd-journal");
	ASSERT_TRUE(fd >= 0);
	ASSERT_EQ(pread(fd, &byte, 1, offset), 1);
	byte ^= 0x5a;
	ASSERT_EQ(pwrite(fd, &byte, 1, offset), 1);

	launch(&f, &st, "--restore-claim=10000");
	ASSERT_TRUE(fixture_wait_log(&f, "discarding the KV kept across the restart", 1));
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	/* Not even the tenant: the journal failed before any slot was read. */
	ASSERT_EQ(fixture_status(&f, "engine", "sequences"), UINT64_MAX);
	lose(c);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_ERRNO(kvd_seq_claim(a, m), -ENOENT);
	ASSERT_ERRNO(kvd_seq_grow(a, 1), -ESTALE);
	ASSERT_OK(kvd_seq_release(a));
	/* The same chunks, scrubbed: a new sequence reads zeros, not the old pattern. */
	ASSERT_OK(kvd_seq_open(c, m, 512, &s));
	ASSERT_OK(kvd_seq_grow(s, 200));
	ASSERT_TRUE(check_seq(s, 9) > 0);
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

TEST(damaged_journal_header) {
	damaged(16); /* the chunk size */
}

TEST(damaged_journal_slot) {
	damaged(4096 + 10); /* the first slot's tenant name */
}

/* restore-claim=0: nothing goes to the store. */
TEST(keeping_off) {
	struct fixture f;
	struct store st;
	kvd_client *c;
	kvd_seq *a;
	int m;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=0");
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 512, 200, 4);
	store_settle(&st);
	ASSERT_EQ(store_count(&st), 0u);
	ASSERT_OK(kvd_seq_release(a));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

/*
 * On a GPU pool, kept KV needs the GPU kept alive while kvd restarts: a GPU not in
 * persistence mode (the fake NVML says so with KVD_FAKE_NVML_PERSISTENCE=0) is a standing
 * warning while keeping is on, and none while it is off; status says the mode either way.
 */
TEST(gpu_without_persistence_warns) {
	char text[4096];
	struct fixture f;
	struct store st;

	if (!fixture_backend_cuda())
		TEST_SKIP("needs the cuda backend");
	setenv("KVD_FAKE_NVML_PERSISTENCE", "0", 1);
	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=5000");
	ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "warnings", text, sizeof(text)),
	                   "GPU 0 is not in persistence mode: the KV kept across a restart is lost "
	                   "when no engine holds the GPU while kvd restarts"));
	ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "devices", text, sizeof(text)),
	                   " persistence=off"));
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=0");
	ASSERT_NULL(fixture_status_str(&f, NULL, "warnings", text, sizeof(text)));
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
	unsetenv("KVD_FAKE_NVML_PERSISTENCE");

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=5000");
	ASSERT_NULL(fixture_status_str(&f, NULL, "warnings", text, sizeof(text)));
	ASSERT_TRUE(strstr(fixture_status_str(&f, NULL, "devices", text, sizeof(text)),
	                   " persistence=on"));
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

/*
 * A process of the last life that keeps its fd and mapping of a kept chunk (a hostile
 * holder, fixture.h) and never claims: the chunk is freed at the restore-claim deadline,
 * and another tenant that then takes every chunk of the pool, that one included, writes
 * into new memory: the holder sees none of it and changes none of it.
 */
TEST(kept_chunk_never_reaches_another_tenant) {
	/* 4 chunks of 1 MiB: 2048 tokens of `shape` fill one. */
	const uint32_t pool_tokens = 4 * 2048;
	struct hostile_hold k;
	struct fixture f;
	struct store st;
	kvd_client *c, *t;
	kvd_seq *a, *x;
	int m;

	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch_pool(&f, &st, "--restore-claim=300", 4);
	c = fixture_connect(&f, "engine");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 1024, 100, 1);
	hostile_keep(&k, kvd_client_chunk_bytes(c));

	crash(&f, &st);
	launch_pool(&f, &st, "--restore-claim=300", 4);
	ASSERT_TRUE(fixture_wait_log(&f, "were not claimed within", 1));
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "used_bytes", 0));

	t = fixture_connect(&f, "thief");
	m = kvd_model_register(t, &shape);
	ASSERT_OK(m);
	x = open_filled(t, m, pool_tokens, pool_tokens, 5);
	/* Every chunk of its GPU's pool (of the first GPU's, with two). */
	ASSERT_EQ(fixture_status(&f, "thief", "used_bytes"), 4u << 20);
	/* None of the thief's bytes show in the engine's old chunk, which stays the engine's
	 * (scrubbed when the thief's grant took the chunk from it). */
	hostile_assert_reads(&k, 0);
	hostile_write(&k);
	ASSERT_EQ(check_seq(x, 5), 0u);
	assert_digests_agree(x);

	hostile_done(&k);
	ASSERT_OK(kvd_seq_release(x));
	/* Its connection went with the crash. */
	ASSERT_ERRNO(kvd_seq_release(a), -ECONNRESET);
	kvd_client_unref(t);
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
}

#ifdef KVD_HAVE_CUDA
/* Makes device's primary context current on this thread (the connection then takes its
 * chunks there: kvd_client_connect, kvd_client_reconnect). */
static void use_gpu(const struct cuda_dl *cu, int device) {
	CUcontext ctx;
	CUdevice dev;

	ASSERT_EQ(cu->cuDeviceGet(&dev, device), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
}
#endif

/*
 * With two GPUs pooled (the fake driver's two, tests/gpu/meson.build): a sequence comes
 * back on the GPU it was on; a connection to the other GPU cannot claim it (-EXDEV) and it
 * still waits; one to its own GPU can, after another crash, with the same K/V.
 */
TEST(kept_on_its_gpu) {
#ifdef KVD_HAVE_CUDA
	const struct cuda_dl *cu = NULL;
	struct fixture f;
	struct store st;
	kvd_client *c;
	int32_t ordinal = -1;
	uint64_t d;
	kvd_seq *a;
	int m;

	if (!fixture_backend_cuda() || cuda_dl_load(&cu, NULL) < 0 || cu->device_count < 2)
		TEST_SKIP("needs the cuda backend with two GPUs");
	fixture_setup(&f, NULL, true);
	store_start(&st, &f);
	launch(&f, &st, "--restore-claim=5000");
	use_gpu(cu, 1);
	c = fixture_connect(&f, "engine");
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 1);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	a = open_filled(c, m, 512, 100, 5);
	d = digest(a);

	crash(&f, &st);
	launch(&f, &st, "--restore-claim=5000");
	use_gpu(cu, 0);
	lose(c);
	ASSERT_EQ(kvd_client_memory(c, &ordinal), KVD_MEMORY_CUDA);
	ASSERT_EQ(ordinal, 0);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_ERRNO(kvd_seq_claim(a, m), -EXDEV);
	ASSERT_EQ(fixture_status(&f, "engine", "sequences"), 1u);

	crash(&f, &st);
	launch(&f, &st, "--restore-claim=5000");
	use_gpu(cu, 1);
	lose(c);
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_claim(a, m));
	ASSERT_EQ(check_seq(a, 5), 0u);
	ASSERT_EQ(digest(a), d);
	ASSERT_OK(kvd_seq_release(a));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_halt(&f), 0);
	store_stop(&st);
	fixture_cleanup(&f);
#else
	TEST_SKIP("built without the CUDA headers");
#endif
}
