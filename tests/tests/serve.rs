//! `memtrace serve`, the fleet agent, read by the real tools a fleet runs: Debian's Prometheus
//! scraping /metrics finds the fixture's live bytes; Go's pprof reads the live /debug/pprof/heap and
//! finds its leaking functions. Hostile clients (one sending its request byte by byte, one with
//! oversized headers, one that never finishes) stall no one, and 200 concurrent scrapes are all
//! answered. SIGINT ends the agent with status 0, and no trace file is written unless asked.

use std::{
    ffi::OsStr,
    io::{Read, Write},
    net::{Shutdown, TcpListener, TcpStream},
    path::Path,
    process::Command,
    sync::{mpsc, Arc, Barrier},
    thread,
    time::Instant,
};

use memtrace_tests::{
    fixture, poll,
    pprof::go_pprof,
    receiver::{receive, Received},
    Memtrace, Running, Spawned, DEADLINE, INTERVAL,
};
use serde_json::Value;

/// fixtures/leaks.c once its blocks are allocated: 5 x 1000 bytes from leak_textures and
/// 3 x 256 bytes from leak_cache stay live.
const LIVE_BYTES: u64 = 5768;
const LIVE_ALLOCATIONS: u64 = 8;

/// memtrace serve tracing fixtures/leaks.c (lingering with its leaks allocated), on a port of
/// its own.
struct Agent {
    memtrace: Running,
    target: Spawned,
    port: u16,
}

impl Agent {
    fn start() -> Self {
        Self::start_in(Memtrace::new(), &[])
    }

    fn start_in(memtrace: Memtrace, extra_args: &[&str]) -> Self {
        let mut target = Spawned::spawn({
            let mut command = Command::new(fixture("leaks"));
            command.arg("linger");
            command
        });
        target.wait_for_stdout("ready");
        let pid = target.pid().to_string();
        let mut memtrace = memtrace
            .without_default_outputs()
            .args(["serve", "--listen", "127.0.0.1:0", "-i", INTERVAL, "--pid", &pid])
            .args(extra_args)
            .spawn();
        let port = memtrace.serving_port();
        memtrace.wait_for_stderr("memtrace: tracing");
        target.send(b"g");
        target.wait_for_stdout("leaked");
        Self { memtrace, target, port }
    }

    fn pid(&self) -> u32 {
        self.target.pid()
    }

    fn get(&self, path: &str) -> Reply {
        get(self.port, path)
    }

    /// Polls /metrics until the fixture's live bytes show (the first sample after its leaks).
    fn wait_for_leaks(&self) -> String {
        let wanted =
            format!("memtrace_heap_live_bytes{{pid=\"{}\",comm=\"leaks\",allocator=\"glibc\"}} ", self.pid());
        poll("the fixture's live bytes in /metrics", || {
            let metrics = self.get("/metrics").text();
            let value = metrics.lines().find_map(|line| line.strip_prefix(&wanted))?;
            (value == LIVE_BYTES.to_string()).then_some(metrics)
        })
    }
}

/// One HTTP response, read to the end of the connection.
struct Reply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        assert_eq!(self.status, 200, "{}\n{}", self.head, String::from_utf8_lossy(&self.body));
        String::from_utf8(self.body.clone()).expect("a text body")
    }

    fn parse(raw: &[u8]) -> Self {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no end of the response head in {:?}", String::from_utf8_lossy(raw)));
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let status = head.split(' ').nth(1).and_then(|code| code.parse().ok()).expect("a status code");
        Self { status, head, body: raw[split + 4..].to_vec() }
    }
}

fn connect(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to the agent");
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

fn request(path: &str, port: u16) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n")
}

/// Reads a response until the server closes the connection.
fn read_reply(mut stream: TcpStream) -> Reply {
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("reading the response");
    Reply::parse(&raw)
}

fn get(port: u16, path: &str) -> Reply {
    let mut stream = connect(port);
    stream.write_all(request(path, port).as_bytes()).expect("sending a request");
    read_reply(stream)
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    listener.local_addr().unwrap().port()
}

