//! The database across a network: at each round-trip time of
//! `IDEM_BENCH_RTT_MS` above 0, PostgreSQL and the peer's Redis (or
//! MariaDB) are reached through [`idem_tests::delay`] proxies, which hold
//! every chunk each way for half that time (this machine's kernel has no
//! `netem`). The proxies
//! run in a child process of their own, so their CPU is neither the load
//! generator's nor the server's; each run reports the share of a core they
//! used. At 0, the server connects directly, as on loopback.
//!
//! Each run's figures also land in the JSON's `network` array, which
//! [`idem_tests::chart`] draws against round-trip time twice: as requests
//! per second, and as the database's CPU per request.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use idem_tests::chart::{self, Measure};
use idem_tests::delay::Delay;
use serde_json::{Value, json};
use sqlx::Connection;

use crate::{ROLE_DELAY, spawn_listening};

const UPSTREAMS: &str = "IDEM_BENCH_DELAY_UPSTREAMS";
const RTT: &str = "IDEM_BENCH_DELAY_RTT_MS";

/// The child process: one delay proxy per upstream (`host:port`, comma
/// separated), printed in order on one `LISTENING` line; serves until the
/// parent closes our stdin.
pub fn delay_child() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    let upstreams = std::env::var(UPSTREAMS).expect("started by the benchmark");
    let rtt: f64 = crate::app::env_number(RTT, 0.0);
    let proxies: Vec<Delay> = upstreams
        .split(',')
        .map(|upstream| {
            let addr = resolve(upstream);
            Delay::start(addr, Duration::from_secs_f64(rtt / 1000.0))
                .unwrap_or_else(|error| panic!("delay proxy for {upstream}: {error}"))
        })
        .collect();
    let addrs: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    println!("LISTENING {}", addrs.join(","));
    // The parent holds our stdin: its end (or death) ends us.
    for _ in std::io::stdin().lines() {}
}

/// The first of `host_port`'s addresses that accepts a connection (a
/// `localhost` may resolve to `::1` first where the server listens on
/// 127.0.0.1 only).
fn resolve(host_port: &str) -> SocketAddr {
    host_port
        .to_socket_addrs()
        .unwrap_or_else(|error| panic!("cannot resolve {host_port}: {error}"))
        .find(|addr| std::net::TcpStream::connect_timeout(addr, Duration::from_secs(2)).is_ok())
        .unwrap_or_else(|| panic!("nothing listens at {host_port}"))
}

/// The databases as the server reaches them at one round-trip time.
pub struct Network {
    pub rtt_ms: f64,
    /// The upstreams' URLs, in order, as the server is to use them.
    pub urls: Vec<String>,
    /// The proxies' process, when `rtt_ms > 0`.
    proxies: Option<(tokio::process::Child, u32)>,
}

impl Network {
    /// Direct at 0 ms; otherwise through a delay proxy for each of
    /// `upstreams` (a URL, and the port its scheme implies), whose URLs are
    /// returned pointing at the proxies.
    pub async fn start(rtt_ms: f64, upstreams: &[(&str, u16)]) -> Network {
        if rtt_ms <= 0.0 {
            return Network {
                rtt_ms: 0.0,
                urls: upstreams.iter().map(|&(url, _)| url.to_owned()).collect(),
                proxies: None,
            };
        }
        let mut urls = Vec::new();
        let mut hosts = Vec::new();
        for &(url, port) in upstreams {
            let url = reqwest::Url::parse(url).unwrap_or_else(|_| panic!("not a URL: {url}"));
            let host = url.host_str().expect("a URL with a host");
            hosts.push(format!("{host}:{}", url.port().unwrap_or(port)));
            urls.push(url);
        }
        let (child, listening) = spawn_listening(vec![
            (crate::app::ROLE, ROLE_DELAY.to_owned()),
            (UPSTREAMS, hosts.join(",")),
            (RTT, rtt_ms.to_string()),
        ])
        .await;
        let addrs = listening
            .split(',')
            .map(|addr| addr.parse::<SocketAddr>().expect("a proxy address"));
        for (url, addr) in urls.iter_mut().zip(addrs) {
            url.set_ip_host(addr.ip()).expect("a URL with a host");
            url.set_port(Some(addr.port())).expect("a URL with a port");
        }
        let pid = child.id().expect("delay proxies running");
        Network {
            rtt_ms,
            urls: urls.into_iter().map(String::from).collect(),
            proxies: Some((child, pid)),
        }
    }

