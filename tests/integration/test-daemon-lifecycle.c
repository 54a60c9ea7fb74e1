/* SPDX-License-Identifier: MIT */
/*
 * The daemon's life and the library's process rules: a stop tells clients, kvd starts where
 * io_uring is refused, handles do not survive fork(), and the command line says what it
 * accepts.
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

static const char *const small_pool[] = { "--pool-size", "8MiB", "--chunk-size", "1MiB", NULL };
static const kvd_model_spec shape = { "l", 2, 2, 2, 32, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };

TEST(sigterm_tells_clients) {
	struct pollfd p = { .events = POLLIN };
	struct fixture f;
	kvd_client *c;
	kvd_event ev;
	kvd_seq *s;
	int m, status;

	fixture_start(&f, small_pool);
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 64, &s));
	ASSERT_OK(kvd_seq_grow(s, 32));

	ASSERT_OK(kill(f.pid, SIGTERM));
	p.fd = kvd_client_get_event_fd(c);
	ASSERT_EQ(poll(&p, 1, 5000), 1);
	ASSERT_EQ(kvd_client_next_event(c, &ev), 1);
	ASSERT_EQ(ev.type, (uint32_t)KVD_EVENT_STOPPING);
	ASSERT_EQ(waitpid(f.pid, &status, 0), f.pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	/* The socket file went with the daemon. */
	ASSERT_EQ(access(f.socket, F_OK), -1);
	ASSERT_EQ(kvd_seq_grow(s, 1), -ECONNRESET);
	ASSERT_OK(kvd_seq_release(s) == -ECONNRESET ? 0 : -1);
	kvd_client_unref(c);
	rmdir(f.dir);
}

/*
 * Where io_uring is not allowed (here a seccomp filter refusing io_uring_setup with EPERM,
 * as the default profiles of Docker and containerd do), kvd starts on its epoll loop,
 * says why in one line, and serves: a tenant's steps over the rings and the socket.
 */
