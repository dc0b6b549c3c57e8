//! How the allocations a run recorded stand for all of them, where it did not record every one:
//! `--sample`'s Poisson weights by size, or `--window`'s weight per process: its user CPU time
//! over its user CPU time inside windows (the run's time over the windows' where that is too
//! little to measure).

/// The heap's figures as the summary names them, in groups by what makes them, so that each mode's
/// list of estimated figures is put together from them rather than written out again.
pub mod figures {
    /// What allocations make: counted at every call, whatever is recorded of it.
    pub const ALLOCATION: [&str; 2] = ["allocations", "allocated_bytes"];
    /// What the recorded blocks make: their frees, what stays live, its peak.
    pub const FREE_AND_LIVE: [&str; 5] =
        ["frees", "freed_bytes", "live_allocations", "live_bytes", "peak_live_bytes"];
    /// The byte figures of both groups.
    pub const BYTES: [&str; 4] = ["allocated_bytes", "freed_bytes", "live_bytes", "peak_live_bytes"];
    /// The count figures of both groups.
    pub const COUNTS: [&str; 3] = ["allocations", "frees", "live_allocations"];
    /// What is made of the recorded blocks by stack: estimated wherever they are.
    pub const BY_STACK: [&str; 4] = ["leaks", "functions", "pprof", "flamegraph"];

    /// `a` then `b`, as one list (`N` = A + B, checked when the constant is built).
    pub const fn joined<const A: usize, const B: usize, const N: usize>(
        a: [&'static str; A],
        b: [&'static str; B],
    ) -> [&'static str; N] {
        assert!(A + B == N, "the joined list's length is the sum of its parts");
        let mut out = [""; N];
        let mut i = 0;
        while i < A {
            out[i] = a[i];
            i += 1;
        }
        while i < N {
            out[i] = b[i - A];
            i += 1;
        }
        out
    }
}

/// `--sample BYTES`: allocations are sampled by a Poisson process on allocated bytes with this
/// mean, so an allocation of S bytes is recorded with probability 1 - exp(-S/R). Each recorded
/// allocation stands for 1 / (1 - exp(-S/R)) allocations and S / (1 - exp(-S/R)) bytes (as pprof
/// scales heap samples): estimates without bias.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampling {
    pub mean_bytes: u64,
    /// The figures that are estimates; every other figure stays exact.
    #[serde(skip_deserializing, default = "Sampling::estimated")]
    pub estimated: &'static [&'static str],
}

impl Sampling {
    /// The estimated figures; allocations, allocated bytes and failed allocations stay exact,
    /// since every allocation is counted, sampled or not.
    pub const ESTIMATED: &'static [&'static str] =
        &figures::joined::<5, 4, 9>(figures::FREE_AND_LIVE, figures::BY_STACK);

    pub fn new(mean_bytes: u64) -> Self {
        Self { mean_bytes, estimated: Self::ESTIMATED }
    }

    fn estimated() -> &'static [&'static str] {
        Self::ESTIMATED
    }

    /// How many allocations of `size` bytes one sample of that size stands for.
    pub fn count_weight(&self, size: u64) -> f64 {
        let probability = -(-(size.max(1) as f64) / self.mean_bytes as f64).exp_m1();
        1.0 / probability
    }

    /// (allocations, bytes) that `count` samples totalling `bytes` stand for, scaled by their
    /// average size as pprof scales heap profiles.
    pub fn scale(&self, count: u64, bytes: u64) -> (f64, f64) {
        if count == 0 {
            return (0.0, 0.0);
        }
        let weight = self.count_weight(bytes / count);
        (count as f64 * weight, bytes as f64 * weight)
    }
}

/// `--window ON/EVERY`: allocations were probed for ON of every EVERY (free and realloc always),
/// so every block a window recorded is followed until it is freed, and the figures of the time
/// between windows are the windows' scaled by each process's weight (`weight_of`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Windows {
    pub on_s: f64,
    pub every_s: f64,
    /// How long the allocation probes were attached, all windows together, and the run so far.
    pub probed_s: f64,
    pub elapsed_s: f64,
    /// Windows closed so far.
    #[serde(default)]
    pub closed: u64,
    /// Elapsed over probed time: what one recorded allocation stands for in a process whose user
    /// CPU time inside windows is too little to measure (`UserCpu::MEASURABLE_INSIDE_S`).
    pub weight: f64,
    /// The figures that are estimates; every other figure stays exact.
    #[serde(skip_deserializing, default = "Windows::estimated")]
    pub estimated: &'static [&'static str],
}

impl Windows {
    /// Everything the heap figures are made of: out of a window no allocation is seen.
    pub const ESTIMATED: &'static [&'static str] = &figures::joined::<7, 4, 11>(
        figures::joined::<2, 5, 7>(figures::ALLOCATION, figures::FREE_AND_LIVE),
        figures::BY_STACK,
    );

    pub fn new(on_s: f64, every_s: f64) -> Self {
        Self {
            on_s,
            every_s,
            probed_s: 0.0,
            elapsed_s: 0.0,
            closed: 0,
            weight: 1.0,
            estimated: Self::ESTIMATED,
        }
    }

    fn estimated() -> &'static [&'static str] {
        Self::ESTIMATED
    }

    /// The run so far: `probed_s` of `elapsed_s` inside windows, `closed` windows closed.
    pub fn measured(self, probed_s: f64, elapsed_s: f64, closed: u64) -> Self {
        Self { probed_s, elapsed_s, closed, weight: ratio_past_one(elapsed_s, probed_s), ..self }
    }

    /// What one allocation recorded in a process stands for. The probes slow a program inside a
    /// window (their traps are system time), so the share of its wall time a window covers is
    /// less than the share of its work: its user CPU time measures the work, where there is
    /// enough of it inside windows to count in clock ticks.
    pub fn weight_of(&self, cpu: Option<UserCpu>) -> f64 {
        match cpu {
            Some(cpu) if cpu.inside_s >= UserCpu::MEASURABLE_INSIDE_S => {
                ratio_past_one(cpu.total_s, cpu.inside_s)
            }
            _ => self.weight,
        }
    }
}

