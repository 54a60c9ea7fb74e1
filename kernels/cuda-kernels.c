/* SPDX-License-Identifier: MIT */
/*
 * The host side of cuda-kernels.h: argument checks, launch geometry, scratch layouts, and
 * one cuLaunchKernel per step. Each launch passes its arguments as the exact C types of
 * the kernel's parameters in cuda-kernels.cu (uint32_t for u32, uint64_t for u64, device
 * pointers as pointers), since the driver copies them by size without checking.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "cuda-kernels-internal.h"
#include "cuda-kernels.h"
#include "dtype.h"

#ifndef KVD_GPU_ARCH
#define KVD_GPU_ARCH "?"
#endif

enum {
#define KFN_ENUM(name) KFN_##name,
	KVD_CUDA_KERNELS(KFN_ENUM)
#undef KFN_ENUM
	_KFN_MAX,
};

struct kvd_cuda_kernels {
	const struct cuda_dl *cu;
	CUmodule mod;
	CUfunction fn[_KFN_MAX];
};

/* Tokens per partial sum of the o = sum a_i v_i reduction, and the global selection's chunk. */
#define MIX_CHUNK 512u
#define GSEL_CHUNK 4096u
#define NORM_PARTS 256u
/* Scratch regions start at multiples of this. */
#define SCRATCH_ALIGN 256u

#define DIV_UP(a, b) (((a) + (b)-1) / (b))

static size_t align_up(size_t x) {
	return DIV_UP(x, SCRATCH_ALIGN) * SCRATCH_ALIGN;
}

/* Carves the next `bytes` out of a scratch cursor. */
static void *carve(char **cursor, size_t bytes) {
	void *p = *cursor;

	*cursor += align_up(bytes);
	return p;
}

const char *kvd_cuda_kernels_arch(void) {
	return KVD_GPU_ARCH;
}

struct kvd_cuda_kernels *kvd_cuda_kernels_free(struct kvd_cuda_kernels *k) {
	if (!k)
		return NULL;
	if (k->mod)
		k->cu->cuModuleUnload(k->mod);
	free(k);
	return NULL;
}

int kvd_cuda_kernels_new(const struct cuda_dl *cu, struct kvd_cuda_kernels **ret,
                         CUresult *ret_cr) {
	static const char *const names[_KFN_MAX] = {
#define KFN_NAME(name) [KFN_##name] = "kvd_cu_" #name,
		KVD_CUDA_KERNELS(KFN_NAME)
#undef KFN_NAME
	};
	struct kvd_cuda_kernels *k;
	CUresult cr;

	if (!cu || !ret)
		return -EINVAL;
	k = calloc(1, sizeof(*k));
	if (!k)
		return -ENOMEM;
	k->cu = cu;
	cr = cu->cuModuleLoadData(&k->mod, kvd_cuda_fatbin);
	if (ret_cr)
		*ret_cr = cr;
	if (cr != CUDA_SUCCESS) {
		k->mod = NULL;
		kvd_cuda_kernels_free(k);
		/* No SASS for this GPU and PTX newer than the driver can compile. */
		return cr == CUDA_ERROR_NO_BINARY_FOR_GPU || cr == CUDA_ERROR_UNSUPPORTED_PTX_VERSION ?
			       -ENODEV :
			       cuda_dl_errno(cr);
	}
	for (int i = 0; i < _KFN_MAX; i++) {
		cr = cu->cuModuleGetFunction(&k->fn[i], k->mod, names[i]);
		if (ret_cr)
			*ret_cr = cr;
		if (cr != CUDA_SUCCESS) {
			kvd_cuda_kernels_free(k);
			return cuda_dl_errno(cr);
		}
	}
	*ret = k;
	return 0;
}

static int launch(const struct kvd_cuda_kernels *k, int fn, unsigned gx, unsigned gy, unsigned gz,
		  unsigned threads, unsigned shmem, CUstream s, void **args) {
	CUresult cr;

	if (gx == 0 || gy == 0 || gz == 0)
		return 0;
	cr = k->cu->cuLaunchKernel(k->fn[fn], gx, gy, gz, threads, 1, 1, shmem, s, args, NULL);
	return cr == CUDA_SUCCESS ? 0 : cuda_dl_errno(cr);
}

