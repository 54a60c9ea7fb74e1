/* SPDX-License-Identifier: MIT */
/* libkvd: importing MEMORY_CUDA chunks (see cuda-import.h). */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "basic/cuda-dl.h"
#include "cuda-import.h"

/* The most address space reserved for one pool; a HelloReply asking more is broken. */
#define POOL_VA_MAX (UINT64_C(1) << 44)

struct client_cuda {
	const struct cuda_dl *cu;
	CUdevice dev;
	int ordinal;
	CUcontext ctx;                /* the primary context, retained */
	CUdeviceptr base;
	uint64_t pool_bytes, chunk_bytes;
	CUmemAccessDesc access;
};

/* Makes the primary context current on this thread until pop(), whatever the engine had. */
static int push(struct client_cuda *cc) {
	CUresult cr = cc->cu->cuCtxPushCurrent(cc->ctx);

	return cr == CUDA_SUCCESS ? 0 : cuda_dl_errno(cr);
}

static void pop(struct client_cuda *cc) {
	CUcontext ignored;

	(void)cc->cu->cuCtxPopCurrent(&ignored);
}

int client_cuda_new(const uint8_t *uuid, size_t uuid_len, uint64_t pool_bytes,
                    uint64_t chunk_bytes, struct client_cuda **ret) {
	const struct cuda_dl *cu;
	struct client_cuda *cc;
	CUresult cr;
	int r;

	if (!uuid || uuid_len != sizeof(((CUuuid *)NULL)->bytes) || chunk_bytes == 0 ||
	    pool_bytes == 0 || pool_bytes % chunk_bytes != 0 || pool_bytes > POOL_VA_MAX)
		return -EPROTO;
	r = cuda_dl_load(&cu, NULL);
	if (r < 0)
		return r;
	cc = calloc(1, sizeof(*cc));
	if (!cc)
		return -ENOMEM;
	cc->cu = cu;
	cc->ordinal = -1;
	/* Ordinals differ between processes (CUDA_VISIBLE_DEVICES): the UUID names the GPU. */
	for (int i = 0; i < cu->device_count && cc->ordinal < 0; i++) {
		CUuuid u;
		CUdevice dev;

		if (cu->cuDeviceGet(&dev, i) == CUDA_SUCCESS &&
		    cu->cuDeviceGetUuid(&u, dev) == CUDA_SUCCESS && memcmp(u.bytes, uuid, uuid_len) == 0) {
			cc->dev = dev;
			cc->ordinal = i;
		}
	}
	if (cc->ordinal < 0) {
		free(cc);
		return -ENODEV;
	}
	cr = cu->cuDevicePrimaryCtxRetain(&cc->ctx, cc->dev);
	if (cr != CUDA_SUCCESS) {
		free(cc);
		return cuda_dl_errno(cr);
	}
	cc->pool_bytes = pool_bytes;
	cc->chunk_bytes = chunk_bytes;
	cc->access = (CUmemAccessDesc){
		.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = cc->dev },
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
	};
	r = push(cc);
	if (r < 0) {
		cu->cuDevicePrimaryCtxRelease(cc->dev);
		free(cc);
		return r;
	}
	/* Aligned to the largest power of two that divides the chunk size (the driver takes
	 * only powers of two: a 6 MiB chunk cannot be the alignment): the chunk size is a
	 * multiple of the granularity, a power of two, so this is a multiple of it too, and
	 * every chunk's place is aligned as cuMemMap requires. */
	cr = cu->cuMemAddressReserve(&cc->base, pool_bytes, chunk_bytes & -chunk_bytes, 0, 0);
	pop(cc);
	if (cr != CUDA_SUCCESS) {
		cu->cuDevicePrimaryCtxRelease(cc->dev);
		free(cc);
		return cuda_dl_errno(cr);
	}
	*ret = cc;
	return 0;
}

struct client_cuda *client_cuda_free(struct client_cuda *cc, bool child) {
	if (!cc)
		return NULL;
	if (!child) {
		cc->cu->cuMemAddressFree(cc->base, cc->pool_bytes);
		cc->cu->cuDevicePrimaryCtxRelease(cc->dev);
	}
	free(cc);
	return NULL;
}

