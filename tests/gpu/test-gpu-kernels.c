/* SPDX-License-Identifier: MIT */
/*
 * The CUDA kernels (cuda-kernels.h) against the CPU references, on seeded random inputs of
 * several shapes: GQA and MQA, windows of 1, of more than a 32-row tile and equal to the
 * length, lengths and head dims that are not multiples of the tiles, f32/f16/bf16.
 *
 *   - attention, costs, normalisation: within atol + |ref|*rtol of the reference;
 *   - temporal folding, pooling, GQA sums, AWS parameters, selections, gathers: equal
 *     (the device follows the CPU's operation order; selections rank by select.h's order);
 *   - the whole per-layer pipeline: within tolerance, and the kept sets of a top-k on its
 *     scores may differ only in items whose reference score lies within that tolerance of
 *     the cut-off (the rule of tests/kernels/test-score.c).
 * Each stage is fed the same inputs as its reference (the device's own upstream results,
 * copied back), so that a failure names the stage that is wrong.
 *
 * Built twice from this source: test-gpu-kernels (suite gpu) against the CUDA kernels,
 * exiting 77 without a usable GPU; test-gpu-kernels-host (suite unit) against
 * cuda-kernels-host.c, the same entry points run by the optimised CPU kernels on host
 * memory, so that the shapes, reference calls and comparisons run everywhere, plus
 * checks that the comparisons reject a wrong result.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-kernels.h"
#include "ktest.h"
#include "laprox.h"
#include "select.h"

static struct kvd_cuda_kernels *K;

#ifdef KVD_TEST_HOST
/* "Device" memory is host memory. */
static void *dev_alloc(size_t bytes) {
	void *p = calloc(1, bytes ? bytes : 1);

	ASSERT_NOT_NULL(p);
	return p;
}
static void dev_free(void *p) {
	free(p);
}
static void dev_put(void *dst, const void *src, size_t bytes) {
	memcpy(dst, src, bytes);
}
static void dev_get(void *dst, const void *src, size_t bytes) {
	memcpy(dst, src, bytes);
}
static void dev_sync(void) {
}

int test_setup(void) {
	return kvd_cuda_kernels_new(NULL, &K, NULL);
}
#else
#include "cuda-kernels-internal.h"
#include "gpu-test.h"

static const struct cuda_dl *cu;
static CUcontext ctx;

#define CU_OK(expr)                                                                           \
	do {                                                                                  \
		CUresult _r = (expr);                                                         \
		if (_r != CUDA_SUCCESS)                                                       \
			test_fail(__FILE__, __LINE__, "%s: %s", #expr, cuda_dl_strerror(_r)); \
	} while (0)

static void *dev_alloc(size_t bytes) {
	CUdeviceptr p;

	CU_OK(cu->cuMemAlloc(&p, bytes ? bytes : 1));
	/* Garbage, not zeros: a kernel that skips an element must not pass by luck. */
	CU_OK(cu->cuMemsetD8Async(p, 0xa5, bytes ? bytes : 1, 0));
	return (void *)(uintptr_t)p;
}
static void dev_free(void *p) {
	CU_OK(cu->cuMemFree((CUdeviceptr)(uintptr_t)p));
}
static void dev_put(void *dst, const void *src, size_t bytes) {
	CU_OK(cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes));
}
static void dev_get(void *dst, const void *src, size_t bytes) {
	CU_OK(cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes));
}
static void dev_sync(void) {
	CU_OK(cu->cuCtxSynchronize());
}

int test_setup(void) {
	const char *why = NULL;
	CUresult cr = CUDA_SUCCESS;
	CUdevice dev;
	int r;

	r = cuda_dl_load(&cu, &why);
	if (r < 0) {
		printf("no usable GPU: %s\n", why);
		return EXIT_TEST_SKIP;
	}
	if (cu->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
	    cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
		printf("no usable GPU: no context on device 0\n");
		return EXIT_TEST_SKIP;
	}
	gpu_test_ran_on(cu, why);
	r = kvd_cuda_kernels_new(cu, &K, &cr);
	if (r < 0)
		printf("loading the kernels (built for sm %s, needing a CUDA %d.%d driver; this one "
		       "is %d.%d): %s\n", kvd_cuda_kernels_arch(), KVD_CUDA_KERNELS_DRIVER / 1000,
		       KVD_CUDA_KERNELS_DRIVER % 1000 / 10, cu->driver_version / 1000,
		       cu->driver_version % 1000 / 10, cuda_dl_strerror(cr));
	return r;
}

/* Every kernel the launchers resolve is in the embedded module (nothing to launch). */
TEST(module_has_every_kernel) {
	static const char *const names[] = {
#define KNAME(name) "kvd_cu_" #name,
		KVD_CUDA_KERNELS(KNAME)
#undef KNAME
	};

	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		ASSERT_NOT_NULL(memmem(kvd_cuda_fatbin, kvd_cuda_fatbin_size, names[i],
				       strlen(names[i]) + 1));
}
#endif

