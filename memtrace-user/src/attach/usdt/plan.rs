//! Planning a probe site's uses: what the handler does there (a subsystem report, a `--usdt`
//! counter), its decoded argument specs, and their place in `USDT_SPECS`, where the site's
//! cookie finds them one after another.

use anyhow::{bail, Context, Result};
use memtrace_common::{usdt_action, UsdtSpec, MAX_USDT_SPECS, MAX_USES_PER_SITE};

use super::{
    args::{self, SiteContext},
    notes::{ElfProbes, ProbeSite},
    request::UsdtRequest,
};
use crate::{
    kernel::Probes,
    process::{FileId, ObjectFile},
};

/// The provider include/memtrace.h emits, its two report probes and the two that frame a round of
/// its registered dumpers.
const MEMTRACE_PROVIDER: &str = "memtrace";
const REPORT_TOTAL: &str = "report_total";
const REPORT_DELTA: &str = "report_delta";
const DUMP_BEGIN: &str = "dump_begin";
const DUMP_END: &str = "dump_end";

/// OpenTelemetry's memory-profiling probes, which an allocator that samples inside itself fires
/// for its samples (`--app-sampled`).
const OTEL_PROVIDER: &str = "otel_memory";
const OTEL_ALLOC: &str = "alloc";
const OTEL_FREE: &str = "free";

/// The probes every run attaches, whatever `--usdt` asks: memtrace's own (subsystem reports, dump
/// rounds) and, with `--app-sampled`, the allocator's sampled ones.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnSites {
    pub app_sampled: bool,
}

impl OwnSites {
    /// What the handler does at a probe every run attaches; None for any other.
    pub(super) fn action(self, provider: &str, name: &str) -> Option<u32> {
        match (provider, name) {
            (MEMTRACE_PROVIDER, REPORT_TOTAL) => Some(usdt_action::REPORT_TOTAL),
            (MEMTRACE_PROVIDER, REPORT_DELTA) => Some(usdt_action::REPORT_DELTA),
            (MEMTRACE_PROVIDER, DUMP_BEGIN) => Some(usdt_action::DUMP_BEGIN),
            (MEMTRACE_PROVIDER, DUMP_END) => Some(usdt_action::DUMP_END),
            (OTEL_PROVIDER, OTEL_ALLOC) if self.app_sampled => Some(usdt_action::SAMPLED_ALLOC),
            (OTEL_PROVIDER, OTEL_FREE) if self.app_sampled => Some(usdt_action::SAMPLED_FREE),
            _ => None,
        }
    }
}

/// Whether a use is the allocator's sampled probe, handled by its own program (`sampled_site`).
pub(super) fn is_sampled(action: u32) -> bool {
    matches!(action, usdt_action::SAMPLED_ALLOC | usdt_action::SAMPLED_FREE)
}

/// What one site is attached for.
pub(super) struct Use {
    pub(super) action: u32,
    counter: u32,
    argument: Option<usize>,
}

/// Writes the uses of one site one after another in `USDT_SPECS` from `next_spec` on (which moves
/// past them), the last marked; returns the index of the first, the site's cookie, or None when
/// the site has no use.
pub(super) fn write_specs(
    probes: &mut Probes,
    next_spec: &mut u32,
    specs: &mut [UsdtSpec],
) -> Result<Option<u64>> {
    let Some(last) = specs.last_mut() else {
        return Ok(None);
    };
    last.last_of_site = 1;
    if specs.len() > MAX_USES_PER_SITE as usize {
        bail!("a USDT probe site is wanted by more than {MAX_USES_PER_SITE} --usdt options; name fewer");
    }
    let first = *next_spec;
    if first as usize + specs.len() > MAX_USDT_SPECS as usize {
        bail!("more than {MAX_USDT_SPECS} uses of USDT probe sites to attach; name fewer with --usdt");
    }
    for (index, spec) in (first..).zip(specs.iter()) {
        probes.set_usdt_spec(index, spec)?;
    }
    *next_spec += specs.len() as u32;
    Ok(Some(u64::from(first)))
}

