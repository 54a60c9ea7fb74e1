#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""How well MomentKV's two mass estimates match the evicted attention mass on kvd-lm.

    moments-mass.py [--model FILE] [--task niah] [--length 1024] [--evict 0.5] [--seed 0]

For one task prompt (reporting seed), every layer and query head: a random --evict share of
the prefix (BOS and the last 32 tokens kept) stands for the evicted set E; for the last
query q it compares, in natural log, the two estimates of Z_E = sum_{j in E} exp(s q.k_j)
(docs/algorithms.md §4.2; kernels/moments.h) with the exact value:
  first-order     ln n + s q.mu_k                         (kvd+moments; always <= exact)
  gaussian        ln n + s q.mu_k + s^2 sum_a var_a q_a^2 / 2   (kvd+moments-mass)
  bounded         the gaussian one capped by ln n + s |q| max_j |k_j| and by
                  ln n + s q.mu_k + s |q| max_j |k_j - mu_k|    (kvd+moments-bounded)
and prints the median, min and max of ln(estimate / exact) over (layer, head).
"""

import argparse
import math
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvdlm  # noqa: E402
import tasks  # noqa: E402

WINDOW = 32


def main():
    ap = argparse.ArgumentParser(description="MomentKV mass estimates vs the exact mass")
    ap.add_argument("--model", default=os.path.join(HERE, "models", "kvd-lm-small.kvdlm"))
    ap.add_argument("--task", default="niah")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--evict", type=float, default=0.5, help="share of the prefix evicted")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not 0 < args.evict < 1:
        ap.error("--evict must be in (0, 1)")
    torch.set_num_threads(2)
    model = kvdlm.load(args.model)
    cfg = model.cfg
    prompt, _q, _a = tasks.make(tasks.load_haystack(), args.task, tasks.SEEDS_REPORT.start + args.seed,
                                args.length, model.tok)
    tokens = torch.tensor([kvdlm.encode(prompt, model.tok)])

    cache = [None] * cfg.layers
    last_q = []
    plain = model._attend

    def attend(q, k, v, q_pos, k_pos, q_chunk=None):
        last_q.append(q[0, -1].clone())
        return plain(q, k, v, q_pos, k_pos, q_chunk)

    model._attend = attend
    try:
        with torch.no_grad():
            model.forward(tokens, cache=cache)
    finally:
        model._attend = plain

    s = 1.0 / math.sqrt(cfg.head_dim)
    g = cfg.q_heads // cfg.kv_heads
    gen = torch.Generator().manual_seed(args.seed)
    first, gauss, bounded = [], [], []
    for layer in range(cfg.layers):
        k = cache[layer][0][0]                          # [T][kv_heads][head_dim], after RoPE
        prefix = k.shape[0] - WINDOW
        evicted = torch.randperm(prefix - 1, generator=gen)[:int(args.evict * (prefix - 1))] + 1
        for h in range(cfg.q_heads):
            q = last_q[layer][h]
            ke = k[evicted, h // g]
            exact = torch.logsumexp(s * (ke @ q), 0).item()
            mu, var = ke.mean(0), ke.var(0, unbiased=False)
            f = math.log(len(evicted)) + s * (q @ mu).item()
            g_ = f + 0.5 * s * s * (q * q * var).sum().item()
            qn = q.norm().item()
            cap = math.log(len(evicted)) + s * qn * min(ke.norm(dim=1).max().item(),
                                                        (ke - mu).norm(dim=1).max().item() + (q @ mu).item() / qn)
            first.append(f - exact)
            gauss.append(g_ - exact)
            bounded.append(min(g_, cap) - exact)
    print(f"ln(estimate / exact evicted mass), {cfg.layers} layers x {cfg.q_heads} query heads, "
          f"{args.evict:.0%} of the prefix evicted at random, {args.task}@{args.length}:")
    for name, xs in (("first-order", first), ("gaussian", gauss), ("bounded", bounded)):
        print(f"  {name:12s} median {statistics.median(xs):8.2f}  min {min(xs):8.2f}  max {max(xs):8.2f}")


if __name__ == "__main__":
    main()
