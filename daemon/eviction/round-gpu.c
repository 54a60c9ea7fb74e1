/* SPDX-License-Identifier: MIT */
/* Scoring on the GPU for rounds on a cuda pool (round-gpu.h). UNVERIFIED ON HARDWARE. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend-cuda.h"
#include "basic/cuda-dl.h"
#include "cuda-kernels.h"
#include "dtype.h"
#include "log.h"
#include "round-gpu.h"

_Static_assert(ROUND_GPU_DIM_MAX == KVD_CUDA_DIM_MAX, "round-gpu.h's limit is the kernels'");

/* A device buffer that only grows. */
struct dbuf {
	CUdeviceptr p;
	uint64_t bytes;
};

struct round_gpu {
	uint32_t device;              /* of the pool (backend.h) */
	const struct cuda_dl *cu;
	CUcontext ctx;
	CUstream stream;              /* the rounds': scrubs keep the backend's own */
	struct kvd_cuda_kernels *k;
	struct dbuf k_buf, v_buf, q, gram, scratch, scores;
	/* Compaction's, on the loop's thread: a stream and buffers of its own. */
	CUstream gather_stream;
	struct dbuf blocks, keep, staging;
};

/* Slots staged per batch of an in-place gather (cuda-kernels.h): the more, the fewer
 * launches; 1024 slots are 2 x heads x row bytes each (16 MiB for 64 kv heads of 128 f16),
 * and a staging buffer the device cannot give sends compaction to the copies. */
#define GATHER_BATCH_SLOTS 1024u

/* A failed driver call: a sticky error marks the device failed (backend_cuda_failed). */
static int cu_errno(const struct round_gpu *g, CUresult cr, const char *call) {
	log_debug("round on the GPU: %s failed: %s", call, cuda_dl_strerror(cr));
	backend_cuda_failed(g->device, cr, call);
	return cuda_dl_errno(cr);
}

static int use(const struct round_gpu *g) {
	CUresult cr = g->cu->cuCtxSetCurrent(g->ctx);

	return cr == CUDA_SUCCESS ? 0 : cu_errno(g, cr, "cuCtxSetCurrent");
}

/* Makes b hold at least bytes (its contents are lost when it grows). */
static int dbuf_fit(const struct round_gpu *g, struct dbuf *b, uint64_t bytes) {
	CUresult cr;

	if (b->bytes >= bytes)
		return 0;
	if (b->p)
		(void)g->cu->cuMemFree(b->p);
	b->p = 0;
	b->bytes = 0;
	/* At least a page, and half again over what is asked: layers of one model differ
	 * little, and a buffer that grows every round would churn the allocator. */
	bytes = bytes < 4096 ? 4096 : bytes + bytes / 2;
	cr = g->cu->cuMemAlloc(&b->p, bytes);
	if (cr != CUDA_SUCCESS)
		return cu_errno(g, cr, "cuMemAlloc");
	b->bytes = bytes;
	return 0;
}

int round_gpu_new(uint32_t device, struct round_gpu **ret, char *why, size_t why_n) {
	const char *dl_why = NULL;
	struct round_gpu *g;
	CUresult cr = CUDA_SUCCESS;
	int r;

	g = calloc(1, sizeof(*g));
	if (!g)
		return -ENOMEM;
	g->device = device;
	g->ctx = backend_cuda_context(device);
	r = cuda_dl_load(&g->cu, &dl_why);
	if (r < 0 || !g->ctx) {
		snprintf(why, why_n, "%s", !g->ctx ? "not a device of the cuda backend" : dl_why);
		free(g);
		return -ENODEV;
	}
	r = use(g);
	if (r >= 0) {
		cr = g->cu->cuStreamCreate(&g->stream, CU_STREAM_NON_BLOCKING);
		if (cr == CUDA_SUCCESS)
			cr = g->cu->cuStreamCreate(&g->gather_stream, CU_STREAM_NON_BLOCKING);
		r = cr == CUDA_SUCCESS ? 0 : cu_errno(g, cr, "cuStreamCreate");
	}
	if (r >= 0) {
		r = kvd_cuda_kernels_new(g->cu, &g->k, &cr);
		/* The driver's own word for it, and whether it is older than the kernels need
		 * (the likeliest cause on a machine that runs the backend). */
		if (r < 0 && g->cu->driver_version < KVD_CUDA_KERNELS_DRIVER)
			snprintf(why, why_n, "the kernels did not load (%s): they need a CUDA %d.%d "
			         "driver or newer, this one is %d.%d (docs/gpu.md, Drivers)",
			         cuda_dl_strerror(cr), KVD_CUDA_KERNELS_DRIVER / 1000,
			         KVD_CUDA_KERNELS_DRIVER % 1000 / 10, g->cu->driver_version / 1000,
			         g->cu->driver_version % 1000 / 10);
		else if (r < 0)
			snprintf(why, why_n, "the kernels did not load (%s)%s", cuda_dl_strerror(cr),
			         r == -ENODEV ? ": they have no code for this GPU" : "");
	}
	if (r < 0) {
		round_gpu_free(g);
		return r;
	}
	*ret = g;
	return 0;
}

