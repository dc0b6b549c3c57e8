//! The ProfilesDictionary of an OTLP profiles request: every string, mapping, function, location,
//! stack and attribute the request's profiles share, each interned once and referenced by index.
//! Every table starts with its zero value, as the proto requires.

use std::collections::HashMap;

use opentelemetry_proto::tonic::{
    common::v1::AnyValue,
    profiles::v1development::{
        Function, KeyValueAndUnit, Line, Link, Location, Mapping, ProfilesDictionary, Stack, ValueType,
    },
};

use crate::model::frame::Frame;

/// The dictionary being built.
pub struct Dictionary {
    tables: ProfilesDictionary,
    strings: HashMap<String, i32>,
    mappings: HashMap<String, i32>,
    functions: HashMap<(String, String), i32>,
    /// By the whole frame: an interpreter's frames share their module and may share an offset
    /// (the index of an instruction in each function's code).
    locations: HashMap<Frame, i32>,
    stacks: HashMap<Vec<i32>, i32>,
}

impl Default for Dictionary {
    fn default() -> Self {
        let tables = ProfilesDictionary {
            mapping_table: vec![Mapping::default()],
            location_table: vec![Location::default()],
            function_table: vec![Function::default()],
            // 1.11.0: link_table[0] SHOULD be the zero ids at their full lengths (16 and 8 bytes).
            link_table: vec![Link { trace_id: vec![0; 16], span_id: vec![0; 8] }],
            string_table: vec![String::new()],
            attribute_table: vec![KeyValueAndUnit::default()],
            stack_table: vec![Stack::default()],
        };
        let strings = HashMap::from([(String::new(), 0)]);
        let (mappings, functions, locations, stacks) = Default::default();
        Self { tables, strings, mappings, functions, locations, stacks }
    }
}

impl Dictionary {
    pub fn finish(self) -> ProfilesDictionary {
        self.tables
    }

    pub fn string(&mut self, text: &str) -> i32 {
        if let Some(&index) = self.strings.get(text) {
            return index;
        }
        let index = self.tables.string_table.len() as i32;
        self.tables.string_table.push(text.to_owned());
        self.strings.insert(text.to_owned(), index);
        index
    }

    pub fn value_type(&mut self, kind: &str, unit: &str) -> ValueType {
        ValueType { type_strindex: self.string(kind), unit_strindex: self.string(unit) }
    }

    /// An attribute of profiles (a dictionary entry; no deduplication needed for the few made).
    pub fn attribute(&mut self, key: &str, value: AnyValue, unit: &str) -> i32 {
        let entry = KeyValueAndUnit {
            key_strindex: self.string(key),
            value: Some(value),
            unit_strindex: self.string(unit),
        };
        self.tables.attribute_table.push(entry);
        self.tables.attribute_table.len() as i32 - 1
    }

    /// The stack of `frames` (innermost first, as the proto wants the leaf first).
    pub fn stack(&mut self, frames: &[std::sync::Arc<Frame>]) -> i32 {
        let locations: Vec<i32> = frames.iter().map(|frame| self.location(frame)).collect();
        if let Some(&index) = self.stacks.get(&locations) {
            return index;
        }
        let index = self.tables.stack_table.len() as i32;
        self.tables.stack_table.push(Stack { location_indices: locations.clone() });
        self.stacks.insert(locations, index);
        index
    }

    /// A frame's location: its address is the offset in its object file, which is its mapping
    /// (memtrace keeps no load addresses for symbolized frames, so the mapping has no range).
    fn location(&mut self, frame: &Frame) -> i32 {
        if let Some(&index) = self.locations.get(frame) {
            return index;
        }
        let line =
            Line { function_index: self.function(frame), line: frame.line.map_or(0, i64::from), column: 0 };
        let location = Location {
            mapping_index: self.mapping(&frame.module),
            address: frame.offset,
            lines: vec![line],
            attribute_indices: Vec::new(),
        };
        let index = self.tables.location_table.len() as i32;
        self.tables.location_table.push(location);
        self.locations.insert(frame.clone(), index);
        index
    }

    fn function(&mut self, frame: &Frame) -> i32 {
        let key = (frame.profile_function(), frame.file.clone().unwrap_or_default());
        if let Some(&index) = self.functions.get(&key) {
            return index;
        }
        let name = self.string(&key.0);
        // As in pprof: an interpreter's system name is its function with its file.
        let system_name = self.string(&frame.function_name());
        let function = Function {
            name_strindex: name,
            system_name_strindex: system_name,
            filename_strindex: self.string(&key.1),
            start_line: 0,
        };
        let index = self.tables.function_table.len() as i32;
        self.tables.function_table.push(function);
        self.functions.insert(key, index);
        index
    }

    fn mapping(&mut self, module: &str) -> i32 {
        if let Some(&index) = self.mappings.get(module) {
            return index;
        }
        let mapping = Mapping { filename_strindex: self.string(module), ..Mapping::default() };
        let index = self.tables.mapping_table.len() as i32;
        self.tables.mapping_table.push(mapping);
        self.mappings.insert(module.to_owned(), index);
        index
    }
}
