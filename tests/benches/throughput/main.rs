//! Side-by-side throughput of one write handler: without idempotency
//! (`baseline`), with `#[idempotent]` (`idempotent`, a fresh key per
//! request), answered from the store (`replay`), and the hand-written
//! claim-commit-then-work recipe (`two_phase`); 1 and 3 statements, 16 and
//! 64 concurrent clients, over real HTTP on loopback, on PostgreSQL and on
//! SQLite (a WAL file), and on MariaDB when asked for; PostgreSQL (and
//! MariaDB) also across a network, at the round-trip times of
//! `IDEM_BENCH_RTT_MS` (`network.rs`). Also, when named in `IDEM_BENCH_SCENARIOS`, the
//! provider scenarios (`provider.rs`): a payment that inserts a pending
//! row, calls a fake provider over HTTP on loopback and marks the row paid,
//! written without idempotency (`plain_provider`), in the atomic mode
//! (`atomic_provider`, the transaction held over the call), as the
//! hand-written two-phase recipe (`two_phase_provider`) and in the phased
//! mode (`phased`); at each concurrency, not per statement count.
//!
//! ```text
//! cargo bench --bench throughput
//! IDEM_BENCH_SCENARIOS=plain_provider,atomic_provider,two_phase_provider,phased \
//!     cargo bench --bench throughput
//! ```
//!
//! The server runs in a child process (so its memory and CPU are its own);
//! the load generator is in this process. Before the load, the round trips
//! of one request per scenario are counted exactly through a proxy
//! (`idem_tests::pg_proxy`): `extra_round_trips` is idempotent minus
//! baseline. Each row also shows the CPU per request of the load generator,
//! the server and PostgreSQL, from `/proc`: on a machine whose cores are all
//! busy, throughput is cores / CPU per request, so that column says what
//! limits a scenario, and it is steadier than req/s when other work shares
//! the machine. Prints one table, then the path of a JSON file with every
//! figure, last. Environment:
//!
//! | variable | default | |
//! |---|---|---|
//! | `IDEM_TEST_POSTGRES_URL` | `postgres://postgres@127.0.0.1:5432/test` | the server |
//! | `IDEM_BENCH_SECS` | 2 | measured seconds per scenario and round (after the warm-up) |
//! | `IDEM_BENCH_WARMUP_MS` | 1000 | warm-up per scenario |
//! | `IDEM_BENCH_ROUNDS` | 3 | rounds, each running every scenario back to back; a ratio is the median of the rounds' ratios, req/s and latencies are the best round's, and each round's ratios are printed (`by round`) and kept in the JSON (`*_by_round`) |
//! | `IDEM_BENCH_CONCURRENCY` | `16,64` | concurrent clients |
//! | `IDEM_BENCH_STATEMENTS` | `1,3` | statements per handler |
//! | `IDEM_BENCH_SCENARIOS` | the four | a subset, or also the diagnostics `read_floor` (`floor.rs`), `optimistic` (`optimistic.rs`), `two_phase_tx` (`handlers.rs`) and `peer` (the `idempotent` crate with Redis, `idem_tests::peer`), and the provider scenarios `plain_provider`, `atomic_provider`, `two_phase_provider` and `phased` (`provider.rs`); a list with none of the four or the diagnostics runs no statement-count shape |
//! | `IDEM_BENCH_RTT_MS` | 0 | round-trip times to PostgreSQL (and the peer's Redis), each a pass of PostgreSQL's scenarios: at 0 the server connects directly; above, through delay proxies (`network.rs`); every pass lands in the JSON's `network` array, and with two or more, two charts per shape beside the JSON: req/s (`network-*.svg`) and the database's CPU per request (`network-*-db-cpu.svg`) |
//! | `IDEM_BENCH_ENGINES` | `postgres,sqlite` | `postgres` alone skips SQLite (PostgreSQL always runs); `mysql` adds MariaDB |
//! | `IDEM_BENCH_REDIS_URL` | `redis://127.0.0.1:6379` | the `peer` scenario's Redis |
//! | `IDEM_BENCH_ADVISORY_LOCKS` | 1 | 0: the claim without advisory locks, as on a server without them (diagnostic) |
//! | `IDEM_BENCH_POOLER` | `session` | `transaction`: `idem`'s statements keep nothing in the session (`Pooler::Transaction`), for an A/B of what that costs |
//! | `IDEM_BENCH_ENCRYPTION` | 0 | 1: stored responses sealed at rest (`Idem::encryption`), for an A/B of what that costs |
//! | `IDEM_BENCH_HASH_KEYS` | 0 | 1: scopes and keys stored hashed (`Idem::hash_keys`), for an A/B of what that costs |
//! | `IDEM_BENCH_POOL` | 16 | the server's connection pool (all scenarios) |
//! | `IDEM_BENCH_SERVER_THREADS` | cores | the server's tokio workers |
//! | `IDEM_BENCH_FILLFACTOR` | 100 | fillfactor of the key tables (diagnostic) |
//! | `IDEM_BENCH_TEST_BEFORE_ACQUIRE` | 1 | 0: the server's pool skips sqlx's ping before handing out a connection (diagnostic) |
//! | `IDEM_BENCH_MEMORY` | 1 | 0: no memory report at the end |
//! | `IDEM_BENCH_MYSQL_URL` | `mysql://root@127.0.0.1:3306/idem_bench` | with `mysql` in `IDEM_BENCH_ENGINES` (and the bench built with `--features mysql`): the MariaDB server and the benchmark's own database there, created if missing |
//! | `IDEM_BENCH_LOG` | `warn,sqlx::query=error` | the server's log filter |
//! | `IDEM_BENCH_JSON` | `<target>/idem-bench/throughput.json` | the JSON file |
//! | `IDEM_BENCH_ONLY` | | `memory`: only the memory report (`memory.rs`), its JSON in `memory.json` beside the other |

