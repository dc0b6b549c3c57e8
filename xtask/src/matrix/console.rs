//! Reading a matrix VM's serial console: the MATRIX-* lines tests/matrix/guest.sh prints, the test
//! binaries' `test result:` lines, and every kernel message (the console's own and the closing
//! dmesg), checked for an Oops, BUG, WARNING, general protection fault, panic or taint.

use crate::Tally;

/// What marks a kernel log as not clean. "tainting kernel": Debian's kernels say so when a program
/// uses fanotify permission events (`memtrace (PID): Using fanotify permission checks may lead to
/// deadlock; tainting kernel`), which memtrace must never make a node do.
const BAD: &[&str] = &["Oops", "BUG:", "WARNING:", "general protection", "Kernel panic", "tainting kernel"];

/// Words a refusal's `memtrace: error:` line names a kernel feature by (issue 22's list), or the
/// oldest kernel that has it ("Linux 6.6").
const FEATURES: &[&str] = &[
    "uprobe_multi",
    "uretprobe",
    "ref_ctr_offset",
    "perf link",
    "bpf_loop",
    "cookie",
    "fanotify",
    "BTF",
    "kernel feature",
];

/// Text longer than this is cut in the one-line report.
const SHORT: usize = 160;

#[derive(Debug, Default)]
pub struct Report {
    pub package: String,
    release: Option<String>,
    preemption: String,
    tally: Tally,
    failed_tests: Vec<String>,
    /// What the failed tests printed (libtest's `---- NAME stdout ----` sections), for CI's log:
    /// the console log stays on the machine that ran the matrix.
    pub failure_output: Vec<String>,
    doctor: Option<i32>,
    doctor_missing: bool,
    probe: Option<i32>,
    probe_error: Option<String>,
    /// The verifier's own last word in a load error (e.g. "R2 min value is negative, ...").
    probe_verdict: Option<String>,
    may_refuse: bool,
    skipped: bool,
    bad_kernel_line: Option<String>,
    finished: bool,
    /// Why the harness itself could not finish this kernel (fetch, boot, init, deadline).
    pub problem: Option<String>,
    pub seconds: u64,
}

impl Report {
    pub fn broken(package: &str, problem: String) -> Self {
        Self { package: package.to_owned(), problem: Some(problem), ..Self::default() }
    }

    /// Reads the whole console output of one VM.
    pub fn read(package: &str, console: &str, may_refuse: bool) -> Self {
        let mut report = Self { package: package.to_owned(), may_refuse, ..Self::default() };
        let mut version = String::new();
        let mut sched = String::new();
        let mut dmesg = String::new();
        let mut binary = Binary::default();
        for raw in console.lines() {
            let line = strip_escapes(raw);
            let line = line.trim_end();
            if report.bad_kernel_line.is_none()
                && is_kernel_line(line)
                && BAD.iter().any(|bad| line.contains(bad))
            {
                report.bad_kernel_line = Some(line.to_owned());
            }
            let Some((key, value)) = marker(line) else {
                binary.read(line, &mut report);
                continue;
            };
            match key {
                "KERNEL" => report.release = Some(value.to_owned()),
                "VERSION" => version = value.to_owned(),
                "PREEMPT-SCHED" => sched = value.to_owned(),
                "PREEMPT-DMESG" => dmesg = value.to_owned(),
                "PROBE-RC" => report.probe = value.parse().ok(),
                "PROBE-OUT" if report.probe_error.is_none() && value.starts_with("memtrace: error:") => {
                    report.probe_error = Some(value.to_owned())
                }
                "PROBE-OUT" if report.probe_error.is_some() && is_verifier_verdict(value) => {
                    report.probe_verdict = Some(value.to_owned())
                }
                "DOCTOR-RC" => report.doctor = value.parse().ok(),
                "DOCTOR" if is_unknown_command(value) => report.doctor_missing = true,
                "TESTS-SKIPPED" => report.skipped = true,
                "TEST-BEGIN" => binary = Binary { name: value.to_owned(), ..Binary::default() },
                "TEST-RC" => binary.end(value, &mut report),
                "INIT-FAILED" | "GUEST-FAILED" => report.problem = Some(value.to_owned()),
                "END" => report.finished = true,
                _ => {}
            }
        }
        binary.cut_short(&mut report);
        report.preemption = preemption(&version, &sched, &dmesg);
        report
    }

