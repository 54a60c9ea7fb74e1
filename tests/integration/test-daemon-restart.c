/* SPDX-License-Identifier: MIT */
/*
 * A daemon that dies or restarts does not take its engines down: libkvd reports the loss
 * as KVD_EVENT_DISCONNECTED, kvd_client_reconnect() waits (bounded) for the daemon to be
 * back, and the engine goes on with new sequences; the old handles say -ESTALE.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fixture.h"
#include "test.h"

static const kvd_model_spec shape = { "r", 2, 4, 2, 32, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_LAYER };
static const char *const args[] = { "--pool-size=64MiB", "--chunk-size=1MiB", NULL };

/* Waits for the event fd and returns the next event's type (0: none came). */
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

/* The engine's side, from open to check: a model, a sequence, K/V, verified. */
static kvd_seq *engine_work(kvd_client *c, uint32_t tag) {
	kvd_seq *s;
	int m = kvd_model_register(c, &shape);

	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(c, m, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 100));
	fill_seq(s, tag);
	ASSERT_EQ(check_seq(s, tag), 0u);
	assert_digests_agree(s);
	return s;
}

static void survive(bool crash) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *old, *s;
	uint32_t type;
	int status;

	fixture_setup(&f, NULL, false);
	fixture_launch(&f, args);
	c = fixture_connect(&f, "engine");
	old = engine_work(c, 1);

	if (crash) {
		ASSERT_OK(kill(f.pid, SIGKILL));
		ASSERT_EQ(waitpid(f.pid, &status, 0), f.pid);
	} else
		ASSERT_EQ(fixture_halt(&f), 0);
	/* A clean stop says so first; both end in DISCONNECTED. */
	type = next_event(c);
	if (!crash && type == KVD_EVENT_STOPPING)
		type = next_event(c);
	ASSERT_EQ(type, (uint32_t)KVD_EVENT_DISCONNECTED);
	ASSERT_ERRNO(kvd_seq_grow(old, 1), -ECONNRESET);

	/* Nobody there yet: a bounded wait, then a clear error. */
	ASSERT_ERRNO(kvd_client_reconnect(c, 200), -ETIMEDOUT);

	fixture_launch(&f, args);
	ASSERT_OK(kvd_client_reconnect(c, 5000));
	ASSERT_ERRNO(kvd_client_reconnect(c, 0), -EISCONN);
	ASSERT_ERRNO(kvd_seq_grow(old, 1), -ESTALE);
	ASSERT_ERRNO(kvd_seq_tokens(old, 0, 0), -ESTALE);
	ASSERT_ERRNO(kvd_seq_pin(old), -ESTALE);
	ASSERT_OK(kvd_seq_release(old));

	s = engine_work(c, 2);
	ASSERT_EQ(fixture_status(&f, "engine", "sequences"), 1u);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_status(&f, NULL, "used_bytes"), 0u);
	ASSERT_EQ(fixture_stop(&f), 0);
}

TEST(daemon_crash) {
	survive(true);
}

TEST(daemon_restart) {
	survive(false);
}

static void *reconnect_thread(void *userdata) {
	return (void *)(intptr_t)kvd_client_reconnect(userdata, 10000);
}

/* A daemon that comes back while the engine is already waiting for it. */
TEST(reconnect_waits_for_the_daemon) {
	struct fixture f;
	kvd_client *c;
	kvd_seq *s;
	pthread_t t;
	void *r;

	fixture_setup(&f, NULL, false);
	fixture_launch(&f, args);
	c = fixture_connect(&f, "engine");
	ASSERT_EQ(fixture_halt(&f), 0);
	ASSERT_EQ(next_event(c), (uint32_t)KVD_EVENT_STOPPING);
	ASSERT_EQ(pthread_create(&t, NULL, reconnect_thread, c), 0);
	usleep(300 * 1000);
	fixture_launch(&f, args);
	ASSERT_EQ(pthread_join(t, &r), 0);
	ASSERT_EQ((intptr_t)r, 0);
	s = engine_work(c, 3);
	ASSERT_OK(kvd_seq_release(s));
	kvd_client_unref(c);
	ASSERT_EQ(fixture_stop(&f), 0);
}
