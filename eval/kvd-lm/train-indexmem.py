#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""Trains IndexMem's indexer and latent memory (docs/algorithms.md §3) for a frozen kvd-lm.

    train-indexmem.py train --out DIR [--model MODEL.kvdlm] [--indexer-minutes 10]
                            [--latent-minutes 6]
    train-indexmem.py eval WEIGHTS.kvdim [--model MODEL.kvdlm] [--n 24]

The model is frozen: only the IndexMem parameters learn. Data: the retrieval tasks of
tasks.py with TRAINING seeds only ([0, 2^32)), the prompt followed by its answer
(tasks.completion()), so that the queries that copy the answer are in the teacher;
evaluation uses TUNING seeds. Both phases run on one sample at a time, teacher-forced: the
frozen model's full-cache forward gives every layer's attention input, post-RoPE q/k/v,
attention probabilities and output.

Indexer (README.md, "IndexMem"), per layer: iq[t][j] = softplus(ww[j].a_t + bw[j]) *
l2norm(wq[j] a_t) (index_heads heads of index_dim), ik[s] = l2norm(wk a_s), and
I(t, s) = sum_j relu(iq[t][j] . ik[s]). Loss: the block-wise KL of section 3.2. For every
block T of `window` consecutive queries (from position 2 * window), the teacher is the
head-summed attention of T's queries over the keys s in [sinks, start of T), L1-normalised,
and the student softmax_s(mean_{t in T} I(t, s)) over the same keys; plus one "answer
block": the student is the last `window` prompt queries (the daemon's observation window
when it evicts after the prefill), the teacher their attention plus that of the answer's
queries, over the prefix before the window; and one "context block": the student is the
last `window` queries of the context (the window when the daemon evicts before the
question arrives), the teacher the attention of the question's and the answer's queries
over the context before that window. Sinks are left out of all: the daemon never evicts
them, and their attention mass would dominate the distribution. The loss is the stream
blocks' mean plus --answer-weight x the answer block's plus --context-weight x the context
block's.

Latent memory, per layer: keys feature phi(k) = elu(k) + 1 (fixed, so that the daemon folds
evicted tokens without weights), queries psi(q) = elu(lq q + lb) + 1, readout
m(q) = psi^T S / (psi . z + 1e-6) with S = sum phi(k) v^T, z = sum phi(k) over the evicted
tokens of the query's kv head, and one more softmax entry with logit ln(psi . z + 1e-6) +
lbias[h] and value lr m(q). Loss: for an eviction after the prompt (in-window) or after the
context (query-agnostic), keeping the sinks, the window and the top of the prefix by the
window's attention (with noise) at a budget uniform in [--keep-min, --keep-max], the squared
error of the layer's attention output after W_o against the full cache's, over the queries
after the eviction, relative to the same error without the memory (so 1 is "no gain").

Each phase runs for its wall-clock minutes; DIR/indexmem.kvdim holds the result (format in
README.md). Threads: torch.set_num_threads(2), OpenBLAS single-threaded (see train.py).
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import math
import random
import struct
import sys
import time
import zlib

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvdlm  # noqa: E402
import tasks  # noqa: E402
import train as train_mod  # noqa: E402  (tune_malloc)

MAGIC = b"KVDIM\0\0\0"
VERSION = 1
HEADER_BYTES = 128
# magic, version, header bytes, layers, dim, q_heads, kv_heads, head_dim, index_heads,
# index_dim, zero, payload bytes, payload CRC, header CRC, zero[64]
HEADER_FMT = "<8s10IQII64s"
assert struct.calcsize(HEADER_FMT) == HEADER_BYTES
HEADER_CRC_SPAN = 60
SINKS = 4
EPS = 1e-6
TASKS = ("niah", "multikey", "multivalue", "vt")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-12)


