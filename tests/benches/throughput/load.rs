//! The load generator: a fixed number of clients, each on its own
//! keep-alive HTTP/1.1 connection, sending one request after another for a
//! warm-up and then a measured window.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::{Request, StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use crate::cpu;

/// The body every client sends (unless a test needs another).
pub const CHARGE: &str = r#"{"amount": 1250, "currency": "eur"}"#;

/// Which key each request carries.
#[derive(Clone, Debug)]
pub enum Keys {
    /// A new key per request: every request is a first attempt.
    Fresh,
    /// Cycle through the `n` keys per client that [`prepare`] finished.
    Replay(usize),
}

/// One load run.
#[derive(Clone, Debug)]
pub struct Load {
    pub addr: SocketAddr,
    pub path: String,
    pub concurrency: usize,
    pub warmup: Duration,
    pub measure: Duration,
    pub keys: Keys,
    /// Keys are `{prefix}-{client}-{n}`; unique per run.
    pub prefix: String,
    pub body: Bytes,
    /// The server process, for its CPU time.
    pub server_pid: Option<u32>,
    /// The database's processes serving the server, for their CPU time
    /// (see `cpu::sample`).
    pub backends: Vec<u32>,
}

/// What a run measured (the window only).
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub cpu: cpu::PerRequest,
    pub requests: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// A client's HTTP/1.1 connection.
pub struct Client {
    sender: SendRequest<Full<Bytes>>,
    account: String,
}

impl Client {
    pub async fn connect(addr: SocketAddr, account: String) -> Client {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to the server");
        stream.set_nodelay(true).unwrap();
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP handshake");
        tokio::spawn(connection);
        Client { sender, account }
    }

    /// Sends one request; the status, whether it was a replay, and the body.
    pub async fn send(
        &mut self,
        path: &str,
        key: &str,
        body: Bytes,
    ) -> Result<(StatusCode, bool), String> {
        let request = Request::post(path)
            .header(header::HOST, "127.0.0.1")
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-account", &self.account)
            .header("idempotency-key", key)
            .body(Full::new(body))
            .expect("request");
        self.sender.ready().await.map_err(|e| e.to_string())?;
        let response = self
            .sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if status != StatusCode::CREATED {
            return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
        }
        Ok((status, replayed))
    }
}

fn key(prefix: &str, client: usize, n: u64) -> String {
    format!("{prefix}-{client}-{n}")
}

/// Finishes `per_client` keys per client, for a replay run.
pub async fn prepare(load: &Load, per_client: usize) {
    let mut tasks = Vec::new();
    for client in 0..load.concurrency {
        let load = load.clone();
        tasks.push(tokio::spawn(async move {
            let mut http = Client::connect(load.addr, format!("c{client}")).await;
            for n in 0..per_client as u64 {
                let key = key(&load.prefix, client, n);
                // Retried as a client would: a 503 is transient.
                let mut tries = 0;
                while let Err(error) = http.send(&load.path, &key, load.body.clone()).await {
                    tries += 1;
                    assert!(tries < 5, "preparing replay keys: {error}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("client");
    }
}

/// Runs the load; every client on its own connection and account.
pub async fn run(load: &Load) -> Outcome {
    let start = Instant::now() + load.warmup;
    let end = start + load.measure;
    let mut tasks = Vec::new();
    for client in 0..load.concurrency {
        let load = load.clone();
        tasks.push(tokio::spawn(async move {
            drive(&load, client, start, end).await
        }));
    }
    let (pid, backends) = (load.server_pid, load.backends.clone());
    let sampler = tokio::spawn(async move {
        tokio::time::sleep_until(start.into()).await;
        let first = cpu::sample(pid, &backends);
        tokio::time::sleep_until(end.into()).await;
        (first, cpu::sample(pid, &backends))
    });
    let mut outcome = Outcome::default();
    let mut latencies: Vec<u32> = Vec::new();
    for task in tasks {
        let (done, errors, first_error, mut micros) = task.await.expect("client");
        outcome.requests += done;
        outcome.errors += errors;
        outcome.first_error = outcome.first_error.or(first_error);
        latencies.append(&mut micros);
    }
    latencies.sort_unstable();
    let (first, last) = sampler.await.expect("CPU sampler");
    outcome.cpu = first.per_request(&last, outcome.requests, load.measure.as_secs_f64());
    outcome.rps = outcome.requests as f64 / load.measure.as_secs_f64();
    outcome.p50_ms = percentile(&latencies, 0.50);
    outcome.p99_ms = percentile(&latencies, 0.99);
    outcome
}

/// One client: requests until `end`; those that both start and finish
/// inside `[start, end]` are counted.
async fn drive(
    load: &Load,
    client: usize,
    start: Instant,
    end: Instant,
) -> (u64, u64, Option<String>, Vec<u32>) {
    let mut http = Client::connect(load.addr, format!("c{client}")).await;
    let (mut done, mut errors, mut first_error) = (0, 0, None);
    let mut micros = Vec::with_capacity(4096);
    let mut n: u64 = 0;
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let key = match load.keys {
            Keys::Fresh => key(&load.prefix, client, n),
            Keys::Replay(per_client) => key(&load.prefix, client, n % per_client as u64),
        };
        n += 1;
        let result = http.send(&load.path, &key, load.body.clone()).await;
        let finished = Instant::now();
        let result = match (result, &load.keys) {
            (Ok((_, false)), Keys::Replay(_)) => Err("a replay was not replayed".to_owned()),
            (Ok((_, true)), Keys::Fresh) => Err("a first attempt was replayed".to_owned()),
            (result, _) => result,
        };
        if sent < start || finished > end {
            continue;
        }
        match result {
            Ok(_) => {
                done += 1;
                micros.push(finished.duration_since(sent).as_micros() as u32);
            }
            Err(error) => {
                errors += 1;
                first_error.get_or_insert(error);
            }
        }
    }
    (done, errors, first_error, micros)
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    f64::from(sorted[at]) / 1000.0
}
