/* SPDX-License-Identifier: MIT */
/*
 * kvd-bench-gpu: GPU figures for tools/gpu-check. Exits 77 when no GPU is usable, 1 when a
 * measurement failed, 2 on usage errors. Three measurements on device 0:
 *
 *   chunk:  what the cuda backend and libkvd do per chunk (cuMemCreate, export as a POSIX
 *           fd, import, reserve + map + set access, unmap), in one process: the driver's
 *           share of a grant, without the socket (kvd-bench ipc measures that);
 *   attn:   the window-attention kernel on one Llama-3.1-8B-like layer (32 q heads, 8 kv
 *           heads, head_dim 128, bf16, window 32): bytes of K read per second, as a
 *           fraction of the device's peak memory bandwidth (2 * memory clock * bus width,
 *           from the driver's attributes), and what it writes (the fp32 maps);
 *   round:  scoring (score.h's layer pipeline with its kvd defaults: ReST-KV with W_o, EMA,
 *           adaptive pooling, GQA sum, N1 shares; policy kvd's key novelty is the CPU's)
 *           of every layer, one node-wide top-k over all (layer, kv head) rows keeping a
 *           quarter, and the in-place gather of every (layer, kv head) table with
 *           the per-head layout (16-token blocks): the device side of an eviction round.
 *           The layers share one layer's K/V and tables (the work per layer is the same;
 *           32 distinct layers at 128k tokens would need 16 GiB of K/V).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda-kernels.h"
#include "dtype.h"

#define LAYERS 32u
#define HEADS 32u
#define KV_HEADS 8u
#define DIM 128u
#define WINDOW 32u
#define BLOCK_TOKENS 16u

static const struct cuda_dl *cu;
static CUstream stream;

#define CU_TRY(expr)                                                                          \
	do {                                                                                  \
		CUresult _r = (expr);                                                         \
		if (_r != CUDA_SUCCESS) {                                                     \
			fprintf(stderr, "kvd-bench-gpu: %s: %s\n", #expr, cuda_dl_strerror(_r)); \
			return -EIO;                                                          \
		}                                                                             \
	} while (0)

#define TRY(expr)                                                                             \
	do {                                                                                  \
		int _r = (expr);                                                              \
		if (_r < 0) {                                                                 \
			fprintf(stderr, "kvd-bench-gpu: %s: %s\n", #expr, strerror(-_r));     \
			return _r;                                                            \
		}                                                                             \
	} while (0)

static double now_us(void) {
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static double median(double *x, unsigned n) {
	qsort(x, n, sizeof(*x), cmp_double);
	return x[n / 2];
}

/* Device memory holding n random bf16 (or fp32) values in [-amp, amp). */
static int dev_random(CUdeviceptr *ret, size_t n, int f32, float amp, uint64_t seed) {
	size_t es = f32 ? 4 : 2;
	char *h = malloc(n * es);

	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		float f;
		uint32_t u;

		seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
		f = amp * ((float)(seed >> 40) / (float)(1u << 23) - 1.0f);
		memcpy(&u, &f, 4);
		if (f32)
			memcpy(h + 4 * i, &u, 4);
		else
			((uint16_t *)h)[i] = (uint16_t)(u >> 16);
	}
	if (cu->cuMemAlloc(ret, n * es) != CUDA_SUCCESS ||
	    cu->cuMemcpyHtoD(*ret, h, n * es) != CUDA_SUCCESS) {
		free(h);
		return -ENOMEM;
	}
	free(h);
	return 0;
}

