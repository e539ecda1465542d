//! The outbox relay, measured against issue 41's targets: how soon a
//! committed message reaches the broker at a steady rate, how fast a
//! backlog drains, and what one `tx.outbox` write costs a request; on NATS
//! JetStream (`idem::outbox::nats::JetStream`) and RabbitMQ
//! (`idem::outbox::rabbitmq::RabbitMq`).
//!
//! ```text
//! cargo bench -p idem-tests --bench relay
//! IDEM_BENCH_BROKERS=nats IDEM_BENCH_RATE=1000 cargo bench -p idem-tests --bench relay
//! ```
//!
//! Everything runs in this process, on one tokio runtime: a real axum
//! server on loopback with PostgreSQL as its store (a schema of the run's
//! own, dropped at the end), reqwest as its client, and the relay, spawned
//! as an application spawns it. For each broker in `IDEM_BENCH_BROKERS`
//! (a JetStream stream or a quorum queue of the run's own, deleted at the
//! end):
//!
//! 1. Latency: an open-loop sender posts charges at a steady
//!    `IDEM_BENCH_RATE` (a tick every 1/rate s, each request its own key,
//!    over 8 accounts; each request spawned, so slow answers do not slow
//!    the rate) to an `#[idempotent(scope = "account")]` handler that
//!    inserts the charge and writes one `tx.outbox` message holding the
//!    time of that write. The relay (default settings) delivers through a
//!    sink that wraps the broker's and, on the broker's ack, records now
//!    minus that time: *the handler's write to the broker's ack*, an upper
//!    bound of commit to ack (the commit follows the write). Its p50, p90,
//!    p99 and max, against the targets p50 <= 5 ms and p99 <= 20 ms.
//! 2. Backlog: with no relay running, `IDEM_BENCH_BACKLOG` messages are
//!    written through requests (`IDEM_BENCH_PER_REQUEST` messages each,
//!    the requests spread round-robin over `IDEM_BENCH_SCOPES` accounts,
//!    so the outbox interleaves the scopes as concurrent traffic does);
//!    then a relay with `.batch(b)` for each `b` in `IDEM_BENCH_BATCHES`
//!    starts, and the time until `pending_messages()` is 0 gives messages
//!    per second (target: at least 5,000).
//!
//! Then, on NATS alone (the relay running to JetStream throughout), the
//! outbox's cost per request: `IDEM_BENCH_CONCURRENCY` closed-loop clients
//! for `IDEM_BENCH_SECS` against the charges handler and against the same
//! handler without its `tx.outbox` write, alternating over
//! `IDEM_BENCH_ROUNDS` rounds (the relay catching up after each outbox
//! run, before the next measurement): best and median req/s and the
//! median of the rounds' ratios.
//!
//! Prints the figures as tables, then the path of a JSON file with every
//! figure, last; beside it, `relay-latency.svg`, the latency distributions
//! (to p99) per broker. Every target is checked by printing, not failing.
//! Environment:
//!
//! | variable | default | |
//! |---|---|---|
//! | `IDEM_TEST_POSTGRES_URL` | `postgres://postgres@127.0.0.1:5432/test` | the store |
//! | `IDEM_BENCH_BROKERS` | `nats,rabbitmq` | the brokers, in order |
//! | `IDEM_BENCH_RATE` | 500 | charges per second of the latency run |
//! | `IDEM_BENCH_SECS` | 10 | measured seconds of the latency run, and of each outbox-cost run |
//! | `IDEM_BENCH_WARMUP_MS` | 1000 | warm-up before each latency and outbox-cost run, not measured |
//! | `IDEM_BENCH_BACKLOG` | 100000 | messages in the backlog |
//! | `IDEM_BENCH_PER_REQUEST` | 10 | messages each backlog request writes |
//! | `IDEM_BENCH_SCOPES` | 1000 | accounts (scopes) the backlog's requests are spread over |
//! | `IDEM_BENCH_BATCHES` | `1000,100` | the drain relay's batch sizes, a backlog written and drained for each (100 is the relay's default) |
//! | `IDEM_BENCH_CONCURRENCY` | 16 | closed-loop clients of the outbox-cost runs (and writers of the backlog) |
//! | `IDEM_BENCH_ROUNDS` | 3 | outbox-cost rounds |
//! | `IDEM_BENCH_ANALYZE` | 0 | 1: `ANALYZE` the outbox table after writing each backlog, before its drain (else autovacuum's statistics, which may predate the backlog) |
//! | `IDEM_BENCH_POOL` | 16 | the server's (and relay's) connection pool |
//! | `IDEM_BENCH_JSON` | `<target>/idem-bench/relay.json` | the JSON file (the chart beside it) |

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Json;
use axum::http::StatusCode;
use axum::routing::post;
use idem::outbox::nats::JetStream;
use idem::outbox::rabbitmq::RabbitMq;
use idem::outbox::{Message, Sink, SinkError};
use idem::{Idem, Tx, idempotent};
use idem_tests::account::Account;
use idem_tests::chart::{self, Axes, Series};
use idem_tests::nats::TestStream;
use idem_tests::outbox_flow::PgSchema;
use idem_tests::rabbitmq::{AMQP_URL, TestQueue};
use idem_tests::stats;
use serde::Deserialize;
use serde_json::{Value, json};
use sqlx::Postgres;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

