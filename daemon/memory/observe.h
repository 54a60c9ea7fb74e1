/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What a round scores against, besides the resident K/V: each sequence's observation
 * buffer (the engine's last `window` queries per layer) and each model's Gram matrices
 * G_h = W_o^h W_o^hT (docs/algorithms.md §6), derived from the output projection the engine
 * uploads once per layer.
 *
 * Rounds read both from worker threads while the loop goes on, so both are reference
 * counted (atomically): a sequence released or a layer re-uploaded mid-round leaves the
 * round's references valid until it drops them.
 *
 * The observation buffer is shared writable with its owner, so nothing in it is trusted:
 * the daemon keeps its own copy of the geometry, and reads queries as plain numbers (a
 * torn or hostile window only changes its owner's scores; the kernels rank NaN lowest).
 */

#include <stdint.h>

#include "kvd/kvd-abi.h"
#include "model.h"

struct obs {
	int refs;
	void *map;                    /* the daemon's read-only mapping */
	struct kvd_obs_header geo;    /* the geometry as the daemon wrote it */
};

/*
 * Creates the observation buffer of a sequence of model m (m->obs_bytes of it): a memfd
 * sealed against resizing, with its header written and every stamp 0. *ret_fd receives
 * the fd to send to the client (the caller closes it). Returns 0, -ENOMEM or -errno.
 */
int obs_new(const struct model *m, uint64_t seq_id, struct obs **ret, int *ret_fd);
struct obs *obs_ref(struct obs *o);
struct obs *obs_unref(struct obs *o);

/* The stamp of layer l (0: no window yet), read once with acquire ordering. */
uint64_t obs_stamp(const struct obs *o, uint32_t l);
/* Layer l's queries: [q_heads][window][head_dim] of the model's dtype. */
const void *obs_queries(const struct obs *o, uint32_t l);
/* Layer l's index queries (models with an indexer): [window][index_heads][index_dim]. */
const void *obs_index_queries(const struct obs *o, uint32_t l);

/* One layer's Gram matrices, [q_heads][head_dim][head_dim] fp32. */
struct gram_layer {
	int refs;
	uint64_t floats;
	float g[];
};

struct grams {
	uint32_t layers;
	struct gram_layer **layer;    /* [layers], NULL until uploaded */
};

struct gram_layer *gram_layer_ref(struct gram_layer *g);
struct gram_layer *gram_layer_unref(struct gram_layer *g);

/* Largest Gram state of one model (all layers), a bound on what a client makes us keep. */
#define GRAMS_MODEL_MAX (UINT64_C(1) << 30)

/* A client's output projection, mapped read-only: wo[hidden][q_heads * head_dim]. */
struct wo_map {
	void *map;
	uint64_t bytes;
	uint32_t dtype, hidden, q_heads, head_dim;
};

/*
 * Checks an upload for layer `layer` of m: fd must be a memfd sealed with F_SEAL_WRITE,
 * F_SEAL_SHRINK and F_SEAL_GROW holding wo[hidden][q_heads * head_dim] of dtype
 * (KVD_DTYPE_*), and maps it into *ret. Returns 0, or -EINVAL (bad layer, dtype, hidden,
 * seals or size), -EFBIG (the model's Gram state would pass GRAMS_MODEL_MAX), -errno;
 * *ret_why says which.
 */
int grams_check(const struct model *m, uint32_t layer, int fd, uint32_t dtype, uint32_t hidden,
                struct wo_map *ret, const char **ret_why);
void wo_map_done(struct wo_map *wo);

/* Computes the layer's Gram matrices from wo: pure, so it runs on any thread (upload.h).
 * Returns 0 or -ENOMEM. */
int gram_layer_compute(const struct wo_map *wo, struct gram_layer **ret);

/* Makes g (a reference the caller gives away) layer `layer`'s; rounds holding the old
 * one keep it. Returns 0 or -ENOMEM (g is not taken). */
int grams_install(struct model *m, uint32_t layer, struct gram_layer *g);

/* Frees m's Gram state (layers still referenced by a round live on). */
void grams_free(struct model *m);