/* A host array copied to new device memory. */
static void *dev_dup(const void *src, size_t bytes) {
	void *p = dev_alloc(bytes);

	if (bytes)
		dev_put(p, src, bytes);
	return p;
}

/* n device floats back into new host memory (after the stream drained). */
static float *dev_floats(const float *d, size_t n) {
	float *h = kt_floats(n);

	dev_sync();
	dev_get(h, d, n * sizeof(float));
	return h;
}

/* Floats equal bit for bit, except that every NaN equals every NaN. */
static int same_floats(const char *what, const float *ref, const float *got, size_t n) {
	for (size_t i = 0; i < n; i++)
		if (!(isnan(ref[i]) && isnan(got[i])) && memcmp(&ref[i], &got[i], sizeof(float))) {
			fprintf(stderr, "%s: element %zu: ref %.9g, got %.9g\n", what, i, ref[i], got[i]);
			return 0;
		}
	return 1;
}

/*
 * The results the device computes in the CPU reference's operation order: equal on the
 * GPU. The host stand-ins run the optimised CPU kernels, which may contract a*b+c into an
 * fma (smooth.h), so there they are only within an ulp or so.
 */
#ifdef KVD_TEST_HOST
#define same_order(what, ref, got, n) kt_close(what, ref, got, n, 0, 1e-6)
#else
#define same_order(what, ref, got, n) same_floats(what, ref, got, n)
#endif

static int same_u32(const char *what, const uint32_t *ref, const uint32_t *got, size_t n) {
	for (size_t i = 0; i < n; i++)
		if (ref[i] != got[i]) {
			fprintf(stderr, "%s: element %zu: ref %u, got %u\n", what, i, ref[i], got[i]);
			return 0;
		}
	return 1;
}

/* ---- Fixtures ---- */

struct shape {
	uint32_t dtype, heads, kv_heads, window, len, dim;
};

/* GQA, MQA, MHA; w = 1, w = L, w > 32 (two row tiles); L and d off the 32-tiles. The
 * second is the longest: shorter under the sanitizers (the CPU stand-ins run it there). */
static const struct shape shapes[] = {
	{ KVD_DTYPE_F32, 8, 2, 8, 300, 64 },
	{ KVD_DTYPE_BF16, 8, 1, 40, TEST_SIZE(600, 161), 128 },
	{ KVD_DTYPE_F16, 4, 2, 33, 97, 80 },
	{ KVD_DTYPE_F32, 4, 4, 1, 65, 16 },
	{ KVD_DTYPE_BF16, 6, 2, 5, 5, 32 },
	{ KVD_DTYPE_F16, 2, 1, 3, 70, 8 },
};

#define N_SHAPES (sizeof(shapes) / sizeof(shapes[0]))

struct fix {
	struct shape s;
	struct kvd_attn_in in, din; /* host and device views */
	void *q, *k, *v, *dq, *dk, *dv;
	float *gram, *ggram, *dgram, *dggram;
	uint32_t n;
};

static void fix_init(struct fix *f, const struct shape *s, uint64_t seed) {
	uint32_t H = s->heads, Hkv = s->kv_heads, g = H / Hkv, d = s->dim, C = 24;
	size_t es = kvd_dtype_size(s->dtype), gdd = (size_t)g * d * g * d;
	struct kvd_wo wo;
	float *w;

	*f = (struct fix){ .s = *s, .n = s->len - s->window };
	f->q = kt_random(&seed, s->dtype, (size_t)H * s->window * d, 3.0f);
	f->k = kt_random(&seed, s->dtype, (size_t)Hkv * s->len * d, 1.0f);
	f->v = kt_random(&seed, s->dtype, (size_t)Hkv * s->len * d, 1.0f);
	w = kt_random(&seed, KVD_DTYPE_F32, (size_t)C * H * d, 0.3f);
	f->in = (struct kvd_attn_in){
		.dtype = s->dtype, .heads = H, .kv_heads = Hkv, .window = s->window, .len = s->len,
		.dim = d, .scale = 1.0f / sqrtf((float)d), .q = f->q, .k = f->k, .v = f->v,
	};
	kvd_attn_in_contiguous(&f->in);
	wo = (struct kvd_wo){ .dtype = KVD_DTYPE_F32, .c_out = C, .heads = H, .dim = d, .w = w,
			      .row_stride = (size_t)H * d };
	f->gram = kt_floats((size_t)H * d * d);
	f->ggram = kt_floats(Hkv * gdd);
	for (uint32_t h = 0; h < H; h++)
		ASSERT_OK(kvd_gram(&wo, h, 1, f->gram + (size_t)h * d * d));
	for (uint32_t kv = 0; kv < Hkv; kv++)
		ASSERT_OK(kvd_gram(&wo, kv * g, g, f->ggram + kv * gdd));
	free(w);
	f->dq = dev_dup(f->q, (size_t)H * s->window * d * es);
	f->dk = dev_dup(f->k, (size_t)Hkv * s->len * d * es);
	f->dv = dev_dup(f->v, (size_t)Hkv * s->len * d * es);
	f->dgram = dev_dup(f->gram, (size_t)H * d * d * sizeof(float));
	f->dggram = dev_dup(f->ggram, Hkv * gdd * sizeof(float));
	f->din = f->in;
	f->din.q = f->dq, f->din.k = f->dk, f->din.v = f->dv;
}

