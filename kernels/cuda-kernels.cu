/* SPDX-License-Identifier: MIT */
/*
 * The device code behind cuda-kernels.h. Compiled by nvcc to a fatbin only (no host code,
 * no cudart): cuda-kernels.c loads it with the driver API and launches these extern "C"
 * kernels by name with the argument lists written next to each. Keep those lists and the
 * launchers in step: the driver cannot check them.
 *
 * Numerics follow the CPU references where it is cheap to: fp64 where they sum in double,
 * __fadd_rn/__fmul_rn (no fma contraction) where the CPU's fp32 result should be matched
 * bit for bit (temporal folding, the GQA sum), IEEE division and expf (no fast math).
 */
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

/* kernels/dtype.h */
#define DT_F16 1u
#define DT_BF16 2u
#define DT_F32 3u
/* smooth.h enum kvd_temporal_mode, enum kvd_pool_mode; restkv.h enum kvd_restkv_metric */
#define TM_EMA 0u
#define TM_MEAN 1u
#define TM_LAST 2u
#define PL_NONE 0u
#define PL_AVG 1u
#define PL_MAX 2u
#define PL_ADAPTIVE 3u
#define RM_AFTER 0u
/* restkv.h */
#define A_MAX (1.0f - 1e-6f)
#define A_DIRECT (1.0f / 64)

#define FULL 0xffffffffu

struct aws_out { /* struct kvd_cuda_aws */
	u32 kernel;
	int shift;
	double t;
};

__device__ __forceinline__ float ld(const void *base, u32 dtype, u64 off) {
	if (dtype == DT_F32)
		return ((const float *)base)[off];
	unsigned short x = ((const unsigned short *)base)[off];
	if (dtype == DT_BF16)
		return __uint_as_float((u32)x << 16);
	return __half2float(__ushort_as_half(x));
}

__device__ __forceinline__ float warp_sum(float x) {
	for (int o = 16; o > 0; o >>= 1)
		x += __shfl_xor_sync(FULL, x, o);
	return x;
}

__device__ __forceinline__ double warp_sum_d(double x) {
	for (int o = 16; o > 0; o >>= 1)
		x += __shfl_xor_sync(FULL, x, o);
	return x;
}

/* Block-wide sums and max (blockDim a multiple of 32); every thread gets the result. */
__device__ double block_sum_d(double x) {
	__shared__ double s[32];
	u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

	x = warp_sum_d(x);
	__syncthreads();
	if (lane == 0)
		s[warp] = x;
	__syncthreads();
	x = lane < nw ? s[lane] : 0;
	return warp_sum_d(x);
}

__device__ float block_max(float x) {
	__shared__ float s[32];
	u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

	for (int o = 16; o > 0; o >>= 1)
		x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
	__syncthreads();
	if (lane == 0)
		s[warp] = x;
	__syncthreads();
	x = lane < nw ? s[lane] : -INFINITY;
	for (int o = 16; o > 0; o >>= 1)
		x = fmaxf(x, __shfl_xor_sync(FULL, x, o));
	return x;
}

__device__ u64 block_sum_u64(u64 x) {
	__shared__ u64 s[32];
	u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;

	for (int o = 16; o > 0; o >>= 1)
		x += __shfl_xor_sync(FULL, x, o);
	__syncthreads();
	if (lane == 0)
		s[warp] = x;
	__syncthreads();
	x = lane < nw ? s[lane] : 0;
	for (int o = 16; o > 0; o >>= 1)
		x += __shfl_xor_sync(FULL, x, o);
	return x;
}

/*
 * Exclusive prefix count of flag over the block in thread order; *total gets the block's
 * count. Every thread of the block must call it.
 */
__device__ u32 block_scan(u32 flag, u32 *total) {
	__shared__ u32 wc[32];
	u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
	u32 bal = __ballot_sync(FULL, flag), pre = __popc(bal & ((1u << lane) - 1)), base = 0;

	__syncthreads();
	if (lane == 0)
		wc[warp] = __popc(bal);
	__syncthreads();
	for (u32 i = 0; i < nw; i++) {
		if (i == warp)
			pre += base;
		base += wc[i];
	}
	*total = base;
	return pre;
}

/*
 * select.h's order as an unsigned key: a higher key ranks higher; NaN is 0 (below -inf,
 * whose key is 0x007fffff), -0 is +0. Equal keys rank by position.
 */
