/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What the fuzz targets share. Each fuzz-<target>.c defines LLVMFuzzerTestOneInput(), which
 * libFuzzer calls (clang builds with -Dfuzz) and replay.c's main() calls for every file of a
 * corpus (every build). A target checks its invariants with FUZZ_CHECK(), which aborts, so
 * that libFuzzer keeps the input and the replay test fails.
 */

#include <dirent.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Messages are optional: the format gets a leading space, so that it is never empty. */
#define FUZZ_CHECK(cond, ...)                                                                 \
	do {                                                                                  \
		if (!(cond))                                                                  \
			fuzz_check_failed(__FILE__, __LINE__, #cond, " " __VA_ARGS__);        \
	} while (0)

__attribute__((noreturn, format(printf, 4, 5))) static inline void
fuzz_check_failed(const char *file, int line, const char *cond, const char *fmt, ...) {
	va_list ap;

	fprintf(stderr, "%s:%d: check failed: %s;", file, line, cond);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	abort();
}

/* Open fds of this process, to tell that an input left none behind. */
static inline unsigned fuzz_fd_count(void) {
	DIR *d = opendir("/proc/self/fd");
	unsigned n = 0;

	FUZZ_CHECK(d, "cannot list /proc/self/fd");
	while (readdir(d))
		n++;
	closedir(d);
	/* ".", ".." and the listing's own fd. */
	return n - 3;
}
