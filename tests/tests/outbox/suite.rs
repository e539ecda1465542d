//! The tests, generic over the engine.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::routing::post;
use idem::outbox::{Message, Relay, Sink, sink_fn};
use idem::{ConsumeError, Consumed, Idem};
use idem_tests::service::unique as name;
use idem_tests::unique::unique;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::Pool;
use tokio::sync::watch;

use crate::handlers::OutboxDb;

// The relay's wake-up and concurrency, and the status, in modules of
// their own.
pub use crate::relay::{
    a_commit_wakes_the_relay_at_once, a_pass_delivers_scopes_at_once_each_in_order,
    an_aborted_relay_finishes_its_pass,
};
pub use crate::status::the_status_shows_each_failing_scope_with_its_error;

/// Env vars of the child process's server.
pub const CHILD_ENGINE: &str = "IDEM_OUTBOX_CHILD_ENGINE";
const CHILD_DATABASE: &str = "IDEM_OUTBOX_CHILD_DATABASE";
const CHILD_KEYS: &str = "IDEM_OUTBOX_CHILD_KEYS";
/// Where the child's relay delivers (a [`Recorder`]'s URL); unset, the
/// child runs no relay.
const CHILD_RECORDER: &str = "IDEM_OUTBOX_CHILD_RECORDER";
/// A request with this header aborts the child once its response is made:
/// after the commit, before the client hears of it.
const DIE_AFTER_COMMIT: &str = "x-die-after-commit";

/// The longest any test waits for what it waits for.
pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

/// One test's world: its database, key table (and the outbox and
/// consumed tables beside it), a served router and its caller.
pub(crate) struct Fixture<DB: OutboxDb> {
    database: String,
    keys: String,
    pub(crate) pool: Pool<DB>,
    pub(crate) idem: Idem<DB>,
    pub(crate) account: String,
    pub(crate) http: reqwest::Client,
}

impl<DB: OutboxDb> Fixture<DB> {
    pub(crate) async fn new() -> Self {
        let database = DB::fresh_database();
        let keys = unique("outbox_keys");
        let pool = DB::open(&database, 8).await;
        let idem = Idem::new(pool.clone())
            .table(&keys)
            .expect("a plain table name")
            .pooler(idem_tests::service::pooler());
        idem.migrate().await.expect("migrate");
        idem.migrate_outbox().await.expect("migrate the outbox");
        Self {
            database,
            keys,
            pool,
            idem,
            account: name("acct"),
            http: reqwest::Client::new(),
        }
    }

    /// Serves the router in this process.
    pub(crate) async fn serve(&self) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = DB::outbox_router(self.idem.clone());
        tokio::spawn(async move { axum::serve(listener, router).await });
        addr
    }

    fn post(
        &self,
        addr: SocketAddr,
        account: &str,
        key: &str,
        body: Value,
    ) -> reqwest::RequestBuilder {
        self.http
            .post(format!("http://{addr}/emails"))
            .header("x-account", account)
            .header("idempotency-key", key)
            .json(&body)
    }

    /// Sends [`post`](Self::post) and waits for the answer.
    pub(crate) async fn send(
        &self,
        addr: SocketAddr,
        account: &str,
        key: &str,
        body: Value,
    ) -> reqwest::Response {
        tokio::time::timeout(DEADLINE, self.post(addr, account, key, body).send())
            .await
            .unwrap_or_else(|_| panic!("no answer to {account}'s {key} within {DEADLINE:?}"))
            .unwrap()
    }

    /// Runs `relay` until nothing is pending.
    pub(crate) async fn drain<S: Sink>(&self, relay: &Relay<DB, S>) {
        tokio::time::timeout(DEADLINE, async {
            while self.idem.pending_messages().await.unwrap() > 0 {
                relay.run_once().await.expect("relay pass");
            }
        })
        .await
        .expect("the outbox drained");
    }

    /// Drops the test's tables and closes its pool, within [`DEADLINE`]: a
    /// session left in a transaction would hold a table's lock, and a
    /// connection out of step with its server would never come back.
    pub(crate) async fn finish(self) {
        let database = self.database.clone();
        tokio::time::timeout(DEADLINE, self.drop_tables())
            .await
            .expect("the test's tables dropped and its pool closed");
        DB::remove_database(&database);
    }

    async fn drop_tables(self) {
        for table in [
            self.keys.clone(),
            self.idem.outbox_table_name().to_owned(),
            self.idem.consumed_table_name().to_owned(),
            format!("{}_ledger", self.keys),
        ] {
            let _ = DB::run(&self.pool, format!("DROP TABLE IF EXISTS {table}")).await;
        }
        self.pool.close().await;
    }
}

