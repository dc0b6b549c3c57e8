//! arm64 probe points of real allocator entries, their words copied from Debian's arm64 packages
//! (aarch64-linux-gnu-objdump -d): Debian 12's libc6 and libjemalloc2, and Debian 13's, built with
//! `-mbranch-protection=standard`.

use memtrace_common::{AllocatorFunction, ArgumentRegisters, ArgumentsRead, MapFunction};

use super::*;

fn placed(words: &[u32], arguments: ArgumentsRead) -> ProbePoint {
    let code: Vec<u8> = words.iter().flat_map(|word| word.to_le_bytes()).collect();
    place(&code, arguments)
}

fn at(point: &ProbePoint) -> (u64, bool, &str) {
    (point.delta, point.emulated, point.instruction.as_str())
}

#[test]
fn jemalloc_malloc_probes_its_b_hi_past_the_cmp() {
    // Debian 12: cmp x0, #0x1, lsl #12 ; b.hi ; add x1, x0, #0x7 ; adrp x7, ...
    let point =
        placed(&[0xf140_041f, 0x5400_0488, 0x9100_1c01, 0xb000_0427], AllocatorFunction::Malloc.arguments());
    assert_eq!(at(&point), (4, true, "b.cond"));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY);
    // Debian 13: bti c ; mov x3, x0 ; cmp x0, #0x1, lsl #12 ; b.hi
    let point =
        placed(&[0xd503_245f, 0xaa00_03e3, 0xf140_041f, 0x5400_0408], AllocatorFunction::Malloc.arguments());
    assert_eq!(at(&point), (12, true, "b.cond"));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY, "x0 still holds the size");
}

#[test]
fn jemalloc_sdallocx_passes_its_ccmp() {
    // cmp x1, #0x1, lsl #12 ; ccmp w2, #0x0, #0x0, ls ; b.ne ; add x3, x1, #0x7
    let point =
        placed(&[0xf140_043f, 0x7a40_9840, 0x5400_03a1, 0x9100_1c23], AllocatorFunction::Free.arguments());
    assert_eq!(at(&point), (8, true, "b.cond"));
}

#[test]
fn a_bti_landing_pad_is_passed_to_the_next_simulated_instruction() {
    // Debian 13's free: bti c ; cbz x0 ; paciasp ; stp x29, x30, [sp, #-112]!
    let point =
        placed(&[0xd503_245f, 0xb400_0ea0, 0xd503_233f, 0xa9b9_7bfd], AllocatorFunction::Free.arguments());
    assert_eq!(at(&point), (4, true, "cbz/cbnz"));
    // Debian 13's valloc: bti c ; adrp x2 ; mov x1, x0 ; ldrb w0, [x2, #1893]
    let point =
        placed(&[0xd503_245f, 0xd000_08e2, 0xaa00_03e1, 0x395d_9440], AllocatorFunction::Valloc.arguments());
    assert_eq!(at(&point), (4, true, "adr/adrp"));
    // Debian 13's mmap: bti c ; tst x5, #0xfff ; b.ne
    let point = placed(&[0xd503_245f, 0xf240_2cbf, 0x5400_0121, 0x9340_7c42], MapFunction::Mmap.arguments());
    assert_eq!(at(&point), (8, true, "b.cond"));
}

#[test]
fn paciasp_and_a_saved_link_register_keep_the_probe_at_the_entry() {
    // Debian 13's malloc: paciasp ; stp x29, x30, [sp, #-64]! ; mov x29, sp
    let point =
        placed(&[0xd503_233f, 0xa9bc_7bfd, 0x9100_03fd, 0xf900_1bf7], AllocatorFunction::Malloc.arguments());
    assert_eq!(at(&point), (0, false, "paciasp"));
    // Debian 12's malloc: stp x29, x30, [sp, #-64]! ; mov x29, sp ; stp x23, x24, [sp, #48] ; adrp
    let point =
        placed(&[0xa9bc_7bfd, 0x9100_03fd, 0xa903_63f7, 0x9000_08d7], AllocatorFunction::Malloc.arguments());
    assert_eq!(at(&point), (0, false, "stp"));
    // Debian 13's jemalloc calloc: paciasp ; sub sp, sp, #0xc0 ; adrp x4
    let point = placed(&[0xd503_233f, 0xd103_03ff, 0x9000_0424], AllocatorFunction::Calloc.arguments());
    assert_eq!(at(&point), (0, false, "paciasp"));
}

