//! What the agent's exporter and its server share: the latest snapshot of the model, published at
//! every sample and only read by the server, and the heap profile requests that ask the next
//! sample to read the stacks.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use tokio::sync::watch;

use crate::model::Model;

/// The model as of one sample, as the server answers from it.
pub struct Snapshot {
    /// The processes to show, with neither mappings nor stacks; exited ones until a scrape has
    /// shown them.
    pub model: Model,
    /// The processes with their stacks, as read for the latest heap profile request (shared by
    /// every snapshot until the next one).
    pub profile: Arc<Model>,
    /// How long tracing had run at this sample.
    pub traced_for: Duration,
    /// The heap profile requests whose stacks `model` holds: every one up to this number.
    pub profile_ticket: u64,
    /// Events lost over the whole run, including those of processes that have left the model.
    pub lost_events: u64,
    /// Processes the kernel's OOM killer ended during the run (serve/oom.rs).
    pub oom_kills: u64,
    /// Kill profiles (pprof or OTLP) not queued for a push: too many waited already.
    pub oom_profiles_unqueued: u64,
    /// memtrace's own resident set size and CPU time.
    pub agent_rss_bytes: u64,
    pub agent_cpu_seconds: f64,
}

/// At most this many kill profiles wait for a push (a push target down for long), in each form.
pub(super) const MAX_WAITING_KILLS: usize = 100;

/// Adds `item` to a queue of kill profiles unless MAX_WAITING_KILLS already wait; whether it was.
fn push_bounded<T>(queue: &Mutex<Vec<T>>, item: T) -> bool {
    let mut waiting = queue.lock().unwrap_or_else(|e| e.into_inner());
    let room = waiting.len() < MAX_WAITING_KILLS;
    if room {
        waiting.push(item);
    }
    room
}

/// Empties a queue of kill profiles, returning what waited.
fn take_all<T>(queue: &Mutex<Vec<T>>) -> Vec<T> {
    std::mem::take(&mut *queue.lock().unwrap_or_else(|e| e.into_inner()))
}

/// What the exporter and the server share.
pub struct Shared {
    pub(super) snapshot: watch::Sender<Arc<Snapshot>>,
    /// Heap profile requests so far: each takes the next number and waits for stacks that answer it.
    pub(super) profile_requests: AtomicU64,
    /// Exited processes that a /metrics response has shown: they leave the exposition.
    pub(super) shown_exits: Mutex<HashSet<u32>>,
    pub(super) max_series_processes: usize,
    pub(super) max_allocations: u32,
    /// How long a heap profile request waits for a sample to read the stacks.
    pub(super) profile_wait: Duration,
    /// `--push`: pushes that failed (None without --push).
    pub(super) push_failures: Option<AtomicU64>,
    /// The host's name in what is pushed (`--host-name`, or the system's).
    pub(super) host_name: String,
    /// The heap profiles at OOM kills that the next push sends (serve/oom.rs).
    pub(super) oom_profiles: Mutex<Vec<KillProfile>>,
    /// The same as encoded OTLP profiles requests, for the next OTLP push (--otlp-endpoint).
    pub(super) oom_requests: Mutex<Vec<Vec<u8>>>,
}

/// A kill's heap profile on its way to the next push.
pub struct KillProfile {
    pub pid: u32,
    pub comm: String,
    /// The gzipped profile.proto.
    pub gzipped: Vec<u8>,
}

impl Shared {
    /// Queues a kill's heap profile for the next push; false when MAX_WAITING_KILLS wait already.
    pub fn queue_oom_profile(&self, profile: KillProfile) -> bool {
        push_bounded(&self.oom_profiles, profile)
    }

    /// Takes the heap profiles at OOM kills waiting for a push.
    pub fn take_oom_profiles(&self) -> Vec<KillProfile> {
        take_all(&self.oom_profiles)
    }

    /// Queues a kill's encoded OTLP request for the next OTLP push; false when MAX_WAITING_KILLS
    /// wait already.
    pub fn queue_oom_request(&self, request: Vec<u8>) -> bool {
        push_bounded(&self.oom_requests, request)
    }

    /// Takes the OTLP requests of OOM kills waiting for a push.
    pub fn take_oom_requests(&self) -> Vec<Vec<u8>> {
        take_all(&self.oom_requests)
    }

    /// The first snapshot whose stacks were read after this call, or None if none comes in time.
    pub async fn fresh_snapshot(&self) -> Option<Arc<Snapshot>> {
        let ticket = self.profile_requests.fetch_add(1, Ordering::AcqRel) + 1;
        let mut snapshots = self.snapshot.subscribe();
        let answered =
            async { snapshots.wait_for(|s| s.profile_ticket >= ticket).await.map(|s| Arc::clone(&s)) };
        tokio::time::timeout(self.profile_wait, answered).await.ok()?.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_says_it_did_not_take_the_kill() {
        let queue = Mutex::new(Vec::new());
        assert!((0..MAX_WAITING_KILLS).all(|kill| push_bounded(&queue, kill)));
        assert!(!push_bounded(&queue, MAX_WAITING_KILLS));
        assert_eq!(take_all(&queue).len(), MAX_WAITING_KILLS);
        assert!(push_bounded(&queue, 0), "room again once a push took them");
    }
}
