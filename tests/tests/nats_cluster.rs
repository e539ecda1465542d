//! The outbox relay and the consumer on a NATS cluster of the test's own:
//! three `nats-server` nodes with JetStream on loopback ports, the stream
//! at replicas 3 (never the shared server on 4222). The charges example's
//! relay publishes, the consumer example applies, both on PostgreSQL in
//! schemas of the test's own; needs the examples built (`cargo build
//! --examples`).
//!
//! - A node killed, then the stream's leader, while 1,000 charges flow:
//!   every message applied exactly once.
//! - A message published again after the stream's duplicate window (2 s
//!   here, 2 minutes by default), when JetStream no longer drops it: the
//!   consumer's record of the ids it applied does, and it is applied once.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use idem_tests::examples::free_port;
use idem_tests::nats::TestStream;
use idem_tests::nats_cluster::NatsCluster;
use idem_tests::outbox_flow::{
    ConsumerSettings, Deadline, Ledger, OUTBOX, PgSchema, Printed, Store, assert_each_applied_once,
    charge, consumer, service,
};
use tokio::time::Instant;

/// The charges of the kill test.
const CHARGES: usize = 1_000;

/// One charge started every this often: the 1,000 flow for about 15 s,
/// long enough for both kills and the restarts between them.
const PACE: Duration = Duration::from_millis(15);

/// The consumer's ack wait: a message whose acknowledgement a kill lost
/// comes again this soon.
const ACK_WAIT: Duration = Duration::from_secs(2);

