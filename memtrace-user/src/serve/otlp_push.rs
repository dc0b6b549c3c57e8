//! `--otlp-endpoint URL`: every `--push-interval`, one OTLP profiles request with the heap
//! profiles of the largest processes (export/otlp) goes to `URL/v1development/profiles`, as
//! OTLP/HTTP sends it: protobuf, with the development version of the profiles signal in a header
//! the OpenTelemetry Collector checks before decoding. Tried, counted and said as every push is
//! (post.rs); it runs on the server's thread and never blocks tracing.

use std::sync::Arc;

use hyper::body::Bytes;
use prost::Message;

use super::{
    post::{self, Post, Span},
    shared::{Shared, Snapshot},
};
use crate::{
    export::{
        heap_profile,
        otlp::{build_request, Recording, Window},
    },
    plan::PushTarget,
};

/// The OTLP/HTTP path of the profiles signal, under the endpoint's base path.
pub const PROFILES_PATH: &str = "/v1development/profiles";
/// The metadata key of the profiles signal's development version, and the version memtrace's
/// messages are: the Collector (pdata's ProfilesDevelopmentVersionHeader) rejects a request whose
/// value it does not support, and takes a request without it as version 1.
pub const DEVELOPMENT_VERSION_HEADER: &str = "otlp-profiles-development-version";
pub const DEVELOPMENT_VERSION: &str = "1";

/// Pushes at every interval until the server thread stops: the heap at each OOM kill since the
/// last push, a request of its own, once; then the largest processes' heap profiles.
pub async fn run(shared: Arc<Shared>, target: PushTarget) {
    post::every_interval(shared, target, round).await
}

fn round(shared: &Shared, snapshot: &Snapshot, _span: Span) -> Vec<Result<Post, String>> {
    let mut posts: Vec<Result<Post, String>> =
        shared.take_oom_requests().into_iter().map(|request| Ok(profiles_post(request))).collect();
    let processes = heap_profile::largest(&snapshot.profile, shared.max_series_processes);
    let window = Window::ending_now(snapshot.traced_for);
    let request = build_request(Recording::of(&snapshot.profile), &processes, window, &shared.host_name);
    posts.push(Ok(profiles_post(request.encode_to_vec())));
    posts
}

/// The POST of one encoded ExportProfilesServiceRequest.
fn profiles_post(body: Vec<u8>) -> Post {
    Post {
        path: PROFILES_PATH.to_owned(),
        headers: vec![
            ("content-type", "application/x-protobuf".to_owned()),
            (DEVELOPMENT_VERSION_HEADER, DEVELOPMENT_VERSION.to_owned()),
        ],
        body: Bytes::from(body),
    }
}
