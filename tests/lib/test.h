/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A tiny test harness in the style of systemd's tests.h.
 *
 *   #include "test.h"
 *
 *   TEST(grow_past_max) {
 *           ASSERT_ERRNO(kvd_seq_grow(s, 1), -EFBIG);
 *   }
 *
 * Tests register themselves at load time (a constructor per TEST) and run in the order
 * they are defined; test.c provides main(), so a test program is only its TEST()s. Link
 * with test_dep.
 *
 * Each test runs in the test program's own process: a failed ASSERT_* prints the file,
 * line, expression and values and exits 1 at once (later tests do not run), as systemd's
 * do. A test skips with TEST_SKIP("why") (in a TEST) or by returning EXIT_TEST_SKIP (in a
 * TEST_RET). The program exits 0 when every selected test passed or skipped, and 77 (meson's
 * "skipped") when all of them skipped or none was selected.
 *
 * Selection: the TESTFUNCS environment variable, a comma-separated list of test names,
 * runs only those; names given on the command line do the same. --shard=K/N on the
 * command line runs, of those, the tests whose index in the program modulo N is K - 1:
 * meson runs a long program as N tests (shards) this way, each within its time budget.
 *
 * Optional set-up: a test program may define int test_setup(void), called once before the
 * first test; returning EXIT_TEST_SKIP skips the whole program, a negative errno fails it.
 *
 * The ASSERT_* comparisons take integers (of any width and signedness, compared by value,
 * so -1 != UINT64_MAX) or pointers; ASSERT_STREQ takes strings.
 */

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define EXIT_TEST_SKIP 77

/*
 * The size of a heavy case: full in the plain build, smaller in the sanitizer build
 * (meson's b_sanitize defines KVD_TEST_SANITIZED), where ASan and UBSan make code several
 * times slower. Every test must fit its time budget in both builds (meson.build,
 * test_timeout); the full sizes, as figures, are kvd-bench's.
 */
#ifdef KVD_TEST_SANITIZED
#define TEST_SIZE(full, sanitized) (sanitized)
#else
#define TEST_SIZE(full, sanitized) (full)
#endif

typedef struct test_entry {
	const char *name;
	void (*func)(void);
	int (*ret_func)(void);
	struct test_entry *next;
} test_entry;

void test_register(test_entry *t);

/* Marks the running test skipped; used by TEST_SKIP. */
void test_mark_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Defined (optionally) by the test program; see above. */
int test_setup(void);

#define _TEST_DEFINE(name, entry_init)                                                        \
	static test_entry test_entry_##name = entry_init;                                     \
	__attribute__((constructor)) static void test_register_##name(void) {                 \
		test_register(&test_entry_##name);                                            \
	}