int client_cuda_map(struct client_cuda *cc, uint32_t id, int fd, uint64_t bytes, void **ret_addr) {
	CUmemGenericAllocationHandle h;
	CUdeviceptr va;
	CUresult cr;
	int r;

	if (bytes != cc->chunk_bytes || id >= cc->pool_bytes / cc->chunk_bytes)
		return -EPROTO;
	va = cc->base + (CUdeviceptr)id * cc->chunk_bytes;
	r = push(cc);
	if (r < 0)
		return r;
	/* The POSIX fd goes by value, cast to a pointer (cuda.h). */
	cr = cc->cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
	                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (cr != CUDA_SUCCESS)
		goto out;
	cr = cc->cu->cuMemMap(va, bytes, 0, h, 0);
	/* The mapping holds the allocation from here: dropping the handle now means
	 * cuMemUnmap alone gives the chunk back. */
	(void)cc->cu->cuMemRelease(h);
	if (cr != CUDA_SUCCESS)
		goto out;
	cr = cc->cu->cuMemSetAccess(va, bytes, &cc->access, 1);
	if (cr != CUDA_SUCCESS) {
		(void)cc->cu->cuMemUnmap(va, bytes);
		goto out;
	}
	*ret_addr = (void *)(uintptr_t)va;
out:
	pop(cc);
	return cr == CUDA_SUCCESS ? 0 : cuda_dl_errno(cr);
}

void client_cuda_unmap(struct client_cuda *cc, void *addr, uint64_t bytes) {
	if (push(cc) < 0)
		return;
	/* Work the engine queued on this memory must be done by now: the daemon asks for
	 * chunks whose blocks the engine released. */
	(void)cc->cu->cuMemUnmap((CUdeviceptr)(uintptr_t)addr, bytes);
	pop(cc);
}

int client_cuda_current_uuid(uint8_t *uuid, size_t uuid_len) {
	const struct cuda_dl *cu;
	CUresult (*get_current)(CUcontext *);
	CUcontext ctx = NULL;
	bool current;
	CUdevice dev;
	CUuuid u;
	void *h;

	/* Only a process that uses CUDA already has a current device: libkvd neither loads
	 * nor initialises the driver to find out. A driver loaded but not initialised
	 * answers CUDA_ERROR_NOT_INITIALIZED: no device either. */
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
	if (!h)
		return -ENODEV;
	get_current = (CUresult(*)(CUcontext *))dlsym(h, "cuCtxGetCurrent");
	current = get_current && get_current(&ctx) == CUDA_SUCCESS && ctx;
	dlclose(h);
	if (!current || uuid_len != sizeof(u.bytes) || cuda_dl_load(&cu, NULL) < 0 ||
	    cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS || cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
		return -ENODEV;
	memcpy(uuid, u.bytes, sizeof(u.bytes));
	return 0;
}

int client_cuda_device_uuid(int ordinal, uint8_t *uuid, size_t uuid_len) {
	const struct cuda_dl *cu;
	CUdevice dev;
	CUuuid u;
	int r;

	if (uuid_len != sizeof(u.bytes))
		return -EINVAL;
	r = cuda_dl_load(&cu, NULL);
	if (r < 0)
		return r;
	if (ordinal < 0 || ordinal >= cu->device_count || cu->cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS ||
	    cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
		return -ENODEV;
	memcpy(uuid, u.bytes, sizeof(u.bytes));
	return 0;
}

int client_cuda_event_handle(void *event, uint8_t *handle, size_t len) {
	const struct cuda_dl *cu;
	CUipcEventHandle h;
	CUresult cr;
	int r;

	if (len != sizeof(h.reserved))
		return -EINVAL;
	r = cuda_dl_load(&cu, NULL);
	if (r < 0)
		return r;
	/* The engine's context, as when it records the event: the event is its. */
	cr = cu->cuIpcGetEventHandle(&h, (CUevent)event);
	if (cr != CUDA_SUCCESS)
		return cuda_dl_errno(cr);
	memcpy(handle, h.reserved, sizeof(h.reserved));
	return 0;
}

int client_cuda_event_sync(void *event) {
	const struct cuda_dl *cu;
	CUresult cr;
	int r = cuda_dl_load(&cu, NULL);

	if (r < 0)
		return r;
	cr = cu->cuEventSynchronize((CUevent)event);
	return cr == CUDA_SUCCESS ? 0 : cuda_dl_errno(cr);
}

int client_cuda_device(const struct client_cuda *cc) {
	return cc->ordinal;
}

char *client_cuda_base(const struct client_cuda *cc) {
	return (char *)(uintptr_t)cc->base;
}
