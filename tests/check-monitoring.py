#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""
Checks the monitoring files shipped in tools/monitoring against promtool and a live kvd:

kvd-alerts.yml        promtool check rules: the rules load; promtool test rules
                      kvd-alerts.test.yml: each alert fires on the series that should fire
                      it and not on the others;
kvd-dashboard.json    valid JSON; every panel's queries parse as PromQL (promtool check
                      rules on them as recording rules, Grafana's $variables given values);
both                  every kvd_ metric they use is a family (or a histogram's series) of the
                      /metrics scrape of a kvd started here.

promtool comes with Debian's prometheus package (tools/setup installs it); without it the
test skips (exit 77), or fails where CI=true, where it must run.

Usage: check-monitoring.py KVD MONITORING_DIR
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
from scrape import metric_families, scrape  # noqa: E402

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr)


def promtool(promtool_path, args, cwd):
    p = subprocess.run([promtool_path] + args, capture_output=True, text=True, timeout=120,
                       cwd=cwd)
    if p.returncode != 0:
        fail(f"promtool {' '.join(args)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    return p.stdout


def grafana_to_promql(expr):
    """A dashboard query as Prometheus sees it once Grafana filled in its variables."""
    return expr.replace("$__rate_interval", "5m").replace("$instance", ".*")


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().split("Usage: ")[1], file=sys.stderr)
        return 2
    kvd, mon = sys.argv[1], os.path.abspath(sys.argv[2])
    tool = shutil.which("promtool") or ("/usr/bin/promtool" if os.access("/usr/bin/promtool", os.X_OK) else None)
    if not tool:
        print("promtool not found (Debian's prometheus package)",
              file=sys.stderr if os.environ.get("CI") == "true" else sys.stdout)
        return 1 if os.environ.get("CI") == "true" else 77

    rules_text = open(os.path.join(mon, "kvd-alerts.yml"), encoding="utf-8").read()
    print(promtool(tool, ["check", "rules", "kvd-alerts.yml"], mon).strip())
    print(promtool(tool, ["test", "rules", "kvd-alerts.test.yml"], mon).strip())

    with open(os.path.join(mon, "kvd-dashboard.json"), encoding="utf-8") as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    if len(exprs) < 10:
        fail(f"the dashboard has only {len(exprs)} queries")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dashboard-queries.yml")
        with open(path, "w") as f:
            f.write("groups:\n  - name: dashboard\n    rules:\n")
            for i, e in enumerate(exprs):
                f.write(f"      - record: kvd_dashboard_query_{i}\n")
                f.write(f"        expr: {json.dumps(grafana_to_promql(e))}\n")
        promtool(tool, ["check", "rules", path], tmp)
    print(f"dashboard: {len(dashboard['panels'])} panels, {len(exprs)} queries parse")

    try:
        families = {name: kind for name, kind, _, _ in metric_families(scrape(kvd))}
    except RuntimeError as e:
        fail(str(e))
        return 1
    used = set(re.findall(r"\bkvd_[a-z0-9_]+", rules_text + "\n".join(exprs)))
    used = {u for u in used if not u.startswith("kvd_dashboard_query_")}
    for name in sorted(used):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name in families or (base != name and families.get(base) == "histogram"):
            continue
        fail(f"{name} is used by the monitoring files, but a live kvd has no such metric")
    print(f"metrics used: {len(used)}, all in the scrape of {len(families)} families"
          if not failures else "")
    if failures:
        print(f"{len(failures)} problems with tools/monitoring", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
