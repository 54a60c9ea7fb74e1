/* SPDX-License-Identifier: MIT */
/*
 * The cuda backend: chunks are cuMemCreate allocations on the GPUs of --devices (each GPU
 * its own share of the pool: pool.h), exported as POSIX fds (docs/architecture.md §6). UNVERIFIED ON HARDWARE: written against CUDA 13's cuda.h and
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
#include "basic/macro.h"
#include "basic/cuda-dl.h"
#include "log.h"
#include "nvml.h"

/* The most GPUs a machine shows that kvd looks at (--devices numbers them up to 255). */
#define DEVICE_VISIBLE_MAX 256

/* One pooled GPU. */
struct cuda_dev {
	CUdevice dev;
	CUcontext ctx;                /* the device's primary context, retained */
	CUstream stream;              /* the daemon's own: scrubs */
	CUmemAllocationProp prop;
	CUmemAccessDesc access;
	struct backend_device info;
};

static struct {
	const struct cuda_dl *cu;
	struct cuda_dev d[BACKEND_DEVICES_MAX];
	uint32_t n;                   /* devices opened */
	uint64_t granularity;         /* the largest device's: chunks fit every device */
} cuda;

/* Logs a failed driver call at debug level (the caller logs the errno once, where it
 * handles it) and returns it as -errno. */
/* The device whose context use() last made current on this thread: a failure's device. */
static __thread int used_device = -1;

void backend_cuda_failed(uint32_t i, CUresult cr, const char *call) {
	int none = 0;

	if (i >= cuda.n || !cuda_dl_sticky(cr) ||
	    !__atomic_compare_exchange_n(&cuda.d[i].info.failed, &none, (int)cr, false,
	                                 __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		return;
	log_error("GPU %d: %s failed with %s, an error that loses the daemon's context there for "
	          "good: rounds no longer read or score K/V on it, and its memory stays pooled "
	          "and counted; restart kvd (and the engines on that GPU, whose contexts may be "
	          "lost too) to use it again (docs/gpu.md, Sticky errors)",
	          cuda.d[i].info.index, call, cuda_dl_strerror(cr));
}

static int cu_fail(CUresult cr, const char *call) {
	log_debug("cuda: %s failed: %s", call, cuda_dl_strerror(cr));
	if (used_device >= 0)
		backend_cuda_failed((uint32_t)used_device, cr, call);
	return cuda_dl_errno(cr);
}

/* Whether device `ordinal` (index `index` in PCI bus order) can hold a pool; why says what
 * it lacks. */
static bool device_usable(const struct cuda_dl *cu, int ordinal, int index, CUdevice *ret_dev,
                          char *why, size_t why_n) {
	int vmm = 0, posix_fd = 0;
	CUdevice dev;
	CUresult cr;

	cr = cu->cuDeviceGet(&dev, ordinal);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: %s", index, cuda_dl_strerror(cr));
		return false;
	}
	if (cu->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
	                             dev) != CUDA_SUCCESS || !vmm) {
		snprintf(why, why_n, "device %d: no virtual memory management (cuMemCreate)", index);
		return false;
	}
	if (cu->cuDeviceGetAttribute(&posix_fd,
	                             CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
	                             dev) != CUDA_SUCCESS || !posix_fd) {
		snprintf(why, why_n, "device %d: cannot export memory as file descriptors", index);
		return false;
	}
	*ret_dev = dev;
	return true;
}

/* A GPU the driver shows: where it sits on the PCI bus, what it is called across
 * processes. */
struct visible {
	int ordinal;
	uint32_t pci;                 /* domain << 16 | bus << 8 | device: the sort key */
	uint8_t uuid[16];
};

/* The driver's devices (at most n) in PCI bus order, as nvidia-smi numbers them, into v:
 * the driver's own order is CUDA_DEVICE_ORDER's, by default fastest first, which is
 * neither stable across driver versions nor what operators see. Returns how many. */
