//! `IdemClient::not_found_is_done`: a `DELETE` whose earlier attempt may
//! have deleted the resource and lost its answer, against a real server on
//! loopback that deletes for real (and is not `#[idempotent]`, so a retry
//! after a deletion gets 404).

mod support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use idem_client::{Clock, TransportKind};
use idem_client::{Error, IdemClient, Intent, ManualClock, Outcome, RetryPolicy, Sent};
use support::proxy::{Fault, Proxy};
use support::scripted::{Reply, Scripted};
use support::{GatedClock, bounded};

/// A resource server: `DELETE /v1/things/{id}` answers 204 when it deleted
/// the thing and 404 when there was none.
struct Things {
    addr: SocketAddr,
    url: String,
    state: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Inner {
    things: Mutex<HashSet<u32>>,
    /// How many deletions still answer 503 after deleting.
    fail_after_delete: AtomicU32,
    /// Every request's `Idempotency-Key`.
    keys: Mutex<Vec<String>>,
    deletions: AtomicU32,
}

impl Things {
    async fn start(things: &[u32], fail_after_delete: u32) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, things, fail_after_delete)
    }

    fn serve(listener: tokio::net::TcpListener, things: &[u32], fail_after_delete: u32) -> Self {
        let state = Arc::new(Inner {
            things: Mutex::new(things.iter().copied().collect()),
            fail_after_delete: AtomicU32::new(fail_after_delete),
            ..Inner::default()
        });
        let app = axum::Router::new()
            .route("/v1/things/{id}", axum::routing::delete(remove))
            .with_state(state.clone());
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            addr,
            url: format!("http://{addr}"),
            state,
            task,
        }
    }

    fn left(&self) -> HashSet<u32> {
        self.state.things.lock().unwrap().clone()
    }

    fn keys(&self) -> Vec<String> {
        self.state.keys.lock().unwrap().clone()
    }

    fn deletions(&self) -> u32 {
        self.state.deletions.load(Ordering::SeqCst)
    }
}

