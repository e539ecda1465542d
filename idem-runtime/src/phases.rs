//! [`Phases`]: a phased handler's recovery points, as the handler sees them.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use crate::backend::{FinishError, Holder, OpenTx, Phased, StoreError, abandon, in_autocommit};
use crate::idem::Idem;
use crate::key::IdempotencyKey;
use crate::problem::Problem;
use crate::recovery::Recovery;
use crate::seal::Column;
use crate::wake::Written;

/// The steps of a phased `#[idempotent]` handler: local phases, each its
/// own transaction that commits a recovery point, external steps between
/// them, and the last phase, whose writes commit with the stored response.
///
/// Take a `Phases<DB>` parameter in place of `Tx<DB>` for a handler that
/// calls something outside its database (a payment provider, a mailer):
///
/// ```no_run
/// # use idem_runtime as idem;
/// # use idem::{Phases, PhaseError};
/// # use sqlx::Postgres;
/// # struct ApiError;
/// # impl From<PhaseError> for ApiError { fn from(_: PhaseError) -> Self { ApiError } }
/// # impl From<sqlx::Error> for ApiError { fn from(_: sqlx::Error) -> Self { ApiError } }
/// # async fn charge_card(key: String, amount: i64) -> Result<String, ApiError> { Ok(key) }
/// # async fn demo(mut phases: Phases<Postgres>, amount: i64) -> Result<(), ApiError> {
/// // A local phase: its writes and its result commit together, once.
/// let id: i64 = phases
///     .local("pending", async |tx| -> Result<_, ApiError> {
///         let id = sqlx::query_scalar("INSERT INTO payments (amount) VALUES ($1) RETURNING id")
///             .bind(amount)
///             .fetch_one(tx)
///             .await?;
///         Ok(id)
///     })
///     .await?;
/// // An external step: the provider gets a key derived from the request's,
/// // the same on every attempt, so our retry is the provider's retry.
/// let provider_id: String = phases
///     .external("provider", async |key| charge_card(key, amount).await)
///     .await?;
/// // The last phase: its writes commit with the stored response.
/// let tx = phases.last_phase().await?;
/// sqlx::query("UPDATE payments SET status = 'succeeded', provider_id = $1 WHERE id = $2")
///     .bind(&provider_id)
///     .bind(id)
///     .execute(tx)
///     .await?;
/// # Ok(()) }
/// ```
///
/// On a later attempt (a client's retry once the lease has ended, or the
/// completer), a phase or step whose result was recorded is skipped and
/// its recorded result returned: name each phase and step once per
/// handler, and keep the names stable across deploys. Results are kept as
/// JSON (`serde`), so they must read back as they were written.
pub struct Phases<DB: Phased> {
    state: Option<PhaseState<DB>>,
    home: Option<oneshot::Sender<PhaseState<DB>>>,
}

/// What a phase left, handed back to the protocol when the handler ends.
pub(crate) struct PhaseState<DB: Phased> {
    pub(crate) idem: Idem<DB>,
    pub(crate) holder: Holder,
    pub(crate) key: IdempotencyKey,
    pub(crate) lease: Duration,
    /// The handler's `ttl` and `tombstone`, for its response's write.
    pub(crate) ttl: Duration,
    pub(crate) tombstone: Option<Duration>,
    pub(crate) recovery: Recovery,
    /// A recovery point of an earlier attempt was found.
    pub(crate) resumed: bool,
    /// A write under our token matched nothing: another attempt took over.
    pub(crate) fenced: bool,
    /// The last phase's transaction, once begun.
    pub(crate) last: Option<OpenTx<DB>>,
    /// The phases and steps this attempt ran or skipped.
    pub(crate) seen: Vec<String>,
    /// Marked by this attempt's outbox writers; taken by each commit of a
    /// phase, which then wakes the relays.
    pub(crate) written: Written,
    /// The [`external_once`](Phases::external_once) step an earlier
    /// attempt began without a recorded result: the key becomes uncertain.
    pub(crate) uncertain: Option<String>,
}

