/* SPDX-License-Identifier: MIT */
/*
 * Selection (kernels/select.h): the order's rules on hand-built cases (ties, NaN, inf,
 * signed zeros, k = 0 and k = n), then the optimised path against the sorting reference on
 * seeded random inputs up to 1e6 items (2e5 under the sanitizers), which must agree exactly:
 * a selection under a total order is unique. Greedy eviction is also checked against a
 * third, quadratic implementation written from the greedy's definition.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "select.h"
#include "simd.h"
#include "test.h"

/* ---- Helpers ---- */

static uint64_t rng_next(uint64_t *s) {
	uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));

	z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
	z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
	return z ^ (z >> 31);
}

static uint32_t rng_below(uint64_t *s, uint32_t n) {
	return n ? (uint32_t)(rng_next(s) % n) : 0;
}

static double rng_unit(uint64_t *s) {
	return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static void *xcalloc(size_t n, size_t size) {
	void *p = calloc(n ? n : 1, size);

	ASSERT_NOT_NULL(p);
	return p;
}

static float nan_with_payload(uint32_t sign, uint32_t payload) {
	uint32_t u = (sign ? 0x80000000u : 0) | 0x7f800000u | (payload & 0x7fffff) | 1;
	float f;

	memcpy(&f, &u, 4);
	return f;
}

/*
 * Score distributions that stress different parts of the selection: spread values,
 * heavy ties, clumped exponents (softmax-like), sprinkled NaN/inf/signed zeros.
 */
enum { DIST_UNIFORM, DIST_TIES, DIST_SOFTMAX, DIST_SPECIAL, DIST_CONST, DIST_MAX };

static float random_score(uint64_t *s, int dist) {
	switch (dist) {
	case DIST_UNIFORM:
		return (float)(rng_unit(s) * 2 - 1);
	case DIST_TIES:
		return (float)rng_below(s, 7) - 3;
	case DIST_SOFTMAX:
		return (float)exp(-rng_unit(s) * 20) * (1.0f + (float)rng_below(s, 3));
	case DIST_SPECIAL:
		switch (rng_below(s, 12)) {
		case 0:
			return nan_with_payload(rng_below(s, 2), (uint32_t)rng_next(s));
		case 1:
			return INFINITY;
		case 2:
			return -INFINITY;
		case 3:
			return 0.0f;
		case 4:
			return -0.0f;
		case 5:
			return 1e-40f; /* subnormal */
		case 6:
			return -1e-40f;
		default:
			return (float)(rng_unit(s) * 2e3 - 1e3);
		}
	default:
		return 0.25f;
	}
}

static float *random_scores(uint64_t *s, uint32_t n, int dist) {
	float *x = xcalloc(n, sizeof(float));

	for (uint32_t i = 0; i < n; i++)
		x[i] = random_score(s, dist);
	return x;
}

static void check_topk_case(const float *x, uint32_t n, uint32_t k) {
	uint32_t *a = xcalloc(k, sizeof(uint32_t)), *b = xcalloc(k, sizeof(uint32_t));

	ASSERT_OK(kvd_topk_ref(x, n, k, a));
	ASSERT_OK(kvd_topk(x, n, k, b));
	for (uint32_t i = 0; i < k; i++) {
		if (a[i] != b[i])
			fprintf(stderr, "n %u k %u: keep[%u]: ref %u, optimised %u\n", n, k, i, a[i], b[i]);
		ASSERT_EQ(a[i], b[i]);
		if (i > 0)
			ASSERT_LT(a[i - 1], a[i]);
	}
	free(a);
	free(b);
}

/* Both paths keep exactly want[0..k) (ascending) for every k given by the ranking. */
static void check_ranking(const float *x, uint32_t n, const uint32_t *ranking) {
	uint32_t keep[16], expect[16];

	ASSERT_LE(n, 16u);
	for (uint32_t k = 0; k <= n; k++) {
		uint32_t m = 0;

		/* The expected set: the first k of the ranking, in ascending index order. */
		for (uint32_t i = 0; i < n; i++)
			for (uint32_t j = 0; j < k; j++)
				if (ranking[j] == i)
					expect[m++] = i;
		ASSERT_EQ(m, k);
		ASSERT_OK(kvd_topk_ref(x, n, k, keep));
		for (uint32_t i = 0; i < k; i++)
			ASSERT_EQ(keep[i], expect[i]);
		ASSERT_OK(kvd_topk(x, n, k, keep));
		for (uint32_t i = 0; i < k; i++)
			ASSERT_EQ(keep[i], expect[i]);
	}
}

/* ---- Top-k ---- */

TEST(topk_small) {
	const float x[] = { 3, 1, 4, 1, 5, 9, 2, 6 };
	const uint32_t ranking[] = { 5, 7, 4, 2, 0, 6, 1, 3 };

	check_ranking(x, 8, ranking);
}

TEST(topk_ties_lower_index_kept) {
	const float same[] = { 2, 2, 2, 2, 2, 2 };
	const uint32_t same_rank[] = { 0, 1, 2, 3, 4, 5 };
	const float cut[] = { 1, 2, 2, 2, 3, 2 };
	const uint32_t cut_rank[] = { 4, 1, 2, 3, 5, 0 };

	check_ranking(same, 6, same_rank);
	check_ranking(cut, 6, cut_rank);
}

TEST(topk_nan_inf_signed_zero) {
	/* inf > 1 > 0 == -0 > -1 > -inf > NaN == NaN; equal ones by index. */
	const float x[] = { NAN, -INFINITY, 0.0f, -0.0f, INFINITY, -NAN, 1, -1 };
	const uint32_t ranking[] = { 4, 6, 2, 3, 7, 1, 0, 5 };
	const float zeros[] = { -0.0f, 0.0f, -0.0f };
	const uint32_t zeros_rank[] = { 0, 1, 2 };
	float nans[6];
	const uint32_t nans_rank[] = { 3, 0, 1, 2, 4, 5 };

	check_ranking(x, 8, ranking);
	check_ranking(zeros, 3, zeros_rank);
	/* NaNs of any sign and payload are equal, and below the lowest finite score. */
	nans[0] = nan_with_payload(0, 1);
	nans[1] = nan_with_payload(1, 0x400000);
	nans[2] = nan_with_payload(1, 0x7fffff);
	nans[3] = -FLT_MAX;
	nans[4] = nan_with_payload(0, 0x123);
	nans[5] = NAN;
	check_ranking(nans, 6, nans_rank);
}

TEST(topk_edges) {
	const float one = NAN;
	uint32_t keep[4] = { 7, 7, 7, 7 };

	/* n = 0, k = 0: nothing, and NULL is fine. */
	ASSERT_OK(kvd_topk(NULL, 0, 0, NULL));
	ASSERT_OK(kvd_topk_ref(NULL, 0, 0, NULL));
	/* n = 1. */
	ASSERT_OK(kvd_topk(&one, 1, 1, keep));
	ASSERT_EQ(keep[0], 0u);
	ASSERT_OK(kvd_topk(&one, 1, 0, keep));
	ASSERT_OK(kvd_topk_ref(&one, 1, 1, keep + 1));
	ASSERT_EQ(keep[1], 0u);
	/* Refusals. */
	ASSERT_ERRNO(kvd_topk(&one, 1, 2, keep), -EINVAL);
	ASSERT_ERRNO(kvd_topk_ref(&one, 1, 2, keep), -EINVAL);
	ASSERT_ERRNO(kvd_topk(NULL, 3, 1, keep), -EINVAL);
	ASSERT_ERRNO(kvd_topk(&one, 1, 1, NULL), -EINVAL);
	/* k = n keeps everything, in order. */
	{
		const float x[] = { NAN, NAN, -INFINITY, 5 };

		ASSERT_OK(kvd_topk(x, 4, 4, keep));
		for (uint32_t i = 0; i < 4; i++)
			ASSERT_EQ(keep[i], i);
	}
}

TEST(topk_random_matches_reference) {
	static const uint32_t sizes[] = { 1, 2, 3, 17, 100, 2048, 4097, TEST_SIZE(65536, 20000),
					    TEST_SIZE(100003, 30011) };
	uint64_t s = 1;

	for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
		for (int dist = 0; dist < DIST_MAX; dist++) {
			uint32_t n = sizes[si];
			float *x = random_scores(&s, n, dist);
			uint32_t ks[] = { 0, 1, n / 2, n - 1, n, rng_below(&s, n + 1),
					  rng_below(&s, n / 16 + 1) };

			for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++)
				check_topk_case(x, n, ks[ki]);
			free(x);
		}
}

