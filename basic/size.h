/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Byte sizes as people write them on command lines: "4096", "512K", "4MiB", "1GiB",
 * "2T" (binary multiples; "B" and the "iB" suffix are optional). Shared by the daemon and
 * the tools.
 */

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Returns 0 and the size in *ret, or -EINVAL (not a size), -ERANGE (overflows 64 bits). */
static inline int size_parse(const char *s, uint64_t *ret) {
	static const struct {
		const char *suffix;
		unsigned shift;
	} units[] = {
		{ "", 0 },     { "B", 0 },     { "K", 10 },  { "KB", 10 },  { "KiB", 10 },
		{ "M", 20 },   { "MB", 20 },   { "MiB", 20 }, { "G", 30 },  { "GB", 30 },
		{ "GiB", 30 }, { "T", 40 },    { "TB", 40 }, { "TiB", 40 },
	};
	unsigned long long v;
	uint64_t frac = 0, denom = 1;
	char *end;

	if (!s || !isdigit((unsigned char)*s))
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno == ERANGE)
		return -ERANGE;
	/* A fraction of a unit (1.5GiB), to 9 digits; rounded down to a byte. */
	if (*end == '.') {
		end++;
		if (!isdigit((unsigned char)*end))
			return -EINVAL;
		for (; isdigit((unsigned char)*end); end++)
			if (denom < UINT64_C(1000000000)) {
				frac = frac * 10 + (uint64_t)(*end - '0');
				denom *= 10;
			}
	}
	for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
		uint64_t part;

		if (strcasecmp(end, units[i].suffix) != 0)
			continue;
		/* A fraction of a byte is no size. */
		if (denom > 1 && units[i].shift == 0)
			return -EINVAL;
		if (units[i].shift && v > (UINT64_MAX >> units[i].shift))
			return -ERANGE;
		part = (uint64_t)(((unsigned __int128)frac << units[i].shift) / denom);
		if (((uint64_t)v << units[i].shift) > UINT64_MAX - part)
			return -ERANGE;
		*ret = ((uint64_t)v << units[i].shift) + part;
		return 0;
	}
	return -EINVAL;
}

/* pct percent of bytes, rounded down, without overflow; 100 is all of it (bytes / 100 *
 * 100 is not, and a full pool would then count as past a share of 100). */
static inline uint64_t size_percent(uint64_t bytes, uint32_t pct) {
	return bytes / 100 * pct + bytes % 100 * pct / 100;
}

/* Formats a size for people ("1.5 GiB", "512 B") into buf and returns buf. */
static inline char *size_format(uint64_t v, char *buf, size_t n) {
	static const char *const units[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	size_t u = 0;
	double d = (double)v;

	while (d >= 1024.0 && u + 1 < sizeof(units) / sizeof(units[0])) {
		d /= 1024.0;
		u++;
	}
	if (u == 0)
		snprintf(buf, n, "%llu B", (unsigned long long)v);
	else
		snprintf(buf, n, "%.1f %s", d, units[u]);
	return buf;
}
