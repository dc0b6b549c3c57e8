//! Every BPF program of memtrace-ebpf, named once for both sides: its name (the function's, which
//! is the program's in the object), its kind (the ELF section aya-ebpf's attribute puts it in) and
//! what attaches it. memtrace-user's build script reads the built object and fails the build where
//! a program is missing from this table, missing from the object, or of another kind, so a
//! renamed or retyped program is found when building, not when the kernel refuses a load.

/// A program's kind, as its section in the object says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgramKind {
    /// `#[uprobe]`: section `uprobe`.
    Uprobe,
    /// `#[uprobe(sleepable)]`: section `uprobe.s`.
    SleepableUprobe,
    /// `#[uretprobe]`: section `uretprobe`.
    Uretprobe,
    /// `#[raw_tracepoint(tracepoint = "...")]`: section `raw_tp/<tracepoint>`.
    RawTracepoint(&'static str),
    /// `#[fentry(function = "...")]`: section `fentry/<function>`.
    Fentry(&'static str),
}

impl ProgramKind {
    /// Whether a program in ELF section `section` is of this kind.
    pub fn is_section(self, section: &str) -> bool {
        match self {
            ProgramKind::Uprobe => section == "uprobe",
            ProgramKind::SleepableUprobe => section == "uprobe.s",
            ProgramKind::Uretprobe => section == "uretprobe",
            ProgramKind::RawTracepoint(tracepoint) => section.strip_prefix("raw_tp/") == Some(tracepoint),
            ProgramKind::Fentry(function) => section.strip_prefix("fentry/") == Some(function),
        }
    }
}

/// One program: its name, its kind, and what attaches it (for the reader; the attaching code
/// names the program by this constant).
#[derive(Clone, Copy, Debug)]
pub struct Program {
    pub name: &'static str,
    pub kind: ProgramKind,
    pub attached_at: &'static str,
}

pub const ALLOC_ENTER: Program = Program {
    name: "alloc_enter",
    kind: ProgramKind::Uprobe,
    attached_at: "every allocator entry point of a traced process's allocators",
};
pub const ALLOC_EXIT: Program = Program {
    name: "alloc_exit",
    kind: ProgramKind::Uretprobe,
    attached_at: "the return of every allocator entry point that returns a block",
};
pub const EMPTY_ENTER: Program = Program {
    name: "empty_enter",
    kind: ProgramKind::Uprobe,
    attached_at: "alloc_enter's points, instead of it, under --empty-probes (the bench's floor)",
};
pub const EMPTY_EXIT: Program = Program {
    name: "empty_exit",
    kind: ProgramKind::Uretprobe,
    attached_at: "alloc_exit's points, instead of it, under --empty-probes",
};
pub const MAP_ENTER: Program = Program {
    name: "map_enter",
    kind: ProgramKind::Uprobe,
    attached_at: "the C library's mmap, munmap and mremap",
};
pub const MAP_EXIT: Program = Program {
    name: "map_exit",
    kind: ProgramKind::Uretprobe,
    attached_at: "the returns of mmap, munmap and mremap",
};
pub const SAMPLED_SITE: Program = Program {
    name: "sampled_site",
    kind: ProgramKind::Uprobe,
    attached_at: "the sampled allocator's own sites (--app-sampled)",
};
pub const USDT_SITE: Program =
    Program { name: "usdt_site", kind: ProgramKind::SleepableUprobe, attached_at: "every USDT site traced" };
pub const FORK_RETURN: Program = Program {
    name: "fork_return",
    kind: ProgramKind::Uretprobe,
    attached_at: "the C library's fork, in a followed tree",
};
pub const LIBRARY_LOADED: Program = Program {
    name: "library_loaded",
    kind: ProgramKind::Uretprobe,
    attached_at: "the C library's dlopen and dlmopen, for traced processes whose stacks unwind from tables",
};
pub const PROCESS_FORK: Program = Program {
    name: "process_fork",
    kind: ProgramKind::RawTracepoint("sched_process_fork"),
    attached_at: "the kernel, while children are followed",
};
pub const PROCESS_EXEC: Program = Program {
    name: "process_exec",
    kind: ProgramKind::RawTracepoint("sched_process_exec"),
    attached_at: "the kernel, while execs are followed or held",
};
pub const PROCESS_EXIT: Program = Program {
    name: "process_exit",
    kind: ProgramKind::RawTracepoint("sched_process_exit"),
    attached_at: "the kernel, in every run",
};
pub const OOM_VICTIM: Program = Program {
    name: "oom_victim",
    kind: ProgramKind::RawTracepoint("mark_victim"),
    attached_at: "the kernel, where the OOM killer's tracepoint exists",
};
pub const EXIT_BEGINS: Program = Program {
    name: "exit_begins",
    kind: ProgramKind::Fentry("do_exit"),
    attached_at: "the kernel's do_exit, where fentry works, to read an exiting process's memory",
};

/// Every program of the object.
pub const ALL: [Program; 15] = [
    ALLOC_ENTER,
    ALLOC_EXIT,
    EMPTY_ENTER,
    EMPTY_EXIT,
    MAP_ENTER,
    MAP_EXIT,
    SAMPLED_SITE,
    USDT_SITE,
    FORK_RETURN,
    LIBRARY_LOADED,
    PROCESS_FORK,
    PROCESS_EXEC,
    PROCESS_EXIT,
    OOM_VICTIM,
    EXIT_BEGINS,
];

/// What is wrong with an object whose programs are `found` (name and section), against `ALL`.
pub fn mismatch<'a>(found: impl Iterator<Item = (&'a str, &'a str)> + Clone) -> Option<Mismatch<'a>> {
    for (name, section) in found.clone() {
        match ALL.iter().find(|program| program.name == name) {
            None => return Some(Mismatch::Unlisted { name, section }),
            Some(program) if !program.kind.is_section(section) => {
                return Some(Mismatch::OtherKind { program: *program, section })
            }
            Some(_) => {}
        }
    }
    ALL.iter()
        .find(|program| !found.clone().any(|(name, _)| name == program.name))
        .map(|p| Mismatch::Missing(*p))
}

/// Why an object does not match the table.
#[derive(Debug)]
pub enum Mismatch<'a> {
    /// The object has a program the table does not list.
    Unlisted { name: &'a str, section: &'a str },
    /// The object's program is of another kind than the table says.
    OtherKind { program: Program, section: &'a str },
    /// The table lists a program the object does not have.
    Missing(Program),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The object's programs as the table describes them.
    fn sections() -> [(&'static str, &'static str); ALL.len()] {
        ALL.map(|program| {
            let section = match program.kind {
                ProgramKind::Uprobe => "uprobe",
                ProgramKind::SleepableUprobe => "uprobe.s",
                ProgramKind::Uretprobe => "uretprobe",
                ProgramKind::RawTracepoint("sched_process_fork") => "raw_tp/sched_process_fork",
                ProgramKind::RawTracepoint("sched_process_exec") => "raw_tp/sched_process_exec",
                ProgramKind::RawTracepoint("sched_process_exit") => "raw_tp/sched_process_exit",
                ProgramKind::RawTracepoint("mark_victim") => "raw_tp/mark_victim",
                ProgramKind::Fentry("do_exit") => "fentry/do_exit",
                other => panic!("a kind this test does not know: {other:?}"),
            };
            (program.name, section)
        })
    }

    #[test]
    fn an_object_as_the_table_says_matches() {
        assert!(mismatch(sections().into_iter()).is_none());
    }

    #[test]
    fn a_program_renamed_retyped_or_dropped_is_named() {
        let mut renamed = sections();
        renamed[1].0 = "alloc_return";
        assert!(matches!(
            mismatch(renamed.into_iter()),
            Some(Mismatch::Unlisted { name: "alloc_return", .. })
        ));
        let mut retyped = sections();
        retyped[1].1 = "uprobe";
        assert!(matches!(
            mismatch(retyped.into_iter()),
            Some(Mismatch::OtherKind { program: Program { name: "alloc_exit", .. }, section: "uprobe" })
        ));
        let dropped = &sections()[..ALL.len() - 1];
        assert!(matches!(
            mismatch(dropped.iter().copied()),
            Some(Mismatch::Missing(Program { name: "exit_begins", .. }))
        ));
    }
}
