/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A registered model shape: what fixes a sequence's block size and table count. Models
 * belong to the connection that registered them.
 */

#include <stdbool.h>
#include <stdint.h>

#include "kvd.pb-c.h"
#include "kvd/kvd-abi.h"

#define MODEL_NAME_MAX 63

struct grams;

struct model {
	uint32_t id;
	char name[MODEL_NAME_MAX + 1];
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout;
	uint64_t block_bytes;  /* K and V of one block, and its index keys */
	uint32_t n_tables;     /* layers, or layers * kv_heads with the per-head layout */
	/* Eviction: KVD_UNIT_* (NONE: never evicted), window w, sinks. */
	uint32_t unit, window, sinks;
	uint64_t obs_bytes;    /* observation buffer size, 0 without eviction */
	/* KVD_COMPENSATION_*; with compensation, the size of one (layer, kv head)'s block
	 * (moments or latent). */
	uint32_t compensation;
	uint64_t moments_bytes;
	/* The indexer (0: none): index key rows start at index_offset in every block. */
	uint32_t index_heads, index_dim;
	uint64_t index_offset;
	struct grams *grams;   /* from the output projections (observe.h); NULL until set */
};

/*
 * Validates a registration against the limits in model.c, the chunk size and the largest
 * observation buffer, and fills *m (grams NULL). Returns 0, or -EINVAL or -EFBIG (the
 * observation buffer is too large) with a reason in *ret_why.
 */
int model_from_request(const Kvd__V1__RegisterModel *req, uint64_t chunk_bytes,
                       uint64_t max_obs_bytes, struct model *m, const char **ret_why);

/* Whether blocks of a and b hold the same K/V for the same content (a key of one names a
 * block of the other: prefix.h): both named, the same name, and the same block layout. */
bool model_same_kv(const struct model *a, const struct model *b);

/* Size of an observation buffer for the shape (index queries included when index_dim is
 * not 0), and its header in *ret (may be NULL). */
uint64_t model_obs_bytes(uint32_t layers, uint32_t q_heads, uint32_t window, uint32_t head_dim,
                         uint32_t dtype, uint32_t index_heads, uint32_t index_dim,
                         struct kvd_obs_header *ret);
