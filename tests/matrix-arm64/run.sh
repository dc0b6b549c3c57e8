#!/bin/bash
# The arm64 matrix (`cargo xtask matrix-arm64`, and on Debian 12's arm64 6.12 in `cargo xtask test`): boots
# Debian's arm64 kernel packages in qemu-system-aarch64 (-M virt -cpu max: emulated, pointer authentication
# and BTI on) over an initramfs of Debian's own arm64 packages, extracted, never installed: Debian 12's libc6,
# python3-minimal, perl, libjemalloc2 and busybox-static (mmdebstrap --variant=extract), and Debian 13's libc6 and
# libjemalloc2 (built with -mbranch-protection=standard). In it (init.sh): memtrace doctor, then fixtures.c, cross-compiled,
# under memtrace with Debian 12's glibc (one thread and four), with Debian 12's jemalloc, with Debian 13's
# jemalloc and glibc, and with Debian 13's glibc, the kernel's single-steps counted by a kprobe on
# arch_uprobe_pre_xol. One line a kernel, and a non-zero exit when any check fails:
# - doctor exits 0 and names the architecture;
# - every run counts the fixture exactly (100 allocations, 50 frees, 50,000 bytes live, all of it held by
#   `main`, whose stack is unwound by DWARF; 4 threads: 20,000-20,008 each, none lost);
# - under either jemalloc, whose malloc and free the probes reach past `bti c`/`cmp`, fewer than 50
#   single-steps (the 150 calls would each take one otherwise), and neither function is named as
#   single-stepped; under glibc, whose malloc starts with `stp x29, x30` (12) or `paciasp` (13), at least
#   its 100 mallocs, and malloc named so (which shows the count counts);
# - the kernel log has no warning, BUG or Oops, and the kernel is not tainted.
#
# The same userland runs Debian 12's python3 and perl with scripts whose allocations are known (cache.py, from
# tests/tests/python.rs, and threads.pl, from tests/tests/perl.rs): each function's live bytes must be exact, and
# the interpreters' frames read.
#
# usage: run.sh MEMTRACE_AARCH64_BINARY [KERNEL_PACKAGE...]  (default: Debian 12's linux-image-6.12-arm64;
#   a metapackage stands for the build it depends on; a kernel Debian 12 lacks comes from unstable)
# Needs root (apt-get). Packages are cached in /var/cache/memtrace-kernels; each console log is kept in
# target/matrix-arm64/.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=$(readlink -f "${1:?usage: run.sh MEMTRACE_AARCH64_BINARY [KERNEL_PACKAGE...]}"); shift
LC_ALL=C readelf -h "$bin" 2>/dev/null | grep -q 'Machine: *AArch64' \
  || { echo "matrix-arm64: $bin is not an aarch64 binary: build it with cargo xtask build --target aarch64-unknown-linux-gnu"; exit 2; }
