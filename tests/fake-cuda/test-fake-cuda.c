/* SPDX-License-Identifier: MIT */
/*
 * The fake driver itself (suite fake-gpu): that it refuses what the real driver refuses,
 * so that the tests run under it catch a kvd mistake instead of passing over it. Runs with
 * LD_LIBRARY_PATH at tests/fake-cuda; exits 77 when another libcuda.so.1 was loaded. Runs
 * twice (meson.build): as is, and with KVD_FAKE_CUDA_STRICT=1, where the CPU cannot touch
 * device memory at all. The call counts (KVD_FAKE_CUDA_COUNT) are checked in a child that
 * this program runs again (call_counts).
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <stdbool.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "basic/cuda-dl.h"
#include "test.h"

#define MiB (UINT64_C(1) << 20)
/* Set in call_counts's child: test_setup runs count_child() instead of the tests. */
#define COUNT_CHILD_ENV "KVD_FAKE_CUDA_TEST_COUNT_CHILD"

static const struct cuda_dl *cu;
static CUcontext ctx;
static size_t gran;
static const CUmemAllocationProp prop = {
	.type = CU_MEM_ALLOCATION_TYPE_PINNED,
	.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
	.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
};
static const CUmemAccessDesc rw = {
	.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0 },
	.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
};

/* call_counts's child, a new process whose cuInit read KVD_FAKE_CUDA_COUNT: three 100-byte
 * copies to the device and one of 50 bytes back; its exit() then writes the counts. */
static int count_child(void) {
	uint8_t in[100] = { 1, 2, 3 }, out[50];
	CUdeviceptr d;
	CUcontext c;

	if (cu->cuDevicePrimaryCtxRetain(&c, 0) != CUDA_SUCCESS ||
	    cu->cuCtxPushCurrent(c) != CUDA_SUCCESS || cu->cuMemAlloc(&d, 4096) != CUDA_SUCCESS)
		return 2;
	for (int i = 0; i < 3; i++)
		if (cu->cuMemcpyHtoD(d + (CUdeviceptr)i * sizeof(in), in, sizeof(in)) != CUDA_SUCCESS)
			return 3;
	if (cu->cuMemcpyDtoH(out, d, sizeof(out)) != CUDA_SUCCESS || out[2] != 3)
		return 4;
	return 0;
}

int test_setup(void) {
	CUresult (*get_info)(size_t *, size_t *);
	char name[64] = "";
	const char *why;
	size_t f, t;
	CUdevice dev;
	void *h;

	/* Before cuda_dl_load's cuInit: the driver answers nothing yet. */
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		printf("no libcuda.so.1: %s\n", dlerror());
		return EXIT_TEST_SKIP;
	}
	get_info = (CUresult(*)(size_t *, size_t *))dlsym(h, "cuMemGetInfo_v2");
	if (!get_info || get_info(&f, &t) != CUDA_ERROR_NOT_INITIALIZED) {
		printf("libcuda.so.1 is not the fake driver\n");
		return EXIT_TEST_SKIP;
	}
	if (cuda_dl_load(&cu, &why) < 0) {
		printf("the fake driver does not load: %s\n", why);
		return -EIO;
	}
	if (cu->cuDeviceGet(&dev, 0) != CUDA_SUCCESS ||
	    cu->cuDeviceGetName(name, sizeof(name), dev) != CUDA_SUCCESS ||
	    strcmp(name, "kvd fake CUDA device 0") != 0) {
		printf("libcuda.so.1 is not the fake driver (device 0: '%s')\n", name);
		return EXIT_TEST_SKIP;
	}
	if (getenv(COUNT_CHILD_ENV))
		exit(count_child()); /* exit(), not _exit(): the fake writes its counts at exit */
	return 0;
}

TEST(devices) {
	CUuuid u0, u1;
	CUdevice dev;
	int v = 0;

	/* KVD_FAKE_CUDA_DEVICES=2 (meson.build). */
	ASSERT_EQ(cu->device_count, 2);
	ASSERT_EQ(cu->cuDeviceGet(&dev, 2), CUDA_ERROR_INVALID_DEVICE);
	ASSERT_EQ(cu->cuDeviceGetUuid(&u0, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuDeviceGetUuid(&u1, 1), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(u0.bytes, u1.bytes, sizeof(u0.bytes)) != 0);
	ASSERT_EQ(cu->cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0),
	          CUDA_SUCCESS);
	ASSERT_EQ(v, 1);
	ASSERT_EQ(cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
	          CUDA_SUCCESS);
	ASSERT_EQ(gran, 2 * MiB);
}

