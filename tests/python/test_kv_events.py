# SPDX-License-Identifier: MIT
"""KV events (docs/engines.md, "KV events"), read as a router reads vLLM's: a ZeroMQ SUB
socket on loopback, each message (topic, 8-byte big-endian sequence number, msgpack
EventBatch [ts, events]) decoded with msgpack; every BlockStored checked against what the
test computes itself from the token ids (vLLM's sha256_cbor chain, with cbor2), removals
checked when the prefix cache lets go, and the replay socket asked for what the
subscriber missed (the AllBlocksCleared a starting daemon sends).
"""

import hashlib
import socket
import time
import unittest

from kvdtest import F16, Daemon  # first: it skips the test without numpy or torch

import cbor2  # noqa: E402
import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

import kvd  # noqa: E402

BLOCK = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sha256_cbor(x):
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


class KvEventsTest(unittest.TestCase):
    def setUp(self):
        self.pub, self.replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        self.daemon = Daemon("--kv-events", self.pub, "--kv-events-replay", self.replay,
                             "--kv-events-topic", "kvd")
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kvd")
        self.sub.connect(self.pub)
        self.seqs = []

    def tearDown(self):
        self.sub.close(0)
        self.ctx.term()
        self.assertEqual(self.daemon.stop(), 0)

    def events(self, want, timeout=10):
        """Events as they come, until `want` of them: (seq, [event])."""
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.assertEqual(topic, b"kvd")
                self.assertEqual(len(seq), 8)
                self.seqs.append(int.from_bytes(seq, "big"))
                ts, events = msgpack.unpackb(payload)
                self.assertLess(abs(ts - time.time()), 60)
                got += events
        return got

    def test_events_follow_the_index(self):
        c = kvd.Client(self.daemon.socket, "router")
        # The SUB socket joins a moment after connecting: published events before that are
        # lost to it, as to any late subscriber (the replay below has them).
        time.sleep(0.3)
        model = c.register_model(2, 4, 2, 64, F16, BLOCK, name="ev-model")
        tokens = np.arange(5000, 5100, dtype=np.uint32)
        keys = kvd.prefix_keys(tokens, BLOCK, kvd.key_root("0"))
        a = c.open(model, 1024, prefix_keys=keys, prefix_tokens=tokens[:96])
        a.grow(100)
        a.publish(6)
        stored = self.events(6)
        self.assertEqual(len(stored), 6)
        parent = sha256_cbor("0")
        for i, ev in enumerate(stored):
            tag, hashes, parent_hash, token_ids, block_size, lora_id, medium = ev
            self.assertEqual(tag, "BlockStored")
            block = [int(t) for t in tokens[BLOCK * i:BLOCK * (i + 1)]]
            self.assertEqual(token_ids, block)
            self.assertEqual(block_size, BLOCK)
            self.assertIsNone(lora_id)
            self.assertEqual(medium, "GPU")
            # The hash is the router's own computation from the token ids.
            want = sha256_cbor((parent, tuple(block), None))
            self.assertEqual(hashes, [want])
            self.assertEqual(parent_hash, None if i == 0 else parent)
            parent = want
        # Another sequence sharing the blocks, and the first going: nothing new to say
        # (the cache keeps the blocks after their last sequence).
        b = c.open(model, 1024, prefix_keys=keys)
        self.assertEqual(b.tokens(), 96)
        a.release()
        b.release()
        self.assertEqual(self.events(1, timeout=0.5), [])
        # The tenant goes: its cached blocks with it, each announced as removed.
        c.close()
        with kvd.Client(self.daemon.socket) as admin:
            admin.tenant_delete("router")
        removed = self.events(6)
        self.assertEqual(sorted(h for ev in removed for h in ev[1]),
                         sorted(keys[32 * i:32 * (i + 1)] for i in range(6)))
        for ev in removed:
            self.assertEqual(ev[0], "BlockRemoved")
            self.assertEqual(ev[2], "GPU")
        self.assertEqual(self.seqs, sorted(self.seqs))

        # The replay from 0: everything, the daemon's AllBlocksCleared first, then the end.
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            self.assertTrue(dealer.poll(5000))
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                self.assertEqual(payload, b"")
                break
            replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
        dealer.close(0)
        self.assertEqual(replayed[0], (0, [["AllBlocksCleared"]]))
        self.assertEqual([s for s, _ in replayed], list(range(len(replayed))))
        self.assertEqual([ev for _, evs in replayed[1:] for ev in evs], stored + removed)
        with kvd.Client(self.daemon.socket) as admin:
            st = admin.status()
            self.assertEqual(st.get("kv_events"), 13)
            self.assertEqual(st.get("kv_events_dropped"), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
