//! `memtrace serve`, the fleet agent: an exporter that publishes the model at every sample to an
//! HTTP server on a thread of its own, which answers `/metrics` (Prometheus), `/debug/pprof/heap`
//! (the live heap profile, as Go's net/http/pprof serves it) and `/healthz`. The server only reads
//! the latest published snapshot, so a slow client never delays a sample.

mod http;
mod metrics;
mod oom;
mod otlp_push;
mod post;
mod profile;
pub mod push;
mod reply;
mod shared;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::Result;
use tokio::sync::watch;

use shared::{Shared, Snapshot};

use crate::{
    export::exporter::{Exporter, StacksWanted},
    model::{Model, Process, RunEnd, Sample},
    plan::ServeOptions,
    process::procfs,
};

/// The table occupancy is read at least this often (a pass over every kernel table), and at each
/// heap profile request.
const OCCUPANCY_PERIOD: Duration = Duration::from_secs(60);

/// The exporter of `memtrace serve`.
pub struct Agent {
    shared: Arc<Shared>,
    server: Option<http::Server>,
    /// The profile request number read before this sample's stacks were.
    stacks_for: Option<u64>,
    profile_ticket: u64,
    profile: Arc<Model>,
    /// When the table occupancy was last read for the agent (never: at the first sample).
    occupancy_read: Option<Instant>,
    departures: Departures,
    /// Each process's lost events as last seen, and the sum of those that left the model.
    lost_by_process: HashMap<u32, u64>,
    departed_lost: u64,
    /// The OOM kills seen, their profiles kept (--oom-dir, --push).
    oom: oom::OomKeeper,
}

impl Agent {
    /// Binds the address and starts serving (with nothing to show until the first sample).
    pub fn start(options: &ServeOptions) -> Result<Self> {
        let oom =
            oom::OomKeeper::new(options.oom_dir.as_deref(), options.push.is_some(), options.otlp.is_some())?;
        let empty = Snapshot {
            model: Model::default(),
            profile: Arc::new(Model::default()),
            traced_for: Duration::ZERO,
            profile_ticket: 0,
            lost_events: 0,
            oom_kills: 0,
            oom_profiles_unqueued: 0,
            agent_rss_bytes: 0,
            agent_cpu_seconds: 0.0,
        };
        let shared = Arc::new(Shared {
            snapshot: watch::Sender::new(Arc::new(empty)),
            profile_requests: AtomicU64::new(0),
            shown_exits: Mutex::new(HashSet::new()),
            max_series_processes: options.max_series_processes,
            max_allocations: options.max_allocations,
            profile_wait: options.interval * 2 + Duration::from_secs(20),
            push_failures: (options.push.is_some() || options.otlp.is_some()).then(|| AtomicU64::new(0)),
            host_name: options.host_name.clone(),
            oom_profiles: Mutex::new(Vec::new()),
            oom_requests: Mutex::new(Vec::new()),
        });
        let server = http::Server::start(options, Arc::clone(&shared))?;
        let address = server.address();
        eprintln!("memtrace: serving http://{address}/metrics, /debug/pprof/heap and /healthz");
        if !address.ip().is_loopback() {
            eprintln!(
                "memtrace: warning: {address} is reachable from other hosts and the endpoints have no \
                 authentication; put them behind a firewall or an authenticating proxy"
            );
        }
        Ok(Self {
            shared,
            server: Some(server),
            stacks_for: None,
            profile_ticket: 0,
            profile: Arc::new(Model::default()),
            occupancy_read: None,
            departures: Departures::default(),
            lost_by_process: HashMap::new(),
            departed_lost: 0,
            oom,
        })
    }

    /// Lost events over the run: processes released system-wide leave the model, not the count.
    fn lost_events(&mut self, model: &Model) -> u64 {
        let departed: Vec<u32> =
            self.lost_by_process.keys().filter(|pid| !model.processes.contains_key(pid)).copied().collect();
        for pid in departed {
            self.departed_lost += self.lost_by_process.remove(&pid).unwrap_or(0);
        }
        for process in model.processes.values() {
            self.lost_by_process.insert(process.identity.pid, process.stats.lost_events);
        }
        self.departed_lost + model.lost_events()
    }
}

impl Exporter for Agent {
    fn wants_stacks(&mut self) -> StacksWanted {
        let requested = self.shared.profile_requests.load(Ordering::Acquire);
        if requested > self.profile_ticket {
            self.stacks_for = Some(requested);
            return StacksWanted::All;
        }
        StacksWanted::None
    }

    fn wants_occupancy(&mut self) -> bool {
        let due = self.occupancy_read.is_none_or(|at| at.elapsed() >= OCCUPANCY_PERIOD);
        if due {
            self.occupancy_read = Some(Instant::now());
        }
        due
    }

