# SPDX-License-Identifier: MIT
"""The Python binding (client/python) against real daemons: views are the daemon's memory
(their data pointers are the blocks' addresses, and writes through numpy arrays and torch
tensors change the daemon's digest), block tables index the block range, the safety
contract of views, errors, fork(), the GIL, observation windows, status and live settings.

Run by meson (suite python) with KVD_DAEMON and PYTHONPATH set. numpy and torch are needed:
without them the test is skipped (exit 77), or fails when CI=true.
"""

import ctypes
import errno
import os
import signal
import threading
import time
import unittest

from kvdtest import CUDA, F16, Daemon  # first: it skips the test without numpy or torch

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvd  # noqa: E402


class DaemonTest(unittest.TestCase):
    def setUp(self):
        self.daemon = Daemon()
        self.client = kvd.Client(self.daemon.socket, "py")
        # 2 layers of 2 kv heads of 64, f16, 16-token blocks: 8 KiB blocks.
        self.model = self.client.register_model(2, 4, 2, 64, F16, 16)

    def tearDown(self):
        # The daemon stops even when a failed test left the client unable to close.
        try:
            self.client.close()
        finally:
            self.assertEqual(self.daemon.stop(), 0)



# Tests that touch K/V with the CPU, which a GPU pool's memory does not allow.
cpu_memory = unittest.skipIf(CUDA, "touches K/V with the CPU")


