/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The scoring, selection and gather kernels on an NVIDIA GPU: the device versions of
 * attn.h, smooth.h, restkv.h, laprox.h, score.h, select.h and gather.h, one C entry point
 * per kernel, each with the CPU function it must agree with named at its declaration
 * (tests/gpu/test-gpu-kernels.c compares them on random inputs).
 *
 * How they are built and loaded. nvcc compiles kernels/cuda-kernels.cu into a fatbin (SASS
 * for the gpu_arch list, PTX of the newest for later GPUs), which the build embeds in
 * cuda-kernels.c as a byte array; kvd_cuda_kernels_new() loads it with cuModuleLoadData
 * through the dlopen'd driver (cuda-dl.h) and launches with cuLaunchKernel. So no binary
 * links cudart or libcuda (tests/check-needed.py), nothing is linked by nvcc (no libstdc++
 * in kvd), a binary that contains the kernels still starts without a driver, and there is
 * no second file to install next to it. The kernels use no cudart API, only the driver's.
 *
 * Pointers. Every tensor pointer passed here is a DEVICE address (a CUdeviceptr cast to a
 * pointer), including q, k and v in struct kvd_attn_in, whose dtype, shapes and element
 * strides mean what attn.h says. Scalars and structs are host values.
 *
 * Streams. Every entry point only enqueues work on the given stream (0: the context's
 * legacy default stream) and returns; results are valid once the stream has reached that
 * point. None synchronises, none allocates: work buffers ("scratch") are the caller's, of
 * the size the matching *_scratch_bytes() returns, and may be reused by the next call on
 * the same stream. Launch failures are reported as -errno (cuda_dl_errno()); a kernel that
 * faults shows up at the caller's next synchronisation, as always with CUDA.
 *
 * Context. kvd_cuda_kernels_new() loads the module into the context current on the calling
 * thread; every call must then run with that context current. One struct kvd_cuda_kernels
 * may be used from several threads (the driver serialises launches per stream).
 *
 * Limits: head_dim <= KVD_CUDA_DIM_MAX, heads <= 65535, selections over fewer than 2^32
 * items. Violations are -EINVAL, checked before anything is enqueued.
 *
 * Agreement with the CPU. Attention, costs and normalisation accumulate in fp32 (fp64 where
 * the CPU path does), in another order than the CPU, and agree within a tolerance;
 * temporal folding, pooling, the GQA sum, the AWS parameters, selections and the gather
 * follow the CPU's operation order and agree exactly (given the same inputs). Selections
 * rank by select.h's total order (NaN lowest, ties to the lower index), so a kept set
 * differs from the CPU's only where the scores it ranks differ.
 */

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "attn.h"
#include "basic/cuda-dl.h"
#include "gather.h"
#include "restkv.h"
#include "score.h"
#include "smooth.h"

#define KVD_CUDA_DIM_MAX 512u

/* The driver the kernels need (cuDriverGetVersion's 1000 * major + 10 * minor): the
 * toolkit's that built them, whose cubins and PTX older drivers cannot load (CUDA 13.0:
 * an R580 driver). The backend's own driver calls need far less (docs/gpu.md). */
#define KVD_CUDA_KERNELS_DRIVER CUDA_VERSION

struct kvd_cuda_kernels;

/*
 * Loads the embedded module into the current context and resolves every kernel. Returns 0
 * and the handle in *ret, -ENODEV if the module has no code this GPU can run (no matching
 * SASS and a driver too old for the PTX), -ENOMEM, or another cuda_dl_errno() value; then
 * *ret_cr (may be NULL) holds the driver's result, which names the cause (a driver older
 * than the kernels need says so only there: KVD_CUDA_KERNELS_DRIVER).
 */
int kvd_cuda_kernels_new(const struct cuda_dl *cu, struct kvd_cuda_kernels **ret,
                         CUresult *ret_cr);
/* Unloads the module (current context as at _new). Accepts NULL; returns NULL. */
struct kvd_cuda_kernels *kvd_cuda_kernels_free(struct kvd_cuda_kernels *k);

