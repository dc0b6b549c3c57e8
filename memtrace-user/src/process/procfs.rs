//! What the OS says about a process, read from /proc.

use std::{fs, path::PathBuf};

use crate::model::levels::OsMemory;

/// Whether process `pid` still exists (a zombie does, until it is reaped).
pub fn is_running(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The process (thread group) a pid or thread id belongs to.
pub fn tgid(pid: u32) -> Option<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| line.strip_prefix("Tgid:"))?.trim().parse().ok()
}

/// Why an existing pid cannot be traced: a kernel thread has no user memory, a zombie has exited.
pub fn untraceable(pid: u32) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (state, flags) = parse_stat_state_and_flags(&stat)?;
    let name = comm(pid).unwrap_or_default();
    if flags & PF_KTHREAD != 0 {
        return Some(format!(
            "pid {pid} ({name}) is a kernel thread: it has no user-space memory and no allocator to \
             trace; give the pid of a user program"
        ));
    }
    matches!(state, 'Z' | 'X').then(|| {
        format!(
            "pid {pid} ({name}) is a zombie: it has exited and only waits for its parent to collect its \
             exit status, so there is nothing left to trace"
        )
    })
}

/// include/linux/sched.h: the task is a kernel thread.
const PF_KTHREAD: u64 = 0x0020_0000;

/// The state letter and the flags of /proc/PID/stat (fields 3 and 9; the name before them may
/// hold spaces and parentheses, so fields are counted after its last `)`).
/// Whether a process or thread has ended: /proc has no entry of it, or it is a zombie (it exited
/// and waits to be collected) or dead.
pub fn has_ended(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    parse_stat_state_and_flags(&stat).is_some_and(|(state, _)| matches!(state, 'Z' | 'X'))
}

fn parse_stat_state_and_flags(stat: &str) -> Option<(char, u64)> {
    let mut fields = stat.get(stat.rfind(')')? + 1..)?.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let flags = fields.nth(5)?.parse().ok()?;
    Some((state, flags))
}

/// Every process descended from `roots` now (not the roots): children, their children, and so on.
/// /proc/PID/task/TID/children is not in every kernel (CONFIG_PROC_CHILDREN), so each process's
/// parent is read from /proc/PID/stat.
pub fn descendants(roots: &[u32]) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .filter_map(|pid: u32| Some((pid, parent(pid)?)))
        .collect();
    let mut found: Vec<u32> = Vec::new();
    let mut frontier = roots.to_vec();
    while let Some(parent_pid) = frontier.pop() {
        let children: Vec<u32> = parents
            .iter()
            .filter(|&&(pid, ppid)| ppid == parent_pid && !found.contains(&pid) && !roots.contains(&pid))
            .map(|&(pid, _)| pid)
            .collect();
        found.extend(&children);
        frontier.extend(children);
    }
    found
}

/// The parent process id (field 4 of /proc/PID/stat).
fn parent(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.get(stat.rfind(')')? + 1..)?.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// The kernel's short name of the process (at most 15 bytes).
pub fn comm(pid: u32) -> Option<String> {
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    Some(comm.trim_end_matches('\n').to_owned())
}

/// What the OS says the process holds, from /proc/PID/status.
pub fn os_memory(pid: u32) -> Option<OsMemory> {
    parse_status_memory(&fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
}

/// RssAnon, RssFile, RssShmem, VmSwap and VmSize of /proc/PID/status (in kB there).
fn parse_status_memory(status: &str) -> Option<OsMemory> {
    let mut memory = OsMemory::default();
    let mut found = 0;
    for line in status.lines() {
        let Some((name, value)) = line.split_once(':') else { continue };
        let (field, counted) = match name {
            "RssAnon" => (&mut memory.rss_anon_bytes, 1),
            "RssFile" => (&mut memory.rss_file_bytes, 1),
            "RssShmem" => (&mut memory.rss_shmem_bytes, 1),
            "VmSwap" => (&mut memory.swap_bytes, 1),
            "VmSize" => (&mut memory.address_space_bytes, 0),
            _ => continue,
        };
        let kib: u64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
        *field = kib * 1024;
        found += counted;
    }
    // A zombie or kernel thread has none of them.
    (found == 4).then_some(memory)
}

/// Resident set size in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let statm = fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    parse_statm_resident_pages(&statm).map(|pages| pages * page_size())
}

fn parse_statm_resident_pages(statm: &str) -> Option<u64> {
    statm.split_ascii_whitespace().nth(1)?.parse().ok()
}

pub fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// The user CPU time of a process (all its threads, those that ended too) and when it started,
/// both in clock ticks (`clock_ticks_per_second`), from /proc/PID/stat; a zombie still has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UserTime {
    pub utime_ticks: u64,
    /// Field 22, `starttime`: with the pid, which process this is.
    pub start_ticks: u64,
}

