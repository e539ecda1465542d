//! What the outbox's broker tests share (`tests/outbox_broker`, against
//! the shared NATS server and RabbitMQ, and `tests/nats_cluster.rs`,
//! against a cluster of the test's own): the charges service and the
//! consumer example as processes, the service's store and the consumer's
//! ledger as the test reads them, and polling with a deadline.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
#[cfg(feature = "sqlite")]
use sqlx::SqlitePool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::examples;
use crate::nats::TestStream;

/// The outbox table of the charges example (beside `idem_keys`).
pub const OUTBOX: &str = "idem_keys_outbox";

/// A point in time every wait of a test ends by.
#[derive(Clone, Copy)]
pub struct Deadline(Instant);

impl Deadline {
    pub fn after(limit: Duration) -> Self {
        Self(Instant::now() + limit)
    }

    /// `check`'s first `Some`, asked every 50 ms; panics naming `what` if
    /// none comes before the deadline.
    pub async fn until<T, F, Fut>(self, what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        loop {
            if let Some(value) = check().await {
                return value;
            }
            assert!(Instant::now() < self.0, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The charges example on `addr`, its relay publishing through `nats_url`
/// to `stream`; its store `database_url` (default: `dir`'s SQLite file).
pub async fn service(
    dir: &Path,
    addr: SocketAddr,
    stream: &TestStream,
    nats_url: &str,
    database_url: Option<&str>,
) -> Child {
    service_on(dir, addr, &nats_env(nats_url, stream), database_url).await
}

/// The examples' variables for NATS at `nats_url` and `stream`.
fn nats_env(nats_url: &str, stream: &TestStream) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("BROKER", "nats".to_owned()),
        ("NATS_URL", nats_url.to_owned()),
    ];
    env.extend(stream.env());
    env
}

/// The charges example on `addr`, its relay publishing to the broker that
/// `broker` names (the examples' variables: `BROKER` and NATS's or
/// RabbitMQ's); its store `database_url` (default: `dir`'s SQLite file).
pub async fn service_on(
    dir: &Path,
    addr: SocketAddr,
    broker: &[(&'static str, String)],
    database_url: Option<&str>,
) -> Child {
    let mut env: Vec<(&str, Option<&str>)> = broker
        .iter()
        .map(|(name, value)| (*name, Some(value.as_str())))
        .collect();
    env.extend([("PROVIDER_URL", None), ("ADMIN_TOKEN", None)]);
    if let Some(url) = database_url {
        env.push(("DATABASE_URL", Some(url)));
    }
    examples::charges(dir, addr, &env).await
}

/// `POST /v1/charges` of `amount` for `account` under `key`: the charge's
/// id (the answer must be 201) and how long the answer took.
pub async fn charge(
    http: &reqwest::Client,
    addr: SocketAddr,
    account: &str,
    key: &str,
    amount: i64,
) -> (i64, Duration) {
    let started = Instant::now();
    let response = http
        .post(format!("http://{addr}/v1/charges"))
        .bearer_auth(account)
        .header("Idempotency-Key", key)
        .json(&serde_json::json!({"amount": amount, "currency": "eur"}))
        .send()
        .await
        .unwrap_or_else(|error| panic!("POST /v1/charges ({key}): {error}"));
    let elapsed = started.elapsed();
    assert_eq!(response.status(), 201, "POST /v1/charges ({key})");
    let body: serde_json::Value = response.json().await.unwrap();
    (body["id"].as_i64().unwrap(), elapsed)
}

/// What the consumer processes printed, across their runs.
#[derive(Default)]
pub struct Printed {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    /// Messages dropped as unreadable (acknowledged, never applied).
    pub dropped: AtomicU64,
}

impl Printed {
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::SeqCst)
    }

    /// Every message handled: applied, duplicate or dropped.
    pub fn total(&self) -> u64 {
        self.applied() + self.duplicates() + self.dropped()
    }

    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::SeqCst)
    }

    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }
}

/// How the consumer example runs.
pub struct ConsumerSettings<'a> {
    /// Its durable consumer's name.
    pub name: &'a str,
    pub ack_wait: Duration,
    /// `CONSUMER_CRASH_AFTER`.
    pub crash_after: Option<u32>,
}

/// The consumer example in `dir`, reading `stream` through `nats_url`, its
/// ledger at `database_url`, once it reads; its lines counted in
/// `printed`.
pub async fn consumer(
    dir: &Path,
    nats_url: &str,
    database_url: &str,
    stream: &TestStream,
    settings: &ConsumerSettings<'_>,
    printed: &Arc<Printed>,
) -> Child {
    let env = nats_env(nats_url, stream);
    consumer_on(dir, &env, database_url, settings, printed).await
}

