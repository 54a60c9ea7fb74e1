/* SPDX-License-Identifier: MIT */
/*
 * A fake CUDA driver: a libcuda.so.1 that basic/cuda-dl.c loads in place of NVIDIA's when
 * its directory comes first in LD_LIBRARY_PATH, so that the cuda backend's host-side paths
 * (the daemon's chunk export, scrubs and reads, libkvd's import and mapping, the contexts
 * both use) run in CI, where there is no GPU.
 *
 * "Device" memory is host memory: cuMemCreate makes a memfd, exported fds are dups of it,
 * and cuMemMap maps it MAP_SHARED into a reservation, so two processes that share a chunk
 * really share its bytes. Device pointers are host addresses; copies and memsets happen at
 * once, streams and events are bookkeeping. Kernels cannot run: cuModuleLoadData says
 * CUDA_ERROR_NO_BINARY_FOR_GPU.
 *
 * Where the real driver refuses something, the fake refuses it the same way, so that a
 * mistake kvd makes here fails here rather than only on a GPU: calls before cuInit, calls
 * that need a current context without one (per thread, as in the driver), unaligned or
 * mismatched VMM arguments, unknown handles, and a mapping used before cuMemSetAccess (it
 * stays PROT_NONE: a CPU touch faults, and a copy or memset through the driver returns
 * CUDA_ERROR_ILLEGAL_ADDRESS, as a GPU kernel's access would fault). Which calls need a
 * context follows the error lists of cuda.h: the VMM calls (cuMemCreate, cuMemMap, ...)
 * name no CUDA_ERROR_INVALID_CONTEXT and run without one; copies, memsets, cuMemGetInfo,
 * cuMemAlloc, streams, events and modules need one.
 *
 * Strict mode (KVD_FAKE_CUDA_STRICT=1, read at cuInit): as on a GPU, the CPU cannot
 * dereference device pointers at all. A mapping's device address stays PROT_NONE even
 * after cuMemSetAccess (which then only records the access, still checked by copies and
 * memsets), and the driver's copies and memsets go through a private MAP_SHARED view of
 * the memfd that cuMemMap makes and cuMemUnmap removes; so any CPU touch of device memory
 * by the daemon, libkvd or a test faults. tests/gpu/meson.build says which tests run so
 * (those whose test programs do not read device memory themselves). cuMemAlloc memory
 * stays host-readable in both modes (neither the daemon nor libkvd uses it).
 *
 * Environment: KVD_FAKE_CUDA_DEVICES (default 1, at most 8; 0: cuInit says
 * CUDA_ERROR_NO_DEVICE), KVD_FAKE_CUDA_MEMORY_MIB per device (default 1024),
 * KVD_FAKE_CUDA_GRANULARITY_KIB (default 2048, as on real GPUs), KVD_FAKE_CUDA_STRICT=1
 * (above), KVD_FAKE_CUDA_TRACE=1 to print every refused call to stderr,
 * KVD_FAKE_CUDA_COUNT=PATH (read at cuInit) to count the driver calls (below),
 * KVD_FAKE_CUDA_LEDGER=DIR (read at each use) for device memory shared by processes (below),
 * KVD_FAKE_CUDA_ALLOC_MAX_KIB (read at each cuMemAlloc: larger ones fail as out of memory),
 * KVD_FAKE_CUDA_STICKY_ON=CALL (the process's first call of that entry point fails with
 * CUDA_ERROR_ILLEGAL_ADDRESS, and so does every later call needing that context, as after
 * a kernel's illegal address on a GPU: a sticky error; other devices' contexts go on),
 * KVD_FAKE_CUDA_DRIVER_VERSION=12040 (cuDriverGetVersion's value, default the toolkit's; an
 * older one refuses the kernels' module as an older driver does),
 * KVD_FAKE_CUDA_PCI_BUS=41,1 (hex, one per ordinal; default ordinal + 1) the devices' PCI
 * buses (domain and device numbers are 0), KVD_FAKE_CUDA_PITCH_ALIGN (2D copies, below),
 * KVD_FAKE_CUDA_RDMA=0 for devices without GPUDirect RDMA on VMM memory (default 1; then
 * cuMemCreate refuses gpuDirectRDMACapable), KVD_FAKE_CUDA_IPC_EVENTS=0 and
 * KVD_FAKE_CUDA_IPC_EVENT_PENDING (interprocess events, below).
 *
 * Ledger: without it each process counts only the allocations it made (cuMemCreate) against
 * its devices' memory. With it, as on a GPU, an allocation counts for as long as any
 * process holds it through a handle or a mapping, made or imported: each process that holds
 * one has a file DIR/INODE.PID ("ORDINAL SIZE") while it does, and cuMemCreate and
 * cuMemGetInfo count every allocation (inode) that a live process holds. So a process that
 * imported a chunk and keeps it pins memory that the daemon released. (An exported fd kept
 * without an import does not count here; on a GPU it would.) cuMemAlloc stays per process.
 *
 * Call counts: every exported entry point counts its calls, and the bytes that the copies
 * and memsets were asked to move or set (a 2D copy: WidthInBytes * Height; other calls
 * move none), refused calls included. With KVD_FAKE_CUDA_COUNT=PATH, a process that
 * called cuInit writes its counts when it exits (exit() or a return from main, not _exit
 * or a fatal signal) to PATH.PID (its pid appended: a daemon and its clients share the
 * environment), one line "NAME CALLS BYTES" per entry point called, sorted by name. NAME
 * is the exported symbol, the versioned one where cuda.h maps the call to one
 * (cuMemcpyHtoD_v2 for cuMemcpyHtoD). A child forked after cuInit starts from zero.
 *
 * Late copies: device-to-device copies on the legacy default stream (cuMemcpyDtoD, and
 * cuMemcpy2D, cuMemcpy2DUnaligned, cuMemcpyDtoDAsync and cuMemcpy2DAsync between device
 * memory with that stream) return before they land, as the driver documents (no host-side
 * synchronisation for device-to-device transfers). They land, in order, when something
 * waits for the legacy stream: a copy with host memory on it, work on it or on a blocking
 * stream (made without CU_STREAM_NON_BLOCKING, or the per-thread one), cuStreamSynchronize
 * of either, cuCtxSynchronize, an event recorded on either; and before memory is unmapped
 * or freed. Work on a non-blocking stream does not wait for them, as on a GPU: a program
 * that copies on the legacy stream and then works on a non-blocking stream of its own
 * without synchronising reads or overwrites memory the copy has not finished with.
 *
 * Thread-safe: one mutex guards every table (the daemon calls from several threads); the
 * context stack is per thread, as in the driver. Not installed: a test double only.
 */
#include <cuda.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FAKE_DEVICES_MAX 8
#define CTX_STACK_MAX 32
#define MEMFD_PREFIX "kvd-fake-cuda-dev"

struct CUctx_st {
	int ordinal;
	unsigned refs;                /* primary context retains; 0: inactive */
};

struct CUstream_st {
	struct CUstream_st *next;
	unsigned flags;
};

struct CUevent_st {
	struct CUevent_st *next;
	unsigned flags;
	bool recorded;
	struct timespec at;
	uint64_t serial;              /* this process's count of events made: IPC handles */
	long pending;                 /* an opened IPC event: queries left that say not ready */
};

/* Physical memory, made by cuMemCreate or first imported here; one per memfd, however many
 * handles name it (an fd exported here and imported again is the same memory). */
struct alloc {
	struct alloc *next;
	int fd;                       /* the memfd */
	ino_t ino;
	size_t size;
	int ordinal;
	bool created;                 /* counts against this process's free memory */
	bool exportable;
	bool ledgered;                /* this process's file is in the ledger */
	unsigned refs;                /* handles and mappings that hold it */
};

struct handle {
	struct handle *next;
	CUmemGenericAllocationHandle id;
	struct alloc *alloc;
};

struct reservation {
	struct reservation *next;
	uintptr_t va;
	size_t size;
};

struct mapping {
	struct mapping *next;
	uintptr_t va;
	size_t size;
	struct alloc *alloc;
	int prot;                     /* PROT_NONE until cuMemSetAccess */
	void *host;                   /* where copies reach it: va, or (strict) a private view */
};

/* A device-to-device copy on the legacy stream that has not landed yet (copy2d): rows of
 * width bytes, height of them, each pitch apart. */
struct late_copy {
	struct late_copy *next;
	uintptr_t dst, src;
	size_t width, height, dpitch, spitch;
};

/* A cuMemAlloc allocation. */
struct devmem {
	struct devmem *next;
	void *p;
	size_t size;
	int ordinal;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
	bool initialized;             /* read with __atomic: checked before the lock */
	bool strict;                  /* KVD_FAKE_CUDA_STRICT: the CPU never gets access */
	int devices;
	size_t total;
	size_t granularity;
	size_t used[FAKE_DEVICES_MAX];
	CUmemGenericAllocationHandle next_handle;
	struct alloc *allocs;
	struct handle *handles;
	struct reservation *reservations;
	struct mapping *mappings;
	struct devmem *devmems;
	struct CUstream_st *streams;
	struct CUevent_st *events;
	uint64_t event_serial;
	struct late_copy *late, **late_tail; /* in queue order */
	bool sticky[FAKE_DEVICES_MAX];   /* the context had a sticky error (need_ctx) */
	bool sticky_fired;               /* KVD_FAKE_CUDA_STICKY_ON fires once a process */
} fk;
static struct CUctx_st primary[FAKE_DEVICES_MAX];

/* Late copies (above): landed where something waits for the legacy stream. */
static void land_late_locked(void);
static void land_late(void);

/* The driver's context stack is per thread: a thread starts with none current. */
static __thread CUcontext ctx_stack[CTX_STACK_MAX];
static __thread unsigned ctx_depth;

static CUresult error_name(CUresult error, const char **pStr);

/* Returns r, saying why on stderr when KVD_FAKE_CUDA_TRACE is set (the real driver says
 * nothing; this is for whoever debugs a test). */
__attribute__((format(printf, 3, 4)))
static CUresult fail(CUresult r, const char *call, const char *fmt, ...) {
	const char *trace = getenv("KVD_FAKE_CUDA_TRACE");
	const char *name = NULL;
	va_list ap;

	if (!trace || !*trace || strcmp(trace, "0") == 0)
		return r;
	error_name(r, &name);
	fprintf(stderr, "fake-cuda[%d]: %s: %s: ", (int)getpid(), call, name ? name : "?");
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return r;
}