class IndexMem(torch.nn.Module):
    def __init__(self, cfg, index_heads, index_dim):
        super().__init__()
        self.cfg, self.ih, self.idim = cfg, index_heads, index_dim
        L, D, hd = cfg.layers, cfg.dim, cfg.head_dim
        g = torch.Generator().manual_seed(1)
        r = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g) / math.sqrt(s[-1]))
        self.wq = r(L, index_heads * index_dim, D)
        self.wk = r(L, index_dim, D)
        self.ww = torch.nn.Parameter(torch.zeros(L, index_heads, D))
        self.bw = torch.nn.Parameter(torch.full((L, index_heads), 2.0))
        self.lq = torch.nn.Parameter(torch.eye(hd).repeat(L, 1, 1))
        self.lb = torch.nn.Parameter(torch.zeros(L, hd))
        self.lr = torch.nn.Parameter(torch.eye(hd).repeat(L, 1, 1))
        self.lbias = torch.nn.Parameter(torch.zeros(L, cfg.q_heads))

    def tensors(self):
        """(name, tensor) in file order: per layer wq, wk, ww, bw, lq, lb, lr, lbias."""
        out = []
        for l in range(self.cfg.layers):
            for n in ("wq", "wk", "ww", "bw", "lq", "lb", "lr", "lbias"):
                out.append((f"{n}.{l}", getattr(self, n)[l]))
        return out

    def index(self, l, a):
        """a [T][dim] -> iq [T][ih][idim] (head weight folded in), ik [T][idim]."""
        T = a.shape[0]
        q = l2norm((a @ self.wq[l].T).view(T, self.ih, self.idim))
        w = F.softplus(a @ self.ww[l].T + self.bw[l])
        return q * w[..., None], l2norm(a @ self.wk[l].T)


def scores(iq, ik):
    """I(t, s) = sum_j relu(iq[t][j] . ik[s]): [T][S]."""
    return torch.relu(torch.einsum("tjd,sd->tjs", iq, ik)).sum(1)


def save(im, path):
    cfg = im.cfg
    payload = b"".join(t.detach().float().contiguous().numpy().astype("<f4").tobytes()
                       for _, t in im.tensors())
    pcrc = zlib.crc32(payload) & 0xFFFFFFFF
    head = struct.pack(HEADER_FMT, MAGIC, VERSION, HEADER_BYTES, cfg.layers, cfg.dim,
                       cfg.q_heads, cfg.kv_heads, cfg.head_dim, im.ih, im.idim, 0, len(payload),
                       pcrc, 0, b"\0" * 64)
    hcrc = zlib.crc32(head[:HEADER_CRC_SPAN]) & 0xFFFFFFFF
    head = head[:HEADER_CRC_SPAN] + struct.pack("<I", hcrc) + head[HEADER_CRC_SPAN + 4:]
    with open(str(path) + ".tmp", "wb") as f:
        f.write(head + payload)
    os.replace(str(path) + ".tmp", path)


def load(path, cfg):
    data = open(path, "rb").read()
    (magic, version, hb, layers, dim, qh, kvh, hd, ih, idim, _r, pbytes, pcrc, hcrc,
     _z) = struct.unpack(HEADER_FMT, data[:HEADER_BYTES])
    if magic != MAGIC or version != VERSION or hb != HEADER_BYTES:
        raise ValueError(f"{path}: not a version {VERSION} .kvdim file")
    if zlib.crc32(data[:HEADER_CRC_SPAN]) & 0xFFFFFFFF != hcrc:
        raise ValueError(f"{path}: header CRC-32 mismatch")
    if (layers, dim, qh, kvh, hd) != (cfg.layers, cfg.dim, cfg.q_heads, cfg.kv_heads, cfg.head_dim):
        raise ValueError(f"{path}: made for another model shape")
    if zlib.crc32(data[HEADER_BYTES:]) & 0xFFFFFFFF != pcrc or len(data) != HEADER_BYTES + pbytes:
        raise ValueError(f"{path}: payload CRC-32 or size mismatch")
    im = IndexMem(cfg, ih, idim)
    import numpy as np
    flat = np.frombuffer(data, dtype="<f4", offset=HEADER_BYTES)
    off = 0
    with torch.no_grad():
        for _, t in im.tensors():
            t.copy_(torch.from_numpy(flat[off:off + t.numel()].copy()).view(t.shape))
            off += t.numel()
    return im


