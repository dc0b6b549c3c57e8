"""The arm64 matrix's verdict on one kernel's console log (tests/matrix-arm64/run.sh, init.sh): prints one
line, the checks that failed named, and exits 1 if any did.

usage: verdict.py CONSOLE_LOG KERNEL_PACKAGE SECONDS"""
import json
import re
import sys

LOG, PACKAGE, SECONDS = sys.argv[1], sys.argv[2], sys.argv[3]
lines = [line.rstrip("\r\n") for line in open(LOG, encoding="utf-8", errors="replace")]


def field(name):
    """The text after the first `ARM64-<name> `, or None."""
    prefix = f"ARM64-{name} "
    return next((line.split(prefix, 1)[1] for line in lines if prefix in line), None)


def fixture(name, comm="fixture"):
    """The process COMM in run NAME's summary, with the run's single-stepped functions."""
    summary = json.loads(field(f"{name}-SUMMARY") or "{}")
    process = next(p for p in summary.get("processes", []) if p.get("comm", "").startswith(comm))
    stepped = {(s["function"], s["instruction"]) for s in summary.get("single_stepped", [])}
    return process, stepped


def main_holds(process):
    """The live bytes `main` holds, inclusive: its stacks unwound down to it."""
    return next((f["live_inclusive_bytes"] for f in process.get("functions", []) if f["name"] == "main"), None)


failed = []
kernel = field("KERNEL") or "?"
if kernel == "?":
    failed.append("the VM did not boot")
doctor = [line.split("ARM64-DOCTOR ", 1)[1] for line in lines if "ARM64-DOCTOR " in line]
if field("DOCTOR-RC") != "0" or not any("aarch64" in line or "arm64" in line for line in doctor):
    failed.append(f"doctor exited {field('DOCTOR-RC')} or named no architecture")
if field("KPROBE") != "1":
    failed.append("no kprobe on arch_uprobe_pre_xol: single-steps not counted")

steps = {}
for run, allocator in [("GLIBC12", "glibc"), ("JEMALLOC12", "jemalloc"), ("JEMALLOC13", "jemalloc"), ("GLIBC13", "glibc")]:
    try:
        process, stepped = fixture(run)
    except (StopIteration, ValueError) as error:
        failed.append(f"{run}: no summary (exit {field(run + '-RC')}: {field(run + '-ERR')}; {error})")
        continue
    got = (process["allocations"], process["frees"], process["live_bytes"], main_holds(process))
    # jemalloc's libstdc++ allocates its 72,704-byte emergency pool at start: not main's, not freed
    want = (100, 50, 50000, 50000) if allocator == "glibc" else (101, 50, 50000 + 72704, 50000)
    if got != want or process.get("lost_events"):
        failed.append(f"{run}: allocations, frees, live bytes, main's {got} (want {want}), {process.get('lost_events')} lost")
    steps[run] = int(field(f"{run}-XOL") or -1)
    names = {function for function, _ in stepped}
    if allocator == "jemalloc" and (steps[run] >= 50 or names & {"malloc", "free"}):
        failed.append(f"{run}: {steps[run]} single-steps, single-stepped {sorted(names & {'malloc', 'free'})} (want < 50, none)")
    if allocator == "glibc" and (steps[run] < 100 or "malloc" not in names):
        failed.append(f"{run}: {steps[run]} single-steps, malloc named {'malloc' in names} (want at least 100, named)")

try:
    threads, _ = fixture("THREADS")
    counts = (threads["allocations"], threads["frees"])
    if not all(20000 <= count <= 20008 for count in counts) or threads.get("lost_events"):
        failed.append(f"4 threads: {counts} allocations and frees, {threads.get('lost_events')} lost (want 20,000-20,008 each, 0)")
except (StopIteration, ValueError):
    failed.append(f"4 threads: no summary (exit {field('THREADS-RC')})")

# Interpreter frames: each function's live bytes, as tests/tests/python.rs and perl.rs have them on x86-64
for run, comm, rows in [
    ("PYTHON", "python3", {"make_cache (/cache.py)": (400 * 10001, 400 * 10001)}),
    ("PYTHON313", "python3", {"make_cache (/cache.py)": (400 * 10001, 400 * 10001)}),
    ("PERL", "perl", {"main::fill_a (/threads.pl)": (100 * 30008,) * 2, "main::fill_b (/threads.pl)": (100 * 50008,) * 2}),
]:
    try:
        process, _ = fixture(run, comm)
    except (StopIteration, ValueError):
        failed.append(f"{run}: no summary (exit {field(run + '-RC')}: {field(run + '-ERR')})")
        continue
    functions = {f["name"]: (f["live_inclusive_bytes"], f["live_exclusive_bytes"]) for f in process.get("functions", [])}
    for name, want in rows.items():
        if functions.get(name) != want:
            failed.append(f"{run}: {name} holds {functions.get(name)} live (inclusive, exclusive; want {want})")
    if process.get("unwind_stops", {}).get("interpreter_unreadable"):
        failed.append(f"{run}: {process['unwind_stops']['interpreter_unreadable']} interpreter frames unreadable")

dmesg = [line.split("ARM64-DMESG ", 1)[1] for line in lines if "ARM64-DMESG " in line]
bad = [line for line in dmesg if re.search(r"WARNING|BUG|Oops|Internal error|Call trace", line)]
if bad:
    failed.append(f"kernel log: {bad[0][:120]}")
if field("TAINTED") != "0":
    failed.append(f"kernel tainted ({field('TAINTED')})")
if not any("ARM64-END" in line for line in lines):
    failed.append("the VM stopped before the end")

stepped = ", ".join(f"{run.lower()} {count}" for run, count in steps.items())
verdict = "PASS" if not failed else "FAIL: " + "; ".join(failed)
print(f"Linux {kernel}: doctor, exact with 1 and 4 threads under glibc 12/13 and jemalloc 12/13, "
      f"single-steps {stepped}, python3 3.11 (launched) and 3.13 (--pid) and perl frames, kernel log clean; {SECONDS} s: {verdict}")
sys.exit(1 if failed else 0)