static void fix_done(struct fix *f) {
	free(f->q), free(f->k), free(f->v), free(f->gram), free(f->ggram);
	dev_free(f->dq), dev_free(f->dk), dev_free(f->dv), dev_free(f->dgram), dev_free(f->dggram);
}

/* The device's attention maps of every head: device copy in *ret_dprobs, host copy returned. */
static float *fix_attn(struct fix *f, float **ret_dprobs) {
	size_t wl = (size_t)f->s.window * f->s.len;
	float *dprobs = dev_alloc(f->s.heads * wl * sizeof(float));

	ASSERT_OK(kvd_cuda_attn(K, &f->din, dprobs, 0));
	*ret_dprobs = dprobs;
	return dev_floats(dprobs, f->s.heads * wl);
}

/* ---- Tests ---- */

TEST(attn_matches_reference) {
	for (size_t c = 0; c < N_SHAPES; c++) {
		struct fix f;
		size_t wl = (size_t)shapes[c].window * shapes[c].len;
		float *dprobs, *got, *ref = kt_floats(wl);
		char what[64];

		fix_init(&f, &shapes[c], 100 + c);
		got = fix_attn(&f, &dprobs);
		for (uint32_t h = 0; h < f.s.heads; h++) {
			ASSERT_OK(kvd_attn_head_ref(&f.in, h, ref));
			snprintf(what, sizeof(what), "attn shape %zu head %u", c, h);
			ASSERT_TRUE(kt_close(what, ref, got + h * wl, wl, 1e-6, 1e-4));
		}
		free(ref), free(got), dev_free(dprobs);
		fix_done(&f);
	}
}

TEST(attn_refuses_what_the_cpu_refuses) {
	struct fix f;
	struct kvd_attn_in in;

	fix_init(&f, &shapes[0], 7);
	in = f.din;
	in.window = in.len + 1; /* a window longer than the sequence */
	ASSERT_ERRNO(kvd_cuda_attn(K, &in, (float *)f.dq, 0), -EINVAL);
	in = f.din;
	in.kv_heads = 3; /* not a divisor of the heads */
	ASSERT_ERRNO(kvd_cuda_attn(K, &in, (float *)f.dq, 0), -EINVAL);
	fix_done(&f);
}

TEST(temporal_matches_reference) {
	static const enum kvd_temporal_mode modes[] = { KVD_TEMPORAL_EMA, KVD_TEMPORAL_MEAN,
							KVD_TEMPORAL_LAST, KVD_TEMPORAL_SUM };

	for (size_t c = 0; c < N_SHAPES; c++) {
		struct fix f;
		size_t wl = (size_t)shapes[c].window * shapes[c].len;
		float *dprobs, *probs, *dagg, *got, *ref;

		fix_init(&f, &shapes[c], 200 + c);
		probs = fix_attn(&f, &dprobs);
		dagg = dev_alloc((size_t)f.s.heads * f.n * sizeof(float) + 1);
		ref = kt_floats((size_t)f.s.heads * f.n);
		for (size_t m = 0; m < 4; m++) {
			ASSERT_OK(kvd_cuda_temporal(K, modes[m], 0.3f, dprobs, f.s.heads, wl, f.s.window,
						    f.s.len, f.n, dagg, 0));
			got = dev_floats(dagg, (size_t)f.s.heads * f.n);
			for (uint32_t h = 0; h < f.s.heads; h++)
				ASSERT_OK(kvd_temporal_agg_ref(modes[m], 0.3f, probs + h * wl, f.s.window,
							       f.s.len, f.n, ref + (size_t)h * f.n));
			ASSERT_TRUE(same_order(kvd_temporal_mode_to_string(modes[m]), ref, got,
						(size_t)f.s.heads * f.n));
			free(got);
		}
		ASSERT_ERRNO(kvd_cuda_temporal(K, KVD_TEMPORAL_EMA, 0, dprobs, 1, wl, f.s.window,
					       f.s.len, f.n, dagg, 0),
			     -EINVAL);
		free(ref), free(probs), dev_free(dagg), dev_free(dprobs);
		fix_done(&f);
	}
}

