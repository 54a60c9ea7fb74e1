#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""Trains kvd-lm (README.md, "Training") on CPU with Debian's python3-torch.

    train.py tokenizer --out FILE.kvdtok [--vocab 3072]
    train.py train --out DIR [--tokenizer FILE.kvdtok] [--minutes 48] [--resume]
                   [model and schedule options]
    train.py eval MODEL.kvdlm [--seeds tune|report] [--n 50] [--lengths 1024,2048,4096]
                              [--tasks niah,multikey] [--table OUT.txt]
    train.py export DIR/ckpt.pt OUT.kvdlm

The tokenizer (README.md, "Tokens") comes first for a subword model: without --tokenizer
the model is byte-level (vocab 260). Lengths are in tokens throughout.

Data: the retrieval tasks of tasks.py with TRAINING seeds only ([0, 2^32)), mostly niah
and multikey, and plain English text from the Debian packages installed here (READMEs,
copyright files, man pages; ASCII only, whitespace folded; never data/haystack.txt or
/usr/share/common-licenses). The tasks draw their filler from data/haystack.txt, so the
training tasks contain the evaluation haystack (not its needles, questions or seeds).
Two aids teach copying, which a model this small does not pick up from the tasks alone in
the time there is: "copies" (a text span that comes back at a random distance, or random
characters repeated with a random period) and "drills" (needles with random keys and
values and no filler, then several questions, each followed by its answer). Training
starts with a warm-up on periodic random letters only (sample_periodic) until induction
heads show in the loss (--warm-until), at most --warm-max of the time; then the mix takes
over over --warm-ramp steps (switching at once undid the induction heads), and periodic
copies stay in it (--copy-frac x --copy-random).

Loss: next-token cross-entropy over every token, plus --answer-weight times the mean
cross-entropy of the answer tokens (tasks.completion()) of task and drill samples.

The schedule runs on wall-clock training time (--minutes; evaluation and checkpoints not
counted): learning rate warmup then cosine decay, and a curriculum of context lengths by
the fraction of that time spent (--curriculum). Every --ckpt-minutes it writes DIR/ckpt.pt
(model, optimizer, progress, random states) and DIR/latest.kvdlm and evaluates a few
TUNING seeds; --resume continues from DIR/ckpt.pt (with a larger --minutes, the schedule
stretches to it). At the end it writes DIR/final.kvdlm, and the tokenizer beside each
.kvdlm (.kvdtok) for a subword model.

Threads: OpenBLAS single-threaded and OpenMP waiting passively (set below, before torch
loads), torch.set_num_threads(--threads, 2); glibc malloc told not to mmap activations.
"""

import os

# One BLAS thread: OpenBLAS's own pool spins against torch's threads on this 2-core machine
# (3x slower under load). Must be set before torch is loaded.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning threads: 10x slower under load

import argparse
import ctypes
import glob
import gzip
import json
import math
import random
import re
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvdlm  # noqa: E402
import tokenizer  # noqa: E402

NEWLINE = 10


def tune_malloc():
    """No mmap for big tensors and no trimming: glibc otherwise maps and unmaps every
    activation of every step, and page faults ate a third of the CPU time."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)            # M_MMAP_MAX
        libc.mallopt(-1, 2**31 - 1)    # M_TRIM_THRESHOLD
        libc.mallopt(-2, 64 << 20)     # M_TOP_PAD
    except OSError:
        pass


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# --- plain text ------------------------------------------------------------------------------

_MAN_KEEP = {"SH", "SS", "B", "I", "BR", "IR", "RB", "BI", "IB", "RI", "IP", "TP", "Nm", "Nd"}


