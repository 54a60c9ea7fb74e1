/* SPDX-License-Identifier: MIT */
/*
 * The unmap deadline (kvd.8, --unmap-timeout): a chunk the daemon takes back is reused only
 * once every connection that mapped it says it unmapped it, since neither a memfd nor a
 * cuMem handle can be revoked. A connection that does not answer within unmap-timeout gets
 * no grants (-ETIMEDOUT, refused_unmap_timeout), and after unmap-grace it is disconnected;
 * the chunk then stays charged to its tenant until its process exits. One that answers in
 * time never notices.
 *
 * Every test builds the same situation: two connections of tenant "t", "late" and "peer",
 * each with a sequence whose blocks share the one chunk X; "late" releases its sequence,
 * then "peer" does, which empties X and asks "late" to unmap it with an event. Whether
 * "late" answers is up to the test: libkvd answers while the program calls it, so a
 * program that stops calling it stops answering.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "fixture.h"
#include "test.h"

static const kvd_model_spec shape = { "k", 2, 4, 2, 64, KVD_DTYPE_F16, 16, KVD_LAYOUT_PER_HEAD };

struct pair {
	kvd_client *late, *peer;
	kvd_seq *spare;               /* late's second sequence, opened before it went quiet */
	int peer_model;
};

static void pause_ms(long ms) {
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

/* Starts the daemon with a pool of one chunk, so that X is the chunk everyone gets, and
 * with extra (NULL-terminated) arguments; then builds the situation above. */
static void setup(struct fixture *f, const char *const *extra, struct pair *ret) {
	const char *args[16] = { "--pool-size", "1MiB", "--chunk-size", "1MiB", "--grant-wait", "0" };
	size_t n = 6;
	kvd_seq *a, *b;
	int ml;

	for (; *extra; extra++)
		args[n++] = *extra;
	args[n] = NULL;
	fixture_start(f, args);

	ret->late = fixture_connect(f, "t");
	ret->peer = fixture_connect(f, "t");
	ml = kvd_model_register(ret->late, &shape);
	ret->peer_model = kvd_model_register(ret->peer, &shape);
	ASSERT_OK(ml);
	ASSERT_OK(ret->peer_model);
	ASSERT_OK(kvd_seq_open(ret->late, ml, 1024, &a));
	ASSERT_OK(kvd_seq_grow(a, 16));
	fill_seq(a, 1);
	ASSERT_OK(kvd_seq_open(ret->late, ml, 1024, &ret->spare));
	ASSERT_OK(kvd_seq_open(ret->peer, ret->peer_model, 1024, &b));
	ASSERT_OK(kvd_seq_grow(b, 16));
	fill_seq(b, 2);
	/* X keeps b's blocks: late stays a holder without being asked anything. */
	ASSERT_OK(kvd_seq_release(a));
	ASSERT_EQ(fixture_status(f, NULL, "chunks_draining"), 0u);
	/* Empties X: peer unmaps it as part of the release, late is sent an event. */
	ASSERT_OK(kvd_seq_release(b));
	ASSERT_EQ(fixture_status(f, NULL, "chunks_draining"), 1u);
}

/* A late connection loses grants, and gets them back by answering: the failed grow itself
 * read the unmap request and answered it. */
TEST(late_connection_refused_until_it_answers) {
	static const char *const extra[] = { "--unmap-timeout", "50", "--unmap-grace", "60000", NULL };
	struct fixture f;
	struct pair p;
	kvd_seq *s;

	setup(&f, extra, &p);
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "unmap_timeouts", 1));
	ASSERT_EQ(fixture_status(&f, NULL, "refused_unmap_timeout"), 0u);

	ASSERT_ERRNO(kvd_seq_grow(p.spare, 16), -ETIMEDOUT);
	ASSERT_TRUE(strstr(kvd_client_last_error(p.late), "unmap-timeout") != NULL);
	ASSERT_EQ(fixture_status(&f, NULL, "refused_unmap_timeout"), 1u);
	/* Its answer went out before this grow, so the daemon has it when the grow comes. */
	ASSERT_OK(kvd_seq_grow(p.spare, 16));
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 0u);
	ASSERT_EQ(fixture_status(&f, "t", "connections"), 2u);
	ASSERT_EQ(fixture_status(&f, NULL, "unmap_timeouts"), 1u);
	ASSERT_EQ(fixture_status(&f, NULL, "unmap_disconnects"), 0u);

	/* The peer answered in time: never refused. */
	ASSERT_OK(kvd_seq_open(p.peer, p.peer_model, 1024, &s));
	ASSERT_OK(kvd_seq_grow(s, 16));
	ASSERT_EQ(fixture_status(&f, NULL, "refused_unmap_timeout"), 1u);
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_OK(kvd_seq_release(p.spare));
	kvd_client_unref(p.late);
	kvd_client_unref(p.peer);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/*
 * A connection that stays quiet is disconnected after the grace. Its process still lives
 * (this one) and may still map X: X stays charged to tenant t, draining, until the process
 * exits (departed.h; test-daemon-isolation has the exit), and nobody else gets it.
 */
