#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# Several kvd-lm processes of different tenants share one kvd budget, the way engines share
# a node: each tenant's process answers its own task samples one after another, all tenants
# at once, while the daemon's pressure rounds hold the budget. Two runs of the same samples:
#
#   global   one node budget, no caps: pressure rounds rank every tenant's tokens together
#   static   the same budget split into equal per-tenant caps (max = budget / tenants)
#
# and a third without a daemon (the engine's private full cache) as the reference. Prints a
# table of accuracy per tenant and writes DIR/results.csv (mode, run, tenant, task, length,
# sample, right, answer, output) and DIR/table.md.
#
# Which tokens a round takes depends on what the other tenants hold at that moment, so the
# figures move from run to run: --runs repeats the two daemon modes and the table gives the
# spread. This is a scenario, not a test.
#
# Needs a built tree (build/ by default) and python3 (for the task prompts: tasks.py).
set -euo pipefail

usage() {
	cat <<EOF
Usage: eval/quality/multi-tenant.sh [OPTIONS]

Runs kvd-lm processes of several tenants at once against one kvd whose budget is a
percentage of what they need, with the budget ranked globally and then split statically,
and prints the accuracy per tenant next to the full cache's.

Options:
  --tenants LIST   TASK:LENGTH per tenant, 2..4 of them
                   (default: niah:1024,multikey:2048,multikey:4096)
  --samples N      Samples per tenant, 1..1000 (default: 10), from the reporting seeds
  --percent P      Budget, percent of the tenants' full KV together, 1..100 (default: 25)
  --runs N         Runs of each daemon mode, 1..20 (default: 1); the table gives their
                   mean and range
  --policy P       The tenants' eviction policy (kvd.conf(5); default: kvd)
  --build DIR      Build tree with daemon/kvd and eval/kvd-lm/kvd-lm (default: build)
  --model FILE     Weights (default: eval/kvd-lm/models/kvd-lm-base.kvdlm)
  --out DIR        Output directory (default: a new one under /tmp, printed)
  -h, --help       Show this help
EOF
}

cd "$(dirname "$0")/../.."

tenants=niah:1024,multikey:2048,multikey:4096
samples=10
percent=25
runs=1
policy=kvd
build=build
model=eval/kvd-lm/models/kvd-lm-base.kvdlm
out=

while [ $# -gt 0 ]; do
	case $1 in
	--tenants) tenants=${2:?--tenants needs a value}; shift 2 ;;
	--samples) samples=${2:?--samples needs a value}; shift 2 ;;
	--percent) percent=${2:?--percent needs a value}; shift 2 ;;
	--runs) runs=${2:?--runs needs a value}; shift 2 ;;
	--policy) policy=${2:?--policy needs a value}; shift 2 ;;
	--build) build=${2:?--build needs a value}; shift 2 ;;
	--model) model=${2:?--model needs a value}; shift 2 ;;
	--out) out=${2:?--out needs a value}; shift 2 ;;
	-h | --help) usage; exit 0 ;;
	*) echo "multi-tenant.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
	esac
done

