/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The KV cache of a kvd-lm sequence, behind one interface with two implementations:
 *
 *   - full: a private cache that keeps every token of every (layer, kv head), fp32, in this
 *     process. The reference: attention sees the whole context.
 *   - kvd: the sequence's K/V live in kvd blocks through libkvd (KVD_LAYOUT_PER_HEAD, f32,
 *     16 tokens a block). The daemon may evict tokens between steps, per (layer, kv head)
 *     with KVD_UNIT_HEAD_TOKEN, so tables hold different numbers of tokens; survivors keep
 *     their original positions, which attention masks and RoPE use. With compensation,
 *     each table's view also carries the MomentKV moments or the IndexMem latent memory of
 *     what was evicted from it, which attention adds as one more softmax entry
 *     (kernels/moments.h, kernels/indexmem.h). With an indexer, each slot also has an
 *     index key, and the observation window the index queries.
 *
 * A forward step (forward.c) goes:
 *
 *   kvdlm_cache_begin(c, n, &pos0)   append n tokens at positions pos0 .. pos0+n-1
 *                                    (kvd: grow, which may wait for an eviction round,
 *                                    then pin, so that nothing moves until _end)
 *   for each layer:
 *       kvdlm_cache_view(c, layer, kv_head)   where each table's slots are; the caller
 *                                             writes K (after RoPE) and V of its new tokens
 *                                             into the slots from first_new on, then
 *                                             attends over them by position
 *       kvdlm_cache_observe(c, layer, q, ...) the layer's new post-RoPE queries (kvd: the
 *                                             observation window the daemon scores with)
 *   kvdlm_cache_end(c)               kvd: unpin, then drain the client's events
 *
 * Views are valid from _begin to _end. Both implementations keep positions ascending
 * within a table. A cache serves one sequence and is used from one thread at a time; views
 * may be read and their new slots written from any thread in between.
 */

#include <stddef.h>
#include <stdint.h>

#include "indexmem.h"
#include "kvd/kvd.h"
#include "model.h"
#include "moments.h"

/* Tokens per kvd block. */
#define KVDLM_KVD_BLOCK_TOKENS 16u
/* The private cache's largest max_tokens (1M tokens per table). */
#define KVDLM_FULL_MAX_TOKENS (1u << 20)

struct kvdlm_cache;

/* Where a table's slots are during a step. */
struct kvdlm_kv_view {
	uint32_t n;            /* resident slots */
	uint32_t block_tokens; /* slots per block: slot j is row j % block_tokens of block j / block_tokens */
	uint32_t first_new;    /* slots from here on hold this step's tokens, at pos[j] - pos0 */
	const uint32_t *pos;   /* [n]: original positions, ascending */
	float *const *k;       /* [DIV_ROUND_UP(n, block_tokens)]: each block's K rows, [block_tokens][head_dim] */
	float *const *v;       /* the same for V */
	/* The summary of the tokens evicted from the table (kvd with moments), read-only; NULL
	 * when there is none or nothing was evicted yet, so that a cache that lost nothing
	 * attends exactly as the full cache does. form: how attention adds it. */
	const struct kvd_moments *moments;
	enum kvd_moments_form form;
	/* The same for IndexMem's latent memory (kvd with latent compensation). */
	const struct kvd_latent *latent;
	/* kvd with an indexer: each block's index key rows, [block_tokens][index_dim], for the
	 * caller to write with the K/V of its new tokens; NULL without. */
	float *const *ik;
};

/* Tokens in a cache so far. */
struct kvdlm_cache_stats {
	uint64_t positions;     /* tokens appended: the next position */
	uint64_t resident;      /* tokens resident, summed over tables */
	uint32_t tables;        /* layers * kv_heads */
	uint32_t resident_min;  /* the emptiest table's tokens */
	uint32_t resident_max;
	uint64_t changed;       /* KVD_EVENT_SEQ_CHANGED events seen for the sequence (kvd) */
};