TEST(restkv_matches_reference) {
	struct kvd_restkv_opts opts[4];

	kvd_restkv_opts_default(&opts[0]);
	opts[1] = opts[0], opts[1].tau = 0.5f, opts[1].temporal = KVD_TEMPORAL_MEAN;
	opts[2] = opts[0], opts[2].metric = KVD_RESTKV_BEFORE;
	opts[3] = opts[2], opts[3].use_norm = 1, opts[3].temporal = KVD_TEMPORAL_SUM;
	for (size_t c = 0; c < N_SHAPES; c++) {
		struct fix f;
		size_t wl = (size_t)shapes[c].window * shapes[c].len, hn;
		float *dprobs, *probs, *dcost, *dvgv, *got, *ref, *vgv;

		fix_init(&f, &shapes[c], 300 + c);
		hn = (size_t)f.s.heads * f.n;
		probs = fix_attn(&f, &dprobs);
		dcost = dev_alloc(hn * sizeof(float) + 1);
		dvgv = dev_alloc(hn * sizeof(float) + 1);
		ref = kt_floats(hn);
		for (int use_wo = 0; use_wo < 2; use_wo++) {
			const float *gram = use_wo ? f.gram : NULL, *dgram = use_wo ? f.dgram : NULL;

			/* The cached v G v^T first: the cost kernels may take it. */
			ASSERT_OK(kvd_cuda_restkv_vgv(K, &f.din, dgram, f.n, dvgv, 0));
			vgv = dev_floats(dvgv, hn);
			for (uint32_t h = 0; h < f.s.heads; h++) {
				ASSERT_OK(kvd_restkv_vgv_ref(&f.in, h, gram ? gram + (size_t)h * f.s.dim * f.s.dim : NULL,
							     f.n, ref + (size_t)h * f.n));
			}
			ASSERT_TRUE(kt_close("vgv", ref, vgv, hn, 1e-6, 1e-4));
			/* The reference's before mode costs w * d^2 per token: small heads only. */
			for (size_t o = 0; o < (f.s.dim >= 128 ? 2u : 4u); o++)
				for (int cached = 0; cached < 2; cached++) {
					void *scratch = dev_alloc(kvd_cuda_restkv_scratch_bytes(&f.in, &opts[o]));
					char what[96];

					ASSERT_OK(kvd_cuda_restkv(K, &f.din, dprobs, dgram,
								  cached ? dvgv : NULL, &opts[o], scratch,
								  dcost, 0));
					got = dev_floats(dcost, hn);
					for (uint32_t h = 0; h < f.s.heads; h++)
						ASSERT_OK(kvd_restkv_head_ref(
							&f.in, h, probs + h * wl,
							gram ? gram + (size_t)h * f.s.dim * f.s.dim : NULL,
							cached ? vgv + (size_t)h * f.n : NULL, &opts[o],
							ref + (size_t)h * f.n));
					snprintf(what, sizeof(what), "restkv shape %zu wo %d opts %zu cached %d",
						 c, use_wo, o, cached);
					ASSERT_TRUE(kt_close(what, ref, got, hn, 1e-6, 1e-4));
					free(got), dev_free(scratch);
				}
			free(vgv);
		}
		free(ref), free(probs), dev_free(dcost), dev_free(dvgv), dev_free(dprobs);
		fix_done(&f);
	}
}

TEST(laprox_matches_reference) {
	for (size_t c = 0; c < N_SHAPES; c++) {
		struct fix f;
		uint32_t g;
		size_t wl = (size_t)shapes[c].window * shapes[c].len, hn, gdd;
		float *dprobs, *probs, *dcost, *got, *ref;
		const float *pp[64];

		fix_init(&f, &shapes[c], 400 + c);
		g = f.s.heads / f.s.kv_heads, gdd = (size_t)g * f.s.dim * g * f.s.dim;
		hn = (size_t)f.s.heads * f.n;
		probs = fix_attn(&f, &dprobs);
		dcost = dev_alloc(hn * sizeof(float) + 1);
		ref = kt_floats(hn);
		for (int use_wo = 0; use_wo < 2; use_wo++) {
			char what[64];

			ASSERT_OK(kvd_cuda_laprox(K, &f.din, dprobs, use_wo ? f.dgram : NULL, NULL, dcost, 0));
			got = dev_floats(dcost, hn);
			for (uint32_t h = 0; h < f.s.heads; h++)
				ASSERT_OK(kvd_laprox_head_ref(&f.in, h, probs + h * wl,
							      use_wo ? f.gram + (size_t)h * f.s.dim * f.s.dim : NULL,
							      NULL, ref + (size_t)h * f.n));
			snprintf(what, sizeof(what), "laprox shape %zu wo %d", c, use_wo);
			ASSERT_TRUE(kt_close(what, ref, got, hn, 1e-6, 1e-4));
			free(got);

			ASSERT_OK(kvd_cuda_laprox_group(K, &f.din, dprobs, use_wo ? f.dggram : NULL, dcost, 0));
			got = dev_floats(dcost, (size_t)f.s.kv_heads * f.n);
			for (uint32_t kv = 0; kv < f.s.kv_heads; kv++) {
				for (uint32_t a = 0; a < g; a++)
					pp[a] = probs + (kv * g + a) * wl;
				ASSERT_OK(kvd_laprox_group_ref(&f.in, kv, pp,
							       use_wo ? f.ggram + kv * gdd : NULL,
							       ref + (size_t)kv * f.n));
			}
			snprintf(what, sizeof(what), "laprox group shape %zu wo %d", c, use_wo);
			ASSERT_TRUE(kt_close(what, ref, got, (size_t)f.s.kv_heads * f.n, 1e-6, 1e-4));
			free(got);
		}
		free(ref), free(probs), dev_free(dcost), dev_free(dprobs);
		fix_done(&f);
	}
}

