/* SPDX-License-Identifier: MIT */
/*
 * examples/engine.c against a real daemon whose budget holds well under the sequence it
 * grows: every step's grow waits for rounds that evict from it, and every resident token
 * must still be the one written at its position.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

TEST(engine_survives_evictions) {
	static const char *const args[] = { "--pool-size", "4MiB", "--chunk-size", "256KiB",
		                            "--budget", "1MiB", NULL };
	const char *engine = getenv("KVD_EXAMPLE_ENGINE");
	struct fixture f;
	char out[4096];
	int fd[2], status;
	ssize_t n, k = 0;
	pid_t pid;

	ASSERT_NOT_NULL(engine);
	fixture_start(&f, args);
	ASSERT_OK(pipe(fd));
	pid = fixture_fork();
	if (pid == 0) {
		dup2(fd[1], STDOUT_FILENO);
		execl(engine, engine, f.socket, "example", TEST_SIZE("512", "384"), (char *)NULL);
		_exit(127);
	}
	close(fd[1]);
	while ((n = read(fd[0], out + k, sizeof(out) - 1 - (size_t)k)) > 0)
		k += n;
	out[k] = 0;
	close(fd[0]);
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status));
	ASSERT_EQ(WEXITSTATUS(status), 0);
	fputs(out, stdout);
	ASSERT_TRUE(strstr(out, "tokens generated") != NULL);
	/* The budget held: rounds evicted from the sequence while it grew. */
	ASSERT_GT(fixture_status(&f, "example", "evicted_tokens"), 0u);
	ASSERT_LE(fixture_status(&f, NULL, "used_bytes"), 1u << 20);
	ASSERT_EQ(fixture_stop(&f), 0);
}
