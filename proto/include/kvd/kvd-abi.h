/* SPDX-License-Identifier: MIT */
#ifndef KVD_KVD_ABI_H
#define KVD_KVD_ABI_H

/*
 * The kvd ABI: what the daemon and its clients share, in one place. The protocol version,
 * every limit both sides check, the numbers both sides use for dtypes, layouts, units and
 * events, and the layouts of the shared memory the daemon writes and clients map: the
 * sequence descriptor, the observation buffer and the compensation blocks. The daemon
 * includes this header and never libkvd's; libkvd's kvd.h includes it, so that engines see
 * it too. Nothing else defines these values. The layouts are checked below
 * (offsets and sizes), so that a change to one is a change to this file.
 *
 * The header compiles as C99 and C++ and uses fixed-width types only.
 */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Wire protocol versions this library speaks. */
#define KVD_PROTOCOL_VERSION_MIN 1
#define KVD_PROTOCOL_VERSION_MAX 1

/* Hello.features / HelloReply.features bits (kvd.proto): what a client offers in its hello
 * and, in the reply, what the daemon does for this connection. */
#define KVD_FEATURE_RING (UINT64_C(1) << 0)          /* per-step shared-memory rings */
#define KVD_FEATURE_DEVICE_CHUNKS (UINT64_C(1) << 1) /* the client imports GPU (cuMem) chunks */
#define KVD_FEATURE_SEQ_HEADER (UINT64_C(1) << 2)    /* descriptors carry header_bytes */
#define KVD_FEATURE_TENANT_POLICY (UINT64_C(1) << 3) /* TenantSet.policy is applied */
#define KVD_FEATURE_TIERS (UINT64_C(1) << 4)         /* host tier: TenantSet.tier, recalls */
#define KVD_FEATURE_RECALL (UINT64_C(1) << 5)        /* token recall: TenantSet.recall, SeqRecall */
#define KVD_FEATURE_FORK (UINT64_C(1) << 6)          /* SeqOpen.fork_of: forks share blocks */
#define KVD_FEATURE_PREFIX (UINT64_C(1) << 7)        /* SeqOpen.prefix_blocks, SeqPublish */
#define KVD_FEATURE_GROUPS (UINT64_C(1) << 8)        /* SeqOpen.group_size, group_of */

/* What a pin found (kvd_seq_pin_recall; SeqPinReply.recall; the ring's completion flags):
 * the sequence was resident; it was brought back from the host tier; it had been moved out
 * and could not be brought back (its tables are empty: it behaves as evicted whole); it was
 * brought back from the file tier. */
#define KVD_RECALL_NONE 0
#define KVD_RECALL_HOST 1
#define KVD_RECALL_LOST 2
#define KVD_RECALL_FILE 3  /* brought back from the file tier */

/* Token recall (TenantSet.recall, kvd_tenant_params.recall): tokens per row one recall may
 * bring back, at most. */
#define KVD_TENANT_RECALL_MAX (1u << 20)

/* Default socket path of a system-wide daemon. */
#define KVD_DEFAULT_SOCKET "/run/kvd/kvd.sock"

/* Values of kvd_model_spec.dtype (same numbers as the wire protocol). */
#define KVD_DTYPE_F16 1
#define KVD_DTYPE_BF16 2
#define KVD_DTYPE_F32 3

/* Values of kvd_model_spec.layout. */
#define KVD_LAYOUT_PER_LAYER 1
#define KVD_LAYOUT_PER_HEAD 2

/*
 * How the shared headers grow. The sequence descriptor's and the observation buffer's
 * headers only ever grow at their end: a field, once placed, stays where it is, so a reader
 * built against an older header reads a newer one as it is, and `version` stays 1.
 * `header_bytes` says how many bytes of the header the daemon wrote; a reader takes those
 * and reads every field past them as 0 (libkvd does: kvd_seq_header()). Daemons from before
 * libkvd 1.4 do not write it:
 *   - descriptor: a HelloReply without KVD_FEATURE_SEQ_HEADER says so; the header then ends
 *     at the lowest of tokens_offset, positions_offset and blocks_offset, and is at most
 *     KVD_SEQ_DESC_HEADER_LEGACY_MAX bytes (those daemons wrote 104, 128 or 144);
 *   - observation buffer: header_bytes reads 0 (the field was reserved, always 0); the
 *     header then ends at the lower of stamps_offset and q_offset, at most
 *     KVD_OBS_HEADER_LEGACY_MAX bytes.
 * Every daemon writes at least the fields up to total_bytes (KVD_SEQ_DESC_HEADER_MIN) and the
 * observation header's up to total_bytes (KVD_OBS_HEADER_MIN). A layout an older reader could
 * not read (a field moved) takes a new version number, and the daemon writes it only for
 * clients whose hello offers the feature bit that names it.
 */
