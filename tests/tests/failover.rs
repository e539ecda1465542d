//! Across a PostgreSQL failover, `idem` loses an effect and its key
//! together or neither: never a charge twice.
//!
//! A cluster of the test's own (`idem_tests::patroni`: etcd, two nodes
//! under Patroni, HAProxy routing to the leader), an axum service in this
//! process whose pool goes through HAProxy, and clients with `idem-client`
//! each completing a sequence of intents (charges), every intent minted
//! once and retried until it has its answer. While intents are in flight
//! the leader's postmaster is SIGKILLed. Then, through the new leader:
//! one effect per key, an effect exactly where its key is, every 201 the
//! clients saw replayed verbatim (synchronous replication), and, with
//! asynchronous replication, whatever was lost lost as effect and key
//! together. The service never answers 500 and every 503 says
//! `Retry-After`.
//!
//! One synchronous and one asynchronous failover by default;
//! `IDEM_FAILOVER_ROUNDS=n` runs `n` of each, `IDEM_FAILOVER_CLIENTS=n`
//! sets the clients (default 8). The figures print with `--nocapture`.

#![cfg(feature = "postgres")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use futures::StreamExt as _;
use idem::{Idem, Tx, idempotent};
use idem_client::{IdemClient, Intent, RetryPolicy};
use idem_tests::account::Account;
use idem_tests::patroni::{Killed, Patroni, Replication};
use serde_json::{Value, json};
use sqlx::Connection as _;
use sqlx::Postgres;
use sqlx::postgres::{PgPool, PgPoolOptions};

const EFFECTS_DDL: &str = "CREATE TABLE IF NOT EXISTS failover_effects (
    id bigserial PRIMARY KEY,
    account text NOT NULL,
    key text NOT NULL,
    amount bigint NOT NULL,
    execution uuid NOT NULL DEFAULT gen_random_uuid());
    CREATE TABLE IF NOT EXISTS failover_probe (at timestamptz NOT NULL DEFAULT now())";

/// How long the clients may take to finish once the leader is dead: well
/// past a failover (seconds), within their retry budget.
const ROUND_LIMIT: Duration = Duration::from_secs(90);
/// How long a rejoining node may take (a `pg_rewind` or a fresh copy).
const REJOIN_LIMIT: Duration = Duration::from_secs(90);
/// The clients' retry budget: longer than any failover here.
const CLIENT_BUDGET: Duration = Duration::from_secs(60);

fn env_count(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value}: not a count")),
        Err(_) => default,
    }
}

/// The handler's own database errors (the connection lost between the
/// claim and the insert, say): what they said.
static HANDLER_TRANSIENT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A database error of the handler's, answered 500 as a plain handler
/// answers every one. A postmaster killed between the claim and the
/// insert makes the insert fail with "terminating connection due to
/// unexpected postmaster exit" (57P01); `idem` finds the connection gone
/// at the rollback and answers 503 with `Retry-After` in place of this
/// 500 (nothing committed, a retry is safe), so the clients never see it.
/// The figures count these.
struct Failure(sqlx::Error);

impl From<sqlx::Error> for Failure {
    fn from(error: sqlx::Error) -> Self {
        Failure(error)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        HANDLER_TRANSIENT.lock().unwrap().push(self.0.to_string());
        (StatusCode::INTERNAL_SERVER_ERROR, self.0.to_string()).into_response()
    }
}

/// One charge: one effect row, whose id and random execution id the
/// answer carries, so a run that was lost and ran again answers
/// differently.
#[idempotent(scope = "account")]
async fn charge(
    account: Account,
    mut tx: Tx<Postgres>,
    Json(req): Json<Value>,
) -> Result<(StatusCode, Json<Value>), Failure> {
    let amount = req["amount"].as_i64().unwrap_or(0);
    let key = tx
        .key()
        .map(|key| key.as_str().to_owned())
        .unwrap_or_default();
    let (id, execution): (i64, String) = sqlx::query_as(
        "INSERT INTO failover_effects (account, key, amount) VALUES ($1, $2, $3)
         RETURNING id, execution::text",
    )
    .bind(&account.0)
    .bind(&key)
    .bind(amount)
    .fetch_one(&mut *tx)
    .await?;
    let body = json!({ "id": id, "execution": execution, "key": key, "amount": amount });
    Ok((StatusCode::CREATED, Json(body)))
}

/// A response the service gave, as the counting layer saw it.
#[derive(Debug, Clone, Copy)]
struct Served {
    started: Instant,
    done: Instant,
    status: u16,
    retry_after: bool,
}

#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Served>>>);

