//! The values the command line takes, each parsed once into its type with an error that says what
//! to write instead: durations, byte counts, percentages, windows, commands, container ids,
//! cgroup paths, addresses and URLs.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use hyper::Uri;

/// "5%" as 0.05.
pub fn parse_percent(text: &str) -> Result<f64, String> {
    text.strip_suffix('%')
        .and_then(|number| number.trim().parse::<f64>().ok())
        .filter(|percent| percent.is_finite() && *percent >= 0.0)
        .map(|percent| percent / 100.0)
        .ok_or_else(|| format!("\"{text}\" is not a percentage; write it as 5%"))
}

/// A container id or a prefix of one: 12 to 64 hex digits, kept in lower case.
pub(crate) fn parse_container_id(text: &str) -> Result<String, String> {
    let hex = text.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex || !(12..=64).contains(&text.len()) {
        return Err(format!(
            "{text:?} is not a container id: give 12 to 64 hex digits, as `docker ps` or `crictl ps` shows it"
        ));
    }
    Ok(text.to_ascii_lowercase())
}

/// A cgroup path as /proc/PID/cgroup shows it: absolute, without `..`.
pub(crate) fn parse_cgroup_path(text: &str) -> Result<String, String> {
    if !text.starts_with('/') || text.split('/').any(|part| part == "..") {
        return Err(format!(
            "{text:?} is not a cgroup path: give it as /proc/PID/cgroup shows it, e.g. /kubepods/besteffort/pod<UID>"
        ));
    }
    Ok(text.trim_end_matches('/').to_owned()).map(|path| if path.is_empty() { "/".to_owned() } else { path })
}

/// `--window ON/EVERY`: allocations probed for `on` of every `every`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub on: Duration,
    pub every: Duration,
}

impl Window {
    /// The shortest window: attaching a window's probes takes a few milliseconds.
    const SHORTEST: Duration = Duration::from_millis(50);

    /// Parses `ON/EVERY`, e.g. `1s/20s`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let Some((on, every)) = text.split_once('/') else {
            return Err(format!("`{text}` is not ON/EVERY; write e.g. 1s/20s (probe 1 s of every 20 s)"));
        };
        let (on, every) = (parse_duration(on)?, parse_duration(every)?);
        if on < Self::SHORTEST {
            return Err(format!(
                "a window of {on:?} is too short to attach its probes in; use at least 50ms"
            ));
        }
        if on >= every {
            return Err(format!(
                "a window of {on:?} every {every:?} never closes; make EVERY longer than ON, e.g. 1s/20s, \
                 or leave --window out to probe all the time"
            ));
        }
        Ok(Self { on, every })
    }
}

/// Parses a human duration such as `250ms`, `2s`, `1m30s`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|err| {
        format!("`{text}` is not a duration ({err}); write a number with a unit, e.g. 250ms, 2s, 1m")
    })
}

/// A byte count with an optional unit: 4096, 64K, 64KiB, 1M, 1MiB, 1G (units are powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed.find(|c: char| !c.is_ascii_digit()).unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("`{text}` has an unknown unit; write e.g. 4096, 64KiB, 1MiB")),
    };
    let value: u64 =
        digits.parse().map_err(|_| format!("`{text}` is not a byte count; write e.g. 512KiB"))?;
    match value.checked_mul(1 << shift) {
        Some(0) => Err("a sampling interval of 0 bytes samples nothing; leave --sample out to record \
                        every allocation"
            .to_owned()),
        Some(bytes) if bytes <= 1 << 40 => Ok(bytes),
        _ => Err(format!("`{text}` is more than 1TiB; use a smaller mean, e.g. 512KiB")),
    }
}

/// A command name as the kernel keeps it: 1 to 15 bytes.
pub(crate) fn parse_comm(text: &str) -> Result<String, String> {
    match text.len() {
        0 => Err("a command name is needed, as `ps -o comm` shows it".to_owned()),
        1..=15 => Ok(text.to_owned()),
        _ => Err(format!(
            "the kernel keeps only the first 15 bytes of a command name; write `{}`",
            String::from_utf8_lossy(&text.as_bytes()[..15])
        )),
    }
}

pub(crate) fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_millis(1) {
        return Err(format!("interval `{text}` is too short; use at least 1ms"));
    }
    Ok(interval)
}

/// The port `--listen` takes when none is given.
pub(crate) const DEFAULT_PORT: u16 = 9464;

/// Parses `--listen`: IP:PORT, or a port alone for loopback. An address that reaches other hosts
/// must be written out in full: `:9464` (every interface, in Go's shorthand) is refused.
pub fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    if text.starts_with(':') {
        return Err(format!(
            "`{text}` leaves the address out; memtrace listens beyond loopback only on an address written \
             in full, e.g. 0.0.0.0{text} for every interface, or 127.0.0.1{text}"
        ));
    }
    text.parse().map_err(|_| {
        format!("`{text}` is not IP:PORT; write e.g. 127.0.0.1:{DEFAULT_PORT} or [::1]:{DEFAULT_PORT}")
    })
}

/// Parses `--push`: an http:// URL of a Pyroscope server.
pub fn parse_push_url(text: &str) -> Result<Uri, String> {
    parse_http_url(text, "http://127.0.0.1:4040, where Pyroscope listens")
}

/// Parses `--otlp-endpoint`: an http:// URL of an OTLP/HTTP receiver.
pub fn parse_otlp_url(text: &str) -> Result<Uri, String> {
    parse_http_url(
        text,
        "http://127.0.0.1:4318, where an OpenTelemetry Collector's OTLP/HTTP receiver listens",
    )
}

/// A plain http:// URL, with a path prefix but no query; `example` shows one in the errors.
pub(crate) fn parse_http_url(text: &str, example: &str) -> Result<Uri, String> {
    let uri: Uri =
        text.trim().parse().map_err(|err| format!("`{text}` is not a URL ({err}); write e.g. {example}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http"), Some(_)) if uri.query().is_none() => Ok(uri),
        (Some("https"), _) => Err(format!(
            "`{text}`: memtrace pushes over plain HTTP only; push to a local TLS-terminating proxy \
             (http://127.0.0.1:PORT) that forwards to the server"
        )),
        _ => Err(format!("`{text}` is not an http://HOST:PORT URL; write e.g. {example}")),
    }
}

/// A host name as `--host-name` takes it: not empty, no spaces or control characters.
pub(crate) fn parse_host_name(text: &str) -> Result<String, String> {
    if text.is_empty() || text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!(
            "`{text}` is not a host name; give the node's name, e.g. --host-name $(NODE_NAME) with NODE_NAME \
             from the downward API (spec.nodeName)"
        ));
    }
    Ok(text.to_owned())
}
