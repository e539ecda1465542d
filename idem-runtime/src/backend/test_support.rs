//! What the engines' tests share: the test of an expired key's takeover,
//! for which each engine's test writes the expired row and the lock on it.

use std::future::Future;
use std::time::Duration;

use sqlx::Pool;

use super::admin::{Admin, Forgotten, KeyInfo, KeyState, MAX_RECENT};
use super::single_flight;
use super::{Acquire, Backend, Claim, ClaimOutcome, OpenTx};
use crate::fingerprint::Fingerprint;
use crate::response::EncodedResponse;

/// A claim of `key` in `scope` as the engines' tests make them: kept a
/// minute, its fingerprint `fill` repeated, a 30 s deadline.
pub(crate) fn claim_of<'a>(scope: &'a str, key: &'a str, fill: u8, wait: Duration) -> Claim<'a> {
    Claim {
        scope,
        key,
        fingerprint: Fingerprint::from_bytes(&[fill; 32]).unwrap(),
        ttl: Duration::from_secs(60),
        tombstone_ms: None,
        wait,
        timeout_ms: 30_000,
        advisory: true,
        pooled: false,
    }
}

/// A response of `status` with `body` and no headers, as a handler's
/// answer is stored.
pub(crate) fn response(status: http::StatusCode, body: &'static str) -> EncodedResponse {
    EncodedResponse {
        status,
        headers: Vec::new(),
        body: body.into(),
        tombstone: None,
    }
}

/// A 201 with `body`.
pub(crate) fn created(body: &'static str) -> EncodedResponse {
    response(http::StatusCode::CREATED, body)
}

/// Claims `claim`'s fresh key in `table`; panics with `what` if the key
/// was not claimed.
pub(crate) async fn claimed<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    claim: &Claim<'_>,
    what: &str,
) -> OpenTx<DB> {
    match DB::claim(pool, Acquire::default(), table, claim)
        .await
        .unwrap_or_else(|error| panic!("{what}: {error}"))
    {
        ClaimOutcome::Claimed(conn) => conn,
        other => panic!("{what}: a fresh key is claimed, not {other:?}"),
    }
}

/// Claims `claim`'s fresh key in `table` and stores `response` on it.
pub(crate) async fn finished<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    claim: &Claim<'_>,
    response: &EncodedResponse,
) {
    let mut conn = claimed(pool, table, claim, claim.key).await;
    DB::finish(&mut conn, table, Some(claim), Some(response))
        .await
        .expect("finish");
    conn.release();
}

/// The key the tests' expired row has: `old` in `acct`, claimed anew
/// with the fingerprint `[1; 32]`, without a wait.
pub(crate) fn claim() -> Claim<'static> {
    claim_of("acct", "old", 1, Duration::ZERO)
}

/// While another transaction holds the expired row, the claim is told
/// the key is in use (within a bound far above `wait`, so a claim that
/// waits for the holder fails the test); once `release` has ended that
/// transaction, the claim takes the key over and stores a 201.
pub(crate) async fn in_use_then_taken_over<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    release: impl Future<Output = ()>,
) {
    let claim = claim();
    let outcome = tokio::time::timeout(
        Duration::from_secs(5),
        DB::claim(pool, Acquire::default(), table, &claim),
    )
    .await
    .expect("the claim waited for the row's holder, not `wait`")
    .expect("claim");
    assert!(matches!(outcome, ClaimOutcome::InUse { .. }), "{outcome:?}");
    release.await;
    finished(pool, table, &claim, &created("{}")).await;
}

/// Panics unless `claim`'s key replays `response` (with its fingerprint).
pub(crate) async fn replays<DB: Backend>(
    pool: &Pool<DB>,
    table: &str,
    claim: &Claim<'_>,
    response: &EncodedResponse,
) {
    match DB::claim(pool, Acquire::default(), table, claim)
        .await
        .unwrap()
    {
        ClaimOutcome::Finished {
            fingerprint,
            response: stored,
        } => {
            assert_eq!(fingerprint, claim.fingerprint);
            assert_eq!(&stored, response);
        }
        other => panic!("the key must replay: {other:?}"),
    }
}

