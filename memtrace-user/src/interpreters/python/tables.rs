//! CPython's two tables in the kernel, named for kernel/interpreter_tables.rs's operations.

use memtrace_common::{InterpreterCodeKey, PythonCode, PythonProcess};

use crate::kernel::{
    interpreter_tables::InterpreterTables,
    tables::{Table, PYTHON_CODES, PYTHON_PROCESSES},
};

/// CPython's tables in the kernel.
pub struct Python;

impl InterpreterTables for Python {
    type Process = PythonProcess;
    type Code = PythonCode;
    const PROCESSES: Table<u32, PythonProcess> = PYTHON_PROCESSES;
    const CODES: Table<InterpreterCodeKey, PythonCode> = PYTHON_CODES;

    fn complete(code: &PythonCode) -> bool {
        code.complete != 0
    }
}
