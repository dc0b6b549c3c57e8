//! The bpf(2) commands memtrace issues itself, beneath both the loader (`probes`) and the
//! kernel feature probes (`kernel_features`), so that finding out what the kernel can do needs
//! nothing of the loader: the syscall returning a descriptor, BPF_PROG_LOAD's attribute and a
//! program loaded from raw instructions, a uprobe_multi link (BPF_LINK_CREATE), and what the kernel
//! says of a loaded program (`prog_info`). Nothing here knows memtrace's programs or maps.

pub mod prog_info;

use std::{
    ffi::CStr,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

const BPF_PROG_LOAD: libc::c_long = 5;
pub const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
/// uprobe_multi.flags: BPF_F_UPROBE_MULTI_RETURN.
const UPROBE_MULTI_RETURN: u32 = 1;

/// `union bpf_attr` for BPF_PROG_LOAD, up to the expected attach type: all a uprobe program needs.
#[repr(C)]
#[derive(Default)]
pub struct ProgLoadAttr {
    pub prog_type: u32,
    pub insn_cnt: u32,
    pub insns: u64,
    pub license: u64,
    pub log_level: u32,
    pub log_size: u32,
    pub log_buf: u64,
    pub kern_version: u32,
    pub prog_flags: u32,
    pub prog_name: [u8; 16],
    pub prog_ifindex: u32,
    pub expected_attach_type: u32,
    pub prog_btf_fd: u32,
    pub func_info_rec_size: u32,
    pub func_info: u64,
    pub func_info_cnt: u32,
    pub line_info_rec_size: u32,
    pub line_info: u64,
    pub line_info_cnt: u32,
    /// The kernel's next field, zero: without it the struct's padding would be read as it,
    /// whatever bytes it held (EINVAL, now and then).
    pub attach_btf_id: u32,
}

/// BPF_PROG_LOAD. The attribute's pointers (instructions, license, BTF records, log) must be valid
/// for the call: every `ProgLoadAttr` is built from live buffers by its caller.
pub fn prog_load(attr: &ProgLoadAttr) -> io::Result<OwnedFd> {
    // SAFETY: the attribute, and the instructions, license, BTF records and log it points to,
    // outlive the call.
    unsafe { bpf(BPF_PROG_LOAD, std::ptr::from_ref(attr).cast(), size_of::<ProgLoadAttr>()) }
}

/// A program the kernel refused, with the verifier's log.
#[derive(Debug)]
pub struct Refused {
    pub error: io::Error,
    pub log: String,
}

/// BPF_PROG_LOAD of a tiny program from raw instructions (8 bytes each, as the kernel reads them),
/// with the verifier's log on failure: what kernel feature probes load.
pub fn load_raw_program(
    prog_type: u32,
    expected_attach_type: u32,
    instructions: &[u64],
) -> Result<OwnedFd, Refused> {
    let mut log = vec![0u8; 1 << 16];
    let attr = ProgLoadAttr {
        prog_type,
        insn_cnt: instructions.len() as u32,
        insns: instructions.as_ptr() as u64,
        license: c"GPL".as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        expected_attach_type,
        ..ProgLoadAttr::default()
    };
    prog_load(&attr).map_err(|error| Refused { error, log: log_text(&log) })
}

/// The NUL-terminated text the kernel wrote into a log buffer.
pub fn log_text(log: &[u8]) -> String {
    String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(0)]).into_owned()
}

/// The sites of one uprobe_multi link, as BPF_LINK_CREATE takes them: file offsets, a BPF cookie
/// each and, where any site has a semaphore, a semaphore offset each (0 for none).
pub struct UprobeMulti<'a> {
    pub path: &'a CStr,
    pub offsets: &'a [u64],
    pub cookies: &'a [u64],
    /// Empty where no site has a semaphore; else one per offset.
    pub ref_ctr_offsets: &'a [u64],
    /// The process the link fires in; 0 for every process.
    pub pid: u32,
    /// At the functions' returns rather than their entries.
    pub returns: bool,
}

/// `union bpf_attr` for BPF_LINK_CREATE of a uprobe_multi link.
#[repr(C)]
#[derive(Default)]
struct UprobeMultiAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    _pad: u32,
}

/// A uprobe_multi link of `program` at `sites` (kernel 6.6+).
pub fn uprobe_multi_link(program: BorrowedFd<'_>, sites: &UprobeMulti<'_>) -> io::Result<OwnedFd> {
    let count = sites.offsets.len();
    if sites.cookies.len() != count
        || !(sites.ref_ctr_offsets.is_empty() || sites.ref_ctr_offsets.len() == count)
    {
        return Err(io::Error::other("a uprobe_multi link's arrays differ in length"));
    }
    let attr = UprobeMultiAttr {
        prog_fd: program.as_raw_fd() as u32,
        attach_type: BPF_TRACE_UPROBE_MULTI,
        path: sites.path.as_ptr() as u64,
        offsets: sites.offsets.as_ptr() as u64,
        ref_ctr_offsets: if sites.ref_ctr_offsets.is_empty() {
            0
        } else {
            sites.ref_ctr_offsets.as_ptr() as u64
        },
        cookies: sites.cookies.as_ptr() as u64,
        cnt: u32::try_from(count).map_err(|_| io::Error::other("too many probe sites in one file"))?,
        multi_flags: if sites.returns { UPROBE_MULTI_RETURN } else { 0 },
        pid: sites.pid,
        ..UprobeMultiAttr::default()
    };
    // SAFETY: the attribute and the arrays and path it points to (borrowed by `sites`, each of
    // `cnt` entries) outlive the call; its size is passed along.
    unsafe { bpf(BPF_LINK_CREATE, std::ptr::from_ref(&attr).cast(), size_of::<UprobeMultiAttr>()) }
}

/// bpf(2) for a command that returns a new descriptor.
///
/// # Safety
/// `attr` points to `size` bytes of the command's attribute, whose pointers are valid for the call.
pub unsafe fn bpf(command: libc::c_long, attr: *const u8, size: usize) -> io::Result<OwnedFd> {
    // SAFETY: as the caller promises; the result is a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, command, attr, size as u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_layouts_match_the_kernel() {
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, prog_name), 48);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, expected_attach_type), 68);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, func_info), 80);
        assert_eq!(std::mem::offset_of!(ProgLoadAttr, line_info_cnt), 104);
        // No padding: every byte passed is a field the kernel reads.
        assert_eq!(size_of::<ProgLoadAttr>(), std::mem::offset_of!(ProgLoadAttr, attach_btf_id) + 4);
        assert_eq!(std::mem::offset_of!(UprobeMultiAttr, path), 16);
        assert_eq!(std::mem::offset_of!(UprobeMultiAttr, cnt), 48);
        assert_eq!(std::mem::offset_of!(UprobeMultiAttr, pid), 56);
    }
}
