//! The gateway's data path (`GATEWAY_DATAPLANE=rust`): the HTTP server the clients talk to and the HTTP
//! client to the replicas, and nothing else. Every decision (the key, its scope and limits, the queue, the
//! replica, the answer to an error, the accounting) stays in the gateway's Python process
//! (endpoints/gateway/asgi.py), which this program asks over a socket pair it inherits, one small frame per
//! step of a request (endpoints/gateway/dataplane.py speaks the other end).
//!
//! Why a compiled data path at all: at concurrency 1 a proxy's added latency is its CPU per request, and a
//! Python HTTP server and client (uvicorn, aiohttp) spent 2-2.5x what vLLM's Rust router does (docs/benchmarks.md,
//! "Gateway"). Here Python is left with the decisions, about a fifth of what it used to run per request.
//!
//! Written by hand because no library is this: hyper does the HTTP on both sides; what is ours is the
//! relay (streaming, time to first byte, the usage at an answer's end) and the frames to the gateway.
//!
//! The frames between the two halves, their kinds and the constants both share are defined once, in
//! ../protocol.toml (src/protocol.rs is written from it). A report (an S or M nobody waits for: the client has
//! the answer) may wait a moment for the next frame (write_frames).
use hyper::body::{Bytes, HttpBody};
use hyper::client::HttpConnector;
use hyper::header::{
    HeaderName, HeaderValue, AUTHORIZATION, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE,
    TRANSFER_ENCODING,
};
use hyper::server::conn::Http;
use hyper::service::service_fn;
use hyper::{Body, Client, Method, Request, Response, StatusCode};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::io::FromRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, UnixStream};
use tokio::sync::{mpsc, oneshot};

// The protocol's constants (frame kinds, header lists, sizes, the stream-error event): written from
// ../protocol.toml, the one definition the gateway's Python half reads too.
#[rustfmt::skip]
mod protocol;
use protocol::*;
// How long a report (how an answer the client has went) may wait to share a write with the next request's frame.
// Any frame the gateway must answer takes the waiting reports along, ahead of it: every decision still sees every
// answer that came before it; only the accounting's clock runs up to this much late. `--report-delay MS`
// overrides it; the gateway never passes it (not one of protocol.toml's arguments): a test lengthens the moment
// so that a Python client lands its next request inside it (tests/endpoints/test_gateway_dataplane.py).
const REPORT_DELAY: Duration = Duration::from_millis(2);

struct Settings {
    connect_timeout: Duration,
    read_timeout: Duration,
    idle_timeout: Duration,
    body_timeout: Duration,
    max_body: usize,
}

enum Reply {
    Answer {
        status: u16,
        content_type: String,
        retry_after: String,
        body: Bytes,
    },
    SendBody,
    Forward {
        url: String,
        token: String,
        whole: bool,
        engine_headers: bool,
        note: String,
        body: Bytes,
    },
}

/// A frame on its way to the gateway; empty bytes end the writer.
struct Frame {
    bytes: Vec<u8>,
    report: bool, // see Gateway::report
}

struct Gateway {
    out: mpsc::UnboundedSender<Frame>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Reply>>>,
    next_id: AtomicU64,
}

impl Gateway {
    fn send(&self, id: u64, kind: u8, head: &[u8], body: &[u8]) {
        self.queue(id, kind, head, body, false);
    }

    /// Tell the gateway how an answer the client already has went: nothing waits for it, so it may wait a
    /// moment for the next frame that is waited for (see write_frames).
    fn report(&self, id: u64, kind: u8, head: &[u8], body: &[u8]) {
        self.queue(id, kind, head, body, true);
    }

    fn queue(&self, id: u64, kind: u8, head: &[u8], body: &[u8], report: bool) {
        let mut bytes = Vec::with_capacity(17 + head.len() + body.len());
        bytes.extend_from_slice(&((13 + head.len() + body.len()) as u32).to_le_bytes());
        bytes.extend_from_slice(&id.to_le_bytes());
        bytes.push(kind);
        bytes.extend_from_slice(&(head.len() as u32).to_le_bytes());
        bytes.extend_from_slice(head);
        bytes.extend_from_slice(body);
        // The writer ends only when the gateway is gone, and so does this process.
        let _ = self.out.send(Frame { bytes, report });
    }

