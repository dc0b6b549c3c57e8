//! Headless Chromium (Debian's `chromium`), driven over the DevTools protocol: load a page, record
//! every console message, uncaught exception, log entry and network request it makes, evaluate
//! JavaScript in it and take a screenshot.

use std::{
    net::TcpStream,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use base64::Engine;
use serde_json::{json, Value};
use tempfile::TempDir;
use tungstenite::{Message, WebSocket};

use crate::{Spawned, DEADLINE};

/// A headless Chromium with one page, attached over the DevTools protocol.
pub struct Chromium {
    socket: WebSocket<TcpStream>,
    session: String,
    next_id: u64,
    /// Every event the page sent so far, in order.
    pub events: Vec<Value>,
    _browser: Spawned,
    _profile: TempDir,
}

impl Chromium {
    /// Starts Chromium with a fresh profile, opens a page and enables the domains whose events
    /// tell what a page did: Runtime (console, exceptions), Log, Network, Page.
    pub fn start() -> Self {
        let profile =
            tempfile::Builder::new().prefix("memtrace-chromium-").tempdir().expect("a profile directory");
        let mut command = Command::new("chromium");
        command
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
            ])
            .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
            .args(["--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1400,1000"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank");
        let mut browser = Spawned::spawn(command);
        let line = browser.wait_for_stderr_containing("DevTools listening on ");
        let url = line.split("DevTools listening on ").nth(1).expect("a DevTools URL").trim().to_owned();
        let address = url.trim_start_matches("ws://").split('/').next().expect("host:port").to_owned();
        let stream =
            TcpStream::connect(&address).unwrap_or_else(|err| panic!("connecting to {address}: {err}"));
        // The handshake may take a while on a loaded machine; after it, reads wake up often so
        // that a wait for a message can keep to its deadline.
        stream.set_read_timeout(Some(DEADLINE)).expect("a read timeout");
        let (socket, _) = tungstenite::client(url.as_str(), stream)
            .unwrap_or_else(|err| panic!("the DevTools handshake with {url}: {err}"));
        socket.get_ref().set_read_timeout(Some(Duration::from_millis(500))).expect("a read timeout");
        let mut chromium = Self {
            socket,
            session: String::new(),
            next_id: 0,
            events: Vec::new(),
            _browser: browser,
            _profile: profile,
        };
        let target = chromium.call("Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().expect("a target id").to_owned();
        let attached =
            chromium.call("Target.attachToTarget", json!({"targetId": target_id, "flatten": true}));
        chromium.session = attached["sessionId"].as_str().expect("a session id").to_owned();
        for domain in ["Runtime", "Log", "Network", "Page"] {
            chromium.call(&format!("{domain}.enable"), json!({}));
        }
        chromium
    }

    /// Sends a command (to the page, once attached) and returns its result; events that arrive
    /// meanwhile are kept in `events`.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        self.socket
            .send(Message::text(message.to_string()))
            .unwrap_or_else(|err| panic!("sending {method}: {err}"));
        let reply = self.receive_until(&format!("the reply to {method}"), |m| m["id"] == id);
        if let Some(error) = reply.get("error") {
            panic!("{method} failed: {error}");
        }
        reply["result"].clone()
    }

    /// Loads `path` and waits for its load event.
    pub fn open(&mut self, path: &Path) {
        let url = format!("file://{}", path.canonicalize().expect("the page exists").display());
        self.call("Page.navigate", json!({"url": url}));
        self.receive_until("the page's load event", |m| m["method"] == "Page.loadEventFired");
    }

    /// Evaluates a JavaScript expression in the page and returns its value.
    pub fn evaluate(&mut self, expression: &str) -> Value {
        let result = self.call("Runtime.evaluate", json!({"expression": expression, "returnByValue": true}));
        if let Some(exception) = result.get("exceptionDetails") {
            panic!("evaluating {expression}: {exception}");
        }
        result["result"]["value"].clone()
    }

    /// Writes a PNG of the whole page (up to 6000 pixels tall).
    pub fn screenshot(&mut self, path: &Path) {
        self.screenshot_top(path, 6000.0);
    }

    /// Writes a PNG of the page's top, at most `max_height` CSS pixels of it.
    pub fn screenshot_top(&mut self, path: &Path, max_height: f64) {
        let metrics = self.call("Page.getLayoutMetrics", json!({}));
        let size = &metrics["cssContentSize"];
        let height = size["height"].as_f64().unwrap_or(1000.0).min(max_height);
        let clip = json!({"x": 0, "y": 0, "width": size["width"], "height": height, "scale": 1});
        let shot = self.call(
            "Page.captureScreenshot",
            json!({"format": "png", "captureBeyondViewport": true, "clip": clip}),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("the screenshot is base64");
        std::fs::write(path, png).unwrap_or_else(|err| panic!("writing {}: {err}", path.display()));
    }

    /// Console messages of type error or assert, uncaught exceptions and error log entries.
    pub fn errors(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|event| {
                let params = &event["params"];
                match event["method"].as_str()? {
                    "Runtime.consoleAPICalled" if ["error", "assert"].contains(&params["type"].as_str()?) => {
                        Some(format!("console.{}: {}", params["type"], params["args"]))
                    }
                    "Runtime.exceptionThrown" => Some(format!("uncaught: {}", params["exceptionDetails"])),
                    "Log.entryAdded" if params["entry"]["level"] == "error" => {
                        Some(format!("log: {}", params["entry"]))
                    }
                    _ => None,
                }
            })
            .collect()
    }

    /// The URL of every request the page made.
    pub fn requests(&self) -> Vec<String> {
        self.events
            .iter()
            .filter(|event| event["method"] == "Network.requestWillBeSent")
            .filter_map(|event| event["params"]["request"]["url"].as_str().map(str::to_owned))
            .collect()
    }

    fn receive_until(&mut self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + DEADLINE;
        loop {
            assert!(Instant::now() < deadline, "Chromium never sent {what}");
            let message = match self.socket.read() {
                Ok(Message::Text(text)) => text,
                Ok(_) => continue,
                Err(tungstenite::Error::Io(err))
                    if matches!(
                        err.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(err) => panic!("reading from Chromium while waiting for {what}: {err}"),
            };
            let value: Value = serde_json::from_str(&message).expect("DevTools messages are JSON");
            if done(&value) {
                return value;
            }
            if value.get("method").is_some() {
                self.events.push(value);
            }
        }
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        self.session.clear();
        let _ = self.socket.send(Message::text(json!({"id": 0, "method": "Browser.close"}).to_string()));
    }
}
