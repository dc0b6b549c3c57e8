//! `--perfetto PATH`: a native Perfetto trace (protobuf), written whole at the end of the run. Per
//! process a process track with a counter track per memory level and per USDT subsystem, a value at
//! every point of the process's timeline; and the heap profile as Perfetto's heap-profile packets
//! (interned mappings, frames, function names and call stacks, and what each call stack allocated
//! and freed), which Perfetto UI shows as a native-heap flamegraph.

use std::{
    collections::{BTreeSet, HashMap},
    fs::File,
    io::{BufWriter, Write},
    path::Path,
};

use anyhow::Result;

use super::{
    exporter::WholeFile,
    perfetto_proto::{self as proto, SEQ_INCREMENTAL_STATE_CLEARED, TYPE_COUNTER, UNIT_SIZE_BYTES},
};
use crate::model::{frame::Frame, levels::MemoryLevels, Model, Process, RunEnd, StackProfile};

/// Every packet memtrace writes is on this one sequence, so the heap profile's interned data is
/// in scope for it.
const SEQUENCE: u32 = 1;

/// The heap name the profile is filed under, as heapprofd names the libc allocator's.
const HEAP_NAME: &str = "malloc";

/// `--perfetto`'s file.
pub struct Perfetto;

impl WholeFile for Perfetto {
    const WHAT: &'static str = "Perfetto trace";
    const OPTION: &'static str = "--perfetto";

    fn written(path: &Path) -> String {
        format!("Perfetto trace written to {} (open it in Perfetto UI)", path.display())
    }

    fn write(model: &Model, end: RunEnd, file: &mut File) -> Result<()> {
        let mut out = BufWriter::new(file);
        write_trace(model, end, &mut out)?;
        Ok(out.flush()?)
    }
}

/// Writes the whole trace, packet by packet as each is made (a long run has millions of counter
/// values; none is held longer than its own encoding): track descriptors and counter values per
/// process, then the heap profile. A trace is its packets one after the other, each field 1.
pub fn write_trace(model: &Model, end: RunEnd, out: &mut impl Write) -> std::io::Result<()> {
    let mut buffer = Vec::new();
    let mut write = |packet: proto::TracePacket| {
        buffer.clear();
        prost::encoding::message::encode(1, &packet, &mut buffer);
        out.write_all(&buffer)
    };
    let mut first = clock_snapshot();
    first.sequence_flags = SEQ_INCREMENTAL_STATE_CLEARED;
    first.first_packet_on_sequence = true;
    write(first)?;
    let mut uuids = 0u64;
    for process in model.every_process() {
        counter_tracks(process, &mut uuids, &mut write)?;
    }
    match heap_profile(model, end.duration.as_nanos() as u64) {
        Some(profile) => write(profile),
        None => Ok(()),
    }
}

/// Every timestamp memtrace writes counts from the start of tracing, on every clock: the packets'
/// (BOOTTIME, the trace's clock) and the heap profile's (MONOTONIC_COARSE, as heapprofd's) are
/// one timebase, which the trace processor learns from this snapshot.
fn clock_snapshot() -> proto::TracePacket {
    let clocks = [proto::CLOCK_BOOTTIME, proto::CLOCK_MONOTONIC, proto::CLOCK_MONOTONIC_COARSE]
        .map(|clock_id| proto::Clock { clock_id, timestamp: Some(0) })
        .to_vec();
    proto::TracePacket { clock_snapshot: Some(proto::ClockSnapshot { clocks }), ..packet() }
}

fn packet() -> proto::TracePacket {
    proto::TracePacket { trusted_packet_sequence_id: Some(SEQUENCE), ..Default::default() }
}

fn descriptor_packet(descriptor: proto::TrackDescriptor) -> proto::TracePacket {
    proto::TracePacket { track_descriptor: Some(descriptor), ..packet() }
}

