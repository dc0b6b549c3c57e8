//! Tests of the feature table (one row per feature, the oldest kernel it implies, the one message a
//! refusal gives, fallbacks, what following a tree and probe sites need), of reading the kernel's
//! preemption model, and of the probes themselves: instructions and map attributes as the kernel
//! reads them, and missing told from found on this kernel.

use super::*;

#[test]
fn every_feature_has_one_row() {
    for info in &FEATURES {
        assert_eq!(FEATURES.iter().filter(|other| other.feature == info.feature).count(), 1, "{info:?}");
        assert_eq!(info.feature.info().name, info.name);
    }
}

#[test]
fn the_oldest_kernel_is_set_by_bpf_loop() {
    let newest_required = FEATURES
        .iter()
        .filter(|info| matches!(info.without, Without::Refuse(_)))
        .map(|info| info.since)
        .max();
    assert_eq!(newest_required, Some(Feature::BpfLoop.info().since));
    assert_eq!(Feature::BpfLoop.info().since, (5, 17));
    assert_eq!(Feature::UprobeMulti.info().since, (6, 6));
}

#[test]
fn a_missing_bpf_loop_is_refused_with_one_message() {
    let features = KernelFeatures::with_missing("5.10.0-32-amd64", &[Feature::BpfLoop]);
    let refusal = features.refusal(Needs::default()).expect("bpf_loop is required");
    assert_eq!(
        refusal,
        "this kernel (5.10.0-32-amd64) lacks bpf_loop, which memtrace's unwinder and live-allocation \
         table need (Linux 5.17 or later); run memtrace on a newer kernel (Debian 12's 6.1 is the \
         oldest tested)"
    );
    let error = features.check(Needs::default()).unwrap_err();
    assert_eq!(error.to_string(), refusal);
}

#[test]
fn the_newest_missing_requirement_is_named_first() {
    let features =
        KernelFeatures::with_missing("5.4.0", &[Feature::RingBuf, Feature::BpfLoop, Feature::Cookies]);
    let refusal = features.refusal(Needs::default()).unwrap();
    assert!(refusal.starts_with("this kernel (5.4.0) lacks bpf_loop,"), "{refusal}");
    assert!(
        refusal.contains("and lacks BPF cookies (bpf_get_attach_cookie), BPF ring buffers too"),
        "{refusal}"
    );
}

#[test]
fn fallbacks_are_not_refusals() {
    let features = KernelFeatures::with_missing(
        "6.1.0",
        &[Feature::UprobeMulti, Feature::OptimizedUprobes, Feature::UretprobeSyscall, Feature::SendSignal],
    );
    assert_eq!(features.refusal(Needs { follows_tree: true }), None);
    assert_eq!(features.link_kind(), LinkKind::PerfEvent);
    assert_eq!(KernelFeatures::with_missing("6.18", &[]).link_kind(), LinkKind::Multi);
}

#[test]
fn btf_is_needed_only_to_follow_trees() {
    let features = KernelFeatures::with_missing("6.1.0", &[Feature::Btf]);
    assert_eq!(features.refusal(Needs { follows_tree: false }), None);
    let refusal = features.refusal(Needs { follows_tree: true }).unwrap();
    assert!(refusal.contains("lacks BTF") && refusal.contains("--no-children"), "{refusal}");
}

#[test]
fn probe_sites_need_one_way_to_attach() {
    let perf_only = KernelFeatures::with_missing("6.1.0", &[Feature::UprobePerfEvents]);
    assert_eq!(perf_only.refusal(Needs::default()), None, "uprobe_multi serves instead");
    let neither = KernelFeatures::with_missing("6.1.0", &[Feature::UprobePerfEvents, Feature::UprobeMulti]);
    let refusal = neither.refusal(Needs::default()).unwrap();
    assert!(refusal.contains("lacks uprobe perf events"), "{refusal}");
}

#[test]
fn preemption_models() {
    let debian = "#1 SMP PREEMPT_DYNAMIC Debian 6.1.140-1 (2025-05-22)";
    assert_eq!(preemption(debian, None, "root=/dev/vda"), Preemption::DynamicUnknown);
    assert_eq!(preemption(debian, None, "preempt=full quiet"), Preemption::Mode("full".into()));
    assert_eq!(preemption(debian, Some("none voluntary (full) lazy\n"), ""), Preemption::Mode("full".into()));
    assert_eq!(preemption("#1 SMP PREEMPT_RT Debian 6.12.43-1", None, ""), Preemption::Realtime);
    assert_eq!(preemption("#1 SMP PREEMPT(lazy) Debian 7.2.13-1", None, ""), Preemption::Mode("lazy".into()));
    assert_eq!(preemption("#1 SMP PREEMPT Tue Jan 1", None, ""), Preemption::Mode("full".into()));
    assert_eq!(preemption("#1 SMP Debian 5.10.237-1", None, ""), Preemption::NotPreemptible);
}

#[test]
fn instructions_are_encoded_as_the_kernel_reads_them() {
    // call 181: opcode 0x85, imm 181 in the upper half.
    assert_eq!(insn(0x85, 0, 0, 0, HELPER_LOOP), 0x0000_00b5_0000_0085);
    assert_eq!(insn(0xb7, 1, 0, 0, -1), 0xffff_ffff_0000_01b7);
    assert_eq!(insn(0x79, 2, 1, -8, 0), 0x0000_0000_fff8_1279);
}

/// Probes that tell missing from found on any kernel (the unit tests run as root).
#[test]
fn probes_tell_missing_from_found() {
    const BPF_FUNC_MAP_LOOKUP_ELEM: i32 = 1;
    assert_eq!(helper(BPF_FUNC_MAP_LOOKUP_ELEM), Presence::Found, "its arguments are wrong, its name known");
    assert!(matches!(helper(100_000), Presence::Missing(how) if how.contains("invalid func")));
    assert_eq!(syscall_exists(libc::SYS_getppid), Presence::Found);
    assert_eq!(syscall_exists(100_000), Presence::Missing("ENOSYS".into()));
    assert_eq!(map_creation(MapAttr::mmapable_array()), Presence::Found);
}

#[test]
fn map_attribute_layout_matches_the_kernel() {
    assert_eq!(std::mem::offset_of!(MapAttr, map_flags), 16);
}