/// The topic every message is written on.
const TOPIC: &str = "charge.created";
/// Accounts (scopes) of the latency run.
const LATENCY_ACCOUNTS: u64 = 8;
/// The longest the run waits for a relay to catch up, or a backlog to
/// drain: the benchmark is bounded in time.
const DRAIN_LIMIT: Duration = Duration::from_secs(300);
/// The JetStream duplicate window of the run's streams (the broker's
/// default).
const DEDUPE: Duration = Duration::from_secs(120);

// --- The service -----------------------------------------------------------

/// Microseconds since the process's first call: a monotonic clock the
/// handler and the sink share.
fn now_us() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = START.get_or_init(Instant::now);
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[derive(Deserialize)]
struct NewCharge {
    amount: i64,
}

#[derive(Deserialize)]
struct NewBatch {
    messages: u32,
}

type Answer = Result<(StatusCode, Json<Value>), (StatusCode, String)>;

fn failed(error: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
}

async fn insert_charge(
    tx: &mut Tx<Postgres>,
    account: &str,
    amount: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("INSERT INTO bench_charges (account, amount) VALUES ($1, $2) RETURNING id")
        .bind(account)
        .bind(amount)
        .fetch_one(&mut **tx)
        .await
}

/// `POST /charges`: the charge and one outbox message, the time of the
/// write in it (`written_us`); the commit follows the handler's return.
#[idempotent(scope = "account")]
async fn charge(account: Account, mut tx: Tx<Postgres>, Json(new): Json<NewCharge>) -> Answer {
    let id = insert_charge(&mut tx, &account.0, new.amount)
        .await
        .map_err(failed)?;
    let payload = json!({
        "charge": id,
        "account": account.0,
        "amount": new.amount,
        "written_us": now_us(),
    });
    tx.outbox(TOPIC, &payload).await.map_err(failed)?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// `POST /charges_plain`: the same charge, no outbox write.
#[idempotent(scope = "account")]
async fn charge_plain(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(new): Json<NewCharge>,
) -> Answer {
    let id = insert_charge(&mut tx, &account.0, new.amount)
        .await
        .map_err(failed)?;
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

/// `POST /batch` `{"messages": n}`: `n` outbox messages in one
/// transaction (the backlog).
#[idempotent(scope = "account")]
async fn write_batch(account: Account, mut tx: Tx<Postgres>, Json(new): Json<NewBatch>) -> Answer {
    for n in 0..new.messages {
        let payload = json!({ "account": account.0, "n": n, "written_us": now_us() });
        tx.outbox(TOPIC, &payload).await.map_err(failed)?;
    }
    Ok((
        StatusCode::CREATED,
        Json(json!({ "messages": new.messages })),
    ))
}

/// The service of one broker's run: its schema, its store, its server.
struct World {
    schema: PgSchema,
    pool: PgPool,
    idem: Idem<Postgres>,
    addr: SocketAddr,
    server: tokio::task::JoinHandle<()>,
}

impl World {
    async fn new(label: &str, pool_size: u32) -> World {
        let schema = PgSchema::create(label).await;
        let options: PgConnectOptions = schema.url.parse().expect("the schema's URL");
        let pool = PgPoolOptions::new()
            .max_connections(pool_size)
            .min_connections(pool_size)
            .connect_with(options.application_name("idem-bench-relay"))
            .await
            .expect("PostgreSQL answers");
        let idem = Idem::new(pool.clone());
        idem.migrate().await.expect("migrate");
        idem.migrate_outbox().await.expect("migrate the outbox");
        sqlx::raw_sql(
            "CREATE TABLE bench_charges (id bigserial PRIMARY KEY, account text NOT NULL, \
             amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .execute(&pool)
        .await
        .expect("create bench_charges");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new()
            .route("/charges", post(charge))
            .route("/charges_plain", post(charge_plain))
            .route("/batch", post(write_batch))
            .with_state(idem.clone());
        let server = tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the server runs");
        });
        World {
            schema,
            pool,
            idem,
            addr,
            server,
        }
    }

    async fn pending(&self) -> u64 {
        self.idem
            .pending_messages()
            .await
            .expect("pending_messages")
    }

    /// Waits, up to [`DRAIN_LIMIT`], until no message is pending: how long
    /// that took, or `None` at the limit.
    async fn drained(&self, poll: Duration) -> Option<Duration> {
        let start = Instant::now();
        loop {
            if self.pending().await == 0 {
                return Some(start.elapsed());
            }
            if start.elapsed() > DRAIN_LIMIT {
                return None;
            }
            tokio::time::sleep(poll).await;
        }
    }

    async fn finish(self) {
        self.server.abort();
        let _ = self.server.await;
        self.pool.close().await;
        self.schema.drop().await;
    }
}

// --- The brokers -------------------------------------------------------------

/// A broker's destination of the run's own, and a sink to it.
enum Broker {
    Nats(TestStream),
    Rabbit(TestQueue),
}

impl Broker {
    async fn create(name: &str) -> Broker {
        match name {
            "nats" => Broker::Nats(TestStream::create("idem_bench_relay", DEDUPE).await),
            "rabbitmq" => Broker::Rabbit(TestQueue::create("idem_bench_relay").await),
            other => panic!("IDEM_BENCH_BROKERS: unknown broker {other} (nats, rabbitmq)"),
        }
    }

    async fn sink(&self) -> AnySink {
        match self {
            Broker::Nats(stream) => AnySink::Nats(Box::new(
                JetStream::new(stream.jetstream().clone()).subject_prefix(&stream.prefix),
            )),
            Broker::Rabbit(queue) => AnySink::Rabbit(Box::new(
                RabbitMq::to_queue(AMQP_URL, &queue.name)
                    .await
                    .expect("the RabbitMQ sink connects"),
            )),
        }
    }

    /// Messages the broker holds (a check that the relay delivered).
    async fn held(&self) -> u64 {
        match self {
            Broker::Nats(stream) => stream.state().await.messages,
            Broker::Rabbit(queue) => u64::from(queue.ready().await),
        }
    }

    async fn delete(self) {
        match self {
            Broker::Nats(stream) => stream.delete().await,
            Broker::Rabbit(queue) => queue.delete().await,
        }
    }
}

/// Either broker's sink.
enum AnySink {
    Nats(Box<JetStream>),
    Rabbit(Box<RabbitMq>),
}

impl Sink for AnySink {
    async fn deliver(&self, message: &Message) -> Result<(), SinkError> {
        match self {
            AnySink::Nats(sink) => sink.deliver(message).await,
            AnySink::Rabbit(sink) => sink.deliver(message).await,
        }
    }
}

/// A sink that, on the inner sink's `Ok` (the broker's ack), records now
/// minus the `written_us` in the payload: the handler's write to the
/// broker's ack, for messages written from `from_us` on.
struct Timed {
    inner: AnySink,
    from_us: Arc<AtomicU64>,
    samples: Arc<Mutex<Vec<u64>>>,
}

impl Sink for Timed {
    async fn deliver(&self, message: &Message) -> Result<(), SinkError> {
        self.inner.deliver(message).await?;
        let acked = now_us();
        let written = message
            .json::<Value>()
            .ok()
            .and_then(|payload| payload["written_us"].as_u64());
        if let Some(written) = written
            && written >= self.from_us.load(Ordering::Relaxed)
        {
            self.samples
                .lock()
                .unwrap()
                .push(acked.saturating_sub(written));
        }
        Ok(())
    }
}

// --- The load ----------------------------------------------------------------

/// A client of one world.
#[derive(Clone)]
struct Client {
    http: reqwest::Client,
    base: String,
    run: String,
}

impl Client {
    fn new(world: &World, run: &str) -> Client {
        Client {
            http: reqwest::Client::new(),
            base: format!("http://{}", world.addr),
            run: run.to_owned(),
        }
    }

    /// One POST: whether it was answered 201.
    async fn post(&self, path: &str, account: &str, key: &str, body: &Value) -> bool {
        let sent = self
            .http
            .post(format!("{}{path}", self.base))
            .header("x-account", account)
            .header("idempotency-key", format!("{}-{key}", self.run))
            .json(body)
            .send()
            .await;
        matches!(sent, Ok(response) if response.status() == StatusCode::CREATED)
    }
}

/// The open-loop sender: a request every 1/rate s for `span`, each
/// spawned; waits for their answers. Returns (sent, answered 201, HTTP
/// latencies in us of the requests sent from `measure_from` on).
async fn open_loop(
    client: &Client,
    rate: f64,
    span: Duration,
    first: u64,
    measure_from: Instant,
) -> (u64, u64, Vec<u64>) {
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let ok = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let start = Instant::now();
    let mut n = first;
    while start.elapsed() < span {
        ticks.tick().await;
        let (client, ok, latencies) = (client.clone(), Arc::clone(&ok), Arc::clone(&latencies));
        let account = format!("acct{}", n % LATENCY_ACCOUNTS);
        let key = format!("c{n}");
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let body = json!({ "amount": 100 });
            if client.post("/charges", &account, &key, &body).await {
                ok.fetch_add(1, Ordering::Relaxed);
                if sent >= measure_from {
                    let took = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                    latencies.lock().unwrap().push(took);
                }
            }
        }));
        n += 1;
    }
    for task in tasks {
        task.await.expect("a request task");
    }
    let latencies = std::mem::take(&mut *latencies.lock().unwrap());
    (n - first, ok.load(Ordering::Relaxed), latencies)
}

