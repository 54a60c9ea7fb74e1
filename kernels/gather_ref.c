/* SPDX-License-Identifier: MIT */
/* The reference gather: one memmove per row, slots in ascending order (see gather.h). */
#include <errno.h>
#include <string.h>

#include "gather.h"

int kvd_gather_table_check(const struct kvd_gather_table *t) {
	if (!t || t->block_tokens == 0 || t->heads == 0 || t->row_bytes == 0 ||
	    t->v_offset < (uint64_t)t->heads * t->block_tokens * t->row_bytes)
		return -EINVAL;
	return 0;
}

static char *row_addr(const struct kvd_gather_table *t, char *const *blocks, uint32_t slot,
		      uint32_t h, int v) {
	return blocks[slot / t->block_tokens] +
	       ((uint64_t)h * t->block_tokens + slot % t->block_tokens) * t->row_bytes +
	       (v ? t->v_offset : 0);
}

int kvd_gather_ref(const struct kvd_gather_table *t, char *const *src_blocks,
		   char *const *dst_blocks, const uint32_t *keep, uint32_t n_keep) {
	char *const *dst = dst_blocks ? dst_blocks : src_blocks;

	if (kvd_gather_table_check(t) < 0 || (n_keep > 0 && (!src_blocks || !keep)))
		return -EINVAL;
	for (uint32_t j = 1; j < n_keep; j++)
		if (keep[j] <= keep[j - 1])
			return -EINVAL;
	for (uint32_t j = 0; j < n_keep; j++)
		for (uint32_t h = 0; h < t->heads; h++)
			for (int v = 0; v < 2; v++)
				/* memmove: in place, keep[j] == j copies a row onto itself. */
				memmove(row_addr(t, dst, j, h, v), row_addr(t, src_blocks, keep[j], h, v),
					t->row_bytes);
	return 0;
}