/// The consumer example in `dir`, reading from the broker that `broker`
/// names (the examples' variables), its ledger at `database_url`, once it
/// reads; its lines counted in `printed`.
pub async fn consumer_on(
    dir: &Path,
    broker: &[(&'static str, String)],
    database_url: &str,
    settings: &ConsumerSettings<'_>,
    printed: &Arc<Printed>,
) -> Child {
    let mut command = Command::new(examples::binary("consumer"));
    command
        .current_dir(dir)
        .env("DATABASE_URL", database_url)
        .env("CONSUMER_NAME", settings.name)
        .env(
            "CONSUMER_ACK_WAIT_MS",
            settings.ack_wait.as_millis().to_string(),
        )
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env_remove("CONSUMER_CRASH_AFTER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    for (name, value) in broker {
        command.env(name, value);
    }
    if let Some(after) = settings.crash_after {
        command.env("CONSUMER_CRASH_AFTER", after.to_string());
    }
    let mut child = command.spawn().expect("the consumer example starts");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (ready, reading) = tokio::sync::oneshot::channel();
    let printed = Arc::clone(printed);
    tokio::spawn(async move {
        let mut ready = Some(ready);
        while let Ok(Some(line)) = lines.next_line().await {
            if line.starts_with("applied ") {
                printed.applied.fetch_add(1, Ordering::SeqCst);
            } else if line.starts_with("duplicate ") {
                printed.duplicates.fetch_add(1, Ordering::SeqCst);
            } else if line.contains(": dropped") {
                // The consumer's warning for an unreadable message.
                printed.dropped.fetch_add(1, Ordering::SeqCst);
            } else if line.contains("reading")
                && let Some(ready) = ready.take()
            {
                let _ = ready.send(());
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(30), reading)
        .await
        .expect("the consumer reads within 30 s")
        .expect("the consumer exited before reading");
    child
}

/// The consumer's ledger, as the test reads it.
pub enum Ledger {
    Postgres(PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
}

impl Ledger {
    /// The SQLite file `ledger.db` in `dir`.
    #[cfg(feature = "sqlite")]
    pub async fn open(dir: &Path) -> Ledger {
        let url = format!("sqlite:{}", dir.join("ledger.db").display());
        Ledger::Sqlite(SqlitePool::connect(&url).await.expect("the ledger opens"))
    }

    /// The ledger in the PostgreSQL database (and schema) `url` names.
    pub async fn postgres(url: &str) -> Ledger {
        Ledger::Postgres(PgPool::connect(url).await.expect("the ledger opens"))
    }

    /// Its rows.
    pub async fn rows(&self) -> u64 {
        let sql = "SELECT count(*) FROM ledger";
        let rows: i64 = match self {
            Ledger::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await,
        }
        .unwrap();
        rows.unsigned_abs()
    }

    /// Its rows' message ids in the order they were applied.
    pub async fn applied_order(&self) -> Vec<String> {
        let sql = "SELECT message_id FROM ledger ORDER BY entry";
        match self {
            Ledger::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        }
        .unwrap()
    }

    /// Each account's charge ids in the order they were applied.
    pub async fn charges_by_account(&self) -> HashMap<String, Vec<i64>> {
        let sql = "SELECT account, charge_id FROM ledger ORDER BY entry";
        let rows: Vec<(String, i64)> = match self {
            Ledger::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .unwrap();
        let mut accounts: HashMap<String, Vec<i64>> = HashMap::new();
        for (account, charge) in rows {
            accounts.entry(account).or_default().push(charge);
        }
        accounts
    }

    /// How many rows each message id has, and each charge id.
    pub async fn entries(&self) -> (HashMap<String, u32>, HashMap<i64, u32>) {
        let sql = "SELECT message_id, charge_id FROM ledger";
        let rows: Vec<(String, i64)> = match self {
            Ledger::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .unwrap();
        let (mut messages, mut charges) = (HashMap::new(), HashMap::new());
        for (message, charge) in rows {
            *messages.entry(message).or_default() += 1;
            *charges.entry(charge).or_default() += 1;
        }
        (messages, charges)
    }
}

/// An outbox row, as the test reads it.
#[derive(Debug, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: String,
    pub delivered: bool,
    pub leased: bool,
    pub attempts: i32,
}

/// The charges service's database, read beside it.
pub enum Store {
    Postgres(PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(SqlitePool),
}

impl Store {
    /// The SQLite file the service keeps in `dir`.
    #[cfg(feature = "sqlite")]
    pub async fn sqlite(dir: &Path) -> Store {
        let url = format!("sqlite:{}", dir.join("charges.db").display());
        Store::Sqlite(SqlitePool::connect(&url).await.unwrap())
    }

    /// The ids of the committed charges.
    pub async fn charges(&self) -> Vec<i64> {
        let sql = "SELECT id FROM charges ORDER BY id";
        match self {
            Store::Postgres(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Store::Sqlite(pool) => sqlx::query_scalar(sql).fetch_all(pool).await,
        }
        .unwrap()
    }

    /// Every outbox message.
    pub async fn outbox(&self) -> Vec<OutboxRow> {
        let sql = format!(
            "SELECT id, delivered_at IS NOT NULL AS delivered, \
             lease_token IS NOT NULL AS leased, attempts FROM {OUTBOX}"
        );
        let sql = sqlx::AssertSqlSafe(sql);
        match self {
            Store::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Store::Sqlite(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .unwrap()
    }

    /// Each scope's message ids in the order they were written (`seq`).
    pub async fn scopes(&self) -> HashMap<String, Vec<String>> {
        let sql = format!("SELECT id, scope FROM {OUTBOX} ORDER BY seq");
        let sql = sqlx::AssertSqlSafe(sql);
        let rows: Vec<(String, Vec<u8>)> = match self {
            Store::Postgres(pool) => sqlx::query_as(sql).fetch_all(pool).await,
            #[cfg(feature = "sqlite")]
            Store::Sqlite(pool) => sqlx::query_as(sql).fetch_all(pool).await,
        }
        .unwrap();
        let mut scopes: HashMap<String, Vec<String>> = HashMap::new();
        for (id, scope) in rows {
            let scope = String::from_utf8(scope).expect("a scope is text");
            scopes.entry(scope).or_default().push(id);
        }
        scopes
    }

    /// The relay's marks lost, as after a relay that published and stopped
    /// before marking: every message pending again, unleased. Returns how
    /// many.
    pub async fn forget_deliveries(&self) -> u64 {
        let sql = format!(
            "UPDATE {OUTBOX} SET delivered_at = NULL, lease_token = NULL, lease_until = NULL"
        );
        let sql = sqlx::AssertSqlSafe(sql);
        match self {
            Store::Postgres(pool) => sqlx::query(sql)
                .execute(pool)
                .await
                .map(|done| done.rows_affected()),
            #[cfg(feature = "sqlite")]
            Store::Sqlite(pool) => sqlx::query(sql)
                .execute(pool)
                .await
                .map(|done| done.rows_affected()),
        }
        .unwrap()
    }

    /// Outbox messages not delivered yet.
    pub async fn pending(&self) -> usize {
        self.outbox()
            .await
            .iter()
            .filter(|row| !row.delivered)
            .count()
    }
}

/// A PostgreSQL schema of one test's own: the service's tables live in
/// it (through the connection's `search_path`), apart from every other
/// test's.
pub struct PgSchema {
    name: String,
    admin: PgPool,
    /// The service's `DATABASE_URL`.
    pub url: String,
}

const POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/test";

impl PgSchema {
    pub async fn create(label: &str) -> PgSchema {
        let name = crate::unique::unique(label);
        let admin = PgPool::connect(POSTGRES).await.expect("PostgreSQL answers");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&admin)
            .await
            .unwrap();
        let url = format!("{POSTGRES}?options[search_path]={name}");
        PgSchema { name, admin, url }
    }

    /// The store, as the service sees it.
    pub async fn store(&self) -> Store {
        Store::Postgres(PgPool::connect(&self.url).await.unwrap())
    }

    /// Drops the schema and its tables (at a test's end).
    pub async fn drop(self) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.name
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }
}

/// Every message ends applied exactly once: the service's committed
/// charges, its outbox, the stream and the ledger agree. Returns how
/// many copies beyond the first the stream holds (the relay's
/// redeliveries).
pub async fn assert_each_applied_once(
    store: &Store,
    stream: &TestStream,
    ledger: &Ledger,
) -> usize {
    let charges = store.charges().await;
    let outbox = store.outbox().await;
    assert_eq!(
        outbox.len(),
        charges.len(),
        "one outbox message per committed charge"
    );
    assert!(
        outbox.iter().all(|row| row.delivered),
        "every message marked delivered"
    );
    let in_stream = stream.message_ids().await;
    for row in &outbox {
        assert!(
            in_stream.contains_key(&row.id),
            "message {} never reached the stream",
            row.id
        );
    }
    assert_eq!(
        in_stream.len(),
        outbox.len(),
        "the stream holds nothing but the outbox's messages"
    );
    let (messages, charged) = ledger.entries().await;
    let twice: Vec<_> = messages.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "messages applied twice: {twice:?}");
    assert_eq!(messages.len(), outbox.len(), "every message applied");
    let mut applied: Vec<i64> = charged.keys().copied().collect();
    applied.sort_unstable();
    assert_eq!(applied, charges, "the ledger has each committed charge");
    in_stream.values().map(|count| *count as usize - 1).sum()
}