/// `clients` closed-loop clients posting to `path` for `span`: requests
/// answered 201 (keys `<prefix><client>-<n>`).
async fn closed_loop(
    client: &Client,
    path: &str,
    clients: u64,
    span: Duration,
    prefix: &str,
) -> u64 {
    let until = Instant::now() + span;
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, done) = (client.clone(), Arc::clone(&done));
            let (path, prefix) = (path.to_owned(), prefix.to_owned());
            tokio::spawn(async move {
                let account = format!("acct{c}");
                let body = json!({ "amount": 100 });
                let mut n = 0u64;
                while Instant::now() < until {
                    if client
                        .post(&path, &account, &format!("{prefix}{c}-{n}"), &body)
                        .await
                    {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a client task");
    }
    done.load(Ordering::Relaxed)
}

// --- Figures -----------------------------------------------------------------

/// The nearest-rank percentile `p` (0-100) of sorted `values`.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[allow(clippy::cast_precision_loss)]
fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// p50/p90/p99/max in ms and the count of `samples` (sorted here).
fn summary(samples: &mut [u64]) -> Value {
    samples.sort_unstable();
    json!({
        "count": samples.len(),
        "p50_ms": ms(percentile(samples, 50.0)),
        "p90_ms": ms(percentile(samples, 90.0)),
        "p99_ms": ms(percentile(samples, 99.0)),
        "max_ms": ms(samples.last().copied().unwrap_or(0)),
    })
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value} is not a number")),
        Err(_) => default,
    }
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(str::to_owned)
        .collect()
}

