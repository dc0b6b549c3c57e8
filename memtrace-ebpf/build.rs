//! Sets `bpf_target_arch` as aya-ebpf's own build does, so that code reading the saved registers
//! (arguments.rs) is compiled for the architecture whose `pt_regs` aya-ebpf binds.

fn main() -> aya_build::Result<()> {
    aya_build::emit_bpf_target_arch_cfg()
}