/* Calls that need a context refuse a thread without one, as the driver does. */
TEST(contexts) {
	CUcontext popped = NULL;
	size_t f, t;
	CUstream s;

	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuCtxPopCurrent(&popped), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxPushCurrent(ctx), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_SUCCESS);
	ASSERT_EQ(t, 64 * MiB); /* KVD_FAKE_CUDA_MEMORY_MIB=64 */
	ASSERT_EQ(f, t);
	ASSERT_EQ(cu->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
	ASSERT_TRUE(popped == ctx);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuCtxSetCurrent(ctx), CUDA_SUCCESS);
	/* A released primary context is destroyed: no more calls in it. */
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_SUCCESS);
}

/* The VMM calls' argument checks, and access only after cuMemSetAccess. */
TEST(vmm) {
	CUmemGenericAllocationHandle h, h2;
	CUdeviceptr va, va2;
	size_t f, t;
	uint8_t buf[16] = { 1, 2, 3 }, back[16];
	int fd;

	ASSERT_EQ(cu->cuMemCreate(&h, gran + 4096, &prop, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemCreate(&h, 128 * MiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
	ASSERT_EQ(cu->cuMemCreate(&h, 2 * gran, &prop, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_SUCCESS);
	ASSERT_EQ(t - f, 2 * gran);
	ASSERT_EQ(cu->cuMemAddressReserve(&va, 4 * gran, 3 * gran, 0, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemAddressReserve(&va, 4 * gran, 4 * gran, 0, 0), CUDA_SUCCESS);
	ASSERT_EQ(va % (4 * gran), 0u);
	ASSERT_EQ(cu->cuMemMap(va + 4096, 2 * gran, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemMap(va, 2 * gran, gran, h, 0), CUDA_ERROR_INVALID_VALUE);
	/* As the real driver does: a prefix of the allocation maps, more than it does not. */
	ASSERT_EQ(cu->cuMemMap(va, 3 * gran, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemMap(va, gran, 0, h, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemUnmap(va, gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va, 2 * gran, 0, h + 1000, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemMap(va + 3 * gran, 2 * gran, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemMap(va, 2 * gran, 0, h, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va + gran, 2 * gran, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
	/* Mapped, but no access yet: what a kernel would fault on. */
	ASSERT_EQ(cu->cuMemcpyHtoD(va, buf, sizeof(buf)), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_EQ(cu->cuMemSetAccess(va, gran, &rw, 1), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemSetAccess(va, 2 * gran, &rw, 1), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyHtoD(va + 100, buf, sizeof(buf)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoD(va + 200, va + 100, sizeof(buf)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va + 200, sizeof(back)), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(buf, back, sizeof(buf)) == 0);
	ASSERT_EQ(cu->cuMemsetD8Async(va + 2 * gran, 0, 1, NULL), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_EQ(cu->cuMemsetD8Async(va, 0, 1, (CUstream)buf), CUDA_ERROR_INVALID_HANDLE);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, (CUdeviceptr)(uintptr_t)back, 1), CUDA_ERROR_INVALID_VALUE);

	/* Exported and imported: the same memory under another handle, at another place. */
	ASSERT_EQ(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	          CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd,
	                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
	          CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemImportFromShareableHandle(&h2, (void *)(uintptr_t)STDIN_FILENO,
	                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
	          CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemAddressReserve(&va2, 2 * gran, 0, 0, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va2, 2 * gran, 0, h2, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemRelease(h2), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemRelease(h2), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemSetAccess(va2, 2 * gran, &rw, 1), CUDA_SUCCESS);
	memset(back, 0, sizeof(back));
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va2 + 200, sizeof(back)), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(buf, back, sizeof(back)) == 0);

	/* Whole mappings only; a reservation with mappings is not freed. */
	ASSERT_EQ(cu->cuMemUnmap(va, gran), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemAddressFree(va, 4 * gran), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemUnmap(va, 2 * gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va, 1), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_EQ(cu->cuMemAddressFree(va, 2 * gran), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemAddressFree(va, 4 * gran), CUDA_SUCCESS);
	/* The handle and the other mapping hold the memory still. */
	ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_SUCCESS);
	ASSERT_EQ(t - f, 2 * gran);
	ASSERT_EQ(cu->cuMemUnmap(va2, 2 * gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemGetInfo(&f, &t), CUDA_SUCCESS);
	ASSERT_EQ(f, t);
	ASSERT_EQ(cu->cuMemAddressFree(va2, 2 * gran), CUDA_SUCCESS);
	close(fd);
}

/* Another process that imports the exported fd writes memory this one reads. */
TEST(shared_across_processes) {
	CUmemGenericAllocationHandle h;
	CUdeviceptr va;
	uint8_t b = 0;
	int fd, status;
	pid_t pid;

	ASSERT_EQ(cu->cuMemCreate(&h, gran, &prop, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	          CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressReserve(&va, gran, 0, 0, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va, gran, 0, h, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemSetAccess(va, gran, &rw, 1), CUDA_SUCCESS);
	pid = fork();
	ASSERT_GE(pid, 0);
	if (pid == 0) {
		/* The fake's state came along with fork: this is only about the memory. */
		CUmemGenericAllocationHandle h2;
		CUdeviceptr va2;
		uint8_t v = 42;

		if (cu->cuMemImportFromShareableHandle(&h2, (void *)(uintptr_t)fd,
		                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ||
		    cu->cuMemAddressReserve(&va2, gran, 0, 0, 0) || cu->cuMemMap(va2, gran, 0, h2, 0) ||
		    cu->cuMemSetAccess(va2, gran, &rw, 1) || cu->cuMemcpyHtoD(va2 + 7, &v, 1))
			_exit(1);
		_exit(0);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ASSERT_EQ(cu->cuMemcpyDtoH(&b, va + 7, 1), CUDA_SUCCESS);
	ASSERT_EQ(b, 42);
	ASSERT_EQ(cu->cuMemUnmap(va, gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressFree(va, gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
	close(fd);
}

TEST(streams_events_modules) {
	uint8_t back[100], want[100];
	CUdeviceptr d;
	CUevent a, b;
	CUstream s;
	CUmodule m;
	float ms = -1;

	ASSERT_EQ(cu->cuMemAlloc(&d, sizeof(back)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemsetD8Async(d, 7, sizeof(back), CU_STREAM_LEGACY), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, d, sizeof(back)), CUDA_SUCCESS);
	memset(want, 7, sizeof(want));
	ASSERT_TRUE(memcmp(back, want, sizeof(back)) == 0);
	ASSERT_EQ(cu->cuMemFree(d), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemFree(d), CUDA_ERROR_INVALID_VALUE);

	ASSERT_EQ(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventCreate(&a, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventCreate(&b, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventElapsedTime(&ms, a, b), CUDA_ERROR_INVALID_HANDLE);
	ASSERT_EQ(cu->cuEventRecord(a, s), CUDA_SUCCESS);
	usleep(2000);
	ASSERT_EQ(cu->cuEventRecord(b, s), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamSynchronize(s), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventSynchronize(b), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventElapsedTime(&ms, a, b), CUDA_SUCCESS);
	ASSERT_TRUE(ms >= 1.5f);
	ASSERT_EQ(cu->cuEventDestroy(a), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuEventDestroy(b), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamDestroy(s), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuStreamDestroy(s), CUDA_ERROR_INVALID_HANDLE);
	/* A driver older than the toolkit (the fake built as a pre-12.8 one says 12.4) refuses
	 * the module as too new; a current one has no code for it. */
	ASSERT_EQ(cu->cuModuleLoadData(&m, "x"), cu->driver_version < CUDA_VERSION ?
	                                         CUDA_ERROR_UNSUPPORTED_PTX_VERSION :
	                                         CUDA_ERROR_NO_BINARY_FOR_GPU);
	ASSERT_STREQ(cuda_dl_strerror(CUDA_ERROR_NO_BINARY_FOR_GPU), "CUDA_ERROR_NO_BINARY_FOR_GPU");
}

/* Whether KVD_FAKE_CUDA_STRICT is on (the fake reads it at cuInit, as here). */
static bool strict(void) {
	const char *e = getenv("KVD_FAKE_CUDA_STRICT");

	return e && strcmp(e, "1") == 0;
}

/*
 * Access granted, the CPU may read device memory only outside strict mode: strictly, as on
 * a GPU, a CPU read faults while the driver's copies work. Copies that run over two
 * mappings (two allocations side by side in one reservation) reach both.
 */
TEST(cpu_access) {
	CUmemGenericAllocationHandle h[2];
	uint8_t buf[64], back[64];
	CUdeviceptr va;
	int status;
	pid_t pid;

	for (int i = 0; i < 2; i++)
		ASSERT_EQ(cu->cuMemCreate(&h[i], gran, &prop, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressReserve(&va, 2 * gran, 0, 0, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va, gran, 0, h[0], 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va + gran, gran, 0, h[1], 0), CUDA_SUCCESS);
	/* Strict or not, no access yet is no copy. */
	ASSERT_EQ(cu->cuMemcpyHtoD(va, buf, 1), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_EQ(cu->cuMemSetAccess(va, 2 * gran, &rw, 1), CUDA_SUCCESS);
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(i + 1);
	ASSERT_EQ(cu->cuMemcpyHtoD(va + 5, buf, sizeof(buf)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va + 5, sizeof(back)), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(buf, back, sizeof(buf)) == 0);
	/* Over the boundary between the two mappings, overlapping itself. */
	ASSERT_EQ(cu->cuMemcpyHtoD(va + gran - 32, buf, sizeof(buf)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoD(va + gran - 16, va + gran - 32, sizeof(buf)), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va + gran - 16, sizeof(back)), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(buf, back, sizeof(buf)) == 0);
	ASSERT_EQ(cu->cuMemsetD8Async(va + gran - 8, 0xee, 16, NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(back, va + gran - 8, 16), CUDA_SUCCESS);
	for (int i = 0; i < 16; i++)
		ASSERT_EQ(back[i], 0xee);

	pid = fork();
	ASSERT_GE(pid, 0);
	if (pid == 0) {
		/* The default action, not a sanitizer's report; and no core file. */
		struct rlimit no_core = { 0, 0 };
		volatile const uint8_t *p = (volatile const uint8_t *)(uintptr_t)(va + 5);

		setrlimit(RLIMIT_CORE, &no_core);
		signal(SIGSEGV, SIG_DFL);
		_exit(p[0] == buf[0] && p[sizeof(buf) - 1] == buf[sizeof(buf) - 1] ? 0 : 2);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	if (strict())
		ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV);
	else
		ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);

	ASSERT_EQ(cu->cuMemUnmap(va, 2 * gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressFree(va, 2 * gran), CUDA_SUCCESS);
	for (int i = 0; i < 2; i++)
		ASSERT_EQ(cu->cuMemRelease(h[i]), CUDA_SUCCESS);
}

/* A 2D copy's parameters: row y from src + (srcY + y) * srcPitch + srcX, dst likewise. */
static CUDA_MEMCPY2D copy2d(CUmemorytype st, const void *sh, CUdeviceptr sd, size_t sx,
                            size_t sy, size_t sp, CUmemorytype dt, void *dh, CUdeviceptr dd,
                            size_t dx, size_t dy, size_t dp, size_t w, size_t hgt) {
	return (CUDA_MEMCPY2D){
		.srcMemoryType = st, .srcHost = sh, .srcDevice = sd, .srcXInBytes = sx, .srcY = sy,
		.srcPitch = sp, .dstMemoryType = dt, .dstHost = dh, .dstDevice = dd,
		.dstXInBytes = dx, .dstY = dy, .dstPitch = dp, .WidthInBytes = w, .Height = hgt,
	};
}

/*
 * cuMemcpy2D (and cuMemcpy2DAsync, not in cuda_dl: looked up here): strided rows either
 * way, checked as the driver checks them, every row in accessible memory before anything
 * is copied. Device memory is reached only through the driver, so this runs strict too.
 */
TEST(memcpy_2d) {
	CUresult (*copy_async)(const CUDA_MEMCPY2D *, CUstream);
	static uint8_t pat[4096], out[512], want[512], rows[512], span[1024];
	CUmemGenericAllocationHandle h;
	CUcontext popped = NULL;
	CUDA_MEMCPY2D c;
	CUdeviceptr va;
	void *lib;

	ASSERT_TRUE(cu->cuMemcpy2D != NULL);
	lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	ASSERT_TRUE(lib != NULL);
	copy_async = (CUresult(*)(const CUDA_MEMCPY2D *, CUstream))dlsym(lib, "cuMemcpy2DAsync_v2");
	ASSERT_TRUE(copy_async != NULL);
	/* One mapping at the start of a two-granule reservation: the rest is reserved only. */
	ASSERT_EQ(cu->cuMemCreate(&h, gran, &prop, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressReserve(&va, 2 * gran, 0, 0, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemMap(va, gran, 0, h, 0), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemSetAccess(va, gran, &rw, 1), CUDA_SUCCESS);
	for (size_t i = 0; i < sizeof(pat); i++)
		pat[i] = (uint8_t)(i * 7 + i / 251);
	ASSERT_EQ(cu->cuMemcpyHtoD(va, pat, sizeof(pat)), CUDA_SUCCESS);

	/* DtoH of a strided region: 5 rows of 40 bytes at pitch 100 from (3, 2), into rows of
	 * pitch 48 at X 4; the gaps between rows keep their bytes. */
	memset(out, 0xaa, sizeof(out));
	memset(want, 0xaa, sizeof(want));
	for (size_t y = 0; y < 5; y++)
		memcpy(want + y * 48 + 4, pat + (2 + y) * 100 + 3, 40);
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va, 3, 2, 100, CU_MEMORYTYPE_HOST, out, 0, 4, 0, 48,
	           40, 5);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(out, want, sizeof(out)) == 0);

	/* HtoD 2D, read back in 1D: 6 rows of 30 bytes at pitch 50 to (2, 1) at pitch 64, over
	 * memory set to 0x55 first. */
	for (size_t i = 0; i < sizeof(rows); i++)
		rows[i] = (uint8_t)(255 - i);
	ASSERT_EQ(cu->cuMemsetD8Async(va + 8192, 0x55, sizeof(span), NULL), CUDA_SUCCESS);
	memset(want, 0x55, sizeof(want));
	for (size_t y = 0; y < 6; y++)
		memcpy(want + (1 + y) * 64 + 2, rows + y * 50, 30);
	c = copy2d(CU_MEMORYTYPE_HOST, rows, 0, 0, 0, 50, CU_MEMORYTYPE_DEVICE, NULL, va + 8192, 2,
	           1, 64, 30, 6);
	ASSERT_EQ(copy_async(&c, NULL), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(span, va + 8192, sizeof(want)), CUDA_SUCCESS);
	ASSERT_TRUE(memcmp(span, want, sizeof(want)) == 0);

	/* DtoD 2D: those rows again, to pitch 32 at va + 16384, read back in 1D. */
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va + 8192, 2, 1, 64, CU_MEMORYTYPE_DEVICE, NULL,
	           va + 16384, 0, 0, 32, 30, 6);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpyDtoH(span, va + 16384, 6 * 32), CUDA_SUCCESS);
	for (size_t y = 0; y < 6; y++)
		ASSERT_TRUE(memcmp(span + y * 32, rows + y * 50, 30) == 0);

	/* The last row (at gran - 32) runs past the mapping, into the reservation's unmapped
	 * half: refused as a 1D copy of that row is, and nothing copied, not even the rows
	 * before. */
	memset(out, 0xaa, sizeof(out));
	memset(want, 0xaa, sizeof(want));
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va + gran - 232, 0, 0, 100, CU_MEMORYTYPE_HOST,
	           out, 0, 0, 0, 64, 64, 3);
	ASSERT_EQ(cu->cuMemcpyDtoH(out, va + gran - 32, 64), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_ILLEGAL_ADDRESS);
	ASSERT_TRUE(memcmp(out, want, sizeof(out)) == 0);
	c = copy2d(CU_MEMORYTYPE_HOST, pat, 0, 0, 0, 100, CU_MEMORYTYPE_DEVICE, NULL,
	           va + gran - 232, 0, 0, 100, 64, 3);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_ILLEGAL_ADDRESS);
	/* One row less fits. */
	c.Height = 2;
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);

	/* A pitch under X + width, with more than one row; one row has no pitch to check. */
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va, 0, 0, 32, CU_MEMORYTYPE_HOST, out, 0, 0, 0, 64,
	           40, 2);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_INVALID_VALUE);
	c.srcPitch = 40;
	c.dstXInBytes = 30;
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_INVALID_VALUE);
	c.dstXInBytes = 0;
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va, 0, 0, 0, CU_MEMORYTYPE_HOST, out, 0, 0, 0, 0,
	           40, 1);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);

	/* NULL pointers, arrays, streams, no context; nothing to copy is no error. */
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va, 0, 0, 64, CU_MEMORYTYPE_HOST, NULL, 0, 0, 0, 64,
	           40, 2);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_INVALID_VALUE);
	ASSERT_EQ(cu->cuMemcpy2D(NULL), CUDA_ERROR_INVALID_VALUE);
	c.Height = 0;
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_SUCCESS);
	c = copy2d(CU_MEMORYTYPE_ARRAY, NULL, 0, 0, 0, 64, CU_MEMORYTYPE_HOST, out, 0, 0, 0, 64, 40,
	           2);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_NOT_SUPPORTED);
	c = copy2d(CU_MEMORYTYPE_DEVICE, NULL, va, 0, 0, 64, CU_MEMORYTYPE_HOST, out, 0, 0, 0, 64,
	           40, 2);
	ASSERT_EQ(copy_async(&c, (CUstream)out), CUDA_ERROR_INVALID_HANDLE);
	ASSERT_EQ(copy_async(&c, CU_STREAM_LEGACY), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemcpy2D(&c), CUDA_ERROR_INVALID_CONTEXT);
	ASSERT_EQ(cu->cuCtxPushCurrent(popped), CUDA_SUCCESS);

	ASSERT_EQ(cu->cuMemUnmap(va, gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemAddressFree(va, 2 * gran), CUDA_SUCCESS);
	ASSERT_EQ(cu->cuMemRelease(h), CUDA_SUCCESS);
	dlclose(lib);
}

/*
 * KVD_FAKE_CUDA_COUNT: a child (exec'd, so that its cuInit reads the variable) makes known
 * copies; at its exit the fake writes PATH.PID, lines "NAME CALLS BYTES" sorted by name,
 * NAME the exported (versioned) symbol.
 */
TEST(call_counts) {
	char dir[PATH_MAX], base[PATH_MAX + 16], path[PATH_MAX + 32], line[256], prev[128] = "";
	const char *tmp = getenv("TMPDIR");
	bool htod = false, dtoh = false, init = false;
	int status;
	pid_t pid;
	FILE *f;

	snprintf(dir, sizeof(dir), "%s/kvd-fake-cuda-count-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	ASSERT_TRUE(mkdtemp(dir) != NULL);
	snprintf(base, sizeof(base), "%s/counts", dir);
	fflush(stdout);
	pid = fork();
	ASSERT_GE(pid, 0);
	if (pid == 0) {
		setenv("KVD_FAKE_CUDA_COUNT", base, 1);
		setenv(COUNT_CHILD_ENV, "1", 1);
		execl("/proc/self/exe", "test-fake-cuda", (char *)NULL);
		_exit(127);
	}
	ASSERT_EQ(waitpid(pid, &status, 0), pid);
	ASSERT_TRUE(WIFEXITED(status));
	ASSERT_EQ(WEXITSTATUS(status), 0);
	snprintf(path, sizeof(path), "%s.%d", base, (int)pid);
	f = fopen(path, "re");
	ASSERT_TRUE(f != NULL);
	while (fgets(line, sizeof(line), f)) {
		unsigned long long calls, bytes;
		char name[128];
		int end = 0;

		ASSERT_EQ(sscanf(line, "%127s %llu %llu%n", name, &calls, &bytes, &end), 3);
		ASSERT_STREQ(line + end, "\n");
		ASSERT_TRUE(strcmp(prev, name) < 0); /* sorted, each name once */
		ASSERT_GT(calls, 0);
		if (strcmp(name, "cuMemcpyHtoD_v2") == 0) {
			ASSERT_EQ(calls, 3);
			ASSERT_EQ(bytes, 300);
			htod = true;
		} else if (strcmp(name, "cuMemcpyDtoH_v2") == 0) {
			ASSERT_EQ(calls, 1);
			ASSERT_EQ(bytes, 50);
			dtoh = true;
		} else {
			/* Only copies and memsets move bytes; this child made no other. */
			ASSERT_EQ(bytes, 0);
			if (strcmp(name, "cuInit") == 0)
				init = true;
		}
		snprintf(prev, sizeof(prev), "%s", name);
	}
	fclose(f);
	ASSERT_TRUE(htod && dtoh && init);
	ASSERT_OK(unlink(path));
	/* Nothing else: the parent, which has no KVD_FAKE_CUDA_COUNT, writes nothing anyway. */
	ASSERT_OK(rmdir(dir));
}