out=$here/../../target/matrix-arm64
mkdir -p "$out"; out=$(cd "$out" && pwd)
cache=/var/cache/memtrace-kernels
need=()
command -v qemu-system-aarch64 >/dev/null || need+=(qemu-system-arm)
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/include/stdlib.h ] || need+=(libc6-dev-arm64-cross)
command -v cpio >/dev/null || need+=(cpio)
if ((${#need[@]})); then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1; DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1; } \
    || { echo "matrix-arm64: could not install ${need[*]}"; exit 2; }
fi
xlib=/usr/aarch64-linux-gnu/lib

# apt states of our own, one a suite, from the mirror this machine's apt sources name
mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)\/*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
[ -n "$mirror" ] || mirror=http://deb.debian.org/debian
apt64() {  # SUITE apt-get|apt-cache ARG...
  local s=$cache/apt-arm64-$1 tool=$2; shift 2
  timeout 600 "$tool" -o APT::Architecture=arm64 -o APT::Architectures=arm64 -o Dir::Etc::sourcelist="$s/sources.list" \
    -o Dir::Etc::sourceparts=- -o Dir::Etc::preferencesparts=- -o Dir::State::lists="$s/lists" -o Dir::State::status="$s/status" \
    -o Dir::Cache::archives="$s/archives" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Debug::NoLocking=1 \
    -o APT::Sandbox::User=root "$@"
}
lists() {  # SUITE: its package lists, fetched once a week (the security archive keeps only the newest kernel)
  local s=$cache/apt-arm64-$1
  [ -n "$(find "$s/updated" -mtime -7 2>/dev/null)" ] && return 0
  mkdir -p "$s/lists/partial" "$s/archives/partial"; touch "$s/status"
  case $1 in
    bookworm) printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s-security bookworm-security main\n' "$mirror" "$mirror" "$mirror" ;;
    *) printf 'deb %s %s main\n' "$mirror" "$1" ;;
  esac >"$s/sources.list"
  apt64 "$1" apt-get update >/dev/null 2>&1 && touch "$s/updated"
}
unpacked() {  # SUITE PACKAGE [ALSO] -> a directory holding PACKAGE (and ALSO, where the suite has it) unpacked, once
  local dir=$cache/arm64-$1-$2 tmp deb
  if [ ! -d "$dir" ]; then
    tmp=$(mktemp -d); lists "$1"
    if (cd "$tmp" && apt64 "$1" apt-get download "$2") >/dev/null 2>&1; then
      [ -n "${3:-}" ] && (cd "$tmp" && apt64 "$1" apt-get download "$3") >/dev/null 2>&1
      for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/x"; done && mv "$tmp/x" "$dir"
    fi
    rm -rf "$tmp"
  fi
  [ -d "$dir" ] && echo "$dir"
}
build_of() {  # PACKAGE -> the kernel build it names (a metapackage: the build it depends on), and its suite
  local suite dep
  for suite in bookworm sid; do
    lists $suite
    dep=$(apt64 $suite apt-cache depends "$1" 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*-arm64\)$/\1/p' | head -1)
    [ -n "$dep" ] && { echo "$suite $dep"; return; }
    apt64 $suite apt-cache show "$1" >/dev/null 2>&1 && { echo "$suite $1"; return; }
  done
}

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# Debian 12's arm64 userland: glibc, python3, perl, jemalloc and busybox, extracted by mmdebstrap once
userland=(busybox-static python3-minimal perl libjemalloc2)
base=$cache/arm64-userland-bookworm
if [ "$(cat "$base.packages" 2>/dev/null)" != "${userland[*]}" ]; then
  command -v mmdebstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends mmdebstrap >/dev/null 2>&1
  rm -rf "$base"
  mmdebstrap --variant=extract --mode=root --architectures=arm64 --include="$(IFS=,; echo "${userland[*]}")" \
    bookworm "$base" "$mirror" >"$work/mmdebstrap.log" 2>&1 \
    || { echo "matrix-arm64: mmdebstrap could not extract Debian 12's arm64 ${userland[*]}: $(tail -1 "$work/mmdebstrap.log")"; exit 2; }
  rm -rf "$base"/usr/share/{doc,man,locale,info} "$base"/usr/share/perl/5.36*/pod
  echo "${userland[*]}" >"$base.packages"
fi
# Debian 13's python3-minimal and its glibc, a root the guest enters with chroot, in trixie/ of its directory
# as the guest sees it (merged /usr: the links too)
trixie=$cache/arm64-userland-trixie
if [ ! -e "$trixie/trixie/usr/bin/python3" ]; then
  rm -rf "$trixie"; mkdir -p "$trixie"
  mmdebstrap --variant=extract --mode=root --architectures=arm64 --include=python3-minimal trixie "$trixie/trixie" "$mirror" \
    >"$work/mmdebstrap.log" 2>&1 \
    || { echo "matrix-arm64: mmdebstrap could not extract Debian 13's arm64 python3-minimal: $(tail -1 "$work/mmdebstrap.log")"; exit 2; }
  rm -rf "$trixie"/trixie/usr/share/{doc,man,locale,info}
  for d in bin lib sbin; do [ -e "$trixie/trixie/$d" ] || ln -s "usr/$d" "$trixie/trixie/$d"; done
fi
libc13=$(unpacked trixie libc6) && jem13=$(unpacked trixie libjemalloc2) \
  || { echo "matrix-arm64: could not fetch Debian 13's arm64 libc6 and libjemalloc2 from $mirror"; exit 2; }
# What the guest adds to the two userlands: the last cpio archive, which the kernel unpacks over them
r=$work/root
mkdir -p "$r"/{bin,d13,proc,sys,dev,tmp,trixie}
for t in sh mount poweroff cat uname dmesg sed tr grep head rm echo mkfifo chroot; do ln -s busybox "$r/bin/$t"; done
cp "$here/cache.py" "$r/trixie/"
cp "$bin" "$r/bin/memtrace"; cp "$here/init.sh" "$r/init"; chmod +x "$r/init"; cp "$here"/cache.py "$here"/threads.pl "$r/"
cp -L "$jem13/usr/lib/aarch64-linux-gnu/libjemalloc.so.2" "$libc13"/usr/lib/aarch64-linux-gnu/{libc.so.6,libm.so.6} \
  "$libc13/usr/lib/ld-linux-aarch64.so.1" "$r/d13/"
cc() { aarch64-linux-gnu-gcc -O1 -pthread -o "$r/bin/$1" "$here/fixtures.c" "${@:2}" || { echo "matrix-arm64: aarch64-linux-gnu-gcc failed"; exit 2; }; }
d13=(-Wl,-rpath,/d13 -Wl,--dynamic-linker=/d13/ld-linux-aarch64.so.1)
cc fixture; cc fixture-jemalloc12 "$base/usr/lib/aarch64-linux-gnu/libjemalloc.so.2"
cc fixture-jemalloc13 "$r/d13/libjemalloc.so.2" "${d13[@]}"; cc fixture-glibc13 "${d13[@]}"
# three cpio archives, one after another, which the kernel unpacks in turn
{ for d in "$base" "$trixie" "$r"; do (cd "$d" && find . | cpio -o -H newc 2>/dev/null); done; } | gzip -1 >"$work/initrd.gz"

(($#)) || set -- linux-image-6.12-arm64
status=0
for pkg; do
  suite=; build=; read -r suite build < <(build_of "$pkg")
  [ -n "${build:-}" ] || { echo "$pkg: no such arm64 kernel package in Debian 12's or unstable's lists"; status=1; continue; }
  # unstable's kernels keep their image in linux-binary-<release>
  k=; dir=$(unpacked "$suite" "$build" "${build/linux-image/linux-binary}") && k=$(find "$dir" -name 'vmlinuz*' -type f | head -1)
  [ -n "${k:-}" ] || { echo "$build: could not fetch the kernel package"; rm -rf "${dir:-}"; status=1; continue; }
  log=$out/$build.log
  start=$(date +%s)
  # Debian's arm64 vmlinuz is an uncompressed Image: QEMU's -kernel boots it as it is
  timeout --foreground 900 qemu-system-aarch64 -M virt -cpu max -m 2048 -smp 2 -nographic -no-reboot -kernel "$k" \
    -initrd "$work/initrd.gz" -append "console=ttyAMA0 quiet oops=panic panic=-1" </dev/null >"$log" 2>&1
  python3 "$here/verdict.py" "$log" "$build" "$(($(date +%s) - start))" || status=1
done
exit $status
