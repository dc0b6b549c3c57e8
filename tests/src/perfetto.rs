//! Native Perfetto traces (`--perfetto PATH`) decoded whole by protoc against Perfetto's own .proto
//! files (the perfetto_protos crate ships them; tests/Cargo.toml names it so that cargo fetches it),
//! and the heap profile they carry, its call stacks named frame by frame.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;

use crate::workspace_root;

/// A message of protoc's text format: its fields in order, each a scalar or a message.
#[derive(Debug, Default)]
pub struct Message {
    pub fields: Vec<(String, Field)>,
}

#[derive(Debug)]
pub enum Field {
    Scalar(String),
    Message(Message),
}

impl Message {
    fn all(&self, name: &str) -> impl Iterator<Item = &Field> + '_ {
        let name = name.to_owned();
        self.fields.iter().filter(move |(key, _)| *key == name).map(|(_, field)| field)
    }

    /// The submessages named `name`, in order.
    pub fn messages(&self, name: &str) -> Vec<&Message> {
        self.all(name)
            .filter_map(|field| match field {
                Field::Message(message) => Some(message),
                Field::Scalar(_) => None,
            })
            .collect()
    }

    pub fn message(&self, name: &str) -> Option<&Message> {
        self.messages(name).into_iter().next()
    }

    pub fn scalar(&self, name: &str) -> Option<&str> {
        self.all(name).find_map(|field| match field {
            Field::Scalar(value) => Some(value.as_str()),
            Field::Message(_) => None,
        })
    }

    /// A numeric field; None where it is absent (protoc leaves out fields of value 0).
    pub fn number(&self, name: &str) -> Option<i64> {
        self.scalar(name)
            .map(|value| value.parse().unwrap_or_else(|_| panic!("{name}: {value} is no number")))
    }

    /// Every value of a repeated numeric field.
    pub fn numbers(&self, name: &str) -> Vec<i64> {
        self.all(name)
            .filter_map(|field| match field {
                Field::Scalar(value) => Some(value.parse().unwrap()),
                Field::Message(_) => None,
            })
            .collect()
    }

    /// A string or bytes field, unquoted (the names here need no unescaping).
    pub fn string(&self, name: &str) -> Option<&str> {
        self.scalar(name).map(|value| value.trim_matches('"'))
    }

    /// Every field name at any depth that is a number: a field Perfetto's protos do not know.
    pub fn unknown_fields(&self, path: &str, found: &mut Vec<String>) {
        for (key, field) in &self.fields {
            let here = format!("{path}/{key}");
            if key.chars().all(|c| c.is_ascii_digit()) {
                found.push(here.clone());
            }
            if let Field::Message(message) = field {
                message.unknown_fields(&here, found);
            }
        }
    }
}

/// Parses what `protoc --decode` prints: `name: value` lines and `name {` ... `}` blocks.
fn parse_text_format(text: &str) -> Message {
    let mut stack = vec![(String::new(), Message::default())];
    for line in text.lines().map(str::trim).filter(|line| !line.is_empty()) {
        if line == "}" {
            let (name, message) = stack.pop().expect("balanced braces");
            stack
                .last_mut()
                .expect("a closing brace closes a block")
                .1
                .fields
                .push((name, Field::Message(message)));
        } else if let Some(name) = line.strip_suffix(" {") {
            stack.push((name.to_owned(), Message::default()));
        } else {
            let (name, value) = line.split_once(": ").unwrap_or_else(|| panic!("not a field: {line}"));
            stack.last_mut().unwrap().1.fields.push((name.to_owned(), Field::Scalar(value.to_owned())));
        }
    }
    assert_eq!(stack.len(), 1, "unbalanced braces in protoc's output");
    stack.pop().unwrap().1
}

/// Where Perfetto's .proto files are: the perfetto_protos crate, which this crate's manifest names
/// (under a cfg that is never true, so that cargo fetches it but never builds it).
fn perfetto_protos_dir() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(workspace_root().join("Cargo.toml"))
        .stderr(Stdio::inherit())
        .output()
        .expect("running cargo metadata");
    assert!(output.status.success(), "cargo metadata failed");
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let package = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|package| package["name"] == "perfetto_protos")
        .expect("perfetto_protos in cargo metadata (tests/Cargo.toml names it)");
    let manifest = Path::new(package["manifest_path"].as_str().unwrap());
    let dir = manifest.parent().unwrap().to_owned();
    assert!(dir.join("protos/perfetto/trace/trace.proto").is_file(), "no trace.proto in {}", dir.display());
    dir
}