#[test]
fn prometheus_scrapes_the_fixture_live_heap() {
    let agent = Agent::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: memtrace\n    \
             static_configs:\n      - targets: ['127.0.0.1:{}']\n",
            agent.port
        ),
    )
    .unwrap();
    let web = free_port();
    let mut prometheus = Spawned::spawn({
        let mut command = Command::new("prometheus");
        command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{web}"));
        command
    });
    let query = |expression: &str| -> Option<String> {
        // Refused until Prometheus listens.
        let mut stream = TcpStream::connect(("127.0.0.1", web)).ok()?;
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        let path = format!("/api/v1/query?query={}", encode_query(expression));
        stream.write_all(request(&path, web).as_bytes()).ok()?;
        let reply = read_reply(stream);
        let answer: Value = serde_json::from_slice(&reply.body).ok()?;
        answer["data"]["result"][0]["value"][1].as_str().map(str::to_owned)
    };
    let pid = agent.pid();
    let live = poll("Prometheus's memtrace_heap_live_bytes of the fixture", || {
        if let Some(status) = prometheus.try_wait() {
            panic!("prometheus exited ({status}):\n{}", prometheus.stderr_text());
        }
        query(&format!("memtrace_heap_live_bytes{{pid=\"{pid}\"}}")).filter(|v| *v == LIVE_BYTES.to_string())
    });
    assert_eq!(live, LIVE_BYTES.to_string());
    let blocks =
        query(&format!("memtrace_heap_live_allocations{{pid=\"{pid}\",comm=\"leaks\",allocator=\"glibc\"}}"));
    assert_eq!(blocks, Some(LIVE_ALLOCATIONS.to_string()));
    // Every memory level is a gauge: the fixture's program and libc are resident.
    let file = query(&format!("memtrace_rss_file_bytes{{pid=\"{pid}\"}}"));
    assert!(file.and_then(|v| v.parse::<u64>().ok()).is_some_and(|bytes| bytes > 0));
    assert!(query(&format!("memtrace_dark_bytes{{pid=\"{pid}\"}}")).is_some());
    assert_eq!(query("memtrace_traced_processes"), Some("1".to_owned()));
    assert_eq!(query("memtrace_lost_events_total"), Some("0".to_owned()));
    assert_eq!(query("up{job=\"memtrace\"}"), Some("1".to_owned()));
    prometheus.kill();
}

/// Percent-encodes a PromQL expression for a query string.
fn encode_query(expression: &str) -> String {
    expression
        .bytes()
        .map(|byte| match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (byte as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}

/// `go tool pprof -top` of a live URL: the lines of its report.
fn pprof_top(url: &str, home: &Path) -> String {
    go_pprof(["-top", "-sample_index=inuse_space", url], home)
}

/// The flat inuse_space of `function` in a `-top` report.
fn flat_bytes(top: &str, function: &str) -> Option<String> {
    top.lines()
        .find(|line| line.split_whitespace().last() == Some(function))?
        .split_whitespace()
        .next()
        .map(str::to_owned)
}

#[test]
fn go_pprof_reads_the_live_heap_profile() {
    let agent = Agent::start();
    agent.wait_for_leaks();
    let home = tempfile::tempdir().unwrap();
    for path in ["/debug/pprof/heap".to_owned(), format!("/debug/pprof/heap?pid={}", agent.pid())] {
        let top = pprof_top(&format!("http://127.0.0.1:{}{path}", agent.port), home.path());
        assert!(top.contains(&format!("of {LIVE_BYTES}B total")), "{path}:\n{top}");
        assert_eq!(flat_bytes(&top, "leak_textures").as_deref(), Some("5000B"), "{path}:\n{top}");
        assert_eq!(flat_bytes(&top, "leak_cache").as_deref(), Some("768B"), "{path}:\n{top}");
    }
    let raw = agent.get("/debug/pprof/heap");
    assert_eq!(raw.status, 200);
    assert!(raw.head.to_ascii_lowercase().contains("content-type: application/octet-stream"), "{}", raw.head);
    assert_eq!(raw.body[..2], [0x1f, 0x8b], "gzipped, as Go serves it");
    let unknown = agent.get(&format!("/debug/pprof/heap?pid={}", memtrace_tests::unused_pid()));
    assert_eq!(unknown.status, 404);
    assert_eq!(agent.get("/debug/pprof/heap?pid=x").status, 400);
    assert_eq!(agent.get("/healthz").text(), "ok\n");
    assert_eq!(agent.get("/nothing").status, 404);
}

#[test]
fn hostile_clients_stall_no_one_and_200_concurrent_scrapes_are_answered() {
    let agent = Agent::start();
    let series = format!("memtrace_heap_live_bytes{{pid=\"{}\"", agent.pid());
    agent.wait_for_leaks();
    let port = agent.port;
    // A client that starts a request and never finishes it: the server closes the connection.
    let stalled = thread::spawn(move || {
        let mut stream = connect(port);
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    });
    // Headers beyond the server's bound are refused, not buffered.
    let oversized = {
        let mut stream = connect(port);
        let header =
            format!("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: {}\r\n\r\n", "a".repeat(64 * 1024));
        let _ = stream.write_all(header.as_bytes());
        let _ = stream.shutdown(Shutdown::Write);
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw);
        raw
    };
    assert!(!oversized.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&oversized));
    // A client sending its request a byte at a time, halfway through while the others scrape.
    let (halfway, resume) = (mpsc::channel(), mpsc::channel::<()>());
    let slow = thread::spawn(move || {
        let mut stream = connect(port);
        let bytes = request("/metrics", port).into_bytes();
        let (first, second) = bytes.split_at(bytes.len() / 2);
        for byte in first {
            stream.write_all(&[*byte]).unwrap();
        }
        halfway.0.send(()).unwrap();
        resume.1.recv().unwrap();
        for byte in second {
            stream.write_all(&[*byte]).unwrap();
        }
        read_reply(stream)
    });
    halfway.1.recv_timeout(DEADLINE).expect("the slow client sent half its request");
    const SCRAPES: usize = 200;
    let start = Arc::new(Barrier::new(SCRAPES));
    let scrapers: Vec<_> = (0..SCRAPES)
        .map(|_| {
            let start = Arc::clone(&start);
            thread::spawn(move || {
                start.wait();
                get(port, "/metrics")
            })
        })
        .collect();
    for scraper in scrapers {
        let reply = scraper.join().expect("a scraper thread");
        assert!(reply.text().contains(&series), "a scrape without the fixture's series");
    }
    resume.0.send(()).unwrap();
    let slow = slow.join().expect("the slow client");
    assert!(slow.text().contains(&series));
    stalled.join().expect("the stalled client's connection was closed");
}

