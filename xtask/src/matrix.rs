//! `cargo xtask matrix [KERNEL_PACKAGE...]`: boots Debian's own kernel packages in QEMU (TCG: nested
//! KVM does not boot on this machine kind) with this machine's root filesystem shared read-only over
//! 9p under a tmpfs overlay, and runs inside each, as root, a set of memtrace's integration test
//! binaries that exercises every BPF program and attach path, plus `memtrace doctor`. A VM runs
//! on one host CPU, so as many boot at once as the host has CPUs. One line a kernel, as it ends:
//! release, preemption model, tests run/passed/failed, doctor's exit status, time, and whether the
//! kernel log is clean. Fails when any kernel fails.
//!
//! The guest side lives in tests/matrix/ (init.sh: the initramfs's /init; guest.sh: what runs on
//! the shared root); kernel packages and apt states of our own (Debian unstable, Debian 11) are
//! cached in /var/cache/memtrace-kernels/matrix; each kernel's console log is kept in
//! target/matrix/<package>.log.

mod console;
mod kernels;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{cargo, toolchain, workspace_root};
use console::Report;
use kernels::Kernel;

/// What booting a kernel takes on the host: QEMU, the initramfs's shell and tools, and what unpacks
/// and indexes a kernel package's modules.
const HOST_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "cpio", "kmod", "xz-utils", "zstd"];

