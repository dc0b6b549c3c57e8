//! The Kubernetes deployment (deploy/kubernetes/, deploy/Containerfile), tested as far as a machine
//! without a cluster allows. The DaemonSet's container runs under runc from the image's root
//! (Debian packages, mmdebstrap) with exactly its manifest's command, environment (the node's name
//! from the downward API), securityContext, namespaces (hostPID, the pod's own network) and
//! limits, translated from the YAML by tests/src/kubernetes.rs; it traces a fixture started on the
//! host, outside its container, and its /metrics, read from inside the pod's network namespace,
//! shows that process's exact figures. The node's name the manifest passes is the host of pushed
//! profiles. The manifests pass the Kubernetes API schema
//! (kubernetes-validate from PyPI, strict, in a venv under target/).

use std::{
    fs::{self, File},
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use memtrace_tests::{
    assert_root, fixture, kubernetes, memtrace_bin, workspace_root, Memtrace, Spawned, DEADLINE,
};
use serde_json::Value;

/// fixtures/held_heap.c once ready: 8 blocks of 8 MiB live, of 9 allocations (67112960 bytes), 1 freed.
const LIVE_BYTES: u64 = 8 * 8_388_608;
const LIVE_ALLOCATIONS: u64 = 8;
const ALLOCATIONS: u64 = 9;
const ALLOCATED_BYTES: u64 = LIVE_BYTES + 4096;
const FREES: u64 = 1;

/// The node's name the downward API gives the pod here.
const NODE: &str = "test-node-1";

/// Capability numbers (linux/capability.h) of the names a manifest may add.
const CAPABILITIES: [(&str, u32); 9] = [
    ("CAP_DAC_READ_SEARCH", 2),
    ("CAP_IPC_LOCK", 14),
    ("CAP_SYS_PTRACE", 19),
    ("CAP_SYS_ADMIN", 21),
    ("CAP_SYS_RESOURCE", 24),
    ("CAP_SYSLOG", 34),
    ("CAP_PERFMON", 38),
    ("CAP_BPF", 39),
    ("CAP_CHECKPOINT_RESTORE", 40),
];

/// A container run by runc from a bundle of its own, deleted when the test ends however it ends.
struct Container {
    id: String,
    state: PathBuf,
    bundle: tempfile::TempDir,
    running: Option<Spawned>,
}

impl Container {
    /// The bundle: the image's root with the memtrace binary where the Containerfile puts it, and
    /// the config translated from the DaemonSet.
    fn create(pod: &Value) -> Self {
        let deploy = workspace_root().join("target/deploy");
        fs::create_dir_all(&deploy).expect("creating target/deploy");
        let bundle =
            tempfile::Builder::new().prefix("bundle-").tempdir_in(&deploy).expect("a bundle directory");
        let rootfs = bundle.path().join("rootfs");
        let copied = Command::new("cp").arg("-a").arg(kubernetes::image_rootfs()).arg(&rootfs).status();
        assert!(copied.is_ok_and(|status| status.success()), "copying the image's root");
        let binary = rootfs.join(kubernetes::binary_in_image().strip_prefix("/").unwrap());
        fs::create_dir_all(binary.parent().unwrap()).unwrap();
        fs::copy(memtrace_bin(), &binary).expect("copying memtrace into the image's root");
        for mount_point in ["proc", "sys", "dev"] {
            fs::create_dir_all(rootfs.join(mount_point)).unwrap();
        }
        let id = format!("memtrace-deploy-{}", std::process::id());
        let config = kubernetes::oci_config(pod, NODE, &format!("/{id}"));
        fs::write(bundle.path().join("config.json"), config.to_string()).expect("writing config.json");
        Self { state: deploy.join("runc-state"), id, bundle, running: None }
    }

    fn runc(&self) -> Command {
        let mut command = Command::new("runc");
        command.arg("--root").arg(&self.state);
        command
    }

    /// `runc run` in the foreground: the container's stdout and stderr are runc's.
    fn run(&mut self) -> &mut Spawned {
        let mut command = self.runc();
        command.arg("run").arg("--bundle").arg(self.bundle.path()).arg(&self.id);
        self.running.insert(Spawned::spawn(command))
    }

    /// The container's first process, as the host sees it.
    fn pid(&self) -> u32 {
        let output = self.runc().arg("state").arg(&self.id).output().expect("running runc state");
        let state: Value = serde_json::from_slice(&output.stdout).expect("runc state prints JSON");
        state["pid"].as_u64().expect("a running container has a pid") as u32
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = self.runc().args(["delete", "--force"]).arg(&self.id).output();
    }
}

/// GET `path` on 127.0.0.1:`port` inside the network namespace of process `pid` (the pod's).
fn get_in_pod(pid: u32, port: u16, path: &str) -> String {
    let netns = File::open(format!("/proc/{pid}/ns/net")).expect("opening the pod's network namespace");
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    let raw = thread::spawn(move || {
        // SAFETY: setns on a descriptor we own moves only this thread, which ends after the request.
        let joined = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(joined, 0, "joining the pod's network namespace: {}", std::io::Error::last_os_error());
        let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to the agent in its pod");
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        stream.write_all(request.as_bytes()).expect("sending the request");
        let mut raw = String::new();
        stream.read_to_string(&mut raw).expect("reading the response");
        raw
    })
    .join()
    .expect("the request's thread");
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"), "{head}");
    body.to_owned()
}

/// The value of the series `name{pid="PID",...}` in a /metrics text.
fn series(metrics: &str, name: &str, pid: u32) -> Option<u64> {
    let prefix = format!("{name}{{pid=\"{pid}\",");
    let line = metrics.lines().find(|line| line.starts_with(&prefix))?;
    line.rsplit(' ').next()?.parse().ok()
}

/// The effective capabilities of process `pid` (CapEff in /proc/PID/status).
fn effective_capabilities(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("reading the agent's status");
    let field = status.lines().find_map(|line| line.strip_prefix("CapEff:")).expect("CapEff");
    u64::from_str_radix(field.trim(), 16).expect("CapEff is hex")
}

fn status_field(pid: u32, name: &str) -> String {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).expect("reading the agent's status");
    status.lines().find_map(|line| line.strip_prefix(name)).expect("a status field").trim().to_owned()
}

