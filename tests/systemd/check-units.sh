#!/usr/bin/env bash
# Checks systemd/ the way systemd reads it, without systemd as PID 1:
#  - systemd-analyze verify on the units, failing on ANY output: verify exits 0 on unknown
#    keys and typos, and only says so (docs/architecture.md §8);
#  - systemd-analyze security --offline=yes on kvd.service: the overall exposure at most
#    THRESHOLD (tenths: 6 is "0.6"), and no failed check but the ones the unit leaves out
#    on purpose, so that dropping any hardening line fails here with its name;
#  - the same for kvd.service with the metrics drop-in (DROPIN) applied: verify silent, the
#    exposure at most DROPIN_THRESHOLD, and only the network checks it opens on purpose
#    failing besides;
#  - the units meson installs have every @placeholder@ filled in;
#  - kvd.service admits the device classes the NVIDIA drivers register;
#  - systemd-sysusers and systemd-tmpfiles --root=TMP create the users, groups and
#    directories.
# Usage: check-units.sh TEST_UNIT_DIR INSTALL_UNIT_DIR SYSUSERS_CONF TMPFILES_CONF THRESHOLD
#                       DROPIN DROPIN_THRESHOLD
# TEST_UNIT_DIR holds the units generated with ExecStart= pointing at the built daemon, so
# that verify can check the binary; INSTALL_UNIT_DIR the ones `meson install` installs.
set -euo pipefail

if [ "$#" -ne 7 ]; then
	echo "usage: $0 TEST_UNIT_DIR INSTALL_UNIT_DIR SYSUSERS_CONF TMPFILES_CONF THRESHOLD" \
		"DROPIN DROPIN_THRESHOLD" >&2
	exit 2
fi
# sysusers and tmpfiles read a relative path under --root: make them absolute.
units=$(realpath "$1") installed=$(realpath "$2") sysusers=$(realpath "$3")
tmpfiles=$(realpath "$4") threshold=$5 dropin=$(realpath "$6") dropin_threshold=$7

for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
	if ! command -v "$tool" >/dev/null; then
		echo "SKIP: $tool is not installed"
		exit 77
	fi
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() {
	echo "FAIL: $*" >&2
	fail=1
}

# verify also runs man(1) on every man: page of Documentation=, and says so when one is
# missing. The pages of this build are not installed: KVD_MAN_PAGES (meson sets it, a
# colon-separated list of built pages) puts them where MANPATH shows them to man. Without
# built pages or man(1), verify is told not to look.
verify_opts=()
if [ -n "${KVD_MAN_PAGES:-}" ] && command -v man >/dev/null; then
	IFS=: read -ra pages <<<"$KVD_MAN_PAGES"
	for page in "${pages[@]}"; do
		mkdir -p "$tmp/man/man${page##*.}"
		cp "$page" "$tmp/man/man${page##*.}/"
	done
	export MANPATH=$tmp/man
	echo "verify: man pages from this build: ${pages[*]##*/}"
else
	verify_opts=(--man=no)
	if [ -n "${KVD_MAN_PAGES:-}" ]; then
		echo "verify: --man=no (no man(1) to look the pages up with)"
	else
		echo "verify: --man=no (no man pages built)"
	fi
fi

# 1. verify: silent, and exit 0. It reads units relative to the working directory, and the
# two units must be checked together (kvd.service requires kvd.socket).
out=$(cd "$units" && systemd-analyze verify "${verify_opts[@]}" ./kvd.socket ./kvd.service 2>&1) ||
	bad "verify exited $?"
if [ -n "$out" ]; then
	bad "systemd-analyze verify said something:"
	printf '%s\n' "$out" >&2
else
	echo "verify: no output"
fi

# verify must still catch what we rely on it to catch: a typo in a key, here.
sed 's/^WatchdogSec=/WatchdogSecs=/' "$units/kvd.service" >"$tmp/kvd.service"
cp "$units/kvd.socket" "$tmp/kvd.socket"
out=$(cd "$tmp" && systemd-analyze verify "${verify_opts[@]}" ./kvd.socket ./kvd.service 2>&1) ||
	true
if ! grep -q "Unknown key.*WatchdogSecs" <<<"$out"; then
	bad "verify did not report a misspelt key (its output: $out)"
fi
rm -f "$tmp/kvd.service" "$tmp/kvd.socket"

# 2. security. The checks kvd.service fails on purpose (a GPU daemon needs them so, see the
# comments in kvd.service.in); any other failed check is hardening that went missing.
allowed=(
	'RootDirectory=/RootImage='          # runs from the host's root: needs libcuda
	'PrivateDevices='                    # its /dev has no /dev/nvidia*
	'DeviceAllow='                       # the NVIDIA classes (and char-rtc, ProtectClock's)
	'MemoryDenyWriteExecute='            # libcuda may JIT; to be tested on a GPU host
	'RestrictAddressFamilies=~AF_UNIX'   # clients connect over AF_UNIX
	'ProcSubset='                        # would hide /proc/driver/nvidia
	'PrivateUsers='                      # device node ownership
)
# security UNIT THRESHOLD EXTRA...: the failed checks of UNIT are allowed ones or EXTRA,
# and its exposure is at most THRESHOLD.
security() {
	local unit=$1 limit=$2 report line name ok a overall
	shift 2
	report=$(systemd-analyze security --offline=yes "$unit" 2>&1) || {
		bad "systemd-analyze security failed on $unit"
		printf '%s\n' "$report" >&2
	}
	while IFS= read -r line; do
		name=$(awk '{print $2}' <<<"$line")
		ok=0
		for a in "${allowed[@]}" "$@"; do
			[ "$name" = "$a" ] && ok=1
		done
		[ "$ok" = 1 ] || bad "security of $unit: $line"
	done < <(grep '^✗' <<<"$report" || true)
	overall=$(grep -o 'Overall exposure level for kvd.service: [0-9.]* [A-Z]*' <<<"$report" || true)
	echo "security of ${unit#"$tmp"/}: ${overall:-no overall exposure level}"
	[ -n "$overall" ] || bad "security printed no overall exposure level for $unit"
	if ! systemd-analyze security --offline=yes --threshold="$limit" "$unit" >/dev/null 2>&1; then
		bad "security: exposure of $unit above the threshold $limit (tenths): $overall"
	fi
}
security "$units/kvd.service" "$threshold"

