//! containerd: a container run by a real containerd (Debian's package), from an OCI image that the
//! test builds from local files (busybox-static and the leaks fixture; the host's /usr bind-mounted
//! read-only for its libc) and imports from a tarball with `ctr image import`, no registry; run with
//! `ctr run` and the `io.kubernetes.*` labels the kubelet gives its containers, in the cgroup path
//! of the kubelet's cgroupfs driver. Checked: memtrace names the container's pod, namespace and
//! container from containerd's API (`--containerd-socket`) in the summary and the trace, and in
//! serve's labels, with the fixture's exact figures; a socket that refuses is said once, and the
//! container keeps its id and pod uid. The test runs a containerd of its own (its
//! own root, state and socket in a temporary directory), stopped at the end, and removes its
//! containers and tasks whether it passes or not. On the host only: the kernel matrix's VMs have
//! no containerd.

use std::{
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::Mutex,
    time::{Duration, Instant},
};

use memtrace_tests::{
    assert_figures_of,
    chromium::Chromium,
    containers::{cgroup_hierarchies, root_filesystem, Pod},
    pprof::go_pprof,
    scrape_metrics,
    tmux::{path, InTerminal, Streams},
    Memtrace, Outcome, DEADLINE, LEAKS,
};
use serde_json::Value;

/// One container run at a time: a run under --all sees every other test's container.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The kubelet's names for the container, as its labels carry them.
const POD: &str = "web-7f9";
const NAMESPACE: &str = "shop";
const NAME: &str = "api";
const IMAGE: &str = "localhost/memtrace-test:leaks";

/// A containerd of the test's own, stopped (and its directory removed) when the test ends.
struct Containerd {
    dir: tempfile::TempDir,
    daemon: Child,
}

