#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
Checks the DT_NEEDED entries of every ELF executable and shared library under a build
directory against the libraries a clean Debian host has once kvd's own dependencies are
installed. Above all: no binary may need a CUDA library (libcuda, libcudart, ...). The
daemon and libkvd load libcuda.so.1 with dlopen() at run time, so that they start on a
machine without the NVIDIA driver; a NEEDED libcuda would make them fail to start there
(exit 127), and a NEEDED libcudart would need the toolkit installed. A development machine
with LIBRARY_PATH pointing at the toolkit's stubs links -lcuda silently, which is what this
test catches.

Reads the ELF files itself (no readelf), so it runs wherever python3 does.

Usage: check-needed.py BUILD_DIR [--sanitizers]
  --sanitizers  also allow the sanitizer runtimes (libasan, libubsan, ...): a sanitizer
                build links them by design, and it is never installed.
"""
import os
import struct
import sys

# What a clean host has: glibc (libdl, libpthread and librt are stubs inside libc since
# glibc 2.34, but old links may still name them), the compiler's runtime, and the Debian
# packages kvd depends on. libkvd.so.1 is ours.
ALLOWED = {
    "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
    "libgcc_s.so.1", "libstdc++.so.6",
    "liburing.so.2", "libprotobuf-c.so.1", "libsystemd.so.0", "libinih.so.1",
    "libzmq.so.5",  # the KV events publisher (Debian's libzmq5)
    "libkvd.so.1",
}

SHT_DYNAMIC = 6
DT_NEEDED = 1
ET_EXEC, ET_DYN = 2, 3


def needed(path):
    """DT_NEEDED names of an ELF executable or shared object; None for anything else."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        return None
    is64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is64:
        e_type, = struct.unpack_from(end + "H", data, 16)
        shoff, = struct.unpack_from(end + "Q", data, 40)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 58)
    else:
        e_type, = struct.unpack_from(end + "H", data, 16)
        shoff, = struct.unpack_from(end + "I", data, 32)
        shentsize, shnum = struct.unpack_from(end + "HH", data, 46)
    if e_type not in (ET_EXEC, ET_DYN):
        return None
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        if is64:
            _, stype, _, _, soff, ssize, link, _, _, entsize = struct.unpack_from(
                end + "IIQQQQIIQQ", data, off)
        else:
            _, stype, _, _, soff, ssize, link, _, _, entsize = struct.unpack_from(
                end + "IIIIIIIIII", data, off)
        sections.append((stype, soff, ssize, link, entsize))
    out = []
    for stype, soff, ssize, link, entsize in sections:
        if stype != SHT_DYNAMIC:
            continue
        _, stroff, strsize, _, _ = sections[link]
        fmt = end + ("qQ" if is64 else "iI")
        step = struct.calcsize(fmt)
        for off in range(soff, soff + ssize, step):
            tag, val = struct.unpack_from(fmt, data, off)
            if tag == 0:
                break
            if tag == DT_NEEDED:
                name = data[stroff + val:data.index(b"\0", stroff + val)]
                out.append(name.decode())
    return out


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = argv[1]
    if argv[2:] not in ([], ["--sanitizers"]):
        print(__doc__, file=sys.stderr)
        return 2
    sanitizers = argv[2:] == ["--sanitizers"]

    def allowed(lib):
        return lib in ALLOWED or (sanitizers and lib.startswith(
            ("libasan.so", "libubsan.so", "libtsan.so", "liblsan.so")))

    checked, bad = 0, []
    for dirpath, dirnames, filenames in os.walk(root):
        # Meson's own probes are not ours to ship, nor the system libraries that
        # tools/gpu-check --bundle copies next to the binaries.
        dirnames[:] = [d for d in dirnames if d not in ("meson-private", "meson-logs", "gpu-libs")]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith((".o", ".a")) or os.path.islink(path) or not os.path.isfile(path):
                continue
            try:
                libs = needed(path)
            except (OSError, struct.error, ValueError, IndexError):
                continue
            if libs is None:
                continue
            checked += 1
            for lib in libs:
                if not allowed(lib):
                    bad.append(f"{os.path.relpath(path, root)}: NEEDED {lib}")
    for line in bad:
        print(f"FAIL: {line}", file=sys.stderr)
    print(f"{checked} ELF files checked, {len(bad)} needing a library a clean host lacks")
    if checked == 0:
        print("FAIL: no ELF file found under " + root, file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