TEST(quiet_connection_disconnected_and_charged_while_it_lives) {
	static const char *const extra[] = { "--unmap-timeout", "50", "--unmap-grace", "50", NULL };
	__attribute__((cleanup(kvd_client_unrefp))) kvd_client *other = NULL;
	struct fixture f;
	struct pair p;
	kvd_seq *s;
	kvd_event ev;
	int m;

	setup(&f, extra, &p);
	other = fixture_connect(&f, "other");
	m = kvd_model_register(other, &shape);
	ASSERT_OK(m);
	ASSERT_OK(kvd_seq_open(other, m, 1024, &s));
	/* The pool's only chunk is draining. */
	ASSERT_ERRNO(kvd_seq_grow(s, 16), -ENOSPC);

	ASSERT_TRUE(fixture_wait_status(&f, NULL, "unmap_disconnects", 1));
	ASSERT_EQ(fixture_status(&f, NULL, "unmap_timeouts"), 1u);
	ASSERT_EQ(fixture_status(&f, "t", "connections"), 1u);
	ASSERT_EQ(kvd_client_next_event(p.late, &ev), 1);
	ASSERT_EQ(ev.type, (uint32_t)KVD_EVENT_DISCONNECTED);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 1u);
	ASSERT_EQ(fixture_status(&f, "t", "used_bytes"), 1u << 20);
	ASSERT_ERRNO(kvd_seq_grow(s, 16), -ENOSPC);
	ASSERT_OK(kvd_seq_release(s));
	ASSERT_ERRNO(kvd_seq_release(p.spare), -ECONNRESET);
	kvd_client_unref(p.late);
	kvd_client_unref(p.peer);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* A program that handles its events (poll the event fd, kvd_client_next_event) is never
 * late, however short the deadline. */
TEST(complying_connection_unaffected) {
	static const char *const extra[] = { "--unmap-timeout", "50", "--unmap-grace", "50", NULL };
	struct fixture f;
	struct pair p;
	struct pollfd pfd;
	kvd_event ev;

	setup(&f, extra, &p);
	pfd = (struct pollfd){ .fd = kvd_client_get_event_fd(p.late), .events = POLLIN };
	ASSERT_EQ(poll(&pfd, 1, 5000), 1);
	while (kvd_client_next_event(p.late, &ev) > 0)
		;
	ASSERT_TRUE(fixture_wait_status(&f, NULL, "chunks_draining", 0));
	/* Well past both deadlines and several ticks. */
	pause_ms(300);
	ASSERT_EQ(fixture_status(&f, NULL, "unmap_timeouts"), 0u);
	ASSERT_EQ(fixture_status(&f, "t", "connections"), 2u);
	ASSERT_OK(kvd_seq_grow(p.spare, 16));
	ASSERT_EQ(fixture_status(&f, NULL, "refused_unmap_timeout"), 0u);
	ASSERT_OK(kvd_seq_release(p.spare));
	kvd_client_unref(p.late);
	kvd_client_unref(p.peer);
	ASSERT_EQ(fixture_stop(&f), 0);
}

/* --unmap-timeout 0: the chunk waits for the quiet connection as long as it takes. */
TEST(timeout_zero_waits_forever) {
	static const char *const extra[] = { "--unmap-timeout", "0", "--unmap-grace", "0",
		                             "--hello-timeout", "200", NULL };
	struct fixture f;
	struct pair p;

	setup(&f, extra, &p);
	/* Several ticks (a quarter of --hello-timeout, at least 50 ms). */
	pause_ms(300);
	ASSERT_EQ(fixture_status(&f, NULL, "chunks_draining"), 1u);
	ASSERT_EQ(fixture_status(&f, NULL, "unmap_timeouts"), 0u);
	ASSERT_EQ(fixture_status(&f, "t", "connections"), 2u);
	/* Not refused for being late: the pool's only chunk still drains. The call read the
	 * unmap request and answered it, which gives the chunk back. */
	ASSERT_ERRNO(kvd_seq_grow(p.spare, 16), -ENOSPC);
	ASSERT_OK(kvd_seq_grow(p.spare, 16));
	ASSERT_EQ(fixture_status(&f, NULL, "refused_unmap_timeout"), 0u);
	ASSERT_OK(kvd_seq_release(p.spare));
	kvd_client_unref(p.late);
	kvd_client_unref(p.peer);
	ASSERT_EQ(fixture_stop(&f), 0);
}
