#!/bin/sh
# SPDX-License-Identifier: MIT
#
# A short `kvd-soak` against a daemon of its own: starts $KVD_DAEMON on a socket in
# a temporary directory with a small pool and budget, runs $KVD_SOAK with eviction,
# stops the daemon with SIGTERM and checks that both exit 0 and that the daemon logged
# nothing at error level (its lines carry their priority, as under journald) and no
# sanitizer or valgrind report.
#
# Environment: KVD_DAEMON, KVD_SOAK (set by meson); SOAK_DURATION (seconds, default 5),
# SOAK_SEED (default 1), SOAK_ARGS (more kvd-soak options), SOAK_WRAPPER (a command
# the daemon runs under, e.g. "valgrind --error-exitcode=99 --undef-value-errors=no"),
# SOAK_KEEP (keep the directory, with kvd.log, and print its path); SOAK_TIERS=1 (a host
# tier of 4 MiB that takes sequences idle for 50 ms and a file tier of 16 MiB below it, and
# kvd-soak --tiers).

set -u

daemon=${KVD_DAEMON:?KVD_DAEMON is not set (run the test through meson)}
soak=${KVD_SOAK:?KVD_SOAK is not set (run the test through meson)}
duration=${SOAK_DURATION:-5}
seed=${SOAK_SEED:-1}

dir=$(mktemp -d /tmp/kvd-soak-XXXXXX) || exit 1
tier_args=
soak_tiers=
if [ "${SOAK_TIERS:-}" = 1 ]; then
	tier_args="--host-tier-size 4MiB --tier-idle 50 --file-tier-size 16MiB --file-tier-dir $dir"
	soak_tiers=--tiers
fi
pid=
cleanup() {
	[ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null
	if [ -n "${SOAK_KEEP:-}" ]; then
		echo "soak.sh: kept $dir"
	else
		rm -rf "$dir"
	fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# JOURNAL_STREAM makes the daemon prefix each line with its priority: <3> is an error.
# The admin group is ours, so that the soak may change the budget and the tenants.
JOURNAL_STREAM=soak ${SOAK_WRAPPER:-} "$daemon" --socket "$dir/kvd.sock" --config /dev/null \
	--state-dir "$dir/state" --backend host --pool-size 64MiB --budget 16MiB --chunk-size 256KiB \
	--grant-wait 200 --admin-group "$(id -g)" $tier_args 2>"$dir/kvd.log" &
pid=$!

# Ready means listening; valgrind takes a while to get there.
i=0
while [ ! -S "$dir/kvd.sock" ]; do
	if ! kill -0 "$pid" 2>/dev/null; then
		echo "soak.sh: the daemon exited during start-up:" >&2
		cat "$dir/kvd.log" >&2
		pid=
		exit 1
	fi
	i=$((i + 1))
	if [ "$i" -gt 6000 ]; then
		echo "soak.sh: the daemon did not listen within 60 s" >&2
		exit 1
	fi
	sleep 0.01
done

# shellcheck disable=SC2086 # SOAK_ARGS is a word list
"$soak" --socket "$dir/kvd.sock" --duration "$duration" --evict $soak_tiers --seed "$seed" ${SOAK_ARGS:-}
bench_rc=$?

kill -TERM "$pid" 2>/dev/null
wait "$pid"
daemon_rc=$?
pid=

fail=0
if [ "$bench_rc" -ne 0 ]; then
	echo "soak.sh: kvd-soak exited $bench_rc" >&2
	fail=1
fi
if [ "$daemon_rc" -ne 0 ]; then
	echo "soak.sh: the daemon exited $daemon_rc" >&2
	fail=1
fi
# Priorities 0..3 (emerg..err), and what ASan, UBSan, LSan and valgrind print (but
# valgrind's closing "ERROR SUMMARY: 0 errors").
if grep -E '^<[0-3]>|ERROR|runtime error|Sanitizer|==[0-9]+== (Invalid|Conditional|Syscall param|Mismatched|Source and destination|Use of uninit|Jump to|Process terminating)|definitely lost: [1-9]' \
	"$dir/kvd.log" | grep -v '== ERROR SUMMARY: 0 errors' >&2; then
	echo "soak.sh: the daemon's log has errors (above)" >&2
	fail=1
fi
if [ "$fail" -ne 0 ]; then
	echo "soak.sh: the daemon's log:" >&2
	tail -n 200 "$dir/kvd.log" >&2
	exit 1
fi
echo "soak.sh: OK ($(grep -c . "$dir/kvd.log") log lines, none at error level)"
