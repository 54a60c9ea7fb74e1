#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Every reference the sources make to a file of the project resolves: the project explains
itself, so a comment, man page or document that sends the reader to a file sends them to
one that exists.

Checked in every text file of the tree (build directories and test data aside):
  - documents: README.md and other capitalised .md names, bare (the file's own directory,
    then the top) or as a path, and any .md under docs/;
  - paths under the top-level folders (daemon/eviction/round.c, docs/abi.md, eval/kvd-lm/), except
    patterns (simd-*.c, cuda-kernels.{h,cu}, regular expressions), #include lines (system headers share the
    names) and, on a line that speaks of a build, what the build makes (daemon/kvd);
  - "docs/NAME.md §N.M" or "docs/NAME.md section N": NAME.md has a heading numbered N.M.
Lower-case bare .md names are files programs write (table.md), not references.

Usage: check-references.py SOURCE_ROOT
"""
import os
import re
import sys
from pathlib import Path

root = Path(sys.argv[1]).resolve()
TOP = ("basic", "client", "daemon", "docs", "eval", "kernels", "proto", "systemd", "tests", "tools")
TEXT = {".c", ".h", ".cu", ".cc", ".py", ".sh", ".md", ".scd", ".proto", ".build", ".txt",
        ".in", ".sym", ".conf", ".service", ".socket"}
SKIP_DIRS = {".git", "__pycache__", "corpus", "data"}

md_ref = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
PLACEHOLDERS = {"NAME", "DOC", "FILE", "X", "DIR"}


def is_document(ref):
    stem = Path(ref).stem
    if stem in PLACEHOLDERS:
        return False
    return ref.startswith("docs/") or stem[:1].isupper()

path_ref = re.compile(r"(?<![\w/.-])((?:%s)/[\w./-]*[\w-])" % "|".join(TOP))
section_ref = re.compile(r"(docs/[\w.-]+\.md)[,]?\s*(?:§|section\s+)(\d+(?:\.\d+)?)")


def text_files():
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not (rel == Path(".") and d.startswith("build"))]
        for name in filenames:
            p = Path(dirpath) / name
            if p.suffix in TEXT or name in ("meson.build", "meson_options.txt") or \
                    (rel.parts[:1] == ("tools",) and "." not in name) or \
                    rel.parts[:1] == (".ci",):
                yield p


def resolves(ref, here):
    ref = ref.rstrip(".")
    for base in (here.parent, root):
        if (base / ref).exists():
            return True
    return False


headings = {}


def has_heading(doc, number):
    if doc not in headings:
        text = (root / doc).read_text(errors="replace") if (root / doc).exists() else ""
        headings[doc] = set(re.findall(r"^#+\s+(\d+(?:\.\d+)*)[.\s]", text, re.M))
    return number in headings[doc]


failures = []
checked = 0
for f in sorted(text_files()):
    try:
        text = f.read_text()
    except (UnicodeDecodeError, OSError):
        continue
    rel = f.relative_to(root)
    for lineno, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*#\s*include", line):
            continue
        for m in md_ref.finditer(line):
            if not is_document(m.group(1)):
                continue
            checked += 1
            if not resolves(m.group(1), f):
                failures.append(f"{rel}:{lineno}: {m.group(1)} does not exist")
        for m in path_ref.finditer(line):
            ref = m.group(1)
            # A pattern or a placeholder, not a file (simd-*.c, docs/NAME.md).
            if re.search(r"[*{}\[\\]|NAME|\.\.\.", line[m.start():m.end() + 2]):
                continue
            if re.search(r"build", line, re.I) and (root / ref).parent.is_dir():
                continue
            checked += 1
            if not resolves(ref, f):
                failures.append(f"{rel}:{lineno}: {ref} does not exist")
        for m in section_ref.finditer(line):
            checked += 1
            if not has_heading(m.group(1), m.group(2)):
                failures.append(f"{rel}:{lineno}: {m.group(1)} has no section {m.group(2)}")

for line in failures:
    print("FAIL: " + line, file=sys.stderr)
print(f"{checked} references checked, {len(failures)} broken")
sys.exit(1 if failures else 0)