bool round_gpu_driver_ok(char *why, size_t why_n) {
	const struct cuda_dl *cu;
	const char *dl_why;

	if (cuda_dl_load(&cu, &dl_why) < 0 || cu->driver_version >= KVD_CUDA_KERNELS_DRIVER)
		return true;
	snprintf(why, why_n, "CUDA driver %d.%d: kvd's GPU memory works with it (11.4 or newer), "
	         "but its scoring kernels need %d.%d or newer: rounds will "
	         "score on the CPU, with the K/V copied there (docs/gpu.md, Drivers)",
	         cu->driver_version / 1000, cu->driver_version % 1000 / 10,
	         KVD_CUDA_KERNELS_DRIVER / 1000, KVD_CUDA_KERNELS_DRIVER % 1000 / 10);
	return false;
}

struct round_gpu *round_gpu_free(struct round_gpu *g) {
	if (!g)
		return NULL;
	if (use(g) >= 0) {
		struct dbuf *all[] = { &g->k_buf, &g->v_buf, &g->q, &g->gram, &g->scratch, &g->scores,
			               &g->blocks, &g->keep, &g->staging };

		for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
			if (all[i]->p)
				(void)g->cu->cuMemFree(all[i]->p);
		g->k = kvd_cuda_kernels_free(g->k);
		if (g->stream)
			(void)g->cu->cuStreamDestroy(g->stream);
		if (g->gather_stream)
			(void)g->cu->cuStreamDestroy(g->gather_stream);
	}
	free(g);
	return NULL;
}

int round_gpu_kv(struct round_gpu *g, uint64_t bytes, uint8_t **ret_k, uint8_t **ret_v) {
	int r = use(g);

	if (r >= 0)
		r = dbuf_fit(g, &g->k_buf, bytes);
	if (r >= 0)
		r = dbuf_fit(g, &g->v_buf, bytes);
	if (r < 0)
		return r;
	*ret_k = (uint8_t *)(uintptr_t)g->k_buf.p;
	*ret_v = (uint8_t *)(uintptr_t)g->v_buf.p;
	return 0;
}

int round_gpu_copy_rows(struct round_gpu *g, uint8_t *dst, uint64_t dst_pitch, const uint8_t *src,
                        uint64_t src_pitch, uint64_t width, uint64_t rows) {
	CUDA_MEMCPY2D m = {
		.srcMemoryType = CU_MEMORYTYPE_DEVICE,
		.srcDevice = (CUdeviceptr)(uintptr_t)src,
		.srcPitch = src_pitch,
		.dstMemoryType = CU_MEMORYTYPE_DEVICE,
		.dstDevice = (CUdeviceptr)(uintptr_t)dst,
		.dstPitch = dst_pitch,
		.WidthInBytes = width,
		.Height = rows,
	};
	int r = use(g);

	/* On the rounds' stream: the scoring that reads it comes after on the same stream. */
	return r < 0 ? r : backend_cuda_copy_2d(&m, g->stream);
}