struct Settings {
    brokers: Vec<String>,
    rate: f64,
    secs: u64,
    warmup: Duration,
    backlog: u64,
    per_request: u64,
    scopes: u64,
    batches: Vec<u32>,
    concurrency: u64,
    rounds: usize,
    pool: u32,
    analyze: bool,
}

impl Settings {
    fn from_env() -> Settings {
        let batches = env_list("IDEM_BENCH_BATCHES", "1000,100")
            .iter()
            .map(|batch| {
                batch
                    .parse()
                    .unwrap_or_else(|_| panic!("IDEM_BENCH_BATCHES: {batch} is not a number"))
            })
            .collect();
        Settings {
            brokers: env_list("IDEM_BENCH_BROKERS", "nats,rabbitmq"),
            rate: env_number("IDEM_BENCH_RATE", 500.0),
            secs: env_number("IDEM_BENCH_SECS", 10),
            warmup: Duration::from_millis(env_number("IDEM_BENCH_WARMUP_MS", 1000)),
            backlog: env_number("IDEM_BENCH_BACKLOG", 100_000),
            per_request: env_number::<u64>("IDEM_BENCH_PER_REQUEST", 10).max(1),
            scopes: env_number::<u64>("IDEM_BENCH_SCOPES", 1000).max(1),
            batches,
            concurrency: env_number::<u64>("IDEM_BENCH_CONCURRENCY", 16).max(1),
            rounds: env_number::<usize>("IDEM_BENCH_ROUNDS", 3).max(1),
            pool: env_number("IDEM_BENCH_POOL", 16),
            analyze: env_number::<u8>("IDEM_BENCH_ANALYZE", 0) != 0,
        }
    }

