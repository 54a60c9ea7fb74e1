#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""kvd-lm's inference in PyTorch with its KV cache in kvd: the C engine (kvd-lm) again, on the
Python binding (docs/engines.md, "A PyTorch engine on kvd").

The model is kvdlm.py's (README.md). The cache follows the C engine's (cache.h) step by
step, so that both make the same requests of the daemon: per_head blocks of 16 tokens in
f32, W_o uploaded per layer, and every step (a prefill chunk of --chunk tokens, or one
decoded token) grows the sequence, pins it, writes each new token's post-RoPE K and V into
the new slots of its (layer, kv head) tables through the block tables, attends over the
slots the tables hold by their original positions (a paged attention: the table's blocks
gathered from the pool with index_select), publishes the layer's last --window queries
once it has that many, unpins and drains the events. With --check, every step also
attends over the same tokens read another way (Seq.block per block, Seq.position per slot)
as a plain dense attention, and fails when the two differ. With --compensation moments
(or moments-mass, moments-bounded), the daemon keeps the MomentKV moments of what it evicts from each table,
and attention adds them as one more softmax entry, as the C engine does (README.md,
"Compensation"). With --no-daemon the cache is kvdlm.py's private full cache.

With --samples N, it samples N continuations of the prompt in parallel (docs/engines.md,
"Fork"): sample i starts from the i-th token after the greedy one, then goes greedy; on the
daemon the prompt is prefilled once and forked (Seq.fork) for every sample but the first.
With --question Q (repeated), each question is a request of its own whose prompt is the
--prompt (a system prompt shared by all) and Q; on the daemon each opens with its prompt's
block keys (kvd.prefix_keys, root seed "kvd-lm": "Prefix sharing"), prefills only what was
not found, and publishes its blocks. --no-share runs both without sharing: every sample and
request on a sequence of its own, its whole prompt prefilled. --stats reports the block
bytes held with every sample or request open, and the prefill tokens skipped.

With --draft K, it decodes speculatively (docs/engines.md, "Rollback"): each step feeds the
next token and K draft tokens (prompt lookup: what followed the last earlier occurrence of
the current token), keeps the drafts the model agrees with, and drops the rest from the
sequence with Seq.truncate; the text is plain decoding's.

    kvd-lm-torch.py --model FILE [--socket PATH | --no-daemon] [--prompt TEXT]
                    [--max-new N] [--chunk N] [--unit head|layer|block|none]
                    [--window W] [--compensation none|moments|moments-mass|moments-bounded]
                    [--evict-every N [--evict-bytes B]] [--draft K] [--print-logits] [--check]
                    [--samples N | --question Q...] [--no-share] [--stats]

