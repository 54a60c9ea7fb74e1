# SPDX-License-Identifier: MIT
"""kvd.paged, the adapter in the shape of paged-attention backends, against real daemons: K/V
written through slot mappings into the HND and NHD views land in the daemon's blocks (as
Seq.kv sees them), the views are the pool's memory, and paged attention through the block
tables equals a dense attention over the tokens the test kept itself, with and without
evictions (then over the surviving tokens, by their original positions).
"""

import unittest

from kvdtest import CUDA, Daemon  # first: it skips the test without numpy or torch

import torch  # noqa: E402

import kvd  # noqa: E402
import kvd.paged as paged  # noqa: E402

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BT = 2, 4, 2, 32, 16


def dense_attention(q, q_pos, k, v, k_pos):
    """Plain attention of q ([t][Hq][d]) over k, v ([n][H][d]) at positions k_pos: the
    independent reference (no blocks, no tables)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            keep = k_pos <= q_pos[t]
            kk, vv = k[keep, h // group].float(), v[keep, h // group].float()
            w = torch.softmax(kk @ q[t, h].float() / HEAD_DIM ** 0.5, dim=0)
            out[t, h] = w @ vv
    return out


@unittest.skipIf(CUDA, "touches K/V with the CPU")
class PagedTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon()
        self.client = kvd.Client(self.daemon.socket, "paged")
        self.gen = torch.Generator().manual_seed(7)

    def tearDown(self):
        # The daemon stops even when a failed test left the client unable to close.
        try:
            self.client.close()
        finally:
            self.assertEqual(self.daemon.stop(), 0)

    def model(self, dtype=kvd.DTYPE_F32, **ev):
        m = self.client.register_model(LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, dtype, BT, **ev)
        cache = paged.PagedKV(self.client, m, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              block_tokens=BT, dtype=dtype)
        return m, cache

    def grow_and_write(self, cache, seqs, steps, kept, layout):
        """Grows every sequence by each step's tokens in turn and writes random K/V for the
        new slots through the layout's views; kept[layer][i] collects (k, v, positions)."""
        k_cache, v_cache = cache.cache(layout)
        for n in steps:
            for i, s in enumerate(seqs):
                s.grow(n)
                # Written pinned, as an engine does: rounds take no slot grown and not yet
                # unpinned after its write.
                s.pin()
                for layer in range(LAYERS):
                    table, lens, positions = paged.block_tables([s], layer)
                    slots = paged.slot_mapping(table, lens, [n], BT)
                    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=self.gen)
                    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=self.gen)
                    paged.write_kv(k_cache, v_cache, slots, k, v, layout)
                    kk, vv, pp = kept[layer][i]
                    kept[layer][i] = (torch.cat([kk, k]), torch.cat([vv, v]),
                                      torch.cat([pp, positions[0][-n:]]))
                s.unpin()

    def check_attention(self, cache, seqs, kept, layout, atol):
        k_cache, v_cache = cache.cache(layout)
        for layer in range(LAYERS):
            table, lens, positions = paged.block_tables(seqs, layer)
            for i in range(len(seqs)):
                k, v, kpos = kept[layer][i]
                # Survivors: the tokens whose positions the table still holds.
                alive = torch.isin(kpos, positions[i])
                self.assertEqual(int(alive.sum()), int(lens[i]))
                last = int(positions[i][-1])
                q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=self.gen)
                q_pos = torch.tensor([last - 40, last - 1, last])
                got = paged.paged_attention(q, q_pos, k_cache, v_cache, table[i], lens[i],
                                            positions[i], layout)
                want = dense_attention(q, q_pos, k[alive], v[alive], kpos[alive])
                torch.testing.assert_close(got, want, atol=atol, rtol=atol)

    def test_views_are_the_blocks(self):
        m, cache = self.model()
        with self.client.open(m, 512) as s:
            s.grow(40)
            hnd_k, hnd_v = cache.cache("HND")
            nhd_k, _ = cache.cache("NHD")
            self.assertEqual(tuple(hnd_k.shape[1:]), (KV_HEADS, BT, HEAD_DIM))
            self.assertEqual(tuple(nhd_k.shape[1:]), (BT, KV_HEADS, HEAD_DIM))
            self.assertEqual(nhd_k.stride(-1), 1)
            table, lens, _ = paged.block_tables([s], 1)
            b = int(table[0, 2])
            block = s.block(1, 2)           # [2][H][BT][D]
            self.assertEqual(hnd_k[b].data_ptr(), block.address)
            self.assertEqual(hnd_v[b].data_ptr(), block.address + KV_HEADS * BT * HEAD_DIM * 4)
            self.assertEqual(nhd_k[b].data_ptr(), block.address)
            # Slot 37 of layer 1 is row 5 of block 2: both views and Seq.kv agree on it.
            slots = paged.slot_mapping(table, lens, [40], BT)
            self.assertEqual(int(slots[37]), b * BT + 5)
            paged.write_kv(*cache.cache("NHD"), slots[37:38],
                           torch.full((1, KV_HEADS, HEAD_DIM), 2.5),
                           torch.full((1, KV_HEADS, HEAD_DIM), -1.0), "NHD")
            k, v = s.kv(1, 1, 37)
            self.assertTrue(bool((torch.from_dlpack(k) == 2.5).all()))
            self.assertTrue(bool((torch.from_dlpack(v) == -1.0).all()))
            self.assertTrue(bool((hnd_k[b, :, 5] == 2.5).all()))
            del k, v, block, hnd_k, hnd_v, nhd_k
        cache.close()

    def test_every_layer_in_one_call(self):
        m, cache = self.model()
        seqs = [self.client.open(m, 512) for _ in range(3)]
        for i, s in enumerate(seqs):
            s.grow(20 + 30 * i)
        tables, lens = paged.block_tables_layers(seqs, 0, LAYERS)
        self.assertEqual(tuple(tables.shape), (LAYERS, 3, (80 + BT - 1) // BT))
        for layer in range(LAYERS):
            table, seq_lens, positions = paged.block_tables(seqs, layer)
            self.assertTrue(torch.equal(tables[layer], table))
            self.assertTrue(torch.equal(lens[layer], seq_lens))
            self.assertEqual([len(p) for p in positions], [20, 50, 80])
            one, _, none = paged.block_tables(seqs, layer, positions=False)
            self.assertTrue(torch.equal(one, table))
            self.assertIsNone(none)
            for i, s in enumerate(seqs):
                blocks, _, _ = s.block_table(layer)
                want = torch.from_dlpack(blocks).tolist()
                n = len(want)
                self.assertEqual(table[i, :n].tolist(), want)
                self.assertTrue(bool((table[i, n:] == 0).all()))
                del blocks
        other = kvd.Client(self.daemon.socket, "other")
        try:
            with self.assertRaises(ValueError):
                other.block_tables(seqs, 0)
        finally:
            other.close()
        for s in seqs:
            s.release()
        cache.close()

    def test_attention_equals_dense(self):
        for layout in ("HND", "NHD"):
            m, cache = self.model()
            seqs = [self.client.open(m, 1024) for _ in range(3)]
            kept = [[(torch.empty(0, KV_HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM),
                      torch.empty(0, dtype=torch.int64)) for _ in seqs] for _ in range(LAYERS)]
            self.grow_and_write(cache, seqs, [100, 1, 1, 37, 1], kept, layout)
            self.check_attention(cache, seqs, kept, layout, 1e-5)
            cache.close()
            for s in seqs:
                s.release()

    def test_attention_after_evictions_equals_dense_over_survivors(self):
        m, cache = self.model(unit=kvd.UNIT_LAYER_TOKEN, window=8)
        seqs = [self.client.open(m, 4096) for _ in range(2)]
        kept = [[(torch.empty(0, KV_HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM),
                  torch.empty(0, dtype=torch.int64)) for _ in seqs] for _ in range(LAYERS)]
        self.grow_and_write(cache, seqs, [600, 1, 1], kept, "HND")
        with kvd.Client(self.daemon.socket) as admin:
            admin.evict(1 << 20, tenant="paged")
        self.assertLess(seqs[0].tokens(0), 602)
        for s in seqs:
            s.pin()
        self.check_attention(cache, seqs, kept, "HND", 1e-5)
        # Decode on after the eviction: new slots go after the survivors.
        for s in seqs:
            s.unpin()
        self.grow_and_write(cache, seqs, [1, 1], kept, "HND")
        self.check_attention(cache, seqs, kept, "HND", 1e-5)
        cache.close()
        for s in seqs:
            s.release()

    def test_half_precision(self):
        m, cache = self.model(kvd.DTYPE_BF16)
        s = self.client.open(m, 256)
        kept = [[(torch.empty(0, KV_HEADS, HEAD_DIM), torch.empty(0, KV_HEADS, HEAD_DIM),
                  torch.empty(0, dtype=torch.int64))] for _ in range(LAYERS)]
        self.grow_and_write(cache, [s], [50], kept, "HND")
        # The reference attends over what bf16 kept of the values written.
        kept = [[(k.bfloat16(), v.bfloat16(), p) for k, v, p in layer] for layer in kept]
        self.check_attention(cache, [s], kept, "HND", 1e-4)
        cache.close()
        s.release()

    def test_refusals(self):
        m = self.client.register_model(LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, kvd.DTYPE_F16, BT,
                                       kvd.LAYOUT_PER_HEAD)
        with self.assertRaises(ValueError):
            paged.PagedKV(self.client, m, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_tokens=BT,
                          dtype=kvd.DTYPE_F16, layout=kvd.LAYOUT_PER_HEAD)
        # A shape other than the registered one would put the V view at the wrong offset:
        # refused, naming both.
        m = self.client.register_model(LAYERS, Q_HEADS, 2, 64, kvd.DTYPE_F16, 16)
        for wrong in ({"kv_heads": 1}, {"head_dim": 32}, {"block_tokens": 8},
                      {"dtype": kvd.DTYPE_F32}):
            with self.assertRaises(ValueError) as e:
                paged.PagedKV(self.client, m, **wrong)
            self.assertIn("kv_heads=2, head_dim=64, block_tokens=16", str(e.exception))
            self.assertIn(f"{next(iter(wrong))}={next(iter(wrong.values()))}", str(e.exception))
        # torch's name of the registered dtype is the same dtype; another is refused.
        paged.PagedKV(self.client, m, dtype=torch.float16).close()
        with self.assertRaises(ValueError):
            paged.PagedKV(self.client, m, dtype=torch.bfloat16)
        # Nothing named: the registered shape.
        cache = paged.PagedKV(self.client, m)
        k, _ = cache.cache("HND")
        self.assertEqual(tuple(k.shape[1:]), (2, 16, 64))
        self.assertEqual(k.dtype, torch.float16)
        cache.close()
        del k
        with self.assertRaises(ValueError):
            paged.PagedKV(self.client, 999)
        m, cache = self.model()
        with self.assertRaises(BufferError):
            self.client.close()            # the cache holds the range
        with self.assertRaises(ValueError):
            cache.cache("NDH")
        cache.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