    /// Whether this kernel passes: it ran to its end with a clean log, and either every test passed
    /// or (on a kernel memtrace may refuse) memtrace refused it naming the feature it lacks.
    pub fn passed(&self, doctor_required: bool) -> bool {
        if self.problem.is_some() || !self.finished || self.bad_kernel_line.is_some() {
            return false;
        }
        let refused = self.skipped && self.may_refuse && self.refusal_is_clear();
        let worked = !self.skipped && self.tally.failed == 0 && self.tally.passed > 0;
        let doctor_agrees = match (refused, self.doctor) {
            (true, Some(1)) | (false, Some(0)) => true,
            _ => !doctor_required,
        };
        (refused || worked) && doctor_agrees
    }

    fn refusal_is_clear(&self) -> bool {
        self.probe.is_some_and(|rc| rc != 0)
            && self.probe_error.as_deref().is_some_and(|error| {
                FEATURES.iter().any(|feature| error.contains(feature)) || names_a_linux_version(error)
            })
    }

    /// One line: release, preemption model, tests, doctor, time, kernel log; and why it failed.
    pub fn line(&self) -> String {
        let release =
            self.release.as_deref().map_or_else(|| "did not boot".to_owned(), |r| format!("Linux {r}"));
        let tests = if self.skipped {
            let error = self.probe_error.as_deref().unwrap_or("no `memtrace: error:` line");
            format!(
                "refused ({}): {}",
                if self.refusal_is_clear() { "clear" } else { "NOT naming a kernel feature" },
                short(error)
            )
        } else {
            let run = self.tally.passed + self.tally.failed;
            format!("tests {run} run, {} passed, {} failed", self.tally.passed, self.tally.failed)
        };
        let doctor = match (self.doctor, self.doctor_missing) {
            (Some(rc), true) => format!("doctor exit {rc} (no doctor subcommand yet)"),
            (Some(rc), false) => format!("doctor exit {rc}"),
            (None, _) => "doctor not run".to_owned(),
        };
        let log = match &self.bad_kernel_line {
            Some(line) => format!("KERNEL LOG: {}", short(line)),
            None if self.finished => "kernel log clean".to_owned(),
            None => "kernel log clean so far".to_owned(),
        };
        let verdict = if self.passed(super::DOCTOR_REQUIRED) { "PASS" } else { "FAIL" };
        let mut line = format!(
            "{verdict} {} | {release} | {} | {tests} | {doctor} | {} | {log}",
            self.package,
            if self.preemption.is_empty() { "preemption unknown" } else { &self.preemption },
            crate::minutes(std::time::Duration::from_secs(self.seconds))
        );
        line += &self.failure_notes();
        line
    }

    /// Why a kernel failed, beyond the counts: the harness's problem, memtrace's load error, the
    /// failed tests.
    fn failure_notes(&self) -> String {
        let mut notes = String::new();
        if let Some(problem) = &self.problem {
            notes += &format!(" | {}", short(problem));
        } else if !self.finished {
            notes += " | the VM stopped before the guest's end (panic or crash: see the log)";
        }
        if !self.skipped {
            if let (Some(rc), Some(error)) = (self.probe.filter(|rc| *rc != 0), &self.probe_error) {
                notes += &format!(" | memtrace -- true: exit {rc}: {}", short(error));
                if let Some(verdict) = &self.probe_verdict {
                    notes += &format!(" | verifier: {}", short(verdict));
                }
            }
        }
        if !self.failed_tests.is_empty() {
            let shown: Vec<&str> = self.failed_tests.iter().take(4).map(String::as_str).collect();
            let more = self.failed_tests.len().saturating_sub(shown.len());
            notes += &format!(
                " | failed: {}{}",
                shown.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() }
            );
        }
        notes
    }
}

/// Lines of one failed test's output kept for the report; the rest is in the console log.
const FAILURE_LINES: usize = 60;

/// The test binary being read, from its MATRIX-TEST-BEGIN to its MATRIX-TEST-RC: each
/// `test NAME ... ok|FAILED` line counts (so a VM that dies mid-binary still reports what ran),
/// and the output libtest prints for each failed test is kept.
#[derive(Default)]
struct Binary {
    name: String,
    tests: u32,
    ended: bool,
    /// Lines kept of the failed test whose `---- NAME stdout ----` section is being read.
    capturing: Option<usize>,
}

impl Binary {
    fn read(&mut self, line: &str, report: &mut Report) {
        if self.capture(line, report) {
            return;
        }
        let Some((test, outcome)) = line.strip_prefix("test ").and_then(|rest| rest.rsplit_once(" ... "))
        else {
            return;
        };
        self.tests += 1;
        match outcome {
            "ok" => report.tally.passed += 1,
            "FAILED" => {
                report.tally.failed += 1;
                report.failed_tests.push(format!("{}::{test}", self.name));
            }
            _ => {}
        }
    }

