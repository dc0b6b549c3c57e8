//! `--push URL`: every `--push-interval`, the heap profile of each of the largest processes goes to
//! a Pyroscope-compatible ingest endpoint: `POST /ingest?name=memtrace.heap{host=..,pid=..,comm=..}
//! &from=..&until=..&format=pprof`, the gzipped profile in the multipart field `profile`. Each push
//! is tried three times with backoff; a push that still fails is counted (memtrace_push_failures_total)
//! and said on stderr. The heap at each OOM kill since the last push (serve/oom.rs) goes too, once, as
//! `memtrace.oom_heap{host=..,pid=..,comm=..}`. It runs on the server's thread: it never blocks tracing.

use std::{
    sync::{atomic::Ordering, Arc},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use http_body_util::Full;
use hyper::{body::Bytes, header, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::shared::Shared;
use crate::{
    export::pprof::{build_profile, write_gzipped, Processes},
    model::Process,
    plan::PushTarget,
};

const ATTEMPTS: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
const BOUNDARY: &str = "memtrace-profile-boundary-7d1f0c";

/// Pushes at every interval until the server thread stops.
pub async fn run(shared: Arc<Shared>, target: PushTarget) {
    let host = nix::unistd::gethostname().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
    let mut ticks = tokio::time::interval(target.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let until = unix_seconds();
        let from = until.saturating_sub(target.interval.as_secs().max(1));
        let Some(snapshot) = shared.fresh_snapshot().await else {
            failed(&shared, &target, 1, "no sample came to read the stacks".to_owned());
            continue;
        };
        let mut processes: Vec<&Process> = snapshot.profile.processes.values().collect();
        processes.sort_by_key(|process| (std::cmp::Reverse(process.stats.live_bytes), process.pid));
        processes.truncate(shared.max_series_processes);
        let (mut failures, mut last_error) = (0, String::new());
        for process in &processes {
            let name = series_name(&host, process);
            let profile = build_profile(&snapshot.profile, snapshot.traced_for, Processes::One(process.pid));
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
            failed(&shared, &target, failures, last_error);
        }
    }
}

fn failed(shared: &Shared, target: &PushTarget, failures: u64, error: String) {
    if let Some(count) = &shared.push_failures {
        count.fetch_add(failures, Ordering::Relaxed);
    }
    eprintln!("memtrace: warning: {failures} heap profile push(es) to {} failed: {error}", target.base);
}

/// `memtrace.heap{host=..,pid=..,comm=..}`, label values cut to what Pyroscope accepts.
fn series_name(host: &str, process: &Process) -> String {
    format!("memtrace.heap{{host={},pid={},comm={}}}", clean(host), process.pid, clean(&process.comm))
}

/// A label value cut to what Pyroscope accepts.
fn clean(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect()
}

async fn push_with_retries(base: &Uri, name: &str, from: u64, until: u64, profile: Vec<u8>) -> Result<()> {
    let body = Bytes::from(multipart(&profile));
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1;
    loop {
        let pushed = tokio::time::timeout(ATTEMPT_TIMEOUT, push_once(base, name, from, until, body.clone()))
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {ATTEMPT_TIMEOUT:?}")));
        match pushed {
            Ok(()) => return Ok(()),
            Err(err) if attempt >= ATTEMPTS => return Err(err.context(format!("{ATTEMPTS} attempts"))),
            Err(_) => {}
        }
        tokio::time::sleep(backoff).await;
        backoff *= 2;
        attempt += 1;
    }
}

async fn push_once(base: &Uri, name: &str, from: u64, until: u64, body: Bytes) -> Result<()> {
    let authority = base.authority().context("the --push URL has no host")?;
    let port = authority.port_u16().unwrap_or(80);
    let stream = TcpStream::connect((authority.host(), port))
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let path = format!(
        "{}/ingest?name={}&from={from}&until={until}&format=pprof",
        base.path().trim_end_matches('/'),
        percent_encode(name)
    );
    let request = Request::post(path)
        .header(header::HOST, authority.as_str())
        .header(header::CONTENT_TYPE, format!("multipart/form-data; boundary={BOUNDARY}"))
        .body(Full::new(body))?;
    let response = sender.send_request(request).await.context("sending the profile")?;
    if !response.status().is_success() {
        bail!("the server answered {}", response.status());
    }
    Ok(())
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

fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_names_carry_host_and_process() {
        let mut model = crate::model::Model::default();
        model.add_process(42, "my app".into(), "/libc".into());
        let name = series_name("web-1", &model.processes[&42]);
        assert_eq!(name, "memtrace.heap{host=web-1,pid=42,comm=my_app}");
        assert_eq!(percent_encode("a{b=c,d}"), "a%7Bb%3Dc%2Cd%7D");
        let body = multipart(b"PROFILE");
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains("name=\"profile\"") && text.contains("\r\n\r\nPROFILE\r\n--"), "{text}");
    }
}