pub(super) fn uses_of(
    own: OwnSites,
    requests: &[UsdtRequest],
    site: &ProbeSite,
    object: &ObjectFile,
    explicit: &[FileId],
) -> Vec<Use> {
    let mut uses = Vec::new();
    if let Some(action) = own.action(&site.provider, &site.name) {
        uses.push(Use { action, counter: 0, argument: None });
    }
    for (index, request) in requests.iter().enumerate() {
        if request.matches(site) && request.wants_object(object, explicit) {
            uses.push(Use {
                action: if request.argument.is_some() {
                    usdt_action::TRACK_ARGUMENT
                } else {
                    usdt_action::COUNT_HITS
                },
                counter: index as u32,
                argument: request.argument,
            });
        }
    }
    uses
}

/// The spec of one use of a site; None (after a warning) when the site cannot serve it.
pub(super) fn spec_of(
    requests: &[UsdtRequest],
    object: &ObjectFile,
    elf: &ElfProbes,
    site: &ProbeSite,
    site_use: &Use,
) -> Result<Option<UsdtSpec>> {
    let where_ =
        || format!("probe {} in {} at offset {:#x}", site.full_name(), object.path.display(), site.offset);
    let specs = match args::parse_all(&site.arguments) {
        Ok(specs) => specs,
        Err(err) if site_use.action == usdt_action::COUNT_HITS => {
            // Counting hits needs no argument.
            let _ = err;
            Vec::new()
        }
        Err(err) => return Err(err).with_context(where_),
    };
    let symbol_address = |name: &str| elf.symbol_address(name);
    let context = SiteContext { address: site.address, symbol_address: &symbol_address };
    let mut spec = UsdtSpec { action: site_use.action, counter: site_use.counter, ..UsdtSpec::default() };
    match site_use.action {
        usdt_action::REPORT_TOTAL | usdt_action::REPORT_DELTA => {
            if specs.len() != 2 {
                eprintln!(
                    "memtrace: warning: skipping {}: it has {} arguments, not (subsystem, bytes)",
                    where_(),
                    specs.len()
                );
                return Ok(None);
            }
            for (slot, arg) in spec.args.iter_mut().zip(&specs) {
                *slot = arg.to_bpf(&context).with_context(where_)?;
            }
        }
        usdt_action::DUMP_BEGIN | usdt_action::DUMP_END => {
            let [dump_no] = specs.as_slice() else {
                eprintln!(
                    "memtrace: warning: skipping {}: it has {} arguments, not (dump_no)",
                    where_(),
                    specs.len()
                );
                return Ok(None);
            };
            spec.args[0] = dump_no.to_bpf(&context).with_context(where_)?;
        }
        usdt_action::SAMPLED_ALLOC | usdt_action::SAMPLED_FREE => {
            let wanted = if site_use.action == usdt_action::SAMPLED_ALLOC { 3 } else { 1 };
            if specs.len() < wanted {
                eprintln!(
                    "memtrace: warning: skipping {}: it has {} arguments, not {}",
                    where_(),
                    specs.len(),
                    if wanted == 3 { "(ptr, size, weighted_bytes)" } else { "(ptr)" }
                );
                return Ok(None);
            }
            for (slot, arg) in spec.args.iter_mut().zip(&specs) {
                *slot = arg.to_bpf(&context).with_context(where_)?;
            }
        }
        usdt_action::TRACK_ARGUMENT => {
            let index = site_use.argument.unwrap_or(0);
            let Some(arg) = specs.get(index) else {
                bail!(
                    "--usdt {}: {} has {} argument{}, so there is no arg{index} (arguments \
                     count from arg0)",
                    requests[site_use.counter as usize].label,
                    where_(),
                    specs.len(),
                    if specs.len() == 1 { "" } else { "s" }
                );
            };
            spec.args[0] = arg.to_bpf(&context).with_context(where_)?;
        }
        _ => {}
    }
    Ok(Some(spec))
}