/// Checks the running container against its manifest: exactly the capabilities added, no new
/// privileges, no seccomp filter, a read-only root, the host's process table, a network of its own.
fn assert_confined_as_the_manifest_says(pid: u32, container: &Value) {
    let added = container["securityContext"]["capabilities"]["add"].as_array().unwrap();
    let wanted = added.iter().fold(0u64, |mask, name| {
        let name = format!("CAP_{}", name.as_str().unwrap());
        let bit = CAPABILITIES.iter().find(|(known, _)| *known == name).expect("a known capability").1;
        mask | 1 << bit
    });
    assert_eq!(effective_capabilities(pid), wanted, "the agent holds exactly the manifest's capabilities");
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
    let mountinfo = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    let root = mountinfo.lines().find(|line| line.split(' ').nth(4) == Some("/")).expect("the root mount");
    assert!(
        root.split(' ').nth(5).unwrap().split(',').any(|option| option == "ro"),
        "read-only root: {root}"
    );
    let namespace = |pid: &str, kind: &str| fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    assert_eq!(
        namespace(&pid.to_string(), "pid"),
        namespace("self", "pid"),
        "hostPID: the host's process table"
    );
    assert_ne!(namespace(&pid.to_string(), "net"), namespace("self", "net"), "the pod's own network");
}