/* attn.h's checks plus the device limits (grid y is the head count, shared memory d). */
static int in_check(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in, int need_v) {
	if (!k || kvd_attn_in_check(in) < 0 || (need_v && !in->v) || in->dim > KVD_CUDA_DIM_MAX ||
	    in->heads > 65535 || in->len > INT32_MAX)
		return -EINVAL;
	return 0;
}

int kvd_cuda_attn(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in, float *probs,
		  CUstream stream) {
	uint32_t dtype, heads, kv_heads, w, L, d, rows;
	uint64_t qhs, qrs, khs, krs;
	float scale;
	int r;

	if (in_check(k, in, 0) < 0 || !probs)
		return -EINVAL;
	dtype = in->dtype, heads = in->heads, kv_heads = in->kv_heads, w = in->window;
	L = in->len, d = in->dim, scale = in->scale;
	qhs = in->q_head_stride, qrs = in->q_row_stride, khs = in->k_head_stride, krs = in->k_row_stride;
	r = launch(k, KFN_attn_logits, DIV_UP(L, 32), kv_heads, DIV_UP(w, 32), 256, 0, stream,
		   (void *[]){ (void *)&in->q, (void *)&in->k, &dtype, &heads, &kv_heads, &w, &L, &d,
			       &scale, &qhs, &qrs, &khs, &krs, &probs });
	if (r < 0)
		return r;
	rows = heads * w;
	return launch(k, KFN_softmax, rows, 1, 1, 512, 0, stream, (void *[]){ &probs, &w, &L });
}

static int temporal_check(enum kvd_temporal_mode mode, float alpha) {
	if ((int)mode < 0 || mode >= _KVD_TEMPORAL_MAX)
		return -EINVAL;
	if (mode == KVD_TEMPORAL_EMA && (!(alpha > 0) || alpha > 1))
		return -EINVAL;
	return 0;
}

int kvd_cuda_temporal(const struct kvd_cuda_kernels *k, enum kvd_temporal_mode mode, float alpha,
		      const float *probs, uint32_t rows, size_t matrix_stride, uint32_t w,
		      size_t stride, uint32_t n, float *agg, CUstream stream) {
	uint64_t ms = matrix_stride, st = stride;
	uint32_t m = (uint32_t)mode;

	if (!k || temporal_check(mode, alpha) < 0 || w == 0 || stride < n || rows > 65535 ||
	    (n > 0 && rows > 0 && (!probs || !agg)))
		return -EINVAL;
	return launch(k, KFN_temporal, DIV_UP(n, 256), rows, 1, 256, 0, stream,
		      (void *[]){ &probs, &ms, &w, &st, &n, &m, &alpha, &agg });
}

int kvd_cuda_restkv_vgv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			const float *gram, uint32_t n, float *vgv, CUstream stream) {
	uint32_t dtype, g, d;
	uint64_t vhs, vrs;

	if (in_check(k, in, 1) < 0 || n > in->len || (n && !vgv))
		return -EINVAL;
	dtype = in->dtype, g = in->heads / in->kv_heads, d = in->dim;
	vhs = in->v_head_stride, vrs = in->v_row_stride;
	return launch(k, KFN_vgv, DIV_UP(n, 8), in->heads, 1, 256, 8 * d * sizeof(float), stream,
		      (void *[]){ (void *)&in->v, &dtype, &g, &vhs, &vrs, &d, &n, &gram, &vgv });
}

static int restkv_opts_check(const struct kvd_restkv_opts *o) {
	if (!o || (int)o->metric < 0 || o->metric >= _KVD_RESTKV_METRIC_MAX ||
	    temporal_check(o->temporal, o->alpha) < 0 || !(o->tau > 0) || !isfinite(o->tau))
		return -EINVAL;
	return 0;
}

/* The rows of weights the o reduction sums: one per head (after) or per window row. */
static void restkv_dims(const struct kvd_attn_in *in, const struct kvd_restkv_opts *o,
			uint32_t *ret_rows, uint32_t *ret_tokens, uint32_t *ret_chunks) {
	int after = o->metric == KVD_RESTKV_AFTER;
	uint32_t tokens = after ? in->len - in->window : in->len;

	*ret_rows = after ? in->heads : in->heads * in->window;
	*ret_tokens = tokens;
	*ret_chunks = tokens ? DIV_UP(tokens, MIX_CHUNK) : 1;
}