is_int() { [[ $1 =~ ^[0-9]+$ ]] && [ "$1" -ge "$2" ] && [ "$1" -le "$3" ]; }
is_int "$samples" 1 1000 || { echo "multi-tenant.sh: --samples must be 1..1000" >&2; exit 2; }
is_int "$percent" 1 100 || { echo "multi-tenant.sh: --percent must be 1..100" >&2; exit 2; }
is_int "$runs" 1 20 || { echo "multi-tenant.sh: --runs must be 1..20" >&2; exit 2; }
IFS=, read -r -a specs <<<"$tenants"
[ ${#specs[@]} -ge 2 ] && [ ${#specs[@]} -le 4 ] ||
	{ echo "multi-tenant.sh: --tenants takes 2..4 TASK:LENGTH items" >&2; exit 2; }

kvd=$build/daemon/kvd
kvdlm=$build/eval/kvd-lm/kvd-lm
for f in "$kvd" "$kvdlm" "$model"; do
	[ -e "$f" ] || { echo "multi-tenant.sh: $f is missing (build first: meson setup build && ninja -C build)" >&2; exit 1; }
done

if [ -z "$out" ]; then
	out=$(mktemp -d /tmp/kvd-multi-tenant-XXXXXX)
fi
mkdir -p "$out/prompts"

# The prompts and answers, one file pair per (tenant, sample), LENGTH tokens of the model's
# tokenizer; the seeds are the reporting range's, tenant j's offset by j * 65536 as
# kvd-quality --multi does.
python3 - "$out/prompts" "$samples" "$model" "${specs[@]}" <<'PY' || { echo "multi-tenant.sh: bad --tenants" >&2; exit 2; }
import os, struct, sys
sys.path.insert(0, "eval/kvd-lm")
import tasks, tokenizer
outdir, n, model, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
with open(model, "rb") as f:
    vocab = struct.unpack("<I", f.read(20)[16:20])[0]  # the header's third word
tok = tokenizer.for_model(model, vocab)
hay = tasks.load_haystack()
for j, spec in enumerate(specs):
    task, length = spec.split(":")
    for i in range(n):
        prompt, _q, answer = tasks.make(hay, task, tasks.SEEDS_REPORT.start + j * 65536 + i,
                                        int(length), tok)
        with open(os.path.join(outdir, f"{j}-{i}.txt"), "wb") as f:
            f.write(prompt)
        with open(os.path.join(outdir, f"{j}-{i}.answer"), "w") as f:
            f.write(answer)
PY

# KV bytes of one token of this model: layers x kv heads x head_dim x fp32 x (K and V).
read -r layers kv_heads head_dim < <(od -An -t u4 -j 24 -N 16 "$model" | awk '{print $1, $3, $4}')
need=0
for spec in "${specs[@]}"; do
	need=$((need + ${spec#*:} * layers * kv_heads * head_dim * 4 * 2))
done
budget=$((need * percent / 100))
chunk=$((64 * 1024))
budget=$(((budget + chunk - 1) / chunk * chunk))
cap=$((budget / ${#specs[@]} / chunk * chunk))

daemon_pid=
cleanup() {
	if [ -n "$daemon_pid" ]; then
		kill "$daemon_pid" 2>/dev/null || true
		wait "$daemon_pid" 2>/dev/null || true
	fi
}
trap cleanup EXIT

# One tenant's samples, one kvd-lm process each, in order; RUN names the run ("full",
# "global-1", ...); "$@" are kvd-lm's extra options.
run_tenant() {
	local run=$1 j=$2
	shift 2
	for ((i = 0; i < samples; i++)); do
		"$kvdlm" --model "$model" --tenant "t$j" --prompt-file "$out/prompts/$j-$i.txt" \
			--max-new 48 --threads 1 --stats "$@" >"$out/$run-$j-$i.out" 2>"$out/$run-$j-$i.err" ||
			echo "kvd-lm failed (exit $?)" >"$out/$run-$j-$i.out"
	done
}

# One run of MODE (global or static) numbered R: a fresh daemon, all tenants at once.
run_mode() {
	local mode=$1 run=$1-$2
	local config=$out/$run.conf sock=$out/$run.sock
	local -a pids=()

	for j in "${!specs[@]}"; do
		echo "[tenant t$j]"
		echo "policy = $policy"
		if [ "$mode" = static ]; then
			echo "max = $cap"
		fi
		echo
	done >"$config"
	"$kvd" --backend=host --config "$config" --socket "$sock" --state-dir "$out/$run.state" \
		--budget "$budget" --pool-size $((need + 16 * 1024 * 1024)) --chunk-size $chunk --eviction-floor 0 \
		2>"$out/$run.kvd.log" &
	daemon_pid=$!
	for _ in $(seq 100); do
		[ -S "$sock" ] && break
		sleep 0.05
	done
	[ -S "$sock" ] || { echo "multi-tenant.sh: kvd did not start ($out/$run.kvd.log)" >&2; exit 1; }
	for j in "${!specs[@]}"; do
		run_tenant "$run" "$j" --socket "$sock" &
		pids+=($!)
	done
	wait "${pids[@]}"
	kill "$daemon_pid"
	wait "$daemon_pid" 2>/dev/null || true
	daemon_pid=
}

start=$(date +%s)
echo "multi-tenant.sh: ${#specs[@]} tenants (${specs[*]}), policy $policy, $samples samples each, $runs run(s)," \
	"budget $((budget / 1024)) KiB ($percent% of $((need / 1024)) KiB; static caps $((cap / 1024)) KiB); output in $out"
for j in "${!specs[@]}"; do
	run_tenant full "$j" --no-daemon &
done
wait
# Alternating the modes spreads a slow stretch of the machine over both.
for ((r = 1; r <= runs; r++)); do
	run_mode global "$r"
	run_mode static "$r"
done

python3 - "$out" "$samples" "$runs" "$percent" "$((budget / 1024))" "$policy" "${specs[@]}" <<'PY'
import csv, os, re, sys
sys.path.insert(0, "eval/kvd-lm")
import tasks
out, n, runs, percent, budget_kib, policy, specs = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                    sys.argv[4], sys.argv[5], sys.argv[6],
                                                    sys.argv[7:])
runs_of = {"full": ["full"], "global": [f"global-{r}" for r in range(1, runs + 1)],
           "static": [f"static-{r}" for r in range(1, runs + 1)]}
right = {}  # (run name, tenant) -> samples right
kept = {}   # (run name, tenant) -> resident fractions at the end of each sample


def resident(path):
    """The fraction of the sample's table tokens resident when it ended (kvd-lm --stats)."""
    m = re.search(rb"(\d+) of (\d+) table tokens resident", open(path, "rb").read())
    return int(m[1]) / int(m[2]) if m and int(m[2]) else float("nan")


with open(os.path.join(out, "results.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["mode", "run", "tenant", "task", "length", "sample", "right", "resident",
                "answer", "output"])
    for mode, names in runs_of.items():
        for r, name in enumerate(names):
            for j, spec in enumerate(specs):
                task, length = spec.split(":")
                for i in range(n):
                    prompt = open(os.path.join(out, "prompts", f"{j}-{i}.txt"), "rb").read()
                    answer = open(os.path.join(out, "prompts", f"{j}-{i}.answer")).read()
                    got = open(os.path.join(out, f"{name}-{j}-{i}.out"), "rb").read()
                    ok = tasks.score(prompt, answer, got)
                    res = resident(os.path.join(out, f"{name}-{j}-{i}.err"))
                    right[name, j] = right.get((name, j), 0) + ok
                    kept.setdefault((name, j), []).append(res)
                    w.writerow([mode, r + 1 if mode != "full" else 0, f"t{j}", task, length, i,
                                int(ok), f"{res:.3f}", answer, got.decode(errors="replace")])


def cell(mode, tenants):
    accs = [sum(right[name, j] for j in tenants) / (n * len(tenants)) for name in runs_of[mode]]
    mean = sum(accs) / len(accs)
    text = f"{mean:.2f}" if len(accs) == 1 else f"{mean:.2f} ({min(accs):.2f}-{max(accs):.2f})"
    if mode == "full":
        return text
    res = [x for name in runs_of[mode] for j in tenants for x in kept[name, j]]
    ran = [x for x in res if x == x]  # a sample kvd-lm failed (a refused grow) has none
    text += f", kept {sum(ran) / len(ran):.2f}" if ran else ""
    return text + (f", {len(res) - len(ran)} failed" if len(ran) < len(res) else "")


lines = [f"Budget {budget_kib} KiB: {percent}% of the tenants' full KV together; policy {policy}; "
         f"{n} samples per tenant; {runs} run(s) of each daemon mode"
         + (", mean (range)" if runs > 1 else "")
         + "; kept: the mean fraction of a sample's KV resident when it ended; failed: samples"
         + " whose kvd-lm stopped with an error (a grow refused), counted wrong.", "",
         "| tenant | full cache | one budget, ranked globally | split statically |", "|---|---:|---:|---:|"]
for j, spec in enumerate(specs):
    lines.append(f"| t{j} ({spec.replace(':', '@')}) | "
                 + " | ".join(cell(m, [j]) for m in runs_of) + " |")
lines.append("| all | " + " | ".join(cell(m, range(len(specs))) for m in runs_of) + " |")
table = "\n".join(lines) + "\n"
open(os.path.join(out, "table.md"), "w").write(table)
print(table, end="")
PY
echo "multi-tenant.sh: $(($(date +%s) - start)) s; $out/results.csv, $out/table.md"