/* Probability-like rows full of ties: a few levels, zeros of both signs, NaN, infinities. */
static float *tie_rows(uint64_t *seed, size_t n) {
	static const float levels[] = { 0.0f, -0.0f, 0.125f, 0.25f, 0.5f, 1.0f, NAN, INFINITY,
					-INFINITY, 0.375f };
	float *x = kt_floats(n);

	for (size_t i = 0; i < n; i++)
		x[i] = kt_next(seed) % 3 ? kt_uniform(seed) : levels[kt_next(seed) % 10];
	return x;
}

TEST(aws_and_pooling_match_reference) {
	static const struct {
		uint32_t heads, group, w, L, topk, k_min;
		double scale;
	} cfg[] = {
		{ 4, 1, 8, 300, 40, 5, 20 },  { 6, 3, 7, 129, 200, 3, 2 },  { 2, 1, 1, 50, 10, 5, 20 },
		{ 4, 2, 32, 2100, 97, 5, 7 }, { 3, 1, 40, 64, 64, 1, 1.5 },
	};
	uint64_t seed = 42;

	for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++) {
		uint32_t H = cfg[c].heads, w = cfg[c].w, L = cfg[c].L, n_out = H / cfg[c].group;
		size_t wl = (size_t)w * L;
		/* Half the rows with ties (every selection path), half plain random. */
		float *probs = c % 2 ? tie_rows(&seed, H * wl) : kt_random(&seed, KVD_DTYPE_F32, H * wl, 1.0f);
		float *dprobs = dev_dup(probs, H * wl * sizeof(float));
		struct kvd_cuda_aws *daws = dev_alloc(n_out * sizeof(*daws)), *got = calloc(n_out, sizeof(*got));
		void *scratch = dev_alloc(kvd_cuda_aws_scratch_bytes(H, w));
		float *dout = dev_alloc(n_out * (size_t)L * sizeof(float)), *out, *ref = kt_floats(L);

		ASSERT_NOT_NULL(got);
		ASSERT_OK(kvd_cuda_aws(K, dprobs, H, cfg[c].group, w, L, cfg[c].topk, cfg[c].k_min,
				       cfg[c].scale, scratch, daws, 0));
		dev_sync();
		dev_get(got, daws, n_out * sizeof(*got));
		for (uint32_t o = 0; o < n_out; o++) {
			struct kvd_aws a;
			double t = 0;

			for (uint32_t j = 0; j < cfg[c].group; j++) {
				ASSERT_OK(kvd_aws_params_ref(probs + (o * cfg[c].group + j) * wl, w, L, L,
							     cfg[c].topk, cfg[c].k_min, cfg[c].scale, &a));
				t += a.t;
			}
			if (cfg[c].group > 1)
				ASSERT_OK(kvd_aws_from_t(t / cfg[c].group, cfg[c].k_min, cfg[c].scale, &a));
			if (got[o].kernel != a.kernel || got[o].shift != a.shift || got[o].t != a.t) {
				fprintf(stderr, "aws cfg %zu out %u: ref (%u, %d, %.17g), got (%u, %d, %.17g)\n",
					c, o, a.kernel, a.shift, a.t, got[o].kernel, got[o].shift, got[o].t);
				ASSERT_TRUE(0);
			}
		}
		/* Pool the first row of each map with its parameters; then avg and max. */
		for (int mode = KVD_POOL_NONE; mode < _KVD_POOL_MAX; mode++) {
			float *rows = kt_floats(n_out * (size_t)L), *drows;

			for (uint32_t o = 0; o < n_out; o++)
				memcpy(rows + (size_t)o * L, probs + o * wl, L * sizeof(float));
			drows = dev_dup(rows, n_out * (size_t)L * sizeof(float));
			ASSERT_OK(kvd_cuda_pool(K, mode, 7, mode == KVD_POOL_ADAPTIVE ? daws : NULL, drows,
						n_out, L, dout, 0));
			out = dev_floats(dout, n_out * (size_t)L);
			for (uint32_t o = 0; o < n_out; o++) {
				ASSERT_OK(kvd_pool_row_ref(mode, mode == KVD_POOL_ADAPTIVE ? got[o].kernel : 7,
							   mode == KVD_POOL_ADAPTIVE ? got[o].shift : 0,
							   rows + (size_t)o * L, L, ref));
				ASSERT_TRUE(same_order(kvd_pool_mode_to_string(mode), ref,
							out + (size_t)o * L, L));
			}
			free(rows), free(out), dev_free(drows);
		}
		ASSERT_ERRNO(kvd_cuda_pool(K, KVD_POOL_AVG, 4, NULL, dprobs, 1, L, dout, 0), -EINVAL);
		free(probs), free(got), free(ref);
		dev_free(dprobs), dev_free(daws), dev_free(scratch), dev_free(dout);
	}
}

