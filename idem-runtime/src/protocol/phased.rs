//! One phased request: a claim that commits on its own with a lease, the
//! handler's phases (see [`Phases`]), and the response stored under the
//! fencing token with the last phase's writes.
//!
//! The failure rule: an attempt that fails (an error, a transient status,
//! a panic, its deadline) before any external step was attempted, in it or
//! an earlier attempt, deletes its key, so the next attempt starts afresh;
//! once one may have happened, the key and its recovery point stay, and the
//! next attempt (a client's retry or the completer) resumes.

use std::borrow::Cow;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use tracing::Instrument;

use super::{
    Answer, DynHandler, Prepared, answer_finished, answer_tombstone, answer_uncertain, call_once,
    read_seen, record, retry_after_secs, scope_too_long, tombstone_write,
};
use crate::backend::{
    Claim, ClaimOutcome, FinishError, Holder, LeaseClaim, LeaseOutcome, Phased, Release,
    StoreError, abandon, external_step,
};
use crate::completer::{give_up, make_uncertain, release};
use crate::idem::Idem;
use crate::key::IdempotencyKey;
use crate::observe::{self, Outcome};
use crate::phases::{PhaseState, Phases};
use crate::problem::{OperationState, Problem, restate};
use crate::recovery::Recovery;
use crate::request::StoredRequest;
use crate::resolve::Uncertainty;
use crate::response::{CaptureError, StoredResponse};
use crate::seal::Column;
use crate::wake::Written;

/// Claims the key with a lease (or resumes it), runs the handler's phases,
/// and stores its response with the last phase; see the module docs for
/// what a failure leaves.
pub async fn run_phased<'f, DB, H, Fut>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: H,
) -> Response
where
    DB: Phased,
    H: FnOnce(Phases<DB>) -> Fut + Send,
    Fut: Future<Output = Answer> + Send + 'f,
{
    run_dyn(idem, prepared, scope, &mut call_once(handler)).await
}

async fn run_dyn<'f, DB: Phased>(
    idem: Idem<DB>,
    prepared: Prepared,
    scope: Cow<'_, str>,
    handler: &mut DynHandler<'_, 'f, Phases<DB>>,
) -> Response {
    let span = prepared.span.clone();
    let Some((key, fingerprint)) = prepared.key else {
        // The attribute refuses `key = "optional"` with phases.
        observe::finish(&span, Outcome::Rejected);
        return idem.problem(Problem::KeyMissing);
    };
    let (stored_scope, stored_key) = idem.stored(&scope, &key);
    record(&span, &stored_scope, Some(&stored_key));
    let config = prepared.config;
    let request = prepared.request.as_deref().unwrap_or_default();
    // Where the table keeps hashes, the request names its caller, whom the
    // completer resumes it as.
    let request = match idem.key_hasher() {
        Some(_) => Cow::Owned(StoredRequest::with_caller(request, &scope, &key)),
        None => Cow::Borrowed(request),
    };
    // The request is kept sealed where the store encrypts.
    let request = idem
        .sealer()
        .seal(&stored_scope, &stored_key, Column::Request, &request);
    let claim = LeaseClaim {
        // A phased claim never waits for an attempt in flight.
        claim: Claim {
            wait: Duration::ZERO,
            ..config.claim(&idem, &stored_scope, &stored_key, fingerprint)
        },
        lease: config.lease.unwrap_or(Duration::from_secs(30)),
        request: &request,
        reserved: prepared.resumed.as_ref().map(|resumed| resumed.token),
        max_attempts: idem.attempts_limit(),
    };
    let backoff = prepared
        .resumed
        .as_ref()
        .map_or(Duration::ZERO, |resumed| resumed.backoff);
    let (outcome, response) = run_keyed(&idem, &claim, (&scope, &key), backoff, handler)
        .instrument(span.clone())
        .await;
    observe::finish(&span, outcome);
    idem.typed(response)
}

