//! How a run is watched: written to files at its end, watched live in the terminal (`memtrace
//! top`), or served to a fleet's scrapers (`memtrace serve`, with what serving adds).

use std::{net::SocketAddr, time::Duration};

use hyper::Uri;

/// The run's mode: one place says which it is.
#[derive(Debug, Clone)]
pub enum Mode {
    /// `memtrace [OPTIONS]`: a trace file (by default) and the reports, a progress line meanwhile.
    Trace,
    /// `memtrace top`: the run watched live in the terminal.
    Top,
    /// `memtrace serve`: the agent's endpoints are the live output.
    Serve(Box<ServeOptions>),
}

/// What `memtrace serve` adds to a tracing run.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    /// Processes with series of their own in /metrics; the rest are summed under comm="other".
    pub max_series_processes: usize,
    /// The sampling interval: a heap profile request waits for the next sample.
    pub interval: Duration,
    /// Capacity of the kernel's live-allocation table, shown beside its occupancy.
    pub max_allocations: u32,
    /// `--push`: where heap profiles go as Pyroscope ingests them, and how often.
    pub push: Option<PushTarget>,
    /// The host's name in what is pushed: `--host-name`, or the system's host name.
    pub host_name: String,
    /// `--otlp-endpoint`: where heap profiles go as OTLP profiles requests, and how often.
    pub otlp: Option<PushTarget>,
    /// `--oom-dir`: where the heap profile at each OOM kill is kept.
    pub oom_dir: Option<std::path::PathBuf>,
}

/// Where profiles are pushed: a plain-HTTP Pyroscope (or compatible) server, or an OTLP/HTTP
/// receiver.
#[derive(Debug, Clone)]
pub struct PushTarget {
    /// `http://host:port`, with any path prefix; `/ingest` (Pyroscope) or
    /// `/v1development/profiles` (OTLP) is added.
    pub base: Uri,
    pub interval: Duration,
}
