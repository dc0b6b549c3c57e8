//! Where the running kernel keeps a field of one of its structs, read from its BTF
//! (/sys/kernel/btf/vmlinux): aya-ebpf has no CO-RE, so a BPF program that reads a kernel struct
//! is told the offset by the loader.

use std::path::Path;

use anyhow::{bail, Context, Result};
use memtrace_common::KernelLayout;

/// The kernel's own type information (BTF).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: usize = 24;
/// Every BTF type starts with name_off, info and size_or_type.
const TYPE_LEN: usize = 12;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;

/// Where the running kernel keeps what the BPF programs read (`memtrace_common::KernelLayout`),
/// from the BTF file at `path`.
pub fn kernel_layout(path: &Path) -> Result<KernelLayout> {
    let data = std::fs::read(path).with_context(|| {
        format!(
            "reading the kernel's type information {}: following a process tree needs a kernel built \
             with CONFIG_DEBUG_INFO_BTF; trace without --children (or with --no-children) instead",
            path.display()
        )
    })?;
    let layout = || -> Result<KernelLayout> {
        let btf = Btf::parse(&data)?;
        let task = btf.find_struct("task_struct")?;
        let mm = btf.find_struct("mm_struct")?;
        let (percpu_counter_count, percpu_counter_size, percpu_counter_counters) = rss_counter_layout(&btf)?;
        let (binprm, file) = (btf.find_struct("linux_binprm")?, btf.find_struct("file")?);
        let (inode, super_block) = (btf.find_struct("inode")?, btf.find_struct("super_block")?);
        let vma = btf.find_struct("vm_area_struct")?;
        Ok(KernelLayout {
            task_tgid: btf.member_offset(task, "tgid")?,
            task_mm: btf.member_offset(task, "mm")?,
            mm_rss_stat: btf.member_offset(mm, "rss_stat")?,
            mm_start_brk: btf.member_offset(mm, "start_brk")?,
            mm_brk: btf.member_offset(mm, "brk")?,
            percpu_counter_count,
            percpu_counter_size,
            percpu_counter_counters,
            binprm_file: btf.member_offset(binprm, "file")?,
            file_inode: btf.member_offset(file, "f_inode")?,
            inode_ino: btf.member_offset(inode, "i_ino")?,
            inode_sb: btf.member_offset(inode, "i_sb")?,
            sb_dev: btf.member_offset(super_block, "s_dev")?,
            oom_victim_is_task: u32::from(oom_victim_is_task(&btf)),
            vma_start: btf.member_offset(vma, "vm_start")?,
            vma_end: btf.member_offset(vma, "vm_end")?,
            vma_pgoff: btf.member_offset(vma, "vm_pgoff")?,
            vma_file: btf.member_offset(vma, "vm_file")?,
            task_thread_pointer: thread_pointer_offset(&btf).unwrap_or(0),
            ..with_backing_files(&btf, memcg_layout(&btf).unwrap_or_default())
        })
    };
    layout().with_context(|| format!("reading {}", path.display()))
}

/// Whether the kernel's BTF at `path` has a struct `name`.
pub fn has_struct(path: &Path, name: &str) -> Result<bool> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let btf = Btf::parse(&data).with_context(|| format!("reading {}", path.display()))?;
    Ok(btf.find_struct(name).is_ok())
}

/// Where each of mm_struct's rss_stat counters keeps its count: (offset in the counter, the
/// counter's size, offset of its per-CPU deltas or 0). Since 6.2 rss_stat is an array of struct
/// percpu_counter; before, it is a struct mm_rss_stat holding an array of atomic_long_t (Debian
/// 12's 6.1), each its own count.
fn rss_counter_layout(btf: &Btf<'_>) -> Result<(u32, u32, u32)> {
    if btf.find_struct("mm_rss_stat").is_ok() {
        return Ok((0, 8, 0));
    }
    let counter = btf.find_struct("percpu_counter")?;
    Ok((btf.member_offset(counter, "count")?, btf.size(counter)?, btf.member_offset(counter, "counters")?))
}