int round_gpu_gather(struct round_gpu *g, const struct kvd_gather_table *t,
                     uint8_t *const *blocks, uint32_t nb, const uint32_t *keep, uint32_t n_keep,
                     bool *ret_launched) {
	uint64_t staging = kvd_cuda_gather_slot_bytes(t) * GATHER_BATCH_SLOTS;
	int r = use(g);
	CUresult cr;

	*ret_launched = false;
	if (r >= 0)
		r = dbuf_fit(g, &g->blocks, (uint64_t)nb * sizeof(uint64_t));
	if (r >= 0)
		r = dbuf_fit(g, &g->keep, (uint64_t)n_keep * sizeof(uint32_t));
	if (r >= 0)
		r = dbuf_fit(g, &g->staging, staging);
	if (r < 0)
		return r;
	/* Device addresses are 64-bit: the block list goes up as it is. */
	_Static_assert(sizeof(*blocks) == sizeof(uint64_t), "64-bit device pointers");
	cr = g->cu->cuMemcpyHtoDAsync(g->blocks.p, blocks, (uint64_t)nb * sizeof(uint64_t),
	                              g->gather_stream);
	if (cr == CUDA_SUCCESS)
		cr = g->cu->cuMemcpyHtoDAsync(g->keep.p, keep, (uint64_t)n_keep * sizeof(uint32_t),
		                              g->gather_stream);
	if (cr != CUDA_SUCCESS)
		return cu_errno(g, cr, "cuMemcpyHtoDAsync");
	/* Sizes refused before anything is enqueued (-EINVAL, -ENOBUFS: cuda-kernels.h) moved
	 * nothing either; a launch that failed after earlier batches may have moved some. */
	r = kvd_cuda_gather(g->k, t, (const uint64_t *)(uintptr_t)g->blocks.p, NULL,
	                    (const uint32_t *)(uintptr_t)g->keep.p, n_keep,
	                    (void *)(uintptr_t)g->staging.p, staging, g->gather_stream);
	*ret_launched = r >= 0 || (r != -EINVAL && r != -ENOBUFS);
	if (r < 0)
		return r;
	cr = g->cu->cuStreamSynchronize(g->gather_stream);
	return cr == CUDA_SUCCESS ? 0 : cu_errno(g, cr, "cuStreamSynchronize");
}

int round_gpu_score_layer(void *userdata, const struct kvd_attn_in *in, const float *gram,
                          const float *gram_group, const struct kvd_score_params *sp,
                          float *scores) {
	struct round_gpu *g = userdata;
	struct kvd_attn_in din = *in;
	uint64_t q_bytes = (uint64_t)in->heads * in->window * in->dim * kvd_dtype_size(in->dtype);
	uint64_t gram_bytes = gram ? (uint64_t)in->heads * in->dim * in->dim * sizeof(float) : 0;
	uint64_t score_bytes = (uint64_t)kvd_score_rows(sp, in) * (in->len - in->window) * sizeof(float);
	int r;
	CUresult cr;

	if (gram_group)
		return -EINVAL;
	r = use(g);
	if (r >= 0)
		r = dbuf_fit(g, &g->q, q_bytes);
	if (r >= 0 && gram)
		r = dbuf_fit(g, &g->gram, gram_bytes);
	if (r >= 0)
		r = dbuf_fit(g, &g->scratch, kvd_cuda_score_layer_scratch_bytes(in, sp));
	if (r >= 0)
		r = dbuf_fit(g, &g->scores, score_bytes);
	if (r < 0)
		return r;
	/* The queries are contiguous [H][w][d] (round.c): one upload, the strides kept. */
	cr = g->cu->cuMemcpyHtoDAsync(g->q.p, in->q, q_bytes, g->stream);
	if (cr == CUDA_SUCCESS && gram)
		cr = g->cu->cuMemcpyHtoDAsync(g->gram.p, gram, gram_bytes, g->stream);
	if (cr != CUDA_SUCCESS)
		return cu_errno(g, cr, "cuMemcpyHtoDAsync");
	din.q = (const void *)(uintptr_t)g->q.p;
	r = kvd_cuda_score_layer(g->k, &din, gram ? (const float *)(uintptr_t)g->gram.p : NULL, NULL,
	                         sp, (void *)(uintptr_t)g->scratch.p,
	                         (float *)(uintptr_t)g->scores.p, g->stream);
	if (r < 0)
		return r;
	cr = g->cu->cuMemcpyDtoHAsync(scores, g->scores.p, score_bytes, g->stream);
	if (cr == CUDA_SUCCESS)
		cr = g->cu->cuStreamSynchronize(g->stream);
	return cr == CUDA_SUCCESS ? 0 : cu_errno(g, cr, "scores back to the host");
}
