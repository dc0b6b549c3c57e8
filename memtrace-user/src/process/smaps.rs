//! A process's mappings with what each holds resident, from /proc/PID/smaps: the address range,
//! the protection, what backs it (a file, the brk heap, the main stack, nothing) and its anonymous
//! resident and swapped bytes. RssAnon + VmSwap of /proc/PID/status is the sum of `anonymous` and
//! `swap` over every mapping, so a classification of mappings accounts for every anonymous page.

use std::fs;

/// What backs a mapping, as the last field of its smaps header names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// No name: anonymous memory (mmap, or a .bss after its object's file mappings).
    Anonymous,
    /// `[heap]`: the brk heap.
    Heap,
    /// `[stack]`: the main thread's stack.
    MainStack,
    /// `[anon:NAME]` (prctl PR_SET_VMA_ANON_NAME; glibc 2.39+ names its arenas and thread stacks).
    Named(String),
    /// A file (its path as the process sees it).
    File(String),
    /// Any other bracketed name: `[vdso]`, `[vvar]`, ...
    Special(String),
}

/// One mapping of /proc/PID/smaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub writable: bool,
    pub executable: bool,
    /// Private (copy-on-write) rather than shared.
    pub private: bool,
    pub backing: Backing,
    /// Anonymous resident bytes (`Anonymous:`): for a private file mapping, its copied pages.
    pub anonymous: u64,
    /// Swapped-out bytes (`Swap:`).
    pub swap: u64,
}

impl Vma {
    /// Neither readable nor writable: a reservation (PROT_NONE), which holds no memory.
    pub fn is_reservation(&self) -> bool {
        !self.readable && !self.writable
    }

    /// Anonymous memory with no file or name: what mmap(MAP_ANONYMOUS | MAP_PRIVATE) makes.
    pub fn is_plain_anonymous(&self) -> bool {
        self.backing == Backing::Anonymous && self.private
    }

    /// The anonymous pages it holds, resident or swapped: its share of RssAnon + VmSwap.
    pub fn anonymous_and_swap(&self) -> u64 {
        self.anonymous + self.swap
    }

    pub fn len(&self) -> u64 {
        self.end - self.start
    }
}

/// The mappings of `pid`, lowest first; None when the process has gone, is exiting (its memory
/// released: smaps reads empty, and an empty reading would say it owns nothing), or is a kernel
/// thread.
pub fn read(pid: u32) -> Option<Vec<Vma>> {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    Some(parse(&text)).filter(|vmas| !vmas.is_empty())
}

/// Parses smaps: a header line per mapping, then `Name:   N kB` lines of which two are kept.
pub fn parse(text: &str) -> Vec<Vma> {
    let mut vmas: Vec<Vma> = Vec::new();
    for line in text.lines() {
        if let Some(vma) = parse_header(line) {
            vmas.push(vma);
            continue;
        }
        let Some(vma) = vmas.last_mut() else { continue };
        if let Some(kib) = field_kib(line, "Anonymous:") {
            vma.anonymous = kib * 1024;
        } else if let Some(kib) = field_kib(line, "Swap:") {
            vma.swap = kib * 1024;
        }
    }
    vmas
}

fn field_kib(line: &str, name: &str) -> Option<u64> {
    line.strip_prefix(name)?.trim().strip_suffix("kB")?.trim().parse().ok()
}

/// `start-end perms offset dev inode [name]`; the field lines (`Rss:`...) never parse as one.
fn parse_header(line: &str) -> Option<Vma> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?.as_bytes();
    if perms.len() != 4 {
        return None;
    }
    let _offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    let name = fields.next().unwrap_or("").trim_start();
    Some(Vma {
        start,
        end,
        readable: perms[0] == b'r',
        writable: perms[1] == b'w',
        executable: perms[2] == b'x',
        private: perms[3] == b'p',
        backing: backing_of(name),
        anonymous: 0,
        swap: 0,
    })
}

fn backing_of(name: &str) -> Backing {
    match name {
        "" => Backing::Anonymous,
        "[heap]" => Backing::Heap,
        "[stack]" => Backing::MainStack,
        _ => match name.strip_prefix("[anon:").and_then(|rest| rest.strip_suffix(']')) {
            Some(anon) => Backing::Named(anon.to_owned()),
            None if name.starts_with('[') => Backing::Special(name.to_owned()),
            None => Backing::File(name.strip_suffix(" (deleted)").unwrap_or(name).to_owned()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fe:01 1234                       /usr/bin/app
Size:                  4 kB
Anonymous:             0 kB
Swap:                  0 kB
55d0c0a03000-55d0c0a04000 rw-p 00002000 fe:01 1234                       /usr/bin/app
Anonymous:             4 kB
55d0c0a04000-55d0c1004000 rw-p 00000000 00:00 0 
Rss:                6144 kB
Anonymous:          6144 kB
Swap:                 12 kB
55d0c2000000-55d0c2100000 rw-p 00000000 00:00 0                          [heap]
Anonymous:          1024 kB
7f0000000000-7f0000021000 rw-p 00000000 00:00 0                          [anon:glibc: malloc arena]
7f0000021000-7f0004000000 ---p 00000000 00:00 0 
7fff00000000-7fff00021000 rw-p 00000000 00:00 0                          [stack]
Anonymous:            16 kB
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
VmFlags: ex
";

    #[test]
    fn every_mapping_with_its_anonymous_and_swapped_bytes() {
        let vmas = parse(SMAPS);
        assert_eq!(vmas.len(), 8);
        assert_eq!(vmas[1].backing, Backing::File("/usr/bin/app".into()));
        assert_eq!(vmas[1].anonymous, 4096);
        assert!(vmas[2].is_plain_anonymous());
        assert_eq!(vmas[2].anonymous_and_swap(), (6144 + 12) * 1024);
        assert_eq!(vmas[3].backing, Backing::Heap);
        assert_eq!(vmas[4].backing, Backing::Named("glibc: malloc arena".into()));
        assert!(vmas[5].is_reservation());
        assert_eq!(vmas[5].len(), 0x7f0004000000 - 0x7f0000021000);
        assert_eq!(vmas[6].backing, Backing::MainStack);
        assert_eq!(vmas[7].backing, Backing::Special("[vsyscall]".into()));
        let total: u64 = vmas.iter().map(Vma::anonymous_and_swap).sum();
        assert_eq!(total, (4 + 6144 + 12 + 1024 + 16) * 1024);
    }

    #[test]
    fn this_process_has_a_heap_or_anonymous_memory_and_a_stack() {
        let vmas = read(std::process::id()).unwrap();
        assert!(vmas.iter().any(|vma| vma.backing == Backing::MainStack));
        assert!(vmas.iter().any(|vma| vma.anonymous > 0));
    }
}
