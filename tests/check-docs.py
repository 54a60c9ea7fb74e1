#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
Checks that the man pages say what the code does, reading the code's own answers:

kvd.8.scd       every long option `kvd --help` prints has an entry (*--name*), each entry
                names an option that exists, and each entry carries the default --help
                prints ("Default: X.") and "(reloadable)" exactly when --help marks the
                option with * (SIGHUP applies it);
kvd.conf.5.scd  every key of the [kvd] section has an entry (*name* = ...) with the same
                default and "(reloadable)" mark, and every key of [tenant NAME] sections
                (the list --help prints) has one with its default; no entry names a key
                that does not exist. Which options are keys is asked of kvd itself: a
                file with every option as a key goes through --check-config, and the
                options it calls unknown keys are the command-line-only ones;
kvdctl.8.scd    every command of `kvdctl --help` (status, budget get, ...) has an entry
                (*budget get* ...), and every option of `kvdctl --help` and `kvdctl score
                --help` appears as *--name*; no entry names a command or option that does
                not exist;
libkvd.3.scd    every function kvd/kvd.h exports (KVD_EXPORT) and its cleanup helpers are
                named;
reference.md    is the text this script generates from the same answers and from the
                /metrics scrape of a kvd it starts (host backend, one tenant declared):
                tables of kvd's options, the config keys, kvdctl's commands and options,
                and every metric family with its type, labels and help. With --write it
                writes the file instead (tools/docs-reference).

Usage: check-docs.py [--write] KVD KVDCTL KVD_8_SCD KVD_CONF_5_SCD KVDCTL_8_SCD KVD_H
                     LIBKVD_3_SCD REFERENCE_MD