#[test]
fn a_moved_stack_pointer_or_link_register_ends_the_walk() {
    // sub sp, sp, #0x20 ; b.ne
    assert_eq!(placed(&[0xd100_83ff, 0x5400_0121], AllocatorFunction::Free.arguments()).delta, 0);
    // mov x30, x1 ; b.ne
    assert_eq!(placed(&[0xaa01_03fe, 0x5400_0121], AllocatorFunction::Free.arguments()).delta, 0);
    // str x19, [sp, #16] ; b.ne: a store
    assert_eq!(placed(&[0xf900_0bf3, 0x5400_0121], AllocatorFunction::Free.arguments()).delta, 0);
    // str q0, [sp, #16] ; b.ne: a SIMD store (opc 10)
    assert_eq!(placed(&[0x3d80_07e0, 0x5400_0121], AllocatorFunction::Free.arguments()).delta, 0);
    // ldr q0, [x1] ; b.ne: a SIMD load passes
    assert_eq!(placed(&[0x3dc0_0020, 0x5400_0121], AllocatorFunction::Free.arguments()).delta, 4);
}

#[test]
fn munmap_keeps_its_probe_where_svc_would_take_the_address() {
    // Debian 12: nop ; mov x8, #0xd7 ; svc #0 ; cmn x0, #0xfff ; b.cs: x0 is the result after svc
    let point = placed(
        &[0xd503_201f, 0xd280_1ae8, 0xd400_0001, 0xb13f_fc1f, 0x5400_0042],
        MapFunction::Munmap.arguments(),
    );
    assert_eq!(at(&point), (0, false, "nop"));
}

#[test]
fn arguments_moved_before_the_branch_are_found_where_they_went() {
    // mimalloc 3's realloc (Debian 13) without its adrp: bti c ; ldr x3, [x3, #4032] ;
    // mrs x4, tpidr_el0 ; mov x2, x1 ; mov x1, x0 ; ldr x0, [x4, x3] ; b mi_realloc
    let words = [0xd503_245f, 0xf947_e063, 0xd53b_d044, 0xaa01_03e2, 0xaa00_03e1, 0xf863_6880, 0x17ff_fb31];
    let point = placed(&words, AllocatorFunction::Realloc.arguments());
    assert_eq!(at(&point), (24, true, "b/bl"));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY.with(0, 1).with(1, 2));
}

#[test]
fn a_branch_target_inside_the_prologue_ends_the_walk() {
    // cmp x0, #0x1, lsl #12 ; mov x1, x0 ; b.hi ; b -8 (to the mov)
    let point =
        placed(&[0xf140_041f, 0xaa00_03e1, 0x5400_0048, 0x17ff_fffe], AllocatorFunction::Malloc.arguments());
    assert_eq!(at(&point), (0, false, "0xf140041f"));
}

/// What the kernel simulates under a uprobe and what it steps (Arm ARM, A64 encodings).
#[test]
fn branches_adrp_and_literal_loads_are_simulated_and_a_prologue_is_not() {
    let simulated_words = [
        (0x9400_0010, "b/bl"),     // bl +0x40
        (0x1400_0002, "b/bl"),     // b +8
        (0x5400_0041, "b.cond"),   // b.ne +8
        (0xb400_0040, "cbz/cbnz"), // cbz x0, +8
        (0xd65f_03c0, "ret"),
        (0xd61f_0200, "br"),       // br x16
        (0x9000_0000, "adr/adrp"), // adrp x0, 0
        (0x5800_0050, "ldr (literal)"),
    ];
    for (word, name) in simulated_words {
        assert_eq!(simulated(word), Some(name), "{word:#010x}");
    }
    // paciasp, bti c, stp x29, x30, [sp, #-16]!, mov x29, sp, nop, sub sp, sp, #0x20
    for word in [0xd503_233f, 0xd503_245f, 0xa9bf_7bfd, 0x9100_03fd, 0xd503_201f, 0xd100_83ff] {
        assert_eq!(simulated(word), None, "{word:#010x}");
    }
}

#[test]
fn a_literal_load_is_passed_not_probed() {
    // ldr x1, <literal> ; cbz x0: recent kernels refuse a uprobe on the load
    let point = placed(&[0x5800_0041, 0xb400_0040], AllocatorFunction::Free.arguments());
    assert_eq!(at(&point), (4, true, "cbz/cbnz"));
}

#[test]
fn single_stepped_entries_are_named() {
    for (word, expected) in
        [(0xd503_245f, "bti c"), (0xd503_233f, "paciasp"), (0xa9bc_7bfd, "stp"), (0xf900_0bf3, "str")]
    {
        assert_eq!(name(word), expected);
    }
    assert_eq!(name(0xf140_041f), "0xf140041f");
}