pub fn user_time(pid: u32) -> Option<UserTime> {
    parse_stat_user_time(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Fields 14 (utime) and 22 (starttime) of a stat line; the name (field 2) may hold spaces and
/// parentheses, so the fields are counted from its closing one.
fn parse_stat_user_time(stat: &str) -> Option<UserTime> {
    let (_, after_name) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = after_name.split_ascii_whitespace().collect();
    // fields[0] is field 3 (state).
    Some(UserTime { utime_ticks: fields.get(11)?.parse().ok()?, start_ticks: fields.get(19)?.parse().ok()? })
}

/// The unit of /proc's CPU times (USER_HZ, 100 on Linux).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&ticks| ticks > 0).unwrap_or(100)
}

/// This machine's host name (empty when it cannot be read): what OTLP's `host.name` and the
/// pushes' `host` name by default.
pub fn host_name() -> String {
    nix::unistd::gethostname().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default()
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
    Ok(maps(pid)?.files)
}

/// What one read of /proc/PID/maps tells: the file mappings, and the size of the brk heap.
#[derive(Debug, Clone, Default)]
pub struct Maps {
    pub files: Vec<Mapping>,
    /// The `[heap]` mapping: the program break less its start, as the allocator moved it.
    pub brk_heap_bytes: u64,
}

pub fn maps(pid: u32) -> std::io::Result<Maps> {
    let text = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(Maps { files: parse_maps(&text), brk_heap_bytes: brk_heap_bytes(&text) })
}

fn brk_heap_bytes(maps: &str) -> u64 {
    let heap = maps.lines().find(|line| line.ends_with(" [heap]"));
    let range = heap.and_then(|line| line.split(' ').next()?.split_once('-'));
    range
        .and_then(|(start, end)| {
            Some(u64::from_str_radix(end, 16).ok()? - u64::from_str_radix(start, 16).ok()?)
        })
        .unwrap_or(0)
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
    #[test]
    fn user_time_is_read_past_a_name_with_parentheses() {
        let stat = "42 (a) b (c)) R 1 42 42 0 -1 4194560 100 0 0 0 731 12 0 0 20 0 5 0 98765 1000 10 0";
        let read = super::parse_stat_user_time(stat).unwrap();
        assert_eq!(read, super::UserTime { utime_ticks: 731, start_ticks: 98765 });
        assert_eq!(super::parse_stat_user_time("42 (cut) R 1"), None);
    }

    use super::*;
    use std::path::Path;

    #[test]
    fn a_process_has_ended_once_it_is_a_zombie_or_gone() {
        use nix::sys::wait::{waitid, Id, WaitPidFlag};
        assert!(!has_ended(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        // Waits for its exit without collecting it: a zombie now.
        waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT).unwrap();
        assert!(has_ended(child.id()), "a zombie has ended");
        assert!(child.wait().unwrap().success());
        assert!(has_ended(child.id()), "a collected process has ended");
    }

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
        assert_eq!(brk_heap_bytes(maps), 0x21000);
        assert_eq!(brk_heap_bytes(""), 0);
        assert_eq!(mappings.len(), 3);
        assert_eq!(mappings[1].start, 0x7f1c2a828000);
        assert!(mappings[1].executable);
        assert_eq!(mappings[1].file_offset, 0x28000);
        assert_eq!(mappings[1].path, Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!mappings[0].executable);
        assert_eq!(mappings[2].path, Path::new("/tmp/my lib.so"));
    }

    #[test]
    fn kernel_threads_and_zombies_are_told_apart() {
        let kthreadd = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 1 0 0";
        let (state, flags) = parse_stat_state_and_flags(kthreadd).unwrap();
        assert_eq!(state, 'S');
        assert_ne!(flags & PF_KTHREAD, 0);
        let zombie = "77 (a (b) c) Z 1 77 77 0 -1 4227084 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0";
        let (state, flags) = parse_stat_state_and_flags(zombie).unwrap();
        assert_eq!(state, 'Z');
        assert_eq!(flags & PF_KTHREAD, 0);
        assert!(untraceable(std::process::id()).is_none());
        if fs::read_to_string("/proc/2/comm").is_ok_and(|name| name.trim() == "kthreadd") {
            assert!(untraceable(2).unwrap().contains("kernel thread"));
        }
    }

    #[test]
    fn status_gives_the_os_view() {
        let status = "Name:\tx\nVmRSS:\t  300 kB\nRssAnon:\t  100 kB\nRssFile:\t  150 kB\nRssShmem:\t  50 kB\nVmSwap:\t 8 kB\n";
        let memory = parse_status_memory(status).unwrap();
        assert_eq!(memory.rss_anon_bytes, 100 * 1024);
        assert_eq!(memory.rss_file_bytes, 150 * 1024);
        assert_eq!(memory.rss_shmem_bytes, 50 * 1024);
        assert_eq!(memory.swap_bytes, 8 * 1024);
        assert_eq!(parse_status_memory("Name:\tkthreadd\n"), None);
        assert!(os_memory(std::process::id()).unwrap().rss_anon_bytes > 0);
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
