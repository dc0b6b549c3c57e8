//! The Kubernetes deployment as a container runtime would run it, without a cluster: the manifests
//! of deploy/kubernetes/ read as the API server would (YAML into JSON values), the agent's
//! container translated into an OCI runtime config the way a CRI runtime (containerd, CRI-O)
//! builds one for a non-privileged container, and the image's root built from Debian packages as
//! deploy/Containerfile's context is (deploy/rootfs.packages, mmdebstrap). Whatever the manifest
//! says that this translation does not know fails the test, so the two cannot drift apart.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::{json, Value};

use crate::{target_dir, workspace_root};

/// A manifest of deploy/kubernetes/, e.g. "daemonset.yaml", as the JSON the API server keeps.
pub fn manifest(name: &str) -> Value {
    let path = workspace_root().join("deploy/kubernetes").join(name);
    let text = fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    serde_norway::from_str(&text).unwrap_or_else(|err| panic!("{} is not YAML: {err}", path.display()))
}

/// The pod template's spec of a DaemonSet.
pub fn pod_spec(daemonset: &Value) -> &Value {
    &daemonset["spec"]["template"]["spec"]
}

/// The pod's one container.
pub fn container(pod: &Value) -> &Value {
    let containers = pod["containers"].as_array().expect("the pod has containers");
    assert_eq!(containers.len(), 1, "the agent's pod has one container");
    &containers[0]
}

/// The OCI runtime config (runc's config.json) of the pod's container on node `node`, in cgroup
/// `cgroup`.
pub fn oci_config(pod: &Value, node: &str, cgroup: &str) -> Value {
    let container = container(pod);
    assert!(pod.get("securityContext").is_none(), "a pod-level securityContext is not translated");
    known_keys(
        container,
        &[
            "name",
            "image",
            "imagePullPolicy",
            "command",
            "args",
            "env",
            "ports",
            "readinessProbe",
            "livenessProbe",
            "resources",
            "securityContext",
            "volumeMounts",
        ],
    );
    let security = &container["securityContext"];
    known_keys(
        security,
        &[
            "privileged",
            "allowPrivilegeEscalation",
            "readOnlyRootFilesystem",
            "runAsUser",
            "runAsGroup",
            "runAsNonRoot",
            "capabilities",
            "seccompProfile",
            "appArmorProfile",
        ],
    );
    assert_eq!(security["privileged"], json!(false), "the agent is not privileged");
    assert_eq!(
        security["seccompProfile"]["type"], "Unconfined",
        "only an unconfined seccomp profile is translated"
    );
    let caps = capabilities(&security["capabilities"]);
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": security["runAsUser"].as_u64().expect("runAsUser"),
                     "gid": security["runAsGroup"].as_u64().expect("runAsGroup")},
            "args": args(container, node),
            "env": env(container, node).iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": !security["allowPrivilegeEscalation"].as_bool().expect("allowPrivilegeEscalation"),
        },
        "root": {"path": "rootfs", "readonly": security["readOnlyRootFilesystem"].as_bool().expect("readOnlyRootFilesystem")},
        "hostname": "memtrace-pod",
        "mounts": mounts(pod, container),
        "linux": {
            "namespaces": namespaces(pod),
            "cgroupsPath": cgroup,
            "resources": resources(&container["resources"]),
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                            "/proc/scsi", "/sys/firmware"],
            "readonlyPaths": ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    })
}

/// Fails on a key of `object` that the translation does not know.
fn known_keys(object: &Value, known: &[&str]) {
    for key in object.as_object().expect("an object").keys() {
        assert!(
            known.contains(&key.as_str()),
            "the manifest says {key:?}, which the test does not translate"
        );
    }
}

/// `drop: [ALL]` then `add`: the capabilities as OCI names them (CAP_BPF ...).
fn capabilities(capabilities: &Value) -> Vec<String> {
    assert_eq!(capabilities["drop"], json!(["ALL"]), "every capability not added is dropped");
    let added = capabilities["add"].as_array().expect("capabilities.add");
    added.iter().map(|name| format!("CAP_{}", name.as_str().expect("a capability name"))).collect()
}

/// The container's environment: its `env`, with the downward API's fields of this node.
pub fn env(container: &Value, node: &str) -> Vec<(String, String)> {
    let mut env = vec![("PATH".to_owned(), "/usr/sbin:/usr/bin:/sbin:/bin".to_owned())];
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().expect("an env name").to_owned();
        let value = match (&var["value"], &var["valueFrom"]["fieldRef"]["fieldPath"]) {
            (Value::String(value), _) => value.clone(),
            (_, Value::String(field)) if field == "spec.nodeName" => node.to_owned(),
            _ => panic!("env {name}: only plain values and spec.nodeName are translated"),
        };
        env.push((name, value));
    }
    env
}

