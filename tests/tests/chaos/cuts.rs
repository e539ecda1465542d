//! The database connection cut at the commit, one request at a time: the
//! engine's proxy, between the service's pool (one connection) and the
//! server, drops the connection at the message that carries the finish's
//! `COMMIT` (on PostgreSQL `EXECUTE <finish>; COMMIT; BEGIN`, on MySQL the
//! batch `...; UPDATE <the key's row>; ...; COMMIT AND CHAIN`):
//!
//! - before forwarding it: the server never sees the commit and rolls the
//!   transaction back when the connection drops. The client is told 503,
//!   and a retry with the key runs the handler as a first attempt;
//! - after the server answered it (the answer withheld): the effect and the
//!   stored response committed, the client cannot know. The client is told
//!   503, and a retry replays the stored response.
//!
//! Either way exactly one effect, and the pool opens new connections.

use idem_tests::hardening::{Answer, Client, Server, send, unique};
use idem_tests::proxied::{self, Proxied};
use idem_tests::proxy::CutOnCommit;
use idem_tests::service::until_session_ends;

use idem::Idem;
use sqlx::Pool;

const BODY: &str = r#"{"note":"cut"}"#;

/// 503, `idempotency_store_unavailable`, with `Retry-After`: "retry with
/// the same key", never success.
fn assert_unavailable(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {answer:?}");
    assert_eq!(
        answer.header("retry-after"),
        Some("1"),
        "{what}: {answer:?}"
    );
    assert_eq!(
        answer.problem_code(),
        "idempotency_store_unavailable",
        "{what}: {answer:?}"
    );
    assert!(!answer.replayed(), "{what}: {answer:?}");
}

/// 201, a replay or not.
fn assert_created(answer: &Answer, replayed: bool, what: &str) {
    let got = (answer.status.as_u16(), answer.replayed());
    assert_eq!(got, (201, replayed), "{what}: {answer:?}");
}

/// Without a key: 503 with the same stable code, but no `Retry-After`
/// and a detail that says the outcome is unknown (a retry could do the
/// work twice), and why a key would have helped.
fn assert_outcome_unknown(answer: &Answer, what: &str) {
    assert_eq!(answer.status, 503, "{what}: {answer:?}");
    assert_eq!(answer.header("retry-after"), None, "{what}: {answer:?}");
    assert_eq!(
        answer.problem_code(),
        "idempotency_store_unavailable",
        "{what}: {answer:?}"
    );
    let detail = answer.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        detail.contains("may or may not have been done") && detail.contains("Idempotency-Key"),
        "{what}: {answer:?}"
    );
}

/// The service on a pool of one connection through the engine's proxy,
/// for a caller of its own.
struct Fixture<DB: Proxied> {
    admin: Pool<DB>,
    proxy: DB::Proxy,
    server: Server<DB>,
    client: Client,
}

impl<DB: Proxied> Fixture<DB> {
    async fn start(prefix: &str) -> Self {
        // Migrates the tables, once per process.
        let admin = DB::pool(2).await;
        let proxy = proxied::start_proxy::<DB>().await;
        let pool = proxied::through::<DB>(&proxy, 1).await;
        let server = Server::start(Idem::new(pool)).await;
        let client = server.client(&unique(prefix));
        Fixture {
            admin,
            proxy,
            server,
            client,
        }
    }

    /// `POST /effects` with `key`.
    async fn charge(&self, key: &str) -> Answer {
        send(self.client.post(key, BODY)).await
    }

    /// A first attempt with a new key whose commit the proxy cuts in
    /// `mode`: 503, retry with the key. The key and the answer.
    async fn charge_cut(&self, mode: CutOnCommit) -> (String, Answer) {
        let key = unique("k");
        self.proxy.set_cut_on_commit(mode);
        let first = self.charge(&key).await;
        self.proxy.set_cut_on_commit(CutOnCommit::Off);
        println!("the finish's COMMIT cut ({mode:?}): {first:?}");
        assert_unavailable(
            &first,
            &format!("the first attempt, its commit cut {mode:?}"),
        );
        (key, first)
    }

    /// `POST /effects/optional` without a key, for `caller`.
    async fn keyless(&self, caller: &str) -> Answer {
        let client = self.server.client(caller);
        let request = client
            .bare("/effects/optional")
            .header("content-type", "application/json")
            .body(BODY);
        send(request).await
    }