/// Why a phase could not run or be recorded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError {
    /// Another attempt took the key over (this one's lease had ended):
    /// nothing of this phase was committed. The request answers 409.
    #[error("another attempt took this idempotency key over; this attempt stops")]
    Fenced,
    /// The key store failed to begin, record or commit the phase.
    #[error("the key store failed while recording a phase: {0}")]
    Store(#[source] sqlx::Error),
    /// A result did not serialize, or a recorded one did not read back as
    /// the type the handler asks for (a phase renamed or retyped across a
    /// deploy).
    #[error("the result of phase `{name}` could not be recorded or read back: {source}")]
    Result {
        /// The phase or step.
        name: String,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// A phase or step name used twice in one handler, or a phase after
    /// the last one began.
    #[error("phase `{0}` is out of order: each name once, and nothing after `last_phase`")]
    Order(String),
    /// An [`external_once`](Phases::external_once) step began in an earlier
    /// attempt and its result was not recorded: it may have happened, and
    /// it must not be called again. The key becomes uncertain, and the
    /// request answers 409 `idempotency_outcome_uncertain` whatever the
    /// handler makes of the error.
    #[error("step `{0}` may have happened without a recorded result; the outcome is uncertain")]
    Uncertain(String),
}

impl PhaseError {
    fn problem(&self) -> Problem {
        match self {
            Self::Fenced => Problem::KeyInUse,
            Self::Uncertain(_) => Problem::OutcomeUncertain,
            Self::Store(_) => Problem::StoreUnavailable,
            Self::Result { .. } | Self::Order(_) => Problem::TransactionFailed,
        }
    }
}

/// As the problem `idem` answers for it: 409 when fenced, 503 when the
/// store failed, 500 otherwise. (A fenced attempt is answered 409 whatever
/// the handler made of the error.)
impl IntoResponse for PhaseError {
    fn into_response(self) -> Response {
        if !matches!(self, Self::Fenced | Self::Uncertain(_)) {
            tracing::error!(error = %self, "a phase failed");
        }
        self.problem().into_response()
    }
}

impl From<PhaseError> for Response {
    fn from(error: PhaseError) -> Self {
        error.into_response()
    }
}

impl<DB: Phased> Phases<DB> {
    pub(crate) fn new(state: PhaseState<DB>) -> (Self, oneshot::Receiver<PhaseState<DB>>) {
        let (home, back) = oneshot::channel();
        let phases = Self {
            state: Some(state),
            home: Some(home),
        };
        (phases, back)
    }

    fn state(&mut self) -> &mut PhaseState<DB> {
        self.state.as_mut().expect("Phases used after drop")
    }

    /// The request's idempotency key; [`derive`](IdempotencyKey::derive)
    /// it for a downstream call by hand, or let [`external`](Self::external)
    /// do so.
    pub fn key(&self) -> &IdempotencyKey {
        &self.state.as_ref().expect("Phases used after drop").key
    }

    /// The outbox table, the request's scope and the mark its writes
    /// leave, for an outbox writer.
    pub(crate) fn outbox_parts(&self) -> (std::sync::Arc<str>, String, Written) {
        let state = self.state.as_ref().expect("Phases used after drop");
        (
            std::sync::Arc::clone(&state.idem.inner().messages.outbox),
            state.key.scope().to_owned(),
            state.written.clone(),
        )
    }

    /// Whether this attempt resumes an earlier one's recovery point.
    pub fn resumed(&self) -> bool {
        self.state.as_ref().is_some_and(|state| state.resumed)
    }

    /// Runs a local phase: `phase` gets a connection in a new transaction,
    /// and its `Ok` result commits together with its writes and the key's
    /// recovery point (renewing the lease). On a later attempt the phase is
    /// skipped and the recorded result returned. An `Err` rolls the phase
    /// back and is returned as is; a phase whose attempt lost the key
    /// rolls back and returns [`PhaseError::Fenced`].
    pub async fn local<T, E, F>(&mut self, name: &str, phase: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<PhaseError>,
        F: AsyncFnOnce(&mut DB::Connection) -> Result<T, E>,
    {
        let state = self.state();
        if let Some(done) = state.recorded(name)? {
            crate::observe::phase(name, "skipped");
            return Ok(done);
        }
        let mut conn = DB::begin(state.idem.pool(), state.idem.acquire())
            .await
            .map_err(PhaseError::Store)?;
        let value = match phase(&mut **conn).await {
            Ok(value) => value,
            Err(error) => {
                abandon(conn).await;
                // Its messages rolled back with it.
                self.state().written.take();
                crate::observe::phase(name, "failed");
                return Err(error);
            }
        };
        let state = self.state();
        state.keep(name, &value)?;
        let recorded = DB::record_and_commit(
            &mut conn,
            state.idem.table_name(),
            &state.holder,
            &state.sealed_recovery(),
            state.lease,
        )
        .await;
        match recorded {
            Ok(true) => {
                conn.release();
                // After the commit, never before: a relay woken earlier
                // would not see the phase's messages.
                if state.written.take() {
                    state.idem.wake_relays();
                }
                crate::observe::phase(name, "committed");
                Ok(value)
            }
            Ok(false) => {
                abandon(conn).await;
                state.written.take();
                Err(state.fence(name).into())
            }
            Err(error) => {
                // The commit may have landed: a later attempt then skips
                // the phase, or runs it again if it did not. (Messages it
                // wrote, if it landed, wait for the relays' next poll.)
                abandon(conn).await;
                state.written.take();
                state.recovery.steps.remove(name);
                crate::observe::phase(name, "failed");
                let (FinishError::Ended(error) | FinishError::Store(error)) = error;
                let error = match error {
                    StoreError::Database(error) => error,
                    other => sqlx::Error::Protocol(other.to_string()),
                };
                Err(PhaseError::Store(error).into())
            }
        }
    }

    /// Runs an external step: `step` gets the key derived from the
    /// request's for `label` ([`IdempotencyKey::derive`]), the same on every
    /// attempt, to pass to the downstream API so that our retry is its
    /// retry. Before the call, the recovery point notes that an external
    /// step may happen (so a failed attempt keeps the key, and the next one
    /// resumes rather than starting afresh), and the lease is renewed. The
    /// `Ok` result is recorded with the next local phase, or the response;
    /// on a later attempt that recorded it the step is skipped.
    pub async fn external<T, E, F>(&mut self, label: &str, step: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<PhaseError>,
        F: AsyncFnOnce(String) -> Result<T, E>,
    {
        let state = self.state();
        if let Some(done) = state.recorded(label)? {
            crate::observe::phase(label, "skipped");
            return Ok(done);
        }
        state.recovery.external = true;
        state.note_external(label).await?;
        self.call(label, step).await
    }

    /// Runs an external step that must never run twice: for a downstream
    /// that takes no idempotency key (an SMTP relay, a legacy bank API).
    /// Before the call, the recovery point notes that the step began (as
    /// [`external`](Self::external) notes that one may happen); its `Ok`
    /// result is recorded with the next local phase or the response, and a
    /// later attempt then skips the step. A later attempt (a client's
    /// retry, or the completer) that finds the step begun without a
    /// recorded result does not call it again: whether it happened is
    /// unknown, so the key becomes uncertain, the step returns
    /// [`PhaseError::Uncertain`], and the request answers 409
    /// `idempotency_outcome_uncertain` until an operator resolves it
    /// ([`Idem::resolve`](crate::Idem::resolve)).
    ///
    /// An `Err` from the step counts as "may have happened" too: return
    /// `Ok` with a value that says the downstream refused, where it did so
    /// for certain, to have that recorded instead. `step` gets the key
    /// derived for `label`, to quote to the downstream as a reference.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # use idem::{Phases, PhaseError};
    /// # use sqlx::Postgres;
    /// # struct ApiError;
    /// # impl From<PhaseError> for ApiError { fn from(_: PhaseError) -> Self { ApiError } }
    /// # async fn send_receipt(reference: String) -> Result<(), ApiError> { Ok(()) }
    /// # async fn demo(mut phases: Phases<Postgres>) -> Result<(), ApiError> {
    /// phases
    ///     .external_once("receipt", async |reference| send_receipt(reference).await)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn external_once<T, E, F>(&mut self, label: &str, step: F) -> Result<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: From<PhaseError>,
        F: AsyncFnOnce(String) -> Result<T, E>,
    {
        let state = self.state();
        if let Some(done) = state.recorded(label)? {
            crate::observe::phase(label, "skipped");
            return Ok(done);
        }
        if state.recovery.begun.iter().any(|begun| begun == label) {
            crate::observe::phase(label, "uncertain");
            state.uncertain = Some(label.to_owned());
            return Err(PhaseError::Uncertain(label.to_owned()).into());
        }
        state.recovery.external = true;
        state.recovery.begun.push(label.to_owned());
        state.note_external(label).await?;
        self.call(label, step).await
    }

    /// Calls an external step whose start is recorded, and keeps its `Ok`
    /// result to be recorded with the next commit.
    async fn call<T, E, F>(&mut self, label: &str, step: F) -> Result<T, E>
    where
        T: Serialize,
        E: From<PhaseError>,
        F: AsyncFnOnce(String) -> Result<T, E>,
    {
        let derived = self.state().key.derive(label);
        match step(derived).await {
            Ok(value) => {
                self.state().keep(label, &value)?;
                crate::observe::phase(label, "called");
                Ok(value)
            }
            Err(error) => {
                crate::observe::phase(label, "failed");
                Err(error)
            }
        }
    }

    /// Begins the last phase, if it has not begun, and returns its
    /// connection: its writes commit together with the stored response
    /// when the handler answers a storable status, as in the atomic mode,
    /// and roll back otherwise. A handler that never calls it has its
    /// response stored in a transaction of its own.
    pub async fn last_phase(&mut self) -> Result<&mut DB::Connection, PhaseError> {
        let state = self.state();
        if state.last.is_none() {
            let conn = DB::begin(state.idem.pool(), state.idem.acquire())
                .await
                .map_err(PhaseError::Store)?;
            state.last = Some(conn);
        }
        let conn = state.last.as_mut().expect("begun above");
        Ok(&mut ***conn)
    }
}

impl<DB: Phased> PhaseState<DB> {
    /// Writes the recovery point (noting an external step) and renews the
    /// lease, committed on its own before the step's call.
    async fn note_external(&mut self, label: &str) -> Result<(), PhaseError> {
        let recovery = self.sealed_recovery();
        let (idem, holder, lease) = (&self.idem, &self.holder, self.lease);
        let recovery = &recovery;
        let recorded = in_autocommit(idem.pool(), idem.acquire(), |mut conn| async move {
            let recorded = DB::record(&mut conn, idem.table_name(), holder, recovery, lease).await;
            (conn, recorded)
        })
        .await;
        match recorded {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.fence(label)),
            Err(error) => {
                crate::observe::phase(label, "failed");
                Err(PhaseError::Store(error))
            }
        }
    }

    /// The recovery point as the key's row keeps it: sealed where the
    /// store encrypts.
    fn sealed_recovery(&self) -> Vec<u8> {
        let plain = self.recovery.encode();
        let sealer = self.idem.sealer();
        if sealer.ring.is_none() {
            return plain;
        }
        let (scope, key) = (&self.holder.scope, &self.holder.key);
        sealer
            .seal(scope, key, Column::Recovery, &plain)
            .into_owned()
    }

    /// A recorded result of `name`, if an earlier attempt recorded one.
    fn recorded<T: DeserializeOwned>(&mut self, name: &str) -> Result<Option<T>, PhaseError> {
        if self.last.is_some() || self.seen.iter().any(|seen| seen == name) {
            return Err(PhaseError::Order(name.to_owned()));
        }
        self.seen.push(name.to_owned());
        let Some(value) = self.recovery.steps.get(name) else {
            return Ok(None);
        };
        T::deserialize(value)
            .map(Some)
            .map_err(|source| PhaseError::Result {
                name: name.to_owned(),
                source,
            })
    }

    /// Keeps `value` as `name`'s result in the recovery point to write.
    fn keep<T: Serialize>(&mut self, name: &str, value: &T) -> Result<(), PhaseError> {
        let json = serde_json::to_value(value).map_err(|source| PhaseError::Result {
            name: name.to_owned(),
            source,
        })?;
        self.recovery.steps.insert(name.to_owned(), json);
        Ok(())
    }

    /// Notes that another attempt took the key over.
    fn fence(&mut self, name: &str) -> PhaseError {
        self.fenced = true;
        crate::observe::phase(name, "fenced");
        tracing::warn!(
            phase = name,
            "another attempt took this idempotency key over; this attempt's phase rolled back"
        );
        PhaseError::Fenced
    }
}

impl<DB: Phased> Drop for Phases<DB> {
    fn drop(&mut self) {
        // Hand what the phases left to the protocol; if nobody waits (the
        // request was cancelled), the last phase's connection closes with
        // the state, which rolls its transaction back.
        if let (Some(state), Some(home)) = (self.state.take(), self.home.take()) {
            let _ = home.send(state);
        }
    }
}

impl<DB: Phased> std::fmt::Debug for Phases<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phases")
            .field("resumed", &self.resumed())
            .finish_non_exhaustive()
    }
}