class BindingTest(DaemonTest):
    @cpu_memory
    def test_views_are_the_blocks(self):
        with self.client.open(self.model, 1024) as s:
            s.grow(100)
            v = s.block(1, 2)
            self.assertEqual(v.shape, (2, 2, 16, 64))
            self.assertEqual(v.dtype, "float16")
            a = np.asarray(v)
            self.assertEqual(a.__array_interface__["data"][0], v.address)
            self.assertFalse(a.flags.owndata)
            t = torch.from_dlpack(v)
            self.assertEqual(t.data_ptr(), v.address)
            self.assertEqual(t.dtype, torch.float16)
            k, vrow = s.kv(1, 1, 40)
            # Slot 40 is row 8 of block 2: K of kv head 1 at [0][1][8].
            self.assertEqual(k.address, v.address + ((1 * 16 + 8) * 64) * 2)
            self.assertEqual(vrow.address, v.address + ((2 * 16 + 1 * 16 + 8) * 64) * 2)

            before, local = s.digest()
            self.assertEqual(before, local)
            a[0, 1, 8, :] = 0.5       # through numpy
            t[1, 0, 3, :] = -2.0      # through torch
            after, local = s.digest()
            self.assertEqual(after, local)
            self.assertNotEqual(after, before)
            self.assertTrue((np.asarray(k) == 0.5).all())
            self.assertEqual(s.views, 3)
            del a, t, v, k, vrow
            self.assertEqual(s.views, 0)

    @cpu_memory
    def test_numpy_dlpack(self):
        with self.client.open(self.model, 64) as s:
            s.grow(16)
            v = s.block(0, 0)
            a = np.from_dlpack(v)
            self.assertEqual(a.__array_interface__["data"][0], v.address)
            self.assertEqual(v.__dlpack_device__(), (1, 0))
            with self.assertRaises(BufferError):
                v.__dlpack__(copy=True)
            del a, v

    @cpu_memory
    def test_block_table_indexes_the_pool(self):
        pool, stride = self.client.block_pool(self.model)
        self.assertEqual(stride, 8192)
        rows = np.asarray(pool)
        self.assertEqual(rows.shape[1], stride)
        s1 = self.client.open(self.model, 1024)
        s2 = self.client.open(self.model, 1024)
        for _ in range(5):
            s1.grow(100)
            s2.grow(100)
        blocks, positions, generation = s1.block_table(1)
        b = np.asarray(blocks)
        self.assertEqual(b.dtype, np.int32)
        self.assertEqual(len(b), (500 + 15) // 16)
        self.assertEqual(list(np.asarray(positions)), list(range(500)))
        self.assertEqual(generation, s1.generation)
        for i, index in enumerate(b):
            blk = s1.block(1, i)
            self.assertEqual(rows[index].__array_interface__["data"][0], blk.address)
            del blk
        # Through the pool, seen in the block.
        rows[b[3], :2] = 7
        blk = np.asarray(s1.block(1, 3)).view(np.uint8)
        self.assertEqual(blk.reshape(-1)[0], 7)
        del blk
        blocks2, none, _ = s1.block_table(0, positions=False)
        self.assertIsNone(none)
        del blocks, positions, blocks2
        # The range outlives sequences; the client cannot close under it.
        with self.assertRaises(BufferError):
            self.client.close()
        del rows, pool
        s1.release()
        s2.release()

    @cpu_memory
    def test_truncate_rolls_back(self):
        s = self.client.open(self.model, 1024)
        s.grow(40)
        blk = np.asarray(s.block(0, 1)).view(np.uint8)
        blk[:] = 9
        # Not while a view of the sequence lives: its blocks may go back to the pool.
        with self.assertRaises(BufferError):
            s.truncate(10)
        del blk
        gen = s.generation
        s.truncate(10)
        self.assertNotEqual(s.generation, gen)
        blocks, positions, _ = s.block_table(0)
        self.assertEqual(list(np.asarray(positions)), list(range(30)))
        self.assertEqual(len(np.asarray(blocks)), 2)
        del blocks, positions
        blk = np.asarray(s.block(0, 1)).view(np.uint8)
        self.assertTrue((blk == 9).all())
        del blk
        s.grow(3)
        blocks, positions, _ = s.block_table(1)
        self.assertEqual(list(np.asarray(positions)), list(range(33)))
        del blocks, positions
        with self.assertRaises(kvd.KvdError) as e:
            s.truncate(34)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        s.release()

    @cpu_memory
    def test_fork_shares_the_prompt(self):
        s = self.client.open(self.model, 1024)
        s.grow(40)
        blk = np.asarray(s.block(1, 0)).view(np.uint8)
        blk[:] = 5
        del blk
        kid = s.fork()
        self.assertEqual(kid.model, s.model)
        kid_blocks, kid_pos, _ = kid.block_table(1)
        blocks, pos, _ = s.block_table(1)
        self.assertEqual(list(np.asarray(kid_pos)), list(range(40)))
        # The full blocks are the parent's own, the partly filled last one a copy.
        self.assertEqual(list(np.asarray(kid_blocks)[:2]), list(np.asarray(blocks)[:2]))
        self.assertNotEqual(np.asarray(kid_blocks)[2], np.asarray(blocks)[2])
        del kid_blocks, kid_pos, blocks, pos
        blk = np.asarray(kid.block(1, 0)).view(np.uint8)
        self.assertTrue((blk == 5).all())
        del blk
        self.assertGreater(self.client.status().get("shared_bytes"), 0)
        s.release()
        blk = np.asarray(kid.block(1, 0)).view(np.uint8)
        self.assertTrue((blk == 5).all())
        del blk
        kid.release()

    @cpu_memory
    def test_prefix_open_shares_published_blocks(self):
        import cbor2
        import hashlib

        def sha256_cbor(x):
            return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

        # The keys are vLLM's sha256_cbor chain, here recomputed from its definition.
        tokens = np.arange(1000, 1100, dtype=np.uint32)
        root = kvd.key_root("0")
        self.assertEqual(root, sha256_cbor("0"))
        keys = kvd.prefix_keys(tokens, 16, root)
        want, parent = b"", root
        for b in range(6):
            parent = sha256_cbor((parent, tuple(int(t) for t in tokens[16 * b:16 * b + 16]), None))
            want += parent
        self.assertEqual(keys, want)
        salted = kvd.prefix_keys(tokens, 16, root, cache_salt="s")
        self.assertEqual(salted[:32], sha256_cbor((root, tuple(int(t) for t in tokens[:16]), ("s",))))
        self.assertEqual(kvd.prefix_keys(tokens[:15], 16, root), b"")
        with self.assertRaises(ValueError):
            kvd.prefix_keys(tokens, 16, b"short")

        model = self.client.register_model(2, 4, 2, 64, F16, 16, name="py-chat")
        a = self.client.open(model, 1024, prefix_keys=keys)
        self.assertEqual(a.tokens(), 0)
        a.grow(100)
        blk = np.asarray(a.block(1, 0)).view(np.uint8)
        blk[:] = 9
        del blk
        a.publish(6)
        with kvd.Client(self.daemon.socket, "py") as other:
            m2 = other.register_model(2, 4, 2, 64, F16, 16, name="py-chat")
            self.assertEqual(other.lookup(m2, keys), (6, 0))
            self.assertEqual(other.lookup(m2, keys[32:]), (0, 0))
            b = other.open(m2, 1024, prefix_keys=keys)
            self.assertEqual(b.tokens(), 96)
            self.assertEqual(b.tokens(1, 0), 96)
            blk = np.asarray(b.block(1, 0)).view(np.uint8)
            self.assertTrue((blk == 9).all())
            del blk
            st = self.client.status()
            self.assertEqual(st.tenant("py", "prefix_hits"), 1)
            self.assertEqual(st.tenant("py", "prefix_tokens"), 96)
            self.assertGreater(st.tenant("py", "shared_bytes"), 0)
            b.release()
        with self.assertRaises(kvd.KvdError) as e:
            a.publish(7)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(ValueError):
            self.client.open(model, 1024, prefix_keys=keys[:31])
        a.release()

    def test_tensor_parallel_group(self):
        first = self.client.open(self.model, 1024, group_size=2)
        with kvd.Client(self.daemon.socket, "py") as rank1:
            m1 = rank1.register_model(2, 4, 2, 64, F16, 16)
            second = rank1.open(m1, 1024, group_of=first.id)
            first.grow(20)
            self.assertEqual(second.tokens(), 20)
            second.grow(20)           # claims the step rank 0 made
            with self.assertRaises(kvd.KvdError) as e:
                second.grow(5)
                first.grow(6)
            self.assertEqual(e.exception.errno, errno.EINVAL)
            second.release()
        with self.assertRaises(kvd.KvdError) as e:
            first.grow(1)
        self.assertEqual(e.exception.errno, errno.EPIPE)
        first.release()

    def test_every_call_documented(self):
        # help() and inspect show each call's parameters and what it does.
        import inspect
        for owner in (kvd.Client, kvd.Seq, kvd.View, kvd.Status, kvd):
            for name in dir(owner):
                f = getattr(owner, name)
                if name.startswith("_") or not callable(f) or isinstance(f, type):
                    continue
                with self.subTest(call=f"{getattr(owner, '__name__', owner)}.{name}"):
                    try:
                        inspect.signature(f)
                    except TypeError:
                        pass        # not introspectable at all: a plain Python function
                    self.assertTrue(f.__doc__ and f.__doc__.strip())

    def test_batch_steps(self):
        seqs = [self.client.open(self.model, 64 if i == 2 else 1024) for i in range(5)]
        self.assertEqual(self.client.grow_batch(seqs, 40), [0] * 5)
        # The third holds at most 64 tokens: refused alone, the others grown.
        self.assertEqual(self.client.grow_batch(seqs, 40), [0, 0, -errno.EFBIG, 0, 0])
        self.assertEqual([s.tokens() for s in seqs], [80, 80, 40, 80, 80])
        self.assertEqual(self.client.pin_batch(seqs), [kvd.RECALL_NONE] * 5)
        self.assertEqual(self.client.unpin_batch(seqs), [0] * 5)
        self.assertEqual(self.client.unpin_batch(seqs), [-errno.EINVAL] * 5)
        with self.assertRaises(ValueError):
            self.client.grow_batch(seqs, 0)
        with self.assertRaises(ValueError):
            self.client.pin_batch([])
        with kvd.Client(self.daemon.socket, "py") as other:
            with self.assertRaises(ValueError):
                other.pin_batch(seqs)
        for s in seqs:
            s.release()

    @cpu_memory
    def test_views_keep_their_client(self):
        # Closing or reconnecting unmaps every chunk: a live view of a sequence's K/V (not
        # only of the block range) refuses both, and the view stays readable.
        s = self.client.open(self.model, 256)
        s.grow(32)
        a = np.asarray(s.block(0, 1))
        a[:] = 0.25
        t = torch.from_dlpack(s.kv(1, 0, 5)[0])
        self.daemon.restart()
        with self.assertRaises(kvd.KvdError):
            self.client.status()       # how the client learns that the daemon went away
        for call in (lambda: self.client.reconnect(10000), self.client.close):
            with self.assertRaises(BufferError):
                call()
        self.assertTrue((a == 0.25).all())
        del a
        with self.assertRaises(BufferError):
            self.client.reconnect(10000)
        self.assertEqual(float(t.sum()), 0.0)
        del t
        self.client.reconnect(10000)
        s.release()                    # stale: only this side is freed
        m = self.client.register_model(2, 4, 2, 64, F16, 16)
        with self.client.open(m, 64) as s2:
            s2.grow(16)
            self.assertEqual(np.asarray(s2.block(0, 0)).shape, (2, 2, 16, 64))

    @cpu_memory
    def test_views_keep_their_sequence(self):
        s = self.client.open(self.model, 256)
        s.grow(32)
        t = torch.from_dlpack(s.block(0, 1))
        with self.assertRaises(BufferError):
            s.release()
        self.assertFalse(s.released)
        t.fill_(1.0)
        del t
        s.release()
        self.assertTrue(s.released)
        with self.assertRaises(ValueError):
            s.grow(1)

    def test_views_pin_against_rounds(self):
        m = self.client.register_model(2, 4, 2, 64, F16, 16, unit=kvd.UNIT_LAYER_TOKEN, window=8)
        s = self.client.open(m, 4096)
        s.grow(2048)
        generation = s.generation
        v = s.block(0, 0)
        with kvd.Client(self.daemon.socket) as admin:
            # A round finds nothing to take from a sequence a view pins...
            admin.evict(1 << 20, tenant="py")
            self.assertEqual(s.generation, generation)
            self.assertEqual(s.tokens(0), 2048)
            # ...and compacts it once the view is gone.
            del v
            admin.evict(1 << 20, tenant="py")
            self.assertNotEqual(s.generation, generation)
            self.assertLess(s.tokens(0), 2048)
            rounds = admin.evictions()
            self.assertGreaterEqual(len(rounds), 2)
            last = rounds[-1]
            self.assertIsInstance(last["duration_us"], int)
            self.assertIsInstance(last["trigger"], str)
            self.assertEqual([t["name"] for t in last["tenants"]], ["py"])
            self.assertGreater(last["tenants"][0]["evicted_tokens"], 0)
        s.release()

    def test_errors_carry_errno_and_message(self):
        with self.client.open(self.model, 16) as s:
            s.grow(16)
            with self.assertRaises(kvd.KvdError) as e:
                s.grow(1)
            self.assertEqual(e.exception.errno, errno.EFBIG)
            self.assertTrue(e.exception.strerror)
            with self.assertRaises(kvd.KvdError) as e:
                s.grow(0)
            self.assertEqual(e.exception.errno, errno.EINVAL)
            self.assertEqual(e.exception.strerror, "kvd_seq_grow: n is 0 (grow by 1 or more)")
            self.assertIsInstance(e.exception, OSError)
        with self.client.open(self.model, 16) as s:
            s.pin()
            with self.assertRaises(TypeError):
                s.unpin("an event")
            s.unpin(None)
            s.pin()
            if CUDA:            # the driver refuses a handle that is no event
                with self.assertRaises(kvd.KvdError):
                    s.unpin(0x1234)
                s.unpin()
            else:               # an event handle means nothing to a host pool: unpinned
                s.unpin(0x1234)
            with self.assertRaises(kvd.KvdError) as e:
                s.unpin()       # one unpin too many
            self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(kvd.KvdError) as e:
            self.client.open(self.model + 7, 16)
        self.assertEqual(e.exception.errno, errno.EINVAL)
        with self.assertRaises(kvd.KvdError) as e:
            kvd.Client(os.path.join(self.daemon.dir, "nothing.sock"), "py")
        self.assertEqual(e.exception.errno, errno.ENOENT)
        self.assertIn("max_tokens", kvd.strerror(errno.EFBIG))
        with self.assertRaises(ValueError):
            kvd.Client(self.daemon.socket, "py", device=-2)
        if CUDA:                # the fake driver has one device: no CUDA device 5 here
            with self.assertRaises(kvd.KvdError) as e:
                kvd.Client(self.daemon.socket, "py", device=5)
            self.assertEqual(e.exception.errno, errno.ENODEV)
        else:                   # a host pool has no GPU to choose
            with kvd.Client(self.daemon.socket, "py", device=5) as c:
                self.assertEqual(c.memory, "cpu")

    def test_used_after_fork_raises(self):
        s = self.client.open(self.model, 64)
        s.grow(16)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                s.grow(1)
            except kvd.KvdError as e:
                code = 0 if e.errno == errno.ECHILD else 2
            except BaseException:
                code = 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)
        # The parent's handles are untouched.
        s.grow(1)
        s.release()

    def test_blocking_calls_release_the_gil(self):
        s = self.client.open(self.model, 64)
        s.grow(16)
        done = threading.Event()
        ticks = 0

        def pin():
            s.pin()
            done.set()

        # With the daemon stopped, pin() waits for its answer: other threads must run.
        self.daemon.proc.send_signal(signal.SIGSTOP)
        try:
            t = threading.Thread(target=pin)
            t.start()
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                ticks += 1
            self.assertFalse(done.is_set())
            self.assertGreater(ticks, 1000)
        finally:
            self.daemon.proc.send_signal(signal.SIGCONT)
        t.join(timeout=60)
        self.assertTrue(done.is_set())
        s.unpin()
        s.release()

    def test_observation_window(self):
        m = self.client.register_model(2, 4, 2, 64, F16, 16, unit=kvd.UNIT_LAYER_TOKEN, window=8)
        # W_o of layer 1: [hidden][q_heads * head_dim] float32, from any buffer.
        wo = np.random.default_rng(1).standard_normal((16, 4 * 64), dtype=np.float32)
        self.client.output_proj(m, 1, kvd.DTYPE_F32, 16, wo)
        for hidden in (15, 17):   # a buffer shorter or longer than hidden rows
            with self.assertRaises(ValueError):
                self.client.output_proj(m, 1, kvd.DTYPE_F32, hidden, wo)
        with self.client.open(m, 256) as s:
            s.grow(40)
            q = s.observation(1)
            self.assertEqual(q.shape, (4, 8, 64))
            a = np.asarray(q)
            a[:] = 0.25
            del a, q
            s.observe(1)
        with self.client.open(self.model, 64) as plain:
            with self.assertRaises(kvd.KvdError) as e:
                plain.observation(0)
            self.assertEqual(e.exception.errno, errno.EOPNOTSUPP)

    @cpu_memory
    def test_compensation_and_index_views(self):
        m = self.client.register_model(2, 4, 2, 64, F16, 16, unit=kvd.UNIT_LAYER_TOKEN,
                                       window=8, compensation=kvd.COMPENSATION_MOMENTS)
        with self.client.open(m, 256) as s:
            s.grow(32)
            mom = np.asarray(s.moments(1, 1))
            # struct kvd_moments_header (64 bytes: count, head_dim, ...), then the moments.
            self.assertEqual(len(mom), 64 + 4 * (3 * 64 + 64 * 64))
            self.assertFalse(mom.flags.writeable)
            self.assertEqual(int(mom[8:12].view(np.uint32)[0]), 64)
            del mom
        ix = self.client.register_model(2, 4, 2, 64, F16, 16, kvd.LAYOUT_PER_LAYER,
                                        unit=kvd.UNIT_LAYER_TOKEN, window=8, index_heads=2,
                                        index_dim=32)
        with self.client.open(ix, 256) as s:
            s.grow(20)
            key = s.index_key(1, 0, 19)
            self.assertEqual(key.shape, (32,))
            np.asarray(key)[:] = 1.0
            iq = s.index_observation(0)
            self.assertEqual(iq.shape, (8, 2, 32))
            self.assertEqual(s.views, 2)
            del key, iq

    def test_status_and_live_settings(self):
        with self.client.open(self.model, 256) as s:
            s.grow(64)
            st = self.client.status()
            self.assertIn("py", st.tenants())
            self.assertGreater(st.get("used_bytes"), 0)
            self.assertEqual(st.tenant("py", "used_bytes"), self.client.chunk_bytes)
            with self.assertRaises(KeyError):
                st.get("no_such_key")
            with kvd.Client(self.daemon.socket) as admin:
                self.assertTrue(admin.tenant_set("py", max_bytes=8 << 20, weight=3) in (True, False))
                st = admin.status()
                self.assertEqual(st.tenant("py", "max_bytes"), 8 << 20)
                self.assertEqual(st.tenant("py", "weight"), 3)
                with self.assertRaises(kvd.KvdError) as e:
                    admin.tenant_set("bad/name", weight=1)
                self.assertEqual(e.exception.errno, errno.EINVAL)
                self.assertIn("tenant name", e.exception.strerror)
                admin.tenant_reset("py")
            self.assertIsNone(self.client.next_event())
            self.assertGreaterEqual(self.client.fileno(), 0)

    def test_who_holds_what_and_dry_runs(self):
        m = self.client.register_model(2, 4, 2, 64, F16, 16, unit=kvd.UNIT_LAYER_TOKEN, window=8)
        s = self.client.open(m, 4096)
        s.grow(2048)
        # Written: a round takes only what an unpin said was.
        s.pin()
        s.unpin()
        with kvd.Client(self.daemon.socket) as admin:
            conns = {c.get("tenant"): c for c in admin.connections()}
            self.assertEqual(conns["py"]["pid"], os.getpid())
            self.assertEqual(conns["py"]["sequences"], 1)
            seqs = admin.sequences("py")
            self.assertEqual([q["tokens"] for q in seqs], [2048])
            self.assertEqual(seqs[0]["evictable"], 1)
            # A dry run takes nothing; the eviction it plans then takes what it said.
            plan = admin.evict_plan(1 << 20, tenant="py")
            self.assertNotIn("id", plan)
            self.assertGreater(plan["planned_bytes"], 0)
            self.assertEqual(s.tokens(0), 2048)
            self.assertGreaterEqual(plan["tenants"][0]["predicted_error"], 0.0)
            admin.evict(1 << 20, tenant="py")
            done = admin.evictions()[-1]
            self.assertEqual(done["tenants"][0]["freed_bytes"], plan["tenants"][0]["freed_bytes"])
            self.assertEqual(done["planned_bytes"], plan["planned_bytes"])
            # Budgets as a percent of the pool; below the floor only with force.
            admin.budget_set(percent=50)
            self.assertEqual(admin.status().get("budget_bytes"), admin.status().get("pool_bytes") // 2)
            with self.assertRaises(kvd.KvdError) as e:
                admin.budget_set(1)
            self.assertEqual(e.exception.errno, errno.ERANGE)
            with self.assertRaises(TypeError):
                admin.budget_set(1 << 20, percent=10)
            self.assertEqual(admin.budget_plan(percent=100)["target_bytes"], 0)
            self.assertEqual(admin.tenant_plan("py", weight=2)["target_bytes"], 0)
            admin.budget_reset()
        s.release()


class TierTest(unittest.TestCase):
    """The host tier through the binding: tenant_set(tier=), and pin() saying a recall."""

    def setUp(self):
        self.daemon = Daemon("--host-tier-size", "8MiB", "--tier-idle", "100")

    def tearDown(self):
        self.assertEqual(self.daemon.stop(), 0)

    def test_pin_says_it_came_back(self):
        with kvd.Client(self.daemon.socket) as admin:
            admin.tenant_set("py", tier="host")
            self.assertEqual(admin.status().tenant("py", "tier"), "host")
            with self.assertRaises(kvd.KvdError) as e:
                admin.tenant_set("py", tier="disk")
            self.assertEqual(e.exception.errno, errno.EINVAL)
            with kvd.Client(self.daemon.socket, "py") as c:
                m = c.register_model(2, 4, 2, 64, F16, 16)
                with c.open(m, 1024) as s:
                    s.grow(100)
                    if not CUDA:
                        s.pin()
                        for t in range(2):
                            for b in range((100 + 15) // 16):
                                a = np.asarray(s.block(t, b))
                                a[:] = np.arange(a.size, dtype=np.float16).reshape(a.shape) * (t + b + 1)
                                del a
                        s.unpin()
                    before, _ = s.digest()
                    deadline = time.monotonic() + 30
                    while admin.status().get("host_tier_sequences") != 1:
                        self.assertLess(time.monotonic(), deadline)
                        time.sleep(0.02)
                    self.assertEqual(s.tokens(), 0)
                    self.assertEqual(s.pin(), kvd.RECALL_HOST)
                    self.assertEqual(s.tokens(), 100)
                    after, local = s.digest()
                    self.assertEqual(after, before)
                    # A GPU pool's memory has no local digest.
                    self.assertEqual(local, None if CUDA else before)
                    self.assertEqual(s.unpin(), 0)
                    self.assertEqual(s.pin(), kvd.RECALL_NONE)
                    s.unpin()


@cpu_memory
class RecallTest(unittest.TestCase):
    """Token recall through the binding: tenant_set(recall=), Sequence.recall()."""

    def setUp(self):
        self.daemon = Daemon("--host-tier-size", "8MiB")

    def tearDown(self):
        self.assertEqual(self.daemon.stop(), 0)

    def test_recall_brings_back_what_the_window_wants(self):
        rng = np.random.default_rng(3)
        with kvd.Client(self.daemon.socket) as admin:
            # Recency evicts the oldest: the needle (positions 40..47) among them.
            admin.tenant_set("pyr", policy="streamingllm", recall=4096)
            self.assertEqual(admin.status().tenant("pyr", "recall"), 4096)
            with kvd.Client(self.daemon.socket, "pyr") as c:
                m = c.register_model(2, 4, 2, 64, F16, 16, unit=kvd.UNIT_LAYER_TOKEN, window=8)
                with c.open(m, 1024) as s:
                    s.grow(256)
                    s.pin()
                    for layer in range(2):
                        for head in range(2):
                            for slot in range(256):
                                k, v = s.kv(layer, head, slot)
                                key = np.asarray(k)
                                key[:] = 1.0 if 40 <= slot < 48 else rng.choice([-0.5, 0.5], 64)
                                np.asarray(v)[:] = rng.choice([-0.5, 0.5], 64)
                                del key, k, v
                        q = np.asarray(s.observation(layer))
                        q[:] = rng.choice([-0.5, 0.5], q.shape)
                        del q
                        s.observe(layer)
                    s.unpin()
                    admin.evict(2 * 128 * 2 * 2 * 64 * 2, tenant="pyr")
                    s.pin()
                    kept = {s.position(0, 0, i) for i in range(s.tokens(0, 0))}
                    self.assertFalse(kept & set(range(40, 48)))
                    tokens = s.tokens(0, 0)
                    # The question: a window that looks for the needle.
                    for layer in range(2):
                        q = np.asarray(s.observation(layer))
                        q[:] = 1.0
                        del q
                        s.observe(layer)
                    s.unpin()
                    n = s.recall()
                    self.assertGreaterEqual(n, 2 * 8)
                    s.pin()
                    self.assertEqual(s.tokens(0, 0), tokens)
                    back = {s.position(0, 0, i) for i in range(s.tokens(0, 0))}
                    self.assertTrue(set(range(40, 48)) <= back)
                    self.assertTrue(np.all(np.asarray(s.kv(1, 1, sorted(back).index(44))[0]) == 1.0))
                    with self.assertRaises(kvd.KvdError) as e:
                        s.recall()
                    self.assertEqual(e.exception.errno, errno.EBUSY)
                    s.unpin()
            self.assertEqual(admin.status().get("recalled_tokens"), n)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def dltensor_of(capsule):
    """The DLTensor a "dltensor" capsule holds (DLManagedTensor starts with it)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return DLTensor.from_address(get(capsule, b"dltensor"))


@unittest.skipUnless(CUDA, "a GPU pool (KVD_TEST_BACKEND=cuda)")
class CudaPoolTest(DaemonTest):
    def test_dlpack_fields_of_device_memory(self):
        self.assertEqual(self.client.memory, "cuda:0")
        pool, stride = self.client.block_pool(self.model)
        self.assertEqual(pool.device, "cuda:0")
        with self.client.open(self.model, 1024) as s:
            s.grow(100)
            blocks, _, _ = s.block_table(0)
            b = memoryview(blocks).tolist()   # the table itself is host memory
            v = s.block(0, 2)
            self.assertEqual(v.__dlpack_device__(), (2, 0))   # kDLCUDA, device 0
            self.assertEqual(v.address, pool.address + b[2] * stride)
            with self.assertRaises(BufferError):
                memoryview(v)
            capsule = v.__dlpack__()
            t = dltensor_of(capsule)
            self.assertEqual(t.data, v.address)
            self.assertEqual((t.device.device_type, t.device.device_id), (2, 0))
            self.assertEqual((t.code, t.bits, t.lanes), (2, 16, 1))   # kDLFloat 16
            self.assertEqual([t.shape[i] for i in range(t.ndim)], [2, 2, 16, 64])
            del t, capsule, v, blocks
        del pool


@unittest.skipUnless(CUDA and torch.cuda.is_available(), "a GPU pool and torch with CUDA")
class TorchCudaTest(DaemonTest):
    """On a real GPU (tools/gpu-check): torch tensors over the pool's memory."""

    def test_torch_writes_what_the_daemon_reads(self):
        with self.client.open(self.model, 256) as s:
            s.grow(64)
            v = s.block(1, 1)
            t = torch.from_dlpack(v)
            self.assertEqual(t.device.type, "cuda")
            self.assertEqual(t.data_ptr(), v.address)
            before, _ = s.digest()
            t.fill_(0.5)
            torch.cuda.synchronize()
            after, _ = s.digest()
            self.assertNotEqual(after, before)
            # Unpinned once the work recorded before the event is done.
            event = torch.cuda.Event(interprocess=True)
            s.pin()
            t.add_(1.0)
            event.record()
            self.assertIn(s.unpin(event), (0, 1))
            event.synchronize()
            later, _ = s.digest()
            self.assertNotEqual(later, after)
            self.assertEqual(float(t[0, 0, 0, 0]), 1.5)
            del t, v

if __name__ == "__main__":
    unittest.main(verbosity=2)
