//! Round trips per request, counted exactly: the server's one-connection
//! pool talks to PostgreSQL through the counting proxy, one request at a
//! time, after a warm-up that fills the prepared-statement cache.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};

use crate::app;
use crate::load::{CHARGE, Client};
use crate::pg_proxy::PgProxy;

/// Round trips of one request per scenario, the pool's pings included
/// (sqlx pings a connection when it is acquired and when it comes back).
#[derive(Clone, Debug, Serialize)]
pub struct RoundTrips {
    pub engine: &'static str,
    pub statements_per_handler: u32,
    pub baseline: u64,
    pub idempotent: u64,
    pub replay: u64,
    pub two_phase: u64,
    /// The diagnostics `optimistic` (see `optimistic.rs`) and `two_phase_tx`.
    pub optimistic: u64,
    pub two_phase_tx: u64,
    /// `idempotent - baseline`: what the wrapper adds to a first attempt.
    pub extra_round_trips: i64,
}

pub async fn count(database_url: &str, statements: &[u32]) -> Vec<RoundTrips> {
    let mut counter = Counter::start(database_url, 1).await;
    let mut out = Vec::new();
    for &s in statements {
        let [baseline, idempotent, two_phase, optimistic, two_phase_tx] = [
            "baseline",
            "idempotent",
            "two_phase",
            "optimistic",
            "two_phase_tx",
        ]
        .map(|route| format!("/{s}/{route}"));
        for _ in 0..3 {
            let key = counter.fresh();
            for path in [&baseline, &idempotent, &idempotent, &two_phase] {
                counter.send(path, &key).await;
            }
            let key = counter.fresh();
            counter.send(&two_phase_tx, &key).await;
            // The diagnostic, checked too: a retry of its key is a replay.
            let key = counter.fresh();
            let replayed = [
                counter.send(&optimistic, &key).await,
                counter.send(&optimistic, &key).await,
            ];
            assert_eq!(
                replayed,
                [false, true],
                "{optimistic}: first attempt, then its replay"
            );
        }
        let key = counter.fresh();
        let base = counter.fresh_measure(&baseline).await;
        let idem = counter.measure(&idempotent, &key).await;
        let replay = counter.measure(&idempotent, &key).await;
        let two = counter.fresh_measure(&two_phase).await;
        let optimistic = counter.fresh_measure(&optimistic).await;
        let two_phase_tx = counter.fresh_measure(&two_phase_tx).await;
        out.push(RoundTrips {
            engine: "postgres",
            statements_per_handler: s,
            baseline: base,
            idempotent: idem,
            replay,
            two_phase: two,
            optimistic,
            two_phase_tx,
            extra_round_trips: idem as i64 - base as i64,
        });
    }
    counter.stop().await;
    out
}

/// Round trips of one payment per provider scenario (`provider.rs`),
/// counted once: they do not depend on the statements knob.
#[derive(Clone, Debug, Serialize)]
pub struct ProviderTrips {
    pub engine: &'static str,
    pub plain_provider: u64,
    pub atomic_provider: u64,
    pub two_phase_provider: u64,
    /// A phased first attempt.
    pub phased: u64,
    /// A retry of a finished phased key, answered from the store.
    pub phased_replay: u64,
    /// A phased first attempt on a pool of two connections: each phase's
    /// checkout then finds an idle connection (`idem` takes it without the
    /// pool's ping) while the one the step before returned is still on its
    /// way back; on the one-connection pool of the other counts, it waits
    /// for that one and the pool pings it.
    pub phased_spare_connection: u64,
    /// `phased - atomic_provider`: what the phased mode adds to the
    /// atomic mode's first attempt.
    pub phased_extra_over_atomic: i64,
    /// `phased - two_phase_provider`.
    pub phased_extra_over_two_phase: i64,
    /// The phased first attempt's round trips as the proxy saw them, one
    /// per entry: `ping` (the pool's), `statement` (a prepared one, which
    /// the proxy sees without its SQL) or the SQL sent as text.
    pub phased_recorded: Vec<String>,
}

impl ProviderTrips {
    /// The round trips of `scenario`, one of `crate::PROVIDER`.
    pub fn of(&self, scenario: &str) -> u64 {
        match scenario {
            "plain_provider" => self.plain_provider,
            "atomic_provider" => self.atomic_provider,
            "two_phase_provider" => self.two_phase_provider,
            "phased" => self.phased,
            _ => 0,
        }
    }
}