static int visible_devices(const struct cuda_dl *cu, struct visible *v, int n) {
	int count = MIN(cu->device_count, n);

	for (int i = 0; i < count; i++) {
		int domain = 0, bus = 0, slot = 0, j;
		struct visible d = { .ordinal = i };
		CUuuid uuid;
		CUdevice dev;

		if (cu->cuDeviceGet(&dev, i) == CUDA_SUCCESS) {
			(void)cu->cuDeviceGetAttribute(&domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev);
			(void)cu->cuDeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev);
			(void)cu->cuDeviceGetAttribute(&slot, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev);
			if (cu->cuDeviceGetUuid(&uuid, dev) == CUDA_SUCCESS)
				memcpy(d.uuid, uuid.bytes, sizeof(d.uuid));
		}
		d.pci = (uint32_t)(domain & 0xffff) << 16 | (uint32_t)(bus & 0xff) << 8 | (uint32_t)(slot & 0xff);
		for (j = i; j > 0 && v[j - 1].pci > d.pci; j--)
			v[j] = v[j - 1];
		v[j] = d;
	}
	return count;
}

/* Opens usable device v, index `index` in PCI bus order, as d: context, stream,
 * allocation properties, memory. Returns 0, or -ENODEV with why saying what failed (d is
 * then closed). */
static int device_open(struct cuda_dev *d, int index, const struct visible *v, CUdevice dev,
                       char *why, size_t why_n) {
	const struct cuda_dl *cu = cuda.cu;
	size_t free_b = 0, total_b = 0, gran = 0;
	char text[BACKEND_UUID_STRLEN];
	int rdma = 0, ipc_events = 0;
	CUresult cr;

	*d = (struct cuda_dev){ .dev = dev };
	cr = cu->cuDevicePrimaryCtxRetain(&d->ctx, dev);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: no context: %s", index, cuda_dl_strerror(cr));
		d->ctx = NULL;
		return -ENODEV;
	}
	cr = cu->cuCtxSetCurrent(d->ctx);
	if (cr == CUDA_SUCCESS)
		/* Non-blocking: the daemon's own legacy-stream copies order themselves (they
		 * wait until they landed: legacy_landed()), so its scrubs need not wait for
		 * every one of them. Engines' streams are in their own processes' contexts and
		 * never wait on the daemon's, whatever the flag. */
		cr = cu->cuStreamCreate(&d->stream, CU_STREAM_NON_BLOCKING);
	if (cr != CUDA_SUCCESS) {
		snprintf(why, why_n, "device %d: no stream: %s", index, cuda_dl_strerror(cr));
		return -ENODEV;
	}
	d->prop = (CUmemAllocationProp){
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev },
	};
	/* Engines that register KV with a NIC (NIXL, UCX, NCCL) need RDMA-capable memory; the
	 * driver refuses the flag where the device cannot have it. */
	if (cu->cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
	                             dev) == CUDA_SUCCESS && rdma) {
		d->prop.allocFlags.gpuDirectRDMACapable = 1;
		d->info.rdma = true;
	}
	/* Engines' events (kvd_seq_unpin_after) need it; libkvd waits for them itself where
	 * the daemon cannot take them. */
	d->info.ipc_events = cu->cuDeviceGetAttribute(&ipc_events, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED,
	                                              dev) == CUDA_SUCCESS && ipc_events;
	d->access = (CUmemAccessDesc){
		.location = d->prop.location,
		.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
	};
	/* The minimum, not the recommended granularity: chunk-size is the operator's choice,
	 * and the minimum is what cuMemCreate and cuMemMap require. */
	cr = cu->cuMemGetAllocationGranularity(&gran, &d->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (cr == CUDA_SUCCESS)
		cr = cu->cuMemGetInfo(&free_b, &total_b);
	if (cr != CUDA_SUCCESS || gran == 0) {
		snprintf(why, why_n, "device %d: cannot query memory: %s", index, cuda_dl_strerror(cr));
		return -ENODEV;
	}
	d->info.index = index;
	d->info.ordinal = v->ordinal;
	d->info.granularity = gran;
	memcpy(d->info.uuid, v->uuid, sizeof(d->info.uuid));
	backend_uuid_format(d->info.uuid, text);
	d->info.persistence = nvml_persistence_mode(text);
	if (d->info.persistence < 0)
		d->info.persistence = -1;
	snprintf(d->info.pci_bus_id, sizeof(d->info.pci_bus_id), "%04x:%02x:%02x.0", v->pci >> 16,
	         v->pci >> 8 & 0xff, v->pci & 0xff);
	if (cu->cuDeviceGetName(d->info.name, sizeof(d->info.name), dev) != CUDA_SUCCESS)
		snprintf(d->info.name, sizeof(d->info.name), "?");
	d->info.free_bytes = free_b;
	d->info.total_bytes = total_b;
	return 0;
}

