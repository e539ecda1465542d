//! The consumer killed mid-message, again and again: it aborts right after
//! a message's effect commits, before its acknowledgement, and the broker
//! delivers the message again to the next run. Over 1,000 messages, each
//! is applied exactly once, each account's in the order published: what a
//! dead consumer left unacknowledged comes back ahead of newer messages
//! (RabbitMQ requeues it at the head; the example's JetStream consumer
//! keeps one message unacknowledged at a time).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::process::Child;

use crate::harness::{
    ConsumerSettings, Deadline, Ledger, Printed, TestBroker, accounts_out_of_order, consumer,
};

const MESSAGES: usize = 1_000;

/// Each run aborts after applying this many (in turn): from a crash at
/// its first message to one after a few pull batches.
const CRASH_AFTER: [u32; 8] = [1, 17, 41, 5, 64, 23, 2, 97];

pub async fn consumer_killed_after_its_effect_applies_each_message_once<B: TestBroker>() {
    let deadline = Deadline::after(Duration::from_secs(180));
    let broker = B::create("outbox_consumer_kill", Duration::from_secs(120)).await;
    let dir = tempfile::tempdir().unwrap();

    // Published as the relay publishes: with the outbox id.
    let label = dir.path().file_name().unwrap().to_string_lossy();
    let messages: Vec<(String, Vec<u8>)> = (0..MESSAGES)
        .map(|i| {
            let payload = serde_json::json!({
                "charge_id": i, "account": format!("acct_{}", i % 5), "amount": 100 + i,
                "currency": "eur",
            });
            (
                format!("{label}-{i}"),
                serde_json::to_vec(&payload).unwrap(),
            )
        })
        .collect();
    broker.publish(&messages).await;
    let published: HashSet<String> = messages.into_iter().map(|(id, _)| id).collect();
    assert_eq!(broker.held().await, MESSAGES as u64);

    let printed = Arc::new(Printed::default());
    let mut crashes = 0;
    let mut ledger = None;
    // A run aborts after its share; the next is started, until every
    // message is applied and every copy acknowledged.
    loop {
        let settings = ConsumerSettings {
            name: "ledger",
            ack_wait: Duration::from_millis(500),
            crash_after: Some(CRASH_AFTER[crashes % CRASH_AFTER.len()]),
        };
        let mut run: Child = consumer(dir.path(), &broker, &settings, &printed).await;
        if ledger.is_none() {
            ledger = Some(Ledger::open(dir.path()).await);
        }
        let ledger = ledger.as_ref().unwrap();
        let done = async {
            deadline
                .until("every message applied", || async {
                    (ledger.rows().await == MESSAGES as u64).then_some(())
                })
                .await;
            broker.settle(deadline, settings.name, &printed).await;
        };
        tokio::select! {
            status = run.wait() => {
                let status = status.unwrap();
                assert!(!status.success(), "a run ends only by its abort: {status}");
                crashes += 1;
            }
            () = done => break,
        }
    }
    let ledger = ledger.unwrap();

    let (messages, _) = ledger.entries().await;
    let twice: Vec<_> = messages.iter().filter(|(_, count)| **count > 1).collect();
    assert!(twice.is_empty(), "messages applied twice: {twice:?}");
    let applied: HashSet<String> = messages.into_keys().collect();
    assert_eq!(applied, published, "the ledger has every published message");
    assert_eq!(printed.applied(), MESSAGES as u64);
    assert!(crashes >= 10, "the consumer crashed {crashes} times");
    assert!(
        printed.duplicates() >= crashes as u64,
        "each crash's message delivered again and found applied: {} duplicates, {crashes} \
         crashes",
        printed.duplicates()
    );
    let out_of_order = accounts_out_of_order(&ledger).await;
    assert!(
        out_of_order.is_empty(),
        "each account's charges applied in the order published: {out_of_order:?}"
    );
    eprintln!(
        "consumer: {MESSAGES} messages applied once each over {} runs, {crashes} aborted \
         between commit and ack; {} redeliveries found applied; {} of 5 accounts applied \
         out of their order",
        crashes + 1,
        printed.duplicates(),
        out_of_order.len()
    );
    broker.delete().await;
}