/// The integration tests each kernel runs: a test binary of tests/tests/ and name filters (none:
/// all of it). Together they reach every BPF program and attach path.
const PLAN: &[(&str, &[&str])] = &[
    // the stack every program uses, as this kernel's verifier reports it, both attach paths
    ("kernel_stack", &[]),
    // memtrace doctor: every line, its verdict and exit status
    ("doctor", &[]),
    // every glibc entry point, threads, a full live table counted as lost, per-site perf links
    ("accounting", &[]),
    // stacks with frame pointers, --no-stacks, sampling
    (
        "stacks",
        &[
            "leaks_are_named_by_call_site_with_exact_bytes_and_counts",
            "no_stacks_still_counts_exactly_but_names_no_leaks",
            "sampled_leaks_are_estimated_within_five_percent",
        ],
    ),
    // stacks without frame pointers: the .eh_frame unwinder; 128 frames; deep stacks taken over
    // from the slot's last walk (frame_memo.rs) told apart far out; whole from a launched
    // program's first instruction and in short-lived programs a shell runs, held at their exec
    // (the kernel's own mappings, bpf_find_vma, before memtrace has read the process's); a
    // library called right after its dlopen, the process held at dlopen's return
    (
        "unwind",
        &[
            "chain_without_frame_pointers_is_whole_and_one_group",
            "a_stack_of_a_hundred_frames_is_whole_from_the_first_instruction",
            "deep_stacks_that_differ_far_out_stay_apart",
            "a_stack_past_the_depth_limit_keeps_128_frames_and_says_so",
            "short_lived_programs_a_shell_runs_have_whole_stacks",
            "a_library_called_right_after_dlopen_has_whole_stacks",
        ],
    ),
    // Python's own frames: Debian's python3 (3.11) launched, attached, with threads (the GIL
    // holder's frames, read from outside in BPF), and Debian 13's python3.13 the same way in a
    // root of its own (its threads found in its list of threads). (The comparison with memray stays on the host: the VM
    // has no network to install it from PyPI.)
    (
        "python",
        &[
            "a_launched_scripts_leak_is_named_by_its_functions_and_lines",
            "an_attached_interpreter_has_its_frames_read_too",
            "each_threads_allocations_have_its_own_frames",
            "no_interpreter_frames_leaves_native_frames_alone",
            "python_3_13s_frames_are_read_from_its_own_description",
            "python_3_13s_threads_have_their_own_frames",
            "an_attached_python_3_13_has_its_frames_read_too",
            "generators_and_coroutines_have_their_frames",
            "python_3_13s_generators_and_coroutines_have_their_frames",
        ],
    ),
    // Perl's own frames: Debian's perl launched and attached, each sub's bytes inclusive and
    // exclusive (the contexts, read from outside in BPF), each `threads` thread's own interpreter
    // (found from the task's FS base, an offset from each kernel's BTF), and a recursion past the
    // frames a stack keeps, counted.
    (
        "perl",
        &[
            "a_launched_scripts_subs_hold_their_bytes_inclusive_and_exclusive",
            "an_attached_perl_has_its_frames_read_too",
            "no_interpreter_frames_leaves_perls_native_frames_alone",
            "each_perl_threads_allocations_have_its_own_subs",
            "perl_frames_past_the_limit_keep_the_innermost_and_say_so",
        ],
    ),
    // USDT: memtrace.h's semaphore and its reports (the claimed key slot), its dumpers' rounds
    // (dump_begin/dump_end, a round's values per subsystem), and --usdt arguments, launched. (usdt.rs's semaphore test by --pid stays on the host: on the preemptible kernels it
    // missed a hit twice in five runs; our reading is that the kernel raises a semaphore before the
    // breakpoint of its site is written, so a program spinning on it can pass the site unprobed.)
    (
        "usdt",
        &[
            "subsystems_from_the_header_match_what_the_program_reported",
            "registered_dumpers_show_one_whole_round_in_every_dump",
            "argument_forms_decode_to_the_values_passed_at_o0_and_o2",
        ],
    ),
    // a launched tree with children, and exec, each probed for itself (held at its return from
    // fork, on raw_syscalls:sys_exit); a static program a traced shell execs, stopped at exec from
    // BPF until it is probed; no breakpoint in a process outside the tree
    (
        "process_trees",
        &[
            "a_command_is_traced_with_every_child_it_forks",
            "an_env_chain_ends_in_the_final_program",
            "a_static_program_execd_by_a_traced_shell_is_exact_from_its_first_instruction",
            "a_process_outside_the_tree_carries_no_breakpoint",
        ],
    ),
    // no memtrace run taints the kernel (Debian's kernels taint on fanotify permission events)
    ("no_taint", &[]),
    // levels: the mapping and brk probes, and the exit levels of a process that ends within an
    // interval (read at do_exit's entry where sched_process_exit comes after exit_mm: 6.1, 6.12;
    // its CPUs' pending RSS counts summed where the counters are per-CPU: 6.2 and later)
    (
        "levels",
        &[
            "every_level_of_a_running_and_of_an_exited_process",
            "a_process_that_exits_at_once_still_has_its_memory_and_its_temporary_allocations",
            "a_brief_process_that_touched_4_mib_has_them_resident_at_exit",
        ],
    ),
    // the owners of resident pages (smaps, pagemap, glibc's heap headers read from the process),
    // launched and attached, the free pool by size class, jemalloc, Debian's python3 with threads:
    // every test of resident.rs
    ("resident", &[]),
    // 8 threads on 2 vCPUs beside an untraced busy neighbour
    ("preemption", &[]),
    // the cgroup id each process's figures record at its first event, and the cgroup filter in
    // BPF (bpf_get_current_ancestor_cgroup_id): a runc container under --all, --container, --cgroup
    // (serve's label test stays on the host: the VM has no network to scrape over; so does the
    // test of a process that joins a container and execs: it passed on 6.12 and timed out on
    // 6.1, not understood yet)
    (
        "containers",
        &[
            "all_labels_a_kubelet_container_and_counts_it_exactly",
            "container_and_cgroup_targets_trace_only_that_container_started_later",
        ],
    ),
    // OOM kills: oom:mark_victim (its pid on 6.1, its task on 6.8+), a memory cgroup on v2, the
    // heap and stacks at the kill (serve's --oom-dir reads the same record; it stays on the host)
    ("oom", &["an_oom_killed_command_is_recorded_with_its_heap_at_the_kill"]),
    // --app-sampled: the allocator's own otel_memory probes, read by a non-sleepable program
    // (sampled_site) that walks the stack from the probe site
    ("app_sampled", &["the_allocators_samples_alone_make_the_heap_figures"]),
    // the kernel's own count of single-steps (kprobes on arch_uprobe_pre_xol and
    // arch_uprobe_skip_sstep) under a program of each allocator: ignored on the host, which has no
    // kprobes; the only test of its binary
    ("single_steps", &["--ignored"]),
    // exact counts with each allocator, its probes past the first instruction: linked jemalloc,
    // tcmalloc and mimalloc, preloaded jemalloc, tcmalloc_minimal and mimalloc, static glibc,
    // launched and attached
    (
        "allocators",
        &[
            "linked_jemalloc_is_found_and_traced_exactly",
            "linked_tcmalloc_and_mimalloc_are_found_and_traced_exactly",
            "preloaded_jemalloc_wins_over_libc_when_attaching_by_pid",
            "preloaded_tcmalloc_minimal_and_mimalloc_are_traced_exactly",
            "static_binary_is_traced_through_its_own_malloc",
        ],
    ),
    // --window: the windowed probes attached and detached while free and realloc stay, both link
    // kinds where the kernel has both, threads caught inside malloc as a window closes. (The
    // estimates' accuracy test stays on the host: under TCG the utime/stime split of a program
    // whose mallocs trap is not what it is on a real CPU; see the guide, docs/src/sampling.md, Windows.)
    (
        "windows",
        &[
            "what_a_window_recorded_is_followed_after_it_closes",
            "windows_work_through_per_site_links_too",
            "threads_caught_inside_malloc_as_windows_close_lose_no_free",
            "windows_open_again_under_all",
            "a_window_that_never_closes_is_refused",
        ],
    ),
];

