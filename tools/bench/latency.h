/* SPDX-License-Identifier: MIT */
#pragma once

/* Latency samples in nanoseconds, for the subcommands of kvd-bench that print percentiles. */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

static inline int latency_cmp(const void *a, const void *b) {
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static inline void latency_sort(uint64_t *ns, size_t n) {
	qsort(ns, n, sizeof(*ns), latency_cmp);
}

/* Nearest-rank percentile p (0..100) of sorted samples, in microseconds; 0 without any. */
static inline double latency_percentile_us(const uint64_t *sorted, size_t n, double p) {
	size_t rank;

	if (n == 0)
		return 0.0;
	rank = (size_t)((p / 100.0) * (double)n + 0.999999);
	rank = rank == 0 ? 1 : rank > n ? n : rank;
	return (double)sorted[rank - 1] / 1000.0;
}