mod app;
mod count;
mod cpu;
mod floor;
mod handlers;
mod load;
mod memory;
#[cfg(feature = "mysql")]
mod mysql;
mod network;
mod optimistic;
mod provider;
mod report;
mod sqlite;

use idem_tests::{account, pg_proxy, stats};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

use app::{ServerConfig, env_number};
use load::{Keys, Load, Outcome};

const SCENARIOS: [&str; 4] = ["baseline", "idempotent", "replay", "two_phase"];
/// Diagnostic scenarios (see `floor`, `optimistic` and `two_phase_tx` in
/// `handlers`), run on PostgreSQL only when named in
/// `IDEM_BENCH_SCENARIOS`; printed, and kept in the JSON as
/// `diagnostic_*`, apart from the issue's fields.
const DIAGNOSTICS: [&str; 4] = ["read_floor", "optimistic", "two_phase_tx", "peer"];
/// `optimistic`'s place among a group's scenarios.
const OPTIMISTIC: usize = SCENARIOS.len() + 1;
/// `two_phase_tx`'s place among a group's scenarios.
const TWO_PHASE_TX: usize = SCENARIOS.len() + 2;
/// `peer`'s place: the plain handler behind the `idempotent` crate (0.3)
/// with its Redis store (`idem_tests::peer`), as a Rust team would write it.
const PEER: usize = SCENARIOS.len() + 3;
/// The provider scenarios (see `provider`), run when named in
/// `IDEM_BENCH_SCENARIOS`, once per concurrency (and engine); kept in the
/// JSON as `provider_runs`.
pub const PROVIDER: [&str; 4] = [
    "plain_provider",
    "atomic_provider",
    "two_phase_provider",
    "phased",
];
/// Places among the provider group's scenarios.
pub const PLAIN_PROVIDER: usize = 0;
pub const ATOMIC_PROVIDER: usize = 1;
pub const TWO_PHASE_PROVIDER: usize = 2;
pub const PHASED: usize = 3;
/// `IDEM_BENCH_ROLE` of the delay proxies' process (`network`).
pub const ROLE_DELAY: &str = "delay";
/// Finished keys per client that a replay run cycles through.
const REPLAY_KEYS: usize = 16;