/// `command` + `args`, with `$(VAR)` replaced from the environment as the kubelet does.
fn args(container: &Value, node: &str) -> Vec<String> {
    let env = env(container, node);
    let words = container["command"].as_array().expect("the manifest names the command").iter();
    let words = words.chain(container["args"].as_array().into_iter().flatten());
    let expand = |word: &str| {
        env.iter().fold(word.to_owned(), |word, (name, value)| word.replace(&format!("$({name})"), value))
    };
    words.map(|word| expand(word.as_str().expect("a word"))).collect()
}

/// The namespaces of a pod's container: its own mount, UTS and IPC namespaces, the pod's network
/// namespace unless hostNetwork, and the host's process table with hostPID.
fn namespaces(pod: &Value) -> Value {
    assert_ne!(pod["hostIPC"], json!(true), "hostIPC is not translated");
    let mut namespaces = vec![json!({"type": "mount"}), json!({"type": "uts"}), json!({"type": "ipc"})];
    if pod["hostNetwork"] != json!(true) {
        namespaces.push(json!({"type": "network"}));
    }
    if pod["hostPID"] != json!(true) {
        namespaces.push(json!({"type": "pid"}));
    }
    json!(namespaces)
}

/// What a CRI runtime mounts in every non-privileged container (/sys read-only), and the
/// container's volumeMounts of hostPath volumes.
fn mounts(pod: &Value, container: &Value) -> Value {
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let volume =
            volumes.iter().find(|volume| volume["name"] == mount["name"]).expect("a volume of the pod");
        let host = volume["hostPath"]["path"].as_str().expect("only hostPath volumes are translated");
        let access = if mount["readOnly"] == json!(true) { "ro" } else { "rw" };
        mounts.push(json!({"destination": mount["mountPath"], "type": "bind", "source": host,
                           "options": ["rbind", "rprivate", access]}));
    }
    json!(mounts)
}

/// limits.memory and limits.cpu as the runtime enforces them (the requests only place the pod).
fn resources(resources: &Value) -> Value {
    let limits = &resources["limits"];
    let memory = bytes(limits["memory"].as_str().expect("a memory limit"));
    let period = 100_000u64;
    let quota = millicores(limits["cpu"].as_str().expect("a cpu limit")) * period / 1000;
    json!({"memory": {"limit": memory}, "cpu": {"quota": quota, "period": period}})
}

/// A Kubernetes memory quantity in bytes: 384Mi, 1Gi, 500M, 1000.
pub fn bytes(quantity: &str) -> u64 {
    let split = quantity.find(|c: char| !c.is_ascii_digit()).unwrap_or(quantity.len());
    let (number, unit) = quantity.split_at(split);
    let scale: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "k" => 1000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => panic!("memory quantity {quantity:?}: unit {unit:?} is not translated"),
    };
    number.parse::<u64>().expect("a whole number") * scale
}

/// A Kubernetes CPU quantity in thousandths of a core: 100m, 1, 2.
pub fn millicores(quantity: &str) -> u64 {
    match quantity.strip_suffix('m') {
        Some(milli) => milli.parse().expect("whole millicores"),
        None => quantity.parse::<u64>().expect("whole cores") * 1000,
    }
}

/// The image's root (deploy/rootfs.packages from Debian bookworm, extracted by mmdebstrap as
/// `cargo xtask image` does), built once into target/deploy/ and kept while the list is unchanged.
pub fn image_rootfs() -> PathBuf {
    let list = workspace_root().join("deploy/rootfs.packages");
    let text = fs::read_to_string(&list).unwrap_or_else(|err| panic!("reading {}: {err}", list.display()));
    let packages: Vec<&str> =
        text.lines().map(str::trim).filter(|line| !line.is_empty() && !line.starts_with('#')).collect();
    let rootfs = target_dir().join("deploy").join(format!("rootfs-{}", packages.join("+")));
    if rootfs.join("usr/lib/x86_64-linux-gnu").is_dir() {
        return rootfs;
    }
    let partial = rootfs.with_extension(format!("partial-{}", std::process::id()));
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(partial.parent().unwrap()).expect("creating target/deploy");
    let status = Command::new("mmdebstrap")
        .args(["--variant=extract", "--mode=root", "--quiet"])
        .arg(format!("--include={}", packages.join(",")))
        .arg("bookworm")
        .arg(&partial)
        .status()
        .unwrap_or_else(|err| panic!("running mmdebstrap ({err}): install it with `cargo xtask setup`"));
    assert!(status.success(), "mmdebstrap could not build the image's root ({status})");
    fs::rename(&partial, &rootfs)
        .unwrap_or_else(|err| panic!("moving the root to {}: {err}", rootfs.display()));
    rootfs
}

/// Where deploy/Containerfile copies the memtrace binary (its `COPY memtrace DEST` line).
pub fn binary_in_image() -> PathBuf {
    let path = workspace_root().join("deploy/Containerfile");
    let text = fs::read_to_string(&path).unwrap_or_else(|err| panic!("reading {}: {err}", path.display()));
    let dest = text.lines().find_map(|line| line.strip_prefix("COPY memtrace ")).expect("a COPY of memtrace");
    Path::new(dest.trim()).to_owned()
}
