//! A long run sees many more processes than anyone reads reports of: beyond the most recent
//! `--keep-exited N` exited processes, each is folded into its command's totals (`folded` in the
//! model and the summary), so memtrace's memory stays bounded however many processes come and go.
//! The model holds the totals (`FoldedProcesses`); this room works out when a process folds and
//! what it adds, on the model, which names nothing of it.

use super::{FoldedProcesses, Model, Process};

impl FoldedProcesses {
    fn add(&mut self, process: &Process) {
        let stats = &process.stats;
        self.processes += 1;
        self.allocations += stats.allocations;
        self.frees += stats.frees;
        self.allocated_bytes += stats.allocated_bytes;
        self.freed_bytes += stats.freed_bytes;
        self.live_bytes_at_exit += stats.live_bytes;
        self.peak_live_bytes = self.peak_live_bytes.max(stats.peak_live_bytes);
        self.temporary_allocations += stats.temporary_allocations;
        self.untracked_frees += stats.untracked_frees;
        self.failed_allocations += stats.failed_allocations;
        self.lost_events += stats.lost_events;
    }
}

impl Model {
    /// Notes that `pid`'s process was released (its figures are final), in the order they were.
    pub fn note_released(&mut self, pid: u32) {
        self.released_order.push_back(pid);
    }

    /// Folds the exited processes released longest ago into their command's totals until at most
    /// `keep` remain with reports of their own.
    pub fn fold_exited(&mut self, keep: usize) {
        while self.released_order.len() > keep {
            let Some(pid) = self.released_order.pop_front() else { break };
            // The oldest exited process of that pid: retired (its pid was taken again) before any
            // still in the table.
            let process = match self.retired.iter().position(|p| p.identity.pid == pid) {
                Some(index) => Some(self.retired.remove(index)),
                None => match self.processes.get(&pid) {
                    Some(process) if process.released => self.processes.remove(&pid),
                    _ => None,
                },
            };
            if let Some(process) = process {
                // A command in each container folds apart: what a pod's processes did stays its own.
                let folded = self.folded.entry(process.identity.display_name()).or_default();
                folded.comm.clone_from(&process.identity.comm);
                folded.container = process.identity.container_name();
                folded.add(&process);
            }
        }
    }

    /// The folded totals, most processes first.
    pub fn folded_by_count(&self) -> Vec<&FoldedProcesses> {
        let mut folded: Vec<&FoldedProcesses> = self.folded.values().collect();
        folded.sort_by(|a, b| b.processes.cmp(&a.processes).then_with(|| a.comm.cmp(&b.comm)));
        folded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(model: &mut Model, pid: u32, comm: &str, allocations: u64) {
        model.add_process(crate::model::identity::ProcessIdentity::new(pid, comm.into()), "/libc".into());
        let process = model.processes.get_mut(&pid).unwrap();
        process.stats.allocations = allocations;
        process.stats.lost_events = 1;
        process.exited = true;
        process.released = true;
        model.note_released(pid);
    }

    #[test]
    fn the_oldest_exited_processes_fold_into_their_command() {
        let mut model = Model::default();
        exited(&mut model, 10, "cc1", 5);
        exited(&mut model, 11, "cc1", 7);
        // Pid 10 is taken again: the first cc1 is retired, and the new one exits too.
        model.retire(10);
        exited(&mut model, 10, "as", 3);
        exited(&mut model, 12, "ld", 1);
        assert_eq!(model.lost_events(), 4);
        model.fold_exited(2);
        let folded = model.folded_by_count();
        assert_eq!(folded.len(), 1);
        assert_eq!((folded[0].comm.as_str(), folded[0].processes, folded[0].allocations), ("cc1", 2, 12));
        // Kept: the two released last, with reports of their own.
        let kept: Vec<&str> = model.every_process().map(|p| p.identity.comm.as_str()).collect();
        assert_eq!(kept, ["as", "ld"]);
        assert_eq!(model.lost_events(), 4, "folded losses still count");
        // A running process is never folded.
        model.add_process(crate::model::identity::ProcessIdentity::new(13, "make".into()), "/libc".into());
        model.fold_exited(0);
        assert_eq!(model.every_process().map(|p| p.identity.pid).collect::<Vec<_>>(), [13]);
        assert_eq!(model.folded_by_count()[0].processes, 2);
    }
}