size_t kvd_cuda_restkv_scratch_bytes(const struct kvd_attn_in *in, const struct kvd_restkv_opts *o) {
	uint32_t rows, tokens, chunks;
	size_t n = in->len - in->window;

	restkv_dims(in, o, &rows, &tokens, &chunks);
	return align_up((size_t)in->heads * n * sizeof(float)) +
	       align_up((size_t)rows * chunks * in->dim * sizeof(float)) +
	       2 * align_up((size_t)rows * in->dim * sizeof(float)) +
	       align_up((size_t)rows * sizeof(float));
}

int kvd_cuda_restkv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv,
		    const struct kvd_restkv_opts *o, void *scratch, float *cost, CUstream stream) {
	uint32_t rows, tokens, chunks, per_head, dtype, g, d, w, L, n, metric, temporal, use_norm;
	uint64_t vhs, vrs, wstride;
	float alpha, tau, *agg, *partial, *ov, *og, *ogo;
	const float *wgt;
	char *cur = scratch;
	int r;

	if (in_check(k, in, 1) < 0 || restkv_opts_check(o) < 0 || !probs || !cost || !scratch)
		return -EINVAL;
	restkv_dims(in, o, &rows, &tokens, &chunks);
	dtype = in->dtype, g = in->heads / in->kv_heads, d = in->dim, w = in->window, L = in->len;
	n = L - w, vhs = in->v_head_stride, vrs = in->v_row_stride;
	metric = o->metric, temporal = o->temporal, alpha = o->alpha, tau = o->tau;
	use_norm = !!o->use_norm;
	agg = carve(&cur, (size_t)in->heads * n * sizeof(float));
	partial = carve(&cur, (size_t)rows * chunks * d * sizeof(float));
	ov = carve(&cur, (size_t)rows * d * sizeof(float));
	og = carve(&cur, (size_t)rows * d * sizeof(float));
	ogo = carve(&cur, (size_t)rows * sizeof(float));

	if (o->metric == KVD_RESTKV_AFTER) {
		/* The aggregate over the window rows weighs the prefix values. */
		r = kvd_cuda_temporal(k, o->temporal, o->alpha, probs, in->heads, (size_t)w * L, w, L,
				      n, agg, stream);
		if (r < 0)
			return r;
		wgt = agg, wstride = n, per_head = 1;
	} else
		/* Every window row's own attention output, over all the keys it sees. */
		wgt = probs, wstride = L, per_head = w;
	if (chunks > 65535)
		return -EINVAL;
	r = launch(k, KFN_mix_partial, rows, chunks, 1, 128, 0, stream,
		   (void *[]){ &wgt, &wstride, &per_head, &tokens, (void *)&in->v, &dtype, &g, &vhs,
			       &vrs, &d, &(uint32_t){ MIX_CHUNK }, &partial });
	if (r < 0)
		return r;
	r = launch(k, KFN_mix_final, rows, 1, 1, 128, d * sizeof(float), stream,
		   (void *[]){ &partial, &chunks, &d, &per_head, &gram, &ov, &og, &ogo });
	if (r < 0)
		return r;
	return launch(k, KFN_restkv_cost, DIV_UP(n, 8), in->heads, 1, 256, 16 * d * sizeof(float),
		      stream,
		      (void *[]){ (void *)&in->v, &dtype, &g, &vhs, &vrs, &d, &w, &L, &probs, &agg,
				  &gram, &vgv, &ov, &og, &ogo, &metric, &temporal, &alpha, &tau,
				  &use_norm, &cost });
}

int kvd_cuda_laprox(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv, float *cost,
		    CUstream stream) {
	uint32_t dtype, g, d, w, L, n;
	uint64_t vhs, vrs;

	if (in_check(k, in, 1) < 0 || !probs || !cost)
		return -EINVAL;
	dtype = in->dtype, g = in->heads / in->kv_heads, d = in->dim, w = in->window, L = in->len;
	n = L - w, vhs = in->v_head_stride, vrs = in->v_row_stride;
	return launch(k, KFN_laprox_diag, DIV_UP(n, 8), in->heads, 1, 256, 8 * d * sizeof(float),
		      stream,
		      (void *[]){ (void *)&in->v, &dtype, &g, &vhs, &vrs, &d, &w, &L, &probs, &gram,
				  &vgv, &cost });
}

