/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The kvd-lm transformer (eval/kvd-lm/README.md, "Model"), fp32 on the CPU.
 *
 * A session runs one sequence of a model over a KV cache (cache.h): kvdlm_prefill() feeds
 * tokens in chunks, kvdlm_decode() one token; both append at the sequence's next positions
 * and can return logits. Per layer: RMSNorm, the q/k/v projections, RoPE with the angle
 * (float)pos * inv_freq[i] in fp32 and inv_freq[i] = (float)pow(theta, -2i/head_dim),
 * K (after RoPE) and V written into the cache, grouped-query attention over the cached
 * slots whose original position is at most the query's (positions, not slot indices, so
 * that a cache the daemon evicted from is read correctly), the output projection, and
 * the SwiGLU feed-forward.
 *
 * Matrix products run on kernels/simd.h (AVX-512, AVX2 or baseline vectors, chosen at run
 * time): one token at a time as dot products along the weights' rows, several as a
 * cache-blocked sgemm whose weight panels are transposed into a per-thread buffer. Work is
 * shared by a pool of threads that the session owns; attention is split over (kv head,
 * block of queries) and, for a few queries over a long context, over blocks of keys too.
 * Results do not depend on the cache implementation, only on the thread count and the
 * chunking, so a kvd cache that evicted nothing gives the very same logits as the full
 * cache. A kvd cache with moments (cache.h) adds each table's summary of what it evicted
 * as one more entry of every query's softmax (kernels/moments.h), in the view's form.
 * With IndexMem weights (kvdlm-indexmem.h), a kvd cache with an indexer gets every token's
 * index key and its observation windows' index queries (kernels/indexmem.h), and a kvd
 * cache with latent memory adds its readout as that entry; other caches are unaffected.
 *
 * A session is used from one thread at a time. Errors leave the cache in the state its
 * own documentation says (a failed step may have appended tokens): start a new sequence.
 */

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "kvdlm-indexmem.h"
#include "model.h"

/* The longest --chunk: tokens one forward step takes. */
#define KVDLM_CHUNK_MAX 4096u
#define KVDLM_CHUNK_DEFAULT 256u
#define KVDLM_THREADS_MAX 256u

struct kvdlm_session;

struct kvdlm_session_opts {
	uint32_t threads; /* 0: the online CPUs (at most KVDLM_THREADS_MAX) */
	uint32_t chunk;   /* tokens per forward step of a prefill, 1..KVDLM_CHUNK_MAX; 0: 256 */
	/* IndexMem weights of the model (borrowed, must outlive the session), or NULL: needed
	 * by caches with an indexer of their shape or with latent memory. */
	const struct kvdlm_indexmem *indexmem;
};

/* Which logits kvdlm_prefill() writes. */
enum kvdlm_logits {
	KVDLM_LOGITS_NONE,
	KVDLM_LOGITS_LAST, /* [vocab]: after the last token */
	KVDLM_LOGITS_ALL,  /* [n][vocab]: after every token */
	_KVDLM_LOGITS_MAX,
	_KVDLM_LOGITS_INVALID = -EINVAL,
};

/*
 * A session of model m over cache (borrowed: both must outlive the session, or until
 * kvdlm_session_reset() swaps the cache). opts may be NULL for the defaults. Returns 0, or
 * -EINVAL (also IndexMem weights of another number of layers), -ENOMEM, or the error of
 * pthread_create(). A step over a cache whose indexer the weights do not match, or with
 * latent memory and no weights, fails with -EINVAL.
 */
int kvdlm_session_new(const struct kvdlm_model *m, struct kvdlm_cache *cache,
                      const struct kvdlm_session_opts *opts, struct kvdlm_session **ret);

/* Frees s and stops its threads; accepts NULL; returns NULL. The cache is not touched. */
struct kvdlm_session *kvdlm_session_free(struct kvdlm_session *s);

static inline void kvdlm_session_freep(struct kvdlm_session **s) {
	if (s && *s)
		kvdlm_session_free(*s);
}

/* Runs the session over another cache (a new sequence), keeping its threads and buffers.
 * Returns 0 or -EINVAL. */
int kvdlm_session_reset(struct kvdlm_session *s, struct kvdlm_cache *cache);

/*
 * Appends tokens[n] (n >= 1, each < vocab) in steps of the session's chunk. logits (may be
 * NULL with KVDLM_LOGITS_NONE) receives what `which` says. Returns 0, or -EINVAL (bad
 * argument or token), -ENOMEM, or the errors of kvdlm_cache_begin(), _observe() and _end().
 */
int kvdlm_prefill(struct kvdlm_session *s, const uint32_t *tokens, uint32_t n, enum kvdlm_logits which,
                  float *logits);

/* Appends one token; logits[vocab] (may be NULL) receives the next token's. Errors as
 * kvdlm_prefill(). */
int kvdlm_decode(struct kvdlm_session *s, uint32_t token, float *logits);

/* The next position of the session's sequence. */
uint32_t kvdlm_session_position(const struct kvdlm_session *s);

/* Threads the session computes with, the caller's included. */
uint32_t kvdlm_session_threads(const struct kvdlm_session *s);

/* The name of the SIMD path in use ("avx512", "avx2", "generic"). */
const char *kvdlm_simd_name(void);

/* The index of the largest of x[n] (n >= 1), the first on ties, as torch.argmax. */
uint32_t kvdlm_argmax(const float *x, uint32_t n);