    /// Tell the gateway something and wait for its answer (None: the gateway is gone).
    async fn ask(&self, id: u64, kind: u8, head: &[u8], body: &[u8]) -> Option<Reply> {
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        self.send(id, kind, head, body);
        rx.await.ok()
    }
}

/// Tells the gateway the client left if the request ends before its answer was settled (hyper drops a
/// request's future when its client closes the connection), and forgets the request's pending answer.
struct Watch {
    gateway: Arc<Gateway>,
    id: u64,
    settled: bool,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.gateway.pending.lock().unwrap().remove(&self.id);
        if !self.settled {
            self.gateway.send(self.id, LEFT, b"", b"");
        }
    }
}

fn parse_reply(kind: u8, head: &[u8], body: Bytes) -> Option<Reply> {
    let text = std::str::from_utf8(head).ok()?;
    let mut fields = text.split('\n');
    match kind {
        ANSWER => Some(Reply::Answer {
            status: fields.next()?.parse().ok()?,
            content_type: fields.next()?.to_string(),
            retry_after: fields.next().unwrap_or("").to_string(),
            body,
        }),
        SEND_BODY => Some(Reply::SendBody),
        FORWARD => Some(Reply::Forward {
            url: fields.next()?.to_string(),
            token: fields.next()?.to_string(),
            whole: fields.next()? == "1",
            engine_headers: fields.next() == Some("1"),
            note: fields.next().unwrap_or("").to_string(),
            body,
        }),
        _ => None,
    }
}

async fn read_replies(mut socket: tokio::net::unix::OwnedReadHalf, gateway: Arc<Gateway>) {
    let mut prefix = [0u8; 17];
    loop {
        if socket.read_exact(&mut prefix).await.is_err() {
            break;
        }
        let len = u32::from_le_bytes(prefix[0..4].try_into().unwrap()) as usize;
        let id = u64::from_le_bytes(prefix[4..12].try_into().unwrap());
        let kind = prefix[12];
        let head_len = u32::from_le_bytes(prefix[13..17].try_into().unwrap()) as usize;
        if len < 13 + head_len {
            break;
        }
        let mut rest = vec![0u8; len - 13];
        if socket.read_exact(&mut rest).await.is_err() {
            break;
        }
        let mut head = Bytes::from(rest);
        let body = head.split_off(head_len);
        let waiting = gateway.pending.lock().unwrap().remove(&id);
        // A request whose client left is no longer waiting: its answer is dropped.
        if let (Some(tx), Some(reply)) = (waiting, parse_reply(kind, &head, body)) {
            let _ = tx.send(reply);
        }
    }
    eprintln!("dataplane: the gateway closed its socket; stopping");
    std::process::exit(0);
}

/// Writes the frames in order, what queued up meanwhile in one write; an empty frame ends it (at exit: every
/// answer's report written before the process goes). Reports alone wait up to report_delay for a frame the
/// gateway must answer (the next request, under load), to go in the same write: the gateway's process then
/// wakes once per request instead of twice, which under load is CPU given back to the replicas on the host.
async fn write_frames(
    mut socket: tokio::net::unix::OwnedWriteHalf,
    mut frames: mpsc::UnboundedReceiver<Frame>,
    report_delay: Duration,
) {
    let mut buf = Vec::new();
    while let Some(first) = frames.recv().await {
        let mut reports_only = true;
        let mut last = take(first, &mut buf, &mut reports_only);
        let deadline = tokio::time::Instant::now() + report_delay;
        loop {
            while !last {
                match frames.try_recv() {
                    Ok(more) => last = take(more, &mut buf, &mut reports_only),
                    Err(_) => break,
                }
            }
            if last || !reports_only {
                break;
            }
            match tokio::time::timeout_at(deadline, frames.recv()).await {
                Ok(Some(more)) => last = take(more, &mut buf, &mut reports_only),
                Ok(None) => last = true,
                Err(_) => break, // the moment is up: the reports go alone
            }
        }
        if socket.write_all(&buf).await.is_err() {
            eprintln!("dataplane: writing to the gateway failed; stopping");
            std::process::exit(0);
        }
        buf.clear();
        if last {
            return;
        }
    }
}

