//! `--sample BYTES`: the Poisson process on allocated bytes that tcmalloc, jemalloc and heapprofd
//! use. Sample points fall on the stream of bytes a thread allocates, a mean of `SAMPLE_MEAN` bytes
//! apart, and an allocation is sampled when a point falls inside it: an allocation of S bytes with
//! probability 1 - exp(-S/R), so userspace scales each sample by S / (1 - exp(-S/R)) for unbiased
//! estimates. Only sampled allocations take a stack and a live-allocation record. BPF has no
//! floating point: the exponential distances are drawn with a fixed-point log2.

use aya_ebpf::{helpers::bpf_get_prandom_u32, macros::map, maps::Array};
use memtrace_common::ThreadState;

use crate::{counters::add_signed, helpers::loaded};

/// Set by the loader: the mean bytes between samples; 0 records every allocation.
#[no_mangle]
static SAMPLE_MEAN: u64 = 0;

/// Fractional bits of the fixed-point logarithms.
const FRACTION_BITS: u32 = 16;
/// ln 2 in 16-bit fixed point (0.693147 * 65536).
const LN_2: u64 = 45_426;

fn mean() -> u64 {
    loaded(&SAMPLE_MEAN)
}

/// Whether only some blocks get a record (`--sample`, or `--window`'s blocks of a window), so that
/// frees are filtered by `RECORDED_BLOCKS`.
fn some_recorded() -> bool {
    mean() != 0 || crate::windowed::enabled()
}

/// Recorded blocks, counted by a hash of (process, address): a free whose count is 0 frees no
/// recorded block and needs no lookup in the live-allocation table, which most frees miss when
/// sampling. Kept only when some blocks go unrecorded (`some_recorded`). Counts of blocks that userspace releases with their process
/// stay (a later free there only costs the lookup it would have cost anyway).
#[map]
static RECORDED_BLOCKS: Array<i64> = Array::with_max_entries(RECORDED_BLOCK_COUNTS, 0);

const RECORDED_BLOCK_COUNTS: u32 = 1 << 16;

fn recorded_count(tgid: u32, address: u64) -> Option<&'static i64> {
    // Fibonacci hashing: the top 16 bits of the product.
    let hash = ((u64::from(tgid) << 48) ^ address).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 48;
    // SAFETY: a map value, valid while the program runs.
    RECORDED_BLOCKS.get_ptr(hash as u32).map(|count| unsafe { &*count })
}

/// A block got a live-allocation record (`released` when it loses it).
pub(crate) fn recorded(tgid: u32, address: u64) {
    count_recorded(tgid, address, 1);
}

/// A block's live-allocation record was removed.
pub(crate) fn released(tgid: u32, address: u64) {
    count_recorded(tgid, address, -1);
}

fn count_recorded(tgid: u32, address: u64, change: i64) {
    if some_recorded() {
        if let Some(count) = recorded_count(tgid, address) {
            add_signed(count, change);
        }
    }
}

/// Whether `address` may have a live-allocation record: always when every block is recorded.
pub(crate) fn may_be_recorded(tgid: u32, address: u64) -> bool {
    // SAFETY: a map value; a plain read, as a count that changes meanwhile is another thread's
    // block, not this one.
    !some_recorded()
        || recorded_count(tgid, address).is_none_or(|count| unsafe { core::ptr::read_volatile(count) } > 0)
}

/// Whether this allocation of `size` bytes is recorded; moves the thread along its byte stream.
pub(crate) fn take(thread: &mut ThreadState, size: u64) -> bool {
    if mean() == 0 {
        return true;
    }
    if thread.until_sample > size {
        thread.until_sample -= size;
        return false;
    }
    // A point fell inside this allocation; the next is an exponential distance past its end
    // (points inside the rest of it change nothing: the process has no memory).
    thread.until_sample = next_distance();
    true
}

/// An exponential distance with mean SAMPLE_MEAN: -mean * ln(u), u uniform in (0, 1].
pub(crate) fn next_distance() -> u64 {
    let mean = mean();
    if mean == 0 {
        return 0;
    }
    // SAFETY: the helper has no preconditions.
    let u = u64::from(unsafe { bpf_get_prandom_u32() }) + 1;
    // -ln(u / 2^32) = ln 2 * (32 - log2(u)).
    let minus_log2 = (32 << FRACTION_BITS) - log2_fixed(u);
    let distance = ((mean * minus_log2) >> FRACTION_BITS) * LN_2 >> FRACTION_BITS;
    distance.max(1)
}

/// log2(v) for 1 <= v <= 2^32, with FRACTION_BITS fractional bits: the integer part from the
/// highest set bit, the fraction bit by bit by repeated squaring of the mantissa. Without a
/// data-dependent branch, so that the verifier walks it once, whatever the program did before.
fn log2_fixed(v: u64) -> u64 {
    let integer = u64::from(63 - v.leading_zeros());
    // The mantissa v / 2^integer in [1, 2), as Q30 (v has at most 33 bits, so v << 30 fits).
    let mut mantissa = (v << 30) >> integer;
    let mut fraction = 0u64;
    for _ in 0..FRACTION_BITS {
        // The square lies in [1, 4): its bit 31 says whether it reached 2.
        mantissa = (mantissa * mantissa) >> 30;
        let bit = mantissa >> 31;
        mantissa >>= bit;
        fraction = (fraction << 1) | bit;
    }
    (integer << FRACTION_BITS) | fraction
}