TEST(topk_large) {
	uint64_t s = 42;

	for (int dist = 0; dist < DIST_MAX; dist++) {
		uint32_t n = TEST_SIZE(500000, 200000);
		float *x = random_scores(&s, n, dist);

		check_topk_case(x, n, 31337);
		check_topk_case(x, n, n - 999);
		free(x);
	}
}

/* ---- Several rows ---- */

static void check_rows_case(uint64_t *s, uint32_t n_rows, uint32_t max_len, int dist,
			    uint64_t k_choice) {
	const float **rows = xcalloc(n_rows, sizeof(*rows));
	uint32_t *lens = xcalloc(n_rows, sizeof(uint32_t));
	uint32_t *ca = xcalloc(n_rows, sizeof(uint32_t)), *cb = xcalloc(n_rows, sizeof(uint32_t));
	uint32_t *ka, *kb;
	uint64_t total = 0, k;

	for (uint32_t r = 0; r < n_rows; r++) {
		/* Some empty rows, some long ones. */
		lens[r] = rng_below(s, 5) == 0 ? 0 : rng_below(s, max_len + 1);
		rows[r] = random_scores(s, lens[r], dist);
		total += lens[r];
	}
	k = k_choice == UINT64_MAX ? total : k_choice % (total + 1);
	ka = xcalloc(k, sizeof(uint32_t));
	kb = xcalloc(k, sizeof(uint32_t));
	ASSERT_OK(kvd_topk_rows_ref(rows, lens, n_rows, k, 1, ca, ka));
	for (unsigned threads = 0; threads <= 8; threads += threads < 3 ? 1 : 5) {
		memset(cb, 0xff, n_rows * sizeof(uint32_t));
		ASSERT_OK(kvd_topk_rows(rows, lens, n_rows, k, threads, cb, kb));
		for (uint32_t r = 0; r < n_rows; r++)
			ASSERT_EQ(ca[r], cb[r]);
		for (uint64_t i = 0; i < k; i++)
			ASSERT_EQ(ka[i], kb[i]);
	}
	for (uint32_t r = 0; r < n_rows; r++)
		free((void *)rows[r]);
	free(rows);
	free(lens);
	free(ca);
	free(cb);
	free(ka);
	free(kb);
}

TEST(topk_rows_random_matches_reference) {
	uint64_t s = 7;

	for (int dist = 0; dist < DIST_MAX; dist++) {
		check_rows_case(&s, 1, 100, dist, rng_next(&s));
		check_rows_case(&s, 5, 10, dist, rng_next(&s));
		check_rows_case(&s, 32, 4096, dist, rng_next(&s));
		check_rows_case(&s, 32, 4096, dist, UINT64_MAX);
		check_rows_case(&s, 32, 4096, dist, 0);
		/* Big enough for threads to start (2^16 scores each). */
		check_rows_case(&s, 64, TEST_SIZE(20000, 8192), dist, rng_next(&s));
	}
}