/// The kill test's points, in messages the consumer applied: the first
/// node killed, restarted, the stream's leader killed, restarted.
const KILL_NODE: u64 = 150;
const RESTART_NODE: u64 = 300;
const KILL_LEADER: u64 = 450;
const RESTART_LEADER: u64 = 650;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_then_the_stream_leader_killed_every_message_applied_once() {
    let started = Instant::now();
    let deadline = Deadline::after(Duration::from_secs(150));
    let mut cluster = NatsCluster::start("idem-kill").await;
    let jetstream = cluster.jetstream().await;
    let stream = TestStream::create_on(
        jetstream.clone(),
        "outbox_cluster_kill",
        Duration::from_secs(120),
        3,
        Duration::from_secs(30),
    )
    .await;
    let leader = cluster.stream_current(&jetstream, &stream.name).await;
    let victim = cluster
        .names()
        .into_iter()
        .find(|name| *name != leader)
        .unwrap();

    // The relay talks to the node killed first, the consumer to the
    // stream's leader, killed second: each must move to another node
    // (their clients learn the others from the cluster).
    let running = Flow::start(
        "nats_cluster",
        &stream,
        &cluster.url(&victim),
        &cluster.url(&leader),
    )
    .await;
    let Flow {
        addr,
        printed,
        mut consumer,
        store,
        ledger,
        schemas,
        ..
    } = running;

    let flow = tokio::spawn(async move {
        let http = reqwest::Client::new();
        let start = Instant::now();
        futures::stream::iter(0..CHARGES)
            .map(|i| {
                let http = http.clone();
                async move {
                    tokio::time::sleep_until(start + PACE * i as u32).await;
                    let account = format!("acct_{}", i % 8);
                    let key = format!("cluster-{i}");
                    charge(&http, addr, &account, &key, 100 + i as i64).await.0
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<i64>>()
            .await
    });

    let applied = async |at: u64, what: &str| {
        deadline
            .until(&format!("{at} messages applied ({what})"), || async {
                (ledger.rows().await >= at).then_some(())
            })
            .await;
    };
    applied(KILL_NODE, "before the first kill").await;
    cluster.kill(&victim).await;
    let killed_at = ledger.rows().await;
    applied(RESTART_NODE, "with a node down").await;
    cluster.restart(&victim).await;
    let caught_up = Instant::now();
    let leader = cluster.stream_current(&jetstream, &stream.name).await;
    let caught_up = caught_up.elapsed();

    applied(KILL_LEADER, "before the leader's kill").await;
    cluster.kill(&leader).await;
    let leader_killed_at = ledger.rows().await;
    let election = Instant::now();
    let new_leader = cluster
        .stream_leader(&jetstream, &stream.name, Some(&leader))
        .await;
    let election = election.elapsed();
    applied(RESTART_LEADER, "under the new leader").await;
    cluster.restart(&leader).await;
    cluster.stream_current(&jetstream, &stream.name).await;

    let written = tokio::time::timeout(Duration::from_secs(30), flow)
        .await
        .expect("the 1,000 charges answered within 30 s of the restarts")
        .expect("every charge answered 201");
    assert_eq!(written.len(), CHARGES);
    deadline
        .until(
            "every message delivered, applied and acknowledged",
            || async {
                if store.pending().await > 0 || ledger.rows().await < CHARGES as u64 {
                    return None;
                }
                (stream.consumer_backlog(CONSUMER).await == (0, 0)).then_some(())
            },
        )
        .await;
    assert!(
        consumer.try_wait().unwrap().is_none(),
        "the consumer example ran through both kills"
    );

    let again = assert_each_applied_once(&store, &stream, &ledger).await;
    assert_eq!(ledger.rows().await, CHARGES as u64, "one ledger row each");
    assert_eq!(printed.applied(), CHARGES as u64, "each applied once");
    let outbox = store.outbox().await;
    let retried = outbox.iter().filter(|row| row.attempts > 0).count();
    let failures: i32 = outbox.iter().map(|row| row.attempts).sum();
    eprintln!(
        "NATS cluster: {CHARGES} charges; node {victim} killed at {killed_at} applied, caught \
         up {caught_up:?} after its restart; stream leader {leader} killed at \
         {leader_killed_at} applied, {new_leader} seen leading {election:?} later; the relay \
         retried {retried} messages ({failures} failed publishes), the stream holds {again} \
         second copies, the consumer found {} deliveries applied before; every message \
         applied once; {:?} in all",
        printed.duplicates(),
        started.elapsed()
    );
    let (charges, ledger_db) = schemas;
    charges.drop().await;
    ledger_db.drop().await;
}

/// The consumer example's durable name.
const CONSUMER: &str = "ledger";

/// The duplicate window of the second test.
const WINDOW: Duration = Duration::from_secs(2);

/// The messages of the second test; the first is published again.
const MESSAGES: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_the_duplicate_window_is_applied_once() {
    let started = Instant::now();
    let deadline = Deadline::after(Duration::from_secs(120));
    let cluster = NatsCluster::start("idem-window").await;
    let jetstream = cluster.jetstream().await;
    let stream = TestStream::create_on(
        jetstream.clone(),
        "outbox_cluster_window",
        WINDOW,
        3,
        Duration::from_secs(30),
    )
    .await;
    let leader = cluster.stream_current(&jetstream, &stream.name).await;

    let url = cluster.url(&leader);
    let running = Flow::start("nats_window", &stream, &url, &url).await;
    let Flow {
        addr,
        printed,
        store,
        ledger,
        schemas,
        ..
    } = running;

    let http = reqwest::Client::new();
    for i in 0..MESSAGES {
        let key = format!("window-{i}");
        charge(&http, addr, "acct_window", &key, 100 + i as i64).await;
    }
    let consumed = async |copies: u64| {
        deadline
            .until(
                &format!("{copies} copies in the stream, each consumed"),
                || async {
                    if store.pending().await > 0 || stream.state().await.messages < copies {
                        return None;
                    }
                    let backlog = stream.consumer_backlog(CONSUMER).await;
                    let seen = printed.applied() + printed.duplicates();
                    (backlog == (0, 0) && seen >= copies).then_some(())
                },
            )
            .await;
    };
    consumed(MESSAGES as u64).await;
    assert_eq!(ledger.rows().await, MESSAGES as u64);

    // The first message's window runs out twice over (the server drops
    // its ids on a timer), then the relay is told it was never delivered.
    let first = jetstream
        .get_stream(&stream.name)
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    let id = first
        .headers
        .get(async_nats::header::NATS_MESSAGE_ID)
        .unwrap()
        .as_str()
        .to_owned();
    let published = std::time::SystemTime::from(first.time);
    deadline
        .until("the duplicate window run out twice over", || async {
            let age = published.elapsed().unwrap_or_default();
            (age > 2 * WINDOW).then_some(())
        })
        .await;
    let Store::Postgres(pool) = &store else {
        unreachable!("the service's store is PostgreSQL")
    };
    let marked = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {OUTBOX} SET delivered_at = NULL, lease_token = NULL, lease_until = NULL, \
         available_at = now() WHERE id = $1"
    )))
    .bind(&id)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(
        marked.rows_affected(),
        1,
        "the message {id} marked undelivered"
    );
    let age = published.elapsed().unwrap_or_default();
    let republished = Instant::now();

    consumed(MESSAGES as u64 + 1).await;
    let republished = republished.elapsed();
    let copies = stream.message_ids().await;
    assert_eq!(
        copies.get(&id),
        Some(&2),
        "past the window, JetStream took the message {id} again"
    );
    let again = assert_each_applied_once(&store, &stream, &ledger).await;
    assert_eq!(again, 1, "one message published twice");
    assert_eq!(ledger.rows().await, MESSAGES as u64, "one ledger row each");
    assert_eq!(printed.applied(), MESSAGES as u64);
    assert_eq!(
        printed.duplicates(),
        1,
        "the second copy found applied by the consumer"
    );
    eprintln!(
        "NATS cluster, duplicate window {WINDOW:?}: message {id} marked undelivered {age:?} \
         after its first publish, published again and taken by the stream (2 copies), delivered to the consumer \
         {republished:?} after it was marked undelivered and found applied there; \
         {MESSAGES} messages, one ledger row each; {:?} in all",
        started.elapsed()
    );
    let (charges, ledger_db) = schemas;
    charges.drop().await;
    ledger_db.drop().await;
}

