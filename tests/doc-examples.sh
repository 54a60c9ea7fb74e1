#!/usr/bin/env bash
# Compiles and links every ```c block of a document (docs/engines.md) against the public
# header and the built libkvd, as a user would, so that the examples cannot rot.
# Usage: doc-examples.sh DOC.md INCLUDE_DIR ABI_INCLUDE_DIR LIBKVD
# (kvd/kvd.h is in the first directory, kvd/kvd-abi.h in the second, as in the source tree;
# installed, both are in one.)
set -euo pipefail

if [ "$#" -ne 4 ]; then
	echo "usage: $0 DOC.md INCLUDE_DIR ABI_INCLUDE_DIR LIBKVD" >&2
	exit 2
fi
doc=$1
include=$2
abi_include=$3
libkvd=$4
cc=${CC:-cc}

for f in "$doc" "$libkvd"; do
	[ -f "$f" ] || { echo "doc-examples: $f: no such file" >&2; exit 1; }
done
[ -f "$include/kvd/kvd.h" ] || { echo "doc-examples: $include/kvd/kvd.h: no such file" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One file per block, named after the line the block starts on, so that a failure
# points at the right place. Only blocks opened with exactly ```c are examples.
awk -v dir="$tmp" '
	!inside && /^```c[ \t]*$/ { inside = 1; n++; file = sprintf("%s/line-%d.c", dir, NR + 1); next }
	inside && /^```[ \t]*$/ { inside = 0; close(file); next }
	inside { print > file }
	END { if (inside) { print "doc-examples: unterminated ```c block" > "/dev/stderr"; exit 1 } }
' "$doc"

shopt -s nullglob
examples=("$tmp"/line-*.c)
if [ "${#examples[@]}" -eq 0 ]; then
	echo "doc-examples: no \`\`\`c block in $doc" >&2
	exit 1
fi

failed=0
for src in "${examples[@]}"; do
	name=$(basename "$src" .c)
	where="$doc:${name#line-}"
	# $cc and $CFLAGS may hold several words (a launcher, sanitizer flags).
	# shellcheck disable=SC2086
	if $cc ${CFLAGS:-} -std=c99 -Wall -Wextra -pedantic -Werror -I"$include" -I"$abi_include" "$src" "$libkvd" \
		-o "$tmp/$name" 2>"$tmp/$name.log"; then
		echo "ok: the block at $where"
	else
		echo "FAIL: the block at $where:" >&2
		cat "$tmp/$name.log" >&2
		failed=1
	fi
done
exit "$failed"
