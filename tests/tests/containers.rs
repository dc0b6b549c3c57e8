//! Containers and pods: a fixture run by a real runtime (Debian's runc) in a container whose root is
//! busybox-static plus the fixture (the host's /usr bind-mounted read-only for its libc), in the
//! cgroup path the kubelet's cgroupfs driver gives a pod's container. Checked: the summary's
//! `container` (id, pod uid, cgroup) and the trace's process name under --all, with the fixture's
//! exact figures; `--container ID-PREFIX` and `--cgroup POD-PATH` tracing that container, started
//! after memtrace, and nothing outside it; `memtrace serve --cgroup` labelling the container's series
//! with its id and counting it exactly.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use memtrace_tests::{
    assert_figures_of,
    containers::{cgroup_hierarchies, root_filesystem, Pod},
    fixture, scrape_metrics, Figures, Memtrace, Outcome, Running, Spawned,
};
use serde_json::Value;

/// fixtures/malloc_free.c: malloc 100, 200, 300 and 0 (the peak: 600 live); free the 200,
/// free(NULL) (nothing), free the 100; malloc 50; free the 0-byte block. Live: 300 + 50.
const MALLOC_FREE: Figures = Figures {
    allocations: 5,
    frees: 3,
    allocated_bytes: 100 + 200 + 300 + 50,
    freed_bytes: 200 + 100,
    live_allocations: 2,
    live_bytes: 300 + 50,
    peak_live_bytes: Some(600),
    untracked_frees: 0,
    failed_allocations: 0,
};

/// One container run at a time: a run under --all sees every other test's container.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// An OCI bundle: busybox and the fixture in the root, the host's /usr read-only at /usr (glibc),
/// a shell that waits for a line on stdin before it runs the fixture and after, so that the test
/// decides when the fixture runs and when the container (and its cgroup) goes.
fn bundle(dir: &Path, pod: &Pod) -> PathBuf {
    let bundle = dir.join("bundle");
    root_filesystem(&bundle.join("rootfs"), "malloc_free");
    let status =
        Command::new("runc").args(["spec", "--bundle"]).arg(&bundle).status().expect("runc is installed");
    assert!(status.success(), "runc spec failed");
    let path = bundle.join("config.json");
    let mut config: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    config["process"]["terminal"] = false.into();
    config["process"]["args"] =
        serde_json::json!(["/bin/sh", "-c", "read go; /malloc_free; echo ran $?; read done"]);
    config["linux"]["cgroupsPath"] = pod.container_cgroup().into();
    config["mounts"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}));
    fs::write(&path, config.to_string()).unwrap();
    bundle
}

/// A runc container's name, deleted (whatever state it is in) when the test ends, passed or not.
struct Deleted(String);

impl Drop for Deleted {
    fn drop(&mut self) {
        let _ = Command::new("runc").args(["delete", "--force", &self.0]).output();
    }
}

/// Runs the pod's container under runc; it waits for a line before it runs the fixture.
fn start_container(dir: &Path, pod: &Pod) -> (Spawned, Deleted) {
    let bundle = bundle(dir, pod);
    let name = Deleted(format!("memtrace-test-{}", &pod.container_id[..12]));
    // One left by a test that was killed.
    let _ = Command::new("runc").args(["delete", "--force", &name.0]).output();
    let mut command = Command::new("runc");
    command.arg("run").arg("--bundle").arg(&bundle).arg(&name.0);
    (Spawned::spawn(command), name)
}

/// Lets the container run its fixture, waits until memtrace has it in its trace (adopted while
/// its cgroup exists), then lets the container end.
fn run_fixture(memtrace: &mut Running, container: &mut Spawned, pod: &Pod) {
    container.send(b"go\n");
    assert_eq!(container.wait_for_stdout("ran"), "ran 0");
    memtrace.wait_for_process_named(&pod.process_name("malloc_free"));
    container.send(b"done\n");
    assert!(container.wait().success(), "the container failed: {}", container.stderr_text());
}

/// The pod's cgroup directories: made in every hierarchy before a run that names the pod (the
/// kubelet makes them before its containers), removed at the end of the test.
struct PodCgroups(Vec<PathBuf>);

