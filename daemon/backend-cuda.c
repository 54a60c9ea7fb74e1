/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend: chunks are cuMemCreate allocations on one GPU, exported as POSIX fds
 * (PLATFORM.md section 2.2). UNVERIFIED ON HARDWARE: written against CUDA 13's cuda.h and
 * run here only without a driver, where it falls back; see tools/gpu-check.
 *
 * The daemon maps each chunk into its own device address space (one reservation per
 * chunk: cuMemMap maps whole allocations at offset 0 only), so that device kernels can
 * read and move K/V; backend_chunk.addr is that device address, which the CPU must never
 * dereference (host_access is false).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend-cuda.h"
#include "common/macro.h"
#include "cuda-dl.h"
#include "log.h"

static struct {
	const struct cuda_dl *cu;
	CUdevice dev;
	CUcontext ctx;                /* the device's primary context, retained */
	CUstream stream;              /* the daemon's own: scrubs, later kernels */
	CUmemAllocationProp prop;
	CUmemAccessDesc access;
	uint64_t granularity;
	struct backend_device info;
	bool open;
} cuda;

/* Logs a failed driver call at debug level (the caller logs the errno once, where it
 * handles it) and returns it as -errno. */
static int cu_fail(CUresult cr, const char *call) {
	log_debug("cuda: %s failed: %s", call, cuda_dl_strerror(cr));
	return cuda_dl_errno(cr);
}

/* Whether device `ordinal` can hold a pool; why says what it lacks. */
static bool device_usable(const struct cuda_dl *cu, int ordinal, CUdevice *ret_dev, char *why,
                          size_t why_n) {
	int vmm = 0, posix_fd = 0;
	CUdevice dev;
	CUresult cr;

	cr = cu->cuDeviceGet(&dev, ordinal);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: %s", ordinal, cuda_dl_strerror(cr));
		return false;
	}
	if (cu->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
	                             dev) != CUDA_SUCCESS || !vmm) {
		snprintf(why, why_n, "device %d: no virtual memory management (cuMemCreate)", ordinal);
		return false;
	}
	if (cu->cuDeviceGetAttribute(&posix_fd,
	                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
	                             dev) != CUDA_SUCCESS || !posix_fd) {
		snprintf(why, why_n, "device %d: cannot export memory as file descriptors", ordinal);
		return false;
	}
	*ret_dev = dev;
	return true;
}

/* Parses the next ordinal of a --devices list (checked by backend_devices_check). */
static bool next_ordinal(const char **p, int *ret) {
	static const char seps[] = " \t,";
	char *end;

	*p += strspn(*p, seps);
	if (!**p)
		return false;
	*ret = (int)strtol(*p, &end, 10);
	*p = end;
	return true;
}