/// `whole / part`, at least 1 (a part never stands for less than itself); 1 when `part` is none.
fn ratio_past_one(whole: f64, part: f64) -> f64 {
    if part > 0.0 {
        (whole / part).max(1.0)
    } else {
        1.0
    }
}

/// `--window`: a process's user CPU time (all its threads) since memtrace first saw it, and the
/// part of it spent inside windows, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UserCpu {
    pub inside_s: f64,
    pub total_s: f64,
}

impl UserCpu {
    /// /proc counts CPU time in clock ticks (10 ms), and a reading at a window's open or close is
    /// off by up to one: those errors average out over many windows, but below this much user
    /// time inside windows (10 ticks) the wall-time weight stands in.
    pub const MEASURABLE_INSIDE_S: f64 = 0.1;
}

/// How every process's recorded allocations stand for all of them, as of the latest sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimators {
    pub sampling: Option<Sampling>,
    pub windows: Option<Windows>,
}

impl Estimators {
    /// The estimator of a process whose user CPU time is `cpu`; None where every allocation is
    /// recorded.
    pub fn of(&self, cpu: Option<UserCpu>) -> Option<Estimator> {
        match (self.sampling, self.windows) {
            (Some(sampling), _) => Some(Estimator::Poisson(sampling)),
            (None, Some(windows)) => Some(Estimator::Windows(windows.weight_of(cpu))),
            (None, None) => None,
        }
    }

    /// Whether the heap figures are estimates.
    pub fn any(&self) -> bool {
        self.sampling.is_some() || self.windows.is_some()
    }
}

/// What a recorded allocation stands for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Estimator {
    /// `--sample`: each block by the probability that a block of its size was sampled; every
    /// allocation is counted, so allocation counts stay exact.
    Poisson(Sampling),
    /// `--window`: every block alike, counts too.
    Windows(f64),
}

impl Estimator {
    /// How many allocations of `size` bytes one recorded allocation of that size stands for.
    pub fn count_weight(&self, size: u64) -> f64 {
        match self {
            Estimator::Poisson(sampling) => sampling.count_weight(size),
            Estimator::Windows(weight) => *weight,
        }
    }

    /// (allocations, bytes) that `count` recorded allocations totalling `bytes` stand for.
    pub fn scale(&self, count: u64, bytes: u64) -> (f64, f64) {
        match self {
            Estimator::Poisson(sampling) => sampling.scale(count, bytes),
            Estimator::Windows(weight) => (count as f64 * weight, bytes as f64 * weight),
        }
    }

    /// `--window`'s weight.
    pub fn window_weight(&self) -> Option<f64> {
        match self {
            Estimator::Windows(weight) => Some(*weight),
            Estimator::Poisson(_) => None,
        }
    }

    /// Whether the kernel's allocation counts are of recorded allocations only (windows), not of
    /// every allocation (sampling counts each, recorded or not).
    pub fn counts_recorded_only(&self) -> bool {
        matches!(self, Estimator::Windows(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_of_a_tenth_makes_each_allocation_stand_for_ten() {
        // 2 s probed of 20 s: one recorded block stands for 10.
        let windows = Windows::new(1.0, 10.0).measured(2.0, 20.0, 2);
        assert_eq!(windows.weight, 10.0);
        assert_eq!(Estimator::Windows(windows.weight).scale(3, 300), (30.0, 3000.0));
        // Before any window closed, nothing is scaled.
        assert_eq!(Windows::new(1.0, 10.0).measured(0.5, 0.5, 0).weight, 1.0);
    }

    #[test]
    fn a_process_is_weighted_by_its_user_time_where_it_can_be_measured() {
        let windows = Windows::new(1.0, 10.0).measured(2.0, 20.0, 2);
        // The probes slowed it: 2 s of wall time in windows, but only 0.5 s of its 20 s of work.
        let slowed = UserCpu { inside_s: 0.5, total_s: 20.0 };
        assert_eq!(windows.weight_of(Some(slowed)), 40.0);
        let estimators = Estimators { sampling: None, windows: Some(windows) };
        assert_eq!(estimators.of(Some(slowed)), Some(Estimator::Windows(40.0)));
        // Too few ticks inside windows to count, or none read: the run's wall-time weight.
        assert_eq!(windows.weight_of(Some(UserCpu { inside_s: 0.05, total_s: 3.0 })), 10.0);
        assert_eq!(windows.weight_of(None), 10.0);
    }
}

#[cfg(test)]
mod figure_lists {
    use super::*;

    /// The summary's lists of estimated figures, as the output contract has them.
    #[test]
    fn each_mode_names_its_estimated_figures_in_the_summarys_order() {
        let by_stack = ["leaks", "functions", "pprof", "flamegraph"];
        let free_and_live = ["frees", "freed_bytes", "live_allocations", "live_bytes", "peak_live_bytes"];
        assert_eq!(Sampling::ESTIMATED, [&free_and_live[..], &by_stack].concat());
        let windows = [&["allocations", "allocated_bytes"][..], &free_and_live, &by_stack].concat();
        assert_eq!(Windows::ESTIMATED, windows);
    }
}