impl PodCgroups {
    fn make(pod: &Pod) -> Self {
        let mut made = Vec::new();
        for hierarchy in cgroup_hierarchies() {
            let dir = hierarchy.join(pod.pod_cgroup().trim_start_matches('/'));
            fs::create_dir_all(&dir).unwrap_or_else(|err| panic!("making {}: {err}", dir.display()));
            made.push(dir);
        }
        Self(made)
    }
}

impl Drop for PodCgroups {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = fs::remove_dir(dir);
        }
    }
}

fn processes_named<'a>(outcome: &'a Outcome, comm: &str) -> Vec<&'a Value> {
    outcome.summary()["processes"].as_array().unwrap().iter().filter(|p| p["comm"] == comm).collect()
}

/// Runs the host's own copy of the fixture while memtrace traces: a process outside the pod.
fn run_outside() -> u32 {
    let mut child = Command::new(fixture("malloc_free")).spawn().unwrap();
    let pid = child.id();
    assert!(child.wait().unwrap().success());
    pid
}

fn assert_labelled(process: &Value, pod: &Pod) {
    let container = &process["container"];
    assert_eq!(container["id"], pod.container_id.as_str(), "{process:#}");
    assert_eq!(container["pod_uid"], pod.uid.as_str());
    assert_eq!(container["cgroup"], pod.container_cgroup().as_str());
    assert_eq!(process["cgroup"], pod.container_cgroup().as_str());
    assert_figures_of(process, MALLOC_FREE);
}

#[test]
fn all_labels_a_kubelet_container_and_counts_it_exactly() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let pod = Pod::new(1);
    let _cgroups = PodCgroups::make(&pod);
    let scratch = tempfile::tempdir().unwrap();
    let mut memtrace = Memtrace::new().arg("--all").spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let (mut container, _deleted) = start_container(scratch.path(), &pod);
    run_fixture(&mut memtrace, &mut container, &pod);
    let outside = run_outside();
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let ran = processes_named(&outcome, "malloc_free");
    let inside: Vec<_> = ran.iter().filter(|p| p["pid"] != outside).collect();
    assert_eq!(inside.len(), 1, "one fixture ran in the container: {ran:#?}");
    assert_labelled(inside[0], &pod);
    let host = ran.iter().find(|p| p["pid"] == outside).expect("the host's fixture is traced too");
    assert!(host.get("container").is_none(), "a process outside containers has none: {host:#}");
}

#[test]
fn container_and_cgroup_targets_trace_only_that_container_started_later() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for (seed, by_container) in [(2u8, true), (3, false)] {
        let pod = Pod::new(seed);
        // The pod exists before the run (the kubelet makes it); its container comes later.
        let _cgroups = PodCgroups::make(&pod);
        let scratch = tempfile::tempdir().unwrap();
        let target = match by_container {
            true => ["--container".to_owned(), pod.container_id[..12].to_owned()],
            false => ["--cgroup".to_owned(), pod.pod_cgroup()],
        };
        let mut memtrace = Memtrace::new().args(&target).spawn();
        memtrace.wait_for_stderr("memtrace: tracing");
        let (mut container, _deleted) = start_container(scratch.path(), &pod);
        if by_container {
            // The container's cgroup is found at the sample after runc made it.
            memtrace.wait_for_stderr_containing(&format!("following cgroup {}", pod.container_cgroup()));
        }
        let outside = run_outside();
        run_fixture(&mut memtrace, &mut container, &pod);
        memtrace.interrupt();
        let outcome = memtrace.finish();
        outcome.assert_exit_code(0);
        let traced = outcome.summary()["processes"].as_array().unwrap();
        assert!(traced.iter().all(|p| p["pid"] != outside), "{target:?}: the host's fixture is not traced");
        let ran = processes_named(&outcome, "malloc_free");
        assert_eq!(ran.len(), 1, "{target:?}: {traced:#?}");
        assert_labelled(ran[0], &pod);
    }
}

