/* SPDX-License-Identifier: MIT */
/*
 * The runner behind test.h: the registry filled by TEST() constructors, the failure
 * reports of the ASSERT_* macros, and main(). Output is one line per test, so that meson's
 * log shows what ran even when a later test fails.
 */

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "test.h"

static test_entry *tests_head, **tests_tail = &tests_head;
static const char *current_test;
static int current_skipped;
static char skip_reason[256];

void test_register(test_entry *t) {
	/* Appending keeps definition order: constructors of one file run in that order. */
	t->next = NULL;
	*tests_tail = t;
	tests_tail = &t->next;
}

void test_mark_skip(const char *fmt, ...) {
	va_list ap;

	current_skipped = 1;
	va_start(ap, fmt);
	vsnprintf(skip_reason, sizeof(skip_reason), fmt, ap);
	va_end(ap);
}

/* Weak, so that a test program may define its own. */
__attribute__((weak)) int test_setup(void) {
	return 0;
}

static void fail_begin(const char *file, int line) {
	fflush(stdout);
	fprintf(stderr, "%s:%d: %s: assertion failed: ", file, line, current_test ? current_test : "?");
}

static _Noreturn void fail_end(void) {
	fprintf(stderr, "\n");
	printf("%s: FAIL\n", current_test ? current_test : "?");
	fflush(stdout);
	exit(EXIT_FAILURE);
}

void test_fail(const char *file, int line, const char *fmt, ...) {
	va_list ap;

	fail_begin(file, line);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fail_end();
}

int test_cmp(int s1, uintmax_t v1, int s2, uintmax_t v2) {
	int neg1 = s1 && (intmax_t)v1 < 0, neg2 = s2 && (intmax_t)v2 < 0;

	/* A negative value is below every value of an unsigned type. */
	if (neg1 != neg2)
		return neg1 ? -1 : 1;
	if (neg1)
		return (intmax_t)v1 < (intmax_t)v2 ? -1 : (intmax_t)v1 > (intmax_t)v2;
	return v1 < v2 ? -1 : v1 > v2;
}

static void print_value(int s, uintmax_t v) {
	if (s)
		fprintf(stderr, "%" PRIdMAX, (intmax_t)v);
	else if (v > 0xffff)
		fprintf(stderr, "%" PRIuMAX " (0x%" PRIxMAX ")", v, v);
	else
		fprintf(stderr, "%" PRIuMAX, v);
}

void test_fail_cmp(const char *file, int line, const char *op, const char *e1, const char *e2,
		   int s1, uintmax_t v1, int s2, uintmax_t v2) {
	fail_begin(file, line);
	fprintf(stderr, "expected \"%s %s %s\", but ", e1, op, e2);
	print_value(s1, v1);
	fprintf(stderr, " vs ");
	print_value(s2, v2);
	fail_end();
}

static void print_errno(intmax_t v) {
	if (v < 0 && v > -4096) {
		const char *name = strerrorname_np((int)-v);

		fprintf(stderr, "%" PRIdMAX " (-%s: %s)", v, name ? name : "?", strerror((int)-v));
	} else
		fprintf(stderr, "%" PRIdMAX, v);
}

void test_fail_errno(const char *file, int line, const char *expr, intmax_t got, intmax_t want) {
	fail_begin(file, line);
	if (want == 0)
		fprintf(stderr, "expected \"%s\" to succeed, but got ", expr);
	else {
		fprintf(stderr, "expected \"%s\" to fail with ", expr);
		print_errno(want);
		fprintf(stderr, ", but got ");
	}
	print_errno(got);
	fail_end();
}

/* --shard=K/N: only the tests whose index in the program, modulo N, is K - 1. */
static unsigned shard_k, shard_n;

static int shard_parse(const char *arg) {
	char end;

	if (sscanf(arg, "--shard=%u/%u%c", &shard_k, &shard_n, &end) != 2 || shard_n == 0 ||
	    shard_k == 0 || shard_k > shard_n) {
		fprintf(stderr, "bad %s: expected --shard=K/N, 1 <= K <= N\n", arg);
		return -EINVAL;
	}
	return 0;
}

