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
    kernel::{tables::USDT_SPECS, Probes},
    process::{FileId, ObjectFile},
};

/// The provider include/memtrace.h emits, its two report probes and the two that frame a round of
/// its registered dumpers.
const MEMTRACE_PROVIDER: &str = "memtrace";
const REPORT_TOTAL: &str = "report_total";
const REPORT_DELTA: &str = "report_delta";
const DUMP_BEGIN: &str = "dump_begin";
const DUMP_END: &str = "dump_end";

/// Whether a probe is one of memtrace's own (subsystem reports, dump rounds), which every run
/// attaches.
pub(super) fn is_memtrace_site(provider: &str, name: &str) -> bool {
    memtrace_action(provider, name).is_some()
}

/// What the handler does at one of memtrace's own probes.
fn memtrace_action(provider: &str, name: &str) -> Option<u32> {
    if provider != MEMTRACE_PROVIDER {
        return None;
    }
    match name {
        REPORT_TOTAL => Some(usdt_action::REPORT_TOTAL),
        REPORT_DELTA => Some(usdt_action::REPORT_DELTA),
        DUMP_BEGIN => Some(usdt_action::DUMP_BEGIN),
        DUMP_END => Some(usdt_action::DUMP_END),
        _ => None,
    }
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
        probes.array_set(&USDT_SPECS, index, spec).context("writing a USDT site's spec")?;
    }
    *next_spec += specs.len() as u32;
    Ok(Some(u64::from(first)))
}

pub(super) fn uses_of(
    requests: &[UsdtRequest],
    site: &ProbeSite,
    object: &ObjectFile,
    explicit: &[FileId],
) -> Vec<Use> {
    let mut uses = Vec::new();
    if let Some(action) = memtrace_action(&site.provider, &site.name) {
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