/* The gpu_arch list the module was built for ("80 90"), for messages. */
const char *kvd_cuda_kernels_arch(void);

/*
 * Window attention of every query head: probs[H][w][L], row t of head h at
 * probs + (h * w + t) * L, exactly kvd_attn_head_ref()'s map for each head (0 where a row
 * may not see). Returns 0 or -EINVAL.
 */
int kvd_cuda_attn(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in, float *probs,
		  CUstream stream);

/*
 * kvd_temporal_agg_ref() for `rows` matrices at once: matrix r is w rows of stride `stride`
 * starting at probs + r * matrix_stride, its first n columns folded into agg[r][n]. Same
 * errors.
 */
int kvd_cuda_temporal(const struct kvd_cuda_kernels *k, enum kvd_temporal_mode mode, float alpha,
		      const float *probs, uint32_t rows, size_t matrix_stride, uint32_t w,
		      size_t stride, uint32_t n, float *agg, CUstream stream);

/*
 * kvd_restkv_vgv_ref() for every query head: vgv[H][n], row h with G_h = gram + h * d * d
 * (gram [H][d][d] or NULL). Returns 0 or -EINVAL.
 */
int kvd_cuda_restkv_vgv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			const float *gram, uint32_t n, float *vgv, CUstream stream);

/*
 * kvd_restkv_head_ref() for every query head: cost[H][L - w] from probs [H][w][L]
 * (kvd_cuda_attn()), gram [H][d][d] or NULL, vgv [H][L - w] or NULL, options o (host).
 * Uses the cancellation guard of restkv.h (direct norms from a >= KVD_RESTKV_A_DIRECT).
 * Returns 0 or -EINVAL.
 */
size_t kvd_cuda_restkv_scratch_bytes(const struct kvd_attn_in *in, const struct kvd_restkv_opts *o);
int kvd_cuda_restkv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv,
		    const struct kvd_restkv_opts *o, void *scratch, float *cost, CUstream stream);

/*
 * kvd_laprox_head_ref() for every query head (cost [H][L - w]), and kvd_laprox_group_ref()
 * for every kv head (cost [Hkv][L - w], gram_group [Hkv][g*d][g*d] or NULL, as score.h
 * passes them). probs as above. Return 0 or -EINVAL.
 */
int kvd_cuda_laprox(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv, float *cost,
		    CUstream stream);
int kvd_cuda_laprox_group(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			  const float *probs, const float *gram_group, float *cost, CUstream stream);

/* One head's (or group's) AWS parameters as the device writes them (struct kvd_aws's). */
struct kvd_cuda_aws {
	uint32_t kernel;
	int32_t shift;
	double t;
};

/*
 * kvd_aws_params_ref() for `heads` probability maps [heads][w][L] (probs + h * w * L),
 * into ret[heads / group] (device): with group 1 one entry per head; with group g the
 * parameters of the mean t of each g consecutive heads (score.h's joint LaProx rows, via
 * kvd_aws_from_t()). Exact: the same top-K sets and the same floor divisions. Returns 0,
 * -EINVAL (as kvd_aws_params_ref(), or heads % group) or -ERANGE (a scale so small that a
 * kernel could overflow).
 */
size_t kvd_cuda_aws_scratch_bytes(uint32_t heads, uint32_t w);
int kvd_cuda_aws(const struct kvd_cuda_kernels *k, const float *probs, uint32_t heads,
		 uint32_t group, uint32_t w, uint32_t L, uint32_t topk, uint32_t k_min,
		 double scale, void *scratch, struct kvd_cuda_aws *ret, CUstream stream);

/*
 * kvd_pool_row_ref() for `rows` rows in[rows][n] into out[rows][n] (not overlapping). mode
 * ADAPTIVE takes each row's (kernel, shift) from aws[r] (device, kvd_cuda_aws()) and
 * ignores kernel; the others use kernel and need aws NULL. Returns 0 or -EINVAL.
 */
