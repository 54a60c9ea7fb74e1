/* SPDX-License-Identifier: MIT */
/* The daemon's log lines: journald priority prefixes, and repeats rate-limited per call site. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "test.h"

/* Runs fn with stderr going to a file and returns what it wrote (free it). */
static char *capture(void (*fn)(void)) {
	FILE *f = tmpfile();
	int saved = dup(2);
	char *out = calloc(1, 8192);
	size_t n;

	ASSERT_TRUE(f && out && saved >= 0);
	fflush(stderr);
	ASSERT_OK(dup2(fileno(f), 2));
	fn();
	fflush(stderr);
	ASSERT_OK(dup2(saved, 2));
	close(saved);
	rewind(f);
	n = fread(out, 1, 8191, f);
	out[n] = 0;
	fclose(f);
	return out;
}

static size_t count(const char *s, const char *needle) {
	size_t n = 0;

	for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

static void ten_repeats(void) {
	for (int i = 0; i < 10; i++)
		log_warning("client %d misbehaves", i);
}

static void one_more(void) {
	log_warning("client %d misbehaves", 99);
	log_error_errno(-ENOSPC, "other site");
}

TEST(repeats_are_rate_limited_per_call_site) {
	struct timespec pause = { .tv_nsec = 300 * 1000 * 1000 };
	char *out;

	log_setup();
	log_set_ratelimit(200, 3);
	out = capture(ten_repeats);
	ASSERT_EQ(count(out, "misbehaves"), 3u);
	ASSERT_TRUE(strstr(out, "kvd: client 0 misbehaves\n"));
	free(out);

	/* After a quiet spell the site speaks again and says what it dropped. */
	nanosleep(&pause, NULL);
	out = capture(one_more);
	ASSERT_TRUE(strstr(out, "kvd: client 99 misbehaves (7 similar messages suppressed)\n"));
	/* Another call site is counted on its own, and errors carry their text. */
	ASSERT_TRUE(strstr(out, "kvd: other site: No space left on device\n"));
	free(out);
}

static void one_info(void) {
	log_info("hello from pid %d", 42);
	log_debug("not shown at the default level");
}

TEST(journald_priority_prefix) {
	char *out;

	log_set_ratelimit(5000, 10);
	ASSERT_OK(setenv("JOURNAL_STREAM", "8:1234", 1));
	log_setup();
	out = capture(one_info);
	ASSERT_TRUE(strcmp(out, "<6>kvd: hello from pid 42\n") == 0);
	free(out);
	unsetenv("JOURNAL_STREAM");
	log_setup();
	out = capture(one_info);
	ASSERT_TRUE(strcmp(out, "kvd: hello from pid 42\n") == 0);
	free(out);
}
