/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/layout.h"
#include "basic/macro.h"
#include "indexmem.h"
#include "model.h"


uint64_t model_obs_bytes(uint32_t layers, uint32_t q_heads, uint32_t window, uint32_t head_dim,
                         uint32_t dtype, uint32_t index_heads, uint32_t index_dim,
                         struct kvd_obs_header *ret) {
	struct kvd_obs_header h = {
		.magic = KVD_OBS_MAGIC,
		.version = KVD_OBS_VERSION,
		.layers = layers,
		.q_heads = q_heads,
		.window = window,
		.head_dim = head_dim,
		.dtype = dtype,
		.header_bytes = sizeof(struct kvd_obs_header),
		.index_heads = index_heads,
		.index_dim = index_dim,
	};

	/* layers, heads <= 1024, window <= 256, head_dim <= 4096, 4 bytes: below 2^52. */
	h.stamps_offset = ALIGN_TO(sizeof(h), 64);
	h.q_offset = ALIGN_TO(h.stamps_offset + 8ull * layers, 64);
	h.layer_bytes = (uint64_t)q_heads * window * head_dim * layout_dtype_bytes(dtype);
	h.total_bytes = h.q_offset + h.layer_bytes * layers;
	if (index_dim) {
		/* index_heads <= 64, index_dim <= 256: smaller than the queries' bound. */
		h.iq_offset = ALIGN_TO(h.total_bytes, 64);
		h.iq_layer_bytes = (uint64_t)window * index_heads * index_dim * layout_dtype_bytes(dtype);
		h.total_bytes = h.iq_offset + h.iq_layer_bytes * layers;
	}
	h.total_bytes = ALIGN_TO(h.total_bytes, 4096);
	if (ret)
		*ret = h;
	return h.total_bytes;
}

