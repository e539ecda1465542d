//! What the engines' tests share: the test of an expired key's takeover,
//! for which each engine's test writes the expired row and the lock on it.

use std::future::Future;
use std::time::Duration;

use sqlx::Pool;

use super::{Acquire, Backend, Claim, ClaimOutcome};
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

/// A claim of `key` in `scope` as the engines' tests make them: kept a
/// minute, its fingerprint `fill` repeated, a 30 s deadline.
pub(crate) fn claim_of<'a>(scope: &'a str, key: &'a str, fill: u8, wait: Duration) -> Claim<'a> {
    Claim {
        scope,
        key,
        fingerprint: Fingerprint::from_bytes(&[fill; 32]).unwrap(),
        ttl: Duration::from_secs(60),
        wait,
        timeout_ms: 30_000,
    }
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
    match DB::claim(pool, Acquire::default(), table, &claim)
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(mut conn) => {
            let response = StoredResponse {
                status: http::StatusCode::CREATED,
                headers: Vec::new(),
                body: "{}".into(),
            };
            DB::finish(&mut conn, table, Some(&claim), Some(&response))
                .await
                .expect("finish");
            conn.release();
        }
        other => panic!("the expired key was not taken over: {other:?}"),
    }
}