__device__ __forceinline__ u32 rank_key(float f) {
	if (isnan(f))
		return 0;
	u32 b = __float_as_uint(f == 0.0f ? 0.0f : f);
	return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/*
 * The K-th highest key of x[0..n) (1 <= K <= n) by a block-wide 8-bit radix select: *ret_t
 * gets it, *ret_need how many items with that key the top K holds (the lowest positions
 * among them). Every thread of the block must call it.
 */
__device__ void block_select(const float *x, u32 n, u32 K, u32 *ret_t, u32 *ret_need) {
	__shared__ u32 hist[256], s_prefix, s_k;
	u32 prefix = 0, mask = 0, k = K;

	for (int shift = 24; shift >= 0; shift -= 8) {
		for (u32 b = threadIdx.x; b < 256; b += blockDim.x)
			hist[b] = 0;
		__syncthreads();
		for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
			u32 key = rank_key(x[i]);

			if ((key & mask) == prefix)
				atomicAdd(&hist[(key >> shift) & 255u], 1u);
		}
		__syncthreads();
		if (threadIdx.x == 0) {
			for (int b = 255; b >= 0; b--) {
				if (k <= hist[b]) {
					prefix |= (u32)b << shift;
					break;
				}
				k -= hist[b];
			}
			s_prefix = prefix;
			s_k = k;
		}
		__syncthreads();
		prefix = s_prefix;
		k = s_k;
		mask |= 255u << shift;
		__syncthreads();
	}
	*ret_t = prefix;
	*ret_need = k;
}

/* ---- Window attention ---- */

/*
 * Logits of a 32-row x 32-key tile for every query head of one kv head (grid x: key tiles,
 * y: kv heads, z: row tiles; 256 threads), accumulated over d in chunks of 32 through
 * shared memory. The key tile is re-read from L1/L2 for each head of the group, so DRAM
 * sees K about once per layer. Logits a row may not see are -inf (the softmax zeroes them).
 */
extern "C" __global__ void __launch_bounds__(256)
kvd_cu_attn_logits(const void *q, const void *k, u32 dtype, u32 heads, u32 kv_heads, u32 w,
		   u32 L, u32 d, float scale, u64 qhs, u64 qrs, u64 khs, u64 krs, float *probs) {
	__shared__ float ks[32][33], qs[32][33];
	u32 g = heads / kv_heads, kv = blockIdx.y, i0 = blockIdx.x * 32, t0 = blockIdx.z * 32;
	u32 tx = threadIdx.x & 31, ty = threadIdx.x >> 5;

	for (u32 j = 0; j < g; j++) {
		u32 h = kv * g + j;
		float acc[4] = { 0, 0, 0, 0 };

		for (u32 d0 = 0; d0 < d; d0 += 32) {
			for (u32 e = threadIdx.x; e < 1024; e += 256) {
				u32 r = e >> 5, c = e & 31, dim = d0 + c;

				ks[r][c] = i0 + r < L && dim < d ?
						   ld(k, dtype, kv * khs + (u64)(i0 + r) * krs + dim) :
						   0.0f;
				qs[r][c] = t0 + r < w && dim < d ?
						   ld(q, dtype, h * qhs + (u64)(t0 + r) * qrs + dim) :
						   0.0f;
			}
			__syncthreads();
#pragma unroll 8
			for (u32 c = 0; c < 32; c++) {
				float kx = ks[tx][c];

#pragma unroll
				for (u32 m = 0; m < 4; m++)
					acc[m] += qs[ty + 8 * m][c] * kx;
			}
			__syncthreads();
		}
#pragma unroll
		for (u32 m = 0; m < 4; m++) {
			u32 t = t0 + ty + 8 * m, i = i0 + tx;

			if (t < w && i < L)
				probs[((u64)h * w + t) * L + i] = i <= L - w + t ? acc[m] * scale : -INFINITY;
		}
	}
}

/* Softmax of one row (grid: H * w rows) over the keys it sees, in place; the sum in fp64. */
extern "C" __global__ void __launch_bounds__(512)
kvd_cu_softmax(float *probs, u32 w, u32 L) {
	u32 t = blockIdx.x % w, visible = L - w + t + 1;
	float *p = probs + (u64)blockIdx.x * L, m = -INFINITY;
	double s = 0;

	for (u32 i = threadIdx.x; i < visible; i += blockDim.x)
		m = fmaxf(m, p[i]);
	m = block_max(m);
	for (u32 i = threadIdx.x; i < visible; i += blockDim.x)
		s += expf(p[i] - m);
	s = block_sum_d(s);
	for (u32 i = threadIdx.x; i < visible; i += blockDim.x)
		p[i] = (float)(expf(p[i] - m) / s);
	for (u32 i = visible + threadIdx.x; i < L; i += blockDim.x)
		p[i] = 0;
}

