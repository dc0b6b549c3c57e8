//! `--pprof PATH`: a gzipped profile.proto (github.com/google/pprof/blob/main/proto/profile.proto)
//! with the sample types alloc_objects, alloc_space, inuse_objects and inuse_space, one sample per
//! (process, call stack), labelled with the pid and command name.

use std::{collections::HashMap, fs::File, io::Write, time::Duration};

use anyhow::Result;
use flate2::{write::GzEncoder, Compression};
use prost::Message;

use super::{
    exporter::WholeFile,
    heap_profile::{self, Processes, DEFAULT_SAMPLE_TYPE, SAMPLE_TYPES},
};
use crate::model::{frame::Frame, identity::ProcessIdentity, Model, RunEnd};

/// `--pprof`'s file.
pub struct Pprof;

impl WholeFile for Pprof {
    const WHAT: &'static str = "pprof profile";
    const OPTION: &'static str = "--pprof";

    fn write(model: &Model, end: RunEnd, file: &mut File) -> Result<()> {
        Ok(write_gzipped(&build_profile(model, end.duration, Processes::All), file)?)
    }
}

/// Writes the profile as pprof files are kept and as Go's net/http/pprof serves them: gzipped.
pub fn write_gzipped(profile: &proto::Profile, out: impl Write) -> std::io::Result<()> {
    let mut gzip = GzEncoder::new(out, Compression::default());
    gzip.write_all(&profile.encode_to_vec())?;
    gzip.finish().map(drop)
}

/// The heap profile of the processes chosen, from the stacks the model holds, over `duration`.
pub fn build_profile(model: &Model, duration: Duration, processes: Processes) -> proto::Profile {
    let (mut builder, sample_type) = ProfileBuilder::with_sample_types(&SAMPLE_TYPES);
    let mut samples = Vec::new();
    for process in heap_profile::chosen(model, processes) {
        let labels = labels_of(&mut builder, &process.identity);
        for stack in heap_profile::samples(process) {
            samples.push(proto::Sample {
                location_id: stack.frames.iter().map(|f| builder.location(f)).collect(),
                value: stack.values.to_vec(),
                label: labels.clone(),
            });
        }
    }
    let period_type = Some(builder.value_type("space", "bytes"));
    let comment = heap_profile::estimate_note(model).map(|note| builder.string(&note)).into_iter().collect();
    proto::Profile {
        duration_nanos: duration.as_nanos() as i64,
        period_type,
        period: model.sampling.map_or(1, |sampling| sampling.mean_bytes as i64),
        comment,
        ..builder.finish(sample_type, samples, DEFAULT_SAMPLE_TYPE)
    }
}

/// One sample of [`profile_of`]: its frames innermost first, its values in the sample types'
/// order, and its string labels.
pub struct NamedSample<'a> {
    pub frames: Vec<Frame>,
    pub values: Vec<i64>,
    pub labels: Vec<(&'a str, &'a str)>,
}

/// A profile of any samples, of the sample types (kind, unit) given, `default` shown first.
pub fn profile_of<'a>(
    sample_types: &[(&str, &str)],
    default: &str,
    samples: impl IntoIterator<Item = NamedSample<'a>>,
) -> proto::Profile {
    let (mut builder, sample_type) = ProfileBuilder::with_sample_types(sample_types);
    let sample = samples
        .into_iter()
        .map(|sample| proto::Sample {
            location_id: sample.frames.iter().map(|f| builder.location(f)).collect(),
            value: sample.values,
            label: sample
                .labels
                .iter()
                .map(|(key, value)| proto::Label {
                    key: builder.string(key),
                    str: builder.string(value),
                    ..Default::default()
                })
                .collect(),
        })
        .collect();
    builder.finish(sample_type, sample, default)
}

/// A process's labels on its samples: the identity's, the pid as a number, the rest as strings
/// where known.
fn labels_of(builder: &mut ProfileBuilder, identity: &ProcessIdentity) -> Vec<proto::Label> {
    identity
        .labels()
        .into_iter()
        .filter(|(_, value)| !value.is_empty())
        .map(|(key, value)| match key {
            "pid" => {
                proto::Label { key: builder.string(key), num: i64::from(identity.pid), ..Default::default() }
            }
            _ => proto::Label { key: builder.string(key), str: builder.string(&value), ..Default::default() },
        })
        .collect()
}

/// Interns strings, functions and locations, as the format wants them referenced by index or id.
#[derive(Default)]
struct ProfileBuilder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<proto::Function>,
    function_ids: HashMap<(String, String), u64>,
    locations: Vec<proto::Location>,
    /// By the whole frame: an interpreter's frames share their module and may share an offset
    /// (the index of an instruction in each function's code).
    location_ids: HashMap<Frame, u64>,
}

