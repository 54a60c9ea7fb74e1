/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * What cuda-kernels.c and its tests share: the embedded module (generated at build time by
 * kernels/embed-fatbin.py from nvcc's fatbin) and the list of kernels it must contain, each
 * named kvd_cu_<name> in cuda-kernels.cu.
 */

#include <stddef.h>

extern const unsigned char kvd_cuda_fatbin[];
extern const size_t kvd_cuda_fatbin_size;

#define KVD_CUDA_KERNELS(X)                                                                   \
	X(attn_logits)                                                                        \
	X(softmax)                                                                            \
	X(temporal)                                                                           \
	X(mix_partial)                                                                        \
	X(mix_final)                                                                          \
	X(restkv_cost)                                                                        \
	X(vgv)                                                                                \
	X(laprox_diag)                                                                        \
	X(laprox_group)                                                                       \
	X(aws_rows)                                                                           \
	X(aws_final)                                                                          \
	X(pool)                                                                               \
	X(group_sum)                                                                          \
	X(norm_partial)                                                                       \
	X(norm_apply)                                                                         \
	X(topk_rows)                                                                          \
	X(gsel_init)                                                                          \
	X(gsel_hist)                                                                          \
	X(gsel_pick)                                                                          \
	X(gsel_count)                                                                         \
	X(gsel_scan)                                                                          \
	X(gsel_write)                                                                         \
	X(gsel_counts)                                                                        \
	X(gsel_index)                                                                         \
	X(gather)
