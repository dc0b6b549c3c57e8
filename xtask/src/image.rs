//! `cargo xtask image`: memtrace's container image (deploy/Containerfile) without a registry, for
//! x86-64 and arm64 in one manifest list.
//!
//! Each architecture's root is Debian bookworm's packages of deploy/rootfs.packages (what the
//! binary links against) for that architecture, extracted by mmdebstrap into a tarball (extracted
//! only: nothing of the other architecture runs, so no emulation is needed); its build context is
//! that tarball and the architecture's release binary, in target/deploy/image-ARCH/. buildah
//! (Debian's) builds the Containerfile's `FROM scratch` image once per architecture into the
//! manifest list localhost/memtrace:latest and writes the list and both images as one OCI archive,
//! which a node's runtime imports, taking its own architecture's image
//! (`ctr -n k8s.io images import`). [`check`] reads the archive back.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::{run, toolchain, workspace_root};

/// The image's name in the manifests (deploy/kubernetes/daemonset.yaml).
const IMAGE: &str = "localhost/memtrace:latest";

/// An architecture of the image: Debian's and OCI's name for it (they agree), and the ELF machine
/// of its binaries (`e_machine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Architecture {
    pub name: &'static str,
    elf_machine: u16,
}

/// The image's architectures.
pub const ARCHITECTURES: [Architecture; 2] =
    [Architecture { name: "amd64", elf_machine: 62 }, Architecture { name: "arm64", elf_machine: 183 }];

/// The image's OCI archive.
pub fn archive() -> PathBuf {
    workspace_root().join("target/deploy/memtrace-image.tar")
}

/// Builds the image for each architecture from its binary (`binaries`, in `ARCHITECTURES`'
/// order) into one manifest list, and writes its OCI archive.
pub fn build(binaries: [&Path; 2]) -> Result<()> {
    toolchain::ensure_packages(&["mmdebstrap", "buildah"])?;
    let root = workspace_root();
    // A list left by an earlier build would gain a second image of each architecture.
    let _ = Command::new("buildah").args(["manifest", "rm", IMAGE]).output();
    for (architecture, binary) in ARCHITECTURES.iter().zip(binaries) {
        let context = context(&root, architecture, binary)?;
        run(Command::new("buildah")
            .args(["bud", "--layers=false", "--os", "linux"])
            .args(["--arch", architecture.name, "--manifest", IMAGE])
            .arg("-f")
            .arg(root.join("deploy/Containerfile"))
            .arg(&context))?;
    }
    let archive = archive();
    let _ = fs::remove_file(&archive);
    run(Command::new("buildah")
        .args(["manifest", "push", "--all", IMAGE])
        .arg(format!("oci-archive:{}:{IMAGE}", archive.display())))?;
    eprintln!("xtask: image {IMAGE} built for amd64 and arm64; OCI archive {}", archive.display());
    Ok(())
}

/// The build context of one architecture: its root's tarball and its binary.
fn context(root: &Path, architecture: &Architecture, binary: &Path) -> Result<PathBuf> {
    let machine = elf_machine(&fs::read(binary).with_context(|| format!("reading {}", binary.display()))?);
    if machine != Some(architecture.elf_machine) {
        bail!("{} is not a {} binary (ELF machine {machine:?})", binary.display(), architecture.name);
    }
    let context = root.join(format!("target/deploy/image-{}", architecture.name));
    fs::create_dir_all(&context).with_context(|| format!("creating {}", context.display()))?;
    let packages = packages(root)?.join(",");
    eprintln!("xtask: the {} image's root from Debian bookworm: {packages}", architecture.name);
    run(Command::new("mmdebstrap")
        .args(["--variant=extract", "--mode=root", "--format=tar"])
        .arg(format!("--architectures={}", architecture.name))
        .arg(format!("--include={packages}"))
        .arg("bookworm")
        .arg(context.join("rootfs.tar"))
        .env("SOURCE_DATE_EPOCH", "0"))?;
    fs::copy(binary, context.join("memtrace")).context("copying the memtrace binary into the context")?;
    Ok(context)
}

/// The ELF machine of a 64-bit little-endian ELF file's bytes.
fn elf_machine(bytes: &[u8]) -> Option<u16> {
    (bytes.get(..4)? == b"\x7fELF").then_some(())?;
    Some(u16::from_le_bytes(bytes.get(18..20)?.try_into().ok()?))
}