/// The phased mode's storage contract on `table`, as every engine keeps
/// it: a lease claim, the fence, a takeover that carries the recovery
/// point, the completer's reservation, the release, the stored response
/// and a table from before the phased mode migrated.
pub(crate) async fn lease_contract<DB: super::Phased>(pool: &Pool<DB>, table: &str) {
    use super::{Holder, LeaseClaim, LeaseOutcome, Release};

    let lease = |claim: Claim<'static>, reserved: Option<i64>| LeaseClaim {
        claim,
        lease: Duration::from_secs(30),
        request: b"stored request",
        reserved,
        // No limit here: the claims' limit has its own tests.
        max_attempts: u32::MAX,
    };
    let claim_a = claim_of("acct", "phased", 7, Duration::ZERO);
    let owned = |outcome: LeaseOutcome| match outcome {
        LeaseOutcome::Owned { token, recovery } => (token, recovery),
        other => panic!("not owned: {other:?}"),
    };
    let take = async |reserved| {
        DB::lease(pool, Acquire::default(), table, &lease(claim_a, reserved))
            .await
            .unwrap()
    };

    // A new key: ours, token 1, nothing to resume.
    let (first, recovery) = owned(take(None).await);
    assert_eq!((first, recovery), (1, None));
    let holder = |token| Holder {
        scope: "acct".into(),
        key: "phased".into(),
        token,
    };

    // While leased: another attempt is told how long the lease has left;
    // another request with the key is told so.
    match take(None).await {
        LeaseOutcome::Leased { remaining } => {
            assert!(
                remaining <= Duration::from_secs(30) && remaining > Duration::from_secs(20),
                "{remaining:?}"
            );
        }
        other => panic!("a live lease was taken: {other:?}"),
    }
    let other_request = lease(claim_of("acct", "phased", 8, Duration::ZERO), None);
    assert!(matches!(
        DB::lease(pool, Acquire::default(), table, &other_request)
            .await
            .unwrap(),
        LeaseOutcome::Reused
    ));

    // The holder records a recovery point; its lease then ends at once.
    assert!(
        DB::record(
            &mut *one(pool).await,
            table,
            &holder(first),
            b"{\"steps\":{}}",
            Duration::from_secs(30)
        )
        .await
        .unwrap()
    );
    assert!(
        DB::release(
            &mut *one(pool).await,
            table,
            &holder(first),
            Release::Keep(Duration::ZERO)
        )
        .await
        .unwrap()
    );

    // The next attempt takes over with a larger token and the recovery
    // point; the first holder is fenced from then on.
    let (second, recovery) = owned(take(None).await);
    assert_eq!(second, first + 1);
    assert_eq!(recovery.as_deref(), Some(&b"{\"steps\":{}}"[..]));
    assert!(
        !DB::record(
            &mut *one(pool).await,
            table,
            &holder(first),
            b"late",
            Duration::from_secs(30)
        )
        .await
        .unwrap()
    );
    assert!(
        !DB::release(
            &mut *one(pool).await,
            table,
            &holder(first),
            Release::Delete
        )
        .await
        .unwrap()
    );

    // Abandoned (lease over), the key is listed for the completer, whose
    // reservation gives a new token that only its own request takes over.
    assert!(
        DB::release(
            &mut *one(pool).await,
            table,
            &holder(second),
            Release::Keep(Duration::ZERO)
        )
        .await
        .unwrap()
    );
    let abandoned = DB::abandoned(pool, table, 10).await.unwrap();
    assert_eq!(abandoned.len(), 1, "{abandoned:?}");
    // The takeover of the first attempt's ended lease was a resumption.
    assert_eq!(
        (abandoned[0].holder.token, abandoned[0].attempts),
        (second, 1)
    );
    assert_eq!(
        abandoned[0].request.as_deref(),
        Some(&b"stored request"[..])
    );
    let reserved = DB::reserve(pool, table, &holder(second), Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(reserved, Some(second + 1));
    assert_eq!(
        DB::reserve(pool, table, &holder(second), Duration::from_secs(30))
            .await
            .unwrap(),
        None,
        "reserved twice"
    );
    assert!(DB::abandoned(pool, table, 10).await.unwrap().is_empty());
    assert!(
        matches!(take(None).await, LeaseOutcome::Leased { .. }),
        "a client took the reservation"
    );
    let (third, _) = owned(take(reserved).await);
    assert_eq!(third, second + 2);

    // The response is stored under the holding token only, and finishes
    // the key for every later claim.
    let response = created("{\"paid\":true}");
    assert!(
        !DB::store(&mut *one(pool).await, table, &holder(second), &response)
            .await
            .unwrap()
    );
    assert!(
        DB::store(&mut *one(pool).await, table, &holder(third), &response)
            .await
            .unwrap()
    );
    match take(None).await {
        LeaseOutcome::Finished {
            fingerprint,
            response,
        } => {
            assert_eq!(fingerprint, claim_a.fingerprint);
            assert_eq!(&response.body[..], b"{\"paid\":true}");
        }
        other => panic!("not finished: {other:?}"),
    }

    // Released before any external step: the row goes, and the key starts
    // afresh at token 1.
    let claim_b = claim_of("acct", "released", 7, Duration::ZERO);
    let (token, _) = owned(
        DB::lease(pool, Acquire::default(), table, &lease(claim_b, None))
            .await
            .unwrap(),
    );
    let released = Holder {
        key: "released".into(),
        ..holder(token)
    };
    assert!(
        DB::release(&mut *one(pool).await, table, &released, Release::Delete)
            .await
            .unwrap()
    );
    let (again, recovery) = owned(
        DB::lease(pool, Acquire::default(), table, &lease(claim_b, None))
            .await
            .unwrap(),
    );
    assert_eq!((again, recovery), (1, None));
}