/// Tests at once inside a VM (it has 2 vCPUs).
const TEST_THREADS: u32 = 2;
const VCPUS: &str = "2";
const MEMORY: &str = "4096";
/// How long one kernel may take, boot to power-off, before the VM is killed: a hang, not a slow
/// machine (CI's machine once took 24 min, alone, for a kernel this one runs in 14 beside another VM).
const DEADLINE: Duration = Duration::from_secs(40 * 60);

/// A kernel fails unless `memtrace doctor` exits 0 where memtrace works and 1 where it refuses.
const DOCTOR_REQUIRED: bool = true;

/// Which of the plan runs, and how often: all of it once (CI), or one binary many times to chase a
/// failure seen once.
pub struct Selection {
    /// Test binaries of the plan to run; empty: all.
    pub only: Vec<String>,
    pub repeat: u32,
}

impl Default for Selection {
    fn default() -> Self {
        Self { only: Vec::new(), repeat: 1 }
    }
}

impl Selection {
    /// The plan's entries chosen, each `repeat` times; an `--only` name the plan lacks is an error.
    fn entries(&self) -> Result<Vec<(&'static str, &'static [&'static str])>> {
        if let Some(unknown) = self.only.iter().find(|name| !PLAN.iter().any(|(planned, _)| planned == name))
        {
            let names: Vec<&str> = PLAN.iter().map(|(name, _)| *name).collect();
            bail!(
                "--only {unknown}: the matrix's plan has no test binary of that name (it has {})",
                names.join(", ")
            );
        }
        let chosen =
            PLAN.iter().filter(|(name, _)| self.only.is_empty() || self.only.iter().any(|only| only == name));
        let once: Vec<_> = chosen.copied().collect();
        Ok((0..self.repeat.max(1)).flat_map(|_| once.iter().copied()).collect())
    }
}

/// Boots each kernel (the default set when `packages` is empty) and runs the plan; fails if any
/// kernel fails.
pub fn run(memtrace: &Path, packages: &[String], selection: &Selection) -> Result<()> {
    toolchain::ensure_packages(HOST_PACKAGES)?;
    let entries = selection.entries()?;
    let kernels = kernels::resolve(packages)?;
    let tests = planned(&entries, &test_executables()?)?;
    if entries.iter().any(|(binary, _)| *binary == "python") {
        // Debian 13's python3.13, unpacked here: the VM has no network to fetch it.
        let root = workspace_root().join("target/debian13-python");
        crate::run(
            Command::new("sh").arg(workspace_root().join("tests/fixtures/debian13-python.sh")).arg(root),
        )?;
    }
    let out = workspace_root().join("target/matrix");
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let reports = boot_all(&kernels, &out, |kernel| prepare(kernel, memtrace, &tests, &out));
    let mut failed = Vec::new();
    let lines: Vec<String> = reports.iter().map(Report::line).collect();
    for (kernel, report) in kernels.iter().zip(&reports) {
        if !report.passed(DOCTOR_REQUIRED) {
            failed.push(kernel.package.clone());
        }
    }
    println!("matrix:");
    lines.iter().for_each(|line| println!("  {line}"));
    fs::write(out.join("summary.txt"), lines.join("\n") + "\n")?;
    if !failed.is_empty() {
        bail!("the kernel matrix failed on {} (logs: {}/<package>.log)", failed.join(", "), out.display());
    }
    Ok(())
}

/// A kernel ready to boot: its kernel image, initramfs and plan.
struct Prepared {
    vmlinuz: PathBuf,
    initrd: PathBuf,
    plan: PathBuf,
}

/// Fetches the kernel and writes its plan and initramfs.
fn prepare(kernel: &Kernel, memtrace: &Path, tests: &[Planned], out: &Path) -> Result<Prepared> {
    let unpacked = kernels::fetch(kernel)?;
    let dir = out.join(&kernel.package);
    fs::create_dir_all(&dir)?;
    let plan = dir.join("plan.sh");
    fs::write(&plan, plan_text(memtrace, tests, kernel.may_refuse))?;
    let initrd = kernels::initramfs(&unpacked, &dir)?;
    Ok(Prepared { vmlinuz: unpacked.vmlinuz, initrd, plan })
}

/// VMs booted at once: one a host CPU. Each runs its vCPUs on one host thread (see [`qemu`]), so
/// a second VM uses the CPU that would otherwise idle and the matrix takes half the time on this
/// 2-CPU machine kind.
fn vms_at_once(kernels: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |cpus| cpus.get());
    cpus.clamp(1, kernels.max(1))
}

