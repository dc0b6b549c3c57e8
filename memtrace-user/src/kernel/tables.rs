//! memtrace-ebpf's maps as userspace reads them: each map's name spelt once, here, with its key and
//! value types and what an error calls it, so that no map is read with another's types and every
//! read of a whole map goes a batch at a time (map_ops.rs) rather than a syscall per key. Hash maps
//! are [`Table`]s, arrays [`ArrayTable`]s, the exec ring buffer a [`RingTable`]; nothing else in
//! memtrace opens a map by name.

use std::{collections::HashSet, marker::PhantomData};

use anyhow::{Context, Result};
use aya::{
    maps::{Array, HashMap, Map, MapData, MapError, RingBuf},
    Ebpf,
};
use memtrace_common::{
    AllocatorCode, DeepStackFrames, DumpRound, ImageKey, InterpreterCodeKey, LiveSlot, PerlProcess, PerlSub,
    ProcessStats, PythonCode, PythonProcess, Region, RegionKey, StackFrames, StackKey, StackTotals,
    SubsystemKey, SubsystemValue, ThreadSlot, UnwindFile, UnwindMappings, UnwindRow, UsdtCounterKey,
    UsdtCounterValue, UsdtSpec,
};

use super::map_ops::{self, Taken};

/// A BPF hash map of memtrace-ebpf: its name, its key and value types, and what to call it.
pub struct Table<K, V> {
    pub name: &'static str,
    what: &'static str,
    types: PhantomData<fn() -> (K, V)>,
}

/// Per-process figures, by tgid.
pub const STATS: Table<u32, ProcessStats> = Table::new("STATS", "the per-process statistics map");
/// Processes traced by name (`--pid`, a command and, with a tree, its descendants).
pub const TARGETS: Table<u32, u8> = Table::new("TARGETS", "the map of traced processes");
/// Pids `--all` leaves out.
pub const EXCLUDED_PIDS: Table<u32, u8> = Table::new("EXCLUDED_PIDS", "the map of excluded pids");
/// The command names `--comm` allows.
pub const ALLOWED_COMMS: Table<[u8; 16], u8> = Table::new("ALLOWED_COMMS", "the map of --comm names");
/// The cgroup ids `--container` and `--cgroup` allow, with their descendants.
pub const ALLOWED_CGROUPS: Table<u64, u8> = Table::new("ALLOWED_CGROUPS", "the map of traced cgroups");
/// Stacks in build-ID form, by hash: those of at most `SHALLOW_STACK_DEPTH` frames.
pub const STACKS: Table<u64, StackFrames> = Table::new("STACKS", "the stack map");
/// The deeper stacks, the same way.
pub const DEEP_STACKS: Table<u64, DeepStackFrames> = Table::new("DEEP_STACKS", "the deep stack map");
/// What each (process, stack) allocated and still holds.
pub const STACK_TOTALS: Table<StackKey, StackTotals> = Table::new("STACK_TOTALS", "the per-stack totals map");
/// Anonymous mappings followed.
pub const REGIONS: Table<RegionKey, Region> = Table::new("REGIONS", "the mapping map");
/// USDT subsystem counters, with their values in the last dump rounds that reported them.
pub const SUBSYSTEMS: Table<SubsystemKey, SubsystemValue> =
    Table::new("SUBSYSTEMS", "the USDT subsystem map");
/// The dump rounds of each thread that runs them (include/memtrace.h's dumpers), by pid_tgid.
pub const DUMP_ROUNDS: Table<u64, DumpRound> = Table::new("DUMP_ROUNDS", "the USDT dump round map");
/// `--usdt` counters.
pub const USDT_COUNTERS: Table<UsdtCounterKey, UsdtCounterValue> =
    Table::new("USDT_COUNTERS", "the --usdt counter map");
/// Each traced process's executable mappings, naming unwind file slots (memtrace-ebpf/src/stacks.rs).
pub const UNWIND_MAPPINGS: Table<u32, UnwindMappings> =
    Table::new("UNWIND_MAPPINGS", "the unwind mapping tables");

/// Unwind file slots by the file's kernel name, for the unwinder's lookups of the kernel's own
/// mappings (memtrace-ebpf/src/vma.rs).
pub const UNWIND_FILE_SLOTS: Table<ImageKey, u32> =
    Table::new("UNWIND_FILE_SLOTS", "the unwind file slots by file");

/// Each CPython process's runtime address and layout (memtrace-ebpf/src/interpreters/python.rs).
pub const PYTHON_PROCESSES: Table<u32, PythonProcess> =
    Table::new("PYTHON_PROCESSES", "the map of Python processes");
