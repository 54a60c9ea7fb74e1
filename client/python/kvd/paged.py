# SPDX-License-Identifier: MIT
"""kvd's KV in the shape paged-attention backends take (docs/engines.md, "Paged KV from
Python"): per-layer K and V cache tensors over the connection's block range, block tables,
slot mappings for the new tokens, and a reference paged attention in torch.

A kvd block of a `per_layer` model is [K: kv_heads x block_tokens x head_dim | V: the same]:
per block, K then V, each "HND" (heads, then tokens), FlashInfer's HND page. `PagedKV.cache`
gives the K and V caches as strided views of the pool's memory, never copies:

- "HND": [num_blocks][kv_heads][block_tokens][head_dim] (FlashInfer's kv_layout="HND");
- "NHD": [num_blocks][block_tokens][kv_heads][head_dim], vLLM FlashAttention's and
  FlashInfer's "NHD" shape, with the tokens' and heads' strides swapped (the last
  dimension stays contiguous).

Unlike vLLM's one block table per sequence for all layers, kvd gives each layer its own
table (and, after evictions, its own length): `block_tables` is per layer. `per_head`
models (a block per kv head) have no such shape and are refused.
"""

import torch

from ._kvd import DTYPE_BF16, DTYPE_F16, DTYPE_F32, LAYOUT_PER_LAYER

_TORCH_DTYPES = {DTYPE_F16: torch.float16, DTYPE_BF16: torch.bfloat16, DTYPE_F32: torch.float32}


class PagedKV:
    """A model's blocks in the connection's block range, as torch tensors.

    Holds the range's View, so the client cannot close while this lives: call close()
    (or drop it) first. On a GPU pool the tensors are CUDA tensors."""

    def __init__(self, client, model, *, kv_heads=None, head_dim=None, block_tokens=None,
                 dtype=None, layout=None):
        # The shape is the model's, as registered: what the caller names must match it,
        # or the views would land at the wrong offsets.
        spec = client.model_spec(model)
        # A dtype may be named as kvd's (DTYPE_F16) or as torch's (torch.float16).
        dtype = {t: d for d, t in _TORCH_DTYPES.items()}.get(dtype, dtype)
        asked = {"kv_heads": kv_heads, "head_dim": head_dim, "block_tokens": block_tokens,
                 "dtype": dtype, "layout": layout}
        wrong = {k: v for k, v in asked.items() if v is not None and v != spec[k]}
        if wrong:
            given = ", ".join(f"{k}={v}" for k, v in asked.items() if v is not None)
            registered = ", ".join(f"{k}={spec[k]}" for k in asked)
            raise ValueError(f"PagedKV({given}) does not match model {model} as registered "
                             f"({registered})")
        if spec["layout"] != LAYOUT_PER_LAYER:
            raise ValueError("paged caches need per_layer blocks (all kv heads in a block)")
        if spec["dtype"] not in _TORCH_DTYPES:
            raise ValueError(f"unknown dtype {spec['dtype']}")
        kv_heads, head_dim, block_tokens = spec["kv_heads"], spec["head_dim"], spec["block_tokens"]
        self.dtype = _TORCH_DTYPES[spec["dtype"]]
        self.kv_heads, self.head_dim, self.block_tokens = kv_heads, head_dim, block_tokens
        view, stride = client.block_pool(model)
        item = torch.finfo(self.dtype).bits // 8
        kv_elems = 2 * kv_heads * block_tokens * head_dim
        if stride % item or stride // item < kv_elems:
            raise ValueError(f"a block stride of {stride} bytes does not hold this shape")
        # [n_blocks][stride] bytes -> elements -> the K/V part of each block, unflattened:
        # every step a view.
        typed = torch.from_dlpack(view).view(self.dtype)
        self.kv = typed[:, :kv_elems].unflatten(1, (2, kv_heads, block_tokens, head_dim))
        self.num_blocks = self.kv.shape[0]

    def cache(self, layout="HND"):
        """(K cache, V cache) of every layer (layers differ by their block tables), as
        strided views: "HND" [blocks][kv_heads][block_tokens][head_dim], or "NHD"
        [blocks][block_tokens][kv_heads][head_dim]."""
        k, v = self.kv[:, 0], self.kv[:, 1]
        if layout == "HND":
            return k, v
        if layout == "NHD":
            return k.transpose(1, 2), v.transpose(1, 2)
        raise ValueError(f"layout {layout!r}: HND or NHD")

    def close(self):
        """Drops the tensors over the range (and so its View): the client may close."""
        self.kv = None


