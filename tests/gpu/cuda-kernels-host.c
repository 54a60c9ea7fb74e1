/* SPDX-License-Identifier: MIT */
/*
 * cuda-kernels.h on the CPU, for test-gpu-kernels-host: every entry point runs the
 * optimised CPU kernel it is specified against, on host memory ("device" pointers are host
 * pointers, streams are ignored, work is done on return). Linked instead of the real
 * launchers, it lets test-gpu-kernels.c run its shapes, reference calls and comparisons
 * on any machine, so that the test logic itself is tested where no GPU is; on a GPU the
 * same test source runs against the CUDA kernels.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-kernels.h"
#include "laprox.h"
#include "select.h"

struct kvd_cuda_kernels {
	int unused;
};

int kvd_cuda_kernels_new(const struct cuda_dl *cu, struct kvd_cuda_kernels **ret,
                         CUresult *ret_cr) {
	(void)cu;
	if (ret_cr)
		*ret_cr = CUDA_SUCCESS;
	*ret = calloc(1, sizeof(**ret));
	return *ret ? 0 : -ENOMEM;
}

struct kvd_cuda_kernels *kvd_cuda_kernels_free(struct kvd_cuda_kernels *k) {
	free(k);
	return NULL;
}

const char *kvd_cuda_kernels_arch(void) {
	return "host";
}

int kvd_cuda_attn(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in, float *probs,
		  CUstream stream) {
	uint32_t g;
	float *scratch;
	int r = 0;

	(void)k, (void)stream;
	if (kvd_attn_in_check(in) < 0 || !probs)
		return -EINVAL;
	g = in->heads / in->kv_heads;
	scratch = malloc(kvd_attn_scratch_floats(in) * sizeof(float));
	if (!scratch)
		return -ENOMEM;
	for (uint32_t kv = 0; r >= 0 && kv < in->kv_heads; kv++)
		r = kvd_attn_heads_buf(in, kv * g, g, probs + (size_t)kv * g * in->window * in->len,
				       scratch);
	free(scratch);
	return r;
}

int kvd_cuda_temporal(const struct kvd_cuda_kernels *k, enum kvd_temporal_mode mode, float alpha,
		      const float *probs, uint32_t rows, size_t matrix_stride, uint32_t w,
		      size_t stride, uint32_t n, float *agg, CUstream stream) {
	int r = 0;

	(void)k, (void)stream;
	for (uint32_t i = 0; r >= 0 && i < rows; i++)
		r = kvd_temporal_agg(mode, alpha, probs + i * matrix_stride, w, stride, n,
				     agg + (size_t)i * n);
	return r;
}

int kvd_cuda_restkv_vgv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			const float *gram, uint32_t n, float *vgv, CUstream stream) {
	size_t dd = (size_t)in->dim * in->dim;
	int r = 0;

	(void)k, (void)stream;
	for (uint32_t h = 0; r >= 0 && h < in->heads; h++)
		r = kvd_restkv_vgv(in, h, gram ? gram + h * dd : NULL, n, vgv + (size_t)h * n);
	return r;
}

size_t kvd_cuda_restkv_scratch_bytes(const struct kvd_attn_in *in, const struct kvd_restkv_opts *o) {
	(void)in, (void)o;
	return 1;
}

int kvd_cuda_restkv(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv,
		    const struct kvd_restkv_opts *o, void *scratch, float *cost, CUstream stream) {
	uint32_t g = in->heads / in->kv_heads;
	size_t n = in->len - in->window, dd = (size_t)in->dim * in->dim;
	int r = 0;

	(void)k, (void)stream, (void)scratch;
	for (uint32_t kv = 0; r >= 0 && kv < in->kv_heads; kv++) {
		uint32_t h0 = kv * g;

		r = kvd_restkv_heads(in, h0, g, probs + (size_t)h0 * in->window * in->len,
				     gram ? gram + h0 * dd : NULL, vgv ? vgv + h0 * n : NULL, o,
				     cost + h0 * n);
	}
	return r;
}

int kvd_cuda_laprox(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
		    const float *probs, const float *gram, const float *vgv, float *cost,
		    CUstream stream) {
	size_t n = in->len - in->window, dd = (size_t)in->dim * in->dim;
	int r = 0;

	(void)k, (void)stream;
	for (uint32_t h = 0; r >= 0 && h < in->heads; h++)
		r = kvd_laprox_head(in, h, probs + (size_t)h * in->window * in->len,
				    gram ? gram + h * dd : NULL, vgv ? vgv + h * n : NULL,
				    cost + h * n);
	return r;
}

int kvd_cuda_laprox_group(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			  const float *probs, const float *gram_group, float *cost, CUstream stream) {
	uint32_t g = in->heads / in->kv_heads;
	size_t n = in->len - in->window, gd = (size_t)g * in->dim;
	const float *pp[64];
	int r = 0;

	(void)k, (void)stream;
	if (g > 64)
		return -EINVAL;
	for (uint32_t kv = 0; r >= 0 && kv < in->kv_heads; kv++) {
		for (uint32_t a = 0; a < g; a++)
			pp[a] = probs + (size_t)(kv * g + a) * in->window * in->len;
		r = kvd_laprox_group(in, kv, pp, gram_group ? gram_group + kv * gd * gd : NULL,
				     cost + kv * n);
	}
	return r;
}

size_t kvd_cuda_aws_scratch_bytes(uint32_t heads, uint32_t w) {
	(void)heads, (void)w;
	return 1;
}

int kvd_cuda_aws(const struct kvd_cuda_kernels *k, const float *probs, uint32_t heads,
		 uint32_t group, uint32_t w, uint32_t L, uint32_t topk, uint32_t k_min,
		 double scale, void *scratch, struct kvd_cuda_aws *ret, CUstream stream) {
	(void)k, (void)stream, (void)scratch;
	if (group == 0 || heads % group)
		return -EINVAL;
	for (uint32_t o = 0; o < heads / group; o++) {
		struct kvd_aws a;
		double t = 0;
		int r;

		for (uint32_t j = 0; j < group; j++) {
			r = kvd_aws_params(probs + (size_t)(o * group + j) * w * L, w, L, L, topk, k_min,
					   scale, &a);
			if (r < 0)
				return r;
			t += a.t;
		}
		if (group > 1) {
			r = kvd_aws_from_t(t / group, k_min, scale, &a);
			if (r < 0)
				return r;
		}
		ret[o] = (struct kvd_cuda_aws){ a.kernel, a.shift, a.t };
	}
	return 0;
}

int kvd_cuda_pool(const struct kvd_cuda_kernels *k, enum kvd_pool_mode mode, uint32_t kernel,
		  const struct kvd_cuda_aws *aws, const float *in, uint32_t rows, uint32_t n,
		  float *out, CUstream stream) {
	int r = 0;

	(void)k, (void)stream;
	if ((mode == KVD_POOL_ADAPTIVE) != (aws != NULL))
		return -EINVAL;
	for (uint32_t i = 0; r >= 0 && i < rows; i++)
		r = kvd_pool_row(mode, aws ? aws[i].kernel : kernel, aws ? aws[i].shift : 0,
				 in + (size_t)i * n, n, out + (size_t)i * n);
	return r;
}

int kvd_cuda_group_sum(const struct kvd_cuda_kernels *k, const float *in, uint32_t rows,
		       uint32_t g, uint32_t n, float *out, CUstream stream) {
	(void)k, (void)stream;
	for (uint32_t r = 0; r < rows; r++)
		for (uint32_t i = 0; i < n; i++) {
			float s = in[(size_t)r * g * n + i];

			for (uint32_t a = 1; a < g; a++)
				s += in[((size_t)r * g + a) * n + i];
			out[(size_t)r * n + i] = s;
		}
	return 0;
}

size_t kvd_cuda_normalize_scratch_bytes(size_t n) {
	(void)n;
	return 1;
}

int kvd_cuda_normalize(const struct kvd_cuda_kernels *k, float *c, size_t n, float lambda,
		       void *scratch, CUstream stream) {
	(void)k, (void)stream, (void)scratch;
	return kvd_laprox_normalize(c, n, lambda);
}

size_t kvd_cuda_score_layer_scratch_bytes(const struct kvd_attn_in *in,
					  const struct kvd_score_params *p) {
	(void)in, (void)p;
	return 1;
}

int kvd_cuda_score_layer(const struct kvd_cuda_kernels *k, const struct kvd_attn_in *in,
			 const float *gram, const float *gram_group,
			 const struct kvd_score_params *p, void *scratch, float *scores,
			 CUstream stream) {
	struct kvd_score_params q = *p;

	(void)k, (void)stream, (void)scratch;
	q.threads = 2;
	return kvd_score_layer(in, gram, gram_group, &q, scores);
}

int kvd_cuda_topk_each(const struct kvd_cuda_kernels *k, const float *scores, uint32_t rows,
		       size_t stride, uint32_t n, uint32_t kk, uint32_t *keep, CUstream stream) {
	int r = 0;

	(void)k, (void)stream;
	for (uint32_t i = 0; r >= 0 && i < rows; i++)
		r = kvd_topk(scores + i * stride, n, kk, keep + (size_t)i * kk);
	return r;
}

size_t kvd_cuda_topk_global_scratch_bytes(uint32_t total) {
	(void)total;
	return 1;
}

int kvd_cuda_topk_global(const struct kvd_cuda_kernels *k, const float *scores, uint32_t total,
			 const uint32_t *row_start, uint32_t n_rows, uint32_t kk, void *scratch,
			 uint32_t *ret_counts, uint32_t *ret_keep, CUstream stream) {
	const float **rows;
	uint32_t *lens, one;
	int r;

	(void)k, (void)stream, (void)scratch;
	if (!row_start)
		return kvd_topk_rows(&scores, &total, 1, kk, 2, ret_counts ? ret_counts : &one,
				     ret_keep);
	rows = calloc(n_rows, sizeof(*rows));
	lens = calloc(n_rows, sizeof(*lens));
	if (!rows || !lens) {
		free(rows), free(lens);
		return -ENOMEM;
	}
	for (uint32_t i = 0; i < n_rows; i++) {
		rows[i] = scores + row_start[i];
		lens[i] = row_start[i + 1] - row_start[i];
	}
	r = kvd_topk_rows(rows, lens, n_rows, kk, 2, ret_counts, ret_keep);
	free(rows), free(lens);
	return r;
}

size_t kvd_cuda_gather_slot_bytes(const struct kvd_gather_table *t) {
	return (size_t)t->heads * 2 * t->row_bytes;
}

int kvd_cuda_gather(const struct kvd_cuda_kernels *k, const struct kvd_gather_table *t,
		    const uint64_t *src_blocks, const uint64_t *dst_blocks, const uint32_t *keep,
		    uint32_t n_keep, void *scratch, size_t scratch_bytes, CUstream stream) {
	/* uint64_t and char * have one size here (the test only runs on 64-bit hosts). */
	(void)k, (void)stream, (void)scratch;
	if (!dst_blocks && n_keep > 0 && scratch_bytes < kvd_cuda_gather_slot_bytes(t))
		return -ENOBUFS;
	return kvd_gather_ref(t, (char *const *)src_blocks, (char *const *)dst_blocks, keep, n_keep);
}