fn main() {
    match std::env::var(app::ROLE).as_deref() {
        Ok("server") => return app::serve_child(),
        // The tables alone, for `benches/instructions.sh`'s own cluster.
        Ok("setup") => return app::setup_child(),
        Ok(ROLE_DELAY) => return network::delay_child(),
        _ => {}
    }
    // `cargo test --benches` runs this binary without `--bench`: nothing to test.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("throughput: a benchmark; run it with `cargo bench --bench throughput`");
        return;
    }
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("load generator runtime")
        .block_on(bench());
}

struct Settings {
    url: String,
    secs: u64,
    warmup: Duration,
    rounds: usize,
    concurrency: Vec<usize>,
    statements: Vec<u32>,
    scenarios: Vec<String>,
    engines: Vec<String>,
    /// Round-trip times to PostgreSQL, in milliseconds (0: direct).
    rtts: Vec<f64>,
    server: ServerConfig,
}

impl Settings {
    fn from_env() -> Self {
        let url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let settings = Self {
            server: ServerConfig::from_env(url.clone()),
            url,
            secs: env_number("IDEM_BENCH_SECS", 2),
            warmup: Duration::from_millis(env_number("IDEM_BENCH_WARMUP_MS", 1000)),
            rounds: env_number("IDEM_BENCH_ROUNDS", 3usize).max(1),
            concurrency: env_list("IDEM_BENCH_CONCURRENCY", "16,64"),
            statements: env_list("IDEM_BENCH_STATEMENTS", "1,3"),
            scenarios: env_list("IDEM_BENCH_SCENARIOS", &SCENARIOS.join(",")),
            engines: env_list("IDEM_BENCH_ENGINES", "postgres,sqlite"),
            rtts: env_list("IDEM_BENCH_RTT_MS", "0"),
        };
        assert!(
            settings
                .rtts
                .iter()
                .all(|rtt| rtt.is_finite() && *rtt >= 0.0),
            "IDEM_BENCH_RTT_MS: round-trip times are milliseconds, 0 or more"
        );
        for scenario in &settings.scenarios {
            assert!(
                SCENARIOS
                    .iter()
                    .chain(&DIAGNOSTICS)
                    .chain(&PROVIDER)
                    .any(|known| known == scenario),
                "IDEM_BENCH_SCENARIOS: no scenario {scenario}"
            );
        }
        settings
    }

    fn selected(&self, scenario: &str) -> bool {
        self.scenarios.iter().any(|s| s == scenario)
    }

    /// Whether any statement-count scenario (the four, the diagnostics)
    /// is selected.
    fn shapes(&self) -> bool {
        SCENARIOS
            .iter()
            .chain(&DIAGNOSTICS)
            .any(|s| self.selected(s))
    }

    /// Whether any provider scenario is selected.
    fn payments(&self) -> bool {
        PROVIDER.iter().any(|s| self.selected(s))
    }
}