/// The port the agent listens on: the container's one port, which --listen and the Prometheus
/// annotation name too.
fn metrics_port(daemonset: &Value) -> u16 {
    let pod = kubernetes::pod_spec(daemonset);
    let container = kubernetes::container(pod);
    let port = container["ports"][0]["containerPort"].as_u64().expect("a container port") as u16;
    let annotations = &daemonset["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let listen = args.windows(2).find(|pair| pair[0] == "--listen").map(|pair| pair[1]).expect("--listen");
    assert_eq!(listen, format!("0.0.0.0:{port}"), "the agent listens on the pod's addresses, at its port");
    port
}

#[test]
fn the_daemonset_under_runc_traces_a_host_process_and_serves_its_figures() {
    assert_root();
    let daemonset = kubernetes::manifest("daemonset.yaml");
    let pod = kubernetes::pod_spec(&daemonset);
    let port = metrics_port(&daemonset);
    let mut container = Container::create(pod);
    let runc = container.run();
    runc.wait_for_stderr("memtrace: serving http://0.0.0.0:");
    runc.wait_for_stderr("memtrace: tracing all processes");
    let agent = container.pid();
    assert_confined_as_the_manifest_says(agent, kubernetes::container(pod));
    assert_eq!(get_in_pod(agent, port, "/healthz").trim(), "ok");

    // A process of the node, outside the agent's container, started once the agent traces.
    let mut target = Spawned::spawn(Command::new(fixture("held_heap")));
    target.wait_for_stdout("ready");
    let pid = target.pid();
    let deadline = Instant::now() + DEADLINE;
    let metrics = loop {
        let metrics = get_in_pod(agent, port, "/metrics");
        if series(&metrics, "memtrace_heap_live_bytes", pid) == Some(LIVE_BYTES) {
            break metrics;
        }
        assert!(Instant::now() < deadline, "the host process's live heap never showed:\n{metrics}");
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(series(&metrics, "memtrace_heap_live_allocations", pid), Some(LIVE_ALLOCATIONS));
    assert_eq!(series(&metrics, "memtrace_allocations_total", pid), Some(ALLOCATIONS));
    assert_eq!(series(&metrics, "memtrace_allocated_bytes_total", pid), Some(ALLOCATED_BYTES));
    assert_eq!(series(&metrics, "memtrace_frees_total", pid), Some(FREES));
    assert!(
        metrics.contains(&format!(
            "memtrace_heap_live_bytes{{pid=\"{pid}\",comm=\"held_heap\",allocator=\"glibc\"}}"
        )),
        "the host process is named by its own pid and command"
    );

    // SIGTERM, as the kubelet stops a pod: the agent ends cleanly, status 0.
    target.close_stdin();
    assert!(target.wait().success());
    let stopped = container.runc().args(["kill"]).arg(&container.id).arg("TERM").status().unwrap();
    assert!(stopped.success(), "runc kill");
    let runc = container.running.as_mut().unwrap();
    let status = runc.wait();
    assert!(status.success(), "the agent ended with {status}:\n{}", runc.stderr_text());
}

/// The venv under target/ that holds PyPI's kubernetes-validate, made when missing.
fn kubernetes_validate() -> PathBuf {
    let venv = workspace_root().join("target/deploy/venv");
    let validate = venv.join("bin/kubernetes-validate");
    if validate.is_file() {
        return validate;
    }
    let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).status();
    assert!(
        made.is_ok_and(|s| s.success()),
        "python3 -m venv failed: install python3-venv (`cargo xtask setup`)"
    );
    let pip = venv.join("bin/pip");
    let installed = Command::new(&pip).args(["install", "--quiet", "kubernetes-validate==1.37.0"]).status();
    assert!(installed.is_ok_and(|s| s.success()), "pip could not install kubernetes-validate from PyPI");
    validate
}

#[test]
fn the_manifests_pass_the_kubernetes_api_schema() {
    let dir = workspace_root().join("deploy/kubernetes");
    let manifests: Vec<PathBuf> =
        ["namespace.yaml", "serviceaccount.yaml", "networkpolicy.yaml", "daemonset.yaml"]
            .iter()
            .map(|name| dir.join(name))
            .collect();
    let kustomization = fs::read_to_string(dir.join("kustomization.yaml")).unwrap();
    for manifest in &manifests {
        let name = manifest.file_name().unwrap().to_str().unwrap();
        assert!(kustomization.contains(&format!("- {name}")), "kustomization.yaml lists {name}");
    }
    // The oldest Kubernetes the DaemonSet's fields exist in (appArmorProfile: 1.30), and the newest.
    for version in ["1.30.0", "1.37.0"] {
        let output = Command::new(kubernetes_validate())
            .args(["--strict", "--kubernetes-version", version])
            .args(&manifests)
            .output()
            .expect("running kubernetes-validate");
        let text =
            String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "kubernetes-validate {version}:\n{text}");
        assert_eq!(text.matches(" passed for resource ").count(), manifests.len(), "{text}");
    }
    // A field the schema does not know fails: the validator is not one that passes anything.
    let broken = workspace_root().join("target/deploy/broken-daemonset.yaml");
    let text = fs::read_to_string(dir.join("daemonset.yaml")).unwrap();
    fs::write(&broken, text.replace("hostPID: true", "hostPID: true\n      hostPid: true")).unwrap();
    let output = Command::new(kubernetes_validate()).arg("--strict").arg(&broken).output().unwrap();
    assert!(!output.status.success(), "kubernetes-validate passed an unknown field");
}

