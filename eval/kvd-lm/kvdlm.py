#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""kvd-lm in torch: the reference implementation of the model of README.md.

The model (Llama-style: RMSNorm, RoPE in the rotate_half layout, grouped-query attention,
SwiGLU, no biases, fp32), the `.kvdlm` weights file (load and save, both CRC-32s checked),
a full-context forward (`Model.logits`) and greedy decoding with a KV cache.

    kvdlm.py info FILE
    kvdlm.py generate FILE --prompt TEXT [--max-tokens N] [--stop-newline]

Only Debian's python3-torch and python3-numpy are needed. The daemon and the C library never
need Python; this file is used by the training (train.py), by make-random.py (the test
data of the C engine) and by hand.
"""

import argparse
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass, asdict

if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # see train.py
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tokenizer  # noqa: E402
from tokenizer import BOS, EOS, PAD, RESERVED  # noqa: E402,F401

MAGIC = b"KVDLM\0\0\0"
VERSION = 1
HEADER_BYTES = 128
# magic, version, header bytes, vocab, dim, layers, q_heads, kv_heads, head_dim, ffn,
# max_positions, rope_theta, norm_eps, payload bytes, payload CRC, header CRC, zero[56]
HEADER_FMT = "<8s10IffQII56s"
assert struct.calcsize(HEADER_FMT) == HEADER_BYTES
HEADER_CRC_SPAN = 68


class FormatError(Exception):
    pass


@dataclass
class Config:
    vocab: int = tokenizer.FIRST_MERGE
    dim: int = 64
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    max_positions: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def check(self):
        """Raises FormatError naming what is wrong with the shape."""
        for name in ("vocab", "dim", "layers", "q_heads", "kv_heads", "head_dim", "ffn",
                     "max_positions"):
            if getattr(self, name) < 1:
                raise FormatError(f"{name} is {getattr(self, name)}, must be >= 1")
        if self.q_heads % self.kv_heads:
            raise FormatError(f"q_heads {self.q_heads} is not a multiple of kv_heads "
                              f"{self.kv_heads}")
        if self.head_dim % 2:
            raise FormatError(f"head_dim {self.head_dim} is odd")
        if not tokenizer.FIRST_MERGE <= self.vocab <= tokenizer.VOCAB_MAX:
            raise FormatError(f"vocab is {self.vocab}, must be {tokenizer.FIRST_MERGE}.."
                              f"{tokenizer.VOCAB_MAX}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise FormatError(f"rope_theta {self.rope_theta} is not a positive number")
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise FormatError(f"norm_eps {self.norm_eps} is not a positive number")

    def tensor_shapes(self):
        """(name, shape) of every tensor, in file order."""
        qd, kd = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("tok_emb", (self.vocab, self.dim))]
        for l in range(self.layers):
            out += [
                (f"layers.{l}.attn_norm", (self.dim,)),
                (f"layers.{l}.wq", (qd, self.dim)),
                (f"layers.{l}.wk", (kd, self.dim)),
                (f"layers.{l}.wv", (kd, self.dim)),
                (f"layers.{l}.wo", (self.dim, qd)),
                (f"layers.{l}.ffn_norm", (self.dim,)),
                (f"layers.{l}.w_gate", (self.ffn, self.dim)),
                (f"layers.{l}.w_up", (self.ffn, self.dim)),
                (f"layers.{l}.w_down", (self.dim, self.ffn)),
            ]
        out += [("final_norm", (self.dim,)), ("lm_head", (self.vocab, self.dim))]
        return out

    def n_elements(self):
        return sum(math.prod(s) for _, s in self.tensor_shapes())


def rope_inv_freq(head_dim, theta):
    """inv_freq[i] = theta^(-2i/head_dim), i < head_dim/2: computed in double from the fp32
    theta of the file and rounded once to fp32 (C: (float)pow((double)theta, -2.0*i/hd))."""
    theta = struct.unpack("<f", struct.pack("<f", theta))[0]
    return torch.tensor([theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)],
                        dtype=torch.float64).float()


def rope_cos_sin(positions, inv_freq):
    """angle = float(pos) * inv_freq in fp32 (as torch does); returns cos, sin [T][hd/2]."""
    ang = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x, cos, sin):
    """x [..., T, heads, hd]; pairs (i, i + hd/2): x'[i] = x[i] cos - x[i+hd/2] sin,
    x'[i+hd/2] = x[i+hd/2] cos + x[i] sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Layer(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        P = lambda *s: torch.nn.Parameter(torch.empty(*s))
        self.attn_norm = P(cfg.dim)
        self.wq = P(qd, cfg.dim)
        self.wk = P(kd, cfg.dim)
        self.wv = P(kd, cfg.dim)
        self.wo = P(cfg.dim, qd)
        self.ffn_norm = P(cfg.dim)
        self.w_gate = P(cfg.ffn, cfg.dim)
        self.w_up = P(cfg.ffn, cfg.dim)
        self.w_down = P(cfg.dim, cfg.ffn)