class Sample:
    """A task sample and the frozen model's full-cache view of it, per layer: attention
    input a [T][dim], post-RoPE q [T][Hq][hd], k, v [T][Hkv][hd], head-summed attention
    probabilities p [T][T], attention output o [T][Hq*hd]."""

    def __init__(self, model, hay, rng, seeds, lengths):
        task = rng.choice(TASKS)
        length = max(rng.choice(lengths), tasks.min_length(task))
        seed = rng.randrange(seeds.start, seeds.stop)
        tok = model.tok
        prompt, question, answer = tasks.make(hay, task, seed, length, tok)
        toks = kvdlm.encode(prompt, tok)
        self.prompt_end = len(toks)
        self.context_end = 1 + tok.count(prompt[:tasks.context_size(prompt)])
        toks += tok.encode(tasks.completion(prompt, answer))
        self.tokens = toks[:-1]
        self.layers = self.capture(model, torch.tensor(self.tokens))

    @torch.no_grad()
    def capture(self, model, tokens):
        cfg, T = model.cfg, tokens.shape[0]
        pos = torch.arange(T)
        cos, sin = kvdlm.rope_cos_sin(pos, model.inv_freq)
        h = F.embedding(tokens, model.tok_emb)
        g = cfg.q_heads // cfg.kv_heads
        mask = torch.triu(torch.full((T, T), float("-inf")), 1)
        out = []
        for L in model.layers:
            a = kvdlm.rmsnorm(h, L.attn_norm, cfg.norm_eps)
            q = kvdlm.apply_rope((a @ L.wq.T).view(T, cfg.q_heads, cfg.head_dim), cos, sin)
            k = kvdlm.apply_rope((a @ L.wk.T).view(T, cfg.kv_heads, cfg.head_dim), cos, sin)
            v = (a @ L.wv.T).view(T, cfg.kv_heads, cfg.head_dim)
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(cfg.head_dim) + mask
            p = torch.softmax(s, -1)
            o = torch.einsum("hts,shd->thd", p, vv).reshape(T, -1)
            out.append(dict(a=a, q=q, k=k, v=v, p=p.sum(0), o=o, wo=L.wo))
            h = h + o @ L.wo.T
            m = kvdlm.rmsnorm(h, L.ffn_norm, cfg.norm_eps)
            h = h + (F.silu(m @ L.w_gate.T) * (m @ L.w_up.T)) @ L.w_down.T
        return out


def kl(p, logq):
    """KL(p || q) for p [.., S] (rows summing to 1) and log q; 0 log 0 is 0, also where q
    is 0 (keys outside the block's range)."""
    zero = p == 0
    return (p * (torch.log(p.masked_fill(zero, 1)) - logq.masked_fill(zero, 0))).sum(-1)


def indexer_loss(im, s, w):
    """Mean over the layers of: the stream blocks' KL, the answer block's, the context
    block's, and the last two's KL with the window's own attention as the predictor (what
    attention-based policies see)."""
    P, C, T = s.prompt_end, s.context_end, len(s.tokens)
    stream = ans = base = ctx = ctx_base = 0.0
    for l, x in enumerate(s.layers):
        iq, ik = im.index(l, x["a"])
        I = scores(iq, ik)
        nb = (P - w) // w - 1                      # blocks starting at 2w, 3w, .. < P
        starts = torch.arange(2, 2 + nb) * w
        rows = torch.arange(2 * w, (2 + nb) * w)
        col = torch.arange(T)
        bad = (col[None, :] < SINKS) | (col[None, :] >= starts[:, None])
        stu = I[rows].view(nb, w, T).mean(1).masked_fill(bad, float("-inf"))
        tea = x["p"][rows].view(nb, w, T).sum(1).masked_fill(bad, 0)
        tea = tea / tea.sum(-1, keepdim=True)
        stream = stream + kl(tea, torch.log_softmax(stu, -1)).mean()
        # The answer block: the observation window predicts the window and the answer.
        keys = slice(SINKS, P - w)
        stu = I[P - w:P, keys].mean(0)
        tea = x["p"][P - w:, keys].sum(0)
        tea = tea / tea.sum()
        ans = ans + kl(tea, torch.log_softmax(stu, -1))
        own = x["p"][P - w:P, keys].sum(0)
        base = base + kl(tea, torch.log(own / own.sum()))
        # The context block: the context's last window predicts the question and answer.
        keys = slice(SINKS, C - w)
        stu = I[C - w:C, keys].mean(0)
        tea = x["p"][C:, keys].sum(0)
        tea = tea / tea.sum()
        ctx = ctx + kl(tea, torch.log_softmax(stu, -1))
        own = x["p"][C - w:C, keys].sum(0)
        ctx_base = ctx_base + kl(tea, torch.log(own / own.sum()))
    n = len(s.layers)
    return stream / n, ans / n, base / n, ctx / n, ctx_base / n