int model_from_request(const Kvd__V1__RegisterModel *req, uint64_t chunk_bytes,
                       uint64_t max_obs_bytes, struct model *m, const char **ret_why) {
	uint32_t unit = req->has_eviction_unit ? req->eviction_unit : KVD_UNIT_NONE;
	uint32_t window = req->has_window ? req->window : KVD_WINDOW_DEFAULT;
	uint32_t sinks = req->has_sinks ? req->sinks : KVD_SINKS_DEFAULT_COUNT;
	uint32_t compensation = req->has_compensation ? req->compensation : KVD_COMPENSATION_NONE;
	uint32_t index_heads = req->has_index_heads ? req->index_heads : 0;
	uint32_t index_dim = req->has_index_dim ? req->index_dim : 0;
	uint64_t bytes, index_bytes, comp_bytes, obs = 0;

#define REQUIRE(cond, why)                                                                    \
	do {                                                                                  \
		if (!(cond)) {                                                                \
			*ret_why = why;                                                       \
			return -EINVAL;                                                       \
		}                                                                             \
	} while (0)

	REQUIRE(req->has_layers && req->layers >= 1 && req->layers <= KVD_LAYERS_MAX,
	        "layers must be 1..1024");
	REQUIRE(req->has_q_heads && req->q_heads >= 1 && req->q_heads <= KVD_HEADS_MAX,
	        "q_heads must be 1..1024");
	REQUIRE(req->has_kv_heads && req->kv_heads >= 1 && req->kv_heads <= KVD_HEADS_MAX,
	        "kv_heads must be 1..1024");
	REQUIRE(req->q_heads % req->kv_heads == 0, "q_heads must be a multiple of kv_heads");
	REQUIRE(req->has_head_dim && req->head_dim >= 1 && req->head_dim <= KVD_HEAD_DIM_MAX,
	        "head_dim must be 1..4096");
	REQUIRE(req->has_dtype && layout_dtype_bytes(req->dtype) != 0, "unknown dtype");
	REQUIRE(req->has_block_tokens && req->block_tokens >= 1 &&
	                req->block_tokens <= KVD_BLOCK_TOKENS_MAX,
	        "block_tokens must be 1..65536");
	REQUIRE(req->has_layout &&
	                (req->layout == KVD__V1__LAYOUT__LAYOUT_PER_LAYER ||
	                 req->layout == KVD__V1__LAYOUT__LAYOUT_PER_HEAD),
	        "unknown layout");
	REQUIRE(!req->name || strlen(req->name) <= MODEL_NAME_MAX, "name longer than 63 bytes");
	REQUIRE(unit <= KVD_UNIT_BLOCK, "unknown eviction unit");
	REQUIRE(unit != KVD_UNIT_HEAD_TOKEN || req->layout == KVD__V1__LAYOUT__LAYOUT_PER_HEAD,
	        "head-token eviction needs the per-head layout");
	REQUIRE(window >= 1 && window <= KVD_WINDOW_MAX, "window must be 1..256");
	REQUIRE(sinks <= KVD_SINKS_MAX, "sinks must be 0..1024");
	REQUIRE(compensation <= KVD_COMPENSATION_LATENT, "unknown compensation");
	REQUIRE(compensation == KVD_COMPENSATION_NONE || unit != KVD_UNIT_NONE,
	        "compensation needs an eviction unit");
	comp_bytes = compensation == KVD_COMPENSATION_MOMENTS ? KVD_MOMENTS_BYTES(req->head_dim)
	             : compensation == KVD_COMPENSATION_LATENT ? KVD_LATENT_BYTES(req->head_dim)
	                                                       : 0;
	/* A compensation block is one (layer, kv head)'s summary: it cannot span chunks. */
	REQUIRE(comp_bytes <= chunk_bytes, "the compensation state of one head must fit in one chunk");
	REQUIRE(!index_heads == !index_dim, "index_heads and index_dim go together");
	REQUIRE(index_heads <= KVD_INDEX_HEADS_MAX && index_dim <= KVD_INDEX_DIM_MAX,
	        "index_heads must be 1..64 and index_dim 1..256");
	REQUIRE(index_dim == 0 || unit != KVD_UNIT_NONE, "an indexer needs an eviction unit");
	if (unit != KVD_UNIT_NONE) {
		obs = model_obs_bytes(req->layers, req->q_heads, window, req->head_dim, req->dtype,
		                      index_heads, index_dim, NULL);
		if (obs > max_obs_bytes) {
			*ret_why = "its observation buffer would exceed the daemon's max-observation-bytes";
			return -EFBIG;
		}
	}

	/* The limits above keep this below 2^53, but say so in code rather than in a proof. */
	bytes = 2 * (uint64_t)req->block_tokens * req->head_dim * layout_dtype_bytes(req->dtype);
	if (req->layout == KVD__V1__LAYOUT__LAYOUT_PER_LAYER)
		REQUIRE(mul_u64(bytes, req->kv_heads, &bytes) == 0, "block size overflows");
	/* Index keys: one row per slot after K and V (bounded like them). */
	index_bytes = (uint64_t)req->block_tokens * index_dim * layout_dtype_bytes(req->dtype);
	REQUIRE(bytes + index_bytes <= chunk_bytes, "a block must fit in one chunk");

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
	m->block_bytes = bytes + index_bytes;
	m->index_heads = index_heads;
	m->index_dim = index_dim;
	m->index_offset = index_dim ? bytes : 0;
	m->n_tables = m->layout == KVD_LAYOUT_PER_HEAD ? m->layers * m->kv_heads : m->layers;
	m->unit = unit;
	m->window = window;
	m->sinks = sinks;
	m->obs_bytes = obs;
	m->compensation = compensation;
	m->moments_bytes = comp_bytes;
	return 0;
}

bool model_same_kv(const struct model *a, const struct model *b) {
	if (a == b)
		return a->name[0] != '\0';
	return a->name[0] != '\0' && strcmp(a->name, b->name) == 0 && a->layers == b->layers &&
	       a->kv_heads == b->kv_heads && a->head_dim == b->head_dim && a->dtype == b->dtype &&
	       a->block_tokens == b->block_tokens && a->layout == b->layout &&
	       a->block_bytes == b->block_bytes && a->index_heads == b->index_heads &&
	       a->index_dim == b->index_dim;
}