/// Decodes a whole trace file as perfetto.protos.Trace with protoc; every field must be one
/// Perfetto's protos know.
pub fn decode(path: &Path) -> Message {
    let protos = perfetto_protos_dir();
    let output = Command::new("protoc")
        .arg("--decode=perfetto.protos.Trace")
        .arg("-I")
        .arg(&protos)
        .arg(protos.join("protos/perfetto/trace/trace.proto"))
        .stdin(fs::File::open(path).unwrap_or_else(|err| panic!("opening {}: {err}", path.display())))
        .output()
        .unwrap_or_else(|err| {
            panic!("running protoc ({err}): install Debian's protobuf-compiler (`cargo xtask setup` does)")
        });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stderr.is_empty(),
        "protoc cannot decode {}: {stderr}",
        path.display()
    );
    let trace = parse_text_format(&String::from_utf8(output.stdout).expect("protoc prints UTF-8"));
    let mut unknown = Vec::new();
    trace.unknown_fields("", &mut unknown);
    assert!(unknown.is_empty(), "fields Perfetto's protos do not know: {unknown:?}");
    trace
}

/// One sample of a heap profile's process dump, its call stack resolved to function names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeapSample {
    /// The function name of each frame, outermost first (as Perfetto orders a callstack).
    pub stack: Vec<String>,
    pub alloc_count: u64,
    pub self_allocated: u64,
    pub free_count: u64,
    pub self_freed: u64,
}

/// The trace's one heap profile packet (a packet holding a `profile_packet`).
pub fn heap_profile(trace: &Message) -> &Message {
    let profiles: Vec<&Message> = trace
        .messages("packet")
        .into_iter()
        .filter(|packet| packet.message("profile_packet").is_some())
        .collect();
    assert_eq!(profiles.len(), 1, "one heap profile packet");
    profiles[0]
}

/// The interned strings of table `name` ("function_names", "mapping_paths"), by iid.
pub fn interned_strings(interned: &Message, name: &str) -> BTreeMap<i64, String> {
    interned
        .messages(name)
        .into_iter()
        .map(|s| (s.number("iid").unwrap(), s.string("str").unwrap_or_default().to_owned()))
        .collect()
}

/// The samples of process `pid`'s dump in the trace's one heap profile packet.
pub fn heap_samples(trace: &Message, pid: i64) -> Vec<HeapSample> {
    let packet = heap_profile(trace);
    let interned = packet.message("interned_data").expect("the profile's interned data");
    let function_names = interned_strings(interned, "function_names");
    let frames: BTreeMap<i64, &str> = interned
        .messages("frames")
        .into_iter()
        .map(|frame| {
            let name = &function_names[&frame.number("function_name_id").expect("a frame's function")];
            (frame.number("iid").unwrap(), name.as_str())
        })
        .collect();
    let callstacks: BTreeMap<i64, Vec<String>> = interned
        .messages("callstacks")
        .into_iter()
        .map(|stack| {
            let names = stack.numbers("frame_ids").iter().map(|id| frames[id].to_owned()).collect();
            (stack.number("iid").unwrap(), names)
        })
        .collect();
    let profile = packet.message("profile_packet").unwrap();
    let dumps: Vec<&Message> = profile
        .messages("process_dumps")
        .into_iter()
        .filter(|dump| dump.number("pid") == Some(pid))
        .collect();
    assert_eq!(dumps.len(), 1, "one process dump of pid {pid}");
    dumps[0]
        .messages("samples")
        .into_iter()
        .map(|sample| {
            let figure = |name: &str| sample.number(name).unwrap_or(0) as u64;
            HeapSample {
                stack: callstacks[&sample.number("callstack_id").expect("a sample's callstack")].clone(),
                alloc_count: figure("alloc_count"),
                self_allocated: figure("self_allocated"),
                free_count: figure("free_count"),
                self_freed: figure("self_freed"),
            }
        })
        .collect()
}
