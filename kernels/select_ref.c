/* SPDX-License-Identifier: MIT */
/*
 * The reference selections: sort everything by the order of select.h with a comparator
 * written straight from its rules, then walk the sorted list. O(n log n) and obviously
 * right; select.c must return exactly the same sets.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "select.h"

/* One item: its score and its position in the concatenation of the rows. */
struct ref_item {
	float score;
	uint32_t row, index;
	uint64_t pos;
};

/* <0 if a ranks higher than b (kept first), >0 if lower; never 0 for distinct items. */
static int ref_rank(const void *pa, const void *pb) {
	const struct ref_item *a = pa, *b = pb;
	int na = isnan(a->score), nb = isnan(b->score);

	if (na != nb)
		return na ? 1 : -1;
	if (!na && a->score > b->score)
		return -1;
	if (!na && a->score < b->score)
		return 1;
	/* Equal (both NaN, or -0.0 == +0.0 and the like): the lower position ranks higher. */
	return a->pos < b->pos ? -1 : a->pos > b->pos ? 1 : 0;
}

static int ref_by_pos(const void *pa, const void *pb) {
	const struct ref_item *a = pa, *b = pb;

	return a->pos < b->pos ? -1 : a->pos > b->pos;
}

int kvd_topk_rows_ref(const float *const *rows, const uint32_t *lens, uint32_t n_rows, uint64_t k,
		      unsigned threads, uint32_t *ret_counts, uint32_t *ret_keep) {
	struct ref_item *it;
	uint64_t total = 0, pos = 0;

	(void)threads;
	if (n_rows > 0 && (!rows || !lens || !ret_counts))
		return -EINVAL;
	for (uint32_t r = 0; r < n_rows; r++) {
		if (lens[r] > 0 && !rows[r])
			return -EINVAL;
		total += lens[r];
	}
	if (k > total || (k > 0 && !ret_keep))
		return -EINVAL;
	if (total > SIZE_MAX / sizeof(*it))
		return -ENOMEM;
	it = malloc((total ? total : 1) * sizeof(*it));
	if (!it)
		return -ENOMEM;
	for (uint32_t r = 0; r < n_rows; r++)
		for (uint32_t i = 0; i < lens[r]; i++, pos++)
			it[pos] = (struct ref_item){ rows[r][i], r, i, pos };
	qsort(it, total, sizeof(*it), ref_rank);
	/* The first k are kept; back into row order for the output. */
	qsort(it, k, sizeof(*it), ref_by_pos);
	for (uint32_t r = 0; r < n_rows; r++)
		ret_counts[r] = 0;
	for (uint64_t j = 0; j < k; j++) {
		ret_counts[it[j].row]++;
		ret_keep[j] = it[j].index;
	}
	free(it);
	return 0;
}

int kvd_topk_ref(const float *scores, uint32_t n, uint32_t k, uint32_t *keep) {
	uint32_t count;

	if ((n > 0 && !scores) || k > n)
		return -EINVAL;
	return kvd_topk_rows_ref(&scores, &n, 1, k, 1, &count, keep);
}

int kvd_evict_greedy_ref(const struct kvd_evict_in *in, uint32_t *ret_ids, uint32_t *ret_n_ids,
			 uint64_t *ret_freed) {
	struct ref_item *it = NULL;
	uint32_t *group_of = NULL, *units = NULL, m = 0, n_ids = 0;
	uint64_t *bytes_out = NULL, freed = 0;
	uint8_t *closed = NULL;
	uint32_t n_groups;
	int r = -ENOMEM;

	if (!in || !ret_n_ids || !ret_freed || (in->n > 0 && (!in->value || !in->bytes || !ret_ids)))
		return -EINVAL;
	if (in->n_groups > 0) {
		if (!in->group_start || in->group_start[0] != 0 || in->group_start[in->n_groups] != in->n)
			return -EINVAL;
		for (uint32_t g = 0; g < in->n_groups; g++)
			if (in->group_start[g] > in->group_start[g + 1])
				return -EINVAL;
	}
	n_groups = in->n_groups ? in->n_groups : 1;

	it = malloc((in->n ? in->n : 1) * sizeof(*it));
	group_of = malloc((in->n ? in->n : 1) * sizeof(*group_of));
	units = calloc(n_groups, sizeof(*units));
	bytes_out = calloc(n_groups, sizeof(*bytes_out));
	closed = calloc(n_groups, 1);
	if (!it || !group_of || !units || !bytes_out || !closed)
		goto out;
	for (uint32_t g = 0, i = 0; i < in->n; i++) {
		while (in->n_groups > 0 && i >= in->group_start[g + 1])
			g++;
		group_of[i] = g;
	}

	/* Evictable units, highest density first: the greedy walks the list from the end. */
	for (uint32_t i = 0; i < in->n; i++)
		if (in->bytes[i] > 0 && !(in->pinned && in->pinned[i]))
			it[m++] = (struct ref_item){ kvd_density(in->value[i], in->bytes[i]), 0, i, i };
	qsort(it, m, sizeof(*it), ref_rank);
	for (uint32_t j = m; j-- > 0 && freed < in->target;) {
		uint32_t i = it[j].index, g = group_of[i], b = in->bytes[i];

		if (closed[g])
			continue;
		if ((in->group_max_units && units[g] + 1 > in->group_max_units[g]) ||
		    (in->group_max_bytes && bytes_out[g] + b > in->group_max_bytes[g])) {
			/* The group reached its floor: none of its later units go. */
			closed[g] = 1;
			continue;
		}
		units[g]++;
		bytes_out[g] += b;
		freed += b;
		/* it[] is done with, and ids go in ascending order: collect them at its front. */
		it[n_ids++].pos = i;
	}
	qsort(it, n_ids, sizeof(*it), ref_by_pos);
	for (uint32_t j = 0; j < n_ids; j++)
		ret_ids[j] = (uint32_t)it[j].pos;
	*ret_n_ids = n_ids;
	*ret_freed = freed;
	r = 0;
out:
	free(it);
	free(group_of);
	free(units);
	free(bytes_out);
	free(closed);
	return r;
}

int kvd_block_scores_ref(const float *tok, uint32_t n_tok, uint32_t block_tokens,
			 uint32_t needle_ppm, float *ret_blocks, uint8_t *ret_needle) {
	uint32_t n_blocks, m, *top;
	int r;

	if (block_tokens == 0 || needle_ppm > 1000000 || (n_tok > 0 && (!tok || !ret_blocks)))
		return -EINVAL;
	n_blocks = n_tok / block_tokens + (n_tok % block_tokens != 0);
	for (uint32_t b = 0; b < n_blocks; b++) {
		double sum = 0;

		for (uint64_t i = (uint64_t)b * block_tokens; i < n_tok && i < (uint64_t)(b + 1) * block_tokens; i++)
			sum += tok[i];
		ret_blocks[b] = (float)sum;
	}
	if (!ret_needle)
		return 0;
	for (uint32_t b = 0; b < n_blocks; b++)
		ret_needle[b] = 0;
	m = (uint32_t)(((uint64_t)needle_ppm * n_tok + 999999) / 1000000);
	top = malloc((m ? m : 1) * sizeof(*top));
	if (!top)
		return -ENOMEM;
	r = kvd_topk_ref(tok, n_tok, m, top);
	for (uint32_t j = 0; r >= 0 && j < m; j++)
		if (!isnan(tok[top[j]]))
			ret_needle[top[j] / block_tokens] = 1;
	free(top);
	return r;
}
