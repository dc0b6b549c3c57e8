#!/bin/sh
# The arm64 matrix's guest (the initramfs's /init, busybox's sh): memtrace doctor, then the fixtures of
# fixtures.c under memtrace with each allocator, then python3 and perl scripts, the kernel's single-steps counted by a kprobe on
# arch_uprobe_pre_xol, then the kernel log. Each result is an ARM64-* line on the console for run.sh.
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev; mount -t tmpfs tmp /tmp
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null; mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
T=/sys/kernel/tracing
echo "ARM64-KERNEL $(uname -r) $(uname -m)"
/bin/memtrace doctor >/tmp/doctor 2>&1; echo "ARM64-DOCTOR-RC $?"
sed 's/^/ARM64-DOCTOR /' /tmp/doctor
# Single-steps: the kernel prepares each in arch_uprobe_pre_xol.
if echo 'p:xol arch_uprobe_pre_xol' >$T/kprobe_events && echo 1 >$T/events/kprobes/xol/enable; then xol=1; else xol=0; fi
echo "ARM64-KPROBE $xol"
run() {  # NAME FIXTURE [ARG]: the fixture under memtrace, its summary and the single-steps it took
  name=$1; shift
  rm -f /tmp/s.json; echo >$T/trace
  /bin/memtrace --summary /tmp/s.json -o /tmp/t.json -- "$@" >/tmp/out 2>/tmp/err; echo "ARM64-$name-RC $?"
  grep -v '^    ' /tmp/err | head -20 | sed "s/^/ARM64-$name-ERR /"
  echo "ARM64-$name-XOL $(grep -c 'xol:' $T/trace)"
  tr -d '\n' </tmp/s.json | sed "s/^/ARM64-$name-SUMMARY /"; echo
}
run GLIBC12 /bin/fixture
run THREADS /bin/fixture threads
run JEMALLOC12 /bin/fixture-jemalloc12
run JEMALLOC13 /bin/fixture-jemalloc13
run GLIBC13 /bin/fixture-glibc13
run PYTHON /usr/bin/python3 /cache.py
run PERL /usr/bin/perl /threads.pl
# Debian 13's python3.13 in a root of its own (its glibc too), attached with --pid while it waits on a pipe
mkfifo /tmp/go; exec 3<>/tmp/go
chroot /trixie /usr/bin/python3 /cache.py wait </tmp/go &
py=$!
until grep -q pipe_read /proc/$py/wchan 2>/dev/null || ! [ -e /proc/$py ]; do :; done
rm -f /tmp/s.json
/bin/memtrace --summary /tmp/s.json -o /tmp/t.json --pid $py >/tmp/out 2>/tmp/err &
mt=$!
until grep -q 'memtrace: tracing' /tmp/err 2>/dev/null || ! [ -e /proc/$mt ]; do :; done
echo g >&3
wait $mt; echo "ARM64-PYTHON313-RC $?"
grep -v '^    ' /tmp/err | head -20 | sed "s/^/ARM64-PYTHON313-ERR /"
tr -d '\n' </tmp/s.json | sed "s/^/ARM64-PYTHON313-SUMMARY /"; echo
dmesg | sed 's/^/ARM64-DMESG /'; echo "ARM64-TAINTED $(cat /proc/sys/kernel/tainted)"; echo ARM64-END
poweroff -f