int kvd_cuda_laprox_group(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			  const float *probs, const float *gram_group, float *cost, CUstream stream) {
	uint32_t dtype, g, d, w, L, n;
	uint64_t vhs, vrs;

	if (in_check(k, in, 1) < 0 || !probs || !cost)
		return -EINVAL;
	dtype = in->dtype, g = in->heads / in->kv_heads, d = in->dim, w = in->window, L = in->len;
	n = L - w, vhs = in->v_head_stride, vrs = in->v_row_stride;
	return launch(k, KFN_laprox_group, DIV_UP(n, 8), in->kv_heads, 1, 256,
		      8 * d * sizeof(float), stream,
		      (void *[]){ (void *)&in->v, &dtype, &g, &vhs, &vrs, &d, &w, &L, &probs,
				  &gram_group, &cost });
}

size_t kvd_cuda_aws_scratch_bytes(uint32_t heads, uint32_t w) {
	return align_up((size_t)heads * (w >= 2 ? w / 2 * 2 : 1) * sizeof(uint64_t));
}

int kvd_cuda_aws(const struct kvd_cuda_kernels *k, const float *probs, uint32_t heads,
		 uint32_t group, uint32_t w, uint32_t L, uint32_t topk, uint32_t k_min,
		 double scale, void *scratch, struct kvd_cuda_aws *ret, CUstream stream) {
	uint32_t half = w / 2, K = topk < L ? topk : L, n_out;
	uint64_t *possum = scratch;
	int r;

	if (!k || !probs || !ret || !scratch || heads == 0 || heads > 65535 || group == 0 ||
	    heads % group || w == 0 || L == 0 || topk == 0 || k_min % 2 == 0 || !isfinite(scale) ||
	    !(scale > 0))
		return -EINVAL;
	/* |t| <= L: the kernel 2 * floor(|t| / scale) + 1 must fit in 31 bits (smooth.h). */
	if ((double)L / scale >= (double)(INT32_MAX / 2))
		return -ERANGE;
	n_out = heads / group;
	r = launch(k, KFN_aws_rows, 2 * half, heads, 1, 1024, 0, stream,
		   (void *[]){ &probs, &w, &L, &K, &possum });
	if (r < 0)
		return r;
	return launch(k, KFN_aws_final, DIV_UP(n_out, 128), 1, 1, 128, 0, stream,
		      (void *[]){ &possum, &half, &K, &group, &k_min, &scale, &n_out, &ret });
}

int kvd_cuda_pool(const struct kvd_cuda_kernels *k, enum kvd_pool_mode mode, uint32_t kernel,
		  const struct kvd_cuda_aws *aws, const float *in, uint32_t rows, uint32_t n,
		  float *out, CUstream stream) {
	uint32_t m = (uint32_t)mode;

	if (!k || (int)mode < 0 || mode >= _KVD_POOL_MAX || rows > 65535 ||
	    (mode == KVD_POOL_ADAPTIVE) != (aws != NULL) ||
	    ((mode == KVD_POOL_AVG || mode == KVD_POOL_MAX) && kernel % 2 == 0) ||
	    (n > 0 && rows > 0 && (!in || !out)))
		return -EINVAL;
	return launch(k, KFN_pool, DIV_UP(n, 256), rows, 1, 256, 0, stream,
		      (void *[]){ &in, &n, &m, &kernel, &aws, &out });
}

int kvd_cuda_group_sum(const struct kvd_cuda_kernels *k, const float *in, uint32_t rows,
		       uint32_t g, uint32_t n, float *out, CUstream stream) {
	if (!k || g == 0 || rows > 65535 || (n > 0 && rows > 0 && (!in || !out)))
		return -EINVAL;
	return launch(k, KFN_group_sum, DIV_UP(n, 256), rows, 1, 256, 0, stream,
		      (void *[]){ &in, &g, &n, &out });
}

