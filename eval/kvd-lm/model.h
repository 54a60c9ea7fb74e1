/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * kvd-lm weights: a .kvdlm file (eval/kvd-lm/README.md, "Weights file") loaded and checked.
 *
 * The loader reads the 128-byte header, checks it (magic, version, header size, header
 * CRC-32, a sane shape, payload size against the shape), checks that the file is exactly
 * header + payload, reads the payload into one 64-byte aligned buffer and checks its CRC-32.
 * Every refusal comes with a message naming the file and what is wrong, in the words of
 * kvdlm.py's loader, for the caller to print.
 *
 * The tensors are views into that buffer, in the file's layout ([out][in] matrices, as torch
 * Linear weights): nothing is transposed or copied, so that kvd_model_output_proj() gets the
 * file's wo as it is. A loaded model is immutable: any number of sessions and threads may
 * share it.
 */

#include <stddef.h>
#include <stdint.h>

#include "kvd/kvd-abi.h"       /* KVD_LAYERS_MAX, KVD_HEADS_MAX, KVD_HEAD_DIM_MAX */

#include "format.h"
#include "tokenizer.h"      /* the token ids, KVDLM_BYTE_VOCAB */

#define KVDLM_HEADER_BYTES 128u
/* Room for any message of this module, a file name of up to 256 bytes included. */
#define KVDLM_ERROR_MAX 512

/*
 * Bounds of a sane shape beyond the spec's (all >= 1, q_heads a multiple of kv_heads,
 * head_dim even, vocab 260..KVDLM_VOCAB_MAX): kvd_model_spec's for layers, heads and
 * head_dim (kvd-abi.h), kvd_model_output_proj's for dim, and a cap on ffn so that sizes
 * stay in range.
 */
#define KVDLM_DIM_MAX 65536u
#define KVDLM_FFN_MAX (1u << 20)

struct kvdlm_config {
	uint32_t vocab, dim, layers, q_heads, kv_heads, head_dim, ffn, max_positions;
	float rope_theta, norm_eps;
};

/* One layer's tensors, [out][in] row-major. */
struct kvdlm_layer {
	const float *attn_norm; /* [dim] */
	const float *wq;        /* [q_heads * head_dim][dim] */
	const float *wk;        /* [kv_heads * head_dim][dim] */
	const float *wv;        /* [kv_heads * head_dim][dim] */
	const float *wo;        /* [dim][q_heads * head_dim] */
	const float *ffn_norm;  /* [dim] */
	const float *w_gate;    /* [ffn][dim] */
	const float *w_up;      /* [ffn][dim] */
	const float *w_down;    /* [dim][ffn] */
};

struct kvdlm_model {
	struct kvdlm_config cfg;
	const float *tok_emb;        /* [vocab][dim] */
	struct kvdlm_layer *layers;  /* [layers] */
	const float *final_norm;     /* [dim] */
	const float *lm_head;        /* [vocab][dim] */
	uint64_t params;             /* fp32 elements of the payload */
	/* Private: the payload buffer. */
	float *payload_;
};

/*
 * Loads and checks path. Returns 0 and the model in *ret, or -errno with a message in
 * err[errlen] (err may be NULL):
 *   -EBADMSG     shorter than the header, bad magic, header size not 128, a CRC-32 mismatch
 *                (header or payload), or a file size other than header + payload;
 *   -EOPNOTSUPP  a version other than 1;
 *   -EINVAL      an insane shape (a field 0 or over the bounds above, q_heads not a
 *                multiple of kv_heads, odd head_dim, vocab below 260, rope_theta or
 *                norm_eps not a positive number) or payload bytes that do not match it;
 *   -ENOMEM, or the error of open(2), fstat(2), read(2) (-ENOENT, -EACCES, -EISDIR...).
 */
int kvdlm_model_load(const char *path, struct kvdlm_model **ret, char *err, size_t errlen);

/* Frees m; accepts NULL; returns NULL. */
struct kvdlm_model *kvdlm_model_free(struct kvdlm_model *m);

static inline void kvdlm_model_freep(struct kvdlm_model **m) {
	if (m && *m)
		kvdlm_model_free(*m);
}
