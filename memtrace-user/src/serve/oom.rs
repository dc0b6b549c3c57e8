//! What the agent keeps of each process the kernel's OOM killer ends, so that an agent that runs
//! for weeks still has what it saw at every kill after the process has left the model: the count
//! (`memtrace_oom_kills_total`), the heap profile at the kill as a gzipped pprof file in
//! `--oom-dir`, and the same profile in the next `--push`.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use memtrace_common::StackTotals;

use super::shared::{KillProfile, Shared};
use crate::{
    export::{
        heap_profile::Processes,
        pprof::{build_profile, write_gzipped},
    },
    model::{oom::OomKill, Model, Process, StackProfile},
};

/// At most this many kill profiles wait for a push (a push target down for long).
const MAX_WAITING: usize = 100;

/// The kills seen, by process (pid and image start), while the process is in the model.
pub struct OomKeeper {
    dir: Option<PathBuf>,
    push: bool,
    seen: HashSet<(u32, u64)>,
    /// Kills over the run.
    pub total: u64,
}

impl OomKeeper {
    /// `dir` is made if missing; an error names it when it cannot be written.
    pub fn new(dir: Option<&Path>, push: bool) -> Result<Self> {
        if let Some(dir) = dir {
            let cannot = || {
                format!(
                    "cannot keep OOM profiles in {}; name a writable directory with --oom-dir",
                    dir.display()
                )
            };
            std::fs::create_dir_all(dir).with_context(cannot)?;
            tempfile::tempfile_in(dir).with_context(cannot)?;
        }
        Ok(Self { dir: dir.map(Path::to_owned), push, seen: HashSet::new(), total: 0 })
    }

    /// Keeps every kill the collector has read since the last sample.
    pub fn sample(&mut self, model: &Model, shared: &Shared) {
        self.seen.retain(|(pid, started)| {
            model.processes.get(pid).is_some_and(|p| p.stats.started_ns == *started)
        });
        for process in model.processes.values() {
            let Some(kill) = process.oom_kill.as_ref().filter(|kill| kill.read) else { continue };
            if !self.seen.insert((process.identity.pid, process.stats.started_ns)) {
                continue;
            }
            self.total += 1;
            let mut gzipped = Vec::new();
            if let Err(err) = write_gzipped(&kill_profile(process, kill), &mut gzipped) {
                eprintln!(
                    "memtrace: warning: the heap profile of OOM-killed pid {}: {err}",
                    process.identity.pid
                );
                continue;
            }
            if let Some(dir) = &self.dir {
                let path = dir.join(file_name(process));
                match std::fs::write(&path, &gzipped) {
                    Ok(()) => eprintln!(
                        "memtrace: the heap at the OOM kill of pid {} is in {}",
                        process.identity.pid,
                        path.display()
                    ),
                    Err(err) => eprintln!("memtrace: warning: writing {}: {err}", path.display()),
                }
            }
            if self.push {
                let mut waiting = shared.oom_profiles.lock().unwrap_or_else(|e| e.into_inner());
                if waiting.len() < MAX_WAITING {
                    waiting.push(KillProfile {
                        pid: process.identity.pid,
                        comm: process.identity.comm.clone(),
                        gzipped,
                    });
                }
            }
        }
    }
}

/// The heap of `process` at its kill as a pprof profile: inuse_* are the stacks that held the
/// most then (the top `OOM_STACKS`), alloc_* are left 0; a comment says when and where.
fn kill_profile(process: &Process, kill: &OomKill) -> crate::export::pprof::proto::Profile {
    let stacks = kill
        .stacks
        .iter()
        .map(|stack| StackProfile {
            frames: stack.frames.clone(),
            totals: StackTotals {
                live_bytes: stack.live_bytes,
                live_allocations: stack.live_allocations,
                ..StackTotals::default()
            },
            leaked_bytes: 0,
            leaked_allocations: 0,
            oldest_age: None,
        })
        .collect();
    let mut victim = process.clone();
    victim.stacks = stacks;
    victim.mappings = Vec::new();
    let mut model = Model { sampling: None, ..Model::default() };
    model.processes.insert(process.identity.pid, victim);
    let mut profile =
        build_profile(&model, Duration::from_micros(kill.ts_us), Processes::One(process.identity.pid));
    let comment = format!(
        "memtrace: the heap of pid {} ({}) when the kernel's OOM killer ended it, {:.3}s into tracing; memory \
         cgroup {} (limit {}); live heap {} bytes in {} blocks",
        process.identity.pid,
        process.identity.comm,
        kill.ts_us as f64 / 1e6,
        kill.cgroup.as_deref().unwrap_or("unknown"),
        kill.limit_bytes.map_or_else(|| "none".to_owned(), |limit| format!("{limit} bytes")),
        kill.live_bytes,
        kill.live_allocations
    );
    profile.string_table.push(comment);
    profile.comment.push(profile.string_table.len() as i64 - 1);
    profile
}

/// `oom-UNIXSECONDS-PID-COMM.pb.gz`, the command name kept to characters safe in a file name.
fn file_name(process: &Process) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let comm: String = process
        .identity
        .comm
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' })
        .collect();
    format!("oom-{now}-{}-{comm}.pb.gz", process.identity.pid)
}
