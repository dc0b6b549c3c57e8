//! The subset of Perfetto's trace format memtrace writes (github.com/google/perfetto,
//! protos/perfetto/trace/): trace.proto, trace_packet.proto, track_event/{track_descriptor,
//! process_descriptor, counter_descriptor, track_event}.proto, interned_data/interned_data.proto,
//! profiling/{profile_packet, profile_common}.proto, with the upstream field numbers. Fields in a
//! proto2 `oneof`, where absence means something, are `Option`s so that a zero is still written.
//! Enums are written as their numbers (`int32`), which is the same on the wire.

/// `Trace`: a file is a sequence of packets, each field 1. memtrace writes the packets one by one
/// (`perfetto::write_trace`); the tests read a file back whole with this.
#[cfg(test)]
#[derive(Clone, PartialEq, prost::Message)]
pub struct Trace {
    #[prost(message, repeated, tag = "1")]
    pub packet: Vec<TracePacket>,
}

/// `TracePacket.sequence_flags`: the sequence's interned data starts afresh with this packet.
pub const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
pub struct TracePacket {
    /// Nanoseconds (the default clock, BOOTTIME; memtrace's are since tracing began).
    #[prost(uint64, optional, tag = "8")]
    pub timestamp: Option<u64>,
    #[prost(message, optional, tag = "6")]
    pub clock_snapshot: Option<ClockSnapshot>,
    #[prost(message, optional, tag = "11")]
    pub track_event: Option<TrackEvent>,
    #[prost(message, optional, tag = "37")]
    pub profile_packet: Option<ProfilePacket>,
    #[prost(message, optional, tag = "60")]
    pub track_descriptor: Option<TrackDescriptor>,
    #[prost(uint32, optional, tag = "10")]
    pub trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "12")]
    pub interned_data: Option<InternedData>,
    #[prost(uint32, tag = "13")]
    pub sequence_flags: u32,
    #[prost(bool, tag = "87")]
    pub first_packet_on_sequence: bool,
}

/// `BuiltinClock` ids.
pub const CLOCK_MONOTONIC: u32 = 3;
pub const CLOCK_MONOTONIC_COARSE: u32 = 4;
pub const CLOCK_BOOTTIME: u32 = 6;

/// The readings of several clocks at one moment, which relate their timestamps to each other.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ClockSnapshot {
    #[prost(message, repeated, tag = "1")]
    pub clocks: Vec<Clock>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Clock {
    #[prost(uint32, tag = "1")]
    pub clock_id: u32,
    #[prost(uint64, optional, tag = "2")]
    pub timestamp: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackDescriptor {
    #[prost(uint64, tag = "1")]
    pub uuid: u64,
    #[prost(uint64, tag = "5")]
    pub parent_uuid: u64,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(message, optional, tag = "3")]
    pub process: Option<ProcessDescriptor>,
    #[prost(message, optional, tag = "8")]
    pub counter: Option<CounterDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessDescriptor {
    #[prost(int32, tag = "1")]
    pub pid: i32,
    #[prost(string, tag = "6")]
    pub process_name: String,
}

/// `CounterDescriptor.Unit.UNIT_SIZE_BYTES`.
pub const UNIT_SIZE_BYTES: i32 = 3;

#[derive(Clone, PartialEq, prost::Message)]
pub struct CounterDescriptor {
    /// `CounterDescriptor.Unit`.
    #[prost(int32, tag = "3")]
    pub unit: i32,
}

/// `TrackEvent.Type.TYPE_COUNTER`.
pub const TYPE_COUNTER: i32 = 4;

#[derive(Clone, PartialEq, prost::Message)]
pub struct TrackEvent {
    /// `TrackEvent.Type`.
    #[prost(int32, tag = "9")]
    pub r#type: i32,
    #[prost(uint64, tag = "11")]
    pub track_uuid: u64,
    #[prost(int64, optional, tag = "30")]
    pub counter_value: Option<i64>,
}

/// What a sequence's later packets refer to by interning id (`iid`, from 1).
#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedData {
    #[prost(message, repeated, tag = "5")]
    pub function_names: Vec<InternedString>,
    #[prost(message, repeated, tag = "6")]
    pub frames: Vec<Frame>,
    #[prost(message, repeated, tag = "7")]
    pub callstacks: Vec<Callstack>,
    #[prost(message, repeated, tag = "16")]
    pub build_ids: Vec<InternedString>,
    #[prost(message, repeated, tag = "17")]
    pub mapping_paths: Vec<InternedString>,
    #[prost(message, repeated, tag = "19")]
    pub mappings: Vec<Mapping>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct InternedString {
    #[prost(uint64, tag = "1")]
    pub iid: u64,
    #[prost(bytes = "vec", tag = "2")]
    pub str: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub iid: u64,
    /// An iid of `build_ids`.
    #[prost(uint64, tag = "2")]
    pub build_id: u64,
    /// iids of `mapping_paths`: the path's components.
    #[prost(uint64, repeated, packed = "false", tag = "7")]
    pub path_string_ids: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Frame {
    #[prost(uint64, tag = "1")]
    pub iid: u64,
    /// An iid of `function_names`.
    #[prost(uint64, tag = "2")]
    pub function_name_id: u64,
    /// An iid of `mappings`.
    #[prost(uint64, tag = "3")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "4")]
    pub rel_pc: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Callstack {
    #[prost(uint64, tag = "1")]
    pub iid: u64,
    /// iids of `frames`, outermost (the bottom of the stack) first.
    #[prost(uint64, repeated, packed = "false", tag = "2")]
    pub frame_ids: Vec<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProfilePacket {
    #[prost(message, repeated, tag = "5")]
    pub process_dumps: Vec<ProcessHeapSamples>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessHeapSamples {
    #[prost(uint64, tag = "1")]
    pub pid: u64,
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<HeapSample>,
    #[prost(uint64, tag = "9")]
    pub timestamp: u64,
    #[prost(string, tag = "11")]
    pub heap_name: String,
}

/// What one call stack allocated and freed, in bytes and in blocks, over the whole run.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeapSample {
    /// An iid of `callstacks`.
    #[prost(uint64, tag = "1")]
    pub callstack_id: u64,
    #[prost(uint64, tag = "2")]
    pub self_allocated: u64,
    #[prost(uint64, tag = "3")]
    pub self_freed: u64,
    #[prost(uint64, tag = "5")]
    pub alloc_count: u64,
    #[prost(uint64, tag = "6")]
    pub free_count: u64,
}
