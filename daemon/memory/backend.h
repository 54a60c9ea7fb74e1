/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * Memory backends behind one ops table. A backend makes chunks: fixed-size pieces of pool
 * memory, each exported as one file descriptor that clients map (a sealed memfd on the
 * host backend, a cuMem allocation exported as a POSIX fd on the CUDA backend) and mapped
 * by the daemon itself so that it can read and move K/V.
 */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The most devices one daemon pools (--devices). */
#define BACKEND_DEVICES_MAX 16

struct backend_chunk {
	int fd;        /* the exportable handle; -EBADF when not created */
	void *addr;    /* the daemon's own mapping (a device address on cuda) */
	uint64_t bytes;
	uint64_t handle; /* cuda: the CUmemGenericAllocationHandle; 0 on host */
	uint32_t device; /* which of the backend's devices holds it (backend_device()); 0 on host */
};

/* What clients are told a chunk's memory is (kvd.proto MemoryKind: same values). */
enum backend_memory {
	BACKEND_MEMORY_HOST = 1,
	BACKEND_MEMORY_CUDA = 2,
};

struct backend_ops {
	const char *name;
	enum backend_memory memory;
	/* Whether the CPU can dereference backend_chunk.addr. Where it cannot, the CPU paths
	 * that read or move K/V (scoring, compaction, compensation, digests) go through read,
	 * write and copy below, one driver copy per call. */
	bool host_access;
	/* Granularity chunk sizes must be a multiple of. */
	uint64_t (*granularity)(void);
	/* Creates chunk `id` of `bytes` bytes on device (below backend_n_devices()),
	 * zero-filled. */
	int (*chunk_create)(uint32_t id, uint32_t device, uint64_t bytes, struct backend_chunk *ret);
	/*
	 * Takes over chunk `id` of device that an earlier life of the daemon made, from fd,
	 * what its chunk_create exported (the fd store kept it; keep.h): maps it as
	 * chunk_create would, contents untouched. The fd stays the caller's (ret->fd is
	 * -EBADF). Returns 0, -EINVAL (fd is not such a chunk of bytes), or -errno.
	 */
	int (*chunk_adopt)(uint32_t id, uint32_t device, int fd, uint64_t bytes,
	                   struct backend_chunk *ret);
	/* Zeroes the chunk before it can change owner; returns 0 or -errno. */
	int (*chunk_scrub)(struct backend_chunk *c);
	/*
	 * Copies between the daemon's mapping of chunks of device (addresses inside [addr,
	 * addr + bytes) of its chunks, device addresses on cuda) and host memory: read (pool
	 * to host), write (host to pool), copy (pool to pool, within the device; the ranges
	 * must not overlap). memcpy on the host backend, synchronous driver copies in the
	 * device's context on cuda. Safe from any thread (round workers read K/V this way).
	 * Return 0 or -errno.
	 */
	int (*read)(uint32_t device, const void *src, void *dst, uint64_t bytes);
	/* read of `rows` rows of `width` bytes, row i at src + i * src_pitch, to dst packed
	 * (row i at dst + i * width): one driver call for what would be rows reads, for the
	 * same rows of consecutive blocks. */
	int (*read_rows)(uint32_t device, const void *src, uint64_t src_pitch, void *dst,
	                 uint64_t width, uint64_t rows);
	int (*write)(uint32_t device, void *dst, const void *src, uint64_t bytes);
	int (*copy)(uint32_t device, void *dst, const void *src, uint64_t bytes);
	/* copy of `rows` rows of `width` bytes, row i from src + i * pitch to dst + i * pitch
	 * (rows that do not overlap): the same rows of every head of a block in one call. */
	int (*copy_rows)(uint32_t device, void *dst, const void *src, uint64_t pitch,
	                 uint64_t width, uint64_t rows);
	void (*chunk_destroy)(struct backend_chunk *c);
	/*
	 * Host memory the backend copies to and from often (the host tier), made quicker to
	 * reach: on cuda pinned for every device (cuMemHostRegister, portable), so that read
	 * and write are DMA without the driver's staging; NULL on host. Returns 0 or -errno;
	 * host_unregister undoes it before the memory goes.
	 */
	int (*host_register)(void *addr, uint64_t bytes);
	void (*host_unregister)(void *addr);
	/*
	 * An engine's interprocess event (cuda; NULL on host): event_open opens it on device
	 * from its IPC handle (len bytes, BACKEND_EVENT_HANDLE_BYTES) into *ret (-EINVAL: not
	 * an event handle; -EOPNOTSUPP: the device has no interprocess events); event_query says, without blocking, whether the work recorded
	 * before it completed (0) or not yet (-EAGAIN); event_close closes it. Otherwise
	 * -errno.
	 */
	int (*event_open)(uint32_t device, const void *handle, size_t len, void **ret);
	int (*event_query)(uint32_t device, void *event);
	void (*event_close)(uint32_t device, void *event);
};

