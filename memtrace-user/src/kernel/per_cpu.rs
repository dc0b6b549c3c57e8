//! Where the kernel keeps each CPU's data: the address of its `__per_cpu_offset` array (from
//! /proc/kallsyms, readable as root or with CAP_SYSLOG) and how many CPUs it may have. The exit
//! probe sums an exiting process's per-CPU RSS deltas with them, as `percpu_counter_sum` does.

use std::{
    fs,
    io::{BufRead, BufReader},
};

use memtrace_common::KernelLayout;

const KALLSYMS: &str = "/proc/kallsyms";
const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";

/// `layout` with the per-CPU facts filled in where both can be read; as it was otherwise (the
/// exit levels then leave the CPUs' pending deltas out, as /proc/PID/status does before 6.16).
/// Nothing is read where the kernel's RSS counters are not per-CPU (before 6.2): kallsyms is some
/// 10 MB of text, ~25 ms of a run's start-up to read whole.
pub fn with_per_cpu_sums(layout: KernelLayout) -> KernelLayout {
    if layout.percpu_counter_counters == 0 {
        return layout;
    }
    let offsets = fs::File::open(KALLSYMS).ok().and_then(|file| per_cpu_offset(BufReader::new(file)));
    let cpus = fs::read_to_string(POSSIBLE_CPUS).ok().and_then(|text| cpu_count(&text));
    match (offsets, cpus) {
        (Some(per_cpu_offset), Some(possible_cpus)) => {
            KernelLayout { per_cpu_offset, possible_cpus, ..layout }
        }
        _ => layout,
    }
}

/// The address of `__per_cpu_offset` in kallsyms' text, read up to its line; None where it is
/// missing or hidden (an unprivileged reader sees every address as 0).
fn per_cpu_offset(kallsyms: impl BufRead) -> Option<u64> {
    kallsyms
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            let (address, _kind, name) = (fields.next()?, fields.next()?, fields.next()?);
            (name == "__per_cpu_offset").then(|| u64::from_str_radix(address, 16).ok()).flatten()
        })
        .filter(|&address| address != 0)
}

/// One past the highest CPU of a cpu list such as `0-3` or `0,2-5`.
fn cpu_count(list: &str) -> Option<u32> {
    let last = list.trim().split([',', '-']).filter_map(|cpu| cpu.parse::<u32>().ok()).max()?;
    Some(last + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offsets_array_is_found_by_name_and_a_hidden_address_is_none() {
        let text = "ffffffff82a1b2c0 D __per_cpu_offset\nffffffff81000000 T _stext\n";
        assert_eq!(per_cpu_offset(text.as_bytes()), Some(0xffff_ffff_82a1_b2c0));
        assert_eq!(per_cpu_offset("0000000000000000 D __per_cpu_offset\n".as_bytes()), None);
        assert_eq!(per_cpu_offset("ffffffff81000000 T _stext\n".as_bytes()), None);
    }

    #[test]
    fn the_cpu_count_is_one_past_the_highest_possible_cpu() {
        assert_eq!(cpu_count("0-3\n"), Some(4));
        assert_eq!(cpu_count("0\n"), Some(1));
        assert_eq!(cpu_count("0,2-5\n"), Some(6));
        assert_eq!(cpu_count(""), None);
    }

    #[test]
    fn this_machines_kallsyms_gives_the_offsets_array_where_it_lists_it() {
        // A kernel whose counters are not per-CPU (6.1) needs nothing, and nothing is read.
        assert_eq!(with_per_cpu_sums(KernelLayout::default()), KernelLayout::default());
        let layout =
            with_per_cpu_sums(KernelLayout { percpu_counter_counters: 16, ..KernelLayout::default() });
        let listed = fs::read_to_string(KALLSYMS).unwrap().contains(" __per_cpu_offset\n");
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if listed && root {
            assert_ne!(layout.per_cpu_offset, 0, "{layout:?}");
            assert!(layout.possible_cpus >= 1, "{layout:?}");
        }
    }
}
