//! Tests of arm64 unwind rows on real arm64 files: Debian 12's arm64 libc (libc6-arm64-cross)
//! against gimli at every row and against the disassembly of `strdup`, and tests/fixtures/
//! arm64_chain.c cross-compiled without frame pointers, with and without pointer authentication,
//! against its disassembly (`aarch64-linux-gnu-objdump -d`). Both files' first PT_LOAD maps offset
//! 0 at address 0, so a file offset here is the address objdump prints.

use std::{path::Path, process::Command};

use memtrace_common::{unwind_kind, unwind_ra, UnwindRow};
use object::{Object, ObjectSymbol};

use super::{build::build_table, index::UnwindTable, rows};

const ARM64_LIBC: &str = "/usr/aarch64-linux-gnu/lib/libc.so.6";

fn read(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!("{path}: {e} (the arm64 unwind tests need gcc-aarch64-linux-gnu and libc6-dev-arm64-cross)")
    })
}

/// A stepping row with CFA = sp + `cfa_offset`, return address rule `ra`, x29 slot `rbp`.
fn sp_row(cfa_offset: u16, ra: u8, rbp: i8) -> (u8, u16, i8) {
    (UnwindRow::kind_of(unwind_kind::CFA_RSP, ra), cfa_offset, rbp)
}

/// The rule the table gives at each address, as (kind, cfa_offset, rbp).
fn rules_at(table: &UnwindTable, addresses: &[u64]) -> Vec<(u8, u16, i8)> {
    addresses
        .iter()
        .map(|&pc| table.lookup(pc).map_or((unwind_kind::NONE, 0, 0), |r| (r.kind, r.cfa_offset, r.rbp)))
        .collect()
}

#[test]
fn arm64_libc_builds_and_agrees_with_gimli_at_every_row() {
    let data = read(ARM64_LIBC);
    let (table, stats) = build_table(&data).unwrap();
    assert!(stats.fdes > 3000 && stats.corrupt_entries == 0, "{stats:?}");
    let checked = rows::check_against_gimli(&data, &table).unwrap();
    let count = |f: &dyn Fn(&UnwindRow) -> bool| table.rows.iter().filter(|r| f(r)).count();
    let records = count(&|r| r.ra_rule() == unwind_ra::FRAME_RECORD);
    let links = count(&|r| r.ra_rule() == unwind_ra::LINK_REGISTER && r.kind != unwind_kind::NONE);
    let unsupported = count(&|r| r.kind == unwind_kind::UNSUPPORTED);
    println!("{ARM64_LIBC}: {} rows, {checked} addresses checked, {stats:?}", table.rows.len());
    println!("frame records {records}, in x30 {links}, unsupported {unsupported}");
    assert!(checked > 20_000, "only {checked} addresses checked");
    // Debian 12's (2.36-8cross1), merged: 12,684 rows, 4,298 with x30 in the x29/x30 frame
    // record, 5,886 with it still in x30, 176 unsupported (853 ranges before merging: frames
    // whose record lies beyond the 1,016 bytes an i8 of x29 units reaches, x0-based CFAs).
    assert!(records * 4 > table.rows.len(), "{records} frame records of {}", table.rows.len());
    assert!(links * 5 > table.rows.len(), "{links} rows in x30 of {}", table.rows.len());
    assert!(unsupported * 20 < table.rows.len(), "{unsupported} unsupported of {}", table.rows.len());
    // __libc_start_main's caller, _start, is in the executable; libc's outermost frames are
    // its thread start (clone's child: x30 undefined).
    assert!(table.rows.iter().any(|r| r.kind == unwind_kind::END), "no outermost frame");
}

