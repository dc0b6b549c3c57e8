//! `GET /debug/pprof/heap` (and `/debug/pprof/allocs`): the heap profile as Go's net/http/pprof
//! serves it, a gzipped profile.proto, built from stacks read at the first sample after the request.
//! `?pid=N` for one process; all traced processes otherwise, each sample labelled with its pid.

use http_body_util::Full;
use hyper::{body::Bytes, header, StatusCode};

use super::{
    reply::{text, Reply},
    shared::Shared,
};
use crate::export::{
    heap_profile::Processes,
    pprof::{build_profile, write_gzipped},
};

/// Which of Go's two heap endpoints: the same profile, shown by default as live or as allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Heap,
    Allocs,
}

pub async fn respond(shared: &Shared, query: Option<&str>, endpoint: Endpoint) -> Reply {
    let pid = match requested_pid(query) {
        Ok(pid) => pid,
        Err(problem) => return text(StatusCode::BAD_REQUEST, problem),
    };
    let Some(snapshot) = shared.fresh_snapshot().await else {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "memtrace took no sample to read the stacks in time; try again\n".to_owned(),
        );
    };
    let processes = match pid {
        Some(pid) if !snapshot.profile.processes.contains_key(&pid) => {
            return text(StatusCode::NOT_FOUND, format!("pid {pid} is not traced (or has exited)\n"));
        }
        Some(pid) => Processes::One(pid),
        None => Processes::All,
    };
    let mut profile = build_profile(&snapshot.profile, snapshot.traced_for, processes);
    if endpoint == Endpoint::Allocs {
        if let Some(index) = profile.string_table.iter().position(|s| s == "alloc_space") {
            profile.default_sample_type = index as i64;
        }
    }
    let mut body = Vec::new();
    if let Err(err) = write_gzipped(&profile, &mut body) {
        return text(StatusCode::INTERNAL_SERVER_ERROR, format!("compressing the profile: {err}"));
    }
    let name = match endpoint {
        Endpoint::Heap => "heap",
        Endpoint::Allocs => "allocs",
    };
    hyper::Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_DISPOSITION, format!("attachment; filename=\"{name}\""))
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "building the response\n".to_owned()))
}

/// `pid=N` from the query; `debug=N` asks for Go's text form, which memtrace does not write.
fn requested_pid(query: Option<&str>) -> Result<Option<u32>, String> {
    let mut pid = None;
    for pair in query.unwrap_or_default().split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "pid" => match value.parse::<u32>() {
                Ok(number) if number > 0 => pid = Some(number),
                _ => return Err(format!("pid={value} is not a process id; write e.g. ?pid=4242\n")),
            },
            "debug" if value != "0" => {
                return Err("memtrace serves only the protobuf form of the profile (debug=0); read it with \
                            `go tool pprof`\n"
                    .to_owned())
            }
            // gc=1 and other options of Go's handler change nothing here.
            _ => {}
        }
    }
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_names_one_process_or_none() {
        assert_eq!(requested_pid(None), Ok(None));
        assert_eq!(requested_pid(Some("pid=42")), Ok(Some(42)));
        assert_eq!(requested_pid(Some("gc=1&pid=7")), Ok(Some(7)));
        assert!(requested_pid(Some("pid=x")).unwrap_err().contains("pid=x"));
        assert!(requested_pid(Some("pid=0")).is_err());
        assert!(requested_pid(Some("debug=1")).is_err());
        assert_eq!(requested_pid(Some("debug=0")), Ok(None));
    }
}
