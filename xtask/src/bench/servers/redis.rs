//! Debian's redis-server (linked with Debian's libjemalloc2) launched under a runner on a free
//! port, driven by redis-benchmark from the same machine: the mean of its SET and GET requests a
//! second. Ready once `redis-cli ping` answers PONG; shut down with `shutdown nosave`, after
//! which the runner (memtrace, heaptrack) must exit successfully. On request (memtrace exact),
//! after the benchmark, `DEBUG POPULATE` fills it and redis's own `INFO memory` is set against
//! the levels memtrace's summary gives the process at its exit.

use std::{
    ffi::OsString,
    fs::File,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

use super::{python_work, Bench, Launch, Runner};

const BENCHMARK: [&str; 9] = ["-n", "50000", "-c", "16", "-d", "64", "-t", "set,get", "-q"];
const POPULATE: [&str; 5] = ["DEBUG", "POPULATE", "300000", "key", "200"];
/// The kernel's live table for memtrace's runs: 300,000 keys of 200 bytes take some 1.2 million
/// live blocks, over the default 1,048,576 (192 MiB of kernel memory).
const MAX_ALLOCATIONS: &str = "2097152";
/// How long redis may take to answer its first PING (memtrace loads and attaches first), and to
/// exit once shut down (memtrace writes its outputs first: with a populated heap, a while).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const EXIT_TIMEOUT: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_millis(20);

/// What one run measured.
pub struct Run {
    pub requests_per_second: f64,
    pub memory: Option<Memory>,
}

/// redis's `INFO memory` after `DEBUG POPULATE`, and memtrace's levels of the process.
pub struct Memory {
    allocator_allocated: u64,
    allocator_resident: u64,
    used_memory: u64,
    heap_live_bytes: u64,
    /// What jemalloc's size classes add to the live blocks: live + rounding is what it counts
    /// as allocated.
    heap_rounding_bytes: u64,
    allocator_resident_bytes: u64,
    lost_events: u64,
}

/// A launched server: the runner's process, its port, the log of what it printed.
struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

/// One run of redis-server under `runner`; with `populate` (memtrace alone), the memory figures too.
pub fn run(bench: &Bench<'_>, runner: Runner, populate: bool) -> Result<Run> {
    let summary = bench.out.join("redis-summary.json");
    let server = Server::start(bench, runner, &summary)?;
    let measured = server.drive(populate);
    let stopped = server.stop();
    let (requests_per_second, info) = measured?;
    stopped?;
    let memory = match info {
        Some(info) => Some(Memory::read(&info, &summary)?),
        None => None,
    };
    Ok(Run { requests_per_second, memory })
}

impl Server {
    /// Launches redis-server on a free port, its output (and the runner's) in redis.log, and waits
    /// until it answers.
    fn start(bench: &Bench<'_>, runner: Runner, summary: &Path) -> Result<Self> {
        let port = free_port()?;
        let argv: Vec<OsString> = ["/usr/bin/redis-server", "--port", &port.to_string(), "--save", ""]
            .into_iter()
            .chain(["--appendonly", "no", "--enable-debug-command", "yes"])
            .map(OsString::from)
            .collect();
        let memtrace_args =
            ["--max-allocations".into(), MAX_ALLOCATIONS.into(), "--summary".into(), summary.into()];
        let program = Launch { env: &[], argv: &argv, memtrace_args: &memtrace_args };
        let mut command = python_work::launch(runner, bench.memtrace, &program, &bench.out.join("redis"));
        let log = bench.out.join("redis.log");
        let file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        command.stdout(file.try_clone()?).stderr(file);
        let child = command.spawn().with_context(|| format!("starting {command:?}"))?;
        let mut server = Server { child, port, log };
        if let Err(error) = server.wait_ready() {
            let _ = server.child.kill();
            let _ = server.child.wait();
            return Err(error.context(format!("{command:?} never became ready")));
        }
        Ok(server)
    }

    /// Polls `redis-cli ping` until it answers PONG, as long as the runner lives.
    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("it exited ({status}) before answering PING; {}", self.log_tail());
            }
            if self.cli(&["ping"]).is_ok_and(|reply| reply.trim() == "PONG") {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "no PONG within {READY_TIMEOUT:?}; {}", self.log_tail());
            std::thread::sleep(POLL);
        }
    }

    /// The benchmark's requests a second; with `populate`, `INFO memory` after `DEBUG POPULATE`.
    fn drive(&self, populate: bool) -> Result<(f64, Option<String>)> {
        let mut benchmark = Command::new("redis-benchmark");
        benchmark.arg("-p").arg(self.port.to_string()).args(BENCHMARK);
        let requests_per_second = mean_requests_per_second(&super::super::stdout_of(&mut benchmark)?)?;
        if !populate {
            return Ok((requests_per_second, None));
        }
        let reply = self.cli(&POPULATE)?;
        ensure!(reply.trim() == "OK", "{} answered {reply:?}", POPULATE.join(" "));
        Ok((requests_per_second, Some(self.cli(&["info", "memory"])?)))
    }

    /// `shutdown nosave`, then the runner's exit, which must be a success.
    fn stop(mut self) -> Result<()> {
        let shutdown = self.cli(&["shutdown", "nosave"]);
        let deadline = Instant::now() + EXIT_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                shutdown.context("redis-cli shutdown nosave")?;
                ensure!(status.success(), "the run exited with {status}; {}", self.log_tail());
                return Ok(());
            }
            std::thread::sleep(POLL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        bail!("the run had not exited {EXIT_TIMEOUT:?} after shutdown ({shutdown:?}); {}", self.log_tail())
    }

    /// redis-cli's reply to a command, failing when redis-cli does.
    fn cli(&self, args: &[&str]) -> Result<String> {
        let mut command = Command::new("redis-cli");
        command.arg("-p").arg(self.port.to_string()).args(args);
        super::super::stdout_of(&mut command)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("the end of {}:\n{tail}", self.log.display())
    }
}