    /// A request without a key, for a caller of its own, whose commit the
    /// proxy cuts in `mode` (the cut after `cuts_before` others): 503,
    /// outcome unknown. The caller, once the server ended the session.
    async fn keyless_cut(&self, mode: CutOnCommit, cuts_before: usize) -> String {
        let caller = unique("op");
        self.proxy.set_cut_on_commit(mode);
        let answer = self.keyless(&caller).await;
        self.proxy.set_cut_on_commit(CutOnCommit::Off);
        assert_outcome_unknown(&answer, &format!("keyless, its commit cut {mode:?}"));
        self.cut_once(cuts_before).await;
        caller
    }

    /// The committed effects of `key` in the caller's scope, their ids.
    async fn effects(&self, key: &str) -> Vec<i64> {
        effect_ids(&self.admin, &self.client.scope, key).await
    }

    /// The committed key row of `key`: `(status, body)`.
    async fn stored(&self, key: &str) -> Option<(Option<i16>, Vec<u8>)> {
        DB::stored(&self.admin, &self.client.scope, key).await
    }

    /// The one session cut since `cuts_before` cuts, once the server ended
    /// it (and so rolled back what it left open).
    async fn cut_once(&self, cuts_before: usize) -> u32 {
        let cut = self.proxy.cut_sessions();
        assert_eq!(
            cut.len(),
            cuts_before + 1,
            "one cut at the commit, not {:?}",
            &cut[cuts_before..]
        );
        ended(&self.admin, cut[cuts_before]).await;
        cut[cuts_before]
    }

    /// `key` committed as `first` reported: one effect, its id in the
    /// stored 201, whose body is `first`'s.
    async fn assert_committed(&self, key: &str, first: &Answer) {
        assert_eq!(
            self.effects(key).await,
            [first.effect().id],
            "exactly one effect, the one {first:?} reports"
        );
        assert_eq!(
            self.stored(key).await,
            Some((Some(201), first.body.to_vec())),
            "the stored response is the one the client got"
        );
    }

    async fn stop(self) {
        let pool = self.server.pool().clone();
        drop(self.server);
        pool.close().await;
        drop(self.proxy);
    }
}

async fn effect_ids<DB: Proxied>(admin: &Pool<DB>, scope: &str, key: &str) -> Vec<i64> {
    let effects = DB::effects(admin, scope, key).await;
    effects.into_iter().map(|(id, _)| id).collect()
}

/// Waits until the server has ended session `id` (a connection the proxy
/// cut): it rolls back what the session left open before it lets go of
/// it, so from then on its locks are free and its writes undone.
async fn ended<DB: Proxied>(admin: &Pool<DB>, id: u32) {
    assert_ne!(id, 0, "the proxy did not read the cut session's id");
    until_session_ends::<DB>(admin, id.into()).await;
}

/// The commit never reaches the server: nothing committed, the client is
/// told 503 (retry with the key), and the retry is a first attempt.
pub async fn a_commit_cut_before_the_server_sees_it_is_503_and_the_retry_runs_once<DB: Proxied>() {
    let fixture = Fixture::<DB>::start("cut_before").await;
    let (key, _) = fixture.charge_cut(CutOnCommit::BeforeForwarding).await;
    fixture.cut_once(0).await;
    assert!(
        fixture.effects(&key).await.is_empty(),
        "the effect rolled back"
    );
    assert_eq!(fixture.stored(&key).await, None, "the claim rolled back");

    let retry = fixture.charge(&key).await;
    println!("the retry: {retry:?}");
    assert_eq!(retry.status, 201, "the retry: {retry:?}");
    assert!(!retry.replayed(), "nothing was stored to replay: {retry:?}");
    fixture.assert_committed(&key, &retry).await;

    let replay = fixture.charge(&key).await;
    assert_created(&replay, true, "the replay");
    assert_eq!(replay.body, retry.body);
    assert_eq!(fixture.effects(&key).await.len(), 1, "exactly one effect");
    fixture.stop().await;
}