fn env_list<T: std::str::FromStr>(name: &str, default: &str) -> Vec<T> {
    let value = std::env::var(name).unwrap_or_else(|_| default.to_owned());
    value
        .split(',')
        .map(|item| {
            item.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}={value}: not a valid list"))
        })
        .collect()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|load| {
            load.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

async fn bench() {
    let settings = Settings::from_env();
    assert!(
        settings.concurrency.iter().all(|&c| c <= app::ACCOUNTS),
        "at most {} clients (one account row each)",
        app::ACCOUNTS
    );
    let load_before = loadavg();
    println!(
        "idem throughput: PostgreSQL at {}, {} s per scenario after {} ms warm-up, {} round(s) \
         (ratios: the median of the rounds'), server pool {} connections, {} server threads; \
         load average {load_before}",
        settings.url,
        settings.secs,
        settings.warmup.as_millis(),
        settings.rounds,
        settings.server.pool,
        settings.server.threads,
    );
    let admin = app::connect(&settings.url, 2, false).await;
    app::setup(&admin)
        .await
        .expect("create the benchmark tables");

    if std::env::var("IDEM_BENCH_ONLY").as_deref() == Ok("memory") {
        let memory = memory::report(&settings.server).await;
        let path = json_path().with_file_name("memory.json");
        std::fs::create_dir_all(path.parent().expect("a directory"))
            .expect("create the JSON directory");
        std::fs::write(&path, serde_json::to_string_pretty(&memory).unwrap())
            .expect("write the JSON");
        println!("{}", path.display());
        return;
    }

    let trips = if settings.shapes() {
        count::count(&settings.url, &settings.statements).await
    } else {
        Vec::new()
    };
    for t in &trips {
        println!(
            "round trips per request ({} statement(s), pool pings included): baseline {}, \
             idempotent {}, replay {}, two_phase {} => extra_round_trips = {} \
             (diagnostics: optimistic {}, two_phase_tx {})",
            t.statements_per_handler,
            t.baseline,
            t.idempotent,
            t.replay,
            t.two_phase,
            t.extra_round_trips,
            t.optimistic,
            t.two_phase_tx
        );
    }

    let provider_trips = if settings.payments() {
        let t = count::count_provider(&settings.url).await;
        println!(
            "round trips per payment (provider scenarios, pool pings included): plain_provider {}, \
             atomic_provider {}, two_phase_provider {}, phased {} (replay {}, with a spare connection {}) \
             => phased - atomic = {}, phased - two_phase = {}; phased's, as sent:",
            t.plain_provider,
            t.atomic_provider,
            t.two_phase_provider,
            t.phased,
            t.phased_replay,
            t.phased_spare_connection,
            t.phased_extra_over_atomic,
            t.phased_extra_over_two_phase
        );
        for (i, round_trip) in t.phased_recorded.iter().enumerate() {
            println!("  {:>2}. {round_trip}", i + 1);
        }
        Some(t)
    } else {
        None
    };

    let mut out = Collected::default();
    for &rtt in &settings.rtts {
        // Every pass starts alike, and no pass meets another's keys.
        app::setup(&admin)
            .await
            .expect("empty the benchmark tables");
        // Redis is behind the same delay, when the peer runs.
        let mut upstreams = vec![(settings.url.as_str(), 5432)];
        if settings.selected("peer") {
            upstreams.push((&settings.server.redis_url, 6379));
        }
        let net = network::Network::start(rtt, &upstreams).await;
        let measured = network::measured_rtt_ms::<sqlx::Postgres>(&net.urls[0]).await;
        let config = ServerConfig {
            database_url: net.urls[0].clone(),
            redis_url: net
                .urls
                .get(1)
                .unwrap_or(&settings.server.redis_url)
                .clone(),
            ..settings.server.clone()
        };
        let placed = Placed {
            net: &net,
            measured,
        };
        pass(
            &settings,
            &admin,
            &config,
            Some(placed),
            &trips,
            provider_trips.as_ref(),
            &mut out,
        )
        .await;
    }

    // MariaDB: the same service, at each round-trip time too.
    if settings.engines.iter().any(|engine| engine == "mysql") {
        #[cfg(not(feature = "mysql"))]
        panic!("IDEM_BENCH_ENGINES=mysql: build the benchmark with `--features mysql`");
        #[cfg(feature = "mysql")]
        let url = std::env::var("IDEM_BENCH_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/idem_bench".to_owned());
        #[cfg(feature = "mysql")]
        for &rtt in &settings.rtts {
            mysql::setup(&url)
                .await
                .expect("create the MariaDB benchmark database");
            let net = network::Network::start(rtt, &[(&url, 3306)]).await;
            let measured = network::measured_rtt_ms::<sqlx::MySql>(&net.urls[0]).await;
            let config = ServerConfig {
                engine: "mysql",
                database_url: net.urls[0].clone(),
                ..settings.server.clone()
            };
            let placed = Placed {
                net: &net,
                measured,
            };
            pass(
                &settings,
                &admin,
                &config,
                Some(placed),
                &[],
                None,
                &mut out,
            )
            .await;
        }
    }

    // SQLite: the same service on a WAL file, in its own server process.
    let sqlite_file = json_path().with_file_name("bench.sqlite3");
    if settings.engines.iter().any(|engine| engine == "sqlite") {
        let sqlite = ServerConfig {
            engine: "sqlite",
            database_url: sqlite_file.display().to_string(),
            ..settings.server.clone()
        };
        sqlite::setup(&sqlite.database_url)
            .await
            .expect("create the SQLite benchmark database");
        pass(&settings, &admin, &sqlite, None, &[], None, &mut out).await;
    }
    let Collected {
        runs,
        provider_runs,
        points,
    } = out;

    let memory = if app::env_number("IDEM_BENCH_MEMORY", 1) == 1 {
        memory::report(&settings.server).await
    } else {
        Vec::new()
    };

    println!();
    if settings.shapes() {
        report::targets(&runs, &trips);
        network::targets(&points);
    }
    if settings.payments() {
        report::provider_summary(&provider_runs);
    }
    let load_after = loadavg();
    println!("load average before {load_before}, after {load_after}");

    let report = json!({
        "command": "cargo bench --bench throughput",
        "engine": "postgres and sqlite (see each run)",
        "extra_round_trips": trips.iter().map(|t| t.extra_round_trips).max(),
        "round_trips": trips,
        "runs": runs,
        "network": points,
        "provider_round_trips": provider_trips,
        "provider_runs": provider_runs,
        "memory": memory,
        "sqlite_file": sqlite_file,
        "settings": {
            "rtt_ms": settings.rtts,
            "secs": settings.secs,
            "warmup_ms": settings.warmup.as_millis() as u64,
            "rounds": settings.rounds,
            "pool": settings.server.pool,
            "server_threads": settings.server.threads,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        },
        "load_average_before": load_before,
        "load_average_after": load_after,
    });
    let path = json_path();
    std::fs::create_dir_all(path.parent().expect("a directory"))
        .expect("create the JSON directory");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).expect("write the JSON");
    for chart in network::charts(&report, &path) {
        println!("{}", chart.display());
    }
    println!("{}", path.display());
}

