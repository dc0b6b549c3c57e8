//! `memtrace doctor` on the running kernel: it prints the kernel, every feature with the oldest
//! kernel that has it, the attach path, the unwinder, the privileges and whether the kernel takes
//! memtrace's BPF programs, and ends with a verdict its exit status agrees with.

use std::{fs, process::ExitStatus};

use memtrace_tests::{assert_root, exit_counts_are_whole, guide::guide_example, Memtrace};

/// The features `memtrace doctor` lists, one a line, by the name it gives them.
const FEATURES: [&str; 13] = [
    "BTF (/sys/kernel/btf/vmlinux)",
    "uprobe_multi links",
    "uprobe perf events",
    "uprobe semaphores (ref_ctr_offset)",
    "BPF cookies (bpf_get_attach_cookie)",
    "bpf_loop",
    "BPF ring buffers",
    "mmapable BPF arrays (BPF_F_MMAPABLE)",
    "optimized uprobes (uprobe syscall)",
    "uretprobe syscall",
    "bpf_send_signal (stopping an exec from BPF)",
    "bpf_prog_info recursion_misses",
    "BPF run-time stats (kernel.bpf_stats_enabled)",
];

const CAN_WORK: &str = "memtrace: tracing can work here";
const CANNOT_WORK: &str = "memtrace: tracing cannot work here: ";

struct Doctor {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Doctor {
    fn run(memtrace: Memtrace) -> Self {
        let mut running = memtrace.without_default_outputs().arg("doctor").spawn();
        let status = running.wait();
        let stdout = running.stdout_text();
        let stderr = running.stderr_text();
        Self { status, stdout, stderr }
    }

