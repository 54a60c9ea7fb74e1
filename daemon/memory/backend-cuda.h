/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The cuda backend (backend-cuda.c): GPUs' memory, in chunks made with cuMemCreate,
 * each exported once as a POSIX fd that clients import (libkvd, client/cuda-import.c), and mapped
 * by the daemon into its own address space on the device. The driver is loaded at run time
 * (basic/cuda-dl.h); the daemon uses each device's primary context, made current by every
 * call that needs it, and scrubs on one stream of its own per device.
 *
 * Only built with the CUDA headers (KVD_HAVE_CUDA); backend.c is what the rest calls.
 */

#ifdef KVD_HAVE_CUDA
#include <cuda.h>

#include "backend.h"

/* Opens every usable device of `devices` (see backend_open), logging those it skips.
 * Returns 0 and, in why, what was opened; or -ENODEV with why saying what made the last
 * device unusable. */
int backend_cuda_open(const char *devices, char *why, size_t why_n);
uint32_t backend_cuda_n_devices(void);
const struct backend_device *backend_cuda_device(uint32_t i);
void backend_cuda_close(void);
/* Device i's primary context (retained while the backend is open), or NULL. */
CUcontext backend_cuda_context(uint32_t i);
/* A driver call on device i failed with cr: when it is a sticky error, the device is marked
 * failed (backend_device.failed) and that is logged, once. Any thread. */
void backend_cuda_failed(uint32_t i, CUresult cr, const char *call);
/*
 * A 2D copy in the current context: on stream (asynchronous), or synchronous when stream is
 * NULL. The driver may refuse a device-to-device copy whose pitches cuMemAllocPitch did not
 * make (CUDA_ERROR_INVALID_VALUE, as its documentation allows): such a copy is done by
 * cuMemcpy2DUnaligned after stream's queued work, and said once in the log. Returns 0 or
 * -errno.
 */
int backend_cuda_copy_2d(const CUDA_MEMCPY2D *m, CUstream stream);
#endif
