/* SPDX-License-Identifier: MIT */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static int max_level = LOG_INFO;
static int prefix_priority;

void log_setup(void) {
	/* journald sets JOURNAL_STREAM for services whose stderr it reads. */
	prefix_priority = getenv("JOURNAL_STREAM") != NULL;
}

void log_set_max_level(int level) {
	max_level = level;
}

static void log_va(int level, int error, const char *fmt, va_list ap) {
	char line[1024];
	int n;

	if (level > max_level)
		return;
	n = vsnprintf(line, sizeof(line), fmt, ap);
	if (n < 0)
		return;
	if (prefix_priority)
		fprintf(stderr, "<%d>", level);
	if (error)
		fprintf(stderr, "kvd: %s: %s\n", line, strerror(abs(error)));
	else
		fprintf(stderr, "kvd: %s\n", line);
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
