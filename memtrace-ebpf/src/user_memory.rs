//! Reads of a traced process's memory, for the interpreters' frames (interpreters/): each
//! checks the user address and fails rather than faults. Nothing is ever written there.

use core::ffi::c_void;

use aya_ebpf::helpers::{bpf_probe_read_user, generated};

/// A word of the traced process at `address`.
pub(crate) fn read_user(address: u64) -> Option<u64> {
    // SAFETY: the helper checks the user address and fails rather than faults.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}

/// Words of the traced process at `address` into `into` (a map value); false if unreadable.
pub(crate) fn read_user_into<const N: usize>(into: &mut [u64; N], address: u64) -> bool {
    read_bytes_raw(into.as_mut_ptr().cast(), address, (N * 8) as u64)
}

/// `len` bytes (at most `N`) of the traced process at `address` into `into`.
pub(crate) fn read_bytes<const N: usize>(into: &mut [u8; N], address: u64, len: u64) -> bool {
    len <= N as u64 && read_bytes_raw(into.as_mut_ptr().cast(), address, len)
}

/// A NUL-terminated string of the traced process at `address` into `into`, cut to fit and always
/// NUL-terminated; nothing where it cannot be read.
pub(crate) fn read_string<const N: usize>(into: &mut [u8; N], address: u64) {
    // SAFETY: the helper writes at most N bytes into `into`, NUL-terminated, and checks the user
    // address, failing rather than faulting.
    unsafe {
        generated::bpf_probe_read_user_str(into.as_mut_ptr().cast(), N as u32, address as *const c_void)
    };
}

fn read_bytes_raw(into: *mut c_void, address: u64, len: u64) -> bool {
    // SAFETY: callers pass a destination of at least `len` bytes; the helper checks the user
    // address and fails rather than faults.
    unsafe { generated::bpf_probe_read_user(into, len as u32, address as *const c_void) == 0 }
}
