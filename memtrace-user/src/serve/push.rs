//! `--push URL`: every `--push-interval`, the heap profile of each of the largest processes goes to
//! a Pyroscope-compatible ingest endpoint: `POST /ingest?name=memtrace.heap{host=..,pid=..,comm=..}
//! &from=..&until=..&format=pprof`, the gzipped profile in the multipart field `profile`. Each push
//! is tried three times with backoff; a push that still fails is counted (memtrace_push_failures_total)
//! and said on stderr (post.rs). The heap at each OOM kill since the last push (serve/oom.rs) goes
//! too, once, as `memtrace.oom_heap{host=..,pid=..,comm=..}`. It runs on the server's thread: it
//! never blocks tracing.

use std::sync::Arc;

use hyper::body::Bytes;

use super::{
    post::{self, Post, Span},
    shared::{Shared, Snapshot},
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
    post::every_interval(shared, target, round).await
}

/// A round's posts: each of the largest processes' heap profile, then the heap at each OOM kill
/// since the last round, once.
fn round(shared: &Shared, snapshot: &Snapshot, span: Span) -> Vec<Result<Post, String>> {
    let host = &shared.host_name;
    let processes = heap_profile::largest(&snapshot.profile, shared.max_series_processes);
    let mut posts = Vec::new();
    for process in &processes {
        let profile =
            build_profile(&snapshot.profile, snapshot.traced_for, Processes::One(process.identity.pid));
        let mut gzipped = Vec::new();
        posts.push(match write_gzipped(&profile, &mut gzipped) {
            Ok(()) => Ok(ingest_post(&series_name(host, process), span, gzipped)),
            Err(err) => Err(err.to_string()),
        });
    }
    for kill in shared.take_oom_profiles() {
        let name =
            format!("memtrace.oom_heap{{host={},pid={},comm={}}}", clean(host), kill.pid, clean(&kill.comm));
        posts.push(Ok(ingest_post(&name, span, kill.gzipped)));
    }
    posts
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

/// The ingest POST of one gzipped profile under series `name`.
fn ingest_post(name: &str, span: Span, profile: Vec<u8>) -> Post {
    Post {
        path: format!(
            "/ingest?name={}&from={}&until={}&format=pprof",
            percent_encode(name),
            span.from,
            span.until
        ),
        headers: vec![("content-type", format!("multipart/form-data; boundary={BOUNDARY}"))],
        body: Bytes::from(multipart(&profile)),
    }
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
