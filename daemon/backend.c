/* SPDX-License-Identifier: MIT */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "backend.h"
#include "backend-cuda.h"
#include "basic/macro.h"

/* Ordinals beyond this are typos, not GPUs. */
#define DEVICE_ORDINAL_MAX 255

const struct backend_ops *backend_find(const char *name) {
	if (strcmp(name, "host") == 0 || strcmp(name, "auto") == 0)
		return &backend_host_ops;
#ifdef KVD_HAVE_CUDA
	if (strcmp(name, "cuda") == 0)
		return &backend_cuda_ops;
#endif
	return NULL;
}

int backend_devices_check(const char *value, const char **ret_why) {
	static const char seps[] = " \t,";
	unsigned n = 0;

	if (strcmp(value, "all") == 0)
		return 0;
	for (const char *p = value + strspn(value, seps); *p; p += strspn(p, seps)) {
		char *end;
		long v = strtol(p, &end, 10);

		if (end == p || (*end && !strchr(seps, *end)) || v < 0 || v > DEVICE_ORDINAL_MAX) {
			*ret_why = "must be all, or device numbers (0 to 255) separated by spaces or commas";
			return -EINVAL;
		}
		p = end;
		n++;
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

void backend_close(void) {
#ifdef KVD_HAVE_CUDA
	backend_cuda_close();
#endif
}