class Model(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.tok = tokenizer.BYTES     # load() sets the file's (tokenizer.for_model)
        self.tok_emb = torch.nn.Parameter(torch.empty(cfg.vocab, cfg.dim))
        self.layers = torch.nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.final_norm = torch.nn.Parameter(torch.empty(cfg.dim))
        self.lm_head = torch.nn.Parameter(torch.empty(cfg.vocab, cfg.dim))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta),
                             persistent=False)
        self.init_weights(torch.Generator().manual_seed(0))

    def init_weights(self, gen, std=0.02):
        """Training init: N(0, std^2), output projections scaled by 1/sqrt(2 layers), norms 1."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm"):
                    p.fill_(1.0)
                else:
                    s = std
                    if name.endswith(".wo") or name.endswith(".w_down"):
                        s = std / math.sqrt(2 * self.cfg.layers)
                    p.copy_(torch.randn(p.shape, generator=gen) * s)

    def tensors(self):
        """(name, parameter) in file order; a tied lm_head (train.py --tie-embeddings) is
        tok_emb again."""
        out = []
        for n, _ in self.cfg.tensor_shapes():
            obj = self
            for part in n.split("."):
                obj = getattr(obj, part)
            out.append((n, obj))
        return out

    # --- forward ------------------------------------------------------------------------

    def _attend(self, q, k, v, q_pos, k_pos, q_chunk=None):
        """q [B,T,Hq,hd], k/v [B,S,Hkv,hd] (after RoPE), k_pos ascending; causal by position.

        Queries go in chunks of q_chunk (default 512); a chunk only looks at the keys up to
        its last position, so a long causal prefill costs about half the full square."""
        cfg = self.cfg
        g = cfg.q_heads // cfg.kv_heads
        B, T, Hq, hd = q.shape
        S = k.shape[1]
        q = q.transpose(1, 2).reshape(B * Hq, T, hd)
        k = k.transpose(1, 2).repeat_interleave(g, dim=1).reshape(B * Hq, S, hd)
        v = v.transpose(1, 2).repeat_interleave(g, dim=1).reshape(B * Hq, S, hd)
        scale = 1.0 / math.sqrt(hd)
        step = q_chunk or 512
        outs = []
        for s0 in range(0, T, step):
            qp = q_pos[s0:s0 + step]
            n = int(torch.searchsorted(k_pos, qp.max(), right=True))
            mask = torch.zeros(qp.shape[0], n).masked_fill_(k_pos[None, :n] > qp[:, None],
                                                            float("-inf"))
            scores = torch.baddbmm(mask.expand(B * Hq, -1, -1), q[:, s0:s0 + step],
                                   k[:, :n].transpose(1, 2), alpha=scale)
            outs.append(torch.bmm(torch.softmax(scores, dim=-1), v[:, :n]))
        o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        return o.view(B, Hq, T, hd).transpose(1, 2).reshape(B, T, Hq * hd)

    def forward(self, tokens, positions=None, cache=None, q_chunk=None, checkpoint=False):
        """tokens [B,T] (int64) -> logits [B,T,vocab].

        positions [T] (default: after what the cache holds, from 0); cache: a list (one
        entry per layer) of (k, v, pos) that is extended in place, or None. q_chunk: attend
        in chunks of that many queries (saves memory for long prefills)."""
        cfg = self.cfg
        B, T = tokens.shape
        if positions is None:
            start = 0 if not cache or cache[0] is None else int(cache[0][2][-1]) + 1
            positions = torch.arange(start, start + T)
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        h = F.embedding(tokens, self.tok_emb)
        for li, L in enumerate(self.layers):
            if checkpoint and cache is None:
                h = torch.utils.checkpoint.checkpoint(
                    self._layer, L, h, cos, sin, positions, None, li, q_chunk,
                    use_reentrant=False)
            else:
                h = self._layer(L, h, cos, sin, positions, cache, li, q_chunk)
        h = rmsnorm(h, self.final_norm, cfg.norm_eps)
        return F.linear(h, self.lm_head)

    def _layer(self, L, h, cos, sin, positions, cache, li, q_chunk):
        cfg = self.cfg
        B, T, _ = h.shape
        a = rmsnorm(h, L.attn_norm, cfg.norm_eps)
        q = F.linear(a, L.wq).view(B, T, cfg.q_heads, cfg.head_dim)
        k = F.linear(a, L.wk).view(B, T, cfg.kv_heads, cfg.head_dim)
        v = F.linear(a, L.wv).view(B, T, cfg.kv_heads, cfg.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pos = positions
        if cache is not None:
            if cache[li] is not None:
                pk, pv, pp = cache[li]
                k, v, k_pos = torch.cat((pk, k), 1), torch.cat((pv, v), 1), torch.cat((pp, positions))
            cache[li] = (k, v, k_pos)
        o = self._attend(q, k, v, positions, k_pos, q_chunk)
        h = h + F.linear(o, L.wo)
        m = rmsnorm(h, L.ffn_norm, cfg.norm_eps)
        return h + F.linear(F.silu(F.linear(m, L.w_gate)) * F.linear(m, L.w_up), L.w_down)

    @torch.no_grad()
    def logits(self, tokens, q_chunk=1024):
        """Full-context forward of one sequence: tokens (list or 1-D) -> fp32 [T][vocab]."""
        t = torch.as_tensor(list(tokens), dtype=torch.int64)[None]
        return self.forward(t, q_chunk=q_chunk)[0]

    @torch.no_grad()
    def generate(self, tokens, max_tokens=32, stop=(EOS,), q_chunk=1024):
        """Greedy decoding with a full KV cache; returns the new tokens (the stop token
        included when one was produced)."""
        cache = [None] * self.cfg.layers
        t = torch.as_tensor(list(tokens), dtype=torch.int64)[None]
        logits = self.forward(t, cache=cache, q_chunk=q_chunk)[0, -1]
        out = []
        for _ in range(max_tokens):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if nxt in stop:
                break
            logits = self.forward(torch.tensor([[nxt]]), cache=cache)[0, -1]
        return out


# --- the .kvdlm file ------------------------------------------------------------------------

def save(model, path):
    cfg = model.cfg
    cfg.check()
    payload = b"".join(p.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
                       for _, p in model.tensors())
    assert len(payload) == 4 * cfg.n_elements()
    pcrc = zlib.crc32(payload) & 0xFFFFFFFF
    head = struct.pack(HEADER_FMT, MAGIC, VERSION, HEADER_BYTES, cfg.vocab, cfg.dim,
                       cfg.layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn,
                       cfg.max_positions, cfg.rope_theta, cfg.norm_eps, len(payload), pcrc,
                       0, b"\0" * 56)
    hcrc = zlib.crc32(head[:HEADER_CRC_SPAN]) & 0xFFFFFFFF
    head = head[:HEADER_CRC_SPAN] + struct.pack("<I", hcrc) + head[HEADER_CRC_SPAN + 4:]
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(payload)
    import os
    os.replace(tmp, path)


def read_header(data, name="file"):
    """Parses and checks the header of data (bytes); returns (Config, payload_bytes, pcrc)."""
    if len(data) < HEADER_BYTES:
        raise FormatError(f"{name}: {len(data)} bytes, shorter than the 128-byte header")
    (magic, version, hbytes, vocab, dim, layers, qh, kvh, hd, ffn, maxpos, theta, eps,
     pbytes, pcrc, hcrc, _zero) = struct.unpack(HEADER_FMT, data[:HEADER_BYTES])
    if magic != MAGIC:
        raise FormatError(f"{name}: bad magic {magic!r}, not a .kvdlm file")
    if version != VERSION:
        raise FormatError(f"{name}: version {version}, only {VERSION} is known")
    if hbytes != HEADER_BYTES:
        raise FormatError(f"{name}: header bytes {hbytes}, expected {HEADER_BYTES}")
    got = zlib.crc32(data[:HEADER_CRC_SPAN]) & 0xFFFFFFFF
    if got != hcrc:
        raise FormatError(f"{name}: header CRC-32 mismatch (stored {hcrc:08x}, computed "
                          f"{got:08x})")
    cfg = Config(vocab, dim, layers, qh, kvh, hd, ffn, maxpos, theta, eps)
    try:
        cfg.check()
    except FormatError as e:
        raise FormatError(f"{name}: {e}") from None
    if pbytes != 4 * cfg.n_elements():
        raise FormatError(f"{name}: payload bytes {pbytes} do not match the shape "
                          f"({4 * cfg.n_elements()} expected)")
    return cfg, pbytes, pcrc


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    cfg, pbytes, pcrc = read_header(data, str(path))
    if len(data) != HEADER_BYTES + pbytes:
        raise FormatError(f"{path}: file size {len(data)} is not header + payload "
                          f"({HEADER_BYTES + pbytes})")
    payload = memoryview(data)[HEADER_BYTES:]
    got = zlib.crc32(payload) & 0xFFFFFFFF
    if got != pcrc:
        raise FormatError(f"{path}: payload CRC-32 mismatch (stored {pcrc:08x}, computed "
                          f"{got:08x})")
    model = Model(cfg)
    try:
        model.tok = tokenizer.for_model(str(path), cfg.vocab)
    except tokenizer.FormatError as e:
        raise FormatError(str(e)) from None
    import numpy as np
    flat = np.frombuffer(payload, dtype="<f4")
    off = 0
    with torch.no_grad():
        for name, p in model.tensors():
            n = p.numel()
            p.copy_(torch.from_numpy(flat[off:off + n].copy()).view(p.shape))
            off += n
    model.eval()
    return model


def encode(text, tok=tokenizer.BYTES):
    """BOS + the tokens of text (str: its UTF-8 bytes)."""
    return [BOS] + tok.encode(text)


def decode(tokens, tok=tokenizer.BYTES):
    """The bytes of the tokens; special tokens as <bos>, <eos>, <pad>, <259>."""
    return tok.decode(tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvdlm.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="print the header and check both CRCs")
    p.add_argument("file")
    p = sub.add_parser("generate", help="greedy decoding after BOS + the prompt")
    p.add_argument("file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (BOS is prepended)")
    g.add_argument("--prompt-file", help="file whose bytes are the prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stop-newline", action="store_true", help="stop after a newline")
    p.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        model = load(args.file)
        tok = model.tok
    except (FormatError, OSError) as e:
        print(f"kvdlm.py: {e}", file=sys.stderr)
        return 1
    cfg = model.cfg
    if args.cmd == "info":
        for k, v in asdict(cfg).items():
            print(f"{k:14} {v}")
        print(f"{'parameters':14} {cfg.n_elements()}")
        print(f"{'payload bytes':14} {4 * cfg.n_elements()}")
        print("crc            ok (header and payload)")
        return 0
    torch.set_num_threads(args.threads)
    prompt = args.prompt.encode() if args.prompt is not None else open(args.prompt_file, "rb").read()
    stop = (EOS, 10) if args.stop_newline else (EOS,)
    out = model.generate(encode(prompt, tok), args.max_tokens, stop=stop)
    sys.stdout.buffer.write(decode(out, tok))
    if not args.stop_newline or (out and out[-1] != 10):
        sys.stdout.buffer.write(b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
