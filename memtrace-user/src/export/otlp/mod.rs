//! `--otlp PATH`: the run's heap profile as an OpenTelemetry profiles request
//! (`ExportProfilesServiceRequest` of opentelemetry-proto's `profiles/v1development`, protobuf), the
//! body `memtrace serve --otlp-endpoint` POSTs too. One ResourceProfiles per process (resource.rs),
//! one Profile per sample type (alloc_objects, alloc_space, inuse_objects, inuse_space), all sharing
//! one ProfilesDictionary (dictionary.rs). Sampling is stated as the proto asks: period_type
//! (allocated_bytes, bytes) with period 1 when every allocation is recorded, or `--sample`'s mean
//! distance when sampled; the profile attribute `memtrace.sampling` says what makes the values
//! estimates (`--sample`'s scaling, or `--app-sampled`'s allocator samples), as pprof's comment does.

mod dictionary;
pub mod resource;

use std::{
    fs::File,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Result;
use opentelemetry_proto::tonic::{
    collector::profiles::v1development::ExportProfilesServiceRequest,
    common::v1::{any_value::Value, AnyValue, InstrumentationScope},
    profiles::v1development::{Profile, ResourceProfiles, Sample, ScopeProfiles, ValueType},
};
use prost::Message;

use self::dictionary::Dictionary;
use super::{
    exporter::WholeFile,
    heap_profile::{self, Processes, SAMPLE_TYPES},
};
use crate::model::{Model, Process, RunEnd};

/// `--otlp`'s file.
pub struct Otlp;

impl WholeFile for Otlp {
    const WHAT: &'static str = "OTLP profiles request";
    const OPTION: &'static str = "--otlp";

    fn written(path: &Path) -> String {
        format!("OTLP profiles written to {}", path.display())
    }

    fn write(model: &Model, end: RunEnd, file: &mut File) -> Result<()> {
        let processes: Vec<&Process> = heap_profile::chosen(model, Processes::All).collect();
        let request = build_request(
            Recording::of(model),
            &processes,
            Window::ending_now(end.duration),
            &crate::process::procfs::host_name(),
        );
        Ok(std::io::Write::write_all(file, &request.encode_to_vec())?)
    }
}

/// The time a profile covers: from the start of tracing (its allocation figures count from
/// there) to the moment it was read.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub start: SystemTime,
    pub duration: Duration,
}

impl Window {
    /// The window of `duration` that ends now.
    pub fn ending_now(duration: Duration) -> Self {
        let now = SystemTime::now();
        Self { start: now.checked_sub(duration).unwrap_or(now), duration }
    }
}

/// What every profile of a request shares.
struct Shape {
    sample_types: [ValueType; 4],
    period_type: ValueType,
    period: i64,
    attributes: Vec<i32>,
    window: Window,
}

/// How the values were recorded: `--sample`'s mean distance (the period; 1 when exact) and the
/// note saying what makes them estimates (heap_profile::estimate_note), if anything does.
pub struct Recording {
    pub sample_mean: Option<u64>,
    pub note: Option<String>,
}

impl Recording {
    pub fn of(model: &Model) -> Self {
        Self { sample_mean: model.sampling.map(|s| s.mean_bytes), note: heap_profile::estimate_note(model) }
    }
}

/// The request for `processes`, whose values were recorded as `recording` says over `window`.
pub fn build_request(
    recording: Recording,
    processes: &[&Process],
    window: Window,
    host: &str,
) -> ExportProfilesServiceRequest {
    let mut dictionary = Dictionary::default();
    let shape = Shape {
        sample_types: SAMPLE_TYPES.map(|(kind, unit)| dictionary.value_type(kind, unit)),
        period_type: dictionary.value_type("allocated_bytes", "bytes"),
        period: recording.sample_mean.map_or(1, |mean| mean as i64),
        attributes: recording
            .note
            .map(|note| {
                let note = AnyValue { value: Some(Value::StringValue(note)) };
                dictionary.attribute("memtrace.sampling", note, "")
            })
            .into_iter()
            .collect(),
        window,
    };
    let resource_profiles =
        processes.iter().map(|process| process_profiles(process, &shape, &mut dictionary, host)).collect();
    ExportProfilesServiceRequest { resource_profiles, dictionary: Some(dictionary.finish()) }
}