#define KVD_SEQ_DESC_MAGIC 0x5344564bu /* "KVDS" */
#define KVD_SEQ_DESC_VERSION 1
#define KVD_SEQ_DESC_HEADER_MIN 104u
#define KVD_SEQ_DESC_HEADER_LEGACY_MAX 144u

/* Limits both sides check (kvd_model_spec, kvd_eviction_spec, kvd_index_spec, tenants). */
#define KVD_LAYERS_MAX 1024u
#define KVD_HEADS_MAX 1024u          /* q_heads and kv_heads */
#define KVD_HEAD_DIM_MAX 4096u
#define KVD_BLOCK_TOKENS_MAX 65536u
#define KVD_WINDOW_DEFAULT 32u       /* kvd_eviction_spec.window 0 */
#define KVD_WINDOW_MAX 256u
#define KVD_SINKS_DEFAULT_COUNT 4u   /* kvd_eviction_spec.sinks KVD_SINKS_DEFAULT */
#define KVD_SINKS_MAX 1024u
#define KVD_INDEX_HEADS_MAX 64u
#define KVD_INDEX_DIM_MAX 256u
/* A tenant's name: [A-Za-z0-9_.-], 1 to this many characters. */
#define KVD_TENANT_NAME_MAX 63u
/* A tenant's weight (kvd_tenant_params.weight, kvd.conf's weight): 1..this. */
#define KVD_TENANT_WEIGHT_MAX 10000u
/* Engine events (kvd_seq_unpin_after) one connection registers at most. */
#define KVD_CONN_EVENTS_MAX 16u

/* A block, named by the chunk that holds it and its index in that chunk. */
struct kvd_block_ref {
	uint32_t chunk_id;
	uint32_t index;
};

/* The head of a sequence descriptor, as the daemon writes it (see the top of this file). */
struct kvd_seq_desc {
	uint32_t magic;        /* KVD_SEQ_DESC_MAGIC */
	uint32_t version;      /* KVD_SEQ_DESC_VERSION */
	uint64_t generation;   /* sequence lock: odd while being rewritten */
	uint64_t seq_id;
	uint32_t layers;
	uint32_t kv_heads;
	uint32_t head_dim;
	uint32_t dtype;
	uint32_t block_tokens;
	uint32_t layout;
	uint32_t n_tables;
	uint32_t max_tokens;   /* slot capacity of every table */
	uint32_t max_blocks;   /* entries of every table's block list */
	uint32_t next_position; /* original position the next grown token will get */
	uint64_t block_bytes;  /* bytes of one block (K then V) */
	uint64_t tokens_offset;    /* byte offset of tokens[] from the descriptor start */
	uint64_t positions_offset; /* byte offset of positions[][] */
	uint64_t blocks_offset;    /* byte offset of blocks[][] */
	uint64_t total_bytes;      /* size of the whole descriptor */
	/* Compensation (kvd_model_register_compensated); all 0 without it, and from daemons
	 * that predate it. */
	uint32_t compensation;     /* KVD_COMPENSATION_* */
	uint32_t moments_blocks;   /* entries of moments[] in use: 0 until the first grow
	                            * allocates them, then layers * kv_heads */
	uint64_t moments_offset;   /* byte offset of struct kvd_block_ref moments[layers][kv_heads]:
	                            * the compensation blocks, moments or latent */
	uint64_t moments_bytes;    /* bytes of one compensation block: KVD_MOMENTS_BYTES(head_dim)
	                            * or KVD_LATENT_BYTES(head_dim) */
	/* Indexer (kvd_model_register_indexed); 0 without, and from daemons that predate it.
	 * Every block then holds, after its K and V (which fill index_offset bytes, so V starts
	 * at index_offset / 2), the index keys: [block_tokens][index_dim] of dtype at
	 * index_offset, one per slot; block_bytes counts them. With KVD_LAYOUT_PER_HEAD each
	 * (layer, kv head) table has its own copy, since its tokens may be evicted alone. */
	uint32_t index_heads;
	uint32_t index_dim;
	uint64_t index_offset;
	/* Since libkvd 1.4 (KVD_FEATURE_SEQ_HEADER): bytes of this header the daemon wrote. */
	uint32_t header_bytes;
	uint32_t reserved;         /* 0 */
};

