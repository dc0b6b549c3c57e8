//! Which object files are a Perl interpreter whose frames the kernel side can read, and where in a
//! process that maps one its interpreter lies: from what perl exports (`PL_curinterp`, the main
//! thread's interpreter; `PL_thr_key`, the thread-specific key each thread's interpreter is kept
//! under; `PL_revision`, `PL_version` and `PL_subversion`, which say the version),
//! no debug symbols. A version's struct layout is known here (5.36, from its headers); a perl of
//! another version is named (`PerlImage::version`) but not read.

use memtrace_common::{PerlLayout, PerlProcess, ThreadKeys};

use crate::process::elf::{load_bias, ElfObject};

/// A Perl interpreter's file (Debian's /usr/bin/perl, or a libperl.so), as its symbols describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerlImage {
    /// (revision, version, subversion): 5.36.0 is (5, 36, 0).
    pub version: (u8, u8, u8),
    /// The virtual address of `PL_curinterp` in the file.
    curinterp: u64,
    /// The virtual address of `PL_thr_key` (a perl built with threads has one).
    thr_key: Option<u64>,
    /// The file's PT_LOAD segments: (file offset, virtual address, bytes in the file).
    segments: Vec<(u64, u64, u64)>,
}

impl PerlImage {
    /// The interpreter `elf` is, if it exports Perl's interpreter pointer and version.
    pub fn of(elf: &ElfObject<'_>) -> Option<Self> {
        let curinterp = elf.defined_data("PL_curinterp")?;
        let byte = |name: &str| elf.bytes_at(elf.defined_data(name)?, 1)?.first().copied();
        let version = (byte("PL_revision")?, byte("PL_version")?, byte("PL_subversion")?);
        let thr_key = elf.defined_data("PL_thr_key");
        Some(Self { version, curinterp, thr_key, segments: elf.load_segments() })
    }

    /// What the kernel side reads in a process that maps this file at `start` from file offset
    /// `file_offset` (one of its mappings); None for a version whose layout memtrace lacks. Its
    /// threads are read once the C library's keys are known ([`with_thread_keys`]).
    pub fn in_process(&self, start: u64, file_offset: u64) -> Option<PerlProcess> {
        let layout = layout((self.version.0, self.version.1))?;
        let bias = load_bias(&self.segments, start, file_offset)?;
        let thr_key = self.thr_key.map_or(0, |key| bias.wrapping_add(key));
        Some(PerlProcess {
            curinterp: bias.wrapping_add(self.curinterp),
            thr_key,
            layout,
            ..Default::default()
        })
    }
}

/// `process` with the thread-specific keys of the C library it maps, so that each thread's
/// interpreter is found (where either is unknown, only the main thread's is read).
pub fn with_thread_keys(process: PerlProcess, keys: Option<ThreadKeys>) -> PerlProcess {
    match keys {
        Some(keys) if process.thr_key != 0 => PerlProcess { keys, ..process },
        _ => PerlProcess { thr_key: 0, ..process },
    }
}

/// The layout of a Perl version memtrace reads.
pub fn layout(version: (u8, u8)) -> Option<PerlLayout> {
    match version {
        // intrpvar.h, cop.h, cv.h, gv.h, hv.h and sv.h of 5.36 (offsetof, as compiled for x86-64
        // against Debian's perl headers, /usr/lib/x86_64-linux-gnu/perl/5.36/CORE, with
        // `perl -MExtUtils::Embed -e ccopts`: threads and multiplicity). Compiled the same way
        // for arm64 against Debian 12's libperl-dev:arm64 headers, every offset is the same but
        // `Iphase`'s, which lies past the interpreter's `Istart_env` (a JMPENV, whose sigjmp_buf
        // is larger on arm64).
        (5, 36) => Some(PerlLayout {
            interp_curcop: 208,
            interp_curstackinfo: 224,
            interp_phase: if cfg!(target_arch = "aarch64") { 2608 } else { 2512 },
            phase_run: 4,
            si_cxstack: 8,
            si_prev: 16,
            si_cxix: 32,
            context_size: 104,
            context_oldcop: 16,
            context_sub_cv: 72,
            type_sub: 9,
            type_eval: 11,
            type_mask: 15,
            op_require: 342,
            cop_line: 36,
            cop_file: 48,
            cv_gv: 56,
            cv_file: 64,
            cv_flags: 92,
            cv_stash: 32,
            cv_named: 0x8000,
            gv_name: 32,
            gv_stash: 40,
            // xpvhv_with_aux.xhv_aux (32) . xhv_name_u (0) and . xhv_name_count (28)
            stash_name: 32,
            stash_name_count: 60,
            hek_key: 8,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debians_perl_is_found_with_its_version() {
        let data = std::fs::read("/usr/bin/perl").expect("Debian 12's perl");
        let elf = ElfObject::parse(&data).unwrap();
        let image = PerlImage::of(&elf).expect("perl exports PL_curinterp and its version");
        assert_eq!(image.version, (5, 36, 0));
        let process = image.in_process(0x5555_0000_0000, 0).unwrap();
        assert_ne!(process.thr_key, 0, "Debian's perl has threads: {process:?}");
        // Without the C library's keys, no thread but the main one is read.
        assert_eq!(with_thread_keys(process, None).thr_key, 0);
    }
}
