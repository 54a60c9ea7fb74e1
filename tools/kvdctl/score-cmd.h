/* SPDX-License-Identifier: MIT */
#pragma once

/* `kvdctl score`: offline scoring of .npy tensors with the kernels' policies (score.c). */
int cmd_score(int argc, char **argv);