/// The charges example (its relay on `relay_url`) and the consumer example
/// (on `consumer_url`), each on PostgreSQL in a schema of its own, over
/// `stream`; stopped when dropped (destructure a binding of it, not the
/// call: the fields left out of a temporary's pattern are dropped at once).
struct Flow {
    addr: std::net::SocketAddr,
    printed: Arc<Printed>,
    consumer: tokio::process::Child,
    store: Store,
    ledger: Ledger,
    _service: tokio::process::Child,
    /// The charges' and the ledger's schemas, for the test to drop.
    schemas: (PgSchema, PgSchema),
    _dir: tempfile::TempDir,
}

impl Flow {
    async fn start(label: &str, stream: &TestStream, relay_url: &str, consumer_url: &str) -> Flow {
        let charges = PgSchema::create(&format!("{label}_charges")).await;
        let ledger_db = PgSchema::create(&format!("{label}_ledger")).await;
        let dir = tempfile::tempdir().unwrap();
        let addr = free_port();
        let service = service(dir.path(), addr, stream, relay_url, Some(&charges.url)).await;
        let printed = Arc::new(Printed::default());
        let settings = ConsumerSettings {
            name: CONSUMER,
            ack_wait: ACK_WAIT,
            crash_after: None,
        };
        let consumer = consumer(
            dir.path(),
            consumer_url,
            &ledger_db.url,
            stream,
            &settings,
            &printed,
        )
        .await;
        Flow {
            addr,
            printed,
            consumer,
            store: charges.store().await,
            ledger: Ledger::postgres(&ledger_db.url).await,
            _service: service,
            schemas: (charges, ledger_db),
            _dir: dir,
        }
    }
}