/// Every run's JSON object so far.
#[derive(Default)]
struct Collected {
    runs: Vec<serde_json::Value>,
    provider_runs: Vec<serde_json::Value>,
    /// The runs' points for the network table and chart (`network::point`).
    points: Vec<serde_json::Value>,
}

/// Where a pass's database is: at which round-trip time, through which
/// delay proxies (whose CPU each run reports), and the round trip measured.
struct Placed<'a> {
    net: &'a network::Network,
    measured: f64,
}

/// One engine's scenarios, every shape and concurrency, in one server
/// process started with `config`; each run is labelled with the engine
/// and, when `placed`, where its database was (and becomes a point).
async fn pass(
    settings: &Settings,
    admin: &sqlx::PgPool,
    config: &ServerConfig,
    placed: Option<Placed<'_>>,
    trips: &[count::RoundTrips],
    provider_trips: Option<&count::ProviderTrips>,
    out: &mut Collected,
) {
    let engine = config.engine;
    if let Some(placed) = &placed {
        println!(
            "\n{engine}: round-trip time {} ms ({}), measured {:.3} ms per SELECT 1",
            placed.net.rtt_ms,
            if placed.net.rtt_ms > 0.0 {
                "through delay proxies"
            } else {
                "direct"
            },
            placed.measured
        );
    }
    let server = ServerProcess::start(config).await;
    // Adds to a run where the database was and how much of a core the
    // delay proxies used over its group (warm-ups included; null when
    // direct).
    let cpu = || placed.as_ref().and_then(|placed| placed.net.cpu_secs());
    let place =
        |mut run: serde_json::Value, cpu_before: Option<f64>, started: std::time::Instant| {
            if let Some(placed) = &placed {
                let fields = run.as_object_mut().expect("a run is an object");
                fields.insert("rtt_ms".into(), json!(placed.net.rtt_ms));
                fields.insert("measured_rtt_ms".into(), json!(placed.measured));
                let wall = started.elapsed().as_secs_f64();
                let cores = cpu()
                    .zip(cpu_before)
                    .map(|(after, before)| (after - before) / wall);
                fields.insert("delay_cpu_cores".into(), json!(cores));
            }
            run
        };
    if settings.shapes() {
        print_header();
        for &statements in &settings.statements {
            for &concurrency in &settings.concurrency {
                let (before, started) = (cpu(), std::time::Instant::now());
                let results = group(settings, &server, admin, statements, concurrency).await;
                let extra = trips
                    .iter()
                    .find(|t| t.statements_per_handler == statements)
                    .map(|t| t.extra_round_trips);
                let run = place(
                    report::run_json(engine, statements, concurrency, &results, extra),
                    before,
                    started,
                );
                if placed.is_some() {
                    out.points.push(network::point(&run));
                }
                out.runs.push(run);
            }
        }
    }
    if settings.payments() {
        print_provider_header();
        for &concurrency in &settings.concurrency {
            let (before, started) = (cpu(), std::time::Instant::now());
            let results = provider_group(settings, &server, admin, concurrency).await;
            out.provider_runs.push(place(
                report::provider_json(engine, concurrency, &results, provider_trips),
                before,
                started,
            ));
        }
    }
}

