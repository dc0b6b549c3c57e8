//! The matrix's kernels: which Debian kernel packages (this machine's Debian 12 lists, plus apt
//! states of our own for Debian unstable and Debian 11), fetched and unpacked once into
//! /var/cache/memtrace-kernels/matrix, their modules indexed with depmod, and an initramfs for each
//! holding busybox, tests/matrix/init.sh and the modules that mount the host's root.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{run, toolchain, workspace_root};

const CACHE: &str = "/var/cache/memtrace-kernels/matrix";
/// What mounts the host's root in the guest; modprobe --show-depends adds what they need.
const MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// Where a kernel package comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    /// This machine's own apt lists (Debian 12).
    Host,
    Unstable,
    /// Debian 11, whose 5.10 memtrace may refuse.
    Bullseye,
}

pub struct Kernel {
    pub package: String,
    pub suite: Suite,
    /// Older than memtrace's oldest supported kernel: refusing it with a clear message passes.
    pub may_refuse: bool,
}

/// A kernel package unpacked: its vmlinuz and its modules (indexed).
pub struct Unpacked {
    pub vmlinuz: PathBuf,
    root: PathBuf,
    release: String,
}

impl Suite {
    fn state(self) -> Option<PathBuf> {
        match self {
            Suite::Host => None,
            Suite::Unstable => Some(Path::new(CACHE).join("apt-unstable")),
            Suite::Bullseye => Some(Path::new(CACHE).join("apt-bullseye")),
        }
    }

    fn sources(self, mirror: &str) -> String {
        match self {
            Suite::Host => String::new(),
            Suite::Unstable => format!("deb {mirror} sid main\n"),
            Suite::Bullseye => {
                format!("deb {mirror} bullseye main\ndeb {mirror}-security bullseye-security main\n")
            }
        }
    }

    /// `apt-get` or `apt-cache` on this suite's lists (an apt state of our own but for Host).
    fn apt(self, tool: &str) -> Command {
        let mut command = Command::new(tool);
        command.args(["-o", "APT::Sandbox::User=root"]);
        if let Some(state) = self.state() {
            let option = |name: &str, value: &Path| format!("{name}={}", value.display());
            command
                .args(["-o", &option("Dir::Etc::sourcelist", &state.join("sources.list"))])
                .args(["-o", "Dir::Etc::sourceparts=-", "-o", "Debug::NoLocking=1"])
                .args(["-o", "Acquire::Check-Valid-Until=false"])
                .args(["-o", &option("Dir::State::lists", &state.join("lists"))])
                .args(["-o", &option("Dir::Cache::archives", &state.join("archives"))]);
        }
        command
    }

    /// Fetches the suite's package lists: always for an apt state of our own that has none yet,
    /// and when `refresh` (a package was not found, or would not download).
    fn update(self, refresh: bool) -> Result<()> {
        let Some(state) = self.state() else {
            return if refresh { run(self.apt("apt-get").arg("update")) } else { Ok(()) };
        };
        let lists = state.join("lists");
        let has_lists = fs::read_dir(&lists).is_ok_and(|entries| {
            entries.flatten().any(|e| e.file_name().to_string_lossy().contains("Packages"))
        });
        if has_lists && !refresh {
            return Ok(());
        }
        fs::create_dir_all(lists.join("partial"))?;
        fs::create_dir_all(state.join("archives/partial"))?;
        fs::write(state.join("sources.list"), self.sources(&toolchain::debian_mirror()))?;
        eprintln!("xtask: matrix: fetching the {self:?} package lists into {}", state.display());
        run(self.apt("apt-get").arg("update"))
    }

    /// What `apt-cache depends PACKAGE` lists, or None when the suite has no such package.
    fn depends(self, package: &str) -> Option<Vec<String>> {
        let output = self.apt("apt-cache").args(["depends", package]).output().ok()?;
        let text = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() || text.trim().is_empty() {
            return None;
        }
        let depends = text.lines().filter_map(|line| line.trim().strip_prefix("Depends: "));
        Some(depends.map(str::to_owned).collect())
    }
}

/// The kernels to boot: `packages` (each looked up in Debian 12's lists, then unstable's, then
/// Debian 11's; a metapackage stands for the build it depends on), or the default set.
pub fn resolve(packages: &[String]) -> Result<Vec<Kernel>> {
    if !packages.is_empty() {
        return packages.iter().map(|package| locate(package)).collect();
    }
    let defaults = [
        (Suite::Host, "linux-image-amd64"),
        (Suite::Host, "linux-image-6.12-amd64"),
        (Suite::Host, "linux-image-6.12-rt-amd64"),
        (Suite::Unstable, "linux-image-amd64"),
        (Suite::Bullseye, "linux-image-amd64"),
    ];
    defaults.iter().map(|&(suite, meta)| newest_build(suite, meta)).collect()
}

