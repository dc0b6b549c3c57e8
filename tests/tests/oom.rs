//! OOM kills, recorded: fixtures/oom_grow.c grows its heap 1 MiB at a time in a memory cgroup
//! limited to 96 MiB until the kernel's OOM killer ends it. memtrace says so on stderr at once,
//! the summary's process carries `oom_kill` with its heap and stacks at the kill, the trace has an
//! instant event there, and `memtrace serve` counts the kill and keeps the heap profile at the kill
//! in `--oom-dir`. The cgroup is made by the test (cgroup v1's memory controller on this host, v2
//! in the matrix's VMs) and removed at its end, even on failure.

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use memtrace_tests::{
    fixture, guide::guide_example, otlp::decode, pprof::go_pprof, receiver::receive, scrape_metrics,
    Memtrace, Spawned, DEADLINE, INTERVAL,
};
use serde_json::Value;

/// fixtures/oom_grow.c's BLOCK: every block it allocates, and so every live block at the kill.
const BLOCK: u64 = 1 << 20;
/// The cgroup's limit.
const LIMIT: u64 = 96 << 20;
/// The most blocks it can hold at the kill: each block is a mapping of 257 pages (1 MiB and the
/// 16-byte chunk header, rounded up to a page), all touched by memset, and all but the block
/// being touched are charged whole: (n - 1) * 257 pages <= LIMIT / 4096 = 24576, so n <= 96.
const MOST_BLOCKS: u64 = 96;
/// The fewest: the limit less what the program's image, libc, its stack and page tables take
/// (a few MiB), with a wide margin.
const FEWEST_BLOCKS: u64 = 64;

/// A memory cgroup of the test's own, limited to LIMIT without swap; removed on drop, its
/// processes killed first.
struct TestCgroup {
    dir: PathBuf,
    /// Its path in the memory hierarchy, as /proc/PID/cgroup shows it.
    path: String,
}