/// One shape's scenarios, in the order of `SCENARIOS` then `DIAGNOSTICS`,
/// or the provider scenarios in the order of `PROVIDER` (a scenario not
/// selected stays at zero).
struct Group {
    /// The best round of each scenario.
    best: Vec<Outcome>,
    /// Requests per second of each round, per scenario.
    rounds: Vec<Vec<f64>>,
}

impl Group {
    /// `a / b` in each round: scenarios run back to back within a round,
    /// so this shows how far the machine moved between rounds.
    fn ratio_by_round(&self, a: usize, b: usize) -> Vec<f64> {
        stats::ratio_by_round(&self.rounds, a, b)
    }

    /// The median of `a / b` over the rounds: see [`stats::paired_ratio`].
    fn ratio(&self, a: usize, b: usize) -> f64 {
        stats::paired_ratio(&self.rounds, a, b)
    }

    /// Whether scenario `i` ran (it is a diagnostic not selected if not).
    fn ran(&self, i: usize) -> bool {
        self.best.get(i).is_some_and(|outcome| outcome.requests > 0)
    }
}

fn print_header() {
    println!(
        "\n{:<9} {:>5} {:>7}  {:<16} {:>9} {:>8} {:>8} {:>8}  {:>27}  {:>4}",
        "engine",
        "stmts",
        "clients",
        "scenario",
        "req/s",
        "p50 ms",
        "p99 ms",
        "vs base",
        "CPU us/req: load srv db all",
        "idle"
    );
}

fn print_provider_header() {
    println!(
        "\nprovider scenarios: insert pending, call the fake provider, mark paid (a new key each)\n\
         {:<9} {:>7}  {:<18} {:>9} {:>8} {:>8} {:>8} {:>9}  {:>27}  {:>4}",
        "engine",
        "clients",
        "scenario",
        "req/s",
        "p50 ms",
        "p99 ms",
        "vs plain",
        "phased/it",
        "CPU us/req: load srv db all",
        "idle"
    );
}