static void device_close(struct cuda_dev *d) {
	if (d->stream)
		cuda.cu->cuStreamDestroy(d->stream);
	d->stream = NULL;
	if (d->ctx)
		cuda.cu->cuDevicePrimaryCtxRelease(d->dev);
	d->ctx = NULL;
}

/* Which of the n visible devices ref names: its index in v, or -1 (why says why). */
static int resolve(const struct backend_device_ref *ref, const struct visible *v, int n,
                   char *why, size_t why_n) {
	char text[BACKEND_UUID_STRLEN];

	if (ref->index >= 0) {
		if (ref->index < n)
			return ref->index;
		snprintf(why, why_n, "device %d: no such device (%d found)", ref->index, n);
		return -1;
	}
	for (int i = 0; i < n; i++)
		if (memcmp(v[i].uuid, ref->uuid, sizeof(ref->uuid)) == 0)
			return i;
	backend_uuid_format(ref->uuid, text);
	snprintf(why, why_n, "device %s: no such device here (nvidia-smi -L lists them)", text);
	return -1;
}

int backend_cuda_open(const char *devices, char *why, size_t why_n) {
	struct visible v[DEVICE_VISIBLE_MAX];
	struct backend_device_ref ref;
	const char *dl_why, *p = devices;
	bool all = !devices || strcmp(devices, "all") == 0;
	char skip[160] = "", *w = why;
	int n_visible, r;

	r = cuda_dl_load(&cuda.cu, &dl_why);
	if (r < 0) {
		snprintf(why, why_n, "%s", dl_why);
		return -ENODEV;
	}
	n_visible = visible_devices(cuda.cu, v, DEVICE_VISIBLE_MAX);
	for (int i = 0; all ? i < n_visible : backend_devices_next(&p, &ref) > 0; i++) {
		int want = all ? i : resolve(&ref, v, n_visible, skip, sizeof(skip));
		bool listed = false;
		CUdevice dev;

		if (want < 0) {
			log_warning("cuda: %s", skip);
			continue;
		}
		for (uint32_t k = 0; k < cuda.n; k++)
			listed |= cuda.d[k].info.index == want;
		if (listed)
			continue;
		if (cuda.n == BACKEND_DEVICES_MAX) {
			log_warning("cuda: device %d left alone: at most %u GPUs are pooled", want,
			            BACKEND_DEVICES_MAX);
			continue;
		}
		if (!device_usable(cuda.cu, v[want].ordinal, want, &dev, skip, sizeof(skip)) ||
		    device_open(&cuda.d[cuda.n], want, &v[want], dev, skip, sizeof(skip)) < 0) {
			device_close(&cuda.d[cuda.n]);
			log_warning("cuda: %s", skip);
			continue;
		}
		cuda.granularity = MAX(cuda.granularity, cuda.d[cuda.n].info.granularity);
		cuda.n++;
	}
	if (cuda.n == 0) {
		snprintf(why, why_n, "%s", skip[0] ? skip : "no device listed");
		return -ENODEV;
	}
	/* The context of the first device stays current on the loop's thread. */
	(void)cuda.cu->cuCtxSetCurrent(cuda.d[0].ctx);
	w += snprintf(w, why_n, "cuda on %u GPU%s:", cuda.n, cuda.n == 1 ? "" : "s");
	for (uint32_t k = 0; k < cuda.n && (size_t)(w - why) < why_n; k++) {
		const struct backend_device *info = &cuda.d[k].info;
		char uuid[BACKEND_UUID_STRLEN];

		backend_uuid_format(info->uuid, uuid);
		w += snprintf(w, why_n - (size_t)(w - why), " GPU %d (%s, %llu of %llu MiB free, "
		              "granularity %llu KiB, %s at %s)%s", info->index, info->name,
		              (unsigned long long)(info->free_bytes >> 20),
		              (unsigned long long)(info->total_bytes >> 20),
		              (unsigned long long)(info->granularity >> 10), uuid, info->pci_bus_id,
		              k + 1 < cuda.n ? ";" : "");
	}
	if ((size_t)(w - why) < why_n)
		snprintf(w, why_n - (size_t)(w - why), "; %s", dl_why);
	return 0;
}

uint32_t backend_cuda_n_devices(void) {
	return cuda.n;
}

const struct backend_device *backend_cuda_device(uint32_t i) {
	return i < cuda.n ? &cuda.d[i].info : NULL;
}

CUcontext backend_cuda_context(uint32_t i) {
	return i < cuda.n ? cuda.d[i].ctx : NULL;
}

void backend_cuda_close(void) {
	if (!cuda.cu)
		return;
	for (uint32_t k = 0; k < cuda.n; k++)
		device_close(&cuda.d[k]);
	cuda.n = 0;
}

static uint64_t cuda_granularity(void) {
	/* Before the driver is asked, the settings checks can only hold chunks to pages;
	 * pool_new checks the devices' granularity at start. */
	return cuda.n > 0 ? cuda.granularity : (uint64_t)sysconf(_SC_PAGESIZE);
}

/* Makes device's context current on this thread (a round worker has none until its
 * first call; the loop's may hold another device's). */
static int use(uint32_t device) {
	CUresult cr;

	if (device >= cuda.n)
		return -EINVAL;
	used_device = (int)device;
	cr = cuda.cu->cuCtxSetCurrent(cuda.d[device].ctx);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuCtxSetCurrent");
}

/* Zeroes [addr, addr + bytes) of device on its daemon stream and waits: a chunk leaves here
 * only once no byte of its last owner can be read. The device's context is current. */
static int cuda_zero(uint32_t device, CUdeviceptr addr, uint64_t bytes) {
	CUresult cr;

	cr = cuda.cu->cuMemsetD8Async(addr, 0, bytes, cuda.d[device].stream);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuMemsetD8Async");
	cr = cuda.cu->cuStreamSynchronize(cuda.d[device].stream);
	if (cr != CUDA_SUCCESS)
		return cu_fail(cr, "cuStreamSynchronize");
	return 0;
}

static void cuda_chunk_destroy(struct backend_chunk *c) {
	CUdeviceptr va = (CUdeviceptr)(uintptr_t)c->addr;

	(void)use(c->device);
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

static int cuda_chunk_create(uint32_t id, uint32_t device, uint64_t bytes,
                             struct backend_chunk *ret) {
	struct backend_chunk c = { .fd = -EBADF, .bytes = bytes, .device = device };
	CUmemGenericAllocationHandle h;
	CUdeviceptr va = 0;
	int fd = -1, r;
	CUresult cr;

	r = use(device);
	if (r < 0)
		return r;
	cr = cuda.cu->cuMemCreate(&h, bytes, &cuda.d[device].prop, 0);
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
	cr = cuda.cu->cuMemAddressReserve(&va, bytes, cuda.d[device].info.granularity, 0, 0);
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
	cr = cuda.cu->cuMemSetAccess(va, bytes, &cuda.d[device].access, 1);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemSetAccess");
		goto fail;
	}
	/* cuMemCreate makes no promise about the contents: the chunk's first owner reads
	 * zeros like every later one. */
	r = cuda_zero(device, va, bytes);
	if (r < 0)
		goto fail;
	log_debug("cuda: chunk %u: %llu bytes on GPU %d at device address 0x%llx", id,
	          (unsigned long long)bytes, cuda.d[device].info.index, (unsigned long long)va);
	*ret = c;
	return 0;
fail:
	cuda_chunk_destroy(&c);
	return r;
}

static int cuda_chunk_adopt(uint32_t id, uint32_t device, int fd, uint64_t bytes,
                            struct backend_chunk *ret) {
	struct backend_chunk c = { .fd = -EBADF, .bytes = bytes, .device = device };
	CUmemGenericAllocationHandle h;
	CUdeviceptr va = 0;
	CUresult cr;
	int r;

	r = use(device);
	if (r < 0)
		return r;
	/* The allocation outlived the daemon that made it: the fd store's fd, and the
	 * engines' mappings, hold it. The POSIX fd goes by value, cast to a pointer. */
	cr = cuda.cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
	                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (cr != CUDA_SUCCESS)
		return cr == CUDA_ERROR_INVALID_VALUE ? -EINVAL : cu_fail(cr, "cuMemImportFromShareableHandle");
	c.handle = (uint64_t)h;
	cr = cuda.cu->cuMemAddressReserve(&va, bytes, cuda.d[device].info.granularity, 0, 0);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemAddressReserve");
		goto fail;
	}
	/* cuMemMap refuses a size larger than the allocation, but maps a prefix of a larger
	 * one: that the allocation is one chunk comes from the journal, whose chunk size
	 * keep.c checked against this pool's before any chunk is adopted. */
	cr = cuda.cu->cuMemMap(va, bytes, 0, h, 0);
	if (cr != CUDA_SUCCESS) {
		cuda.cu->cuMemAddressFree(va, bytes);
		r = cr == CUDA_ERROR_INVALID_VALUE ? -EINVAL : cu_fail(cr, "cuMemMap");
		goto fail;
	}
	c.addr = (void *)(uintptr_t)va;
	cr = cuda.cu->cuMemSetAccess(va, bytes, &cuda.d[device].access, 1);
	if (cr != CUDA_SUCCESS) {
		r = cu_fail(cr, "cuMemSetAccess");
		goto fail;
	}
	log_debug("cuda: chunk %u adopted on GPU %d at device address 0x%llx", id,
	          cuda.d[device].info.index, (unsigned long long)va);
	*ret = c;
	return 0;