/// strdup in Debian 12's arm64 libc 2.36 (libc6-arm64-cross 2.36-8cross1):
///
/// ```text
/// 95770: stp x29, x30, [sp, #-32]!   CFA = sp + 32 after it; x29 at CFA-32 (units -4), x30 at CFA-24
/// 95774: mov x29, sp
/// 95778: stp x19, x20, [sp, #16]
/// 95780: bl  strlen
/// 9578c: bl  malloc@plt
/// 957a0: ldp x29, x30, [sp], #32     CFA = sp from 957a4 (the tail call to memcpy)
/// 957a4: b   memcpy
/// 957a8: ldp x19, x20, [sp, #16]     the frame again (the NULL path's epilogue)
/// 957ac: ldp x29, x30, [sp], #32
/// 957b0: ret                         CFA = sp; x30 holds the return address
/// ```
#[test]
fn arm64_libc_strdup_rows_match_its_disassembly() {
    let (table, _) = build_table(&read(ARM64_LIBC)).unwrap();
    let leaf = sp_row(0, unwind_ra::LINK_REGISTER, 0);
    // x30 at CFA-24 is right above x29's slot at CFA-32 = CFA + 8 * -4: a frame record.
    let framed = sp_row(32, unwind_ra::FRAME_RECORD, -4);
    let at = [0x95770, 0x95774, 0x95790, 0x957a3, 0x957a4, 0x957a8, 0x957af, 0x957b0, 0x957b3];
    let want = [leaf, framed, framed, framed, leaf, framed, framed, leaf, leaf];
    assert_eq!(rules_at(&table, &at), want);
}

/// Cross-compiles tests/fixtures/arm64_chain.c with `flags` into `dir`.
fn compile_arm64_fixture(dir: &Path, name: &str, flags: &[&str]) -> Vec<u8> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/arm64_chain.c");
    let program = dir.join(name);
    let status = Command::new("aarch64-linux-gnu-gcc")
        .args(flags)
        .arg("-o")
        .arg(&program)
        .arg(&source)
        .status()
        .expect("run aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu)");
    assert!(status.success(), "aarch64-linux-gnu-gcc failed on {}", source.display());
    std::fs::read(&program).unwrap()
}

/// The address of function `name` in an ELF file's symbol table.
fn symbol(data: &[u8], name: &str) -> u64 {
    let file = object::File::parse(data).unwrap();
    let symbol = file.symbols().find(|s| s.name() == Ok(name));
    symbol.unwrap_or_else(|| panic!("no symbol {name}")).address()
}

/// GCC 12 at -O2 -fomit-frame-pointer saves x30 alone (`str x30, [sp, #-16]!`: CFA-16, rule 1) in
/// grab; with -mbranch-protection=standard it signs it first (`paciasp`, which the CFI marks with
/// DW_CFA_AARCH64_negate_ra_state) and authenticates it before `ret` (`autiasp`):
///
/// ```text
/// plain                              with pointer authentication
/// grab+0:  str x30, [sp, #-16]!      grab+0:  paciasp
/// grab+4:  bl  malloc@plt            grab+4:  str x30, [sp, #-16]!
/// ...                                grab+8:  bl  malloc@plt
/// grab+20: ldr x30, [sp], #16        ...
/// grab+24: ret                       grab+24: ldr x30, [sp], #16
///                                    grab+28: autiasp
///                                    grab+32: ret
/// ```
#[test]
fn arm64_fixture_rows_match_its_disassembly_with_and_without_pointer_authentication() {
    let dir = std::env::temp_dir().join(format!("memtrace-arm64-unwind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = compile_arm64_fixture(&dir, "plain", &["-O2", "-fomit-frame-pointer"]);
    let signed = compile_arm64_fixture(
        &dir,
        "signed",
        &["-O2", "-fomit-frame-pointer", "-mbranch-protection=standard"],
    );
    std::fs::remove_dir_all(&dir).ok();
    let leaf = sp_row(0, unwind_ra::LINK_REGISTER, 0);
    // x30 at CFA-16 = CFA - 8 * (1 + 1).
    let saved = sp_row(16, 1, 0);
    // The rule changes after the instruction: x30 is saved from the `bl` (plain grab+4, signed
    // grab+8) up to the instruction after the load that restores it (grab+24, grab+28).
    for (data, saved_from, saved_until) in [(&plain, 4, 24), (&signed, 8, 28)] {
        let (table, stats) = build_table(data).unwrap();
        assert_eq!(stats.corrupt_entries, 0, "{stats:?}");
        let grab = symbol(data, "grab");
        let at = [grab, grab + saved_from - 1, grab + saved_from, grab + saved_until - 1, grab + saved_until];
        assert_eq!(rules_at(&table, &at), [leaf, leaf, saved, saved, leaf], "grab at {grab:#x}");
        // tail_alloc is `b malloc@plt`: no frame, x30 the whole way.
        let tail = symbol(data, "tail_alloc");
        assert_eq!(rules_at(&table, &[tail]), [leaf]);
    }
}
