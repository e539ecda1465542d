//! The outbox's status, as an operator's page shows it: how many messages
//! wait, and each scope whose head message failed, with the sink's last
//! error, its failed deliveries and when the next is due.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idem::outbox::{FailingScope, Message, Sink, sink_fn};
use idem_tests::service::unique as name;
use reqwest::StatusCode;
use serde_json::json;

use crate::handlers::OutboxDb;
use crate::suite::Fixture;

/// What the sink says of a refused message, with its cause.
#[derive(Debug)]
struct Refused {
    attempt: u32,
    cause: std::io::Error,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the mail server refused attempt {}", self.attempt)
    }
}

impl std::error::Error for Refused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.cause)
    }
}

/// A sink that refuses every message of `always`, and the first delivery
/// of each message of `once`.
fn refusing(always: String, once: String) -> impl Sink {
    let refused_once = Arc::new(Mutex::new(HashSet::new()));
    sink_fn(move |message: Message| {
        let refuse = message.scope == always
            || (message.scope == once && refused_once.lock().unwrap().insert(message.id.clone()));
        async move {
            if !refuse {
                return Ok(());
            }
            Err(Box::new(Refused {
                attempt: message.attempts + 1,
                cause: std::io::Error::other("421 try again later"),
            })
            .into())
        }
    })
}

fn scopes(failing: &[FailingScope]) -> Vec<(&str, u64, u32)> {
    failing
        .iter()
        .map(|scope| (scope.scope.as_str(), scope.pending, scope.attempts))
        .collect()
}

pub async fn the_status_shows_each_failing_scope_with_its_error<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    // An outbox from before errors were kept gets the column on migrate.
    let outbox = fixture.idem.outbox_table_name().to_owned();
    DB::run(
        &fixture.pool,
        format!("ALTER TABLE {outbox} DROP COLUMN last_error"),
    )
    .await
    .unwrap();
    for _ in 0..2 {
        fixture.idem.migrate_outbox().await.expect("migrate again");
    }
    let addr = fixture.serve().await;
    // `down` two messages, `fine` one, `flaky` one, written in that order.
    let (down, fine, flaky) = (name("down"), name("fine"), name("flaky"));
    for (account, n) in [(&down, 0), (&down, 1), (&fine, 0), (&flaky, 0)] {
        let sent = fixture
            .send(
                addr,
                account,
                &format!("k{n}"),
                json!({ "to": "x@example.com", "n": n }),
            )
            .await;
        assert_eq!(sent.status(), StatusCode::CREATED);
    }
    let status = fixture.idem.outbox_status(10).await.unwrap();
    assert_eq!((status.pending, status.failing.len()), (4, 0), "{status:?}");

    // Retried at once: the pass after a failure tries the head again.
    let sink = Arc::new(refusing(down.clone(), flaky.clone()));
    let relay = |backoff| {
        let sink = Arc::clone(&sink);
        fixture
            .idem
            .relay(sink_fn(move |message: Message| {
                let sink = Arc::clone(&sink);
                async move { sink.deliver(&message).await }
            }))
            .backoff(backoff)
    };
    let run = relay(Duration::ZERO).run_once().await.unwrap();
    assert_eq!((run.delivered, run.failed, run.deferred), (1, 2, 1));
    let status = fixture.idem.outbox_status(10).await.unwrap();
    assert_eq!(status.pending, 3);
    assert_eq!(
        scopes(&status.failing),
        [(down.as_str(), 2, 1), (flaky.as_str(), 1, 1)],
        "each failing head, the oldest first among equals"
    );
    assert_eq!(
        status.failing[1].last_error.as_deref(),
        Some("the mail server refused attempt 1: 421 try again later"),
        "the sink's error with its cause"
    );

    // The flaky scope goes through and is no longer failing; `down`
    // fails again, with the later error kept.
    let run = relay(Duration::ZERO).run_once().await.unwrap();
    assert_eq!((run.delivered, run.failed), (1, 1));
    let status = fixture.idem.outbox_status(10).await.unwrap();
    assert_eq!(status.pending, 2);
    assert_eq!(scopes(&status.failing), [(down.as_str(), 2, 2)]);
    assert_eq!(
        status.failing[0].last_error.as_deref(),
        Some("the mail server refused attempt 2: 421 try again later")
    );

    // With a backoff, the next delivery is due a minute on (the relay's
    // longest wait by default).
    let relay = relay(Duration::from_secs(60));
    let before = SystemTime::now();
    let run = relay.run_once().await.unwrap();
    assert_eq!(run.failed, 1);
    let status = fixture.idem.outbox_status(10).await.unwrap();
    let [failing] = &status.failing[..] else {
        panic!("{status:?}")
    };
    assert_eq!((failing.pending, failing.attempts), (2, 3));
    let due = failing
        .next_attempt
        .expect("a due time")
        .duration_since(before)
        .expect("due after the pass");
    // The database's clock against this one: a few seconds either way.
    assert!(
        (Duration::from_secs(50)..Duration::from_secs(70)).contains(&due),
        "{due:?}"
    );
    assert!(
        fixture
            .idem
            .outbox_status(0)
            .await
            .unwrap()
            .failing
            .is_empty(),
        "at most `limit` scopes"
    );
    // The pass is the store's last one, for the same page.
    let last = fixture.idem.last_relay_pass().expect("a pass was kept");
    assert_eq!(last.result, Ok(run));
    assert!(
        relay.run_once().await.unwrap().failed == 0,
        "waits its minute"
    );
    fixture.finish().await;
}