/// Whether oom:mark_victim passes the victim's task (6.8 and later) rather than its pid (6.1): the
/// change came with the event's new fields (comm, total_vm, the RSS counters, uid), so its record
/// struct having `total_vm` tells the two apart.
fn oom_victim_is_task(btf: &Btf<'_>) -> bool {
    btf.find_struct("trace_event_raw_mark_victim")
        .is_ok_and(|record| btf.member_offset(record, "total_vm").is_ok())
}

/// Where a task keeps its user thread pointer: `task_struct.thread` . `thread_struct.fsbase` on
/// x86-64, `.thread` . `.uw.tp_value` on arm64 (`uw` is an unnamed struct).
fn thread_pointer_offset(btf: &Btf<'_>) -> Result<u32> {
    let (thread, thread_struct) = btf.member_composite(btf.find_struct("task_struct")?, "thread")?;
    if cfg!(target_arch = "aarch64") {
        let (user, registers) = btf.member_composite(thread_struct, "uw")?;
        Ok(thread + user + btf.member_offset(registers, "tp_value")?)
    } else {
        Ok(thread + btf.member_offset(thread_struct, "fsbase")?)
    }
}

/// `layout` with the way from an overlay's backing file to the file it was opened as, where the
/// kernel has backing files (6.6 and later; `struct backing_file`, its `user_path`).
fn with_backing_files(btf: &Btf<'_>, layout: KernelLayout) -> KernelLayout {
    let offsets = || -> Result<(u32, u32, u32)> {
        let backing = btf.find_struct("backing_file")?;
        Ok((
            btf.member_offset(backing, "user_path")?,
            btf.member_offset(btf.find_struct("path")?, "dentry")?,
            btf.member_offset(btf.find_struct("dentry")?, "d_inode")?,
        ))
    };
    match offsets() {
        Ok((backing_user_path, path_dentry, dentry_inode)) => {
            KernelLayout { backing_user_path, path_dentry, dentry_inode, ..layout }
        }
        Err(_) => layout,
    }
}

/// The way from a task to its memory cgroup's id (`KernelLayout::task_cgroups` ...); an error
/// where the kernel has no memory controller (then none is read).
fn memcg_layout(btf: &Btf<'_>) -> Result<KernelLayout> {
    let (task, css_set) = (btf.find_struct("task_struct")?, btf.find_struct("css_set")?);
    let (css, cgroup) = (btf.find_struct("cgroup_subsys_state")?, btf.find_struct("cgroup")?);
    Ok(KernelLayout {
        task_cgroups: btf.member_offset(task, "cgroups")?,
        css_set_subsys: btf.member_offset(css_set, "subsys")?,
        memory_subsys_slot: btf.enum_value("memory_cgrp_id")? + 1,
        css_cgroup: btf.member_offset(css, "cgroup")?,
        cgroup_kn: btf.member_offset(cgroup, "kn")?,
        kernfs_node_id: btf.member_offset(btf.find_struct("kernfs_node")?, "id")?,
        ..KernelLayout::default()
    })
}

