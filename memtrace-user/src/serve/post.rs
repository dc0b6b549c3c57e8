//! What every push of the agent shares (Pyroscope's ingest, OTLP): the loop that pushes at every
//! interval from a fresh snapshot, one HTTP/1.1 POST to a plain http:// base URL, tried three
//! times with backoff, and the failures of each round said on stderr and counted in
//! memtrace_push_failures_total. What a round sends is the target's (push.rs, otlp_push.rs).

use std::{
    sync::{atomic::Ordering, Arc},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{bail, Context, Result};
use http_body_util::Full;
use hyper::{body::Bytes, header, Request, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::shared::{Shared, Snapshot};
use crate::plan::PushTarget;

const ATTEMPTS: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// One request: a path (and query) under the base URL's path, its headers and its body.
pub struct Post {
    pub path: String,
    pub headers: Vec<(&'static str, String)>,
    pub body: Bytes,
}

/// The time a round of pushes covers, in Unix seconds: the last interval.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub from: u64,
    pub until: u64,
}

/// Pushes at every `target.interval` until the server thread stops. Each round waits for a fresh
/// snapshot (one that read the stacks), asks `round` for its posts (a post that could not be made
/// says why), sends each with retries, and counts and says the round's failures once.
pub async fn every_interval<F>(shared: Arc<Shared>, target: PushTarget, round: F)
where
    F: Fn(&Shared, &Snapshot, Span) -> Vec<Result<Post, String>>,
{
    let mut ticks = tokio::time::interval(target.interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let until = unix_seconds();
        let span = Span { from: until.saturating_sub(target.interval.as_secs().max(1)), until };
        let Some(snapshot) = shared.fresh_snapshot().await else {
            failed(&shared, &target.base, 1, "no sample came to read the stacks".to_owned());
            continue;
        };
        let (mut failures, mut last_error) = (0, String::new());
        for post in round(&shared, &snapshot, span) {
            let sent = match post {
                Ok(post) => with_retries(&target.base, &post).await.map_err(|err| format!("{err:#}")),
                Err(why) => Err(why),
            };
            if let Err(error) = sent {
                (failures, last_error) = (failures + 1, error);
            }
        }
        if failures > 0 {
            failed(&shared, &target.base, failures, last_error);
        }
    }
}

/// POSTs until the server answers 2xx, at most three times.
pub async fn with_retries(base: &Uri, post: &Post) -> Result<()> {
    let mut backoff = FIRST_BACKOFF;
    let mut attempt = 1;
    loop {
        let pushed = tokio::time::timeout(ATTEMPT_TIMEOUT, once(base, post))
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

async fn once(base: &Uri, post: &Post) -> Result<()> {
    let authority = base.authority().context("the push URL has no host")?;
    let port = authority.port_u16().unwrap_or(80);
    let stream = TcpStream::connect((authority.host(), port))
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let mut request = Request::post(format!("{}{}", base.path().trim_end_matches('/'), post.path))
        .header(header::HOST, authority.as_str());
    for (name, value) in &post.headers {
        request = request.header(*name, value);
    }
    let request = request.body(Full::new(post.body.clone()))?;
    let response = sender.send_request(request).await.context("sending the profile")?;
    if !response.status().is_success() {
        bail!("the server answered {}", response.status());
    }
    Ok(())
}

/// Counts `failures` pushes to `base` as failed and says so with the last error.
fn failed(shared: &Shared, base: &Uri, failures: u64, error: String) {
    if let Some(count) = &shared.push_failures {
        count.fetch_add(failures, Ordering::Relaxed);
    }
    eprintln!("memtrace: warning: {failures} heap profile push(es) to {base} failed: {error}");
}

fn unix_seconds() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs())
}