/*
 * A private full cache for up to max_tokens tokens (1..KVDLM_FULL_MAX_TOKENS). Returns 0, or
 * -EINVAL, -ENOMEM.
 */
int kvdlm_cache_full_new(const struct kvdlm_config *cfg, uint32_t max_tokens, struct kvdlm_cache **ret);

/* A model registered with a daemon, for kvdlm_cache_kvd_new(). */
struct kvdlm_kvd_model {
	kvd_client *client; /* borrowed: must outlive every cache made from this */
	int model_id;
	uint32_t unit;      /* KVD_UNIT_* */
	uint32_t window;    /* observation window */
	uint32_t observe;   /* whether the daemon takes observations (not with KVD_UNIT_NONE) */
	uint32_t compensation;     /* KVD_COMPENSATION_* */
	enum kvd_moments_form form; /* with moments: the correction attention applies (plain by
	                             * default; the caller may change it before making caches) */
	uint32_t index_heads, index_dim; /* the indexer registered (0: none) */
};

/*
 * Registers m with the daemon behind client: per-head layout, f32, KVDLM_KVD_BLOCK_TOKENS
 * tokens a block, eviction unit `unit` (KVD_UNIT_*) with `window` (1..256) and the default
 * sinks; then uploads every layer's wo (kvd_model_output_proj) unless unit is
 * KVD_UNIT_NONE, retrying while the daemon answers -EBUSY. Returns 0 and *ret, or the
 * errors of kvd_model_register_evictable() and kvd_model_output_proj() (the daemon's message
 * in kvd_client_last_error()).
 */
int kvdlm_kvd_register(kvd_client *client, const struct kvdlm_model *m, const char *name,
                       uint32_t unit, uint32_t window, struct kvdlm_kvd_model *ret);

/* kvdlm_kvd_register() with compensation (KVD_COMPENSATION_*; moments need a unit). Errors
 * as there, and those of kvd_model_register_compensated(). */
int kvdlm_kvd_register_compensated(kvd_client *client, const struct kvdlm_model *m, const char *name,
                                   uint32_t unit, uint32_t window, uint32_t compensation,
                                   struct kvdlm_kvd_model *ret);

/* kvdlm_kvd_register_compensated() with an indexer ix (NULL: none; needs a unit), and
 * compensation possibly KVD_COMPENSATION_LATENT. Errors as there, and those of
 * kvd_model_register_indexed(). */
int kvdlm_kvd_register_indexed(kvd_client *client, const struct kvdlm_model *m, const char *name,
                               uint32_t unit, uint32_t window, uint32_t compensation,
                               const kvd_index_spec *ix, struct kvdlm_kvd_model *ret);

/*
 * A cache whose K/V live in one new kvd sequence of km, of up to max_tokens tokens per
 * table. Returns 0, or the errors of kvd_seq_open(), -ENOMEM.
 */
int kvdlm_cache_kvd_new(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                        uint32_t max_tokens, struct kvdlm_cache **ret);

/*
 * A cache whose kvd sequence starts with the blocks of the prompt tokens[n] that sequences
 * of this tenant published (kvd_seq_open_params with the prompt's keys, from the root of
 * seed "kvd-lm"); kvd_seq_tokens() of kvdlm_cache_seq() says how many tokens it found, and the caller
 * prefills the rest. Publish the prompt's blocks with kvdlm_cache_kvd_publish() once
 * prefilled. Returns 0, or -EINVAL, the errors of kvd_seq_open_params(), -ENOMEM.
 */
int kvdlm_cache_kvd_open_prefix(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                                uint32_t max_tokens, const uint32_t *tokens, uint32_t n,
                                struct kvdlm_cache **ret);

/* Publishes the full blocks of the prompt c was opened with (kvd_seq_publish()). */
int kvdlm_cache_kvd_publish(struct kvdlm_cache *c);

/*
 * A cache over a fork of kvd cache parent's sequence (kvd_seq_fork(): its full blocks
 * shared), with parent's positions and recent queries, between steps. Returns 0, or
 * -EINVAL, the errors of kvd_seq_fork(), -ENOMEM.
 */
