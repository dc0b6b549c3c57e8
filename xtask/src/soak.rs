//! `cargo xtask soak [MINUTES]`: memtrace --all for a while (10 minutes by default) under a mixed
//! load: a C compiler in a loop, short Python scripts, and a small HTTP server answering a client
//! loop. Then: memtrace's own memory at the start and the end (from its /proc status), the
//! kernel tables' occupancy (the summary's `kernel_maps`), events lost, how many processes were
//! reported (each pid once), and whether every output parses. With `--serve`, the agent
//! (`memtrace serve --all`) soaks instead, scraped as a fleet would: /metrics every 5 s, the heap
//! profile every minute, each answer checked and timed. Not part of `cargo xtask test`.

use std::{
    fs,
    io::{BufRead, BufReader, Read, Write},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{as_root, workspace_root};

/// Where the agent listens under `--serve`.
const AGENT: &str = "127.0.0.1:19464";

pub fn run(memtrace: &Path, minutes: u64, serve: bool) -> Result<()> {
    let dir = workspace_root().join("target/soak");
    fs::create_dir_all(&dir)?;
    let (trace, summary) = (dir.join("trace.json"), dir.join("summary.json"));
    let mut command = as_root(memtrace);
    if serve {
        command.args(["serve", "--listen", AGENT]);
    }
    let mut tracer = command
        .args(["--all", "-o"])
        .arg(&trace)
        .arg("--summary")
        .arg(&summary)
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memtrace --all")?;
    let stderr = tracer.stderr.take().context("memtrace's stderr")?;
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    if !lines.any(|line| line.starts_with("memtrace: tracing")) {
        bail!("memtrace --all never said it was tracing");
    }
    let rss_start = Memory::of(tracer.id());
    let load = start_load(&dir)?;
    let end = Instant::now() + Duration::from_secs(minutes * 60);
    let mut rss_peak = rss_start;
    let mut scrapes = serve.then(Scrapes::default);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_secs(5));
        rss_peak = rss_peak.max(Memory::of(tracer.id()));
        if let Some(scrapes) = &mut scrapes {
            scrapes.scrape();
        }
    }
    let rss_end = Memory::of(tracer.id());
    for mut child in load {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = Command::new("kill").arg("-INT").arg(tracer.id().to_string()).status();
    let said: Vec<String> = lines.collect();
    let status = tracer.wait()?;
    report(&summary, &trace, (rss_start, rss_peak, rss_end), &said)?;
    if !status.success() {
        bail!("memtrace exited with {status}");
    }
    scrapes.map_or(Ok(()), |scrapes| scrapes.report())
}

/// What the agent's endpoints answered over the soak.
#[derive(Default)]
struct Scrapes {
    metrics: Endpoint,
    profiles: Endpoint,
    last_profile: Option<Instant>,
}

/// One endpoint's answers: how many, how many failed (and the first failure), the slowest and
/// the largest.
#[derive(Default)]
struct Endpoint {
    answered: u32,
    failed: u32,
    first_failure: Option<String>,
    slowest: Duration,
    largest: usize,
}

impl Scrapes {
    /// A /metrics scrape, and the heap profile once a minute.
    fn scrape(&mut self) {
        self.metrics.note(get("/metrics"), |body| {
            String::from_utf8_lossy(body)
                .contains("memtrace_traced_processes")
                .then_some(())
                .ok_or("no memtrace_traced_processes series")
        });
        if self.last_profile.is_none_or(|last| last.elapsed() >= Duration::from_secs(60)) {
            self.last_profile = Some(Instant::now());
            self.profiles.note(get("/debug/pprof/heap"), |body| {
                body.starts_with(&[0x1f, 0x8b]).then_some(()).ok_or("not a gzipped profile")
            });
        }
    }

    fn report(&self) -> Result<()> {
        for (what, endpoint) in [("/metrics", &self.metrics), ("/debug/pprof/heap", &self.profiles)] {
            println!(
                "soak: {what}: {} answered, {} failed; slowest {:.2} s, largest {} KiB",
                endpoint.answered,
                endpoint.failed,
                endpoint.slowest.as_secs_f64(),
                endpoint.largest / 1024
            );
            if let Some(failure) = &endpoint.first_failure {
                bail!("the agent's {what} failed {} times; the first: {failure}", endpoint.failed);
            }
        }
        Ok(())
    }
}