static long env_long(const char *name, long def, long min, long max) {
	const char *s = getenv(name);
	char *end;
	long v;

	if (!s || !*s)
		return def;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end || v < min)
		return def;
	return v > max ? max : v;
}

/* One per exported entry point (COUNT), linked into counters on its first call. */
struct counter {
	const char *name;
	struct counter *next;
	unsigned long long calls, bytes;
	bool linked;
};
static struct counter *counters;
static char *count_path;              /* KVD_FAKE_CUDA_COUNT, set once by cuInit */

static void counter_add(struct counter *c, unsigned long long bytes) {
	__atomic_add_fetch(&c->calls, 1, __ATOMIC_RELAXED);
	__atomic_add_fetch(&c->bytes, bytes, __ATOMIC_RELAXED);
	if (__atomic_load_n(&c->linked, __ATOMIC_ACQUIRE) ||
	    __atomic_exchange_n(&c->linked, true, __ATOMIC_ACQ_REL))
		return;
	c->next = __atomic_load_n(&counters, __ATOMIC_RELAXED);
	while (!__atomic_compare_exchange_n(&counters, &c->next, c, true, __ATOMIC_RELEASE,
	                                    __ATOMIC_RELAXED))
		;
}

/* At the top of each exported function: counts the call and the bytes it moves. __func__
 * is the exported name (cuda.h's macros rename the definition, e.g. to cuMemcpyHtoD_v2). */
#define COUNT(bytes)                                                                          \
	do {                                                                                  \
		static struct counter counter_ = { .name = __func__ };                       \
		counter_add(&counter_, (bytes));                                              \
	} while (0)

/* A child of fork counts its own calls only: its PATH.PID must not repeat the parent's. */
static void counts_reset(void) {
	for (struct counter *c = __atomic_load_n(&counters, __ATOMIC_ACQUIRE); c; c = c->next) {
		__atomic_store_n(&c->calls, 0, __ATOMIC_RELAXED);
		__atomic_store_n(&c->bytes, 0, __ATOMIC_RELAXED);
	}
}

static int counter_cmp(const void *a, const void *b) {
	return strcmp((*(struct counter *const *)a)->name, (*(struct counter *const *)b)->name);
}

/* At exit, with KVD_FAKE_CUDA_COUNT: the counts to PATH.PID (see the top). */
__attribute__((destructor)) static void write_counts(void) {
	struct counter **v = NULL, *head = __atomic_load_n(&counters, __ATOMIC_ACQUIRE);
	char *path = __atomic_load_n(&count_path, __ATOMIC_ACQUIRE);
	size_t n = 0, i = 0;
	FILE *f = NULL;
	char *out = NULL;

	if (!path)
		return;
	for (struct counter *c = head; c; c = c->next)
		n++;
	v = calloc(n ? n : 1, sizeof(*v));
	if (v && asprintf(&out, "%s.%d", path, (int)getpid()) >= 0)
		f = fopen(out, "we");
	if (!f) {
		fprintf(stderr, "fake-cuda[%d]: cannot write the call counts to %s.%d: %s\n",
		        (int)getpid(), path, (int)getpid(), strerror(errno));
		goto out;
	}
	for (struct counter *c = head; c && i < n; c = c->next)
		v[i++] = c;
	qsort(v, n, sizeof(*v), counter_cmp);
	for (i = 0; i < n; i++) {
		unsigned long long calls = __atomic_load_n(&v[i]->calls, __ATOMIC_RELAXED);

		if (calls)
			fprintf(f, "%s %llu %llu\n", v[i]->name, calls,
			        __atomic_load_n(&v[i]->bytes, __ATOMIC_RELAXED));
	}
	if (fclose(f) != 0)
		fprintf(stderr, "fake-cuda[%d]: cannot write the call counts to %s: %s\n",
		        (int)getpid(), out, strerror(errno));
out:
	free(out);
	free(v);
}

static bool initialized(void) {
	return __atomic_load_n(&fk.initialized, __ATOMIC_ACQUIRE);
}

#define NEED_INIT(call)                                                                       \
	do {                                                                                  \
		if (!initialized())                                                           \
			return fail(CUDA_ERROR_NOT_INITIALIZED, call, "cuInit was not called"); \
	} while (0)

static bool is_device(CUdevice dev) {
	return dev >= 0 && dev < fk.devices;
}

static bool is_ctx(CUcontext ctx) {
	return ctx >= &primary[0] && ctx < &primary[fk.devices];
}

static CUcontext ctx_current(void) {
	return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}

/*
 * Whether the calling thread has a usable context: the driver answers
 * CUDA_ERROR_INVALID_CONTEXT to a thread without one (a thread of the daemon or of an
 * engine that forgot cuCtxSetCurrent), and to a primary context released to zero (it was
 * destroyed). Returns the device's ordinal in *ret_ordinal.
 */
static CUresult need_ctx(const char *call, int *ret_ordinal) {
	CUcontext ctx = ctx_current();
	unsigned refs;

	if (!initialized())
		return fail(CUDA_ERROR_NOT_INITIALIZED, call, "cuInit was not called");
	if (!ctx)
		return fail(CUDA_ERROR_INVALID_CONTEXT, call, "no current context on this thread");
	pthread_mutex_lock(&lock);
	refs = ctx->refs;
	pthread_mutex_unlock(&lock);
	if (refs == 0)
		return fail(CUDA_ERROR_INVALID_CONTEXT, call,
		            "the current context (device %d's primary) was released", ctx->ordinal);
	/* A sticky error: the context is lost for every later call, as after a kernel's
	 * illegal address on a GPU. */
	{
		const char *on = getenv("KVD_FAKE_CUDA_STICKY_ON");

		if (on && strcmp(on, call) == 0 &&
		    !__atomic_exchange_n(&fk.sticky_fired, true, __ATOMIC_RELAXED))
			__atomic_store_n(&fk.sticky[ctx->ordinal], true, __ATOMIC_RELAXED);
		if (__atomic_load_n(&fk.sticky[ctx->ordinal], __ATOMIC_RELAXED))
			return fail(CUDA_ERROR_ILLEGAL_ADDRESS, call, "device %d's context had a sticky "
			            "error (KVD_FAKE_CUDA_STICKY_ON)", ctx->ordinal);
	}
	if (ret_ordinal)
		*ret_ordinal = ctx->ordinal;
	return CUDA_SUCCESS;
}

/* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD are streams too; anything else must be one
 * cuStreamCreate made (the driver: CUDA_ERROR_INVALID_HANDLE). Called with the lock held. */
static bool is_stream(CUstream s) {
	if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD)
		return true;
	for (struct CUstream_st *p = fk.streams; p; p = p->next)
		if (p == s)
			return true;
	return false;
}

static bool is_event(CUevent e) {
	for (struct CUevent_st *p = fk.events; p; p = p->next)
		if (p == e)
			return true;
	return false;
}

static struct alloc *alloc_find(CUmemGenericAllocationHandle id) {
	for (struct handle *h = fk.handles; h; h = h->next)
		if (h->id == id)
			return h->alloc;
	return NULL;
}

/* ---- the ledger (KVD_FAKE_CUDA_LEDGER, above) ---- */

static const char *ledger_dir(void) {
	const char *d = getenv("KVD_FAKE_CUDA_LEDGER");

	return d && *d ? d : NULL;
}

/* This process holds a, or no longer does (a registered when it did). */
static void ledger_hold(struct alloc *a, bool hold) {
	const char *dir = ledger_dir();
	char path[PATH_MAX];
	FILE *f;

	if (!dir || (!hold && !a->ledgered))
		return;
	snprintf(path, sizeof(path), "%s/%llu.%d", dir, (unsigned long long)a->ino, (int)getpid());
	if (!hold) {
		unlink(path);
		return;
	}
	f = fopen(path, "we");
	if (!f)
		return;
	fprintf(f, "%d %zu\n", a->ordinal, a->size);
	a->ledgered = fclose(f) == 0;
}

/* Bytes of ordinal held by live processes (each allocation once); stale files go. Without
 * a ledger, this process's own. Lock held. */
static size_t device_used(int ordinal) {
	const char *dir = ledger_dir();
	unsigned long long seen[1024];
	unsigned n_seen = 0;
	size_t used = 0;
	struct dirent *e;
	DIR *d;

	if (!dir || !(d = opendir(dir)))
		return fk.used[ordinal];
	while ((e = readdir(d))) {
		char path[PATH_MAX];
		unsigned long long ino;
		bool dup = false;
		size_t size;
		int pid, ord;
		FILE *f;

		if (sscanf(e->d_name, "%llu.%d", &ino, &pid) != 2)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (kill(pid, 0) < 0 && errno == ESRCH) {
			unlink(path);
			continue;
		}
		f = fopen(path, "re");
		if (!f)
			continue;
		if (fscanf(f, "%d %zu", &ord, &size) == 2 && ord == ordinal) {
			for (unsigned i = 0; i < n_seen; i++)
				dup = dup || seen[i] == ino;
			if (!dup && n_seen < 1024) {
				seen[n_seen++] = ino;
				used += size;
			}
		}
		fclose(f);
	}
	closedir(d);
	return used;
}

/* A new handle for a (which it holds). Lock held. */
static int handle_new(struct alloc *a, CUmemGenericAllocationHandle *ret) {
	struct handle *h = calloc(1, sizeof(*h));

	if (!h)
		return -ENOMEM;
	h->id = fk.next_handle++;
	h->alloc = a;
	h->next = fk.handles;
	fk.handles = h;
	a->refs++;
	*ret = h->id;
	return 0;
}

/* Physical memory goes when neither a handle nor a mapping holds it (cuMemRelease: "the
 * memory is freed when all outstanding mappings are unmapped"); exported fds hold the memfd
 * on their own, as they hold the allocation on the real driver. Lock held. */
static void alloc_put(struct alloc *a) {
	if (--a->refs > 0)
		return;
	for (struct alloc **pp = &fk.allocs; *pp; pp = &(*pp)->next)
		if (*pp == a) {
			*pp = a->next;
			break;
		}
	if (a->created)
		fk.used[a->ordinal] -= a->size;
	ledger_hold(a, false);
	close(a->fd);
	free(a);
}

