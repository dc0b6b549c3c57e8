//! Which value of each subsystem a sample shows. include/memtrace.h's dumper thread calls every
//! registered dumper once a round, between `memtrace:dump_begin(n)` and `memtrace:dump_end(n)`; the
//! kernel keeps each subsystem's value in its last rounds (`SubsystemValue::rounds`) and each
//! thread's last complete round (`DUMP_ROUNDS`). A sample shows a subsystem a dumper reports as of
//! its thread's last round complete when the sample began, so every subsystem of one round lands in
//! one dump together, never half a round. A subsystem whose latest report came outside any round
//! shows that latest value, as before rounds existed.
//!
//! The kernel's maps are read one after another, not at one instant: the rounds complete, then the
//! subsystems, then the rounds again. Round C's values stay in their slots until round
//! C + ROUND_SLOTS begins; a read during which it did ([`Rounds::steady`] is false) is taken again.

use std::collections::HashMap;

use memtrace_common::{DumpRound, SubsystemValue, ROUND_SLOTS};

/// The dump rounds of every thread that runs them, as read around one read of the subsystems.
#[derive(Debug, Default)]
pub(super) struct Rounds {
    /// Each thread's last complete round (by pid_tgid) when the read began.
    complete: HashMap<u64, u64>,
    /// Each thread's latest round begun when the read ended.
    begun_after: HashMap<u64, u64>,
}

impl Rounds {
    /// `before` and `after`: `DUMP_ROUNDS` read before and after the subsystems.
    pub(super) fn new(before: Vec<(u64, DumpRound)>, after: Vec<(u64, DumpRound)>) -> Self {
        Self {
            complete: before.into_iter().map(|(thread, round)| (thread, round.complete)).collect(),
            begun_after: after.into_iter().map(|(thread, round)| (thread, round.begun)).collect(),
        }
    }

    /// Whether every thread's last complete round still had its slots when the read ended: no thread
    /// began round C + ROUND_SLOTS (which writes round C's slot) during the read.
    pub(super) fn steady(&self) -> bool {
        self.begun_after.iter().all(|(thread, &begun)| {
            let complete = self.complete.get(thread).copied().unwrap_or(0);
            begun < complete + ROUND_SLOTS as u64
        })
    }

    /// The value of a subsystem of process `tgid` to show: its value at the end of the latest round
    /// of its dumper thread that reported it and was complete; None while it was reported in no
    /// complete round yet. Its latest value when its latest report came outside any round.
    pub(super) fn value_of(&self, tgid: u32, subsystem: &SubsystemValue) -> Option<i64> {
        if subsystem.latest_round == 0 {
            return Some(subsystem.value);
        }
        let thread = (u64::from(tgid) << 32) | u64::from(subsystem.round_tid);
        let complete = self.complete.get(&thread).copied().unwrap_or(0);
        (0..ROUND_SLOTS)
            .filter(|&slot| subsystem.rounds[slot] != 0 && subsystem.rounds[slot] <= complete)
            .max_by_key(|&slot| subsystem.rounds[slot])
            .map(|slot| subsystem.round_values[slot])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TGID: u32 = 700;
    const TID: u32 = 701;
    const THREAD: u64 = (TGID as u64) << 32 | TID as u64;

    /// A subsystem reported in `rounds` (round, value), in order, as the kernel keeps it.
    fn reported(rounds: &[(u64, i64)]) -> SubsystemValue {
        let mut subsystem = SubsystemValue { round_tid: TID, ..SubsystemValue::default() };
        for &(round, value) in rounds {
            let slot = round as usize % ROUND_SLOTS;
            subsystem.rounds[slot] = round;
            subsystem.round_values[slot] = value;
            subsystem.value = value;
            subsystem.latest_round = round;
        }
        subsystem
    }

    fn rounds(complete: u64, begun_after: u64) -> Rounds {
        Rounds::new(
            vec![(THREAD, DumpRound { begun: complete, complete })],
            vec![(THREAD, DumpRound { begun: begun_after, complete: begun_after - 1 })],
        )
    }

    #[test]
    fn a_sample_shows_the_last_complete_round() {
        // Round 6 is under way: its first report is in, the rest not yet.
        let a = reported(&[(4, 4 * 4096), (5, 5 * 4096), (6, 6 * 4096)]);
        let b = reported(&[(4, 4 * 8192), (5, 5 * 8192)]);
        let read = rounds(5, 6);
        assert!(read.steady());
        assert_eq!(read.value_of(TGID, &a), Some(5 * 4096));
        assert_eq!(read.value_of(TGID, &b), Some(5 * 8192));
    }

    #[test]
    fn a_subsystem_left_out_of_a_round_keeps_its_value_from_before() {
        let c = reported(&[(2, 20), (3, 30)]);
        assert_eq!(rounds(7, 8).value_of(TGID, &c), Some(30));
    }

    #[test]
    fn a_subsystem_of_no_complete_round_is_not_shown() {
        let new = reported(&[(6, 1)]);
        assert_eq!(rounds(5, 6).value_of(TGID, &new), None);
        // A process whose rounds were never seen complete.
        assert_eq!(Rounds::default().value_of(TGID, &new), None);
    }

    #[test]
    fn a_report_outside_rounds_shows_as_it_is() {
        let plain = SubsystemValue { value: -12, ..SubsystemValue::default() };
        assert_eq!(Rounds::default().value_of(TGID, &plain), Some(-12));
        let mut later = reported(&[(3, 30)]);
        (later.value, later.latest_round) = (31, 0);
        assert_eq!(rounds(3, 4).value_of(TGID, &later), Some(31));
    }

    #[test]
    fn a_read_overtaken_by_rounds_is_not_steady() {
        // Round 5 was complete when the read began; round 9 writes its slot.
        assert!(rounds(5, 8).steady());
        assert!(!rounds(5, 9).steady());
        // A thread that began its first round during the read.
        let fresh = Rounds::new(vec![], vec![(THREAD, DumpRound { begun: 4, complete: 3 })]);
        assert!(!fresh.steady());
        let fresh = Rounds::new(vec![], vec![(THREAD, DumpRound { begun: 2, complete: 1 })]);
        assert!(fresh.steady());
    }

    #[test]
    fn rounds_are_per_thread() {
        // Another thread of the process completed round 9; this subsystem's thread only round 2.
        let other = (u64::from(TGID) << 32) | 999;
        let read = Rounds::new(
            vec![(THREAD, DumpRound { begun: 3, complete: 2 }), (other, DumpRound { begun: 9, complete: 9 })],
            vec![],
        );
        let a = reported(&[(2, 200), (3, 300)]);
        assert_eq!(read.value_of(TGID, &a), Some(200));
    }
}
