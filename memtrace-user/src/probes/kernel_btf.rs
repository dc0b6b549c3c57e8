//! Where the running kernel keeps a field of one of its structs, read from its BTF
//! (/sys/kernel/btf/vmlinux): aya-ebpf has no CO-RE, so a BPF program that reads a kernel struct
//! is told the offset by the loader.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The kernel's own type information.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: usize = 24;
/// Every BTF type starts with name_off, info and size_or_type.
const TYPE_LEN: usize = 12;
const KIND_STRUCT: u32 = 4;

/// Byte offset of `member` in `struct name`, from the BTF file at `path`.
pub fn member_offset(path: &Path, name: &str, member: &str) -> Result<u32> {
    let data = std::fs::read(path).with_context(|| {
        format!(
            "reading the kernel's type information {}: following a process tree needs a kernel built \
             with CONFIG_DEBUG_INFO_BTF; trace without --children (or with --no-children) instead",
            path.display()
        )
    })?;
    Btf::parse(&data)
        .and_then(|btf| btf.member_offset(name, member))
        .with_context(|| format!("reading {}", path.display()))
}

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Self> {
        if data.len() < HEADER_LEN || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            bail!("not BTF in this machine's byte order");
        }
        let header_len = u32_at(data, 4)? as usize;
        let section = |offset_at: usize| -> Result<&'a [u8]> {
            let start = header_len.saturating_add(u32_at(data, offset_at)? as usize);
            let len = u32_at(data, offset_at + 4)? as usize;
            data.get(start..start.saturating_add(len)).context("a BTF section runs past the end of the file")
        };
        Ok(Self { types: section(8)?, strings: section(16)? })
    }

    fn member_offset(&self, name: &str, member: &str) -> Result<u32> {
        let mut at = 0;
        while at < self.types.len() {
            let (name_off, info) = (u32_at(self.types, at)?, u32_at(self.types, at + 4)?);
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let members = at + TYPE_LEN;
            if kind == KIND_STRUCT && vlen > 0 && self.string(name_off)? == name.as_bytes() {
                return self.find_member(members, vlen, info >> 31 == 1, name, member);
            }
            at = members + extra_len(kind, vlen)?;
        }
        bail!("the kernel's BTF has no struct {name}")
    }

    fn find_member(&self, at: usize, count: usize, bitfields: bool, name: &str, member: &str) -> Result<u32> {
        for index in 0..count {
            let entry = at + index * 12;
            if self.string(u32_at(self.types, entry)?)? != member.as_bytes() {
                continue;
            }
            let offset = u32_at(self.types, entry + 8)?;
            // With bitfields in the struct, the top 8 bits are the field's size in bits.
            let bits = if bitfields { offset & 0x00ff_ffff } else { offset };
            if bits % 8 != 0 {
                bail!("struct {name} keeps {member} in a bitfield");
            }
            return Ok(bits / 8);
        }
        bail!("struct {name} has no member {member} in the kernel's BTF")
    }

    fn string(&self, offset: u32) -> Result<&[u8]> {
        let rest =
            self.strings.get(offset as usize..).context("a BTF name lies outside its string section")?;
        Ok(rest.split(|&b| b == 0).next().unwrap_or_default())
    }
}

/// The bytes that follow a type's common part, by kind (linux/btf.h).
fn extra_len(kind: u32, vlen: usize) -> Result<usize> {
    Ok(match kind {
        // INT, VAR, DECL_TAG
        1 | 14 | 17 => 4,
        // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
        2 | 7..=12 | 16 | 18 => 0,
        // ARRAY
        3 => 12,
        // STRUCT, UNION, DATASEC, ENUM64
        4 | 5 | 15 | 19 => 12 * vlen,
        // ENUM, FUNC_PROTO
        6 | 13 => 8 * vlen,
        _ => bail!("a BTF type of unknown kind {kind}"),
    })
}

fn u32_at(data: &[u8], at: usize) -> Result<u32> {
    let bytes = data.get(at..at + 4).context("BTF cut short")?;
    Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// struct task_struct keeps `pid` and then `tgid`, both pid_t, one after the other.
    #[test]
    fn task_struct_keeps_tgid_right_after_pid() {
        let path = Path::new(VMLINUX_BTF);
        let pid = member_offset(path, "task_struct", "pid").unwrap();
        let tgid = member_offset(path, "task_struct", "tgid").unwrap();
        assert_eq!(tgid, pid + 4);
        // task_struct starts with thread_info and state, scheduling fields and more: far from 0.
        assert!(pid > 256, "{pid}");
    }

    #[test]
    fn unknown_structs_and_members_are_named() {
        let path = Path::new(VMLINUX_BTF);
        let err = member_offset(path, "no_such_struct", "x").unwrap_err();
        assert!(format!("{err:#}").contains("no struct no_such_struct"), "{err:#}");
        let err = member_offset(path, "task_struct", "no_such_member").unwrap_err();
        assert!(format!("{err:#}").contains("no member no_such_member"), "{err:#}");
    }

    #[test]
    fn cut_or_foreign_files_are_refused() {
        let data = std::fs::read(VMLINUX_BTF).unwrap();
        for len in [0, 10, HEADER_LEN, data.len() / 2] {
            assert!(Btf::parse(&data[..len])
                .and_then(|btf| btf.member_offset("task_struct", "tgid"))
                .is_err());
        }
        assert!(Btf::parse(&[0u8; 64]).is_err());
    }
}
