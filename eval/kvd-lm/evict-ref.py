#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""A torch reference for eviction on the kvd-lm tasks, independent of kvd.

    evict-ref.py [--model FILE] [--policy h2o|snapkv|recent] [--keep FRACTION]
                 [--task niah] [--length 1024] [--n 6] [--window 32] [--mass]
                 [--answer-prefix]

The in-window setting of `kvd-quality`: BOS + context + question prefilled; the last
--window queries of each layer are the observation; each (layer, kv head) keeps
ceil(keep x prompt) slots: BOS, the window, and the prefix slots that rank highest by
  h2o     the window's attention, summed over the window and the group's query heads,
  snapkv  the same, max-pooled over 7 neighbours,
  recent  recency;
then the answer is decoded greedily over what is kept, its first token from the prefill's
full attention, as the harness takes it. Prints each answer and
how many of the value's (layer, kv head, digit) slots were dropped, and the accuracy.

The budget here is uniform over (layer, kv head); kvd ranks globally, so the two agree only
where the ranking is flat enough (they do for H2O on niah at 1k: same wrong answers at 93%).

With --mass it evicts nothing and reports, for needle tasks, where the window's attention
goes: the share of its mass (every window query of every layer and query head, each
summing to 1) that lands on the needles' tokens and on the asked value's tokens, against
the needles' share of the prompt's tokens.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvdlm  # noqa: E402
import tasks  # noqa: E402

NEWLINE = 10


def window_attention(model, tokens, window):
    """Per layer, [kv_heads][len] of the last `window` queries' attention, summed over the
    window and each kv head's query heads."""
    cfg = model.cfg
    g = cfg.q_heads // cfg.kv_heads
    sums = []
    plain = model._attend

    def attend(q, k, v, q_pos, k_pos, q_chunk=None):
        qq = q[0, -window:].transpose(0, 1)
        kk = k[0].transpose(0, 1).repeat_interleave(g, 0)
        s = torch.einsum("hwd,hsd->hws", qq, kk) / math.sqrt(cfg.head_dim)
        s = s.masked_fill((k_pos[None, :] > q_pos[-window:][:, None])[None], float("-inf"))
        p = torch.softmax(s, -1)
        sums.append(p.view(cfg.kv_heads, g, window, -1).sum((1, 2)))
        return plain(q, k, v, q_pos, k_pos, q_chunk)

    model._attend = attend
    try:
        with torch.no_grad():
            model.forward(torch.tensor([tokens]))
    finally:
        model._attend = plain
    return sums


def keep_masks(sums, n, window, budget, policy):
    """Per layer, a bool [kv_heads][n] of the slots kept."""
    prefix = n - window
    masks = []
    for s in sums:
        m = torch.zeros(s.shape[0], n, dtype=torch.bool)
        for h in range(s.shape[0]):
            score = s[h, :prefix].clone()
            if policy == "snapkv":
                score = F.max_pool1d(score[None, None], 7, 1, 3)[0, 0]
            elif policy == "recent":
                score = torch.arange(prefix, dtype=torch.float32)
            m[h, torch.topk(score, max(budget - window - 1, 0)).indices] = True
        m[:, prefix:] = True
        m[:, 0] = True
        masks.append(m)
    return masks


def decode_kept(model, tokens, masks, max_new):
    """Greedy answer: the first token from the prefill's full attention, the next ones
    attending to the kept prompt slots and every new token."""
    cfg = model.cfg
    g = cfg.q_heads // cfg.kv_heads
    n = len(tokens)
    layer = [0]

    def attend(q, k, v, q_pos, k_pos, q_chunk=None):
        m = masks[layer[0]]
        layer[0] = (layer[0] + 1) % cfg.layers
        keep = torch.ones(cfg.kv_heads, k.shape[1], dtype=torch.bool)
        keep[:, :n] = m
        keep = keep.repeat_interleave(g, 0)
        qq = q[0].transpose(0, 1)
        kk = k[0].transpose(0, 1).repeat_interleave(g, 0)
        vv = v[0].transpose(0, 1).repeat_interleave(g, 0)
        s = torch.einsum("htd,hsd->hts", qq, kk) / math.sqrt(cfg.head_dim)
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        s = s.masked_fill((k_pos[None, :] > q_pos[:, None])[None], float("-inf"))
        o = torch.einsum("hts,hsd->htd", torch.softmax(s, -1), vv)
        return o.transpose(0, 1).reshape(1, q.shape[1], -1)

    cache = [None] * cfg.layers
    plain = model._attend
    with torch.no_grad():
        nxt = int(torch.argmax(model.forward(torch.tensor([tokens]), cache=cache)[0, -1]))
        out = [nxt]
        model._attend = attend
        try:
            while len(out) < max_new and nxt not in (NEWLINE, kvdlm.EOS):
                logits = model.forward(torch.tensor([[nxt]]), cache=cache)[0, -1]
                nxt = int(torch.argmax(logits))
                out.append(nxt)
        finally:
            model._attend = plain
    return model.tok.decode(t if t not in range(256, 260) else 0 for t in out)


