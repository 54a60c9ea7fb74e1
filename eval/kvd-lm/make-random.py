#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""Writes the random-weight kvd-lm model and its reference outputs for the C engine's tests,
and checks the torch forward (kvdlm.py) against a second, independent numpy forward.

    make-random.py --out tests/data/kvd-lm          # random.kvdlm and reference files
    make-random.py --model FILE --input TEXTFILE --logits OUT.npy [--greedy OUT.txt]
                                                    # reference logits of any model

Files (in --out):
  random.kvdlm         dim 64, 2 layers, 4 q heads / 2 kv heads, head_dim 16, ffn 128
  random-input.txt     ASCII text, no newline; the tokens are BOS + its bytes
  random-logits.npy    float32 [T][260], the logits at every position of those tokens
  random-greedy.txt    the 16 greedy next tokens after the input, decimal ids, one line

The weights are not training-like N(0, 0.02^2) (everything would be near uniform and a
wrong RoPE or mask would hardly show): embeddings ~N(0, 1), wq/wk ~N(0, (2/sqrt(dim))^2)
so that attention is peaked, the other matrices ~N(0, 1/in), norm weights ~1 + N(0, 0.1^2).
"""

import argparse
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdlm  # noqa: E402

SEED = 20240601
INPUT_TEXT = (b"kvd keeps the KV cache of a small transformer in a daemon; the daemon evicts "
              b"what the model needs least.")
RANDOM_CONFIG = kvdlm.Config(vocab=260, dim=64, layers=2, q_heads=4, kv_heads=2, head_dim=16,
                             ffn=128, max_positions=512, rope_theta=10000.0, norm_eps=1e-5)


def random_model(seed=SEED):
    model = kvdlm.Model(RANDOM_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    with torch.no_grad():
        for name, p in model.tensors():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("norm"):
                p.copy_(1.0 + 0.1 * r)
            elif name == "tok_emb":
                p.copy_(r)
            elif name.endswith(".wq") or name.endswith(".wk"):
                p.copy_(r * 2.0 / cfg.dim ** 0.5)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    return model.eval()


# --- the second forward: numpy, from the file bytes, one position at a time, float64 -------

def np_load(path):
    data = open(path, "rb").read()
    f = struct.unpack_from("<8s10IffQII", data)
    magic, _ver, hb, vocab, dim, layers, qh, kvh, hd, ffn, _mp, theta, eps = f[:13]
    assert magic == b"KVDLM\0\0\0" and hb == 128
    flat = np.frombuffer(data, dtype="<f4", offset=128).astype(np.float64)
    off = 0

    def take(*shape):
        nonlocal off
        n = int(np.prod(shape))
        t = flat[off:off + n].reshape(shape)
        off += n
        return t
    w = {"tok_emb": take(vocab, dim), "layers": []}
    for _ in range(layers):
        w["layers"].append(dict(
            attn_norm=take(dim), wq=take(qh * hd, dim), wk=take(kvh * hd, dim),
            wv=take(kvh * hd, dim), wo=take(dim, qh * hd), ffn_norm=take(dim),
            w_gate=take(ffn, dim), w_up=take(ffn, dim), w_down=take(dim, ffn)))
    w["final_norm"] = take(dim)
    w["lm_head"] = take(vocab, dim)
    assert off == flat.size
    w.update(dim=dim, qh=qh, kvh=kvh, hd=hd, theta=np.float32(theta), eps=eps)
    return w


def np_rope(x, pos, hd, theta):
    """x [hd] of one head; pair (i, i + hd/2); the angle in fp32 as the spec says."""
    out = np.empty(hd)
    half = hd // 2
    for i in range(half):
        inv = np.float32(float(theta) ** (-2.0 * i / hd))
        ang = float(np.float32(pos) * inv)
        c, s = np.cos(ang), np.sin(ang)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def np_logits(w, tokens):
    """Logits at every position, computed token by token with an explicit KV list."""
    eps, hd, qh, kvh = w["eps"], w["hd"], w["qh"], w["kvh"]
    g = qh // kvh
    norm = lambda x, nw: x / np.sqrt(np.mean(x * x) + eps) * nw
    silu = lambda x: x / (1.0 + np.exp(-x))
    kv = [([], []) for _ in w["layers"]]
    out = []
    for pos, tok in enumerate(tokens):
        h = w["tok_emb"][tok].copy()
        for L, (ks, vs) in zip(w["layers"], kv):
            a = norm(h, L["attn_norm"])
            q = (L["wq"] @ a).reshape(qh, hd)
            k = (L["wk"] @ a).reshape(kvh, hd)
            v = (L["wv"] @ a).reshape(kvh, hd)
            ks.append(np.stack([np_rope(k[j], pos, hd, w["theta"]) for j in range(kvh)]))
            vs.append(v)
            o = np.zeros((qh, hd))
            for head in range(qh):
                qr = np_rope(q[head], pos, hd, w["theta"])
                sc = np.array([qr @ kk[head // g] for kk in ks]) / np.sqrt(hd)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                o[head] = sum(pj * vv[head // g] for pj, vv in zip(p, vs))
            h = h + L["wo"] @ o.reshape(-1)
            m = norm(h, L["ffn_norm"])
            h = h + L["w_down"] @ (silu(L["w_gate"] @ m) * (L["w_up"] @ m))
        out.append(w["lm_head"] @ norm(h, w["final_norm"]))
    return np.stack(out)


def check_numpy(path, tokens, ref, tol=2e-4):
    w = np_load(path)
    got = np_logits(w, tokens)
    err = np.abs(got - ref).max() / max(1.0, np.abs(got).max())
    print(f"numpy check: {len(tokens)} positions, max |torch - numpy| / max|logit| = {err:.2e}")
    if not err < tol:
        raise SystemExit(f"numpy check FAILED: {err:.2e} >= {tol}")


def greedy(model, tokens, steps):
    """Greedy next tokens by full-context forwards (no cache, no stop), with the top-1 margin."""
    toks, out, margins = list(tokens), [], []
    for _ in range(steps):
        lg = model.logits(toks)[-1]
        top = torch.topk(lg, 2).values
        margins.append(float(top[0] - top[1]))
        out.append(int(torch.argmax(lg)))
        toks.append(out[-1])
    cached = model.generate(tokens, steps, stop=())
    assert cached == out, f"cached decoding {cached} != full-context {out}"
    return out, margins


def write_reference(model, model_path, text, logits_path, greedy_path=None, steps=16,
                    numpy_check=True):
    tokens = kvdlm.encode(text, model.tok)
    ref = model.logits(tokens).numpy().astype("<f4")
    # what the C engine will read: the saved file, not the in-memory model
    again = kvdlm.load(model_path).logits(tokens).numpy()
    assert np.array_equal(ref, again), "saved model differs from the in-memory one"
    np.save(logits_path, ref)
    print(f"{logits_path}: float32 {list(ref.shape)}")
    if numpy_check:
        check_numpy(model_path, tokens, ref)
    if greedy_path:
        out, margins = greedy(model, tokens, steps)
        with open(greedy_path, "w") as f:
            f.write(" ".join(map(str, out)) + "\n")
        print(f"{greedy_path}: {out} (smallest top-1 margin {min(margins):.3g})")


def main():
    ap = argparse.ArgumentParser(description="random kvd-lm model and reference data")
    ap.add_argument("--out", help="directory for random.kvdlm and its reference files")
    ap.add_argument("--model", help="reference data of this model instead (with --input)")
    ap.add_argument("--input", help="text file; tokens = BOS + its tokens (the model's tokenizer)")
    ap.add_argument("--logits", help="output .npy of the logits (with --model)")
    ap.add_argument("--greedy", help="output .txt of the greedy tokens (with --model)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--no-numpy-check", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        model = random_model()
        path = os.path.join(args.out, "random.kvdlm")
        kvdlm.save(model, path)
        print(f"{path}: {os.path.getsize(path)} bytes")
        with open(os.path.join(args.out, "random-input.txt"), "wb") as f:
            f.write(INPUT_TEXT)
        write_reference(model, path, INPUT_TEXT, os.path.join(args.out, "random-logits.npy"),
                        os.path.join(args.out, "random-greedy.txt"), args.steps,
                        not args.no_numpy_check)
    elif args.model and args.input and args.logits:
        model = kvdlm.load(args.model)
        text = open(args.input, "rb").read()
        write_reference(model, args.model, text, args.logits, args.greedy, args.steps,
                        not args.no_numpy_check)
    else:
        ap.error("give --out, or --model, --input and --logits")


if __name__ == "__main__":
    main()
