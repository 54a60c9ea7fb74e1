# SPDX-License-Identifier: MIT
"""What the Python binding's tests share: numpy and torch (a skip without them, or a failure
when CI=true), the backend they run on, and a daemon of their own."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import numpy  # noqa: F401
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the machine
    if os.environ.get("CI") == "true":
        print(f"{os.path.basename(sys.argv[0])}: {e}: CI needs numpy and torch (tools/setup installs them)",
              file=sys.stderr)
        sys.exit(1)
    print(f"{os.path.basename(sys.argv[0])}: skipped: {e}", file=sys.stderr)
    sys.exit(77)

import kvd  # noqa: E402

F16 = kvd.DTYPE_F16
# KVD_TEST_BACKEND=cuda: the daemon pools GPU memory (under tests/fake-cuda's driver in the
# fake-gpu suite, which the environment sets up): only the tests that never touch K/V
# with the CPU run then.
CUDA = os.environ.get("KVD_TEST_BACKEND") == "cuda"


class Daemon:
    """A kvd of its own, on the host backend, in a fresh directory."""

    def __init__(self, *args):
        self.dir = tempfile.mkdtemp(prefix="kvd-py-")
        self.socket = os.path.join(self.dir, "kvd.sock")
        self.log = open(os.path.join(self.dir, "kvd.log"), "w+")
        self.args = args
        self._start()

    def _start(self):
        args = self.args
        self.proc = subprocess.Popen(
            [os.environ["KVD_DAEMON"], "--backend", "cuda" if CUDA else "host",
             "--socket", self.socket,
             "--config", "/dev/null", "--state-dir", os.path.join(self.dir, "state"),
             "--pool-size", "64MiB", "--chunk-size", "1MiB", *args],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:
            try:
                kvd.Client(self.socket).close()
                break
            except kvd.KvdError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise RuntimeError("kvd did not start: " + self.log.read())
                time.sleep(0.02)

    def restart(self):
        """Stops it with SIGTERM and starts it again on the same socket: its clients must
        reconnect."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        self._start()

    def stop(self):
        """Stops it with SIGTERM; returns its exit status."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=60)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc
