/* SPDX-License-Identifier: MIT */
#pragma once

/*
 * The subcommands of kvd-bench beyond `load` (kvd-bench.c).
 *
 * `kvd-bench score` (score.c) times the scoring kernels and eviction policies on one
 * Llama-3.1-8B-like layer next to this machine's compute and memory ceilings. argv[0] is
 * "score"; it returns the process exit status (0, 1 if a run failed, 2 on usage errors).
 */
int bench_score(int argc, char **argv);
