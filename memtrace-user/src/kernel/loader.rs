//! Loading memtrace's uprobe programs for uprobe_multi links.
//!
//! A uprobe_multi link (kernel 6.6+) attaches one program at every probe site of a file at once and
//! detaches them all in one grace period, but the kernel takes only programs loaded with the
//! expected attach type BPF_TRACE_UPROBE_MULTI, which aya 0.14's `UProbe::load` never sets. So the
//! uprobe programs are loaded here: the embedded object is parsed again with aya-obj, relocated
//! against the maps aya already created (so both loads share every map), and handed to
//! BPF_PROG_LOAD, with the object's BTF and each program's function and line info (the verifier
//! needs them for the unwinder's bpf_loop callback). The raw tracepoints, and the uprobe programs
//! on kernels without uprobe_multi, are still loaded by aya.

use std::{
    collections::{HashMap, HashSet},
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd},
};

use anyhow::{bail, Context, Result};
use aya::{maps::Map, Ebpf};
use aya_obj::{
    btf::BtfFeatures,
    generated::{
        bpf_attach_type::BPF_TRACE_UPROBE_MULTI,
        bpf_prog_type::{BPF_PROG_TYPE_KPROBE, BPF_PROG_TYPE_RAW_TRACEPOINT},
    },
    Function, Object, ProgramSection,
};

use crate::kernel::sys::{bpf, log_text, prog_load, ProgLoadAttr};

const BPF_BTF_LOAD: libc::c_long = 18;
/// bpf(2): BPF_F_SLEEPABLE in prog_flags.
const BPF_F_SLEEPABLE: u32 = 1 << 4;
/// Bytes of verifier log kept when a load fails.
const LOG_SIZE: usize = 1 << 20;

/// `union bpf_attr` for BPF_BTF_LOAD.
#[repr(C)]
#[derive(Default)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    /// Written by the kernel; declared so that no padding is passed in its place.
    btf_log_true_size: u32,
}

/// memtrace's uprobe programs, loaded for uprobe_multi links, by name.
/// Each is verified when it is first asked for: the verifier takes most of memtrace's start-up
/// (the allocator's return probe alone some 0.4 s here, 30 times that on an emulated CPU), so a
/// run pays only for the programs it attaches.
pub struct MultiPrograms {
    programs: HashMap<String, OwnedFd>,
    /// The relocated object, with its type information in the kernel, which the programs refer to.
    prepared: Prepared,
}

/// The embedded object parsed and relocated against the maps aya created, with its BTF in the
/// kernel: ready for BPF_PROG_LOAD of any of its programs.
pub(super) struct Prepared {
    obj: Object,
    btf: OwnedFd,
}

impl Prepared {
    pub(super) fn new(object: &[u8], ebpf: &Ebpf) -> Result<Self> {
        let mut obj = Object::parse(object).context("parsing the embedded BPF object")?;
        let btf = load_btf(&mut obj)?;
        let text_sections: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
        let map_objects = std::mem::take(&mut obj.maps);
        let mut maps = Vec::with_capacity(map_objects.len());
        for (name, map_object) in &map_objects {
            let map = ebpf.map(name).with_context(|| format!("aya created no map {name}"))?;
            maps.push((&**name, map_fd(map), map_object));
        }
        obj.relocate_maps(maps.into_iter(), &text_sections).context("relocating map references")?;
        obj.relocate_calls(&text_sections).context("relocating function calls")?;
        Ok(Self { obj, btf })
    }

    /// A program's section and its code (the main function with its subprograms appended).
    pub(super) fn program(&self, name: &str) -> Result<(&ProgramSection, &Function)> {
        let program =
            self.obj.programs.get(name).with_context(|| format!("the BPF object has no program {name}"))?;
        let function = self
            .obj
            .functions
            .get(&(program.section_index, program.address))
            .with_context(|| format!("the BPF object has no code for program {name}"))?;
        Ok((&program.section, function))
    }
}

/// How a program is loaded: its type, expected attach type and flags.
#[derive(Clone, Copy)]
pub(super) struct ProgramKind {
    prog_type: u32,
    attach_type: u32,
    pub(super) sleepable: bool,
}