    /// Keeps the lines of a failed test's output section (from libtest's `---- NAME stdout ----`
    /// to the next section or its closing `failures:`); true when `line` was one of them.
    fn capture(&mut self, line: &str, report: &mut Report) -> bool {
        if line.starts_with("---- ") && line.ends_with(" ----") {
            report.failure_output.push(format!("{}: {line}", self.name));
            self.capturing = Some(0);
            return true;
        }
        let Some(kept) = self.capturing.as_mut() else { return false };
        if line == "failures:" || line.starts_with("test result:") {
            self.capturing = None;
            return false;
        }
        *kept += 1;
        if *kept <= FAILURE_LINES {
            report.failure_output.push(format!("  {line}"));
        } else if *kept == FAILURE_LINES + 1 {
            report.failure_output.push("  [... the rest is in the console log]".to_owned());
        }
        true
    }

    /// `NAME RC SECONDS`: a binary that ended badly with no test failed (a crash, the guest's
    /// timeout) counts as one failed test.
    fn end(&mut self, value: &str, report: &mut Report) {
        self.ended = true;
        let rc = value.split_whitespace().nth(1).unwrap_or("?");
        if rc != "0" && !report.failed_tests.iter().any(|test| test.starts_with(&format!("{}::", self.name)))
        {
            report.tally.failed += 1;
            report.failed_tests.push(format!("{} (exit {rc}, no test failed)", self.name));
        }
    }

    /// At the console's end: a binary still running when the VM stopped failed.
    fn cut_short(&self, report: &mut Report) {
        if !self.name.is_empty() && !self.ended {
            report.tally.failed += 1;
            report.failed_tests.push(format!("{} (the VM stopped while it ran)", self.name));
        }
    }
}

/// A verifier log line that is neither an instruction, a source line nor its closing statistics:
/// what the verifier objected to.
fn is_verifier_verdict(line: &str) -> bool {
    const NOT: &[&str] =
        &["processed ", "memtrace:", "Func#", "func#", "from ", "stack depth", "verification time", ";", "("];
    let starts_with_number_or_space = line.starts_with(|c: char| c.is_ascii_digit() || c.is_whitespace());
    !line.is_empty() && !starts_with_number_or_space && !NOT.iter().any(|prefix| line.starts_with(prefix))
}

/// `MATRIX-KEY value` -> (KEY, value).
fn marker(line: &str) -> Option<(&str, &str)> {
    let rest = &line[line.find("MATRIX-")? + "MATRIX-".len()..];
    let (key, value) = rest.split_once(' ').unwrap_or((rest, ""));
    Some((key, value.trim()))
}

/// A kernel message: `[    1.234567] ...`, as printk and dmesg print them.
fn is_kernel_line(line: &str) -> bool {
    let Some(rest) = line.strip_prefix('[') else { return false };
    let Some((stamp, _)) = rest.split_once(']') else { return false };
    let stamp = stamp.trim_start();
    stamp.contains('.') && stamp.chars().all(|c| c.is_ascii_digit() || c == '.') && !stamp.is_empty()
}

/// Drops terminal escape sequences (the firmware clears the screen) and carriage returns.
fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                if chars.next_if_eq(&'[').is_some() {
                    // parameters, then one final byte in @..~
                    while chars.next().is_some_and(|p| !('@'..='~').contains(&p)) {}
                } else if chars.next().is_some_and(|c| c == '(' || c == ')') {
                    chars.next(); // a character set: ESC ( B
                }
            }
            c if c.is_control() && c != '\t' => {}
            c => out.push(c),
        }
    }
    out
}

/// The console, readable: escapes and carriage returns dropped.
pub fn readable(console: &str) -> String {
    console.lines().map(|line| strip_escapes(line) + "\n").collect()
}

/// `memtrace doctor` when memtrace has no such subcommand (clap's own message).
fn is_unknown_command(line: &str) -> bool {
    line.contains("unrecognized subcommand") || line.contains("unexpected argument")
}

fn names_a_linux_version(text: &str) -> bool {
    text.match_indices("Linux ").any(|(at, _)| text[at + 6..].starts_with(|c: char| c.is_ascii_digit()))
}

/// PREEMPT_RT, or the dynamic model in force (sched/preempt's parenthesised one, else dmesg's
/// "Dynamic Preempt:"), or what `uname -v` says.
fn preemption(version: &str, sched: &str, dmesg: &str) -> String {
    if version.contains("PREEMPT_RT") {
        return "PREEMPT_RT".to_owned();
    }
    let chosen = sched.split_whitespace().find_map(|word| word.strip_prefix('(')?.strip_suffix(')'));
    let chosen = chosen.or_else(|| dmesg.strip_prefix("Dynamic Preempt: ").map(str::trim));
    match chosen {
        Some(model) => format!("PREEMPT_DYNAMIC ({model})"),
        None => version
            .split_whitespace()
            .find(|w| w.starts_with("PREEMPT"))
            .unwrap_or("no preemption")
            .to_owned(),
    }
}