impl Endpoint {
    fn note(
        &mut self,
        answer: Result<(Vec<u8>, Duration)>,
        check: impl Fn(&[u8]) -> Result<(), &'static str>,
    ) {
        let checked = answer.and_then(|(body, took)| {
            check(&body).map_err(|why| anyhow::anyhow!(why))?;
            Ok((body.len(), took))
        });
        match checked {
            Ok((size, took)) => {
                self.answered += 1;
                self.slowest = self.slowest.max(took);
                self.largest = self.largest.max(size);
            }
            Err(err) => {
                self.failed += 1;
                self.first_failure.get_or_insert(format!("{err:#}"));
            }
        }
    }
}

/// GET `path` from the agent: the body of a 200 answer and how long it took.
fn get(path: &str) -> Result<(Vec<u8>, Duration)> {
    let start = Instant::now();
    let mut stream = TcpStream::connect(AGENT).with_context(|| format!("connecting to {AGENT}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {AGENT}\r\nConnection: close\r\n\r\n")?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).with_context(|| format!("reading the answer to GET {path}"))?;
    let took = start.elapsed();
    let split = answer.windows(4).position(|w| w == b"\r\n\r\n").context("an answer without a header")?;
    let status = String::from_utf8_lossy(&answer[..split]).lines().next().unwrap_or_default().to_owned();
    if !status.contains(" 200 ") {
        bail!("GET {path}: {status}");
    }
    Ok((answer[split + 4..].to_vec(), took))
}

/// The load, as shell loops that run until killed: a compiler, short Python scripts, an HTTP
/// server and a client.
fn start_load(dir: &Path) -> Result<Vec<Child>> {
    let source = dir.join("unit.c");
    fs::write(&source, "#include <stdio.h>\nint main(void) { puts(\"soak\"); return 0; }\n")?;
    let loops = [
        format!("while true; do cc -O2 -o {0}/unit {0}/unit.c; done", dir.display()),
        "while true; do python3 -c 'import json; json.dumps([str(i) for i in range(20000)])'; done".to_owned(),
        format!("cd {} && exec python3 -m http.server 18080 --bind 127.0.0.1", dir.display()),
        "while true; do python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:18080/\").read()' \
         2>/dev/null; done"
            .to_owned(),
    ];
    loops
        .iter()
        .map(|script| {
            Command::new("sh")
                .args(["-c", script])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {script}"))
        })
        .collect()
}

fn report(
    summary: &Path,
    trace: &Path,
    (start, peak, end): (Memory, Memory, Memory),
    said: &[String],
) -> Result<()> {
    let text = fs::read_to_string(summary).with_context(|| format!("reading {}", summary.display()))?;
    let summary: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", summary.display()))?;
    let trace_text = fs::read_to_string(trace).with_context(|| format!("reading {}", trace.display()))?;
    serde_json::from_str::<serde_json::Value>(&trace_text)
        .with_context(|| format!("{} is not valid JSON", trace.display()))?;
    let processes = summary["processes"].as_array().context("no processes in the summary")?;
    let mut pids: Vec<u64> = processes.iter().filter_map(|p| p["pid"].as_u64()).collect();
    let reported = pids.len();
    pids.sort_unstable();
    pids.dedup();
    println!(
        "soak: memtrace RSS {} KiB at the start, {} KiB at its peak, {} KiB at the end",
        start.rss, peak.rss, end.rss
    );
    println!(
        "soak: of which its own (anonymous) memory {} KiB, {} KiB, {} KiB (the rest: its binary and \
         other mapped files)",
        start.anon, peak.anon, end.anon
    );
    println!("soak: kernel tables at the end: {}", summary["kernel_maps"]);
    println!(
        "soak: {reported} processes reported ({} distinct pids); {} events lost",
        pids.len(),
        summary["lost_events"]
    );
    println!("soak: the summary and the trace parse as JSON");
    for line in said.iter().filter(|line| line.contains("warning")) {
        println!("soak: memtrace said: {line}");
    }
    Ok(())
}

/// A process's resident memory (`VmRSS`) and its anonymous part (`RssAnon`), in KiB; peaks are
/// taken field by field.
#[derive(Clone, Copy, Default)]
struct Memory {
    rss: u64,
    anon: u64,
}

impl Memory {
    fn of(pid: u32) -> Self {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|value| value.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        Self { rss: field("VmRSS:"), anon: field("RssAnon:") }
    }

    fn max(self, other: Self) -> Self {
        Self { rss: self.rss.max(other.rss), anon: self.anon.max(other.anon) }
    }
}