    fn span(&self) -> Duration {
        Duration::from_secs(self.secs)
    }
}

// --- The runs ----------------------------------------------------------------

/// Part 1 on `broker`: the latency at a steady rate, the relay's
/// default settings.
async fn latency(world: &World, broker: &Broker, name: &str, settings: &Settings) -> Value {
    let from_us = Arc::new(AtomicU64::new(u64::MAX));
    let samples = Arc::new(Mutex::new(Vec::new()));
    let timed = Timed {
        inner: broker.sink().await,
        from_us: Arc::clone(&from_us),
        samples: Arc::clone(&samples),
    };
    let relay = world.idem.relay(timed).spawn();
    let client = Client::new(world, &format!("lat-{name}"));

    let warmup = open_loop(&client, settings.rate, settings.warmup, 0, Instant::now());
    let (warm_sent, _, _) = warmup.await;
    let measure_from = Instant::now();
    from_us.store(now_us(), Ordering::Relaxed);
    let (sent, ok, mut http) = open_loop(
        &client,
        settings.rate,
        settings.span(),
        warm_sent,
        measure_from,
    )
    .await;
    let elapsed = measure_from.elapsed();
    let caught_up = world.drained(Duration::from_millis(20)).await;
    relay.abort();
    let _ = relay.await;

    let mut samples = std::mem::take(&mut *samples.lock().unwrap());
    let mut cdf = samples.clone();
    cdf.sort_unstable();
    // The chart's points: p1, p5, p10, ..., p95, p99.
    let distribution: Vec<Value> = std::iter::once(1)
        .chain((5..=95).step_by(5))
        .chain(std::iter::once(99))
        .map(|p| json!([ms(percentile(&cdf, f64::from(p))), p]))
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let achieved = sent as f64 / elapsed.as_secs_f64();
    json!({
        "broker": name,
        "rate_asked": settings.rate,
        "rate_sent": achieved,
        "sent": sent,
        "answered_201": ok,
        "relay": "default settings (batch 100, 32 scopes at once, woken on commit)",
        "write_to_ack": summary(&mut samples),
        "http": summary(&mut http),
        "caught_up": caught_up.is_some(),
        "distribution": distribution,
    })
}