Output as kvd-lm's: with --print-logits a line 'logits POSITION TOKEN' and the 260 logits
per generated token, then the text (special tokens as <eos> and so on); with --samples or
--question, each sample's or request's, its lines prefixed 'sample I ' or 'request I '. Not supported:
latent compensation and IndexMem (--indexmem), which only the C engine has.
"""

import argparse
import array
import copy
import errno
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvdlm  # noqa: E402

import kvd  # noqa: E402

BLOCK_TOKENS = 16
SEQ_SLACK = BLOCK_TOKENS    # kvd-lm.c's: room past the last token
UNITS = {"none": kvd.UNIT_NONE, "head": kvd.UNIT_HEAD_TOKEN, "layer": kvd.UNIT_LAYER_TOKEN,
         "block": kvd.UNIT_BLOCK}
# kvd_moments_header: 64 bytes (count, head_dim, ...), then mean_k, mean_v, var_k [hd] and
# cov_vk [hd][hd], fp32 (kernels/moments.h).
MOMENTS_HEADER_BYTES = 64


class KvdCache:
    """The sequence's K/V in kvd: per_head tables, read and written through the block range."""

    def __init__(self, client, model, unit, window, max_tokens, check, compensation,
                 prefix_keys=None):
        cfg = model.cfg
        self.cfg, self.client, self.window, self.check = cfg, client, window, check
        self.compensation = compensation      # None, "moments", "moments-mass" or "moments-bounded"
        self.model_id = client.register_model(
            cfg.layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim, kvd.DTYPE_F32, BLOCK_TOKENS,
            kvd.LAYOUT_PER_HEAD, name="kvd-lm", unit=unit, window=window,
            compensation=kvd.COMPENSATION_MOMENTS if compensation else kvd.COMPENSATION_NONE)
        self.observe_windows = unit != kvd.UNIT_NONE
        for li, L in enumerate(model.layers if self.observe_windows else []):
            wo = L.wo.detach().contiguous().numpy()
            for tries in range(100):      # the daemon computes uploads off its loop
                try:
                    client.output_proj(self.model_id, li, kvd.DTYPE_F32, cfg.dim, wo)
                    break
                except kvd.KvdError as e:
                    if e.errno != errno.EBUSY or tries == 99:
                        raise
                    time.sleep(0.01)
        pool, stride = client.block_pool(self.model_id)
        kv_elems = 2 * BLOCK_TOKENS * cfg.head_dim
        # A per_head block: K [block_tokens][head_dim], then V: [n_blocks][2][bt][hd].
        self.kv = torch.from_dlpack(pool).view(torch.float32)[:, :kv_elems].unflatten(
            1, (2, BLOCK_TOKENS, cfg.head_dim))
        self.seq = client.open(self.model_id, max_tokens, prefix_keys=prefix_keys)
        # A prefix open starts with the tokens it found.
        self.next_pos = self.seq.tokens()
        self.changed = 0
        # The last `window` queries of each layer, oldest first once full (cache.c's ring).
        self.ring = [torch.zeros(0, cfg.q_heads * cfg.head_dim) for _ in range(cfg.layers)]

    def fork(self):
        """A cache over a fork of this one's sequence, with its windows, between steps."""
        kid = copy.copy(self)
        kid.seq, kid.ring, kid.changed = self.seq.fork(), list(self.ring), 0
        return kid

    def open_request(self, max_tokens, prefix_keys=None):
        """A cache over a new sequence of the same model (with prefix_keys, a prefix open)."""
        other = copy.copy(self)
        other.seq = self.client.open(self.model_id, max_tokens, prefix_keys=prefix_keys)
        other.next_pos, other.changed = other.seq.tokens(), 0
        other.ring = [torch.zeros(0, self.cfg.q_heads * self.cfg.head_dim) for _ in self.ring]
        return other

    def begin(self, n):
        """Appends n tokens: grow (which may wait for a round), then pin. Returns pos0."""
        self.seq.grow(n)
        self.seq.pin()
        pos0 = self.next_pos
        self.next_pos += n
        return pos0

    def attend(self, layer, kv_head, k_new, v_new, q, q_pos):
        """Writes the new tokens' K and V ([n][hd]) into the table's last n slots, then
        attends q ([t][g][hd], the kv head's query heads) over what the table holds."""
        blocks, positions, _ = self.seq.block_table(layer, kv_head)
        blocks = torch.from_dlpack(blocks).to(torch.int64)
        pos = torch.from_dlpack(positions).to(torch.int64)
        n_all, n = pos.shape[0], k_new.shape[0]
        slots = torch.arange(n_all - n, n_all)
        b, r = blocks[slots // BLOCK_TOKENS], slots % BLOCK_TOKENS
        self.kv[b, 0, r] = k_new
        self.kv[b, 1, r] = v_new
        # Paged attention: only the table's blocks are gathered from the pool.
        g = self.kv.index_select(0, blocks)                     # [nb][2][bt][hd]
        k = g[:, 0].reshape(-1, self.cfg.head_dim)[:n_all]
        v = g[:, 1].reshape(-1, self.cfg.head_dim)[:n_all]
        extra = self.moments_entry(layer, kv_head, q)
        out = dense_attention(q, q_pos, k, v, pos, extra)
        if self.check:
            want = dense_attention(q, q_pos, *self.read_slots(layer, kv_head), extra)
            if not torch.allclose(out, want, rtol=1e-5, atol=1e-6):
                raise RuntimeError(f"layer {layer} kv head {kv_head}: the paged attention "
                                   f"differs from the dense one by "
                                   f"{float((out - want).abs().max()):.3g}")
        return out

    def moments_entry(self, layer, kv_head, q):
        """The evicted tokens' softmax entry for q ([t][g][hd]): (logit [t][g], value
        [t][g][hd]), or None when nothing was evicted from the table (or no compensation).
        Plain: logit s q.mu_k + ln n, value mu_v + s C_vk q; mass adds s^2 q.var_k q / 2;
        bounded caps that by ln n + s |q| key_norm_max and plain + s |q| key_radius."""
        if not self.compensation:
            return None
        raw = torch.from_dlpack(self.seq.moments(layer, kv_head))
        count = int(raw[:8].view(torch.int64)[0])
        if count == 0:
            return None
        hd = self.cfg.head_dim
        f = raw[MOMENTS_HEADER_BYTES:].view(torch.float32)
        mean_k, mean_v, var_k = f[:hd], f[hd:2 * hd], f[2 * hd:3 * hd]
        cov_vk = f[3 * hd:3 * hd + hd * hd].view(hd, hd)
        s = hd ** -0.5
        ln_n = torch.log(torch.tensor(float(count)))
        plain = s * (q @ mean_k) + ln_n
        logit = plain
        if self.compensation in ("moments-mass", "moments-bounded"):
            logit = plain + s * s * (q * q) @ var_k / 2
        if self.compensation == "moments-bounded":
            key_norm_max, key_radius = (float(x) for x in raw[12:20].view(torch.float32))
            q_norm = q.norm(dim=-1)
            logit = torch.minimum(logit, ln_n + s * q_norm * key_norm_max)
            logit = torch.minimum(logit, plain + s * q_norm * key_radius)
            logit = torch.maximum(logit, plain)
        value = mean_v + s * torch.einsum("ab,tgb->tga", cov_vk, q)
        return logit.clone(), value.clone()

    def read_slots(self, layer, kv_head):
        """The table's K, V and positions, read without the block table: Seq.block per
        block, Seq.position per slot."""
        cfg, seq = self.cfg, self.seq
        t = layer * cfg.kv_heads + kv_head
        n = seq.tokens(layer, kv_head)
        ks, vs = [], []
        for i in range((n + BLOCK_TOKENS - 1) // BLOCK_TOKENS):
            blk = torch.from_dlpack(seq.block(t, i)).clone()   # [2][bt][hd]
            ks.append(blk[0])
            vs.append(blk[1])
        pos = torch.tensor([seq.position(layer, kv_head, j) for j in range(n)])
        return torch.cat(ks)[:n], torch.cat(vs)[:n], pos

    def observe(self, layer, q):
        """q [n][q_heads * hd]: the layer's new post-RoPE queries, into its window."""
        if not self.observe_windows:
            return
        ring = torch.cat([self.ring[layer], q])[-self.window:]
        self.ring[layer] = ring
        if ring.shape[0] < self.window:
            return
        cfg = self.cfg
        obs = torch.from_dlpack(self.seq.observation(layer))    # [q_heads][window][hd]
        obs.copy_(ring.view(self.window, cfg.q_heads, cfg.head_dim).transpose(0, 1))
        del obs
        self.seq.observe(layer)

    def truncate(self, n):
        """Drops the last n positions (rejected drafts), and their queries from the windows:
        the window then holds fewer until the next steps fill it again."""
        self.seq.truncate(n)
        self.next_pos -= n
        self.ring = [r[:-n] for r in self.ring]

    def end(self):
        self.seq.unpin()
        while (ev := self.client.next_event()) is not None:
            if ev[0] == kvd.EVENT_SEQ_CHANGED and ev[1] == self.seq.id:
                self.changed += 1

    def close(self):
        self.kv = None
        self.seq.release()


def dense_attention(q, q_pos, k, v, k_pos, extra=None):
    """q [t][g][hd] at positions q_pos over k, v [n][hd] at k_pos: softmax(q k / sqrt(hd)) v,
    a key attended when its position is at most the query's; extra (logit [t][g], value
    [t][g][hd]) is one more entry, the evicted tokens' (all of them precede every query).
    Returns [t][g][hd]."""
    scores = torch.einsum("tgd,nd->tgn", q, k) / (q.shape[-1] ** 0.5)
    scores = scores.masked_fill(k_pos.view(1, 1, -1) > q_pos.view(-1, 1, 1), float("-inf"))
    if extra is None:
        return torch.einsum("tgn,nd->tgd", torch.softmax(scores, dim=-1), v)
    w = torch.softmax(torch.cat([scores, extra[0].unsqueeze(-1)], dim=-1), dim=-1)
    return torch.einsum("tgn,nd->tgd", w[..., :-1], v) + w[..., -1:] * extra[1]


def step_kvd(model, cache, tokens, every=False):
    """One step of the engine on kvd: tokens [n] -> the last token's logits [vocab], or with
    every, each token's [n][vocab]."""
    cfg = model.cfg
    n, hd, group = len(tokens), cfg.head_dim, cfg.q_heads // cfg.kv_heads
    pos0 = cache.begin(n)
    try:
        positions = torch.arange(pos0, pos0 + n)
        cos, sin = kvdlm.rope_cos_sin(positions, model.inv_freq)
        h = F.embedding(torch.tensor(tokens), model.tok_emb)
        for li, L in enumerate(model.layers):
            a = kvdlm.rmsnorm(h, L.attn_norm, cfg.norm_eps)
            q = kvdlm.apply_rope(F.linear(a, L.wq).view(n, cfg.q_heads, hd), cos, sin)
            k = kvdlm.apply_rope(F.linear(a, L.wk).view(n, cfg.kv_heads, hd), cos, sin)
            v = F.linear(a, L.wv).view(n, cfg.kv_heads, hd)
            o = torch.empty(n, cfg.q_heads, hd)
            for kh in range(cfg.kv_heads):
                heads = slice(kh * group, (kh + 1) * group)
                o[:, heads] = cache.attend(li, kh, k[:, kh], v[:, kh], q[:, heads], positions)
            cache.observe(li, q.reshape(n, -1))
            h = h + F.linear(o.reshape(n, -1), L.wo)
            m = kvdlm.rmsnorm(h, L.ffn_norm, cfg.norm_eps)
            h = h + F.linear(F.silu(F.linear(m, L.w_gate)) * F.linear(m, L.w_up), L.w_down)
        h = kvdlm.rmsnorm(h if every else h[-1:], model.final_norm, cfg.norm_eps)
        logits = F.linear(h, model.lm_head)
        return logits if every else logits[0]
    finally:
        cache.end()


def draft_tokens(context, k):
    """Prompt lookup: the k tokens that followed the last earlier occurrence of context's
    last token (fewer at the end, none without one)."""
    last = context[-1]
    for i in range(len(context) - 2, -1, -1):
        if context[i] == last:
            return context[i + 1:i + 1 + k]
    return []


def speculate(model, cache, tokens, logits, args):
    """Greedy decoding with drafts, from the prompt's last logits: each step feeds the next
    token and its drafts, keeps the drafts the model's own choices agree with, and truncates
    the rest from the sequence. Returns (tokens out, drafts fed, drafts kept)."""
    context, out = list(tokens), []
    drafted = accepted = 0

    def emit(tok, lg):
        """Appends tok, chosen by logits lg; says whether decoding goes on (plain
        decoding's stops)."""
        if args.print_logits:
            print(f"logits {len(tokens) + len(out)} {tok} " +
                  " ".join(f"{float(x):.9g}" for x in lg))
        out.append(tok)
        context.append(tok)
        return not (tok == kvdlm.EOS or (tok == ord("\n") and not args.no_stop) or
                    len(out) == args.max_new)

    nxt = int(torch.argmax(logits))
    going = emit(nxt, logits)
    while going:
        drafts = draft_tokens(context, args.draft)[:args.max_new - len(out)]
        every = step_kvd(model, cache, [nxt] + drafts, every=True)
        drafted += len(drafts)
        kept = 0
        # every[i]: the logits after nxt and the first i drafts, which choose the next.
        while going and kept < len(drafts) and int(torch.argmax(every[kept])) == drafts[kept]:
            going = emit(drafts[kept], every[kept])
            kept += 1
        accepted += kept
        if kept < len(drafts):
            cache.truncate(len(drafts) - kept)
        if going:
            logits = every[kept]
            nxt = int(torch.argmax(logits))
            going = emit(nxt, logits)
    return out, drafted, accepted


def prefill(step, tokens, start, chunk):
    """Feeds tokens[start:] in steps of chunk; returns the last one's logits."""
    for c0 in range(start, len(tokens), chunk):
        logits = step(tokens[c0:c0 + chunk])
    return logits


def greedy(step, logits, position, first, args):
    """Greedy decoding from logits at position, the first token the first-th best:
    [(position, token, logits)] with plain decoding's stops."""
    out = []
    while len(out) < args.max_new:
        tok = int(torch.argsort(logits, descending=True)[first]) if not out else \
            int(torch.argmax(logits))
        out.append((position, tok, logits))
        if tok == kvdlm.EOS or (tok == ord("\n") and not args.no_stop) or \
                len(out) == args.max_new:
            break
        logits = step([tok])
        position += 1
    return out


def run_shared(model, tokens, args):
    """--samples and --question: several sequences of one engine, shared or not."""
    prompts = [tokens] * args.samples if not args.question else \
        [tokens + list(q.encode()) for q in args.question]
    label = "request" if args.question else "sample"
    outs, caches, skipped, held = [], [], 0, 0
    with torch.no_grad():
        if args.no_daemon:
            private = [None] * model.cfg.layers
            base = None
            for i, toks in enumerate(prompts):
                if args.question or i == 0:
                    private = [None] * model.cfg.layers
                    base = prefill(lambda t: model.forward(torch.tensor([t]), cache=private)[0, -1],
                                   toks, 0, args.chunk)
                mine = copy.deepcopy(private)
                outs.append(greedy(lambda t: model.forward(torch.tensor([t]), cache=mine)[0, -1],
                                   base, len(toks), 0 if args.question else i, args))
        else:
            client = kvd.Client(args.socket, args.tenant)
            root = kvd.key_root("kvd-lm")
            for i, toks in enumerate(prompts):
                room = len(toks) + args.max_new + SEQ_SLACK
                keys = None if args.no_share or not args.question else \
                    kvd.prefix_keys(array.array("I", toks), BLOCK_TOKENS, root)
                if not caches:
                    cache = KvdCache(client, model, UNITS[args.unit], args.window, room,
                                     args.check, None, prefix_keys=keys or None)
                elif args.question or args.no_share:
                    cache = caches[0].open_request(room, keys or None)
                else:
                    cache = caches[0].fork()
                caches.append(cache)
                if args.question or args.no_share or i == 0:
                    skipped += cache.next_pos
                    logits = prefill(lambda t: step_kvd(model, cache, t), toks, cache.next_pos,
                                     args.chunk)
                    if keys:
                        cache.seq.publish(len(keys) // kvd.KEY_BYTES)
                    if i == 0:
                        first_logits = logits
                else:
                    skipped += len(toks)      # the fork's prompt is the first sample's
                    logits = first_logits
                # The samples branch before any of them decodes: each fork is of the prompt.
                outs.append((cache, logits, len(toks), 0 if args.question else i))
            outs = [greedy(lambda t, c=c: step_kvd(model, c, t), lg, pos, first, args)
                    for c, lg, pos, first in outs]
            held = client.status().tenant(args.tenant, "block_bytes")
            for cache in caches:
                cache.close()
            client.close()
    for i, out in enumerate(outs):
        if args.print_logits:
            for pos, tok, lg in out:
                print(f"{label} {i} logits {pos} {tok} " + " ".join(f"{float(x):.9g}" for x in lg))
        text = model.tok.decode([tok for _, tok, _ in out])
        print(f"{label} {i} " + text.decode("utf-8", "replace").replace("\n", "\\n"))
    if args.stats and not args.no_daemon:
        print(f"kvd-lm-torch: {held} block bytes held by {len(prompts)} {label}s, "
              f"{skipped} of {sum(len(p) for p in prompts)} prompt tokens not prefilled",
              file=sys.stderr)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", default=None, help="default: $KVD_SOCKET, else the default")
    ap.add_argument("--no-daemon", action="store_true", help="kvdlm.py's private full cache")
    ap.add_argument("--tenant", default="kvd-lm")
    ap.add_argument("--prompt", default="")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--no-stop", action="store_true", help="do not stop at a newline")
    ap.add_argument("--chunk", type=int, default=256, help="prefill step, tokens")
    ap.add_argument("--unit", choices=UNITS, default="head")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--compensation", choices=["none", "moments", "moments-mass", "moments-bounded"],
                    default="none", help="what the daemon keeps of evicted tokens")
    ap.add_argument("--evict-every", type=int, default=0, metavar="N",
                    help="after each decode step that reaches a multiple of N positions, an "
                    "eviction round of --evict-bytes on this tenant (as kvd-lm's)")
    ap.add_argument("--evict-bytes", type=int, default=0, metavar="B",
                    help="bytes each of those rounds frees (default: one chunk)")
    ap.add_argument("--draft", type=int, default=0, metavar="K",
                    help="decode speculatively with K draft tokens a step (needs the daemon)")
    ap.add_argument("--samples", type=int, default=1, metavar="N",
                    help="N samples of the prompt, forked on the daemon (1..64)")
    ap.add_argument("--question", action="append", default=[], metavar="Q",
                    help="a request of --prompt and Q (repeat it), by prefix open on the daemon")
    ap.add_argument("--no-share", action="store_true",
                    help="samples and requests each on its own sequence, prefilled whole")
    ap.add_argument("--print-logits", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="check every attention against a dense one over Seq.block reads")
    ap.add_argument("--stats", action="store_true", help="evictions seen, on stderr")
    args = ap.parse_args(argv)
    if args.chunk < 1 or args.max_new < 0 or not 1 <= args.window <= 256 or \
            args.evict_every < 0 or args.evict_bytes < 0:
        ap.error("--chunk, --max-new, --window or --evict-* out of range")
    if args.evict_every and (args.no_daemon or args.unit == "none"):
        ap.error("--evict-every needs the daemon and a --unit other than none")
    if args.compensation != "none" and (args.no_daemon or args.unit == "none"):
        ap.error("--compensation needs the daemon and a --unit other than none")
    if not 0 <= args.draft <= 64 or (args.draft and (args.no_daemon or args.evict_every)):
        ap.error("--draft is 0..64, needs the daemon, and is not for --evict-every")
    if not 1 <= args.samples <= 64 or (args.samples > 1 and args.question) or \
            ((args.samples > 1 or args.question) and (args.draft or args.evict_every)):
        ap.error("--samples is 1..64, not with --question, and neither with --draft or "
                 "--evict-every")

    torch.set_num_threads(1)    # the same summation order from run to run
    model = kvdlm.load(args.model)
    tokens = kvdlm.encode(args.prompt, model.tok)   # BOS + the prompt's tokens
    if args.samples > 1 or args.question:
        return run_shared(model, tokens, args)
    cache, client = None, None
    with torch.no_grad():
        if args.no_daemon:
            private = [None] * model.cfg.layers

            def step(toks):
                return model.forward(torch.tensor([toks]), cache=private)[0, -1]
        else:
            client = kvd.Client(args.socket, args.tenant)
            cache = KvdCache(client, model, UNITS[args.unit], args.window,
                             len(tokens) + args.max_new + SEQ_SLACK, args.check,
                             None if args.compensation == "none" else args.compensation)

            def step(toks):
                return step_kvd(model, cache, toks)

        for c0 in range(0, len(tokens), args.chunk):
            logits = step(tokens[c0:c0 + args.chunk])
        out = []
        if args.draft and args.max_new:
            out, drafted, accepted = speculate(model, cache, tokens, logits, args)
            if args.stats:
                print(f"kvd-lm-torch: {accepted} of {drafted} draft tokens accepted",
                      file=sys.stderr)
        position = len(tokens)       # kvd-lm's: the tokens processed
        while not args.draft and len(out) < args.max_new:
            nxt = int(torch.argmax(logits))
            if args.print_logits:
                print(f"logits {position} {nxt} " + " ".join(f"{float(x):.9g}" for x in logits))
            out.append(nxt)
            if nxt == kvdlm.EOS or (nxt == ord("\n") and not args.no_stop) or \
                    len(out) == args.max_new:
                break
            logits = step([nxt])
            position += 1
            if args.evict_every and position % args.evict_every == 0:
                client.evict(args.evict_bytes or client.chunk_bytes, tenant=args.tenant)
    text = model.tok.decode(out)
    sys.stdout.buffer.write(text if text.endswith(b"\n") else text + b"\n")
    sys.stdout.flush()
    if cache is not None:
        if args.stats:
            print(f"kvd-lm-torch: {cache.changed} evictions rewrote the sequence", file=sys.stderr)
        cache.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
