/* SPDX-License-Identifier: MIT */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>

#include "basic/cuda-dl.h"

#define STR_(x) #x
#define STR(x) STR_(x)

static struct cuda_dl dl;
static int dl_result;
static char dl_why[256];
static pthread_once_t dl_once = PTHREAD_ONCE_INIT;

static void dl_load_once(void) {
	CUresult cr;
	void *h;

	/* RTLD_NODELETE: function pointers into it outlive any handle we could close. */
	h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
	if (!h) {
		snprintf(dl_why, sizeof(dl_why), "no CUDA driver (%s)", dlerror());
		dl_result = -ENOENT;
		return;
	}
	/* STR() expands first: the symbol is the versioned name cuda.h maps the call to. */
#define CUDA_DL_RESOLVE(name)                                                                 \
	dl.name = (__typeof__(dl.name))dlsym(h, STR(name));                                   \
	if (!dl.name) {                                                                       \
		snprintf(dl_why, sizeof(dl_why), "the CUDA driver lacks %s (too old?)",       \
		         STR(name));                                                          \
		dl_result = -ENOSYS;                                                          \
		return;                                                                       \
	}
	CUDA_DL_SYMBOLS(CUDA_DL_RESOLVE)
#undef CUDA_DL_RESOLVE
	/* #name does not expand: it is the API's unversioned name. */
#define CUDA_DL_RESOLVE_COMPAT(name)                                                          \
	dl.name = (__typeof__(dl.name))dlsym(h, STR(name));                                   \
	if (!dl.name)                                                                         \
		dl.name = (__typeof__(dl.name))dlsym(h, #name);                               \
	if (!dl.name) {                                                                       \
		snprintf(dl_why, sizeof(dl_why), "the CUDA driver lacks %s and %s (too old?)", \
		         STR(name), #name);                                                   \
		dl_result = -ENOSYS;                                                          \
		return;                                                                       \
	}
	CUDA_DL_COMPAT_SYMBOLS(CUDA_DL_RESOLVE_COMPAT)
#undef CUDA_DL_RESOLVE_COMPAT

	cr = dl.cuInit(0);
	if (cr != CUDA_SUCCESS) {
		/* The toolkit's stub answers every call with CUDA_ERROR_STUB_LIBRARY; without
		 * a device the driver says CUDA_ERROR_NO_DEVICE. */
		snprintf(dl_why, sizeof(dl_why), "cuInit failed: %d %s", (int)cr,
		         cr == CUDA_ERROR_STUB_LIBRARY ? "(the toolkit's stub, not a driver)"
		         : cr == CUDA_ERROR_NO_DEVICE  ? "(no CUDA device)"
		                                       : "");
		dl_result = cr == CUDA_ERROR_NO_DEVICE ? -ENXIO : -ENODEV;
		return;
	}
	if (dl.cuDriverGetVersion(&dl.driver_version) != CUDA_SUCCESS)
		dl.driver_version = 0;
	cr = dl.cuDeviceGetCount(&dl.device_count);
	if (cr != CUDA_SUCCESS || dl.device_count <= 0) {
		snprintf(dl_why, sizeof(dl_why), "the CUDA driver sees no device");
		dl_result = -ENXIO;
		return;
	}
	snprintf(dl_why, sizeof(dl_why), "CUDA driver %d.%d, %d device(s)",
	         dl.driver_version / 1000, dl.driver_version % 1000 / 10, dl.device_count);
	dl_result = 0;
}

int cuda_dl_load(const struct cuda_dl **ret, const char **ret_why) {
	pthread_once(&dl_once, dl_load_once);
	if (ret_why)
		*ret_why = dl_why;
	if (dl_result < 0)
		return dl_result;
	*ret = &dl;
	return 0;
}

const char *cuda_dl_strerror(CUresult r) {
	static __thread char buf[32];
	const char *name = NULL;

	if (dl.cuGetErrorName && dl.cuGetErrorName(r, &name) == CUDA_SUCCESS && name)
		return name;
	snprintf(buf, sizeof(buf), "CUresult %d", (int)r);
	return buf;
}

bool cuda_dl_sticky(CUresult r) {
	switch (r) {
	case CUDA_ERROR_ILLEGAL_ADDRESS:
	case CUDA_ERROR_HARDWARE_STACK_ERROR:
	case CUDA_ERROR_ILLEGAL_INSTRUCTION:
	case CUDA_ERROR_MISALIGNED_ADDRESS:
	case CUDA_ERROR_INVALID_ADDRESS_SPACE:
	case CUDA_ERROR_INVALID_PC:
	case CUDA_ERROR_LAUNCH_FAILED:
		return true;
	default:
		return false;
	}
}

int cuda_dl_errno(CUresult r) {
	switch (r) {
	case CUDA_SUCCESS:
		return 0;
	case CUDA_ERROR_OUT_OF_MEMORY:
		return -ENOMEM;
	case CUDA_ERROR_INVALID_VALUE:
	case CUDA_ERROR_INVALID_HANDLE:
	case CUDA_ERROR_INVALID_DEVICE:
		return -EINVAL;
	case CUDA_ERROR_NOT_PERMITTED:
		return -EPERM;
	case CUDA_ERROR_NOT_SUPPORTED:
		return -EOPNOTSUPP;
	case CUDA_ERROR_NO_DEVICE:
	case CUDA_ERROR_DEVICE_UNAVAILABLE:
	case CUDA_ERROR_DEVICE_NOT_LICENSED:
		return -ENODEV;
	default:
		return -EIO;
	}
}