#[test]
fn bad_container_ids_and_cgroup_paths_are_usage_errors() {
    for args in [["--container", "abc123"], ["--container", "xyz456789012"], ["--cgroup", "kubepods/x"]] {
        let outcome = Memtrace::new().args(args).run();
        outcome.assert_exit_code(2);
        outcome.assert_stderr_mentions(&[args[1]]);
    }
}

#[test]
fn serve_labels_a_containers_series() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let pod = Pod::new(4);
    let _cgroups = PodCgroups::make(&pod);
    let scratch = tempfile::tempdir().unwrap();
    let mut memtrace = Memtrace::new()
        .without_default_outputs()
        .args(["serve", "--listen", "127.0.0.1:0", "-i", "100ms", "--cgroup", &pod.pod_cgroup()])
        .spawn();
    let port = memtrace.serving_port();
    memtrace.wait_for_stderr("memtrace: tracing");
    let (mut container, _deleted) = start_container(scratch.path(), &pod);
    container.send(b"go\n");
    assert_eq!(container.wait_for_stdout("ran"), "ran 0");
    // The fixture's final figures, with its container's id (12 hex digits) as a label; polled
    // until a sample has read them, for at most the harness's deadline.
    let series =
        format!(r#"comm="malloc_free",container_id="{}",allocator="glibc"}} "#, &pod.container_id[..12]);
    let deadline = std::time::Instant::now() + memtrace_tests::DEADLINE;
    let body = loop {
        let body = scrape_metrics(port);
        if body.lines().any(|line| line.starts_with("memtrace_allocations_total{") && line.contains(&series))
        {
            break body;
        }
        assert!(std::time::Instant::now() < deadline, "no series with {series} in:\n{body}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let value = |metric: &str| {
        body.lines()
            .find(|line| line.starts_with(&format!("{metric}{{")) && line.contains(&series))
            .and_then(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
    };
    assert_eq!(value("memtrace_allocations_total"), Some(MALLOC_FREE.allocations), "{body}");
    assert_eq!(value("memtrace_frees_total"), Some(MALLOC_FREE.frees), "{body}");
    container.send(b"done\n");
    assert!(container.wait().success());
    memtrace.interrupt();
    assert!(memtrace.wait().success());
}

/// A process seen allocating outside the container that then joins it and execs the container's
/// program, as runc's init does for `runc exec` and `ctr task exec` (it allocates before its parent
/// has moved it into the container's cgroup): the program it execs is named by the container it
/// runs in, not by where the process first allocated. Here bash, traced first as itself, moves into
/// the container's cgroup at the test's word and execs the fixture.
#[test]
fn a_process_that_joins_a_container_and_execs_is_named_by_its_container() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let pod = Pod::new(5);
    let cgroups = PodCgroups::make(&pod);
    let containers: Vec<PathBuf> = cgroups.0.iter().map(|dir| dir.join(&pod.container_id)).collect();
    for dir in &containers {
        fs::create_dir_all(dir).unwrap_or_else(|err| panic!("making {}: {err}", dir.display()));
    }
    let join: String =
        containers.iter().map(|dir| format!("echo $$ > {}/cgroup.procs; ", dir.display())).collect();
    let mut memtrace = Memtrace::new().arg("--all").spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let mut command = Command::new("bash");
    command.arg("-c").arg(format!("read word; {join}exec {}", fixture("malloc_free").display()));
    let mut joiner = Spawned::spawn(command);
    let pid = joiner.pid();
    memtrace.wait_for_trace("the shell before it joins", |trace| {
        trace.phase("M").any(|event| event["pid"] == pid && event["args"]["name"] == "bash")
    });
    joiner.send(b"go\n");
    assert!(joiner.wait().success(), "the shell failed: {}", joiner.stderr_text());
    memtrace.wait_for_process_named(&pod.process_name("malloc_free"));
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let ran = processes_named(&outcome, "malloc_free");
    let joined = ran.iter().find(|p| p["pid"] == pid).unwrap_or_else(|| panic!("pid {pid} in {ran:#?}"));
    assert_labelled(joined, &pod);
    for dir in containers.iter().rev() {
        let _ = fs::remove_dir(dir);
    }
}
