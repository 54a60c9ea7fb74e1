/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * IndexMem weights for a kvd-lm model (eval/kvd-lm/README.md, "IndexMem"): per layer, the
 * indexer (kernels/indexmem.h, struct kvd_indexer_layer) and the latent memory's readout
 * (struct kvd_latent_readout plus a logit bias per query head), from a `.kvdim` file that
 * eval/kvd-lm/train-indexmem.py writes. Immutable once loaded; any thread may read it.
 */

#include <stddef.h>
#include <stdint.h>

#include "indexmem.h"
#include "model.h"

struct kvdlm_indexmem {
	uint32_t layers, index_heads, index_dim;
	struct kvd_indexer_layer *indexer;   /* [layers] */
	struct kvd_latent_readout *readout;  /* [layers] */
	const float **bias;                  /* [layers] -> [q_heads] */
	/* Private: the payload. */
	float *payload_;
};

/*
 * Loads path for the model shape cfg. On failure *err (errlen bytes, may be NULL) says
 * what is wrong. Returns 0, or -EINVAL, -ENOMEM, -EBADMSG (not a valid file: magic,
 * version, a CRC, the size, or a shape that is not cfg's), or the error of open()/read().
 */
int kvdlm_indexmem_load(const char *path, const struct kvdlm_config *cfg,
                        struct kvdlm_indexmem **ret, char *err, size_t errlen);

/* Frees im; accepts NULL; returns NULL. */
struct kvdlm_indexmem *kvdlm_indexmem_free(struct kvdlm_indexmem *im);

static inline void kvdlm_indexmem_freep(struct kvdlm_indexmem **im) {
	if (im && *im)
		kvdlm_indexmem_free(*im);
}
