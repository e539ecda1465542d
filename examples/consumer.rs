//! Keeps a ledger of the charges example's charges: reads its
//! `charge.created` messages from NATS JetStream (or RabbitMQ) and applies
//! each exactly once, however often the broker delivers it.
//!
//! ```text
//! NATS_URL=nats://127.0.0.1:4222 cargo run --example charges &
//! cargo run --example consumer
//! BROKER=rabbitmq cargo run --example charges &
//! BROKER=rabbitmq cargo run --example consumer
//! ```
//!
//! It prints nothing until a charge event arrives that it has not
//! acknowledged before: post a charge to see one.
//!
//! Each message is applied through `idem.consume("ledger", id, ...)`: the
//! ledger row and the record of the message's id commit in one
//! transaction. The message is acknowledged only after that (applied, or
//! found applied before); a failure acknowledges nothing, so the broker
//! delivers it again. A consumer that dies between its commit and its
//! acknowledgement gets the message again, and finds it applied. One line
//! is printed per message: `applied <subject> <id> charge=<id> account=<a>
//! amount=<n> <currency>`, or `duplicate <subject> <id>`.
//!
//! Environment:
//! - `BROKER`: `nats` (the default) or `rabbitmq`.
//! - `NATS_URL`: the broker, default `nats://127.0.0.1:4222`; a cluster's
//!   servers separated by commas.
//! - `NATS_STREAM`, `NATS_SUBJECT_PREFIX`: the stream and the subjects'
//!   prefix, as for the charges example (default `CHARGES`, none).
//! - `CONSUMER_NAME`: the durable consumer's name, default `ledger`: the
//!   broker remembers what it acknowledged, across restarts.
//! - `AMQP_URL`, `AMQP_QUEUE` (with `BROKER=rabbitmq`): the broker, default
//!   `amqp://guest:guest@127.0.0.1:5672/%2f`, and the queue, default
//!   `charges` (a durable quorum queue, declared if missing).
//! - `DATABASE_URL`: unset, the ledger is the SQLite file `ledger.db` in the
//!   working directory; `postgres://...`, `mysql://...` (`--features mysql`)
//!   or `sqlite:...` choose the database instead.
//! - `DATABASE_POOLER`: `transaction` when `DATABASE_URL` is a
//!   transaction-mode pooler (PgBouncer): the ledger's statements then keep
//!   nothing in the session.
//! - `CONSUMER_ACK_WAIT_MS`: how long the broker waits for an
//!   acknowledgement before it delivers a message again, default 30000.
//!   Taken when the durable consumer is created.
//! - `CONSUMER_CRASH_AFTER`: `N`, the process aborts right after the `N`th
//!   message it applied commits, before acknowledging it (for the tests:
//!   the broker must deliver it again, and it must not be applied twice).

use std::future::Future;
use std::time::Duration;

#[path = "shared/broker.rs"]
mod broker;
#[path = "shared/database.rs"]
mod database;
use database::Database;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use futures::StreamExt;
use idem::Consumed;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use serde::Deserialize;

/// A `charge.created` message, as the charges example writes it.
#[derive(Deserialize)]
struct ChargeCreated {
    charge_id: i64,
    account: String,
    amount: i64,
    currency: String,
}

/// The ledger's SQL on one engine.
trait Ledger: idem::Backend {
    /// Creates the `ledger` table if it is missing.
    fn create(pool: &sqlx::Pool<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    /// Inserts one entry, in the transaction `conn` is in. No unique key:
    /// a message applied twice would show as two rows.
    fn insert(
        conn: &mut Self::Connection,
        message_id: &str,
        charge: &ChargeCreated,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;
}

/// `ledger` on one engine: its `CREATE TABLE` and its placeholders.
macro_rules! ledger {
    ($db:ty, $create:expr, $insert:expr) => {
        impl Ledger for $db {
            async fn create(pool: &sqlx::Pool<Self>) -> Result<(), sqlx::Error> {
                sqlx::raw_sql($create).execute(pool).await?;
                Ok(())
            }

            async fn insert(
                conn: &mut Self::Connection,
                message_id: &str,
                charge: &ChargeCreated,
            ) -> Result<(), sqlx::Error> {
                sqlx::query($insert)
                    .bind(message_id)
                    .bind(charge.charge_id)
                    .bind(&charge.account)
                    .bind(charge.amount)
                    .bind(&charge.currency)
                    .persistent(database::persistent())
                    .execute(conn)
                    .await?;
                Ok(())
            }
        }
    };
}

#[cfg(feature = "postgres")]
ledger!(
    sqlx::Postgres,
    "CREATE TABLE IF NOT EXISTS ledger (
        entry bigserial PRIMARY KEY, message_id text NOT NULL, charge_id bigint NOT NULL,
        account text NOT NULL, amount bigint NOT NULL, currency text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now())",
    "INSERT INTO ledger (message_id, charge_id, account, amount, currency) \
     VALUES ($1, $2, $3, $4, $5)"
);

#[cfg(feature = "sqlite")]
ledger!(
    sqlx::Sqlite,
    "CREATE TABLE IF NOT EXISTS ledger (
        entry INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL,
        charge_id INTEGER NOT NULL, account TEXT NOT NULL, amount INTEGER NOT NULL,
        currency TEXT NOT NULL, applied_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP)",
    "INSERT INTO ledger (message_id, charge_id, account, amount, currency) \
     VALUES (?, ?, ?, ?, ?)"
);

