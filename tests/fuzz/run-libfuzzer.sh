#!/bin/sh
# A short, deterministic libFuzzer run for the unit suite:
#   run-libfuzzer.sh FUZZER CORPUS-DIR RUNS ARTIFACT-PREFIX [STRIDE]
# starts from the seed corpus (with STRIDE, every STRIDE-th of its files, in name order: for
# targets whose inputs are a whole daemon each, replaying all of it takes most of the time,
# and the fuzz-replay-* tests replay all of it anyway) with -seed=1 and stops after RUNS
# inputs, or 30 s on a machine
# slower than the one RUNS was sized on (libFuzzer then says how many ran). New inputs go to a
# temporary directory, so that the corpus in the source tree stays as it is and every run
# starts from the same seeds; a crashing input is kept as ARTIFACT-PREFIX{crash,leak,...}-*.
set -eu

fuzzer=$1
corpus=$2
runs=$3
artifacts=$4
stride=${5:-1}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ "$stride" -gt 1 ]; then
	mkdir "$work/seeds"
	find "$corpus" -maxdepth 1 -type f | LC_ALL=C sort | awk -v s="$stride" 'NR % s == 1' |
		while IFS= read -r f; do cp "$f" "$work/seeds/"; done
	corpus=$work/seeds
	mkdir "$work/new"
	set -- "$work/new"
else
	set -- "$work"
fi

# Sanitizer reports must fail the run, the daemon's logs stay out of the test log.
export ASAN_OPTIONS="${ASAN_OPTIONS:-}:detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-}:halt_on_error=1:print_stacktrace=1"
exec "$fuzzer" -seed=1 -runs="$runs" -max_total_time=30 -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
	-close_fd_mask=2 -artifact_prefix="$artifacts" "$1" "$corpus"
