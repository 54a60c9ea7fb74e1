# SPDX-License-Identifier: MIT
"""examples/engine.py (KVD_EXAMPLE_ENGINE_PY) against a real daemon whose budget holds well
under the sequence it grows, as tests/integration/test-example-engine.c runs engine.c:
every step's grow waits for rounds that evict from it, and every resident token must still
be the one written at its position."""

import os
import re
import subprocess
import sys
import unittest

from kvdtest import CUDA, Daemon  # first: it skips the test without numpy or torch

import kvd  # noqa: E402


@unittest.skipIf(CUDA, "the example touches K/V with the CPU")
class ExampleEngineTest(unittest.TestCase):
    def test_engine_py_survives_evictions(self):
        daemon = Daemon("--pool-size", "4MiB", "--chunk-size", "256KiB", "--budget", "1MiB")
        try:
            out = subprocess.run([sys.executable, os.environ["KVD_EXAMPLE_ENGINE_PY"],
                                  daemon.socket, "example", "384"],
                                 capture_output=True, text=True, timeout=120)
            print(out.stdout, out.stderr, end="")
            self.assertEqual(out.returncode, 0)
            m = re.search(r"(\d+) of (\d+) positions resident.*; (\d+) evictions", out.stdout)
            self.assertIsNotNone(m)
            resident, total, rewrites = (int(x) for x in m.groups())
            self.assertEqual(total, 256 + 384)
            self.assertLess(resident, total)
            self.assertGreater(rewrites, 0)
            # The budget held: rounds evicted from the sequence while it grew.
            with kvd.Client(daemon.socket) as admin:
                st = admin.status()
                self.assertGreater(st.tenant("example", "evicted_tokens"), 0)
                self.assertLessEqual(st.get("used_bytes"), 1 << 20)
        finally:
            self.assertEqual(daemon.stop(), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