/// Adds a frame to the write being gathered; true for the empty frame that ends the writer.
fn take(frame: Frame, buf: &mut Vec<u8>, reports_only: &mut bool) -> bool {
    if frame.bytes.is_empty() {
        return true;
    }
    *reports_only &= frame.report;
    buf.extend_from_slice(&frame.bytes);
    false
}

fn answer(status: u16, content_type: &str, retry_after: &str, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = response.headers_mut();
    let content_type = if content_type.is_empty() {
        "application/json"
    } else {
        content_type
    };
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_str(content_type).unwrap_or(HeaderValue::from_static("application/json")),
    );
    headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
    if !retry_after.is_empty() {
        if let Ok(v) = HeaderValue::from_str(retry_after) {
            headers.insert("retry-after", v);
        }
    }
    *response.body_mut() = Body::from(body);
    response
}

/// What the gateway changed in the request before forwarding it (asgi.py NOTICE_HEADER), told to the client.
fn add_notice(response: &mut Response<Body>, note: &str) {
    if !note.is_empty() {
        if let Ok(v) = HeaderValue::from_str(note) {
            response.headers_mut().insert("x-gateway-notice", v);
        }
    }
}

fn error_body(status: u16, message: &str, code: &str) -> Response<Body> {
    // The gateway's error shape (asgi.py _error), for the one refusal made here: a body over the limit.
    let body = format!(
        "{{\"error\": {{\"message\": \"{message}\", \"type\": \"{code}\", \"code\": {status}}}}}"
    );
    answer(status, "application/json", "", Bytes::from(body))
}

/// A refusal after which the connection is closed (RFC 9112 §6.1, §9.6): what else the client sent is not read.
fn refuse_and_close(status: u16, message: &str, code: &str) -> Response<Body> {
    let mut response = error_body(status, message, code);
    response
        .headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

enum BodyError {
    TooLarge,
    Broken,
    Slow,
}

/// The request body, all of it within `within` (a client that announces a body and trickles it, or sends none,
/// holds no connection longer), at most `max` bytes.
async fn read_request_body(body: Body, max: usize, within: Duration) -> Result<Bytes, BodyError> {
    match tokio::time::timeout(within, read_body_upto(body, max)).await {
        Ok(read) => read,
        Err(_) => Err(BodyError::Slow),
    }
}

async fn read_body_upto(mut body: Body, max: usize) -> Result<Bytes, BodyError> {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut size = 0;
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|_| BodyError::Broken)?;
        size += chunk.len();
        if size > max {
            return Err(BodyError::TooLarge);
        }
        chunks.push(chunk);
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap(),
        _ => Bytes::from(chunks.concat()),
    })
}

/// The replica's whole answer, each read within the read timeout.
async fn read_answer(mut body: Body, read_timeout: Duration) -> Result<Bytes, String> {
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        match tokio::time::timeout(read_timeout, body.data()).await {
            Err(_) => return Err("ReadTimeout".into()),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(error_name(&e)),
            Ok(Some(Ok(chunk))) => chunks.push(chunk),
        }
    }
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap(),
        _ => Bytes::from(chunks.concat()),
    })
}

fn error_name(e: &hyper::Error) -> String {
    if e.is_timeout() {
        "Timeout".into()
    } else if e.is_incomplete_message() {
        "IncompleteMessage".into()
    } else if e.is_closed() {
        "ConnectionClosed".into()
    } else if e.is_connect() {
        "ConnectError".into()
    } else {
        "HTTPError".into()
    }
}

/// Nothing came back: the request may go to another replica (aiohttp's connect errors, ServerDisconnectedError
/// and ClientOSError in asgi.py RETRYABLE).
fn retryable(e: &hyper::Error) -> bool {
    if e.is_connect()
        || e.is_canceled()
        || e.is_closed()
        || (e.is_incomplete_message() && !e.is_timeout())
    {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.downcast_ref::<std::io::Error>().is_some() {
            return true;
        }
        source = cause.source();
    }
    false
}