#[cfg(feature = "mysql")]
ledger!(
    sqlx::MySql,
    "CREATE TABLE IF NOT EXISTS ledger (
        entry BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(255) NOT NULL,
        charge_id BIGINT NOT NULL, account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL,
        currency VARCHAR(16) NOT NULL,
        applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
    "INSERT INTO ledger (message_id, charge_id, account, amount, currency) \
     VALUES (?, ?, ?, ?, ?)"
);

/// With no `DATABASE_URL`: a SQLite file next to where the example runs.
const DEFAULT_DATABASE: &str = "ledger.db";

/// How many messages RabbitMQ hands over ahead of their acknowledgement:
/// what a crash leaves unacknowledged goes back to the queue's head, in
/// order.
const PREFETCH: u16 = 20;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    match database::connect(DEFAULT_DATABASE, "the ledger").await? {
        #[cfg(feature = "sqlite")]
        Database::Sqlite(pool) => run(pool).await,
        #[cfg(feature = "postgres")]
        Database::Postgres(pool) => run(pool).await,
        #[cfg(feature = "mysql")]
        Database::MySql(pool) => run(pool).await,
    }
}

/// An environment variable as a number, if set.
fn number(name: &str) -> Result<Option<u64>, Box<dyn std::error::Error>> {
    match std::env::var(name) {
        Ok(value) => Ok(Some(
            value
                .parse()
                .map_err(|error| format!("{name}={value:?}: {error}"))?,
        )),
        Err(_) => Ok(None),
    }
}

/// Consumes until the process ends, the ledger in `pool`.
async fn run<DB: Ledger>(pool: sqlx::Pool<DB>) -> Result<(), Box<dyn std::error::Error>> {
    let idem = database::idem(&pool);
    idem.migrate_outbox().await?;
    DB::create(&pool).await?;
    let ledger = Applier {
        idem,
        crash_after: number("CONSUMER_CRASH_AFTER")?,
        applied: 0,
    };
    match broker::which()? {
        broker::Which::Nats => from_nats(ledger).await,
        broker::Which::RabbitMq => from_rabbitmq(ledger).await,
    }
}

/// What became of one message, and so what to tell the broker.
enum Verdict {
    /// Applied now or before: acknowledge it.
    Done,
    /// Unreadable: acknowledge it as never to be delivered again.
    Dropped,
    /// Nothing committed: the broker delivers it again.
    Again,
}

/// Applies messages to the ledger, each once.
struct Applier<DB: Ledger> {
    idem: idem::Idem<DB>,
    crash_after: Option<u64>,
    applied: u64,
}