/// `caller`: the clear scope and key, as the handler sees them (the claim
/// has them as the table keeps them).
async fn run_keyed<'f, DB: Phased>(
    idem: &Idem<DB>,
    lease: &LeaseClaim<'_>,
    caller: (&str, &str),
    backoff: Duration,
    handler: &mut DynHandler<'_, 'f, Phases<DB>>,
) -> (Outcome, Response) {
    let claim = &lease.claim;
    if let Some(refused) = scope_too_long(claim) {
        return refused;
    }
    if let Some(replayed) = peek(idem, claim).await {
        return replayed;
    }
    let (token, recovery) = match claim_lease(idem, lease).await {
        Ok(owned) => owned,
        Err(answer) => return answer,
    };
    let holder = Holder {
        scope: claim.scope.to_owned(),
        key: claim.key.to_owned(),
        token,
    };
    let opened = idem.sealer().open_logged(
        claim.scope,
        claim.key,
        Column::Recovery,
        recovery.as_deref(),
    );
    let decoded = opened.map(|opened| Recovery::decode(opened.as_deref()));
    let recovery = match decoded {
        Ok(Ok(recovery)) => recovery,
        // Logged (once per key) by `open_logged`.
        Err(_) => {
            return (
                Outcome::StoreUnavailable,
                Problem::TransactionFailed.answer(OperationState::Uncertain),
            );
        }
        Ok(Err(error)) => {
            // Not a recovery point `idem` wrote: resuming from it could
            // repeat what it recorded. The key stays held for a human.
            tracing::error!(%error, "corrupt recovery point; the key is left as it is");
            return (
                Outcome::StoreUnavailable,
                Problem::TransactionFailed.answer(OperationState::Uncertain),
            );
        }
    };
    let resumed = !recovery.steps.is_empty() || recovery.external;
    if resumed {
        observe::resumed();
        tracing::info!(
            steps = recovery.steps.len(),
            "resuming an idempotent request from its recovery point"
        );
    }
    let state = PhaseState {
        idem: idem.clone(),
        holder,
        key: IdempotencyKey::new(caller.0.to_owned(), caller.1.to_owned()),
        lease: lease.lease,
        ttl: claim.ttl,
        tombstone: claim.tombstone(),
        recovery,
        resumed,
        fenced: false,
        last: None,
        seen: Vec::new(),
        written: Written::default(),
        uncertain: None,
    };
    let (phases, mut back) = Phases::new(state);
    let timeout = claim.timeout();
    let ran = tokio::time::timeout(timeout, AssertUnwindSafe(handler(phases)).catch_unwind()).await;
    // The handler's future is dropped by now, and its `Phases` with it.
    let Ok(mut state) = back.try_recv() else {
        tracing::error!(
            "a phased handler kept its Phases after returning; its key is released when its \
             lease ends"
        );
        return (
            Outcome::RolledBack,
            Problem::HandlerPanicked.into_response(),
        );
    };
    if state.fenced {
        if let Some(conn) = state.last.take() {
            abandon(conn).await;
        }
        observe::fenced();
        return (Outcome::Fenced, Problem::KeyInUse.into_response());
    }
    if let Some(step) = state.uncertain.take() {
        return settle_uncertain(state, &step).await;
    }
    let answer = match ran {
        Ok(Ok(answer)) if answer.commits() => answer,
        Ok(Ok(answer)) => {
            let left = fail(state, backoff).await;
            return (Outcome::RolledBack, restate(answer.response, left));
        }
        Ok(Err(_panic)) => {
            tracing::error!("phased handler panicked; its last phase was rolled back");
            let left = fail(state, backoff).await;
            return (Outcome::RolledBack, Problem::HandlerPanicked.answer(left));
        }
        Err(_elapsed) => {
            tracing::warn!(
                timeout_ms = timeout.as_millis(),
                "phased handler passed its deadline; dropped"
            );
            // The last phase may have been mid-statement: closed, not reused.
            drop(state.last.take());
            let left = fail(state, backoff).await;
            return (Outcome::TimedOut, Problem::HandlerTimeout.answer(left));
        }
    };
    store(idem, state, answer.response, backoff).await
}