/* A test that passes unless an assertion fails. */
#define TEST(name)                                                                            \
	static void test_##name(void);                                                        \
	_TEST_DEFINE(name, ((test_entry){ #name, test_##name, NULL, NULL }))                  \
	static void test_##name(void)

/* A test that returns 0 (pass), EXIT_TEST_SKIP, or anything else (fail). */
#define TEST_RET(name)                                                                        \
	static int test_##name(void);                                                         \
	_TEST_DEFINE(name, ((test_entry){ #name, NULL, test_##name, NULL }))                  \
	static int test_##name(void)

/* Skips the rest of a TEST(). */
#define TEST_SKIP(...)                                                                        \
	do {                                                                                  \
		test_mark_skip(__VA_ARGS__);                                                  \
		return;                                                                       \
	} while (0)

/* Skips a TEST() that needs the daemon's or libkvd's KVD_TEST_* hooks, in a build without
 * them (meson -Dtest_hooks=true; tools/check turns it on). */
#define TEST_NEEDS_HOOKS()                                                                    \
	do {                                                                                  \
		if (!KVD_TEST_HOOKS)                                                          \
			TEST_SKIP("needs the test hooks (meson -Dtest_hooks=true)");          \
	} while (0)

/* The whole file at path, NUL-terminated, its size in *ret_size (may be NULL); fails the
 * test when it cannot be read. The caller frees it. */
char *test_read_file(const char *path, size_t *ret_size);

/* ---- Assertions ---- */

void test_fail(const char *file, int line, const char *fmt, ...)
	__attribute__((format(printf, 3, 4), noreturn));
void test_fail_cmp(const char *file, int line, const char *op, const char *e1, const char *e2,
		   int s1, uintmax_t v1, int s2, uintmax_t v2) __attribute__((noreturn));
void test_fail_errno(const char *file, int line, const char *expr, intmax_t got, intmax_t want)
	__attribute__((noreturn));

/* Compares two integers by value whatever their types: <0, 0 or >0. */
int test_cmp(int s1, uintmax_t v1, int s2, uintmax_t v2);

/*
 * Whether an expression's type is a signed integer, without evaluating it. _Generic rather
 * than "(T)-1 < 0", which -Wtype-limits reports for every unsigned T; enums and pointers
 * fall through to the types they are compatible with, or to unsigned.
 */
#define _TEST_SIGNED(x)                                                                       \
	_Generic((x), signed char: 1, short: 1, int: 1, long: 1, long long: 1,                \
		 char: CHAR_MIN < 0, default: 0)

/* Both sides are evaluated once; pointers compare by address. */
#define _TEST_CMP(op, a, b, sa, sb)                                                           \
	do {                                                                                  \
		__typeof__(a) _a = (a);                                                       \
		__typeof__(b) _b = (b);                                                       \
		uintmax_t _va = (uintmax_t)_a, _vb = (uintmax_t)_b;                           \
		int _sa = _TEST_SIGNED(_a), _sb = _TEST_SIGNED(_b);                           \
		if (!(test_cmp(_sa, _va, _sb, _vb) op 0))                                     \
			test_fail_cmp(__FILE__, __LINE__, #op, sa, sb, _sa, _va, _sb, _vb);   \
	} while (0)

#define ASSERT_EQ(a, b) _TEST_CMP(==, a, b, #a, #b)
#define ASSERT_NE(a, b) _TEST_CMP(!=, a, b, #a, #b)
#define ASSERT_LT(a, b) _TEST_CMP(<, a, b, #a, #b)
#define ASSERT_LE(a, b) _TEST_CMP(<=, a, b, #a, #b)
#define ASSERT_GT(a, b) _TEST_CMP(>, a, b, #a, #b)
#define ASSERT_GE(a, b) _TEST_CMP(>=, a, b, #a, #b)

#define _TEST_TRUE(expr, s)                                                                   \
	do {                                                                                  \
		if (!(expr))                                                                  \
			test_fail(__FILE__, __LINE__, "expected \"%s\" to be true", s);        \
	} while (0)

/* Macro arguments are stringified here, before expansion, so that failures quote the
 * source as written (UINT64_MAX, not its expansion). */
#define ASSERT_TRUE(expr) _TEST_TRUE(expr, #expr)

#define ASSERT_FALSE(expr)                                                                    \
	do {                                                                                  \
		if (expr)                                                                     \
			test_fail(__FILE__, __LINE__, "expected \"%s\" to be false", #expr);  \
	} while (0)

/* expr >= 0, the success of a -errno-returning call; prints the errno name otherwise. */
#define ASSERT_OK(expr)                                                                       \
	do {                                                                                  \
		intmax_t _r = (intmax_t)(expr);                                               \
		if (_r < 0)                                                                   \
			test_fail_errno(__FILE__, __LINE__, #expr, _r, 0);                    \
	} while (0)

/* expr == -ECODE, e.g. ASSERT_ERRNO(kvd_seq_grow(s, 0), -EINVAL). */
#define ASSERT_ERRNO(expr, want)                                                              \
	do {                                                                                  \
		intmax_t _r = (intmax_t)(expr), _w = (intmax_t)(want);                        \
		if (_r != _w)                                                                 \
			test_fail_errno(__FILE__, __LINE__, #expr, _r, _w);                   \
	} while (0)

#define ASSERT_STREQ(a, b)                                                                    \
	do {                                                                                  \
		const char *_a = (a), *_b = (b);                                              \
		if (!_a || !_b || strcmp(_a, _b) != 0)                                        \
			test_fail(__FILE__, __LINE__,                                         \
				  "expected \"%s == %s\", but \"%s\" != \"%s\"", #a, #b,      \
				  _a ? _a : "(null)", _b ? _b : "(null)");                    \
	} while (0)

#define ASSERT_NULL(p) _TEST_TRUE((p) == NULL, #p " == NULL")
#define ASSERT_NOT_NULL(p) _TEST_TRUE((p) != NULL, #p " != NULL")