impl TestCgroup {
    fn new() -> Self {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let name = format!("memtrace-oom-{}-{}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
        let v2 = fs::metadata("/sys/fs/cgroup/cgroup.controllers").is_ok();
        let root = if v2 { Path::new("/sys/fs/cgroup") } else { Path::new("/sys/fs/cgroup/memory") };
        if v2 {
            // The memory controller must be on for the root's children (the VMs boot with none).
            write(&root.join("cgroup.subtree_control"), "+memory");
        }
        let dir = root.join(&name);
        fs::create_dir(&dir).unwrap_or_else(|err| panic!("creating the cgroup {}: {err}", dir.display()));
        let cgroup = Self { dir, path: format!("/{name}") };
        if v2 {
            write(&cgroup.dir.join("memory.max"), &LIMIT.to_string());
            // Without swap (where the kernel has it), pages cannot leave: the limit ends in a kill.
            if cgroup.dir.join("memory.swap.max").exists() {
                write(&cgroup.dir.join("memory.swap.max"), "0");
            }
        } else {
            write(&cgroup.dir.join("memory.limit_in_bytes"), &LIMIT.to_string());
            write(&cgroup.dir.join("memory.swappiness"), "0");
        }
        cgroup
    }

    fn procs(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn add(&self, pid: u32) {
        write(&self.procs(), &pid.to_string());
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Whatever is left in it is killed, and the cgroup goes once the kernel has let them go.
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = fs::read_to_string(self.procs()).unwrap_or_default();
            for pid in left.split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() || Instant::now() >= deadline {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

fn write(path: &Path, value: &str) {
    fs::write(path, value).unwrap_or_else(|err| panic!("writing {value} to {}: {err}", path.display()));
}

/// The checks every record of the kill shares, on the summary's `oom_kill` (or the trace's
/// event args): the blocks grow() held, whole, within what the limit allows.
fn assert_heap_at_the_kill(kill: &Value) {
    let live_bytes = kill["live_bytes"].as_u64().unwrap_or_else(|| panic!("no live_bytes: {kill}"));
    let blocks = kill["live_allocations"].as_u64().unwrap_or_else(|| panic!("no live_allocations: {kill}"));
    assert_eq!(live_bytes, blocks * BLOCK, "only whole blocks are live: {kill}");
    assert!((FEWEST_BLOCKS..=MOST_BLOCKS).contains(&blocks), "{blocks} blocks at the kill: {kill}");
    let rss = kill["rss_bytes"].as_u64().unwrap_or_else(|| panic!("no rss_bytes: {kill}"));
    // Every block but the one being touched is resident; beyond the limit only pages charged
    // elsewhere (libc's, in the page cache before the test) can be.
    assert!(
        rss >= (blocks - 1) * BLOCK && rss <= LIMIT + (16 << 20),
        "rss {rss} with {blocks} blocks: {kill}"
    );
}

#[test]
fn an_oom_killed_command_is_recorded_with_its_heap_at_the_kill() {
    let cgroup = TestCgroup::new();
    // The shell puts itself in the cgroup and becomes the fixture: the same process, traced from
    // the fixture's first instruction (figures restart at exec).
    let script = format!("echo $$ > {} && exec {}", cgroup.procs().display(), fixture("oom_grow").display());
    let outcome = Memtrace::new().args(["--", "sh", "-c", &script]).run();
    outcome.assert_exit_code(137);
    let processes = outcome.summary()["processes"].as_array().expect("processes");
    let process = processes.iter().find(|p| p["comm"] == "oom_grow").expect("the fixture's report");
    let pid = process["pid"].as_u64().expect("a pid");
    let kill = &process["oom_kill"];
    assert_heap_at_the_kill(kill);
    // Nothing was allocated or freed after the kill: the heap at exit is the heap at the kill.
    assert_eq!(kill["live_bytes"], process["live_bytes"], "{process}");
    assert_eq!(kill["cgroup"], cgroup.path.as_str(), "{kill}");
    assert_eq!(kill["limit_bytes"], LIMIT, "{kill}");
    let at_s = kill["at_s"].as_f64().expect("at_s");
    let duration_s = outcome.summary()["duration_s"].as_f64().expect("duration_s");
    assert!(at_s > 0.0 && at_s <= duration_s, "killed at {at_s}s of {duration_s}s");
    // Every live block came from grow(), called by main.
    let top = &kill["stacks"][0];
    assert_eq!(top["live_bytes"], kill["live_bytes"], "{kill}");
    let frames: Vec<&str> =
        top["stack"].as_array().expect("a stack").iter().filter_map(Value::as_str).collect();
    assert_eq!(frames[..2], ["grow", "main"], "{kill}");
    // Said at once on stderr, with the cgroup, its limit and the stack.
    let said = format!("memtrace: OOM kill: pid {pid} (oom_grow) killed by the kernel's OOM killer at ");
    let line = outcome.stderr.lines().find(|line| line.starts_with(&said)).unwrap_or_else(|| {
        panic!("no {said:?} on stderr:\n{}", outcome.stderr);
    });
    let live = kill["live_bytes"].as_u64().unwrap();
    let expected = [
        format!("memory cgroup {} (limit {LIMIT} bytes (96.0 MiB))", cgroup.path),
        format!("live heap {live} bytes"),
        format!("in {} blocks", kill["live_allocations"]),
    ];
    for part in &expected {
        assert!(line.contains(part.as_str()), "{part:?} not in {line:?}");
    }
    let stack_line = format!(
        "memtrace:   {live} bytes ({:.1} MiB) in {} blocks: grow < main",
        live as f64 / 1048576.0,
        kill["live_allocations"]
    );
    assert!(outcome.stderr.contains(&stack_line), "no {stack_line:?} on stderr:\n{}", outcome.stderr);
    // And the text report at the end says it too.
    let report = format!("    OOM-killed at {at_s:.2} s in memory cgroup {} (limit ", cgroup.path);
    assert!(outcome.stderr.contains(&report), "no {report:?} in the report:\n{}", outcome.stderr);
    // The trace has an instant event at the kill, on the process's track.
    let events: Vec<&Value> =
        outcome.trace().phase("i").filter(|event| event["name"] == "oom_kill").collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let event = events[0];
    assert_eq!(event["pid"], pid);
    assert_eq!(event["ts"].as_f64().map(|ts| (ts / 1e3).round()), Some((at_s * 1e3).round()), "{event}");
    assert_heap_at_the_kill(&event["args"]);
    assert_eq!(event["args"]["top_stack"][0], "grow", "{event}");
    // The guide's outputs.md shows the two lines said at the kill.
    guide_example("oom-kill", &format!("{line}\n{}", stderr_line_starting(&outcome.stderr, &stack_line)));
    drop(cgroup);
}

/// The line of `stderr` that starts with `prefix` (the test has found it there already).
fn stderr_line_starting<'a>(stderr: &'a str, prefix: &str) -> &'a str {
    stderr.lines().find(|line| line.starts_with(prefix)).expect("a line the test found")
}

#[test]
fn serve_counts_the_kill_and_keeps_the_heap_profile_in_the_oom_dir() {
    let cgroup = TestCgroup::new();
    let mut target = Spawned::spawn(Command::new(fixture("oom_grow")));
    target.wait_for_stdout("ready");
    cgroup.add(target.pid());
    let memtrace = Memtrace::new().without_default_outputs();
    let oom_dir = memtrace.dir().join("oom");
    let pid = target.pid().to_string();
    // With an OTLP receiver, the kill is kept as an OTLP request too: a file and a push.
    let receiver = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let otlp = format!("http://{}", receiver.local_addr().unwrap());
    let mut agent = memtrace
        .args(["serve", "--listen", "127.0.0.1:0", "-i", INTERVAL, "--pid", &pid, "--otlp-endpoint", &otlp])
        .args(["--push-interval", "1s", "--oom-dir"])
        .arg(&oom_dir)
        .spawn();
    let port = agent.serving_port();
    agent.wait_for_stderr("memtrace: tracing");
    assert!(scrape_metrics(port).contains("memtrace_oom_kills_total 0\n"), "no kill counted before the kill");
    target.send(b"g");
    let status = target.wait();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status:?}");
    let kept =
        agent.wait_for_stderr_containing(&format!("memtrace: the heap at the OOM kill of pid {pid} is in "));
    let path = PathBuf::from(kept.rsplit(" is in ").next().expect("a path"));
    assert_eq!(path.parent(), Some(oom_dir.as_path()));
    let name = path.file_name().and_then(|name| name.to_str()).expect("a file name");
    assert!(name.starts_with("oom-") && name.ends_with(&format!("-{pid}-oom_grow.pb.gz")), "{name}");
    let deadline = Instant::now() + DEADLINE;
    while !scrape_metrics(port).contains("memtrace_oom_kills_total 1\n") {
        assert!(
            Instant::now() < deadline,
            "memtrace_oom_kills_total never became 1:\n{}",
            scrape_metrics(port)
        );
        thread::sleep(Duration::from_millis(50));
    }
    // The profile, as go tool pprof reads it: every byte live at the kill, all from grow().
    let top = pprof_top(&path, memtrace_dir(&oom_dir));
    let total = top
        .lines()
        .find_map(|line| line.split(" of ").nth(1)?.strip_suffix(" total").map(str::to_owned))
        .unwrap_or_else(|| panic!("no total in:\n{top}"));
    let grow_flat = top
        .lines()
        .find(|line| line.split_whitespace().last() == Some("grow"))
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or_else(|| panic!("no grow in:\n{top}"));
    assert_eq!(grow_flat, total, "{top}");
    let mib: f64 = total.trim_end_matches("MB").parse().unwrap_or_else(|_| panic!("{total} in MB:\n{top}"));
    // go tool pprof says MB for MiB.
    assert!((FEWEST_BLOCKS as f64..=MOST_BLOCKS as f64).contains(&mib), "{total}:\n{top}");
    // The same heap as an OTLP request beside it, as the OpenTelemetry definitions decode it.
    let kept = agent.wait_for_stderr_containing(".otlp.pb");
    let otlp_path = PathBuf::from(kept.rsplit(" is in ").next().expect("a path"));
    assert_eq!(otlp_path, path.with_file_name(name.replace(".pb.gz", ".otlp.pb")));
    let decoded = decode(&std::fs::read(&otlp_path).expect("the kill's OTLP file"));
    assert_heap_at_the_kill_in_otlp(&decoded, target.pid()).unwrap_or_else(|why| panic!("{why}: {decoded}"));
    // And pushed once, a request of its own (the regular pushes around it carry the whole run).
    let deadline = Instant::now() + DEADLINE;
    while let Err(why) =
        assert_heap_at_the_kill_in_otlp(&decode(&receive(&receiver, "200 OK").body), target.pid())
    {
        assert!(Instant::now() < deadline, "no push was the kill's heap: the last {why}");
    }
    agent.interrupt();
    agent.wait();
    drop(cgroup);
}

/// Whether a decoded OTLP request is the heap at the kill of `pid`: one resource, the victim's,
/// nothing allocated counted (a kill's profile has live figures only), every live byte grow's, and
/// at least FEWEST_BLOCKS MiB of them.
fn assert_heap_at_the_kill_in_otlp(decoded: &Value, pid: u32) -> Result<(), String> {
    let resources = decoded["resources"].as_array().ok_or("no resources")?;
    let [resource] = resources.as_slice() else { return Err(format!("{} resources", resources.len())) };
    if resource["attributes"]["process.pid"] != pid {
        return Err("another process's".to_owned());
    }
    let values = |kind: &str| -> Vec<(String, i64)> {
        let profiles = resource["profiles"].as_array().into_iter().flatten();
        let samples =
            profiles.filter(|p| p["sample_type"][0] == kind).flat_map(|p| p["samples"].as_array()).flatten();
        samples
            .map(|s| (s["stack"][0].as_str().unwrap_or("").to_owned(), s["values"][0].as_i64().unwrap_or(0)))
            .collect()
    };
    if values("alloc_space").iter().any(|(_, value)| *value != 0) {
        return Err("allocations counted: the run's profile, not the kill's".to_owned());
    }
    let inuse = values("inuse_space");
    let all: i64 = inuse.iter().map(|(_, value)| value).sum();
    if inuse.iter().any(|(leaf, _)| leaf != "grow") || (all as u64) < FEWEST_BLOCKS << 20 {
        return Err(format!("live bytes not all grow's, or too few ({all})"));
    }
    Ok(())
}

/// The run's directory (the --oom-dir's parent), for go's caches.
fn memtrace_dir(oom_dir: &Path) -> &Path {
    oom_dir.parent().expect("the run's directory")
}

/// `go tool pprof -top` of a profile file.
fn pprof_top(profile: &Path, home: &Path) -> String {
    go_pprof([OsStr::new("-top"), OsStr::new("-sample_index=inuse_space"), profile.as_os_str()], home)
}