/// A connection for one statement, back to the pool when dropped (an
/// in-memory SQLite pool has one connection, which the claims need too).
async fn one<DB: Backend>(pool: &Pool<DB>) -> sqlx::pool::PoolConnection<DB> {
    pool.acquire().await.unwrap()
}

/// The operators' key operations of `pool`'s `table`, as
/// [`Idem::lookup`](crate::Idem::lookup), `recent` and `forget` ask them
/// of the store.
struct Keys<'a, DB: Admin> {
    pool: &'a Pool<DB>,
    table: &'a str,
}

impl<DB: Admin> Keys<'_, DB> {
    async fn lookup(&self, scope: &str, key: &str) -> Option<KeyInfo> {
        let row = DB::lookup(self.pool, self.table, scope, key).await;
        row.unwrap().map(super::admin::KeyRow::into_info)
    }

    async fn recent(&self, scope: &str, limit: u32) -> Vec<KeyInfo> {
        let rows = DB::recent(self.pool, self.table, scope, limit.min(MAX_RECENT)).await;
        rows.unwrap()
            .into_iter()
            .map(|row| row.into_info())
            .collect()
    }

    /// What a forget answers: a key this process has in flight is
    /// refused before the store is asked; a delete that deleted nothing
    /// is told from a key in flight by a read.
    async fn forget(&self, scope: &str, key: &str) -> Forgotten {
        let (slot, _) = single_flight::flight_slot(self.pool, self.table, scope, key);
        if single_flight::in_flight(&slot).is_some() {
            return Forgotten::InFlight;
        }
        match DB::forget(self.pool, self.table, scope, key).await.unwrap() {
            Forgotten::Absent => match self.lookup(scope, key).await {
                Some(info) if info.state == KeyState::InFlight => Forgotten::InFlight,
                Some(info) => panic!("{key}: left behind, {:?}", info.state),
                None => Forgotten::Absent,
            },
            forgotten => forgotten,
        }
    }
}

