/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The cuda backend (backend-cuda.c): one GPU's memory, in chunks made with cuMemCreate,
 * each exported once as a POSIX fd that clients import (libkvd, client/cuda.c), and mapped
 * by the daemon into its own address space on the device. The driver is loaded at run time
 * (kernels/cuda-dl.h); the daemon keeps the device's primary context current on its thread
 * and does its device work (scrubbing now, kernels later) on one stream of its own.
 *
 * Only built with the CUDA headers (KVD_HAVE_CUDA); backend.c is what the rest calls.
 */

#ifdef KVD_HAVE_CUDA
#include <cuda.h>

#include "backend.h"

/* Opens the first usable device of `devices` (see backend_open). Returns 0 and, in why,
 * what was opened; or -ENODEV with why saying what made every device unusable. */
int backend_cuda_open(const char *devices, char *why, size_t why_n);
const struct backend_device *backend_cuda_device(void);
void backend_cuda_close(void);

/* The daemon's stream, for the device kernels; NULL before backend_cuda_open. */
CUstream backend_cuda_stream(void);
#endif