/// A recording sink: every message delivered, and whether two deliveries
/// of one message ever overlapped.
#[derive(Clone, Default)]
struct Recorder {
    delivered: Arc<Mutex<Vec<Message>>>,
    in_flight: Arc<Mutex<HashSet<String>>>,
    overlaps: Arc<Mutex<u32>>,
    /// Deliveries of these ids that fail first (count left).
    failing: Arc<Mutex<HashMap<String, u32>>>,
}

impl Recorder {
    fn sink(&self) -> impl Sink {
        let recorder = self.clone();
        sink_fn(move |message: Message| {
            let recorder = recorder.clone();
            async move {
                if !recorder
                    .in_flight
                    .lock()
                    .unwrap()
                    .insert(message.id.clone())
                {
                    *recorder.overlaps.lock().unwrap() += 1;
                }
                // Give another relay the moment to deliver it too, if it could.
                tokio::task::yield_now().await;
                let fail = match recorder.failing.lock().unwrap().get_mut(&message.id) {
                    Some(left) if *left > 0 => {
                        *left -= 1;
                        true
                    }
                    _ => false,
                };
                recorder.in_flight.lock().unwrap().remove(&message.id);
                if fail {
                    return Err("the sink refused".into());
                }
                recorder.delivered.lock().unwrap().push(message);
                Ok(())
            }
        })
    }

    fn ids(&self) -> Vec<String> {
        self.delivered
            .lock()
            .unwrap()
            .iter()
            .map(|m| m.id.clone())
            .collect()
    }
}

pub async fn emails_go_once_per_committed_request<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let recorder = Recorder::default();
    let relay = fixture.idem.relay(recorder.sink());

    let first = fixture
        .send(
            addr,
            &fixture.account,
            "k1",
            json!({ "to": "a@example.com", "n": 1 }),
        )
        .await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Value = first.json().await.unwrap();
    let replay = fixture
        .send(
            addr,
            &fixture.account,
            "k1",
            json!({ "to": "a@example.com", "n": 1 }),
        )
        .await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let refused = fixture
        .send(
            addr,
            &fixture.account,
            "k2",
            json!({ "to": "b@example.com", "fail": true }),
        )
        .await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    assert_eq!(
        fixture.idem.pending_messages().await.unwrap(),
        1,
        "one committed message"
    );

    fixture.drain(&relay).await;
    let delivered = recorder.delivered.lock().unwrap().clone();
    assert_eq!(
        delivered.len(),
        1,
        "once on success, never for the rollback or the replay"
    );
    assert_eq!(delivered[0].id, first["message"].as_str().unwrap());
    assert_eq!(delivered[0].topic, "email.receipt");
    assert_eq!(delivered[0].scope, fixture.account);
    let payload: Value = delivered[0].json().unwrap();
    assert_eq!(payload["to"], "a@example.com");
    assert_eq!(
        relay.run_once().await.unwrap().delivered,
        0,
        "delivered once"
    );
    fixture.finish().await;
}

