/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The CUDA driver API, loaded at run time. Nothing in kvd links libcuda: a binary that did
 * would not start on a machine without the NVIDIA driver (the daemon must fall back to the
 * host backend there, and libkvd must keep working against a host daemon). So the daemon,
 * libkvd and the GPU tests dlopen("libcuda.so.1") once, through cuda_dl_load(), and call
 * the driver through the function pointers of struct cuda_dl. Only the toolkit's cuda.h is
 * needed at build time.
 *
 * Members are named after the API, so that cu->cuMemGetInfo(...) reads like the API; cuda.h
 * maps some names to versioned entry points (cuMemGetInfo is cuMemGetInfo_v2), and the
 * symbol looked up is that versioned one, the same as a program linked with -lcuda gets.
 *
 * cuda_dl_load() runs once per process (pthread_once) and is safe from any thread; its
 * result and message stay valid for the life of the process. It never logs: callers say
 * what the failure means for them (the daemon falls back, libkvd refuses CUDA chunks).
 */

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

/* Every driver entry point kvd uses, in one list: the struct, the symbol table and the
 * check that every one resolved all come from it. */
#define CUDA_DL_SYMBOLS(X)                                                                    \
	X(cuInit)                                                                             \
	X(cuDriverGetVersion)                                                                 \
	X(cuGetErrorName)                                                                     \
	X(cuGetErrorString)                                                                   \
	X(cuDeviceGetCount)                                                                   \
	X(cuDeviceGet)                                                                        \
	X(cuDeviceGetName)                                                                    \
	X(cuDeviceGetAttribute)                                                               \
	X(cuDeviceGetUuid)                                                                    \
	X(cuDevicePrimaryCtxRetain)                                                           \
	X(cuDevicePrimaryCtxRelease)                                                          \
	X(cuCtxSetCurrent)                                                                    \
	X(cuCtxGetCurrent)                                                                    \
	X(cuCtxGetDevice)                                                                     \
	X(cuCtxPushCurrent)                                                                   \
	X(cuCtxPopCurrent)                                                                    \
	X(cuCtxSynchronize)                                                                   \
	X(cuMemGetInfo)                                                                       \
	X(cuMemGetAllocationGranularity)                                                      \
	X(cuMemCreate)                                                                        \
	X(cuMemRelease)                                                                       \
	X(cuMemExportToShareableHandle)                                                       \
	X(cuMemImportFromShareableHandle)                                                     \
	X(cuMemAddressReserve)                                                                \
	X(cuMemAddressFree)                                                                   \
	X(cuMemMap)                                                                           \
	X(cuMemUnmap)                                                                         \
	X(cuMemSetAccess)                                                                     \
	X(cuMemsetD8Async)                                                                    \
	X(cuMemcpyHtoD)                                                                       \
	X(cuMemcpyDtoH)                                                                       \
	X(cuMemcpyDtoD)                                                                       \
	X(cuMemcpy2D)                                                                         \
	X(cuMemcpy2DAsync)                                                                    \
	X(cuMemcpy2DUnaligned)                                                                \
	X(cuMemcpyHtoDAsync)                                                                  \
	X(cuMemcpyDtoHAsync)                                                                  \
	X(cuMemHostRegister)                                                                  \
	X(cuMemHostUnregister)                                                                \
	X(cuMemAlloc)                                                                         \
	X(cuMemFree)                                                                          \
	X(cuStreamCreate)                                                                     \
	X(cuStreamDestroy)                                                                    \
	X(cuStreamSynchronize)                                                                \
	X(cuEventCreate)                                                                      \
	X(cuEventDestroy)                                                                     \
	X(cuEventRecord)                                                                      \
	X(cuEventSynchronize)                                                                 \
	X(cuEventQuery)                                                                       \
	X(cuIpcGetEventHandle)                                                                \
	X(cuIpcOpenEventHandle)                                                               \
	X(cuModuleLoadData)                                                                   \
	X(cuModuleUnload)                                                                     \
	X(cuModuleGetFunction)                                                                \
	X(cuLaunchKernel)

/*
 * Entry points whose versioned name in these headers is newer than the oldest driver kvd
 * supports (CUDA 11.4, R470: README.md): looked up under that name, else under the API's
 * unversioned one, whose arguments are the same. cuEventElapsedTime_v2 came with CUDA 12.8
 * (R570); R535 and R550 drivers, still common, have cuEventElapsedTime only. Never put a
 * name here whose old entry point takes other arguments (cuMemGetInfo's took 32-bit
 * sizes).
 */
#define CUDA_DL_COMPAT_SYMBOLS(X) X(cuEventElapsedTime)

struct cuda_dl {
#define CUDA_DL_MEMBER(name) __typeof__(&name) name;
	CUDA_DL_SYMBOLS(CUDA_DL_MEMBER)
	CUDA_DL_COMPAT_SYMBOLS(CUDA_DL_MEMBER)
#undef CUDA_DL_MEMBER
	int driver_version;           /* cuDriverGetVersion: 1000 * major + 10 * minor */
	int device_count;
};

/*
 * Loads libcuda.so.1, resolves every symbol (those of CUDA_DL_COMPAT_SYMBOLS under either
 * name) and calls cuInit(0). Returns 0 and the table in *ret, or -ENOENT (no libcuda.so.1:
 * no driver), -ENOSYS (a symbol is missing: a driver older than kvd needs), -ENODEV (cuInit failed: no usable GPU, or the toolkit's stub
 * library was found instead of a driver), -ENXIO (a driver, but no device). *ret_why (may be
 * NULL) gets a sentence saying which, for messages.
 */
int cuda_dl_load(const struct cuda_dl **ret, const char **ret_why);

/* The driver's name for an error ("CUDA_ERROR_OUT_OF_MEMORY"), or "CUresult N". */
const char *cuda_dl_strerror(CUresult r);

/* An errno for a CUresult, for the -errno convention: -ENOMEM for out-of-memory errors,
 * -EINVAL for invalid values and handles, -ENODEV for lost devices, -EIO otherwise. */
int cuda_dl_errno(CUresult r);

/* Whether r is a sticky error: one after which the context is lost, every later call in
 * it failing the same way until the process ends (a kernel's illegal address, a launch
 * failure, an illegal instruction and their kin). */
bool cuda_dl_sticky(CUresult r);
