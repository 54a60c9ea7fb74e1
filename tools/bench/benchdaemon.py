# SPDX-License-Identifier: MIT
"""A kvd of a Python benchmark's own (binding-step.py, paged-tables.py)."""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time

import kvd


@contextlib.contextmanager
def daemon(path, pool_size):
    """Starts kvd at path (host backend, pool_size, no config file, state in a temporary
    directory) and yields its socket once it accepts connections; stops it after."""
    tmp = tempfile.mkdtemp(prefix="kvd-bench-")
    sock = os.path.join(tmp, "kvd.sock")
    proc = subprocess.Popen([path, "--backend", "host", "--socket", sock, "--config",
                             "/dev/null", "--state-dir", os.path.join(tmp, "state"),
                             "--pool-size", pool_size], stderr=subprocess.DEVNULL)
    try:
        for _ in range(500):
            try:
                kvd.Client(sock).close()
                break
            except kvd.KvdError:
                time.sleep(0.02)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