/* Bytes of an interprocess event handle (CUipcEventHandle). */
#define BACKEND_EVENT_HANDLE_BYTES 64u

/* The GPU a device backend opened. */
struct backend_device {
	int index;                    /* among the GPUs this daemon sees, in PCI bus order: what
	                               * --devices, logs, status and metrics number it by */
	int ordinal;                  /* the driver's (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER
	                               * apply); for driver calls only */
	uint8_t uuid[16];             /* what clients match their own devices against */
	char pci_bus_id[16];          /* "0000:41:00.0" */
	char name[96];
	uint64_t free_bytes, total_bytes; /* when it was opened */
	uint64_t granularity;         /* of its allocations (the minimum) */
	bool rdma;                    /* chunks are GPUDirect RDMA capable (NICs may register them) */
	int persistence;              /* persistence mode when opened (nvml.h): 1 on, 0 off, -1
	                               * unknown */
	bool ipc_events;              /* engines' interprocess events can be opened here */
	/* 0, or the sticky error (cuda_dl_sticky) that lost the daemon's context on it: no
	 * round reads or scores K/V there any more (backend_cuda_failed). */
	int failed;
};

/* "GPU-" and the UUID's 16 bytes in hex, dashed 8-4-4-4-12, as nvidia-smi prints it. */
#define BACKEND_UUID_STRLEN 41
void backend_uuid_format(const uint8_t uuid[16], char buf[BACKEND_UUID_STRLEN]);

/* One GPU of a --devices list: by its index in PCI bus order, or by UUID (index -1). */
struct backend_device_ref {
	int index;
	uint8_t uuid[16];
};

/* Parses the next GPU of a --devices list (not "all") at *p, moving *p past it: returns 1
 * with it in *ret, 0 at the end of the list, or -EINVAL (neither a number of 0 to 255 nor a
 * UUID). */
int backend_devices_next(const char **p, struct backend_device_ref *ret);

extern const struct backend_ops backend_host_ops;
#ifdef KVD_HAVE_CUDA
extern const struct backend_ops backend_cuda_ops;
#endif

/*
 * Looks a backend up by name, for the settings checks: "host", "cuda" (NULL when built
 * without it) or "auto" (host: what auto becomes is only known once the driver is asked).
 * The cuda backend's granularity is the page size until it is opened.
 */
const struct backend_ops *backend_find(const char *name);

/*
 * Opens the backend the settings name: "host" always works (one device); "cuda" loads the
 * driver and takes every usable device of `devices` ("all", or GPUs separated by spaces or
 * commas, each its index in PCI bus order or its UUID; at most BACKEND_DEVICES_MAX), or
 * fails when none is; "auto" tries cuda and falls back to host. Returns 0 with the backend in *ret and, in why, a sentence saying
 * what was chosen and why (for auto's fallback, what made the GPU unusable); or -ENODEV
 * (cuda asked for but not usable, why says why).
 */
int backend_open(const char *name, const char *devices, const struct backend_ops **ret,
                 char *why, size_t why_n);

/*
 * Whether this machine has the NVIDIA kernel driver loaded (/proc/driver/nvidia/version
 * exists): where it has, an auto backend that fell back to host is a GPU node whose daemon
 * cannot reach its GPUs (blocked devices, a missing nvidia-uvm, a broken driver), not a
 * machine without GPUs. Test builds read the path from $KVD_TEST_NVIDIA_DRIVER if set.
 */
bool backend_nvidia_driver_loaded(void);

/* How many devices the open backend pools: 1 on host. */
uint32_t backend_n_devices(void);
/* Device i of the open backend (0 to backend_n_devices() - 1), or NULL (host). */
const struct backend_device *backend_device(uint32_t i);

/* The driver's name for backend_device.failed's error ("CUDA_ERROR_ILLEGAL_ADDRESS"). */
const char *backend_error_name(int failed);

/* The open backend's devices for status, one line each (kvd.proto StatusReply.devices),
 * into buf (truncated to n); "" on host. */
void backend_devices_text(char *buf, size_t n);

/* Releases what backend_open took (the CUDA context and stream); after every chunk is
 * destroyed. */
void backend_close(void);

/* Whether a --devices value is "all" or a list of GPUs (backend_devices_next); for
 * settings checks. */
int backend_devices_check(const char *value, const char **ret_why);