/* ---- Temporal folding (grid x: column blocks, y: matrices) ---- */

extern "C" __global__ void kvd_cu_temporal(const float *probs, u64 matrix_stride, u32 w,
					   u64 stride, u32 n, u32 mode, float alpha, float *agg) {
	u32 i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
	const float *p;
	float acc;

	if (i >= n)
		return;
	p = probs + r * matrix_stride + i;
	if (mode == TM_EMA) {
		acc = p[0];
		for (u32 t = 1; t < w; t++)
			acc = __fadd_rn(__fmul_rn(alpha, p[t * stride]), __fmul_rn(1.0f - alpha, acc));
	} else if (mode == TM_LAST)
		acc = p[(u64)(w - 1) * stride];
	else {
		acc = 0;
		for (u32 t = 0; t < w; t++)
			acc = __fadd_rn(acc, p[t * stride]);
		if (mode == TM_MEAN)
			acc = __fdiv_rn(acc, (float)w);
	}
	agg[(u64)r * n + i] = acc;
}

/* ---- ReST-KV and LaProx costs ---- */

/*
 * o = sum_i wgt[r][i] v_i, in partial sums: block (r, c) sums tokens [c * chunk, ..) of row
 * r of the weights into partial[r][c][d] (grid x: rows, which may be H * w; y: chunks). Row r belongs to query head r / rows_per_head
 * (after: 1, weights = the aggregate; before: w, weights = the probability rows).
 */
extern "C" __global__ void kvd_cu_mix_partial(const float *wgt, u64 w_stride, u32 rows_per_head,
					      u32 n, const void *v, u32 dtype, u32 g, u64 vhs,
					      u64 vrs, u32 d, u32 chunk, float *partial) {
	u32 r = blockIdx.x, c = blockIdx.y, kv = r / rows_per_head / g;
	u32 lo = c * chunk, hi = min(n, lo + chunk);
	const float *wr = wgt + r * w_stride;

	for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
		float acc = 0;

		for (u32 i = lo; i < hi; i++)
			acc += wr[i] * ld(v, dtype, kv * vhs + (u64)i * vrs + j);
		partial[((u64)r * gridDim.y + c) * d + j] = acc;
	}
}

/*
 * One row r per block: o[r] = the sum of its partials (fp64), og[r] = o G_h, ogo[r] =
 * o G_h o^T (G the identity when gram is NULL). Dynamic shared memory: d floats.
 */
extern "C" __global__ void kvd_cu_mix_final(const float *partial, u32 nchunk, u32 d,
					    u32 rows_per_head, const float *gram, float *o,
					    float *og, float *ogo) {
	extern __shared__ float so[];
	u32 r = blockIdx.x, h = r / rows_per_head;
	const float *G = gram ? gram + (u64)h * d * d : NULL;
	double part = 0;

	for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
		double s = 0;

		for (u32 c = 0; c < nchunk; c++)
			s += partial[((u64)r * nchunk + c) * d + j];
		so[j] = (float)s;
		o[(u64)r * d + j] = (float)s;
	}
	__syncthreads();
	for (u32 b = threadIdx.x; b < d; b += blockDim.x) {
		double x = 0;

		if (G)
			for (u32 a = 0; a < d; a++)
				x += (double)so[a] * G[(u64)a * d + b];
		else
			x = so[b];
		og[(u64)r * d + b] = (float)x;
		part += x * so[b];
	}
	part = block_sum_d(part);
	if (threadIdx.x == 0)
		ogo[r] = (float)part;
}

/* x G x^T over a warp (x in shared memory, G rows ld apart; the identity when NULL). */
__device__ float warp_quad(const float *x, const float *G, u64 ldg, u32 d) {
	u32 lane = threadIdx.x & 31;
	float acc = 0;

	if (!G)
		for (u32 j = lane; j < d; j += 32)
			acc += x[j] * x[j];
	else
		for (u32 a = 0; a < d; a++) {
			float xa = x[a];
			const float *row = G + a * ldg;

			for (u32 b = lane; b < d; b += 32)
				acc += xa * row[b] * x[b];
		}
	return warp_sum(acc);
}

/* Loads value row i of kv head kv into shared sv (warp-wide). */
__device__ void warp_vrow(const void *v, u32 dtype, u64 vhs, u64 vrs, u32 kv, u32 i, u32 d,
			  float *sv) {
	for (u32 j = threadIdx.x & 31; j < d; j += 32)
		sv[j] = ld(v, dtype, kv * vhs + (u64)i * vrs + j);
	__syncwarp();
}

