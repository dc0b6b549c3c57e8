//! The USDT handler: one uprobe program attached at every probe site memtrace listens to.
//!
//! Userspace attaches each site with a BPF cookie that indexes `USDT_SPECS`; the spec says what the
//! site means (a subsystem report, a dump round's begin or end, a `--usdt` counter) and where its
//! arguments are, decoded from the note's x86-64 argument specs. Figures are keyed by the process
//! the probe fires in; under system-wide tracing the process filter of the allocator probes
//! applies. Arguments are read from the saved registers (`struct pt_regs`, the program's context)
//! or from the target's memory; nothing is ever written to the target.
//!
//! Dump rounds (include/memtrace.h's registered dumpers): a thread's reports between its
//! `memtrace:dump_begin(n)` and `memtrace:dump_end(n)` are kept as round n's too, beside the
//! subsystem's latest value, and `DUMP_ROUNDS` says which round of the thread is complete, so that
//! userspace shows a process's subsystems as of one complete round, never half of one.

use core::arch::asm;

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{
        bpf_get_current_pid_tgid, bpf_probe_read_kernel, bpf_probe_read_user_str_bytes,
        generated::{self, bpf_copy_from_user},
    },
    macros::{map, uprobe},
    maps::{Array, HashMap, PerCpuArray},
    programs::ProbeContext,
};
use memtrace_common::{
    reach, usdt_action, usdt_location, DumpRound, SubsystemKey, SubsystemValue, UsdtArg, UsdtCounterKey,
    UsdtCounterValue, UsdtSpec, MAX_DUMP_STREAMS, MAX_SUBSYSTEMS, MAX_USDT_COUNTERS, MAX_USDT_SPECS,
    MAX_USES_PER_SITE, ROUND_SLOTS, SUBSYSTEM_NAME_LEN, USDT_LOST_SLOT,
};

use crate::{
    processes,
    scratch::{Claim, Claimable},
};

#[map]
pub(crate) static USDT_SPECS: Array<UsdtSpec> = Array::with_max_entries(MAX_USDT_SPECS, 0);

/// The current value of every subsystem of every process, as last reported, and as of the last
/// dump rounds that reported it.
#[map]
static SUBSYSTEMS: HashMap<SubsystemKey, SubsystemValue> = HashMap::with_max_entries(MAX_SUBSYSTEMS, 0);

/// The dump rounds of every thread that runs them (include/memtrace.h's dumper thread), by pid_tgid.
#[map]
static DUMP_ROUNDS: HashMap<u64, DumpRound> = HashMap::with_max_entries(MAX_DUMP_STREAMS, 0);

#[map]
static USDT_COUNTERS: HashMap<UsdtCounterKey, UsdtCounterValue> =
    HashMap::with_max_entries(MAX_USDT_COUNTERS, 0);

/// USDT events that could not be recorded: a full map, an unreadable argument.
#[map]
static USDT_LOST_EVENTS: Array<u64> = Array::with_max_entries(1, 0);

// The round slot of a report is `round & (ROUND_SLOTS - 1)`.
const _: () = assert!(ROUND_SLOTS.is_power_of_two());
/// Size of x86-64 `struct pt_regs`; a register offset must lie inside it.
const PT_REGS_SIZE: u16 = 168;

/// Atomically adds `n` to a counter in a map value; threads of one process report from many CPUs.
fn atomic_add(counter: *const u64, n: u64) {
    // SAFETY: `counter` points into a map value, which stays valid while the program runs.
    unsafe {
        asm!(
            "{value} = atomic_fetch_add((u64 *)({counter} + 0), {value})",
            counter = in(reg) counter,
            value = inout(reg) n => _,
        );
    }
}

fn count_loss() {
    if let Some(lost) = USDT_LOST_EVENTS.get_ptr_mut(USDT_LOST_SLOT) {
        atomic_add(lost, 1);
    }
}

