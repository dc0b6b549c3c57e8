//! The OTLP resource of a traced process: its attributes in OpenTelemetry's semantic conventions
//! (`process.pid`, `process.executable.name`, `host.name`, and `container.id`, `k8s.pod.name`,
//! `k8s.namespace.name`, `k8s.container.name` where the container is known), made in one place.

use opentelemetry_proto::tonic::{
    common::v1::{any_value::Value, AnyValue, KeyValue},
    resource::v1::Resource,
};

use crate::model::{identity::ProcessIdentity, Process};

/// The resource of `process` on `host`: its identity's pid, executable (the command name where
/// the executable is unknown) and container.
pub fn resource(process: &Process, host: &str) -> Resource {
    let identity: &ProcessIdentity = &process.identity;
    let executable =
        identity.executable.as_ref().and_then(|path| path.file_name()).map(|name| name.to_string_lossy());
    let mut attributes = vec![
        int("process.pid", i64::from(identity.pid)),
        string("process.executable.name", executable.as_deref().unwrap_or(&identity.comm)),
        string("host.name", host),
    ];
    if let Some(container) = &identity.container {
        let labels = [
            ("container.id", &container.id),
            ("k8s.pod.name", &container.pod),
            ("k8s.namespace.name", &container.namespace),
            ("k8s.container.name", &container.name),
        ];
        attributes.extend(labels.into_iter().filter_map(|(key, value)| Some(string(key, value.as_deref()?))));
    }
    Resource { attributes, ..Resource::default() }
}

fn string(key: &str, value: &str) -> KeyValue {
    attribute(key, Value::StringValue(value.to_owned()))
}

fn int(key: &str, value: i64) -> KeyValue {
    attribute(key, Value::IntValue(value))
}

fn attribute(key: &str, value: Value) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(value) }), ..KeyValue::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(resource: &Resource) -> Vec<&str> {
        resource.attributes.iter().map(|kv| kv.key.as_str()).collect()
    }

    #[test]
    fn container_attributes_appear_only_where_known() {
        let mut model = crate::model::Model::default();
        model.add_process(ProcessIdentity::new(42, "app".into()), "/libc".into());
        let plain = resource(&model.processes[&42], "node-1");
        assert_eq!(keys(&plain), ["process.pid", "process.executable.name", "host.name"]);
        assert_eq!(plain.attributes[0].value, Some(AnyValue { value: Some(Value::IntValue(42)) }));
        let process = model.processes.get_mut(&42).unwrap();
        process.identity.container = Some(crate::process::cgroup::Container {
            id: Some("abc".into()),
            pod: Some("web-0".into()),
            ..Default::default()
        });
        let labelled = resource(process, "node-1");
        assert_eq!(keys(&labelled)[3..], ["container.id", "k8s.pod.name"]);
    }
}