impl Seen {
    fn since(&self, from: Instant) -> Vec<Served> {
        let seen = self.0.lock().unwrap();
        seen.iter()
            .copied()
            .filter(|served| served.started >= from)
            .collect()
    }
}

/// The service under test on 127.0.0.1, its pool through HAProxy.
struct Service {
    addr: SocketAddr,
    seen: Seen,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(database: &str, clients: usize) -> Service {
    let pool: PgPool = PgPoolOptions::new()
        .max_connections(clients as u32 + 4)
        // Short: while no node takes writes a request waits this long for
        // a connection and is answered 503.
        .acquire_timeout(Duration::from_secs(2))
        .connect(database)
        .await
        .unwrap_or_else(|error| panic!("connect to {database}: {error}"));
    sqlx::raw_sql(EFFECTS_DDL).execute(&pool).await.unwrap();
    let idem = Idem::new(pool);
    idem.migrate().await.unwrap();
    let seen = Seen::default();
    let counted = seen.clone();
    let app = axum::Router::new()
        .route("/v1/charges", post(charge))
        .with_state(idem)
        .layer(axum::middleware::from_fn(
            move |request: Request, next: Next| {
                let counted = counted.clone();
                async move {
                    let started = Instant::now();
                    let response = next.run(request).await;
                    counted.0.lock().unwrap().push(Served {
                        started,
                        done: Instant::now(),
                        status: response.status().as_u16(),
                        retry_after: response.headers().contains_key(header::RETRY_AFTER),
                    });
                    response
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Service { addr, seen, task }
}

/// An intent a client completed.
#[derive(Debug, Clone)]
struct Completed {
    key: String,
    account: String,
    request: Bytes,
    status: u16,
    answer: Bytes,
    replayed: bool,
    attempts: usize,
}

fn retrying_client() -> IdemClient {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    IdemClient::new(http).with_policy(
        RetryPolicy::new()
            .initial_backoff(Duration::from_millis(100))
            .max_backoff(Duration::from_secs(2))
            .budget(CLIENT_BUDGET)
            .max_attempts(1000)
            .attempt_timeout(Duration::from_secs(10)),
    )
}

/// What the clients share with the test.
#[derive(Default)]
struct Progress {
    stop: AtomicBool,
    in_flight: AtomicUsize,
    completed: AtomicUsize,
    /// Completed intents that started after the kill.
    after_kill: AtomicUsize,
    /// A write through HAProxy begun after the kill succeeded.
    writable: AtomicBool,
    kill: OnceLock<Instant>,
}

/// One client: intents one after another until told to stop, each minted
/// once and sent until it has its answer.
async fn client(
    url: String,
    account: String,
    progress: Arc<Progress>,
) -> Result<Vec<Completed>, String> {
    let client = retrying_client();
    let mut completed = Vec::new();
    let mut amount = 0;
    while !progress.stop.load(Ordering::Relaxed) {
        amount += 1;
        let intent = Intent::new();
        let request = Bytes::from(json!({ "amount": amount }).to_string());
        progress.in_flight.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        let builder = client
            .post(&url)
            .header("x-account", &account)
            .header(header::CONTENT_TYPE, "application/json")
            .body(request.clone());
        let sent = client.send(&intent, builder).await;
        progress.in_flight.fetch_sub(1, Ordering::SeqCst);
        let sent = sent.map_err(|error| format!("intent {intent} of {account}: {error:#?}"))?;
        progress.completed.fetch_add(1, Ordering::SeqCst);
        if progress.kill.get().is_some_and(|kill| started > *kill) {
            progress.after_kill.fetch_add(1, Ordering::SeqCst);
        }
        completed.push(Completed {
            key: intent.as_str().to_owned(),
            account: account.clone(),
            request,
            status: sent.status.as_u16(),
            answer: sent.body,
            replayed: sent.replayed,
            attempts: sent.attempts.len(),
        });
    }
    Ok(completed)
}

/// Writes through HAProxy every 100 ms, each on a fresh connection and
/// on its own (a write that hangs holds up no other): when did the
/// database take writes again after the kill.
async fn probe(router: String, progress: Arc<Progress>) -> Vec<(Instant, Instant, bool)> {
    let mut probes = Vec::new();
    while !progress.stop.load(Ordering::SeqCst) {
        let router = router.clone();
        let progress = Arc::clone(&progress);
        probes.push(tokio::spawn(async move {
            let started = Instant::now();
            let write = async {
                let mut conn = sqlx::PgConnection::connect(&router).await?;
                sqlx::query("INSERT INTO failover_probe DEFAULT VALUES")
                    .execute(&mut conn)
                    .await?;
                conn.close().await
            };
            let ok = matches!(
                tokio::time::timeout(Duration::from_secs(2), write).await,
                Ok(Ok(()))
            );
            if ok && progress.kill.get().is_some_and(|kill| started > *kill) {
                progress.writable.store(true, Ordering::SeqCst);
            }
            (started, Instant::now(), ok)
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut done = Vec::new();
    for probe in probes {
        done.push(probe.await.unwrap());
    }
    done
}

/// Waits up to `limit` for `done`, polling; panics with `what`.
async fn wait_for(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A round's figures.
#[derive(Debug, Default)]
struct Figures {
    intents: usize,
    in_flight_at_kill: usize,
    served: usize,
    served_503: usize,
    served_503_without_retry_after: usize,
    served_409: usize,
    served_500: usize,
    other_statuses: HashMap<u16, usize>,
    handler_transient: Vec<String>,
    election_ms: u128,
    writable_ms: Option<u128>,
    service_recovered_ms: Option<u128>,
    /// Intents whose final answer came from a retry that was a replay:
    /// the work committed, its answer had been lost.
    answered_by_replay: usize,
    max_attempts: usize,
    final_not_201: usize,
    stored_not_201: usize,
    duplicates: usize,
    lost_effects: usize,
    lost_keys: usize,
    effect_without_key: usize,
    key_without_effect: usize,
    acknowledged_then_lost: usize,
    replays_identical: usize,
}

impl Figures {
    fn print(&self, mode: &str, round: usize) {
        let ms = |value: Option<u128>| value.map_or("never".to_owned(), |ms| format!("{ms} ms"));
        println!(
            "failover {mode} round {round}: intents {}, in flight at the kill {}, \
             responses {} (503: {}, of them without Retry-After {}; 409: {}; 500: {}; other non-2xx: {:?}), \
             handler's own statement failed (answered 503 by idem) {} ({}), \
             Patroni reports a new leader after {} ms, writes through HAProxy again after {}, \
             service answering 201 again after {}, answered by a replay after a lost answer {}, \
             most attempts for one intent {}, final answers not 201 {}, stored answers not 201 {}, \
             duplicates {}, acknowledged-then-lost {}, lost effects {}, lost keys {}, \
             effect without key {}, key without effect {}, replays identical {}",
            self.intents,
            self.in_flight_at_kill,
            self.served,
            self.served_503,
            self.served_503_without_retry_after,
            self.served_409,
            self.served_500,
            self.other_statuses,
            self.handler_transient.len(),
            distinct(&self.handler_transient),
            self.election_ms,
            ms(self.writable_ms),
            ms(self.service_recovered_ms),
            self.answered_by_replay,
            self.max_attempts,
            self.final_not_201,
            self.stored_not_201,
            self.duplicates,
            self.acknowledged_then_lost,
            self.lost_effects,
            self.lost_keys,
            self.effect_without_key,
            self.key_without_effect,
            self.replays_identical,
        );
    }
}

/// The distinct messages of `messages`, with their counts.
fn distinct(messages: &[String]) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for message in messages {
        match counts.iter_mut().find(|(seen, _)| *seen == message) {
            Some((_, count)) => *count += 1,
            None => counts.push((message, 1)),
        }
    }
    let counts: Vec<String> = counts
        .iter()
        .map(|(message, count)| format!("{count}x {message}"))
        .collect();
    counts.join("; ")
}

/// Per key of `keys`, on the node at `url`: effect rows, and the stored
/// status of its key row (`None`: no key row).
async fn state_of(
    url: &str,
    keys: &[String],
) -> (HashMap<String, i64>, HashMap<String, Option<i16>>) {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let effects: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key, count(*) FROM failover_effects WHERE key = ANY($1) GROUP BY key",
    )
    .bind(keys)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let byte_keys: Vec<Vec<u8>> = keys.iter().map(|key| key.as_bytes().to_vec()).collect();
    let stored: Vec<(Vec<u8>, Option<i16>)> =
        sqlx::query_as("SELECT key, status FROM idem_keys WHERE key = ANY($1)")
            .bind(&byte_keys)
            .fetch_all(&mut conn)
            .await
            .unwrap();
    conn.close().await.unwrap();
    let stored = stored
        .into_iter()
        .map(|(key, status)| (String::from_utf8(key).unwrap(), status))
        .collect();
    (effects.into_iter().collect(), stored)
}

/// One failover: clients running, the leader's postmaster SIGKILLed,
/// the clients finishing, then the figures through the new leader.
async fn failover(cluster: &Patroni, service: &Service, clients: usize) -> Figures {
    let round_start = Instant::now();
    let handler_transient = HANDLER_TRANSIENT.lock().unwrap().len();
    let progress = Arc::new(Progress::default());
    let url = format!("http://{}/v1/charges", service.addr);
    let tag = format!("{:x}", rand_tag());
    let tasks: Vec<_> = (0..clients)
        .map(|index| {
            let account = format!("acct_{tag}_{index}");
            tokio::spawn(client(url.clone(), account, Arc::clone(&progress)))
        })
        .collect();
    let prober = tokio::spawn(probe(cluster.url(), Arc::clone(&progress)));

    // Warm: every client has charged a few times.
    wait_for(
        "the clients' first charges",
        Duration::from_secs(30),
        || progress.completed.load(Ordering::SeqCst) >= clients * 5,
    )
    .await;
    let killed: Killed = cluster.kill_leader().await;
    let in_flight_at_kill = progress.in_flight.load(Ordering::SeqCst);
    progress.kill.set(killed.at).unwrap();

    // Patroni's view, polled on its own: when the other node took the
    // lock; meanwhile the clients go on until every client has, on
    // average, finished two intents begun after the kill.
    let election = async {
        let deadline = killed.at + ROUND_LIMIT;
        loop {
            if let Some(leader) = cluster.leader().await
                && leader != killed.node
            {
                return killed.at.elapsed().as_millis();
            }
            assert!(
                Instant::now() < deadline,
                "a new leader within {ROUND_LIMIT:?}:\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let flowing = wait_for("charges and writes after the failover", ROUND_LIMIT, || {
        progress.after_kill.load(Ordering::SeqCst) >= clients * 2
            && progress.writable.load(Ordering::SeqCst)
    });
    let (election_ms, ()) = tokio::join!(election, flowing);
    let leader = cluster.wait_new_leader(killed.node, ROUND_LIMIT).await;
    progress.stop.store(true, Ordering::SeqCst);
    let mut completed = Vec::new();
    for task in tasks {
        let done = tokio::time::timeout(ROUND_LIMIT, task)
            .await
            .expect("the clients finish their intents")
            .expect("a client task");
        completed.extend(done.unwrap_or_else(|error| panic!("a client gave up: {error}")));
    }
    let probes = prober.await.unwrap();

    let served = service.seen.since(round_start);
    let mut figures = Figures {
        intents: completed.len(),
        in_flight_at_kill,
        served: served.len(),
        handler_transient: HANDLER_TRANSIENT.lock().unwrap()[handler_transient..].to_vec(),
        election_ms,
        ..Figures::default()
    };
    for response in &served {
        match response.status {
            503 => {
                figures.served_503 += 1;
                if !response.retry_after {
                    figures.served_503_without_retry_after += 1;
                }
            }
            409 => figures.served_409 += 1,
            500 => figures.served_500 += 1,
            200..=299 => {}
            other => *figures.other_statuses.entry(other).or_default() += 1,
        }
    }
    figures.writable_ms = probes
        .iter()
        .find(|(started, _, ok)| *ok && *started > killed.at)
        .map(|(_, done, _)| (*done - killed.at).as_millis());
    // The first 2xx of a request begun after the first 503 that followed
    // the kill (a backend may still commit for a few milliseconds after
    // its postmaster is gone).
    let first_503 = served
        .iter()
        .filter(|response| response.started > killed.at && response.status == 503)
        .map(|response| response.done)
        .min();
    figures.service_recovered_ms = first_503.and_then(|first_503| {
        served
            .iter()
            .filter(|response| {
                response.started > first_503 && (200..300).contains(&response.status)
            })
            .map(|response| (response.done - killed.at).as_millis())
            .min()
    });
    figures.answered_by_replay = completed.iter().filter(|done| done.replayed).count();
    figures.max_attempts = completed
        .iter()
        .map(|done| done.attempts)
        .max()
        .unwrap_or(0);
    figures.final_not_201 = completed.iter().filter(|done| done.status != 201).count();

    // Through the new leader.
    let keys: Vec<String> = completed.iter().map(|done| done.key.clone()).collect();
    let (effects, stored) = state_of(&cluster.node_url(leader), &keys).await;
    for key in &keys {
        let effect = effects.get(key).copied().unwrap_or(0);
        let status = stored.get(key);
        if effect > 1 {
            figures.duplicates += 1;
        }
        if effect == 0 {
            figures.lost_effects += 1;
        }
        match status {
            None => figures.lost_keys += 1,
            Some(Some(201)) => {}
            Some(_) => figures.stored_not_201 += 1,
        }
        match (effect > 0, status.is_some()) {
            (true, false) => figures.effect_without_key += 1,
            (false, true) => figures.key_without_effect += 1,
            _ => {}
        }
    }

    // Every acknowledged intent sent again: a replay of the very answer,
    // or, where it was lost, a new run.
    let resender = retrying_client();
    let url = &url;
    let resent: Vec<(Completed, Result<idem_client::Sent, idem_client::Error>)> =
        futures::stream::iter(completed.iter().cloned())
            .map(|done| {
                let resender = resender.clone();
                async move {
                    let intent = Intent::restore(&done.key).unwrap();
                    let builder = resender
                        .post(url)
                        .header("x-account", &done.account)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(done.request.clone());
                    let sent = resender.send(&intent, builder).await;
                    (done, sent)
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
    for (done, sent) in resent {
        let sent = sent.unwrap_or_else(|error| panic!("resending {}: {error:#?}", done.key));
        if sent.status.as_u16() == done.status && sent.replayed && sent.body == done.answer {
            figures.replays_identical += 1;
        } else {
            figures.acknowledged_then_lost += 1;
        }
    }

    // After the resends every intent has exactly one effect and its key.
    let (effects, stored) = state_of(&cluster.node_url(leader), &keys).await;
    for key in &keys {
        assert_eq!(
            effects.get(key).copied().unwrap_or(0),
            1,
            "one effect for {key} after the resends"
        );
        assert_eq!(
            stored.get(key),
            Some(&Some(201)),
            "the key {key} stored with its 201 after the resends"
        );
    }
    figures
}

/// Distinct accounts for every round and run.
fn rand_tag() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

fn check_common(figures: &Figures, mode: &str) {
    assert!(
        figures.in_flight_at_kill > 0,
        "{mode}: intents in flight at the kill"
    );
    assert_eq!(figures.served_500, 0, "{mode}: no 500 during the failover");
    assert_eq!(
        figures.served_503_without_retry_after, 0,
        "{mode}: every 503 says Retry-After"
    );
    assert!(figures.served_503 > 0, "{mode}: the switch was seen (503s)");
    assert_eq!(
        figures.final_not_201, 0,
        "{mode}: every intent answered 201"
    );
    assert_eq!(figures.stored_not_201, 0, "{mode}: no stored error");
    assert_eq!(figures.duplicates, 0, "{mode}: no intent charged twice");
    assert_eq!(
        (figures.effect_without_key, figures.key_without_effect),
        (0, 0),
        "{mode}: an effect exactly where its key is"
    );
    assert_eq!(
        figures.lost_effects, figures.lost_keys,
        "{mode}: lost effects equal lost keys"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_loses_effect_and_key_together() {
    let rounds = env_count("IDEM_FAILOVER_ROUNDS", 1);
    let clients = env_count("IDEM_FAILOVER_CLIENTS", 8);
    let started = Instant::now();
    let cluster = Patroni::start(Replication::Synchronous).await;
    println!(
        "failover: cluster (etcd, two Patroni nodes, HAProxy) ready after {} ms",
        started.elapsed().as_millis()
    );
    let service = serve(&cluster.url(), clients).await;

    for round in 1..=rounds {
        cluster
            .wait_ready(Replication::Synchronous, REJOIN_LIMIT)
            .await;
        let figures = failover(&cluster, &service, clients).await;
        figures.print("synchronous", round);
        check_common(&figures, "synchronous");
        assert_eq!(
            figures.acknowledged_then_lost, 0,
            "synchronous: every 201 the clients saw still replays"
        );
        assert_eq!(
            (figures.lost_effects, figures.lost_keys),
            (0, 0),
            "synchronous: nothing lost"
        );
    }

    cluster
        .wait_ready(Replication::Synchronous, REJOIN_LIMIT)
        .await;
    cluster
        .set_replication(Replication::Asynchronous, REJOIN_LIMIT)
        .await;
    for round in 1..=rounds {
        cluster
            .wait_ready(Replication::Asynchronous, REJOIN_LIMIT)
            .await;
        let figures = failover(&cluster, &service, clients).await;
        figures.print("asynchronous", round);
        check_common(&figures, "asynchronous");
        assert_eq!(
            figures.acknowledged_then_lost, figures.lost_keys,
            "asynchronous: the 201s that no longer replay are the lost keys"
        );
    }
    println!(
        "failover: {rounds} synchronous and {rounds} asynchronous round(s), {clients} clients, in {} ms",
        started.elapsed().as_millis()
    );
}