impl Containerd {
    /// Starts containerd with its root, state and socket in a new directory, its CRI plugin off,
    /// and waits until it answers.
    fn start() -> Self {
        let dir = tempfile::Builder::new().prefix("memtrace-ctd").tempdir_in("/tmp").unwrap();
        let path = |name: &str| dir.path().join(name).display().to_string();
        let config = format!(
            "version = 2\nroot = {:?}\nstate = {:?}\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
             [grpc]\n  address = {:?}\n[ttrpc]\n  address = {:?}\n",
            path("root"),
            path("state"),
            path("containerd.sock"),
            path("containerd.sock.ttrpc"),
        );
        fs::write(dir.path().join("config.toml"), config).unwrap();
        let log = fs::File::create(dir.path().join("containerd.log")).unwrap();
        let daemon = Command::new("containerd")
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("containerd is installed (cargo xtask setup installs Debian's containerd)");
        let containerd = Self { dir, daemon };
        let deadline = Instant::now() + DEADLINE;
        while !containerd.ctr(&["version"]).status.success() {
            assert!(Instant::now() < deadline, "containerd did not answer: {}", containerd.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        containerd
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("containerd.sock")
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr` against this containerd, in the kubelet's namespace `k8s.io`.
    fn ctr(&self, args: &[&str]) -> Output {
        Command::new("ctr")
            .arg("--address")
            .arg(self.socket())
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .expect("ctr is installed (Debian's containerd)")
    }

    /// `ctr`, which must succeed; returns its stdout.
    fn ctr_ok(&self, args: &[&str]) -> String {
        let output = self.ctr(args);
        let say = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        assert!(
            output.status.success(),
            "ctr {args:?} failed: {}{}\ncontainerd's log:\n{}",
            say(&output.stdout),
            say(&output.stderr),
            self.log()
        );
        say(&output.stdout)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // SAFETY: kill has no memory-safety preconditions; the daemon is our child, not yet reaped.
        unsafe { libc::kill(self.daemon.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.daemon.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

/// A container of this containerd, with its task: removed (the task killed first) when the test
/// ends, passed or not, and the pod's cgroup directories with it.
struct Running<'a> {
    containerd: &'a Containerd,
    pod: &'a Pod,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let id = self.pod.container_id.as_str();
        let _ = self.containerd.ctr(&["task", "kill", "--signal", "SIGKILL", id]);
        let _ = self.containerd.ctr(&["task", "delete", "--force", id]);
        let _ = self.containerd.ctr(&["container", "delete", id]);
        for hierarchy in cgroup_hierarchies() {
            let pod = hierarchy.join(self.pod.pod_cgroup().trim_start_matches('/'));
            let _ = fs::remove_dir(pod.join(&self.pod.container_id));
            let _ = fs::remove_dir(&pod);
        }
    }
}

/// Writes an OCI image archive to `dir`: one uncompressed layer with busybox (as /bin/sh) and
/// the leaks fixture at /leaks, and /lib, /lib64 pointing into /usr (bind-mounted from the host).
fn image_archive(dir: &Path) -> PathBuf {
    let layer = dir.join("layer");
    root_filesystem(&layer, "leaks");
    let oci = dir.join("oci");
    fs::create_dir_all(oci.join("blobs/sha256")).unwrap();
    let layer_tar = dir.join("layer.tar");
    tar(&layer, &layer_tar);
    let (layer_digest, layer_size) = blob(&oci, &fs::read(&layer_tar).unwrap());
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {"Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    });
    let (config_digest, config_size) = blob(&oci, config.to_string().as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}],
    });
    let (manifest_digest, manifest_size) = blob(&oci, manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest_size,
            "annotations": {"io.containerd.image.name": IMAGE, "org.opencontainers.image.ref.name": "leaks"},
        }],
    });
    fs::write(oci.join("index.json"), index.to_string()).unwrap();
    fs::write(oci.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let archive = dir.join("image.tar");
    tar(&oci, &archive);
    archive
}

fn tar(dir: &Path, archive: &Path) {
    let status = Command::new("tar").arg("-C").arg(dir).arg("-cf").arg(archive).arg(".").status().unwrap();
    assert!(status.success(), "tar of {} failed", dir.display());
}

/// Stores `bytes` as a blob of the OCI layout at `oci`: its digest (`sha256:...`) and size.
fn blob(oci: &Path, bytes: &[u8]) -> (String, usize) {
    let scratch = oci.join("blob.tmp");
    fs::write(&scratch, bytes).unwrap();
    let output = Command::new("sha256sum").arg(&scratch).output().expect("sha256sum (coreutils)");
    let text = String::from_utf8(output.stdout).unwrap();
    let hex = text.split_whitespace().next().expect("sha256sum prints a digest").to_owned();
    fs::rename(&scratch, oci.join("blobs/sha256").join(&hex)).unwrap();
    (format!("sha256:{hex}"), bytes.len())
}

/// Imports the image and runs the pod's container, labelled as the kubelet labels it; its task
/// sleeps until the test execs the fixture in it.
fn run_container<'a>(containerd: &'a Containerd, pod: &'a Pod, scratch: &Path) -> Running<'a> {
    let archive = image_archive(scratch);
    containerd.ctr_ok(&["images", "import", archive.to_str().unwrap()]);
    // One left by a test that was killed.
    drop(Running { containerd, pod });
    let running = Running { containerd, pod };
    let labels = [("io.kubernetes.pod.name", POD), ("io.kubernetes.pod.namespace", NAMESPACE)];
    let labels = labels.into_iter().chain([("io.kubernetes.container.name", NAME)]);
    let mut args: Vec<String> =
        ["run", "--detach", "--cgroup", &pod.container_cgroup()].map(str::to_owned).into();
    args.push("--mount".into());
    args.push("type=bind,src=/usr,dst=/usr,options=rbind:ro".into());
    args.extend(labels.flat_map(|(key, value)| ["--label".to_owned(), format!("{key}={value}")]));
    args.extend([IMAGE, &pod.container_id, "/bin/busybox", "sleep", "600"].map(str::to_owned));
    containerd.ctr_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    running
}

/// Runs the fixture in the container (`ctr task exec`), to its end.
fn exec_fixture(containerd: &Containerd, pod: &Pod, exec_id: &str) {
    containerd.ctr_ok(&["task", "exec", "--exec-id", exec_id, &pod.container_id, "/leaks"]);
}

/// The summary's processes of the leaks fixture that ran in `pod`'s container.
fn fixtures_in<'a>(outcome: &'a Outcome, pod: &Pod) -> Vec<&'a Value> {
    let processes = outcome.summary()["processes"].as_array().unwrap();
    processes
        .iter()
        .filter(|p| p["comm"] == "leaks" && p["container"]["id"] == pod.container_id.as_str())
        .collect()
}

/// What memtrace names a process `comm` of the test's container where containerd gave its names
/// (model/identity.rs's display_name).
fn named(comm: &str) -> String {
    format!("{comm} [{NAMESPACE}/{POD}/{NAME}]")
}

fn assert_named(process: &Value, pod: &Pod) {
    let container = &process["container"];
    assert_eq!(container["id"], pod.container_id.as_str(), "{process:#}");
    assert_eq!(container["pod_uid"], pod.uid.as_str(), "{process:#}");
    assert_eq!(container["cgroup"], pod.container_cgroup().as_str(), "{process:#}");
    assert_eq!(container["pod"], POD, "{process:#}");
    assert_eq!(container["namespace"], NAMESPACE, "{process:#}");
    assert_eq!(container["name"], NAME, "{process:#}");
    assert_figures_of(process, LEAKS);
}

#[test]
fn all_names_a_containerd_containers_pod_namespace_and_container() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let containerd = Containerd::start();
    let pod = Pod::new(0x11);
    let scratch = tempfile::tempdir().unwrap();
    let socket = containerd.socket();
    let mut memtrace = Memtrace::new().arg("--all").arg("--containerd-socket").arg(&socket).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let _container = run_container(&containerd, &pod, scratch.path());
    exec_fixture(&containerd, &pod, "leaks-1");
    memtrace.wait_for_process_named(&named("leaks"));
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let ran = fixtures_in(&outcome, &pod);
    assert_eq!(ran.len(), 1, "one fixture ran in the container: {ran:#?}");
    assert_named(ran[0], &pod);
    assert!(!outcome.stderr.contains("asking containerd"), "containerd answered: {}", outcome.stderr);
}

/// `--container ID`, the container started after memtrace, with every report a run writes: the
/// text report, the HTML report (as Chromium draws it), the flamegraph and pprof's labels (as
/// `go tool pprof -raw` reads them) name the container by its pod, namespace and name.
#[test]
fn every_report_names_a_containerd_containers_pod() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let containerd = Containerd::start();
    let pod = Pod::new(0x14);
    let scratch = tempfile::tempdir().unwrap();
    let memtrace = Memtrace::new();
    let dir = memtrace.dir().to_owned();
    let (page, profile, flamegraph) = (dir.join("report.html"), dir.join("heap.pb.gz"), dir.join("live.svg"));
    let mut memtrace = memtrace
        .args(["--container", &pod.container_id[..12], "--containerd-socket"])
        .arg(containerd.socket())
        .arg("--html")
        .arg(&page)
        .arg("--pprof")
        .arg(&profile)
        .arg("--flamegraph")
        .arg(&flamegraph)
        .spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let _container = run_container(&containerd, &pod, scratch.path());
    memtrace.wait_for_stderr_containing(&format!("following cgroup {}", pod.container_cgroup()));
    exec_fixture(&containerd, &pod, "leaks-4");
    let name = named("leaks");
    memtrace.wait_for_process_named(&name);
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let ran = fixtures_in(&outcome, &pod);
    assert_eq!(ran.len(), 1, "{ran:#?}");
    assert_named(ran[0], &pod);
    let pid = &ran[0]["pid"];
    assert!(
        outcome.stderr.contains(&format!("  pid {pid} ({name}), exited via glibc")),
        "{}",
        outcome.stderr
    );
    let svg = fs::read_to_string(&flamegraph).unwrap();
    assert!(svg.contains(&format!("{name} ({pid})")), "the flamegraph's root names the container:\n{svg}");
    let raw = pprof_raw(&profile, scratch.path());
    for (key, value) in [
        ("pod", POD),
        ("namespace", NAMESPACE),
        ("container", NAME),
        ("container_id", &pod.container_id[..12]),
    ] {
        assert!(raw.contains(&format!("{key}:[{value}]")), "the samples carry {key} {value}:\n{raw}");
    }
    let mut chromium = Chromium::start();
    chromium.open(&page);
    let shown = chromium.evaluate("document.body.innerText").as_str().unwrap_or_default().to_owned();
    assert!(shown.contains(&format!("{name} ({pid})")), "the HTML report names the container:\n{shown}");
}

/// `memtrace top --container ID` in a terminal, the container running before it: the row of the
/// fixture exec'd in it names the pod, namespace and container, with the fixture's live heap.
#[test]
fn top_names_a_containerd_containers_pod() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let containerd = Containerd::start();
    let pod = Pod::new(0x15);
    let scratch = tempfile::tempdir().unwrap();
    let _container = run_container(&containerd, &pod, scratch.path());
    let socket = containerd.socket();
    let args =
        ["top", "-i", "100ms", "--container", &pod.container_id[..12], "--containerd-socket", path(&socket)];
    let run =
        InTerminal::start(scratch.path(), &args, Streams { stderr_to_file: true, ..Streams::default() });
    let tmux = &run.tmux;
    tmux.wait_for("every probe attached");
    exec_fixture(&containerd, &pod, "leaks-5");
    let name = named("leaks");
    let screen = tmux.wait_until(&name, |screen| {
        screen.lines().any(|line| line.contains(&name) && line.contains(&format!("{} B", LEAKS.live_bytes)))
    });
    tmux.send("q");
    assert_eq!(run.status(), 0, "{screen}\nstderr:\n{}", run.stderr());
}

/// `go tool pprof -raw` of a profile: its samples, each with its labels, as text.
fn pprof_raw(profile: &Path, home: &Path) -> String {
    go_pprof([OsStr::new("-raw"), profile.as_os_str()], home)
}

/// `memtrace serve --container ID`, the container started after it: its series carry the pod,
/// namespace and container labels, with the fixture's exact counts.
#[test]
fn serve_labels_a_containerd_containers_series_with_its_names() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let containerd = Containerd::start();
    let pod = Pod::new(0x12);
    let scratch = tempfile::tempdir().unwrap();
    let socket = containerd.socket();
    let mut memtrace = Memtrace::new()
        .without_default_outputs()
        .args(["serve", "--listen", "127.0.0.1:0", "-i", "100ms", "--container", &pod.container_id[..12]])
        .arg("--containerd-socket")
        .arg(&socket)
        .spawn();
    let port = memtrace.serving_port();
    memtrace.wait_for_stderr("memtrace: tracing");
    let _container = run_container(&containerd, &pod, scratch.path());
    memtrace.wait_for_stderr_containing(&format!("following cgroup {}", pod.container_cgroup()));
    exec_fixture(&containerd, &pod, "leaks-2");
    let labels = format!(
        r#"comm="leaks",container_id="{}",pod="{POD}",namespace="{NAMESPACE}",container="{NAME}","#,
        &pod.container_id[..12]
    );
    let deadline = Instant::now() + DEADLINE;
    let body = loop {
        let body = scrape_metrics(port);
        if body.lines().any(|line| line.starts_with("memtrace_frees_total{") && line.contains(&labels)) {
            break body;
        }
        assert!(Instant::now() < deadline, "no series with {labels} in:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let value = |metric: &str| {
        body.lines()
            .find(|line| line.starts_with(&format!("{metric}{{")) && line.contains(&labels))
            .and_then(|line| line.rsplit(' ').next()?.parse::<i64>().ok())
    };
    assert_eq!(value("memtrace_allocations_total"), Some(LEAKS.allocations as i64), "{body}");
    assert_eq!(value("memtrace_frees_total"), Some(LEAKS.frees as i64), "{body}");
    assert_eq!(value("memtrace_heap_live_bytes"), Some(LEAKS.live_bytes), "{body}");
    memtrace.interrupt();
    assert!(memtrace.wait().success());
}

/// A containerd socket that refuses (nobody listens on it): said once on stderr, naming the
/// socket and the option; the container keeps its id and pod uid, the figures stay exact.
#[test]
fn a_refusing_socket_is_said_once_and_the_container_keeps_its_id() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let containerd = Containerd::start();
    let pod = Pod::new(0x13);
    let scratch = tempfile::tempdir().unwrap();
    let dead = scratch.path().join("dead.sock");
    drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
    let mut memtrace = Memtrace::new().arg("--all").arg("--containerd-socket").arg(&dead).spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let _container = run_container(&containerd, &pod, scratch.path());
    exec_fixture(&containerd, &pod, "leaks-3");
    memtrace.wait_for_process_named(&pod.process_name("leaks"));
    memtrace.interrupt();
    let outcome = memtrace.finish();
    outcome.assert_exit_code(0);
    let said = format!("memtrace: asking containerd at {} ", dead.display());
    assert_eq!(outcome.stderr.matches(&said).count(), 1, "{}", outcome.stderr);
    outcome.assert_stderr_mentions(&["--containerd-socket PATH"]);
    let ran = fixtures_in(&outcome, &pod);
    assert_eq!(ran.len(), 1, "{ran:#?}");
    let container = &ran[0]["container"];
    assert_eq!(container["pod_uid"], pod.uid.as_str());
    assert!(container.get("pod").is_none() && container.get("name").is_none(), "{container:#}");
    assert_figures_of(ran[0], LEAKS);
}
