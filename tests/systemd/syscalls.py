#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
The daemon makes no system call that kvd.service's SystemCallFilter= denies: under systemd
such a call fails with EPERM (SystemCallErrorNumber=), which a test without systemd as PID 1
never sees. The daemon runs socket-activated under `strace -D -f -c` (-D keeps its pid, so
LISTEN_PID matches) through a session that touches every request path kvdctl and kvd-bench
reach (hello, status, budget and tenant settings, models, sequences grown, written,
verified, digested and released, a client that vanishes, SIGHUP, SIGTERM), and each call it
made is checked against the filter computed from the unit's SystemCallFilter= lines with
`systemd-analyze syscall-filter`.

Usage: syscalls.py UNIT (the test copy of kvd.service). Environment: KVD_DAEMON, KVDCTL,
KVD_BENCH. Skips (77) without strace or systemd-analyze, and where ptrace is not allowed.
Not for sanitizer builds (meson does not register it there): their runtimes make calls of
their own.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def skip(why):
    print("SKIP:", why)
    sys.exit(77)


def fail(msg):
    print("FAIL:", msg, file=sys.stderr)
    sys.exit(1)


def syscall_groups():
    """{"@name": [members]} from `systemd-analyze syscall-filter`."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"],
                         capture_output=True, text=True, check=True).stdout
    groups, cur = {}, None
    for line in out.splitlines():
        if line.startswith("@"):
            cur = groups.setdefault(line.strip(), [])
        elif cur is not None and line.strip() and not line.strip().startswith("#"):
            cur.append(line.strip())
        elif not line.strip():
            cur = None
    return groups


def expand(names, groups, seen=None):
    seen = set() if seen is None else seen
    out = set()
    for n in names:
        if n.startswith("@"):
            if n not in seen:
                seen.add(n)
                out |= expand(groups.get(n, []), groups, seen)
        else:
            out.add(n)
    return out


def unit_filter(unit, groups):
    """The set of calls the unit allows (systemd's rule: the first line sets an allow list,
    ~ lines take from it)."""
    allowed = None
    for line in open(unit):
        m = re.match(r"\s*SystemCallFilter=(~?)(.*)", line)
        if not m:
            continue
        names = expand(m.group(2).split(), groups)
        if m.group(1):
            if allowed is None:
                fail("a deny-list SystemCallFilter= is not what this test understands")
            allowed -= names
        else:
            allowed = names if allowed is None else allowed | names
    if allowed is None:
        fail(f"{unit} has no SystemCallFilter=")
    return allowed


def isolated(daemon, tmp):
    """Flags that keep the daemon off the host's config file and state directory, where it
    has them (--help lists them)."""
    help_text = subprocess.run([daemon, "--help"], capture_output=True, text=True).stdout
    args = []
    if "--state-dir" in help_text:
        args += ["--state-dir", os.path.join(tmp, "state")]
    if "--config" in help_text:
        args += ["--config", "/dev/null"]
    return args


def read_notes(sock, notes):
    while True:
        notes.append(sock.recv(4096).decode())


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)
    if r.returncode != 0:
        fail(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    if len(sys.argv) != 2:
        fail("usage: syscalls.py UNIT")
    for tool in ("strace", "systemd-analyze"):
        if not shutil.which(tool):
            skip(f"{tool} is not installed")
    daemon, kvdctl, bench = (os.environ[k] for k in ("KVD_DAEMON", "KVDCTL", "KVD_BENCH"))
    if subprocess.run(["strace", "-o", "/dev/null", "true"], capture_output=True).returncode:
        skip("strace cannot trace here (ptrace not allowed)")
    allowed = unit_filter(sys.argv[1], syscall_groups())

    tmp = tempfile.mkdtemp(prefix="kvd-syscalls-")
    try:
        sock_path = os.path.join(tmp, "kvd.sock")
        trace = os.path.join(tmp, "trace")
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(sock_path)
        ls.listen()
        # sd_notify's calls too: READY=1, STATUS= and the watchdog's pings.
        # Read as a service manager does, all along: a full queue (10 datagrams by default)
        # would block the daemon in sd_notify().
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(tmp, "notify"))
        notes = []
        reader = threading.Thread(target=lambda: read_notes(notify, notes), daemon=True)
        reader.start()
        # fd 3 and LISTEN_PID=$$ as in socket-activation.py; strace -D keeps that pid.
        script = ('trace=$1; shift; exec 20<&"$0"; exec 3<&20 20<&-; '
                  'export LISTEN_FDS=1 LISTEN_PID=$$; exec strace -D -f -c -o "$trace" -- "$@"')
        d = subprocess.Popen(["bash", "-c", script, str(ls.fileno()), trace, daemon,
                              "--socket", sock_path, "--backend", "host", "--pool-size", "64MiB",
                              "--chunk-size", "1MiB"] + isolated(daemon, tmp),
                             env=dict(os.environ, NOTIFY_SOCKET=os.path.join(tmp, "notify"),
                                      WATCHDOG_USEC="100000"),
                             pass_fds=[ls.fileno()], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        ls.close()
        for _ in range(500):
            if subprocess.run([kvdctl, "--socket", sock_path, "status"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.02)
        ctl = [kvdctl, "--socket", sock_path]
        run(ctl + ["budget", "set", "48MiB"])
        run(ctl + ["tenant", "set", "bench-0", "--min", "1MiB", "--max", "32MiB", "--weight", "2"])
        run([bench, "load", "--socket", sock_path, "--tenants", "2", "--seqs", "2",
             "--tokens", "256", "--verify"])
        # A client that vanishes holding sequences: its chunks are reclaimed.
        v = subprocess.Popen([bench, "load", "--socket", sock_path, "--tenants", "1",
                              "--seqs", "2", "--tokens", "128", "--hold", "30"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        time.sleep(1.0)
        os.killpg(v.pid, signal.SIGKILL)  # kvd-bench and the tenant process it forked
        v.wait()
        run(ctl + ["status", "--json"])
        # A reload (SIGHUP), where the daemon has one: it says RELOADING=1, then READY=1.
        if "SIGHUP" in subprocess.run([daemon, "--help"], capture_output=True,
                                      text=True).stdout:
            os.kill(d.pid, signal.SIGHUP)
            for _ in range(500):
                if any("RELOADING=1" in n for n in notes):
                    break
                time.sleep(0.01)
            else:
                fail("no RELOADING=1 after SIGHUP")
            run(ctl + ["status"])
        os.kill(d.pid, signal.SIGTERM)
        out, _ = d.communicate(timeout=30)
        if d.returncode != 0:
            fail(f"the daemon exited {d.returncode}:\n{out}")
        if "passed by the service manager" not in out:
            fail(f"the daemon did not take the passed socket:\n{out}")
        # strace, detached, writes its summary after the daemon is gone.
        for _ in range(500):
            if os.path.exists(trace) and "total" in open(trace).read():
                break
            time.sleep(0.02)
        if not any("READY=1" in n for n in notes):
            fail(f"no READY=1 from the daemon (got {notes[:3]!r})")
        used = set()
        for line in open(trace):
            f = line.split()
            if len(f) >= 5 and re.match(r"^\d", f[0]) and f[-1] != "total":
                used.add(f[-1])
        if not used:
            fail("strace recorded no system call:\n" + open(trace).read())
        denied = sorted(used - allowed)
        print(f"{len(used)} system calls made: {' '.join(sorted(used))}")
        if denied:
            fail("kvd.service's SystemCallFilter= denies: " + " ".join(denied))
        print("all allowed by kvd.service's SystemCallFilter=")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