__device__ __forceinline__ float restkv_cost(float a, float norm) {
	float c = a > A_MAX ? A_MAX : a;

	return a > A_MAX ? INFINITY : c / (1.0f - c) * norm;
}

/*
 * ||(o - v) W_o^h|| in the Gram form, clamped at 0, for weight a; from a >= A_DIRECT the
 * direct (o - v) G (o - v)^T (restkv.h's cancellation guard). *vgv is v G v^T if *have_vgv,
 * else computed here once (the before mode asks for it up to w times).
 */
__device__ float restkv_norm(const float *sv, float *sx, const float *o, const float *og,
			     float ogo, float a, const float *G, u32 d, float *vgv, int *have_vgv) {
	u32 lane = threadIdx.x & 31;
	float cross = 0, sq;

	if (a >= A_DIRECT) {
		for (u32 j = lane; j < d; j += 32)
			sx[j] = o[j] - sv[j];
		__syncwarp();
		sq = warp_quad(sx, G, d, d);
		__syncwarp();
		return sqrtf(fmaxf(sq, 0.0f));
	}
	for (u32 j = lane; j < d; j += 32)
		cross += og[j] * sv[j];
	cross = warp_sum(cross);
	if (!*have_vgv) {
		*vgv = warp_quad(sv, G, d, d);
		*have_vgv = 1;
	}
	sq = ogo - 2 * cross + *vgv;
	return sqrtf(fmaxf(sq, 0.0f));
}

/*
 * The ReST-KV cost, a warp per token (grid x: token groups of 8, y: query heads; 256
 * threads; dynamic shared memory 16 * d floats). o/og/ogo: [H][d] (after) or [H*w][d]
 * (before), from kvd_cu_mix_*.
 */
extern "C" __global__ void __launch_bounds__(256)
kvd_cu_restkv_cost(const void *v, u32 dtype, u32 g, u64 vhs, u64 vrs, u32 d, u32 w, u32 L,
		   const float *probs, const float *agg, const float *gram, const float *vgv,
		   const float *o, const float *og, const float *ogo, u32 metric, u32 temporal,
		   float alpha, float tau, u32 use_norm, float *cost) {
	extern __shared__ float sh[];
	u32 n = L - w, warp = threadIdx.x >> 5, i = blockIdx.x * 8 + warp, h = blockIdx.y;
	float *sv = sh + warp * 2 * d, *sx = sv + d, vg = 0, c;
	const float *G = gram ? gram + (u64)h * d * d : NULL;
	int have_vg = vgv != NULL;

	if (i >= n)
		return;
	warp_vrow(v, dtype, vhs, vrs, h / g, i, d, sv);
	if (vgv)
		vg = vgv[(u64)h * n + i];
	if (metric == RM_AFTER) {
		float a = agg[(u64)h * n + i];
		float norm = restkv_norm(sv, sx, o + (u64)h * d, og + (u64)h * d, ogo[h], a, G, d, &vg,
					 &have_vg);

		if (tau != 1.0f)
			norm = powf(norm, tau);
		c = restkv_cost(a, norm);
	} else {
		c = 0;
		for (u32 t = 0; t < w; t++) {
			u64 r = (u64)h * w + t;
			float p = probs[r * L + i];
			float norm = restkv_norm(sv, sx, o + r * d, og + r * d, ogo[r], p, G, d, &vg,
						 &have_vg);
			float on = sqrtf(fmaxf(ogo[r], 0.0f)), s;

			if (use_norm && on > 0)
				norm /= on;
			s = restkv_cost(p, norm);
			/* kvd_temporal_agg_ref()'s fold, in its operation order. */
			if (temporal == TM_EMA)
				c = t == 0 ? s : __fadd_rn(__fmul_rn(alpha, s), __fmul_rn(1.0f - alpha, c));
			else if (temporal == TM_LAST)
				c = s;
			else
				c = __fadd_rn(c, s);
		}
		if (temporal == TM_MEAN)
			c = __fdiv_rn(c, (float)w);
	}
	if ((threadIdx.x & 31) == 0)
		cost[(u64)h * n + i] = c;
}