TEST(group_sum_and_normalize_match_reference) {
	uint64_t seed = 5;
	uint32_t rows = 3, g = 4, n = 1234;
	float *in = tie_rows(&seed, (size_t)rows * g * n), *din = dev_dup(in, (size_t)rows * g * n * 4);
	float *dout = dev_alloc((size_t)rows * n * 4), *got, *ref = kt_floats((size_t)rows * n);
	void *scratch = dev_alloc(kvd_cuda_normalize_scratch_bytes((size_t)rows * n));

	ASSERT_OK(kvd_cuda_group_sum(K, din, rows, g, n, dout, 0));
	got = dev_floats(dout, (size_t)rows * n);
	for (uint32_t r = 0; r < rows; r++)
		for (uint32_t i = 0; i < n; i++) {
			float s = in[(size_t)r * g * n + i];

			for (uint32_t a = 1; a < g; a++)
				s += in[((size_t)r * g + a) * n + i];
			ref[(size_t)r * n + i] = s;
		}
	ASSERT_TRUE(same_order("group sum", ref, got, (size_t)rows * n));
	free(got);
	/* Normalise plain random costs (ties and infinities are kept as they are). */
	for (size_t i = 0; i < (size_t)rows * n; i++)
		ref[i] = fabsf(kt_uniform(&seed)) + (i % 97 == 0 ? INFINITY : 0);
	dev_put(dout, ref, (size_t)rows * n * 4);
	ASSERT_OK(kvd_cuda_normalize(K, dout, (size_t)rows * n, 0.5f, scratch, 0));
	got = dev_floats(dout, (size_t)rows * n);
	ASSERT_OK(kvd_laprox_normalize(ref, (size_t)rows * n, 0.5f));
	ASSERT_TRUE(kt_close("normalize", ref, got, (size_t)rows * n, 1e-12, 1e-6));
	free(in), free(got), free(ref);
	dev_free(din), dev_free(dout), dev_free(scratch);
}

TEST(score_layer_matches_reference) {
	static const struct {
		enum kvd_score_kind kind;
		uint32_t per_query_head, joint, normalize;
		enum kvd_pool_mode pool;
	} cfgs[] = {
		{ KVD_SCORE_RESTKV, 0, 0, 0, KVD_POOL_ADAPTIVE },
		{ KVD_SCORE_RESTKV, 1, 0, 0, KVD_POOL_ADAPTIVE },
		{ KVD_SCORE_RESTKV, 0, 0, 1, KVD_POOL_AVG },
		{ KVD_SCORE_LAPROX, 0, 1, 1, KVD_POOL_NONE },
		{ KVD_SCORE_LAPROX, 0, 0, 1, KVD_POOL_MAX },
		{ KVD_SCORE_LAPROX, 0, 1, 0, KVD_POOL_ADAPTIVE },
	};

	for (size_t c = 0; c < 3; c++)
		for (size_t k = 0; k < sizeof(cfgs) / sizeof(cfgs[0]); k++)
			for (int use_wo = 0; use_wo < 2; use_wo++) {
				struct fix f;
				struct kvd_score_params p;
				uint32_t rows;
				size_t rn;
				float *dscores, *got, *ref;
				void *scratch;
				char what[96];

				fix_init(&f, &shapes[c], 500 + c);
				kvd_score_params_default(cfgs[k].kind, &p);
				p.per_query_head = cfgs[k].per_query_head;
				p.laprox_joint = cfgs[k].joint;
				p.normalize = cfgs[k].normalize;
				p.pooling = cfgs[k].pool;
				p.aws_topk = 40;
				p.aws_scale = 20; /* small enough that kernels and shifts vary */
				p.layer_weight = 0.5f;
				rows = kvd_score_rows(&p, &f.in), rn = (size_t)rows * f.n;
				scratch = dev_alloc(kvd_cuda_score_layer_scratch_bytes(&f.in, &p));
				dscores = dev_alloc(rn * sizeof(float) + 1);
				ref = kt_floats(rn);
				ASSERT_OK(kvd_cuda_score_layer(K, &f.din, use_wo ? f.dgram : NULL,
							       use_wo ? f.dggram : NULL, &p, scratch,
							       dscores, 0));
				got = dev_floats(dscores, rn);
				ASSERT_OK(kvd_score_layer_ref(&f.in, use_wo ? f.gram : NULL,
							      use_wo ? f.ggram : NULL, &p, ref));
				snprintf(what, sizeof(what), "score shape %zu cfg %zu wo %d", c, k, use_wo);
				ASSERT_TRUE(kt_close(what, ref, got, rn, 1e-6, 1e-4));
				for (uint32_t r = 0; r < rows && f.n > 0; r++)
					ASSERT_TRUE(kt_selection_ok(what, ref + (size_t)r * f.n,
								 got + (size_t)r * f.n, f.n, f.n / 3,
								 1e-6, 1e-4));
				free(got), free(ref), dev_free(scratch), dev_free(dscores);
				fix_done(&f);
			}
}

