#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
kvd under a service manager, played by this script (PID 1 is not systemd on CI machines):
a datagram NOTIFY_SOCKET receives sd_notify messages, and the listening socket comes from
systemd-socket-activate or, for the cases it cannot make, from a shell that puts a socket
on fd 3 and execs the daemon with LISTEN_FDS/LISTEN_PID of its own pid.

Checks: READY=1 with a one-line STATUS=, WATCHDOG=1 at least twice per WATCHDOG_USEC and
none while the daemon is stopped (SIGSTOP: a loop that does not turn does not ping), a
client served through the inherited socket, STOPPING=1 after SIGTERM, exit 0, and the
socket file left in place; the inherited socket wins over --socket; a passed socket that is
not one listening AF_UNIX stream socket is refused; a LISTEN_PID or WATCHDOG_PID of another
process is ignored.

Environment: KVD_DAEMON and KVDCTL (set by meson).
"""
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

DAEMON = os.environ.get("KVD_DAEMON")
KVDCTL = os.environ.get("KVDCTL")
# The host backend, also on a machine with a GPU, where auto would pick cuda.
SMALL = ["--backend", "host", "--pool-size", "8MiB", "--chunk-size", "1MiB"]
WATCHDOG_USEC = 200000
# What the sanitizer runtimes read: systemd-socket-activate passes on only what it is told.
PASS_ENV = ["ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS", "MALLOC_PERTURB_"]


def fail(msg):
    print("FAIL:", msg, file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


class Manager:
    """A temporary directory with the notify socket; collects what the daemon sends."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvd-sd-")
        self.notify_path = os.path.join(self.dir, "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.notify.bind(self.notify_path)
        # Read all along, as a service manager does: a full queue (10 datagrams by default)
        # would block the daemon in sd_notify().
        self.queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.proc = None

    def _read(self):
        try:
            while True:
                self.queue.put(self.notify.recv(4096).decode())
        except OSError:  # closed
            pass

    def path(self, name):
        return os.path.join(self.dir, name)

    def recv(self, timeout):
        """The next message as a dict of its assignments, or None after timeout seconds."""
        try:
            data = self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return None
        fields = {}
        for line in data.split("\n"):
            if line:
                key, _, value = line.partition("=")
                fields[key] = value
        return fields

    def wait_for(self, key, timeout=10):
        """Messages until one with key; returns (that one, all seen on the way)."""
        seen = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = self.recv(max(end - time.monotonic(), 0.01))
            if m is None:
                break
            seen.append(m)
            if key in m:
                return m, seen
        fail(f"no {key}= within {timeout} s (got {seen})")

    def drain(self):
        while self.recv(0) is not None:
            pass

    def start(self, args, **kw):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, **kw)
        return self.proc

    def output(self, timeout=20):
        """Waits for the daemon to exit; returns (status, its output)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            fail(f"the daemon did not exit within {timeout} s; output:\n{out}")
        return self.proc.returncode, out

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.shutdown(socket.SHUT_RDWR)
        self.notify.close()
        shutil.rmtree(self.dir, ignore_errors=True)


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


def pass_env():
    out = []
    for name in PASS_ENV:
        if name in os.environ:
            out += ["-E", f"{name}={os.environ[name]}"]
    return out


def kvdctl_status(path):
    r = subprocess.run([KVDCTL, "--socket", path, "status", "--json"], capture_output=True,
                       text=True, timeout=20)
    check(r.returncode == 0, f"kvdctl status through {path}: {r.returncode} {r.stderr}")
    return json.loads(r.stdout)


def count_watchdog(m, seconds):
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        msg = m.recv(max(end - time.monotonic(), 0.01))
        if msg is not None and msg.get("WATCHDOG") == "1":
            n += 1
    return n


def test_activated():
    m = Manager()
    try:
        sock = m.path("kvd.sock")
        other = m.path("not-this.sock")
        # exec keeps the shell's pid through systemd-socket-activate (which execs the daemon
        # itself when not --accept), so $$ is the daemon's pid: WATCHDOG_PID matches.
        script = ('listen=$0 notify=$1; shift; '
                  'exec systemd-socket-activate -l "$listen" -E NOTIFY_SOCKET="$notify" '
                  f'-E WATCHDOG_USEC={WATCHDOG_USEC} -E WATCHDOG_PID=$$ "$@"')
        m.start(["sh", "-c", script, sock, m.notify_path] + pass_env() +
                [DAEMON, "--socket", other] + SMALL + isolated(DAEMON, m.dir))
        for _ in range(500):
            if os.path.exists(sock):
                break
            time.sleep(0.01)
        check(os.path.exists(sock), "systemd-socket-activate made no socket")
        # It starts the daemon on the first connection: this one.
        st = kvdctl_status(sock)
        check(st["pool_bytes"] == 8 << 20, f"status through the activated socket: {st}")
        ready, _ = m.wait_for("READY")
        check(ready["READY"] == "1", f"READY: {ready}")
        status = ready.get("STATUS", "")
        check(status.startswith(f"serving {sock}"),
              f"STATUS names the inherited socket: {status!r}")
        check("budget" in status, f"STATUS shows the budget: {status!r}")
        print("READY=1, STATUS=" + status)

        n = count_watchdog(m, 1.0)
        # Every tick pings, at least twice per interval: 5 per second here, ~10 in fact.
        check(n >= 5, f"{n} WATCHDOG=1 in 1 s with WATCHDOG_USEC={WATCHDOG_USEC}")
        print(f"{n} WATCHDOG=1 in 1 s")

        # A new connection shows in STATUS= at the next tick, on one line.
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock)
        msg, _ = m.wait_for("STATUS", 5)
        check("1 connection," in msg["STATUS"], f"STATUS after a connection: {msg}")
        print("STATUS=" + msg["STATUS"])
        c.close()

        # A stopped loop stops pinging; it resumes with the loop.
        os.kill(m.proc.pid, signal.SIGSTOP)
        time.sleep(0.05)
        m.drain()
        n = count_watchdog(m, 0.6)
        os.kill(m.proc.pid, signal.SIGCONT)
        check(n == 0, f"{n} WATCHDOG=1 while the daemon was stopped")
        check(count_watchdog(m, 0.6) >= 2, "no WATCHDOG=1 after SIGCONT")
        print("no WATCHDOG=1 while stopped, pings again after SIGCONT")

        os.kill(m.proc.pid, signal.SIGTERM)
        stopping, _ = m.wait_for("STOPPING")
        check(stopping["STOPPING"] == "1", f"STOPPING: {stopping}")
        rc, out = m.output()
        check(rc == 0, f"exit status {rc}; output:\n{out}")
        check("instead of --socket " + other in out, f"no log of the socket choice:\n{out}")
        check(os.path.exists(sock), "the daemon removed the socket file it did not create")
        check(not os.path.exists(other), "the daemon bound --socket as well")
        print("STOPPING=1, exit 0, socket file left in place")
    finally:
        m.close()


def run_with_fds(m, socks, extra_env, args):
    """Runs the daemon with socks on fds 3, 4...: a shell moves them there (through fds 20
    and up, so that no move overwrites a socket still to be moved), exports LISTEN_PID=$$
    unless extra_env has one, and execs the daemon, which keeps the shell's pid."""
    env = dict(os.environ)
    env.update(extra_env)
    env["NOTIFY_SOCKET"] = m.notify_path
    fds = [s.fileno() for s in socks]
    high = " ".join(f"{20 + i}<&{fd}" for i, fd in enumerate(fds))
    close = " ".join(f"{fd}<&-" for fd in fds)
    place = " ".join(f"{3 + i}<&{20 + i} {20 + i}<&-" for i in range(len(fds)))
    script = (f'exec {high}; exec {close}; exec {place}; '
              'export LISTEN_PID=${LISTEN_PID:-$$}; exec "$@"')
    # bash: dash takes only one-digit fds in redirections.
    m.start(["bash", "-c", script, "bash", DAEMON] + args, env=env, pass_fds=fds)