/* v G_h v^T per token, a warp each (grid x: groups of 8 tokens, y: query heads). */
extern "C" __global__ void __launch_bounds__(256)
kvd_cu_vgv(const void *v, u32 dtype, u32 g, u64 vhs, u64 vrs, u32 d, u32 n, const float *gram,
	   float *vgv) {
	extern __shared__ float sh[];
	u32 warp = threadIdx.x >> 5, i = blockIdx.x * 8 + warp, h = blockIdx.y;
	float *sv = sh + warp * d, q;

	if (i >= n)
		return;
	warp_vrow(v, dtype, vhs, vrs, h / g, i, d, sv);
	q = warp_quad(sv, gram ? gram + (u64)h * d * d : NULL, d, d);
	if ((threadIdx.x & 31) == 0)
		vgv[(u64)h * n + i] = q;
}

/* LaProx diagonal cost, a warp per token (grid x: groups of 8 tokens, y: query heads). */
extern "C" __global__ void __launch_bounds__(256)
kvd_cu_laprox_diag(const void *v, u32 dtype, u32 g, u64 vhs, u64 vrs, u32 d, u32 w, u32 L,
		   const float *probs, const float *gram, const float *vgv, float *cost) {
	extern __shared__ float sh[];
	u32 n = L - w, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	u32 i = blockIdx.x * 8 + warp, h = blockIdx.y;
	float *sv = sh + warp * d, col = 0, vn;

	if (i >= n)
		return;
	for (u32 t = lane; t < w; t += 32) {
		float x = probs[((u64)h * w + t) * L + i];

		col += x * x;
	}
	col = warp_sum(col);
	if (vgv)
		vn = vgv[(u64)h * n + i];
	else {
		warp_vrow(v, dtype, vhs, vrs, h / g, i, d, sv);
		vn = warp_quad(sv, gram ? gram + (u64)h * d * d : NULL, d, d);
	}
	if (lane == 0)
		cost[(u64)h * n + i] = sqrtf(col) * sqrtf(fmaxf(vn, 0.0f));
}

/*
 * LaProx GQA-joint cost, a warp per token of one kv head (grid x: groups of 8 tokens, y: kv
 * heads): sum over head pairs (a, b) of the group of (A_a[:, i] . A_b[:, i]) * v G_ab v^T.
 */
extern "C" __global__ void __launch_bounds__(256)
kvd_cu_laprox_group(const void *v, u32 dtype, u32 g, u64 vhs, u64 vrs, u32 d, u32 w, u32 L,
		    const float *probs, const float *gram_group, float *cost) {
	extern __shared__ float sh[];
	u32 n = L - w, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	u32 i = blockIdx.x * 8 + warp, kv = blockIdx.y;
	u64 gd = (u64)g * d;
	float *sv = sh + warp * d, s = 0;
	const float *gg = gram_group ? gram_group + kv * gd * gd : NULL;

	if (i >= n)
		return;
	warp_vrow(v, dtype, vhs, vrs, kv, i, d, sv);
	for (u32 a = 0; a < g; a++)
		for (u32 b = 0; b < g; b++) {
			const float *pa = probs + ((u64)(kv * g + a) * w) * L + i;
			const float *pb = probs + ((u64)(kv * g + b) * w) * L + i;
			float col = 0, q;

			if (!gg && a != b)
				continue;
			for (u32 t = lane; t < w; t += 32)
				col += pa[(u64)t * L] * pb[(u64)t * L];
			col = warp_sum(col);
			q = warp_quad(sv, gg ? gg + a * d * gd + b * d : NULL, gd, d);
			s += col * q;
		}
	if (lane == 0)
		cost[(u64)kv * n + i] = sqrtf(fmaxf(s, 0.0f));
}

/* ---- Adaptive window pooling parameters ---- */

/*
 * The sum of the positions of the top-K of one probability row (grid x: rows 0..2*half-1,
 * y: heads; 1024 threads), by smooth.h's ranking: NaN lowest, ties to the lower position.
 */
extern "C" __global__ void __launch_bounds__(1024)
kvd_cu_aws_rows(const float *probs, u32 w, u32 L, u32 K, u64 *possum) {
	const float *x = probs + ((u64)blockIdx.y * w + blockIdx.x) * L;
	u32 T, need, eq_before = 0;
	u64 sum = 0;

	block_select(x, L, K, &T, &need);
	for (u32 base = 0; base < L; base += blockDim.x) {
		u32 i = base + threadIdx.x, in = i < L, key = in ? rank_key(x[i]) : 0;
		u32 eq = in && key == T, tot, pre = block_scan(eq, &tot);

		if (in && (key > T || (eq && eq_before + pre < need)))
			sum += i;
		eq_before += tot;
	}
	sum = block_sum_u64(sum);
	if (threadIdx.x == 0)
		possum[(u64)blockIdx.y * gridDim.x + blockIdx.x] = sum;
}

/* CPython's float floor division: smooth_ref.c's py_floordiv(). */
__device__ double py_floordiv(double vx, double wx) {
	double mod = fmod(vx, wx), div = (vx - mod) / wx, fd;

	if (mod != 0 && (wx < 0) != (mod < 0))
		div -= 1.0;
	if (div != 0) {
		fd = floor(div);
		if (div - fd > 0.5)
			fd += 1.0;
	} else
		fd = copysign(0.0, vx / wx);
	return fd;
}

/*
 * t, kernel and shift per output (one thread each): kvd_aws_params_ref()'s t per head,
 * averaged over `group` consecutive heads when group > 1, then kvd_aws_from_t(). The host
 * checked the arguments and that no kernel can overflow.
 */
extern "C" __global__ void kvd_cu_aws_final(const u64 *possum, u32 half, u32 K, u32 group,
					    u32 k_min, double scale, u32 n_out, struct aws_out *out) {
	u32 o = blockIdx.x * blockDim.x + threadIdx.x;
	double t = 0, q, s, kk;

	if (o >= n_out)
		return;
	for (u32 a = 0; a < group; a++) {
		const u64 *ps = possum + (u64)(o * group + a) * 2 * half;
		i64 diff = 0;

		for (u32 r = 0; r < half; r++)
			diff += (i64)ps[r] - (i64)ps[half + r];
		t += half > 0 ? (double)diff / ((double)half * K) : 0.0;
	}
	if (group > 1)
		t /= group;
	q = py_floordiv(fabs(t), scale);
	s = py_floordiv(t, scale);
	if (!(t > 0))
		s += 1;
	kk = 2 * q + 1;
	out[o].kernel = kk > k_min ? (u32)kk : k_min;
	out[o].shift = (int)s;
	out[o].t = t;
}

/* ---- Pooling, GQA sum, normalisation ---- */

extern "C" __global__ void kvd_cu_pool(const float *in, u32 n, u32 mode, u32 kernel,
				       const struct aws_out *aws, float *out) {
	u32 j = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
	const float *x = in + (u64)r * n;
	int shift = 0;
	i64 half;

	if (j >= n)
		return;
	if (mode == PL_NONE) {
		out[(u64)r * n + j] = x[j];
		return;
	}
	if (mode == PL_ADAPTIVE)
		kernel = aws[r].kernel, shift = aws[r].shift;
	half = kernel / 2;
	if (mode == PL_MAX) {
		float m = -INFINITY;
		int any_nan = 0;

		for (i64 i = (i64)j - half; i <= (i64)j + half; i++)
			if (i >= 0 && i < (i64)n) {
				if (isnan(x[i]))
					any_nan = 1;
				else if (x[i] > m)
					m = x[i];
			}
		out[(u64)r * n + j] = any_nan ? NAN : m;
	} else {
		double sum = 0;

		for (i64 m = -half; m <= half; m++) {
			i64 i = (i64)j + m;

			if (mode == PL_AVG) {
				if (i >= 0 && i < (i64)n)
					sum += x[i];
			} else {
				i += shift;
				sum += x[i < 0 ? 0 : i >= (i64)n ? (i64)n - 1 : i];
			}
		}
		out[(u64)r * n + j] = (float)(sum / (double)kernel);
	}
}

extern "C" __global__ void kvd_cu_group_sum(const float *in, u32 g, u32 n, float *out) {
	u32 i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
	float s;

	if (i >= n)
		return;
	s = in[(u64)r * g * n + i];
	for (u32 a = 1; a < g; a++)
		s = __fadd_rn(s, in[((u64)r * g + a) * n + i]);
	out[(u64)r * n + i] = s;
}

/* Partial fp64 sums of the finite entries, one per block (grid-stride). */
extern "C" __global__ void kvd_cu_norm_partial(const float *c, u64 n, double *partial) {
	double s = 0;

	for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (u64)gridDim.x * blockDim.x)
		if (isfinite(c[i]))
			s += c[i];
	s = block_sum_d(s);
	if (threadIdx.x == 0)
		partial[blockIdx.x] = s;
}

extern "C" __global__ void kvd_cu_norm_apply(float *c, u64 n, const double *partial,
					     u32 nparts, float lambda) {
	__shared__ double s_sum;
	double sum;

	/* The partials in one fixed order: every block gets the same total. */
	if (threadIdx.x == 0) {
		sum = 0;
		for (u32 b = 0; b < nparts; b++)
			sum += partial[b];
		s_sum = sum;
	}
	__syncthreads();
	sum = s_sum;
	for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (u64)gridDim.x * blockDim.x)
		c[i] = sum > 0 ? (float)(lambda * (c[i] / sum)) : lambda * c[i];
}