#[test]
fn sigint_ends_the_agent_with_status_0_and_no_trace_file() {
    let memtrace = Memtrace::new();
    // Run in its own directory, where a default trace file would appear.
    let dir = memtrace.dir().to_owned();
    let mut agent =
        Agent::start_in(memtrace.wrapped_in([OsStr::new("env"), OsStr::new("-C"), dir.as_os_str()]), &[]);
    agent.wait_for_leaks();
    agent.memtrace.interrupt();
    let stopped = Instant::now();
    let outcome = agent.memtrace.finish();
    eprintln!("memtrace serve exited {:?} after SIGINT", stopped.elapsed());
    outcome.assert_exit_code(0);
    let written: Vec<_> =
        std::fs::read_dir(outcome.dir()).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    assert!(written.is_empty(), "memtrace serve wrote {written:?} without -o");
}

/// `serve -- COMMAND` is a run whose live output is the agent: it takes every option of a run,
/// ends with the command (status 0, no signal needed), and writes what a run writes at its end.
#[test]
fn serving_a_command_ends_with_it_and_writes_the_run_outputs() {
    let memtrace = Memtrace::new().without_default_outputs();
    let summary = memtrace.dir().join("summary.json");
    let outcome = memtrace
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "-i",
            INTERVAL,
            "--max-stacks",
            "4096",
            "--keep-exited",
            "5",
        ])
        .arg("--summary")
        .arg(&summary)
        .arg("--")
        .arg(fixture("leaks"))
        .run();
    outcome.assert_exit_code(0);
    outcome.assert_stderr_mentions(&["memtrace: serving http://127.0.0.1:", "memtrace: tracing"]);
    let processes = outcome.summary()["processes"].as_array().expect("processes");
    let leaks = processes.iter().find(|process| process["comm"] == "leaks").expect("the fixture's report");
    assert_eq!(leaks["live_bytes"], LIVE_BYTES);
    assert_eq!(leaks["live_allocations"], LIVE_ALLOCATIONS);
}

#[test]
fn listening_beyond_loopback_needs_the_address_in_full() {
    let outcome =
        Memtrace::new().without_default_outputs().args(["serve", "--listen", ":9464", "--all"]).run();
    outcome.assert_exit_code(2);
    outcome.assert_stderr_mentions(&["0.0.0.0:9464", "127.0.0.1:9464"]);
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let outcome =
        Memtrace::new().without_default_outputs().args(["serve", "--listen", &address, "--all"]).run();
    outcome.assert_exit_code(1);
    assert!(
        outcome.error_line().contains(&address) && outcome.error_line().contains("--listen"),
        "{}",
        outcome.stderr
    );
}