static struct reservation *reservation_of(uintptr_t va, size_t size) {
	for (struct reservation *r = fk.reservations; r; r = r->next)
		if (va >= r->va && size <= r->size && va - r->va <= r->size - size)
			return r;
	return NULL;
}

static struct mapping *mapping_at(uintptr_t va) {
	for (struct mapping *m = fk.mappings; m; m = m->next)
		if (va >= m->va && va - m->va < m->size)
			return m;
	return NULL;
}

/*
 * Whether [va, va + size) is made of whole mappings with no gap: cuMemUnmap and
 * cuMemSetAccess take "the entire contiguous address range that was mapped", never part of
 * a mapping. Lock held.
 */
static bool whole_mappings(uintptr_t va, size_t size) {
	uintptr_t end = va + size;

	if (size == 0 || end < va)
		return false;
	for (uintptr_t p = va; p < end;) {
		struct mapping *m = mapping_at(p);

		if (!m || m->va != p || m->size > end - p)
			return false;
		p += m->size;
	}
	return true;
}

/*
 * Checks that the device range [va, va + size) may be read (or written): every byte in an
 * accessible mapping or a cuMemAlloc allocation. A range inside a reservation but not
 * mapped, or mapped without access, is what a kernel would fault on (the driver then says
 * CUDA_ERROR_ILLEGAL_ADDRESS); an address the driver never gave out is
 * CUDA_ERROR_INVALID_VALUE. Lock held.
 */
static CUresult dev_range(const char *call, CUdeviceptr dptr, size_t size, bool write) {
	uintptr_t va = (uintptr_t)dptr, end = va + size;

	if (size == 0)
		return CUDA_SUCCESS;
	if (end < va)
		return fail(CUDA_ERROR_INVALID_VALUE, call, "range wraps");
	for (uintptr_t p = va; p < end;) {
		struct mapping *m = mapping_at(p);
		struct devmem *d;

		if (m) {
			if (!(m->prot & (write ? PROT_WRITE : PROT_READ)))
				return fail(CUDA_ERROR_ILLEGAL_ADDRESS, call,
				            "0x%lx is mapped without %s access (cuMemSetAccess)",
				            (unsigned long)p, write ? "write" : "read");
			p = m->va + m->size;
			continue;
		}
		for (d = fk.devmems; d; d = d->next)
			if (p >= (uintptr_t)d->p && p - (uintptr_t)d->p < d->size)
				break;
		if (d) {
			p = (uintptr_t)d->p + d->size;
			continue;
		}
		if (reservation_of(p, 1))
			return fail(CUDA_ERROR_ILLEGAL_ADDRESS, call,
			            "0x%lx is reserved but not mapped", (unsigned long)p);
		return fail(CUDA_ERROR_INVALID_VALUE, call, "0x%lx is no device memory",
		            (unsigned long)p);
	}
	return CUDA_SUCCESS;
}

/*
 * Where the driver reaches device address va: the host address of the same byte, and in
 * *ret_run how many bytes from there lie in the same mapping or cuMemAlloc block (at most
 * max). The device address itself outside strict mode; in strict mode, for a mapping, its
 * private view (the device address stays PROT_NONE). After dev_range succeeded; lock held.
 */
static void *dev_host(uintptr_t va, size_t max, size_t *ret_run) {
	struct mapping *m = mapping_at(va);
	uintptr_t base = va, host = va;
	size_t size = max;

	if (m) {
		base = m->va;
		size = m->size;
		host = (uintptr_t)m->host;
	} else
		for (struct devmem *d = fk.devmems; d; d = d->next)
			if (va >= (uintptr_t)d->p && va - (uintptr_t)d->p < d->size) {
				base = (uintptr_t)d->p;
				size = d->size;
				host = base;
				break;
			}
	*ret_run = size - (va - base) < max ? size - (va - base) : max;
	return (void *)(host + (va - base));
}

/* At exit, with KVD_FAKE_CUDA_TRACE: what the process left behind. The real driver frees
 * it all at exit too, so this is no error, but a daemon or library that means to give
 * everything back shows here what it did not. */
__attribute__((destructor)) static void report_leftovers(void) {
	unsigned n_handles = 0, n_res = 0, n_maps = 0, n_mem = 0, n_streams = 0, n_events = 0;
	const char *trace = getenv("KVD_FAKE_CUDA_TRACE");
	unsigned refs;

	if (!trace || !*trace || strcmp(trace, "0") == 0 || !initialized())
		return;
	pthread_mutex_lock(&lock);
	for (struct handle *h = fk.handles; h; h = h->next)
		n_handles++;
	for (struct reservation *r = fk.reservations; r; r = r->next)
		n_res++;
	for (struct mapping *m = fk.mappings; m; m = m->next)
		n_maps++;
	for (struct devmem *d = fk.devmems; d; d = d->next)
		n_mem++;
	for (struct CUstream_st *s = fk.streams; s; s = s->next)
		n_streams++;
	for (struct CUevent_st *e = fk.events; e; e = e->next)
		n_events++;
	refs = primary[0].refs;
	pthread_mutex_unlock(&lock);
	fprintf(stderr, "fake-cuda[%d]: at exit: %u handles, %u reservations, %u mappings, "
	        "%u cuMemAlloc blocks, %u streams, %u events; device 0's primary context refs %u\n",
	        (int)getpid(), n_handles, n_res, n_maps, n_mem, n_streams, n_events, refs);
}

/* ---- initialisation, versions, errors ---- */

/* The driver's first call: everything but versions and error names needs it. Without a
 * device, the driver fails it with CUDA_ERROR_NO_DEVICE and stays uninitialised. */
CUresult CUDAAPI cuInit(unsigned int flags) {
	const char *count_env;
	long devices;

	COUNT(0);
	if (flags != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuInit", "flags must be 0");
	devices = env_long("KVD_FAKE_CUDA_DEVICES", 1, 0, FAKE_DEVICES_MAX);
	if (devices == 0)
		return fail(CUDA_ERROR_NO_DEVICE, "cuInit", "KVD_FAKE_CUDA_DEVICES=0");
	pthread_mutex_lock(&lock);
	if (!fk.initialized) {
		long page = sysconf(_SC_PAGESIZE);
		size_t gran = (size_t)env_long("KVD_FAKE_CUDA_GRANULARITY_KIB", 2048, 4, 1L << 20) << 10;

		fk.devices = (int)devices;
		fk.strict = env_long("KVD_FAKE_CUDA_STRICT", 0, 0, 1) != 0;
		fk.total = (size_t)env_long("KVD_FAKE_CUDA_MEMORY_MIB", 1024, 1, 1L << 24) << 20;
		/* mmap works in pages: a granularity is a whole number of them. */
		fk.granularity = (gran + (size_t)page - 1) / (size_t)page * (size_t)page;
		fk.next_handle = 1;
		count_env = getenv("KVD_FAKE_CUDA_COUNT");
		if (count_env && *count_env) {
			__atomic_store_n(&count_path, strdup(count_env), __ATOMIC_RELEASE);
			pthread_atfork(NULL, NULL, counts_reset);
		}
		for (int i = 0; i < FAKE_DEVICES_MAX; i++)
			primary[i].ordinal = i;
		__atomic_store_n(&fk.initialized, true, __ATOMIC_RELEASE);
	}
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/* The version this fake says it is: the toolkit's (the headers we match), an older one as
 * KVD_FAKE_CUDA_DRIVER_VERSION says (12040: CUDA 12.4, an R550 driver), or 12040 when built
 * as a driver before CUDA 12.8. */
static int driver_version(void) {
#ifdef FAKE_CUDA_PRE_12_8
	long def = 12040;
#else
	long def = CUDA_VERSION;
#endif

	return (int)env_long("KVD_FAKE_CUDA_DRIVER_VERSION", def, 11040, CUDA_VERSION);
}

/* Works before cuInit, as in the driver. */
CUresult CUDAAPI cuDriverGetVersion(int *driverVersion) {
	COUNT(0);
	if (!driverVersion)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDriverGetVersion", "NULL");
	*driverVersion = driver_version();
	return CUDA_SUCCESS;
}

static const struct {
	CUresult r;
	const char *name, *text;
} errors[] = {
#define E(code, text) { code, #code, text }
	E(CUDA_SUCCESS, "no error"),
	E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
	E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
	E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
	E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
	E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
	E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
	E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
	E(CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device"),
	E(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "the provided PTX was compiled with an unsupported toolchain."),
	E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
	E(CUDA_ERROR_NOT_READY, "device not ready"),
	E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
	E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
	E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
	E(CUDA_ERROR_UNKNOWN, "unknown error"),
#undef E
};

/* Names for the codes this fake returns; others are CUDA_ERROR_INVALID_VALUE with *pStr
 * NULL, as the driver answers codes it does not know. No cuInit needed. */
static CUresult error_name(CUresult error, const char **pStr) {
	if (!pStr)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].r == error) {
			*pStr = errors[i].name;
			return CUDA_SUCCESS;
		}
	*pStr = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuGetErrorName(CUresult error, const char **pStr) {
	COUNT(0);
	return error_name(error, pStr);
}

CUresult CUDAAPI cuGetErrorString(CUresult error, const char **pStr) {
	COUNT(0);
	if (!pStr)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++)
		if (errors[i].r == error) {
			*pStr = errors[i].text;
			return CUDA_SUCCESS;
		}
	*pStr = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

/* ---- devices ---- */

CUresult CUDAAPI cuDeviceGetCount(int *count) {
	COUNT(0);
	NEED_INIT("cuDeviceGetCount");
	if (!count)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetCount", "NULL");
	*count = fk.devices;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) {
	COUNT(0);
	NEED_INIT("cuDeviceGet");
	if (!device)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGet", "NULL");
	if (!is_device(ordinal))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet", "ordinal %d", ordinal);
	*device = ordinal;
	return CUDA_SUCCESS;
}

/* Truncated to len, NUL-terminated, like the driver. */
CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev) {
	COUNT(0);
	NEED_INIT("cuDeviceGetName");
	if (!name || len <= 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetName", "no buffer");
	if (!is_device(dev))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGetName", "device %d", dev);
	snprintf(name, (size_t)len, "kvd fake CUDA device %d", dev);
	return CUDA_SUCCESS;
}

/* Whether the devices support GPUDirect RDMA on VMM memory (KVD_FAKE_CUDA_RDMA, default
 * 1, as on current data-center GPUs). */
static bool rdma_vmm(void) {
	return env_long("KVD_FAKE_CUDA_RDMA", 1, 0, 1) != 0;
}

/* Whether the devices support interprocess events (KVD_FAKE_CUDA_IPC_EVENTS, default 1). */
static bool ipc_events(void) {
	return env_long("KVD_FAKE_CUDA_IPC_EVENTS", 1, 0, 1) != 0;
}

/* Device dev's PCI bus: the dev-th number of KVD_FAKE_CUDA_PCI_BUS (hex, comma separated),
 * or 1 + dev, so that CUDA's order (fastest first, on a GPU) may differ from the bus's. */
static int pci_bus(CUdevice dev) {
	const char *p = getenv("KVD_FAKE_CUDA_PCI_BUS");

	for (int i = 0; p && *p; i++) {
		char *end;
		long v = strtol(p, &end, 16);

		if (end == p || v < 0 || v > 0xff)
			break;
		if (i == dev)
			return (int)v;
		p = *end == ',' ? end + 1 : end;
	}
	return 1 + dev;
}

/*
 * What kvd asks: VMM and POSIX-fd export are supported (what the cuda backend needs).
 * A few other values are those of a plausible GPU for tools that print them, and the PCI bus
 * is pci_bus()'s; the rest are 0. An attribute the enum does not have is CUDA_ERROR_INVALID_VALUE.
 */
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
	COUNT(0);
	NEED_INIT("cuDeviceGetAttribute");
	if (!pi || (int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute", "attribute %d",
		            (int)attrib);
	if (!is_device(dev))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGetAttribute", "device %d", dev);
	switch (attrib) {
	case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
	case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED:
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
		*pi = 1;
		break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
		*pi = 9;
		break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
		*pi = 1;
		break;
	case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
		*pi = 32;
		break;
	case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
		*pi = 1024;
		break;
	case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
		*pi = pci_bus(dev);
		break;
	case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED:
		*pi = rdma_vmm();
		break;
	case CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED:
		*pi = ipc_events();
		break;
	default:
		*pi = 0;
		break;
	}
	return CUDA_SUCCESS;
}

/* Fixed and distinct per ordinal: kvd names a GPU across processes by its UUID. */
CUresult CUDAAPI cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
	static const char base[16] = "kvd-fake-cuda-0";

	COUNT(0);
	NEED_INIT("cuDeviceGetUuid");
	if (!uuid)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetUuid", "NULL");
	if (!is_device(dev))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGetUuid", "device %d", dev);
	memcpy(uuid->bytes, base, sizeof(uuid->bytes));
	uuid->bytes[14] = (char)('0' + dev);
	uuid->bytes[15] = (char)0xfa;
	return CUDA_SUCCESS;
}

/* ---- contexts ---- */

/* One primary context per device, reference counted: retained, it is active; released to
 * zero, the driver destroys it (here: calls in it fail until it is retained again). */
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
	COUNT(0);
	NEED_INIT("cuDevicePrimaryCtxRetain");
	if (!pctx)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuDevicePrimaryCtxRetain", "NULL");
	if (!is_device(dev))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRetain", "device %d", dev);
	pthread_mutex_lock(&lock);
	primary[dev].refs++;
	pthread_mutex_unlock(&lock);
	*pctx = &primary[dev];
	return CUDA_SUCCESS;
}