def latent_loss(im, s, rng, w, keep_min, keep_max):
    """Relative output error with the memory (1: no gain), and its parts."""
    cfg = im.cfg
    g, hd = cfg.q_heads // cfg.kv_heads, cfg.head_dim
    e = s.prompt_end if rng.random() < 0.5 else s.context_end
    T = len(s.tokens)
    keep = rng.uniform(keep_min, keep_max)
    prefix = e - w                                  # evictable: [SINKS, prefix)
    budget = max(int(keep * e) - SINKS - w, 0)
    num = den = 0.0
    for l, x in enumerate(s.layers):
        share = x["p"][e - w:e, SINKS:prefix].sum(0)
        share = share / share.sum() * torch.exp(0.7 * torch.randn(share.shape))
        kept = torch.zeros(T, dtype=torch.bool)
        kept[:SINKS] = True
        kept[prefix:] = True
        if budget > 0:
            kept[SINKS + torch.topk(share, min(budget, share.numel())).indices] = True
        ev = ~kept
        ev[prefix:] = False
        q = x["q"][e:]                              # [n][Hq][hd]
        n = q.shape[0]
        qpos = torch.arange(e, T)
        vis = kept[None, :] & (torch.arange(T)[None, :] <= qpos[:, None])
        sc = torch.einsum("nhd,shd->hns", q, x["k"].repeat_interleave(g, 1)) / math.sqrt(hd)
        sc = sc.masked_fill(~vis[None], float("-inf"))
        vv = x["v"].repeat_interleave(g, 1)
        o_kept = torch.einsum("hns,shd->nhd", torch.softmax(sc, -1), vv).reshape(n, -1)
        # The memory: per kv head, S and z of the evicted keys' features.
        phi = F.elu(x["k"][ev]) + 1                 # [m][Hkv][hd]
        z = phi.sum(0)                              # [Hkv][hd]
        S = torch.einsum("mha,mhb->hab", phi, x["v"][ev])
        psi = F.elu(q @ im.lq[l].T + im.lb[l]) + 1  # [n][Hq][hd]
        zz, SS = z.repeat_interleave(g, 0), S.repeat_interleave(g, 0)
        dz = (psi * zz[None]).sum(-1) + EPS         # [n][Hq]
        m = torch.einsum("nha,hab->nhb", psi, SS) / dz[..., None]
        val = m @ im.lr[l].T
        vl = (torch.log(dz) + im.lbias[l][None, :]).T[..., None]   # [Hq][n][1]
        if not ev.any():
            vl = torch.full_like(vl, float("-inf"))
        wts = torch.softmax(torch.cat((sc, vl), -1), -1)
        o = (torch.einsum("hns,shd->nhd", wts[..., :-1], vv)
             + wts[..., -1].T[..., None] * val).reshape(n, -1)
        err = ((o - x["o"][e:]) @ x["wo"].T).pow(2).sum()
        err0 = ((o_kept - x["o"][e:]) @ x["wo"].T).pow(2).sum().detach()
        num, den = num + err, den + err0
    return num / (den + 1e-12), float(den)