/// One request an ingest receiver got: its request line and the multipart field `profile`.
struct Pushed {
    request_line: String,
    profile: Vec<u8>,
}

/// Accepts one connection and answers its request with `status`, returning what it got.
fn receive_push(listener: &TcpListener, status: &str) -> Pushed {
    let Received { head, body: raw } = receive(listener, status);
    let boundary = head
        .lines()
        .find(|line| line.to_ascii_lowercase().starts_with("content-type: multipart/form-data"))
        .and_then(|line| line.split("boundary=").nth(1))
        .unwrap_or_else(|| panic!("no multipart boundary in {head}"))
        .trim()
        .to_owned();
    let body = &raw[..];
    let part = find(body, b"name=\"profile\"").expect("a field named profile");
    let start = part + find(&body[part..], b"\r\n\r\n").unwrap() + 4;
    let end = start + find(&body[start..], format!("\r\n--{boundary}").as_bytes()).unwrap();
    Pushed { request_line: head.lines().next().unwrap().to_owned(), profile: body[start..end].to_vec() }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

#[test]
fn pushes_reach_a_pyroscope_ingest_endpoint_and_failures_are_counted() {
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", receiver.local_addr().unwrap());
    let agent = Agent::start_in(Memtrace::new(), &["--push", &url, "--push-interval", "1s"]);
    let home = tempfile::tempdir().unwrap();
    let process = format!("%2Cpid%3D{}%2Ccomm%3Dleaks%7D", agent.pid());
    // The first pushes may come before the fixture's leaks; a later one has them all.
    let top = poll("a pushed profile with the fixture's leaks", || {
        let pushed = receive_push(&receiver, "200 OK");
        let line = &pushed.request_line;
        assert!(line.starts_with("POST /ingest?name=memtrace.heap%7Bhost%3D"), "{line}");
        assert!(line.contains(&process), "{line}");
        assert!(
            line.contains("&from=") && line.contains("&until=") && line.contains("&format=pprof"),
            "{line}"
        );
        assert_eq!(pushed.profile[..2], [0x1f, 0x8b], "a gzipped profile");
        let file = home.path().join("pushed.pb.gz");
        std::fs::write(&file, &pushed.profile).unwrap();
        let top = pprof_top(file.to_str().unwrap(), home.path());
        top.contains(&format!("of {LIVE_BYTES}B total")).then_some(top)
    });
    assert_eq!(flat_bytes(&top, "leak_textures").as_deref(), Some("5000B"), "{top}");
    // A server that refuses: the push is tried three times, then counted and said.
    for _ in 0..3 {
        receive_push(&receiver, "500 Internal Server Error");
    }
    let port = agent.port;
    let mut memtrace = agent.memtrace;
    memtrace.wait_for_stderr_containing("heap profile push(es) to");
    let failures = poll("memtrace_push_failures_total", || {
        let metrics = get(port, "/metrics").text();
        let value = metrics.lines().find_map(|line| line.strip_prefix("memtrace_push_failures_total "))?;
        (value != "0").then(|| value.to_owned())
    });
    assert_eq!(failures, "1");
}

#[test]
fn an_exited_target_is_in_one_more_scrape_then_leaves() {
    let mut agent = Agent::start();
    agent.wait_for_leaks();
    agent.target.close_stdin();
    assert!(agent.target.wait().success());
    let series =
        format!("memtrace_heap_live_bytes{{pid=\"{}\",comm=\"leaks\",allocator=\"glibc\"}} ", agent.pid());
    // The first scrape that counts no traced process is the first to see the exit.
    let last = poll("a scrape after the target's exit", || {
        let metrics = agent.get("/metrics").text();
        metrics.lines().any(|line| line == "memtrace_traced_processes 0").then_some(metrics)
    });
    let live = last.lines().find_map(|line| line.strip_prefix(&series));
    assert_eq!(live, Some(LIVE_BYTES.to_string().as_str()), "the final figures, once:\n{last}");
    let after = agent.get("/metrics").text();
    assert!(!after.contains(&series), "the exited target is still exposed:\n{after}");
    assert!(after.contains("memtrace_traced_processes 0\n"), "{after}");
}