/* The selection does not depend on how one array is split into rows. */
TEST(topk_rows_split_invariant) {
	uint64_t s = 99;
	uint32_t n = 300000, k = 12345, *whole = xcalloc(k, sizeof(uint32_t));
	float *x = random_scores(&s, n, DIST_TIES);

	ASSERT_OK(kvd_topk(x, n, k, whole));
	for (int trial = 0; trial < 4; trial++) {
		uint32_t n_rows = 1 + rng_below(&s, 40), *lens = xcalloc(n_rows, sizeof(uint32_t));
		uint32_t *counts = xcalloc(n_rows, sizeof(uint32_t)), *keep = xcalloc(k, sizeof(uint32_t));
		const float **rows = xcalloc(n_rows, sizeof(*rows));
		uint32_t off = 0, j = 0;

		for (uint32_t r = 0; r < n_rows; r++) {
			lens[r] = r == n_rows - 1 ? n - off : rng_below(&s, n - off + 1);
			rows[r] = x + off;
			off += lens[r];
		}
		ASSERT_OK(kvd_topk_rows(rows, lens, n_rows, k, (unsigned)trial * 3, counts, keep));
		off = 0;
		for (uint32_t r = 0; r < n_rows; r++) {
			for (uint32_t c = 0; c < counts[r]; c++, j++)
				ASSERT_EQ(whole[j], off + keep[j]);
			off += lens[r];
		}
		ASSERT_EQ(j, k);
		free(lens);
		free(counts);
		free(keep);
		free(rows);
	}
	free(x);
	free(whole);
}

TEST(topk_rows_errors) {
	const float x[] = { 1, 2 };
	const float *rows[] = { x, NULL };
	uint32_t lens[] = { 2, 1 }, counts[2], keep[3];

	ASSERT_ERRNO(kvd_topk_rows(rows, lens, 2, 1, 1, counts, keep), -EINVAL);
	ASSERT_ERRNO(kvd_topk_rows_ref(rows, lens, 2, 1, 1, counts, keep), -EINVAL);
	lens[1] = 0;
	ASSERT_ERRNO(kvd_topk_rows(rows, lens, 2, 3, 1, counts, keep), -EINVAL);
	ASSERT_OK(kvd_topk_rows(rows, lens, 2, 1, 1, counts, keep));
	ASSERT_EQ(counts[0], 1u);
	ASSERT_EQ(counts[1], 0u);
	ASSERT_EQ(keep[0], 1u);
	ASSERT_OK(kvd_topk_rows(NULL, NULL, 0, 0, 4, NULL, NULL));
}

/* ---- Greedy eviction ---- */

/* a goes before b in eviction order: lower density, NaN lowest; ties: higher index. */
static int evicts_before(float da, uint32_t ia, float db, uint32_t ib) {
	if (isnan(da) != isnan(db))
		return isnan(da);
	if (!isnan(da) && da != db)
		return da < db;
	return ia > ib;
}

/* The greedy by its definition: repeatedly take the next unit in order that may go. */
static void brute_evict(const struct kvd_evict_in *in, uint8_t *chosen, uint64_t *ret_freed) {
	uint32_t n_groups = in->n_groups ? in->n_groups : 1;
	uint32_t *units = xcalloc(n_groups, sizeof(uint32_t));
	uint64_t *bytes = xcalloc(n_groups, sizeof(uint64_t)), freed = 0;
	uint8_t *closed = xcalloc(n_groups, 1), *seen = xcalloc(in->n, 1);

	memset(chosen, 0, in->n);
	while (freed < in->target) {
		uint32_t best = UINT32_MAX, g = 0;

		for (uint32_t i = 0; i < in->n; i++) {
			if (seen[i] || in->bytes[i] == 0 || (in->pinned && in->pinned[i]))
				continue;
			if (best == UINT32_MAX ||
			    evicts_before(kvd_density(in->value[i], in->bytes[i]), i,
					  kvd_density(in->value[best], in->bytes[best]), best))
				best = i;
		}
		if (best == UINT32_MAX)
			break;
		seen[best] = 1;
		while (in->n_groups && best >= in->group_start[g + 1])
			g++;
		if (closed[g])
			continue;
		if ((in->n_groups && in->group_max_units && units[g] + 1 > in->group_max_units[g]) ||
		    (in->n_groups && in->group_max_bytes && bytes[g] + in->bytes[best] > in->group_max_bytes[g])) {
			closed[g] = 1;
			continue;
		}
		units[g]++;
		bytes[g] += in->bytes[best];
		freed += in->bytes[best];
		chosen[best] = 1;
	}
	*ret_freed = freed;
	free(units);
	free(bytes);
	free(closed);
	free(seen);
}

/*
 * Runs both paths (and the brute force if asked), which must agree exactly. The optimised
 * path runs twice: allocating, and in a scratch of the exact size, misaligned and dirty.
 */