/// Sleepable, so that it may fault in the target's pages: a subsystem name in .rodata that the
/// target never touched itself is not mapped yet, and a non-sleeping read of it would fail.
///
/// One probe per site: its cookie indexes the first of the site's uses in `USDT_SPECS` (the
/// memtrace provider's report, `--usdt` requests), which follow one another up to the one marked
/// `last_of_site`. A site attached once is in place, for every use, before its semaphore rises.
#[uprobe(sleepable)]
pub fn usdt_site(ctx: ProbeContext) -> u32 {
    let first = processes::attach_cookie(&ctx) as u32;
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // System-wide, a site fires in every process that maps its file: the same processes count as
    // for allocator events (never memtrace itself, --comm, --exclude-pid).
    if !processes::is_traced(tgid) {
        return 0;
    }
    if processes::reach() != reach::TARGETS {
        // Figures in STATS make the process known to userspace (with its command name) even if
        // it never allocates, and tell it when the process exits, so its entries here are
        // released too. A full STATS table is counted there; the report still counts here.
        let _ = processes::stats_of(tgid);
    }
    // Counted from 0 so that the verifier sees the bound.
    for step in 0..MAX_USES_PER_SITE {
        let Some(spec) = USDT_SPECS.get(first.wrapping_add(step)) else {
            return 0;
        };
        match spec.action {
            usdt_action::REPORT_TOTAL | usdt_action::REPORT_DELTA => report(&ctx, tgid, spec),
            usdt_action::COUNT_HITS | usdt_action::TRACK_ARGUMENT => count(&ctx, tgid, spec),
            usdt_action::DUMP_BEGIN | usdt_action::DUMP_END => dump_round(&ctx, spec),
            _ => {}
        }
        if spec.last_of_site != 0 {
            break;
        }
    }
    0
}

/// A report's key, built in a slot the run claims (scratch.rs). This program is sleepable, so it
/// cannot hold the tail call that keeps the others off a private stack (kernel_stack.rs); instead
/// no function of it keeps 64 bytes of stack, the least the verifier gives a private stack to, and
/// a 72-byte key would, or an 88-byte value.
#[repr(C)]
struct KeySlot {
    owner: u64,
    key: SubsystemKey,
    /// A new subsystem's first value; never written, so always zero.
    zero: SubsystemValue,
}

// SAFETY: #[repr(C)] with the owner word first.
unsafe impl Claimable for KeySlot {}

/// Reports that can be under way on one CPU at once (each may sleep in a page fault).
const KEY_SLOTS: u32 = 8;

#[map]
static REPORT_KEYS: PerCpuArray<KeySlot> = PerCpuArray::with_max_entries(KEY_SLOTS, 0);

#[inline(never)]
fn report(ctx: &ProbeContext, tgid: u32, spec: &UsdtSpec) {
    let (Some(name), Some(value)) =
        (read_arg::<true>(ctx, &spec.args[0]), read_arg::<true>(ctx, &spec.args[1]))
    else {
        count_loss();
        return;
    };
    let Some(mut claim) = Claim::take(&REPORT_KEYS, KEY_SLOTS) else {
        count_loss();
        return;
    };
    let slot = claim.get();
    slot.key.tgid = tgid;
    slot.key._pad = 0;
    if !read_name(name as u64, &mut slot.key.name) {
        count_loss();
        return;
    }
    let Some(entry) = subsystem_entry(slot) else {
        count_loss();
        return;
    };
    // SAFETY: a map value, valid while the program runs. Other threads of the process may write it
    // at once: each writes a field with a single aligned store or an atomic add, never through a
    // reference.
    let now = unsafe {
        if spec.action == usdt_action::REPORT_TOTAL {
            // A single 8-byte store: readers see the old or the new value, never a mix.
            core::ptr::write_volatile(&raw mut (*entry).value, value);
            value
        } else {
            atomic_add(&raw const (*entry).value as *const u64, value as u64);
            // Another thread's delta may land in between, as it may at any moment of a round.
            core::ptr::read_volatile(&raw const (*entry).value)
        }
    };
    note_round(entry, bpf_get_current_pid_tgid(), now);
}

/// The subsystem's entry, created (zero) on its first report; None when the map is full.
fn subsystem_entry(slot: &KeySlot) -> Option<*mut SubsystemValue> {
    if let Some(entry) = SUBSYSTEMS.get_ptr_mut(&slot.key) {
        return Some(entry);
    }
    // Another thread may create it first (EEXIST): the entry is there either way.
    let _ = SUBSYSTEMS.insert(&slot.key, &slot.zero, u64::from(BPF_NOEXIST));
    SUBSYSTEMS.get_ptr_mut(&slot.key)
}

