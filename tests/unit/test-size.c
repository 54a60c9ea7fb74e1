/* SPDX-License-Identifier: MIT */
/*
 * size_parse() and size_format(): the sizes operators type for --pool, --chunk and
 * --budget, and what the daemon and tools print back.
 */

#include "basic/size.h"
#include "test.h"

static uint64_t parse_ok(const char *s) {
	uint64_t v = UINT64_C(0xdeadbeef);

	ASSERT_OK(size_parse(s, &v));
	return v;
}

/* A refused string must leave the output alone. */
static void parse_fails(const char *s, int want) {
	uint64_t v = UINT64_C(0xdeadbeef);

	ASSERT_ERRNO(size_parse(s, &v), want);
	ASSERT_EQ(v, UINT64_C(0xdeadbeef));
}

TEST(parse_accepts) {
	ASSERT_EQ(parse_ok("0"), 0u);
	ASSERT_EQ(parse_ok("4096"), 4096u);
	ASSERT_EQ(parse_ok("4096B"), 4096u);
	ASSERT_EQ(parse_ok("4K"), 4096u);
	ASSERT_EQ(parse_ok("4KiB"), 4096u);
	ASSERT_EQ(parse_ok("4kb"), 4096u);
	ASSERT_EQ(parse_ok("512k"), 512u * 1024);
	ASSERT_EQ(parse_ok("2MiB"), 2u * 1024 * 1024);
	ASSERT_EQ(parse_ok("1G"), UINT64_C(1) << 30);
	ASSERT_EQ(parse_ok("1GiB"), UINT64_C(1) << 30);
	ASSERT_EQ(parse_ok("3T"), UINT64_C(3) << 40);
	ASSERT_EQ(parse_ok("0G"), 0u);
	/* The largest values that still fit. */
	ASSERT_EQ(parse_ok("18446744073709551615"), UINT64_MAX);
	ASSERT_EQ(parse_ok("17179869183G"), (UINT64_C(17179869183)) << 30);
	ASSERT_EQ(parse_ok("16777215TiB"), UINT64_C(16777215) << 40);
	/* Fractions of a unit, rounded down to a byte. */
	ASSERT_EQ(parse_ok("1.5GiB"), UINT64_C(3) << 29);
	ASSERT_EQ(parse_ok("0.5K"), 512u);
	ASSERT_EQ(parse_ok("2.25M"), 9u << 18);
	ASSERT_EQ(parse_ok("1.000976563K"), 1025u);
	ASSERT_EQ(parse_ok("0.1K"), 102u);
	ASSERT_EQ(parse_ok("1.5000000001G"), UINT64_C(3) << 29);   /* past 9 digits: ignored */
}

TEST(parse_rejects) {
	parse_fails("", -EINVAL);
	parse_fails("-1", -EINVAL);
	parse_fails("+1", -EINVAL);
	parse_fails("1X", -EINVAL);
	parse_fails("K", -EINVAL);
	parse_fails("1.5", -EINVAL);
	parse_fails("1.5B", -EINVAL);
	parse_fails("1.G", -EINVAL);
	parse_fails("1..5G", -EINVAL);
	parse_fails(".5G", -EINVAL);
	parse_fails(" 1G", -EINVAL);
	parse_fails("1G ", -EINVAL);
	parse_fails("1 G", -EINVAL);
	parse_fails("1GiBB", -EINVAL);
	parse_fails("1i", -EINVAL);
	parse_fails("0x10", -EINVAL);
	parse_fails(NULL, -EINVAL);
}

TEST(parse_overflow) {
	/* 2^34 GiB is 2^64 bytes: one past the top. */
	parse_fails("17179869184G", -ERANGE);
	parse_fails("16777216T", -ERANGE);
	parse_fails("18446744073709551615K", -ERANGE);
	/* The largest whole number of a unit with a fraction still fits (a fraction is less
	 * than the unit). */
	ASSERT_EQ(parse_ok("17179869183.5G"), (UINT64_C(17179869183) << 30) + (UINT64_C(1) << 29));
	/* Overflows before any suffix. */
	parse_fails("18446744073709551616", -ERANGE);
	parse_fails("99999999999999999999", -ERANGE);
	parse_fails("99999999999999999999G", -ERANGE);
}

TEST(format) {
	char buf[32];

	ASSERT_STREQ(size_format(0, buf, sizeof(buf)), "0 B");
	ASSERT_STREQ(size_format(512, buf, sizeof(buf)), "512 B");
	ASSERT_STREQ(size_format(1023, buf, sizeof(buf)), "1023 B");
	ASSERT_STREQ(size_format(1024, buf, sizeof(buf)), "1.0 KiB");
	ASSERT_STREQ(size_format(1536, buf, sizeof(buf)), "1.5 KiB");
	ASSERT_STREQ(size_format(UINT64_C(3) << 29, buf, sizeof(buf)), "1.5 GiB");
	ASSERT_STREQ(size_format(UINT64_C(2) << 40, buf, sizeof(buf)), "2.0 TiB");
	ASSERT_STREQ(size_format(UINT64_MAX, buf, sizeof(buf)), "16.0 EiB");
}