int kvdlm_cache_kvd_fork(const struct kvdlm_kvd_model *km, const struct kvdlm_config *cfg,
                         const struct kvdlm_cache *parent, struct kvdlm_cache **ret);

/* Frees c (kvd: releases the sequence); accepts NULL; returns NULL. */
struct kvdlm_cache *kvdlm_cache_free(struct kvdlm_cache *c);

static inline void kvdlm_cache_freep(struct kvdlm_cache **c) {
	if (c && *c)
		kvdlm_cache_free(*c);
}

/*
 * Starts a step that appends n >= 1 tokens; *ret_pos0 gets the first one's position.
 * All or nothing, except that with kvd a failure after the grow (of kvd_seq_pin(), or
 * -EPROTO for a descriptor that breaks kvd.h) leaves granted slots that were never written:
 * free the cache then. Returns 0, or -EINVAL (n 0, or a step already begun), -EFBIG (past
 * max_tokens), kvd: the errors of kvd_seq_grow() (-ENOSPC, -EDQUOT, ...), kvd_seq_pin(),
 * kvd_seq_block(), kvd_seq_moments(), kvd_seq_latent(), -EPROTO.
 */
int kvdlm_cache_begin(struct kvdlm_cache *c, uint32_t n, uint32_t *ret_pos0);

/* The view of (layer, kv_head) during a step; NULL out of range or outside a step. */
const struct kvdlm_kv_view *kvdlm_cache_view(const struct kvdlm_cache *c, uint32_t layer,
                                             uint32_t kv_head);

/*
 * The step's n post-RoPE queries of layer, row i (all q heads, [q_heads][head_dim]) at
 * q + i * ldq, and with an indexer their index queries iq[n][index_heads][index_dim] (NULL
 * without). The full cache ignores them; kvd keeps the last `window` and publishes them
 * once the sequence holds at least `window` tokens. Returns 0, or -EINVAL (also iq NULL
 * for a cache with an indexer), or the errors of kvd_seq_observation(),
 * kvd_seq_index_observation() and kvd_seq_observe().
 */
int kvdlm_cache_observe(struct kvdlm_cache *c, uint32_t layer, const float *q, size_t ldq, uint32_t n,
                        const float *iq);

/*
 * Ends the step (kvd: unpins, which applies an eviction plan that waited, then reads the
 * client's events). Returns 0, or -EINVAL (no step), the errors of kvd_seq_unpin() and
 * kvd_client_next_event() (-ECONNRESET when the daemon went away).
 */
int kvdlm_cache_end(struct kvdlm_cache *c);

/* The indexer's index heads and dimension (0 for caches without one). */
uint32_t kvdlm_cache_index_heads(const struct kvdlm_cache *c);
uint32_t kvdlm_cache_index_dim(const struct kvdlm_cache *c);

/* The next position (tokens appended so far). */
uint32_t kvdlm_cache_position(const struct kvdlm_cache *c);

/* Fills *ret. kvd: the tables are read pinned, so that no round rewrites them meanwhile.
 * Returns 0, or the errors of kvd_seq_pin()/kvd_seq_unpin(). */
int kvdlm_cache_stats(struct kvdlm_cache *c, struct kvdlm_cache_stats *ret);

/*
 * Makes the queries kvd cache dst has seen those of kvd cache src (same model and window):
 * the recent queries it publishes as its observation windows. What a cell whose K/V are a
 * byte copy of src's needs, so that its next steps publish the windows a cache that ran
 * src's steps itself would (index queries too, where dst has an indexer: then src must
 * have the same). Returns 0, or -EINVAL (not two kvd caches of one geometry).
 */
int kvdlm_cache_copy_queries(struct kvdlm_cache *dst, const struct kvdlm_cache *src);

/* The kvd sequence of a kvd cache, NULL for the full cache. */
kvd_seq *kvdlm_cache_seq(const struct kvdlm_cache *c);