def _clean_man(text):
    out = []
    for line in text.split("\n"):
        if line.startswith((".", "'")):
            parts = line[1:].split(None, 1)
            if not parts or parts[0] not in _MAN_KEEP or len(parts) < 2:
                continue
            line = parts[1].replace('"', "")
        out.append(line)
    t = "\n".join(out)
    t = re.sub(r"\\f(\[[^]]*\]|\(..|.)", "", t)
    t = re.sub(r"\\\*?\((..)", "", t)
    t = re.sub(r"\\\*\[[^]]*\]", "", t)
    t = t.replace("\\-", "-").replace("\\e", "\\")
    t = re.sub(r"\\[&|^%:c ]", "", t)
    return t


def _read(path):
    with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
        return f.read(1 << 20).decode("utf-8", "replace")


def _fold(text):
    t = "".join(c for c in text if 32 <= ord(c) < 127 or c in "\n\t")
    return re.sub(r"\s+", " ", t).strip()


def text_corpus(cache, limit=12 << 20):
    """ASCII text from the docs and man pages installed here, cached in the file cache."""
    if os.path.exists(cache):
        return open(cache, "rb").read()
    docs = sorted(glob.glob("/usr/share/doc/*/README*") + glob.glob("/usr/share/doc/*/copyright"))
    mans = sorted(glob.glob("/usr/share/man/man1/*.gz"))[::3]
    pieces, size = [], 0
    hay = os.path.realpath(os.path.join(HERE, "data", "haystack.txt"))
    for i, path in enumerate(docs + mans):
        if os.path.realpath(path) == hay or path.startswith("/usr/share/common-licenses"):
            continue
        try:
            t = _read(path)
        except (OSError, EOFError, ValueError):
            continue
        if path.startswith("/usr/share/man/"):
            t = _clean_man(t)
        t = _fold(t)
        if len(t) < 200:
            continue
        pieces.append(t.encode("ascii"))
        size += len(t) + 1
        if size > limit:
            break
    data = b" ".join(pieces)
    with open(cache + ".tmp", "wb") as f:
        f.write(data)
    os.replace(cache + ".tmp", cache)
    return data


# --- samples ---------------------------------------------------------------------------------

def text_tokens(text, tok, cache):
    """The corpus as tokens (numpy int32), cached in the file cache."""
    import numpy as np
    if os.path.exists(cache):
        return np.load(cache)
    ids = np.array(tok.encode(text), dtype=np.int32)
    np.save(cache + ".tmp.npy", ids)
    os.replace(cache + ".tmp.npy", cache)
    return ids