int backend_cuda_open(const char *devices, char *why, size_t why_n) {
	const struct cuda_dl *cu;
	const char *dl_why, *p = devices;
	bool all = !devices || strcmp(devices, "all") == 0;
	char skip[160] = "";
	unsigned usable = 0;
	int ordinal = -1, o, r;
	size_t free_b = 0, total_b = 0, gran = 0;
	CUuuid uuid;
	CUresult cr;

	r = cuda_dl_load(&cu, &dl_why);
	if (r < 0) {
		snprintf(why, why_n, "%s", dl_why);
		return -ENODEV;
	}
	/* The first usable device is pooled; the others are counted to say so. */
	for (int i = 0; all ? i < cu->device_count : next_ordinal(&p, &o); i++) {
		CUdevice dev;
		int want = all ? i : o;

		if (want >= cu->device_count) {
			snprintf(skip, sizeof(skip), "device %d: no such device (%d found)", want,
			         cu->device_count);
			continue;
		}
		if (!device_usable(cu, want, &dev, skip, sizeof(skip)))
			continue;
		if (usable++ == 0) {
			ordinal = want;
			cuda.dev = dev;
		}
	}
	if (ordinal < 0) {
		snprintf(why, why_n, "%s", skip[0] ? skip : "no device listed");
		return -ENODEV;
	}
	if (usable > 1)
		log_warning("cuda: %u usable GPUs listed, but this version pools only the first (%d); "
		            "the others are left alone", usable, ordinal);

	cr = cu->cuDevicePrimaryCtxRetain(&cuda.ctx, cuda.dev);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: no context: %s", ordinal, cuda_dl_strerror(cr));
		return -ENODEV;
	}
	cuda.cu = cu;
	cr = cu->cuCtxSetCurrent(cuda.ctx);
	if (cr == CUDA_SUCCESS)
		/* Non-blocking: engines' work on the legacy default stream must not wait for
		 * the daemon's scrubs, nor the other way round. */
		cr = cu->cuStreamCreate(&cuda.stream, CU_STREAM_NON_BLOCKING);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: no stream: %s", ordinal, cuda_dl_strerror(cr));
		backend_cuda_close();
		return -ENODEV;
	}

	cuda.prop = (CUmemAllocationProp){
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cuda.dev },
	};
	cuda.access = (CUmemAccessDesc){
		.location = cuda.prop.location,
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
	};
	/* The minimum, not the recommended granularity: chunk-size is the operator's choice,
	 * and the minimum is what cuMemCreate and cuMemMap require. */
	cr = cu->cuMemGetAllocationGranularity(&gran, &cuda.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (cr == CUDA_SUCCESS)
		cr = cu->cuMemGetInfo(&free_b, &total_b);
	if (cr != CUDA_SUCCESS || gran == 0) {
		snprintf(why, why_n, "device %d: cannot query memory: %s", ordinal, cuda_dl_strerror(cr));
		backend_cuda_close();
		return -ENODEV;
	}
	cuda.granularity = gran;

	memset(&cuda.info, 0, sizeof(cuda.info));
	cuda.info.ordinal = ordinal;
	if (cu->cuDeviceGetUuid(&uuid, cuda.dev) == CUDA_SUCCESS)
		memcpy(cuda.info.uuid, uuid.bytes, sizeof(cuda.info.uuid));
	if (cu->cuDeviceGetName(cuda.info.name, sizeof(cuda.info.name), cuda.dev) != CUDA_SUCCESS)
		snprintf(cuda.info.name, sizeof(cuda.info.name), "?");
	cuda.info.free_bytes = free_b;
	cuda.info.total_bytes = total_b;
	cuda.open = true;
	snprintf(why, why_n, "cuda on GPU %d (%s, %llu of %llu MiB free, granularity %llu KiB; %s)",
	         ordinal, cuda.info.name, (unsigned long long)(free_b >> 20),
	         (unsigned long long)(total_b >> 20), (unsigned long long)(gran >> 10), dl_why);
	return 0;
}

const struct backend_device *backend_cuda_device(void) {
	return cuda.open ? &cuda.info : NULL;
}

CUstream backend_cuda_stream(void) {
	return cuda.stream;
}

void backend_cuda_close(void) {
	if (!cuda.cu)
		return;
	if (cuda.stream)
		cuda.cu->cuStreamDestroy(cuda.stream);
	cuda.stream = NULL;
	if (cuda.ctx)
		cuda.cu->cuDevicePrimaryCtxRelease(cuda.dev);
	cuda.ctx = NULL;
	cuda.open = false;
}