size_t kvd_cuda_normalize_scratch_bytes(size_t n) {
	(void)n;
	return align_up(NORM_PARTS * sizeof(double));
}

int kvd_cuda_normalize(const struct kvd_cuda_kernels *k, float *c, size_t n, float lambda,
		       void *scratch, CUstream stream) {
	uint64_t nn = n;
	uint32_t parts = NORM_PARTS;
	int r;

	if (!k || (n && !c) || !scratch || !isfinite(lambda) || lambda < 0)
		return -EINVAL;
	if (n == 0)
		return 0;
	r = launch(k, KFN_norm_partial, parts, 1, 1, 256, 0, stream,
		   (void *[]){ &c, &nn, &scratch });
	if (r < 0)
		return r;
	return launch(k, KFN_norm_apply, parts, 1, 1, 256, 0, stream,
		      (void *[]){ &c, &nn, &scratch, &parts, &lambda });
}

/* score.c's params_check(). */
static int score_params_check(const struct kvd_score_params *p) {
	if (!p || (int)p->kind < 0 || p->kind >= _KVD_SCORE_KIND_MAX || (int)p->pooling < 0 ||
	    p->pooling >= _KVD_POOL_MAX)
		return -EINVAL;
	if (p->pooling != KVD_POOL_NONE && (p->kernel == 0 || p->kernel % 2 == 0))
		return -EINVAL;
	if (p->pooling == KVD_POOL_ADAPTIVE &&
	    (p->aws_topk == 0 || !(p->aws_scale > 0) || !isfinite(p->aws_scale)))
		return -EINVAL;
	if (!isfinite(p->layer_weight) || p->layer_weight < 0)
		return -EINVAL;
	if (p->kind == KVD_SCORE_RESTKV && restkv_opts_check(&p->restkv) < 0)
		return -EINVAL;
	return 0;
}

static int score_joint(const struct kvd_score_params *p) {
	return p->kind == KVD_SCORE_LAPROX && p->laprox_joint && !p->per_query_head;
}

size_t kvd_cuda_score_layer_scratch_bytes(const struct kvd_attn_in *in,
					  const struct kvd_score_params *p) {
	size_t n = in->len - in->window, H = in->heads;

	return align_up(H * in->window * in->len * sizeof(float)) + /* probs */
	       2 * align_up(H * n * sizeof(float)) +                /* costs, pooled rows */
	       align_up(H * sizeof(struct kvd_cuda_aws)) + kvd_cuda_aws_scratch_bytes(in->heads, in->window) +
	       (p->kind == KVD_SCORE_RESTKV ? kvd_cuda_restkv_scratch_bytes(in, &p->restkv) : 0) +
	       kvd_cuda_normalize_scratch_bytes(0);
}

