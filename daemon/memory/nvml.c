/* SPDX-License-Identifier: MIT */
#include <dlfcn.h>
#include <errno.h>

#include "nvml.h"

/* The few NVML declarations used (nvml.h is not in every toolkit install); the ABI is
 * NVML's, stable since the _v2 init of CUDA 5. */
typedef int nvml_return;
typedef struct nvml_device *nvml_device;
#define NVML_SUCCESS 0
#define NVML_ERROR_NOT_FOUND 6
#define NVML_FEATURE_ENABLED 1

int nvml_persistence_mode(const char *uuid) {
	nvml_return (*init)(void), (*shutdown)(void);
	nvml_return (*by_uuid)(const char *, nvml_device *);
	nvml_return (*persistence)(nvml_device, int *);
	nvml_device dev;
	int mode = 0, r = -EIO;
	nvml_return nr;
	void *h;

	h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return -ENOENT;
	init = (nvml_return (*)(void))dlsym(h, "nvmlInit_v2");
	shutdown = (nvml_return (*)(void))dlsym(h, "nvmlShutdown");
	by_uuid = (nvml_return (*)(const char *, nvml_device *))dlsym(h, "nvmlDeviceGetHandleByUUID");
	persistence = (nvml_return (*)(nvml_device, int *))dlsym(h, "nvmlDeviceGetPersistenceMode");
	if (!init || !shutdown || !by_uuid || !persistence) {
		dlclose(h);
		return -ENOENT;
	}
	if (init() == NVML_SUCCESS) {
		nr = by_uuid(uuid, &dev);
		if (nr == NVML_SUCCESS && persistence(dev, &mode) == NVML_SUCCESS)
			r = mode == NVML_FEATURE_ENABLED;
		else if (nr == NVML_ERROR_NOT_FOUND)
			r = -ENODEV;
		(void)shutdown();
	}
	dlclose(h);
	return r;
}