impl Drop for Things {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn remove(
    State(state): State<Arc<Inner>>,
    Path(id): Path<u32>,
    headers: HeaderMap,
) -> StatusCode {
    if let Some(key) = headers.get("idempotency-key") {
        state
            .keys
            .lock()
            .unwrap()
            .push(key.to_str().unwrap().to_owned());
    }
    if !state.things.lock().unwrap().remove(&id) {
        return StatusCode::NOT_FOUND;
    }
    state.deletions.fetch_add(1, Ordering::SeqCst);
    let fail = state
        .fail_after_delete
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok();
    if fail {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::NO_CONTENT
    }
}

fn client(clock: impl Clock) -> IdemClient {
    IdemClient::new(reqwest::Client::new())
        .with_clock(clock)
        .with_seed(5)
        .with_policy(RetryPolicy::default().attempt_timeout(Duration::from_secs(10)))
}

async fn delete(client: &IdemClient, intent: &Intent, url: &str, id: u32) -> Result<Sent, Error> {
    let request = client.delete(format!("{url}/v1/things/{id}"));
    client.send(intent, request).await
}

fn assert_rejected_404(result: Result<Sent, Error>) {
    match result {
        Err(Error::Rejected { status, .. }) => assert_eq!(status, 404),
        other => panic!("expected a 404 error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_deletion_whose_answer_was_lost_is_done_and_already_gone() {
    bounded(async {
        let server = Things::start(&[7, 8], 0).await;
        let proxy = Proxy::start(server.addr, vec![Fault::DropResponse], None).await;
        let intent = Intent::new();
        let client = client(ManualClock::new()).not_found_is_done(true);

        let sent = delete(&client, &intent, &proxy.url, 7).await.unwrap();

        assert!(sent.already_gone);
        assert_eq!(sent.status, 404);
        assert!(!sent.replayed);
        let answers = proxy.answers();
        assert_eq!(answers[0].status, 204, "the first attempt deleted it");
        assert_eq!(answers[1].status, 404);
        assert!(matches!(
            sent.attempts[0].outcome,
            Outcome::Transport { .. }
        ));
        assert_eq!(
            sent.attempts[1].outcome,
            Outcome::Status(StatusCode::NOT_FOUND)
        );
        assert_eq!(server.deletions(), 1);
        assert_eq!(server.left(), HashSet::from([8]));
        assert_eq!(server.keys(), vec![intent.to_string(); 2]);
    })
    .await;
}

#[tokio::test]
async fn a_deletion_answered_503_is_done_when_the_retry_gets_404() {
    bounded(async {
        let server = Things::start(&[7], 1).await;
        let client = client(ManualClock::new()).not_found_is_done(true);

        let sent = delete(&client, &Intent::new(), &server.url, 7)
            .await
            .unwrap();

        assert!(sent.already_gone);
        assert_eq!(sent.status, 404);
        let outcomes: Vec<_> = sent.attempts.iter().map(|a| a.outcome.clone()).collect();
        assert_eq!(
            outcomes,
            [
                Outcome::Status(StatusCode::SERVICE_UNAVAILABLE),
                Outcome::Status(StatusCode::NOT_FOUND)
            ]
        );
        assert_eq!(server.deletions(), 1);
        assert!(server.left().is_empty());
    })
    .await;
}

#[tokio::test]
async fn a_real_deletion_is_not_already_gone() {
    bounded(async {
        let server = Things::start(&[7], 0).await;
        let client = client(ManualClock::new()).not_found_is_done(true);
        let sent = delete(&client, &Intent::new(), &server.url, 7)
            .await
            .unwrap();
        assert_eq!(sent.status, 204);
        assert!(!sent.already_gone);
        assert_eq!(sent.attempts.len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_404_on_the_first_attempt_is_still_an_error() {
    bounded(async {
        let server = Things::start(&[8], 0).await;
        let clock = ManualClock::new();
        let client = client(clock.clone()).not_found_is_done(true);
        assert_rejected_404(delete(&client, &Intent::new(), &server.url, 7).await);
        assert_eq!(server.keys().len(), 1, "not retried");
        assert!(clock.sleeps().is_empty());
    })
    .await;
}

#[tokio::test]
async fn without_the_option_the_retrys_404_is_an_error_as_before() {
    bounded(async {
        let server = Things::start(&[7], 1).await;
        let off = client(ManualClock::new());
        assert_rejected_404(delete(&off, &Intent::new(), &server.url, 7).await);
        assert_eq!(server.keys().len(), 2);
        assert_eq!(server.deletions(), 1);

        let server = Things::start(&[7], 0).await;
        let proxy = Proxy::start(server.addr, vec![Fault::DropResponse], None).await;
        let off = client(ManualClock::new()).not_found_is_done(false);
        assert_rejected_404(delete(&off, &Intent::new(), &proxy.url, 7).await);
        assert_eq!(server.deletions(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_replayed_404_is_the_first_attempts_answer_and_stays_an_error() {
    bounded(async {
        // An `#[idempotent]` DELETE whose first attempt found nothing stored
        // its 404; a retry gets that 404 replayed.
        let server = Scripted::start(vec![Reply::status(503), Reply::status(404).replayed()]).await;
        let client = client(ManualClock::new()).not_found_is_done(true);
        assert_rejected_404(delete(&client, &Intent::new(), &server.url, 7).await);
        assert_eq!(server.received().len(), 2);
    })
    .await;
}

#[tokio::test]
async fn only_a_delete_is_counted_as_done() {
    bounded(async {
        let server = Scripted::start(vec![Reply::status(503), Reply::status(404)]).await;
        let client = client(ManualClock::new()).not_found_is_done(true);
        let request = client.post(format!("{}/v1/things/7/archive", server.url));
        assert_rejected_404(client.send(&Intent::new(), request).await);
        assert_eq!(server.received().len(), 2);
    })
    .await;
}

#[tokio::test]
async fn a_connection_that_could_not_be_made_sent_nothing_and_does_not_count() {
    bounded(async {
        // Nothing listens on the port for the first attempt; the server
        // starts there, with no thing 7, before the retry.
        let addr = {
            let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            reserved.local_addr().unwrap()
        };
        let (open, gate) = tokio::sync::watch::channel(false);
        let clock = GatedClock::new(gate);
        let client = client(clock.clone()).not_found_is_done(true);
        let intent = Intent::new();
        let url = format!("http://{addr}");
        let sending = tokio::spawn(async move { delete(&client, &intent, &url, 7).await });

        // The first attempt failed to connect and its backoff began.
        tokio::time::timeout(Duration::from_secs(10), async {
            while clock.manual.sleeps().is_empty() {
                assert!(!sending.is_finished(), "the client ended without a retry");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the client backed off within 10 s");
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let server = Things::serve(listener, &[8], 0);
        open.send_replace(true);

        let result = sending.await.unwrap();
        let Err(Error::Rejected { status, .. }) = &result else {
            panic!("expected a 404 error, got {result:?}")
        };
        assert_eq!(*status, 404);
        assert_eq!(server.keys().len(), 1, "the first attempt never arrived");
    })
    .await;
}

#[tokio::test]
async fn the_first_attempt_that_connected_makes_a_later_404_done() {
    bounded(async {
        // Connected, and the connection reset before the request was read:
        // the sender cannot tell that from a request the server read.
        let server = Things::start(&[8], 0).await;
        let proxy = Proxy::start(server.addr, vec![Fault::ResetBeforeRequest], None).await;
        let client = client(ManualClock::new()).not_found_is_done(true);
        let sent = delete(&client, &Intent::new(), &proxy.url, 7)
            .await
            .unwrap();
        assert!(sent.already_gone);
        assert!(matches!(
            sent.attempts[0].outcome,
            Outcome::Transport { kind, .. } if kind != TransportKind::Connect
        ));
    })
    .await;
}