/* kvd_tenant_set() values: leave unchanged; no cap (also how status reports no cap). */
#define KVD_TENANT_KEEP (UINT64_MAX - 1)
#define KVD_TENANT_NO_CAP UINT64_MAX

/* Events the daemon sends on its own; see kvd_client_next_event(). */
#define KVD_EVENT_STOPPING 1    /* the daemon is shutting down; the connection will close */
#define KVD_EVENT_SEQ_CHANGED 2 /* arg: a sequence id; an eviction rewrote its descriptor */
#define KVD_EVENT_DISCONNECTED 3 /* the connection to the daemon is lost; see
                                  * kvd_client_reconnect() */

/* Values of kvd_eviction_spec.unit: what one eviction frees (docs/architecture.md §5). */
#define KVD_UNIT_NONE 0        /* never evict this model's sequences */
#define KVD_UNIT_HEAD_TOKEN 1  /* a token of one (layer, kv head); needs KVD_LAYOUT_PER_HEAD */
#define KVD_UNIT_LAYER_TOKEN 2 /* a token of one layer, all kv heads */
#define KVD_UNIT_BLOCK 3       /* a full block of one table */

#define KVD_SINKS_DEFAULT UINT32_MAX

/* Values of kvd_model_register_compensated()'s compensation (same numbers as the wire). */
#define KVD_COMPENSATION_NONE 0    /* evicted K/V are gone */
#define KVD_COMPENSATION_MOMENTS 1 /* MomentKV moments of each (layer, kv head)'s evicted set */
#define KVD_COMPENSATION_LATENT 2  /* IndexMem's latent memory of each (layer, kv head)'s
                                    * evicted set */

/*
 * A moments block (KVD_COMPENSATION_MOMENTS): the summary of the tokens evicted so far from
 * one (layer, kv head) of a sequence (docs/algorithms.md §4), which the daemon folds every
 * eviction into, exactly, before the tokens' K/V leave the pool. The header is followed, at
 * KVD_MOMENTS_HEADER_BYTES, by fp32 arrays: mean_k[head_dim], mean_v[head_dim],
 * var_k[head_dim] (the diagonal of the keys' covariance) and cov_vk[head_dim][head_dim]
 * (row-major, cov_vk[a][b] = (1/count) sum (v_a - mean_v_a)(k_b - mean_k_b)). count 0: nothing
 * evicted yet, the arrays are 0. Keys are post-RoPE, as stored. Like the tables, a block is
 * only stable while the sequence is pinned. kvd_seq_moments() finds it; kernels/moments.h
 * has the attention correction that uses it. The two key bounds (libkvd 1.6) were reserved
 * words before, which daemons wrote as 0: a reader that finds count > 0 and both 0 has a
 * daemon that does not keep them (the bounded correction then falls back to the plain one).
 */
struct kvd_moments_header {
	uint64_t count;        /* tokens folded in */
	uint32_t head_dim;
	float key_norm_max;    /* max ||k|| over the evicted keys */
	float key_radius;      /* at least max ||k - mean_k|| over the evicted keys */
	uint32_t reserved[11];
};

#define KVD_MOMENTS_HEADER_BYTES 64
#define KVD_MOMENTS_BYTES(head_dim) \
	(KVD_MOMENTS_HEADER_BYTES + 4 * (3 * (uint64_t)(head_dim) + (uint64_t)(head_dim) * (head_dim)))

/*
 * A latent block (KVD_COMPENSATION_LATENT): IndexMem's memory of the tokens evicted so far
 * from one (layer, kv head) of a sequence (docs/algorithms.md §3), with the feature map
 * phi(x) = elu(x) + 1 applied to each element of the post-RoPE key: after the header, at
 * KVD_LATENT_HEADER_BYTES, fp32 z[head_dim] = sum phi(k) and s[head_dim][head_dim] =
 * sum phi(k) v^T (s[a][b] = sum phi(k_a) v_b). The daemon adds every eviction into it;
 * count 0: nothing evicted yet, the arrays are 0. Only stable while the sequence is
 * pinned. kvd_seq_latent() finds it; the readout is the engine's (learned weights), see
 * kernels/indexmem.h.
 */
