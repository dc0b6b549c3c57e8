//! What the agent's server answers with: a whole response at once, and the plain-text replies
//! (the index, `/healthz` and every error) that the routes and the profile endpoint share.

use http_body_util::Full;
use hyper::{body::Bytes, header, Response, StatusCode};

/// Every response: the whole body at once (metrics and profiles are built before they are sent).
pub type Reply = Response<Full<Bytes>>;

/// A plain-text reply.
pub fn text(status: StatusCode, body: String) -> Reply {
    let mut reply = Response::new(Full::new(Bytes::from(body)));
    *reply.status_mut() = status;
    reply
        .headers_mut()
        .insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/plain; charset=utf-8"));
    reply
}
