#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""What a decode step's kvd calls cost through the binding and kvd.paged, for a batch of
sequences and every layer. The block tables: one Seq.block_table call per sequence and
layer, padded into a tensor (what kvd.paged.block_tables did before kvd_seq_block_tables),
per layer in one call (kvd.paged.block_tables, positions=False), and every layer in one
call (kvd.paged.block_tables_layers). Then the whole step, each sequence grown by a token
and pinned, the tables, each unpinned: per sequence (Seq.grow, Seq.pin, the tables per
sequence and layer, Seq.unpin) against the batch calls (Client.grow_batch, pin_batch,
block_tables_layers, unpin_batch), and those for one sequence. Starts a kvd of its own
(host backend); prints the median and p99 of each and their ratios. A benchmark: nothing
asserts on timings; the last lines set what the batch costs beside one sequence's.

    PYTHONPATH=build/client/python tools/bench/paged-tables.py --kvd build/daemon/kvd
"""

import argparse
import sys
import time

import torch

import benchdaemon
import kvd
import kvd.paged as paged


def per_sequence(seqs, layer):
    """A layer's padded table, a Seq.block_table call per sequence."""
    tables = [torch.from_dlpack(s.block_table(layer)[0]) for s in seqs]
    table = torch.zeros((len(seqs), max(len(t) for t in tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    return table


def step_per_sequence(seqs, layers):
    for s in seqs:
        s.grow(1)
        s.pin()
    for layer in range(layers):
        per_sequence(seqs, layer)
    for s in seqs:
        s.unpin()


def step_batched(client, seqs, layers):
    if any(client.grow_batch(seqs, 1)) or any(client.pin_batch(seqs)):
        raise RuntimeError("a grow or pin of the batch was refused")
    paged.block_tables_layers(seqs, 0, layers)
    if any(client.unpin_batch(seqs)):
        raise RuntimeError("an unpin of the batch was refused")


def timed(fn, steps):
    ns = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fn()
        ns.append(time.perf_counter_ns() - t0)
    ns.sort()
    return ns[len(ns) // 2] / 1e3, ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default="build/daemon/kvd", help="the daemon to start")
    ap.add_argument("--seqs", type=int, default=32, help="sequences in the batch (32)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the model (32)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of each sequence (1024)")
    ap.add_argument("--steps", type=int, default=100, help="steps timed (100)")
    args = ap.parse_args()

    with benchdaemon.daemon(args.kvd, "8GiB") as sock:
        with kvd.Client(sock, "bench-tables") as c:
            # Llama-3.1-8B's KV: 8 kv heads of 128, f16, blocks of 16 tokens.
            m = c.register_model(args.layers, 32, 8, 128, kvd.DTYPE_F16, 16)
            # Each step of the step rows grows every sequence by a token (warm-ups included).
            seqs = [c.open(m, args.tokens + 3 * (args.steps + 1)) for _ in range(args.seqs)]
            for s in seqs:
                s.grow(args.tokens)
                s.pin()
            layers = range(args.layers)
            rows = [
                ("per layer and sequence", lambda: [per_sequence(seqs, layer) for layer in layers]),
                ("per layer, one call (no positions)",
                 lambda: [paged.block_tables(seqs, layer, positions=False) for layer in layers]),
                ("every layer, one call", lambda: paged.block_tables_layers(seqs, 0, args.layers)),
                ("one sequence: every layer, one call",
                 lambda: paged.block_tables_layers(seqs[:1], 0, args.layers)),
            ]
            results = []
            for name, fn in rows:
                fn()
                results.append((name, *timed(fn, args.steps)))
            for s in seqs:
                s.unpin()
            steps = [
                ("step, per sequence", lambda: step_per_sequence(seqs, args.layers)),
                ("step, batch calls", lambda: step_batched(c, seqs, args.layers)),
                ("step, batch calls, one sequence", lambda: step_batched(c, seqs[:1], args.layers)),
            ]
            for name, fn in steps:
                fn()
                results.append((name, *timed(fn, args.steps)))
            for s in seqs:
                s.release()
        print(f"paged-tables: {args.seqs} sequences of {args.tokens} tokens, {args.layers} "
              f"layers, {args.steps} steps (median / p99, us a step):")
        for k, (name, p50, p99) in enumerate(results):
            base = results[0 if k < 4 else 4][1]
            print(f"  {name:38s} {p50:9.1f} / {p99:9.1f}   {base / p50:6.1f}x the first's speed")
        print(f"  tables: the batch in one call / one sequence in one call: "
              f"{results[2][1] / results[3][1]:.2f}x")
        print(f"  step: the batch in batch calls / one sequence in them: "
              f"{results[5][1] / results[6][1]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