/// The scenarios at one shape, interleaved `rounds` times: each
/// scenario's best round, and every round's req/s for the ratios.
async fn group(
    settings: &Settings,
    server: &ServerProcess,
    admin: &sqlx::PgPool,
    statements: u32,
    concurrency: usize,
) -> Group {
    let engine = server.engine;
    let diagnostics: &[&str] = if engine == "postgres" {
        &DIAGNOSTICS
    } else {
        &[]
    };
    let all: Vec<&str> = SCENARIOS.iter().chain(diagnostics).copied().collect();
    let group = rounds(
        settings,
        server,
        admin,
        &all,
        &statements.to_string(),
        concurrency,
    )
    .await;
    for (i, (scenario, outcome)) in all.iter().zip(&group.best).enumerate() {
        if outcome.requests == 0 && !settings.selected(scenario) {
            continue;
        }
        let cpu = &outcome.cpu;
        println!(
            "{:<9} {:>5} {:>7}  {:<16} {:>9.0} {:>8.2} {:>8.2} {:>8.2}  {:>6.0} {:>6.0} {:>6.0} {:>6.0}  {:>3.0}%",
            engine,
            statements,
            concurrency,
            scenario,
            outcome.rps,
            outcome.p50_ms,
            outcome.p99_ms,
            group.ratio(i, 0),
            cpu.client_us,
            cpu.server_us,
            cpu.database_us,
            cpu.total_us(),
            cpu.idle_share * 100.0
        );
    }
    if settings.rounds > 1 {
        let show = |a: usize, b: usize| show_by_round(&group, a, b);
        println!(
            "  by round: idempotent/baseline {} | replay/baseline {} | idempotent/two_phase {}",
            show(1, 0),
            show(2, 0),
            show(1, 3)
        );
        if group.ran(TWO_PHASE_TX) {
            println!(
                "  by round: idempotent/two_phase_tx {}",
                show(1, TWO_PHASE_TX)
            );
        }
        if group.ran(PEER) {
            println!(
                "  by round: peer/baseline {} | idempotent/peer {}",
                show(PEER, 0),
                show(1, PEER)
            );
        }
        if group.ran(OPTIMISTIC) {
            println!(
                "  by round: optimistic/baseline {} | optimistic/two_phase {} | optimistic/idempotent {}",
                show(OPTIMISTIC, 0),
                show(OPTIMISTIC, 3),
                show(OPTIMISTIC, 1)
            );
        }
    }
    group
}

/// The provider scenarios at one concurrency, run as `group` runs a
/// shape's. `vs plain` is a scenario's req/s over `plain_provider`'s,
/// `phased/it` `phased`'s over the scenario's (medians of the rounds');
/// their round trips are the counts printed before the tables.
async fn provider_group(
    settings: &Settings,
    server: &ServerProcess,
    admin: &sqlx::PgPool,
    concurrency: usize,
) -> Group {
    let engine = server.engine;
    let group = rounds(settings, server, admin, &PROVIDER, "provider", concurrency).await;
    for (i, (scenario, outcome)) in PROVIDER.iter().zip(&group.best).enumerate() {
        if outcome.requests == 0 && !settings.selected(scenario) {
            continue;
        }
        let cpu = &outcome.cpu;
        println!(
            "{:<9} {:>7}  {:<18} {:>9.0} {:>8.2} {:>8.2} {:>8.2} {:>9.2}  {:>6.0} {:>6.0} {:>6.0} {:>6.0}  {:>3.0}%",
            engine,
            concurrency,
            scenario,
            outcome.rps,
            outcome.p50_ms,
            outcome.p99_ms,
            group.ratio(i, PLAIN_PROVIDER),
            group.ratio(PHASED, i),
            cpu.client_us,
            cpu.server_us,
            cpu.database_us,
            cpu.total_us(),
            cpu.idle_share * 100.0
        );
    }
    if settings.rounds > 1 {
        let show = |a: usize, b: usize| show_by_round(&group, a, b);
        println!(
            "  by round: phased/atomic_provider {} | phased/two_phase_provider {} | phased/plain_provider {}",
            show(PHASED, ATOMIC_PROVIDER),
            show(PHASED, TWO_PHASE_PROVIDER),
            show(PHASED, PLAIN_PROVIDER)
        );
    }
    group
}