/* ---- Selection ---- */

/* Per-row top-k (grid x: rows; 1024 threads): kept indices, ascending, into keep[row][K]. */
extern "C" __global__ void __launch_bounds__(1024)
kvd_cu_topk_rows(const float *scores, u64 stride, u32 n, u32 K, u32 *keep) {
	const float *x = scores + blockIdx.x * stride;
	u32 *out = keep + (u64)blockIdx.x * K;
	u32 T, need, eq_before = 0, kept_before = 0;

	block_select(x, n, K, &T, &need);
	for (u32 base = 0; base < n && kept_before < K; base += blockDim.x) {
		u32 i = base + threadIdx.x, in = i < n, key = in ? rank_key(x[i]) : 0;
		u32 eq = in && key == T, tot_eq, pre_eq = block_scan(eq, &tot_eq);
		u32 kept = in && (key > T || (eq && eq_before + pre_eq < need));
		u32 tot_k, pre_k = block_scan(kept, &tot_k);

		if (kept)
			out[kept_before + pre_k] = i;
		eq_before += tot_eq;
		kept_before += tot_k;
	}
}

/*
 * Global selection over n items in a few grid-wide passes. State (device):
 *   hist[256] u64, then k (u64: the rank still to find), prefix, mask (u32).
 */
struct gsel_state {
	u64 hist[256];
	u64 k;
	u32 prefix, mask;
};

extern "C" __global__ void kvd_cu_gsel_hist(const float *x, u64 n, struct gsel_state *st,
					    u32 shift) {
	__shared__ u32 hist[256];
	u32 prefix = st->prefix, mask = st->mask;

	for (u32 b = threadIdx.x; b < 256; b += blockDim.x)
		hist[b] = 0;
	__syncthreads();
	for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (u64)gridDim.x * blockDim.x) {
		u32 key = rank_key(x[i]);

		if ((key & mask) == prefix)
			atomicAdd(&hist[(key >> shift) & 255u], 1u);
	}
	__syncthreads();
	for (u32 b = threadIdx.x; b < 256; b += blockDim.x)
		if (hist[b])
			atomicAdd(&st->hist[b], (u64)hist[b]);
}

/* One thread: the state for a selection of the k highest. */
extern "C" __global__ void kvd_cu_gsel_init(struct gsel_state *st, u64 k) {
	for (int b = 0; b < 256; b++)
		st->hist[b] = 0;
	st->k = k;
	st->prefix = 0;
	st->mask = 0;
}

/* One thread: picks the digit holding the k-th highest, narrows the prefix, clears hist. */
extern "C" __global__ void kvd_cu_gsel_pick(struct gsel_state *st, u32 shift) {
	u64 k = st->k;

	for (int b = 255; b >= 0; b--) {
		if (k <= st->hist[b]) {
			st->prefix |= (u32)b << shift;
			break;
		}
		k -= st->hist[b];
	}
	st->k = k;
	st->mask |= 255u << shift;
	for (int b = 0; b < 256; b++)
		st->hist[b] = 0;
}

/* Per chunk (a block each): items above the threshold and items equal to it. */
extern "C" __global__ void kvd_cu_gsel_count(const float *x, u64 n, u32 chunk,
					     const struct gsel_state *st, u64 *counts) {
	u64 lo = (u64)blockIdx.x * chunk, hi = min(n, lo + chunk);
	u64 above = 0, eq = 0;
	u32 T = st->prefix;

	for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
		u32 key = rank_key(x[i]);

		above += key > T;
		eq += key == T;
	}
	above = block_sum_u64(above);
	eq = block_sum_u64(eq);
	if (threadIdx.x == 0) {
		counts[2 * blockIdx.x] = above;
		counts[2 * blockIdx.x + 1] = eq;
	}
}

/* One thread: exclusive offsets per chunk, kept items and equal items before it. */
extern "C" __global__ void kvd_cu_gsel_scan(const u64 *counts, u32 nchunk,
					    const struct gsel_state *st, u64 *offsets) {
	u64 kept = 0, eq = 0, need = st->k;

	for (u32 c = 0; c < nchunk; c++) {
		u64 take = eq >= need ? 0 : min(need - eq, counts[2 * c + 1]);

		offsets[2 * c] = kept;
		offsets[2 * c + 1] = eq;
		kept += counts[2 * c] + take;
		eq += counts[2 * c + 1];
	}
}

