//! Perl frames named: the kernel stores a stack's Perl frames after its native ones (the sub's CV
//! or the file's name, kind, line: `memtrace_common::FRAME_PERL`) and copies each sub's package,
//! name and file once (PERL_SUBS); the names are taken at every sample and kept here for the
//! process's life. Where they go among the native frames is ../frames.rs's.

use std::collections::{HashMap, HashSet};

use anyhow::Result;
use memtrace_common::{perl_frame, until_nul, PerlSub};

use super::tables::Perl;
use crate::{interpreters::language::Language, kernel::Probes, model::frame::Frame};

/// How memtrace shows Perl: each run of Perl frames ran in one call of its op loop (standard, or
/// under `-d`).
pub const LANGUAGE: Language = Language {
    name: "perl",
    functions: "Perl sub",
    loop_functions: &["Perl_runops_standard", "Perl_runops_debug"],
};

/// A sub's names (a file's, for another kind of frame), as the kernel copied them.
struct Sub {
    /// `package::name`, or empty for a frame that is no sub's.
    name: String,
    file: String,
}

/// The subs of every traced process, by process, code and fingerprint (a CV freed and another
/// made at its address are two).
#[derive(Default)]
pub struct PerlNames {
    subs: HashMap<(u32, u64, u64), Sub>,
}

impl PerlNames {
    /// Takes what the kernel copied since the last sample.
    pub fn drain(&mut self, probes: &Probes) -> Result<()> {
        for (key, sub) in probes.take_codes::<Perl>()? {
            self.subs.insert((key.tgid, key.code, key.fingerprint), Sub::from_kernel(&sub));
        }
        Ok(())
    }

    /// Forgets the subs of processes gone.
    pub fn forget(&mut self, tgids: &HashSet<u32>) {
        self.subs.retain(|(tgid, _, _), _| !tgids.contains(tgid));
    }

    /// A Perl frame of `kind` (`perl_frame`) at `line`, named by its code where the kernel copied it:
    /// `package::sub`, or as `caller` and NYTProf name the rest.
    pub fn frame(&self, tgid: u32, code: u64, fingerprint: u64, kind: u8, line: u64) -> Frame {
        let known = self.subs.get(&(tgid, code, fingerprint));
        let function = match kind {
            perl_frame::MAIN => "main::RUNTIME".to_owned(),
            perl_frame::EVAL => "(eval)".to_owned(),
            perl_frame::REQUIRE => "(require)".to_owned(),
            _ => known.map_or_else(|| format!("[sub {code:#x}]"), |sub| sub.name.clone()),
        };
        Frame {
            function: Some(function),
            file: Some(known.map_or_else(|| "?".to_owned(), |sub| sub.file.clone())),
            line: u32::try_from(line).ok(),
            module: LANGUAGE.name.to_owned(),
            offset: line,
            interpreter: Some(LANGUAGE.name.to_owned()),
        }
    }
}

impl Sub {
    fn from_kernel(sub: &PerlSub) -> Self {
        let text = |bytes: &[u8]| String::from_utf8_lossy(until_nul(bytes)).into_owned();
        let (package, name, file) = (text(&sub.package), text(&sub.name), text(&sub.file));
        let name = match (package.is_empty(), name.is_empty()) {
            (_, true) => "?".to_owned(),
            (true, false) => name,
            (false, false) => format!("{package}::{name}"),
        };
        Self { name, file: if file.is_empty() { "?".to_owned() } else { file } }
    }
}