int kvd_cuda_pool(const struct kvd_cuda_kernels *k, enum kvd_pool_mode mode, uint32_t kernel,
		  const struct kvd_cuda_aws *aws, const float *in, uint32_t rows, uint32_t n,
		  float *out, CUstream stream);

/*
 * The diagonal GQA sum of score.c: out[r][i] = in[r*g][i] + ... + in[r*g + g-1][i], added
 * in head order, for r < rows. Returns 0 or -EINVAL.
 */
int kvd_cuda_group_sum(const struct kvd_cuda_kernels *k, const float *in, uint32_t rows,
		       uint32_t g, uint32_t n, float *out, CUstream stream);

/* kvd_laprox_normalize() of c[n] in place. Returns 0 or -EINVAL. */
size_t kvd_cuda_normalize_scratch_bytes(size_t n);
int kvd_cuda_normalize(const struct kvd_cuda_kernels *k, float *c, size_t n, float lambda,
		       void *scratch, CUstream stream);

/*
 * kvd_score_layer_ref(): the whole per-layer pipeline of score.h (attention, ReST-KV or
 * LaProx costs, pooling with per-head AWS, GQA sum, normalisation) into
 * scores[rows][L - w]. gram, gram_group as there (device); p->threads is ignored. Returns 0
 * or -EINVAL.
 */
size_t kvd_cuda_score_layer_scratch_bytes(const struct kvd_attn_in *in,
					  const struct kvd_score_params *p);
int kvd_cuda_score_layer(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			 const float *gram, const float *gram_group,
			 const struct kvd_score_params *p, void *scratch, float *scores,
			 CUstream stream);

/*
 * kvd_topk() of each of `rows` rows (row r at scores + r * stride, n entries): the indices
 * of its kk highest, ascending, into keep[r][kk]. Returns 0 or -EINVAL (kk > n).
 */
int kvd_cuda_topk_each(const struct kvd_cuda_kernels *k, const float *scores, uint32_t rows,
		       size_t stride, uint32_t n, uint32_t kk, uint32_t *keep, CUstream stream);

/*
 * kvd_topk_rows() over rows laid out back to back: row r is scores[row_start[r] ..
 * row_start[r+1]) (row_start: device, n_rows + 1 entries, row_start[0] = 0, total =
 * row_start[n_rows]). ret_counts[n_rows] and ret_keep[kk] (device) as kvd_topk_rows()
 * writes them. With row_start NULL there is one row of `total` items and ret_counts may be
 * NULL: ret_keep gets positions. Returns 0 or -EINVAL (kk > total).
 */
size_t kvd_cuda_topk_global_scratch_bytes(uint32_t total);
int kvd_cuda_topk_global(const struct kvd_cuda_kernels *k, const float *scores, uint32_t total,
			 const uint32_t *row_start, uint32_t n_rows, uint32_t kk, void *scratch,
			 uint32_t *ret_counts, uint32_t *ret_keep, CUstream stream);

/*
 * kvd_gather_ref() on device memory: src_blocks and dst_blocks are device arrays of block
 * addresses (uint64_t), blocks 16-byte aligned (pool blocks are 64-byte aligned); keep
 * (device) strictly ascending. With dst_blocks it is one parallel copy (the destination must
 * not overlap the source). In place (dst_blocks NULL) kept slots are staged through scratch
 * in batches of scratch_bytes / kvd_cuda_gather_slot_bytes(t) slots (at least one, else
 * -ENOBUFS): each batch is read whole before any of it is written, and a batch only
 * overwrites slots below those later batches read. keep is not checked for order here (the
 * device has it): the caller guarantees it. Returns 0, -EINVAL or -ENOBUFS.
 */
size_t kvd_cuda_gather_slot_bytes(const struct kvd_gather_table *t);
int kvd_cuda_gather(const struct kvd_cuda_kernels *k, const struct kvd_gather_table *t,
		    const uint64_t *src_blocks, const uint64_t *dst_blocks, const uint32_t *keep,
		    uint32_t n_keep, void *scratch, size_t scratch_bytes, CUstream stream);
