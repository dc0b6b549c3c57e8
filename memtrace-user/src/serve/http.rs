//! The agent's HTTP server: hyper on a single-threaded tokio runtime, on a thread of its own. It
//! only reads the latest snapshot; nothing it serves writes or runs anything. Slow or hostile
//! clients are bounded: at most MAX_CONNECTIONS at once (more wait in the listen backlog), request
//! headers within HEADER_TIMEOUT and MAX_REQUEST_BYTES, and every connection closed after
//! CONNECTION_LIFETIME. Each connection is a task of its own, so a client that sends its request
//! byte by byte holds one slot and stalls no one.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{atomic::Ordering, Arc, PoisonError},
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{Context, Result};
use http_body_util::Full;
use hyper::{
    body::{Bytes, Incoming},
    header,
    server::conn::http1,
    service::service_fn,
    Method, Request, Response, StatusCode,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{oneshot, OwnedSemaphorePermit, Semaphore},
};

use super::{
    metrics, otlp_push,
    profile::{self, Endpoint},
    push,
    reply::{text, Reply},
    shared::Shared,
};
use crate::plan::ServeOptions;

const MAX_CONNECTIONS: usize = 64;
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// hyper's read buffer, which bounds a request's line and headers (its minimum is 8 KiB).
const MAX_REQUEST_BYTES: usize = 16 * 1024;
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// After CONNECTION_LIFETIME, a response being written gets this long to finish.
const CLOSING_GRACE: Duration = Duration::from_secs(10);
/// Connections the kernel queues while every slot is taken.
const BACKLOG: u32 = 1024;

const INDEX: &str = "memtrace agent\n/metrics            Prometheus metrics\n/debug/pprof/heap   heap \
                     profile (pprof; ?pid=N for one process)\n/debug/pprof/allocs the same, allocated \
                     bytes first\n/healthz            liveness\n";

/// The server thread, stopped by `stop` or when dropped with the agent.
pub struct Server {
    address: SocketAddr,
    stop: oneshot::Sender<()>,
    thread: JoinHandle<()>,
}

impl Server {
    /// Binds `address` at once (an error names it) and serves on a new thread.
    pub fn start(options: &ServeOptions, shared: Arc<Shared>) -> Result<Self> {
        let (address, push, otlp) = (options.listen, options.push.clone(), options.otlp.clone());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the HTTP server's runtime")?;
        let listener = {
            let _context = runtime.enter();
            listen(address).with_context(|| {
                format!("listening on {address} (--listen); choose a free port, e.g. --listen 127.0.0.1:9465")
            })?
        };
        let address = listener.local_addr().context("reading the address listened on")?;
        let (stop, stopped) = oneshot::channel();
        // Spawned after SIGINT and SIGTERM are blocked: they reach the run's signalfd, never here.
        let thread = std::thread::Builder::new()
            .name("memtrace-serve".to_owned())
            .spawn(move || {
                runtime.block_on(async {
                    if let Some(target) = push {
                        tokio::spawn(push::run(Arc::clone(&shared), target));
                    }
                    if let Some(target) = otlp {
                        tokio::spawn(otlp_push::run(Arc::clone(&shared), target));
                    }
                    accept(listener, shared, stopped).await;
                });
            })
            .context("starting the HTTP server's thread")?;
        Ok(Self { address, stop, thread })
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops accepting, drops every connection and waits for the thread.
    pub fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

fn listen(address: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(BACKLOG)
}

async fn accept(listener: TcpListener, shared: Arc<Shared>, mut stopped: oneshot::Receiver<()>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = tokio::select! {
            _ = &mut stopped => return,
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
        };
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors, or a connection reset while queued: try again shortly.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        tokio::spawn(connection(stream, Arc::clone(&shared), slot));
    }
}

async fn connection(stream: TcpStream, shared: Arc<Shared>, _slot: OwnedSemaphorePermit) {
    let _ = stream.set_nodelay(true);
    let service = service_fn(move |request| {
        let shared = Arc::clone(&shared);
        async move { Ok::<_, Infallible>(route(&shared, &request).await) }
    });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_REQUEST_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        () = tokio::time::sleep(CONNECTION_LIFETIME) => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSING_GRACE, connection).await;
}

async fn route(shared: &Shared, request: &Request<Incoming>) -> Reply {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        let mut reply = text(StatusCode::METHOD_NOT_ALLOWED, "memtrace serves only GET\n".to_owned());
        reply.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        return reply;
    }
    match request.uri().path() {
        "/metrics" => metrics(shared),
        "/debug/pprof/heap" => profile::respond(shared, request.uri().query(), Endpoint::Heap).await,
        "/debug/pprof/allocs" => profile::respond(shared, request.uri().query(), Endpoint::Allocs).await,
        "/healthz" => text(StatusCode::OK, "ok\n".to_owned()),
        "/" => text(StatusCode::OK, INDEX.to_owned()),
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; memtrace serves /metrics, /debug/pprof/heap and /healthz\n".to_owned(),
        ),
    }
}

fn metrics(shared: &Shared) -> Reply {
    let snapshot = Arc::clone(&shared.snapshot.borrow());
    // Worked on a copy: the lock is never held while the text is written.
    let mut shown = shared.shown_exits.lock().unwrap_or_else(PoisonError::into_inner).clone();
    let push_failures = shared.push_failures.as_ref().map(|count| count.load(Ordering::Relaxed));
    let limits = metrics::Limits {
        max_series: shared.max_series_processes,
        max_allocations: shared.max_allocations,
        push_failures,
    };
    let body = metrics::exposition(&snapshot, &mut shown, &limits);
    shared.shown_exits.lock().unwrap_or_else(PoisonError::into_inner).extend(shown);
    Response::builder()
        .header(header::CONTENT_TYPE, metrics::CONTENT_TYPE)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "building the response\n".to_owned()))
}
