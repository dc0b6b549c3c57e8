//! How the allocations a run recorded stand for all of them, where it did not record every one:
//! `--sample`'s Poisson weights by size, or `--window`'s one weight, the run's time over the time
//! its allocation probes were attached.

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
    pub const ESTIMATED: &'static [&'static str] = &[
        "frees",
        "freed_bytes",
        "live_allocations",
        "live_bytes",
        "peak_live_bytes",
        "leaks",
        "functions",
        "pprof",
        "flamegraph",
    ];

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
/// between windows are the windows' scaled by `weight`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Windows {
    pub on_s: f64,
    pub every_s: f64,
    /// How long the allocation probes were attached, all windows together, and the run so far.
    pub probed_s: f64,
    pub elapsed_s: f64,
    /// What one recorded allocation stands for: elapsed over probed time.
    pub weight: f64,
    /// The figures that are estimates; every other figure stays exact.
    #[serde(skip_deserializing, default = "Windows::estimated")]
    pub estimated: &'static [&'static str],
}

impl Windows {
    /// Everything the heap figures are made of: out of a window no allocation is seen.
    pub const ESTIMATED: &'static [&'static str] = &[
        "allocations",
        "allocated_bytes",
        "frees",
        "freed_bytes",
        "live_allocations",
        "live_bytes",
        "peak_live_bytes",
        "leaks",
        "functions",
        "pprof",
        "flamegraph",
    ];

    pub fn new(on_s: f64, every_s: f64) -> Self {
        Self { on_s, every_s, probed_s: 0.0, elapsed_s: 0.0, weight: 1.0, estimated: Self::ESTIMATED }
    }

    fn estimated() -> &'static [&'static str] {
        Self::ESTIMATED
    }

    /// The run so far: `probed_s` of `elapsed_s` inside windows.
    pub fn measured(self, probed_s: f64, elapsed_s: f64) -> Self {
        let weight = if probed_s > 0.0 { (elapsed_s / probed_s).max(1.0) } else { 1.0 };
        Self { probed_s, elapsed_s, weight, ..self }
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
        let windows = Windows::new(1.0, 10.0).measured(2.0, 20.0);
        assert_eq!(windows.weight, 10.0);
        assert_eq!(Estimator::Windows(windows.weight).scale(3, 300), (30.0, 3000.0));
        // Before any window closed, nothing is scaled.
        assert_eq!(Windows::new(1.0, 10.0).measured(0.5, 0.5).weight, 1.0);
    }
}