/// The names of the Python code objects stacks hold.
pub const PYTHON_CODES: Table<InterpreterCodeKey, PythonCode> =
    Table::new("PYTHON_CODES", "the map of Python code objects");
/// Each Perl process's `PL_curinterp` address and layout (memtrace-ebpf/src/interpreters/perl.rs).
pub const PERL_PROCESSES: Table<u32, PerlProcess> = Table::new("PERL_PROCESSES", "the map of Perl processes");
/// The names of the Perl subs (and files) stacks hold.
pub const PERL_SUBS: Table<InterpreterCodeKey, PerlSub> = Table::new("PERL_SUBS", "the map of Perl subs");

/// Program files whose execs need no stop (their allocators are probed), as the kernel names them.
pub const KNOWN_IMAGES: Table<ImageKey, u8> = Table::new("KNOWN_IMAGES", "the map of known programs");

/// A BPF array of memtrace-ebpf: its name, its value type, and what to call it.
pub struct ArrayTable<V> {
    pub name: &'static str,
    pub what: &'static str,
    types: PhantomData<fn() -> V>,
}

/// Events that could not be charged to any process, at `GLOBAL_LOST_SLOT`.
pub const LOST_EVENTS: ArrayTable<u64> = ArrayTable::new("LOST_EVENTS", "the lost-event counter");
/// Each allocator's code around its free probe (memtrace-ebpf/src/stacks.rs).
pub const ALLOCATOR_CODES: ArrayTable<AllocatorCode> =
    ArrayTable::new("ALLOCATOR_CODES", "the allocators' code ranges");
/// USDT reports that found no room, at `USDT_LOST_SLOT`.
pub const USDT_LOST_EVENTS: ArrayTable<u64> =
    ArrayTable::new("USDT_LOST_EVENTS", "the USDT lost-event counter");
/// The uses of every attached USDT site, which a site's cookie indexes.
pub const USDT_SPECS: ArrayTable<UsdtSpec> = ArrayTable::new("USDT_SPECS", "the USDT site specs");
/// The live-allocation table's slots (memtrace-ebpf/src/live.rs), mapped by live_table.rs.
pub const LIVE_SLOTS: ArrayTable<LiveSlot> = ArrayTable::new("ALLOCATIONS", "the live-allocation table");
/// The live-allocation table's record count.
pub const LIVE_RECORDS: ArrayTable<u64> = ArrayTable::new("LIVE_RECORDS", "the live-allocation count");
/// Every unwind file slot's state and table.
pub const UNWIND_FILES: ArrayTable<UnwindFile> = ArrayTable::new("UNWIND_FILES", "the unwind file slots");
/// The rows of every loaded unwind table.
pub const UNWIND_ROWS: ArrayTable<UnwindRow> = ArrayTable::new("UNWIND_ROWS", "the unwind rows");
/// The page indices of every loaded unwind table.
pub const UNWIND_PAGES: ArrayTable<u32> = ArrayTable::new("UNWIND_PAGES", "the unwind pages");
/// The unwind tables' epoch (memtrace-ebpf/src/stack_read.rs), at index 0.
pub const UNWIND_EPOCH: ArrayTable<u64> = ArrayTable::new("UNWIND_EPOCH", "the unwind tables' epoch");

/// Whether the exec tracepoint stops programs not known yet, at index 0 (1: it does).
pub const HOLD_EXECS: ArrayTable<u32> = ArrayTable::new("HOLD_EXECS", "the exec hold switch");

/// `--window`'s generation, at `WINDOW_SLOT`: odd while a window is open (memtrace-ebpf/src/windowed.rs).
pub const WINDOW_GENERATION: ArrayTable<u32> =
    ArrayTable::new("WINDOW_GENERATION", "the window generation counter");

/// Each traced thread's allocator state, tagged with its tid (memtrace-ebpf/src/threads.rs).
pub const THREAD_SLOTS: ArrayTable<ThreadSlot> = ArrayTable::new("THREAD_SLOTS", "the thread slot array");

/// The ring buffer that announces the execs of traced processes.
pub const EXEC_EVENTS: RingTable = RingTable { name: "EXEC_EVENTS" };
/// The ring buffer that announces the OOM killer's victims (memtrace-ebpf/src/oom.rs).
pub const OOM_EVENTS: RingTable = RingTable { name: "OOM_EVENTS" };

/// A BPF ring buffer of memtrace-ebpf, by name.
pub struct RingTable {
    pub name: &'static str,
}