/// Part 2 on `broker`: a backlog written with no relay, then drained by a
/// relay with `.batch(batch)`.
async fn backlog(
    world: &World,
    broker: &Broker,
    name: &str,
    batch: u32,
    settings: &Settings,
) -> Value {
    let requests = settings.backlog.div_ceil(settings.per_request);
    let messages = requests * settings.per_request;
    static BACKLOGS: AtomicU64 = AtomicU64::new(0);
    let nth = BACKLOGS.fetch_add(1, Ordering::Relaxed);
    let client = Client::new(world, &format!("backlog{nth}-{name}-{batch}"));
    let writers = settings.concurrency;
    let next = Arc::new(AtomicU64::new(0));
    let written = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|_| {
            let (client, next) = (client.clone(), Arc::clone(&next));
            let (per_request, scopes) = (settings.per_request, settings.scopes);
            tokio::spawn(async move {
                let body = json!({ "messages": per_request });
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        break;
                    }
                    let account = format!("s{}", n % scopes);
                    assert!(
                        client
                            .post("/batch", &account, &format!("b{n}"), &body)
                            .await,
                        "a backlog request is answered 201"
                    );
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a backlog writer");
    }
    let write_secs = written.elapsed().as_secs_f64();
    let pending = world.pending().await;
    let held_before = broker.held().await;
    if settings.analyze {
        let sql = format!("ANALYZE {}", world.idem.outbox_table_name());
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&world.pool)
            .await
            .expect("ANALYZE the outbox");
    }

    let sink = broker.sink().await;
    let start = Instant::now();
    let relay = world.idem.relay(sink).batch(batch).spawn();
    let drained = world.drained(Duration::from_millis(25)).await;
    let took = drained.unwrap_or_else(|| start.elapsed());
    relay.abort();
    let _ = relay.await;
    let held = broker.held().await.saturating_sub(held_before);
    #[allow(clippy::cast_precision_loss)]
    let rate = pending as f64 / took.as_secs_f64();
    json!({
        "broker": name,
        "messages": pending,
        "asked": messages,
        "requests": requests,
        "per_request": settings.per_request,
        "scopes": settings.scopes,
        "write_secs": write_secs,
        "relay": format!(".batch({batch}), otherwise default (32 scopes at once)"),
        "batch": batch,
        "analyzed": settings.analyze,
        "drained": drained.is_some(),
        "drain_secs": took.as_secs_f64(),
        "messages_per_sec": rate,
        "broker_received": held,
    })
}

/// Part 3: the charges handler with and without its outbox write, the
/// relay running to NATS.
async fn outbox_cost(settings: &Settings) -> Value {
    let world = World::new("idem_bench_cost", settings.pool).await;
    let broker = Broker::create("nats").await;
    let relay = world.idem.relay(broker.sink().await).spawn();
    let client = Client::new(&world, "cost");
    let mut rounds: Vec<Vec<f64>> = Vec::new();
    for round in 0..settings.rounds {
        // [outbox, plain] req/s; the first one run alternates.
        let mut rps = [0.0; 2];
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let path = ["/charges", "/charges_plain"][which];
            let prefix = format!("r{round}{path}-");
            let warm = format!("{prefix}warm-");
            closed_loop(&client, path, settings.concurrency, settings.warmup, &warm).await;
            let done = closed_loop(
                &client,
                path,
                settings.concurrency,
                settings.span(),
                &prefix,
            )
            .await;
            #[allow(clippy::cast_precision_loss)]
            let rate = done as f64 / settings.span().as_secs_f64();
            rps[which] = rate;
            // What the relay still owes is not the next run's to pay.
            world.drained(Duration::from_millis(50)).await;
            println!(
                "  outbox cost, round {}: {path:<15} {rate:>8.0} req/s",
                round + 1
            );
        }
        rounds.push(rps.to_vec());
    }
    relay.abort();
    let _ = relay.await;
    let delivered = broker.held().await;
    broker.delete().await;
    world.finish().await;

    let column = |i: usize| -> Vec<f64> { rounds.iter().map(|round| round[i]).collect() };
    let best = |values: Vec<f64>| values.into_iter().fold(0.0_f64, f64::max);
    json!({
        "concurrency": settings.concurrency,
        "secs": settings.secs,
        "rounds": rounds.len(),
        "relay": "default settings, to NATS JetStream",
        "with_outbox_rps": column(0),
        "without_outbox_rps": column(1),
        "with_outbox_best": best(column(0)),
        "without_outbox_best": best(column(1)),
        "with_outbox_median": stats::median(column(0)),
        "without_outbox_median": stats::median(column(1)),
        "ratio_by_round": stats::ratio_by_round(&rounds, 0, 1),
        "ratio_median": stats::paired_ratio(&rounds, 0, 1),
        "messages_delivered": delivered,
    })
}