/// The commit lands and its answer is lost: the client is told 503 (it
/// cannot know), and the retry replays what committed.
pub async fn a_commit_cut_after_the_server_answered_is_503_and_the_retry_replays<DB: Proxied>() {
    let fixture = Fixture::<DB>::start("cut_after").await;
    let (key, _) = fixture.charge_cut(CutOnCommit::AfterForwarding).await;
    // The proxy read the whole answer before it cut: committed already.
    let effects = fixture.effects(&key).await;
    assert_eq!(effects.len(), 1, "the effect committed: {effects:?}");
    let Some((Some(201), stored)) = fixture.stored(&key).await else {
        panic!("the response committed with the effect");
    };
    let body: serde_json::Value = serde_json::from_slice(&stored).unwrap();
    assert_eq!(body["id"].as_i64(), Some(effects[0]), "{body}");
    fixture.cut_once(0).await;

    let retry = fixture.charge(&key).await;
    println!("the retry: {retry:?}");
    assert_eq!(retry.status, 201, "the retry: {retry:?}");
    assert!(
        retry.replayed(),
        "the committed response is replayed: {retry:?}"
    );
    assert_eq!(retry.body, stored);
    fixture.assert_committed(&key, &retry).await;
    fixture.stop().await;
}

/// Commit after commit cut, each on the pool's one connection: every
/// request gets a new one, nothing piles up, and once the cuts stop new
/// keys succeed and the cut ones settle (rerun or replayed, once each).
pub async fn the_pool_reconnects_after_cut_commits<DB: Proxied>() {
    let fixture = Fixture::<DB>::start("cut_pool").await;
    let proxy = &fixture.proxy;
    // A first request, uncut: PostgreSQL's once-per-server question
    // (whether it offers advisory locks) opens a connection of its own.
    let warm = fixture.charge(&unique("warm")).await;
    assert_eq!(warm.status, 201, "the warm-up: {warm:?}");
    proxy.reset();

    let mut cut = Vec::new();
    for (mode, count) in [
        (CutOnCommit::BeforeForwarding, 3),
        (CutOnCommit::AfterForwarding, 2),
    ] {
        proxy.set_cut_on_commit(mode);
        for _ in 0..count {
            let key = unique("cut");
            let answer = fixture.charge(&key).await;
            assert_unavailable(&answer, &format!("{mode:?}"));
            cut.push((mode, key));
        }
    }
    proxy.set_cut_on_commit(CutOnCommit::Off);
    let sessions = proxy.cut_sessions();
    let mut distinct = sessions.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        cut.len(),
        "each cut request ran on a new connection: {sessions:?}"
    );
    for &session in &sessions {
        ended(&fixture.admin, session).await;
    }
    // The first cut request ran on the pool's connection, each later one
    // on a new one.
    assert_eq!(proxy.accepted(), cut.len() as u64 - 1, "connections opened");

    for _ in 0..5 {
        let key = unique("new");
        let answer = fixture.charge(&key).await;
        assert_created(&answer, false, "a new key");
        fixture.assert_committed(&key, &answer).await;
    }
    for (mode, key) in &cut {
        let answer = fixture.charge(key).await;
        let replayed = *mode == CutOnCommit::AfterForwarding;
        assert_created(&answer, replayed, &format!("{mode:?}"));
        fixture.assert_committed(key, &answer).await;
    }
    // One more connection, which served every later request.
    assert_eq!(proxy.accepted(), cut.len() as u64, "connections opened");
    assert_eq!(proxy.connections(), 1, "the pool's one connection");
    fixture.stop().await;
}

/// Without a key, the same cuts: 503 both times, nothing stored; the
/// commit either never happened or did (a keyless request has no memory to
/// make a retry safe: that is what the key is for), and the answer says
/// so instead of inviting a retry. Each request is a caller of its own,
/// whose effects and key rows are its own.
pub async fn a_keyless_commit_cut_is_503_and_stores_nothing<DB: Proxied>() {
    let fixture = Fixture::<DB>::start("cut_keyless").await;
    let admin = &fixture.admin;

    let before = fixture.keyless_cut(CutOnCommit::BeforeForwarding, 0).await;
    assert!(
        effect_ids(admin, &before, "").await.is_empty(),
        "rolled back"
    );
    let after = fixture.keyless_cut(CutOnCommit::AfterForwarding, 1).await;
    assert_eq!(effect_ids(admin, &after, "").await.len(), 1, "committed");

    let calm = unique("op");
    let answer = fixture.keyless(&calm).await;
    assert_created(&answer, false, "keyless, no cut");
    assert_eq!(effect_ids(admin, &calm, "").await, [answer.effect().id]);
    for caller in [&before, &after, &calm] {
        assert_eq!(
            DB::count_keys(admin, caller).await,
            0,
            "no key, nothing stored"
        );
    }
    fixture.stop().await;
}
