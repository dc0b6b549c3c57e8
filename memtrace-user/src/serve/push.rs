//! `--push URL`: every `--push-interval`, the heap profile of each of the largest processes goes to
//! a Pyroscope-compatible ingest endpoint: `POST /ingest?name=memtrace.heap{host=..,pid=..,comm=..}
//! &from=..&until=..&format=pprof`, the gzipped profile in the multipart field `profile`. Each push
//! is tried three times with backoff; a push that still fails is counted (memtrace_push_failures_total)
//! and said on stderr (post.rs). The heap at each OOM kill since the last push (serve/oom.rs) goes
//! too, once, as `memtrace.oom_heap{host=..,pid=..,comm=..}`. It runs on the server's thread: it
//! never blocks tracing.

use std::sync::Arc;

use anyhow::Result;
use hyper::{body::Bytes, Uri};

use super::{
    post::{self, failed, unix_seconds, Post},
    shared::Shared,
};
use crate::{
    export::{
        heap_profile::{self, Processes},
        pprof::{build_profile, write_gzipped},
    },
    model::Process,
    plan::PushTarget,
};

const BOUNDARY: &str = "memtrace-profile-boundary-7d1f0c";

/// Pushes at every interval until the server thread stops.
pub async fn run(shared: Arc<Shared>, target: PushTarget) {
    let host = shared.host_name.clone();
    let mut ticks = tokio::time::interval(target.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let until = unix_seconds();
        let from = until.saturating_sub(target.interval.as_secs().max(1));
        let Some(snapshot) = shared.fresh_snapshot().await else {
            failed(&shared, &target.base, 1, "no sample came to read the stacks".to_owned());
            continue;
        };
        let processes = heap_profile::largest(&snapshot.profile, shared.max_series_processes);
        let (mut failures, mut last_error) = (0, String::new());
        for process in &processes {
            let name = series_name(&host, process);
            let profile =
                build_profile(&snapshot.profile, snapshot.traced_for, Processes::One(process.identity.pid));
            let mut gzipped = Vec::new();
            if let Err(err) = write_gzipped(&profile, &mut gzipped) {
                (failures, last_error) = (failures + 1, err.to_string());
                continue;
            }
            if let Err(err) = push_with_retries(&target.base, &name, from, until, gzipped).await {
                (failures, last_error) = (failures + 1, format!("{err:#}"));
            }
        }
        // The heap at each OOM kill since the last push, once.
        for kill in shared.take_oom_profiles() {
            let name = format!(
                "memtrace.oom_heap{{host={},pid={},comm={}}}",
                clean(&host),
                kill.pid,
                clean(&kill.comm)
            );
            if let Err(err) = push_with_retries(&target.base, &name, from, until, kill.gzipped).await {
                (failures, last_error) = (failures + 1, format!("{err:#}"));
            }
        }
        if failures > 0 {
            failed(&shared, &target.base, failures, last_error);
        }
    }
}

/// `memtrace.heap{host=..,pid=..,comm=..}`, label values cut to what Pyroscope accepts.
fn series_name(host: &str, process: &Process) -> String {
    // The identity's labels (pid, comm, and the container's where known), as serve's metrics.
    let labels: Vec<String> =
        process.identity.labels().iter().map(|(name, value)| format!("{name}={}", clean(value))).collect();
    format!("memtrace.heap{{host={},{}}}", clean(host), labels.join(","))
}

/// A label value cut to what Pyroscope accepts.
fn clean(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect()
}

async fn push_with_retries(base: &Uri, name: &str, from: u64, until: u64, profile: Vec<u8>) -> Result<()> {
    let post = Post {
        path: format!("/ingest?name={}&from={from}&until={until}&format=pprof", percent_encode(name)),
        headers: vec![("content-type", format!("multipart/form-data; boundary={BOUNDARY}"))],
        body: Bytes::from(multipart(&profile)),
    };
    post::with_retries(base, &post).await
}

/// A multipart/form-data body with the one field `profile`.
fn multipart(profile: &[u8]) -> Vec<u8> {
    let mut body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(profile);
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    body
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'_' | b'-' => (byte as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_names_carry_host_and_process() {
        let mut model = crate::model::Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(42, "my app".into()), "/libc".into());
        let name = series_name("web-1", &model.processes[&42]);
        assert_eq!(name, "memtrace.heap{host=web-1,pid=42,comm=my_app}");
        assert_eq!(percent_encode("a{b=c,d}"), "a%7Bb%3Dc%2Cd%7D");
        let body = multipart(b"PROFILE");
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains("name=\"profile\"") && text.contains("\r\n\r\nPROFILE\r\n--"), "{text}");
    }
}
