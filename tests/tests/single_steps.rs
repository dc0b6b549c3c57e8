//! The kernel's own count of the probes it single-steps while memtrace traces a program of each
//! allocator: kprobes on `arch_uprobe_pre_xol` (a probed instruction about to be stepped out of
//! line, a second trap) and `arch_uprobe_skip_sstep` (one the kernel emulated), counted by
//! tracefs's kprobe_profile. Where memtrace's report names no single-stepped function the
//! program calls, the kernel steps none.
//!
//! It needs kprobes, which this host's kernel lacks: the test is ignored here and the kernel
//! matrix runs it (`--ignored`) on every kernel. It is the only test of its binary, so no other
//! run's probes add to the kernel's counts.

use std::{fs, path::Path, process::Command};

use memtrace_tests::{assert_root, fixture, fixture_variant, Memtrace, Outcome};

const TRACING: &str = "/sys/kernel/tracing";
const GROUP: &str = "memtrace_single_steps";
/// The kprobes, by event name: stepped out of line, and emulated.
const STEPPED: &str = "memtrace_stepped";
const EMULATED: &str = "memtrace_emulated";

/// Two kprobes, enabled while it lives and removed when dropped.
struct StepCounter;

impl StepCounter {
    fn install() -> Self {
        if !Path::new(TRACING).join("kprobe_events").exists() {
            let mounted = Command::new("mount").args(["-t", "tracefs", "tracefs", TRACING]).status();
            assert!(mounted.is_ok_and(|status| status.success()), "cannot mount tracefs on {TRACING}");
        }
        let events =
            format!("p:{GROUP}/{STEPPED} arch_uprobe_pre_xol\np:{GROUP}/{EMULATED} arch_uprobe_skip_sstep\n");
        append(&Path::new(TRACING).join("kprobe_events"), &events);
        let counter = Self;
        fs::write(Path::new(TRACING).join("events").join(GROUP).join("enable"), "1")
            .expect("enabling the kprobes");
        counter
    }

    /// The hits of each kprobe so far: (stepped, emulated).
    fn hits(&self) -> (u64, u64) {
        let profile = fs::read_to_string(Path::new(TRACING).join("kprobe_profile")).expect("kprobe_profile");
        let hits = |event: &str| {
            // 6.1 names the event alone, later kernels with its group.
            let grouped = format!("{GROUP}/{event}");
            let named = |name: &str| name == event || name == grouped;
            let line = profile.lines().find(|line| line.split_whitespace().next().is_some_and(named));
            let line = line.unwrap_or_else(|| panic!("no {event} in kprobe_profile:\n{profile}"));
            line.split_whitespace().nth(1).and_then(|hits| hits.parse().ok()).expect("a hit count")
        };
        (hits(STEPPED), hits(EMULATED))
    }

    /// What the kernel stepped and emulated while `run` ran.
    fn during(&self, run: impl FnOnce() -> Outcome) -> (u64, u64, Outcome) {
        let before = self.hits();
        let outcome = run();
        let after = self.hits();
        (after.0 - before.0, after.1 - before.1, outcome)
    }
}

impl Drop for StepCounter {
    fn drop(&mut self) {
        let _ = fs::write(Path::new(TRACING).join("events").join(GROUP).join("enable"), "0");
        append(
            &Path::new(TRACING).join("kprobe_events"),
            &format!("-:{GROUP}/{STEPPED}\n-:{GROUP}/{EMULATED}\n"),
        );
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut file = fs::OpenOptions::new().append(true).open(path).expect("opening kprobe_events");
    file.write_all(text.as_bytes())
        .unwrap_or_else(|err| panic!("writing {text:?} to {}: {err}", path.display()));
}

/// The functions the summary names single-stepped.
fn single_stepped(outcome: &Outcome) -> Vec<String> {
    let listed = outcome.summary()["single_stepped"].as_array().expect("the summary's single_stepped");
    listed.iter().map(|entry| entry["function"].as_str().unwrap().to_owned()).collect()
}

#[test]
#[ignore = "counts the kernel's single-steps with kprobes, which this host's kernel lacks: the kernel matrix runs it"]
fn no_probe_is_single_stepped_where_the_report_says_none() {
    assert_root();
    let counter = StepCounter::install();
    let leaks = fixture("leaks");
    let jemalloc = fixture_variant("leaks", "jemalloc", &["-ljemalloc"]);
    // leaks.c calls malloc, calloc, realloc and free, none of the functions memtrace reports
    // single-stepped (glibc's reallocarray and mremap).
    let runs: [(&str, Vec<String>); 4] = [
        ("glibc", vec![leaks.display().to_string()]),
        ("jemalloc", vec![jemalloc.display().to_string()]),
        (
            "tcmalloc",
            vec!["env".into(), "LD_PRELOAD=libtcmalloc_minimal.so.4".into(), leaks.display().to_string()],
        ),
        ("mimalloc", vec!["env".into(), "LD_PRELOAD=libmimalloc.so.2".into(), leaks.display().to_string()]),
    ];
    for (allocator, command) in runs {
        let (stepped, emulated, outcome) = counter.during(|| Memtrace::new().arg("--").args(&command).run());
        outcome.assert_exit_code(0);
        let listed = single_stepped(&outcome);
        assert!(!listed
            .iter()
            .any(|function| ["malloc", "calloc", "realloc", "free"].contains(&function.as_str())));
        assert_eq!(
            stepped, 0,
            "{allocator}: {stepped} single-steps, {emulated} emulated; the report names {listed:?}"
        );
        assert!(emulated > 0, "{allocator}: the kernel emulated no probe at all: are the kprobes counting?");
    }
    // The control: glibc's reallocarray has no emulated point, the report says so, and the
    // kernel steps each of calloc_reallocarray.c's three calls.
    let (stepped, _, outcome) =
        counter.during(|| Memtrace::new().command(&fixture("calloc_reallocarray")).run());
    outcome.assert_exit_code(0);
    assert!(single_stepped(&outcome).contains(&"reallocarray".to_owned()), "{}", outcome.summary());
    assert!(stepped >= 3, "reallocarray called 3 times, {stepped} single-steps");
}