def block_tables(seqs, layer, device=None, positions=True):
    """Layer `layer`'s tables of seqs (one client's), padded: (block_table int32
    [batch][max_blocks], seq_lens int32 [batch], positions: a list of int64 tensors, each
    sequence's slots' original positions; None with positions=False, which saves a call per
    sequence). Pin the sequences first: a table holds until the sequence changes."""
    table, seq_lens = block_tables_layers(seqs, layer, 1, device)
    pos = None
    if positions:
        pos = [torch.from_dlpack(s.block_table(layer)[1]).to(torch.int64) for s in seqs]
    return table[0], seq_lens[0], pos


def block_tables_layers(seqs, layer, layers, device=None):
    """The tables of seqs (one client's) for layers layer .. layer + layers - 1 in one call
    (Client.block_tables, kvd_seq_block_tables): (block_tables int32 [layers][batch]
    [max_blocks], zero-padded, seq_lens int32 [layers][batch]). What a decode step hands
    the attention of every layer; pin the sequences first."""
    if not seqs:
        return (torch.zeros((layers, 0, 0), dtype=torch.int32),
                torch.zeros((layers, 0), dtype=torch.int32))
    tables, lens = seqs[0].client.block_tables(seqs, layer, layers)
    # Tensors of their own: the Views' memory is the call's, freed with them.
    table, seq_lens = torch.from_dlpack(tables).clone(), torch.from_dlpack(lens).clone()
    if device is not None:
        table, seq_lens = table.to(device), seq_lens.to(device)
    return table, seq_lens


def slot_mapping(block_table, seq_lens, new_tokens, block_tokens):
    """The slots (block * block_tokens + row, int64) of each sequence's last new_tokens[i]
    slots, concatenated: where a step writes its new K and V (vLLM's slot_mapping)."""
    slots = []
    for i, n in enumerate(new_tokens):
        idx = torch.arange(int(seq_lens[i]) - n, int(seq_lens[i]), device=block_table.device)
        slots.append(block_table[i, idx // block_tokens].to(torch.int64) * block_tokens +
                     idx % block_tokens)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)


def write_kv(k_cache, v_cache, slots, k, v, layout="HND"):
    """Writes k and v ([n][kv_heads][head_dim]) at slots (vLLM's reshape_and_cache), into
    the caches of PagedKV.cache(layout)."""
    bt = k_cache.shape[2] if layout == "HND" else k_cache.shape[1]
    blocks, rows = slots // bt, slots % bt
    if layout == "HND":
        k_cache[blocks, :, rows] = k.to(k_cache.dtype)
        v_cache[blocks, :, rows] = v.to(v_cache.dtype)
    else:
        k_cache[blocks, rows] = k.to(k_cache.dtype)
        v_cache[blocks, rows] = v.to(v_cache.dtype)


def paged_attention(q, q_positions, k_cache, v_cache, block_table, seq_len, positions,
                    layout="HND", scale=None):
    """Attention of one sequence's queries q ([t][q_heads][head_dim], at original positions
    q_positions) over its cached tokens, read through its block table: the blocks are
    gathered from the pool (index_select), never the whole cache. A cached token is
    attended when its original position is at most the query's. Returns [t][q_heads][head_dim]
    in float32. The reference the adapter's tests and the torch engine use, not a kernel."""
    n = int(seq_len)
    bt = k_cache.shape[2] if layout == "HND" else k_cache.shape[1]
    blocks = block_table[: (n + bt - 1) // bt].to(torch.int64)
    k = k_cache.index_select(0, blocks)
    v = v_cache.index_select(0, blocks)
    if layout == "HND":                       # [nb][H][bt][d] -> [nb * bt][H][d]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    k = k.reshape(-1, k.shape[2], k.shape[3])[:n].float()
    v = v.reshape(-1, v.shape[2], v.shape[3])[:n].float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)     # grouped-query attention
    v = v.repeat_interleave(group, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    logits = torch.einsum("thd,jhd->htj", q.float(), k) * scale
    mask = positions[:n].view(1, 1, n) > q_positions.view(1, -1, 1)
    logits = logits.masked_fill(mask, float("-inf"))
    return torch.einsum("htj,jhd->thd", torch.softmax(logits, dim=-1), v)