fn locate(package: &str) -> Result<Kernel> {
    for suite in [Suite::Host, Suite::Unstable, Suite::Bullseye] {
        suite.update(false)?;
        if suite.depends(package).is_some() {
            return newest_build(suite, package);
        }
    }
    bail!(
        "no kernel package {package} in Debian 12's, unstable's or Debian 11's lists: name a linux-image-* \
         package (`apt-cache search ^linux-image-` lists Debian 12's)"
    )
}

/// The build a metapackage depends on (or the package itself when it is a build).
fn newest_build(suite: Suite, package: &str) -> Result<Kernel> {
    suite.update(false)?;
    let depends = match suite.depends(package) {
        Some(depends) => depends,
        None => {
            suite.update(true)?;
            suite.depends(package).with_context(|| format!("no package {package} in the {suite:?} lists"))?
        }
    };
    let build = depends.iter().find(|name| is_build(name)).cloned().unwrap_or_else(|| package.to_owned());
    let may_refuse = release_of(&build).is_some_and(|version| version < (6, 1));
    Ok(Kernel { package: build, suite, may_refuse })
}

/// linux-image-6.1.0-57-amd64, linux-image-7.2.13+deb14-amd64: a versioned build, not a metapackage.
fn is_build(name: &str) -> bool {
    name.strip_prefix("linux-image-").is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        && !name.ends_with("-dbg")
        && !name.ends_with("-unsigned")
}

/// (major, minor) of a versioned kernel package's name.
fn release_of(package: &str) -> Option<(u32, u32)> {
    let version = package.strip_prefix("linux-image-")?;
    let mut numbers = version.split(|c: char| !c.is_ascii_digit());
    Some((numbers.next()?.parse().ok()?, numbers.next()?.parse().ok()?))
}

/// Downloads and unpacks the kernel's packages once (Debian unstable splits a kernel into
/// linux-image-*, linux-binary-* with the vmlinuz and linux-modules-*), and indexes its modules.
pub fn fetch(kernel: &Kernel) -> Result<Unpacked> {
    let dir = Path::new(CACHE).join(&kernel.package);
    let root = dir.join("root");
    if !dir.join("unpacked").exists() {
        download_and_unpack(kernel, &dir, &root)?;
        fs::write(dir.join("unpacked"), "")?;
    }
    let (release, modules) = modules_dir(&root)?;
    let vmlinuz = [root.join("boot").join(format!("vmlinuz-{release}")), modules.join("vmlinuz")]
        .into_iter()
        .find(|path| path.is_file())
        .with_context(|| {
            format!("no vmlinuz in {} (remove {} to fetch it again)", root.display(), dir.display())
        })?;
    if !modules.join("modules.dep").exists() {
        // depmod reads <base>/lib/modules; unstable's packages put them in /usr/lib/modules.
        if !root.join("lib").exists() {
            std::os::unix::fs::symlink("usr/lib", root.join("lib"))?;
        }
        run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    }
    Ok(Unpacked { vmlinuz, root, release })
}

fn download_and_unpack(kernel: &Kernel, dir: &Path, root: &Path) -> Result<()> {
    let debs = dir.join("debs");
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(&debs)?;
    let mut packages = vec![kernel.package.clone()];
    let parts = kernel.suite.depends(&kernel.package).unwrap_or_default();
    packages.extend(
        parts.into_iter().filter(|p| p.starts_with("linux-binary-") || p.starts_with("linux-modules-")),
    );
    eprintln!("xtask: matrix: downloading {}", packages.join(" "));
    let download =
        |suite: Suite| suite.apt("apt-get").arg("download").args(&packages).current_dir(&debs).status();
    if !download(kernel.suite)?.success() {
        kernel.suite.update(true)?;
        if !download(kernel.suite)?.success() {
            bail!(
                "apt-get download {} failed: is the mirror {} reachable?",
                packages.join(" "),
                toolchain::debian_mirror()
            );
        }
    }
    for deb in fs::read_dir(&debs)? {
        run(Command::new("dpkg-deb").arg("-x").arg(deb?.path()).arg(root))?;
    }
    Ok(())
}

