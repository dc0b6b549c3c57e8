//! Perl's two tables in the kernel, named for kernel/interpreter_tables.rs's operations.

use memtrace_common::{InterpreterCodeKey, PerlProcess, PerlSub};

use crate::kernel::{
    interpreter_tables::InterpreterTables,
    tables::{Table, PERL_PROCESSES, PERL_SUBS},
};

/// Perl's tables in the kernel.
pub struct Perl;

impl InterpreterTables for Perl {
    type Process = PerlProcess;
    type Code = PerlSub;
    const PROCESSES: Table<u32, PerlProcess> = PERL_PROCESSES;
    const CODES: Table<InterpreterCodeKey, PerlSub> = PERL_SUBS;

    fn complete(sub: &PerlSub) -> bool {
        sub.complete != 0
    }
}