impl ProfileBuilder {
    /// A builder whose string table starts with the empty string, as the format wants, and the
    /// sample types (kind, unit) interned in it.
    fn with_sample_types(types: &[(&str, &str)]) -> (Self, Vec<proto::ValueType>) {
        let mut builder = Self::default();
        builder.string("");
        let sample_type = types.iter().map(|(kind, unit)| builder.value_type(kind, unit)).collect();
        (builder, sample_type)
    }

    /// The profile of `sample`, of `sample_type`, `default` shown first; one sample a unit
    /// (`period` 1) until the caller says otherwise.
    fn finish(
        mut self,
        sample_type: Vec<proto::ValueType>,
        sample: Vec<proto::Sample>,
        default: &str,
    ) -> proto::Profile {
        let default_sample_type = self.string(default);
        proto::Profile {
            sample_type,
            sample,
            location: self.locations,
            function: self.functions,
            string_table: self.strings,
            period: 1,
            default_sample_type,
            ..Default::default()
        }
    }

    fn string(&mut self, text: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(text) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(text.to_owned());
        self.string_ids.insert(text.to_owned(), id);
        id
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> proto::ValueType {
        proto::ValueType { r#type: self.string(kind), unit: self.string(unit) }
    }

    fn function(&mut self, frame: &Frame) -> u64 {
        let name = frame.profile_function();
        let file = frame.file.clone().unwrap_or_default();
        if let Some(&id) = self.function_ids.get(&(name.clone(), file.clone())) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let (name_id, file_id) = (self.string(&name), self.string(&file));
        // An interpreter's function differs from its system name (`Frame::function_name`), which
        // go tool pprof takes as already demangled: it would cut `<module>` to nothing.
        let system_name = self.string(&frame.function_name());
        self.functions.push(proto::Function {
            id,
            name: name_id,
            system_name,
            filename: file_id,
            start_line: 0,
        });
        self.function_ids.insert((name, file), id);
        id
    }

    fn location(&mut self, frame: &Frame) -> u64 {
        if let Some(&id) = self.location_ids.get(frame) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        let function_id = self.function(frame);
        self.locations.push(proto::Location {
            id,
            mapping_id: 0,
            address: frame.offset,
            line: vec![proto::Line { function_id, line: frame.line.map_or(0, i64::from) }],
        });
        self.location_ids.insert(frame.clone(), id);
        id
    }
}

/// The subset of profile.proto memtrace writes, with the upstream field numbers.
pub mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        /// Indices into string_table: free-form notes (here: that values are sampled estimates).
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
        #[prost(int64, tag = "3")]
        pub num: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
        #[prost(int64, tag = "4")]
        pub filename: i64,
        #[prost(int64, tag = "5")]
        pub start_line: i64,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use memtrace_common::StackTotals;

    use super::*;
    use crate::model::StackProfile;

    #[test]
    fn profile_round_trips_with_interned_strings_and_locations() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(9, "app".into()), "/libc".into());
        let frame = |name: &str, offset| {
            std::sync::Arc::new(Frame {
                function: Some(name.into()),
                file: Some("app.c".into()),
                line: Some(3),
                module: "/app".into(),
                offset,
                interpreter: None,
            })
        };
        let totals = StackTotals {
            allocations: 4,
            allocated_bytes: 400,
            live_allocations: 1,
            live_bytes: 100,
            ..StackTotals::default()
        };
        let stack = |frames| StackProfile {
            frames,
            totals,
            leaked_bytes: 0,
            leaked_allocations: 0,
            oldest_age: None,
        };
        model.processes.get_mut(&9).unwrap().stacks =
            vec![stack(vec![frame("leak", 0x10), frame("main", 0x20)]), stack(vec![frame("main", 0x30)])];
        let profile = build_profile(&model, Duration::from_secs(1), Processes::All);
        let decoded = proto::Profile::decode(&*profile.encode_to_vec()).unwrap();
        assert_eq!(decoded, profile);
        assert_eq!(decoded.string_table[0], "");
        let types: Vec<&str> =
            decoded.sample_type.iter().map(|t| decoded.string_table[t.r#type as usize].as_str()).collect();
        assert_eq!(types, ["alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]);
        assert_eq!(decoded.sample.len(), 2);
        assert_eq!(decoded.sample[0].value, [4, 400, 1, 100]);
        assert_eq!(decoded.location.len(), 3, "one location per distinct frame");
        assert_eq!(decoded.function.len(), 2, "main is one function at two offsets");
        assert_eq!(build_profile(&model, Duration::ZERO, Processes::One(9)).sample.len(), 2);
        assert!(build_profile(&model, Duration::ZERO, Processes::One(8)).sample.is_empty());
    }
}
