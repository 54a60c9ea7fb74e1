/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Decimal numbers as command lines and config values give them: digits only, no sign, no
 * blanks, no suffix (sizes with suffixes are size.h's). Shared by the daemon and the tools.
 */

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

/* Returns 0 and the value in *ret, or -EINVAL (not a number), -ERANGE (outside [min, max]). */
static inline int number_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *ret) {
	unsigned long long v;
	char *end;

	if (!s || *s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (*end)
		return -EINVAL;
	if (errno == ERANGE || v < min || v > max)
		return -ERANGE;
	*ret = v;
	return 0;
}

static inline int number_parse_u32(const char *s, uint32_t min, uint32_t max, uint32_t *ret) {
	uint64_t v;
	int r = number_parse_u64(s, min, max, &v);

	if (r == 0)
		*ret = (uint32_t)v;
	return r;
}
