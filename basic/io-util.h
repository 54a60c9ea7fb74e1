/* SPDX-License-Identifier: MIT */
#pragma once

#include <errno.h>
#include <stddef.h>
#include <unistd.h>

/* Writes all n bytes of buf to fd, across short writes and EINTR. Returns 0, or -errno. */
static inline int write_all(int fd, const void *buf, size_t n) {
	const char *p = buf;

	while (n > 0) {
		ssize_t k = write(fd, p, n);

		if (k < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		p += k;
		n -= (size_t)k;
	}
	return 0;
}