/// The operators' key operations on `table` (what `Idem::lookup`, `recent`
/// and `forget` ask of the store), as every engine keeps them: a finished
/// key read back and forgotten, after which it is claimed afresh; keys in
/// flight (an open atomic claim, a phased lease) refused; expired keys
/// forgotten; a scope's recent keys newest first, within the limit.
pub(crate) async fn admin_contract<DB: super::Phased + Admin>(pool: &Pool<DB>, table: &str) {
    use std::time::SystemTime;

    use super::{LeaseClaim, LeaseOutcome};
    use crate::request::StoredRequest;

    let keys_of = Keys { pool, table };
    let finish = async |claim: &Claim<'_>, status| {
        finished(pool, table, claim, &response(status, "{}")).await;
    };

    // A finished key: read back, forgotten once, then claimed afresh.
    let done = claim_of("admin", "done", 3, Duration::ZERO);
    finish(&done, http::StatusCode::CREATED).await;
    let info = keys_of.lookup("admin", "done").await.expect("found");
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(info.status, Some(201));
    assert_eq!(info.fingerprint, "03".repeat(32));
    assert_eq!((info.method, info.path, info.leased), (None, None, false));
    assert!(info.phases.is_empty());
    assert!(info.created <= SystemTime::now() + Duration::from_secs(60));
    assert!(info.expires > info.created);
    assert_eq!(keys_of.forget("admin", "done").await, Forgotten::Deleted);
    assert!(keys_of.lookup("admin", "done").await.is_none());
    assert_eq!(keys_of.forget("admin", "done").await, Forgotten::Absent);
    finish(&done, http::StatusCode::OK).await;

    // An atomic claim in progress is refused, and keeps its key.
    let open = claim_of("admin", "open", 4, Duration::ZERO);
    assert!(
        !DB::claim_in_flight(pool, table, "admin", "open")
            .await
            .unwrap()
    );
    let mut conn = claimed(pool, table, &open, "a new key").await;
    assert_eq!(keys_of.forget("admin", "open").await, Forgotten::InFlight);
    // Seen from another session (the contract's pool is another process's
    // view): by the claim's lock, where the engine can tell.
    assert_eq!(
        DB::claim_in_flight(pool, table, "admin", "open")
            .await
            .unwrap(),
        DB::SEES_CLAIMS
    );
    DB::finish(
        &mut conn,
        table,
        Some(&open),
        Some(&response(http::StatusCode::ACCEPTED, "{}")),
    )
    .await
    .expect("the claim finishes after the refused forget");
    conn.release();
    let info = keys_of.lookup("admin", "open").await.expect("found");
    assert_eq!((info.state, info.status), (KeyState::Completed, Some(202)));
    assert!(
        !DB::claim_in_flight(pool, table, "admin", "open")
            .await
            .unwrap()
    );

    // A phased key under its lease: in flight, with its request and the
    // names (not the values) of what it recorded; refused.
    let uri = "/v1/payments?x=1".parse().unwrap();
    let request = StoredRequest::encode(
        &http::Method::POST,
        &uri,
        &http::HeaderMap::new(),
        b"{\"amount\":1}",
    );
    let phased = claim_of("admin", "phased", 5, Duration::ZERO);
    let lease = |claim| LeaseClaim {
        claim,
        lease: Duration::from_secs(30),
        request: &request,
        reserved: None,
        // No limit here: the claims' limit has its own tests.
        max_attempts: u32::MAX,
    };
    let LeaseOutcome::Owned { token, .. } =
        DB::lease(pool, Acquire::default(), table, &lease(phased))
            .await
            .unwrap()
    else {
        panic!("a new phased key was not owned");
    };
    let holder = super::Holder {
        scope: "admin".into(),
        key: "phased".into(),
        token,
    };
    let recovery = br#"{"steps":{"reserve":{"id":"secret"},"charge":1},"external":true}"#;
    assert!(
        DB::record(
            &mut *one(pool).await,
            table,
            &holder,
            recovery,
            Duration::from_secs(30)
        )
        .await
        .unwrap()
    );
    let info = keys_of.lookup("admin", "phased").await.expect("found");
    assert_eq!(info.state, KeyState::InFlight);
    assert!(info.leased);
    assert!(
        info.lease_until
            .is_some_and(|until| until > SystemTime::now())
    );
    assert_eq!(info.phases, ["charge", "reserve"]);
    assert!(info.external);
    assert_eq!(info.method.as_deref(), Some("POST"));
    assert_eq!(info.path.as_deref(), Some("/v1/payments?x=1"));
    assert_eq!(info.status, None);
    assert_eq!(keys_of.forget("admin", "phased").await, Forgotten::InFlight);
    assert!(keys_of.lookup("admin", "phased").await.is_some());

    // Expired keys, finished or not, can be forgotten.
    let short = |key| Claim {
        ttl: Duration::from_millis(1),
        ..claim_of("admin", key, 6, Duration::ZERO)
    };
    finish(&short("expired"), http::StatusCode::CREATED).await;
    let LeaseOutcome::Owned { .. } =
        DB::lease(pool, Acquire::default(), table, &lease(short("abandoned")))
            .await
            .unwrap()
    else {
        panic!("a new phased key was not owned");
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    for key in ["expired", "abandoned"] {
        let info = keys_of.lookup("admin", key).await.expect("found");
        assert_eq!(info.state, KeyState::Expired, "{key}");
        assert!(!info.leased, "{key}");
        assert_eq!(
            keys_of.forget("admin", key).await,
            Forgotten::Deleted,
            "{key}"
        );
    }

    // A scope's recent keys: newest first, within the limit, no other
    // scope's.
    for key in ["r0", "r1", "r2", "r3", "r4"] {
        finish(
            &claim_of("recent", key, 7, Duration::ZERO),
            http::StatusCode::CREATED,
        )
        .await;
    }
    let keys =
        |infos: Vec<KeyInfo>| -> Vec<String> { infos.into_iter().map(|info| info.key).collect() };
    assert_eq!(keys(keys_of.recent("recent", 3).await), ["r4", "r3", "r2"]);
    assert_eq!(
        keys(keys_of.recent("recent", u32::MAX).await),
        ["r4", "r3", "r2", "r1", "r0"]
    );
    assert!(keys_of.recent("nobody", 10).await.is_empty());
}