/// Claims the key with a lease: our token and the recovery point to resume
/// from, or the answer to give instead. A key whose attempts are spent is
/// given up here (uncertain, or released and claimed afresh when it
/// provably did nothing).
async fn claim_lease<DB: Phased>(
    idem: &Idem<DB>,
    lease: &LeaseClaim<'_>,
) -> Result<(i64, Option<Vec<u8>>), (Outcome, Response)> {
    let claim = &lease.claim;
    // A released key is claimed again; one more round covers a race with
    // another attempt giving the same key up.
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let outcome = DB::lease(idem.pool(), idem.acquire(), idem.table_name(), lease).await;
        let latency = |what| observe::claim_latency(what, started.elapsed());
        match outcome {
            Ok(LeaseOutcome::Owned { token, recovery }) => {
                latency("claimed");
                return Ok((token, recovery));
            }
            Ok(LeaseOutcome::Finished {
                fingerprint,
                response,
            }) => {
                latency("finished");
                idem.finished_keys().remember(claim.scope, claim.key);
                return Err(answer_finished(idem, claim, fingerprint, response));
            }
            Ok(LeaseOutcome::Uncertain { fingerprint })
            | Err(StoreError::Uncertain { fingerprint }) => {
                latency("finished");
                return Err(answer_uncertain(claim, &fingerprint));
            }
            Err(StoreError::Tombstone(tombstone)) => {
                latency("finished");
                return Err(answer_tombstone(idem, claim, &tombstone));
            }
            Ok(LeaseOutcome::Leased { remaining }) => {
                latency("in_use");
                let retry_after = retry_after_secs(remaining).max(1);
                return Err((
                    Outcome::InUse,
                    Problem::KeyLeased { retry_after }.into_response(),
                ));
            }
            Ok(LeaseOutcome::Held) => {
                latency("in_use");
                return Err((Outcome::InUse, Problem::KeyHeld.into_response()));
            }
            Ok(LeaseOutcome::Reused) => {
                latency("finished");
                // Unfinished: its first request is still being worked on.
                return Err((
                    Outcome::Reused,
                    Problem::KeyReused.answer(OperationState::InProgress),
                ));
            }
            Ok(LeaseOutcome::Exhausted {
                token,
                attempts,
                recovery,
            }) => {
                latency("in_use");
                let holder = Holder {
                    scope: claim.scope.to_owned(),
                    key: claim.key.to_owned(),
                    token,
                };
                let external = external_step(&idem.sealer(), &holder, recovery.as_deref());
                tracing::info!(attempts, "the key's attempts are spent; giving it up");
                match give_up(idem, &holder, external).await {
                    Ok(Some(OperationState::Uncertain)) => {
                        return Err((
                            Outcome::Uncertain,
                            Problem::OutcomeUncertain.into_response(),
                        ));
                    }
                    // Released, or given up by another attempt: claim again.
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%error, "giving up a spent idempotency key failed");
                        return Err((
                            Outcome::StoreUnavailable,
                            Problem::StoreUnavailable.answer(OperationState::InProgress),
                        ));
                    }
                }
            }
            Err(error) => {
                latency("error");
                tracing::warn!(error = %error, "idempotency key store unavailable");
                return Err((
                    Outcome::StoreUnavailable,
                    Problem::StoreUnavailable.into_response(),
                ));
            }
        }
    }
    Err((
        Outcome::InUse,
        Problem::KeyLeased { retry_after: 1 }.into_response(),
    ))
}

/// A key this process saw finish: answered by a plain read. Whatever else
/// the read meets, the lease's claim decides.
async fn peek<DB: Phased>(idem: &Idem<DB>, claim: &Claim<'_>) -> Option<(Outcome, Response)> {
    match read_seen(idem, claim).await {
        Ok(Some(ClaimOutcome::Finished {
            fingerprint,
            response,
        })) => Some(answer_finished(idem, claim, fingerprint, response)),
        _ => None,
    }
}