TEST(topk_matches_reference) {
	static const uint32_t sizes[][3] = {
		/* rows, n, k */
		{ 5, 1000, 17 }, { 3, 3000, 2999 }, { 2, 1, 1 }, { 4, 4096, 1024 }, { 1, 70000, 5000 },
	};
	uint64_t seed = 9;

	for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
		uint32_t rows = sizes[c][0], n = sizes[c][1], kk = sizes[c][2];
		float *x = c % 2 ? tie_rows(&seed, (size_t)rows * n) :
				   kt_random(&seed, KVD_DTYPE_F32, (size_t)rows * n, 1.0f);
		float *dx = dev_dup(x, (size_t)rows * n * 4);
		uint32_t *dkeep = dev_alloc((size_t)rows * kk * 4), *got = calloc((size_t)rows * kk, 4);
		uint32_t *ref = calloc(kk, 4);

		ASSERT_TRUE(got && ref);
		ASSERT_OK(kvd_cuda_topk_each(K, dx, rows, n, n, kk, dkeep, 0));
		dev_sync();
		dev_get(got, dkeep, (size_t)rows * kk * 4);
		for (uint32_t r = 0; r < rows; r++) {
			ASSERT_OK(kvd_topk_ref(x + (size_t)r * n, n, kk, ref));
			ASSERT_TRUE(same_u32("topk each", ref, got + (size_t)r * kk, kk));
		}
		ASSERT_ERRNO(kvd_cuda_topk_each(K, dx, rows, n, n, n + 1, dkeep, 0), -EINVAL);
		free(x), free(got), free(ref), dev_free(dx), dev_free(dkeep);
	}
}

TEST(topk_global_matches_reference) {
	/* Rows (some empty) laid back to back, as a layer's or a node's score rows are. */
	static const uint32_t lens[] = { 300, 0, 5000, 1, 4097, 0, 12000, 77 };
	static const uint32_t ks[] = { 0, 1, 100, 4096, 10000, 21475 };
	uint32_t n_rows = sizeof(lens) / sizeof(lens[0]), start[9], total = 0;
	uint64_t seed = 11;

	for (uint32_t r = 0; r < n_rows; r++) {
		start[r] = total;
		total += lens[r];
	}
	start[n_rows] = total;
	for (int ties = 0; ties < 2; ties++)
		for (size_t c = 0; c < sizeof(ks) / sizeof(ks[0]); c++) {
			uint32_t kk = ks[c], counts[8], got_counts[8];
			float *x = ties ? tie_rows(&seed, total) : kt_random(&seed, KVD_DTYPE_F32, total, 1.0f);
			const float *rows[8];
			uint32_t *ref = calloc(kk + 1, 4), *got = calloc(kk + 1, 4);
			float *dx = dev_dup(x, (size_t)total * 4);
			uint32_t *dstart = dev_dup(start, sizeof(start)), *dcounts = dev_alloc(sizeof(counts));
			uint32_t *dkeep = dev_alloc(((size_t)kk + 1) * 4);
			void *scratch = dev_alloc(kvd_cuda_topk_global_scratch_bytes(total));

			ASSERT_TRUE(ref && got);
			for (uint32_t r = 0; r < n_rows; r++)
				rows[r] = x + start[r];
			ASSERT_OK(kvd_topk_rows_ref(rows, lens, n_rows, kk, 1, counts, ref));
			ASSERT_OK(kvd_cuda_topk_global(K, dx, total, dstart, n_rows, kk, scratch, dcounts,
						       dkeep, 0));
			dev_sync();
			dev_get(got_counts, dcounts, sizeof(counts));
			dev_get(got, dkeep, (size_t)kk * 4);
			ASSERT_TRUE(same_u32("global counts", counts, got_counts, n_rows));
			ASSERT_TRUE(same_u32("global keep", ref, got, kk));
			/* One row: positions. */
			ASSERT_OK(kvd_topk_rows_ref((const float *const *)&x, &total, 1, kk, 1, counts, ref));
			ASSERT_OK(kvd_cuda_topk_global(K, dx, total, NULL, 0, kk, scratch, NULL, dkeep, 0));
			dev_sync();
			dev_get(got, dkeep, (size_t)kk * 4);
			ASSERT_TRUE(same_u32("global positions", ref, got, kk));
			free(x), free(ref), free(got);
			dev_free(dx), dev_free(dstart), dev_free(dcounts), dev_free(dkeep), dev_free(scratch);
		}
}

/*
 * A table of nb blocks in one buffer, the blocks in shuffled order (as a pool hands them
 * out), kept slots gathered to a destination table and in place with a staging buffer
 * of a few slots (several batches), both against kvd_gather_ref on a host copy.
 */
