//! A Python frame's line, from its code object's location table, which the kernel copies
//! (`PythonCode::linetable`) with the instruction the frame was at.

/// A code object's line for the instruction at `index` (in code units), from its location table
/// (3.11's format, Objects/locations.md): entries of a first byte (bit 7 set, a code in bits
/// 3-6, the units it covers less one in bits 0-2) and the code's varints. None where the table
/// ends first (it was cut to fit) or says the instruction has no line.
pub fn line_of(table: &[u8], first_line: u32, index: u64) -> Option<u32> {
    let mut line = i64::from(first_line);
    let mut at = 0usize;
    let mut unit = 0u64;
    while at < table.len() {
        let first = table[at];
        at += 1;
        let (code, units) = ((first >> 3) & 15, u64::from(first & 7) + 1);
        let mut no_line = false;
        match code {
            15 => no_line = true,
            14 => {
                line += signed_varint(table, &mut at)?;
                for _ in 0..3 {
                    varint(table, &mut at)?;
                }
            }
            13 => line += signed_varint(table, &mut at)?,
            10..=12 => {
                line += i64::from(code - 10);
                at += 2;
            }
            _ => at += 1,
        }
        if index < unit + units {
            return (!no_line).then(|| u32::try_from(line).ok()).flatten();
        }
        unit += units;
    }
    None
}

/// An unsigned varint of the location table: 6 bits a byte, low first, bit 6 set where more follow.
fn varint(table: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let byte = *table.get(*at)?;
        *at += 1;
        value |= u64::from(byte & 63) << shift;
        if byte & 64 == 0 || shift > 56 {
            return Some(value);
        }
        shift += 6;
    }
}

/// A signed varint: the unsigned one with the sign in its lowest bit.
fn signed_varint(table: &[u8], at: &mut usize) -> Option<i64> {
    let value = varint(table, at)?;
    let magnitude = (value >> 1) as i64;
    Some(if value & 1 != 0 { -magnitude } else { magnitude })
}
#[cfg(test)]
mod tests {
    use super::*;

    /// `def f():\n    x = 1\n    return x` as 3.11 compiles it: RESUME on line 1, then two
    /// one-line entries (a line on: code 11) and one on the same line (code 10).
    #[test]
    fn lines_come_from_the_location_table() {
        let table = [0x80 | 10 << 3, 0, 0, 0x80 | 11 << 3 | 1, 4, 5, 0x80 | 11 << 3 | 1, 4, 10];
        assert_eq!(line_of(&table, 1, 0), Some(1));
        assert_eq!(line_of(&table, 1, 1), Some(2));
        assert_eq!(line_of(&table, 1, 2), Some(2));
        assert_eq!(line_of(&table, 1, 3), Some(3));
        assert_eq!(line_of(&table, 1, 5), None, "past the table");
        // A long entry: line -1 (signed varint 3), then three varints; then no location.
        let long = [0x80 | 14 << 3, 3, 0, 0, 0, 0x80 | 15 << 3];
        assert_eq!(line_of(&long, 10, 0), Some(9));
        assert_eq!(line_of(&long, 10, 1), None);
    }
}