/// The outbox's and consumers' storage contract: messages exist only once
/// committed; a lease is exclusive, in order, a prefix of each scope, and
/// lapses; marks and unleases name their token; a scope whose head failed
/// shows with its error until that head is delivered; a processed message is
/// recorded once, with its transaction, until its retention ends.
pub(crate) async fn outbox_contract<DB: Backend>(pool: &Pool<DB>, outbox: &str, consumed: &str) {
    use super::NewMessage;
    use sqlx::Connection;

    DB::migrate_outbox(pool, outbox, consumed)
        .await
        .expect("migrate");
    DB::migrate_outbox(pool, outbox, consumed)
        .await
        .expect("a second migration changes nothing");
    let message = |id: &'static str, scope: &'static str| NewMessage {
        id,
        scope,
        topic: "email",
        payload: b"{}",
    };
    let lease = |token: i64, lease: Duration| DB::lease_messages(pool, outbox, token, lease, 10);
    let ids =
        |rows: &[super::MessageRow]| rows.iter().map(|row| row.id.clone()).collect::<Vec<_>>();
    let seqs = |rows: &[super::MessageRow]| rows.iter().map(|row| row.seq).collect::<Vec<_>>();
    let minute = Duration::from_secs(60);
    let failed = |retry_after, error| super::Failure { retry_after, error };

    // A rolled-back transaction's messages never exist.
    let mut conn = pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    DB::enqueue(&mut tx, outbox, &message("gone", "a"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(lease(1, minute).await.unwrap().is_empty());

    let mut tx = conn.begin().await.unwrap();
    for (id, scope) in [
        ("a1", "a"),
        ("b1", "b"),
        ("a2", "a"),
        ("c1", "c"),
        ("c2", "c"),
    ] {
        DB::enqueue(&mut tx, outbox, &message(id, scope))
            .await
            .unwrap();
    }
    // Uncommitted: not seen. (SQLite's lease would wait for the writer.)
    assert_eq!(DB::pending_messages(pool, outbox).await.unwrap(), 0);
    tx.commit().await.unwrap();
    assert_eq!(DB::pending_messages(pool, outbox).await.unwrap(), 5);

    let first = lease(1, minute).await.unwrap();
    assert_eq!(
        ids(&first),
        ["a1", "b1", "a2", "c1", "c2"],
        "in the order written"
    );
    assert_eq!(first[0].scope, b"a");
    assert_eq!(first[0].payload, b"{}");
    assert_eq!(first[0].attempts, 0);
    assert!(
        lease(2, minute).await.unwrap().is_empty(),
        "leased messages are not leased twice"
    );

    // c1 failed and waits a minute, c2 behind it; a1 failed and may go
    // again at once.
    let [a1, b1, a2, c1, c2] = seqs(&first)[..] else {
        unreachable!()
    };
    assert_eq!(
        DB::unlease(pool, outbox, 1, &[c1], Some(failed(minute, "c1 refused")))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        DB::unlease(
            pool,
            outbox,
            1,
            &[a1],
            Some(failed(Duration::ZERO, "a1 refused"))
        )
        .await
        .unwrap(),
        1
    );
    assert_eq!(
        DB::unlease(pool, outbox, 1, &[b1, a2, c2], None)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        DB::unlease(pool, outbox, 1, &[b1], None).await.unwrap(),
        0,
        "no longer ours"
    );
    // Each failed head shows with its error, the most failed then the
    // oldest first; b never failed.
    let failing = DB::failing_scopes(pool, outbox, 10).await.unwrap();
    let shown: Vec<_> = failing
        .iter()
        .map(|row| {
            (
                &row.scope[..],
                row.pending,
                row.attempts,
                row.last_error.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            (&b"a"[..], 2, 1, Some("a1 refused")),
            (&b"c"[..], 2, 1, Some("c1 refused")),
        ]
    );
    assert!(
        failing[1].next_attempt_ms - failing[0].next_attempt_ms > 50_000,
        "c1 waits its minute: {failing:?}"
    );
    assert_eq!(
        DB::failing_scopes(pool, outbox, 1).await.unwrap().len(),
        1,
        "limited"
    );
    let second = lease(2, Duration::ZERO).await.unwrap();
    assert_eq!(
        ids(&second),
        ["a1", "b1", "a2"],
        "a scope's messages wait behind a failed one"
    );
    assert_eq!(second[0].attempts, 1, "the failure is counted");
    // A lease that lapsed (a relay that stopped) is taken again.
    let third = lease(3, minute).await.unwrap();
    assert_eq!(seqs(&third), [a1, b1, a2], "a lapsed lease is taken again");
    assert_eq!(
        DB::mark_delivered(pool, outbox, 2, &[a1, b1, a2])
            .await
            .unwrap(),
        0,
        "another token"
    );
    assert_eq!(
        DB::mark_delivered(pool, outbox, 3, &[a1, b1, a2])
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        DB::mark_delivered(pool, outbox, 3, &[a1]).await.unwrap(),
        0,
        "once"
    );
    assert_eq!(DB::pending_messages(pool, outbox).await.unwrap(), 2);
    let failing = DB::failing_scopes(pool, outbox, 10).await.unwrap();
    assert_eq!(
        failing.iter().map(|row| &row.scope[..]).collect::<Vec<_>>(),
        [b"c"],
        "a's failed head was delivered"
    );
    assert!(lease(4, minute).await.unwrap().is_empty(), "c waits for c1");
    assert_eq!(
        DB::sweep_delivered(pool, outbox, minute, 10).await.unwrap(),
        0,
        "kept"
    );
    assert_eq!(
        DB::sweep_delivered(pool, outbox, Duration::ZERO, 2)
            .await
            .unwrap(),
        2,
        "batched"
    );
    assert_eq!(
        DB::sweep_delivered(pool, outbox, Duration::ZERO, 10)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        DB::pending_messages(pool, outbox).await.unwrap(),
        2,
        "undelivered stay"
    );

    // A processed message is recorded once, with its transaction.
    let record = async |id: &str, retention: Duration, commit: bool| {
        let mut conn = pool.acquire().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let new = DB::record_consumed(&mut tx, consumed, "ledger", id, retention)
            .await
            .unwrap();
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        new
    };
    assert!(record("m1", minute, true).await);
    assert!(!record("m1", minute, true).await, "recorded before");
    assert!(record("m2", minute, false).await);
    assert!(
        record("m2", minute, true).await,
        "a rolled-back record is no record"
    );
    assert!(record("m3", Duration::ZERO, true).await);
    assert!(
        record("m3", minute, true).await,
        "past its retention, taken over"
    );
    assert!(record("m4", Duration::ZERO, true).await);
    assert_eq!(
        DB::sweep_consumed(pool, consumed, 10).await.unwrap(),
        1,
        "m4 only"
    );
    assert!(!record("m1", minute, true).await, "m1 kept");

    // A second delivery at the same moment waits for the first's commit.
    let mut tx = conn.begin().await.unwrap();
    assert!(
        DB::record_consumed(&mut tx, consumed, "ledger", "m5", minute)
            .await
            .unwrap()
    );
    let second = tokio::spawn({
        let pool = pool.clone();
        let consumed = consumed.to_owned();
        async move {
            let mut conn = pool.acquire().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            let new =
                DB::record_consumed(&mut tx, &consumed, "ledger", "m5", Duration::from_secs(60))
                    .await
                    .unwrap();
            tx.rollback().await.unwrap();
            new
        }
    });
    tx.commit().await.unwrap();
    assert!(
        !second.await.unwrap(),
        "the concurrent delivery is a duplicate"
    );
}

/// A contract that drives the protocol (encryption at rest, hashed keys)
/// as one test per engine whose feature is on, named as given: each in a
/// key table of its own (`label`), which the test drops after.
macro_rules! contract_on_every_engine {
    ($contract:ident, $label:literal: $postgres:ident, $mysql:ident, $sqlite:ident) => {
        /// The contract on PostgreSQL.
        #[cfg(feature = "postgres")]
        #[tokio::test]
        async fn $postgres() {
            use crate::backend::postgres::tests::{drop_table, table, test_pool};
            let pool = test_pool(4, |options| options).await;
            let table = table(&pool, $label).await;
            $contract(&pool, &table).await;
            drop_table(&pool, &table).await;
        }

        /// The contract on MySQL/MariaDB.
        #[cfg(feature = "mysql")]
        #[tokio::test]
        async fn $mysql() {
            use crate::backend::mysql::tests::{drop_table, key_table, test_pool};
            let pool = test_pool(4).await;
            let table = key_table(&pool, $label).await;
            $contract(&pool, &table).await;
            drop_table(&pool, &table).await;
        }

        /// The contract on SQLite.
        #[cfg(feature = "sqlite")]
        #[tokio::test]
        async fn $sqlite() {
            let pool = crate::backend::sqlite::tests::key_table().await;
            $contract(&pool, "keys").await;
        }
    };
}
pub(crate) use contract_on_every_engine;
