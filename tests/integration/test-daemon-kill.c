/* SPDX-License-Identifier: MIT */
/*
 * Clients killed with SIGKILL at named points (libkvd stops itself there when
 * KVD_TEST_STOP_AT names the point, so no timing is involved), while pinned, or while an
 * eviction round that ranked their tokens waits at the round gate: their chunks come back
 * and the other tenants go on as if nothing happened.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

static const char *const daemon_args[] = { "--pool-size", "64MiB", "--chunk-size", "1MiB", NULL };
static const kvd_model_spec shape = { "k", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };

/* The victim: connects as "victim" with the stop point set, and goes as far as it gets. */
static void victim_main(struct fixture *f, const char *point) {
	kvd_client *c;
	kvd_seq *s;
	int m;

	setenv("KVD_TEST_STOP_AT", point, 1);
	c = fixture_connect(f, "victim");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, 300));
	fill_seq(s, 7);
	ASSERT_OK(kvd_seq_release(s));
	_exit(0);
}

/* Stops the victim at point, checks what it holds there, kills it, and checks that the
 * daemon took everything back while the bystander keeps working. */
static void kill_at(const char *point, bool holds_chunks, bool draining) {
	struct fixture f;
	kvd_client *other;
	kvd_seq *s;
	pid_t pid;
	int status, m;

	fixture_start(&f, daemon_args);
	other = fixture_connect(&f, "bystander");
	m = kvd_model_register(other, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(other, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, 500));
	fill_seq(s, 1);

	pid = fixture_fork();
	if (pid == 0)
		victim_main(&f, point);
	ASSERT_EQ(waitpid(pid, &status, WUNTRACED), pid);
	ASSERT_TRUE(WIFSTOPPED(status));

	ASSERT_EQ(fixture_status(&f, "victim", "connections"), 1u);
	if (holds_chunks)
		ASSERT_GT(fixture_status(&f, "victim", "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), draining ? 1u : 0u);

	ASSERT_OK(kill(pid, SIGKILL));
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

	ASSERT_TRUE(fixture_wait_status(&f, "victim", "connections", 0));
	ASSERT_EQ(fixture_status(&f, "victim", "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, "victim", "block_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, "victim", "sequences"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), fixture_status(&f, "bystander", "used_bytes"));

	/* The bystander's data is intact and it can go on growing. */
	ASSERT_EQ(check_seq(s, 1), 0u);
	ASSERT_OK(kvd_seq_grow(s, 500));
	fill_seq(s, 2);
	ASSERT_EQ(check_seq(s, 2), 0u);
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(other);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(kill_after_grow_sent) {
	TEST_NEEDS_HOOKS();
	/* The grow is on its way, and its reply (with chunk fds) goes to a dead process. */
	kill_at("grow-sent", false, false);
}

TEST(kill_after_grow_mapped) {
	TEST_NEEDS_HOOKS();
	kill_at("grow-mapped", true, false);
}

TEST(kill_after_release_replied) {
	TEST_NEEDS_HOOKS();
	/* The daemon asked the victim to unmap its chunks and waits for the answer. */
	kill_at("release-replied", true, true);
}

/*
 * Two processes of one tenant share a chunk. When the last block in it goes, the one that
 * did not release is asked to unmap it through an event; the chunk drains, and comes back
 * when that process answers, or when it dies without answering.
 */
static void shared_chunk(bool kill_holder) {
	static const kvd_model_spec small = { "s", 1, 2, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
	struct fixture f;
	kvd_client *a, *b;
	kvd_seq *sa, *sb;
	int ma, mb, sync[2], done[2];
	pid_t pid = 0;
	char x;

	fixture_start(&f, daemon_args);
	ASSERT_OK(pipe(sync));
	ASSERT_OK(pipe(done));
	b = fixture_connect(&f, "shared");
	mb = kvd_model_register(b, &small);
	ASSERT_OK(mb);
	ASSERT_OK(kvd_seq_open(b, mb, 64, &sb));

	if (kill_holder) {
		pid = fixture_fork();
		if (pid == 0) {
			/* The holder: maps the chunk, says so, then never reads its events. */
			a = fixture_connect(&f, "shared");
			ma = kvd_model_register(a, &small);
			ASSERT_OK(kvd_seq_open(a, ma, 64, &sa));
			ASSERT_OK(kvd_seq_grow(sa, 16));
			ASSERT_EQ(write(sync[1], "x", 1), 1);
			ASSERT_EQ(read(done[0], &x, 1), 1);
			ASSERT_OK(kvd_seq_release(sa));
			_exit(0);
		}
		ASSERT_EQ(read(sync[0], &x, 1), 1);
		a = NULL;
		sa = NULL;
	} else {
		a = fixture_connect(&f, "shared");
		ma = kvd_model_register(a, &small);
		ASSERT_OK(ma);
		ASSERT_OK(kvd_seq_open(a, ma, 64, &sa));
		ASSERT_OK(kvd_seq_grow(sa, 16));
	}
	/* b's block lands in the same, partly used chunk. */
	ASSERT_OK(kvd_seq_grow(sb, 16));
	ASSERT_EQ(fixture_status(&f, "shared", "chunks"), 1u);

	if (kill_holder) {
		ASSERT_OK(kill(pid, SIGKILL));
		ASSERT_OK(waitpid(pid, NULL, 0));
		/* The holder's sequence went with it; b's block keeps the chunk. */
		ASSERT_TRUE(fixture_wait_status(&f, "shared", "connections", 1));
		ASSERT_EQ(fixture_status(&f, "shared", "chunks"), 1u);
		ASSERT_OK(kvd_seq_release(sb));
		ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	} else {
		struct pollfd p = { .events = POLLIN };
		kvd_event ev;
		uint32_t n;

		ASSERT_OK(kvd_seq_release(sa));
		ASSERT_OK(kvd_seq_release(sb));
		/* b unmapped as part of its release; a still maps the chunk. */
		ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 1u);
		ASSERT_EQ(fixture_status(&f, "shared", "used_bytes"), 1u << 20);
		ASSERT_OK(kvd_client_mapped_chunks(a, NULL, 0, &n));
		ASSERT_EQ(n, 1u);

		p.fd = kvd_client_get_event_fd(a);
		ASSERT_OK(p.fd);
		ASSERT_EQ(poll(&p, 1, 5000), 1);
		/* The unmap request is handled inside the library: no event for the engine. */
		ASSERT_EQ(kvd_client_next_event(a, &ev), 0);
		ASSERT_OK(kvd_client_mapped_chunks(a, NULL, 0, &n));
		ASSERT_EQ(n, 0u);
		ASSERT_TRUE(fixture_wait_status(&f, NULL, "chunks_draining", 0));
		ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
		kvd_client_unref(a);
	}
	kvd_client_unref(b);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(shared_chunk_drains_when_holder_answers) {
	shared_chunk(false);
}

TEST(shared_chunk_freed_when_holder_dies) {
	shared_chunk(true);
}

/* An eviction-enabled victim that grows, pins its sequence (a forward step in flight)
 * and stops there. */
static void pinned_victim_main(struct fixture *f) {
	kvd_eviction_spec ev = { .unit = KVD_UNIT_HEAD_TOKEN, .window = 8 };
	kvd_client *c;
	kvd_seq *s;
	int m;

	c = fixture_connect(f, "victim");
	m = kvd_model_register_evictable(c, &shape, &ev);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, 1000));
	fill_seq(s, 7);
	ASSERT_OK(kvd_seq_pin(s));
	raise(SIGSTOP);
	_exit(0);
}

/*
 * The victim dies while pinned; with mid_round, also while an eviction round that ranked
 * its tokens waits at the round gate (KVD_TEST_ROUND_GATE), so the round lands after the
 * death. Either way its chunks come back and the bystander is untouched.
 */
static void kill_pinned(bool mid_round) {
	char gate[64], dir[] = "/tmp/kvd-kill-XXXXXX";
	struct fixture f;
	kvd_client *other;
	kvd_seq *s;
	pid_t pid, evictor = -1;
	int status, m, g = -EBADF;

	ASSERT_TRUE(mkdtemp(dir));
	snprintf(gate, sizeof(gate), "%s/gate", dir);
	ASSERT_OK(mkfifo(gate, 0600));
	if (mid_round)
		setenv("KVD_TEST_ROUND_GATE", gate, 1);
	fixture_start(&f, daemon_args);
	unsetenv("KVD_TEST_ROUND_GATE");
	other = fixture_connect(&f, "bystander");
	m = kvd_model_register(other, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(other, m, 4096, &s));
	ASSERT_OK(kvd_seq_grow(s, 500));
	fill_seq(s, 1);

	pid = fixture_fork();
	if (pid == 0)
		pinned_victim_main(&f);
	ASSERT_EQ(waitpid(pid, &status, WUNTRACED), pid);
	ASSERT_TRUE(WIFSTOPPED(status));
	ASSERT_GT(fixture_status(&f, "victim", "used_bytes"), 0u);
	if (mid_round) {
		evictor = fixture_fork();
		if (evictor == 0) {
			kvd_client *c;

			if (kvd_client_connect(f.socket, NULL, &c) < 0)
				_exit(3);
			_exit(kvd_evict(c, "victim", 1 << 20, NULL) < 0 ? 1 : 0);
		}
		/* Opening the FIFO returns once the round waits at the gate. */
		g = open(gate, O_WRONLY | O_CLOEXEC);
		ASSERT_OK(g);
	}
	ASSERT_OK(kill(pid, SIGKILL));
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(fixture_wait_status(&f, "victim", "connections", 0));
	if (mid_round) {
		ASSERT_EQ(write(g, "x", 1), 1);
		close(g);
		ASSERT_EQ(waitpid(evictor, &status, 0), evictor);
		ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
		ASSERT_EQ(fixture_status(&f, "victim", "evicted_tokens"), 0u);
	}
	ASSERT_EQ(fixture_status(&f, "victim", "used_bytes"), 0u);
	ASSERT_EQ(fixture_status(&f, "victim", "sequences"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), fixture_status(&f, "bystander", "used_bytes"));
	ASSERT_EQ(check_seq(s, 1), 0u);
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(other);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_free"), fixture_status(&f, NULL, "chunks_total"));
	unlink(gate);
	rmdir(dir);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(kill_while_pinned) {
	kill_pinned(false);
}

TEST(kill_mid_round) {
	TEST_NEEDS_HOOKS();
	kill_pinned(true);
}
