/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What only NVML (libnvidia-ml.so.1, which comes with the NVIDIA driver) says about a GPU,
 * loaded at run time as the CUDA driver is: no kvd binary links it.
 */

/*
 * Whether the GPU of UUID `uuid` ("GPU-...", as nvidia-smi prints it) is in persistence
 * mode: the driver keeps it initialised while no process uses it, by nvidia-persistenced or
 * legacy persistence mode. Without it, the driver tears the device down when its last user
 * exits, and with it every allocation, exported or not. Returns 1 (on), 0 (off), -ENOENT
 * (no NVML here), -ENODEV (NVML does not know the GPU) or -EIO (NVML failed).
 */
int nvml_persistence_mode(const char *uuid);