/// Boots the kernels, [`vms_at_once`] at a time, each kernel's line printed as it ends; the
/// reports in the kernels' order. Kernels are prepared one at a time (apt's state and the package
/// cache are shared), each while the VMs before it run. Each console goes to `out`/<package>.log.
fn boot_all(
    kernels: &[Kernel],
    out: &Path,
    prepare: impl Fn(&Kernel) -> Result<Prepared> + Sync,
) -> Vec<Report> {
    let queue = Mutex::new(kernels.iter().enumerate());
    let preparing = Mutex::new(());
    let reports = Mutex::new(BTreeMap::new());
    std::thread::scope(|scope| {
        for _ in 0..vms_at_once(kernels.len()) {
            scope.spawn(|| loop {
                let Some((index, kernel)) = queue.lock().expect("the matrix's queue").next() else {
                    break;
                };
                let prepared = {
                    let _alone = preparing.lock().expect("the matrix's preparation");
                    prepare(kernel)
                };
                let report = run_kernel(kernel, prepared, &out.join(format!("{}.log", kernel.package)));
                println!("{}", report.line());
                if !report.passed(DOCTOR_REQUIRED) {
                    report.failure_output.iter().for_each(|output| println!("    {output}"));
                }
                reports.lock().expect("the matrix's reports").insert(index, report);
            });
        }
    });
    reports.into_inner().expect("the matrix's reports").into_values().collect()
}

/// Boots one prepared kernel, its console into `log`, and reads the console into a report; a
/// kernel that could not be fetched, prepared or booted is a failed report saying why.
fn run_kernel(kernel: &Kernel, prepared: Result<Prepared>, log: &Path) -> Report {
    let started = Instant::now();
    let in_time = prepared.and_then(|prepared| {
        eprintln!("xtask: matrix: booting {} (console: {})", kernel.package, log.display());
        qemu(&prepared.vmlinuz, &prepared.initrd, &prepared.plan, log)
    });
    // The console of a kernel that booted (a log left by an earlier run is not this one's).
    let mut written = String::new();
    let mut report = match in_time.and_then(|in_time| {
        Ok((fs::read(log).with_context(|| format!("reading {}", log.display()))?, in_time))
    }) {
        Ok((bytes, in_time)) => {
            written = String::from_utf8_lossy(&bytes).into_owned();
            let mut report = Report::read(&kernel.package, &written, kernel.may_refuse);
            if !in_time {
                report.problem = Some(format!("killed after {} min", DEADLINE.as_secs() / 60));
            }
            report
        }
        Err(err) => Report::broken(&kernel.package, format!("{err:#}")),
    };
    report.seconds = started.elapsed().as_secs();
    // The report's line atop the console, also where the kernel never booted.
    let _ = fs::write(log, format!("{}\n\n{}", report.line(), console::readable(&written)));
    report
}