/* Releasing more often than retaining is an error in the driver too. */
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
	CUresult r = CUDA_SUCCESS;

	COUNT(0);
	NEED_INIT("cuDevicePrimaryCtxRelease");
	if (!is_device(dev))
		return fail(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRelease", "device %d", dev);
	pthread_mutex_lock(&lock);
	if (primary[dev].refs == 0)
		r = CUDA_ERROR_INVALID_CONTEXT;
	else
		primary[dev].refs--;
	pthread_mutex_unlock(&lock);
	return r == CUDA_SUCCESS ? r :
	       fail(r, "cuDevicePrimaryCtxRelease", "device %d's primary context is not retained", dev);
}

/* Replaces the top of this thread's stack (or pushes onto an empty one); NULL pops, as the
 * driver documents. */
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
	COUNT(0);
	NEED_INIT("cuCtxSetCurrent");
	if (ctx && !is_ctx(ctx))
		return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxSetCurrent", "not a context");
	if (!ctx) {
		if (ctx_depth)
			ctx_depth--;
	} else if (ctx_depth)
		ctx_stack[ctx_depth - 1] = ctx;
	else
		ctx_stack[ctx_depth++] = ctx;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxPushCurrent(CUcontext ctx) {
	COUNT(0);
	NEED_INIT("cuCtxPushCurrent");
	if (!ctx)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuCtxPushCurrent", "NULL");
	if (!is_ctx(ctx))
		return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxPushCurrent", "not a context");
	if (ctx_depth == CTX_STACK_MAX)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuCtxPushCurrent", "stack full (unbalanced push?)");
	ctx_stack[ctx_depth++] = ctx;
	return CUDA_SUCCESS;
}

/* Popping an empty stack is CUDA_ERROR_INVALID_CONTEXT in the driver. */
CUresult CUDAAPI cuCtxPopCurrent(CUcontext *pctx) {
	COUNT(0);
	NEED_INIT("cuCtxPopCurrent");
	if (!ctx_depth)
		return fail(CUDA_ERROR_INVALID_CONTEXT, "cuCtxPopCurrent", "no current context");
	ctx_depth--;
	if (pctx)
		*pctx = ctx_stack[ctx_depth];
	return CUDA_SUCCESS;
}

/* NULL when the thread has none, as the driver answers (not an error). */
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) {
	COUNT(0);
	NEED_INIT("cuCtxGetCurrent");
	if (!pctx)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuCtxGetCurrent", "NULL");
	*pctx = ctx_current();
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) {
	int ordinal = -1;
	CUresult r;

	COUNT(0);
	if (!device)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuCtxGetDevice", "NULL");
	r = need_ctx("cuCtxGetDevice", &ordinal);
	if (r == CUDA_SUCCESS)
		*device = ordinal;
	return r;
}

/* Everything already happened; only the context is checked. */
CUresult CUDAAPI cuCtxSynchronize(void) {
	CUresult r = need_ctx("cuCtxSynchronize", NULL);

	COUNT(0);
	if (r == CUDA_SUCCESS)
		land_late();
	return r;
}

/* ---- memory: information, cuMemAlloc ---- */

/* Per device: free is the total less what this process has allocated on it (the driver
 * counts every process; here the others' memory is their own host memory). */
CUresult CUDAAPI cuMemGetInfo(size_t *free_b, size_t *total_b) {
	int ordinal;
	CUresult r = need_ctx("cuMemGetInfo", &ordinal);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!free_b || !total_b)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemGetInfo", "NULL");
	pthread_mutex_lock(&lock);
	*free_b = fk.total - (device_used(ordinal) < fk.total ? device_used(ordinal) : fk.total);
	*total_b = fk.total;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize) {
	struct devmem *d;
	int ordinal;
	size_t size;
	CUresult r = need_ctx("cuMemAlloc", &ordinal);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!dptr || bytesize == 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc", "NULL or 0 bytes");
	/* The driver aligns allocations to at least 256 bytes; a page keeps it simple. */
	size = (bytesize + 4095) & ~(size_t)4095;
	if (size < bytesize)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", "%zu bytes", bytesize);
	/* A device an engine filled: its last KiB are all a cuMemAlloc may take. */
	if (size > (size_t)env_long("KVD_FAKE_CUDA_ALLOC_MAX_KIB", LONG_MAX / 1024, 0, LONG_MAX / 1024) * 1024)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", "%zu bytes (KVD_FAKE_CUDA_ALLOC_MAX_KIB)",
		            bytesize);
	pthread_mutex_lock(&lock);
	if (size > fk.total - fk.used[ordinal]) {
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", "%zu bytes", bytesize);
	}
	d = calloc(1, sizeof(*d));
	if (d)
		d->p = aligned_alloc(4096, size);
	if (!d || !d->p) {
		free(d);
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc", "host memory");
	}
	d->size = size;
	d->ordinal = ordinal;
	d->next = fk.devmems;
	fk.devmems = d;
	fk.used[ordinal] += size;
	pthread_mutex_unlock(&lock);
	*dptr = (CUdeviceptr)(uintptr_t)d->p;
	return CUDA_SUCCESS;
}

/* Only what cuMemAlloc returned, and only once. */
CUresult CUDAAPI cuMemFree(CUdeviceptr dptr) {
	CUresult r = need_ctx("cuMemFree", NULL);
	struct devmem *d = NULL;

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	land_late_locked(); /* before the memory goes */
	for (struct devmem **pp = &fk.devmems; *pp; pp = &(*pp)->next)
		if ((uintptr_t)(*pp)->p == (uintptr_t)dptr) {
			d = *pp;
			*pp = d->next;
			fk.used[d->ordinal] -= d->size;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!d)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemFree", "0x%llx was not allocated",
		            (unsigned long long)dptr);
	free(d->p);
	free(d);
	return CUDA_SUCCESS;
}

/* ---- memory: virtual memory management (no context needed, see above) ---- */

/* What cuMemCreate and the granularity query accept: pinned memory on one of our devices. */
static CUresult prop_check(const char *call, const CUmemAllocationProp *prop) {
	if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
		return fail(CUDA_ERROR_INVALID_VALUE, call, "not pinned device memory");
	if (!is_device(prop->location.id))
		return fail(CUDA_ERROR_INVALID_DEVICE, call, "device %d", prop->location.id);
	return CUDA_SUCCESS;
}

