//! `cargo xtask image`: memtrace's container image (deploy/Containerfile) without a registry.
//!
//! The image's root is Debian bookworm's packages of deploy/rootfs.packages (what the binary links
//! against), extracted by mmdebstrap into a tarball; the build context is that tarball and the
//! release binary, in target/deploy/image/. buildah (Debian's) then builds the Containerfile's
//! `FROM scratch` image and writes it as an OCI archive that a node's runtime imports
//! (`ctr -n k8s.io images import`, `podman load`).

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{run, toolchain, workspace_root};

/// The image's name in the manifests (deploy/kubernetes/daemonset.yaml).
const IMAGE: &str = "localhost/memtrace:latest";

/// Builds the context and, with buildah, the image and its OCI archive.
pub fn build(memtrace: &Path) -> Result<()> {
    toolchain::ensure_packages(&["mmdebstrap", "buildah"])?;
    let root = workspace_root();
    let context = root.join("target/deploy/image");
    fs::create_dir_all(&context).with_context(|| format!("creating {}", context.display()))?;
    let rootfs = context.join("rootfs.tar");
    eprintln!("xtask: the image's root from Debian bookworm: {}", packages(&root)?.join(" "));
    run(Command::new("mmdebstrap")
        .args(["--variant=extract", "--mode=root", "--format=tar"])
        .arg(format!("--include={}", packages(&root)?.join(",")))
        .args(["bookworm"])
        .arg(&rootfs)
        .env("SOURCE_DATE_EPOCH", "0"))?;
    fs::copy(memtrace, context.join("memtrace")).context("copying the memtrace binary into the context")?;
    let archive = root.join("target/deploy/memtrace-image.tar");
    run(Command::new("buildah")
        .args(["bud", "--layers=false", "-f"])
        .arg(root.join("deploy/Containerfile"))
        .args(["-t", IMAGE])
        .arg(&context))?;
    let _ = fs::remove_file(&archive);
    run(Command::new("buildah")
        .args(["push", IMAGE])
        .arg(format!("oci-archive:{}:{IMAGE}", archive.display())))?;
    eprintln!("xtask: image {IMAGE} built; OCI archive {} (import it on each node)", archive.display());
    Ok(())
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