fail:
	cuda_chunk_destroy(&c);
	return r;
}

static int cuda_chunk_scrub(struct backend_chunk *c) {
	int r = use(c->device);

	return r < 0 ? r : cuda_zero(c->device, (CUdeviceptr)(uintptr_t)c->addr, c->bytes);
}

/*
 * The CPU paths' copies (backend.h): synchronous, on the device context's legacy stream,
 * from whichever thread asks. Ordering with the engines needs nothing more: the daemon only
 * reads or moves a sequence's K/V while it is not pinned, and an engine unpins after its
 * writes have completed.
 *
 * A device-to-device copy on the legacy stream returns before it lands (the driver does no
 * host-side synchronisation for those), and the daemon's streams do not wait for the
 * legacy one: so each waits until it landed, for what follows to see it done on any
 * stream and thread: a scrub of the chunk it emptied, a kernel reading what it staged, the
 * engine told of the compaction it was part of.
 */
static int legacy_landed(void) {
	CUresult cr = cuda.cu->cuStreamSynchronize(CU_STREAM_LEGACY);

	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuStreamSynchronize");
}

static int cuda_read(uint32_t device, const void *src, void *dst, uint64_t bytes) {
	int r = use(device);
	CUresult cr;

	if (r < 0)
		return r;
	cr = cuda.cu->cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemcpyDtoH");
}

int backend_cuda_copy_2d(const CUDA_MEMCPY2D *m, CUstream stream) {
	bool d2d = m->srcMemoryType == CU_MEMORYTYPE_DEVICE && m->dstMemoryType == CU_MEMORYTYPE_DEVICE;
	static bool said;
	CUresult cr;

	cr = stream ? cuda.cu->cuMemcpy2DAsync(m, stream) : cuda.cu->cuMemcpy2D(m);
	if (cr == CUDA_SUCCESS)
		return !stream && d2d ? legacy_landed() : 0;
	if (cr != CUDA_ERROR_INVALID_VALUE || !d2d)
		return cu_fail(cr, stream ? "cuMemcpy2DAsync" : "cuMemcpy2D");
	/* The driver may refuse intra-device pitches that cuMemAllocPitch did not make (ours
	 * are block strides); cuMemcpy2DUnaligned takes any, synchronously on the legacy
	 * stream, so the work queued on stream must be done before it overwrites what that
	 * work may still read. */
	if (!__atomic_exchange_n(&said, true, __ATOMIC_RELAXED))
		log_info("cuda: the driver refused a device-to-device 2D copy's pitches (%llu, %llu): "
		         "such copies go through cuMemcpy2DUnaligned, synchronously",
		         (unsigned long long)m->srcPitch, (unsigned long long)m->dstPitch);
	if (stream) {
		cr = cuda.cu->cuStreamSynchronize(stream);
		if (cr != CUDA_SUCCESS)
			return cu_fail(cr, "cuStreamSynchronize");
	}
	cr = cuda.cu->cuMemcpy2DUnaligned(m);
	/* Before the stream's next work reads what it wrote. */
	return cr == CUDA_SUCCESS ? legacy_landed() : cu_fail(cr, "cuMemcpy2DUnaligned");
}

/* The row forms: one synchronous 2D copy in device's context. */
static int memcpy_2d(uint32_t device, const CUDA_MEMCPY2D *m) {
	int r = use(device);

	return r < 0 ? r : backend_cuda_copy_2d(m, NULL);
}