fn short(text: &str) -> String {
    match text.char_indices().nth(SHORT) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONSOLE: &str = "\x1bc\x1b[?7l\x1b[2J[    0.056000] tsc: Unable to calibrate against PIT\r
MATRIX-KERNEL 6.12.117+deb12-amd64\r
MATRIX-VERSION #1 SMP PREEMPT_DYNAMIC Debian 6.12.117-1~deb12u1 (2026-11-14)\r
MATRIX-PREEMPT-SCHED none (voluntary) full\r
MATRIX-PROBE-RC 0\r
MATRIX-DOCTOR-RC 0\r
MATRIX-TEST-BEGIN accounting\r
test malloc_and_free ... ok\r
test threads_lose_nothing ... FAILED\r
\r
failures:\r
\r
---- threads_lose_nothing stdout ----\r
thread 'threads_lose_nothing' panicked at tests/tests/accounting.rs:9:5:\r
lost_events: 1\r
\r
failures:\r
    threads_lose_nothing\r
\r
test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\r
MATRIX-TEST-RC accounting 101 30s\r
MATRIX-TEST-BEGIN usdt\r
MATRIX-TEST-RC usdt 124 900s\r
MATRIX-DMESG-BEGIN\r
[   12.5] WARNING: CPU: 1 PID: 77 at kernel/bpf/x.c:1 f+0x1\r
MATRIX-END\r
";

    #[test]
    fn a_console_reads_into_its_report() {
        let report = Report::read("linux-image-x", CONSOLE, false);
        assert_eq!(report.release.as_deref(), Some("6.12.117+deb12-amd64"));
        assert_eq!(report.preemption, "PREEMPT_DYNAMIC (voluntary)");
        assert_eq!((report.tally.passed, report.tally.failed), (1, 2));
        assert_eq!(
            report.failed_tests,
            ["accounting::threads_lose_nothing", "usdt (exit 124, no test failed)"]
        );
        assert_eq!(
            report.bad_kernel_line.as_deref(),
            Some("[   12.5] WARNING: CPU: 1 PID: 77 at kernel/bpf/x.c:1 f+0x1")
        );
        assert_eq!(
            report.failure_output,
            [
                "accounting: ---- threads_lose_nothing stdout ----",
                "  thread 'threads_lose_nothing' panicked at tests/tests/accounting.rs:9:5:",
                "  lost_events: 1",
                "  ",
            ]
        );
        assert!(report.finished);
        assert!(!report.passed(false));
    }

    #[test]
    fn a_refusal_passes_only_when_it_names_a_feature() {
        let refusal = |error: &str| {
            let console = format!(
                "MATRIX-KERNEL 5.10.0-46-amd64\nMATRIX-PROBE-RC 1\nMATRIX-PROBE-OUT {error}\n\
                 MATRIX-TESTS-SKIPPED memtrace refused this kernel\nMATRIX-END\n"
            );
            Report::read("linux-image-5.10.0-46-amd64", &console, true).passed(false)
        };
        assert!(refusal("memtrace: error: this kernel has no BPF cookies (Linux 5.15 has them)"));
        assert!(!refusal("memtrace: error: verifying BPF program alloc_exit: invalid argument"));
    }

    #[test]
    fn only_kernel_messages_count() {
        assert!(is_kernel_line("[    7.295426] Kernel panic - not syncing"));
        assert!(!is_kernel_line("[unknown] WARNING: from a test's output"));
        let taint = "[   12.5] memtrace (311): Using fanotify permission checks may lead to deadlock; tainting kernel";
        let tainted = Report::read("linux-image-6.1.0-57-amd64", &format!("{taint}\n"), false);
        assert_eq!(tainted.bad_kernel_line.as_deref(), Some(taint));
        assert_eq!(strip_escapes("\x1bc\x1b[?7l\x1b[2J[ 1.0] x\r"), "[ 1.0] x");
        assert_eq!(strip_escapes("test a ... \x1b[31mFAILED\x1b(B\x1b[m\x0f"), "test a ... FAILED");
        assert_eq!(preemption("#1 SMP PREEMPT_RT Debian", "", ""), "PREEMPT_RT");
        assert_eq!(
            preemption("#1 SMP PREEMPT_DYNAMIC", "", "Dynamic Preempt: lazy"),
            "PREEMPT_DYNAMIC (lazy)"
        );
    }
}
