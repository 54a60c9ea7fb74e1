#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
kvdctl score against the published ReST-KV implementation, in the same run, on the
published code's own shape: one layer, L 4096 tokens, 32 heads, d 128, C 4096, window 32,
capacity 1024, float32 tensors from numpy.random.default_rng(1) (W_o scaled by 0.02).

kvd: `kvdctl score --policy restkv --per-query-head`, the wall time of the whole process
(reading the .npy files included), median of --reps. Published: AblationCluster.update_kv
of restkv/restkv_utils.py (indicator "reconstruction", temporal "ema", spatial
"adaptive": the paper's ReST-KV) on the same tensors, in process, torch with 2 threads,
median of --reps after one warm-up call. Needs torch (Debian's python3-torch) and a
checkout of github.com/an-yongqi/rest-kv (commit a8bb112 was measured); the transformers
package it imports is not needed (stubbed).

Usage: scorer-vs-published.py KVDCTL REST_KV_CHECKOUT [--reps N] [--dir DIR]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np


def make_inputs(d):
    r = np.random.default_rng(1)
    H, L, dim, C, w = 32, 4096, 128, 4096, 32
    np.save(os.path.join(d, "q.npy"), r.standard_normal((H, w, dim), dtype=np.float32))
    np.save(os.path.join(d, "k.npy"), r.standard_normal((H, L, dim), dtype=np.float32))
    np.save(os.path.join(d, "v.npy"), r.standard_normal((H, L, dim), dtype=np.float32))
    np.save(os.path.join(d, "wo.npy"),
            (r.standard_normal((C, H * dim), dtype=np.float32) * 0.02).astype(np.float32))


def time_kvd(kvdctl, d, reps):
    cmd = [kvdctl, "score", "--policy", "restkv", "--per-query-head", "--capacity", "1024",
           "--window", "32"] + [f"--{n}={os.path.join(d, n + '.npy')}" for n in ("q", "k", "v", "wo")]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return times


def time_published(checkout, d, reps):
    import torch

    cu = types.ModuleType("transformers.cache_utils")
    cu.Cache = object
    tr = types.ModuleType("transformers")
    tr.cache_utils = cu
    sys.modules.setdefault("transformers", tr)
    sys.modules.setdefault("transformers.cache_utils", cu)
    sys.path.insert(0, os.path.join(checkout, "restkv"))
    import restkv_utils

    torch.set_num_threads(2)
    q = torch.from_numpy(np.load(os.path.join(d, "q.npy")))[None]
    k = torch.from_numpy(np.load(os.path.join(d, "k.npy")))[None]
    v = torch.from_numpy(np.load(os.path.join(d, "v.npy")))[None]
    wo = torch.from_numpy(np.load(os.path.join(d, "wo.npy")))
    H, w, dim = q.shape[1], q.shape[2], q.shape[3]
    qf = torch.zeros(1, H, k.shape[2], dim)
    qf[:, :, -w:] = q  # only the window is read
    c = restkv_utils.AblationCluster(window_size=w, max_capacity_prompt=1024, ss="adaptive",
                                     ts="ema", indicator="reconstruction")
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        with torch.no_grad():
            c.update_kv(k, qf, v, None, 1, wo)
        if i > 0:
            times.append(time.perf_counter() - t)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("kvdctl")
    p.add_argument("checkout")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", help="where the .npy files are made (default: a temporary one)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.dir or tmp
        make_inputs(d)
        kvd = time_kvd(a.kvdctl, d, a.reps)
        pub = time_published(a.checkout, d, a.reps)
    mk, mp = statistics.median(kvd), statistics.median(pub)
    print("kvdctl score (whole process): " + " ".join(f"{t:.3f}" for t in kvd) + f" s, median {mk:.3f}")
    print("published update_kv:          " + " ".join(f"{t:.3f}" for t in pub) + f" s, median {mp:.3f}")
    print(f"ratio of the medians: {mp / mk:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
