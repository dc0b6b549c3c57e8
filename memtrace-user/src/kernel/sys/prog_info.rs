//! What the kernel says of a loaded program (BPF_OBJ_GET_INFO_BY_FD): how often it skipped a run,
//! and which of its functions it kept.
//!
//! The kernel does not run a program on a CPU where it is already running (raw tracepoints, the
//! recursion guard of each program); it counts each such run in `recursion_misses` (5.12+). A run
//! that did not happen is an event not recorded, so the collector counts these as lost.

use std::{io, os::fd::AsRawFd, os::fd::BorrowedFd};

use aya_obj::generated::{bpf_func_info, bpf_prog_info};

const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// `union bpf_attr` for BPF_OBJ_GET_INFO_BY_FD.
#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// The program's information, with `func_info` pointing at `func_info_len` records if not null,
/// and how many bytes of it the kernel filled (its own struct's size: older kernels fill less).
fn program_info(
    program: BorrowedFd<'_>,
    func_info: *mut bpf_func_info,
    func_info_len: u32,
) -> io::Result<(bpf_prog_info, u32)> {
    // SAFETY: bpf_prog_info is plain old data; all zeroes is a valid value.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    if !func_info.is_null() {
        info.nr_func_info = func_info_len;
        info.func_info_rec_size = size_of::<bpf_func_info>() as u32;
        info.func_info = func_info as u64;
    }
    let mut attr = InfoAttr {
        bpf_fd: program.as_raw_fd() as u32,
        info_len: size_of::<bpf_prog_info>() as u32,
        info: std::ptr::from_mut(&mut info) as u64,
    };
    // SAFETY: the attribute points to `info`, which outlives the call, with its size, and `info` to
    // at most `func_info_len` records; the kernel writes no more than that.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            std::ptr::from_mut(&mut attr),
            size_of::<InfoAttr>(),
        )
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((info, attr.info_len))
}

/// How many bytes of `struct bpf_prog_info` this kernel fills: which of its fields it has.
pub fn info_size(program: BorrowedFd<'_>) -> io::Result<u32> {
    Ok(program_info(program, std::ptr::null_mut(), 0)?.1)
}

/// The runs of the program the kernel skipped since it was loaded; 0 where the kernel does not
/// count them (before 5.12).
pub fn recursion_misses(program: BorrowedFd<'_>) -> io::Result<u64> {
    Ok(program_info(program, std::ptr::null_mut(), 0)?.0.recursion_misses)
}

/// The BTF types of the program's functions, in the order they lie in it, as the verifier kept
/// them (it drops a function only dead code calls).
pub fn function_types(program: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let count = program_info(program, std::ptr::null_mut(), 0)?.0.nr_func_info;
    let mut records = vec![bpf_func_info { insn_off: 0, type_id: 0 }; count as usize];
    program_info(program, records.as_mut_ptr(), count)?;
    Ok(records.iter().map(|record| record.type_id).collect())
}
