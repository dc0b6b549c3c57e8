//! What the agent keeps of each process the kernel's OOM killer ends, so that an agent that runs
//! for weeks still has what it saw at every kill after the process has left the model: the count
//! (`memtrace_oom_kills_total`), the heap profile at the kill as a gzipped pprof file in
//! `--oom-dir` and in the next `--push`, and, with `--otlp-endpoint`, the same as an OTLP profiles
//! request: a file beside the pprof one and a request of its own in the next OTLP push.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};
use memtrace_common::StackTotals;
use prost::Message;

use super::shared::{KillProfile, Shared, MAX_WAITING_KILLS};
use crate::{
    export::{
        heap_profile::Processes,
        otlp::{build_request, Recording, Window},
        pprof::{build_profile, write_gzipped},
    },
    model::{oom::OomKill, Model, Process, StackProfile},
};

/// The kills seen, by process (pid and image start), while the process is in the model.
pub struct OomKeeper {
    dir: Option<PathBuf>,
    push: bool,
    /// `--otlp-endpoint` is set: each kill is kept as an OTLP request too.
    otlp: bool,
    seen: HashSet<(u32, u64)>,
    /// Kills over the run.
    pub total: u64,
    /// Kill profiles not queued for a push, as too many waited (a push target down for long).
    pub unqueued: u64,
}

impl OomKeeper {
    /// `dir` is made if missing; an error names it when it cannot be written.
    pub fn new(dir: Option<&Path>, push: bool, otlp: bool) -> Result<Self> {
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
        Ok(Self { dir: dir.map(Path::to_owned), push, otlp, seen: HashSet::new(), total: 0, unqueued: 0 })
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
            let victim = victim(process, kill);
            let mut gzipped = Vec::new();
            if let Err(err) = write_gzipped(&kill_profile(&victim, kill), &mut gzipped) {
                eprintln!(
                    "memtrace: warning: the heap profile of OOM-killed pid {}: {err}",
                    process.identity.pid
                );
                continue;
            }
            let otlp = self.otlp.then(|| kill_request(&victim, kill, &shared.host_name));
            self.keep_files(process, &gzipped, otlp.as_deref());
            let (pid, comm) = (process.identity.pid, process.identity.comm.clone());
            if let Some(request) = otlp {
                self.queued(shared.queue_oom_request(request), pid, "OTLP push");
            }
            if self.push {
                self.queued(shared.queue_oom_profile(KillProfile { pid, comm, gzipped }), pid, "push");
            }
        }
    }

    /// Counts and says a kill's profile that did not fit in the queue for the next push.
    fn queued(&mut self, queued: bool, pid: u32, push: &str) {
        if queued {
            return;
        }
        self.unqueued += 1;
        let kept = match &self.dir {
            Some(dir) => format!("it is kept in {}", dir.display()),
            None => "keep kills in files with --oom-dir".to_owned(),
        };
        eprintln!(
            "memtrace: warning: the heap profile of OOM-killed pid {pid} is not queued for the next \
             {push}: {MAX_WAITING_KILLS} kills' profiles wait already (is the push target down?); {kept}"
        );
    }

    /// Writes a kill's profiles into `--oom-dir`: the gzipped pprof and, where OTLP is configured,
    /// the encoded OTLP request beside it.
    fn keep_files(&self, process: &Process, gzipped: &[u8], otlp: Option<&[u8]>) {
        let Some(dir) = &self.dir else { return };
        let stem = file_stem(process);
        let files = [(format!("{stem}.pb.gz"), Some(gzipped)), (format!("{stem}.otlp.pb"), otlp)];
        for (name, bytes) in files {
            let Some(bytes) = bytes else { continue };
            let path = dir.join(name);
            match std::fs::write(&path, bytes) {
                Ok(()) => eprintln!(
                    "memtrace: the heap at the OOM kill of pid {} is in {}",
                    process.identity.pid,
                    path.display()
                ),
                Err(err) => eprintln!("memtrace: warning: writing {}: {err}", path.display()),
            }
        }
    }
}

/// The killed process as it was at the kill: its stacks those that held the most then (the top
/// `OOM_STACKS`, live figures only), no mappings.
fn victim(process: &Process, kill: &OomKill) -> Process {
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
    Process { stacks, mappings: Vec::new(), ..process.clone() }
}

/// The heap at the kill as an encoded OTLP profiles request (one resource, the victim's), over
/// the time from the start of tracing to the kill.
fn kill_request(victim: &Process, kill: &OomKill, host: &str) -> Vec<u8> {
    let traced_for = Duration::from_micros(kill.ts_us);
    let window = Window::ending_now(traced_for);
    let recording = Recording { sample_mean: None, note: None };
    build_request(recording, &[victim], window, host).encode_to_vec()
}

/// The heap of `victim` at its kill as a pprof profile: inuse_* are the stacks that held the
/// most then, alloc_* are left 0; a comment says when and where.
fn kill_profile(victim: &Process, kill: &OomKill) -> crate::export::pprof::proto::Profile {
    let pid = victim.identity.pid;
    let mut model = Model { sampling: None, ..Model::default() };
    model.processes.insert(pid, victim.clone());
    let mut profile = build_profile(&model, Duration::from_micros(kill.ts_us), Processes::One(pid));
    let comment = format!(
        "memtrace: the heap of pid {pid} ({}) when the kernel's OOM killer ended it, {:.3}s into tracing; memory \
         cgroup {} (limit {}); live heap {} bytes in {} blocks",
        victim.identity.comm,
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

/// `oom-UNIXSECONDS-PID-COMM` (then `.pb.gz`, `.otlp.pb`), the command name kept to characters
/// safe in a file name.
fn file_stem(process: &Process) -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let comm: String = process
        .identity
        .comm
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' })
        .collect();
    format!("oom-{now}-{}-{comm}", process.identity.pid)
}
