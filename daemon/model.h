/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * A registered model shape: what fixes a sequence's block size and table count. Models
 * belong to the connection that registered them.
 */

#include <stdint.h>

#include "kvd.pb-c.h"

#define MODEL_NAME_MAX 63

struct model {
	uint32_t id;
	char name[MODEL_NAME_MAX + 1];
	uint32_t layers, q_heads, kv_heads, head_dim, dtype, block_tokens, layout;
	uint64_t block_bytes;  /* K and V of one block */
	uint32_t n_tables;     /* layers, or layers * kv_heads with the per-head layout */
};

/*
 * Validates a registration against the limits below and the chunk size, and fills *m.
 * Returns 0 or -EINVAL with a reason in *ret_why.
 */
int model_from_request(const Kvd__V1__RegisterModel *req, uint64_t chunk_bytes, struct model *m,
                       const char **ret_why);
