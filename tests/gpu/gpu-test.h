/* SPDX-License-Identifier: MIT */
#pragma once

#include <stdio.h>

#include "basic/cuda-dl.h"

/*
 * Says on stdout which GPU (device 0) and driver a GPU test runs on, as the line
 * "ran on: NAME (WHY)", WHY being cuda_dl_load's: tools/gpu-check reports it for each test,
 * since a pass under the fake driver (tests/fake-cuda) is not a run on a GPU.
 */
static inline void gpu_test_ran_on(const struct cuda_dl *cu, const char *why) {
	char name[96] = "?";
	CUdevice dev;

	if (cu->cuDeviceGet(&dev, 0) == CUDA_SUCCESS)
		(void)cu->cuDeviceGetName(name, sizeof(name), dev);
	printf("ran on: %s (%s)\n", name, why);
	fflush(stdout);
}
