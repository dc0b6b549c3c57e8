//! Probe points of real allocator entries, their bytes copied from Debian 12's libraries
//! (objdump -d), and of the libraries installed here where they are.

use memtrace_common::{arguments::register, AllocatorFunction, MapFunction};

use super::*;

fn hex(text: &str) -> Vec<u8> {
    text.split_whitespace().map(|byte| u8::from_str_radix(byte, 16).unwrap()).collect()
}

fn point(code: &str, arguments: ArgumentsRead) -> ProbePoint {
    place(&hex(code), 0x1000, arguments)
}

#[test]
fn jemalloc_malloc_probes_its_ja_with_the_size_in_place() {
    // cmp $0x1000,%rdi ; ja +0x93
    let point = point("48 81 ff 00 10 00 00 0f 87 93 00 00 00", AllocatorFunction::Malloc.arguments());
    assert_eq!((point.delta, point.emulated, point.instruction.as_str()), (7, true, "ja"));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY);
}

#[test]
fn jemalloc_free_passes_loads_and_arithmetic_to_its_jne() {
    // mov %rdi,%rax ; mov 0xa530e(%rip),%rdx ; mov %rdi,%rcx ; shr $0x1a,%rax ; and ...,%rcx ;
    // and $0xf0,%eax ; add %fs:0x0,%rax ; add %rdx,%rax ; cmp 0x1b0(%rax),%rcx ; jne
    let code = "48 89 f8 48 8b 15 0e 53 0a 00 48 89 f9 48 c1 e8 1a 48 81 e1 00 00 00 c0 25 f0 00 00 00 \
                64 48 03 04 25 00 00 00 00 48 01 d0 48 3b 88 b0 01 00 00 0f 85 8a 00 00 00";
    let point = point(code, AllocatorFunction::Free.arguments());
    assert_eq!((point.delta, point.emulated, point.instruction.as_str()), (0x30, true, "jne"));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY);
}

#[test]
fn mimalloc_malloc_finds_the_size_moved_to_rsi() {
    // mov 0xb449(%rip),%rax ; mov %rdi,%rsi ; mov %fs:(%rax),%rdi ; cmp $0x400,%rsi ; ja
    let point = point(
        "48 8b 05 49 b4 00 00 48 89 fe 64 48 8b 38 48 81 fe 00 04 00 00 77 29",
        AllocatorFunction::Malloc.arguments(),
    );
    assert_eq!((point.delta, point.emulated), (0x15, true));
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY.with(0, register::RSI));
}

#[test]
fn mimalloc_realloc_follows_both_arguments_to_its_tail_jump() {
    // mov ...(%rip),%rax ; mov %rsi,%rdx ; mov %rdi,%rsi ; mov %fs:(%rax),%rax ; mov %rax,%rdi ; jmp
    let point = point(
        "48 8b 05 49 a9 00 00 48 89 f2 48 89 fe 64 48 8b 00 48 89 c7 e9 f7 4e ff ff",
        AllocatorFunction::Realloc.arguments(),
    );
    assert_eq!((point.delta, point.instruction.as_str()), (0x14, "jmp"));
    let expected = ArgumentRegisters::AT_ENTRY.with(0, register::RSI).with(1, register::RDX);
    assert_eq!(point.registers, expected);
}

#[test]
fn mimalloc_calloc_finds_the_count_in_rax() {
    // mov ...(%rip),%rdx ; mov %rdi,%rax ; mov %fs:(%rdx),%rdi ; cmp $0x1,%rax ; je
    let point = point(
        "48 8b 15 c9 ad 00 00 48 89 f8 64 48 8b 3a 48 83 f8 01 74 08",
        AllocatorFunction::Calloc.arguments(),
    );
    assert_eq!(point.delta, 0x12);
    assert_eq!(point.registers, ArgumentRegisters::AT_ENTRY.with(0, register::RAX));
}

