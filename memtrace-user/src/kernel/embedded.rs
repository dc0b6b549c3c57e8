//! The BPF object memtrace-ebpf builds (memtrace-user/build.rs), embedded in the binary, and what
//! is checked of its code without loading it.

pub(super) static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace.bpf.o"));

#[cfg(test)]
mod tests {
    use super::*;

    /// BPF has no memcpy: a copy the compiler cannot make loads and stores of (two places that
    /// may overlap) becomes a call of compiler_builtins' `memmove`, a loop a byte. One sat on every
    /// frame of every walk, one on every allocation's record; none may come back outside the
    /// `--debug-bpf` diagnostics (memtrace-ebpf/src/debug.rs), whose records are rare.
    #[test]
    fn no_byte_by_byte_copy_but_in_the_debug_diagnostics() {
        use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget};
        let file = object::File::parse(BPF_OBJECT).expect("the embedded BPF object");
        let mut callers = std::collections::BTreeSet::new();
        for section in file.sections() {
            for (offset, relocation) in section.relocations() {
                let RelocationTarget::Symbol(index) = relocation.target() else { continue };
                let name = file.symbol_by_index(index).and_then(|symbol| symbol.name().map(str::to_owned));
                if !matches!(name.as_deref(), Ok("memmove" | "memcpy")) {
                    continue;
                }
                let caller = file
                    .symbols()
                    .filter(|symbol| symbol.section_index() == Some(section.index()) && symbol.size() > 0)
                    .find(|symbol| (symbol.address()..symbol.address() + symbol.size()).contains(&offset))
                    .and_then(|symbol| symbol.name().ok().map(str::to_owned));
                callers.insert(
                    caller.unwrap_or_else(|| format!("{}+{offset:#x}", section.name().unwrap_or("?"))),
                );
            }
        }
        let debug = ["memtrace_short_stack", "memtrace_allocation_lost", "memtrace_stack_totals_lost"];
        let outside: Vec<&String> =
            callers.iter().filter(|caller| !debug.contains(&caller.as_str())).collect();
        assert!(outside.is_empty(), "byte-by-byte copies (memmove, memcpy) called from {outside:?}");
    }
}