/// The same translation read back: the manifest's numbers as the runtime gets them.
#[test]
fn the_runtime_gets_the_manifests_limits_and_the_node_name() {
    let daemonset = kubernetes::manifest("daemonset.yaml");
    let pod = kubernetes::pod_spec(&daemonset);
    let config = kubernetes::oci_config(pod, NODE, "/x");
    let limits = &kubernetes::container(pod)["resources"]["limits"];
    assert_eq!(
        config["linux"]["resources"]["memory"]["limit"],
        kubernetes::bytes(limits["memory"].as_str().unwrap())
    );
    let args: Vec<&str> =
        config["process"]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert!(args.windows(2).any(|pair| pair == ["--host-name", NODE]), "{args:?}");
    assert!(!args.iter().any(|arg| arg.contains("$(")), "every $(VAR) expanded: {args:?}");
    assert_eq!(Path::new(args[0]), kubernetes::binary_in_image());
    assert_eq!(kubernetes::bytes("384Mi"), 402_653_184);
    assert_eq!(kubernetes::millicores("250m"), 250);
}

/// The node's name the manifest hands memtrace (`--host-name $(NODE_NAME)`, from the downward API)
/// is the `host` of what it pushes, not the pod's host name.
#[test]
fn the_node_name_from_the_downward_api_is_the_host_of_pushed_profiles() {
    let daemonset = kubernetes::manifest("daemonset.yaml");
    let config = kubernetes::oci_config(kubernetes::pod_spec(&daemonset), NODE, "/x");
    let args: Vec<&str> =
        config["process"]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let host =
        args.windows(2).find(|pair| pair[0] == "--host-name").map(|pair| pair[1]).expect("--host-name");
    let mut target = Spawned::spawn(Command::new(fixture("held_heap")));
    target.wait_for_stdout("ready");
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", receiver.local_addr().unwrap());
    let pid = target.pid().to_string();
    let mut memtrace = Memtrace::new()
        .without_default_outputs()
        .args(["serve", "--listen", "127.0.0.1:0", "--pid", &pid, "--no-stacks"])
        .args(["--push", &url, "--push-interval", "1s", "--host-name", host])
        .spawn();
    memtrace.wait_for_stderr("memtrace: tracing");
    let (mut stream, _) = receiver.accept().expect("a push");
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n") && stream.read(&mut byte).expect("reading the push") == 1 {
        head.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&head);
    // memtrace.heap{host=test-node-1,pid=...}, percent-encoded.
    assert!(line.contains(&format!("name=memtrace.heap%7Bhost%3D{NODE}%2Cpid%3D{pid}%2C")), "{line}");
    stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    memtrace.interrupt();
    assert!(memtrace.wait().success());
}