def sample(hay, args, i, tok):
    """Sample i of the reporting seeds: (prompt, answer); with --answer-prefix the prompt
    goes on as RULER's do, with the start of the answer sentence."""
    prompt, question, answer = tasks.make(hay, args.task, tasks.SEEDS_REPORT.start + i,
                                          args.length, tok)
    if args.answer_prefix:
        key = question.rstrip("?").split()[-1]
        prompt = prompt.rstrip(b" ") + f" The special magic number for {key} is ".encode()
    return prompt, answer


def report_mass(model, hay, args):
    tok, cfg = model.tok, model.cfg
    tot = [0.0, 0.0, 0.0]
    for i in range(args.n):
        prompt, answer = sample(hay, args, i, tok)
        tokens = kvdlm.encode(prompt, tok)
        sums = window_attention(model, tokens, args.window)
        mass = sum(float(s.sum()) for s in sums)
        needles, n_needle, at = 0.0, 0, 0
        # every needle and the value: they start pieces, so their tokens are counted alone
        context = prompt[:tasks.context_size(prompt)]
        for start in (b" The special magic number for ", b" VAR "):
            at = context.find(start)
            while at >= 0:
                end = prompt.index(b".", at + len(start)) + 1
                a, b = 1 + tok.count(prompt[:at]), 1 + tok.count(prompt[:end])
                needles += sum(float(s[:, a:b].sum()) for s in sums)
                n_needle += b - a
                at = context.find(start, end)
        v = prompt.find(b" " + answer.split(",")[0].split(" ")[0].encode() + b".")
        a = 1 + tok.count(prompt[:v + 1])
        b = a + tok.count(answer.split(",")[0].split(" ")[0].encode())
        value = sum(float(s[:, a:b].sum()) for s in sums)
        share = (needles / mass, value / mass, n_needle / len(tokens))
        tot = [t + x for t, x in zip(tot, share)]
        print(f"{i}: window mass on needles {100 * share[0]:.2f}%, on the value "
              f"{100 * share[1]:.2f}%; needles are {100 * share[2]:.2f}% of the tokens")
    tot = [t / args.n for t in tot]
    print(f"{os.path.basename(args.model)} {args.task} at {args.length} tokens, window "
          f"{args.window}, {args.n} samples: window mass on needles {100 * tot[0]:.2f}%, on the "
          f"value {100 * tot[1]:.2f}%; needles {100 * tot[2]:.2f}% of the tokens "
          f"({tot[0] / tot[2]:.1f}x their share)")
    return 0


def main():
    ap = argparse.ArgumentParser(description="torch reference for eviction on kvd-lm tasks")
    ap.add_argument("--model", default=os.path.join(HERE, "models", "kvd-lm-small.kvdlm"))
    ap.add_argument("--policy", choices=("h2o", "snapkv", "recent"), default="h2o")
    ap.add_argument("--keep", type=float, default=0.5, help="fraction of the prompt kept")
    ap.add_argument("--task", default="niah")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answer-prefix", action="store_true",
                    help="niah, multikey: the prompt ends 'Answer: The special magic number "
                         "for KEY is ', as RULER's prompts end (not the tasks' format)")
    ap.add_argument("--mass", action="store_true",
                    help="report the window's attention mass on needle tokens instead")
    args = ap.parse_args()
    if not 0 < args.keep <= 1:
        ap.error("--keep must be in (0, 1]")
    torch.set_num_threads(args.threads)
    model = kvdlm.load(args.model)
    hay = tasks.load_haystack()
    if args.mass:
        return report_mass(model, hay, args)
    right = 0
    for i in range(args.n):
        prompt, answer = sample(hay, args, i, model.tok)
        tokens = kvdlm.encode(prompt, model.tok)
        n = len(tokens)
        masks = keep_masks(window_attention(model, tokens, args.window), n, args.window,
                           math.ceil(args.keep * n), args.policy)
        # the answer's slots: its tokens (the value starts a piece), after BOS
        at = 1 + model.tok.count(prompt[:prompt.find(answer.encode())])
        dropped = sum(int((~m[:, at:at + model.tok.count(answer.encode())]).sum()) for m in masks)
        got = decode_kept(model, tokens, masks, tasks.GENERATE_MAX)
        good = tasks.score(prompt, answer, got)
        right += good
        print(f"{i}: want {answer!r} got {got!r} ({'right' if good else 'wrong'}; "
              f"value slots dropped {dropped})")
    print(f"{args.policy} keep {args.keep}: {right}/{args.n} right")


if __name__ == "__main__":
    sys.exit(main())
