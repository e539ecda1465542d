//! Claims and responses as the engine-level tests hand them to a
//! `Backend` directly.

use std::time::Duration;

use axum::http::StatusCode;
use idem::__private::{Claim, Fingerprint, StoredResponse};

/// A claim of key `k` in `scope`, kept a minute, its fingerprint `fill`
/// repeated, with a 30 s deadline.
pub fn claim(scope: &str, fill: u8, wait: Duration) -> Claim<'_> {
    Claim {
        scope,
        key: "k",
        fingerprint: Fingerprint::from_bytes(&[fill; 32]).unwrap(),
        ttl: Duration::from_secs(60),
        wait,
        timeout_ms: 30_000,
        advisory: true,
        pooled: false,
    }
}

/// A 201 with `body` and no headers, as a handler's answer is stored.
pub fn created(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: body.into(),
    }
}

/// Claims `claim`'s fresh key in the default key table; panics with
/// `what` if the key was not claimed.
pub async fn claimed<DB: idem::Backend>(
    pool: &sqlx::Pool<DB>,
    claim: &Claim<'_>,
    what: &str,
) -> idem::__private::OpenTx<DB> {
    match DB::claim(
        pool,
        idem::__private::Acquire::default(),
        "idem_keys",
        claim,
    )
    .await
    .unwrap()
    {
        idem::__private::ClaimOutcome::Claimed(conn) => conn,
        other => panic!("{what}: a fresh key is claimed, not {other:?}"),
    }
}
