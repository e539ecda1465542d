//! The atomic mode: the claim, the handler's writes and its stored
//! response commit together in the request's one transaction, or none of
//! them does.

use std::borrow::Cow;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use crate::backend::{
    Backend, Claim, ClaimOutcome, FinishError, OpenTx, StoreError, abandon, is_gone,
    transaction_depth,
};
use crate::idem::Idem;
use crate::key::IdempotencyKey;
use crate::observe::{self, Outcome};
use crate::problem::{OperationState, Problem};
use crate::response::{CaptureError, StoredResponse};
use crate::tx::Tx;

use super::{
    Answer, DynHandler, Prepared, answer_finished, answer_tombstone, answer_uncertain, call_once,
    read_seen, record, retry_after_secs, scope_too_long, tombstone_write,
};

/// Claims the key in `scope`, runs the handler once, stores its response in
/// the handler's own commit, or answers from the store without running it.
///
/// Generic over the handler only as a thin shim: the protocol itself,
/// `run_dyn`, is instantiated once per database.
pub async fn run<'f, DB, H, Fut>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: H,
) -> Response
where
    DB: Backend,
    H: FnOnce(Tx<DB>) -> Fut + Send,
    Fut: Future<Output = Answer> + Send + 'f,
{
    run_dyn(idem, prepared, scope, &mut call_once(handler)).await
}

/// `run`, with the handler behind a `dyn`.
async fn run_dyn<'f, DB: Backend>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> Response {
    let span = prepared.span.clone();
    let (outcome, response) = match prepared.key {
        Some((key, fingerprint)) => {
            let (stored_scope, stored_key) = idem.stored(&scope, &key);
            record(&span, &stored_scope, Some(&stored_key));
            let claim = prepared
                .config
                .claim(&idem, &stored_scope, &stored_key, fingerprint);
            run_keyed(&idem, &claim, &(&scope, &key), handler)
                .instrument(span.clone())
                .await
        }
        None => {
            if !span.is_disabled() {
                record(&span, &idem.stored_scope(&scope), None);
            }
            run_without_key(&idem, prepared.config.timeout, handler)
                .instrument(span.clone())
                .await
        }
    };
    observe::finish(&span, outcome);
    idem.typed(response)
}

/// `caller`: the clear scope and key, as the handler sees them (the claim
/// has them as the table keeps them).
async fn run_keyed<'f, DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    caller: &(&str, &str),
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> (Outcome, Response) {
    if let Some(refused) = scope_too_long(claim) {
        return refused;
    }
    let started = std::time::Instant::now();
    let claimed = claim_or_read(idem, claim).await;
    let conn = match claimed {
        Ok(ClaimOutcome::Claimed(conn)) => {
            observe::claim_latency("claimed", started.elapsed());
            conn
        }
        Ok(ClaimOutcome::Finished {
            fingerprint,
            response,
        }) => {
            observe::claim_latency("finished", started.elapsed());
            return answer_finished(idem, claim, fingerprint, response);
        }
        Ok(ClaimOutcome::InUse { running }) => {
            observe::claim_latency("in_use", started.elapsed());
            let problem = if running {
                Problem::KeyInUse
            } else {
                Problem::KeyHeld
            };
            return (Outcome::InUse, problem.into_response());
        }
        Err(StoreError::Uncertain { fingerprint }) => {
            // A phased key of the same scope and key, given up.
            observe::claim_latency("finished", started.elapsed());
            return answer_uncertain(claim, &fingerprint);
        }
        Err(StoreError::Tombstone(tombstone)) => {
            observe::claim_latency("finished", started.elapsed());
            return answer_tombstone(idem, claim, &tombstone);
        }
        Err(StoreError::Orphaned { bound }) => {
            observe::claim_latency("error", started.elapsed());
            tracing::warn!(
                bound_ms = bound.as_millis(),
                "the key store connection was lost during the claim; the key is held until \
                 the server ends that session"
            );
            let retry_after = retry_after_secs(bound);
            return (
                Outcome::StoreUnavailable,
                Problem::ConnectionLost { retry_after }.into_response(),
            );
        }
        Err(error) => {
            observe::claim_latency("error", started.elapsed());
            tracing::warn!(error = %error, "idempotency key store unavailable");
            return (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.into_response(),
            );
        }
    };
    let key = IdempotencyKey::new(caller.0.to_owned(), caller.1.to_owned());
    let executed = execute(conn, Some(key), idem, claim.timeout(), handler).await;
    let (response, mut conn, wrote_outbox) = match executed {
        Ok((answer, conn, wrote)) if answer.commits() => (answer.response, conn, wrote),
        Ok((answer, conn, _)) => return rolled_back(conn, idem, claim, answer.response).await,
        Err(ended) => return ended,
    };
    let (stored, parts) = match StoredResponse::capture(
        response,
        idem.replay_header_names(),
        idem.response_cap(),
    )
    .await
    {
        Ok(captured) => captured,
        Err(error) => {
            abandon(conn).await;
            let response = match error {
                CaptureError::TooLarge { limit } => {
                    tracing::error!(
                        limit,
                        "idempotent handler's response exceeds the stored-response cap; \
                             its transaction was rolled back (raise Idem::max_response_bytes)"
                    );
                    Problem::ResponseNotStored.into_response()
                }
                CaptureError::Body(error) => {
                    tracing::error!(error = %error, "idempotent handler's response body failed; rolled back");
                    Problem::HandlerPanicked.into_response()
                }
            };
            return (Outcome::RolledBack, response);
        }
    };
    let mut encoded = stored.seal(&idem.sealer(), claim.scope, claim.key);
    encoded.tombstone = tombstone_write(
        idem,
        (claim.scope, claim.key),
        claim.ttl,
        claim.tombstone(),
        &parts,
    );
    match DB::finish(&mut conn, idem.table_name(), Some(claim), Some(&encoded)).await {
        Ok(()) => {
            conn.release();
            // Committed: the messages exist now, so a relay woken finds them.
            if wrote_outbox {
                idem.wake_relays();
            }
            idem.finished_keys().remember(claim.scope, claim.key);
            (Outcome::Claimed, stored.into_original(parts))
        }
        Err(error) => commit_failed(conn, error, true).await,
    }
}

