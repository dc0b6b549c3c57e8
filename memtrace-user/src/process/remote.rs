//! Reading another process's memory (process_vm_readv(2)), a few words at a time, for facts only
//! its memory holds (the header of a glibc arena, of a block glibc mapped). Never writing it.

use std::io::IoSliceMut;

use nix::{
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};

/// Where words of a process's memory can be read; a test stands in for a process with a map.
pub trait ReadWords {
    /// The 64-bit word at `address`, or None where it cannot be read.
    fn word(&self, address: u64) -> Option<u64>;
}

/// The memory of a live process.
pub struct RemoteMemory {
    pid: Pid,
}

impl RemoteMemory {
    pub fn of(pid: u32) -> Self {
        Self { pid: Pid::from_raw(pid as i32) }
    }
}

impl ReadWords for RemoteMemory {
    fn word(&self, address: u64) -> Option<u64> {
        let mut bytes = [0u8; 8];
        let remote = [RemoteIoVec { base: address as usize, len: 8 }];
        let read = process_vm_readv(self.pid, &mut [IoSliceMut::new(&mut bytes)], &remote).ok()?;
        (read == 8).then(|| u64::from_ne_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_word_of_this_process_reads_back() {
        let word: u64 = 0x1122_3344_5566_7788;
        let memory = RemoteMemory::of(std::process::id());
        assert_eq!(memory.word(&word as *const u64 as u64), Some(word));
        assert_eq!(memory.word(8), None, "page zero is never mapped");
    }
}
