//! The outbox's RabbitMQ sink (`idem::outbox::rabbitmq`) against the real broker
//! on 127.0.0.1:5672 (started by `.ci/run`; the tests fail without it):
//! requests through a real axum server on loopback write messages in
//! their transactions, PostgreSQL keeping the keys, the outbox and the
//! consumer's records (a schema of each test's own); the relay publishes
//! them with confirms and mandatory routing into a quorum queue of each
//! test's own; a consumer applies them through `Idem::consume`.
//!
//! `cargo test -p idem-tests --test rabbitmq` (feature `rabbitmq`, on by
//! default in `idem-tests`).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Json;
use axum::http::StatusCode;
use axum::routing::post;
use futures::StreamExt;
use idem::outbox::RelayRun;
use idem::outbox::rabbitmq::{self, RabbitMq};
use idem::{Consumed, Idem, Tx, idempotent};
use idem_tests::account::Account;
use idem_tests::outbox_flow::{Deadline, PgSchema};
use idem_tests::rabbitmq::{AMQP_URL, AmqpProxy, TestQueue};
use idem_tests::unique::unique;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, ExchangeKind};
use serde_json::{Value, json};
use sqlx::{PgPool, Postgres};

/// The topic the service's messages are written on.
const TOPIC: &str = "entry.created";

/// The longest any test waits for what it waits for.
const DEADLINE: Duration = Duration::from_secs(60);