static void check_evict_case(const struct kvd_evict_in *in, int brute) {
	uint32_t *a = xcalloc(in->n, sizeof(uint32_t)), *b = xcalloc(in->n, sizeof(uint32_t));
	uint32_t *d = xcalloc(in->n, sizeof(uint32_t));
	size_t size = kvd_evict_greedy_scratch_bytes(in->n);
	uint8_t *scratch = xcalloc(size + 1, 1);
	uint32_t na = 0, nb = 0, nd = 0, last_max = 0;
	uint64_t fa = 0, fb = 0, fd = 0, sum = 0;

	ASSERT_OK(kvd_evict_greedy_ref(in, a, &na, &fa));
	ASSERT_OK(kvd_evict_greedy(in, b, &nb, &fb));
	memset(scratch, 0xa5, size + 1);
	memset(d, 0xa5, in->n * sizeof(uint32_t));
	ASSERT_OK(kvd_evict_greedy_buf(in, scratch + 1, size, d, &nd, &fd));
	ASSERT_EQ(na, nb);
	ASSERT_EQ(fa, fb);
	ASSERT_EQ(na, nd);
	ASSERT_EQ(fa, fd);
	for (uint32_t i = 0; i < na; i++) {
		ASSERT_EQ(a[i], b[i]);
		ASSERT_EQ(a[i], d[i]);
		if (i > 0)
			ASSERT_LT(a[i - 1], a[i]);
		ASSERT_GT(in->bytes[a[i]], 0u);
		ASSERT_FALSE(in->pinned && in->pinned[a[i]]);
		sum += in->bytes[a[i]];
		if (in->bytes[a[i]] > last_max)
			last_max = in->bytes[a[i]];
	}
	ASSERT_EQ(sum, fa);
	/* Over the target by less than one unit. */
	if (fa > in->target)
		ASSERT_LT(fa - in->target, (uint64_t)last_max);
	if (brute) {
		uint8_t *chosen = xcalloc(in->n, 1);
		uint64_t fc;
		uint32_t j = 0;

		brute_evict(in, chosen, &fc);
		ASSERT_EQ(fc, fa);
		for (uint32_t i = 0; i < in->n; i++)
			if (chosen[i]) {
				ASSERT_LT(j, na);
				ASSERT_EQ(a[j], i);
				j++;
			}
		ASSERT_EQ(j, na);
		free(chosen);
	}
	free(a);
	free(b);
	free(d);
	free(scratch);
}

struct evict_case {
	struct kvd_evict_in in;
	float *value;
	uint32_t *bytes, *start, *max_units;
	uint8_t *pinned;
	uint64_t *max_bytes;
};

static void evict_case_free(struct evict_case *c) {
	free(c->value);
	free(c->bytes);
	free(c->start);
	free(c->max_units);
	free(c->pinned);
	free(c->max_bytes);
}

static int cmp_u32(const void *a, const void *b) {
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;

	return x < y ? -1 : x > y;
}

static void random_evict_case(uint64_t *s, uint32_t n, int dist, struct evict_case *c) {
	static const uint32_t sizes[] = { 4096, 8192, 12288, 1024, 65536 };
	uint64_t total = 0;

	memset(c, 0, sizeof(*c));
	c->value = random_scores(s, n, dist);
	c->bytes = xcalloc(n, sizeof(uint32_t));
	for (uint32_t i = 0; i < n; i++) {
		/* Same density from different sizes too: value scaled with the size. */
		c->bytes[i] = rng_below(s, 10) == 0 ? 0 : sizes[rng_below(s, 5)];
		if (dist == DIST_TIES && rng_below(s, 2))
			c->value[i] = (float)c->bytes[i] / 4096.0f;
		total += c->bytes[i];
	}
	if (rng_below(s, 3)) {
		c->pinned = xcalloc(n, 1);
		for (uint32_t i = 0; i < n; i++)
			c->pinned[i] = rng_below(s, 6) == 0;
	}
	if (rng_below(s, 4)) {
		uint32_t g = 1 + rng_below(s, n < 8 ? n + 1 : n / 4 + 1);

		c->start = xcalloc(g + 1, sizeof(uint32_t));
		for (uint32_t i = 1; i < g; i++)
			c->start[i] = rng_below(s, n + 1);
		c->start[g] = n;
		qsort(c->start + 1, g - 1, sizeof(uint32_t), cmp_u32);
		if (rng_below(s, 3)) {
			c->max_units = xcalloc(g, sizeof(uint32_t));
			for (uint32_t i = 0; i < g; i++)
				c->max_units[i] = rng_below(s, 4) == 0 ? UINT32_MAX
					: rng_below(s, c->start[i + 1] - c->start[i] + 2);
		}
		if (rng_below(s, 3)) {
			c->max_bytes = xcalloc(g, sizeof(uint64_t));
			for (uint32_t i = 0; i < g; i++)
				c->max_bytes[i] = rng_below(s, 4) == 0 ? UINT64_MAX
					: (uint64_t)rng_below(s, c->start[i + 1] - c->start[i] + 2) * 6000;
		}
		c->in.n_groups = g;
	}
	c->in.n = n;
	c->in.value = c->value;
	c->in.bytes = c->bytes;
	c->in.pinned = c->pinned;
	c->in.group_start = c->start;
	c->in.group_max_units = c->max_units;
	c->in.group_max_bytes = c->max_bytes;
	switch (rng_below(s, 5)) {
	case 0:
		c->in.target = 0;
		break;
	case 1:
		c->in.target = total + 1; /* more than there is */
		break;
	default:
		c->in.target = (uint64_t)(rng_unit(s) * (double)total);
	}
}

TEST(evict_small_against_brute_force) {
	uint64_t s = 2024;

	for (int trial = 0; trial < TEST_SIZE(1000, 200); trial++) {
		struct evict_case c;

		random_evict_case(&s, 1 + rng_below(&s, 14), trial % DIST_MAX, &c);
		check_evict_case(&c.in, 1);
		evict_case_free(&c);
	}
}

TEST(evict_random_matches_reference) {
	static const uint32_t sizes[] = { 100, 1000, 4099, 50000, TEST_SIZE(1000000, 200000) };
	uint64_t s = 5;

	for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
		for (int dist = 0; dist < DIST_MAX; dist++)
			for (int trial = 0; trial < (sizes[si] >= 200000 ? 1 : TEST_SIZE(4, 2)); trial++) {
				struct evict_case c;

				random_evict_case(&s, sizes[si], dist, &c);
				check_evict_case(&c.in, 0);
				evict_case_free(&c);
			}
}