static int cuda_read_rows(uint32_t device, const void *src, uint64_t src_pitch, void *dst,
                          uint64_t width, uint64_t rows) {
	return memcpy_2d(device, &(CUDA_MEMCPY2D){
		.srcMemoryType = CU_MEMORYTYPE_DEVICE,
		.srcDevice = (CUdeviceptr)(uintptr_t)src,
		.srcPitch = src_pitch,
		.dstMemoryType = CU_MEMORYTYPE_HOST,
		.dstHost = dst,
		.dstPitch = width,
		.WidthInBytes = width,
		.Height = rows,
	});
}

static int cuda_write(uint32_t device, void *dst, const void *src, uint64_t bytes) {
	int r = use(device);
	CUresult cr;

	if (r < 0)
		return r;
	cr = cuda.cu->cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemcpyHtoD");
}

static int cuda_copy(uint32_t device, void *dst, const void *src, uint64_t bytes) {
	int r = use(device);
	CUresult cr;

	if (r < 0)
		return r;
	cr = cuda.cu->cuMemcpyDtoD((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes);
	return cr == CUDA_SUCCESS ? legacy_landed() : cu_fail(cr, "cuMemcpyDtoD");
}

static int cuda_copy_rows(uint32_t device, void *dst, const void *src, uint64_t pitch,
                          uint64_t width, uint64_t rows) {
	return memcpy_2d(device, &(CUDA_MEMCPY2D){
		.srcMemoryType = CU_MEMORYTYPE_DEVICE,
		.srcDevice = (CUdeviceptr)(uintptr_t)src,
		.srcPitch = pitch,
		.dstMemoryType = CU_MEMORYTYPE_DEVICE,
		.dstDevice = (CUdeviceptr)(uintptr_t)dst,
		.dstPitch = pitch,
		.WidthInBytes = width,
		.Height = rows,
	});
}

_Static_assert(sizeof(CUipcEventHandle) == BACKEND_EVENT_HANDLE_BYTES, "backend.h's size");

static int cuda_event_open(uint32_t device, const void *handle, size_t len, void **ret) {
	CUipcEventHandle h;
	CUevent ev;
	CUresult cr;
	int r;

	if (len != sizeof(h.reserved))
		return -EINVAL;
	if (device >= cuda.n || !cuda.d[device].info.ipc_events)
		return -EOPNOTSUPP;
	r = use(device);
	if (r < 0)
		return r;
	memcpy(h.reserved, handle, sizeof(h.reserved));
	cr = cuda.cu->cuIpcOpenEventHandle(&ev, h);
	if (cr != CUDA_SUCCESS)
		return cr == CUDA_ERROR_INVALID_VALUE ? -EINVAL : cu_fail(cr, "cuIpcOpenEventHandle");
	*ret = ev;
	return 0;
}

static int cuda_event_query(uint32_t device, void *event) {
	int r = use(device);
	CUresult cr;

	if (r < 0)
		return r;
	cr = cuda.cu->cuEventQuery((CUevent)event);
	if (cr == CUDA_ERROR_NOT_READY)
		return -EAGAIN;
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuEventQuery");
}

static void cuda_event_close(uint32_t device, void *event) {
	if (use(device) >= 0)
		(void)cuda.cu->cuEventDestroy((CUevent)event);
}

static int cuda_host_register(void *addr, uint64_t bytes) {
	int r = use(0);
	CUresult cr;

	if (r < 0)
		return r;
	cr = cuda.cu->cuMemHostRegister(addr, bytes, CU_MEMHOSTREGISTER_PORTABLE);
	return cr == CUDA_SUCCESS ? 0 : cu_fail(cr, "cuMemHostRegister");
}

static void cuda_host_unregister(void *addr) {
	if (use(0) >= 0)
		(void)cuda.cu->cuMemHostUnregister(addr);
}

const struct backend_ops backend_cuda_ops = {
	.name = "cuda",
	.memory = BACKEND_MEMORY_CUDA,
	.host_access = false,
	.granularity = cuda_granularity,
	.chunk_create = cuda_chunk_create,
	.chunk_adopt = cuda_chunk_adopt,
	.event_open = cuda_event_open,
	.event_query = cuda_event_query,
	.event_close = cuda_event_close,
	.chunk_scrub = cuda_chunk_scrub,
	.read = cuda_read,
	.read_rows = cuda_read_rows,
	.write = cuda_write,
	.copy = cuda_copy,
	.copy_rows = cuda_copy_rows,
	.chunk_destroy = cuda_chunk_destroy,
	.host_register = cuda_host_register,
	.host_unregister = cuda_host_unregister,
};