struct kvd_latent_header {
	uint64_t count;        /* tokens folded in */
	uint32_t head_dim;
	uint32_t reserved[13];
};

#define KVD_LATENT_HEADER_BYTES 64
#define KVD_LATENT_BYTES(head_dim) \
	(KVD_LATENT_HEADER_BYTES + 4 * ((uint64_t)(head_dim) + (uint64_t)(head_dim) * (head_dim)))

/* Magic and version at the start of every observation buffer. */
#define KVD_OBS_MAGIC 0x4f44564bu /* "KVDO" */
#define KVD_OBS_VERSION 1
#define KVD_OBS_HEADER_MIN 64u
#define KVD_OBS_HEADER_LEGACY_MAX 88u

/*
 * The observation buffer of a sequence whose model has eviction on: the daemon creates it,
 * the owning process maps it writable. stamp[l] (uint64_t, at stamps_offset) tells which
 * window layer l holds: 0 for none, else the position just past the window's last query;
 * the queries are q[layer][q_heads][window][head_dim] of the model's dtype at q_offset,
 * post-RoPE, oldest first, layer_bytes per layer. kvd_seq_observation() and
 * kvd_seq_observe() write and stamp it.
 */
struct kvd_obs_header {
	uint32_t magic;        /* KVD_OBS_MAGIC */
	uint32_t version;      /* KVD_OBS_VERSION */
	uint32_t layers;
	uint32_t q_heads;
	uint32_t window;
	uint32_t head_dim;
	uint32_t dtype;
	uint32_t header_bytes; /* bytes of this header the daemon wrote; 0 before libkvd 1.4 */
	uint64_t stamps_offset;
	uint64_t q_offset;
	uint64_t layer_bytes;
	uint64_t total_bytes;
	/* With an indexer (0 without): iq[layer][window][index_heads][index_dim] of the model's
	 * dtype at iq_offset, iq_layer_bytes per layer, the index queries of the same window
	 * as q, covered by the same stamp. */
	uint32_t index_heads;
	uint32_t index_dim;
	uint64_t iq_offset;
	uint64_t iq_layer_bytes;
};

/*
 * The per-step rings (KVD_FEATURE_RING): one memfd per connection, which the daemon creates
 * and both sides map (proto/common/ring.h describes the protocol). The region starts with
 * struct kvd_ring_geometry, then seven 32-bit words, each alone at a multiple of
 * KVD_RING_LINE bytes (word i at (i + 1) * KVD_RING_LINE: sq_tail, sq_head, sq_wake,
 * cq_tail, cq_head, cq_wake, frames), then, at the geometry's offsets, the submission queue
 * (entries struct kvd_ring_sqe), the completion queue (entries struct kvd_ring_cqe) and
 * entries refusal messages of KVD_RING_MSG_BYTES.
 */
#define KVD_RING_MAGIC 0x474e524bu /* "KRNG" */
#define KVD_RING_VERSION 1
#define KVD_RING_ENTRIES_MIN 2u
#define KVD_RING_ENTRIES_MAX 4096u
/* Two cache lines: adjacent-line prefetchers fetch lines in pairs. */
#define KVD_RING_LINE 128
/* A refusal's text, NUL-terminated (the daemon's socket messages fit). */
#define KVD_RING_MSG_BYTES 128

/* struct kvd_ring_sqe.op: the per-step requests of kvd.proto. */
#define KVD_RING_OP_GROW 1    /* SeqGrow: arg is the number of tokens */
#define KVD_RING_OP_PIN 2     /* SeqPin */
#define KVD_RING_OP_UNPIN 3   /* SeqUnpin */
#define KVD_RING_OP_RELEASE 4 /* SeqRelease */

/* Completion flags: the refusal's text is in the completion slot's message; a pin's
 * recall (KVD_RECALL_*) in bits 1 and 2, 0 from daemons that predate tiers. */
#define KVD_RING_CQE_F_MESSAGE (1u << 0)
#define KVD_RING_CQE_F_RECALL_SHIFT 1
#define KVD_RING_CQE_F_RECALL_MASK (3u << KVD_RING_CQE_F_RECALL_SHIFT)

/* struct kvd_ring_geometry.doorbell: the values of kvd.proto's RingDoorbell. */
#define KVD_RING_DOORBELL_FUTEX 1
#define KVD_RING_DOORBELL_EVENTFD 2

