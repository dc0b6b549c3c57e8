//! `cargo xtask <task>`: memtrace's developer tasks. Each task installs what it needs when missing.

mod bench;
mod circles;
mod cross;
mod docs;
mod image;
mod matrix;
mod soak;
mod toolchain;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "memtrace's developer tasks")]
struct Xtask {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install the BPF toolchain (Debian's rustc-web + bpf-linker) and test dependencies when missing
    Setup,
    /// Build target/release/memtrace with its BPF programs embedded (with --target
    /// aarch64-unknown-linux-gnu: target/aarch64-unknown-linux-gnu/release/memtrace, cross-built)
    Build {
        /// Cross-build for this target instead of the host: aarch64-unknown-linux-gnu
        #[arg(long)]
        target: Option<String>,
    },
    /// Build, then trace the bundled demo service (examples/demo.c and demo.py) and say where the
    /// trace and reports are ($MEMTRACE_BIN: trace with that build instead)
    Demo,
    /// Run every check: formatting, the guide and its links, clippy, unit tests, the integration
    /// tests against this machine's kernel, then the kernel matrix (see `matrix`)
    Test {
        /// Leave out the kernel matrix (CI does not)
        #[arg(long)]
        no_matrix: bool,
    },
    /// Boot Debian's kernel packages in QEMU and run the integration tests inside each (default:
    /// Debian 12's 6.1, 6.12 and 6.12-rt, Debian unstable's newest, Debian 11's 5.10)
    Matrix {
        /// Kernel packages to boot instead, e.g. linux-image-6.12-rt-amd64
        packages: Vec<String>,
        /// Run only these test binaries of the plan (e.g. --only preemption), to chase one failure
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Run the (chosen) tests this many times in each VM
        #[arg(long, default_value_t = 1)]
        repeat: u32,
    },
    /// Cross-build memtrace for arm64 and boot Debian's arm64 kernel packages in QEMU over Debian's
    /// arm64 glibc and jemalloc (12 and 13): doctor, exact counts, single-steps, a clean kernel log
    /// (tests/matrix-arm64/run.sh; default: Debian 12's 6.12)
    MatrixArm64 {
        /// Kernel packages to boot instead, e.g. linux-image-arm64 (6.1) linux-image-6.12-arm64
        packages: Vec<String>,
    },
    /// Print the circles between modules of memtrace-user and memtrace-ebpf (a module that imports
    /// one that imports it back), failing when there is one
    Circles {
        /// Crates' source folders to read instead, e.g. another checkout's memtrace-user/src
        dirs: Vec<PathBuf>,
    },
    /// Measure what tracing costs a malloc/free loop and real Python work, as ratios from one run
    Bench {
        /// Only the Python work (exact, sampled, heaptrack, --app-sampled, windows)
        #[arg(long, conflicts_with_all = ["collector", "windowed", "servers"])]
        python: bool,
        /// Only the long Python work in windows (untraced, exact, --window, heaptrack)
        #[arg(long, conflicts_with_all = ["collector", "servers"])]
        windowed: bool,
        /// Only memtrace's own CPU and memory (quiet processes launched, under --all, under
        /// serve --all; one big heap)
        #[arg(long, conflicts_with = "servers")]
        collector: bool,
        /// Only real servers and programs, untraced, under the floor (empty programs), memtrace
        /// exact, --no-stacks, --window 1s/20s and heaptrack: redis-server (jemalloc) under
        /// redis-benchmark, sqlite3, python3 JSON work with glibc, tcmalloc and mimalloc
        #[arg(long)]
        servers: bool,
    },
    /// Build the guide (docs/, mdBook, installed when missing) into target/guide/ and check every
    /// internal link and anchor in it and in README.md
    Docs,
    /// Build memtrace's container image (deploy/Containerfile) from Debian packages, no registry,
    /// for amd64 and arm64: the manifest list localhost/memtrace:latest and its OCI archive
    /// target/deploy/memtrace-image.tar, read back and checked
    Image,
    /// memtrace --all for MINUTES (default 10) under a mixed load; memory, tables, losses, outputs
    Soak {
        minutes: Option<u64>,
        /// Soak the agent instead (`memtrace serve --all`), scraping /metrics every 5 s and
        /// fetching /debug/pprof/heap every minute
        #[arg(long)]
        serve: bool,
    },
}

fn main() -> Result<()> {
    match Xtask::parse().task {
        Task::Setup => toolchain::setup(),
        Task::Build { target: None } => build().map(drop),
        Task::Build { target: Some(target) } => {
            let built = cross::build(&target)?;
            eprintln!("xtask: built {}", built.display());
            Ok(())
        }
        Task::Demo => demo(),
        Task::Test { no_matrix } => test(!no_matrix),
        Task::Matrix { packages, only, repeat } => matrix(&packages, &matrix::Selection { only, repeat }),
        Task::MatrixArm64 { packages } => matrix_arm64(&cross::build(cross::AARCH64)?, &packages),
        Task::Circles { dirs } => circles::check(&workspace_root(), &dirs),
        Task::Docs => docs::build_and_check(),
        Task::Image => image_of(&build()?, &cross::build(cross::AARCH64)?),
        Task::Bench { python, windowed, collector, servers } => {
            let part = match (python, windowed, collector, servers) {
                (true, ..) => bench::Part::Python,
                (_, true, ..) => bench::Part::Windowed,
                (_, _, true, _) => bench::Part::Collector,
                (.., true) => bench::Part::Servers,
                _ => bench::Part::All,
            };
            bench::run(&build()?, part)
        }
        Task::Soak { minutes, serve } => soak::run(&build()?, minutes.unwrap_or(10), serve),
    }
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

/// Runs a command in the workspace root, failing with its command line when it fails.
pub fn run(command: &mut Command) -> Result<()> {
    command.current_dir(workspace_root());
    let status = command.status().with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed ({status})");
    }
    Ok(())
}

pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn build() -> Result<PathBuf> {
    toolchain::setup()?;
    eprintln!("xtask: building memtrace (release)");
    run(cargo().args(["build", "--release", "-p", "memtrace-user"]))?;
    Ok(workspace_root().join("target/release/memtrace"))
}

/// Compiles a C program from the workspace into target/<dir>/.
pub fn compile_c(source: &str, dir: &str, extra_flags: &[&str]) -> Result<PathBuf> {
    let root = workspace_root();
    let source = root.join(source);
    let out_dir = root.join("target").join(dir);
    std::fs::create_dir_all(&out_dir)?;
    let output = out_dir.join(source.file_stem().context("C source without a name")?);
    run(Command::new("cc")
        .args(["-O2", "-g", "-fno-omit-frame-pointer", "-Wall", "-o"])
        .arg(&output)
        .arg(&source)
        .args(extra_flags))?;
    Ok(output)
}

/// memtrace needs root; run it through sudo when xtask itself is not root.
pub fn as_root(program: &Path) -> Command {
    if is_root() {
        Command::new(program)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg(program);
        sudo
    }
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .map(|uids| uids.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// `cargo xtask demo`: the memtrace built here (or $MEMTRACE_BIN, a build made already) traces
/// examples/demo.c, a small service that starts examples/demo.py as its child; both are traced.
/// tests/tests/demo.rs runs it the same way and checks what each section of the report shows.
fn demo() -> Result<()> {
    let memtrace = match std::env::var_os("MEMTRACE_BIN") {
        Some(path) => PathBuf::from(path),
        None => build()?,
    };
    let include = format!("-I{}", workspace_root().join("include").display());
    let demo = compile_c("examples/demo.c", "demo", &[&include, "-pthread"])?;
    let script = workspace_root().join("examples/demo.py");
    let out = workspace_root().join("target/demo");
    let trace = out.join("demo-trace.json");
    let summary = out.join("demo-summary.json");
    let html = out.join("demo-report.html");
    eprintln!("xtask: tracing the demo service (and its python3 child) with memtrace");
    run(as_root(&memtrace)
        .args(["--interval", "250ms", "--output"])
        .arg(&trace)
        .arg("--summary")
        .arg(&summary)
        .arg("--html")
        .arg(&html)
        .arg("--")
        .arg(&demo)
        .arg(&script))?;
    println!("trace:   {}  (open it in Perfetto UI or chrome://tracing)", trace.display());
    println!("summary: {}", summary.display());
    println!("report:  {}  (open it in a browser: it works offline)", html.display());
    Ok(())
}

/// `cargo xtask matrix`: the memtrace built here, or $MEMTRACE_BIN (another build to compare).
fn matrix(packages: &[String], selection: &matrix::Selection) -> Result<()> {
    let memtrace = match std::env::var_os("MEMTRACE_BIN") {
        Some(path) => PathBuf::from(path),
        None => build()?,
    };
    if !is_root() {
        bail!("the kernel matrix installs packages and boots VMs: run `sudo cargo xtask matrix`");
    }
    matrix::run(&memtrace, packages, selection)
}

/// The host's checks and tests, then (with `with_matrix`) the kernel matrix, which runs even when
/// the host's tests fail: both verdicts are worth having from one CI run.
fn test(with_matrix: bool) -> Result<()> {
    let started = std::time::Instant::now();
    let memtrace = build()?;
    if !is_root() {
        bail!("the integration tests load BPF programs into the kernel: run `sudo cargo xtask test`");
    }
    eprintln!("xtask: checking formatting");
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args(["fmt", "--manifest-path", "memtrace-ebpf/Cargo.toml", "--", "--check"]))?;
    eprintln!("xtask: the guide and the links of the guide and README.md");
    docs::build_and_check()?;
    eprintln!("xtask: clippy");
    run(cargo().args(["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"]))?;
    eprintln!("xtask: circles between modules");
    circles::check(&workspace_root(), &[])?;
    eprintln!("xtask: unit and integration tests");
    // Every test binary runs even after one fails: a CI run shows every failure at once (one
    // stopped at its 200th test of some 450 on the first failure).
    let (tally, status) =
        run_tests(cargo().args(["test", "--workspace", "--no-fail-fast"]).env("MEMTRACE_BIN", &memtrace))?;
    // One closing line for the whole run: cargo's own last line is that of its last test binary.
    println!("tests: {} passed, {} failed", tally.passed, tally.failed);
    let host = if !status.success() || tally.failed > 0 || tally.passed == 0 {
        Err(anyhow::anyhow!("the tests did not pass on this machine's kernel ({status})"))
    } else {
        Ok(())
    };
    // The arm64 build stays a build: its code under cfg(target_arch = "aarch64") and its BPF
    // programs for arm64's registers compile only there.
    eprintln!("xtask: the arm64 build (cross-built)");
    let arm64 = cross::build(cross::AARCH64).context("cargo xtask build --target aarch64-unknown-linux-gnu");
    // The DaemonSet's image, for both architectures, each with its own binary.
    eprintln!("xtask: the container image (amd64 and arm64)");
    let image = arm64
        .as_ref()
        .map_err(|error| anyhow::anyhow!("{error:#}"))
        .and_then(|arm64| image_of(&memtrace, arm64).context("cargo xtask image"));
    let host = host.and(image);
    // CI gives the whole run a time limit: what each part took is on its record.
    eprintln!("xtask: the host's part took {}", minutes(started.elapsed()));
    if !with_matrix {
        return host;
    }
    eprintln!("xtask: the kernel matrix");
    let matrix_started = std::time::Instant::now();
    let x86 = matrix::run(&memtrace, &[], &matrix::Selection::default());
    // One arm64 kernel, Debian 12's 6.12 (the others: `cargo xtask matrix-arm64 PACKAGE...`).
    eprintln!("xtask: the arm64 matrix (Debian 12's 6.12)");
    let arm64 = arm64.and_then(|arm64| matrix_arm64(&arm64, &[]));
    let matrix = both(x86, arm64);
    eprintln!(
        "xtask: the matrix took {}; the whole test {}",
        minutes(matrix_started.elapsed()),
        minutes(started.elapsed())
    );
    both(host, matrix)
}

/// One verdict of two parts that both ran: the failure of either, or both failures in one error.
fn both(first: Result<()>, second: Result<()>) -> Result<()> {
    match (first, second) {
        (Ok(()), second) => second,
        (Err(first), Ok(())) => Err(first),
        (Err(first), Err(second)) => bail!("{first:#}; and {second:#}"),
    }
}

/// The arm64 matrix (tests/matrix-arm64/run.sh) with an arm64 build, on `packages` (none: its
/// default, Debian 12's 6.12).
fn matrix_arm64(memtrace: &Path, packages: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the arm64 matrix installs packages and boots VMs: run `sudo cargo xtask matrix-arm64`");
    }
    let script = workspace_root().join("tests/matrix-arm64/run.sh");
    run(Command::new("bash").arg(script).arg(memtrace).args(packages)).context("the arm64 matrix failed")
}

/// Builds the container image from the two binaries and reads it back.
fn image_of(amd64: &Path, arm64: &Path) -> Result<()> {
    image::build([amd64, arm64])?;
    for (architecture, bytes) in image::check(&image::archive())? {
        eprintln!("xtask: the image for {architecture} holds its own memtrace ({bytes} bytes)");
    }
    Ok(())
}

/// A duration as `12m05s`.
pub(crate) fn minutes(duration: std::time::Duration) -> String {
    let seconds = duration.as_secs();
    format!("{}m{:02}s", seconds / 60, seconds % 60)
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    passed: u64,
    failed: u64,
}

/// Runs `cargo test`, passing its output through, and adds up its `test result:` lines.
fn run_tests(command: &mut Command) -> Result<(Tally, std::process::ExitStatus)> {
    command.current_dir(workspace_root()).stdout(std::process::Stdio::piped());
    let mut child = command.spawn().with_context(|| format!("running {command:?}"))?;
    let stdout = child.stdout.take().context("cargo test's output")?;
    let mut tally = Tally::default();
    for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
        let line = line?;
        println!("{line}");
        tally.add(&line);
    }
    Ok((tally, child.wait()?))
}

impl Tally {
    /// Adds a line such as `test result: ok. 6 passed; 0 failed; 0 ignored; ...`.
    fn add(&mut self, line: &str) {
        let Some(counts) = line.strip_prefix("test result: ") else { return };
        for part in counts.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(kind), Some(number)) = (words.next(), words.next()) else { continue };
            let Ok(number) = number.parse::<u64>() else { continue };
            match kind {
                "passed" => self.passed += number,
                "failed" => self.failed += number,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_result_lines_add_up() {
        let mut tally = Tally::default();
        tally.add(
            "test result: ok. 6 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 19.13s",
        );
        tally.add("test result: FAILED. 3 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out");
        tally.add("running 4 tests");
        assert_eq!(tally, Tally { passed: 9, failed: 2 });
    }
}