/* Minimum and recommended are the same here, as they are on current GPUs (2 MiB). */
CUresult CUDAAPI cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                               CUmemAllocationGranularity_flags option) {
	CUresult r;

	COUNT(0);
	NEED_INIT("cuMemGetAllocationGranularity");
	r = prop_check("cuMemGetAllocationGranularity", prop);
	if (r != CUDA_SUCCESS)
		return r;
	if (!granularity || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
	                     option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemGetAllocationGranularity", "bad arguments");
	*granularity = fk.granularity;
	return CUDA_SUCCESS;
}

/*
 * Physical memory as a memfd of the size (a multiple of the granularity, as the driver
 * requires). Only POSIX fds can be asked for as a shareable type (the others need Windows
 * or a fabric); memory that did not ask for one cannot be exported, as in the driver.
 */
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags) {
	char name[32];
	struct alloc *a;
	struct stat st;
	CUresult r;
	int fd;

	COUNT(0);
	NEED_INIT("cuMemCreate");
	r = prop_check("cuMemCreate", prop);
	if (r != CUDA_SUCCESS)
		return r;
	if (!handle || flags != 0 || size == 0 || size % fk.granularity != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemCreate",
		            "size %zu (granularity %zu), flags %llu", size, fk.granularity, flags);
	if (prop->requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuMemCreate", "handle types 0x%x",
		            (unsigned)prop->requestedHandleTypes);
	/* RDMA-capable memory where the device says it cannot have it: refused. */
	if (prop->allocFlags.gpuDirectRDMACapable && !rdma_vmm())
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuMemCreate", "gpuDirectRDMACapable on a device "
		            "without GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED (KVD_FAKE_CUDA_RDMA=0)");
	pthread_mutex_lock(&lock);
	if (size + device_used(prop->location.id) > fk.total) {
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "%zu bytes", size);
	}
	snprintf(name, sizeof(name), MEMFD_PREFIX "%d", prop->location.id);
	fd = memfd_create(name, MFD_CLOEXEC);
	a = calloc(1, sizeof(*a));
	if (fd < 0 || !a || ftruncate(fd, (off_t)size) < 0) {
		pthread_mutex_unlock(&lock);
		if (fd >= 0)
			close(fd);
		free(a);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "memfd: %s", strerror(errno));
	}
	a->fd = fd;
	a->size = size;
	a->ordinal = prop->location.id;
	a->created = true;
	a->exportable = prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	if (fstat(fd, &st) < 0 || handle_new(a, handle) < 0) {
		pthread_mutex_unlock(&lock);
		close(fd);
		free(a);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "no memory");
	}
	a->ino = st.st_ino;
	a->next = fk.allocs;
	fk.allocs = a;
	fk.used[a->ordinal] += size;
	ledger_hold(a, true);
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/* Drops the handle; the memory stays while it is mapped (cuMemRelease's documentation). */
CUresult CUDAAPI cuMemRelease(CUmemGenericAllocationHandle handle) {
	struct handle *h = NULL;

	COUNT(0);
	NEED_INIT("cuMemRelease");
	pthread_mutex_lock(&lock);
	land_late_locked(); /* before the memory goes */
	for (struct handle **pp = &fk.handles; *pp; pp = &(*pp)->next)
		if ((*pp)->id == handle) {
			h = *pp;
			*pp = h->next;
			alloc_put(h->alloc);
			free(h);
			break;
		}
	pthread_mutex_unlock(&lock);
	return h ? CUDA_SUCCESS :
	       fail(CUDA_ERROR_INVALID_VALUE, "cuMemRelease", "unknown handle %llu", handle);
}

/* A new fd for the same memory, which the caller owns. */
CUresult CUDAAPI cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                              CUmemAllocationHandleType handleType,
                                              unsigned long long flags) {
	bool known, exportable;
	struct alloc *a;
	int fd = -1;

	COUNT(0);
	NEED_INIT("cuMemExportToShareableHandle");
	if (!shareableHandle || flags != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle", "bad arguments");
	if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuMemExportToShareableHandle", "handle type %d",
		            (int)handleType);
	pthread_mutex_lock(&lock);
	a = alloc_find(handle);
	known = a;
	exportable = a && a->exportable;
	/* Without FD_CLOEXEC: what to do with it is the caller's choice. */
	if (exportable)
		fd = fcntl(a->fd, F_DUPFD, 0);
	pthread_mutex_unlock(&lock);
	if (!known)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle",
		            "unknown handle %llu", handle);
	if (!exportable)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemExportToShareableHandle",
		            "created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
	if (fd < 0)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemExportToShareableHandle", "dup: %s",
		            strerror(errno));
	*(int *)shareableHandle = fd;
	return CUDA_SUCCESS;
}

/*
 * The fd goes by value in the pointer (cuda.h), and stays the caller's. Only fds this
 * driver exported are memory: anything else (a host-backend memfd, a file) is refused, as
 * the driver refuses fds that are not its own.
 */
CUresult CUDAAPI cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                                CUmemAllocationHandleType shHandleType) {
	int fd = (int)(intptr_t)osHandle, ordinal = -1;
	char path[64], target[128];
	bool fresh = false;
	struct alloc *a;
	struct stat st;
	ssize_t n;

	COUNT(0);
	NEED_INIT("cuMemImportFromShareableHandle");
	if (!handle)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle", "NULL");
	if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuMemImportFromShareableHandle",
		            "handle type %d", (int)shHandleType);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	n = readlink(path, target, sizeof(target) - 1);
	if (fd < 0 || fstat(fd, &st) < 0 || n < 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle", "fd %d: %s",
		            fd, strerror(errno));
	target[n] = '\0';
	if (sscanf(target, "/memfd:" MEMFD_PREFIX "%d", &ordinal) != 1 || !is_device(ordinal) ||
	    st.st_size <= 0 || (size_t)st.st_size % fk.granularity != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemImportFromShareableHandle",
		            "fd %d (%s) is not memory of this driver", fd, target);
	pthread_mutex_lock(&lock);
	/* Memory this process knows already (it made it, or imported it before) is the same
	 * allocation under a new handle. */
	for (a = fk.allocs; a; a = a->next)
		if (a->ino == st.st_ino)
			break;
	if (!a) {
		a = calloc(1, sizeof(*a));
		if (a)
			a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
		if (!a || a->fd < 0) {
			pthread_mutex_unlock(&lock);
			free(a);
			return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemImportFromShareableHandle", "no memory");
		}
		a->ino = st.st_ino;
		a->size = (size_t)st.st_size;
		a->ordinal = ordinal;
		a->exportable = true;
		a->next = fk.allocs;
		fk.allocs = a;
		fresh = true;
		ledger_hold(a, true);
	}
	if (handle_new(a, handle) < 0) {
		if (fresh) {
			a->refs = 1;
			alloc_put(a);
		}
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemImportFromShareableHandle", "no memory");
	}
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/*
 * Address space only: an inaccessible anonymous range. The driver wants the size a
 * multiple of the page size and the alignment a power of two (or 0: the granularity); the
 * address is a hint, which the fake does not take.
 */
CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                     unsigned long long flags) {
	size_t page = (size_t)sysconf(_SC_PAGESIZE), span;
	struct reservation *res;
	uintptr_t base, va;
	void *p;

	COUNT(0);
	(void)addr;
	NEED_INIT("cuMemAddressReserve");
	if (!ptr || flags != 0 || size == 0 || size % page != 0 ||
	    (alignment & (alignment - 1)) != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve",
		            "size %zu, alignment %zu, flags %llu", size, alignment, flags);
	if (alignment < fk.granularity)
		alignment = fk.granularity;
	span = size + alignment;
	if (span < size)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAddressReserve", "%zu bytes", size);
	p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	res = calloc(1, sizeof(*res));
	if (p == MAP_FAILED || !res) {
		if (p != MAP_FAILED)
			munmap(p, span);
		free(res);
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAddressReserve", "%zu bytes", size);
	}
	/* Over-reserved by the alignment: keep the aligned part, give back both ends. */
	base = (uintptr_t)p;
	va = (base + alignment - 1) & ~(uintptr_t)(alignment - 1);
	if (va > base)
		munmap(p, va - base);
	if (base + span > va + size)
		munmap((void *)(va + size), base + span - (va + size));
	res->va = va;
	res->size = size;
	pthread_mutex_lock(&lock);
	res->next = fk.reservations;
	fk.reservations = res;
	pthread_mutex_unlock(&lock);
	*ptr = (CUdeviceptr)va;
	return CUDA_SUCCESS;
}

/* The pointer and size must be exactly a reservation's. A reservation that still has
 * mappings is refused: they would hold their memory with no way left to unmap it. */
CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
	struct reservation *res = NULL, **pp;
	bool mapped = false;

	COUNT(0);
	NEED_INIT("cuMemAddressFree");
	pthread_mutex_lock(&lock);
	land_late_locked(); /* before the memory goes */
	for (pp = &fk.reservations; *pp; pp = &(*pp)->next)
		if ((*pp)->va == (uintptr_t)ptr && (*pp)->size == size) {
			res = *pp;
			break;
		}
	for (struct mapping *m = fk.mappings; res && m; m = m->next)
		if (m->va >= res->va && m->va - res->va < res->size)
			mapped = true;
	if (res && !mapped)
		*pp = res->next;
	pthread_mutex_unlock(&lock);
	if (!res)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree",
		            "0x%llx + %zu is not a reservation", (unsigned long long)ptr, size);
	if (mapped)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAddressFree",
		            "0x%llx + %zu still has mappings (cuMemUnmap first)",
		            (unsigned long long)ptr, size);
	munmap((void *)res->va, res->size);
	free(res);
	return CUDA_SUCCESS;
}

/*
 * Maps an allocation, or a prefix of it as the real driver allows (offset 0: the driver
 * takes no other yet), at a granularity-
 * aligned place of a reservation that is not mapped yet. The mapping has no access until
 * cuMemSetAccess ("calling cuMemMap does not make the address accessible"), so it stays
 * PROT_NONE: a CPU or copy that uses it before that fails, as on a GPU.
 */
CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                          unsigned long long flags) {
	uintptr_t va = (uintptr_t)ptr;
	struct mapping *m;
	struct alloc *a;
	const char *why = NULL;

	COUNT(0);
	NEED_INIT("cuMemMap");
	if (offset != 0 || flags != 0 || size == 0 || va % fk.granularity != 0 ||
	    size % fk.granularity != 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemMap",
		            "0x%lx + %zu, offset %zu, flags %llu (granularity %zu)", (unsigned long)va,
		            size, offset, flags, fk.granularity);
	m = calloc(1, sizeof(*m));
	if (!m)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuMemMap", "no memory");
	pthread_mutex_lock(&lock);
	a = alloc_find(handle);
	if (!a)
		why = "unknown handle";
	else if (size > a->size)
		why = "larger than the allocation"; /* a prefix maps, as with the real driver */
	else if (!reservation_of(va, size))
		why = "not inside one reservation";
	else
		for (struct mapping *o = fk.mappings; o && !why; o = o->next)
			if (o->va < va + size && va < o->va + o->size)
				why = "overlaps a mapping";
	if (!why && mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED)
		why = "mmap failed";
	m->host = (void *)va;
	if (!why && fk.strict) {
		/* The driver's own view, for copies and memsets: MAP_SHARED, so that it and every
		 * other process's mappings see one memory. */
		m->host = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
		if (m->host == MAP_FAILED) {
			mmap((void *)va, size, PROT_NONE,
			     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
			why = "mmap of the driver's view failed";
		}
	}
	if (why) {
		pthread_mutex_unlock(&lock);
		free(m);
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemMap", "0x%lx + %zu, handle %llu: %s",
		            (unsigned long)va, size, handle, why);
	}
	m->va = va;
	m->size = size;
	m->alloc = a;
	m->prot = PROT_NONE;
	m->next = fk.mappings;
	fk.mappings = m;
	a->refs++;
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/* Whole mappings only ("cuMemUnmap cannot unmap a sub-range"); the range becomes
 * reservation again, and memory no handle or mapping holds is freed. */
CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
	uintptr_t va = (uintptr_t)ptr, end = va + size;

	COUNT(0);
	NEED_INIT("cuMemUnmap");
	pthread_mutex_lock(&lock);
	land_late_locked(); /* before the memory goes */
	if (!whole_mappings(va, size)) {
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemUnmap",
		            "0x%lx + %zu is not whole mappings", (unsigned long)va, size);
	}
	for (struct mapping **pp = &fk.mappings; *pp;) {
		struct mapping *m = *pp;

		if (m->va < va || m->va >= end) {
			pp = &m->next;
			continue;
		}
		*pp = m->next;
		/* Back to an inaccessible reservation, in the same place. */
		mmap((void *)m->va, m->size, PROT_NONE,
		     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
		if (m->host != (void *)m->va)
			munmap(m->host, m->size);
		alloc_put(m->alloc);
		free(m);
	}
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/*
 * Grants access to whole mappings ("a fully mapped address range"), for devices of this
 * driver. There is one CPU view of the memory, so the most any descriptor grants is what
 * the mapping gets. In strict mode the CPU gets nothing (the device address stays
 * PROT_NONE, as GPU memory is to a CPU): access is only recorded, for copies and memsets.
 */
CUresult CUDAAPI cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
	uintptr_t va = (uintptr_t)ptr, end = va + size;
	int prot = PROT_NONE;

	COUNT(0);
	NEED_INIT("cuMemSetAccess");
	if (!desc || count == 0)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess", "no descriptor");
	for (size_t i = 0; i < count; i++) {
		if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE)
			return fail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess", "location type %d",
			            (int)desc[i].location.type);
		if (!is_device(desc[i].location.id))
			return fail(CUDA_ERROR_INVALID_DEVICE, "cuMemSetAccess", "device %d",
			            desc[i].location.id);
		switch (desc[i].flags) {
		case CU_MEM_ACCESS_FLAGS_PROT_NONE:
			break;
		case CU_MEM_ACCESS_FLAGS_PROT_READ:
			prot |= PROT_READ;
			break;
		case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
			prot |= PROT_READ | PROT_WRITE;
			break;
		default:
			return fail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess", "flags %d",
			            (int)desc[i].flags);
		}
	}
	pthread_mutex_lock(&lock);
	if (!whole_mappings(va, size)) {
		pthread_mutex_unlock(&lock);
		return fail(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess",
		            "0x%lx + %zu is not fully mapped", (unsigned long)va, size);
	}
	for (struct mapping *m = fk.mappings; m; m = m->next)
		if (m->va >= va && m->va < end) {
			if (!fk.strict)
				mprotect((void *)m->va, m->size, prot);
			m->prot = prot;
		}
	pthread_mutex_unlock(&lock);
	return CUDA_SUCCESS;
}

/* ---- copies and memsets: done at once, under the lock so that no unmap races them ---- */

static CUresult stream_check(const char *call, CUstream s) {
	bool ok;

	pthread_mutex_lock(&lock);
	ok = is_stream(s);
	pthread_mutex_unlock(&lock);
	return ok ? CUDA_SUCCESS : fail(CUDA_ERROR_INVALID_HANDLE, call, "unknown stream %p", (void *)s);
}

/* The legacy default stream itself (late copies queue on it). */
static bool is_legacy(CUstream s) {
	return !s || s == CU_STREAM_LEGACY;
}

/* Whether work on s waits for the legacy stream's: s is it, or a blocking stream. Lock held. */
static bool waits_for_legacy(CUstream s) {
	if (is_legacy(s) || s == CU_STREAM_PER_THREAD)
		return true;
	for (struct CUstream_st *p = fk.streams; p; p = p->next)
		if (p == s)
			return !(p->flags & CU_STREAM_NON_BLOCKING);
	return true;
}

static CUresult copy_locked(const char *call, void *dst, const void *src, size_t n,
                            uintptr_t dev_dst, uintptr_t dev_src);

/* The late copies land, oldest first (their ranges were checked when queued, and memory is
 * never unmapped or freed before they land). Lock held. */
static void land_late_locked(void) {
	while (fk.late) {
		struct late_copy *c = fk.late;

		for (size_t y = 0; y < c->height; y++)
			(void)copy_locked("a late device-to-device copy", NULL, NULL, c->width,
			                  c->dst + y * c->dpitch, c->src + y * c->spitch);
		fk.late = c->next;
		free(c);
	}
	fk.late_tail = &fk.late;
}

static void land_late(void) {
	pthread_mutex_lock(&lock);
	land_late_locked();
	pthread_mutex_unlock(&lock);
}

/* Queues a device-to-device copy on the legacy stream. Lock held. */
static CUresult queue_late_locked(const char *call, uintptr_t dst, uintptr_t src, size_t width,
                                  size_t height, size_t dpitch, size_t spitch) {
	struct late_copy *c = malloc(sizeof(*c));

	if (!c)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, call, "no memory for a queued copy");
	*c = (struct late_copy){ .dst = dst, .src = src, .width = width, .height = height,
	                         .dpitch = dpitch, .spitch = spitch };
	if (!fk.late_tail)
		fk.late_tail = &fk.late;
	*fk.late_tail = c;
	fk.late_tail = &c->next;
	return CUDA_SUCCESS;
}

/*
 * Copies n bytes to dst (or device address dev_dst, when not 0) from src (or dev_src),
 * through dev_host: a range may run over several mappings, each with its own view. A
 * device-to-device copy over more than one goes through a bounce buffer, so that it stays
 * a memmove whatever the overlap. Ranges checked; lock held.
 */
static CUresult copy_locked(const char *call, void *dst, const void *src, size_t n,
                            uintptr_t dev_dst, uintptr_t dev_src) {
	uint8_t *bounce = NULL;
	size_t run_d, run_s;
	void *hd = dev_dst ? dev_host(dev_dst, n, &run_d) : dst;
	const void *hs = dev_src ? dev_host(dev_src, n, &run_s) : src;

	if ((!dev_dst || run_d == n) && (!dev_src || run_s == n)) {
		memmove(hd, hs, n);
		return CUDA_SUCCESS;
	}
	if (dev_dst && dev_src) {
		bounce = malloc(n);
		if (!bounce)
			return fail(CUDA_ERROR_OUT_OF_MEMORY, call, "no memory for %zu bytes", n);
		copy_locked(call, bounce, NULL, n, 0, dev_src);
		copy_locked(call, NULL, bounce, n, dev_dst, 0);
		free(bounce);
		return CUDA_SUCCESS;
	}
	for (size_t done = 0, run; done < n; done += run) {
		if (dev_dst) {
			hd = dev_host(dev_dst + done, n - done, &run);
			memcpy(hd, (const uint8_t *)src + done, run);
		} else {
			hs = dev_host(dev_src + done, n - done, &run);
			memcpy((uint8_t *)dst + done, hs, run);
		}
	}
	return CUDA_SUCCESS;
}

/* A 1D copy on stream s (the synchronous calls: the legacy stream); device-to-device on
 * the legacy stream, it lands late. */
static CUresult copy(const char *call, void *dst, const void *src, size_t n, CUdeviceptr dev_dst,
                     CUdeviceptr dev_src, bool dst_dev, bool src_dev, CUstream s) {
	CUresult r = need_ctx(call, NULL);

	if (r != CUDA_SUCCESS)
		return r;
	if (n && ((!dst_dev && !dst) || (!src_dev && !src)))
		return fail(CUDA_ERROR_INVALID_VALUE, call, "NULL host pointer");
	pthread_mutex_lock(&lock);
	if (dst_dev)
		r = dev_range(call, dev_dst, n, true);
	if (r == CUDA_SUCCESS && src_dev)
		r = dev_range(call, dev_src, n, false);
	if (r == CUDA_SUCCESS && n && dst_dev && src_dev && is_legacy(s))
		r = queue_late_locked(call, (uintptr_t)dev_dst, (uintptr_t)dev_src, n, 1, 0, 0);
	else if (r == CUDA_SUCCESS && n) {
		if (waits_for_legacy(s))
			land_late_locked();
		r = copy_locked(call, dst, src, n, dst_dev ? (uintptr_t)dev_dst : 0,
		                src_dev ? (uintptr_t)dev_src : 0);
	}
	pthread_mutex_unlock(&lock);
	return r;
}

CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
	COUNT(ByteCount);
	return copy("cuMemcpyHtoD", NULL, srcHost, ByteCount, dstDevice, 0, true, false, NULL);
}

/* Pinning changes nothing here but the count: host memory is host memory to the fake. */
CUresult CUDAAPI cuMemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
	CUresult r = need_ctx("cuMemHostRegister", NULL);

	COUNT(bytesize);
	if (r != CUDA_SUCCESS)
		return r;
	return p && bytesize > 0 && (Flags & ~0xfu) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemHostUnregister(void *p) {
	CUresult r = need_ctx("cuMemHostUnregister", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult CUDAAPI cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
	COUNT(ByteCount);
	return copy("cuMemcpyDtoH", dstHost, NULL, ByteCount, 0, srcDevice, false, true, NULL);
}

CUresult CUDAAPI cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
	COUNT(ByteCount);
	return copy("cuMemcpyDtoD", NULL, NULL, ByteCount, dstDevice, srcDevice, true, true, NULL);
}

CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                   CUstream hStream) {
	CUresult r = stream_check("cuMemcpyHtoDAsync", hStream);

	COUNT(ByteCount);
	return r != CUDA_SUCCESS ? r :
	       copy("cuMemcpyHtoDAsync", NULL, srcHost, ByteCount, dstDevice, 0, true, false, hStream);
}

CUresult CUDAAPI cuMemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream) {
	CUresult r = stream_check("cuMemcpyDtoHAsync", hStream);

	COUNT(ByteCount);
	return r != CUDA_SUCCESS ? r :
	       copy("cuMemcpyDtoHAsync", dstHost, NULL, ByteCount, 0, srcDevice, false, true, hStream);
}

CUresult CUDAAPI cuMemcpyDtoDAsync(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream) {
	CUresult r = stream_check("cuMemcpyDtoDAsync", hStream);

	COUNT(ByteCount);
	return r != CUDA_SUCCESS ? r :
	       copy("cuMemcpyDtoDAsync", NULL, NULL, ByteCount, dstDevice, srcDevice, true, true,
	            hStream);
}

/*
 * A 2D copy (CUDA_MEMCPY2D): row y is WidthInBytes bytes from src + (srcY + y) * srcPitch +
 * srcXInBytes to dst + (dstY + y) * dstPitch + dstXInBytes, each side host or device memory
 * (arrays and unified memory: not in the fake). Checked as the driver does before anything
 * is copied: with more than one row, a pitch under the row's X offset plus width is
 * CUDA_ERROR_INVALID_VALUE; every device row must lie in accessible device memory, as a 1D
 * copy's range (dev_range). With KVD_FAKE_CUDA_PITCH_ALIGN=N, cuMemcpy2D and
 * cuMemcpy2DAsync refuse (CUDA_ERROR_INVALID_VALUE) a device-to-device copy of more than one
 * row whose pitches are not multiples of N: the driver documents that it may refuse intra-
 * device pitches that cuMemAllocPitch did not make, and cuMemcpy2DUnaligned takes them.
 * Then row by row through copy_locked, so that a row over two
 * mappings, or an overlapping device-to-device row, goes as in cuMemcpyDtoD (the driver
 * leaves overlapping 2D copies undefined). Nothing to copy (no width or no height): success,
 * whatever the pointers and pitches, as a 1D copy of 0 bytes.
 */
static CUresult side_check(const char *call, const char *side, CUmemorytype type,
                           const void *host, CUdeviceptr dev, size_t x, size_t y, size_t pitch,
                           const CUDA_MEMCPY2D *p) {
	size_t last;

	if (type != CU_MEMORYTYPE_HOST && type != CU_MEMORYTYPE_DEVICE)
		return fail(type == CU_MEMORYTYPE_ARRAY || type == CU_MEMORYTYPE_UNIFIED ?
		            CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_INVALID_VALUE, call,
		            "%s memory type %d (the fake copies host and device memory only)",
		            side, (int)type);
	if (p->WidthInBytes == 0 || p->Height == 0)
		return CUDA_SUCCESS;
	if (type == CU_MEMORYTYPE_HOST ? !host : !dev)
		return fail(CUDA_ERROR_INVALID_VALUE, call, "NULL %s pointer", side);
	if (p->WidthInBytes > SIZE_MAX - x ||
	    (p->Height > 1 && pitch < x + p->WidthInBytes))
		return fail(CUDA_ERROR_INVALID_VALUE, call, "%s pitch %zu < X %zu + width %zu", side,
		            pitch, x, p->WidthInBytes);
	/* The last row's end, from the start pointer: it must not wrap the address space. */
	if (__builtin_add_overflow(y, p->Height - 1, &last) ||
	    __builtin_mul_overflow(last, pitch, &last) ||
	    __builtin_add_overflow(last, x + p->WidthInBytes, &last) ||
	    (type == CU_MEMORYTYPE_HOST ? (uintptr_t)host : (uintptr_t)dev) > UINTPTR_MAX - last)
		return fail(CUDA_ERROR_INVALID_VALUE, call, "%s rows wrap the address space", side);
	return CUDA_SUCCESS;
}

static CUresult copy2d(const char *call, const CUDA_MEMCPY2D *p, bool unaligned, CUstream s) {
	bool dst_dev, src_dev;
	uintptr_t dst, src;
	CUresult r = need_ctx(call, NULL);
	long align = env_long("KVD_FAKE_CUDA_PITCH_ALIGN", 0, 0, LONG_MAX);

	if (r != CUDA_SUCCESS)
		return r;
	if (!p)
		return fail(CUDA_ERROR_INVALID_VALUE, call, "NULL CUDA_MEMCPY2D");
	if (!unaligned && align > 0 && p->srcMemoryType == CU_MEMORYTYPE_DEVICE &&
	    p->dstMemoryType == CU_MEMORYTYPE_DEVICE && p->Height > 1 && p->WidthInBytes > 0 &&
	    (p->srcPitch % (size_t)align != 0 || p->dstPitch % (size_t)align != 0))
		return fail(CUDA_ERROR_INVALID_VALUE, call, "intra-device pitches %zu, %zu: not "
		            "multiples of %ld (KVD_FAKE_CUDA_PITCH_ALIGN)", p->srcPitch, p->dstPitch, align);
	r = side_check(call, "source", p->srcMemoryType, p->srcHost, p->srcDevice, p->srcXInBytes,
	               p->srcY, p->srcPitch, p);
	if (r == CUDA_SUCCESS)
		r = side_check(call, "destination", p->dstMemoryType, p->dstHost, p->dstDevice,
		               p->dstXInBytes, p->dstY, p->dstPitch, p);
	if (r != CUDA_SUCCESS || p->WidthInBytes == 0 || p->Height == 0)
		return r;
	src_dev = p->srcMemoryType == CU_MEMORYTYPE_DEVICE;
	dst_dev = p->dstMemoryType == CU_MEMORYTYPE_DEVICE;
	src = (src_dev ? (uintptr_t)p->srcDevice : (uintptr_t)p->srcHost) +
	      p->srcY * p->srcPitch + p->srcXInBytes;
	dst = (dst_dev ? (uintptr_t)p->dstDevice : (uintptr_t)p->dstHost) +
	      p->dstY * p->dstPitch + p->dstXInBytes;
	pthread_mutex_lock(&lock);
	for (size_t y = 0; r == CUDA_SUCCESS && y < p->Height; y++) {
		if (dst_dev)
			r = dev_range(call, (CUdeviceptr)(dst + y * p->dstPitch), p->WidthInBytes, true);
		if (r == CUDA_SUCCESS && src_dev)
			r = dev_range(call, (CUdeviceptr)(src + y * p->srcPitch), p->WidthInBytes, false);
	}
	if (r == CUDA_SUCCESS && dst_dev && src_dev && is_legacy(s)) {
		r = queue_late_locked(call, dst, src, p->WidthInBytes, p->Height, p->dstPitch,
		                      p->srcPitch);
		pthread_mutex_unlock(&lock);
		return r;
	}
	if (r == CUDA_SUCCESS && waits_for_legacy(s))
		land_late_locked();
	for (size_t y = 0; r == CUDA_SUCCESS && y < p->Height; y++) {
		uintptr_t d = dst + y * p->dstPitch, sr = src + y * p->srcPitch;

		r = copy_locked(call, dst_dev ? NULL : (void *)d, src_dev ? NULL : (const void *)sr,
		                p->WidthInBytes, dst_dev ? d : 0, src_dev ? sr : 0);
	}
	pthread_mutex_unlock(&lock);
	return r;
}

CUresult CUDAAPI cuMemcpy2D(const CUDA_MEMCPY2D *pCopy) {
	COUNT(pCopy ? (unsigned long long)pCopy->WidthInBytes * pCopy->Height : 0);
	return copy2d("cuMemcpy2D", pCopy, false, NULL);
}

CUresult CUDAAPI cuMemcpy2DAsync(const CUDA_MEMCPY2D *pCopy, CUstream hStream) {
	CUresult r = stream_check("cuMemcpy2DAsync", hStream);

	COUNT(pCopy ? (unsigned long long)pCopy->WidthInBytes * pCopy->Height : 0);
	return r != CUDA_SUCCESS ? r : copy2d("cuMemcpy2DAsync", pCopy, false, hStream);
}

/* Any pitches (KVD_FAKE_CUDA_PITCH_ALIGN does not apply), as the driver's. */
CUresult CUDAAPI cuMemcpy2DUnaligned(const CUDA_MEMCPY2D *pCopy) {
	COUNT(pCopy ? (unsigned long long)pCopy->WidthInBytes * pCopy->Height : 0);
	return copy2d("cuMemcpy2DUnaligned", pCopy, true, NULL);
}

CUresult CUDAAPI cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream) {
	CUresult r = need_ctx("cuMemsetD8Async", NULL);

	COUNT(N);
	if (r == CUDA_SUCCESS)
		r = stream_check("cuMemsetD8Async", hStream);
	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	if (waits_for_legacy(hStream))
		land_late_locked();
	r = dev_range("cuMemsetD8Async", dstDevice, N, true);
	for (size_t done = 0, run; r == CUDA_SUCCESS && done < N; done += run) {
		void *h = dev_host((uintptr_t)dstDevice + done, N - done, &run);

		memset(h, uc, run);
	}
	pthread_mutex_unlock(&lock);
	return r;
}

/* ---- streams and events ---- */

CUresult CUDAAPI cuStreamCreate(CUstream *phStream, unsigned int Flags) {
	struct CUstream_st *s;
	CUresult r = need_ctx("cuStreamCreate", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))
		return fail(CUDA_ERROR_INVALID_VALUE, "cuStreamCreate", "flags 0x%x", Flags);
	s = calloc(1, sizeof(*s));
	if (!s)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuStreamCreate", "no memory");
	s->flags = Flags;
	pthread_mutex_lock(&lock);
	s->next = fk.streams;
	fk.streams = s;
	pthread_mutex_unlock(&lock);
	*phStream = s;
	return CUDA_SUCCESS;
}

/* Only streams cuStreamCreate made (not NULL or the special ones), once. */
CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
	struct CUstream_st *s = NULL;
	CUresult r = need_ctx("cuStreamDestroy", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	for (struct CUstream_st **pp = &fk.streams; *pp; pp = &(*pp)->next)
		if (*pp == hStream) {
			s = *pp;
			*pp = s->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!s)
		return fail(CUDA_ERROR_INVALID_HANDLE, "cuStreamDestroy", "unknown stream %p",
		            (void *)hStream);
	free(s);
	return CUDA_SUCCESS;
}