    fn sample(&mut self, model: &Model, sample: Sample) -> Result<()> {
        let shown = std::mem::take(&mut *self.shared.shown_exits.lock().unwrap_or_else(|e| e.into_inner()));
        self.departures.update(model, shown);
        if let Some(ticket) = self.stacks_for.take() {
            self.profile_ticket = ticket;
            self.profile = Arc::new(self.departures.visible(model, Stacks::Kept));
        }
        let lost_events = self.lost_events(model);
        self.oom.sample(model, &self.shared);
        let snapshot = Snapshot {
            model: self.departures.visible(model, Stacks::Left),
            profile: Arc::clone(&self.profile),
            traced_for: Duration::from_micros(sample.ts_us),
            profile_ticket: self.profile_ticket,
            lost_events,
            oom_kills: self.oom.total,
            oom_profiles_unqueued: self.oom.unqueued,
            agent_rss_bytes: procfs::rss_bytes(std::process::id()).unwrap_or(0),
            agent_cpu_seconds: metrics::own_cpu_seconds(),
        };
        self.shared.snapshot.send_replace(Arc::new(snapshot));
        Ok(())
    }

    fn finish(&mut self, _model: &Model, _end: RunEnd) -> Result<()> {
        if let Some(server) = self.server.take() {
            server.stop();
        }
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.stop();
        }
    }
}

/// Whether a copy of the model keeps the call stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stacks {
    Kept,
    Left,
}

/// A process as the server reads it: without its mappings, and with its stacks only for a heap
/// profile.
fn copy(process: &Process, stacks: Stacks) -> Process {
    Process {
        identity: process.identity.clone(),
        allocator: process.allocator.clone(),
        allocator_kind: process.allocator_kind.clone(),
        stats: process.stats,
        memory: process.memory,
        timeline: Vec::new(),
        peak: None,
        exited: process.exited,
        seen_from_start: process.seen_from_start,
        free_pool: process.free_pool.clone(),
        released: process.released,
        mappings: Vec::new(),
        stacks: if stacks == Stacks::Kept { process.stacks.clone() } else { Vec::new() },
        usdt: process.usdt.clone(),
        oom_kill: process.oom_kill.clone(),
        window_weight: process.window_weight,
        window_cpu: process.window_cpu,
    }
}

/// At most this many exited processes wait to be shown (a long time without a scrape under --all).
const MAX_DEPARTING: usize = 10_000;

/// Exited processes on their way out of the exposition: each stays until a /metrics response has
/// shown it, also after it has left the model (released system-wide at the next sample).
#[derive(Default)]
struct Departures {
    /// Exited and not yet shown, as last seen.
    departing: BTreeMap<u32, Process>,
    /// Shown already, and left out while the model still holds them.
    gone: HashSet<u32>,
}

impl Departures {
    fn update(&mut self, model: &Model, shown: HashSet<u32>) {
        self.gone.extend(shown);
        let gone = &self.gone;
        self.departing.retain(|pid, _| !gone.contains(pid));
        self.gone.retain(|pid| model.processes.get(pid).is_some_and(|process| process.exited));
        for process in model.processes.values().filter(|p| p.exited && !self.gone.contains(&p.identity.pid)) {
            self.departing.insert(process.identity.pid, copy(process, Stacks::Left));
        }
        while self.departing.len() > MAX_DEPARTING {
            self.departing.pop_first();
        }
    }

    /// The processes to show: the model's, less those shown after their exit, and those that
    /// left the model before a scrape showed them.
    fn visible(&self, model: &Model, stacks: Stacks) -> Model {
        let mut processes: BTreeMap<u32, Process> = model
            .processes
            .values()
            .filter(|process| !(process.exited && self.gone.contains(&process.identity.pid)))
            .map(|process| (process.identity.pid, copy(process, stacks)))
            .collect();
        for (pid, process) in &self.departing {
            processes.entry(*pid).or_insert_with(|| process.clone());
        }
        Model {
            processes,
            unattributed_lost_events: model.unattributed_lost_events,
            usdt_lost_events: model.usdt_lost_events,
            kernel_maps: model.kernel_maps,
            sampling: model.sampling,
            windows: model.windows,
            // Exited processes leave the exposition after one scrape (`departing`).
            ..Model::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exited_processes_stay_until_shown_once() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(1, "a".into()), "/libc".into());
        model.add_process(crate::model::identity::ProcessIdentity::new(2, "b".into()), "/libc".into());
        model.processes.get_mut(&2).unwrap().exited = true;
        let mut departures = Departures::default();
        departures.update(&model, HashSet::new());
        assert_eq!(departures.visible(&model, Stacks::Left).processes.len(), 2);
        // Released system-wide: gone from the model, still shown until a scrape has.
        model.processes.remove(&2);
        departures.update(&model, HashSet::new());
        let visible = departures.visible(&model, Stacks::Left);
        assert!(visible.processes[&2].exited, "{visible:?}");
        departures.update(&model, HashSet::from([2]));
        assert_eq!(departures.visible(&model, Stacks::Left).processes.keys().collect::<Vec<_>>(), [&1]);
        // A --pid target stays in the model once exited: shown once, then left out.
        model.processes.get_mut(&1).unwrap().exited = true;
        departures.update(&model, HashSet::new());
        assert_eq!(departures.visible(&model, Stacks::Left).processes.len(), 1);
        departures.update(&model, HashSet::from([1]));
        assert!(departures.visible(&model, Stacks::Left).processes.is_empty());
    }
}