/// Reads the OCI archive back: its index must name one image of each architecture, whose
/// config says that architecture and whose /usr/bin/memtrace is a binary of it, and whose
/// entrypoint is memtrace's. Returns each architecture with its binary's size.
pub fn check(archive: &Path) -> Result<Vec<(String, u64)>> {
    let unpacked = workspace_root().join("target/deploy/image-check");
    let _ = fs::remove_dir_all(&unpacked);
    fs::create_dir_all(&unpacked)?;
    run(Command::new("tar").arg("-xf").arg(archive).arg("-C").arg(&unpacked))?;
    let layout = Layout { dir: unpacked };
    let mut found = Vec::new();
    for (platform, manifest) in layout.images(&layout.json("index.json")?)? {
        found.push(layout.check_image(&platform, &manifest)?);
    }
    let mut names: Vec<&str> = found.iter().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    if names != ARCHITECTURES.map(|architecture| architecture.name) {
        bail!("{}: images for {names:?}, not one for each of amd64 and arm64", archive.display());
    }
    Ok(found)
}

/// An unpacked OCI image layout.
struct Layout {
    dir: PathBuf,
}

impl Layout {
    fn json(&self, path: &str) -> Result<Value> {
        let path = self.dir.join(path);
        let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// A blob by its descriptor's digest.
    fn blob(&self, descriptor: &Value) -> Result<String> {
        let digest = descriptor["digest"].as_str().context("a descriptor without a digest")?;
        let (algorithm, hex) = digest.split_once(':').context("a digest without its algorithm")?;
        Ok(format!("blobs/{algorithm}/{hex}"))
    }

    /// Each image an index names, through nested indexes (a manifest list): its architecture (from
    /// the descriptor's platform) and its manifest.
    fn images(&self, index: &Value) -> Result<Vec<(String, Value)>> {
        let mut images = Vec::new();
        for descriptor in index["manifests"].as_array().context("an index without manifests")? {
            let blob = self.json(&self.blob(descriptor)?)?;
            if blob["manifests"].is_array() {
                images.extend(self.images(&blob)?);
            } else {
                let architecture = descriptor["platform"]["architecture"].as_str().unwrap_or("none");
                images.push((architecture.to_owned(), blob));
            }
        }
        Ok(images)
    }

    /// One image: its config's architecture and entrypoint, and its binary's ELF machine.
    fn check_image(&self, platform: &str, manifest: &Value) -> Result<(String, u64)> {
        let config = self.json(&self.blob(&manifest["config"])?)?;
        let architecture = config["architecture"].as_str().unwrap_or("none");
        let expected = ARCHITECTURES
            .iter()
            .find(|known| known.name == platform && known.name == architecture)
            .with_context(|| format!("an image for {platform} whose config says {architecture}"))?;
        if config["config"]["Entrypoint"] != serde_json::json!(["/usr/bin/memtrace"]) {
            bail!("the {platform} image's entrypoint is {}", config["config"]["Entrypoint"]);
        }
        let binary = self
            .binary(manifest)?
            .with_context(|| format!("the {platform} image has no /usr/bin/memtrace"))?;
        if elf_machine(&binary) != Some(expected.elf_machine) {
            bail!("the {platform} image's /usr/bin/memtrace is no {platform} binary");
        }
        Ok((platform.to_owned(), binary.len() as u64))
    }

    /// /usr/bin/memtrace as the image's last layer that holds it has it.
    fn binary(&self, manifest: &Value) -> Result<Option<Vec<u8>>> {
        let mut found = None;
        for layer in manifest["layers"].as_array().context("a manifest without layers")? {
            let blob = self.dir.join(self.blob(layer)?);
            // GNU tar reads gzip and zstd layers alike (it tells them by their first bytes).
            let output = Command::new("tar")
                .arg("-xOf")
                .arg(&blob)
                .arg("usr/bin/memtrace")
                .output()
                .context("running tar")?;
            if output.status.success() && !output.stdout.is_empty() {
                found = Some(output.stdout);
            }
        }
        Ok(found)
    }
}

/// The packages deploy/rootfs.packages lists (comments and blank lines left out).
pub fn packages(root: &Path) -> Result<Vec<String>> {
    let path = root.join("deploy/rootfs.packages");
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(str::to_owned)
        .collect())
}