"""
import difflib
import os
import re
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from scrape import OPEN_LABELS, metric_families, scrape  # noqa: E402

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr)


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout, p.stderr


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def entries(scd, term_re):
    """Definition-list entries of an scd page: {key: (term line, body)}, where the term is a
    line matching term_re at column 0 and the body the tab-indented lines that follow."""
    out = {}
    lines = scd.splitlines()
    for i, line in enumerate(lines):
        m = re.match(term_re, line)
        if not m:
            continue
        body = []
        for nxt in lines[i + 1:]:
            if not nxt.startswith("\t"):
                break
            body.append(nxt.strip())
        key = m.group(1)
        if key in out:
            fail(f"two entries for {key!r}")
        out[key] = (line, " ".join(body))
    return out


def section(scd, page, title):
    """The text of the section '# title' of an scd page, up to the next section."""
    m = re.search(rf"^# {re.escape(title)}\n(.*?)(?=^# |\Z)", scd, re.M | re.S)
    if not m:
        fail(f"{page}: no section '# {title}'")
        return ""
    return m.group(1)


def help_entries(text):
    """The option entries of --help: [(lead, text)], continuation lines joined."""
    out = []
    for line in text.splitlines():
        if re.match(r"^  \S", line):
            m = re.match(r"^  (\S.*?)(?:\s{2,}(\S.*))?$", line)
            out.append([m.group(1), m.group(2) or ""])
        elif re.match(r"^\s{3,}\S", line) and out:
            out[-1][1] = (out[-1][1] + " " + line.strip()).strip()
        else:
            out.append(None)  # a blank line or prose ends the entry before it
    return [e for e in out if e]


def default_of(text):
    m = re.search(r"\[([^\[\]]*)\]$", text)
    return m.group(1) if m else None


def check_default(page, name, body, default):
    if default is None:
        return
    if f"Default: {default}." not in body:
        fail(f"{page}: {name}: the default is '{default}' (--help), the page says "
             f"'{(re.search(r'Default: [^.]*', body) or [None])[0]}'")


def cell(text):
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|")


def reference(options, keys, tenant_keys, commands, ctl_options, families):
    out = ["# Reference", "",
           "Generated from the programs themselves by `tools/docs-reference`: `kvd --help`,",
           "`kvdctl --help` and the `/metrics` scrape of a running kvd. The `man-pages` test",
           "fails when this file and the code differ. What each entry means in full is in",
           "kvd(8), kvd.conf(5), kvdctl(8) and `docs/metrics.md`.", "",
           "## kvd options", "",
           "Every option but `--config`, `--check-config`, `--help` and `--version` is also a",
           "key of kvd.conf's `[kvd]` section. Reloadable: `SIGHUP` applies a change at once;",
           "the others need a restart.", "",
           "| option | default | reloadable | key | meaning |",
           "|---|---|---|---|---|"]
    for name, (reloadable, default, lead, text) in options.items():
        arg = lead.partition(f"--{name}")[2].replace(" *", "").strip()
        meaning = re.sub(r"\s*\[[^\[\]]*\]$", "", text)
        out.append(f"| `--{name}{' ' + arg if arg else ''}` | {cell(default or '')} | "
                   f"{'yes' if reloadable else ''} | {'yes' if name in keys else ''} | "
                   f"{cell(meaning)} |")
    out += ["", "## kvd.conf tenant keys", "",
            "The keys of a `[tenant NAME]` section; all are reloadable.", "",
            "| key | default | meaning |", "|---|---|---|"]
    for name, (default, lead, text) in tenant_keys.items():
        meaning = re.sub(r"\s*\[[^\[\]]*\]$", "", text)
        out.append(f"| `{cell(lead)}` | {cell(default or '')} | {cell(meaning)} |")
    out += ["", "## kvdctl commands", "", "| command | what it does |", "|---|---|"]
    for lead, text in commands:
        out.append(f"| `{cell(lead)}` | {cell(text)} |")
    out += ["", "## kvdctl options", "", "| option | meaning |", "|---|---|"]
    for lead, text in ctl_options:
        out.append(f"| `{cell(lead)}` | {cell(text)} |")
    out += ["", "## Metrics", "",
            "Labels list their values where the set is fixed; `tenant` names each tenant,",
            "`device` each pooled GPU's ordinal (0 on host).", "",
            "| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, help_text, labels in families:
        parts = []
        for key, values in labels.items():
            if key == "le":
                continue
            parts.append(f"`{key}`" if key in OPEN_LABELS else
                         f"`{key}`: {', '.join(f'`{v}`' for v in values)}")
        out.append(f"| `{name}` | {kind} | {'; '.join(parts)} | {cell(help_text)} |")
    return "\n".join(out) + "\n"


def main():
    args = sys.argv[1:]
    write = args[:1] == ["--write"]
    if write:
        args = args[1:]
    if len(args) != 8:
        print(__doc__.strip().split("Usage: ")[1], file=sys.stderr)
        return 2
    kvd, kvdctl, kvd8, kvdconf5, kvdctl8, kvd_h, libkvd3, reference_md = args

    # ---- kvd --help ----
    rc, out, err = run([kvd, "--help"])
    if rc != 0:
        fail(f"kvd --help exited {rc}: {err}")
        return 1
    head, _, rest = out.partition("Each tenant is a [tenant NAME] section, with:\n")
    if not rest:
        fail("kvd --help no longer lists the tenant keys after "
             "'Each tenant is a [tenant NAME] section, with:'")
    options = {}  # name -> (reloadable, default, lead, text)
    for lead, text in help_entries(head):
        m = re.match(r"^(?:-h, )?--([a-z][a-z0-9-]*)(\[=[A-Z|]+\]| [A-Z|%]+)?( \*)?$", lead)
        if not m:
            continue
        options[m.group(1)] = (bool(m.group(3)), default_of(text), lead, text)
    tenant_keys = {}  # name -> (default, lead, text)
    for lead, text in help_entries(rest):
        m = re.match(r"^([a-z][a-z-]*) = \S+$", lead)
        if not m:
            break
        tenant_keys[m.group(1)] = (default_of(text), lead, text)
    for must in ("pool-size", "budget", "config", "check-config", "help", "version"):
        if must not in options:
            fail(f"parsing kvd --help found no --{must}: options {sorted(options)}")
    for must in ("min", "max", "weight"):
        if must not in tenant_keys:
            fail(f"parsing kvd --help found no tenant key {must}: {sorted(tenant_keys)}")
    if failures:
        return 1
    print(f"kvd --help: {len(options)} options, {len(tenant_keys)} tenant keys")

    # Which options are keys of [kvd]: kvd's own parser says.
    with tempfile.TemporaryDirectory() as tmp:
        conf = os.path.join(tmp, "all.conf")
        with open(conf, "w") as f:
            f.write("[kvd]\n" + "".join(f"{name} = x\n" for name in options))
        rc, out, err = run([kvd, "--check-config", conf])
    not_keys = set(re.findall(r"unknown key '([a-z0-9-]+)' in \[kvd\]", out + err))
    keys = {n: v for n, v in options.items() if n not in not_keys}
    if rc != 2 or not not_keys or "pool-size" not in keys:
        fail(f"kvd --check-config on every option as a key: exit {rc}, unknown keys "
             f"{sorted(not_keys)}:\n{out}{err}")
        return 1
    print(f"keys of [kvd]: {len(keys)}; command line only: {', '.join(sorted(not_keys))}")

    # ---- kvd.8 ----
    scd = section(read(kvd8), "kvd.8.scd", "OPTIONS")
    doc = entries(scd, r"^\*(?:-h\*, \*)?--([a-z][a-z0-9-]*)\*")
    for name, (reloadable, default, _, _) in options.items():
        if name not in doc:
            fail(f"kvd.8.scd: no entry for --{name}")
            continue
        term, body = doc[name]
        if reloadable != ("(reloadable)" in term):
            fail(f"kvd.8.scd: --{name} is {'' if reloadable else 'not '}reloadable "
                 f"(--help), the page says otherwise: {term!r}")
        check_default("kvd.8.scd", f"--{name}", body, default)
    for name in doc:
        if name not in options:
            fail(f"kvd.8.scd: an entry for --{name}, which kvd --help does not list")

    # ---- kvd.conf.5 ----
    scd = read(kvdconf5)
    kvd_part = section(scd, "kvd.conf.5.scd", "THE [kvd] SECTION")
    tenant_part = section(scd, "kvd.conf.5.scd", "TENANT SECTIONS")
    doc = entries(kvd_part, r"^\*([a-z][a-z0-9-]*)\* = ")
    for name, (reloadable, default, _, _) in keys.items():
        if name not in doc:
            fail(f"kvd.conf.5.scd: no entry for the [kvd] key {name}")
            continue
        term, body = doc[name]
        if reloadable != ("(reloadable)" in term):
            fail(f"kvd.conf.5.scd: {name} is {'' if reloadable else 'not '}reloadable "
                 f"(--help), the page says otherwise: {term!r}")
        check_default("kvd.conf.5.scd", name, body, default)
    for name in doc:
        if name not in keys:
            fail(f"kvd.conf.5.scd: an entry for {name}, which is not a key of [kvd]")
    doc = entries(tenant_part, r"^\*([a-z][a-z0-9-]*)\* = ")
    for name, (default, _, _) in tenant_keys.items():
        if name not in doc:
            fail(f"kvd.conf.5.scd: no entry for the tenant key {name}")
            continue
        check_default("kvd.conf.5.scd", f"[tenant] {name}", doc[name][1], default)
    for name in doc:
        if name not in tenant_keys:
            fail(f"kvd.conf.5.scd: an entry for the tenant key {name}, which kvd --help "
                 "does not list")

    # ---- kvdctl.8 ----
    rc, out, err = run([kvdctl, "--help"])
    rc2, score_out, err2 = run([kvdctl, "score", "--help"])
    if rc != 0 or rc2 != 0:
        fail(f"kvdctl --help exited {rc}, kvdctl score --help {rc2}: {err}{err2}")
        return 1
    commands_part = out.partition("Commands:\n")[2].partition("\n\n")[0]
    command_entries = help_entries(commands_part)
    commands = []
    for lead, _ in command_entries:
        m = re.match(r"^([a-z]+)(?: ([a-z]+)\b)?", lead)
        if m:
            commands.append(" ".join(w for w in m.groups() if w))
    options_part = out.partition("Options:\n")[2].partition("\n\n")[0]
    ctl_options = set(re.findall(r"^  (?:-h )?--([a-z][a-z0-9-]*)", out + score_out, re.M))
    if len(commands) < 5 or "budget get" not in commands or "score" not in commands:
        fail(f"parsing kvdctl --help found the commands {commands}")
        return 1
    print(f"kvdctl --help: commands {', '.join(commands)}; {len(ctl_options)} options")
    scd = read(kvdctl8)
    doc_commands = entries(section(scd, "kvdctl.8.scd", "COMMANDS"),
                           r"^\*([a-z]+(?: [a-z]+)?)\*")
    for cmd in commands:
        if cmd not in doc_commands:
            fail(f"kvdctl.8.scd: no entry for the command '{cmd}'")
    for cmd in doc_commands:
        if cmd not in commands:
            fail(f"kvdctl.8.scd: an entry for '{cmd}', which kvdctl --help does not list")
    # The SYNOPSIS names every command with every option `kvdctl --help` gives it.
    synopsis = [line for line in section(scd, "kvdctl.8.scd", "SYNOPSIS").splitlines()
                if line.startswith("*kvdctl*")]
    for lead, text in command_entries:
        words = re.match(r"^([a-z]+)(?: ([a-z]+)\b)?", lead)
        if not words:
            continue
        marks = [f"*{w}*" for w in words.groups() if w]
        lines = [line for line in synopsis if all(m in line for m in marks)]
        if not lines:
            fail(f"kvdctl.8.scd: SYNOPSIS has no line for '{' '.join(w for w in words.groups() if w)}'")
            continue
        for opt in re.findall(r"(?:^|\[)--([a-z][a-z0-9-]*)", lead + " " + text) + \
                re.findall(r" \[?--([a-z][a-z0-9-]*)", lead):
            if not any(f"*--{opt}*" in line for line in lines):
                fail(f"kvdctl.8.scd: SYNOPSIS of '{' '.join(w for w in words.groups() if w)}' "
                     f"lacks --{opt}")
    doc_options = set(re.findall(r"\*--([a-z][a-z0-9-]*)\*", scd))
    for opt in sorted(ctl_options - doc_options):
        fail(f"kvdctl.8.scd: --{opt} (kvdctl --help or kvdctl score --help) is not documented")
    for opt in sorted(doc_options - ctl_options):
        fail(f"kvdctl.8.scd: names --{opt}, which neither kvdctl --help nor kvdctl score "
             "--help lists")

    # ---- libkvd.3 ----
    header = read(kvd_h)
    functions = re.findall(r"^KVD_EXPORT\b[^(]*?\b(kvd_[a-z0-9_]+)\s*\(", header, re.M)
    functions += re.findall(r"^static inline void (kvd_[a-z0-9_]+)\s*\(", header, re.M)
    if len(functions) < 20:
        fail(f"kvd.h: found only the functions {functions}")
    scd = read(libkvd3)
    for fn in functions:
        if not re.search(rf"\*{fn}\*", scd):
            fail(f"libkvd.3.scd: does not name {fn}, which kvd/kvd.h exports")
    print(f"kvd.h: {len(functions)} functions")

    # ---- reference.md ----
    try:
        text = scrape(kvd)
    except RuntimeError as e:
        fail(str(e))
        return 1
    families = metric_families(text)
    if not any(f[0] == "kvd_tenant_used_bytes" for f in families):
        fail(f"the scrape has no per-tenant families: {[f[0] for f in families]}")
    generated = reference(options, keys, tenant_keys, command_entries,
                          help_entries(options_part), families)
    if write:
        with open(reference_md, "w", encoding="utf-8") as f:
            f.write(generated)
        print(f"wrote {reference_md}")
    else:
        try:
            current = read(reference_md)
        except FileNotFoundError:
            current = ""
        if current != generated:
            sys.stderr.writelines(difflib.unified_diff(
                current.splitlines(True), generated.splitlines(True),
                reference_md, "generated"))
            fail(f"{reference_md} differs from what the code says: run tools/docs-reference")
    print(f"reference: {len(options)} options, {len(families)} metric families")

    if failures:
        print(f"{len(failures)} mismatches between the man pages and the code", file=sys.stderr)
        return 1
    print("the man pages match the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
