//! The relay killed mid-batch (SIGKILL of the charges service, its store
//! PostgreSQL) and restarted: every committed charge's message reaches the
//! broker, some twice, and the consumer applies each once, each account's
//! in the order written.

use std::sync::Arc;
use std::time::Duration;

use idem_tests::examples::free_port;
use idem_tests::outbox_flow::OutboxRow;

use crate::harness::{
    ConsumerSettings, Deadline, Ledger, LinkProxy, PgSchema, Printed, TestBroker,
    assert_each_applied_once, charge, consumer, drained_and_consumed, service,
};

/// Accounts charged at once, each its charges in turn.
const ACCOUNTS: usize = 8;
/// Charges per account written before the kill.
const PER_ACCOUNT: usize = 25;
const CHARGES: usize = ACCOUNTS * PER_ACCOUNT;

pub async fn relay_killed_mid_batch_then_restarted_delivers_every_message<B: TestBroker>() {
    let deadline = Deadline::after(Duration::from_secs(120));
    // NATS: a short duplicate window, so what the restarted relay
    // publishes again lands in the stream again, for the consumer to find
    // applied.
    let broker = B::create("outbox_relay_kill", Duration::from_millis(100)).await;
    let schema = PgSchema::create("outbox_relay_kill").await;
    let dir = tempfile::tempdir().unwrap();
    // Every publish's acknowledgement comes 25 ms late: the relay falls
    // behind the writes, and a batch takes seconds to deliver.
    let proxy = B::Proxy::start().await;
    proxy.set_latency(Duration::from_millis(25));
    let addr = free_port();
    let mut first = service(dir.path(), addr, &broker, &proxy.url(), Some(&schema.url)).await;
    let store = schema.store().await;

    // The accounts at once, each account's charges in turn: a scope's
    // messages are written (and committed) in order.
    let http = reqwest::Client::new();
    let written: Vec<usize> = futures::future::join_all((0..ACCOUNTS).map(|account| {
        let http = &http;
        async move {
            for i in 0..PER_ACCOUNT {
                let key = format!("relay-kill-{account}-{i}");
                let amount = 100 + i as i64;
                charge(http, addr, &format!("acct_{account}"), &key, amount).await;
            }
            PER_ACCOUNT
        }
    }))
    .await;
    assert_eq!(written.iter().sum::<usize>(), CHARGES);

    // Killed past its first batch, at a moment the broker holds messages
    // the relay has not marked delivered: published, still leased. (The
    // broker's count read first: the marks only grow, so more copies then
    // than marks after means some are published and unmarked now.) The
    // service is stopped before the kill and the moment checked again: a
    // batch marked between the first look and the kill would leave none
    // stranded.
    let pid = i32::try_from(first.id().expect("the service runs")).unwrap();
    // SAFETY: `kill` reads no memory; `pid` is our child's, not yet reaped.
    let signal = |signal| assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal {signal}");
    loop {
        deadline
            .until("a published message still leased by the relay", || async {
                let held = broker.held().await;
                let outbox = store.outbox().await;
                let delivered = delivered(&outbox) as u64;
                let leased = outbox.iter().any(|row| row.leased && !row.delivered);
                (delivered > 0 && leased && held > delivered).then_some(())
            })
            .await;
        signal(libc::SIGSTOP);
        let held = broker.held().await;
        if held > delivered(&store.outbox().await) as u64 {
            break;
        }
        signal(libc::SIGCONT);
    }
    first.kill().await.unwrap();

    let held = broker.held().await;
    let outbox = store.outbox().await;
    let delivered = delivered(&outbox);
    let undelivered = CHARGES - delivered;
    // One relay, no failures: each message published at most once so far.
    let stranded = usize::try_from(held).unwrap() - delivered;
    assert!(
        stranded > 0,
        "the kill came mid-batch: published messages left unmarked"
    );
    assert!(
        held < CHARGES as u64,
        "the kill came before the relay delivered everything"
    );

    // Restarted, the broker fast again; the consumer reads.
    proxy.set_latency(Duration::ZERO);
    let addr = free_port();
    let _second = service(dir.path(), addr, &broker, &proxy.url(), Some(&schema.url)).await;
    let printed = Arc::new(Printed::default());
    let settings = ConsumerSettings {
        name: "ledger",
        ack_wait: Duration::from_secs(5),
        crash_after: None,
    };
    let _consumer = consumer(dir.path(), &broker, &settings, &printed).await;
    let ledger = Ledger::open(dir.path()).await;

    drained_and_consumed(deadline, &store, &broker, settings.name, &printed).await;
    let again = assert_each_applied_once(&store, &broker, &ledger, &printed).await;
    assert_eq!(printed.applied(), CHARGES as u64);
    assert!(
        again >= stranded,
        "the {stranded} stranded messages were published again ({again} copies)"
    );
    eprintln!(
        "relay killed with {undelivered} of {CHARGES} messages undelivered, {stranded} \
         published but unmarked; the restarted relay published {again} again, and the \
         consumer found them applied"
    );
    broker.delete().await;
    schema.drop().await;
}

/// How many of the outbox's messages are marked delivered.
fn delivered(outbox: &[OutboxRow]) -> usize {
    outbox.iter().filter(|row| row.delivered).count()
}