/* Work is done when it is queued, but for the late copies, which a stream that waits for
 * the legacy one waits for. */
CUresult CUDAAPI cuStreamSynchronize(CUstream hStream) {
	CUresult r = need_ctx("cuStreamSynchronize", NULL);

	COUNT(0);
	if (r == CUDA_SUCCESS)
		r = stream_check("cuStreamSynchronize", hStream);
	if (r == CUDA_SUCCESS) {
		pthread_mutex_lock(&lock);
		if (waits_for_legacy(hStream))
			land_late_locked();
		pthread_mutex_unlock(&lock);
	}
	return r;
}

CUresult CUDAAPI cuEventCreate(CUevent *phEvent, unsigned int Flags) {
	const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
	struct CUevent_st *e;
	CUresult r = need_ctx("cuEventCreate", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	/* An interprocess event must not time (cuda.h). */
	if (!phEvent || (Flags & ~known) ||
	    ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))
		return fail(CUDA_ERROR_INVALID_VALUE, "cuEventCreate", "flags 0x%x", Flags);
	e = calloc(1, sizeof(*e));
	if (!e)
		return fail(CUDA_ERROR_OUT_OF_MEMORY, "cuEventCreate", "no memory");
	e->flags = Flags;
	pthread_mutex_lock(&lock);
	e->serial = ++fk.event_serial;
	e->next = fk.events;
	fk.events = e;
	pthread_mutex_unlock(&lock);
	*phEvent = e;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent hEvent) {
	struct CUevent_st *e = NULL;
	CUresult r = need_ctx("cuEventDestroy", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	for (struct CUevent_st **pp = &fk.events; *pp; pp = &(*pp)->next)
		if (*pp == hEvent) {
			e = *pp;
			*pp = e->next;
			break;
		}
	pthread_mutex_unlock(&lock);
	if (!e)
		return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventDestroy", "unknown event %p",
		            (void *)hEvent);
	free(e);
	return CUDA_SUCCESS;
}

/* Everything queued before is done already, so the event completes at once: now. */
CUresult CUDAAPI cuEventRecord(CUevent hEvent, CUstream hStream) {
	CUresult r = need_ctx("cuEventRecord", NULL);
	struct timespec now;

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	clock_gettime(CLOCK_MONOTONIC, &now);
	pthread_mutex_lock(&lock);
	if (!is_event(hEvent))
		r = fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord", "unknown event %p", (void *)hEvent);
	else if (!is_stream(hStream))
		r = fail(CUDA_ERROR_INVALID_HANDLE, "cuEventRecord", "unknown stream %p",
		         (void *)hStream);
	else {
		/* Recorded after what its stream waits for. */
		if (waits_for_legacy(hStream))
			land_late_locked();
		hEvent->recorded = true;
		hEvent->at = now;
	}
	pthread_mutex_unlock(&lock);
	return r;
}

/* What waiting for, or asking after, an event answers here: it completed when recorded, so
 * only the context and the handle are checked. */
static CUresult event_complete(const char *call, CUevent hEvent) {
	CUresult r = need_ctx(call, NULL);
	bool ok;

	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	ok = is_event(hEvent);
	pthread_mutex_unlock(&lock);
	return ok ? CUDA_SUCCESS : fail(CUDA_ERROR_INVALID_HANDLE, call, "unknown event %p", (void *)hEvent);
}

CUresult CUDAAPI cuEventSynchronize(CUevent hEvent) {
	COUNT(0);
	return event_complete("cuEventSynchronize", hEvent);
}

/*
 * Interprocess events (legacy IPC): the handle names the event by its exporter's pid and
 * its serial (a new event at a destroyed one's address gets another handle, as from the
 * driver, whose handles name shared memory made for each event); an opened one is an event
 * of this process that is complete, since every copy and launch here finished when it
 * returned; with KVD_FAKE_CUDA_IPC_EVENT_PENDING=N (read at the open), the first N
 * cuEventQuery calls on it say CUDA_ERROR_NOT_READY, as while the engine's work runs. The
 * driver refuses events made without CU_EVENT_INTERPROCESS (CUDA_ERROR_INVALID_VALUE), as
 * here, and both calls on a device without CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED
 * (KVD_FAKE_CUDA_IPC_EVENTS=0: CUDA_ERROR_NOT_SUPPORTED).
 */
struct fake_ipc_event {
	uint64_t magic, pid, serial;
};

#define FAKE_IPC_EVENT_MAGIC UINT64_C(0x6b76642d69706365) /* "kvd-ipce" */

CUresult CUDAAPI cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event) {
	struct fake_ipc_event h = { FAKE_IPC_EVENT_MAGIC, (uint64_t)getpid(), 0 };
	CUresult r = need_ctx("cuIpcGetEventHandle", NULL);
	unsigned flags = 0;
	bool ok;

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!ipc_events())
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuIpcGetEventHandle", "no IPC events "
		            "(KVD_FAKE_CUDA_IPC_EVENTS=0)");
	if (!pHandle)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcGetEventHandle", "NULL");
	pthread_mutex_lock(&lock);
	ok = is_event(event);
	if (ok) {
		flags = event->flags;
		h.serial = event->serial;
	}
	pthread_mutex_unlock(&lock);
	if (!ok)
		return fail(CUDA_ERROR_INVALID_HANDLE, "cuIpcGetEventHandle", "unknown event");
	if (!(flags & CU_EVENT_INTERPROCESS))
		return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcGetEventHandle",
		            "the event was not created with CU_EVENT_INTERPROCESS");
	memset(pHandle, 0, sizeof(*pHandle));
	memcpy(pHandle->reserved, &h, sizeof(h));
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle) {
	struct fake_ipc_event h;
	CUresult r = need_ctx("cuIpcOpenEventHandle", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!ipc_events())
		return fail(CUDA_ERROR_NOT_SUPPORTED, "cuIpcOpenEventHandle", "no IPC events "
		            "(KVD_FAKE_CUDA_IPC_EVENTS=0)");
	memcpy(&h, handle.reserved, sizeof(h));
	if (!phEvent || h.magic != FAKE_IPC_EVENT_MAGIC)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuIpcOpenEventHandle", "not an event handle");
	r = cuEventCreate(phEvent, CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
	if (r == CUDA_SUCCESS)
		(*phEvent)->pending = env_long("KVD_FAKE_CUDA_IPC_EVENT_PENDING", 0, 0, LONG_MAX);
	return r;
}

/* Complete at once, like everything here (cuEventSynchronize), but for an opened IPC
 * event's pending queries (above). */
CUresult CUDAAPI cuEventQuery(CUevent hEvent) {
	CUresult r = need_ctx("cuEventQuery", NULL);
	bool ok, pending = false;

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	pthread_mutex_lock(&lock);
	ok = is_event(hEvent);
	if (ok && hEvent->pending > 0) {
		hEvent->pending--;
		pending = true;
	}
	pthread_mutex_unlock(&lock);
	if (!ok)
		return fail(CUDA_ERROR_INVALID_HANDLE, "cuEventQuery", "unknown event %p", (void *)hEvent);
	return pending ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

/* The time between the two records; the driver refuses events that were never recorded or
 * that do not time (CUDA_ERROR_INVALID_HANDLE). The driver of CUDA 12.8 and later exports
 * it as cuEventElapsedTime_v2, what cuda.h maps the name to; older ones (R535, R550) under
 * the plain name only, as the fake built with FAKE_CUDA_PRE_12_8 does. */
#ifdef FAKE_CUDA_PRE_12_8
#undef cuEventElapsedTime
CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);
#endif
CUresult CUDAAPI cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
	CUresult r = need_ctx("cuEventElapsedTime", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!pMilliseconds)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuEventElapsedTime", "NULL");
	pthread_mutex_lock(&lock);
	if (!is_event(hStart) || !is_event(hEnd) || !hStart->recorded || !hEnd->recorded ||
	    ((hStart->flags | hEnd->flags) & CU_EVENT_DISABLE_TIMING))
		r = fail(CUDA_ERROR_INVALID_HANDLE, "cuEventElapsedTime",
		         "events unknown, not recorded or not timing");
	else
		*pMilliseconds = (float)((double)(hEnd->at.tv_sec - hStart->at.tv_sec) * 1e3 +
		                         (double)(hEnd->at.tv_nsec - hStart->at.tv_nsec) / 1e6);
	pthread_mutex_unlock(&lock);
	return r;
}

/* ---- modules and kernels: a fake cannot run SASS or PTX ---- */

/* What the driver says to a module with no code for this GPU: callers treat it as "no
 * usable kernels" (kvd_cuda_kernels_new returns -ENODEV); a driver older than the
 * toolkit that built the module says its PTX is too new. */
CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
	CUresult r = need_ctx("cuModuleLoadData", NULL);

	COUNT(0);
	if (r != CUDA_SUCCESS)
		return r;
	if (!module || !image)
		return fail(CUDA_ERROR_INVALID_VALUE, "cuModuleLoadData", "NULL");
	if (driver_version() < CUDA_VERSION)
		return fail(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "cuModuleLoadData",
		            "a module built for a newer driver");
	return fail(CUDA_ERROR_NO_BINARY_FOR_GPU, "cuModuleLoadData", "the fake driver runs no kernels");
}

/* No module was ever loaded, so no handle is one. */
CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
	COUNT(0);
	NEED_INIT("cuModuleUnload");
	return fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleUnload", "module %p", (void *)hmod);
}

CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
	COUNT(0);
	(void)hfunc;
	NEED_INIT("cuModuleGetFunction");
	return fail(CUDA_ERROR_INVALID_HANDLE, "cuModuleGetFunction", "module %p, %s", (void *)hmod,
	            name ? name : "(null)");
}

CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                void **kernelParams, void **extra) {
	CUresult r = need_ctx("cuLaunchKernel", NULL);

	COUNT(0);
	(void)gridDimX, (void)gridDimY, (void)gridDimZ, (void)blockDimX, (void)blockDimY;
	(void)blockDimZ, (void)sharedMemBytes, (void)hStream, (void)kernelParams, (void)extra;
	if (r != CUDA_SUCCESS)
		return r;
	return fail(CUDA_ERROR_INVALID_HANDLE, "cuLaunchKernel", "function %p", (void *)f);
}