/* Per chunk: writes the positions of its kept items, in order, at its offset. */
extern "C" __global__ void __launch_bounds__(1024)
kvd_cu_gsel_write(const float *x, u64 n, u32 chunk, const struct gsel_state *st,
		  const u64 *offsets, u32 *keep) {
	u64 lo = (u64)blockIdx.x * chunk, hi = min(n, lo + chunk);
	u64 kept_before = offsets[2 * blockIdx.x], eq_before = offsets[2 * blockIdx.x + 1];
	u64 need = st->k;
	u32 T = st->prefix;

	for (u64 base = lo; base < hi; base += blockDim.x) {
		u64 i = base + threadIdx.x;
		u32 in = i < hi, key = in ? rank_key(x[i]) : 0;
		u32 eq = in && key == T, tot_eq, pre_eq = block_scan(eq, &tot_eq);
		u32 kept = in && (key > T || (eq && eq_before + pre_eq < need));
		u32 tot_k, pre_k = block_scan(kept, &tot_k);

		if (kept)
			keep[kept_before + pre_k] = (u32)i;
		eq_before += tot_eq;
		kept_before += tot_k;
	}
}

/* First index j of keep[0..K) with keep[j] >= x (keep ascending). */
__device__ u32 lower_bound(const u32 *keep, u32 K, u32 x) {
	u32 lo = 0, hi = K;

	while (lo < hi) {
		u32 mid = lo + (hi - lo) / 2;

		if (keep[mid] < x)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/* Per row (a thread each): how many kept positions fall in it. */
extern "C" __global__ void kvd_cu_gsel_counts(const u32 *keep, u32 K, const u32 *row_start,
					      u32 n_rows, u32 *counts) {
	u32 r = blockIdx.x * blockDim.x + threadIdx.x;

	if (r < n_rows)
		counts[r] = lower_bound(keep, K, row_start[r + 1]) - lower_bound(keep, K, row_start[r]);
}

/* Per kept item (a thread each), in place: its position becomes its index within its row. */
extern "C" __global__ void kvd_cu_gsel_index(u32 *keep, u32 K, const u32 *row_start,
					     u32 n_rows) {
	u32 j = blockIdx.x * blockDim.x + threadIdx.x, lo = 0, hi = n_rows;

	if (j >= K)
		return;
	/* The last row whose start is <= the position (rows may be empty). */
	while (hi - lo > 1) {
		u32 mid = lo + (hi - lo) / 2;

		if (row_start[mid] <= keep[j])
			lo = mid;
		else
			hi = mid;
	}
	keep[j] -= row_start[lo];
}

/* ---- Gather ---- */

/*
 * Copies for slots j0 .. j0+gridDim.x-1 (grid y: heads * 2, K then V), one row per block:
 * mode 0 slot keep[j] of src to slot j of dst; mode 1 to staging (skipping keep[j] == j);
 * mode 2 from staging to slot j of dst (same skip). `word` bytes per access: 16, 4 or 1.
 */
__device__ __forceinline__ char *slot_row(const u64 *blocks, u32 bt, u64 row_bytes, u64 v_off,
					  u32 slot, u32 h, u32 vsel) {
	return (char *)blocks[slot / bt] + ((u64)h * bt + slot % bt) * row_bytes + vsel * v_off;
}

extern "C" __global__ void kvd_cu_gather(const u64 *src_blocks, const u64 *dst_blocks, u32 bt,
					 u64 row_bytes, u64 v_off, const u32 *keep, u32 j0,
					 u32 mode, u32 word, char *staging) {
	u32 j = j0 + blockIdx.x, h = blockIdx.y >> 1, vsel = blockIdx.y & 1, s = keep[j];
	char *from, *to;

	if (mode != 0 && s == j)
		return;
	from = mode == 2 ? staging + ((u64)blockIdx.x * gridDim.y + blockIdx.y) * row_bytes :
			   slot_row(src_blocks, bt, row_bytes, v_off, s, h, vsel);
	to = mode == 1 ? staging + ((u64)blockIdx.x * gridDim.y + blockIdx.y) * row_bytes :
			 slot_row(dst_blocks, bt, row_bytes, v_off, j, h, vsel);
	if (word == 16)
		for (u64 b = threadIdx.x; b < row_bytes / 16; b += blockDim.x)
			((uint4 *)to)[b] = ((const uint4 *)from)[b];
	else if (word == 4)
		for (u64 b = threadIdx.x; b < row_bytes / 4; b += blockDim.x)
			((u32 *)to)[b] = ((const u32 *)from)[b];
	else
		for (u64 b = threadIdx.x; b < row_bytes; b += blockDim.x)
			to[b] = from[b];
}
