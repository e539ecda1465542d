//! Peak memory of a server receiving 64 concurrent 256 KiB bodies: the
//! runtime buffers a body once, and the fingerprint and the extractor share
//! that buffer, so the idempotent route should peak close to the baseline.

use bytes::Bytes;
use serde::Serialize;

use crate::ServerProcess;
use crate::app::ServerConfig;
use crate::load::{self, Keys, Load};

pub const CONCURRENCY: usize = 64;
pub const BODY_BYTES: usize = 256 * 1024;
/// Bursts per client: each sends this many bodies back to back.
const BURSTS: usize = 4;

#[derive(Clone, Debug, Serialize)]
pub struct Memory {
    pub route: &'static str,
    pub concurrency: usize,
    pub body_bytes: usize,
    /// VmRSS of the fresh server before the load, in MiB.
    pub rss_before_mib: f64,
    /// VmHWM (peak RSS) of the server after the load, in MiB.
    pub peak_rss_mib: f64,
    /// `peak_rss_mib - rss_before_mib`.
    pub peak_growth_mib: f64,
    /// The bodies in flight at once, in MiB: what buffering each once costs.
    pub bodies_in_flight_mib: f64,
}

/// A JSON charge padded with an ignored `note` to `BODY_BYTES`.
fn big_body() -> Bytes {
    let head = r#"{"amount": 1250, "currency": "eur", "note": ""#;
    let tail = r#""}"#;
    let pad = BODY_BYTES - head.len() - tail.len();
    Bytes::from(format!("{head}{}{tail}", "x".repeat(pad)))
}

/// Measures `route` ("baseline" or "idempotent") on a fresh server.
pub async fn measure(config: &ServerConfig, route: &'static str) -> Memory {
    let server = ServerProcess::start(config).await;
    let before = server.status_kib("VmRSS:");
    let load = Load {
        addr: server.addr,
        path: format!("/1/{route}"),
        concurrency: CONCURRENCY,
        warmup: std::time::Duration::ZERO,
        measure: std::time::Duration::ZERO,
        keys: Keys::Fresh,
        prefix: format!("mem-{route}-{}", std::process::id()),
        body: big_body(),
        server_pid: None,
        backends: Vec::new(),
    };
    load::prepare(&load, BURSTS).await;
    let peak = server.status_kib("VmHWM:");
    let mib = |kib: u64| kib as f64 / 1024.0;
    Memory {
        route,
        concurrency: CONCURRENCY,
        body_bytes: BODY_BYTES,
        rss_before_mib: mib(before),
        peak_rss_mib: mib(peak),
        peak_growth_mib: mib(peak.saturating_sub(before)),
        bodies_in_flight_mib: (CONCURRENCY * BODY_BYTES) as f64 / (1024.0 * 1024.0),
    }
}
