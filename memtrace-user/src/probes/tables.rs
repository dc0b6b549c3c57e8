//! memtrace-ebpf's hash maps as userspace reads them: each map's name spelt once, with its key and
//! value types and what an error calls it, so that no map is read with another's types and every
//! read of a whole map goes a batch at a time (map_ops.rs) rather than a syscall per key.

use std::{collections::HashSet, marker::PhantomData};

use anyhow::{Context, Result};
use aya::{
    maps::{HashMap, Map, MapData, MapError},
    Ebpf,
};
use memtrace_common::{
    ProcessStats, Region, RegionKey, StackFrames, StackKey, StackTotals, SubsystemKey, UsdtCounterKey,
    UsdtCounterValue,
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
/// Stacks in build-ID form, by hash.
pub const STACKS: Table<u64, StackFrames> = Table::new("STACKS", "the stack map");
/// What each (process, stack) allocated and still holds.
pub const STACK_TOTALS: Table<StackKey, StackTotals> = Table::new("STACK_TOTALS", "the per-stack totals map");
/// Anonymous mappings followed.
pub const REGIONS: Table<RegionKey, Region> = Table::new("REGIONS", "the mapping map");
/// USDT subsystem counters.
pub const SUBSYSTEMS: Table<SubsystemKey, i64> = Table::new("SUBSYSTEMS", "the USDT subsystem map");
/// `--usdt` counters.
pub const USDT_COUNTERS: Table<UsdtCounterKey, UsdtCounterValue> =
    Table::new("USDT_COUNTERS", "the --usdt counter map");

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
        format!("the BPF object has no map {}", self.name)
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

impl Table<u32, u8> {
    /// Whether the map has a key, from any thread (its own descriptor).
    pub fn key_lookup(&self, ebpf: &Ebpf) -> Result<map_ops::KeyLookup> {
        map_ops::KeyLookup::of(self.map(ebpf)?, self.what)
    }
}