/// The kernel's release and its modules directory (lib/modules/<release> or usr/lib/modules/...).
fn modules_dir(root: &Path) -> Result<(String, PathBuf)> {
    for base in ["lib/modules", "usr/lib/modules"] {
        let Ok(entries) = fs::read_dir(root.join(base)) else { continue };
        for entry in entries.flatten() {
            if entry.path().join("kernel").is_dir() {
                return Ok((entry.file_name().to_string_lossy().into_owned(), entry.path()));
            }
        }
    }
    bail!("no lib/modules/<release>/kernel in {}: the package holds no modules", root.display())
}

/// The initramfs: busybox, tests/matrix/init.sh as /init, and the modules that mount the host's
/// root (decompressed, in load order, listed in /modules/order).
pub fn initramfs(kernel: &Unpacked, dir: &Path) -> Result<PathBuf> {
    let tree = dir.join("initramfs");
    let _ = fs::remove_dir_all(&tree);
    fs::create_dir_all(tree.join("bin"))?;
    fs::create_dir_all(tree.join("modules"))?;
    fs::copy("/bin/busybox", tree.join("bin/busybox"))
        .context("copying /bin/busybox (package busybox-static)")?;
    std::os::unix::fs::symlink("busybox", tree.join("bin/sh"))?;
    fs::copy(workspace_root().join("tests/matrix/init.sh"), tree.join("init"))?;
    let mut order = String::new();
    for (index, module) in module_files(kernel)?.iter().enumerate() {
        let stem = module.file_name().unwrap_or_default().to_string_lossy();
        let name = format!("{index:02}-{}.ko", stem.split(".ko").next().unwrap_or_default());
        let decompress = match module.extension().and_then(|e| e.to_str()) {
            Some("xz") => "xz",
            Some("zst") => "zstd",
            Some("gz") => "gzip",
            _ => "cat",
        };
        let flags: &[&str] = if decompress == "cat" { &[] } else { &["-dc"] };
        let output = Command::new(decompress).args(flags).arg(module).output()?;
        if !output.status.success() {
            bail!("{decompress} could not read {}", module.display());
        }
        fs::write(tree.join("modules").join(&name), output.stdout)?;
        order += &format!("{name}\n");
    }
    fs::write(tree.join("modules/order"), order)?;
    let initrd = dir.join("initrd.gz");
    let pack = format!("find . | cpio -o -H newc --quiet | gzip -1 > '{}'", initrd.display());
    // Not `run`: that runs in the workspace root.
    let status = Command::new("sh").args(["-c", &pack]).current_dir(&tree).status()?;
    if !status.success() {
        bail!("packing the initramfs ({pack}) failed ({status}): are cpio and gzip installed?");
    }
    Ok(initrd)
}

/// The .ko files MODULES need, dependencies first, each once (built-in ones need none).
fn module_files(kernel: &Unpacked) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = Vec::new();
    for module in MODULES {
        let output = Command::new("modprobe")
            .arg("-d")
            .arg(&kernel.root)
            .args(["-S", &kernel.release, "--show-depends", module])
            .output()
            .context("running modprobe (package kmod)")?;
        if !output.status.success() {
            // Unstable's packages ship no modules.builtin for depmod to index: a module that is
            // not a file is built in (and if it is not, init.sh says which mount failed).
            if has_module_file(&kernel.root, module) {
                bail!(
                    "modprobe could not resolve {module} for kernel {}: {}",
                    kernel.release,
                    String::from_utf8_lossy(&output.stderr).trim()
                );
            }
            continue;
        }
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Some(path) = line.strip_prefix("insmod ").and_then(|rest| rest.split_whitespace().next())
            else {
                continue;
            };
            if !files.iter().any(|known| known == Path::new(path)) {
                files.push(PathBuf::from(path));
            }
        }
    }
    Ok(files)
}

/// Whether the kernel's modules directory holds `module`.ko (compressed or not).
fn has_module_file(root: &Path, module: &str) -> bool {
    let Ok(output) = Command::new("find").arg(root).args(["-name", &format!("{module}.ko*")]).output() else {
        return false;
    };
    !output.stdout.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_package_names() {
        assert!(is_build("linux-image-6.1.0-57-amd64"));
        assert!(is_build("linux-image-7.2.13+deb14-amd64"));
        assert!(!is_build("linux-image-amd64"));
        assert!(!is_build("linux-image-5.10.0-46-amd64-unsigned"));
        assert_eq!(release_of("linux-image-5.10.0-46-amd64"), Some((5, 10)));
        assert_eq!(release_of("linux-image-6.12.117+deb12-rt-amd64"), Some((6, 12)));
    }
}
