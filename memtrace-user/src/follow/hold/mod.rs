//! Holding execs until their program is probed, in one room: the launched command's own exec,
//! held on a pipe until every probe is in place (`command`); and the execs of followed processes,
//! held by fanotify (`fanotify`) until the new program's allocator is probed, so that a static
//! program or one with a private allocator, started by a followed tree or under `--all`, is exact
//! from its first instruction. This file is the policy: whose execs are held, on which
//! filesystems (mountinfo), and what a held exec waits for. The hold calls `serve` on a thread of
//! its own: it resolves the held program's image and allocator there and asks the main loop, which
//! owns the probes, to attach them ([`ProbeRequest`]); the exec goes on once that is done, or at
//! the hold's bound.

pub mod command;
pub mod fanotify;

use std::{
    fs,
    os::fd::{AsRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        mpsc::{self, Receiver, Sender, SyncSender},
        Arc,
    },
};

use self::fanotify::{ExecHold, HeldExec, HoldStats, Unavailable, DEFAULT_BOUND};
use crate::{
    attach::{Probed, ProbedFiles},
    kernel::KeyLookup,
    process::allocator::{Allocator, Overrides},
    process::{FileCache, ObjectFile, ProcessImage},
};

/// Whose execs are held.
#[derive(Clone)]
pub enum Holding {
    /// The processes of the kernel's tree (`Reach::Tree`).
    Tree(Arc<KeyLookup>),
    /// Every process but memtrace.
    Everyone,
}

impl Holding {
    fn wants(&self, pid: u32) -> bool {
        match self {
            Holding::Tree(tree) => tree.contains(pid),
            Holding::Everyone => true,
        }
    }
}

/// An allocator to probe before a held exec goes on.
pub struct ProbeRequest {
    pub allocator: Allocator,
    done: SyncSender<()>,
}

impl ProbeRequest {
    /// Lets the exec go on (the probes are attached, or could not be).
    pub fn done(self) {
        let _ = self.done.try_send(());
    }
}

pub struct HeldExecs {
    hold: Option<ExecHold>,
    probed: ProbedFiles,
    holding: Holding,
    cache: FileCache,
    overrides: Overrides,
    sender: Sender<ProbeRequest>,
    requests: Receiver<ProbeRequest>,
    /// Written once per request, to wake the main loop.
    wake: Arc<OwnedFd>,
    /// What earlier holds did (one per stop and continue).
    earlier: HoldStats,
}

impl HeldExecs {
    /// Starts holding the execs of `holding` on every filesystem programs can run from.
    pub fn start(
        holding: Holding,
        probed: ProbedFiles,
        cache: FileCache,
        overrides: Overrides,
        wake: OwnedFd,
    ) -> Result<Self, Unavailable> {
        let (sender, requests) = mpsc::channel();
        let mut this = Self {
            hold: None,
            probed,
            holding,
            cache,
            overrides,
            sender,
            requests,
            wake: Arc::new(wake),
            earlier: HoldStats::default(),
        };
        this.resume()?;
        Ok(this)
    }

    /// Holds execs again (after `release`).
    pub fn resume(&mut self) -> Result<(), Unavailable> {
        if self.hold.is_some() {
            return Ok(());
        }
        let holding = self.holding.clone();
        let (cache, overrides, sender, wake) =
            (self.cache.clone(), self.overrides.clone(), self.sender.clone(), Arc::clone(&self.wake));
        let probed = Arc::clone(&self.probed);
        let serve = move |held: HeldExec| {
            let Some(allocator) = allocator_of(&held, &cache, &overrides) else { return };
            if probed
                .lock()
                .is_ok_and(|probed| Probed::all_for(&allocator).all(|file| probed.contains(&file)))
            {
                return;
            }
            let (done, finished) = mpsc::sync_channel(1);
            if sender.send(ProbeRequest { allocator, done }).is_ok() {
                // SAFETY: writing one byte from a valid buffer to a pipe we hold open.
                unsafe { libc::write(wake.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
                // The hold lets the exec go at its bound anyway.
                let _ = finished.recv_timeout(DEFAULT_BOUND);
            }
        };
        let hold =
            ExecHold::start(&executable_mounts(), move |pid| holding.wants(pid), serve, DEFAULT_BOUND)?;
        self.hold = Some(hold);
        Ok(())
    }

    /// Lets go of every exec, before memtrace stops or exits.
    pub fn release(&mut self) {
        if let Some(mut hold) = self.hold.take() {
            hold.release();
            self.earlier = add(self.earlier, hold.stats());
        }
    }

    /// The probes that held execs wait for.
    pub fn requests(&self) -> impl Iterator<Item = ProbeRequest> + '_ {
        self.requests.try_iter()
    }

    /// What every hold so far did.
    pub fn stats(&self) -> HoldStats {
        self.hold.as_ref().map_or(self.earlier, |hold| add(self.earlier, hold.stats()))
    }
}

impl Drop for HeldExecs {
    fn drop(&mut self) {
        self.release();
    }
}

/// The allocator of the program a held process is exec'ing, if memtrace knows one.
fn allocator_of(held: &HeldExec, cache: &FileCache, overrides: &Overrides) -> Option<Allocator> {
    let link = PathBuf::from(format!("/proc/self/fd/{}", held.file.as_raw_fd()));
    let program = ObjectFile::open_proc_link(&link, held.path()).ok()?;
    let image = ProcessImage::of_held_exec(held.pid, program, cache).ok()?;
    Allocator::of_image(&image, overrides, cache).ok()
}

fn add(a: HoldStats, b: HoldStats) -> HoldStats {
    HoldStats {
        held: a.held + b.held,
        served: a.served + b.served,
        missed: a.missed + b.missed,
        not_wanted: a.not_wanted + b.not_wanted,
        overflows: a.overflows + b.overflows,
        refused_by_kernel: a.refused_by_kernel + b.refused_by_kernel,
        failed: a.failed || b.failed,
    }
}

/// File systems a program can be run from: every mount of /proc/self/mountinfo but the kernel's
/// pseudo file systems (procfs, sysfs, cgroups, ...), which hold no programs.
fn executable_mounts() -> Vec<PathBuf> {
    const PSEUDO: &[&str] = &[
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "mqueue",
        "debugfs",
        "tracefs",
        "bpf",
        "securityfs",
        "pstore",
        "configfs",
        "fusectl",
        "hugetlbfs",
        "autofs",
        "binfmt_misc",
        "nsfs",
        "efivarfs",
        "rpc_pipefs",
    ];
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|line| {
            let (fields, rest) = line.split_once(" - ")?;
            let fstype = rest.split_whitespace().next()?;
            let mount_point = fields.split_whitespace().nth(4)?;
            (!PSEUDO.contains(&fstype)).then(|| PathBuf::from(unescape(mount_point)))
        })
        .collect();
    if !mounts.iter().any(|mount| mount == Path::new("/")) {
        mounts.push(PathBuf::from("/"));
    }
    mounts
}

/// mountinfo writes a space, tab, newline and backslash in a path as \040, \011, \012 and \134.
fn unescape(path: &str) -> String {
    path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}
