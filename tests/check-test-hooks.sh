#!/bin/sh
# The test hooks (KVD_TEST_* environment variables) are in kvd and libkvd exactly when the
# build asked for them (-Dtest_hooks=true): a build that ships has none.
#   check-test-hooks.sh true|false KVD LIBKVD
set -eu

want=$1
shift
for bin in "$@"; do
	n=$(grep -c -a 'KVD_TEST_' "$bin" || true)
	if [ "$want" = true ] && [ "$n" -eq 0 ]; then
		echo "FAIL: $bin: built with test hooks, but has no KVD_TEST_ string" >&2
		exit 1
	fi
	if [ "$want" = false ] && [ "$n" -ne 0 ]; then
		echo "FAIL: $bin: built without test hooks, but names KVD_TEST_:" >&2
		grep -a -o 'KVD_TEST_[A-Z_]*' "$bin" | sort -u >&2
		exit 1
	fi
	echo "$bin: test hooks $([ "$n" -eq 0 ] && echo absent || echo present), as asked"
done
