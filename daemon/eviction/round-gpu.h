/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Scoring on the GPU, for rounds on a cuda pool. For the policies whose costs are score.h's
 * layer pipeline alone (kvd_policy_scores_via_layer(): restkv, laprox), a layer's K
 * and V are gathered on the device that holds the sequence (device-to-device copies of its
 * block runs, round.c), its window queries and Gram matrices are uploaded, the pipeline runs
 * as kvd_cuda_score_layer() (kernels/cuda-kernels.h) on a stream of the rounds', and only
 * the scores come back to the CPU, which selects and smooths as on any pool; compaction
 * then moves each table's survivors with the gather kernel (round_gpu_gather()).
 * Other policies, and devices whose kernels do not load, copy the K/V to the CPU instead
 * (backend.h read_rows). UNVERIFIED on a GPU: tested with the CPU stand-ins of the kernels
 * under the fake driver (tests/gpu/meson.build, kvd-hostkernels).
 *
 * One struct per pooled device, made when a round first needs it and kept by the evictor
 * (rounds run one at a time, on one thread): the kernels' module, loaded into the device's
 * primary context, a stream, and device buffers grown to the largest layer seen. Every
 * call makes the device's context current on the calling thread.
 */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "gather.h"
#include "policy.h"

struct round_gpu;

/* The largest head_dim the kernels take (KVD_CUDA_DIM_MAX): larger heads score on the CPU. */
#define ROUND_GPU_DIM_MAX 512u

#ifdef KVD_HAVE_CUDA_KERNELS
/* Loads the kernels on device (of the cuda backend). Returns 0, -ENODEV (no code for this
 * GPU, or not the cuda backend), -ENOMEM, or the driver's -errno; why then says why, for
 * the log: the driver's error name, and the driver the kernels need when this one is
 * older. */
int round_gpu_new(uint32_t device, struct round_gpu **ret, char *why, size_t why_n);
/* Whether the CUDA driver is recent enough for the kernels (KVD_CUDA_KERNELS_DRIVER), said
 * at start on a cuda pool, before the first round finds out; why says what applies when
 * not. */
bool round_gpu_driver_ok(char *why, size_t why_n);
struct round_gpu *round_gpu_free(struct round_gpu *g);

/* Device buffers for a layer's gathered K and V, bytes each, valid until the next call.
 * Returns 0 or -ENOMEM. */
int round_gpu_kv(struct round_gpu *g, uint64_t bytes, uint8_t **ret_k, uint8_t **ret_v);

/* Copies rows of width bytes from src (pool memory, rows src_pitch apart) to dst (a
 * round_gpu_kv() buffer, rows dst_pitch apart), on the device. Returns 0 or -errno. */
int round_gpu_copy_rows(struct round_gpu *g, uint8_t *dst, uint64_t dst_pitch, const uint8_t *src,
                        uint64_t src_pitch, uint64_t width, uint64_t rows);

/*
 * Compaction's gather on the device (gather.h, in place): kept slots keep[0..n_keep) of the
 * table whose blocks are blocks[0..nb) (pool addresses on g's device) go to slots
 * 0..n_keep-1, in batches of GATHER_BATCH_SLOTS staged slots (two launches each);
 * synchronous. Has buffers and a stream of its own, so that it may run on the loop's thread
 * while a round scores on its worker. Returns 0 or -errno; *ret_launched says whether the
 * kernels were launched: when not (device memory for the lists or the staging, an upload),
 * nothing moved and the caller can move the rows otherwise.
 */
int round_gpu_gather(struct round_gpu *g, const struct kvd_gather_table *t,
                     uint8_t *const *blocks, uint32_t nb, const uint32_t *keep, uint32_t n_keep,
                     bool *ret_launched);

/* A kvd_score_layer_fn (policy.h) for kvd_policy_scores_via(), userdata g: in's K and V are
 * round_gpu_kv() buffers, its queries, gram and the scores host memory. gram_group must be
 * NULL (rounds score with kv-head rows). */
int round_gpu_score_layer(void *g, const struct kvd_attn_in *in, const float *gram,
                          const float *gram_group, const struct kvd_score_params *sp,
                          float *scores);
#else
static inline int round_gpu_new(uint32_t device, struct round_gpu **ret, char *why,
                                size_t why_n) {
	(void)device, (void)ret;
	snprintf(why, why_n, "this kvd was built without the CUDA kernels (no nvcc)");
	return -ENODEV;
}
static inline bool round_gpu_driver_ok(char *why, size_t why_n) {
	(void)why, (void)why_n;
	return true;
}
static inline struct round_gpu *round_gpu_free(struct round_gpu *g) {
	(void)g;
	return NULL;
}
static inline int round_gpu_kv(struct round_gpu *g, uint64_t bytes, uint8_t **ret_k,
                               uint8_t **ret_v) {
	(void)g, (void)bytes, (void)ret_k, (void)ret_v;
	return -EOPNOTSUPP;
}
static inline int round_gpu_copy_rows(struct round_gpu *g, uint8_t *dst, uint64_t dst_pitch,
                                      const uint8_t *src, uint64_t src_pitch, uint64_t width,
                                      uint64_t rows) {
	(void)g, (void)dst, (void)dst_pitch, (void)src, (void)src_pitch, (void)width, (void)rows;
	return -EOPNOTSUPP;
}
static inline int round_gpu_gather(struct round_gpu *g, const struct kvd_gather_table *t,
                                   uint8_t *const *blocks, uint32_t nb, const uint32_t *keep,
                                   uint32_t n_keep, bool *ret_launched) {
	(void)g, (void)t, (void)blocks, (void)nb, (void)keep, (void)n_keep;
	*ret_launched = false;
	return -EOPNOTSUPP;
}
static inline int round_gpu_score_layer(void *g, const struct kvd_attn_in *in, const float *gram,
                                        const float *gram_group,
                                        const struct kvd_score_params *sp, float *scores) {
	(void)g, (void)in, (void)gram, (void)gram_group, (void)sp, (void)scores;
	return -EOPNOTSUPP;
}
#endif
