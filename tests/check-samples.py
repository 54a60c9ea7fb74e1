#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
Checks the samples of docs/operating.md against a live kvd, so that they cannot drift from
what kvdctl prints:

the kvdctl synopsis   every command of `kvdctl --help` has a line;
the status sample     made again as the text before it says (kvd's flags, the kvd.conf,
                      the live change, the kvd-bench load): the same header line shape,
                      the same labelled lines in the same order, the same table columns,
                      the same tenants and the same footer;
the top sample        the same header line shape, lines and table columns.

Values (sizes, times, paths) are not compared: they change from run to run.

Usage: check-samples.py KVD KVDCTL KVD_BENCH OPERATING_MD
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr)


def code_blocks(text):
    return re.findall(r"^```[a-z]*\n(.*?)^```$", text, flags=re.S | re.M)


def block_starting(blocks, pattern, what):
    for b in blocks:
        if re.match(pattern, b):
            return b.splitlines()
    fail(f"operating.md has no {what} (a code block starting with /{pattern}/)")
    return None


def kvdctl_commands(kvdctl):
    out = subprocess.run([kvdctl, "--help"], capture_output=True, text=True, check=True).stdout
    section = out.split("Commands:\n", 1)[1].split("\n\n", 1)[0]
    return sorted({m.group(1) for m in re.finditer(r"^  ([a-z]+)\b", section, flags=re.M)})


def shape(lines):
    """What a status or top text is made of, without its values."""
    s = {"labels": [], "columns": None, "rows": [], "footer": []}
    table = False
    for i, line in enumerate(lines):
        if i == 0:
            # "kvd 1.10.0, protocol 1, backend host, up 4.0s": its words, paths and
            # numbers as P and N.
            s["first"] = re.sub(r"[^\s,;]*\d[^\s,;]*", "N", re.sub(r"/[^\s,;]+", "P", line))
            continue
        if line.startswith("TENANT "):
            s["columns"] = line.split()
            table = True
            continue
        if table and line and not line.startswith(("* ", "+ ", "^ ")):
            s["rows"].append(line.split()[0])
            continue
        if line.startswith(("* ", "+ ", "^ ")):
            s["footer"].append(line)
            continue
        m = re.match(r"^  (\S+(?: \S+)?)\s{2,}", line)
        if m:
            s["labels"].append(m.group(1))
        elif line and not table:
            # top's lines: "budget ...", "connections ...".
            s["labels"].append(line.split()[0])
    return s


def compare(what, doc, live):
    for key in ("first", "labels", "columns", "footer"):
        if doc.get(key) != live.get(key):
            fail(f"the {what} sample's {key} differ from a live kvdctl's:\n"
                 f"  sample: {doc.get(key)}\n  live:   {live.get(key)}")
    if sorted(doc["rows"]) != sorted(live["rows"]):
        fail(f"the {what} sample's tenants {doc['rows']} are not a live run's {live['rows']}")


def run_sample(kvd, kvdctl, bench, tmp):
    """The commands the text before the status sample gives; returns (status, top)."""
    sock = os.path.join(tmp, "kvd.sock")
    conf = os.path.join(tmp, "kvd.conf")
    with open(conf, "w") as f:
        f.write("[kvd]\nbudget = 768MiB\n[tenant bench-0]\nmin = 64MiB\nmax = 256MiB\nweight = 2\n")
    daemon = subprocess.Popen(
        [kvd, "--backend", "host", "--pool-size", "1GiB", "--chunk-size", "4MiB",
         "--host-tier-size", "64MiB", "--socket", sock, "--state-dir", os.path.join(tmp, "state"),
         "--config", conf, "--log-level", "err"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    load = None
    try:
        ctl = [kvdctl, "--socket", sock]
        deadline = time.monotonic() + 60
        while subprocess.run(ctl + ["status"], capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvd did not start: {daemon.stderr.read()}")
            time.sleep(0.05)
        subprocess.run(ctl + ["tenant", "set", "bench-1", "--max", "128MiB"], check=True,
                       capture_output=True)
        # Held long enough for a loaded 2-core machine to look at it.
        load = subprocess.Popen([bench, "load", "--socket", sock, "--tenants", "3", "--seqs", "8",
                                 "--tokens", "2048", "--hold", "60"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # Every sequence open and grown: the tenants' usage the same over three looks.
        seen = []
        while True:
            st = json.loads(subprocess.run(ctl + ["status", "--json"], capture_output=True,
                                           text=True, check=True).stdout)
            seen.append([(t["name"], t["sequences"], t["block_bytes"]) for t in st["tenants"]])
            if (sum(t["sequences"] for t in st["tenants"]) == 24 and len(seen) >= 3 and
                    seen[-1] == seen[-2] == seen[-3]):
                break
            if load.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvd-bench load did not open its sequences: "
                                   f"{load.stderr.read() if load.poll() is not None else ''}")
            time.sleep(0.2)
        status = subprocess.run(ctl + ["status"], capture_output=True, text=True, check=True).stdout
        top = subprocess.run(ctl + ["top", "--once", "--interval", "0.5"], capture_output=True,
                             text=True, check=True).stdout
        return status.splitlines(), top.splitlines()
    finally:
        if load:
            load.kill()
            load.wait(timeout=30)
        daemon.terminate()
        daemon.wait(timeout=30)


def main():
    if len(sys.argv) != 5:
        print(__doc__.strip().split("Usage: ")[1], file=sys.stderr)
        return 2
    kvd, kvdctl, bench, doc_path = sys.argv[1:]
    with open(doc_path, encoding="utf-8") as f:
        blocks = code_blocks(f.read())

    synopsis = block_starting(blocks, r"kvdctl \[--socket PATH\]", "kvdctl synopsis")
    if synopsis:
        for cmd in kvdctl_commands(kvdctl):
            if not any(re.search(rf"(^kvdctl|\|) (\[--socket PATH\] )?{cmd}\b", l) for l in synopsis):
                fail(f"operating.md's kvdctl synopsis has no line for '{cmd}'")

    doc_status = block_starting(blocks, r"kvd \S+, protocol \d+, backend", "status sample")
    doc_top = block_starting(blocks, r"kvd \S+ at \S+, backend \S+, up .*rates over", "top sample")
    with tempfile.TemporaryDirectory() as tmp:
        status, top = run_sample(kvd, kvdctl, bench, tmp)
    if doc_status:
        compare("status", shape(doc_status), shape(status))
    if doc_top:
        compare("top", shape(doc_top), shape(top))
    if failures:
        print(f"{len(failures)} failures; the live texts were:\n" + "\n".join(status) + "\n\n" +
              "\n".join(top), file=sys.stderr)
        return 1
    print("operating.md's synopsis and samples match a live kvdctl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