struct kvd_ring_sqe {
	uint8_t op;          /* KVD_RING_OP_* */
	uint8_t flags;       /* 0 */
	uint16_t reserved;   /* 0 */
	uint32_t arg;
	uint64_t seq_id;
	uint64_t user_data;  /* echoed in the completion */
	uint64_t reserved2;  /* 0 */
};

struct kvd_ring_cqe {
	uint64_t user_data;
	int32_t res;         /* 0 or a negative errno */
	uint32_t flags;      /* KVD_RING_CQE_F_* */
	uint64_t generation; /* grow: the descriptor's generation after it */
	uint32_t tokens;     /* grow: resident tokens of the first table after it */
	uint32_t reserved;
};

struct kvd_ring_geometry {
	uint32_t magic;      /* KVD_RING_MAGIC */
	uint32_t version;    /* KVD_RING_VERSION */
	uint32_t entries;    /* of each queue, and messages: a power of two */
	uint32_t doorbell;   /* KVD_RING_DOORBELL_* */
	uint64_t total_bytes;
	uint64_t sq_offset, cq_offset, msg_offset; /* from the start of the region */
};

/* The layouts, as engines in other languages and older builds rely on them. */
#if defined(__cplusplus)
#define KVD_ABI_ASSERT(cond, what) static_assert(cond, what)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define KVD_ABI_ASSERT(cond, what) _Static_assert(cond, what)
#else
/* C99: an array type of negative size where the condition fails. */
#define KVD_ABI_CAT2(a, b) a##b
#define KVD_ABI_CAT(a, b) KVD_ABI_CAT2(a, b)
#define KVD_ABI_ASSERT(cond, what) typedef char KVD_ABI_CAT(kvd_abi_assert_, __LINE__)[(cond) ? 1 : -1]
#endif
KVD_ABI_ASSERT(sizeof(struct kvd_block_ref) == 8, "kvd_block_ref");
KVD_ABI_ASSERT(sizeof(struct kvd_seq_desc) == 152, "kvd_seq_desc");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, generation) == 8, "kvd_seq_desc.generation");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, tokens_offset) == 72, "kvd_seq_desc.tokens_offset");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, compensation) == 104, "kvd_seq_desc.compensation");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, index_offset) == 136, "kvd_seq_desc.index_offset");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, header_bytes) == KVD_SEQ_DESC_HEADER_LEGACY_MAX,
               "kvd_seq_desc.header_bytes");
KVD_ABI_ASSERT(offsetof(struct kvd_seq_desc, compensation) == KVD_SEQ_DESC_HEADER_MIN,
               "kvd_seq_desc: the fields every daemon writes");
KVD_ABI_ASSERT(sizeof(struct kvd_moments_header) == KVD_MOMENTS_HEADER_BYTES, "moments header");
KVD_ABI_ASSERT(sizeof(struct kvd_latent_header) == KVD_LATENT_HEADER_BYTES, "latent header");
KVD_ABI_ASSERT(sizeof(struct kvd_obs_header) == 88, "kvd_obs_header");
KVD_ABI_ASSERT(offsetof(struct kvd_obs_header, stamps_offset) == 32, "kvd_obs_header.stamps_offset");
KVD_ABI_ASSERT(offsetof(struct kvd_obs_header, iq_offset) == 72, "kvd_obs_header.iq_offset");
KVD_ABI_ASSERT(offsetof(struct kvd_obs_header, header_bytes) == 28, "kvd_obs_header.header_bytes");
KVD_ABI_ASSERT(offsetof(struct kvd_obs_header, index_heads) == KVD_OBS_HEADER_MIN,
               "kvd_obs_header: the fields every daemon writes");
KVD_ABI_ASSERT(sizeof(struct kvd_obs_header) == KVD_OBS_HEADER_LEGACY_MAX, "kvd_obs_header");
KVD_ABI_ASSERT(sizeof(struct kvd_ring_sqe) == 32, "kvd_ring_sqe");
KVD_ABI_ASSERT(sizeof(struct kvd_ring_cqe) == 32, "kvd_ring_cqe");
KVD_ABI_ASSERT(sizeof(struct kvd_ring_geometry) == 48, "kvd_ring_geometry");
KVD_ABI_ASSERT(offsetof(struct kvd_ring_cqe, generation) == 16, "kvd_ring_cqe.generation");
#undef KVD_ABI_ASSERT
#undef KVD_ABI_CAT
#undef KVD_ABI_CAT2

#ifdef __cplusplus
}
#endif

#endif
