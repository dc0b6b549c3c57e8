//! Builds the BPF programs in ../memtrace-ebpf for bpfel-unknown-none and leaves the object in OUT_DIR,
//! where src/kernel/mod.rs embeds it. It finds the BPF toolchain by itself; `cargo xtask setup` installs one.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

const BPF_TARGET: &str = "bpfel-unknown-none";
/// Debian's rustc-web with libstd-rust-web-dev-bpf ships a prebuilt `core` for the BPF target here.
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_BPF_CORE: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";

enum Route {
    /// Debian's rustc with its prebuilt BPF `core`.
    Debian,
    /// rustup's nightly with rust-src, building `core` itself.
    Nightly,
}

fn main() -> Result<()> {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("memtrace-user has no parent directory")?;
    let ebpf_dir = workspace.join("memtrace-ebpf");
    for watched in ["src", "build.rs", "Cargo.toml", "Cargo.lock", ".cargo/config.toml"] {
        println!("cargo:rerun-if-changed={}", ebpf_dir.join(watched).display());
    }
    println!("cargo:rerun-if-changed={}", workspace.join("memtrace-common/src").display());

    // The programs read the saved registers of the architecture memtrace is built for (aya-ebpf's
    // `bpf_target_arch`): an arm64 memtrace embeds programs built for arm64's `pt_regs`.
    let arch = env::var("CARGO_CFG_TARGET_ARCH")?;
    let target_dir = match arch.as_str() {
        "x86_64" => workspace.join("target/bpf"),
        other => workspace.join(format!("target/bpf-{other}")),
    };
    let route = find_route()?;
    let mut cargo = Command::new("cargo");
    strip_outer_cargo_env(&mut cargo);
    cargo.current_dir(&ebpf_dir).env("AYA_BPF_TARGET_ARCH", &arch);
    match route {
        Route::Debian => {
            cargo.env("RUSTC", DEBIAN_RUSTC).env("RUSTC_BOOTSTRAP", "1");
        }
        Route::Nightly => {
            cargo.arg("+nightly");
        }
    }
    cargo.args(["build", "--release", "--target", BPF_TARGET, "--target-dir"]).arg(&target_dir);
    if matches!(route, Route::Nightly) {
        cargo.args(["-Z", "build-std=core"]);
    }
    let status = cargo.status().context("running cargo for the BPF programs")?;
    if !status.success() {
        bail!("building memtrace-ebpf for {BPF_TARGET} failed ({status})");
    }
    let object = target_dir.join(BPF_TARGET).join("release/memtrace-ebpf");
    let out = PathBuf::from(env::var("OUT_DIR")?).join("memtrace.bpf.o");
    std::fs::copy(&object, &out)
        .with_context(|| format!("copying {} to {}", object.display(), out.display()))?;
    check_programs(&object)
}

/// Fails the build where the object's programs and memtrace_common::programs differ: a program
/// one side names and the other does not, or of another kind.
fn check_programs(object: &Path) -> Result<()> {
    use memtrace_common::programs::{mismatch, Mismatch};
    use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};
    let bytes = std::fs::read(object).with_context(|| format!("reading {}", object.display()))?;
    let file = object::File::parse(&*bytes).with_context(|| format!("parsing {}", object.display()))?;
    // A program is a global function outside .text, in the section its kind names.
    let mut programs = Vec::new();
    for symbol in file.symbols().filter(|s| s.kind() == SymbolKind::Text && s.is_global()) {
        let Some(index) = symbol.section_index() else { continue };
        let section = file.section_by_index(index)?.name()?;
        if section != ".text" {
            programs.push((symbol.name()?, section));
        }
    }
    let Some(mismatch) = mismatch(programs.iter().copied()) else { return Ok(()) };
    let table = "memtrace-common/src/programs.rs";
    match mismatch {
        Mismatch::Unlisted { name, section } => {
            bail!("memtrace-ebpf defines BPF program `{name}` (section {section}), which {table} does not list: add it there")
        }
        Mismatch::OtherKind { program, section } => bail!(
            "BPF program `{}` is in section {section} of the object, but {table} says it is {:?}: make the two agree",
            program.name,
            program.kind
        ),
        Mismatch::Missing(program) => bail!(
            "{table} lists BPF program `{}` ({:?}), which memtrace-ebpf does not define: define it or remove it from the table",
            program.name,
            program.kind
        ),
    }
}

fn find_route() -> Result<Route> {
    if !on_path("bpf-linker") {
        bail!("bpf-linker is not installed; run `cargo xtask setup` (it installs the BPF toolchain)");
    }
    if Path::new(DEBIAN_RUSTC).exists() && has_prebuilt_core(Path::new(DEBIAN_BPF_CORE)) {
        return Ok(Route::Debian);
    }
    if nightly_has_rust_src() {
        return Ok(Route::Nightly);
    }
    bail!(
        "no Rust toolchain for {BPF_TARGET}: neither Debian's rustc-web with libstd-rust-web-dev-bpf nor \
         rustup's nightly with rust-src is installed; run `cargo xtask setup`"
    )
}

fn has_prebuilt_core(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|entry| entry.file_name().to_string_lossy().starts_with("libcore-"))
    })
}

fn nightly_has_rust_src() -> bool {
    let Ok(output) = Command::new("rustc").args(["+nightly", "--print", "sysroot"]).output() else {
        return false;
    };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    output.status.success() && Path::new(&sysroot).join("lib/rustlib/src/rust/library/core").exists()
}

fn on_path(program: &str) -> bool {
    env::var_os("PATH")
        .map(|paths| env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
        .unwrap_or(false)
}

/// The outer build's variables (its rustc, flags, target and build-script settings) must not leak
/// into the nested BPF build.
fn strip_outer_cargo_env(cargo: &mut Command) {
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        let outer = key.starts_with("CARGO_")
            && !matches!(
                key.as_ref(),
                "CARGO_HOME" | "CARGO_NET_OFFLINE" | "CARGO_REGISTRIES_CRATES_IO_PROTOCOL"
            );
        if outer
            || matches!(
                key.as_ref(),
                "RUSTC"
                    | "RUSTC_WRAPPER"
                    | "RUSTC_WORKSPACE_WRAPPER"
                    | "RUSTFLAGS"
                    | "RUSTDOC"
                    | "RUSTC_LINKER"
                    | "TARGET"
                    | "HOST"
                    | "OUT_DIR"
                    | "PROFILE"
                    | "OPT_LEVEL"
                    | "DEBUG"
                    | "NUM_JOBS"
                    | "RUSTUP_TOOLCHAIN"
            )
        {
            cargo.env_remove(key.as_ref());
        }
    }
}
