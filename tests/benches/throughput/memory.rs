//! Peak memory of a server receiving many large bodies at once, keyed
//! (`idempotent`) and without idempotency (`baseline`, the same handler
//! and body; the key header it is sent goes unread). The runtime buffers a
//! body once, and the fingerprint and the extractor share that buffer, so
//! the idempotent route should peak close to the baseline. Two cases:
//! 64 x 256 KiB of one long string, and 128 x 2 MB (axum's default body
//! limit) of `1e20`s, which RFC 8785 writes as 21 digits each, in a member
//! the handler never reads.

use bytes::Bytes;
use serde::Serialize;

use crate::ServerProcess;
use crate::app::ServerConfig;
use crate::load::{self, Keys, Load};

/// Bursts per client: each sends this many bodies back to back.
const BURSTS: usize = 4;

/// axum's `DefaultBodyLimit`, which the benchmark's app keeps.
const AXUM_BODY_LIMIT: usize = 2 * 1024 * 1024;

/// One body shape sent by many clients at once.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub name: &'static str,
    pub concurrency: usize,
    pub body_bytes: usize,
    body: fn(usize) -> Bytes,
}

pub const CASES: [Case; 2] = [
    Case {
        name: "string_256KiB",
        concurrency: 64,
        body_bytes: 256 * 1024,
        body: note_string,
    },
    Case {
        name: "numbers_2MB",
        concurrency: 128,
        body_bytes: AXUM_BODY_LIMIT,
        body: note_numbers,
    },
];

#[derive(Clone, Debug, Serialize)]
pub struct Memory {
    pub case: &'static str,
    pub route: &'static str,
    pub concurrency: usize,
    pub body_bytes: usize,
    /// VmRSS of the fresh server before the load, in MiB.
    pub rss_before_mib: f64,
    /// VmHWM (peak RSS) of the server after the load, in MiB.
    pub peak_rss_mib: f64,
    /// `peak_rss_mib - rss_before_mib`.
    pub peak_growth_mib: f64,
    /// VmRSS after the load, in MiB: what the server kept.
    pub rss_after_mib: f64,
    /// The bodies in flight at once, in MiB: what buffering each once costs.
    pub bodies_in_flight_mib: f64,
}

const HEAD: &str = r#"{"amount": 1250, "currency": "eur", "note": "#;

/// A JSON charge padded with an ignored string `note` to `bytes`.
fn note_string(bytes: usize) -> Bytes {
    let pad = bytes - HEAD.len() - "\"\"}".len();
    Bytes::from(format!("{HEAD}\"{}\"}}", "x".repeat(pad)))
}

/// A JSON charge whose ignored `note` is an array of `1e20` (5 bytes with
/// its comma, 21 digits canonical), up to `bytes`.
fn note_numbers(bytes: usize) -> Bytes {
    let count = (bytes - HEAD.len() - "[]}".len() + 1) / "1e20,".len();
    let mut body = String::with_capacity(bytes);
    body.push_str(HEAD);
    body.push('[');
    body.push_str(&vec!["1e20"; count].join(","));
    body.push_str("]}");
    assert!(body.len() <= bytes);
    Bytes::from(body)
}

/// Measures `route` ("baseline" or "idempotent") on a fresh server.
pub async fn measure(config: &ServerConfig, case: Case, route: &'static str) -> Memory {
    let server = ServerProcess::start(config).await;
    let before = server.status_kib("VmRSS:");
    let body = (case.body)(case.body_bytes);
    let load = Load {
        addr: server.addr,
        path: format!("/1/{route}"),
        concurrency: case.concurrency,
        warmup: std::time::Duration::ZERO,
        measure: std::time::Duration::ZERO,
        keys: Keys::Fresh,
        prefix: format!("mem-{}-{route}-{}", case.name, std::process::id()),
        body: body.clone(),
        server_pid: None,
        backends: Vec::new(),
    };
    load::prepare(&load, BURSTS).await;
    let peak = server.status_kib("VmHWM:");
    let after = server.status_kib("VmRSS:");
    let mib = |kib: u64| kib as f64 / 1024.0;
    Memory {
        case: case.name,
        route,
        concurrency: case.concurrency,
        body_bytes: body.len(),
        rss_before_mib: mib(before),
        peak_rss_mib: mib(peak),
        peak_growth_mib: mib(peak.saturating_sub(before)),
        rss_after_mib: mib(after),
        bodies_in_flight_mib: (case.concurrency * body.len()) as f64 / (1024.0 * 1024.0),
    }
}

/// Every case on both routes, each on a fresh server, printed as it goes
/// with the keyed/unkeyed ratios.
pub async fn report(config: &ServerConfig) -> Vec<Memory> {
    let mut all = Vec::new();
    println!();
    for case in CASES {
        let mut pair = Vec::new();
        for route in ["baseline", "idempotent"] {
            let m = measure(config, case, route).await;
            println!(
                "memory, {} clients x {} bytes ({:.0} MiB in flight), {} on {:<10}: RSS {:.1} MiB \
                 before, peak {:.1} MiB (+{:.1} MiB), {:.1} MiB after",
                m.concurrency,
                m.body_bytes,
                m.bodies_in_flight_mib,
                m.case,
                m.route,
                m.rss_before_mib,
                m.peak_rss_mib,
                m.peak_growth_mib,
                m.rss_after_mib
            );
            pair.push(m);
        }
        let (base, keyed) = (&pair[0], &pair[1]);
        println!(
            "memory, {}: idempotent/baseline peak RSS {:.2}, peak growth {:.2}",
            case.name,
            keyed.peak_rss_mib / base.peak_rss_mib,
            keyed.peak_growth_mib / base.peak_growth_mib
        );
        all.append(&mut pair);
    }
    all
}
