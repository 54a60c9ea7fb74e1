#!/usr/bin/python3
# SPDX-License-Identifier: MIT
"""A minimal engine on kvd from Python: examples/engine.c's loop, with torch tensors over
the daemon's memory and the block tables of kvd.paged (docs/engines.md, docs/python.md).

It connects as a tenant, registers a model whose KV the daemon may evict, opens one
sequence, and runs a prefill and then decode steps. Every step:
  1. grows the sequence by the step's tokens (a grow may wait while an eviction round
     makes room under the node's budget);
  2. pins it, so that no round rewrites it while the step reads it;
  3. writes the new tokens' K and V through the slot mapping, into the blocks the daemon
     granted;
  4. "attends": gathers every resident token's K and V through the block tables and checks
     each is the token written at its original position, which an eviction keeps with it;
  5. publishes its last queries as each layer's observation window;
  6. unpins, and reads the daemon's events (an eviction that rewrote the sequence).
The "model" writes K[d] = position + d / 1000 and V = -K. A real engine runs its attention
(kvd.paged.paged_attention, or a kernel) where step 4 is.

Usage: engine.py [SOCKET [TENANT [STEPS]]]; SOCKET "" or missing: $KVD_SOCKET, else the
default socket. Prints what was evicted; exits 0, or 1 on an error or a wrong token.
"""

import sys

import torch

import kvd
import kvd.paged as paged

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 2, 4, 2, 64, 16
WINDOW, MAX_TOKENS, PREFILL = 8, 4096, 256


def k_value(positions):
    """K of the tokens at positions: [n][KV_HEADS][HEAD_DIM]."""
    d = torch.arange(HEAD_DIM, dtype=torch.float32) / 1000
    return (positions.view(-1, 1, 1).float() + d).expand(-1, KV_HEADS, -1)


def step(client, cache, seq, n, i):
    """One step of n tokens: 1 to 6 above. Returns (resident tokens read, rewrites seen)."""
    k_cache, v_cache = cache.cache("HND")
    seq.grow(n)
    seq.pin()
    try:
        read = 0
        for layer in range(LAYERS):
            table, lens, positions = paged.block_tables([seq], layer)
            new = positions[0][-n:] if n <= int(lens[0]) else positions[0]
            slots = paged.slot_mapping(table, lens, [len(new)], BLOCK_TOKENS)
            k = k_value(new)
            paged.write_kv(k_cache, v_cache, slots, k, -k)
            # Every resident token, read back through the table.
            all_slots = paged.slot_mapping(table, lens, [int(lens[0])], BLOCK_TOKENS)
            blocks, rows = all_slots // BLOCK_TOKENS, all_slots % BLOCK_TOKENS
            k_read, v_read = k_cache[blocks, :, rows], v_cache[blocks, :, rows]
            want = k_value(positions[0])
            if not (torch.equal(k_read, want) and torch.equal(v_read, -want)):
                raise ValueError("a token is not the one written at its position")
            read += int(lens[0]) * KV_HEADS
            q = torch.from_dlpack(seq.observation(layer))    # [Q_HEADS][WINDOW][HEAD_DIM]
            q.copy_(torch.sin(torch.arange(q.numel(), dtype=torch.float32) + i).view_as(q))
            del q
            seq.observe(layer)
    finally:
        seq.unpin()
    changed = 0
    while (ev := client.next_event()) is not None:
        changed += ev[0] == kvd.EVENT_SEQ_CHANGED
    return read, changed


def main(argv):
    socket = argv[1] if len(argv) > 1 and argv[1] else None
    tenant = argv[2] if len(argv) > 2 else "example"
    steps = int(argv[3]) if len(argv) > 3 else 1024
    try:
        with kvd.Client(socket, tenant) as client:
            model = client.register_model(LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, kvd.DTYPE_F32,
                                          BLOCK_TOKENS, unit=kvd.UNIT_LAYER_TOKEN,
                                          window=WINDOW, sinks=4)
            cache = paged.PagedKV(client, model, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  block_tokens=BLOCK_TOKENS, dtype=kvd.DTYPE_F32)
            with client.open(model, MAX_TOKENS) as seq:
                read, changed = step(client, cache, seq, PREFILL, 0)
                for i in range(1, steps + 1):
                    read, c = step(client, cache, seq, 1, i)
                    changed += c
            cache.close()
    except kvd.KvdError as e:
        print(f"engine.py: {e.strerror} ({kvd.strerror(e.errno)})", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"engine.py: {e}", file=sys.stderr)
        return 1
    print(f"engine.py: {steps} tokens generated after a prefill of {PREFILL}; "
          f"{read // (LAYERS * KV_HEADS)} of {PREFILL + steps} positions resident (all layers "
          f"and kv heads); {changed} evictions rewrote the sequence")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
