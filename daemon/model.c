/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/layout.h"
#include "common/macro.h"
#include "model.h"

#define MODEL_LAYERS_MAX 1024
#define MODEL_HEADS_MAX 1024
#define MODEL_HEAD_DIM_MAX 4096
#define MODEL_BLOCK_TOKENS_MAX 65536

int model_from_request(const Kvd__V1__RegisterModel *req, uint64_t chunk_bytes, struct model *m,
                       const char **ret_why) {
	uint64_t bytes;

#define REQUIRE(cond, why)                                                                    \
	do {                                                                                  \
		if (!(cond)) {                                                                \
			*ret_why = why;                                                       \
			return -EINVAL;                                                       \
		}                                                                             \
	} while (0)

	REQUIRE(req->has_layers && req->layers >= 1 && req->layers <= MODEL_LAYERS_MAX,
	        "layers must be 1..1024");
	REQUIRE(req->has_q_heads && req->q_heads >= 1 && req->q_heads <= MODEL_HEADS_MAX,
	        "q_heads must be 1..1024");
	REQUIRE(req->has_kv_heads && req->kv_heads >= 1 && req->kv_heads <= MODEL_HEADS_MAX,
	        "kv_heads must be 1..1024");
	REQUIRE(req->q_heads % req->kv_heads == 0, "q_heads must be a multiple of kv_heads");
	REQUIRE(req->has_head_dim && req->head_dim >= 1 && req->head_dim <= MODEL_HEAD_DIM_MAX,
	        "head_dim must be 1..4096");
	REQUIRE(req->has_dtype && layout_dtype_bytes(req->dtype) != 0, "unknown dtype");
	REQUIRE(req->has_block_tokens && req->block_tokens >= 1 &&
	                req->block_tokens <= MODEL_BLOCK_TOKENS_MAX,
	        "block_tokens must be 1..65536");
	REQUIRE(req->has_layout &&
	                (req->layout == KVD__V1__LAYOUT__LAYOUT_PER_LAYER ||
	                 req->layout == KVD__V1__LAYOUT__LAYOUT_PER_HEAD),
	        "unknown layout");
	REQUIRE(!req->name || strlen(req->name) <= MODEL_NAME_MAX, "name longer than 63 bytes");

	/* The limits above keep this below 2^53, but say so in code rather than in a proof. */
	bytes = 2 * (uint64_t)req->block_tokens * req->head_dim * layout_dtype_bytes(req->dtype);
	if (req->layout == KVD__V1__LAYOUT__LAYOUT_PER_LAYER)
		REQUIRE(mul_u64(bytes, req->kv_heads, &bytes) == 0, "block size overflows");
	REQUIRE(bytes <= chunk_bytes, "a block must fit in one chunk");

#undef REQUIRE
	memset(m, 0, sizeof(*m));
	snprintf(m->name, sizeof(m->name), "%s", req->name ? req->name : "");
	m->layers = req->layers;
	m->q_heads = req->q_heads;
	m->kv_heads = req->kv_heads;
	m->head_dim = req->head_dim;
	m->dtype = req->dtype;
	m->block_tokens = req->block_tokens;
	m->layout = req->layout;
	m->block_bytes = bytes;
	m->n_tables = m->layout == KVD_LAYOUT_PER_HEAD ? m->layers * m->kv_heads : m->layers;
	return 0;
}
