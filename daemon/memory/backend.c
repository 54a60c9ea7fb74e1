/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "config.h"
#include "backend.h"
#include "backend-cuda.h"
#include "basic/macro.h"
#ifdef KVD_HAVE_CUDA
#include "basic/cuda-dl.h"
#endif

/* Device numbers beyond this are typos, not GPUs. */
#define DEVICE_INDEX_MAX 255

const struct backend_ops *backend_find(const char *name) {
	if (strcmp(name, "host") == 0 || strcmp(name, "auto") == 0)
		return &backend_host_ops;
#ifdef KVD_HAVE_CUDA
	if (strcmp(name, "cuda") == 0)
		return &backend_cuda_ops;
#endif
	return NULL;
}

void backend_uuid_format(const uint8_t uuid[16], char buf[BACKEND_UUID_STRLEN]) {
	char *w = buf + sprintf(buf, "GPU-");

	for (unsigned i = 0; i < 16; i++)
		w += sprintf(w, "%s%02x", i == 4 || i == 6 || i == 8 || i == 10 ? "-" : "", uuid[i]);
}

/* Parses "GPU-" and 32 hex digits, dashed as nvidia-smi prints them (8-4-4-4-12; the
 * dashes may be left out), up to end. */
static bool uuid_parse(const char *p, const char *end, uint8_t uuid[16]) {
	unsigned n = 0, dashed = 0;

	if (end - p < 4 || strncasecmp(p, "GPU-", 4) != 0)
		return false;
	for (p += 4; p < end; p++) {
		int v;

		if (*p == '-' && (n == 8 || n == 12 || n == 16 || n == 20) && dashed != n) {
			dashed = n;
			continue;
		}
		if (n == 32)
			return false;
		v = *p >= '0' && *p <= '9' ? *p - '0' :
		    *p >= 'a' && *p <= 'f' ? *p - 'a' + 10 :
		    *p >= 'A' && *p <= 'F' ? *p - 'A' + 10 : -1;
		if (v < 0)
			return false;
		uuid[n / 2] = (uint8_t)(n % 2 ? uuid[n / 2] | v : v << 4);
		n++;
	}
	return n == 32;
}

int backend_devices_next(const char **p, struct backend_device_ref *ret) {
	static const char seps[] = " \t,";
	const char *start = *p + strspn(*p, seps), *end = start + strcspn(start, seps);

	if (start == end)
		return 0;
	*p = end;
	*ret = (struct backend_device_ref){ .index = -1 };
	if (uuid_parse(start, end, ret->uuid))
		return 1;
	if (start[0] >= '0' && start[0] <= '9' && end - start <= 3) {
		int v = 0;

		for (const char *q = start; q < end && v >= 0; q++)
			v = *q >= '0' && *q <= '9' ? v * 10 + *q - '0' : -1;
		if (v >= 0 && v <= DEVICE_INDEX_MAX) {
			ret->index = v;
			return 1;
		}
	}
	return -EINVAL;
}

int backend_devices_check(const char *value, const char **ret_why) {
	struct backend_device_ref ref;
	unsigned n = 0;
	int r;

	if (strcmp(value, "all") == 0)
		return 0;
	while ((r = backend_devices_next(&value, &ref)) > 0)
		n++;
	if (r < 0) {
		*ret_why = "must be all, or GPUs separated by spaces or commas, each a number (0 to "
		           "255, in PCI bus order) or a UUID (GPU-..., as nvidia-smi -L prints it)";
		return -EINVAL;
	}
	if (n == 0) {
		*ret_why = "must be all or name at least one device";
		return -EINVAL;
	}
	return 0;
}

/* The kernel's policy for huge pages in shared memory (the word in brackets of
 * shmem_enabled: always, within_size, advise, never, deny, force), or "unknown". The host
 * backend's chunks get them with "advise" and the ones above it. */
static const char *shmem_huge_pages(char *buf, size_t n) {
	_cleanup_(fclosep) FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
	char line[256], *open_b, *close_b;

	if (!f || !fgets(line, sizeof(line), f) || !(open_b = strchr(line, '[')) ||
	    !(close_b = strchr(open_b, ']')))
		return "unknown";
	*close_b = '\0';
	snprintf(buf, n, "%s", open_b + 1);
	return buf;
}