    /// CPU seconds the proxies have used so far (`None` when direct).
    pub fn cpu_secs(&self) -> Option<f64> {
        self.proxies
            .as_ref()
            .map(|&(_, pid)| crate::cpu::process_secs(pid))
    }
}

/// The round trip as a client sees it: the median of 200 `SELECT 1` on
/// one connection to `url`, in milliseconds (the server's own time
/// included), after 20 that warm the connection up.
pub async fn measured_rtt_ms<DB: sqlx::Database>(url: &str) -> f64
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'q> DB::Arguments: sqlx::IntoArguments<DB>,
{
    let mut connection = DB::Connection::connect(url)
        .await
        .expect("connect through the network");
    let mut times = Vec::with_capacity(220);
    for _ in 0..220 {
        let started = Instant::now();
        sqlx::query::<DB>("SELECT 1")
            .execute(&mut connection)
            .await
            .expect("SELECT 1");
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    connection.close().await.ok();
    let mut times = times.split_off(20);
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Some((child, _)) = self.proxies.as_mut() {
            let _ = child.start_kill();
        }
    }
}

/// One run's point for the charts and the network table: its req/s, the
/// database's CPU per request, median latencies and ratios, from a run's JSON (`report::run_json` with
/// the network fields).
pub fn point(run: &Value) -> Value {
    let rps = |scenario: &str| {
        run[format!("{scenario}_rps")]
            .as_f64()
            .or_else(|| run[format!("diagnostic_{scenario}_rps")].as_f64())
            .filter(|rps| *rps > 0.0)
    };
    let db_cpu_us = |scenario: &str| {
        run[format!("{scenario}_cpu")]["database_us"]
            .as_f64()
            .or_else(|| run[format!("diagnostic_{scenario}_cpu")]["database_us"].as_f64())
            .filter(|_| rps(scenario).is_some())
    };
    // The diagnostics (the peer) keep no latency of their own in a run.
    let p50 = |scenario: &str| {
        run[format!("{scenario}_p50_ms")]
            .as_f64()
            .filter(|_| rps(scenario).is_some())
    };
    json!({
        "engine": run["engine"],
        "rtt_ms": run["rtt_ms"],
        "measured_rtt_ms": run["measured_rtt_ms"],
        "statements": run["statements_per_handler"],
        "concurrency": run["concurrency"],
        "delay_cpu_cores": run["delay_cpu_cores"],
        "rps": {
            "baseline": rps("baseline"),
            "idempotent": rps("idempotent"),
            "replay": rps("replay"),
            "two_phase": rps("two_phase"),
            "peer": rps("peer"),
        },
        "db_cpu_us": {
            "baseline": db_cpu_us("baseline"),
            "idempotent": db_cpu_us("idempotent"),
            "replay": db_cpu_us("replay"),
            "two_phase": db_cpu_us("two_phase"),
            "peer": db_cpu_us("peer"),
        },
        "p50_ms": {
            "baseline": p50("baseline"),
            "idempotent": p50("idempotent"),
            "replay": p50("replay"),
            "two_phase": p50("two_phase"),
        },
        "ratios": {
            "idempotent_to_baseline": run["ratio_idempotent_to_baseline"],
            "replay_to_baseline": run["ratio_replay_to_baseline"],
            "idempotent_to_two_phase": run["ratio_idempotent_to_two_phase"],
            "peer_to_baseline": run["diagnostic_ratio_peer_to_baseline"],
            "idempotent_to_peer": run["diagnostic_ratio_idempotent_to_peer"],
        },
    })
}

