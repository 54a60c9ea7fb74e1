# SPDX-License-Identifier: MIT
"""kvd: the Python binding of libkvd, the client library of the kvd KV-cache daemon.

An engine connects as a tenant, registers its model's KV shape, opens sequences and grows
them; the K/V live in the daemon's pool and are read and written in place, through
numpy arrays and torch tensors made from View objects without a copy::

    import kvd, numpy as np

    with kvd.Client("/run/kvd/kvd.sock", "llama") as c:
        model = c.register_model(32, 32, 8, 128, kvd.DTYPE_F16, 16)
        with c.open(model, 4096) as seq:
            seq.grow(16)
            block = np.asarray(seq.block(0, 0))   # [2][8][16][128] float16, pins seq
            block[0, :, :16] = 1.0                # K of layer 0, tokens 0..15
            del block                             # unpins
            pool, stride = c.block_pool(model)    # for paged-attention kernels
            blocks, positions, generation = seq.block_table(0)

Errors raise KvdError, an OSError whose errno is libkvd's code and whose strerror is the
failed call's message (the daemon's words, or the library's). docs/python.md has the
rest: the safety contract of views, threads, fork(), GPU pools.
"""

from ._kvd import (  # noqa: F401
    COMPENSATION_LATENT,
    COMPENSATION_MOMENTS,
    COMPENSATION_NONE,
    DEFAULT_SOCKET,
    DTYPE_BF16,
    DTYPE_F16,
    DTYPE_F32,
    EVENT_DISCONNECTED,
    EVENT_SEQ_CHANGED,
    EVENT_STOPPING,
    KEY_BYTES,
    LAYOUT_PER_HEAD,
    LAYOUT_PER_LAYER,
    RECALL_FILE,
    RECALL_HOST,
    RECALL_LOST,
    RECALL_NONE,
    UNIT_BLOCK,
    UNIT_HEAD_TOKEN,
    UNIT_LAYER_TOKEN,
    UNIT_NONE,
    VERSION_MAJOR,
    VERSION_MINOR,
    Client,
    KvdError,
    Seq,
    Status,
    View,
    key_root,
    kvd_version,
    prefix_keys,
    strerror,
)

__all__ = [
    "Client", "Seq", "Status", "View", "KvdError", "strerror", "kvd_version",
    "key_root", "prefix_keys", "KEY_BYTES",
    "DEFAULT_SOCKET", "DTYPE_F16", "DTYPE_BF16", "DTYPE_F32", "LAYOUT_PER_LAYER",
    "LAYOUT_PER_HEAD", "UNIT_NONE", "UNIT_HEAD_TOKEN", "UNIT_LAYER_TOKEN", "UNIT_BLOCK",
    "COMPENSATION_NONE", "COMPENSATION_MOMENTS", "COMPENSATION_LATENT", "EVENT_STOPPING",
    "EVENT_SEQ_CHANGED", "EVENT_DISCONNECTED", "RECALL_NONE", "RECALL_HOST", "RECALL_FILE",
    "RECALL_LOST",
    "VERSION_MAJOR", "VERSION_MINOR",
]
