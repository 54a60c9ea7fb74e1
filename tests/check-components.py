#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""The daemon's components include only what they may use (docs/architecture.md §1).

daemon/meson.build lists the components lowest first, each with the components it uses;
the build links each one alone, so a call up the list fails there. This checks the headers:
a file of a component includes the header of another only when it may use that one (it
uses it, or uses a component that may). The includes that still go up the list are named in
tests/components-allowed.txt; that list only shrinks: an entry no file needs any more is
an error too, so that it is deleted with the include it excused.

Usage: check-components.py SOURCE_ROOT
"""
import re
import sys
from pathlib import Path

root = Path(sys.argv[1])
daemon = root / "daemon"
build = (daemon / "meson.build").read_text()
components = re.findall(r"'name': '([a-z]+)', 'uses': \[([^\]]*)\]", build)
if not components:
    sys.exit("check-components: no components found in daemon/meson.build")

may_use = {}
for name, uses in components:
    below = set()
    for u in re.findall(r"'([a-z]+)'", uses):
        if u not in may_use:
            sys.exit(f"check-components: {name} uses {u}, which is not below it")
        below |= may_use[u] | {u}
    may_use[name] = below

home = {}
for name in may_use:
    folder = daemon / name
    if not folder.is_dir():
        sys.exit(f"check-components: no folder daemon/{name}/")
    for f in folder.iterdir():
        if f.suffix in (".c", ".h"):
            home[f.name] = name

allowed_path = root / "tests" / "components-allowed.txt"
allowed = set()
for line in allowed_path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        allowed.add(tuple(line.split()))

errors = []
used = set()
include = re.compile(r'^\s*#\s*include\s+"([^"/]+)"')
for name, comp in sorted(home.items()):
    path = daemon / comp / name
    for n, line in enumerate(path.read_text().splitlines(), 1):
        m = include.match(line)
        if not m or m.group(1) not in home:
            continue
        target = home[m.group(1)]
        if target == comp or target in may_use[comp]:
            continue
        pair = (f"{comp}/{name}", f"{target}/{m.group(1)}")
        if pair in allowed:
            used.add(pair)
        else:
            errors.append(f"daemon/{comp}/{name}:{n}: includes {m.group(1)} of {target}, "
                          f"which {comp} may not use")
for pair in sorted(allowed - used):
    errors.append(f"tests/components-allowed.txt: {pair[0]} {pair[1]} is no longer needed: "
                  "delete it")
for e in errors:
    print(e)
print(f"{len(home)} files in {len(may_use)} components, {len(used)} includes allowed up the list, "
      f"{len(errors)} errors")
sys.exit(1 if errors else 0)
