#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""What the Python binding costs an engine per decode step, against the same calls from C.

Starts a kvd of its own (host backend), then times one decode step's kvd calls through the
binding -- grow by 1, pin, each of 4 layers' observation window (Seq.observation, then
Seq.observe), unpin -- and runs `kvd-bench step`, which makes the same calls from C against
the same daemon, and prints both and their ratio (docs/python.md). A benchmark: nothing
asserts on timings.

    PYTHONPATH=build/client/python tools/bench/binding-step.py \\
        --kvd build/daemon/kvd --bench build/tools/bench/kvd-bench
"""

import argparse
import re
import subprocess
import sys
import time

import benchdaemon
import kvd

LAYERS = 4


def step(s):
    s.grow(1)
    s.pin()
    for layer in range(LAYERS):
        s.observation(layer)
        s.observe(layer)
    s.unpin()


def percentile_us(sorted_ns, p):
    rank = max(1, min(len(sorted_ns), int(p / 100 * len(sorted_ns) + 0.999999)))
    return sorted_ns[rank - 1] / 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default="build/daemon/kvd", help="the daemon to start")
    ap.add_argument("--bench", default="build/tools/bench/kvd-bench", help="kvd-bench")
    ap.add_argument("--steps", type=int, default=2000, help="steps timed (default 2000)")
    args = ap.parse_args()

    with benchdaemon.daemon(args.kvd, "1GiB") as sock:
        with kvd.Client(sock, "bench-step-py") as c:
            m = c.register_model(LAYERS, 32, 8, 128, kvd.DTYPE_F16, 16,
                                 unit=kvd.UNIT_LAYER_TOKEN, window=32)
            with c.open(m, 512 + args.steps + 100) as s:
                s.grow(512)
                for _ in range(100):   # warm-up, as kvd-bench step
                    step(s)
                ns = []
                for _ in range(args.steps):
                    t0 = time.perf_counter_ns()
                    step(s)
                    ns.append(time.perf_counter_ns() - t0)
        ns.sort()
        py50, py99 = percentile_us(ns, 50), percentile_us(ns, 99)
        out = subprocess.run([args.bench, "step", "--socket", sock, "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        c50, c99 = (float(x) for x in re.search(r"p50 ([\d.]+) us\s+p99 ([\d.]+) us", out).groups())
        print(out.strip())
        print(f"Python step (the same calls): p50 {py50:.1f} us  p99 {py99:.1f} us  "
              f"({args.steps} steps)")
        print(f"Python / C: p50 {py50 / c50:.2f}x  p99 {py99 / c99:.2f}x (target: within 3x)")


if __name__ == "__main__":
    sys.exit(main())