/// The round the calling thread has open (between its `dump_begin` and `dump_end`), or 0.
fn open_round(pid_tgid: u64) -> u64 {
    let Some(round) = DUMP_ROUNDS.get_ptr(&pid_tgid) else {
        return 0;
    };
    // SAFETY: a map value, valid while the program runs; only this thread writes it.
    let (begun, complete) = unsafe {
        (
            core::ptr::read_volatile(&raw const (*round).begun),
            core::ptr::read_volatile(&raw const (*round).complete),
        )
    };
    if begun > complete {
        begun
    } else {
        0
    }
}

/// Keeps `value` as the subsystem's value in the reporting thread's open round, if it has one; a
/// report outside any round only marks the latest report as such.
fn note_round(entry: *mut SubsystemValue, pid_tgid: u64, value: i64) {
    let round = open_round(pid_tgid);
    let tid = pid_tgid as u32;
    // ROUND_SLOTS is a power of two: the mask bounds the index for the verifier.
    let slot = round as usize & (ROUND_SLOTS - 1);
    // SAFETY: `entry` is a map value, valid while the program runs. Its round fields are written by
    // the thread running rounds (others only clear `latest_round`); userspace checks that a round's
    // slot held still while it read it (attach/usdt/rounds.rs).
    unsafe {
        if round == 0 {
            core::ptr::write_volatile(&raw mut (*entry).latest_round, 0);
            return;
        }
        if (*entry).round_tid != tid {
            // Another thread's rounds counted it so far: they say nothing about this thread's.
            (*entry).rounds = [0; ROUND_SLOTS];
            (*entry).round_tid = tid;
        }
        (*entry).round_values[slot] = value;
        (*entry).rounds[slot] = round;
        core::ptr::write_volatile(&raw mut (*entry).latest_round, round);
    }
}

/// `memtrace:dump_begin(dump_no)` and `memtrace:dump_end(dump_no)`: opens and completes the calling
/// thread's round. An end that does not match the round begun (a site attached mid-round) completes
/// nothing, so a round is complete only when both ends were seen.
#[inline(never)]
fn dump_round(ctx: &ProbeContext, spec: &UsdtSpec) {
    let Some(dump_no) = read_arg::<true>(ctx, &spec.args[0]) else {
        count_loss();
        return;
    };
    let dump_no = dump_no as u64;
    let pid_tgid = bpf_get_current_pid_tgid();
    let mut round = DUMP_ROUNDS.get_ptr_mut(&pid_tgid);
    if round.is_none() {
        let _ = DUMP_ROUNDS.insert(&pid_tgid, &DumpRound::default(), u64::from(BPF_NOEXIST));
        round = DUMP_ROUNDS.get_ptr_mut(&pid_tgid);
    }
    let Some(round) = round else {
        count_loss();
        return;
    };
    // SAFETY: a map value, valid while the program runs; only this thread writes it, userspace reads.
    unsafe {
        if spec.action == usdt_action::DUMP_BEGIN {
            if dump_no > (*round).complete {
                core::ptr::write_volatile(&raw mut (*round).begun, dump_no);
            }
        } else if (*round).begun == dump_no {
            core::ptr::write_volatile(&raw mut (*round).complete, dump_no);
        }
    }
}

#[inline(never)]
fn count(ctx: &ProbeContext, tgid: u32, spec: &UsdtSpec) {
    let tracked = if spec.action == usdt_action::TRACK_ARGUMENT {
        match read_arg::<true>(ctx, &spec.args[0]) {
            Some(value) => Some(value),
            None => {
                count_loss();
                return;
            }
        }
    } else {
        None
    };
    let key = UsdtCounterKey { tgid, counter: spec.counter };
    let mut counter = USDT_COUNTERS.get_ptr_mut(key);
    if counter.is_none() {
        let _ = USDT_COUNTERS.insert(key, UsdtCounterValue::default(), u64::from(BPF_NOEXIST));
        counter = USDT_COUNTERS.get_ptr_mut(key);
    }
    let Some(counter) = counter else {
        count_loss();
        return;
    };
    // SAFETY: the pointer is into a map value, valid while the program runs.
    unsafe {
        atomic_add(&(*counter).hits, 1);
        if let Some(value) = tracked {
            // A single 8-byte store: readers see the old or the new value, never a mix.
            core::ptr::write_volatile(&raw mut (*counter).value, value);
        }
    }
}