impl ProgramKind {
    /// A uprobe program (kprobe-type), which runs preemptible.
    pub(super) fn preemptible(&self) -> bool {
        self.prog_type == BPF_PROG_TYPE_KPROBE as u32
    }

    /// The kind of a uprobe (for `attach_type`) or raw tracepoint section; None for others.
    pub(super) fn of(section: &ProgramSection, attach_type: u32) -> Option<Self> {
        let sleepable = match section {
            ProgramSection::UProbe { sleepable } | ProgramSection::URetProbe { sleepable } => *sleepable,
            ProgramSection::RawTracePoint => {
                return Some(Self {
                    prog_type: BPF_PROG_TYPE_RAW_TRACEPOINT as u32,
                    attach_type: 0,
                    sleepable: false,
                })
            }
            _ => return None,
        };
        Some(Self { prog_type: BPF_PROG_TYPE_KPROBE as u32, attach_type, sleepable })
    }
}

impl MultiPrograms {
    /// Prepares the uprobe programs of `object`, whose maps `ebpf` created from the same bytes;
    /// none is loaded yet.
    pub fn prepare(object: &[u8], ebpf: &Ebpf) -> Result<Self> {
        Ok(Self { programs: HashMap::new(), prepared: Prepared::new(object, ebpf)? })
    }

    /// Every program loaded so far, by name.
    pub fn named(&self) -> impl Iterator<Item = (&str, BorrowedFd<'_>)> {
        self.programs.iter().map(|(name, fd)| (name.as_str(), fd.as_fd()))
    }

    /// The program `name`, loaded (and verified) on the first call.
    pub fn program(&mut self, name: &str) -> Result<BorrowedFd<'_>> {
        if !self.programs.contains_key(name) {
            let (section, function) = self.prepared.program(name)?;
            let kind = ProgramKind::of(section, BPF_TRACE_UPROBE_MULTI as u32)
                .with_context(|| format!("BPF program {name} is no uprobe"))?;
            let fd = load_program(name, function, &self.prepared, kind)
                .with_context(|| format!("the kernel refused program {name} for uprobe_multi"))?;
            self.programs.insert(name.to_owned(), fd);
        }
        Ok(self.programs[name].as_fd())
    }
}

/// The descriptor of a map aya created. Every kind of map holds its `MapData`.
fn map_fd(map: &Map) -> RawFd {
    use Map::*;
    let data = match map {
        Array(data)
        | ArrayOfMaps(data)
        | BloomFilter(data)
        | CgroupArray(data)
        | CgroupStorage(data)
        | CgrpStorage(data)
        | CpuMap(data)
        | DevMap(data)
        | DevMapHash(data)
        | HashMap(data)
        | HashOfMaps(data)
        | InodeStorage(data)
        | LpmTrie(data)
        | LruHashMap(data)
        | PerCpuArray(data)
        | PerCpuCgroupStorage(data)
        | PerCpuHashMap(data)
        | PerCpuLruHashMap(data)
        | PerfEventArray(data)
        | ProgramArray(data)
        | Queue(data)
        | ReusePortSockArray(data)
        | RingBuf(data)
        | SockHash(data)
        | SockMap(data)
        | SkStorage(data)
        | Stack(data)
        | StackTraceMap(data)
        | Unsupported(data)
        | XskMap(data) => data,
    };
    data.fd().as_fd().as_raw_fd()
}