/// The targets across the network and against the peer, on
/// PostgreSQL at 16 clients and one statement; the round-trip times are
/// matched to within 0.05 ms of 0.5 and 2.
pub fn targets(points: &[Value]) {
    let verdict = |ratio: f64, target: f64| match ratio {
        ratio if ratio.is_nan() => "not run",
        ratio if ratio >= target => "met",
        _ => "MISSED",
    };
    for point in points.iter().filter(|point| {
        point["engine"] == "postgres" && point["concurrency"] == 16 && point["statements"] == 1
    }) {
        let rtt = point["rtt_ms"].as_f64().unwrap_or(f64::NAN);
        let ratio = |name: &str| point["ratios"][name].as_f64().unwrap_or(f64::NAN);
        let (idem, two, peer) = (
            ratio("idempotent_to_baseline"),
            ratio("idempotent_to_two_phase"),
            ratio("idempotent_to_peer"),
        );
        let near = |target: f64| (rtt - target).abs() < 0.05;
        let mut line = format!(
            "network, postgres, 1 statement, 16 clients, RTT {rtt} ms (measured {:.2}): ",
            point["measured_rtt_ms"].as_f64().unwrap_or(f64::NAN)
        );
        if near(2.0) {
            line += &format!(
                "idempotent/baseline {idem:.2} (>= 1.15: {}), idempotent/two_phase {two:.2} \
                 (>= 1.5: {}), idempotent/peer {peer:.2} (>= 2.0: {})",
                verdict(idem, 1.15),
                verdict(two, 1.5),
                verdict(peer, 2.0)
            );
        } else if near(0.5) {
            line += &format!(
                "idempotent/baseline {idem:.2} (>= 1.0: {}), idempotent/two_phase {two:.2}, \
                 idempotent/peer {peer:.2}",
                verdict(idem, 1.0)
            );
        } else if rtt == 0.0 {
            line += &format!(
                "idempotent/baseline {idem:.2}, idempotent/peer {peer:.2} (>= 1.0: {})",
                verdict(peer, 1.0)
            );
        } else {
            line += &format!(
                "idempotent/baseline {idem:.2}, idempotent/two_phase {two:.2}, \
                 idempotent/peer {peer:.2}"
            );
        }
        println!("{line}");
    }
}

/// Two charts per engine, statement count and concurrency that ran at more
/// than one round-trip time, written beside `json`: requests per second as
/// `network-<engine>-<statements>stmt-<clients>c.svg`, the database's CPU
/// per request as `network-<engine>-<statements>stmt-<clients>c-db-cpu.svg`;
/// the paths written.
pub fn charts(report: &Value, json: &Path) -> Vec<PathBuf> {
    let points = report["network"].as_array().cloned().unwrap_or_default();
    let mut shapes: Vec<(String, u32, usize)> = points
        .iter()
        .filter_map(|point| {
            Some((
                point["engine"].as_str()?.to_owned(),
                u32::try_from(point["statements"].as_u64()?).ok()?,
                usize::try_from(point["concurrency"].as_u64()?).ok()?,
            ))
        })
        .collect();
    shapes.sort();
    shapes.dedup();
    let mut written = Vec::new();
    for (engine, statements, concurrency) in shapes {
        let name = match engine.as_str() {
            "postgres" => "PostgreSQL",
            "mysql" => "MariaDB",
            other => other,
        };
        let shape = format!("{statements} statement(s) per handler, {concurrency} clients");
        for (measure, suffix, title) in [
            (Measure::Throughput, "", format!("{name}, {shape}")),
            (
                Measure::DatabaseCpu,
                "-db-cpu",
                format!("{name}'s CPU per request, {shape}"),
            ),
        ] {
            let series = chart::network_series(report, &engine, statements, concurrency, measure);
            if series.iter().all(|line| line.points.len() < 2) {
                continue;
            }
            let path = json.with_file_name(format!(
                "network-{engine}-{statements}stmt-{concurrency}c{suffix}.svg"
            ));
            match chart::write_svg(&path, &title, measure, &series) {
                Ok(()) => written.push(path),
                Err(error) => eprintln!("chart {}: {error}", path.display()),
            }
        }
    }
    written
}