#[test]
fn glibc_mmap_keeps_its_flags_through_a_32_bit_copy() {
    // mov %ecx,%r10d ; test $0xfff,%r9d ; jne: flags (an int) still in rcx, and in r10
    let point = point("41 89 ca 41 f7 c1 ff 0f 00 00 75 14", MapFunction::Mmap.arguments());
    assert_eq!((point.delta, point.registers), (0xa, ArgumentRegisters::AT_ENTRY));
    // A 32-bit copy of a 64-bit argument is not the argument.
    let lengths = ArgumentsRead::wide(0b1000);
    let moved = place(&hex("41 89 ca 31 c9 75 14"), 0x1000, lengths);
    assert_eq!(moved.delta, 0, "rcx cleared and only 32 bits of it in r10: {moved:?}");
}

#[test]
fn glibc_munmap_passes_its_syscall() {
    // mov $0xb,%eax ; syscall ; cmp $-0xfff,%rax ; jae
    let point = point("b8 0b 00 00 00 0f 05 48 3d 01 f0 ff ff 73 01", MapFunction::Munmap.arguments());
    assert_eq!((point.delta, point.instruction.as_str()), (0xd, "jae"));
}

#[test]
fn a_syscall_loses_rcx() {
    // mov %rdi,%rcx ; xor %edi,%edi ; syscall ; jae: the argument was in rcx alone
    let point = point("48 89 f9 31 ff 0f 05 73 01", AllocatorFunction::Malloc.arguments());
    assert_eq!((point.delta, point.emulated), (0, false));
}

#[test]
fn glibc_mremap_moves_the_stack_first_and_stays_single_stepped() {
    // sub $0x58,%rsp ; mov %r8,0x40(%rsp)
    let point = point("48 83 ec 58 4c 89 44 24 40", MapFunction::Mremap.arguments());
    assert_eq!((point.delta, point.emulated, point.instruction.as_str()), (0, false, "sub"));
}

#[test]
fn glibc_reallocarray_multiplies_its_arguments_away() {
    // mov %rsi,%rax ; mul %rdx (rax and rdx written) ; mov %rax,%rsi ; jo
    let point = point("48 89 f0 48 f7 e2 48 89 c6 70 05", AllocatorFunction::Reallocarray.arguments());
    assert_eq!((point.delta, point.emulated), (0, false));
}

#[test]
fn glibc_free_skips_its_test() {
    let point = point("48 85 ff 0f 84 bf 00 00 00", AllocatorFunction::Free.arguments());
    assert_eq!((point.delta, point.emulated, point.instruction.as_str()), (3, true, "je"));
}

#[test]
fn a_push_is_emulated_at_the_entry() {
    // push %r12 ; push %rbp
    let point = point("41 54 55 53", AllocatorFunction::Malloc.arguments());
    assert_eq!((point.delta, point.emulated, point.instruction.as_str()), (0, true, "push"));
}

#[test]
fn a_store_ends_the_walk() {
    // mov %rdi,(%rax) ; jmp
    let point = point("48 89 38 eb 00", AllocatorFunction::Free.arguments());
    assert_eq!((point.delta, point.emulated), (0, false));
}

#[test]
fn a_branch_target_inside_the_walk_ends_it() {
    // 0: cmp $0x1,%rdi ; 4: ja +0 ... no: a loop back to +4 from +6 makes +4 a target.
    // cmp $0x1,%rdi ; xor %eax,%eax (at +4, the target) ; jne -4 (back to +4)
    let point = point("48 83 ff 01 31 c0 75 fc", AllocatorFunction::Free.arguments());
    assert_eq!(point.delta, 0, "{point:?}");
}

#[test]
fn what_the_kernel_emulates() {
    assert!(emulated(&hex("55")));
    assert!(emulated(&hex("41 57")));
    assert!(!emulated(&hex("48 50")), "push with REX.W is refused");
    assert!(emulated(&hex("90")));
    assert!(!emulated(&hex("66 90")), "an operand-size prefix is refused");
    assert!(!emulated(&hex("0f 1f 44 00 00")), "multi-byte nops are single-stepped before 6.18");
    assert!(emulated(&hex("e8 00 00 00 00")));
    assert!(emulated(&hex("f2 e9 00 00 00 00")), "bnd jmp");
    assert!(!emulated(&hex("3e 74 00")), "a segment prefix: the kernel will not probe it at all");
    assert!(!emulated(&hex("48 85 ff")));
    assert!(!emulated(&hex("c3")), "ret");
}
