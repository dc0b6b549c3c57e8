//! A loopback receiver of HTTP pushes (OTLP/HTTP, Pyroscope's ingest): one request accepted,
//! read whole by its Content-Length, and answered with the status a test chooses.

use std::{
    io::{Read, Write},
    net::TcpListener,
    thread,
    time::{Duration, Instant},
};

use crate::DEADLINE;

/// One request a receiver got.
pub struct Received {
    pub head: String,
    pub body: Vec<u8>,
}

/// Accepts one connection on `listener` and answers its request with `status` (`200 OK`).
pub fn receive(listener: &TcpListener, status: &str) -> Received {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let mut stream = loop {
        if let Ok((stream, _)) = listener.accept() {
            break stream;
        }
        assert!(Instant::now() < deadline, "no push came");
        thread::sleep(Duration::from_millis(50));
    };
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    let (mut raw, mut buffer) = (Vec::new(), [0u8; 65536]);
    let (head_end, length) = loop {
        let read = stream.read(&mut buffer).expect("reading a push");
        assert!(read > 0, "the push ended early: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buffer[..read]);
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length = header(&head, "content-length")
                .and_then(|v| v.parse::<usize>().ok())
                .expect("a Content-Length");
            break (end + 4, length);
        }
    };
    while raw.len() < head_end + length {
        let read = stream.read(&mut buffer).expect("reading a push body");
        assert!(read > 0, "the push body ended early");
        raw.extend_from_slice(&buffer[..read]);
    }
    let answer = format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    stream.write_all(answer.as_bytes()).unwrap();
    Received { head: String::from_utf8_lossy(&raw[..head_end]).into_owned(), body: raw[head_end..].to_vec() }
}

/// A header's value in a lowercased request head.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
}
