/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

/* Call sites whose repeats are rate-limited; sites past this many are not limited. */
#define LOG_SITES 128

static int max_level = LOG_INFO;
static int prefix_priority;

/*
 * A client that misbehaves in a loop must not flood the journal: each call site (keyed by
 * its format string) may log `burst` lines per `interval`; the first line after that says
 * how many were dropped. Single-threaded, like the rest of the daemon's event handling.
 */
static struct log_site {
	const char *fmt;
	uint64_t window_start_ms;
	unsigned count, suppressed;
} sites[LOG_SITES];
static uint64_t ratelimit_interval_ms = 5000;
static unsigned ratelimit_burst = 10;

void log_set_ratelimit(uint64_t interval_ms, unsigned burst) {
	ratelimit_interval_ms = interval_ms;
	ratelimit_burst = burst;
	memset(sites, 0, sizeof(sites));
}

static uint64_t monotonic_ms(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Whether a line from this call site may go out; *ret_suppressed is how many lines of it
 * were dropped since it last did. */
static bool ratelimit(const char *fmt, unsigned *ret_suppressed) {
	size_t h = ((uintptr_t)fmt >> 3) % LOG_SITES;
	uint64_t now = monotonic_ms();
	struct log_site *site = NULL;

	*ret_suppressed = 0;
	for (size_t i = 0; i < 8 && !site; i++) {
		struct log_site *x = &sites[(h + i) % LOG_SITES];

		if (!x->fmt) {
			x->fmt = fmt;
			x->window_start_ms = now;
		}
		if (x->fmt == fmt)
			site = x;
	}
	if (!site)
		return true;
	if (now - site->window_start_ms >= ratelimit_interval_ms) {
		*ret_suppressed = site->suppressed;
		site->window_start_ms = now;
		site->count = site->suppressed = 0;
	}
	if (site->count < ratelimit_burst) {
		site->count++;
		return true;
	}
	site->suppressed++;
	return false;
}

void log_setup(void) {
	/* journald sets JOURNAL_STREAM for services whose stderr it reads. */
	prefix_priority = getenv("JOURNAL_STREAM") != NULL;
}

void log_set_max_level(int level) {
	max_level = level;
}

static void log_va(int level, int error, const char *fmt, va_list ap) {
	char line[1024], prefix[8] = "", errtext[160] = "", dropped[64] = "";
	unsigned suppressed;

	if (level > max_level || !ratelimit(fmt, &suppressed))
		return;
	if (vsnprintf(line, sizeof(line), fmt, ap) < 0)
		return;
	if (prefix_priority)
		snprintf(prefix, sizeof(prefix), "<%d>", level);
	if (error)
		snprintf(errtext, sizeof(errtext), ": %s", strerror(abs(error)));
	if (suppressed)
		snprintf(dropped, sizeof(dropped), " (%u similar messages suppressed)", suppressed);
	/* One write per line, so that lines never interleave. */
	fprintf(stderr, "%skvd: %s%s%s\n", prefix, line, errtext, dropped);
}

void log_full(int level, const char *fmt, ...) {
	va_list ap;

	va_start(ap, fmt);
	log_va(level, 0, fmt, ap);
	va_end(ap);
}

int log_full_errno(int level, int error, const char *fmt, ...) {
	va_list ap;

	va_start(ap, fmt);
	log_va(level, error, fmt, ap);
	va_end(ap);
	return error < 0 ? error : -error;
}