static int bench_chunk(CUdevice dev, size_t chunk_mib, unsigned iters) {
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev },
	};
	CUmemAccessDesc access = { .location = prop.location,
				   .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
	size_t bytes = chunk_mib << 20, gran = 0;
	double t[5][64];

	if (iters > 64)
		iters = 64;
	CU_TRY(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
	bytes = (bytes + gran - 1) / gran * gran;
	for (unsigned i = 0; i < iters; i++) {
		CUmemGenericAllocationHandle h, h2;
		CUdeviceptr va;
		double t0;
		int fd = -1;

		t0 = now_us();
		CU_TRY(cu->cuMemCreate(&h, bytes, &prop, 0));
		t[0][i] = now_us() - t0, t0 = now_us();
		CU_TRY(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
		t[1][i] = now_us() - t0, t0 = now_us();
		CU_TRY(cu->cuMemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd,
							  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
		t[2][i] = now_us() - t0, t0 = now_us();
		CU_TRY(cu->cuMemAddressReserve(&va, bytes, gran, 0, 0));
		CU_TRY(cu->cuMemMap(va, bytes, 0, h2, 0));
		CU_TRY(cu->cuMemSetAccess(va, bytes, &access, 1));
		t[3][i] = now_us() - t0, t0 = now_us();
		CU_TRY(cu->cuMemUnmap(va, bytes));
		t[4][i] = now_us() - t0;
		CU_TRY(cu->cuMemAddressFree(va, bytes));
		CU_TRY(cu->cuMemRelease(h2));
		CU_TRY(cu->cuMemRelease(h));
		close(fd);
	}
	printf("chunk %zu MiB (median of %u): create %.1f us, export %.1f us, import %.1f us, "
	       "reserve+map+access %.1f us, unmap %.1f us; export+import+map %.1f us\n",
	       bytes >> 20, iters, median(t[0], iters), median(t[1], iters), median(t[2], iters),
	       median(t[3], iters), median(t[4], iters),
	       median(t[1], iters) + median(t[2], iters) + median(t[3], iters));
	return 0;
}

/* Elapsed ms between two events recorded around what fn enqueued. */
struct timer {
	CUevent a, b;
};

static int timer_ms(struct timer *t, float *ret) {
	CU_TRY(cu->cuEventSynchronize(t->b));
	CU_TRY(cu->cuEventElapsedTime(ret, t->a, t->b));
	return 0;
}

static int bench_layer(const struct kvd_cuda_kernels *k, uint32_t L, double peak_gbs,
		       unsigned reps) {
	uint32_t n = L - WINDOW, rows = LAYERS * KV_HEADS, kk, *counts = NULL, *start = NULL;
	size_t nblocks = (L + BLOCK_TOKENS - 1) / BLOCK_TOKENS, block_bytes = 2 * BLOCK_TOKENS * DIM * 2;
	CUdeviceptr q, kv_k, kv_v, gram, probs, scratch, scores, dstart, dcounts, dkeep, gsel;
	CUdeviceptr tables, dblocks, staging;
	size_t score_scratch, staging_bytes = 16u << 20;
	struct kvd_attn_in in = {
		.dtype = KVD_DTYPE_BF16, .heads = HEADS, .kv_heads = KV_HEADS, .window = WINDOW,
		.len = L, .dim = DIM, .scale = 0.08838834764f,
	};
	struct kvd_gather_table t = { .block_tokens = BLOCK_TOKENS, .heads = 1,
				      .row_bytes = DIM * 2, .v_offset = BLOCK_TOKENS * DIM * 2 };
	struct kvd_score_params p;
	struct timer tm;
	float ms, ms_score, ms_select, ms_gather, best = 1e30f;
	uint64_t *blocks;

	kvd_attn_in_contiguous(&in);
	TRY(dev_random(&q, (size_t)HEADS * WINDOW * DIM, 0, 3.0f, 1));
	TRY(dev_random(&kv_k, (size_t)KV_HEADS * L * DIM, 0, 1.0f, 2));
	TRY(dev_random(&kv_v, (size_t)KV_HEADS * L * DIM, 0, 1.0f, 3));
	TRY(dev_random(&gram, (size_t)HEADS * DIM * DIM, 1, 0.05f, 4));
	in.q = (void *)(uintptr_t)q, in.k = (void *)(uintptr_t)kv_k, in.v = (void *)(uintptr_t)kv_v;
	kvd_score_params_default(KVD_SCORE_RESTKV, &p);
	p.normalize = 1;
	p.aws_topk = L / 4 > WINDOW ? L / 4 - WINDOW : 1;
	score_scratch = kvd_cuda_score_layer_scratch_bytes(&in, &p);
	CU_TRY(cu->cuMemAlloc(&probs, (size_t)HEADS * WINDOW * L * sizeof(float)));
	CU_TRY(cu->cuMemAlloc(&scratch, score_scratch));
	CU_TRY(cu->cuMemAlloc(&scores, (size_t)rows * n * sizeof(float)));
	CU_TRY(cu->cuEventCreate(&tm.a, CU_EVENT_DEFAULT));
	CU_TRY(cu->cuEventCreate(&tm.b, CU_EVENT_DEFAULT));

	/* Attention alone: the K-read bandwidth. */
	for (unsigned i = 0; i < reps + 1; i++) {
		CU_TRY(cu->cuEventRecord(tm.a, stream));
		TRY(kvd_cuda_attn(k, &in, (float *)(uintptr_t)probs, stream));
		CU_TRY(cu->cuEventRecord(tm.b, stream));
		TRY(timer_ms(&tm, &ms));
		if (i > 0 && ms < best) /* the first run warms up */
			best = ms;
	}
	{
		double kbytes = (double)KV_HEADS * L * DIM * 2, pbytes = (double)HEADS * WINDOW * L * 4;
		double gbs = kbytes / (best * 1e-3) / 1e9;

		printf("attn %u tokens: %.3f ms; K read %.1f MB at %.1f GB/s = %.2f%% of peak %.0f GB/s; "
		       "maps written %.1f MB (%.1f GB/s incl. the softmax's re-read and write)\n",
		       L, best, kbytes / 1e6, gbs, 100 * gbs / peak_gbs, peak_gbs, pbytes / 1e6,
		       (kbytes + 4 * pbytes) / (best * 1e-3) / 1e9);
	}

	/* Scoring of every layer (shared K/V), into one [layers][kv heads][n] array. */
	CU_TRY(cu->cuEventRecord(tm.a, stream));
	for (uint32_t l = 0; l < LAYERS; l++)
		TRY(kvd_cuda_score_layer(k, &in, (const float *)(uintptr_t)gram, NULL, &p,
					 (void *)(uintptr_t)scratch,
					 (float *)(uintptr_t)scores + (size_t)l * KV_HEADS * n, stream));
	CU_TRY(cu->cuEventRecord(tm.b, stream));
	TRY(timer_ms(&tm, &ms_score));

	/* One node-wide selection keeping a quarter of all prefix tokens. */
	start = calloc(rows + 1, sizeof(*start));
	counts = calloc(rows, sizeof(*counts));
	if (!start || !counts)
		return -ENOMEM;
	for (uint32_t i = 0; i <= rows; i++)
		start[i] = i * n;
	kk = rows * n / 4;
	CU_TRY(cu->cuMemAlloc(&dstart, (rows + 1) * sizeof(uint32_t)));
	CU_TRY(cu->cuMemcpyHtoD(dstart, start, (rows + 1) * sizeof(uint32_t)));
	CU_TRY(cu->cuMemAlloc(&dcounts, rows * sizeof(uint32_t)));
	CU_TRY(cu->cuMemAlloc(&dkeep, (size_t)kk * sizeof(uint32_t)));
	CU_TRY(cu->cuMemAlloc(&gsel, kvd_cuda_topk_global_scratch_bytes(rows * n)));
	CU_TRY(cu->cuEventRecord(tm.a, stream));
	TRY(kvd_cuda_topk_global(k, (const float *)(uintptr_t)scores, rows * n,
				 (const uint32_t *)(uintptr_t)dstart, rows, kk, (void *)(uintptr_t)gsel,
				 (uint32_t *)(uintptr_t)dcounts, (uint32_t *)(uintptr_t)dkeep, stream));
	CU_TRY(cu->cuEventRecord(tm.b, stream));
	TRY(timer_ms(&tm, &ms_select));
	CU_TRY(cu->cuMemcpyDtoH(counts, dcounts, rows * sizeof(uint32_t)));

	/* The tables of one layer (8 kv heads, per-head layout), reused by every layer. */
	CU_TRY(cu->cuMemAlloc(&tables, KV_HEADS * nblocks * block_bytes));
	CU_TRY(cu->cuMemAlloc(&dblocks, KV_HEADS * nblocks * sizeof(uint64_t)));
	CU_TRY(cu->cuMemAlloc(&staging, staging_bytes));
	blocks = calloc(KV_HEADS * nblocks, sizeof(*blocks));
	if (!blocks)
		return -ENOMEM;
	for (size_t b = 0; b < KV_HEADS * nblocks; b++)
		blocks[b] = tables + b * block_bytes;
	CU_TRY(cu->cuMemcpyHtoD(dblocks, blocks, KV_HEADS * nblocks * sizeof(uint64_t)));
	CU_TRY(cu->cuEventRecord(tm.a, stream));
	for (uint32_t rr = 0, off = 0; rr < rows; off += counts[rr], rr++)
		TRY(kvd_cuda_gather(k, &t,
				    (const uint64_t *)(uintptr_t)dblocks + (rr % KV_HEADS) * nblocks,
				    NULL, (const uint32_t *)(uintptr_t)dkeep + off, counts[rr],
				    (void *)(uintptr_t)staging, staging_bytes, stream));
	CU_TRY(cu->cuEventRecord(tm.b, stream));
	TRY(timer_ms(&tm, &ms_gather));
	printf("round %u tokens x %u layers: score %.1f ms (%.2f ms/layer), select %.1f ms "
	       "(%u of %u), gather %.1f ms (%u tables): %.1f ms\n",
	       L, LAYERS, ms_score, ms_score / LAYERS, ms_select, kk, rows * n, ms_gather, rows,
	       ms_score + ms_select + ms_gather);

	free(blocks), free(start), free(counts);
	CUdeviceptr all[] = { q, kv_k, kv_v, gram, probs, scratch, scores, dstart,
			      dcounts, dkeep, gsel, tables, dblocks, staging };
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		cu->cuMemFree(all[i]);
	cu->cuEventDestroy(tm.a), cu->cuEventDestroy(tm.b);
	return 0;
}

static void usage(void) {
	printf("kvd-bench-gpu [--tokens N[,N...]] [--reps N] [--chunk-mib N] [--iters N]\n"
	       "GPU figures: chunk export+import+map, window-attention bandwidth, full device\n"
	       "rounds (32 layers, 32/8 heads, head_dim 128, bf16). Exit 77 without a GPU.\n");
}

int main(int argc, char **argv) {
	static const struct option options[] = {
		{ "tokens", required_argument, NULL, 't' }, { "reps", required_argument, NULL, 'r' },
		{ "chunk-mib", required_argument, NULL, 'c' }, { "iters", required_argument, NULL, 'i' },
		{ "help", no_argument, NULL, 'h' },         {},
	};
	const char *tokens = "32768,131072", *why = NULL;
	unsigned reps = 3, iters = 20, chunk_mib = 64;
	struct kvd_cuda_kernels *k = NULL;
	CUresult cr = CUDA_SUCCESS;
	int c, clock_khz = 0, bus_bits = 0, major = 0, minor = 0, failed = 0;
	char name[128] = "?", *list, *tok, *save = NULL;
	CUcontext ctx;
	CUdevice dev;
	double peak;

	while ((c = getopt_long(argc, argv, "h", options, NULL)) >= 0)
		switch (c) {
		case 't':
			tokens = optarg;
			break;
		case 'r':
			reps = (unsigned)atoi(optarg);
			break;
		case 'c':
			chunk_mib = (unsigned)atoi(optarg);
			break;
		case 'i':
			iters = (unsigned)atoi(optarg);
			break;
		case 'h':
			usage();
			return 0;
		default:
			return 2;
		}
	if (reps == 0 || iters == 0 || chunk_mib == 0) {
		fprintf(stderr, "kvd-bench-gpu: --reps, --iters and --chunk-mib must be positive\n");
		return 2;
	}
	if (cuda_dl_load(&cu, &why) < 0) {
		printf("kvd-bench-gpu: no usable GPU: %s\n", why);
		return 77;
	}
	if (cu->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
	    cu->cuDevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
	    cu->cuCtxSetCurrent(ctx) != CUDA_SUCCESS ||
	    cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
		printf("kvd-bench-gpu: no usable GPU: no context on device 0\n");
		return 77;
	}
	cu->cuDeviceGetName(name, sizeof(name), dev);
	cu->cuDeviceGetAttribute(&clock_khz, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, dev);
	cu->cuDeviceGetAttribute(&bus_bits, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, dev);
	cu->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev);
	cu->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev);
	/* Double data rate: two transfers per memory clock. */
	peak = 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9;
	printf("device: %s, sm %d.%d, memory clock %d MHz x %d bits: peak %.0f GB/s; kernels "
	       "built for sm %s\n",
	       name, major, minor, clock_khz / 1000, bus_bits, peak, kvd_cuda_kernels_arch());
	if (peak <= 0) {
		fprintf(stderr, "kvd-bench-gpu: the driver reports no memory clock or bus width\n");
		peak = 1;
		failed = 1;
	}
	c = kvd_cuda_kernels_new(cu, &k, &cr);
	if (c < 0) {
		fprintf(stderr, "kvd-bench-gpu: loading the kernels: %s\n", cuda_dl_strerror(cr));
		return 1;
	}
	if (bench_chunk(dev, chunk_mib, iters) < 0)
		failed = 1;
	list = strdup(tokens);
	for (tok = list ? strtok_r(list, ",", &save) : NULL; tok; tok = strtok_r(NULL, ",", &save)) {
		long L = atol(tok);

		if (L <= WINDOW || L > (1l << 24)) {
			fprintf(stderr, "kvd-bench-gpu: --tokens: '%s' is not in %u..%u\n", tok,
				WINDOW + 1, 1u << 24);
			failed = 2;
			break;
		}
		if (bench_layer(k, (uint32_t)L, peak, reps) < 0)
			failed = 1;
	}
	free(list);
	kvd_cuda_kernels_free(k);
	cu->cuStreamDestroy(stream);
	cu->cuDevicePrimaryCtxRelease(dev);
	return failed;
}