/* Equal-size units of a power-of-two size: eviction is the complement of top-k. */
TEST(evict_equal_sizes_is_topk) {
	uint64_t s = 77;

	for (int dist = 0; dist < DIST_MAX; dist++) {
		uint32_t n = 5000, k = rng_below(&s, n + 1), *keep = xcalloc(n, sizeof(uint32_t));
		uint32_t *ids = xcalloc(n, sizeof(uint32_t)), *bytes = xcalloc(n, sizeof(uint32_t)), n_ids;
		float *x = random_scores(&s, n, dist);
		struct kvd_evict_in in = { .n = n, .value = x, .bytes = bytes };
		uint64_t freed;

		for (uint32_t i = 0; i < n; i++)
			bytes[i] = 4096;
		in.target = (uint64_t)(n - k) * 4096;
		ASSERT_OK(kvd_topk(x, n, k, keep));
		ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
		ASSERT_EQ(n_ids, n - k);
		ASSERT_EQ(freed, in.target);
		/* Merge: every index is in exactly one of keep and ids. */
		for (uint32_t i = 0, a = 0, b = 0; i < n; i++) {
			int kept = a < k && keep[a] == i, gone = b < n_ids && ids[b] == i;

			ASSERT_TRUE(kept != gone);
			a += kept;
			b += gone;
		}
		free(keep);
		free(ids);
		free(bytes);
		free(x);
	}
}

TEST(evict_special_values) {
	/* NaN first, then -inf, then by density; +inf last; pinned and empty never. */
	const float value[] = { 1, NAN, INFINITY, -INFINITY, 2, 0.5f, 3 };
	const uint32_t bytes[] = { 100, 100, 100, 100, 100, 0, 100 };
	const uint8_t pinned[] = { 0, 0, 0, 0, 0, 0, 1 };
	struct kvd_evict_in in = { .n = 7, .value = value, .bytes = bytes, .pinned = pinned };
	uint32_t ids[7], n_ids;
	uint64_t freed;

	in.target = 150;
	ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
	ASSERT_EQ(n_ids, 2u);
	ASSERT_EQ(ids[0], 1u);
	ASSERT_EQ(ids[1], 3u);
	ASSERT_EQ(freed, 200u);
	in.target = 10000;
	ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
	ASSERT_EQ(n_ids, 5u);
	ASSERT_EQ(freed, 500u);
	check_evict_case(&in, 1);
	in.target = 450;
	check_evict_case(&in, 1);
}

TEST(evict_floors) {
	/* Two groups of four equal units; group 0 may lose one unit, group 1 200 bytes. */
	const float value[] = { 1, 2, 3, 4, 1.5f, 2.5f, 3.5f, 4.5f };
	const uint32_t bytes[] = { 100, 100, 100, 100, 100, 100, 100, 100 };
	const uint32_t start[] = { 0, 4, 8 }, max_units[] = { 1, UINT32_MAX };
	const uint64_t max_bytes[] = { UINT64_MAX, 250 };
	struct kvd_evict_in in = { .n = 8, .value = value, .bytes = bytes, .n_groups = 2,
				   .group_start = start, .group_max_units = max_units,
				   .group_max_bytes = max_bytes, .target = 800 };
	uint32_t ids[8], n_ids;
	uint64_t freed;

	ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
	ASSERT_EQ(n_ids, 3u);
	ASSERT_EQ(ids[0], 0u);
	ASSERT_EQ(ids[1], 4u);
	ASSERT_EQ(ids[2], 5u);
	ASSERT_EQ(freed, 300u);
	check_evict_case(&in, 1);
	/* A byte limit below the first unit keeps the whole group. */
	{
		const uint64_t tight[] = { 99, 99 };

		in.group_max_units = NULL;
		in.group_max_bytes = tight;
		ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
		ASSERT_EQ(n_ids, 0u);
		ASSERT_EQ(freed, 0u);
	}
}

TEST(evict_errors) {
	const float value[] = { 1, 2 };
	const uint32_t bytes[] = { 1, 1 }, bad_start[] = { 0, 3 }, good_start[] = { 0, 2 };
	struct kvd_evict_in in = { .n = 2, .value = value, .bytes = bytes, .n_groups = 1,
				   .group_start = bad_start, .target = 1 };
	uint32_t ids[2], n_ids;
	uint64_t freed;

	ASSERT_ERRNO(kvd_evict_greedy(&in, ids, &n_ids, &freed), -EINVAL);
	ASSERT_ERRNO(kvd_evict_greedy_ref(&in, ids, &n_ids, &freed), -EINVAL);
	in.group_start = NULL;
	ASSERT_ERRNO(kvd_evict_greedy(&in, ids, &n_ids, &freed), -EINVAL);
	in.group_start = good_start;
	ASSERT_ERRNO(kvd_evict_greedy(NULL, ids, &n_ids, &freed), -EINVAL);
	ASSERT_ERRNO(kvd_evict_greedy(&in, NULL, &n_ids, &freed), -EINVAL);
	ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
	ASSERT_EQ(n_ids, 1u);
	ASSERT_EQ(ids[0], 0u);
	/* No units at all. */
	in.n = 0;
	in.n_groups = 0;
	ASSERT_OK(kvd_evict_greedy(&in, NULL, &n_ids, &freed));
	ASSERT_EQ(n_ids, 0u);
	ASSERT_OK(kvd_evict_greedy_ref(&in, NULL, &n_ids, &freed));
	ASSERT_EQ(n_ids, 0u);
}

/* The SIMD paths of the optimised eviction this machine runs, by kvd_simd_get() name. */
static const char *const evict_paths[] = { "generic", "avx2", "avx512" };

/* Every random case again on each SIMD path, smaller: both must match the reference. */
TEST(evict_simd_paths_match_reference) {
	static const uint32_t sizes[] = { 1, 15, 16, 17, 33, 100, 1000, 4099, 50000 };

	for (size_t p = 0; p < sizeof(evict_paths) / sizeof(evict_paths[0]); p++) {
		const struct kvd_simd_ops *ops = kvd_simd_get(evict_paths[p]);
		uint64_t s = 31 + p;

		if (!ops)
			continue;
		kvd_simd_override(ops);
		for (int trial = 0; trial < TEST_SIZE(300, 20); trial++) {
			struct evict_case c;

			random_evict_case(&s, 1 + rng_below(&s, 40), trial % DIST_MAX, &c);
			check_evict_case(&c.in, 1);
			evict_case_free(&c);
		}
		for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
			for (int dist = 0; dist < DIST_MAX; dist++) {
				struct evict_case c;

				random_evict_case(&s, sizes[si], dist, &c);
				check_evict_case(&c.in, 0);
				evict_case_free(&c);
			}
		kvd_simd_override(NULL);
	}
}

