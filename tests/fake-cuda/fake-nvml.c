/* SPDX-License-Identifier: MIT */
/*
 * A fake NVML: the libnvidia-ml.so.1 that daemon/memory/nvml.c loads in place of the driver's when
 * this directory leads LD_LIBRARY_PATH, beside the fake CUDA driver. It knows the fake
 * driver's devices by the UUIDs that driver gives them (KVD_FAKE_CUDA_DEVICES of them) and
 * says they are in persistence mode unless KVD_FAKE_NVML_PERSISTENCE=0. Only the calls kvd
 * makes; a test double, never installed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_FOUND 6

/* NVML's prototypes (nvml.h is not everywhere the toolkit is). */
nvmlReturn_t nvmlInit_v2(void);
nvmlReturn_t nvmlShutdown(void);
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device);
nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode);

static int initialized;

static long env_long(const char *name, long def) {
	const char *s = getenv(name);

	return s && *s ? strtol(s, NULL, 10) : def;
}

nvmlReturn_t nvmlInit_v2(void) {
	initialized++;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
	if (initialized == 0)
		return NVML_ERROR_UNINITIALIZED;
	initialized--;
	return NVML_SUCCESS;
}

/* The fake driver's UUID of device d is the bytes "kvd-fake-cuda-" d 0xfa. */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
	static const char prefix[] = "GPU-6b76642d-6661-6b65-2d63-7564612d3";
	long devices = env_long("KVD_FAKE_CUDA_DEVICES", 1);

	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	if (!uuid || !device)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (strncmp(uuid, prefix, sizeof(prefix) - 1) != 0 || strlen(uuid) != sizeof(prefix) + 2 ||
	    strcmp(uuid + sizeof(prefix), "fa") != 0 || uuid[sizeof(prefix) - 1] < '0' ||
	    uuid[sizeof(prefix) - 1] - '0' >= devices)
		return NVML_ERROR_NOT_FOUND;
	*device = (nvmlDevice_t)(uintptr_t)(uuid[sizeof(prefix) - 1] - '0' + 1);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	if (!device || !mode)
		return NVML_ERROR_INVALID_ARGUMENT;
	*mode = env_long("KVD_FAKE_NVML_PERSISTENCE", 1) != 0;
	return NVML_SUCCESS;
}