/// Each round's `a / b`, for a `by round` line.
fn show_by_round(group: &Group, a: usize, b: usize) -> String {
    let ratios = group.ratio_by_round(a, b);
    if ratios.is_empty() {
        return "not run".to_owned();
    }
    ratios
        .iter()
        .map(|r| format!("{r:.2}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs the selected scenarios of `all`, whose routes are
/// `/{shape}/{scenario}`, interleaved `rounds` times: each scenario's best
/// round, and every round's req/s for the ratios (a scenario not selected
/// stays at zero).
async fn rounds(
    settings: &Settings,
    server: &ServerProcess,
    admin: &sqlx::PgPool,
    all: &[&str],
    shape: &str,
    concurrency: usize,
) -> Group {
    let engine = server.engine;
    let mut best: Vec<Outcome> = vec![Outcome::default(); all.len()];
    let mut rounds = Vec::with_capacity(settings.rounds);
    for round in 0..settings.rounds {
        let mut rps = vec![0.0; all.len()];
        for (i, scenario) in all.iter().enumerate() {
            if !settings.selected(scenario) {
                continue;
            }
            let replays = matches!(*scenario, "replay" | "read_floor");
            let route = if *scenario == "replay" {
                "idempotent"
            } else {
                scenario
            };
            let mut load = Load {
                addr: server.addr,
                path: format!("/{shape}/idempotent"),
                concurrency,
                warmup: settings.warmup,
                measure: Duration::from_secs(settings.secs),
                keys: if replays {
                    Keys::Replay(REPLAY_KEYS)
                } else {
                    Keys::Fresh
                },
                prefix: format!("{scenario}-{shape}-{concurrency}-{round}"),
                body: Bytes::from_static(load::CHARGE.as_bytes()),
                server_pid: Some(server.pid),
                backends: match engine {
                    "postgres" => app::server_backends(admin).await,
                    "mysql" => cpu::mariadb_pid().into_iter().collect(),
                    _ => Vec::new(),
                },
            };
            if replays {
                load::prepare(&load, REPLAY_KEYS).await;
            }
            load.path = format!("/{shape}/{route}");
            let outcome = load::run(&load).await;
            if outcome.errors > 0 {
                eprintln!(
                    "{scenario}: {} errors, first: {}",
                    outcome.errors,
                    outcome.first_error.as_deref().unwrap_or("?")
                );
            }
            rps[i] = outcome.rps;
            if outcome.rps > best[i].rps {
                best[i] = outcome;
            }
        }
        rounds.push(rps);
    }
    Group { best, rounds }
}

fn json_path() -> PathBuf {
    if let Ok(path) = std::env::var("IDEM_BENCH_JSON") {
        return path.into();
    }
    // <target>/release/deps/throughput-<hash>
    let exe = std::env::current_exe().expect("this executable");
    let target = exe.ancestors().nth(3).unwrap_or(std::path::Path::new("."));
    target.join("idem-bench").join("throughput.json")
}

/// The server, a child process running this executable; killed when dropped.
pub struct ServerProcess {
    pub engine: &'static str,
    pub addr: SocketAddr,
    pub pid: u32,
    // Held for `kill_on_drop`.
    _child: tokio::process::Child,
}

impl ServerProcess {
    pub async fn start(config: &ServerConfig) -> ServerProcess {
        let (child, addr) = spawn_listening(config.to_env()).await;
        ServerProcess {
            engine: config.engine,
            addr: addr.parse().expect("server address"),
            pid: child.id().expect("server running"),
            _child: child,
        }
    }

    /// A `/proc/<pid>/status` field in KiB (`VmRSS:`, `VmHWM:`).
    pub fn status_kib(&self, field: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid)).expect("proc status");
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .unwrap_or(0)
    }
}

/// This executable again as a child process with `envs` (its role among
/// them), killed when dropped and ended when its stdin closes; returns it
/// once it prints `LISTENING <what>`, with `<what>`.
pub async fn spawn_listening(envs: Vec<(&'static str, String)>) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .envs(envs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start a child process");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines
            .next_line()
            .await
            .expect("child output")
            .expect("the child exited before listening");
        if let Some(rest) = line.strip_prefix("LISTENING ") {
            return (child, rest.to_owned());
        }
    }
}