/// One process's four profiles, under its resource. A stack whose value is 0 for a sample type
/// (all it allocated is freed, for the inuse types) is left out of that type's profile.
fn process_profiles(
    process: &Process,
    shape: &Shape,
    dictionary: &mut Dictionary,
    host: &str,
) -> ResourceProfiles {
    let stacks: Vec<(i32, [i64; 4])> = heap_profile::samples(process)
        .map(|sample| (dictionary.stack(sample.frames), sample.values))
        .collect();
    let profiles = shape
        .sample_types
        .iter()
        .enumerate()
        .map(|(kind, sample_type)| Profile {
            sample_type: Some(*sample_type),
            samples: stacks
                .iter()
                .filter(|(_, values)| values[kind] != 0)
                .map(|&(stack_index, values)| Sample {
                    stack_index,
                    values: vec![values[kind]],
                    ..Sample::default()
                })
                .collect(),
            time_unix_nano: shape
                .window
                .start
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos() as u64),
            duration_nano: shape.window.duration.as_nanos() as u64,
            period_type: Some(shape.period_type),
            period: shape.period,
            attribute_indices: shape.attributes.clone(),
            ..Profile::default()
        })
        .collect();
    let scope = InstrumentationScope {
        name: "memtrace".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        ..InstrumentationScope::default()
    };
    ResourceProfiles {
        resource: Some(resource::resource(process, host)),
        scope_profiles: vec![ScopeProfiles { scope: Some(scope), profiles, schema_url: String::new() }],
        schema_url: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use memtrace_common::StackTotals;

    use super::*;
    use crate::model::{frame::Frame, StackProfile};
    use crate::{export::heap_profile::sampling_note, model::estimate::Sampling};

    #[test]
    fn one_profile_per_sample_type_over_one_dictionary() {
        let mut model = Model::default();
        model.add_process(crate::model::identity::ProcessIdentity::new(9, "app".into()), "/libc".into());
        let frame = |name: &str, offset| {
            Arc::new(Frame {
                function: Some(name.into()),
                file: Some("app.c".into()),
                line: Some(3),
                module: "/app".into(),
                offset,
                interpreter: None,
            })
        };
        let stack = |frames, allocations, live_allocations| StackProfile {
            frames,
            totals: StackTotals {
                allocations,
                allocated_bytes: allocations * 100,
                live_allocations,
                live_bytes: live_allocations * 100,
                ..StackTotals::default()
            },
            leaked_bytes: 0,
            leaked_allocations: 0,
            oldest_age: None,
        };
        model.processes.get_mut(&9).unwrap().stacks = vec![
            stack(vec![frame("leak", 0x10), frame("main", 0x20)], 4, 1),
            stack(vec![frame("main", 0x30)], 2, 0),
        ];
        let processes: Vec<&Process> = model.every_process().collect();
        let window = Window { start: UNIX_EPOCH + Duration::from_secs(10), duration: Duration::from_secs(2) };
        let exact = Recording { sample_mean: None, note: None };
        let request = build_request(exact, &processes, window, "node");
        let decoded = ExportProfilesServiceRequest::decode(&*request.encode_to_vec()).unwrap();
        assert_eq!(decoded, request);
        let dictionary = decoded.dictionary.unwrap();
        assert_eq!(dictionary.string_table[0], "");
        assert_eq!(dictionary.stack_table.len(), 3, "the zero stack and two");
        assert_eq!(dictionary.location_table.len(), 4, "the zero location and three");
        assert_eq!(dictionary.function_table.len(), 3, "the zero function, leak and main");
        let profiles = &decoded.resource_profiles[0].scope_profiles[0].profiles;
        let name =
            |profile: &Profile| &dictionary.string_table[profile.sample_type.unwrap().type_strindex as usize];
        assert_eq!(profiles.iter().map(name).collect::<Vec<_>>(), SAMPLE_TYPES.map(|(kind, _)| kind));
        let values = |profile: &Profile| profile.samples.iter().map(|s| s.values[0]).collect::<Vec<_>>();
        assert_eq!(
            profiles.iter().map(values).collect::<Vec<_>>(),
            [vec![4, 2], vec![400, 200], vec![1], vec![100]]
        );
        assert_eq!(profiles[0].time_unix_nano, 10_000_000_000);
        assert_eq!(profiles[0].duration_nano, 2_000_000_000);
        assert_eq!(profiles[0].period, 1);
        assert!(profiles[0].attribute_indices.is_empty());
        let note = Some(sampling_note(Sampling { mean_bytes: 4096, estimated: &[] }));
        let sampled = build_request(Recording { sample_mean: Some(4096), note }, &processes, window, "node");
        let profile = &sampled.resource_profiles[0].scope_profiles[0].profiles[0];
        assert_eq!((profile.period, profile.attribute_indices.len()), (4096, 1));
    }
}