// --- The report --------------------------------------------------------------

fn json_path() -> PathBuf {
    if let Ok(path) = std::env::var("IDEM_BENCH_JSON") {
        return PathBuf::from(path);
    }
    // <target>/release/deps/relay-<hash>
    let exe = std::env::current_exe().expect("this executable");
    let target = exe.ancestors().nth(3).unwrap_or(Path::new("."));
    target.join("idem-bench").join("relay.json")
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

fn print_report(report: &Value) {
    println!();
    println!("handler's write to broker ack (an upper bound of commit to ack), steady rate:");
    println!(
        "{:<9} {:>8} {:>7} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10}  target p50<=5 ms, p99<=20 ms",
        "broker", "rate/s", "count", "p50 ms", "p90 ms", "p99 ms", "max ms", "http p50", "http p99"
    );
    for run in report["latency"].as_array().into_iter().flatten() {
        let ack = &run["write_to_ack"];
        let (p50, p99) = (
            ack["p50_ms"].as_f64().unwrap(),
            ack["p99_ms"].as_f64().unwrap(),
        );
        println!(
            "{:<9} {:>8.0} {:>7} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.2} {:>10.2}  p50 {}, p99 {}",
            run["broker"].as_str().unwrap(),
            run["rate_sent"].as_f64().unwrap(),
            ack["count"].as_u64().unwrap(),
            p50,
            ack["p90_ms"].as_f64().unwrap(),
            p99,
            ack["max_ms"].as_f64().unwrap(),
            run["http"]["p50_ms"].as_f64().unwrap(),
            run["http"]["p99_ms"].as_f64().unwrap(),
            verdict(p50 <= 5.0),
            verdict(p99 <= 20.0),
        );
    }
    println!();
    println!("backlog drain (written with no relay running, then one relay started):");
    println!(
        "{:<9} {:>9} {:>7} {:>9} {:>10} {:>10}  target >= 5,000 msg/s",
        "broker", "messages", "batch", "write s", "drain s", "msg/s"
    );
    for run in report["backlog"].as_array().into_iter().flatten() {
        let rate = run["messages_per_sec"].as_f64().unwrap();
        println!(
            "{:<9} {:>9} {:>7} {:>9.1} {:>10.2} {:>10.0}  {}{}",
            run["broker"].as_str().unwrap(),
            run["messages"].as_u64().unwrap(),
            run["batch"].as_u64().unwrap(),
            run["write_secs"].as_f64().unwrap(),
            run["drain_secs"].as_f64().unwrap(),
            rate,
            verdict(rate >= 5000.0),
            if run["drained"].as_bool() == Some(true) {
                ""
            } else {
                " (not drained in time)"
            },
        );
    }
    let cost = &report["outbox_cost"];
    if cost.is_object() {
        println!();
        println!(
            "the outbox's cost per request ({} closed-loop clients, {} rounds, relay to NATS):",
            cost["concurrency"], cost["rounds"]
        );
        println!("{:<16} {:>10} {:>10}", "handler", "best/s", "median/s");
        for (label, key) in [
            ("with tx.outbox", "with_outbox"),
            ("without", "without_outbox"),
        ] {
            println!(
                "{label:<16} {:>10.0} {:>10.0}",
                cost[format!("{key}_best")].as_f64().unwrap(),
                cost[format!("{key}_median")].as_f64().unwrap()
            );
        }
        println!(
            "with / without: {:.3} (median of the rounds' ratios)",
            cost["ratio_median"].as_f64().unwrap()
        );
    }
}

fn write_chart(report: &Value, path: &Path) {
    let series: Vec<Series> = report["latency"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|run| Series {
            name: format!(
                "{} ({:.0}/s)",
                match run["broker"].as_str().unwrap() {
                    "nats" => "NATS JetStream",
                    "rabbitmq" => "RabbitMQ",
                    other => other,
                },
                run["rate_sent"].as_f64().unwrap()
            ),
            points: run["distribution"]
                .as_array()
                .unwrap()
                .iter()
                .map(|point| (point[0].as_f64().unwrap(), point[1].as_f64().unwrap()))
                .collect(),
        })
        .collect();
    let axes = Axes {
        x: "handler's write to broker ack (ms)",
        y: "deliveries at or under (%)",
    };
    let title = "Outbox relay: handler's write to broker ack, p1 to p99";
    match chart::write_svg_with(path, title, &axes, &series) {
        Ok(()) => println!("chart: {}", path.display()),
        Err(error) => eprintln!("chart {}: {error}", path.display()),
    }
}

async fn bench() {
    let settings = Settings::from_env();
    now_us();
    let mut latencies = Vec::new();
    let mut backlogs = Vec::new();
    for name in &settings.brokers {
        println!(
            "{name}: latency at {}/s for {} s",
            settings.rate, settings.secs
        );
        let world = World::new(&format!("idem_bench_{name}"), settings.pool).await;
        let broker = Broker::create(name).await;
        let run = latency(&world, &broker, name, &settings).await;
        println!("  {}", run["write_to_ack"]);
        latencies.push(run);
        for &batch in &settings.batches {
            println!(
                "{name}: backlog of {} messages, drained with .batch({batch})",
                settings.backlog
            );
            let run = backlog(&world, &broker, name, batch, &settings).await;
            println!(
                "  {:.0} msg/s ({} messages in {:.2} s)",
                run["messages_per_sec"].as_f64().unwrap(),
                run["messages"],
                run["drain_secs"].as_f64().unwrap()
            );
            backlogs.push(run);
        }
        broker.delete().await;
        world.finish().await;
    }
    let cost = if settings.brokers.iter().any(|name| name == "nats") {
        println!(
            "outbox cost: {} clients, {} rounds",
            settings.concurrency, settings.rounds
        );
        outbox_cost(&settings).await
    } else {
        Value::Null
    };

    let report = json!({
        "bench": "relay",
        "settings": {
            "brokers": settings.brokers,
            "rate": settings.rate,
            "secs": settings.secs,
            "warmup_ms": u64::try_from(settings.warmup.as_millis()).unwrap_or(u64::MAX),
            "backlog": settings.backlog,
            "per_request": settings.per_request,
            "scopes": settings.scopes,
            "batches": settings.batches,
            "concurrency": settings.concurrency,
            "rounds": settings.rounds,
            "pool": settings.pool,
            "analyze": settings.analyze,
            "cores": std::thread::available_parallelism().map(usize::from).unwrap_or(1),
        },
        "latency": latencies,
        "backlog": backlogs,
        "outbox_cost": cost,
    });
    print_report(&report);
    let path = json_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("the JSON's directory");
    }
    write_chart(&report, &path.with_file_name("relay-latency.svg"));
    std::fs::write(&path, serde_json::to_vec_pretty(&report).unwrap()).expect("write the JSON");
    println!("{}", path.display());
}

fn main() {
    // `cargo test --benches` runs this binary without `--bench`: nothing to test.
    if !std::env::args().any(|arg| arg == "--bench") {
        println!("relay: a benchmark; run it with `cargo bench -p idem-tests --bench relay`");
        return;
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the runtime")
        .block_on(bench());
}