/* The float of bits u. */
static float float_of_bits(uint32_t u) {
	float f;

	memcpy(&f, &u, sizeof(f));
	return f;
}

/*
 * The whole order, on any float and any size: the units are ranked by the test's own
 * comparator, and every prefix of that ranking (its bytes as the target) must be what
 * both paths evict. Values are raw bits (subnormals, NaNs, infinities, signed zeros),
 * sizes powers of two and not, up to 2^32 - 1, so that the densities' rounding is
 * checked unit by unit on each SIMD path.
 */
TEST(evict_every_prefix_of_the_order) {
	enum { N = 70 };
	float value[N];
	uint32_t bytes[N], rank[N], n_rank;
	uint8_t pinned[N], in_prefix[N];
	uint64_t s = 4242;

	for (size_t p = 0; p < sizeof(evict_paths) / sizeof(evict_paths[0]); p++) {
		const struct kvd_simd_ops *ops = kvd_simd_get(evict_paths[p]);

		if (!ops)
			continue;
		kvd_simd_override(ops);
		for (int trial = 0; trial < TEST_SIZE(30, 2); trial++) {
			struct kvd_evict_in in = { .n = N, .value = value, .bytes = bytes };
			uint64_t acc = 0;

			for (uint32_t i = 0; i < N; i++) {
				uint64_t r = rng_next(&s);

				/* Half raw bits, half a few values: ties across sizes. */
				value[i] = r & 1 ? float_of_bits((uint32_t)(r >> 32))
						 : (float)((r >> 8) % 5) - 1.0f;
				switch ((r >> 1) % 6) {
				case 0:
					bytes[i] = 1u << ((r >> 16) % 32);
					break;
				case 1:
					bytes[i] = (uint32_t)(r >> 24);
					break;
				case 2:
					bytes[i] = UINT32_MAX - (uint32_t)((r >> 16) % 3);
					break;
				case 3:
					bytes[i] = (uint32_t)((r >> 16) % 4); /* 0 too */
					break;
				default:
					bytes[i] = 4096u << ((r >> 16) % 2);
				}
				pinned[i] = (r >> 4) % 8 == 0;
			}
			in.pinned = trial % 2 ? pinned : NULL;
			/* The ranking, by insertion: evictable units in eviction order. */
			n_rank = 0;
			for (uint32_t i = 0; i < N; i++) {
				uint32_t j = n_rank;
				float di;

				if (bytes[i] == 0 || (in.pinned && pinned[i]))
					continue;
				di = kvd_density(value[i], bytes[i]);
				for (; j > 0; j--) {
					uint32_t r = rank[j - 1];
					float dr = kvd_density(value[r], bytes[r]);

					if (!evicts_before(di, i, dr, r))
						break;
					rank[j] = r;
				}
				rank[j] = i;
				n_rank++;
			}
			/* in_prefix: the first k units of the ranking, by id. */
			memset(in_prefix, 0, sizeof(in_prefix));
			for (uint32_t k = 0; k <= n_rank; k++) {
				uint32_t ids[N], n_ids, m = 0;
				uint64_t freed;

				in.target = acc ? acc : 1;
				ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
				if (acc == 0)
					ASSERT_LE(n_ids, 1u);
				else {
					ASSERT_EQ(n_ids, k);
					ASSERT_EQ(freed, acc);
					for (uint32_t i = 0; i < N; i++)
						if (in_prefix[i])
							ASSERT_EQ(ids[m++], i);
				}
				if (k % 8 == 0)
					check_evict_case(&in, 0);
				if (k < n_rank) {
					acc += bytes[rank[k]];
					in_prefix[rank[k]] = 1;
				}
			}
		}
		kvd_simd_override(NULL);
	}
}

/*
 * Cuts that move the threshold again and again: group g holds equal units of density
 * 2^g / 4096 and may give up one, and the target asks for one unit of each group. Each
 * cut moves the threshold up to the next group's bucket, past the passes that follow it
 * (then every group is checked against all its units).
 */
TEST(evict_group_cascade) {
	enum { GROUPS = 12, PER = 16, N = GROUPS * PER };
	float value[N];
	uint32_t bytes[N], start[GROUPS + 1], max_units[GROUPS], ids[N], n_ids;
	uint64_t max_bytes[GROUPS], freed;
	struct kvd_evict_in in = { .n = N, .value = value, .bytes = bytes, .n_groups = GROUPS,
				   .group_start = start, .target = GROUPS * 4096 };

	for (uint32_t g = 0; g <= GROUPS; g++)
		start[g] = g * PER;
	for (uint32_t i = 0; i < N; i++) {
		value[i] = (float)(1u << (i / PER));
		bytes[i] = 4096;
	}
	for (uint32_t g = 0; g < GROUPS; g++) {
		max_units[g] = 1;
		max_bytes[g] = 4096 + 4095;
	}
	for (int limit = 0; limit < 3; limit++) {
		in.group_max_units = limit != 1 ? max_units : NULL;
		in.group_max_bytes = limit != 0 ? max_bytes : NULL;
		ASSERT_OK(kvd_evict_greedy(&in, ids, &n_ids, &freed));
		ASSERT_EQ(n_ids, (uint32_t)GROUPS);
		ASSERT_EQ(freed, in.target);
		/* Equal densities: each group's highest index goes first. */
		for (uint32_t g = 0; g < GROUPS; g++)
			ASSERT_EQ(ids[g], g * PER + PER - 1);
		check_evict_case(&in, 1);
		/* One unit short of the last group, then more than all there is. */
		in.target -= 4096;
		check_evict_case(&in, 1);
		in.target = UINT64_MAX;
		check_evict_case(&in, 1);
		in.target = GROUPS * 4096;
	}
}