/// The process's track, a counter track per level and per subsystem it ever reported, and a
/// value on each at every point of its timeline (a subsystem from the point it was first reported).
fn counter_tracks(
    process: &Process,
    uuids: &mut u64,
    write: &mut impl FnMut(proto::TracePacket) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut next_uuid = || {
        *uuids += 1;
        *uuids
    };
    let process_uuid = next_uuid();
    write(descriptor_packet(proto::TrackDescriptor {
        uuid: process_uuid,
        process: Some(proto::ProcessDescriptor {
            pid: process.identity.pid as i32,
            process_name: process.identity.display_name(),
        }),
        ..Default::default()
    }))?;
    let subsystems: BTreeSet<&String> = process.timeline.iter().flat_map(|p| p.subsystems.keys()).collect();
    let names = MemoryLevels::NAMES.iter().map(|level| level.to_string());
    let names = names.chain(subsystems.iter().map(|name| format!("subsystem:{name}")));
    let mut tracks = HashMap::new();
    for name in names {
        let uuid = next_uuid();
        write(descriptor_packet(proto::TrackDescriptor {
            uuid,
            parent_uuid: process_uuid,
            name: name.clone(),
            counter: Some(proto::CounterDescriptor { unit: UNIT_SIZE_BYTES }),
            ..Default::default()
        }))?;
        tracks.insert(name, uuid);
    }
    let value = |track_uuid: u64, ts_us: u64, value: i64| proto::TracePacket {
        timestamp: Some(ts_us * 1000),
        track_event: Some(proto::TrackEvent { r#type: TYPE_COUNTER, track_uuid, counter_value: Some(value) }),
        ..packet()
    };
    for point in &process.timeline {
        for (level, bytes) in
            point.memory.named().into_iter().filter_map(|(level, bytes)| Some((level, bytes?)))
        {
            write(value(tracks[level], point.ts_us, i64::try_from(bytes).unwrap_or(i64::MAX)))?;
        }
        for (name, &bytes) in &point.subsystems {
            write(value(tracks[&format!("subsystem:{name}")], point.ts_us, bytes))?;
        }
    }
    Ok(())
}

/// One profile packet with every process's call stacks, and the interned data they refer to; none
/// when no process has stacks (`--no-stacks`).
fn heap_profile(model: &Model, end_ns: u64) -> Option<proto::TracePacket> {
    let mut interner = Interner::default();
    let mut dumps = Vec::new();
    for process in model.every_process().filter(|p| !p.stacks.is_empty()) {
        // One sample per call stack: stacks that symbolize alike are one.
        let mut samples: Vec<proto::HeapSample> = Vec::new();
        let mut index_of = HashMap::new();
        for stack in &process.stacks {
            let callstack_id = interner.callstack(&stack.frames);
            let at = *index_of.entry(callstack_id).or_insert_with(|| {
                samples.push(proto::HeapSample { callstack_id, ..Default::default() });
                samples.len() - 1
            });
            add_stack(&mut samples[at], stack);
        }
        dumps.push(proto::ProcessHeapSamples {
            pid: u64::from(process.identity.pid),
            samples,
            timestamp: end_ns,
            heap_name: HEAP_NAME.into(),
        });
    }
    if dumps.is_empty() {
        return None;
    }
    Some(proto::TracePacket {
        timestamp: Some(end_ns),
        interned_data: Some(interner.data),
        profile_packet: Some(proto::ProfilePacket { process_dumps: dumps }),
        ..packet()
    })
}

/// A stack's figures over the run: what it allocated, and what of that was freed again.
fn add_stack(sample: &mut proto::HeapSample, stack: &StackProfile) {
    let totals = &stack.totals;
    let live_bytes = u64::try_from(totals.live_bytes).unwrap_or(0);
    let live_allocations = u64::try_from(totals.live_allocations).unwrap_or(0);
    sample.self_allocated += totals.allocated_bytes;
    sample.self_freed += totals.allocated_bytes.saturating_sub(live_bytes);
    sample.alloc_count += totals.allocations;
    sample.free_count += totals.allocations.saturating_sub(live_allocations);
}

/// Interns strings, mappings, frames and call stacks as `InternedData` wants them: each once, by an
/// iid from 1.
#[derive(Default)]
struct Interner {
    data: proto::InternedData,
    function_names: HashMap<String, u64>,
    mapping_paths: HashMap<String, u64>,
    mappings: HashMap<String, u64>,
    frames: HashMap<(String, u64, String), u64>,
    callstacks: HashMap<Vec<u64>, u64>,
}

/// The iid of `text` in `table`, added when new.
fn intern_string(table: &mut Vec<proto::InternedString>, ids: &mut HashMap<String, u64>, text: &str) -> u64 {
    if let Some(&iid) = ids.get(text) {
        return iid;
    }
    let iid = table.len() as u64 + 1;
    table.push(proto::InternedString { iid, str: text.as_bytes().to_vec() });
    ids.insert(text.to_owned(), iid);
    iid
}

impl Interner {
    /// A mapping per object file, named by its path's components. memtrace's frames carry no
    /// build ID, so every mapping has the empty one.
    fn mapping(&mut self, module: &str) -> u64 {
        if let Some(&iid) = self.mappings.get(module) {
            return iid;
        }
        if self.data.build_ids.is_empty() {
            self.data.build_ids.push(proto::InternedString { iid: 1, str: Vec::new() });
        }
        let path_string_ids = module
            .split('/')
            .filter(|part| !part.is_empty())
            .map(|part| intern_string(&mut self.data.mapping_paths, &mut self.mapping_paths, part))
            .collect();
        let iid = self.data.mappings.len() as u64 + 1;
        self.data.mappings.push(proto::Mapping { iid, build_id: 1, path_string_ids });
        self.mappings.insert(module.to_owned(), iid);
        iid
    }

    fn frame(&mut self, frame: &Frame) -> u64 {
        let name = frame.name();
        let key = (frame.module.clone(), frame.offset, name);
        if let Some(&iid) = self.frames.get(&key) {
            return iid;
        }
        let function_name_id = intern_string(&mut self.data.function_names, &mut self.function_names, &key.2);
        let mapping_id = self.mapping(&frame.module);
        let iid = self.data.frames.len() as u64 + 1;
        self.data.frames.push(proto::Frame { iid, function_name_id, mapping_id, rel_pc: frame.offset });
        self.frames.insert(key, iid);
        iid
    }

    /// `frames` innermost first, as the model keeps them; Perfetto wants the outermost first.
    fn callstack(&mut self, frames: &[std::sync::Arc<Frame>]) -> u64 {
        let frame_ids: Vec<u64> = frames.iter().rev().map(|frame| self.frame(frame)).collect();
        if let Some(&iid) = self.callstacks.get(&frame_ids) {
            return iid;
        }
        let iid = self.data.callstacks.len() as u64 + 1;
        self.data.callstacks.push(proto::Callstack { iid, frame_ids: frame_ids.clone() });
        self.callstacks.insert(frame_ids, iid);
        iid
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, sync::Arc, time::Duration};

    use memtrace_common::StackTotals;

    use prost::Message;

    use super::*;
    use crate::model::TimelinePoint;

    fn frame(name: &str, offset: u64) -> Arc<Frame> {
        Arc::new(Frame {
            function: Some(name.into()),
            file: None,
            line: None,
            module: "/usr/bin/app".into(),
            offset,
            interpreter: None,
        })
    }

    fn stack(
        frames: Vec<Arc<Frame>>,
        allocations: u64,
        allocated: u64,
        live: i64,
        live_count: i64,
    ) -> StackProfile {
        StackProfile {
            frames,
            totals: StackTotals {
                allocations,
                allocated_bytes: allocated,
                live_allocations: live_count,
                live_bytes: live,
                ..StackTotals::default()
            },
            leaked_bytes: 0,
            leaked_allocations: 0,
            oldest_age: None,
        }
    }

    fn model() -> Model {
        let mut model = Model::default();
        model.add_process(
            crate::model::identity::ProcessIdentity::new(7, "app".into()),
            "/lib/libc.so.6".into(),
        );
        let process = model.processes.get_mut(&7).unwrap();
        let memory =
            |live| MemoryLevels { heap_live_bytes: live, rss_anon_bytes: 1 << 20, ..Default::default() };
        process.timeline = vec![
            TimelinePoint { ts_us: 100, memory: memory(0), subsystems: BTreeMap::new() },
            TimelinePoint {
                ts_us: 200,
                memory: memory(5768),
                subsystems: [("textures".to_string(), 4096)].into_iter().collect(),
            },
        ];
        process.stacks = vec![
            stack(vec![frame("leak", 0x10), frame("main", 0x20)], 5, 5000, 5000, 5),
            stack(vec![frame("scratch", 0x30), frame("main", 0x20)], 20, 6660, 0, 0),
            // The same functions at the same offsets: one call stack.
            stack(vec![frame("leak", 0x10), frame("main", 0x20)], 1, 100, 0, 0),
        ];
        model
    }

    /// The trace of `model` as a file holds it, decoded.
    fn build_trace(model: &Model, end: RunEnd) -> proto::Trace {
        let mut bytes = Vec::new();
        write_trace(model, end, &mut bytes).unwrap();
        proto::Trace::decode(&*bytes).unwrap()
    }

    #[test]
    fn counter_tracks_carry_every_level_and_subsystem_at_every_point() {
        let decoded = build_trace(&model(), RunEnd { duration: Duration::from_millis(300) });
        assert_eq!(decoded.packet[0].sequence_flags, SEQ_INCREMENTAL_STATE_CLEARED);
        assert!(decoded.packet[0].clock_snapshot.is_some());
        let first = &decoded.packet[1];
        assert!(decoded.packet.iter().all(|p| p.trusted_packet_sequence_id == Some(SEQUENCE)));
        let process = first.track_descriptor.as_ref().unwrap().process.as_ref().unwrap();
        assert_eq!((process.pid, process.process_name.as_str()), (7, "app"));
        let tracks: HashMap<u64, String> = decoded
            .packet
            .iter()
            .filter_map(|p| p.track_descriptor.as_ref())
            .filter(|d| d.counter.is_some())
            .map(|d| (d.uuid, d.name.clone()))
            .collect();
        assert_eq!(tracks.len(), 15 + 1, "fifteen levels and one subsystem");
        let values: Vec<(String, u64, i64)> = decoded
            .packet
            .iter()
            .filter_map(|p| {
                let event = p.track_event.as_ref()?;
                Some((tracks[&event.track_uuid].clone(), p.timestamp?, event.counter_value?))
            })
            .collect();
        // The free pool and the rounding were never measured: unknown, so not written.
        assert_eq!(values.len(), 13 + 13 + 1);
        assert!(values.contains(&("heap_live_bytes".into(), 100_000, 0)), "a zero is written too");
        assert!(values.contains(&("heap_live_bytes".into(), 200_000, 5768)));
        assert!(values.contains(&("subsystem:textures".into(), 200_000, 4096)));
    }

    #[test]
    fn heap_profile_interns_frames_and_sums_stacks_that_are_one() {
        let trace = build_trace(&model(), RunEnd { duration: Duration::from_millis(300) });
        let profile = trace.packet.iter().find(|p| p.profile_packet.is_some()).unwrap();
        assert_eq!(profile.timestamp, Some(300_000_000));
        let interned = profile.interned_data.as_ref().unwrap();
        let names: Vec<&[u8]> = interned.function_names.iter().map(|s| s.str.as_slice()).collect();
        assert_eq!(names, [&b"main"[..], b"leak", b"scratch"]);
        let paths: Vec<&[u8]> = interned.mapping_paths.iter().map(|s| s.str.as_slice()).collect();
        assert_eq!(paths, [&b"usr"[..], b"bin", b"app"]);
        assert_eq!(interned.mappings.len(), 1);
        assert_eq!(interned.frames.len(), 3);
        assert_eq!(interned.callstacks.len(), 2);
        assert_eq!(interned.callstacks[0].frame_ids, [1, 2], "main first, then leak");
        let dump = &profile.profile_packet.as_ref().unwrap().process_dumps[0];
        assert_eq!((dump.pid, dump.heap_name.as_str()), (7, "malloc"));
        assert_eq!(dump.samples.len(), 2);
        let leak = &dump.samples[0];
        assert_eq!(
            (leak.callstack_id, leak.self_allocated, leak.self_freed, leak.alloc_count, leak.free_count),
            (1, 5100, 100, 6, 1)
        );
        let scratch = &dump.samples[1];
        assert_eq!((scratch.self_allocated, scratch.self_freed, scratch.free_count), (6660, 6660, 20));
    }

    #[test]
    fn no_stacks_no_profile_packet() {
        let mut model = model();
        model.processes.get_mut(&7).unwrap().stacks.clear();
        let trace = build_trace(&model, RunEnd { duration: Duration::from_secs(1) });
        assert!(trace.packet.iter().all(|p| p.profile_packet.is_none() && p.interned_data.is_none()));
    }
}
