//! `cargo xtask build --target aarch64-unknown-linux-gnu`: memtrace for arm64, cross-built on an
//! x86-64 Debian machine from Debian's own parts: gcc-aarch64-linux-gnu (the linker, and the C
//! compiler mimalloc is built with) and the standard library Debian builds for arm64 with the same
//! rustc-web the BPF build uses (`libstd-rust-web-dev:arm64` of /usr/bin/rustc's version,
//! downloaded through an apt state of our own under target/cross/ and unpacked there, never
//! installed: the system's apt state and architectures are untouched). rustup's targets are not
//! needed (its servers are not reachable here). memtrace-user's build script builds the BPF
//! programs for arm64's registers.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{cargo, run, toolchain, workspace_root};

/// The one target besides the host's.
pub const AARCH64: &str = "aarch64-unknown-linux-gnu";
/// Debian's rustc, whose standard library Debian builds for arm64 too.
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
/// The package of Debian's rustc-web standard library (rlibs), one per architecture.
const STD_PACKAGE: &str = "libstd-rust-web-dev";

/// Builds memtrace for `target`; its path.
pub fn build(target: &str) -> Result<PathBuf> {
    if target != AARCH64 {
        bail!("cargo xtask build --target knows {AARCH64} (the host's is the default); not {target}");
    }
    toolchain::setup()?;
    toolchain::ensure_packages(&["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", STD_PACKAGE])?;
    let sysroot = arm64_std()?;
    eprintln!("xtask: building memtrace for {AARCH64} (release)");
    run(cargo()
        .args(["build", "--release", "-p", "memtrace-user", "--target", AARCH64])
        .env("RUSTC", DEBIAN_RUSTC)
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc")
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS", format!("--sysroot={}", sysroot.display()))
        .env("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc")
        .env("AR_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-ar"))?;
    Ok(workspace_root().join("target").join(AARCH64).join("release/memtrace"))
}

/// A sysroot holding Debian's arm64 standard library for /usr/bin/rustc's version, unpacked once.
fn arm64_std() -> Result<PathBuf> {
    let version = installed_version(STD_PACKAGE)?;
    let cross = workspace_root().join("target/cross");
    let unpacked = cross.join("aarch64-std");
    let stamp = unpacked.join("version");
    if fs::read_to_string(&stamp).is_ok_and(|had| had == version) {
        return Ok(unpacked.join("usr"));
    }
    let state = AptState::new(cross.join("apt-arm64"))?;
    state.update()?;
    let debs = cross.join("debs");
    fs::create_dir_all(&debs)?;
    state.download(&format!("{STD_PACKAGE}:arm64={version}"), &debs)?;
    let deb = fs::read_dir(&debs)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| {
            path.to_string_lossy().contains(&format!("{STD_PACKAGE}_"))
                && path.to_string_lossy().ends_with("_arm64.deb")
        })
        .with_context(|| format!("apt downloaded no {STD_PACKAGE} for arm64 into {}", debs.display()))?;
    let _ = fs::remove_dir_all(&unpacked);
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
    fs::write(&stamp, &version)?;
    Ok(unpacked.join("usr"))
}

/// The installed version of a Debian package.
fn installed_version(package: &str) -> Result<String> {
    let output = Command::new("dpkg-query").args(["-W", "-f=${Version}", package]).output()?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() || version.is_empty() {
        bail!("{package} is not installed; `cargo xtask setup` installs Debian's rustc-web with it");
    }
    Ok(version)
}

/// An apt state of our own for arm64 packages, from the mirrors this machine's apt sources name.
struct AptState {
    dir: PathBuf,
}

impl AptState {
    fn new(dir: PathBuf) -> Result<Self> {
        fs::create_dir_all(dir.join("lists/partial"))?;
        fs::create_dir_all(dir.join("archives/partial"))?;
        let status = dir.join("status");
        if !status.exists() {
            fs::write(&status, "")?;
        }
        // The security archive beside the mirror, as the matrix's Debian 11 state takes it.
        let debian = toolchain::debian_mirror();
        let sources = format!(
            "deb {debian} bookworm main\ndeb {debian} bookworm-updates main\ndeb {debian}-security bookworm-security main\n"
        );
        fs::write(dir.join("sources.list"), sources)?;
        Ok(Self { dir })
    }

    fn apt_get(&self) -> Command {
        let mut command = Command::new("apt-get");
        let option = |name: &str, value: &Path| format!("{name}={}", value.display());
        command
            .args(["-q", "-o", "APT::Architecture=arm64", "-o", "APT::Architectures=arm64"])
            .args(["-o", &option("Dir::Etc::sourcelist", &self.dir.join("sources.list"))])
            .args(["-o", "Dir::Etc::sourceparts=-", "-o", "Dir::Etc::preferencesparts=-"])
            .args(["-o", &option("Dir::State::lists", &self.dir.join("lists"))])
            .args(["-o", &option("Dir::State::status", &self.dir.join("status"))])
            .args(["-o", &option("Dir::Cache::archives", &self.dir.join("archives"))])
            .args([
                "-o",
                "Dir::Cache::pkgcache=",
                "-o",
                "Dir::Cache::srcpkgcache=",
                "-o",
                "Debug::NoLocking=1",
            ]);
        command
    }

    fn update(&self) -> Result<()> {
        run(self.apt_get().arg("update")).context("fetching Debian 12's arm64 package lists")
    }

    fn download(&self, package: &str, into: &Path) -> Result<()> {
        let mut command = self.apt_get();
        command.arg("download").arg(package);
        let status = command.current_dir(into).status().with_context(|| format!("running {command:?}"))?;
        if !status.success() {
            bail!(
                "apt-get download {package} failed ({status}): is that version in Debian 12's arm64 archive?"
            );
        }
        Ok(())
    }
}
