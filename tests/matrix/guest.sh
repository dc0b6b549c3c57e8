#!/bin/bash
# Runs inside a matrix VM as root, on the host's root filesystem (see init.sh): says which kernel
# this is and how it preempts, whether memtrace loads, what `memtrace doctor` says, then runs the
# integration test binaries the plan names and dumps the kernel log. Each result is a MATRIX-* line
# on the console for xtask/src/matrix.rs to read.
#
# usage: guest.sh PLAN; PLAN is a bash file setting MEMTRACE_BIN, TEST_THREADS, ALLOW_REFUSAL (1 when
# memtrace may refuse this kernel) and TESTS, an array of "EXECUTABLE [FILTER...]" lines.
set -u
# shellcheck source=/dev/null
source "$1" || { echo "MATRIX-GUEST-FAILED cannot read the plan $1 (it must be on the host's root filesystem, not /tmp)"; exit 1; }
# Emulated CPUs run a test some 30 times slower than the host: whole runs may take 4 times the
# host's deadline (tests/src/lib.rs run_deadline).
export MEMTRACE_TEST_SLOWDOWN=4
export MEMTRACE_BIN PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
echo "MATRIX-KERNEL $(uname -r)"
echo "MATRIX-VERSION $(uname -v)"
echo "MATRIX-PREEMPT-SCHED $(cat /sys/kernel/debug/sched/preempt 2>/dev/null)"
echo "MATRIX-PREEMPT-DMESG $(dmesg | grep -m1 -oE 'Dynamic Preempt: .*|PREEMPT_RT.*')"
echo "MATRIX-CPUS $(nproc)"

# Does memtrace load here at all? (On a kernel it refuses, this is the refusal.)
"$MEMTRACE_BIN" -o /tmp/probe.json -- /bin/true >/tmp/probe.out 2>&1
probe=$?
echo "MATRIX-PROBE-RC $probe"
# A verifier log runs to thousands of lines: its start and its end (the verifier's objection) say it.
if [ "$(wc -l </tmp/probe.out)" -le 60 ]; then cat /tmp/probe.out; else head -n 20 /tmp/probe.out; echo "[...]"; tail -n 40 /tmp/probe.out; fi \
  | sed 's/^/MATRIX-PROBE-OUT /'

"$MEMTRACE_BIN" doctor >/tmp/doctor.out 2>&1
echo "MATRIX-DOCTOR-RC $?"
sed 's/^/MATRIX-DOCTOR /' /tmp/doctor.out | head -80

if [ "$probe" != 0 ] && [ "$ALLOW_REFUSAL" = 1 ]; then
  echo "MATRIX-TESTS-SKIPPED memtrace refused this kernel"
else
  for line in "${TESTS[@]}"; do
    read -r -a words <<<"$line"
    name=$(basename "${words[0]}" | sed 's/-[0-9a-f]*$//')
    echo "MATRIX-TEST-BEGIN $name"
    start=$(date +%s)
    timeout 900 "${words[@]}" --test-threads="$TEST_THREADS" --color never 2>&1
    rc=$?
    echo "MATRIX-TEST-RC $name $rc $(($(date +%s) - start))s"
  done
fi
echo "MATRIX-DMESG-BEGIN"
dmesg
echo "MATRIX-DMESG-END"