/// Stores the response under the token, with the last phase's writes.
async fn store<DB: Phased>(
    idem: &Idem<DB>,
    mut state: PhaseState<DB>,
    response: Response,
    backoff: Duration,
) -> (Outcome, Response) {
    let captured =
        StoredResponse::capture(response, idem.replay_header_names(), idem.response_cap()).await;
    let (stored, parts) = match captured {
        Ok(captured) => captured,
        Err(error) => {
            let left = fail(state, backoff).await;
            let problem = match error {
                CaptureError::TooLarge { limit } => {
                    tracing::error!(
                        limit,
                        "phased handler's response exceeds the stored-response cap; its last \
                         phase was rolled back (raise Idem::max_response_bytes)"
                    );
                    Problem::ResponseNotStored
                }
                CaptureError::Body(error) => {
                    tracing::error!(error = %error, "phased handler's response body failed");
                    Problem::HandlerPanicked
                }
            };
            return (Outcome::RolledBack, problem.answer(left));
        }
    };
    let mut conn = match state.last.take() {
        Some(conn) => conn,
        None => match DB::begin(idem.pool(), idem.acquire()).await {
            Ok(conn) => conn,
            Err(error) => {
                tracing::warn!(%error, "the key store failed before the response was stored");
                let left = fail(state, backoff).await;
                return (
                    Outcome::StoreUnavailable,
                    Problem::StoreUnavailable.answer(left),
                );
            }
        },
    };
    let table = idem.table_name();
    let mut encoded = stored.seal(&idem.sealer(), &state.holder.scope, &state.holder.key);
    let row = (state.holder.scope.as_str(), state.holder.key.as_str());
    encoded.tombstone = tombstone_write(idem, row, state.ttl, state.tombstone, &parts);
    match DB::store_and_commit(&mut conn, table, &state.holder, &encoded).await {
        Ok(true) => {
            conn.release();
            // The last phase's messages are committed: wake the relays.
            if state.written.take() {
                idem.wake_relays();
            }
            idem.finished_keys()
                .remember(&state.holder.scope, &state.holder.key);
            (Outcome::Claimed, stored.into_original(parts))
        }
        Ok(false) => {
            abandon(conn).await;
            observe::fenced();
            tracing::warn!(
                "another attempt took this idempotency key over; this attempt's last phase \
                 rolled back"
            );
            (Outcome::Fenced, Problem::KeyInUse.into_response())
        }
        Err(FinishError::Ended(error)) => {
            // A statement of the last phase had failed the transaction:
            // nothing committed, and the failure rule applies.
            tracing::error!(%error, "the last phase's transaction had failed; rolled back");
            abandon(conn).await;
            let left = fail(state, backoff).await;
            (Outcome::RolledBack, Problem::TransactionFailed.answer(left))
        }
        Err(FinishError::Store(error)) => {
            // The commit may have landed: the key is left to its lease, and
            // the next attempt replays the response or resumes.
            tracing::warn!(%error, "storing the response and committing the last phase failed");
            abandon(conn).await;
            (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.answer(OperationState::InProgress),
            )
        }
    }
}

/// Makes the key uncertain: an `external_once` step (`step`) began in an
/// earlier attempt without a recorded result. Nothing of this attempt's
/// last phase commits.
async fn settle_uncertain<DB: Phased>(
    mut state: PhaseState<DB>,
    step: &str,
) -> (Outcome, Response) {
    if let Some(conn) = state.last.take() {
        abandon(conn).await;
    }
    let settled = make_uncertain(
        &state.idem,
        &state.holder,
        Uncertainty::STEP_BEGUN,
        Some(step),
    )
    .await;
    match settled {
        Ok(true) => (
            Outcome::Uncertain,
            Problem::OutcomeUncertain.into_response(),
        ),
        Ok(false) => {
            observe::fenced();
            (Outcome::Fenced, Problem::KeyInUse.into_response())
        }
        // Kept as it is: the next attempt finds the step begun again.
        Err(error) => {
            tracing::warn!(%error, "marking an idempotency key uncertain failed");
            (
                Outcome::StoreUnavailable,
                Problem::StoreUnavailable.answer(OperationState::Uncertain),
            )
        }
    }
}

/// Leaves the key of a failed attempt as the failure rule says, and says
/// what that leaves of its operation: `NotStarted` once the key is deleted
/// (no external step was attempted), `InProgress` while it is kept for the
/// next attempt to resume, or until its lease ends.
async fn fail<DB: Phased>(mut state: PhaseState<DB>, backoff: Duration) -> OperationState {
    if let Some(conn) = state.last.take() {
        abandon(conn).await;
    }
    let how = if state.recovery.external {
        Release::Keep(backoff)
    } else {
        Release::Delete
    };
    match release(&state.idem, &state.holder, how).await {
        Ok(_) if matches!(how, Release::Delete) => OperationState::NotStarted,
        Ok(_) => OperationState::InProgress,
        // The lease ends by itself; the next attempt then resumes.
        Err(error) => {
            tracing::warn!(
                %error,
                "releasing a failed attempt's key failed; it is free when its lease ends"
            );
            OperationState::InProgress
        }
    }
}