pub async fn a_commit_before_a_kill_is_delivered_by_the_restarted_server<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let (recorder_url, mut deliveries) = serve_recorder().await;

    // The first server commits, then dies before it answers; it runs no
    // relay, so the message is left in the outbox.
    let mut first = Child::spawn::<DB>(&fixture, None).await;
    let body = json!({ "to": "a@example.com", "n": 1 });
    let lost = fixture
        .post(first.addr, &fixture.account, "k1", body.clone())
        .header(DIE_AFTER_COMMIT, "1")
        .send()
        .await;
    assert!(lost.is_err(), "the client hears nothing: {lost:?}");
    let status = tokio::time::timeout(DEADLINE, first.process.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(!status.success(), "the server died: {status}");
    assert_eq!(
        fixture.idem.pending_messages().await.unwrap(),
        1,
        "committed, not delivered"
    );

    // The restarted server's relay delivers it; the client's retry replays.
    let second = Child::spawn::<DB>(&fixture, Some(&recorder_url)).await;
    let retry = fixture
        .send(second.addr, &fixture.account, "k1", body)
        .await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let id = retry.json::<Value>().await.unwrap()["message"]
        .as_str()
        .unwrap()
        .to_owned();
    tokio::time::timeout(DEADLINE, deliveries.wait_for(|ids| !ids.is_empty()))
        .await
        .expect("the restarted server's relay delivered")
        .unwrap();
    tokio::time::timeout(DEADLINE, async {
        while fixture.idem.pending_messages().await.unwrap() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("marked delivered");
    drop(second);
    // Nothing is left for any relay.
    let recorder = Recorder::default();
    assert_eq!(
        fixture
            .idem
            .relay(recorder.sink())
            .run_once()
            .await
            .unwrap()
            .delivered,
        0
    );
    assert_eq!(*deliveries.borrow(), [id], "exactly once");
    fixture.finish().await;
}

pub async fn relays_keep_each_scope_in_order_and_never_overlap<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let accounts: Vec<String> = (0..4).map(|_| name("acct")).collect();
    // Each account's emails are sent one after another; the accounts at once.
    let sends = accounts.iter().map(|account| {
        let fixture = &fixture;
        async move {
            for n in 0..15 {
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
        }
    });
    futures::future::join_all(sends).await;
    assert_eq!(fixture.idem.pending_messages().await.unwrap(), 60);

    let recorder = Recorder::default();
    let relays: Vec<_> = (0..3)
        .map(|_| {
            fixture
                .idem
                .relay(recorder.sink())
                .batch(7)
                .every(Duration::from_millis(5))
                .spawn()
        })
        .collect();
    tokio::time::timeout(DEADLINE, async {
        while fixture.idem.pending_messages().await.unwrap() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the relays drained the outbox");
    relays.iter().for_each(|relay| relay.abort());

    assert_eq!(
        *recorder.overlaps.lock().unwrap(),
        0,
        "no message delivered twice at once"
    );
    let ids = recorder.ids();
    assert_eq!(ids.len(), 60, "each once: {ids:?}");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 60);
    let delivered = recorder.delivered.lock().unwrap().clone();
    for account in &accounts {
        let order: Vec<i64> = delivered
            .iter()
            .filter(|message| &message.scope == account)
            .map(|message| message.json::<Value>().unwrap()["n"].as_i64().unwrap())
            .collect();
        assert_eq!(
            order,
            (0..15).collect::<Vec<_>>(),
            "{account}'s messages in order"
        );
    }
    fixture.finish().await;
}

pub async fn a_failing_delivery_holds_its_scope_and_is_retried<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let mut ids = Vec::new();
    for n in 0..3 {
        let sent = fixture
            .send(
                addr,
                &fixture.account,
                &format!("k{n}"),
                json!({ "to": "x@example.com", "n": n }),
            )
            .await;
        assert_eq!(sent.status(), StatusCode::CREATED);
        ids.push(
            sent.json::<Value>().await.unwrap()["message"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    let recorder = Recorder::default();
    recorder.failing.lock().unwrap().insert(ids[0].clone(), 2);
    let relay = fixture
        .idem
        .relay(recorder.sink())
        .backoff(Duration::from_millis(1))
        .max_backoff(Duration::from_millis(2));
    let run = relay.run_once().await.unwrap();
    assert_eq!(
        (run.delivered, run.failed, run.deferred),
        (0, 1, 2),
        "the scope waits"
    );
    assert!(recorder.ids().is_empty());
    fixture.drain(&relay).await;
    assert_eq!(
        recorder.ids(),
        ids,
        "delivered in order once the first went through"
    );
    fixture.finish().await;
}

pub async fn consumers_apply_each_message_once<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let ledger = format!("{}_ledger", fixture.keys);
    DB::run(
        &fixture.pool,
        format!("CREATE TABLE {ledger} (id VARCHAR(100) NOT NULL)"),
    )
    .await
    .unwrap();
    let apply = |id: &'static str, fail: bool| {
        let (idem, ledger) = (fixture.idem.clone(), ledger.clone());
        async move {
            idem.consume("ledger", id, async |tx| {
                DB::insert_ledger(tx, &ledger, id).await?;
                if fail {
                    return Err(sqlx::Error::Protocol("the effect failed".into()));
                }
                Ok::<_, sqlx::Error>(id)
            })
            .await
        }
    };
    assert!(matches!(
        apply("m1", false).await,
        Ok(Consumed::Applied("m1"))
    ));
    assert!(
        matches!(apply("m1", false).await, Ok(Consumed::Duplicate)),
        "redelivered"
    );
    assert!(matches!(
        apply("m2", true).await,
        Err(ConsumeError::Apply(_))
    ));
    assert!(
        matches!(apply("m2", false).await, Ok(Consumed::Applied("m2"))),
        "a failure records nothing"
    );
    // Eight deliveries of one message at once: one effect.
    let at_once = futures::future::join_all((0..8).map(|_| apply("m3", false))).await;
    let applied = at_once
        .iter()
        .filter(|done| matches!(done, Ok(Consumed::Applied(_))))
        .count();
    let duplicates = at_once
        .iter()
        .filter(|done| matches!(done, Ok(Consumed::Duplicate)))
        .count();
    assert_eq!((applied, duplicates), (1, 7), "{at_once:?}");
    let rows = DB::count(&fixture.pool, &ledger).await;
    assert_eq!(rows, 3, "m1, m2 and m3 once each");
    // Past its retention a record counts as absent: a delivery that late
    // is processed as new, the record taken over.
    let brief = fixture
        .idem
        .clone()
        .consumed_retention(Duration::from_millis(1));
    let late = |idem: Idem<DB>| {
        let ledger = ledger.clone();
        async move {
            idem.consume("ledger", "m4", async |tx| {
                DB::insert_ledger(tx, &ledger, "m4").await?;
                Ok::<_, sqlx::Error>("m4")
            })
            .await
        }
    };
    assert!(matches!(late(brief).await, Ok(Consumed::Applied("m4"))));
    // Waits out the 1 ms retention (expiry is by the clock, not an event).
    tokio::time::sleep(Duration::from_millis(50)).await;
    let again = late(fixture.idem.clone()).await;
    assert!(matches!(again, Ok(Consumed::Applied("m4"))), "{again:?}");
    // Taken over with the usual retention: remembered again.
    let once_more = late(fixture.idem.clone()).await;
    assert!(
        matches!(once_more, Ok(Consumed::Duplicate)),
        "{once_more:?}"
    );
    assert_eq!(DB::count(&fixture.pool, &ledger).await, 5);
    assert!(matches!(
        fixture
            .idem
            .consume("ledger", "", async |_| Ok::<_, sqlx::Error>(()))
            .await,
        Err(ConsumeError::Store(idem::Error::InvalidMessage { .. }))
    ));
    fixture.finish().await;
}

/// An HTTP endpoint recording deliveries (a webhook's receiver), for a
/// relay in another process: its URL, and the ids delivered so far.
async fn serve_recorder() -> (String, watch::Receiver<Vec<String>>) {
    let (sender, receiver) = watch::channel(Vec::new());
    let sender = Arc::new(sender);
    let router = axum::Router::new().route(
        "/deliveries",
        post(move |Json(message): Json<Value>| {
            let sender = Arc::clone(&sender);
            async move {
                let id = message["id"].as_str().unwrap().to_owned();
                sender.send_modify(|ids| ids.push(id));
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/deliveries", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    (url, receiver)
}

/// A server in a child process.
struct Child {
    addr: SocketAddr,
    process: tokio::process::Child,
}

impl Child {
    async fn spawn<DB: OutboxDb>(fixture: &Fixture<DB>, recorder: Option<&str>) -> Self {
        let env = [
            (CHILD_ENGINE, Some(DB::ENGINE)),
            (CHILD_DATABASE, Some(fixture.database.as_str())),
            (CHILD_KEYS, Some(fixture.keys.as_str())),
            (CHILD_RECORDER, recorder),
        ];
        let (process, addr) = idem_tests::examples::test_server("outbox_child_server", &env).await;
        Self { addr, process }
    }
}

/// The child's server: the router, aborting after a request marked
/// [`DIE_AFTER_COMMIT`] has its response, and a relay posting to the
/// recorder when one is named.
pub async fn serve_as_child<DB: OutboxDb>() {
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let pool = DB::open(&var(CHILD_DATABASE), 4).await;
    let idem = Idem::new(pool)
        .table(&var(CHILD_KEYS))
        .unwrap()
        .pooler(idem_tests::service::pooler());
    if let Ok(url) = std::env::var(CHILD_RECORDER) {
        let http = reqwest::Client::new();
        idem.relay(sink_fn(move |message: Message| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                http.post(url)
                    .json(&json!({ "id": message.id, "topic": message.topic }))
                    .send()
                    .await?
                    .error_for_status()?;
                Ok(())
            }
        }))
        .every(Duration::from_millis(20))
        .spawn();
    }
    let router = DB::outbox_router(idem).layer(axum::middleware::from_fn(
        async |request: axum::extract::Request, next: axum::middleware::Next| {
            let die = request.headers().contains_key(DIE_AFTER_COMMIT);
            let response = next.run(request).await;
            if die {
                std::process::abort();
            }
            response
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("LISTENING {}", listener.local_addr().unwrap());
    let _ = std::io::stdout().flush();
    axum::serve(listener, router).await.unwrap();
}