/*
 * Many units in few buckets: densities a few ulps apart (one bucket holds all), with
 * ties within and across sizes, and a few large groups whose limits bind inside that
 * bucket; the selections then work on long lists and resolve every bit of the key.
 */
TEST(evict_one_crowded_bucket) {
	uint32_t n = TEST_SIZE(200003, 50021);
	uint64_t s = 8080, total = 0;

	for (int trial = 0; trial < 8; trial++) {
		struct evict_case c = { 0 };
		uint32_t g = 1 + (uint32_t)trial % 4;

		c.value = xcalloc(n, sizeof(float));
		c.bytes = xcalloc(n, sizeof(uint32_t));
		total = 0;
		for (uint32_t i = 0; i < n; i++) {
			uint32_t big = rng_below(&s, 4) == 0;

			/* 1 + k ulps over 4 KiB, or twice that over 8 KiB: the same density. */
			c.value[i] = (1.0f + (float)rng_below(&s, 1 + (uint32_t)trial * 40) *
						     FLT_EPSILON) * (big ? 2.0f : 1.0f);
			c.bytes[i] = big ? 8192 : 4096;
			total += c.bytes[i];
		}
		if (trial % 2) {
			c.pinned = xcalloc(n, 1);
			for (uint32_t i = 0; i < n; i++)
				c.pinned[i] = rng_below(&s, 50) == 0;
		}
		c.start = xcalloc(g + 1, sizeof(uint32_t));
		c.max_units = xcalloc(g, sizeof(uint32_t));
		c.max_bytes = xcalloc(g, sizeof(uint64_t));
		for (uint32_t x = 0; x <= g; x++)
			c.start[x] = (uint32_t)((uint64_t)n * x / g);
		for (uint32_t x = 0; x < g; x++) {
			uint32_t len = c.start[x + 1] - c.start[x];

			c.max_units[x] = x % 2 ? UINT32_MAX : rng_below(&s, len);
			c.max_bytes[x] = x % 3 == 1 ? UINT64_MAX
						    : (uint64_t)rng_below(&s, len) * 5000;
		}
		c.in = (struct kvd_evict_in){ .n = n, .value = c.value, .bytes = c.bytes,
					      .pinned = c.pinned, .n_groups = g,
					      .group_start = c.start,
					      .group_max_units = trial < 4 ? c.max_units : NULL,
					      .group_max_bytes = c.max_bytes,
					      .target = (uint64_t)(rng_unit(&s) * (double)total) };
		check_evict_case(&c.in, 0);
		evict_case_free(&c);
	}
}

TEST(evict_buf_scratch) {
	const float value[] = { 3, 1, 2, NAN };
	const uint32_t bytes[] = { 100, 100, 100, 100 };
	struct kvd_evict_in in = { .n = 4, .value = value, .bytes = bytes, .target = 150 };
	size_t size = kvd_evict_greedy_scratch_bytes(4);
	uint8_t *scratch = xcalloc(size, 1);
	uint32_t ids[4], n_ids;
	uint64_t freed, s = 12;

	/* 2 bytes a unit on top of a fixed part. */
	ASSERT_GE(size, 4 * sizeof(uint16_t));
	ASSERT_EQ(kvd_evict_greedy_scratch_bytes(1000) - kvd_evict_greedy_scratch_bytes(0), 2000u);
	ASSERT_ERRNO(kvd_evict_greedy_buf(&in, NULL, size, ids, &n_ids, &freed), -ENOBUFS);
	ASSERT_ERRNO(kvd_evict_greedy_buf(&in, scratch, size - 1, ids, &n_ids, &freed), -ENOBUFS);
	ASSERT_ERRNO(kvd_evict_greedy_buf(NULL, scratch, size, ids, &n_ids, &freed), -EINVAL);
	ASSERT_ERRNO(kvd_evict_greedy_buf(&in, scratch, size, NULL, &n_ids, &freed), -EINVAL);
	ASSERT_OK(kvd_evict_greedy_buf(&in, scratch, size, ids, &n_ids, &freed));
	ASSERT_EQ(n_ids, 2u);
	ASSERT_EQ(ids[0], 1u);
	ASSERT_EQ(ids[1], 3u);
	ASSERT_EQ(freed, 200u);
	free(scratch);

	/* One scratch for rounds of different sizes, left as the last round left it. */
	size = kvd_evict_greedy_scratch_bytes(60000);
	scratch = xcalloc(size + 8, 1);
	for (int round = 0; round < 12; round++) {
		struct evict_case c;
		uint32_t *want = NULL, *got = NULL, n_want, n_got;
		uint64_t f_want, f_got;

		random_evict_case(&s, 1 + rng_below(&s, 60000), round % DIST_MAX, &c);
		want = xcalloc(c.in.n, sizeof(uint32_t));
		got = xcalloc(c.in.n, sizeof(uint32_t));
		ASSERT_OK(kvd_evict_greedy_ref(&c.in, want, &n_want, &f_want));
		ASSERT_OK(kvd_evict_greedy_buf(&c.in, scratch + round % 8, size, got, &n_got,
					       &f_got));
		ASSERT_EQ(n_want, n_got);
		ASSERT_EQ(f_want, f_got);
		ASSERT_EQ(memcmp(want, got, n_want * sizeof(uint32_t)), 0);
		free(want);
		free(got);
		evict_case_free(&c);
	}
	free(scratch);
}

/* ---- Blocks and the needle guard ---- */