int backend_open(const char *name, const char *devices, const struct backend_ops **ret,
                 char *why, size_t why_n) {
	char cuda_why[256];

	if (strcmp(name, "host") == 0) {
		char huge[32];
		const char *h = shmem_huge_pages(huge, sizeof(huge));
		bool off = strcmp(h, "never") == 0 || strcmp(h, "deny") == 0;

		snprintf(why, why_n, "host (memfd chunks; shared-memory huge pages: %s%s), as configured",
		         h, off ? ", so releasing many chunks at once takes milliseconds: see "
		         "kvd(8), HUGE PAGES" : "");
		*ret = &backend_host_ops;
		return 0;
	}
#ifdef KVD_HAVE_CUDA
	if (backend_cuda_open(devices, cuda_why, sizeof(cuda_why)) >= 0) {
		snprintf(why, why_n, "%s", cuda_why);
		*ret = &backend_cuda_ops;
		return 0;
	}
#else
	(void)devices;
	snprintf(cuda_why, sizeof(cuda_why), "this kvd was built without the cuda backend "
	         "(no CUDA headers at build time)");
#endif
	if (strcmp(name, "cuda") == 0) {
		snprintf(why, why_n, "backend cuda unusable: %s", cuda_why);
		return -ENODEV;
	}
	snprintf(why, why_n, "no usable GPU (%s): falling back to host (memfd chunks)", cuda_why);
	*ret = &backend_host_ops;
	return 0;
}

bool backend_nvidia_driver_loaded(void) {
	const char *path = "/proc/driver/nvidia/version";

#if KVD_TEST_HOOKS
	if (getenv("KVD_TEST_NVIDIA_DRIVER"))
		path = getenv("KVD_TEST_NVIDIA_DRIVER");
#endif
	return access(path, F_OK) == 0;
}

uint32_t backend_n_devices(void) {
#ifdef KVD_HAVE_CUDA
	return MAX(backend_cuda_n_devices(), 1u);
#else
	return 1;
#endif
}

const struct backend_device *backend_device(uint32_t i) {
#ifdef KVD_HAVE_CUDA
	return backend_cuda_device(i);
#else
	(void)i;
	return NULL;
#endif
}

void backend_devices_text(char *buf, size_t n) {
	size_t w = 0;

	buf[0] = '\0';
	for (uint32_t i = 0; i < backend_n_devices() && w < n; i++) {
		const struct backend_device *dev = backend_device(i);
		char uuid[BACKEND_UUID_STRLEN], name[sizeof(dev->name)];

		if (!dev)
			break;
		backend_uuid_format(dev->uuid, uuid);
		/* One word: the lines are split on spaces. */
		snprintf(name, sizeof(name), "%s", dev->name);
		for (char *p = name; *p; p++)
			if (*p == ' ' || *p < 0x20 || *p > 0x7e)
				*p = '_';
		int failed = __atomic_load_n(&dev->failed, __ATOMIC_RELAXED);

		w += (size_t)snprintf(buf + w, n - w, "%sGPU %d %s %s name=%s memory_mib=%llu rdma=%s "
		                      "persistence=%s ipc_events=%s failed=%s", i ? "\n" : "",
		                      dev->index, uuid, dev->pci_bus_id, name,
		                      (unsigned long long)(dev->total_bytes >> 20),
		                      dev->rdma ? "yes" : "no", dev->persistence > 0 ? "on" :
		                      dev->persistence == 0 ? "off" : "unknown",
		                      dev->ipc_events ? "yes" : "no",
		                      failed ? backend_error_name(failed) : "no");
	}
}

const char *backend_error_name(int failed) {
#ifdef KVD_HAVE_CUDA
	return cuda_dl_strerror((CUresult)failed);
#else
	static __thread char buf[24];

	snprintf(buf, sizeof(buf), "error %d", failed);
	return buf;
#endif
}

void backend_close(void) {
#ifdef KVD_HAVE_CUDA
	backend_cuda_close();
#endif
}
