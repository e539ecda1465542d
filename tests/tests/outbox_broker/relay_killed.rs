//! The relay killed mid-batch (SIGKILL of the charges service, its store
//! PostgreSQL) and restarted: every committed charge's message reaches the
//! stream, some twice, and the consumer applies each once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::header::NATS_MESSAGE_ID;
use futures::StreamExt;
use idem_tests::examples::free_port;
use idem_tests::nats::{NatsProxy, TestStream};

use crate::harness::{
    ConsumerSettings, Deadline, Ledger, PgSchema, Printed, assert_each_applied_once, charge,
    consumer, drained_and_consumed, service,
};

/// Charges written before the kill.
const CHARGES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_mid_batch_then_restarted_delivers_every_message() {
    let deadline = Deadline::after(Duration::from_secs(120));
    // A short duplicate window: what the restarted relay publishes again
    // lands in the stream again, for the consumer to find applied.
    let stream = TestStream::create("outbox_relay_kill", Duration::from_millis(100)).await;
    let schema = PgSchema::create("outbox_relay_kill").await;
    let dir = tempfile::tempdir().unwrap();
    // Every publish's acknowledgement comes 25 ms late: the relay falls
    // behind the writes, and a batch takes seconds to deliver.
    let proxy = NatsProxy::start().await;
    proxy.set_latency(Duration::from_millis(25));
    let addr = free_port();
    let mut first = service(dir.path(), addr, &stream, &proxy.url(), Some(&schema.url)).await;
    let store = schema.store().await;

    let http = reqwest::Client::new();
    let written: Vec<i64> = futures::stream::iter(0..CHARGES)
        .map(|i| {
            let http = &http;
            async move {
                let account = format!("acct_{}", i % 8);
                charge(
                    http,
                    addr,
                    &account,
                    &format!("relay-kill-{i}"),
                    100 + i as i64,
                )
                .await
                .0
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert_eq!(written.len(), CHARGES);

    // Killed past its first batch, at a moment a message is in the stream
    // while the relay's lease on it is unmarked: published, not yet
    // recorded as delivered.
    deadline
        .until("a published message still leased by the relay", || async {
            let outbox = store.outbox().await;
            if !outbox.iter().any(|row| row.delivered) {
                return None;
            }
            let leased: HashSet<String> = outbox
                .into_iter()
                .filter(|row| row.leased && !row.delivered)
                .map(|row| row.id)
                .collect();
            let last = stream.state().await.last_sequence;
            if last == 0 || leased.is_empty() {
                return None;
            }
            let jetstream = stream.jetstream();
            let message = jetstream
                .get_stream(&stream.name)
                .await
                .unwrap()
                .get_raw_message(last)
                .await
                .unwrap();
            let id = message.headers.get(NATS_MESSAGE_ID).unwrap().as_str();
            leased.contains(id).then_some(())
        })
        .await;
    first.kill().await.unwrap();

    let in_stream = stream.message_ids().await;
    let outbox = store.outbox().await;
    let stranded = outbox
        .iter()
        .filter(|row| row.leased && !row.delivered && in_stream.contains_key(&row.id))
        .count();
    let undelivered = outbox.iter().filter(|row| !row.delivered).count();
    assert!(
        stranded > 0,
        "the kill came mid-batch: published messages left unmarked"
    );
    assert!(
        in_stream.len() < CHARGES,
        "the kill came before the relay delivered everything"
    );

    // Restarted, the broker fast again; the consumer reads the stream.
    proxy.set_latency(Duration::ZERO);
    let addr = free_port();
    let _second = service(dir.path(), addr, &stream, &proxy.url(), Some(&schema.url)).await;
    let printed = Arc::new(Printed::default());
    let settings = ConsumerSettings {
        name: "ledger",
        ack_wait: Duration::from_secs(5),
        crash_after: None,
    };
    let _consumer = consumer(dir.path(), &stream, &settings, &printed).await;
    let ledger = Ledger::open(dir.path()).await;

    drained_and_consumed(deadline, &store, &stream, settings.name, &printed).await;
    let again = assert_each_applied_once(&store, &stream, &ledger).await;
    assert_eq!(printed.applied(), CHARGES as u64);
    assert!(
        again >= stranded,
        "the {stranded} stranded messages were published again ({again} copies)"
    );
    assert_eq!(
        printed.duplicates(),
        again as u64,
        "each copy found applied"
    );
    eprintln!(
        "relay killed with {undelivered} of {CHARGES} messages undelivered, {stranded} \
         published but unmarked; the restarted relay published {again} again, and the \
         consumer found them applied"
    );
    stream.delete().await;
    schema.drop().await;
}
