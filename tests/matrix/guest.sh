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

# The scheduler's perf static branch (perf_sched_events) is switched on by the first per-task perf
# event and off about a second after the last: every memtrace run with per-site perf links (the
# tests of MEMTRACE_LINKS=perf) patched __schedule's code while the other vCPU ran it. On 6.12 under
# QEMU's TCG a vCPU then hit the int3 of a patch already finished ("Oops: int3" at
# __schedule+0x407, inside the branch's `jmp`, during accounting's perf-link test), most likely
# TCG's view of code another vCPU rewrites (an earlier CI run's 6.12 Oops: int3, during the
# containers tests, has no site on record). A task holding a perf event of its own (a dummy
# software event, then `sleep`) keeps the branch on, so the tests no longer patch the scheduler.
/usr/bin/python3 - <<'HOLDER' &
import ctypes, os, struct, sys
# perf_event_attr: type PERF_TYPE_SOFTWARE (1), size 128, config PERF_COUNT_SW_DUMMY (9).
attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 9) + bytes(112), 128)
syscall = ctypes.CDLL(None, use_errno=True).syscall
syscall.restype = ctypes.c_long
# perf_event_open(attr, pid 0 (this task), cpu -1, group -1, flags 0): x86-64's syscall 298.
fd = syscall(ctypes.c_long(298), attr, ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_ulong(0))
if fd < 0:
    sys.exit(f"MATRIX-PERF-HOLDER perf_event_open failed: errno {ctypes.get_errno()}")
os.execv("/bin/sleep", ["sleep", "infinity"])
HOLDER

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
