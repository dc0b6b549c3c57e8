//! `memtrace usdt (--pid PID | PATH)`: the probes a process or a file has, with their argument specs,
//! one site per line:
//!
//!     /usr/bin/app memtrace:report_total offset=0x1139 semaphore=0x3010 args: arg0=8@%rdi arg1=-8@%rsi

use std::{fmt::Write as _, path::Path};

use anyhow::{bail, Context, Result};

use super::notes::{self, ProbeSite};
use crate::process::{FileCache, ObjectFile, ProcessImage, SparseImage, NOTES, SYMBOLS};

/// Prints the probes of process `pid` (every object it maps) or of the file at `path`.
pub fn run(pid: Option<u32>, path: Option<&Path>) -> Result<()> {
    let text = match (pid, path) {
        (Some(pid), _) => list_process(pid)?,
        (None, Some(path)) => list_file(path)?,
        (None, None) => bail!("give --pid PID or a PATH"),
    };
    print!("{text}");
    Ok(())
}

fn list_process(pid: u32) -> Result<String> {
    let mut text = String::new();
    let mut sites = 0;
    for object in ProcessImage::of_process(pid, &FileCache::default())?.objects {
        let Ok(image) = read_object(&object) else {
            continue;
        };
        let Ok(elf) = notes::parse_elf(image.data()) else {
            continue;
        };
        for site in &elf.sites {
            sites += 1;
            line(&mut text, &object.path, site);
        }
    }
    if sites == 0 {
        eprintln!("memtrace: pid {pid} maps no object with USDT probes (no .note.stapsdt section)");
    }
    Ok(text)
}

/// What the note parser reads of an object file (its headers, notes and symbol tables), never
/// the whole file.
fn read_object(object: &ObjectFile) -> Result<SparseImage<'_>> {
    SparseImage::of(object, &[NOTES, SYMBOLS].concat())
        .with_context(|| format!("reading {}", object.path.display()))
}

fn list_file(path: &Path) -> Result<String> {
    let object = ObjectFile::open_host(path)?;
    let image = read_object(&object)?;
    let elf = notes::parse_elf(image.data()).with_context(|| format!("reading {}", path.display()))?;
    if elf.sites.is_empty() {
        eprintln!("memtrace: {} has no USDT probes (no .note.stapsdt section)", path.display());
    }
    let mut text = String::new();
    for site in &elf.sites {
        line(&mut text, path, site);
    }
    Ok(text)
}

fn line(text: &mut String, path: &Path, site: &ProbeSite) {
    let semaphore = site.semaphore_offset.map_or_else(|| "none".to_owned(), |offset| format!("{offset:#x}"));
    let _ = write!(
        text,
        "{} {} offset={:#x} semaphore={semaphore} args:",
        path.display(),
        site.full_name(),
        site.offset
    );
    for (index, spec) in site.arguments.split_ascii_whitespace().enumerate() {
        let _ = write!(text, " arg{index}={spec}");
    }
    text.push('\n');
}
