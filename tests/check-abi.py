#!/usr/bin/env python3
"""The ABI has one home (proto/include/kvd/kvd-abi.h): the daemon, proto and the kernels
never include libkvd's kvd.h, and no source file defines again a constant the ABI header
defines, under its name or with a prefix of its own (MODEL_WINDOW_MAX for KVD_WINDOW_MAX).
And every libkvd function added after 1.0 says since when: the comment before its
declaration in kvd.h names the libkvd.sym node that lists it ("Since KVD_1.2.").

Usage: check-abi.py SOURCE_ROOT
"""
import re
import sys
from pathlib import Path

root = Path(sys.argv[1])
abi = root / "proto/include/kvd/kvd-abi.h"
define = re.compile(r"^\s*#\s*define\s+(\w+)", re.M)
names = [n for n in define.findall(abi.read_text()) if n.startswith("KVD_") and
         not n.startswith("KVD_ABI_") and n != "KVD_KVD_ABI_H"]
bases = {n[len("KVD_"):]: n for n in names}
failures = []

for part in ("daemon", "proto", "kernels"):
    for f in sorted((root / part).rglob("*.[ch]")):
        if re.search(r'#\s*include\s*[<"]kvd/kvd\.h[>"]', f.read_text()):
            failures.append(f"{f.relative_to(root)}: includes kvd/kvd.h; the ABI is kvd/kvd-abi.h")

sources = [f for part in ("daemon", "proto", "kernels", "client", "tools")
           for f in (root / part).rglob("*") if f.suffix in (".c", ".h", ".cu") and f != abi]
for f in sorted(sources):
    for n in define.findall(f.read_text()):
        for base, abi_name in bases.items():
            if n == abi_name or n == base or n.endswith("_" + base):
                failures.append(f"{f.relative_to(root)}: #define {n} repeats {abi_name} "
                                f"(kvd-abi.h)")

node_of = {}
for m in re.finditer(r"^(KVD_[0-9.]+) \{(.*?)\}", (root / "client/libkvd.sym").read_text(),
                     re.S | re.M):
    for n in re.findall(r"^\s*(kvd_\w+);", m.group(2), re.M):
        node_of[n] = m.group(1)
comment = ""
for m in re.finditer(r"/\*.*?\*/|^KVD_EXPORT[^;]*;",
                     (root / "client/include/kvd/kvd.h").read_text(), re.S | re.M):
    if m.group(0).startswith("/*"):
        comment = m.group(0)
        continue
    name = re.search(r"(kvd_\w+)\s*\(", m.group(0)).group(1)
    node = node_of.get(name)
    if node and node != "KVD_1.0" and f"Since {node}." not in comment:
        failures.append(f"kvd.h: {name} is in {node} but its comment does not say "
                        f"\"Since {node}.\"")

for line in failures:
    print("FAIL: " + line, file=sys.stderr)
print(f"kvd-abi.h: {len(names)} constants; {len(sources)} sources checked")
sys.exit(1 if failures else 0)