class Data:
    def __init__(self, args, rng, tok):
        import tasks
        self.tasks = tasks
        self.tok = tok
        self.hay = tasks.load_haystack()
        text = text_corpus(os.path.join(args.out, "text.bin"))
        self.text = text_tokens(text, tok, os.path.join(args.out, f"text-{tok.vocab}.npy"))
        self.rng = rng
        # What the mix's periodic copies draw from: the letters of the warm-up, or every
        # token but the specials, so that copying is learnt for each of them (the number
        # tokens of a subword vocabulary are each rare in the text).
        self.periodic_tokens = (list(range(256)) + list(range(260, tok.vocab))
                                if args.periodic_vocab == "all" else None)
        self.text_frac = args.text_frac
        self.copy_frac = args.copy_frac
        self.copy_random = args.copy_random
        self.drill_frac = args.drill_frac
        mix = dict(kv.split(":") for kv in args.task_mix.split(","))
        self.task_names = list(mix)
        self.task_weights = [float(mix[t]) for t in self.task_names]

    def sample(self, length, warm=0.0):
        """(tokens, answer_spans): one training sequence of about length tokens; the spans
        [a, b) are the positions of answer tokens (extra loss weight). warm: the chance of a
        warm-up sample (sample_periodic) instead of the mix."""
        r = self.rng
        if warm and r.random() < warm:
            return self.sample_periodic(length), []
        x = r.random()
        if x < self.text_frac:
            off = r.randrange(len(self.text) - length)
            return [kvdlm.BOS] + self.text[off:off + length - 1].tolist(), []
        x -= self.text_frac
        if x < self.copy_frac:
            if r.random() < self.copy_random:
                return self.sample_periodic(length, self.periodic_tokens), []
            return self.sample_copy(length), []
        x -= self.copy_frac
        if x < self.drill_frac:
            return self.sample_drill(length)
        task = r.choices(self.task_names, self.task_weights)[0]
        seed = r.randrange(self.tasks.SEEDS_TRAIN.start, self.tasks.SEEDS_TRAIN.stop)
        n = max(length, self.tasks.min_length(task))
        prompt, _q, answer = self.tasks.make(self.hay, task, seed, n, self.tok)
        toks = [kvdlm.BOS] + self.tok.encode(prompt)
        a = len(toks)
        toks += self.tok.encode(self.tasks.completion(prompt, answer))
        return toks, [(a, len(toks))]

    def sample_periodic(self, length, tokens=None):
        """Warm-up: random lowercase letters (byte tokens; or random `tokens`) with a random
        period of 4..24, repeated to the end. Nearly every token can only be predicted by
        copying, so induction heads form in a few hundred steps (with text and tasks they
        had not in 900)."""
        r = self.rng
        span = r.choices(tokens or b"abcdefghijklmnopqrstuvwxyz", k=r.randint(4, 24))
        return [kvdlm.BOS] + (span * (length // len(span) + 1))[:length - 1]

    def sample_copy(self, length):
        """Induction aid: plain text in which one span comes back once at a random
        distance (a fixed distance would be learnt as a fixed-offset head, not as copying)."""
        r = self.rng
        n = length - 1
        k = r.randint(8, n // 2)                # the span
        gap = r.randint(0, n - 2 * k)           # text between the two copies
        lead = r.randint(0, n - 2 * k - gap)    # text before the first
        span = self.text_span(k)
        out = self.text_span(lead) + span + self.text_span(gap) + span
        return [kvdlm.BOS] + out + self.text_span(n - len(out))

    def text_span(self, n):
        off = self.rng.randrange(len(self.text) - n - 1)
        return self.text[off:off + n].tolist()

    def sample_drill(self, length):
        """Retrieval aid, in the tasks' own words but without filler: needles with random
        keys and values, then questions about them, each followed by its answer."""
        r = self.rng
        word = lambda: "".join(chr(97 + r.randrange(26)) for _ in range(6))
        num = lambda: str(1000000 + r.randrange(9000000))
        enc = self.tok.encode
        needles, size = [], 1
        while size < length * 0.55 or len(needles) < 2:
            k, v = word(), num()
            s = enc(f" The special magic number for {k} is {v}.")
            needles.append((k, v, s))
            size += len(s)
        toks = [kvdlm.BOS] + [t for _, _, s in needles for t in s]
        spans = []
        while len(toks) < length:
            k, v, _ = needles[r.randrange(len(needles))]
            toks += enc(f"\nQuestion: What is the special magic number for {k}?\nAnswer:")
            a = len(toks)
            toks += enc(f" {v}\n")
            spans.append((a, len(toks)))
        return toks, spans

    def batch(self, length, count, warm=0.0):
        """tokens [B,T], targets [B,T] (-100 where none), answer mask [B,T] (bool)."""
        seqs = [self.sample(length, warm) for _ in range(count)]
        T = max(len(s) for s, _ in seqs) - 1
        x = torch.full((count, T), kvdlm.PAD, dtype=torch.int64)
        y = torch.full((count, T), -100, dtype=torch.int64)
        ans = torch.zeros((count, T), dtype=torch.bool)
        for i, (s, spans) in enumerate(seqs):
            n = len(s) - 1
            x[i, :n] = torch.tensor(s[:-1])
            y[i, :n] = torch.tensor(s[1:])
            for a, b in spans:
                ans[i, a - 1:b - 1] = True   # the positions predicting the answer tokens
        return x, y, ans


def parse_curriculum(spec):
    """"0:256/512,0.35:512/1024/2048,0.75:1024/2048/4096" -> [(start, [lengths])]."""
    out = []
    for part in spec.split(","):
        start, lens = part.split(":")
        out.append((float(start), [int(x) for x in lens.split("/")]))
    return sorted(out)


def lengths_at(curriculum, p):
    cur = curriculum[0][1]
    for start, lens in curriculum:
        if p >= start:
            cur = lens
    return cur


# --- evaluation ------------------------------------------------------------------------------

def evaluate(model, tok, tasks_mod, hay, task_list, lengths, seeds, n, verbose=False):
    """{(task, length): (correct, n)}: greedy, full cache, exact match (tasks.score)."""
    was_training = model.training
    model.eval()
    res = {}
    for task in task_list:
        for length in lengths:
            ok = 0
            for i in range(n):
                prompt, _q, answer = tasks_mod.make(hay, task, seeds.start + i, length, tok)
                out = model.generate(kvdlm.encode(prompt, tok), tasks_mod.GENERATE_MAX,
                                     stop=(NEWLINE, kvdlm.EOS))
                gen = tok.decode(t if t not in range(256, 260) else 0 for t in out)
                good = tasks_mod.score(prompt, answer, gen)
                ok += good
                if verbose and not good and i < 3:
                    log(f"  {task} {length} #{i}: want {answer!r} got {gen!r}")
            res[(task, length)] = (ok, n)
    model.train(was_training)
    return res


def format_table(res, task_list, lengths, title):
    lines = [title, "", "| task | " + " | ".join(f"{l}" for l in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for t in task_list:
        cells = []
        for l in lengths:
            ok, n = res[(t, l)]
            cells.append(f"{100.0 * ok / n:.0f}% ({ok}/{n})")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --- training --------------------------------------------------------------------------------

def model_config(args, vocab):
    return kvdlm.Config(vocab=vocab, dim=args.dim, layers=args.layers,
                        q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        ffn=args.ffn, max_positions=args.max_positions,
                        rope_theta=args.rope_theta, norm_eps=1e-5)


def tie_embeddings(model, args):
    """With --tie-embeddings, lm_head is tok_emb: one matrix trained (and saved twice, as
    the file format has both), so that copying a token is close to an identity map."""
    if args.tie_embeddings:
        model.lm_head = model.tok_emb


def load_tokenizer(path):
    return tokenizer.load(path) if path else tokenizer.BYTES


def save_model(model, tok, path):
    """The weights, and the tokenizer beside them unless it is the byte-level one."""
    kvdlm.save(model, path)
    if tok.merges:
        with open(os.path.splitext(path)[0] + ".kvdtok", "wb") as f:
            f.write(tok.to_bytes())


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(args, step, p):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def save_ckpt(path, model, opt, state, rng, args):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                "config": vars(model.cfg), "args": vars(args)}, tmp)
    os.replace(tmp, path)


def train(args):
    tune_malloc()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "history": []}
    if args.resume:
        ck = torch.load(ckpt_path)
        # The run's own shape, data and schedule; a larger --minutes stretches the schedule.
        for k, v in ck["args"].items():
            if k not in ("out", "resume", "threads", "minutes", "max_steps", "session_minutes",
                         "ckpt_minutes", "eval_n", "log_every"):
                setattr(args, k, v)
        if args.minutes is None:
            args.minutes = ck["args"]["minutes"]
        tok = load_tokenizer(args.tokenizer)
        model = kvdlm.Model(model_config(args, tok.vocab))
        tie_embeddings(model, args)
        model.load_state_dict(ck["model"])
        opt = make_optimizer(model, args)
        opt.load_state_dict(ck["opt"])
        state = ck["state"]
        rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"])
        log(f"resumed at step {state['step']}, {state['elapsed'] / 60:.1f} min trained")
    else:
        if args.minutes is None:
            args.minutes = 48.0
        tok = load_tokenizer(args.tokenizer)
        model = kvdlm.Model(model_config(args, tok.vocab))
        model.init_weights(torch.Generator().manual_seed(args.seed), std=args.init_std)
        tie_embeddings(model, args)
        opt = make_optimizer(model, args)
    with open(os.path.join(args.out, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=1)
    log(f"model {vars(model.cfg)}, {model.cfg.n_elements()} parameters")
    data = Data(args, rng, tok)
    log(f"text corpus {len(data.text)} tokens")
    curriculum = parse_curriculum(args.curriculum)
    budget = args.minutes * 60.0
    # This invocation's share: a long schedule runs as several resumed runs.
    stop_at = state["elapsed"] + args.session_minutes * 60.0 if args.session_minutes else budget
    model.train()
    last_ckpt = time.time()
    ema = None
    while state["elapsed"] < min(budget, stop_at) and (not args.max_steps or
                                                       state["step"] < args.max_steps):
        t0 = time.time()
        p = state["elapsed"] / budget
        if state.setdefault("warm_end", None) is None and (
                p >= args.warm_max or (state["step"] >= 100 and ema is not None
                                     and ema["lm"] < args.warm_until)):
            state["warm_end"] = state["step"]
            log(f"warm-up done at step {state['step']} (lm loss ema "
                f"{ema['lm'] if ema else float('nan'):.3f})")
            save_ckpt(os.path.join(args.out, "warm.pt"), model, opt, state, rng, args)
        if state["warm_end"] is None:
            warm, length = 1.0, args.warm_length
        else:   # then the mix takes over gradually (an abrupt switch undid the induction heads)
            warm = max(0.0, 1.0 - (state["step"] - state["warm_end"]) / args.warm_ramp)
            length = rng.choice(lengths_at(curriculum, p))
        count = max(1, args.batch_tokens // length)
        micro = max(1, min(count, args.micro_tokens // length))
        lr = lr_at(args, state["step"], p)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        tot = {"lm": 0.0, "ans": 0.0}
        for m0 in range(0, count, micro):
            mc = min(micro, count - m0)
            x, y, ans = data.batch(length, mc, warm=warm)
            logits = model(x, q_chunk=args.q_chunk)
            ce = F.cross_entropy(logits.view(-1, tok.vocab), y.view(-1), reduction="none",
                                 ignore_index=-100).view(y.shape)
            valid = y != -100
            lm = ce[valid].mean()
            a = ce[ans].mean() if ans.any() else torch.zeros(())
            loss = (lm + args.answer_weight * a) * (mc / count)
            loss.backward()
            tot["lm"] += lm.item() * mc / count
            tot["ans"] += a.item() * mc / count
            state["tokens"] += int(valid.sum())
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        state["step"] += 1
        dt = time.time() - t0
        state["elapsed"] += min(dt, 120.0)   # a stopped process (SIGSTOP) does not count
        ema = tot if ema is None else {k: 0.95 * ema[k] + 0.05 * tot[k] for k in tot}
        if state["step"] % args.log_every == 0:
            log(f"step {state['step']} {state['elapsed'] / 60:.1f}/{args.minutes} min "
                f"len {length} x{count} lm {tot['lm']:.3f} ans {tot['ans']:.3f} "
                f"(ema {ema['lm']:.3f} / {ema['ans']:.3f}) lr {lr:.2e} "
                f"{count * length / dt:.0f} tok/s, {state['tokens'] / 1e6:.2f}M tokens")
        done = state["elapsed"] >= min(budget, stop_at) or (args.max_steps and
                                                            state["step"] >= args.max_steps)
        if done or time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(ckpt_path, model, opt, state, rng, args)
            save_model(model, tok, os.path.join(args.out, "latest.kvdlm"))
            if args.eval_n:
                lens = sorted(set(min(l, 2048) for l in lengths_at(curriculum, p)
                                  if l >= 512) | {1024})
                t1 = time.time()
                res = evaluate(model, tok, data.tasks, data.hay, ["niah", "multikey"], lens,
                               data.tasks.SEEDS_TUNE, args.eval_n)
                summary = " ".join(f"{t}@{l} {ok}/{n}" for (t, l), (ok, n) in res.items())
                state["history"].append((state["step"], state["elapsed"], summary))
                log(f"checkpoint step {state['step']}: tuning {summary} "
                    f"({time.time() - t1:.0f} s)")
                save_ckpt(ckpt_path, model, opt, state, rng, args)
            last_ckpt = time.time()
    if state["elapsed"] < budget and not (args.max_steps and state["step"] >= args.max_steps):
        log(f"stopped after this run's {args.session_minutes} minutes at "
            f"{state['elapsed'] / 60:.1f} of {args.minutes}: continue with --resume")
        return
    final = os.path.join(args.out, "final.kvdlm")
    save_model(model, tok, final)
    log(f"done: {state['step']} steps, {state['tokens'] / 1e6:.2f}M tokens, "
        f"{state['elapsed'] / 60:.1f} min; wrote {final}")


def cmd_eval(args):
    torch.set_num_threads(args.threads)
    import tasks
    model = kvdlm.load(args.model)
    tok = model.tok
    hay = tasks.load_haystack()
    seeds = tasks.SEEDS_REPORT if args.seeds == "report" else tasks.SEEDS_TUNE
    task_list = args.tasks.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.time()
    res = evaluate(model, tok, tasks, hay, task_list, lengths, seeds, args.n, verbose=args.verbose)
    title = (f"kvd-lm eval of {os.path.basename(args.model)}: exact match, greedy, full cache "
             f"(no eviction), {args.n} samples per cell, {args.seeds.upper()} seeds "
             f"[{seeds.start:#x}, +{args.n}), tasks.py; prompt length in tokens incl. BOS")
    table = format_table(res, task_list, lengths, title)
    print(table, end="")
    log(f"eval took {time.time() - t0:.0f} s")
    if args.table:
        with open(args.table, "w") as f:
            f.write(table)


def cmd_tokenizer(args):
    """Learns the subword vocabulary from the training text: the plain-text corpus, and
    task and drill samples of TRAINING seeds as the mix draws them (byte-level, lengths
    512..4096 bytes), in about the shares training sees them; the digit merges first."""
    import tasks
    os.makedirs(args.work, exist_ok=True)
    text = text_corpus(os.path.join(args.work, "text.bin"))
    rng = random.Random(args.seed)
    hay = tasks.load_haystack()
    mix = dict(kv.split(":") for kv in args.task_mix.split(","))
    names, weights = list(mix), [float(mix[t]) for t in mix]
    samples, size = [], 0
    while size < args.task_bytes:
        task = rng.choices(names, weights)[0]
        seed = rng.randrange(tasks.SEEDS_TRAIN.start, tasks.SEEDS_TRAIN.stop)
        n = max(rng.randint(512, 4096), tasks.min_length(task))
        prompt, _q, answer = tasks.make(hay, task, seed, n)
        samples.append(prompt + tasks.completion(prompt, answer))
        size += len(samples[-1])
    t0 = time.time()
    counts = tokenizer.count_pieces([text] + samples)
    tok = tokenizer.train(counts, args.vocab, tokenizer.digit_merges())
    with open(args.out, "wb") as f:
        f.write(tok.to_bytes())
    per = len(text[:1 << 20]) / len(tok.encode(text[:1 << 20]))
    log(f"{args.out}: vocab {tok.vocab} from {len(text)} bytes of text and {size} of tasks "
        f"({time.time() - t0:.0f} s); {per:.2f} bytes a token on the text")


def cmd_export(args):
    ck = torch.load(args.ckpt)
    model = kvdlm.Model(kvdlm.Config(**ck["config"]))
    model.load_state_dict(ck["model"])
    save_model(model, load_tokenizer(ck["args"].get("tokenizer")), args.output)
    print(f"{args.output}: step {ck['state']['step']}, {ck['state']['elapsed'] / 60:.1f} min")


def main():
    ap = argparse.ArgumentParser(description="train and evaluate kvd-lm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", required=True, help="directory for checkpoints and results")
    t.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    t.add_argument("--minutes", type=float,
                   help="training wall-clock budget (default: 48; with --resume, the run's)")
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--session-minutes", type=float, default=0.0,
                   help="stop, with a checkpoint, after this many minutes of training in this "
                        "run (default: run to the end); --resume continues")
    t.add_argument("--tokenizer", help="a .kvdtok file (train.py tokenizer); default: bytes")
    t.add_argument("--dim", type=int, default=128)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--q-heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--head-dim", type=int, default=32)
    t.add_argument("--ffn", type=int, default=384)
    t.add_argument("--rope-theta", type=float, default=50000.0)
    t.add_argument("--max-positions", type=int, default=4096)
    t.add_argument("--init-std", type=float, default=0.05)
    t.add_argument("--tie-embeddings", action="store_true",
                   help="train lm_head and tok_emb as one matrix")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--min-lr-frac", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=50, help="warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--micro-tokens", type=int, default=8192)
    t.add_argument("--q-chunk", type=int, default=256)
    t.add_argument("--answer-weight", type=float, default=4.0)
    t.add_argument("--text-frac", type=float, default=0.1, help="share of plain text")
    t.add_argument("--copy-frac", type=float, default=0.3, help="share of copies")
    t.add_argument("--copy-random", type=float, default=0.6,
                   help="share of copies that are periodic random letters, not text")
    t.add_argument("--drill-frac", type=float, default=0.2, help="share of needle drills")
    t.add_argument("--periodic-vocab", choices=("letters", "all"), default="letters",
                   help="what the mix's periodic copies draw from (the warm-up: letters)")
    t.add_argument("--warm-until", type=float, default=1.0,
                   help="warm up on periodic copies (sample_periodic) until the loss is below this")
    t.add_argument("--warm-max", type=float, default=0.25, help="but at most this share of the time")
    t.add_argument("--warm-length", type=int, default=128)
    t.add_argument("--warm-ramp", type=int, default=400,
                   help="steps over which the warm-up samples give way to the mix")
    t.add_argument("--task-mix", default="niah:0.35,multikey:0.35,multivalue:0.1,vt:0.1,cwe:0.1")
    t.add_argument("--curriculum", default="0:256/384/512,0.45:512/1024/2048,0.75:1024/2048/4096",
                   help="START:LEN/LEN/...,...: lengths drawn from by fraction of time spent")
    t.add_argument("--ckpt-minutes", type=float, default=5.0)
    t.add_argument("--eval-n", type=int, default=16, help="tuning samples per eval cell")
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--seed", type=int, default=1)
    t.add_argument("--threads", type=int, default=2)
    e = sub.add_parser("eval")
    e.add_argument("model")
    e.add_argument("--seeds", choices=("tune", "report"), default="tune")
    e.add_argument("--n", type=int, default=50)
    e.add_argument("--lengths", default="1024,2048,4096")
    e.add_argument("--tasks", default="niah,multikey")
    e.add_argument("--table", help="also write the table to this file")
    e.add_argument("--verbose", action="store_true")
    e.add_argument("--threads", type=int, default=2)
    k = sub.add_parser("tokenizer", help="learn the subword vocabulary (a .kvdtok file)")
    k.add_argument("--out", required=True, help="the .kvdtok file to write")
    k.add_argument("--vocab", type=int, default=3072)
    k.add_argument("--work", default="/tmp/kvdlm-tokenizer", help="cache of the text corpus")
    k.add_argument("--task-bytes", type=int, default=4 << 20, help="bytes of task samples")
    k.add_argument("--task-mix", default="niah:0.35,multikey:0.35,multivalue:0.1,vt:0.1,cwe:0.1")
    k.add_argument("--seed", type=int, default=1)
    x = sub.add_parser("export")
    x.add_argument("ckpt")
    x.add_argument("output")
    args = ap.parse_args()
    {"train": train, "eval": cmd_eval, "export": cmd_export,
     "tokenizer": cmd_tokenizer}[args.cmd](args)


if __name__ == "__main__":
    main()