impl<K, V> Table<K, V> {
    const fn new(name: &'static str, what: &'static str) -> Self {
        Self { name, what, types: PhantomData }
    }
}

impl<K: aya::Pod, V: aya::Pod> Table<K, V> {
    fn map<'a>(&self, ebpf: &'a Ebpf) -> Result<&'a Map> {
        ebpf.map(self.name).with_context(|| self.missing())
    }

    fn missing(&self) -> String {
        missing(self.name)
    }

    /// The map, typed, for updates.
    pub fn writable<'a>(&self, ebpf: &'a mut Ebpf) -> Result<HashMap<&'a mut MapData, K, V>> {
        let map = ebpf.map_mut(self.name).with_context(|| self.missing())?;
        HashMap::try_from(map).with_context(|| format!("opening {}", self.what))
    }

    /// The value of `key`, if the map has it.
    pub fn get(&self, ebpf: &Ebpf, key: &K) -> Result<Option<V>> {
        let map: HashMap<&MapData, K, V> = HashMap::try_from(self.map(ebpf)?)?;
        match map.get(key, 0) {
            Ok(value) => Ok(Some(value)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(err) => Err(err).with_context(|| format!("reading {}", self.what)),
        }
    }

    /// Every entry.
    pub fn entries(&self, ebpf: &Ebpf) -> Result<Vec<(K, V)>> {
        map_ops::dump(self.map(ebpf)?, self.what)
    }

    /// Takes out the entries `wanted` holds for (see `map_ops::take_entries`).
    pub fn take(&self, ebpf: &Ebpf, wanted: impl Fn(&K, &V) -> bool) -> Result<Taken<K, V>> {
        map_ops::take_entries(self.map(ebpf)?, self.what, wanted)
    }

    /// Removes every entry whose key belongs to one of `tgids`.
    pub fn release(&self, ebpf: &Ebpf, tgids: &HashSet<u32>, tgid_of: impl Fn(&K) -> u32) -> Result<()> {
        let doomed: Vec<K> = self
            .entries(ebpf)?
            .into_iter()
            .map(|(key, _)| key)
            .filter(|key| tgids.contains(&tgid_of(key)))
            .collect();
        map_ops::delete::<K, V>(self.map(ebpf)?, self.what, &doomed)
    }
}

impl ArrayTable<u32> {
    /// The value at `index`, written from any thread (its own descriptor).
    pub fn cell(&self, ebpf: &Ebpf, index: u32) -> Result<map_ops::ArrayCell> {
        map_ops::ArrayCell::of(self.map(ebpf)?, self.what, index)
    }
}

impl<V> ArrayTable<V> {
    const fn new(name: &'static str, what: &'static str) -> Self {
        Self { name, what, types: PhantomData }
    }
}

impl<V: aya::Pod> ArrayTable<V> {
    /// The map, if the object has it.
    pub fn find<'a>(&self, ebpf: &'a Ebpf) -> Option<&'a Map> {
        ebpf.map(self.name)
    }

    fn map<'a>(&self, ebpf: &'a Ebpf) -> Result<&'a Map> {
        self.find(ebpf).with_context(|| missing(self.name))
    }

    /// The value at `index`.
    pub fn get(&self, ebpf: &Ebpf, index: u32) -> Result<V> {
        let array: Array<&MapData, V> = Array::try_from(self.map(ebpf)?)?;
        Ok(array.get(&index, 0)?)
    }

    /// Writes the value at `index`.
    pub fn set(&self, ebpf: &mut Ebpf, index: u32, value: &V) -> Result<()> {
        let map = ebpf.map_mut(self.name).with_context(|| missing(self.name))?;
        let mut array: Array<&mut MapData, V> = Array::try_from(map)?;
        Ok(array.set(index, value, 0)?)
    }

    /// Writes `values` from index `first` on, in a few syscalls.
    pub fn set_many(&self, ebpf: &Ebpf, first: u32, values: &[V]) -> Result<()> {
        map_ops::set_array(self.map(ebpf)?, self.what, first, values)
    }
}

impl RingTable {
    /// Takes the ring buffer out of the object, for a reader of its own.
    pub fn take(&self, ebpf: &mut Ebpf) -> Result<RingBuf<MapData>> {
        let map = ebpf.take_map(self.name).with_context(|| missing(self.name))?;
        Ok(RingBuf::try_from(map)?)
    }
}

fn missing(name: &str) -> String {
    format!("the BPF object has no map {name}")
}
