//! Many tenants on one store: keys are per scope, whatever the scope or the
//! key contains, and a stored response never crosses scopes.

use idem_tests::hardening;

use std::collections::HashSet;

use futures::StreamExt;
use hardening::{Answer, Client, Server, connect, effects, send, stored, unique};
use idem::Idem;

const BODY: &str = r#"{"note":"same request everywhere"}"#;

async fn server() -> Server {
    Server::start(Idem::new(connect(20).await)).await
}

/// One shared HTTP client with room for every concurrent request.
fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1100)
        .timeout(hardening::REQUEST_TIMEOUT)
        .build()
        .unwrap()
}

/// Raises this process's soft limit on open files towards `wanted`, as
/// far as the hard limit allows; returns the limit now in force.
fn raise_open_files(wanted: u64) -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` and `setrlimit` only read and write `limit`.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    limit.rlim_cur
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_from_a_thousand_scopes_is_a_thousand_effects() {
    const SCOPES: usize = 1000;
    // Each request in flight holds two sockets in this process (the
    // client's and the server's), beside the pools, the runtime and
    // libtest's other tests: all 1,000 at once need some 2,300 files, more
    // than a common soft limit of 1,024. Where the hard limit is lower
    // still, as many go at once as fit.
    let open_files = raise_open_files(4096);
    let at_once = usize::try_from(open_files.saturating_sub(300) / 2)
        .unwrap()
        .clamp(1, SCOPES);
    let server = server().await;
    let prefix = unique("tenancy-1000");
    let http = http();
    let clients: Vec<Client> = (0..SCOPES)
        .map(|i| Client::with(http.clone(), server.addr, &format!("{prefix}/{i}")))
        .collect();

    // At once: the claims of one key in 1000 scopes race each other.
    let all = |body| {
        futures::stream::iter(clients.iter().map(move |c| send(c.post("shared", body))))
            .buffered(at_once)
            .collect::<Vec<Answer>>()
    };
    let first: Vec<Answer> = all(BODY).await;
    let mut nonces = HashSet::new();
    for (client, answer) in clients.iter().zip(&first) {
        assert_eq!(answer.status, 201, "{}: {answer:?}", client.scope);
        assert!(
            !answer.replayed(),
            "{}: replayed another scope's answer",
            client.scope
        );
        nonces.insert(answer.effect().nonce);
    }
    assert_eq!(nonces.len(), SCOPES, "every scope ran its own handler");

    let scopes: Vec<Vec<u8>> = clients
        .iter()
        .map(|c| c.scope.clone().into_bytes())
        .collect();
    let per_scope: Vec<(Vec<u8>, i64, String)> = sqlx::query_as(
        "SELECT scope, count(*), min(nonce) FROM idem_service_effects \
         WHERE key = 'shared' AND scope = ANY($1) GROUP BY scope",
    )
    .bind(&scopes)
    .fetch_all(server.pool())
    .await
    .unwrap();
    assert_eq!(per_scope.len(), SCOPES, "one effect row group per scope");
    assert!(
        per_scope.iter().all(|(_, n, _)| *n == 1),
        "exactly one effect per scope"
    );

    // Every scope's retry replays its own answer, never a neighbour's.
    let again: Vec<Answer> = all(BODY).await;
    for ((client, a), b) in clients.iter().zip(&first).zip(&again) {
        assert!(b.replayed(), "{}: {b:?}", client.scope);
        assert_eq!(a.body, b.body, "{}: replay differs", client.scope);
    }
    let total: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idem_service_effects WHERE key = 'shared' AND scope = ANY($1)",
    )
    .bind(&scopes)
    .fetch_one(server.pool())
    .await
    .unwrap();
    assert_eq!(total, SCOPES as i64);
}

/// Pairs that a store joining scope and key into one string would confuse.
/// Each entry is (scope suffix, key); the scope is the test's prefix plus
/// the suffix, so the whole family is this run's own.
const CONFUSABLE: &[(&str, &str)] = &[
    (":a:b", "c"),
    (":a", "b:c"),
    ("/a/b", "c"),
    ("/a", "b/c"),
    ("ab", "c"),
    ("a", "bc"),
    ("", "abc"),
    ("a\0b", "c"),
    ("a", "b\\0c"),
    ("a\0", "bc"),
    ("a%00b", "c"),
    ("\u{e9}", "k"),
    ("e\u{301}", "k"),
    ("\u{1F600}", "k"),
    ("\u{1F600}k", "x"),
    ("-\u{43a}\u{43b}\u{44e}\u{447}", "k"),
    ("A", "bc"),
    ("a\u{2044}b", "c"),
    ("a\\", "\"c"),
    ("a", "\\\"c"),
    ("a|b", "c"),
    ("a", "b|c"),
    ("a\u{0}b\u{0}c", "d"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separators_and_odd_bytes_cannot_collide() {
    let server = server().await;
    let prefix = unique("tenancy-sep");
    let pairs: Vec<(Client, &str)> = CONFUSABLE
        .iter()
        .map(|(suffix, key)| (server.client(&format!("{prefix}{suffix}")), *key))
        .collect();
    let mut seen = HashSet::new();
    let mut first = Vec::new();
    // One after the other: a colliding store would replay an earlier
    // pair's answer (same body, same path) to a later one.
    for (client, key) in &pairs {
        let answer = send(client.post(&header_key(key), BODY)).await;
        assert_eq!(answer.status, 201, "{:?} {key:?}: {answer:?}", client.scope);
        assert!(
            !answer.replayed(),
            "{:?} {key:?} got another pair's answer",
            client.scope
        );
        assert!(seen.insert(answer.effect().nonce));
        first.push(answer);
    }
    for ((client, key), answer) in pairs.iter().zip(&first) {
        let found = effects(server.pool(), &client.scope, key).await;
        assert_eq!(found.len(), 1, "{:?} {key:?}", client.scope);
        assert_eq!(found[0].1, answer.effect().nonce);
        let (status, body) = stored(server.pool(), &client.scope, key).await.unwrap();
        assert_eq!(status, Some(201));
        assert_eq!(body, answer.body, "{:?} {key:?}: stored body", client.scope);
        let again = send(client.post(&header_key(key), BODY)).await;
        assert!(again.replayed());
        assert_eq!(
            again.body, answer.body,
            "{:?} {key:?}: replay",
            client.scope
        );
    }
}

/// The key as a header carries it: quoted when it holds `"` or `\`.
fn header_key(key: &str) -> String {
    if key.contains(['"', '\\']) {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    } else {
        key.to_owned()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_never_reaches_another_scope() {
    let server = server().await;
    let prefix = unique("tenancy-cross");
    let alice = server.client(&format!("{prefix}-alice"));
    let bob = server.client(&format!("{prefix}-bob"));
    let carol = server.client(&format!("{prefix}-carol"));

    // While alice's attempt holds the key open, bob's same key is his own:
    // neither replayed nor blocked.
    let hold = server.state.holds.get(&prefix);
    let held = tokio::spawn(
        alice
            .post("k", BODY)
            .header("x-test-mode", format!("hold:{prefix}"))
            .send(),
    );
    hold.entered().await;
    let bob_first = send(bob.post("k", BODY)).await;
    assert_eq!(bob_first.status, 201, "{bob_first:?}");
    assert!(!bob_first.replayed());
    hold.release.notify_one();
    let alice_first = Answer::of(held.await.unwrap().unwrap()).await.unwrap();
    assert_eq!(alice_first.status, 201);
    assert_ne!(alice_first.effect().nonce, bob_first.effect().nonce);

    // Carol's different body under the same key is not a reuse: the other
    // scopes' fingerprints are invisible to her.
    let carol_first = send(carol.post("k", r#"{"note":"carol's own"}"#)).await;
    assert_eq!(carol_first.status, 201, "{carol_first:?}");

    for (client, first, body) in [
        (&alice, &alice_first, BODY),
        (&bob, &bob_first, BODY),
        (&carol, &carol_first, r#"{"note":"carol's own"}"#),
    ] {
        let again = send(client.post("k", body)).await;
        assert!(again.replayed(), "{}: {again:?}", client.scope);
        assert_eq!(
            again.body, first.body,
            "{} got another scope's answer",
            client.scope
        );
        assert_eq!(effects(server.pool(), &client.scope, "k").await.len(), 1);
    }
    // And a body another scope used is a 422 only within its own scope.
    let reuse = send(bob.post("k", r#"{"note":"carol's own"}"#)).await;
    assert_eq!(reuse.status, 422);
}