int kvd_cuda_score_layer(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			 const float *gram, const float *gram_group,
			 const struct kvd_score_params *p, void *scratch, float *scores,
			 CUstream stream) {
	uint32_t n, H, g, rows, cost_rows;
	float *probs, *cost, *pooled;
	struct kvd_cuda_aws *aws = NULL;
	void *aws_scratch, *rk_scratch = NULL, *norm_scratch;
	char *cur = scratch;
	int joint, r;

	if (in_check(k, in, 1) < 0 || score_params_check(p) < 0 || !scratch || !scores)
		return -EINVAL;
	n = in->len - in->window, H = in->heads, g = H / in->kv_heads;
	rows = kvd_score_rows(p, in);
	joint = score_joint(p);
	cost_rows = joint ? in->kv_heads : H;
	probs = carve(&cur, (size_t)H * in->window * in->len * sizeof(float));
	cost = carve(&cur, (size_t)H * n * sizeof(float));
	pooled = carve(&cur, (size_t)H * n * sizeof(float));
	aws = carve(&cur, H * sizeof(struct kvd_cuda_aws));
	aws_scratch = carve(&cur, kvd_cuda_aws_scratch_bytes(H, in->window));
	if (p->kind == KVD_SCORE_RESTKV)
		rk_scratch = carve(&cur, kvd_cuda_restkv_scratch_bytes(in, &p->restkv));
	norm_scratch = carve(&cur, kvd_cuda_normalize_scratch_bytes(0));

	r = kvd_cuda_attn(k, in, probs, stream);
	if (r < 0)
		return r;
	if (joint)
		r = kvd_cuda_laprox_group(k, in, probs, gram_group, cost, stream);
	else if (p->kind == KVD_SCORE_RESTKV)
		r = kvd_cuda_restkv(k, in, probs, gram, NULL, &p->restkv, rk_scratch, cost, stream);
	else
		r = kvd_cuda_laprox(k, in, probs, gram, NULL, cost, stream);
	if (r < 0)
		return r;
	if (p->pooling == KVD_POOL_ADAPTIVE) {
		/* Each head's own drift, or the group's mean t for joint rows (score.h). */
		r = kvd_cuda_aws(k, probs, H, joint ? g : 1, in->window, in->len, p->aws_topk,
				 p->kernel, p->aws_scale, aws_scratch, aws, stream);
		if (r < 0)
			return r;
	} else
		aws = NULL;
	/* Rows that are summed per kv head are pooled first, each with its own parameters. */
	r = kvd_cuda_pool(k, p->pooling, p->kernel, aws, cost, cost_rows, n,
			  !joint && rows != H ? pooled : scores, stream);
	if (r < 0)
		return r;
	if (!joint && rows != H) {
		r = kvd_cuda_group_sum(k, pooled, rows, g, n, scores, stream);
		if (r < 0)
			return r;
	}
	if (p->normalize)
		r = kvd_cuda_normalize(k, scores, (size_t)rows * n, p->layer_weight, norm_scratch,
				       stream);
	return r;
}

int kvd_cuda_topk_each(const struct kvd_cuda_kernels *k, const float *scores, uint32_t rows,
		       size_t stride, uint32_t n, uint32_t kk, uint32_t *keep, CUstream stream) {
	uint64_t st = stride;

	if (!k || kk > n || stride < n || (rows > 0 && kk > 0 && (!scores || !keep)))
		return -EINVAL;
	if (kk == 0)
		return 0;
	return launch(k, KFN_topk_rows, rows, 1, 1, 1024, 0, stream,
		      (void *[]){ &scores, &st, &n, &kk, &keep });
}

/* The selection state (struct gsel_state in cuda-kernels.cu): 256 counters, k, prefix, mask. */
#define GSEL_STATE_BYTES (256 * 8 + 8 + 4 + 4)

size_t kvd_cuda_topk_global_scratch_bytes(uint32_t total) {
	size_t chunks = total ? DIV_UP(total, GSEL_CHUNK) : 1;

	return align_up(GSEL_STATE_BYTES) + 2 * align_up(2 * chunks * sizeof(uint64_t));
}

