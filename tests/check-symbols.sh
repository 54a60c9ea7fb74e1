#!/usr/bin/env bash
# libkvd's ABI: the library exports exactly the functions the public header declares, each
# versioned in libkvd.sym by the node that lists it, and nothing else.
# Usage: check-symbols.sh kvd.h libkvd.sym libkvd.so
set -euo pipefail

header=$1 map=$2 lib=$3

declared=$(grep '^KVD_EXPORT' "$header" | grep -o '^[^(]*(' | sed 's/.*[^a-z0-9_]\(kvd_[a-z0-9_]*\)($/\1/' | sort -u)
mapped=$(sed -n 's/^[[:space:]]*\(kvd_[a-z0-9_]*\);/\1/p' "$map" | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '$2 == "T" { print $3 }' | sort -u)

status=0
if [ "$declared" != "$mapped" ]; then
	echo "header and version script differ:" >&2
	diff <(echo "$declared") <(echo "$mapped") >&2 || true
	status=1
fi
if [ "$(echo "$exported" | sed 's/@.*//' | sort -u)" != "$mapped" ]; then
	echo "exported symbols and version script differ:" >&2
	diff <(echo "$exported" | sed 's/@.*//' | sort -u) <(echo "$mapped") >&2 || true
	status=1
fi
# Each symbol carries the version of the node that lists it ("name@@KVD_1.1").
versioned=$(awk '/^KVD_[0-9.]+ [{]/ { node = $1 }
	/^[[:space:]]*kvd_[a-z0-9_]*;/ { gsub(/[[:space:];]/, ""); print $0 "@@" node }' "$map" | sort -u)
if [ "$exported" != "$versioned" ]; then
	echo "exported symbol versions and the version script's nodes differ:" >&2
	diff <(echo "$exported") <(echo "$versioned") >&2 || true
	status=1
fi
[ "$status" -eq 0 ] && echo "$(echo "$mapped" | wc -l) symbols, all declared, mapped and versioned"
exit "$status"
