//! Map operations aya 0.14 lacks. Taking entries out of a hash map at once:
//! BPF_MAP_LOOKUP_AND_DELETE_ELEM returns an entry's value as it is removed, so an update the BPF
//! side makes up to that moment is in the value memtrace gets, never lost between a read and a
//! delete (aya offers it only for queues and stacks). Reading and deleting many entries in one
//! call each (BPF_MAP_LOOKUP_BATCH, BPF_MAP_DELETE_BATCH, with buffers of at most 256 KiB): a full
//! stack table is read in a few hundred calls rather than a quarter of a million; an unwind
//! table's rows are written likewise (BPF_MAP_UPDATE_BATCH on an array). And an array value another
//! thread can write ([`ArrayCell`], its own descriptor of the map).

use std::{
    io,
    os::fd::{AsFd, AsRawFd, OwnedFd},
};

use anyhow::{Context, Result};
use aya::maps::{HashMap, Map, MapData};

const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
/// Entries per batch call at most: a hash bucket never holds more.
const BATCH: usize = 8192;
/// Entries per batch call at least (a bucket holding more would make a lookup fail, ENOSPC).
const MIN_BATCH: usize = 128;
/// A batch read's buffers at most, in bytes: a batch of stacks (1 KiB each) is 256 entries.
const BATCH_BYTES: usize = 256 * 1024;

/// Entries per batch read of keys `K` and values `V`.
fn batch_of<K, V>() -> usize {
    (BATCH_BYTES / (size_of::<K>() + size_of::<V>())).clamp(MIN_BATCH, BATCH)
}

/// `union bpf_attr` for the map element commands.
#[repr(C)]
struct ElementAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// What one pass over a map took out, and what it left in as it read it.
pub struct Taken<K, V> {
    pub taken: Vec<(K, V)>,
    pub left: Vec<(K, V)>,
}

/// Removes the entries of the hash map `map` for which `wanted` holds (judged on a read of the
/// entry) and returns each with its value as it was removed, and the others as they were read.
pub fn take_entries<K: aya::Pod, V: aya::Pod>(
    map: &Map,
    what: &str,
    wanted: impl Fn(&K, &V) -> bool,
) -> Result<Taken<K, V>> {
    let fd = hash_map_fd::<K, V>(map, what)?;
    let (wanted, left): (Vec<_>, Vec<_>) =
        dump::<K, V>(map, what)?.into_iter().partition(|(key, value)| wanted(key, value));
    let mut taken = Vec::with_capacity(wanted.len());
    for (key, _) in wanted {
        // Gone meanwhile (the BPF side never removes these, but a release may have).
        if let Some(value) = take(fd, &key).with_context(|| format!("taking an entry out of {what}"))? {
            taken.push((key, value));
        }
    }
    Ok(Taken { taken, left })
}