int kvd_cuda_topk_global(const struct kvd_cuda_kernels *k, const float *scores, uint32_t total,
			 const uint32_t *row_start, uint32_t n_rows, uint32_t kk, void *scratch,
			 uint32_t *ret_counts, uint32_t *ret_keep, CUstream stream) {
	uint32_t chunks = total ? DIV_UP(total, GSEL_CHUNK) : 1, chunk = GSEL_CHUNK;
	uint64_t n = total, k64 = kk, *counts, *offsets;
	void *st;
	char *cur = scratch;
	int r;

	if (!k || kk > total || !scratch || (total && !scores) || (kk && !ret_keep) ||
	    (row_start && (n_rows == 0 || !ret_counts)))
		return -EINVAL;
	st = carve(&cur, GSEL_STATE_BYTES);
	counts = carve(&cur, 2 * (size_t)chunks * sizeof(uint64_t));
	offsets = carve(&cur, 2 * (size_t)chunks * sizeof(uint64_t));
	if (kk == 0) {
		CUresult cr = CUDA_SUCCESS;

		if (row_start)
			cr = k->cu->cuMemsetD8Async((CUdeviceptr)ret_counts, 0,
						    (size_t)n_rows * sizeof(uint32_t), stream);
		return cr == CUDA_SUCCESS ? 0 : cuda_dl_errno(cr);
	}
	r = launch(k, KFN_gsel_init, 1, 1, 1, 1, 0, stream, (void *[]){ &st, &k64 });
	for (int shift = 24; r >= 0 && shift >= 0; shift -= 8) {
		uint32_t sh = (uint32_t)shift;

		r = launch(k, KFN_gsel_hist, DIV_UP(total, 1024) < 1024 ? DIV_UP(total, 1024) : 1024,
			   1, 1, 256, 0, stream, (void *[]){ &scores, &n, &st, &sh });
		if (r >= 0)
			r = launch(k, KFN_gsel_pick, 1, 1, 1, 1, 0, stream, (void *[]){ &st, &sh });
	}
	if (r >= 0)
		r = launch(k, KFN_gsel_count, chunks, 1, 1, 256, 0, stream,
			   (void *[]){ &scores, &n, &chunk, &st, &counts });
	if (r >= 0)
		r = launch(k, KFN_gsel_scan, 1, 1, 1, 1, 0, stream,
			   (void *[]){ &counts, &chunks, &st, &offsets });
	if (r >= 0)
		r = launch(k, KFN_gsel_write, chunks, 1, 1, 1024, 0, stream,
			   (void *[]){ &scores, &n, &chunk, &st, &offsets, &ret_keep });
	if (r < 0 || !row_start)
		return r;
	/* Counts first: they search the positions that the second kernel rewrites. */
	r = launch(k, KFN_gsel_counts, DIV_UP(n_rows, 128), 1, 1, 128, 0, stream,
		   (void *[]){ &ret_keep, &kk, &row_start, &n_rows, &ret_counts });
	if (r < 0)
		return r;
	return launch(k, KFN_gsel_index, DIV_UP(kk, 256), 1, 1, 256, 0, stream,
		      (void *[]){ &ret_keep, &kk, &row_start, &n_rows });
}

size_t kvd_cuda_gather_slot_bytes(const struct kvd_gather_table *t) {
	return (size_t)t->heads * 2 * t->row_bytes;
}

int kvd_cuda_gather(const struct kvd_cuda_kernels *k, const struct kvd_gather_table *t,
		    const uint64_t *src_blocks, const uint64_t *dst_blocks, const uint32_t *keep,
		    uint32_t n_keep, void *scratch, size_t scratch_bytes, CUstream stream) {
	uint32_t bt, word, mode, batch;
	uint64_t rb, vo;
	int r = 0;

	if (!k || kvd_gather_table_check(t) < 0 || t->heads * 2 > 65535 ||
	    (n_keep > 0 && (!src_blocks || !keep)))
		return -EINVAL;
	bt = t->block_tokens, rb = t->row_bytes, vo = t->v_offset;
	/* Wide accesses when every row (and staging row) is aligned for them. */
	word = rb % 16 == 0 && vo % 16 == 0 && (uintptr_t)scratch % 16 == 0 ? 16 :
	       rb % 4 == 0 && vo % 4 == 0 && (uintptr_t)scratch % 4 == 0    ? 4 :
									      1;
	if (dst_blocks) {
		mode = 0;
		return launch(k, KFN_gather, n_keep, t->heads * 2, 1, 64, 0, stream,
			      (void *[]){ &src_blocks, &dst_blocks, &bt, &rb, &vo, &keep,
					  &(uint32_t){ 0 }, &mode, &word, &scratch });
	}
	batch = scratch_bytes / kvd_cuda_gather_slot_bytes(t) < UINT32_MAX ?
			(uint32_t)(scratch_bytes / kvd_cuda_gather_slot_bytes(t)) :
			UINT32_MAX;
	if (n_keep > 0 && (!scratch || batch == 0))
		return -ENOBUFS;
	/* Batch b reads slots >= its first index and writes slots below the next batch's:
	 * staged whole before it writes, it never overwrites what a later batch reads. */
	for (uint32_t j0 = 0; r >= 0 && j0 < n_keep; j0 += batch) {
		uint32_t nj = n_keep - j0 < batch ? n_keep - j0 : batch;

		for (mode = 1; r >= 0 && mode <= 2; mode++)
			r = launch(k, KFN_gather, nj, t->heads * 2, 1, 64, 0, stream,
				   (void *[]){ (void *)&src_blocks, (void *)&src_blocks, &bt, &rb, &vo,
					       &keep, &j0, &mode, &word, &scratch });
	}
	return r;
}
