//! What the OS says about a process, read from /proc.

use std::{fs, path::PathBuf};

/// The process (thread group) a pid or thread id belongs to.
pub fn tgid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:"))?.trim().parse().ok()
}

/// The kernel's short name of the process (at most 15 bytes).
pub fn comm(pid: u32) -> Option<String> {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_owned())
}

/// Resident set size in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let statm = fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    parse_statm_resident_pages(&statm).map(|pages| pages * page_size())
}

fn parse_statm_resident_pages(statm: &str) -> Option<u64> {
    statm.split_ascii_whitespace().nth(1)?.parse().ok()
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// A file-backed mapping of /proc/PID/maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub executable: bool,
    pub file_offset: u64,
    /// The path as the target sees it (its own mount namespace).
    pub path: PathBuf,
}

pub fn mappings(pid: u32) -> std::io::Result<Vec<Mapping>> {
    Ok(parse_maps(&fs::read_to_string(format!("/proc/{pid}/maps"))?))
}

fn parse_maps(maps: &str) -> Vec<Mapping> {
    maps.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let _device = fields.next()?;
    let _inode = fields.next()?;
    let path = fields.next()?.trim_start();
    if !path.starts_with('/') {
        return None;
    }
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        file_offset: u64::from_str_radix(offset, 16).ok()?,
        path: PathBuf::from(path.strip_suffix(" (deleted)").unwrap_or(path)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn maps_lines_keep_file_backed_mappings() {
        let maps = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fe:01 1234    /usr/bin/demo
7f1c2a828000-7f1c2a9bd000 r-xp 00028000 fe:01 5678    /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2aa00000-7f1c2aa21000 rw-p 00000000 00:00 0       [heap]
7f1c2ab00000-7f1c2ab01000 rw-p 00000000 00:00 0
7f1c2ac00000-7f1c2ac01000 r-xp 00001000 fe:01 99      /tmp/my lib.so (deleted)
";
        let mappings = parse_maps(maps);
        assert_eq!(mappings.len(), 3);
        assert_eq!(mappings[1].start, 0x7f1c2a828000);
        assert!(mappings[1].executable);
        assert_eq!(mappings[1].file_offset, 0x28000);
        assert_eq!(mappings[1].path, Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!mappings[0].executable);
        assert_eq!(mappings[2].path, Path::new("/tmp/my lib.so"));
    }

    #[test]
    fn statm_second_field_is_resident_pages() {
        assert_eq!(parse_statm_resident_pages("2000 345 100 10 0 400 0\n"), Some(345));
        assert_eq!(parse_statm_resident_pages("garbage"), None);
    }

    #[test]
    fn own_process_is_readable() {
        let pid = std::process::id();
        assert_eq!(tgid(pid), Some(pid));
        assert!(rss_bytes(pid).unwrap() > 0);
        assert!(!comm(pid).unwrap().is_empty());
        assert!(mappings(pid).unwrap().iter().any(|m| m.executable));
    }
}
