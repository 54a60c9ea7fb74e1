/* SPDX-License-Identifier: MIT */
#pragma once

#include <stdint.h>
#include <time.h>

/*
 * The subcommands of kvd-bench beyond `load` (kvd-bench.c).
 *
 * `kvd-bench score` (score.c) times the scoring kernels and eviction policies on one
 * Llama-3.1-8B-like layer next to this machine's compute and memory ceilings. argv[0] is
 * "score"; it returns the process exit status (0, 1 if a run failed, 2 on usage errors).
 */
int bench_score(int argc, char **argv);

/*
 * `kvd-bench evict` (evict.c) times the node-wide eviction selection (kvd_evict_greedy())
 * over 1M and 10M units next to its target. argv[0] is "evict"; it returns the
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
 * `kvd-bench ipc` (ipc.c): a per-step request's latency over the socket and through the
 * rings against the raw floors under each, and pin/unpin throughput with 1, 4 and 16
 * clients, against kvd daemons it starts. argv[0] is "ipc"; it returns the process exit
 * status (0, 1 if a measurement failed, 2 on usage errors).
 */
int bench_ipc(int argc, char **argv);


/*
 * `kvd-bench table` (table.c): the export of a paged block table (kvd_seq_block_table) for
 * one layer of a long sequence, against a running daemon. argv[0] is "table"; it returns
 * the process exit status (0, 1 if a measurement failed, 2 on usage errors).
 */
int bench_table(int argc, char **argv);

/*
 * `kvd-bench step` (step.c): one decode step's kvd calls from C (grow, pin, observation
 * windows, unpin) against a running daemon; tools/bench/binding-step.py compares the
 * Python binding with it. argv[0] is "step"; returns the process exit status.
 */
int bench_step(int argc, char **argv);

/*
 * `kvd-bench tier` (tier.c): a sequence moved to the daemon's host tier and back, one
 * Llama-3.1-8B-like layer and a whole model, next to a memcpy floor, against a running
 * daemon with a host tier. argv[0] is "tier"; returns the process exit status.
 */
int bench_tier(int argc, char **argv);

/*
 * `kvd-bench lookup` (lookup.c): kvd_prefix_lookup of a long prompt by keys and by token
 * ids, held by a sequence and by the prefix cache, and a prefix open that finds the prompt
 * cached against an open and grow, against a running daemon. argv[0] is "lookup"; returns
 * the process exit status.
 */
int bench_lookup(int argc, char **argv);
