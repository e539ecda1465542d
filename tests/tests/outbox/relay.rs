//! The relay's speed: a commit wakes this process's relays at once (so a
//! message goes out within milliseconds of its commit, with polling set
//! far longer), and a pass delivers different scopes at once while each
//! scope's messages go in order.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::outbox::{Message, Sink, sink_fn};
use idem_tests::service::unique as name;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::handlers::OutboxDb;
use crate::suite::{DEADLINE, Fixture};

/// The relay's polling period in the wake-up test: far longer than any
/// delivery the test accepts, so only the wake-up can explain one.
const POLL: Duration = Duration::from_secs(10);
/// The longest a woken delivery may follow its request's response.
const WOKEN_WITHIN: Duration = Duration::from_millis(50);

/// Each message's id and when the sink got it.
type Arrivals = Vec<(String, Instant)>;

/// A sink noting when each message arrived.
fn timed_sink(arrivals: Arc<watch::Sender<Arrivals>>) -> impl Sink {
    sink_fn(move |message: Message| {
        let arrivals = Arc::clone(&arrivals);
        async move {
            let at = Instant::now();
            arrivals.send_modify(|arrived| arrived.push((message.id, at)));
            Ok(())
        }
    })
}

/// Sends an email on `path` and returns the message id and when the
/// response arrived.
async fn send_timed<DB: OutboxDb>(
    fixture: &Fixture<DB>,
    addr: SocketAddr,
    path: &str,
    key: &str,
    body: Value,
) -> (String, Instant) {
    let response = fixture
        .http
        .post(format!("http://{addr}{path}"))
        .header("x-account", &fixture.account)
        .header("idempotency-key", key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let answered = Instant::now();
    assert_eq!(response.status(), StatusCode::CREATED, "{path} {body}");
    let id = response.json::<Value>().await.unwrap()["message"]
        .as_str()
        .unwrap()
        .to_owned();
    (id, answered)
}

pub async fn a_commit_wakes_the_relay_at_once<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let (arrivals, mut arrived) = watch::channel(Arrivals::new());
    // Polling every 10 s whether or not a pass found work: a message
    // delivered within 50 ms was woken for.
    let relay = fixture
        .idem
        .relay(timed_sink(Arc::new(arrivals)))
        .every(POLL)
        .busy_every(POLL)
        .spawn();

    // The first message may go out with the relay's first pass, at spawn;
    // each later one is sent once the one before it arrived, so after the
    // lease of the pass that delivered it: only a wake-up (or a poll 10 s
    // later) delivers it.
    let writes = [
        ("/emails", "warm-up"),
        ("/emails", "the request's transaction"),
        ("/phased-emails", "local"),
        ("/phased-emails", "last"),
        ("/emails", "the request's transaction, again"),
        ("/phased-emails", "local"),
    ];
    let mut ids = Vec::new();
    for (n, (path, phase)) in writes.into_iter().enumerate() {
        let body = json!({ "to": "a@example.com", "n": n, "phase": phase });
        let (id, answered) = send_timed(&fixture, addr, path, &format!("k{n}"), body).await;
        let wait = tokio::time::timeout(
            POLL / 2,
            arrived.wait_for(|arrived| arrived.iter().any(|(got, _)| got == &id)),
        )
        .await;
        let arrivals = wait
            .unwrap_or_else(|_| panic!("{path} ({phase}): no delivery within 5 s, so no wake-up"))
            .unwrap();
        let (_, at) = arrivals.iter().find(|(got, _)| got == &id).unwrap();
        // The relay may deliver before the client reads the response: the
        // wake-up follows the commit, which precedes the response.
        let late = at.saturating_duration_since(answered);
        drop(arrivals);
        if n > 0 {
            assert!(
                late <= WOKEN_WITHIN,
                "{path} ({phase}): delivered {late:?} after the response"
            );
        }
        ids.push(id);
    }
    tokio::time::timeout(DEADLINE, async {
        while fixture.idem.pending_messages().await.unwrap() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("every message marked delivered");
    relay.abort();
    let delivered: Vec<String> = arrived.borrow().iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(delivered, ids, "each message once, in order");
    fixture.finish().await;
}

/// Deliveries in flight at once across scopes needed to count as
/// concurrent, and the relay's bound on them.
const CONCURRENT: usize = 4;
const BOUND: usize = 8;

/// A sink recording what it took, how many deliveries were in flight at
/// once (overall and per scope), and failing chosen messages.
#[derive(Clone, Default)]
struct OrderSink {
    taken: Arc<Mutex<Vec<Message>>>,
    in_flight: Arc<Mutex<InFlight>>,
    /// Deliveries of these ids that fail first (count left).
    failing: Arc<Mutex<HashMap<String, u32>>>,
    /// Until when a delivery waits for others to join it (set by the
    /// first).
    gate: Arc<Mutex<Option<Instant>>>,
}

#[derive(Default)]
struct InFlight {
    now: usize,
    peak: usize,
    scopes: HashSet<String>,
    /// Deliveries that began while an earlier one of their scope was
    /// still in flight.
    overtaking: u32,
}

impl OrderSink {
    fn sink(&self) -> impl Sink + use<> {
        let sink = self.clone();
        sink_fn(move |message: Message| {
            let sink = sink.clone();
            async move {
                {
                    let mut flight = sink.in_flight.lock().unwrap();
                    flight.now += 1;
                    flight.peak = flight.peak.max(flight.now);
                    if !flight.scopes.insert(message.scope.clone()) {
                        flight.overtaking += 1;
                    }
                }
                // Until several deliveries are in flight together, each
                // waits for others to join it (until a deadline the first
                // sets): a relay delivering one at a time never gets there
                // and fails the test's peak, having waited once.
                let until = *sink
                    .gate
                    .lock()
                    .unwrap()
                    .get_or_insert_with(|| Instant::now() + Duration::from_secs(3));
                while sink.in_flight.lock().unwrap().peak < CONCURRENT && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let fail = match sink.failing.lock().unwrap().get_mut(&message.id) {
                    Some(left) if *left > 0 => {
                        *left -= 1;
                        true
                    }
                    _ => false,
                };
                {
                    let mut flight = sink.in_flight.lock().unwrap();
                    flight.now -= 1;
                    flight.scopes.remove(&message.scope);
                }
                if fail {
                    return Err("the sink refused".into());
                }
                sink.taken.lock().unwrap().push(message);
                Ok(())
            }
        })
    }
}

pub async fn a_pass_delivers_scopes_at_once_each_in_order<DB: OutboxDb>() {
    const SCOPES: usize = 12;
    const EACH: usize = 5;
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let accounts: Vec<String> = (0..SCOPES).map(|_| name("acct")).collect();
    // Each account's emails one after another; the accounts at once.
    let sends = accounts.iter().map(|account| {
        let fixture = &fixture;
        async move {
            let mut ids = Vec::new();
            for n in 0..EACH {
                let body = json!({ "to": "x@example.com", "n": n });
                let sent = fixture.send(addr, account, &format!("k{n}"), body).await;
                assert_eq!(sent.status(), StatusCode::CREATED);
                let sent: Value = sent.json().await.unwrap();
                ids.push(sent["message"].as_str().unwrap().to_owned());
            }
            ids
        }
    });
    let ids: Vec<Vec<String>> = futures::future::join_all(sends).await;
    let total = SCOPES * EACH;
    assert_eq!(fixture.idem.pending_messages().await.unwrap(), total as u64);

    // The second message of one account fails once.
    let (held, refused) = (3, 1);
    let sink = OrderSink::default();
    sink.failing
        .lock()
        .unwrap()
        .insert(ids[held][refused].clone(), 1);
    let relay = |sink: &OrderSink| {
        fixture
            .idem
            .relay(sink.sink())
            .concurrency(BOUND)
            .backoff(Duration::from_millis(1))
            .max_backoff(Duration::from_millis(2))
    };

    // One pass leases the whole outbox and delivers it, but for the
    // refused message and what its scope wrote after it.
    let first = relay(&sink).run_once().await.unwrap();
    let later = EACH - refused - 1;
    assert_eq!(
        (first.delivered, first.failed, first.deferred),
        ((total - 1 - later) as u32, 1, later as u32),
        "the refused scope waits; the others all went"
    );
    {
        let flight = sink.in_flight.lock().unwrap();
        assert!(
            (CONCURRENT..=BOUND).contains(&flight.peak),
            "deliveries in flight together, within the bound: {}",
            flight.peak
        );
    }
    let held_so_far: Vec<String> = sink
        .taken
        .lock()
        .unwrap()
        .iter()
        .filter(|message| message.scope == accounts[held])
        .map(|message| message.id.clone())
        .collect();
    assert_eq!(
        held_so_far,
        ids[held][..refused],
        "nothing after the refused message yet"
    );

    // Two relays drain the rest; the refused one is retried first in its
    // scope.
    let (one, two) = (relay(&sink), relay(&sink));
    let mut marked = first.delivered;
    tokio::time::timeout(DEADLINE, async {
        while fixture.idem.pending_messages().await.unwrap() > 0 {
            let (a, b) = tokio::join!(one.run_once(), two.run_once());
            marked += a.unwrap().delivered + b.unwrap().delivered;
        }
    })
    .await
    .expect("the outbox drained");

    let taken = sink.taken.lock().unwrap().clone();
    assert_eq!(
        sink.in_flight.lock().unwrap().overtaking,
        0,
        "a scope's message began while an earlier one was in flight"
    );
    assert_eq!(taken.len(), total, "each message taken once");
    assert_eq!(
        marked as usize, total,
        "each message marked once, in the pass that delivered it"
    );
    for (account, written) in accounts.iter().zip(&ids) {
        let order: Vec<&String> = taken
            .iter()
            .filter(|message| &message.scope == account)
            .map(|message| &message.id)
            .collect();
        assert_eq!(
            order,
            written.iter().collect::<Vec<_>>(),
            "{account}'s messages in the order written"
        );
    }
    let retried = taken
        .iter()
        .find(|message| message.id == ids[held][refused])
        .unwrap();
    assert_eq!(retried.attempts, 1, "taken on its retry");
    assert_eq!(
        relay(&sink).run_once().await.unwrap(),
        Default::default(),
        "nothing left"
    );
    fixture.finish().await;
}

/// Aborting a spawned relay stops it between passes: the pass in flight
/// (here, waiting on its sink) still ends, marking what it delivered,
/// rather than leaving it leased and its connections cut half-way.
pub async fn an_aborted_relay_finishes_its_pass<DB: OutboxDb>() {
    let fixture = Fixture::<DB>::new().await;
    let addr = fixture.serve().await;
    let (id, _) = send_timed(
        &fixture,
        addr,
        "/emails",
        "k0",
        json!({ "to": "x@example.com" }),
    )
    .await;
    let (started, mut on_start) = watch::channel(false);
    let (go, on_go) = watch::channel(false);
    let taken = Arc::new(Mutex::new(Vec::new()));
    let sink = {
        let (started, on_go, taken) = (Arc::new(started), on_go, Arc::clone(&taken));
        sink_fn(move |message: Message| {
            let (started, mut on_go, taken) =
                (Arc::clone(&started), on_go.clone(), Arc::clone(&taken));
            async move {
                started.send_replace(true);
                on_go
                    .wait_for(|go| *go)
                    .await
                    .expect("the test holds the gate");
                taken.lock().unwrap().push(message.id);
                Ok(())
            }
        })
    };
    let relay = fixture.idem.relay(sink).every(POLL).spawn();
    tokio::time::timeout(DEADLINE, on_start.wait_for(|started| *started))
        .await
        .expect("the relay began a delivery")
        .unwrap();
    relay.abort();
    assert!(relay.await.unwrap_err().is_cancelled());
    go.send_replace(true);
    tokio::time::timeout(DEADLINE, async {
        while fixture.idem.pending_messages().await.unwrap() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the aborted relay's pass marked its delivery");
    assert_eq!(*taken.lock().unwrap(), [id], "delivered once");
    fixture.finish().await;
}
