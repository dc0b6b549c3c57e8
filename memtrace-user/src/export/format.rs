//! Figures as a person reads them on a terminal, in one place for every line that shows them: the
//! progress line (progress.rs) and `memtrace top`'s view. Presentation, not the model's figures, so
//! it lives with the outputs; top reads it from here as it reads the exporter interface. (The text
//! report keeps its own byte units, which go on to TiB.)

use std::time::Duration;

/// Bytes as a person reads them: exact below 10 KiB, else in KiB, MiB or GiB with one decimal.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 3] = ["KiB", "MiB", "GiB"];
    if bytes < 10 * 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A signed byte count (a live heap that sampling estimates below zero, a growth): `+` for growth.
pub fn format_signed_bytes(bytes: i64, plus: bool) -> String {
    let magnitude = format_bytes(bytes.unsigned_abs());
    match bytes {
        0 => "0".to_owned(),
        b if b < 0 => format!("-{magnitude}"),
        _ if plus => format!("+{magnitude}"),
        _ => magnitude,
    }
}

/// An elapsed time to the second: `42s`, `3m07s`, `2h05m09s`.
pub fn format_elapsed(elapsed: Duration) -> String {
    let seconds = elapsed.as_secs();
    match (seconds / 3600, seconds / 60 % 60, seconds % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_exactly_when_small() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(5768), "5768 B");
        assert_eq!(format_bytes(10 * 1024 - 1), "10239 B");
        assert_eq!(format_bytes(10 * 1024), "10.0 KiB");
        assert_eq!(format_bytes(3 << 20), "3.0 MiB");
        assert_eq!(format_bytes(5 << 40), "5120.0 GiB");
        assert_eq!(format_signed_bytes(0, true), "0");
        assert_eq!(format_signed_bytes(2000, true), "+2000 B");
        assert_eq!(format_signed_bytes(-1_572_864, true), "-1.5 MiB");
        assert_eq!(format_signed_bytes(2000, false), "2000 B");
    }

    #[test]
    fn elapsed_reads_to_the_second() {
        assert_eq!(format_elapsed(Duration::from_millis(42_900)), "42s");
        assert_eq!(format_elapsed(Duration::from_secs(187)), "3m07s");
        assert_eq!(format_elapsed(Duration::from_secs(7509)), "2h05m09s");
    }
}