/// A struct or union of the BTF, by the byte offset of its type record.
#[derive(Debug, Clone, Copy)]
struct Composite {
    at: usize,
    name_hint: u32,
}

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// The byte offset of each type's record, by type id (id 0 is void and has none).
    offsets: Vec<usize>,
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
        let types = section(8)?;
        let mut offsets = vec![usize::MAX];
        let mut at = 0;
        while at < types.len() {
            offsets.push(at);
            let info = u32_at(types, at + 4)?;
            at += TYPE_LEN + extra_len((info >> 24) & 0x1f, (info & 0xffff) as usize)?;
        }
        Ok(Self { types, strings: section(16)?, offsets })
    }

    fn find_struct(&self, name: &str) -> Result<Composite> {
        for &at in &self.offsets[1..] {
            let (name_off, info) = (u32_at(self.types, at)?, u32_at(self.types, at + 4)?);
            if (info >> 24) & 0x1f == KIND_STRUCT
                && info & 0xffff > 0
                && self.string(name_off)? == name.as_bytes()
            {
                return Ok(Composite { at, name_hint: name_off });
            }
        }
        bail!("the kernel's BTF has no struct {name}")
    }

    /// The value of the enumerator `name` of any enum.
    fn enum_value(&self, name: &str) -> Result<u32> {
        for &at in &self.offsets[1..] {
            let info = u32_at(self.types, at + 4)?;
            if (info >> 24) & 0x1f != KIND_ENUM {
                continue;
            }
            for index in 0..(info & 0xffff) as usize {
                let entry = at + TYPE_LEN + index * 8;
                if self.string(u32_at(self.types, entry)?)? == name.as_bytes() {
                    return u32_at(self.types, entry + 4);
                }
            }
        }
        bail!("the kernel's BTF has no enumerator {name}")
    }

    fn size(&self, composite: Composite) -> Result<u32> {
        u32_at(self.types, composite.at + 8)
    }

    /// Byte offset of `member`, looked for in anonymous structs and unions inside too.
    fn member_offset(&self, composite: Composite, member: &str) -> Result<u32> {
        self.find_member(composite, member, 0)?.with_context(|| {
            let name = self.string(composite.name_hint).map(String::from_utf8_lossy).unwrap_or_default();
            format!("struct {name} has no member {member} in the kernel's BTF")
        })
    }

    fn find_member(&self, composite: Composite, member: &str, depth: u32) -> Result<Option<u32>> {
        let info = u32_at(self.types, composite.at + 4)?;
        let (count, bitfields) = ((info & 0xffff) as usize, info >> 31 == 1);
        for index in 0..count {
            let entry = composite.at + TYPE_LEN + index * 12;
            let offset = u32_at(self.types, entry + 8)?;
            // With bitfields in the struct, the top 8 bits are the field's size in bits.
            let bits = if bitfields { offset & 0x00ff_ffff } else { offset };
            let name = self.string(u32_at(self.types, entry)?)?;
            let found = if name == member.as_bytes() {
                Some(0)
            } else if name.is_empty() && depth < 8 {
                match self.composite(u32_at(self.types, entry + 4)?)? {
                    Some(inner) => self.find_member(inner, member, depth + 1)?,
                    None => None,
                }
            } else {
                None
            };
            if let Some(inner) = found {
                if bits % 8 != 0 {
                    bail!("the kernel keeps {member} in a bitfield");
                }
                return Ok(Some(bits / 8 + inner));
            }
        }
        Ok(None)
    }

    /// Byte offset of the struct or union `member` of `composite` (a member named so, not one
    /// inside an anonymous member) and its type.
    fn member_composite(&self, composite: Composite, member: &str) -> Result<(u32, Composite)> {
        let info = u32_at(self.types, composite.at + 4)?;
        for index in 0..(info & 0xffff) as usize {
            let entry = composite.at + TYPE_LEN + index * 12;
            if self.string(u32_at(self.types, entry)?)? != member.as_bytes() {
                continue;
            }
            let offset = u32_at(self.types, entry + 8)?;
            let bits = if info >> 31 == 1 { offset & 0x00ff_ffff } else { offset };
            let inner = self.composite(u32_at(self.types, entry + 4)?)?;
            return inner.map(|inner| (bits / 8, inner)).context(format!("{member} is no struct or union"));
        }
        bail!("the kernel's BTF has no member {member} of that struct")
    }

    /// The struct or union a type id names, if it is one.
    fn composite(&self, id: u32) -> Result<Option<Composite>> {
        let at = *self.offsets.get(id as usize).context("a BTF type id out of range")?;
        let kind = (u32_at(self.types, at + 4)? >> 24) & 0x1f;
        Ok((kind == KIND_STRUCT || kind == KIND_UNION).then_some(Composite { at, name_hint: 0 }))
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

    fn offset(name: &str, member: &str) -> Result<u32> {
        let data = std::fs::read(VMLINUX_BTF).unwrap();
        let btf = Btf::parse(&data)?;
        let composite = btf.find_struct(name)?;
        btf.member_offset(composite, member)
    }

    /// struct task_struct keeps `pid` and then `tgid`, both pid_t, one after the other.
    #[test]
    fn task_struct_keeps_tgid_right_after_pid() {
        let pid = offset("task_struct", "pid").unwrap();
        let tgid = offset("task_struct", "tgid").unwrap();
        assert_eq!(tgid, pid + 4);
        // task_struct starts with thread_info and state, scheduling fields and more: far from 0.
        assert!(pid > 256, "{pid}");
    }

    /// This machine's kernel (6.18) counts RSS per process: no per-thread cache.
    #[test]
    fn a_struct_is_found_by_name() {
        assert!(has_struct(Path::new(VMLINUX_BTF), "task_struct").unwrap());
        assert!(!has_struct(Path::new(VMLINUX_BTF), "task_rss_stat").unwrap());
    }

    /// This machine's kernel (6.18) passes oom:mark_victim the victim's task, and its memory
    /// controller's id is its place in /proc/cgroups, which lists the controllers in id order.
    #[test]
    fn the_oom_victim_and_its_memory_cgroup_are_reachable() {
        let layout = kernel_layout(Path::new(VMLINUX_BTF)).unwrap();
        assert_eq!(layout.oom_victim_is_task, 1, "{layout:?}");
        let controllers = std::fs::read_to_string("/proc/cgroups").unwrap();
        let memory = controllers.lines().skip(1).position(|line| line.starts_with("memory\t")).unwrap();
        assert_eq!(layout.memory_subsys_slot, memory as u32 + 1, "{controllers}");
        // css_set begins with its subsys array, cgroup_subsys_state with its cgroup pointer.
        assert_eq!((layout.css_set_subsys, layout.css_cgroup), (0, 0), "{layout:?}");
        assert!(layout.task_cgroups > 0 && layout.cgroup_kn > 0 && layout.kernfs_node_id > 0, "{layout:?}");
    }

    /// mm_struct keeps its fields in an anonymous struct; brk follows start_brk, and the counters
    /// are an array of struct percpu_counter whose `count` follows a 4-byte lock.
    #[test]
    fn the_layout_reaches_into_anonymous_structs() {
        let layout = kernel_layout(Path::new(VMLINUX_BTF)).unwrap();
        assert_eq!(layout.mm_brk, layout.mm_start_brk + 8);
        assert!(layout.mm_rss_stat > 0 && layout.task_mm > 0);
        assert_eq!(layout.percpu_counter_count, 8);
        assert!(layout.percpu_counter_size >= 16, "{layout:?}");
        assert!(layout.percpu_counter_counters > layout.percpu_counter_count, "{layout:?}");
        assert_eq!(layout.task_tgid, offset("task_struct", "pid").unwrap() + 4);
    }

    /// A task's FS base lies in its thread_struct, which task_struct embeds (x86-64).
    #[test]
    fn a_tasks_thread_pointer_is_found() {
        let layout = kernel_layout(Path::new(VMLINUX_BTF)).unwrap();
        let thread = offset("task_struct", "thread").unwrap();
        assert_eq!(layout.task_thread_pointer, thread + offset("thread_struct", "fsbase").unwrap());
        assert!(layout.task_thread_pointer > thread, "{layout:?}");
    }

    #[test]
    fn unknown_structs_and_members_are_named() {
        let err = offset("no_such_struct", "x").unwrap_err();
        assert!(format!("{err:#}").contains("no struct no_such_struct"), "{err:#}");
        let err = offset("task_struct", "no_such_member").unwrap_err();
        assert!(format!("{err:#}").contains("task_struct has no member no_such_member"), "{err:#}");
    }

    #[test]
    fn cut_or_foreign_files_are_refused() {
        let data = std::fs::read(VMLINUX_BTF).unwrap();
        for len in [0, 10, HEADER_LEN, data.len() / 2] {
            let found = Btf::parse(&data[..len])
                .and_then(|btf| btf.find_struct("task_struct").and_then(|t| btf.member_offset(t, "tgid")));
            assert!(found.is_err());
        }
        assert!(Btf::parse(&[0u8; 64]).is_err());
    }
}
