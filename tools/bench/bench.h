/* SPDX-License-Identifier: MIT */
#pragma once

#include <stdint.h>
#include <time.h>

/*
 * The subcommands of kvd-bench beyond `load` (kvd-bench.c), and what they share.
 *
 * `kvd-bench score` (score.c) times the scoring kernels and eviction policies on one
 * Llama-3.1-8B-like layer next to this machine's compute and memory ceilings. argv[0] is
 * "score"; it returns the process exit status (0, 1 if a run failed, 2 on usage errors).
 */
int bench_score(int argc, char **argv);

/*
 * `kvd-bench evict` (evict.c) times the node-wide eviction selection (kvd_evict_greedy())
 * over 1M and 10M units next to the target. argv[0] is "evict"; it returns the
 * process exit status (0, 1 if a run failed, 2 on usage errors).
 */
int bench_evict(int argc, char **argv);

/*
 * The full-round benchmark against a running daemon (round.c): `kvd-bench evict --socket
 * PATH` calls it after the selection figures with the daemon's socket and the evict command
 * line (argv[0] "evict"; getopt has been through it: set optind = 0 to parse it again).
 * Returns the process exit status like bench_evict().
 */
int bench_evict_round(const char *socket, int argc, char **argv);

/*
 * `kvd-bench soak` (soak.c): many client processes of several tenants do random valid and
 * invalid operations against a running daemon for a set time, then check that nothing
 * leaked and nothing was corrupted. argv[0] is "soak"; it returns the process exit status
 * (0 when every check passed, 1 when one failed, 2 on usage errors).
 */
int bench_soak(int argc, char **argv);

/*
 * `kvd-bench ipc` (ipc.c): a per-step request's latency over the socket and through the
 * rings against the raw floors under each, and pin/unpin throughput with 1, 4 and 16
 * clients, against kvd daemons it starts. argv[0] is "ipc"; it returns the process exit
 * status (0, 1 if a measurement failed, 2 on usage errors).
 */
int bench_ipc(int argc, char **argv);

/*
 * `kvd-bench quality` (quality.c): the accuracy of every eviction policy on the kvd-lm
 * tasks, through a kvd daemon it starts, written as CSV, a markdown table and plots.
 * argv[0] is "quality"; it returns the process exit status (0, 1 if a run failed, 2 on
 * usage errors).
 */
int bench_quality(int argc, char **argv);