/// A register's saved value, by its byte offset in pt_regs.
fn register(ctx: &ProbeContext, offset: u16) -> Option<u64> {
    if offset > PT_REGS_SIZE - 8 {
        return None;
    }
    // The offset comes from a map, so the context cannot be read directly (the verifier allows only
    // constant offsets into it); the helper reads it instead.
    // SAFETY: the address lies inside the context's pt_regs, checked above.
    unsafe { bpf_probe_read_kernel((ctx.regs as *const u8).add(offset as usize) as *const u64) }.ok()
}

/// Evaluates one argument spec; None when a register or the target's memory cannot be read.
/// `SLEEPABLE`: the program may fault the target's pages in (usdt_site); otherwise a page not
/// resident fails the read.
pub(crate) fn read_arg<const SLEEPABLE: bool>(ctx: &ProbeContext, arg: &UsdtArg) -> Option<i64> {
    let raw = match arg.location {
        usdt_location::CONSTANT => return Some(arg.value),
        usdt_location::REGISTER => register(ctx, arg.register_offset)? >> (arg.register_shift & 8),
        usdt_location::MEMORY => {
            let mut address = arg.value as u64;
            if arg.has_base != 0 {
                address = address.wrapping_add(register(ctx, arg.register_offset)?);
            }
            if arg.scale != 0 {
                let index = register(ctx, arg.index_offset)?;
                address = address.wrapping_add(index.wrapping_mul(u64::from(arg.scale)));
            }
            read_user::<SLEEPABLE>(address, arg.size)?
        }
        _ => return None,
    };
    Some(extend(raw, arg.size, arg.signed != 0))
}

/// Reads a C string into `name`, which stays zero-padded after the NUL, so equal names make equal
/// keys. A longer name is cut (the helper always terminates it).
fn read_name(address: u64, name: &mut [u8; SUBSYSTEM_NAME_LEN]) -> bool {
    // The slot held an earlier name: a shorter one must not end in its bytes.
    for byte in name.iter_mut() {
        *byte = 0;
    }
    // The string read cannot fault pages in; a one-byte copy can. Try, fault in the first page,
    // try again, fault in the next page (a name may cross into it), try a last time.
    let next_page = (address + 4096) & !4095;
    for fault_in in [0, address, next_page] {
        if fault_in != 0 {
            let mut byte = 0u8;
            // SAFETY: copies one byte into a local; fails rather than faults on a bad address.
            unsafe { bpf_copy_from_user((&raw mut byte).cast(), 1, fault_in as *const _) };
        }
        // SAFETY: the helper checks the user address and writes at most the buffer.
        if unsafe { bpf_probe_read_user_str_bytes(address as *const u8, name) }.is_ok() {
            return true;
        }
    }
    false
}

/// Reads exactly `size` bytes: a wider read could run off the end of a mapping. A sleepable
/// program's copy faults pages in as the target's own access would.
fn read_user<const SLEEPABLE: bool>(address: u64, size: u8) -> Option<u64> {
    let mut value = 0u64;
    let size = match size {
        1 | 2 | 4 => u32::from(size),
        _ => 8,
    };
    let result = if SLEEPABLE {
        // SAFETY: copies at most 8 bytes into a local u64 (the low bytes, little-endian).
        unsafe { bpf_copy_from_user((&raw mut value).cast(), size, address as *const _) }
    } else {
        // SAFETY: as above; the helper fails rather than faults.
        unsafe { generated::bpf_probe_read_user((&raw mut value).cast(), size, address as *const _) }
    };
    (result == 0).then_some(value)
}

/// Keeps the low `size` bytes of `raw`, sign- or zero-extended as the spec says (`-4@` or `4@`).
fn extend(raw: u64, size: u8, signed: bool) -> i64 {
    match (size, signed) {
        (1, true) => raw as i8 as i64,
        (1, false) => raw as u8 as i64,
        (2, true) => raw as i16 as i64,
        (2, false) => raw as u16 as i64,
        (4, true) => raw as i32 as i64,
        (4, false) => raw as u32 as i64,
        _ => raw as i64,
    }
}