/// Loads the object's BTF into the kernel, as this kernel takes it (every BTF feature is there
/// since 5.16; older kernels fall back to per-site links).
fn load_btf(obj: &mut Object) -> Result<OwnedFd> {
    let features = BtfFeatures::new(true, true, true, true, true, true, true, true);
    let btf = obj
        .fixup_and_sanitize_btf(&features)
        .context("preparing the BPF object's BTF")?
        .context("the BPF object carries no BTF (build memtrace-ebpf with bpf-linker --btf)")?
        .to_bytes();
    let mut log = vec![0u8; LOG_SIZE];
    let attr = BtfLoadAttr {
        btf: btf.as_ptr() as u64,
        btf_size: u32::try_from(btf.len()).context("BTF too large")?,
        btf_log_buf: log.as_mut_ptr() as u64,
        btf_log_size: LOG_SIZE as u32,
        btf_log_level: 1,
        btf_log_true_size: 0,
    };
    // SAFETY: the attribute, the BTF and the log it points to outlive the call.
    unsafe { bpf(BPF_BTF_LOAD, std::ptr::from_ref(&attr).cast(), size_of::<BtfLoadAttr>()) }.map_err(|err| {
        let log = log_text(&log);
        anyhow::anyhow!("the kernel refused the BPF object's BTF: {err}\n{log}")
    })
}

/// BPF_PROG_LOAD of one program; on failure, loads it again with the verifier's log to say why.
fn load_program(name: &str, function: &Function, prepared: &Prepared, kind: ProgramKind) -> Result<OwnedFd> {
    if let (Ok(fd), _) = load_logged(name, function, prepared, kind, None)? {
        return Ok(fd);
    }
    match load_logged(name, function, prepared, kind, Some(1))? {
        (Ok(fd), _) => Ok(fd),
        (Err(err), log) => {
            let tail: Vec<&str> = log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
            bail!("{err}\n{}", tail.join("\n"))
        }
    }
}

/// BPF_PROG_LOAD of one program, with the verifier's log at `level` if given (1: the walk, 4:
/// statistics only): the load's result and the log (empty without one).
pub(super) fn load_logged(
    name: &str,
    function: &Function,
    prepared: &Prepared,
    kind: ProgramKind,
    level: Option<u32>,
) -> Result<(io::Result<OwnedFd>, String)> {
    let mut attr = program_attr(name, function, prepared, kind)?;
    // Kept alive until the program is loaded.
    let (func_info, line_info) = (function.func_info.func_info_bytes(), function.line_info.line_info_bytes());
    attr.func_info = func_info.as_ptr() as u64;
    attr.line_info = line_info.as_ptr() as u64;
    Ok(match level {
        None => (prog_load(&attr), String::new()),
        Some(level) => load_with_log(&mut attr, level),
    })
}

/// The load attribute of a program, without its func and line info pointers.
fn program_attr(
    name: &str,
    function: &Function,
    prepared: &Prepared,
    kind: ProgramKind,
) -> Result<ProgLoadAttr> {
    let instructions = &function.instructions;
    let mut prog_name = [0u8; 16];
    for (slot, byte) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *slot = byte;
    }
    Ok(ProgLoadAttr {
        prog_type: kind.prog_type,
        insn_cnt: u32::try_from(instructions.len()).context("program too long")?,
        insns: instructions.as_ptr() as u64,
        license: prepared.obj.license.as_ptr() as u64,
        prog_flags: if kind.sleepable { BPF_F_SLEEPABLE } else { 0 },
        prog_name,
        expected_attach_type: kind.attach_type,
        prog_btf_fd: prepared.btf.as_raw_fd() as u32,
        func_info_rec_size: function.func_info_rec_size as u32,
        func_info_cnt: function.func_info.len() as u32,
        line_info_rec_size: function.line_info_rec_size as u32,
        line_info_cnt: function.line_info.len() as u32,
        ..ProgLoadAttr::default()
    })
}

/// Loads with the verifier's log at `level` (1: the walk, 4: statistics only), returning the log.
fn load_with_log(attr: &mut ProgLoadAttr, level: u32) -> (io::Result<OwnedFd>, String) {
    let mut log = vec![0u8; LOG_SIZE];
    attr.log_level = level;
    attr.log_size = LOG_SIZE as u32;
    attr.log_buf = log.as_mut_ptr() as u64;
    let result = prog_load(attr);
    attr.log_buf = 0;
    (result, log_text(&log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_layout_matches_the_kernel() {
        assert_eq!(std::mem::offset_of!(BtfLoadAttr, btf_log_level), 24);
        assert_eq!(size_of::<BtfLoadAttr>(), 32);
    }
}