/// Where a whole answer's usage is: from its last "usage" key on (vLLM puts kv_transfer_params, ec_transfer_params
/// and metrics after it: vllm/entrypoints/openai/completion/protocol.py CompletionResponse), else its end.
fn usage_part(data: &[u8]) -> &[u8] {
    // The key as vLLM writes it (Starlette's JSON has no spaces); a "usage" string value (a decoded token) has no colon.
    let key = data
        .windows(8)
        .rposition(|w| w == b"\"usage\":")
        .or_else(|| data.windows(7).rposition(|w| w == b"\"usage\""));
    match key {
        Some(at) => &data[at..],
        None => &data[data.len().saturating_sub(TAIL_BYTES)..],
    }
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn micros(since: Option<Duration>) -> String {
    since.map(|d| d.as_micros().to_string()).unwrap_or_default()
}

struct Proxy {
    gateway: Arc<Gateway>,
    client: Client<HttpConnector>,
    settings: Settings,
}

fn content_length(headers: &hyper::HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The client's headers a replica gets: the allow-list (and vLLM's routing headers where the endpoint allows them),
/// less those the request's Connection header names (hop-by-hop by RFC 9110 §7.6.1).
fn forwarded_headers(
    from: &hyper::HeaderMap,
    engine_headers: bool,
) -> Vec<(HeaderName, HeaderValue)> {
    let named: Vec<String> = from
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| {
            v.split(',')
                .map(|t| t.trim().to_ascii_lowercase())
                .collect::<Vec<_>>()
        })
        .collect();
    from.iter()
        .filter(|(name, _)| {
            let name = name.as_str();
            (FORWARDED_HEADERS.contains(&name)
                || (engine_headers && ENGINE_HEADERS.contains(&name)))
                && !named.iter().any(|n| n == name)
        })
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

impl Proxy {
    async fn handle(self: Arc<Self>, request: Request<Body>, busy: Busy) -> Response<Body> {
        let headers = request.headers();
        if headers.contains_key(TRANSFER_ENCODING) && headers.contains_key(CONTENT_LENGTH) {
            // Both framings: which one a server in front read is unknowable (request smuggling), so neither is
            // read (RFC 9112 §6.1). hyper keeps both only when Content-Length came first; with Transfer-Encoding
            // first it drops Content-Length and reads the chunks, and the close below still applies.
            return refuse_and_close(
                400,
                "Content-Length and Transfer-Encoding together are refused.",
                "invalid_request_error",
            );
        }
        // A chunked body's end is its own business (no length up front): the connection closes after the answer,
        // as RFC 9112 §6.1 asks where the request might have carried a Content-Length too.
        let chunked = headers.contains_key(TRANSFER_ENCODING);
        let mut response = self.handle_request(request, busy).await;
        if chunked {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }

    async fn handle_request(self: Arc<Self>, request: Request<Body>, busy: Busy) -> Response<Body> {
        let started = Instant::now();
        let (parts, body) = request.into_parts();
        let chunked = parts.headers.contains_key(TRANSFER_ENCODING);
        let announced = if chunked {
            None
        } else {
            content_length(&parts.headers)
        };
        let mut body = Some(body);
        // Read before the key is checked: only a body whose length is announced, without Transfer-Encoding,
        // and at most EAGER_BODY of it.
        let eager = match announced {
            Some(n) => n <= EAGER_BODY,
            None => false,
        };
        let first = if eager {
            match read_request_body(
                body.take().unwrap(),
                EAGER_BODY as usize,
                self.settings.body_timeout,
            )
            .await
            {
                Ok(data) => data,
                Err(BodyError::Slow) => {
                    return refuse_and_close(
                        408,
                        "The request body did not come in time.",
                        "request_timeout",
                    )
                }
                Err(_) => {
                    return error_body(
                        400,
                        "The request body could not be read.",
                        "invalid_request_error",
                    )
                }
            }
        } else {
            Bytes::new()
        };
        let id = self.gateway.next_id.fetch_add(1, Ordering::Relaxed);
        let mut watch = Watch {
            gateway: self.gateway.clone(),
            id,
            settled: false,
        };
        // A repeated key header counts by its last value, as the gateway reads headers under uvicorn (a dict).
        let header = |name: &str| {
            parts
                .headers
                .get_all(name)
                .iter()
                .next_back()
                .map(|v| v.as_bytes())
                .unwrap_or(b"")
        };
        let mut head = Vec::with_capacity(128);
        for field in [
            parts.method.as_str().as_bytes(),
            parts.uri.path().as_bytes(),
            header("authorization"),
            header("x-api-key"),
            if eager { b"1" } else { b"0" },
        ] {
            head.extend_from_slice(field);
            head.push(b'\n');
        }
        head.pop();
        let mut reply = self.gateway.ask(id, REQUEST, &head, &first).await;
        drop(first);
        loop {
            match reply {
                // No answer: a reply this end could not read (the gateway is told the client left, so it
                // stops too), or the gateway is gone (this process exits).
                None => return error_body(502, "The gateway failed.", "bad_gateway"),
                Some(Reply::Answer {
                    status,
                    content_type,
                    retry_after,
                    body,
                }) => {
                    watch.settled = true;
                    return answer(status, &content_type, &retry_after, body);
                }
                Some(Reply::SendBody) => {
                    let read = match (body.take(), announced) {
                        (_, Some(n)) if n > self.settings.max_body as u64 => {
                            Err(BodyError::TooLarge)
                        }
                        (Some(rest), _) => {
                            read_request_body(
                                rest,
                                self.settings.max_body,
                                self.settings.body_timeout,
                            )
                            .await
                        }
                        (None, _) => Ok(Bytes::new()),
                    };
                    reply = match read {
                        Ok(data) => self.gateway.ask(id, BODY, b"ok", &data).await,
                        Err(BodyError::TooLarge) => {
                            self.gateway.ask(id, BODY, b"too_large", b"").await
                        }
                        Err(BodyError::Slow) => {
                            return refuse_and_close(
                                408,
                                "The request body did not come in time.",
                                "request_timeout",
                            )
                        }
                        // The client broke off: the watch tells the gateway it left.
                        Err(BodyError::Broken) => {
                            return error_body(
                                400,
                                "The request body could not be read.",
                                "invalid_request_error",
                            )
                        }
                    };
                }
                Some(Reply::Forward {
                    url,
                    token,
                    whole,
                    engine_headers,
                    note,
                    body: forwarded,
                }) => {
                    let mut upstream = Request::new(Body::from(forwarded));
                    *upstream.method_mut() = Method::POST;
                    *upstream.uri_mut() = match url.parse() {
                        Ok(uri) => uri,
                        Err(_) => {
                            reply = self.gateway.ask(id, FAILED, b"InvalidURL", b"").await;
                            continue;
                        }
                    };
                    let headers = upstream.headers_mut();
                    for (name, value) in forwarded_headers(&parts.headers, engine_headers) {
                        headers.append(name, value);
                    }
                    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                    if let Ok(v) = HeaderValue::from_str(&format!("Bearer {token}")) {
                        headers.insert(AUTHORIZATION, v);
                    }
                    let response = match tokio::time::timeout(
                        self.settings.read_timeout,
                        self.client.request(upstream),
                    )
                    .await
                    {
                        Err(_) => {
                            reply = self.gateway.ask(id, FAILED, b"ReadTimeout", b"").await;
                            continue;
                        }
                        Ok(Err(e)) if retryable(&e) => {
                            reply = self
                                .gateway
                                .ask(id, UNREACHABLE, error_name(&e).as_bytes(), b"")
                                .await;
                            continue;
                        }
                        Ok(Err(e)) => {
                            reply = self
                                .gateway
                                .ask(id, FAILED, error_name(&e).as_bytes(), b"")
                                .await;
                            continue;
                        }
                        Ok(Ok(response)) => response,
                    };
                    let status = response.status().as_u16();
                    let content_type = response
                        .headers()
                        .get(CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    if whole || !content_type.starts_with("text/event-stream") {
                        let data =
                            match read_answer(response.into_body(), self.settings.read_timeout)
                                .await
                            {
                                Ok(data) => data,
                                Err(e) => {
                                    reply = self
                                        .gateway
                                        .ask(id, CUT_SHORT, format!("0\n\n0\n{e}").as_bytes(), b"")
                                        .await;
                                    continue;
                                }
                            };
                        let head = format!("{status}\n\n0\n0\n{content_type}");
                        if whole {
                            reply = self.gateway.ask(id, ANSWERED, head.as_bytes(), &data).await;
                            continue;
                        }
                        watch.settled = true;
                        self.gateway
                            .report(id, ANSWERED, head.as_bytes(), usage_part(&data));
                        let mut whole_answer = answer(status, &content_type, "", data);
                        add_notice(&mut whole_answer, &note);
                        return whole_answer;
                    }
                    let relay = Relay {
                        gateway: self.gateway.clone(),
                        watch,
                        upstream: response.into_body(),
                        status,
                        started,
                        read_timeout: self.settings.read_timeout,
                        deadline: Box::pin(tokio::time::sleep(self.settings.read_timeout)),
                        ttft: None,
                        events: 0,
                        tail: Vec::new(),
                        done: false,
                        _busy: busy,
                    };
                    let mut streamed = Response::new(Body::wrap_stream(relay));
                    *streamed.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
                    let headers = streamed.headers_mut();
                    headers.insert(CONTENT_TYPE, HeaderValue::from_str(&content_type).unwrap());
                    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
                    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
                    add_notice(&mut streamed, &note);
                    return streamed;
                }
            }
        }
    }
}

/// A streamed answer (SSE) on its way to the client, as it comes: it times the first bytes, counts the events and
/// keeps the end, where vLLM puts the usage, for the gateway's accounting. It is the response's body, so hyper drops
/// it the moment the client leaves: its watch tells the gateway, and dropping `upstream` closes the replica's
/// connection (vLLM aborts the request), however long the replica is silent.
struct Relay {
    gateway: Arc<Gateway>,
    watch: Watch,
    upstream: Body,
    status: u16,
    started: Instant,
    read_timeout: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
    ttft: Option<Duration>,
    events: usize,
    tail: Vec<u8>,
    done: bool,
    _busy: Busy, // the connection is busy until the stream ends
}

impl Relay {
    /// The replica broke off: the head is gone already, so the stream ends with an error event the client can see.
    fn failed(&mut self, error: &str) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        self.done = true;
        self.watch.settled = true;
        let head = format!("1\n{}\n{}\n{error}", micros(self.ttft), self.events);
        self.gateway
            .report(self.watch.id, CUT_SHORT, head.as_bytes(), b"");
        Poll::Ready(Some(Ok(Bytes::from_static(STREAM_ERROR))))
    }
}

impl futures_core::Stream for Relay {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.upstream).poll_data(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                if this.ttft.is_none() {
                    this.ttft = Some(this.started.elapsed());
                }
                this.events += count(&chunk, b"data: {");
                if !this.tail.is_empty() || contains(&chunk, b"\"usage\"") {
                    this.tail.extend_from_slice(&chunk);
                    if this.tail.len() > TAIL_BYTES {
                        this.tail.drain(..this.tail.len() - TAIL_BYTES);
                    }
                }
                let next = tokio::time::Instant::now() + this.read_timeout;
                this.deadline.as_mut().reset(next);
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(None) => {
                this.done = true;
                this.watch.settled = true;
                let head = format!(
                    "{}\n{}\n{}\n1\n",
                    this.status,
                    micros(this.ttft),
                    this.events
                );
                this.gateway
                    .report(this.watch.id, ANSWERED, head.as_bytes(), &this.tail);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => this.failed(&error_name(&e)),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => this.failed("ReadTimeout"),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

/// How long a client connection may take over a request head (from its first byte), and sit with no request.
#[derive(Clone, Copy)]
struct Timeouts {
    header: Duration,
    idle: Duration,
}

/// What a connection is doing, for its watch: requests in the service (a streamed answer counts until it ends),
/// and since when it has been reading a head, or idle (milliseconds since `epoch`; 0: not).
struct ConnState {
    epoch: Instant,
    busy: AtomicU64,
    head_since: AtomicU64,
    idle_since: AtomicU64,
    head_started: tokio::sync::Notify, // wakes the watch: a head's deadline is sooner than the idle one
}

impl ConnState {
    fn new() -> Self {
        ConnState {
            epoch: Instant::now(),
            busy: AtomicU64::new(0),
            head_since: AtomicU64::new(0),
            idle_since: AtomicU64::new(1),
            head_started: tokio::sync::Notify::new(),
        }
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }
}

/// One request in the service: the connection is not idle meanwhile.
struct Busy(Arc<ConnState>);

impl Busy {
    fn new(state: Arc<ConnState>) -> Self {
        state.busy.fetch_add(1, Ordering::SeqCst);
        state.head_since.store(0, Ordering::SeqCst);
        Busy(state)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.idle_since.store(self.0.now(), Ordering::SeqCst);
        self.0.head_since.store(0, Ordering::SeqCst);
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The client's socket, noting when a request head starts to come in on a connection with none in the service.
struct Watched {
    inner: tokio::net::TcpStream,
    state: Arc<ConnState>,
}

impl tokio::io::AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let state = &self.state;
        if buf.filled().len() > before
            && state.busy.load(Ordering::SeqCst) == 0
            && state.head_since.load(Ordering::SeqCst) == 0
        {
            state.head_since.store(state.now(), Ordering::SeqCst);
            state.head_started.notify_one();
        }
        polled
    }
}

impl tokio::io::AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Returns when the connection has been idle past the idle timeout, or reading one head past the header timeout.
/// It sleeps until the earliest such moment and looks again (one wake-up per timeout, not a tick).
async fn watch_connection(state: Arc<ConnState>, timeouts: Timeouts) {
    loop {
        let now = state.now();
        let due = if state.busy.load(Ordering::SeqCst) > 0 {
            now + timeouts.idle.as_millis() as u64 // a request with the service: its own deadlines apply
        } else {
            let head = state.head_since.load(Ordering::SeqCst);
            if head != 0 {
                head + timeouts.header.as_millis() as u64
            } else {
                state.idle_since.load(Ordering::SeqCst) + timeouts.idle.as_millis() as u64
            }
        };
        if due <= now && state.busy.load(Ordering::SeqCst) == 0 {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(due.saturating_sub(now).max(10))) => {}
            _ = state.head_started.notified() => {}
        }
    }
}

const TOO_MANY_CONNECTIONS: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n";

/// The caps on client connections: in all, and from one address (one client cannot take every socket).
struct Limits {
    total: usize,
    per_address: usize,
    open: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

/// One admitted connection's place under the caps, given back when the connection ends.
struct Slot {
    limits: Arc<Limits>,
    address: IpAddr,
}

impl Limits {
    fn admit(limits: &Arc<Limits>, address: IpAddr) -> Option<Slot> {
        let mut open = limits.open.lock().unwrap();
        let from_address = open.1.get(&address).copied().unwrap_or(0);
        if open.0 >= limits.total || from_address >= limits.per_address {
            return None;
        }
        open.0 += 1;
        open.1.insert(address, from_address + 1);
        Some(Slot {
            limits: limits.clone(),
            address,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.limits.open.lock().unwrap();
        open.0 -= 1;
        if let Some(n) = open.1.get_mut(&self.address) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.address);
            }
        }
    }
}

fn argument(args: &[String], name: &str) -> String {
    optional(args, name).unwrap_or_else(|| panic!("dataplane: {name} is required"))
}

/// An argument the gateway does not pass (see REPORT_DELAY); None when absent.
fn optional(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    // The gateway asks this before it starts the program: a binary built from another protocol (a `git pull`
    // without `make dataplane`) is refused with a message instead of failing on an argument it does not know.
    if args.iter().any(|a| a == "--protocol") {
        println!("{FINGERPRINT}");
        return;
    }
    let listen: SocketAddr = argument(&args, "--listen")
        .parse()
        .expect("dataplane: --listen HOST:PORT");
    let seconds = |name: &str| {
        Duration::from_secs_f64(argument(&args, name).parse().expect("dataplane: seconds"))
    };
    let settings = Settings {
        connect_timeout: seconds("--connect-timeout"),
        read_timeout: seconds("--read-timeout"),
        idle_timeout: seconds("--idle-timeout"),
        body_timeout: seconds("--body-timeout"),
        max_body: argument(&args, "--max-body")
            .parse()
            .expect("dataplane: --max-body BYTES"),
    };

    // This program's end of the socket pair the gateway made, inherited: nothing else can reach it.
    let fd: i32 = argument(&args, "--control-fd")
        .parse()
        .expect("dataplane: --control-fd FD");
    // SAFETY: the descriptor is the one the gateway passed to this process for this use alone.
    let socket = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    socket
        .set_nonblocking(true)
        .expect("dataplane: the gateway's socket");
    let socket = UnixStream::from_std(socket).expect("dataplane: the gateway's socket");
    let (reader, writer) = socket.into_split();
    let (out, frames) = mpsc::unbounded_channel();
    let gateway = Arc::new(Gateway {
        out: out.clone(),
        pending: Mutex::new(HashMap::new()),
        next_id: AtomicU64::new(1),
    });
    // The handshake: the first frame of all says which protocol this side speaks (the gateway checks it).
    gateway.send(0, HELLO, FINGERPRINT.as_bytes(), b"");
    let report_delay = optional(&args, "--report-delay").map_or(REPORT_DELAY, |ms| {
        Duration::from_millis(ms.parse().expect("dataplane: --report-delay MS"))
    });
    let writer = tokio::spawn(write_frames(writer, frames, report_delay));
    tokio::spawn(read_replies(reader, gateway.clone()));

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true); // small requests and answers: Nagle's delay would be most of a request's cost
    connector.set_connect_timeout(Some(settings.connect_timeout));
    // An idle connection is dropped before the replica's server drops it (asgi.py UPSTREAM_IDLE_SECONDS says why).
    let client = Client::builder()
        .pool_idle_timeout(settings.idle_timeout)
        .build(connector);
    let proxy = Arc::new(Proxy {
        gateway,
        client,
        settings,
    });

    let tcp = if listen.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .expect("dataplane: socket");
    tcp.set_reuseaddr(true).expect("dataplane: SO_REUSEADDR");
    tcp.bind(listen)
        .unwrap_or_else(|e| panic!("dataplane: cannot listen on {listen}: {e}"));
    let listener = tcp.listen(4096).expect("dataplane: listen");
    let limits = Arc::new(Limits {
        total: argument(&args, "--max-connections")
            .parse()
            .expect("dataplane: --max-connections N"),
        per_address: argument(&args, "--max-connections-per-address")
            .parse()
            .expect("dataplane: N"),
        open: Mutex::new((0, HashMap::new())),
    });
    let mut http = Http::new();
    http.http1_only(true);
    // Not hyper's http1_header_read_timeout: in 0.14.19 it is re-armed at every read (src/proto/h1/role.rs
    // parse_headers never marks it running), so a head trickling in a byte at a time never meets it, and an idle
    // connection never starts it. Watch (below) bounds both.
    let timeouts = Timeouts {
        header: seconds("--header-timeout"),
        idle: seconds("--idle-client-timeout"),
    };
    println!("dataplane: listening on http://{listen}/");
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("dataplane: SIGTERM");
    let mut interrupt = signal(SignalKind::interrupt()).expect("dataplane: SIGINT");
    // SIGTERM (or Ctrl-C's SIGINT): take no new connections, finish the requests under way (the gateway waits,
    // then kills), then write the last reports before exiting.
    let (stopping, stop) = tokio::sync::watch::channel(false);
    let (alive, mut all_closed) = mpsc::channel::<()>(1); // each connection holds a sender; none left: all closed
    loop {
        let (stream, peer) = tokio::select! {
            _ = term.recv() => break,
            _ = interrupt.recv() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    eprintln!("dataplane: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await; // out of descriptors: let some close
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let Some(slot) = Limits::admit(&limits, peer.ip()) else {
            // Over a cap: a short answer and the connection goes (asgi.py GuardedProtocol does the same).
            let mut stream = stream;
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(1),
                    stream.write_all(TOO_MANY_CONNECTIONS),
                )
                .await;
            });
            continue;
        };
        let proxy = proxy.clone();
        let state = Arc::new(ConnState::new());
        let for_service = state.clone();
        let service = service_fn(move |request| {
            let proxy = proxy.clone();
            let busy = Busy::new(for_service.clone());
            async move { Ok::<_, Infallible>(proxy.handle(request, busy).await) }
        });
        let mut connection = http.serve_connection(
            Watched {
                inner: stream,
                state: state.clone(),
            },
            service,
        );
        let mut stop = stop.clone();
        let alive = alive.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _alive = alive;
            tokio::select! {
                _ = &mut connection => return,
                _ = watch_connection(state, timeouts) => return, // dropped: the socket closes
                _ = stop.changed() => {}
            }
            Pin::new(&mut connection).graceful_shutdown();
            let _ = connection.await;
        });
    }
    let _ = stopping.send(true);
    drop(alive);
    let _ = all_closed.recv().await;
    let _ = out.send(Frame {
        bytes: Vec::new(),
        report: false,
    });
    let _ = writer.await;
}