/// `POST /entries` `{"n": n}`: writes one message, `{"account", "n"}`, in
/// the request's transaction; answers its id.
#[idempotent(scope = "account")]
async fn post_entry(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(body): Json<Value>,
) -> Result<(StatusCode, Json<Value>), (StatusCode, String)> {
    let payload = json!({ "account": account.0, "n": body["n"] });
    let id = tx
        .outbox(TOPIC, &payload)
        .await
        .map_err(|error| (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    Ok((StatusCode::CREATED, Json(json!({ "message": id }))))
}

/// One test's world: its PostgreSQL schema (keys, outbox, consumed
/// records and the consumer's ledger) and the service, served on
/// loopback.
struct World {
    schema: PgSchema,
    pool: PgPool,
    idem: Idem<Postgres>,
    addr: SocketAddr,
    http: reqwest::Client,
}

impl World {
    async fn new(label: &str) -> World {
        let schema = PgSchema::create(label).await;
        let pool = PgPool::connect(&schema.url)
            .await
            .expect("PostgreSQL answers");
        let idem = Idem::new(pool.clone());
        idem.migrate().await.expect("migrate");
        idem.migrate_outbox().await.expect("migrate the outbox");
        sqlx::raw_sql(
            "CREATE TABLE ledger (entry bigserial PRIMARY KEY, message_id text NOT NULL, \
             account text NOT NULL, n bigint NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new()
            .route("/entries", post(post_entry))
            .with_state(idem.clone());
        tokio::spawn(async move { axum::serve(listener, router).await });
        World {
            schema,
            pool,
            idem,
            addr,
            http: reqwest::Client::new(),
        }
    }

    /// `POST /entries` as `account` under `key`: the message's id.
    async fn post(&self, account: &str, key: &str, n: i64) -> String {
        let response = self
            .http
            .post(format!("http://{}/entries", self.addr))
            .header("x-account", account)
            .header("idempotency-key", key)
            .json(&json!({ "n": n }))
            .send()
            .await
            .unwrap_or_else(|error| panic!("POST /entries ({account} {key}): {error}"));
        assert_eq!(response.status(), 201, "POST /entries ({account} {key})");
        let body: Value = response.json().await.unwrap();
        body["message"].as_str().unwrap().to_owned()
    }

    /// `PER_ACCOUNT` requests for each of `accounts`, accounts at once and
    /// each account's in order (`n` counting up): each account's message
    /// ids, in that order.
    async fn post_many(&self, accounts: &[String], per_account: i64) -> Vec<Vec<String>> {
        let posting = accounts.iter().map(|account| async move {
            let mut ids = Vec::new();
            for n in 0..per_account {
                ids.push(self.post(account, &format!("k{n}"), n).await);
            }
            ids
        });
        futures::future::join_all(posting).await
    }

    async fn pending(&self) -> u64 {
        self.idem.pending_messages().await.unwrap()
    }

    /// The ledger's rows in the order they were applied: (message id,
    /// account, n).
    async fn ledger(&self) -> Vec<(String, String, i64)> {
        sqlx::query_as("SELECT message_id, account, n FROM ledger ORDER BY entry")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Every outbox message's id.
    async fn outbox_ids(&self) -> HashSet<String> {
        let sql = format!("SELECT id FROM {}", self.idem.outbox_table_name());
        let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap();
        ids.into_iter().collect()
    }

    async fn finish(self) {
        self.pool.close().await;
        self.schema.drop().await;
    }
}

/// What the consumer did, counted.
#[derive(Default)]
struct Tally {
    applied: AtomicU64,
    duplicates: AtomicU64,
    acked: AtomicU64,
}

impl Tally {
    fn applied(&self) -> u64 {
        self.applied.load(Ordering::SeqCst)
    }

    fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }

    fn acked(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }
}

/// How a service consumes the queue: each delivery's outbox message id
/// (its AMQP `message_id`, read with `idem::outbox::rabbitmq::message_id`) goes to
/// `Idem::consume`, whose transaction records it and inserts the ledger
/// row; the delivery is acknowledged only after that commits (applied, or
/// found applied before), so a redelivered message is acknowledged
/// without a second row. One delivery at a time: the queue's order, which
/// is each scope's, is the order applied. Returns the consumer and its
/// counts.
async fn consumer(world: &World, queue: &TestQueue) -> (Consuming, Arc<Tally>) {
    let channel = queue.connection().create_channel().await.unwrap();
    let (idem, queue) = (world.idem.clone(), queue.name.as_str());
    let tally = Arc::new(Tally::default());
    let counted = Arc::clone(&tally);
    channel
        .basic_qos(50, BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|error| panic!("consuming {queue}: {error}"));
    let task = tokio::spawn(async move {
        // An error ends the stream: the channel closed (`Consuming::stop`).
        while let Some(Ok(delivery)) = deliveries.next().await {
            let id = rabbitmq::message_id(&delivery)
                .expect("every message has its message_id")
                .to_owned();
            assert_eq!(rabbitmq::topic(&delivery), Some(TOPIC));
            assert_eq!(delivery.properties.delivery_mode(), &Some(2), "persistent");
            let entry: Value = serde_json::from_slice(&delivery.data).unwrap();
            let account = entry["account"].as_str().unwrap().to_owned();
            assert_eq!(rabbitmq::scope(&delivery), Some(account.as_str()));
            let n = entry["n"].as_i64().unwrap();
            let done = idem
                .consume("ledger", &id, async |tx| {
                    sqlx::query("INSERT INTO ledger (message_id, account, n) VALUES ($1, $2, $3)")
                        .bind(&id)
                        .bind(&account)
                        .bind(n)
                        .execute(&mut *tx)
                        .await
                })
                .await;
            match done {
                Ok(Consumed::Applied(_)) => counted.applied.fetch_add(1, Ordering::SeqCst),
                Ok(Consumed::Duplicate) => counted.duplicates.fetch_add(1, Ordering::SeqCst),
                Err(error) => {
                    // Nothing committed: back to the queue, delivered again.
                    eprintln!("applying {id} failed: {error}; requeued");
                    let requeue = BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    };
                    delivery.nack(requeue).await.expect("nack");
                    continue;
                }
            };
            delivery.ack(BasicAckOptions::default()).await.expect("ack");
            counted.acked.fetch_add(1, Ordering::SeqCst);
        }
    });
    (Consuming { channel, task }, tally)
}

/// A running [`consumer`].
struct Consuming {
    channel: Channel,
    task: tokio::task::JoinHandle<()>,
}

impl Consuming {
    /// Closes the consumer's channel (the broker cancels the consumer) and
    /// waits for the consumer to end: before its queue is deleted, which
    /// would otherwise cancel it from the broker's side while it is
    /// dropped.
    async fn stop(self) {
        self.channel
            .close(200, "OK".into())
            .await
            .expect("the consumer's channel closes");
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the consumer ends")
            .expect("the consumer did not panic");
    }
}

/// Each account's `n`s in the order the ledger applied them.
fn applied_order(ledger: &[(String, String, i64)]) -> HashMap<&str, Vec<i64>> {
    let mut order: HashMap<&str, Vec<i64>> = HashMap::new();
    for (_, account, n) in ledger {
        order.entry(account.as_str()).or_default().push(*n);
    }
    order
}

/// Every ledger row's message id once, and the ids are the outbox's.
fn assert_each_applied_once(ledger: &[(String, String, i64)], outbox: &HashSet<String>) {
    let mut seen = HashSet::new();
    for (id, _, _) in ledger {
        assert!(seen.insert(id.as_str()), "message {id} applied twice");
    }
    let outbox: HashSet<&str> = outbox.iter().map(String::as_str).collect();
    assert_eq!(seen, outbox, "the ledger has exactly the outbox's messages");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_delivers_a_thousand_messages_each_applied_once_in_scope_order() {
    const ACCOUNTS: usize = 10;
    const PER_ACCOUNT: i64 = 100;
    let total = ACCOUNTS as u64 * PER_ACCOUNT.unsigned_abs();
    let world = World::new("rmq_thousand").await;
    let queue = TestQueue::create("idem_thousand").await;
    let (consuming, tally) = consumer(&world, &queue).await;
    let sink = RabbitMq::to_queue(AMQP_URL, &queue.name)
        .await
        .expect("the sink connects");
    let relay = world
        .idem
        .relay(sink)
        .every(Duration::from_millis(50))
        .spawn();

    let accounts: Vec<String> = (0..ACCOUNTS).map(|i| unique(&format!("acct{i}"))).collect();
    let written = world.post_many(&accounts, PER_ACCOUNT).await;
    // A retried request is replayed: the same message, no second one.
    assert_eq!(world.post(&accounts[0], "k0", 0).await, written[0][0]);

    let deadline = Deadline::after(DEADLINE);
    deadline
        .until("every message delivered and applied", || async {
            (world.pending().await == 0 && tally.applied() == total).then_some(())
        })
        .await;
    deadline
        .until("every delivery acknowledged", || async {
            let handled = tally.applied() + tally.duplicates();
            (tally.acked() == handled && queue.ready().await == 0).then_some(())
        })
        .await;

    let ledger = world.ledger().await;
    assert_eq!(ledger.len() as u64, total, "one ledger row per request");
    assert_each_applied_once(&ledger, &world.outbox_ids().await);
    let order = applied_order(&ledger);
    let expected: Vec<i64> = (0..PER_ACCOUNT).collect();
    for account in &accounts {
        assert_eq!(
            order.get(account.as_str()),
            Some(&expected),
            "{account}'s messages applied in the order written"
        );
    }

    relay.abort();
    consuming.stop().await;
    queue.delete().await;
    world.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_retried_and_never_marked_delivered() {
    let world = World::new("rmq_unroutable").await;
    // Not declared yet: with mandatory, the broker returns every publish.
    let queue = TestQueue::named("idem_unroutable").await;
    let sink = RabbitMq::to_queue(AMQP_URL, &queue.name)
        .await
        .expect("the sink connects");
    let relay = world
        .idem
        .relay(sink)
        .backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
        .delivery_timeout(Duration::from_secs(5));
    let accounts = [unique("acct_a"), unique("acct_b")];
    let a = world.post_many(&accounts[..1], 3).await;
    let b = world.post_many(&accounts[1..], 1).await;

    for pass in 0..3 {
        let run = relay.run_once().await.expect("a relay pass");
        assert_eq!(run.delivered, 0, "pass {pass}: nothing can be delivered");
        assert!(
            run.failed >= 2,
            "pass {pass}: each scope's first message fails: {run:?}"
        );
        assert_eq!(world.pending().await, 4, "pass {pass}: nothing marked");
    }
    let sql = format!(
        "SELECT attempts FROM {} WHERE id = $1 OR id = $2",
        world.idem.outbox_table_name()
    );
    let attempts: Vec<i32> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .bind(&a[0][0])
        .bind(&b[0][0])
        .fetch_all(&world.pool)
        .await
        .unwrap();
    assert_eq!(attempts, [3, 3], "each failure counted on the message");

    // Now a queue takes them: the next passes deliver all four.
    queue.declare().await;
    let (consuming, tally) = consumer(&world, &queue).await;
    let mut done = RelayRun::default();
    let started = tokio::time::Instant::now();
    while world.pending().await > 0 {
        assert!(started.elapsed() < DEADLINE, "the outbox drained: {done:?}");
        let run = relay.run_once().await.expect("a relay pass");
        done.delivered += run.delivered;
        done.failed += run.failed;
    }
    assert_eq!((done.delivered, done.failed), (4, 0));
    let deadline = Deadline::after(DEADLINE);
    deadline
        .until("the four applied and acknowledged", || async {
            (tally.acked() == 4).then_some(())
        })
        .await;
    // The returned publishes went nowhere: one copy of each arrived.
    assert_eq!((tally.applied(), tally.duplicates()), (4, 0));
    let ledger = world.ledger().await;
    assert_each_applied_once(&ledger, &world.outbox_ids().await);
    let order = applied_order(&ledger);
    assert_eq!(order[accounts[0].as_str()], [0, 1, 2]);
    assert_eq!(order[accounts[1].as_str()], [0]);

    consuming.stop().await;
    queue.delete().await;
    world.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_the_broker_closed_is_replaced_and_an_exchange_routes_by_topic() {
    let world = World::new("rmq_exchange").await;
    let queue = TestQueue::named("idem_exchange").await;
    let exchange = unique("idem_exchange");
    let sink = RabbitMq::to_exchange(AMQP_URL, &exchange)
        .await
        .expect("the sink connects");
    let relay = world
        .idem
        .relay(sink)
        .backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
        .delivery_timeout(Duration::from_secs(5));
    let account = unique("acct");
    world.post_many(std::slice::from_ref(&account), 1).await;

    // The exchange is missing: the broker closes the sink's channel. Each
    // pass fails (and does not hang: under the delivery timeout), and
    // the next opens a new channel.
    for pass in 0..2 {
        let started = tokio::time::Instant::now();
        let run = relay.run_once().await.expect("a relay pass");
        assert_eq!((run.delivered, run.failed), (0, 1), "pass {pass}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "pass {pass}: the publish failed at once, not by timing out"
        );
    }
    // The exchange exists, no binding: returned, failed.
    queue
        .channel()
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let run = relay.run_once().await.expect("a relay pass");
    assert_eq!((run.delivered, run.failed), (0, 1), "no binding yet");
    assert_eq!(world.pending().await, 1);

    // Bound by topic: delivered.
    queue.declare().await;
    queue
        .channel()
        .queue_bind(
            queue.name.as_str().into(),
            exchange.as_str().into(),
            TOPIC.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let run = relay.run_once().await.expect("a relay pass");
    assert_eq!((run.delivered, run.failed), (1, 0), "routed by its topic");
    assert_eq!(world.pending().await, 0);
    let (consuming, tally) = consumer(&world, &queue).await;
    Deadline::after(DEADLINE)
        .until("the message applied", || async {
            (tally.acked() == 1).then_some(())
        })
        .await;
    assert_eq!(tally.applied(), 1);

    consuming.stop().await;
    queue
        .channel()
        .exchange_delete(exchange.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    queue.delete().await;
    world.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_costs_retries_and_the_sink_reconnects() {
    let world = World::new("rmq_reconnect").await;
    let queue = TestQueue::create("idem_reconnect").await;
    let proxy = AmqpProxy::start().await;
    let sink = RabbitMq::to_queue(&proxy.url(), &queue.name)
        .await
        .expect("the sink connects through the proxy");
    let relay = world
        .idem
        .relay(sink)
        .backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO)
        .delivery_timeout(Duration::from_secs(5));
    let account = unique("acct");
    world.post(&account, "k0", 0).await;
    let run = relay.run_once().await.expect("a relay pass");
    assert_eq!((run.delivered, run.failed), (1, 0), "delivered while up");

    // The broker unreachable: the sink's connection dropped, new ones
    // refused. Each pass fails, at once rather than by timing out.
    proxy.cut();
    world.post(&account, "k1", 1).await;
    for pass in 0..3 {
        let started = tokio::time::Instant::now();
        let run = relay.run_once().await.expect("a relay pass");
        assert_eq!((run.delivered, run.failed), (0, 1), "pass {pass}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "pass {pass}: failed at once, not by timing out"
        );
    }
    assert_eq!(world.pending().await, 1);

    // Reachable again: the sink reconnects on its next delivery.
    proxy.restore();
    let run = relay.run_once().await.expect("a relay pass");
    assert_eq!((run.delivered, run.failed), (1, 0), "delivered once back");
    assert_eq!(world.pending().await, 0);
    let (consuming, tally) = consumer(&world, &queue).await;
    Deadline::after(DEADLINE)
        .until("both messages applied", || async {
            (tally.acked() == 2).then_some(())
        })
        .await;
    assert_eq!(tally.applied(), 2);
    let ledger = world.ledger().await;
    assert_eq!(applied_order(&ledger)[account.as_str()], [0, 1]);

    consuming.stop().await;
    queue.delete().await;
    world.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_published_again_is_applied_once() {
    const PER_ACCOUNT: i64 = 10;
    let world = World::new("rmq_again").await;
    let queue = TestQueue::create("idem_again").await;
    let (consuming, tally) = consumer(&world, &queue).await;
    let sink = RabbitMq::to_queue(AMQP_URL, &queue.name)
        .await
        .expect("the sink connects");
    let relay = world
        .idem
        .relay(sink)
        .every(Duration::from_millis(50))
        .spawn();
    let accounts = [unique("acct_a"), unique("acct_b")];
    world.post_many(&accounts, PER_ACCOUNT).await;
    let total = 2 * PER_ACCOUNT.unsigned_abs();

    let deadline = Deadline::after(DEADLINE);
    deadline
        .until("every message applied and acknowledged", || async {
            (world.pending().await == 0 && tally.acked() == total).then_some(())
        })
        .await;
    assert_eq!(tally.applied(), total);

    // The relay's marks lost (as after a relay that published and stopped
    // before marking): every message is published a second time.
    let sql = format!(
        "UPDATE {} SET delivered_at = NULL, lease_token = NULL, lease_until = NULL",
        world.idem.outbox_table_name()
    );
    let reset = sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&world.pool)
        .await
        .unwrap();
    assert_eq!(reset.rows_affected(), total);
    deadline
        .until("every copy delivered and acknowledged", || async {
            (world.pending().await == 0 && tally.acked() == 2 * total).then_some(())
        })
        .await;
    assert_eq!(
        (tally.applied(), tally.duplicates()),
        (total, total),
        "each second copy found applied"
    );
    let ledger = world.ledger().await;
    assert_eq!(ledger.len() as u64, total);
    assert_each_applied_once(&ledger, &world.outbox_ids().await);

    relay.abort();
    consuming.stop().await;
    queue.delete().await;
    world.finish().await;
}