# 2b. With the metrics drop-in: its lines appended to the unit, as systemd merges a
# drop-in. It opens the network, and nothing else.
mkdir -p "$tmp/dropin"
cp "$units/kvd.socket" "$tmp/dropin/"
cat "$units/kvd.service" "$dropin" >"$tmp/dropin/kvd.service"
out=$(cd "$tmp/dropin" && systemd-analyze verify "${verify_opts[@]}" ./kvd.socket ./kvd.service 2>&1) ||
	bad "verify with the drop-in exited $?"
[ -z "$out" ] || bad "systemd-analyze verify with the drop-in said something: $out"
security "$tmp/dropin/kvd.service" "$dropin_threshold" 'RestrictAddressFamilies=~AF_(INET|INET6)' \
	'PrivateNetwork=' 'IPAddressDeny='

# 3. The installed units: no placeholder left, ExecStart= an absolute path to kvd.
for f in "$installed/kvd.service" "$installed/kvd.socket"; do
	[ -f "$f" ] || { bad "$f was not generated"; continue; }
	if grep -n '@[A-Za-z_]*@' "$f" >&2; then
		bad "$f has a placeholder left"
	fi
done
grep -q '^ExecStart=/[^ ]*/kvd\b' "$installed/kvd.service" ||
	bad "the installed kvd.service has no ExecStart=/.../kvd"

# 4. GPU device access: every character device class the NVIDIA drivers register in
# /proc/devices (kernel-open/nvidia*/ of the open GPU kernel modules: nvidia-frontend in
# older drivers, nvidia and nvidiactl in current ones for major 195; nvidia-uvm; the
# capability classes) is admitted by a DeviceAllow= of the unit, read-write but for the
# read-only nvidia-caps; and the unit is ordered after nvidia-persistenced.
allows=$(sed -n 's/^DeviceAllow=char-//p' "$units/kvd.service")
for want in nvidia-frontend:rw nvidia:rw nvidiactl:rw nvidia-uvm:rw nvidia-caps:r \
	nvidia-caps-imex-channels:rw; do
	class=${want%%:*} mode=${want#*:} got=
	while read -r pattern access; do
		# shellcheck disable=SC2053 # systemd matches the class as a glob
		[[ $class == $pattern ]] && got=$access
	done <<<"$allows"
	[ "$got" = "$mode" ] || bad "kvd.service admits char-$class with '${got:-nothing}', want '$mode'"
done
grep -q '^After=nvidia-persistenced.service$' "$units/kvd.service" ||
	bad "kvd.service is not ordered after nvidia-persistenced.service"
echo "devices: $(tr '\n' ' ' <<<"$allows")"

# 5. sysusers and tmpfiles into an empty root.
root=$tmp/root
mkdir -p "$root/etc"
if ! out=$(systemd-sysusers --root="$root" "$sysusers" 2>&1) || [ ! -f "$root/etc/group" ]; then
	bad "systemd-sysusers failed: $out"
	exit 1
fi
user=$(grep '^kvd:' "$root/etc/passwd" || true)
[ -n "$user" ] || bad "sysusers created no user kvd"
[ "$(cut -d: -f6 <<<"$user")" = /var/lib/kvd ] || bad "kvd's home is not /var/lib/kvd: $user"
case $(cut -d: -f7 <<<"$user") in
*nologin | /bin/false) ;;
*) bad "kvd has a login shell: $user" ;;
esac
gid() { awk -F: -v g="$1" '$1 == g { print $3 }' "$root/etc/group"; }
for g in kvd kvd-clients kvd-admin video; do
	[ -n "$(gid "$g")" ] || bad "sysusers created no group $g"
done
[ "$(cut -d: -f4 <<<"$user")" = "$(gid kvd)" ] || bad "kvd's primary group is not kvd"
awk -F: '$1 == "video" { n = split($4, m, ","); for (i = 1; i <= n; i++) if (m[i] == "kvd") f = 1 }
	END { exit !f }' "$root/etc/group" || bad "kvd is not a member of video"
groups=$(grep -E '^(kvd|kvd-clients|kvd-admin|video):' "$root/etc/group" | tr '\n' ' ')
echo "sysusers: $(cut -d: -f1,3,4,6,7 <<<"$user"); groups $groups"

out=$(systemd-tmpfiles --root="$root" --create "$tmpfiles" 2>&1) ||
	bad "systemd-tmpfiles failed: $out"
check_dir() { # path mode uid gid
	local got
	got=$(stat -c '%a %u %g' "$root$1" 2>/dev/null) || { bad "tmpfiles did not create $1"; return; }
	[ "$got" = "$2 $3 $4" ] || bad "$1 is '$got' (mode uid gid), want '$2 $3 $4'"
	echo "tmpfiles: $1 $got"
}
check_dir /run/kvd 755 0 0
check_dir /etc/kvd 2775 0 "$(gid kvd-admin)"

exit "$fail"