/// A TCP port nothing listens on now (the kernel's choice).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// The mean of `SET: N requests per second` and `GET: ...` in redis-benchmark -q's output
/// (progress lines end in carriage returns).
fn mean_requests_per_second(output: &str) -> Result<f64> {
    let rate = |test: &str| -> Result<f64> {
        let line = output
            .split(['\r', '\n'])
            .filter_map(|line| line.trim().strip_prefix(test))
            .find(|rest| rest.contains("requests per second"))
            .with_context(|| format!("redis-benchmark printed no {test} rate: {output}"))?;
        let figure = line.split_whitespace().next().unwrap_or_default();
        figure.parse().with_context(|| format!("redis-benchmark's {test} rate {figure:?}"))
    };
    Ok((rate("SET:")? + rate("GET:")?) / 2.0)
}

impl Memory {
    /// redis's figures from `INFO memory`, memtrace's from the summary's redis-server process.
    fn read(info: &str, summary: &Path) -> Result<Self> {
        let field = |name: &str| -> Result<u64> {
            let value = info.lines().find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':'));
            value
                .with_context(|| format!("INFO memory has no {name}: {info}"))?
                .parse()
                .context(name.to_owned())
        };
        let text =
            std::fs::read_to_string(summary).with_context(|| format!("reading {}", summary.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text).context("memtrace's summary")?;
        let processes = json["processes"].as_array().map(Vec::as_slice).unwrap_or_default();
        let redis = processes
            .iter()
            .filter(|process| process["comm"] == "redis-server")
            .max_by_key(|process| process["memory"]["heap_live_bytes"].as_u64())
            .with_context(|| format!("{} has no redis-server process", summary.display()))?;
        let level = |name: &str| {
            redis["memory"][name]
                .as_u64()
                .with_context(|| format!("the summary's redis-server has no {name}"))
        };
        Ok(Memory {
            allocator_allocated: field("allocator_allocated")?,
            allocator_resident: field("allocator_resident")?,
            used_memory: field("used_memory")?,
            heap_live_bytes: level("heap_live_bytes")?,
            heap_rounding_bytes: level("heap_rounding_bytes")?,
            allocator_resident_bytes: level("allocator_resident_bytes")?,
            lost_events: super::super::lost_events(summary)?,
        })
    }

    pub fn print(&self) {
        let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
        println!(
            "redis-server's memory after `{}` (memtrace exact, its summary at redis's exit; {} events lost):",
            POPULATE.join(" "),
            self.lost_events
        );
        println!(
            "  memtrace heap_live_bytes          {:>8.1} MiB   redis allocator_allocated {:>8.1} MiB   ratio {:.3}   (used_memory {:.1} MiB)",
            mib(self.heap_live_bytes),
            mib(self.allocator_allocated),
            self.heap_live_bytes as f64 / self.allocator_allocated as f64,
            mib(self.used_memory)
        );
        let allocated = self.heap_live_bytes + self.heap_rounding_bytes;
        println!(
            "  memtrace heap_live + heap_rounding {:>7.1} MiB   redis allocator_allocated {:>8.1} MiB   ratio {:.3}",
            mib(allocated),
            mib(self.allocator_allocated),
            allocated as f64 / self.allocator_allocated as f64
        );
        println!(
            "  memtrace allocator_resident_bytes {:>8.1} MiB   redis allocator_resident  {:>8.1} MiB   ratio {:.3}",
            mib(self.allocator_resident_bytes),
            mib(self.allocator_resident),
            self.allocator_resident_bytes as f64 / self.allocator_resident as f64
        );
    }
}
