# SPDX-License-Identifier: MIT
"""
The /metrics text of a kvd started for the purpose, and its metric families: what the
reference tables (check-docs.py) and the monitoring files (check-monitoring.py) are checked
against.
"""
import os
import re
import socket
import subprocess
import tempfile
import time


def scrape(kvd):
    """The /metrics text of a kvd started here on the host backend with one tenant declared,
    so that every family, the per-tenant ones included, has samples."""
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "kvd.conf")
        with open(conf, "w") as f:
            f.write("[tenant example]\nmax = 64MiB\n")
        metrics = os.path.join(tmp, "metrics.sock")
        daemon = subprocess.Popen(
            [kvd, "--backend", "host", "--socket", os.path.join(tmp, "kvd.sock"),
             "--pool-size", "16MiB", "--state-dir", os.path.join(tmp, "state"),
             "--config", conf, "--metrics-listen", "unix:" + metrics, "--log-level", "err"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with socket.socket(socket.AF_UNIX) as c:
                        c.settimeout(30)
                        c.connect(metrics)
                        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: kvd\r\n\r\n")
                        answer = b""
                        while chunk := c.recv(65536):
                            answer += chunk
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"kvd did not serve metrics: {daemon.stderr.read()}")
                    time.sleep(0.05)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
    head, _, body = answer.decode().partition("\r\n\r\n")
    if not head.startswith("HTTP/1.1 200"):
        raise RuntimeError(f"GET /metrics: {head.splitlines()[:1]}")
    return body


# Labels whose values are names of things on the node, not a fixed set.
OPEN_LABELS = {"tenant", "version", "backend", "device", "le", "policy", "tier"}


def metric_families(text):
    """[(name, type, help, {label: [values]})] in the order of the scrape."""
    families, by_name = [], {}
    for line in text.splitlines():
        m = re.match(r"^# HELP (\S+) (.*)$", line)
        if m:
            by_name[m.group(1)] = [m.group(1), None, m.group(2), {}]
            families.append(by_name[m.group(1)])
            continue
        m = re.match(r"^# TYPE (\S+) (\S+)$", line)
        if m:
            by_name[m.group(1)][1] = m.group(2)
            continue
        m = re.match(r"^([a-z_]+?)(?:_bucket|_sum|_count)?(?:\{(.*)\})? \S+$", line)
        if not m:
            continue
        fam = by_name.get(m.group(1)) or by_name.get(line.split("{")[0].split(" ")[0])
        if not fam:
            continue
        for key, value in re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""):
            values = fam[3].setdefault(key, [])
            if value not in values:
                values.append(value)
    return families