    fn line(&self, prefix: &str) -> &str {
        self.stdout
            .lines()
            .find(|line| line.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting with {prefix:?}:\n{}{}", self.stdout, self.stderr))
    }

    fn verdict(&self) -> &str {
        self.stdout
            .lines()
            .last()
            .unwrap_or_else(|| panic!("doctor printed nothing; stderr:\n{}", self.stderr))
    }

    /// Every feature has a line: found, missing or unknown, and the kernel that has it.
    fn assert_every_feature_listed(&self) {
        for name in FEATURES {
            let line = self.stdout.lines().map(str::trim).find(|line| {
                let status = ["found ", "missing ", "unknown "].into_iter().find(|s| line.starts_with(s));
                status.is_some_and(|status| line[status.len()..].trim_start().starts_with(name))
            });
            let line = line.unwrap_or_else(|| panic!("no line for {name}:\n{}", self.stdout));
            let version = line[line.find(name).unwrap() + name.len()..].split_whitespace().next();
            let version = version.unwrap_or_else(|| panic!("{line:?} names no kernel"));
            let (major, minor) = version.trim_end_matches('+').split_once('.').expect("a kernel version");
            assert!(major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok(), "{line:?}");
        }
    }

    /// The exit status agrees with the verdict, which is the last line.
    fn assert_status_agrees(&self) {
        let verdict = self.verdict();
        match self.status.code() {
            Some(0) => assert_eq!(verdict, CAN_WORK, "exit 0 with another verdict:\n{}", self.stdout),
            Some(1) => {
                let reason = verdict.strip_prefix(CANNOT_WORK);
                let reason =
                    reason.unwrap_or_else(|| panic!("exit 1 with another verdict:\n{}", self.stdout));
                assert!(reason.contains("; "), "the verdict says why but not what to do: {verdict}");
            }
            _ => panic!("doctor exited with {}:\n{}{}", self.status, self.stdout, self.stderr),
        }
    }
}

#[test]
fn doctor_says_tracing_can_work_here() {
    assert_root();
    let doctor = Doctor::run(Memtrace::new());
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").expect("reading the kernel release");
    assert!(doctor.line("kernel ").contains(release.trim()), "{}", doctor.stdout);
    for prefix in ["preemption ", "features ", "attach path ", "unwinder ", "privileges "] {
        doctor.line(prefix);
    }
    doctor.assert_every_feature_listed();
    assert!(doctor.line("unwinder ").contains(".eh_frame tables walked with bpf_loop"), "{}", doctor.stdout);
    // The exit levels are whole where the RSS counts are exact or their per-CPU parts are summed.
    let exit_levels = doctor.line("exit levels ");
    let whole =
        ["per-CPU RSS counts summed", "RSS counts are exact"].iter().any(|said| exit_levels.contains(said));
    assert_eq!(whole, exit_counts_are_whole(), "{exit_levels}");
    let privileges = doctor.line("privileges ");
    assert!(privileges.contains("held: CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE"), "{privileges}");
    assert!(privileges.ends_with("missing: none"), "{privileges}");
    doctor.assert_status_agrees();
    // The kernel takes memtrace's programs here, and so tracing can work.
    assert!(doctor.line("programs ").contains("loaded: the kernel's verifier accepted"), "{}", doctor.stdout);
    assert_eq!(doctor.verdict(), CAN_WORK, "{}", doctor.stdout);
    assert_eq!(doctor.status.code(), Some(0));
    // The guide's kernels.md shows this output.
    guide_example("doctor", &doctor.stdout);
}

#[test]
fn doctor_names_the_attach_path_memtrace_links_asks_for() {
    assert_root();
    let perf = Doctor::run(Memtrace::new().env("MEMTRACE_LINKS", "perf"));
    let path = perf.line("attach path ");
    assert!(path.contains("per-site uprobe perf links"), "{}", perf.stdout);
    perf.assert_status_agrees();
    let chosen = Doctor::run(Memtrace::new());
    let multi = chosen.stdout.lines().any(|line| line.trim().starts_with("found    uprobe_multi links"));
    let expected =
        if multi { "uprobe_multi links, one per probed file" } else { "per-site uprobe perf links" };
    assert!(chosen.line("attach path ").contains(expected), "{}", chosen.stdout);
}

#[test]
fn unprivileged_doctor_says_to_run_as_root_and_still_reports() {
    assert_root();
    let doctor = Doctor::run(Memtrace::unprivileged());
    assert_eq!(doctor.status.code(), Some(1), "{}{}", doctor.stdout, doctor.stderr);
    doctor.line("kernel ");
    doctor.assert_every_feature_listed();
    assert!(doctor.line("privileges ").contains("held: none"), "{}", doctor.stdout);
    assert!(doctor.line("programs ").contains("not loaded"), "{}", doctor.stdout);
    let verdict = doctor.verdict();
    assert!(verdict.starts_with(CANNOT_WORK) && verdict.contains("run it as root"), "{verdict}");
    doctor.assert_status_agrees();
}

/// The probe points of Debian 12's allocators, as doctor lists them: each function's offset and
/// the instruction the kernel emulates there, and the functions left single-stepped. The offsets
/// are those of the packages' own code (objdump -d): jemalloc's malloc begins `cmp $0x1000,%rdi`
/// and reaches its `ja` at +0x7; mimalloc's moves the size to rsi before its `ja` at +0x15.
#[test]
fn doctor_lists_where_each_allocators_probes_sit() {
    assert_root();
    let doctor = Doctor::run(Memtrace::new());
    let library = |name: &str| {
        let prefix = format!("/usr/lib/x86_64-linux-gnu/{name}: ");
        let line = doctor.stdout.lines().map(str::trim).find(|line| line.starts_with(&prefix));
        line.unwrap_or_else(|| panic!("no probe points for {name}:\n{}", doctor.stdout))[prefix.len()..]
            .to_owned()
    };
    let expected: [(&str, &[&str], &str); 4] = [
        (
            "libc.so.6",
            &["malloc push", "free+0x3 je", "mmap+0xa jne", "munmap+0xd jae", "mremap sub*"],
            "reallocarray, mremap",
        ),
        (
            "libjemalloc.so.2",
            &["malloc+0x7 ja", "free+0x30 jne", "sdallocx+0xa ja", "rallocx+0x2 jmp"],
            "none",
        ),
        (
            "libmimalloc.so.2.0",
            &["malloc+0x15 ja", "calloc+0x12 je", "realloc+0x14 jmp", "free+0x6 je"],
            "none",
        ),
        ("libtcmalloc_minimal.so.4.5.10", &["malloc+0xa jne", "free+0xa jne"], "none"),
    ];
    for (name, points, stepped) in expected {
        let line = library(name);
        let (listed, single_stepped) = line.split_once("; single-stepped: ").expect("a single-stepped list");
        let listed: Vec<&str> = listed.split(", ").collect();
        for point in points {
            assert!(listed.contains(point), "{name}: no {point:?} in {listed:?}");
        }
        assert_eq!(single_stepped, stepped, "{name}: {line}");
        // Every starred point is named single-stepped, and only those.
        let starred: Vec<&str> = listed
            .iter()
            .filter_map(|point| point.strip_suffix('*'))
            .map(|p| p.split([' ', '+']).next().unwrap())
            .collect();
        let named: Vec<&str> = if stepped == "none" { Vec::new() } else { stepped.split(", ").collect() };
        assert_eq!(starred, named, "{name}: {line}");
    }
    // The guide's counted.md shows the probe points, one line per allocator library installed.
    let libraries = doctor.stdout.lines().filter(|line| line.trim_start().starts_with("/usr/lib/"));
    guide_example("doctor-probe-points", &libraries.map(str::trim).collect::<Vec<_>>().join("\n"));
}