TEST(starts_where_io_uring_is_refused) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	int m;

	fixture_setup(&f, NULL, true);
	f.deny_io_uring = true;
	fixture_launch(&f, small_pool);
	ASSERT_TRUE(fixture_wait_log(&f, "event loop: epoll: io_uring is not allowed here "
	                                 "(Operation not permitted: a seccomp profile", 1));
	ASSERT_TRUE(fixture_wait_log(&f, "eventfd doorbell", 1));
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 64, &s));
	for (int ring = 1; ring >= 0; ring--) {
		ASSERT_OK(kvd_client_set_ring(c, ring));
		ASSERT_OK(kvd_seq_grow(s, 16));
		ASSERT_OK(kvd_seq_pin(s));
		ASSERT_OK(kvd_seq_unpin(s));
	}
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(handles_do_not_survive_fork) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	pid_t pid;
	int m, status;

	fixture_start(&f, small_pool);
	c = fixture_connect(&f, "t");
	m = kvd_model_register(c, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 64, &s));
	ASSERT_OK(kvd_seq_grow(s, 32));
	fill_seq(s, 3);

	pid = fixture_fork();
	if (pid == 0) {
		uint64_t ino[4];

		ASSERT_EQ(kvd_seq_grow(s, 1), -ECHILD);
		ASSERT_EQ(kvd_client_protocol_version(c), -ECHILD);
		ASSERT_EQ(kvd_model_register(c, &shape), -ECHILD);
		/* The KV memory is not even mapped in the child. */
		ASSERT_EQ(mapped_chunk_inodes(getpid(), ino, 4), 0u);
		/* Letting go of inherited handles is allowed and touches nothing shared. */
		kvd_seq_release(s);
		kvd_client_unref(c);
		_exit(0);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	/* The parent's handles and data are untouched. */
	ASSERT_EQ(check_seq(s, 3), 0u);
	ASSERT_OK(kvd_seq_grow(s, 32));
	assert_digests_agree(s);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(command_line) {
	static const char *const flags[] = {
		"--backend", "--socket", "--pool-size", "--chunk-size", "--budget",
		"--max-connections", "--max-tenants", "--max-models", "--max-seqs",
		"--max-seq-tokens", "--hello-timeout", "--log-level", "--help", "--version",
	};
	char out[16384];

	ASSERT_EQ(fixture_run_daemon("--help", out, sizeof(out)), 0);
	for (size_t i = 0; i < sizeof(flags) / sizeof(flags[0]); i++)
		if (!strstr(out, flags[i]))
			test_fail(__FILE__, __LINE__, "--help does not mention %s", flags[i]);
	ASSERT_EQ(fixture_run_daemon("--version", out, sizeof(out)), 0);
	ASSERT_TRUE(strncmp(out, "kvd ", 4) == 0);

	/* Usage errors exit 2 and say what is wrong. */
	ASSERT_EQ(fixture_run_daemon("--pool-size 12XB", out, sizeof(out)), 2);
	ASSERT_TRUE(strstr(out, "--pool-size"));
	ASSERT_EQ(fixture_run_daemon("--backend tpu", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--chunk-size 1000", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--pool-size 1MiB --chunk-size 4MiB", out, sizeof(out)), 2);
	/* On host (a cuda pool is pool-size on each GPU, known at start only). */
	ASSERT_EQ(fixture_run_daemon("--backend host --pool-size 8MiB --budget 9MiB", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--max-seqs 0", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("--no-such-flag", out, sizeof(out)), 2);
	ASSERT_EQ(fixture_run_daemon("stray", out, sizeof(out)), 2);
	/* A socket that cannot be set up is a runtime failure, with a one-line reason. */
	ASSERT_EQ(fixture_run_daemon("--socket /nonexistent/dir/kvd.sock --pool-size 8MiB", out, sizeof(out)), 1);
	ASSERT_TRUE(strstr(out, "/nonexistent/dir/kvd.sock"));
}

TEST(second_daemon_refuses_live_socket) {
	struct fixture f;
	char args[256], out[4096];

	fixture_start(&f, small_pool);
	snprintf(args, sizeof(args), "--socket %s --pool-size 8MiB", f.socket);
	ASSERT_EQ(fixture_run_daemon(args, out, sizeof(out)), 1);
	ASSERT_TRUE(strstr(out, "in use"));
	/* The first one is unharmed. */
	ASSERT_EQ(fixture_status(&f, NULL, "pool_bytes"), 8u << 20);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* Receives one sd_notify datagram within 5 s into buf; returns its length. */
static ssize_t notify_recv(int fd, char *buf, size_t n) {
	struct pollfd p = { .fd = fd, .events = POLLIN };
	ssize_t k;

	/* What kvd puts in or takes out of the fd store (kvd.8, KEEPING KV ACROSS A RESTART)
	 * is not looked at here; recv() without room for the fds closes them. */
	do {
		ASSERT_EQ(poll(&p, 1, 5000), 1);
		k = recv(fd, buf, n - 1, 0);
		ASSERT_GT(k, 0);
		buf[k] = 0;
	} while (strncmp(buf, "FDSTORE", 7) == 0);
	return k;
}

TEST(notifies_systemd) {
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct fixture f;
	char buf[512];
	int fd, status;

	/* Play the service manager: a datagram socket named by NOTIFY_SOCKET. */
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ASSERT_OK(fd);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "/tmp/kvd-notify-%d", (int)getpid());
	unlink(sa.sun_path);
	ASSERT_OK(bind(fd, (struct sockaddr *)&sa, sizeof(sa)));
	ASSERT_OK(setenv("NOTIFY_SOCKET", sa.sun_path, 1));
	fixture_start(&f, small_pool);
	unsetenv("NOTIFY_SOCKET");

	notify_recv(fd, buf, sizeof(buf));
	ASSERT_TRUE(strstr(buf, "READY=1"));
	ASSERT_TRUE(strstr(buf, "STATUS="));
	ASSERT_OK(kill(f.pid, SIGTERM));
	notify_recv(fd, buf, sizeof(buf));
	ASSERT_TRUE(strstr(buf, "STOPPING=1"));
	ASSERT_EQ(waitpid(f.pid, &status, 0), f.pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	close(fd);
	unlink(sa.sun_path);
	rmdir(f.dir);
}
