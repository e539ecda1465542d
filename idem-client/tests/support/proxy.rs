//! A fault-injecting HTTP/1.1 proxy on 127.0.0.1:0: one request per client
//! connection, each connection meeting the next scripted fault.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What happens to one client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward the request and the answer.
    Forward,
    /// Forward the request, read the whole answer (the server has
    /// committed), then close the client's connection without it.
    DropResponse,
    /// Reset the connection as soon as it is accepted, before reading the
    /// request: the server never sees it.
    ResetBeforeRequest,
    /// Answer 503 (no `Retry-After`) without forwarding.
    Answer503,
    /// Forward the request, read the answer and keep it: the client waits
    /// until its own timeout.
    Hold,
}

/// An answer the server gave, as the proxy read it.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub status: u16,
    pub replayed: bool,
    pub body: String,
}

struct State {
    upstream: SocketAddr,
    faults: Mutex<VecDeque<Fault>>,
    retry_after: Option<u64>,
    answers: Mutex<Vec<Upstream>>,
    committed: watch::Sender<bool>,
}

/// The running proxy; it stops when dropped.
pub struct Proxy {
    pub url: String,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Proxies to `upstream`, meeting `faults` one per connection, then
    /// forwarding. With `retry_after`, a 409's `Retry-After` is rewritten to
    /// that many seconds on its way to the client.
    pub async fn start(upstream: SocketAddr, faults: Vec<Fault>, retry_after: Option<u64>) -> Self {
        let state = Arc::new(State {
            upstream,
            faults: Mutex::new(faults.into()),
            retry_after,
            answers: Mutex::default(),
            committed: watch::channel(false).0,
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shared = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let (client, _) = listener.accept().await.unwrap();
                let fault = shared
                    .faults
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or(Fault::Forward);
                tokio::spawn(serve(shared.clone(), client, fault));
            }
        });
        Self { url, state, task }
    }

    /// Every answer the server gave, in the order the proxy read them.
    pub fn answers(&self) -> Vec<Upstream> {
        self.state.answers.lock().unwrap().clone()
    }

    /// Becomes `true` once the server has answered a first attempt (a 2xx
    /// that is not a replay): its charge is committed.
    pub fn committed(&self) -> watch::Receiver<bool> {
        self.state.committed.subscribe()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(state: Arc<State>, mut client: TcpStream, fault: Fault) {
    if fault == Fault::ResetBeforeRequest {
        client.set_zero_linger().unwrap();
        return; // dropped with SO_LINGER 0: a reset
    }
    let Some(request) = read_request(&mut client).await else {
        return;
    };
    if fault == Fault::Answer503 {
        let answer =
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        let _ = client.write_all(answer.as_bytes()).await;
        return;
    }
    let mut server = TcpStream::connect(state.upstream).await.unwrap();
    server.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    server.read_to_end(&mut answer).await.unwrap();
    let upstream = parse_answer(&answer);
    if (200..300).contains(&upstream.status) && !upstream.replayed {
        state.committed.send_replace(true);
    }
    let status = upstream.status;
    state.answers.lock().unwrap().push(upstream);
    match fault {
        Fault::Forward => {
            if let (409, Some(seconds)) = (status, state.retry_after) {
                answer = rewrite_retry_after(&answer, seconds);
            }
            let _ = client.write_all(&answer).await;
        }
        Fault::DropResponse => {} // dropped: the client sees the connection close
        Fault::Hold => {
            // Until the client gives up and closes.
            let mut rest = [0; 512];
            while matches!(client.read(&mut rest).await, Ok(n) if n > 0) {}
        }
        Fault::ResetBeforeRequest | Fault::Answer503 => unreachable!(),
    }
}

/// Reads one request (head and `content-length` body) and returns it with
/// `connection: close`, so the server closes after its answer.
async fn read_request(client: &mut TcpStream) -> Option<Vec<u8>> {
    let mut raw = Vec::new();
    let head_end = loop {
        if let Some(end) = find(&raw, b"\r\n\r\n") {
            break end;
        }
        let mut chunk = [0; 4096];
        let n = client.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        raw.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(raw[..head_end].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let mut out = format!("{}\r\n", lines.next().unwrap());
    let mut length = 0;
    for line in lines {
        let (name, value) = line.split_once(':').unwrap();
        match name.trim().to_ascii_lowercase().as_str() {
            "connection" => continue,
            "content-length" => length = value.trim().parse().unwrap(),
            "transfer-encoding" => panic!("the proxy reads content-length bodies only"),
            _ => {}
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("connection: close\r\n\r\n");
    let mut body = raw[head_end + 4..].to_vec();
    while body.len() < length {
        let mut chunk = [0; 4096];
        let n = client.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let mut request = out.into_bytes();
    request.extend_from_slice(&body);
    Some(request)
}

fn parse_answer(answer: &[u8]) -> Upstream {
    let head_end = find(answer, b"\r\n\r\n").expect("a complete answer");
    let head = std::str::from_utf8(&answer[..head_end]).unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let replayed = head
        .lines()
        .any(|line| line.eq_ignore_ascii_case("idempotent-replayed: true"));
    let body = String::from_utf8_lossy(&answer[head_end + 4..]).into_owned();
    Upstream {
        status,
        replayed,
        body,
    }
}

fn rewrite_retry_after(answer: &[u8], seconds: u64) -> Vec<u8> {
    let head_end = find(answer, b"\r\n\r\n").unwrap();
    let head = std::str::from_utf8(&answer[..head_end]).unwrap();
    let head: Vec<String> = head
        .split("\r\n")
        .map(|line| match line.split_once(':') {
            Some((name, _)) if name.eq_ignore_ascii_case("retry-after") => {
                format!("retry-after: {seconds}")
            }
            _ => line.to_owned(),
        })
        .collect();
    let mut out = head.join("\r\n").into_bytes();
    out.extend_from_slice(&answer[head_end..]);
    out
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