/// Claims the key; a key this process saw finish is first looked up with a
/// plain read, which answers a retry without the claim's transaction (see
/// `recent`).
async fn claim_or_read<DB: Backend>(
    idem: &Idem<DB>,
    claim: &Claim<'_>,
) -> Result<ClaimOutcome<DB>, StoreError> {
    if let Some(finished) = read_seen(idem, claim).await? {
        return Ok(finished);
    }
    let claimed = DB::claim(idem.pool(), idem.acquire(), idem.table_name(), claim).await;
    if let Ok(ClaimOutcome::Finished { .. }) = &claimed {
        idem.finished_keys().remember(claim.scope, claim.key);
    }
    claimed
}

/// The answer to a claimed request whose handler's answer will not be
/// stored: rolled back, and the handler's answer, except where that is a
/// 5xx and its connection turns out lost (a failover, a cut, a session the
/// server ended): then 503 with `Retry-After`, which a retry with the same
/// key can act on, unless the claim's row is found committed without a
/// response (the handler committed its own transaction, and the key
/// answers 409 until it expires).
async fn rolled_back<DB: Backend>(
    conn: OpenTx<DB>,
    idem: &Idem<DB>,
    claim: &Claim<'_>,
    response: Response,
) -> (Outcome, Response) {
    let stranded = match abandon_keyed(conn, idem, claim).await {
        Abandoned::Open => return (Outcome::RolledBack, response),
        Abandoned::Gone { stranded } => stranded,
    };
    if !response.status().is_server_error() || stranded == Some(true) {
        return (Outcome::RolledBack, response);
    }
    // Nothing of the claim is committed (`Some(false)`), or the store is
    // down and cannot say (`None`), where only a handler that committed its
    // own transaction, outside the contract, leaves a row behind.
    tracing::warn!(
        status = response.status().as_u16(),
        checked = stranded.is_some(),
        "the key store connection was lost during the handler; answering 503"
    );
    (
        Outcome::StoreUnavailable,
        Problem::StoreUnavailable.into_response(),
    )
}

/// How a rolled-back request's connection ended.
enum Abandoned {
    /// The connection answered the rollback (and the check of the key).
    Open,
    /// The connection was gone. `stranded`: whether the key's row is there
    /// without a response, as another connection read it; `None` if it
    /// could not be read within [`STRANDED_CHECK`].
    Gone { stranded: Option<bool> },
}

/// How long a request whose connection was lost waits for another to
/// look at its key.
const STRANDED_CHECK: Duration = Duration::from_secs(1);