TEST(gather_matches_reference) {
	static const struct kvd_gather_table tables[] = {
		{ .block_tokens = 16, .heads = 8, .row_bytes = 256, .v_offset = 8 * 16 * 256 },
		{ .block_tokens = 5, .heads = 1, .row_bytes = 36, .v_offset = 5 * 36 + 4 },
		{ .block_tokens = 3, .heads = 2, .row_bytes = 6, .v_offset = 2 * 3 * 6 + 2 },
	};
	uint64_t seed = 13;

	for (size_t c = 0; c < sizeof(tables) / sizeof(tables[0]); c++) {
		const struct kvd_gather_table *t = &tables[c];
		uint32_t nb = 11, slots = nb * t->block_tokens, n_keep = 0, keep[256];
		size_t bb = (t->v_offset * 2 + 63) / 64 * 64, bytes = bb * nb;
		uint8_t *host = malloc(bytes), *ref = malloc(bytes), *got = malloc(bytes), *dbuf, *dbuf2;
		uint64_t order[16], dsrc[16], ddst[16], *dsrc_d, *ddst_d;
		char *hsrc[16], *hdst[16];
		uint32_t *dkeep;
		void *staging;

		ASSERT_TRUE(host && ref && got && slots <= 256);
		for (size_t i = 0; i < bytes; i++)
			host[i] = (uint8_t)kt_next(&seed);
		for (uint32_t b = 0; b < nb; b++)
			order[b] = b;
		for (uint32_t b = nb - 1; b > 0; b--) {
			uint32_t j = kt_next(&seed) % (b + 1);
			uint64_t x = order[b];

			order[b] = order[j], order[j] = x;
		}
		for (uint32_t s = 0; s < slots; s++)
			if (kt_next(&seed) % 3)
				keep[n_keep++] = s;
		dbuf = dev_dup(host, bytes);
		dbuf2 = dev_alloc(bytes);
		for (uint32_t b = 0; b < nb; b++) {
			dsrc[b] = (uint64_t)(uintptr_t)(dbuf + order[b] * bb);
			ddst[b] = (uint64_t)(uintptr_t)(dbuf2 + order[nb - 1 - b] * bb);
		}
		dsrc_d = dev_dup(dsrc, nb * 8), ddst_d = dev_dup(ddst, nb * 8);
		dkeep = dev_dup(keep, n_keep * 4);

		/* To a destination: compare the kept slots' rows, nothing else is defined. */
		ASSERT_OK(kvd_cuda_gather(K, t, dsrc_d, ddst_d, dkeep, n_keep, NULL, 0, 0));
		dev_sync();
		dev_get(got, dbuf2, bytes);
		memcpy(ref, got, bytes);
		for (uint32_t b = 0; b < nb; b++) {
			hsrc[b] = (char *)host + order[b] * bb;
			hdst[b] = (char *)ref + order[nb - 1 - b] * bb;
		}
		ASSERT_OK(kvd_gather_ref(t, hsrc, hdst, keep, n_keep));
		ASSERT_EQ(memcmp(ref, got, bytes), 0);

		/* In place, 3 slots per batch. */
		staging = dev_alloc(3 * kvd_cuda_gather_slot_bytes(t));
		ASSERT_ERRNO(kvd_cuda_gather(K, t, dsrc_d, NULL, dkeep, n_keep, staging, 1, 0), -ENOBUFS);
		ASSERT_OK(kvd_cuda_gather(K, t, dsrc_d, NULL, dkeep, n_keep, staging,
					  3 * kvd_cuda_gather_slot_bytes(t), 0));
		dev_sync();
		dev_get(got, dbuf, bytes);
		memcpy(ref, host, bytes);
		for (uint32_t b = 0; b < nb; b++)
			hsrc[b] = (char *)ref + order[b] * bb;
		ASSERT_OK(kvd_gather_ref(t, hsrc, NULL, keep, n_keep));
		ASSERT_EQ(memcmp(ref, got, bytes), 0);

		free(host), free(ref), free(got);
		dev_free(dbuf), dev_free(dbuf2), dev_free(dsrc_d), dev_free(ddst_d), dev_free(dkeep);
		dev_free(staging);
	}
}

/* The comparisons above must reject wrong results, or the suite proves nothing. */
TEST(comparisons_reject_wrong_results) {
	uint64_t seed = 17;
	uint32_t n = 500, k = 50;
	float *ref = kt_random(&seed, KVD_DTYPE_F32, n, 1.0f), *bad = kt_floats(n);
	uint32_t a[3] = { 1, 2, 3 }, b[3] = { 1, 2, 4 }, top[50];

	memcpy(bad, ref, n * sizeof(float));
	ASSERT_TRUE(kt_close("same", ref, bad, n, 1e-6, 1e-4));
	ASSERT_TRUE(same_floats("same", ref, bad, n));
	ASSERT_TRUE(kt_selection_ok("same", ref, bad, n, k, 1e-6, 1e-4));
	bad[7] = ref[7] * (1 + 1e-3f) + 1e-5f;
	ASSERT_FALSE(kt_close("expected mismatch", ref, bad, n, 1e-6, 1e-4));
	ASSERT_FALSE(same_floats("expected mismatch", ref, bad, n));
	/* Promote the item just below the cut-off far above it: the kept sets differ there. */
	memcpy(bad, ref, n * sizeof(float));
	ASSERT_OK(kvd_topk(ref, n, k, top));
	for (uint32_t i = 0; i < n; i++)
		if (!kt_selection_has(top, k, i)) {
			bad[i] = 10;
			break;
		}
	ASSERT_FALSE(kt_selection_ok("expected mismatch", ref, bad, n, k, 1e-6, 1e-4));
	ASSERT_FALSE(same_u32("expected mismatch", a, b, 3));
	free(ref), free(bad);
}