def test_refused():
    cases = []
    # Bound and named, but not listening.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cases.append(("a stream socket that does not listen", [s], "not-listening.sock"))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    cases.append(("a datagram socket", [s], "dgram.sock"))
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    cases.append(("a TCP socket", [s], None))
    a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cases.append(("two sockets", [a, b], "two-a.sock"))
    for what, socks, name in cases:
        m = Manager()
        try:
            path = None
            if name:
                path = m.path(name)
                socks[0].bind(path)
                if len(socks) > 1:
                    socks[1].bind(m.path("two-b.sock"))
                    socks[0].listen()
                    socks[1].listen()
            run_with_fds(m, socks, {"LISTEN_FDS": str(len(socks))},
                         ["--socket", m.path("own.sock")] + SMALL + isolated(DAEMON, m.dir))
            rc, out = m.output()
            check(rc == 1, f"{what}: exit status {rc}, want 1; output:\n{out}")
            want = "expected one" if len(socks) > 1 else "not a listening AF_UNIX stream socket"
            check(want in out, f"{what}: no '{want}' in the output:\n{out}")
            check(not os.path.exists(m.path("own.sock")), f"{what}: bound --socket instead")
            check(path is None or os.path.exists(path), f"{what}: removed {path}")
            check(m.recv(0) is None, f"{what}: sent READY")
            print(f"refused {what}: {out.strip().splitlines()[-1]}")
        finally:
            for s in socks:
                s.close()
            m.close()


def test_foreign_pids():
    """LISTEN_PID and WATCHDOG_PID of another process: not ours, so the daemon binds
    --socket (and removes it at exit, being its own) and does not ping."""
    m = Manager()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(m.path("foreign.sock"))
        s.listen()
        own = m.path("own.sock")
        run_with_fds(m, [s], {"LISTEN_FDS": "1", "LISTEN_PID": "1",
                              "WATCHDOG_USEC": str(WATCHDOG_USEC), "WATCHDOG_PID": "1"},
                     ["--socket", own] + SMALL + isolated(DAEMON, m.dir))
        ready, _ = m.wait_for("READY")
        check(ready.get("STATUS", "").startswith(f"serving {own}"), f"STATUS: {ready}")
        check(kvdctl_status(own)["pool_bytes"] == 8 << 20, "status through --socket")
        n = count_watchdog(m, 0.5)
        check(n == 0, f"{n} WATCHDOG=1 with WATCHDOG_PID of another process")
        os.kill(m.proc.pid, signal.SIGTERM)
        m.wait_for("STOPPING")
        rc, out = m.output()
        check(rc == 0, f"exit status {rc}; output:\n{out}")
        check("service manager" not in out, f"took a socket not meant for it:\n{out}")
        check(not os.path.exists(own), "left its own socket file behind")
        check(os.path.exists(m.path("foreign.sock")), "removed a socket file it did not create")
        print("foreign LISTEN_PID/WATCHDOG_PID ignored: bound --socket, no pings")
    finally:
        s.close()
        m.close()


def main():
    if not DAEMON or not KVDCTL:
        fail("KVD_DAEMON and KVDCTL must be set (run the tests through meson)")
    if not shutil.which("systemd-socket-activate"):
        print("SKIP: systemd-socket-activate is not installed")
        sys.exit(77)
    test_activated()
    test_refused()
    test_foreign_pids()
    print("ok")


if __name__ == "__main__":
    main()