/// Rolls back a claimed request that will not be stored, and says so where
/// the handler had committed the transaction itself: its claim row stayed,
/// without a response, and the key answers 409 until it expires.
async fn abandon_keyed<DB: Backend>(
    mut conn: OpenTx<DB>,
    idem: &Idem<DB>,
    claim: &Claim<'_>,
) -> Abandoned {
    // A rollback can fail because the handler's own commit left nothing to
    // roll back (SQLite says so): the check runs either way, and only a
    // connection whose rollback and check both succeeded goes back.
    let rolled_back = DB::rollback(&mut conn).await;
    if let Err(error) = &rolled_back {
        tracing::warn!(%error, "rollback failed; closing the connection");
    }
    let gone = matches!(&rolled_back, Err(error) if is_gone::<DB>(error));
    let checked = if gone {
        drop(conn);
        let check = async {
            let mut other = idem.pool().acquire().await?;
            DB::stranded(&mut other, idem.table_name(), claim).await
        };
        // Boxed: sqlx's acquisition would otherwise sit in every request's
        // future (see `OpenTx::acquire`).
        tokio::time::timeout(STRANDED_CHECK, Box::pin(check))
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut))
    } else {
        let checked = DB::stranded(&mut conn, idem.table_name(), claim).await;
        if rolled_back.is_ok() && checked.is_ok() {
            conn.release();
        }
        checked
    };
    match &checked {
        Ok(true) => tracing::error!(
            scope = observe::redact(&[claim.scope]),
            key = observe::redact(&[claim.scope, claim.key]),
            "an idempotent handler committed its transaction itself and then failed: \
             its key is held without a response and answers 409 until it expires"
        ),
        Ok(false) => {}
        Err(error) => tracing::debug!(%error, "checking the key after a rollback failed"),
    }
    if gone {
        Abandoned::Gone {
            stranded: checked.ok(),
        }
    } else {
        Abandoned::Open
    }
}

/// A request without a key on a `key = "optional"` handler: one plain
/// transaction, committed on a storable answer, nothing remembered.
async fn run_without_key<'f, DB: Backend>(
    idem: &Idem<DB>,
    timeout: Duration,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> (Outcome, Response) {
    let conn = match DB::begin(idem.pool(), idem.acquire()).await {
        Ok(conn) => conn,
        Err(error) => {
            tracing::warn!(error = %error, "database unavailable");
            return (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.into_response(),
            );
        }
    };
    let (response, mut conn, wrote_outbox) = match execute(conn, None, idem, timeout, handler).await
    {
        Ok((answer, conn, wrote)) if answer.commits() => (answer.response, conn, wrote),
        Ok((answer, conn, _)) => {
            abandon(conn).await;
            return (Outcome::RolledBack, answer.response);
        }
        Err(ended) => return ended,
    };
    match DB::finish(&mut conn, idem.table_name(), None, None).await {
        Ok(()) => {
            conn.release();
            if wrote_outbox {
                idem.wake_relays();
            }
            (Outcome::Unkeyed, response)
        }
        Err(error) => commit_failed(conn, error, false).await,
    }
}

/// Runs the handler on the claimed transaction and takes the connection
/// back, with whether the handler wrote to the outbox. A panic, or a `Tx`
/// that outlives its handler, rolls back.
async fn execute<'f, DB: Backend>(
    conn: OpenTx<DB>,
    key: Option<IdempotencyKey>,
    idem: &Idem<DB>,
    timeout: Duration,
    handler: &mut DynHandler<'_, 'f, Tx<DB>>,
) -> Result<(Answer, OpenTx<DB>, bool), (Outcome, Response)> {
    let outbox = Arc::clone(&idem.inner().messages.outbox);
    let (tx, mut back) = Tx::new(conn, key, outbox);
    let run = tokio::time::timeout(timeout, AssertUnwindSafe(handler(tx)).catch_unwind());
    let outcome = match run.await {
        Ok(outcome) => outcome,
        Err(_elapsed) => {
            // The handler was dropped where it stood, perhaps inside a
            // statement: its connection is closed, never reused, and the
            // server rolls its transaction back.
            drop(back.try_recv());
            tracing::warn!(
                timeout_ms = timeout.as_millis(),
                "idempotent handler passed its deadline; dropped and rolled back"
            );
            return Err((Outcome::TimedOut, Problem::HandlerTimeout.into_response()));
        }
    };
    let mut conn = back.try_recv();
    // Whether the handler left the transaction as the claim opened it.
    let intact = match &mut conn {
        Ok((conn, _)) => settled_depth(conn).await == 1,
        Err(_) => false,
    };
    let response = match outcome {
        Ok(answer) => answer,
        Err(_) => {
            // A connection whose transaction the handler ended is closed.
            if let Ok((conn, _)) = conn
                && intact
            {
                abandon(conn).await;
            }
            tracing::error!("idempotent handler panicked; its transaction was rolled back");
            return Err((
                Outcome::RolledBack,
                Problem::HandlerPanicked.into_response(),
            ));
        }
    };
    match conn {
        Ok((conn, wrote)) if intact => Ok((response, conn, wrote)),
        Ok((conn, _)) => {
            // Not the transaction the claim opened: something in the handler
            // ended it (see `Tx`'s `DerefMut`) or left a savepoint open. What
            // the connection is in is unknown, so it is dropped unreleased,
            // which closes it and rolls back whatever is still open.
            tracing::error!(
                depth = transaction_depth::<DB>(&conn),
                "an idempotent handler's transaction ended or changed inside the handler; \
                 nothing was committed by idem"
            );
            drop(conn);
            Err((
                Outcome::RolledBack,
                Problem::TransactionFailed.into_response(),
            ))
        }
        Err(_) => {
            // Dropping the stray Tx later closes its connection, which
            // rolls the transaction back on the server.
            tracing::error!(
                "an idempotent handler kept its Tx after returning; nothing was committed"
            );
            Err((
                Outcome::RolledBack,
                Problem::HandlerPanicked.into_response(),
            ))
        }
    }
}

