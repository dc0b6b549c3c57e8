//! Which pages of another process are resident, from /proc/PID/pagemap: one 64-bit entry a page,
//! bit 63 set while the page is present in memory, bit 62 while it is swapped out (mincore(2)
//! answers for the caller's own memory only). Readable as root; reading it changes nothing in the
//! target.

use std::{fs::File, os::unix::fs::FileExt};

const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
/// Entries read at once: 512 KiB of entries for 256 MiB of address space.
const CHUNK_PAGES: u64 = 65_536;

pub struct Pagemap {
    file: File,
    page_size: u64,
}

/// Pages of a range by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageCounts {
    pub present: u64,
    pub swapped: u64,
}

impl Pagemap {
    /// None when the process has gone or pagemap is not readable.
    pub fn open(pid: u32, page_size: u64) -> Option<Self> {
        let file = File::open(format!("/proc/{pid}/pagemap")).ok()?;
        Some(Self { file, page_size })
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Whether each page of [start, end) is present, lowest first (`start` and `end` page-aligned);
    /// pages the kernel does not answer for count as absent.
    pub fn present(&self, start: u64, end: u64) -> Vec<bool> {
        let mut present = Vec::with_capacity(((end - start) / self.page_size) as usize);
        self.each_entry(start, end, |entry| present.push(entry & PRESENT != 0));
        present
    }

    /// The present and swapped pages of [start, end).
    pub fn count(&self, start: u64, end: u64) -> PageCounts {
        let mut counts = PageCounts::default();
        self.each_entry(start, end, |entry| {
            counts.present += u64::from(entry & PRESENT != 0);
            counts.swapped += u64::from(entry & SWAPPED != 0);
        });
        counts
    }

    fn each_entry(&self, start: u64, end: u64, mut each: impl FnMut(u64)) {
        let pages = end.saturating_sub(start) / self.page_size;
        let mut buffer = vec![0u8; (pages.min(CHUNK_PAGES) * 8) as usize];
        let mut done = 0;
        while done < pages {
            let chunk = (pages - done).min(CHUNK_PAGES);
            let bytes = &mut buffer[..(chunk * 8) as usize];
            let offset = (start / self.page_size + done) * 8;
            let read = self.file.read_at(bytes, offset).unwrap_or(0) / 8;
            for entry in bytes.chunks_exact(8).take(read) {
                each(u64::from_ne_bytes(entry.try_into().expect("8 bytes")));
            }
            for _ in read as u64..chunk {
                each(0);
            }
            done += chunk;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touched_pages_are_present_and_untouched_ones_are_not() {
        let page = crate::process::procfs::page_size();
        let len = 8 * page as usize;
        // SAFETY: a fresh private anonymous mapping of our own, unmapped below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: pages 1 and 5 lie inside the mapping made above.
        unsafe {
            *(base as *mut u8).add(page as usize) = 1;
            *(base as *mut u8).add(5 * page as usize) = 1;
        }
        let start = base as u64;
        let Some(pagemap) = Pagemap::open(std::process::id(), page) else { return };
        let present = pagemap.present(start, start + len as u64);
        assert_eq!(present, [false, true, false, false, false, true, false, false]);
        assert_eq!(pagemap.count(start, start + len as u64), PageCounts { present: 2, swapped: 0 });
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(base, len) };
    }
}