/// The value of `key`, removed from the map; None if it has no such key.
fn take<K: aya::Pod, V: aya::Pod>(fd: i32, key: &K) -> io::Result<Option<V>> {
    let mut value = std::mem::MaybeUninit::<V>::uninit();
    // SAFETY: `value` has room for a value of the map's size (checked in hash_map_fd).
    match unsafe { element_call(BPF_MAP_LOOKUP_AND_DELETE_ELEM, fd, key, value.as_mut_ptr().cast()) } {
        // SAFETY: the kernel wrote the value.
        Ok(()) => Ok(Some(unsafe { value.assume_init() })),
        Err(err) if err.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A map element command on `key`, with room for its value at `value`.
///
/// # Safety
/// `key` and `value` must be of the map's key and value sizes.
unsafe fn element_call<K>(command: libc::c_long, fd: i32, key: &K, value: *mut u8) -> io::Result<()> {
    let attr = ElementAttr {
        map_fd: fd as u32,
        _pad: 0,
        key: std::ptr::from_ref(key) as u64,
        value: value as u64,
        flags: 0,
    };
    // SAFETY: the attribute points to a key and to room for a value of the map's sizes (the
    // caller's promise), both live for the call.
    let result = unsafe {
        libc::syscall(libc::SYS_bpf, command, std::ptr::from_ref(&attr), size_of::<ElementAttr>() as u32)
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// One u32 of a BPF array, written from any thread (its own descriptor of the map).
pub struct ArrayCell {
    fd: OwnedFd,
    index: u32,
}

impl ArrayCell {
    pub fn of(map: &Map, what: &str, index: u32) -> Result<Self> {
        let Map::Array(data) = map else { anyhow::bail!("{what} is not an array") };
        // Checks the value size against the map's.
        let _: aya::maps::Array<&MapData, u32> = aya::maps::Array::try_from(map)?;
        let fd = data.fd().as_fd().try_clone_to_owned().with_context(|| format!("duplicating {what}"))?;
        Ok(Self { fd, index })
    }

    pub fn set(&self, mut value: u32) -> io::Result<()> {
        // SAFETY: a u32 index and a u32 value, the array's sizes (checked in `of`).
        unsafe {
            element_call(BPF_MAP_UPDATE_ELEM, self.fd.as_raw_fd(), &self.index, (&raw mut value).cast())
        }
    }
}

/// `union bpf_attr` for the batch commands.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

fn hash_map_fd<K: aya::Pod, V: aya::Pod>(map: &Map, what: &str) -> Result<i32> {
    let (Map::HashMap(data) | Map::LruHashMap(data)) = map else {
        anyhow::bail!("{what} is not a hash map");
    };
    // Checks the key and value sizes against the map's.
    let _: HashMap<&MapData, K, V> = HashMap::try_from(map)?;
    Ok(data.fd().as_fd().as_raw_fd())
}

fn bpf_batch(command: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: the attribute's pointers lead to buffers of `count` keys and values of the map's
    // sizes (checked in hash_map_fd) and to an 8-byte batch token, all live for the call.
    let result = unsafe {
        libc::syscall(libc::SYS_bpf, command, std::ptr::from_mut(attr), size_of::<BatchAttr>() as u32)
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Every entry of a hash map, read a batch at a time.
pub fn dump<K: aya::Pod, V: aya::Pod>(map: &Map, what: &str) -> Result<Vec<(K, V)>> {
    let fd = hash_map_fd::<K, V>(map, what)?;
    // Not zeroed: the kernel writes only the entries it returns.
    let batch = batch_of::<K, V>();
    let (mut keys, mut values) = (Box::<[K]>::new_uninit_slice(batch), Box::<[V]>::new_uninit_slice(batch));
    let (mut token, mut next) = (0u64, 0u64);
    let mut entries = Vec::new();
    for first in std::iter::once(true).chain(std::iter::repeat(false)) {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { std::ptr::from_ref(&token) as u64 },
            out_batch: std::ptr::from_mut(&mut next) as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: batch as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        let result = bpf_batch(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let read = (attr.count as usize).min(batch);
        // SAFETY: the kernel wrote the first `read` keys and values of the batch.
        let (read_keys, read_values) = unsafe {
            (
                std::slice::from_raw_parts(keys.as_ptr().cast::<K>(), read),
                std::slice::from_raw_parts(values.as_ptr().cast::<V>(), read),
            )
        };
        entries.extend(read_keys.iter().copied().zip(read_values.iter().copied()));
        match result {
            Ok(()) => token = next,
            // The end of the map.
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => return Ok(entries),
            Err(err) => return Err(err).with_context(|| format!("reading {what}")),
        }
    }
    unreachable!("the loop above ends only by returning")
}

/// Deletes `keys` from a hash map, a batch at a time; keys already gone are skipped.
pub fn delete<K: aya::Pod, V: aya::Pod>(map: &Map, what: &str, keys: &[K]) -> Result<()> {
    let fd = hash_map_fd::<K, V>(map, what)?;
    let mut rest = keys;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(BATCH)];
        let mut attr = BatchAttr {
            keys: chunk.as_ptr() as u64,
            count: chunk.len() as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        match bpf_batch(BPF_MAP_DELETE_BATCH, &mut attr) {
            Ok(()) => rest = &rest[chunk.len()..],
            // A key is gone already: the ones before it were deleted; go on after it.
            Err(err) if err.raw_os_error() == Some(libc::ENOENT) => {
                rest = &rest[(attr.count as usize + 1).min(rest.len())..]
            }
            Err(err) => return Err(err).with_context(|| format!("deleting entries of {what}")),
        }
    }
    Ok(())
}

/// Writes `values` into an array from index `first` on, a batch at a time.
pub fn set_array<V: aya::Pod>(map: &Map, what: &str, first: u32, values: &[V]) -> Result<()> {
    let fd = array_of::<V>(map, what)?.fd().as_fd().as_raw_fd();
    for (chunk_index, chunk) in values.chunks(BATCH).enumerate() {
        let start = first + (chunk_index * BATCH) as u32;
        let keys: Vec<u32> = (start..).take(chunk.len()).collect();
        let mut attr = BatchAttr {
            keys: keys.as_ptr() as u64,
            values: chunk.as_ptr() as u64,
            count: chunk.len() as u32,
            map_fd: fd as u32,
            ..BatchAttr::default()
        };
        bpf_batch(BPF_MAP_UPDATE_BATCH, &mut attr).with_context(|| format!("writing {what}"))?;
    }
    Ok(())
}

/// An array map whose values are `V`s (checked against the map's value size).
pub fn array_of<'a, V: aya::Pod>(map: &'a Map, what: &str) -> Result<&'a MapData> {
    let Map::Array(data) = map else {
        anyhow::bail!("{what} is not an array");
    };
    let _: aya::maps::Array<&MapData, V> = aya::maps::Array::try_from(map)?;
    Ok(data)
}