static uint64_t cuda_granularity(void) {
	/* Before the driver is asked, the settings checks can only hold chunks to pages;
	 * pool_new checks the device's granularity at start. */
	return cuda.open ? cuda.granularity : (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Zeroes [addr, addr + bytes) on the daemon's stream and waits: a chunk leaves here only
 * once no byte of its last owner can be read. */
static int cuda_zero(CUdeviceptr addr, uint64_t bytes) {
	CUresult cr;

	cr = cuda.cu->cuMemsetD8Async(addr, 0, bytes, cuda.stream);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuMemsetD8Async");
	cr = cuda.cu->cuStreamSynchronize(cuda.stream);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuStreamSynchronize");
	return 0;
}

static void cuda_chunk_destroy(struct backend_chunk *c) {
	CUdeviceptr va = (CUdeviceptr)(uintptr_t)c->addr;

	(void)cuda.cu->cuCtxSetCurrent(cuda.ctx);
	if (va) {
		cuda.cu->cuMemUnmap(va, c->bytes);
		cuda.cu->cuMemAddressFree(va, c->bytes);
	}
	c->addr = NULL;
	/* The allocation lives on while a client still has it mapped or holds its fd
	 * (cuMemRelease): the driver frees it when the last reference goes. */
	if (c->handle)
		cuda.cu->cuMemRelease((CUmemGenericAllocationHandle)c->handle);
	c->handle = 0;
	c->fd = safe_close(c->fd);
}

static int cuda_chunk_create(uint32_t id, uint64_t bytes, struct backend_chunk *ret) {
	struct backend_chunk c = { .fd = -EBADF, .bytes = bytes };
	CUmemGenericAllocationHandle h;
	CUdeviceptr va = 0;
	int fd = -1, r;
	CUresult cr;

	/* The loop's thread has the context current since open; a round thread may not. */
	cr = cuda.cu->cuCtxSetCurrent(cuda.ctx);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuCtxSetCurrent");
	cr = cuda.cu->cuMemCreate(&h, bytes, &cuda.prop, 0);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuMemCreate");
	c.handle = (uint64_t)h;
	/* Exported once: every grant of this chunk sends a copy of this fd. */
	cr = cuda.cu->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemExportToShareableHandle");
		goto fail;
	}
	c.fd = fd;
	if (fcntl(c.fd, F_SETFD, FD_CLOEXEC) < 0) {
		r = negative_errno();
		goto fail;
	}
	cr = cuda.cu->cuMemAddressReserve(&va, bytes, cuda.granularity, 0, 0);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemAddressReserve");
		goto fail;
	}
	cr = cuda.cu->cuMemMap(va, bytes, 0, h, 0);
	if (cr != CUDA_SUCCESS) {
		cuda.cu->cuMemAddressFree(va, bytes);
		r = cu_fail(cr, "cuMemMap");
		goto fail;
	}
	c.addr = (void *)(uintptr_t)va;
	/* A new mapping has no access at all until it is granted. */
	cr = cuda.cu->cuMemSetAccess(va, bytes, &cuda.access, 1);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemSetAccess");
		goto fail;
	}
	/* cuMemCreate makes no promise about the contents: the chunk's first owner reads
	 * zeros like every later one. */
	r = cuda_zero(va, bytes);
	if (r < 0)
		goto fail;
	log_debug("cuda: chunk %u: %llu bytes at device address 0x%llx", id,
	          (unsigned long long)bytes, (unsigned long long)va);
	*ret = c;
	return 0;
fail:
	cuda_chunk_destroy(&c);
	return r;
}

static int cuda_chunk_scrub(struct backend_chunk *c) {
	CUresult cr = cuda.cu->cuCtxSetCurrent(cuda.ctx);

	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuCtxSetCurrent");
	return cuda_zero((CUdeviceptr)(uintptr_t)c->addr, c->bytes);
}

/*
 * The CPU paths' copies (backend.h): synchronous, on the context's legacy stream, from
 * whichever thread asks (a round worker has no context current until the first call).
 * Ordering with the engines needs nothing more: the daemon only reads or moves a sequence's
 * K/V while it is not pinned, and an engine unpins after its writes have completed.
 */
static int cuda_read(const void *src, void *dst, uint64_t bytes) {
	CUresult cr = cuda.cu->cuCtxSetCurrent(cuda.ctx);

	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuCtxSetCurrent");
	cr = cuda.cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemcpyDtoH");
}

static int cuda_write(void *dst, const void *src, uint64_t bytes) {
	CUresult cr = cuda.cu->cuCtxSetCurrent(cuda.ctx);

	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuCtxSetCurrent");
	cr = cuda.cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemcpyHtoD");
}

static int cuda_copy(void *dst, const void *src, uint64_t bytes) {
	CUresult cr = cuda.cu->cuCtxSetCurrent(cuda.ctx);

	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuCtxSetCurrent");
	cr = cuda.cu->cuMemcpyDtoD((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemcpyDtoD");
}

const struct backend_ops backend_cuda_ops = {
	.name = "cuda",
	.memory = BACKEND_MEMORY_CUDA,
	.host_access = false,
	.granularity = cuda_granularity,
	.chunk_create = cuda_chunk_create,
	.chunk_scrub = cuda_chunk_scrub,
	.read = cuda_read,
	.write = cuda_write,
	.copy = cuda_copy,
	.chunk_destroy = cuda_chunk_destroy,
};
