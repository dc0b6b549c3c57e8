//! Which processes the kernel traces and what it knows of them: targets and a followed tree, the
//! exec hold's switch and known programs, the exec and OOM announcements, the cgroups allowed, each
//! process's figures, and their release once they are gone.

use std::collections::HashSet;

use anyhow::{bail, Context, Result};
use aya::maps::{MapData, RingBuf};
use memtrace_common::{programs, ImageKey, ProcessStats, MAX_CGROUPS, MAX_PROCESSES};

use super::{map_ops, tables, thread_slots, Probes, EXIT_READER};

impl Probes {
    /// Names a process to trace (`Reach::Targets`, `Reach::Tree`): its execs are announced, and
    /// with a tree, the processes it forks from now on are traced too.
    pub fn add_target(&mut self, pid: u32) -> Result<()> {
        let mut targets = tables::TARGETS.writable(&mut self.ebpf)?;
        targets.insert(pid, 1, 0).with_context(|| format!("more than {MAX_PROCESSES} processes to trace"))
    }

    /// The processes the kernel traces by pid (`Reach::Targets`, `Reach::Tree`): those named, and
    /// with a tree the descendants it added at fork.
    pub fn tree_processes(&self) -> Result<Vec<u32>> {
        Ok(tables::TARGETS.entries(&self.ebpf)?.into_iter().map(|(pid, _)| pid).collect())
    }

    /// The switch of the exec tracepoint's stops, for the exec hold (follow::hold).
    pub fn hold_switch(&self) -> Result<map_ops::ArrayCell> {
        tables::HOLD_EXECS.cell(&self.ebpf, 0)
    }

    /// Lets later execs of a program file go on unstopped: its allocators are probed.
    pub fn know_image(&mut self, image: ImageKey) -> Result<()> {
        let mut known = tables::KNOWN_IMAGES.writable(&mut self.ebpf)?;
        known.insert(image, 1, 0).context("remembering a probed program")
    }

    /// Follows processes as they exec; returns the ring buffer that announces the execs of traced
    /// processes.
    pub fn follow_processes(&mut self) -> Result<RingBuf<MapData>> {
        self.attach_raw_tracepoint(programs::PROCESS_EXEC)?;
        tables::EXEC_EVENTS.take(&mut self.ebpf)
    }

    /// Hears of the OOM killer's victims (oom:mark_victim); returns the ring buffer that announces
    /// them. An error where the kernel has no such tracepoint.
    pub fn watch_oom_kills(&mut self) -> Result<RingBuf<MapData>> {
        self.attach_raw_tracepoint(programs::OOM_VICTIM)?;
        tables::OOM_EVENTS.take(&mut self.ebpf)
    }

    /// The exit levels' reader at do_exit's entry (fentry), for kernels whose sched_process_exit
    /// comes after the task's memory is released; an error where the kernel has no fentry.
    pub(super) fn attach_exit_reader(&mut self) -> Result<()> {
        let programs::ProgramKind::Fentry(function) = programs::EXIT_BEGINS.kind else {
            bail!("BPF program {EXIT_READER} is no fentry program: {:?}", programs::EXIT_BEGINS.kind);
        };
        let btf = aya::Btf::from_sys_fs().context("reading the kernel's BTF")?;
        let program: &mut aya::programs::FEntry = self
            .ebpf
            .program_mut(EXIT_READER)
            .with_context(|| format!("the BPF object has no program {EXIT_READER}"))?
            .try_into()?;
        program.load(function, &btf).context("verifying the exit reader")?;
        program.attach().with_context(|| format!("attaching the exit reader to {function}"))?;
        Ok(())
    }

    /// Whether exit levels are read at do_exit's entry too (see `attach_exit_reader`).
    pub fn reads_exits_early(&self) -> bool {
        self.exit_reader
    }

    /// Attaches raw tracepoint `program` to the tracepoint the table names for it: by name, with
    /// no tracefs needed.
    pub(super) fn attach_raw_tracepoint(&mut self, program: programs::Program) -> Result<()> {
        let programs::ProgramKind::RawTracepoint(event) = program.kind else {
            bail!("BPF program {} is no raw tracepoint: {:?}", program.name, program.kind);
        };
        let tracepoint: &mut aya::programs::RawTracePoint = self
            .ebpf
            .program_mut(program.name)
            .with_context(|| format!("the BPF object has no program {}", program.name))?
            .try_into()?;
        tracepoint.attach(event).with_context(|| format!("attaching to tracepoint {event}"))?;
        Ok(())
    }

    /// Every process the kernel has figures for.
    pub fn traced_processes(&self) -> Result<Vec<(u32, ProcessStats)>> {
        tables::STATS.entries(&self.ebpf)
    }

    /// Forgets exited processes in the kernel, so the tables do not fill up over a long run.
    pub fn release(&mut self, tgids: &HashSet<u32>) -> Result<()> {
        if tgids.is_empty() {
            return Ok(());
        }
        let mut stats = tables::STATS.writable(&mut self.ebpf)?;
        for tgid in tgids {
            let _ = stats.remove(tgid);
        }
        self.live.release(tgids)?;
        tables::STACK_TOTALS.release(&self.ebpf, tgids, |key| key.tgid)?;
        tables::REGIONS.release(&self.ebpf, tgids, |key| key.tgid)?;
        if self.usdt_written() {
            tables::SUBSYSTEMS.release(&self.ebpf, tgids, |key| key.tgid)?;
            tables::USDT_COUNTERS.release(&self.ebpf, tgids, |key| key.tgid)?;
            tables::DUMP_ROUNDS.release(&self.ebpf, tgids, |pid_tgid| (pid_tgid >> 32) as u32)?;
        }
        Ok(())
    }

    /// The kernel's totals for a process; zero before its first allocator call.
    pub fn stats(&self, pid: u32) -> Result<ProcessStats> {
        Ok(tables::STATS.get(&self.ebpf, &pid)?.unwrap_or_default())
    }

    /// Whether the kernel saw the process exit: None when it has no figures of it.
    pub fn saw_exit(&self, pid: u32) -> Result<Option<bool>> {
        Ok(tables::STATS.get(&self.ebpf, &pid)?.map(|stats| stats.exited != 0))
    }

    /// Frees the kernel's slots of threads for which `gone` holds, whose exit the kernel skipped;
    /// how many.
    pub fn free_slots_of_gone_threads(&self, gone: impl Fn(u32) -> bool) -> Result<usize> {
        thread_slots::free_slots_of_gone_threads(&self.ebpf, gone)
    }

    /// Lets the processes of cgroups `--container` and `--cgroup` name be traced (ids as
    /// `bpf_get_current_cgroup_id` gives them; the kernel checks their ancestors too).
    pub fn allow_cgroups(&mut self, ids: impl IntoIterator<Item = u64>) -> Result<()> {
        let mut allowed = tables::ALLOWED_CGROUPS.writable(&mut self.ebpf)?;
        for id in ids {
            allowed.insert(id, 1, 0).with_context(|| format!("more than {MAX_CGROUPS} cgroups to trace"))?;
        }
        Ok(())
    }
}
