#!/bin/sh
# SPDX-License-Identifier: MIT
#
# quality-quick.sh SETTING BUDGETS: `kvd-quality --quick` in one setting (in-window
# or query-agnostic) at BUDGETS (percent, comma-separated) with the trained kvd-lm model,
# through a daemon the harness starts itself: every policy must run and appear in
# results.csv, no cell may be left over its budget, the daemon's full cache must answer as
# the engine's private one (the harness fails otherwise), and the full cache must be at
# least as accurate as THRESHOLD below.
# The threshold is on the full cache alone, never on an eviction policy: it checks that
# the model, the tasks and the scoring are wired right, not what any policy achieves.
#
# Environment: KVD_DAEMON, KVD_QUALITY, KVD_LM_MODEL, KVD_LM_HAYSTACK (set by meson);
# QUALITY_KEEP (keep the output directory and print its path).

set -u

# The --quick subset is niah at 1024 tokens, here one sample a cell (the test's time
# budget: a sample is 40 runs of the engine). The trained model answered 16 of 16 tuning
# samples of it at its last checkpoint (eval/kvd-lm/README.md, "Training") and answers the
# first reporting sample right; 0.8 leaves room for a hard sample or two when more samples
# run (`kvd-quality --quick` runs 6), and none for a broken pipeline.
THRESHOLD=0.8

daemon=${KVD_DAEMON:?KVD_DAEMON is not set (run the test through meson)}
quality=${KVD_QUALITY:?KVD_QUALITY is not set (run the test through meson)}
model=${KVD_LM_MODEL:?KVD_LM_MODEL is not set (run the test through meson)}
haystack=${KVD_LM_HAYSTACK:?KVD_LM_HAYSTACK is not set (run the test through meson)}
setting=${1:?usage: quality-quick.sh SETTING BUDGETS}
budgets=${2:?usage: quality-quick.sh SETTING BUDGETS}

if [ ! -f "$model" ]; then
	echo "quality-quick.sh: no trained model at $model" >&2
	exit 1
fi

out=$(mktemp -d /tmp/kvd-quality-test-XXXXXX) || exit 1
cleanup() {
	if [ -n "${QUALITY_KEEP:-}" ]; then
		echo "quality-quick.sh: kept $out"
	else
		rm -rf "$out"
	fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

if ! "$quality" --quick --samples 1 --settings "$setting" --budgets "$budgets" \
	--model "$model" --haystack "$haystack" --kvd "$daemon" --out "$out"; then
	echo "quality-quick.sh: kvd-quality --quick failed (daemon log: $out/kvd.log)" >&2
	[ -f "$out/kvd.log" ] && cat "$out/kvd.log" >&2
	exit 1
fi

csv=$out/results.csv
status=0
for p in full streamingllm h2o snapkv pyramidkv adakv tova knorm keydiff expected_attention \
	restkv laprox kvd kvd-mi indexmem kvd+moments kvd-mi+moments kvd+moments-mass \
	kvd+moments-bounded indexmem+latent kvd+latent kvd+recall indexmem+recall; do
	if ! awk -F, -v p="$p" 'NR > 1 && $1 == p && $6 > 0 { found = 1 } END { exit !found }' "$csv"; then
		echo "quality-quick.sh: policy $p has no sample in $csv" >&2
		status=1
	fi
done

# over_budget (column 11) must be 0 everywhere.
if ! awk -F, 'NR > 1 && $11 != 0 { bad = 1; print "over budget: " $0 } END { exit bad }' "$csv" >&2; then
	status=1
fi

# Full-cache accuracy, every full row pooled.
if ! awk -F, -v t="$THRESHOLD" '
	NR > 1 && $1 == "full" { n += $6; c += $7 }
	END {
		if (n == 0) { print "quality-quick.sh: no full-cache sample"; exit 1 }
		printf "quality-quick.sh: full-cache accuracy %.3f (%d/%d), threshold %s\n", c / n, c, n, t
		exit !(c / n >= t)
	}' "$csv"; then
	echo "quality-quick.sh: the full cache is below the threshold" >&2
	status=1
fi
exit $status