def train(args):
    train_mod.tune_malloc()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    model = kvdlm.load(args.model)
    for p in model.parameters():
        p.requires_grad_(False)
    hay = tasks.load_haystack()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    im = IndexMem(model.cfg, args.index_heads, args.index_dim)
    lengths = [int(x) for x in args.lengths.split(",")]
    t_start = time.time()

    # Phase 1: the indexer.
    opt = torch.optim.Adam([im.wq, im.wk, im.ww, im.bw], lr=args.lr)
    t0, step, avg = time.time(), 0, None
    while time.time() - t0 < args.indexer_minutes * 60:
        s = Sample(model, hay, rng, tasks.SEEDS_TRAIN, lengths)
        stream, ans, base, ctx, ctx_base = indexer_loss(im, s, args.window)
        loss = stream + args.answer_weight * ans + args.context_weight * ctx
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur = torch.tensor([float(x) for x in (stream, ans, base, ctx, ctx_base)])
        avg = cur if avg is None else 0.95 * avg + 0.05 * cur
        step += 1
        if step % 50 == 0:
            log(f"indexer step {step}: stream KL {avg[0]:.3f}, answer KL {avg[1]:.3f} "
                f"(window attention {avg[2]:.3f}), context KL {avg[3]:.3f} (window attention "
                f"{avg[4]:.3f})")
    log(f"indexer: {step} steps in {(time.time() - t0) / 60:.1f} min")
    save(im, os.path.join(args.out, "indexmem.kvdim"))

    # Phase 2: the latent memory.
    opt = torch.optim.Adam([im.lq, im.lb, im.lr, im.lbias], lr=args.lr)
    t0, step, avg = time.time(), 0, None
    while time.time() - t0 < args.latent_minutes * 60:
        s = Sample(model, hay, rng, tasks.SEEDS_TRAIN, lengths)
        for _ in range(args.evictions):
            rel, base = latent_loss(im, s, rng, args.window, args.keep_min, args.keep_max)
            if base == 0:
                continue
            opt.zero_grad()
            rel.backward()
            opt.step()
            avg = float(rel) if avg is None else 0.95 * avg + 0.05 * float(rel)
            step += 1
            if step % 100 == 0:
                log(f"latent step {step}: relative output error {avg:.3f}")
    log(f"latent: {step} steps in {(time.time() - t0) / 60:.1f} min")
    save(im, os.path.join(args.out, "indexmem.kvdim"))
    log(f"done in {(time.time() - t_start) / 60:.1f} min: {args.out}/indexmem.kvdim")
    evaluate(model, im, args)


@torch.no_grad()
def evaluate(model, im, args):
    """Mean answer- and context-block KL (indexer vs the window's own attention) and
    relative output error of the memory, over --n samples of TUNING seeds."""
    hay = tasks.load_haystack()
    rng = random.Random(12345)
    lengths = [int(x) for x in args.lengths.split(",")]
    a = b = c = d = r = 0.0
    for _ in range(args.n):
        s = Sample(model, hay, rng, tasks.SEEDS_TUNE, lengths)
        _, ans, base, ctx, ctx_base = indexer_loss(im, s, args.window)
        rel, _ = latent_loss(im, s, rng, args.window, args.keep_min, args.keep_max)
        a, b, r = a + float(ans), b + float(base), r + float(rel)
        c, d = c + float(ctx), d + float(ctx_base)
    n = args.n
    log(f"eval ({n} tuning samples): answer-block KL indexer {a / n:.3f}, window attention "
        f"{b / n:.3f}; context-block KL indexer {c / n:.3f}, window attention {d / n:.3f}; "
        f"memory's relative output error {r / n:.3f}")


def main():
    ap = argparse.ArgumentParser(prog="train-indexmem.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "eval"):
        p = sub.add_parser(name)
        if name == "train":
            p.add_argument("--out", required=True)
        else:
            p.add_argument("weights")
        p.add_argument("--model", default=os.path.join(HERE, "models", "kvd-lm-small.kvdlm"))
        p.add_argument("--index-heads", type=int, default=4)
        p.add_argument("--index-dim", type=int, default=16)
        p.add_argument("--window", type=int, default=32)
        p.add_argument("--lengths", default="512,768,1024,1536")
        p.add_argument("--indexer-minutes", type=float, default=10)
        p.add_argument("--latent-minutes", type=float, default=6)
        p.add_argument("--evictions", type=int, default=4, help="latent steps per sample")
        p.add_argument("--answer-weight", type=float, default=2.0)
        p.add_argument("--context-weight", type=float, default=2.0)
        p.add_argument("--keep-min", type=float, default=0.1)
        p.add_argument("--keep-max", type=float, default=0.6)
        p.add_argument("--lr", type=float, default=3e-3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--n", type=int, default=24)
        p.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "train":
        train(args)
    else:
        torch.set_num_threads(args.threads)
        model = kvdlm.load(args.model)
        evaluate(model, load(args.weights, model.cfg), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