/// One run of a test binary in the guest: its executable and name filters.
type Planned = (PathBuf, &'static [&'static str]);

/// The chosen plan entries with their executables.
fn planned(
    entries: &[(&'static str, &'static [&'static str])],
    executables: &BTreeMap<String, PathBuf>,
) -> Result<Vec<Planned>> {
    entries
        .iter()
        .map(|(name, filters)| {
            let executable = executables.get(*name).with_context(|| {
                format!(
                    "cargo built no test binary `{name}` (tests/tests/{name}.rs): the matrix's PLAN names it"
                )
            })?;
            Ok((executable.clone(), *filters))
        })
        .collect()
}

/// The bash file guest.sh sources: the binary under test and the test binaries with their filters.
fn plan_text(memtrace: &Path, tests: &[Planned], may_refuse: bool) -> String {
    let mut text = format!(
        "MEMTRACE_BIN='{}'\nTEST_THREADS={TEST_THREADS}\nALLOW_REFUSAL={}\nTESTS=(\n",
        memtrace.display(),
        u8::from(may_refuse)
    );
    for (executable, filters) in tests {
        text += &format!("  '{} {}'\n", executable.display(), filters.join(" "));
    }
    text + ")\n"
}

/// Builds the workspace's test binaries (as `cargo test --workspace` does, so nothing is built
/// twice) and returns those of tests/tests/ by name.
fn test_executables() -> Result<BTreeMap<String, PathBuf>> {
    eprintln!("xtask: matrix: building the integration test binaries");
    let output = cargo()
        .args(["test", "--workspace", "--no-run", "--message-format=json"])
        .current_dir(workspace_root())
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo test --no-run failed ({}): the test binaries do not build", output.status);
    }
    let tests_dir = workspace_root().join("tests/tests");
    let mut found = BTreeMap::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(executable), Some(source)) =
            (message["executable"].as_str(), message["target"]["src_path"].as_str())
        else {
            continue;
        };
        if Path::new(source).parent() == Some(tests_dir.as_path()) {
            let name = message["target"]["name"].as_str().unwrap_or_default().to_owned();
            found.insert(name, PathBuf::from(executable));
        }
    }
    Ok(found)
}

/// Runs QEMU (TCG, 2 vCPUs, the console on the serial port into `log`) until the guest powers off
/// or [`DEADLINE`] passes; false when it had to be killed.
fn qemu(vmlinuz: &Path, initrd: &Path, plan: &Path, log: &Path) -> Result<bool> {
    let guest = workspace_root().join("tests/matrix/guest.sh");
    let append = format!(
        "console=ttyS0 loglevel=5 oops=panic panic=-1 MATRIX_GUEST={} MATRIX_PLAN={}",
        guest.display(),
        plan.display()
    );
    let console = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    // One host thread runs both vCPUs (`thread=single`): with a thread each (MTTCG), a vCPU went on
    // running code the other had just rewritten. The kernel rewrites its own code whenever a static
    // branch turns (a per-task perf event, a memory cgroup, a tracepoint): vCPUs took the int3 of a
    // patch already finished ("Oops: int3" at __schedule+0x38a on 7.2 and +0x407 on 6.12, as the
    // scheduler's perf branch turned; at kmem_cache_alloc_noprof on 6.12-rt, in the containers tests).
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-accel", "tcg,thread=single", "-cpu", "max", "-m", MEMORY, "-smp", VCPUS])
        .args(["-nographic", "-monitor", "none", "-no-reboot", "-kernel"])
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", &append])
        .args(["-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap"])
        .stdin(Stdio::null())
        .stdout(console.try_clone()?)
        .stderr(console)
        .spawn()
        .context("starting qemu-system-x86_64 (package qemu-system-x86)")?;
    let deadline = Instant::now() + DEADLINE;
    // Waiting for the VM to power off, with a deadline: the guest's own end is the event.
    while child.try_wait()?.is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(true)
}