/// The transactions sqlx counts on the connection once it has caught up:
/// 1, the request's, while the handler has not ended it. sqlx's SQLite
/// driver lowers its count for a savepoint the handler dropped on its
/// worker thread, after the drop; a round trip through the worker (a ping)
/// settles it, and is spent only when the count is not 1.
async fn settled_depth<DB: Backend>(conn: &mut OpenTx<DB>) -> usize {
    use sqlx::Connection as _;
    if transaction_depth::<DB>(conn) != 1 {
        // A failed ping leaves the count as it is, which then fails the
        // request.
        let _ = conn.ping().await;
    }
    transaction_depth::<DB>(conn)
}

/// The commit failed, so the client must not be told the work succeeded.
/// If the commit did land, a retry with the key replays it; if not, a retry
/// redoes it. Without a key (`keyed` false) nothing tells which. (A commit
/// lost with a half-open connection leaves its session holding the key
/// until the server ends it; the retries meanwhile get 409 with
/// `Retry-After`. Most lost commits free the key at once, so the first
/// retry is invited soon.)
async fn commit_failed<DB: Backend>(
    conn: OpenTx<DB>,
    error: FinishError,
    keyed: bool,
) -> (Outcome, Response) {
    abandon(conn).await;
    match error {
        FinishError::Ended(error) => {
            tracing::error!(
                error = %error,
                "the handler's transaction had already failed when it answered \
                 (a database error the handler did not return?); rolled back"
            );
            (
                Outcome::RolledBack,
                Problem::TransactionFailed.into_response(),
            )
        }
        FinishError::Store(error) => {
            tracing::warn!(error = %error, "committing the handler's transaction failed");
            // The commit may have landed: with a key, a retry tells
            // (its replay, or a first run); without one nothing does.
            let response = if keyed {
                Problem::StoreUnavailable.answer(OperationState::InProgress)
            } else {
                Problem::CommitOutcomeUnknown.into_response()
            };
            (Outcome::StoreUnavailable, response)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::HandlerFuture;
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::idem::tests::idem;

    /// sqlx's `acquire` future is several KiB; held inline, it would make
    /// every idempotent handler's future as big, and each `.await` on the
    /// way down would copy it. The backends box it (sizes measured either
    /// way: docs/design.md).
    #[tokio::test]
    async fn the_wrapper_future_stays_small() {
        fn size<DB: Backend>(idem: &Idem<DB>) -> (usize, usize) {
            let claim = Claim {
                scope: "s",
                key: "k",
                fingerprint: Fingerprint::from_bytes(&[0; 32]).unwrap(),
                ttl: Duration::from_secs(1),
                tombstone_ms: None,
                wait: Duration::ZERO,
                timeout_ms: 30_000,
                advisory: true,
                pooled: false,
            };
            let acquire = std::mem::size_of_val(&idem.pool().acquire());
            let mut answer = |_tx| -> HandlerFuture<'static> {
                Box::pin(async move { Answer::new(Response::default(), false) })
            };
            let run = std::mem::size_of_val(&run_keyed(idem, &claim, &("s", "k"), &mut answer));
            (run, acquire)
        }
        let mut sizes = vec![("postgres", size(&idem()))];
        #[cfg(feature = "sqlite")]
        sizes.push((
            "sqlite",
            size(&Idem::new(
                sqlx::SqlitePool::connect_lazy("sqlite::memory:").unwrap(),
            )),
        ));
        #[cfg(feature = "mysql")]
        sizes.push((
            "mysql",
            size(&Idem::new(
                sqlx::MySqlPool::connect_lazy("mysql://127.0.0.1:1/none").unwrap(),
            )),
        ));
        // 2440 on PostgreSQL: the response as stored (sealed, maybe) waits
        // for the finish beside the handler's own (encryption at rest,
        // 64 bytes), the clear scope and key wait for the handler beside
        // the claim's (hashed keys, 16), and claims and stored responses
        // carry their tombstone (40; its write and read are boxed), and
        // PostgreSQL's claim may call the key table's functions (16: a
        // flag and the pool that forgets them; their lookup is boxed). An inlined acquire alone
        // would be 2560 more.
        for (engine, (run, acquire)) in sizes {
            assert!(
                run <= 2440,
                "{engine}: run_keyed's future is {run} bytes (acquire's: {acquire})"
            );
        }
    }
}