pub async fn count_provider(database_url: &str) -> ProviderTrips {
    let mut counter = Counter::start(database_url, 1).await;
    let [plain, atomic, two_phase, phased] = crate::PROVIDER.map(|s| format!("/provider/{s}"));
    for _ in 0..3 {
        for path in [&plain, &atomic, &two_phase] {
            let key = counter.fresh();
            counter.send(path, &key).await;
        }
        let key = counter.fresh();
        let replayed = [
            counter.send(&phased, &key).await,
            counter.send(&phased, &key).await,
        ];
        assert_eq!(
            replayed,
            [false, true],
            "{phased}: first attempt, then its replay"
        );
    }
    let plain = counter.fresh_measure(&plain).await;
    let atomic = counter.fresh_measure(&atomic).await;
    let two_phase = counter.fresh_measure(&two_phase).await;
    let key = counter.fresh();
    counter.proxy.record();
    let first = counter.measure(&phased, &key).await;
    let recorded = counter.proxy.recorded().iter().map(|c| label(c)).collect();
    let replay = counter.measure(&phased, &key).await;
    counter.stop().await;
    let mut spare = Counter::start(database_url, 2).await;
    for _ in 0..3 {
        let key = spare.fresh();
        spare.send(&phased, &key).await;
    }
    let spare_connection = spare.fresh_measure(&phased).await;
    spare.stop().await;
    ProviderTrips {
        engine: "postgres",
        plain_provider: plain,
        atomic_provider: atomic,
        two_phase_provider: two_phase,
        phased: first,
        phased_replay: replay,
        phased_spare_connection: spare_connection,
        phased_extra_over_atomic: first as i64 - atomic as i64,
        phased_extra_over_two_phase: first as i64 - two_phase as i64,
        phased_recorded: recorded,
    }
}

/// One round trip's commands, named for a reader.
fn label(commands: &[String]) -> String {
    let mut parts = Vec::new();
    for command in commands {
        match command.as_str() {
            "SYNC" if parts.is_empty() || parts == ["ROLLBACK"] => parts.push("ping".to_owned()),
            "BIND" => parts.push("statement".to_owned()),
            "SYNC" | "EXECUTE" | "CLOSE" | "DESCRIBE" => {}
            other => {
                let text = other.strip_prefix("QUERY ").unwrap_or(other);
                parts.push(text.chars().take(72).collect());
            }
        }
    }
    parts.join(" + ")
}

/// The server in this process, its pool of one or two connections
/// through the counting proxy, and one client.
struct Counter {
    proxy: PgProxy,
    pool: PgPool,
    server: tokio::task::JoinHandle<()>,
    client: Client,
}

impl Counter {
    async fn start(database_url: &str, connections: u32) -> Counter {
        let options: PgConnectOptions = database_url.parse().expect("database URL");
        let upstream = resolve(options.get_host(), options.get_port()).await;
        let proxy = PgProxy::start(upstream).await;
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .min_connections(connections)
            .connect_with(
                options
                    .host("127.0.0.1")
                    .port(proxy.addr().port())
                    .ssl_mode(PgSslMode::Disable),
            )
            .await
            .expect("connect through the proxy");
        let (addr, server) = app::serve_here(pool.clone()).await;
        let client = Client::connect(addr, "c0".to_owned()).await;
        Counter {
            proxy,
            pool,
            server,
            client,
        }
    }

    /// A key no counter of this process used.
    fn fresh(&mut self) -> String {
        static KEYS: AtomicU64 = AtomicU64::new(0);
        let n = KEYS.fetch_add(1, Ordering::Relaxed) + 1;
        format!("count-{}-{n}", std::process::id())
    }

    async fn send(&mut self, path: &str, key: &str) -> bool {
        send(&mut self.client, path, key).await
    }

    /// The round trips of one request, the pool's return ping included.
    async fn measure(&mut self, path: &str, key: &str) -> u64 {
        settle(&self.pool).await;
        self.proxy.reset();
        send(&mut self.client, path, key).await;
        settle(&self.pool).await;
        self.proxy.round_trips()
    }

    async fn fresh_measure(&mut self, path: &str) -> u64 {
        let key = self.fresh();
        self.measure(path, &key).await
    }

    async fn stop(self) {
        self.server.abort();
        self.pool.close().await;
    }
}

/// Sends one charge, which must be answered 201: whether it was a replay.
async fn send(client: &mut Client, path: &str, key: &str) -> bool {
    client
        .send(path, key, bytes::Bytes::from_static(CHARGE.as_bytes()))
        .await
        .unwrap_or_else(|error| panic!("{path}: {error}"))
        .1
}

async fn resolve(host: &str, port: u16) -> SocketAddr {
    tokio::net::lookup_host((host, port))
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .unwrap_or_else(|| panic!("cannot resolve the PostgreSQL host {host}:{port}"))
}

/// Waits until the pool has its connection back (after its return ping).
async fn settle(pool: &PgPool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.num_idle() < pool.size() as usize {
        assert!(Instant::now() < deadline, "a connection never came back");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
