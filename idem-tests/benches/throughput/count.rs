//! Round trips per request, counted exactly: the server's one-connection
//! pool talks to PostgreSQL through the counting proxy, one request at a
//! time, after a warm-up that fills the prepared-statement cache.

use std::net::SocketAddr;
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
    let options: PgConnectOptions = database_url.parse().expect("database URL");
    let upstream = resolve(options.get_host(), options.get_port()).await;
    let proxy = PgProxy::start(upstream).await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(
            options
                .host("127.0.0.1")
                .port(proxy.addr().port())
                .ssl_mode(PgSslMode::Disable),
        )
        .await
        .expect("connect through the proxy");
    let (addr, server) = app::serve_here(pool.clone()).await;
    let mut client = Client::connect(addr, "c0".to_owned()).await;
    let mut n = 0;
    let mut fresh = || {
        n += 1;
        format!("count-{}-{n}", std::process::id())
    };
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
            let key = fresh();
            for path in [&baseline, &idempotent, &idempotent, &two_phase] {
                send(&mut client, path, &key).await;
            }
            send(&mut client, &two_phase_tx, &fresh()).await;
            // The diagnostic, checked too: a retry of its key is a replay.
            let key = fresh();
            let replayed = [
                send(&mut client, &optimistic, &key).await,
                send(&mut client, &optimistic, &key).await,
            ];
            assert_eq!(
                replayed,
                [false, true],
                "{optimistic}: first attempt, then its replay"
            );
        }
        let mut measure = async |path: &str, key: &str| {
            settle(&pool).await;
            proxy.reset();
            send(&mut client, path, key).await;
            settle(&pool).await;
            proxy.round_trips()
        };
        let key = fresh();
        let base = measure(&baseline, &fresh()).await;
        let idem = measure(&idempotent, &key).await;
        let replay = measure(&idempotent, &key).await;
        let two = measure(&two_phase, &fresh()).await;
        let optimistic = measure(&optimistic, &fresh()).await;
        let two_phase_tx = measure(&two_phase_tx, &fresh()).await;
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
    server.abort();
    pool.close().await;
    out
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
