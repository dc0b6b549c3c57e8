//! OTLP profiles requests decoded by the OpenTelemetry project's own definitions: PyPI's
//! opentelemetry-proto, installed into a venv under target/ when missing, running
//! tests/otlp_decode.py.

use std::{
    io::Write,
    path::PathBuf,
    process::{Command, Stdio},
};

use serde_json::Value;

use crate::{venv, workspace_root};

/// The version of PyPI's opentelemetry-proto the tests decode with (its profiles v1development
/// has the ProfilesDictionary layout of proto 1.10.0 and 1.11.0).
const OTLP_PROTO_VERSION: &str = "1.45.2";

/// The venv's python, with opentelemetry-proto installed.
fn python() -> PathBuf {
    venv::with_package("otlp-venv", "opentelemetry-proto", OTLP_PROTO_VERSION).join("bin").join("python3")
}

/// The request in `body`, decoded by tests/otlp_decode.py.
pub fn decode(body: &[u8]) -> Value {
    let mut child = Command::new(python())
        .arg(workspace_root().join("tests").join("otlp_decode.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running tests/otlp_decode.py");
    child.stdin.take().unwrap().write_all(body).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "decoding failed:\n{}", String::from_utf8_lossy(&output.stderr));
    let decoded: Value = serde_json::from_slice(&output.stdout).expect("the decoder's JSON");
    assert_eq!(decoded["all_fields_known"], true, "fields the definitions do not know: {decoded}");
    for (table, zero) in decoded["zeros"].as_object().unwrap() {
        assert_eq!(zero, true, "{table}_table[0] is not the zero value");
    }
    decoded
}