static int selected(const char *name, unsigned index, int argc, char **argv) {
	const char *filter = getenv("TESTFUNCS");
	int any = 0;

	if (shard_n > 0 && index % shard_n != shard_k - 1)
		return 0;

	if (filter && *filter) {
		size_t n = strlen(name);

		any = 1;
		for (const char *p = filter; *p;) {
			size_t len = strcspn(p, ",");

			if (len == n && strncmp(p, name, n) == 0)
				return 1;
			p += len;
			p += *p == ',';
		}
	}
	for (int i = 1; i < argc; i++) {
		if (strncmp(argv[i], "--shard=", 8) == 0)
			continue;
		any = 1;
		if (strcmp(argv[i], name) == 0)
			return 1;
	}
	return !any;
}

static double elapsed_ms(const struct timespec *a) {
	struct timespec b;

	clock_gettime(CLOCK_MONOTONIC, &b);
	return (double)(b.tv_sec - a->tv_sec) * 1e3 + (double)(b.tv_nsec - a->tv_nsec) / 1e6;
}

int main(int argc, char **argv) {
	unsigned ran = 0, passed = 0, skipped = 0, index = 0;
	int r;

	/* Unbuffered relative to stderr would interleave badly; line buffering keeps one
	 * line per test in order when both go to the same log. */
	setvbuf(stdout, NULL, _IOLBF, 0);

	for (int i = 1; i < argc; i++)
		if (strncmp(argv[i], "--shard=", 8) == 0 && shard_parse(argv[i]) < 0)
			return EXIT_FAILURE;
	for (test_entry *t = tests_head; t; t = t->next)
		ran += selected(t->name, index++, argc, argv);
	if (ran == 0) {
		printf("no test selected\n");
		return EXIT_TEST_SKIP;
	}

	r = test_setup();
	if (r == EXIT_TEST_SKIP) {
		printf("setup: skip\n");
		return EXIT_TEST_SKIP;
	}
	if (r != 0) {
		fprintf(stderr, "setup failed: %d%s%s\n", r, r < 0 ? ": " : "", r < 0 ? strerror(-r) : "");
		return EXIT_FAILURE;
	}

	index = 0;
	for (test_entry *t = tests_head; t; t = t->next) {
		struct timespec start;

		if (!selected(t->name, index++, argc, argv))
			continue;
		current_test = t->name;
		current_skipped = 0;
		skip_reason[0] = 0;
		clock_gettime(CLOCK_MONOTONIC, &start);
		if (t->ret_func) {
			r = t->ret_func();
			if (r == EXIT_TEST_SKIP)
				current_skipped = 1;
			else if (r != 0) {
				printf("%s: FAIL (returned %d)\n", t->name, r);
				return EXIT_FAILURE;
			}
		} else
			t->func();
		if (current_skipped) {
			printf("%s: SKIP%s%s%s\n", t->name, skip_reason[0] ? " (" : "", skip_reason,
			       skip_reason[0] ? ")" : "");
			skipped++;
		} else {
			printf("%s: OK (%.1f ms)\n", t->name, elapsed_ms(&start));
			passed++;
		}
	}
	current_test = NULL;
	printf("%u passed, %u skipped\n", passed, skipped);
	return passed == 0 && skipped > 0 ? EXIT_TEST_SKIP : EXIT_SUCCESS;
}

char *test_read_file(const char *path, size_t *ret_size) {
	FILE *f = fopen(path, "re");
	char *buf;
	long n;

	if (!f)
		test_fail(__FILE__, __LINE__, "cannot open %s: %m", path);
	if (fseek(f, 0, SEEK_END) < 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) < 0)
		test_fail(__FILE__, __LINE__, "cannot size %s: %m", path);
	buf = malloc((size_t)n + 1);
	if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
		test_fail(__FILE__, __LINE__, "cannot read %s", path);
	buf[n] = 0;
	fclose(f);
	if (ret_size)
		*ret_size = (size_t)n;
	return buf;
}