impl<DB: Ledger> Applier<DB> {
    /// Applies the message `id` read from `source` (its subject or topic),
    /// printing one line.
    async fn apply(&mut self, source: &str, id: Option<&str>, payload: &[u8]) -> Verdict {
        let Some(id) = id else {
            tracing::warn!(source, "a message without its outbox id: dropped");
            return Verdict::Dropped;
        };
        let charge: ChargeCreated = match serde_json::from_slice(payload) {
            Ok(charge) => charge,
            Err(error) => {
                tracing::warn!(%error, id, "an unreadable charge.created: dropped");
                return Verdict::Dropped;
            }
        };
        let done = self
            .idem
            .consume("ledger", id, async |tx| DB::insert(tx, id, &charge).await)
            .await;
        match done {
            Ok(Consumed::Applied(())) => {
                println!(
                    "applied {source} {id} charge={} account={} amount={} {}",
                    charge.charge_id, charge.account, charge.amount, charge.currency
                );
                self.applied += 1;
                if self.crash_after == Some(self.applied) {
                    eprintln!(
                        "consumer: CONSUMER_CRASH_AFTER={}: aborting before the ack",
                        self.applied
                    );
                    std::process::abort();
                }
                Verdict::Done
            }
            Ok(Consumed::Duplicate) => {
                println!("duplicate {source} {id}");
                Verdict::Done
            }
            Err(error) => {
                let cause = std::error::Error::source(&error)
                    .map(ToString::to_string)
                    .unwrap_or_default();
                tracing::warn!(%error, cause, id, "applying a message failed; redelivered");
                Verdict::Again
            }
        }
    }
}

/// Reads the charge events from NATS JetStream's durable consumer
/// `CONSUMER_NAME`.
async fn from_nats<DB: Ledger>(mut ledger: Applier<DB>) -> Result<(), Box<dyn std::error::Error>> {
    let ack_wait = Duration::from_millis(number("CONSUMER_ACK_WAIT_MS")?.unwrap_or(30_000));
    let name = std::env::var("CONSUMER_NAME").unwrap_or_else(|_| "ledger".into());
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let broker = broker::Broker::from_env(url);
    let jetstream = broker.connect().await?;
    let stream = broker.stream(&jetstream).await;
    let subject = broker.subject("charge.created");
    let consumer = stream
        .get_or_create_consumer(
            &name,
            pull::Config {
                durable_name: Some(name.clone()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                // One message unacknowledged at a time: JetStream gives
                // what a dead consumer left back only after the ack wait,
                // and with more in flight the next run would apply newer
                // messages first. So each account's charges keep their order.
                max_ack_pending: 1,
                filter_subject: subject.clone(),
                ..Default::default()
            },
        )
        .await?;
    // Each pull lasts 5 s and the server beats every second while it
    // waits: a pull the server lost (its node killed, the consumer's
    // leader moved) is noticed within seconds and asked again, rather
    // than when it would have expired (30 s by default).
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(1)
        .expires(Duration::from_secs(5))
        .heartbeat(Duration::from_secs(1))
        .messages()
        .await?;
    tracing::info!(
        "consumer {name} reading {subject} from NATS stream {}",
        broker.stream
    );
    while let Some(message) = messages.next().await {
        let message = match message {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(%error, "reading from NATS failed; going on");
                continue;
            }
        };
        let id = idem::outbox::nats::message_id(&message);
        let verdict = ledger.apply(&message.subject, id, &message.payload).await;
        let acked = match verdict {
            Verdict::Done => message.ack().await,
            Verdict::Dropped => message.ack_with(AckKind::Term).await,
            Verdict::Again => {
                message
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await
            }
        };
        if let Err(error) = acked {
            // Delivered again after the ack wait, and then a duplicate.
            tracing::warn!(%error, "acknowledging failed");
        }
    }
    Err("the NATS message stream ended".into())
}

/// Reads the charge events from the RabbitMQ queue `AMQP_QUEUE`.
async fn from_rabbitmq<DB: Ledger>(
    mut ledger: Applier<DB>,
) -> Result<(), Box<dyn std::error::Error>> {
    let amqp = broker::Amqp::from_env();
    let connection = amqp.connect().await;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            amqp.queue.as_str().into(),
            "ledger".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tracing::info!("consumer reading RabbitMQ queue {}", amqp.queue);
    while let Some(delivery) = deliveries.next().await {
        let delivery = delivery?;
        let topic = idem::outbox::rabbitmq::topic(&delivery)
            .unwrap_or(&amqp.queue)
            .to_owned();
        let id = idem::outbox::rabbitmq::message_id(&delivery).map(str::to_owned);
        let verdict = ledger.apply(&topic, id.as_deref(), &delivery.data).await;
        let acked = match verdict {
            Verdict::Done => delivery.ack(BasicAckOptions::default()).await,
            Verdict::Dropped => delivery.reject(BasicRejectOptions::default()).await,
            Verdict::Again => {
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                delivery.nack(requeue).await
            }
        };
        if let Err(error) = acked {
            // The channel closed: the broker delivers it again, and then
            // it is a duplicate.
            tracing::warn!(%error, "acknowledging failed");
        }
    }
    Err("the RabbitMQ consumer ended".into())
}