static void check_blocks_case(const float *tok, uint32_t n, uint32_t bt, uint32_t ppm) {
	uint32_t nb = n / bt + (n % bt != 0);
	float *ba = xcalloc(nb, sizeof(float)), *bb = xcalloc(nb, sizeof(float));
	uint8_t *na = xcalloc(nb, 1), *nbk = xcalloc(nb, 1);

	ASSERT_OK(kvd_block_scores_ref(tok, n, bt, ppm, ba, na));
	ASSERT_OK(kvd_block_scores(tok, n, bt, ppm, bb, nbk));
	ASSERT_EQ(memcmp(ba, bb, nb * sizeof(float)), 0);
	ASSERT_EQ(memcmp(na, nbk, nb), 0);
	free(ba);
	free(bb);
	free(na);
	free(nbk);
}

TEST(blocks_sum_partial_last) {
	const float tok[] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };
	float blocks[3];
	uint8_t needle[3];

	ASSERT_OK(kvd_block_scores(tok, 10, 4, 0, blocks, needle));
	ASSERT_TRUE(blocks[0] == 10 && blocks[1] == 26 && blocks[2] == 19);
	ASSERT_TRUE(!needle[0] && !needle[1] && !needle[2]);
	/* 1000 ppm of 10 tokens rounds up to one needle: the 10, in block 2. */
	ASSERT_OK(kvd_block_scores(tok, 10, 4, 1000, blocks, needle));
	ASSERT_TRUE(!needle[0] && !needle[1] && needle[2]);
	ASSERT_OK(kvd_block_scores(tok, 10, 4, 1000, blocks, NULL));
	check_blocks_case(tok, 10, 4, 1000);
	check_blocks_case(tok, 10, 3, 500000);
	check_blocks_case(tok, 10, 16, 1000000);
	ASSERT_ERRNO(kvd_block_scores(tok, 10, 0, 0, blocks, needle), -EINVAL);
	ASSERT_ERRNO(kvd_block_scores(tok, 10, 4, 1000001, blocks, needle), -EINVAL);
	ASSERT_OK(kvd_block_scores(NULL, 0, 4, 1000, NULL, NULL));
}

TEST(blocks_needle_guard) {
	uint32_t n = 4096, bt = 16, nb = n / bt;
	/* Room for the one-token blocks at the end. */
	float *tok = xcalloc(n, sizeof(float)), *blocks = xcalloc(n, sizeof(float));
	uint8_t *needle = xcalloc(n, 1);
	uint32_t pinned = 0;

	/* Every block sums to 16 but block 100, whose single needle sums it to 8. */
	for (uint32_t i = 0; i < n; i++)
		tok[i] = 1;
	for (uint32_t i = 100 * bt; i < 101 * bt; i++)
		tok[i] = 0;
	tok[100 * bt + 7] = 8;
	ASSERT_OK(kvd_block_scores(tok, n, bt, KVD_NEEDLE_PPM_DEFAULT, blocks, needle));
	ASSERT_TRUE(blocks[100] == 8 && blocks[99] == 16);
	/* ceil(4096 * 0.001) = 5 needles: the 8, then the four lowest-index 1s (block 0). */
	ASSERT_TRUE(needle[100] && needle[0]);
	for (uint32_t b = 0; b < nb; b++)
		pinned += needle[b];
	ASSERT_EQ(pinned, 2u);
	check_blocks_case(tok, n, bt, KVD_NEEDLE_PPM_DEFAULT);

	/* NaN tokens make their block NaN and are never needles; inf + -inf is NaN too. */
	tok[5 * bt] = NAN;
	tok[6 * bt] = INFINITY;
	tok[6 * bt + 1] = -INFINITY;
	tok[7 * bt] = INFINITY;
	ASSERT_OK(kvd_block_scores(tok, n, bt, KVD_NEEDLE_PPM_DEFAULT, blocks, needle));
	ASSERT_TRUE(isnan(blocks[5]) && isnan(blocks[6]) && isinf(blocks[7]));
	ASSERT_TRUE(!needle[5] && needle[6] && needle[7] && needle[100]);
	check_blocks_case(tok, n, bt, KVD_NEEDLE_PPM_DEFAULT);
	for (uint32_t i = 0; i < n; i++)
		tok[i] = NAN;
	ASSERT_OK(kvd_block_scores(tok, n, bt, KVD_NEEDLE_PPM_DEFAULT, blocks, needle));
	for (uint32_t b = 0; b < nb; b++)
		ASSERT_FALSE(needle[b]);
	check_blocks_case(tok, n, bt, 1000000);

	/* The count rounds up: 1000 tokens at 1000 ppm guard one, 1001 guard two. */
	for (uint32_t i = 0; i < 1001; i++)
		tok[i] = (float)i;
	ASSERT_OK(kvd_block_scores(tok, 1000, 1, 1000, blocks, needle));
	ASSERT_TRUE(needle[999] && !needle[998]);
	ASSERT_OK(kvd_block_scores(tok, 1001, 1, 1000, blocks, needle));
	ASSERT_TRUE(needle[1000] && needle[999] && !needle[998]);
	free(tok);
	free(blocks);
	free(needle);
}

TEST(blocks_random_matches_reference) {
	static const uint32_t sizes[] = { 1, 15, 16, 17, 1000, 4096, 100000, TEST_SIZE(1000000, 200000) };
	static const uint32_t bts[] = { 1, 16, 7, 256 };
	static const uint32_t ppms[] = { 0, 1, 1000, 100000, 1000000 };
	uint64_t s = 11;

	for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
		for (int dist = 0; dist < DIST_MAX; dist++) {
			float *tok = random_scores(&s, sizes[si], dist);

			check_blocks_case(tok, sizes[si], bts[rng_below(&s, 4)], ppms[rng_below(&s, 5)]);
			free(tok);
		}
}
