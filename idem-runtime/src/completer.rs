//! The completer: resumes phased requests whose attempt stopped (its lease
//! ended without a response), without a client, by sending the stored
//! request through the service's own router.
//!
//! [`Idem::completer`](crate::Idem::completer) makes a [`Completer`]; each
//! pass reports a [`CompleterRun`]. A request it sends carries a
//! [`Resumed`] mark, and the phased handler's caller is rebuilt from the
//! stored scope with [`FromScope`].

use std::borrow::Cow;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http::{HeaderValue, header};
use tower::ServiceExt;

use crate::backend::{Holder, Phased, Release, external_step, in_autocommit};
use crate::error::Error;
use crate::idem::Idem;
use crate::key::IDEMPOTENCY_KEY;
use crate::observe;
pub use crate::passes::CompleterRun;
use crate::passes::{self, LastPass};
use crate::problem::OperationState;
use crate::request::StoredRequest;
use crate::resolve::Uncertainty;
use crate::response::is_storable;
use crate::scope::Scope;
use crate::seal::Column;

/// How long a completer's reservation of a key holds it while its request
/// is on the way to the handler, which takes the reservation over at once:
/// short, as a client's retry meanwhile is told to wait this long, and a
/// request that never reaches the handler holds the key this long.
const RESERVATION: Duration = Duration::from_secs(5);

/// The longest wait between two attempts on one key.
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Resumes abandoned phased requests: see [`Idem::completer`].
#[derive(Debug)]
pub struct Completer<DB: Phased> {
    idem: Idem<DB>,
    router: Router,
    every: Duration,
    backoff: Duration,
    batch: u32,
}

impl<DB: Phased> Idem<DB> {
    /// What the completer's last pass on this store did, and when (`None`
    /// before its first).
    pub fn last_completer_pass(&self) -> Option<LastPass<CompleterRun>> {
        passes::last(&self.inner().passes.completer)
    }

    /// A completer for the phased handlers of `router`, the service's own
    /// router (with its state): abandoned keys (their lease ended, no
    /// response stored) are resumed by sending their stored request through
    /// it, without the caller's credentials; the handler's scope parameter
    /// is rebuilt with [`FromScope`]. Attempts back off
    /// (doubling from [`Completer::backoff`]); once a key's attempts
    /// (the completer's and clients' retries together) reach
    /// [`Idem::max_attempts`], a key whose external step may have happened
    /// becomes uncertain (every request with it is answered
    /// `idempotency_outcome_uncertain` until [`Idem::resolve`] says what
    /// happened) and a warning is logged; one that provably did nothing
    /// outside the database is released.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # use std::time::Duration;
    /// # fn demo(idem: idem::Idem<sqlx::Postgres>, app: axum::Router) {
    /// idem.completer(app.clone())
    ///     .every(Duration::from_secs(2))
    ///     .backoff(Duration::from_secs(2))
    ///     .spawn();
    /// # }
    /// ```
    pub fn completer(&self, router: Router) -> Completer<DB> {
        Completer {
            idem: self.clone(),
            router,
            every: Duration::from_secs(5),
            backoff: Duration::from_secs(1),
            batch: 32,
        }
    }
}

impl<DB: Phased> Completer<DB> {
    /// How often it looks for abandoned keys (default 5 s).
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// The wait after a key's first failed resumption, doubled after each
    /// next one, up to 5 minutes (default 1 s).
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    /// One pass: every abandoned key found (up to a batch) is resumed once,
    /// or given up once its attempts are spent.
    pub async fn run_once(&self) -> Result<CompleterRun, Error> {
        let started = std::time::Instant::now();
        let run = self.pass().await;
        passes::keep(
            &self.idem.inner().passes.completer,
            LastPass::ended(started, &run),
        );
        run
    }

    async fn pass(&self) -> Result<CompleterRun, Error> {
        let idem = &self.idem;
        let mut run = CompleterRun::default();
        for abandoned in DB::abandoned(idem.pool(), idem.table_name(), self.batch).await? {
            let (sealer, holder) = (idem.sealer(), &abandoned.holder);
            // A request that does not open is given up as one that does not
            // decode: the key cannot be resumed without a client.
            let request = sealer
                .open_logged(
                    &holder.scope,
                    &holder.key,
                    Column::Request,
                    abandoned.request.as_deref(),
                )
                .ok()
                .flatten()
                .and_then(|request| StoredRequest::decode(&request))
                .filter(|request| resumable(idem, holder, request));
            let spent = abandoned.attempts >= idem.attempts_limit();
            let Some(request) = request.filter(|_| !spent) else {
                let external = external_step(&sealer, holder, abandoned.recovery.as_deref());
                let left = give_up(idem, &abandoned.holder, external).await?;
                match left {
                    Some(OperationState::Uncertain) => run.uncertain += 1,
                    Some(_) => run.released += 1,
                    None => {}
                }
                continue;
            };
            let Some(token) = DB::reserve(
                idem.pool(),
                idem.table_name(),
                &abandoned.holder,
                RESERVATION,
            )
            .await?
            else {
                continue;
            };
            run.resumed += 1;
            let backoff = self.backoff_after(abandoned.attempts + 1);
            if self.send(request, &abandoned.holder, token, backoff).await {
                run.completed += 1;
                observe::completer("completed");
            } else {
                observe::completer("failed");
            }
        }
        let uncertain = DB::count_uncertain(idem.pool(), idem.table_name()).await?;
        observe::uncertain_keys(idem.table_name(), uncertain);
        Ok(run)
    }

    /// Spawns the completer: a pass every [`every`](Self::every), a warning
    /// logged for a pass that fails. Abort the handle to stop it between
    /// passes: a pass in flight still ends, so none of its statements is
    /// cut half-way.
    ///
    /// # Panics
    ///
    /// If `every` is zero.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        assert!(
            !self.every.is_zero(),
            "Completer::every must be more than zero"
        );
        let mut ticks = tokio::time::interval(self.every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let completer = std::sync::Arc::new(self);
        tokio::spawn(async move {
            loop {
                ticks.tick().await;
                let completer = std::sync::Arc::clone(&completer);
                let Some(run) =
                    crate::passes::uncut(async move { completer.run_once().await }).await
                else {
                    return;
                };
                if let Err(error) = run {
                    let cause = std::error::Error::source(&error)
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    tracing::warn!(error = %error, cause, "the idempotency completer's pass failed");
                }
            }
        })
    }

    fn backoff_after(&self, attempts: u32) -> Duration {
        let doubled = self
            .backoff
            .saturating_mul(1_u32 << attempts.saturating_sub(1).min(20));
        doubled.min(MAX_BACKOFF)
    }

    /// Sends the stored request as the reservation's; whether it answered
    /// with a stored response.
    async fn send(
        &self,
        stored: StoredRequest,
        holder: &Holder,
        token: i64,
        backoff: Duration,
    ) -> bool {
        let StoredRequest {
            method,
            uri,
            content_type,
            body,
            caller,
        } = stored;
        // The clear scope and key: the row's own, or where it keeps them
        // hashed, those its request names (`resumable` checked them).
        let (scope, key) = caller.unwrap_or_else(|| (holder.scope.clone(), holder.key.clone()));
        let mut request = http::Request::new(Body::from(body));
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        if let Some(content_type) = content_type {
            request
                .headers_mut()
                .insert(header::CONTENT_TYPE, content_type);
        }
        let Ok(key) = HeaderValue::from_str(&quoted(&key)) else {
            return false;
        };
        request.headers_mut().insert(IDEMPOTENCY_KEY, key);
        request.extensions_mut().insert(Resumed {
            scope,
            token,
            backoff,
        });
        let Ok(response) = self.router.clone().oneshot(request).await;
        let status = response.status();
        let tags = (
            observe::redact(&[&holder.scope]),
            observe::redact(&[&holder.scope, &holder.key]),
        );
        let completed = is_storable(status) && status != 409 && status != 422;
        if completed {
            tracing::info!(scope = tags.0, key = tags.1, %status, "the completer finished an abandoned request");
        } else {
            tracing::warn!(scope = tags.0, key = tags.1, %status, retry_in_ms = backoff.as_millis(), "the completer's attempt at an abandoned request failed");
        }
        completed
    }
}

/// Whether the request the completer sends from `request` reaches
/// `holder`'s row: with the row's scope and key where the store keeps
/// them clear, and where it hashes them, with the clear ones the request
/// names, which must hash to the row's. A row of another setting (kept before hashing was turned on or
/// off, or hashed with another secret) is reached by no request: it is
/// given up as one whose request does not decode.
fn resumable<DB: Phased>(idem: &Idem<DB>, holder: &Holder, request: &StoredRequest) -> bool {
    match (idem.key_hasher(), &request.caller) {
        (None, None) => true,
        (Some(hasher), Some((scope, key))) => {
            hasher.scope(scope) == holder.scope && hasher.key(scope, key) == holder.key
        }
        _ => false,
    }
}

/// Gives up a key whose attempts are spent, if its row still carries
/// `holder`'s token: uncertain when an external step may have happened,
/// released (the next retry runs afresh) when none can have. What it left
/// the key's operation; `None` when another attempt had taken the key.
pub(crate) async fn give_up<DB: Phased>(
    idem: &Idem<DB>,
    holder: &Holder,
    external: bool,
) -> Result<Option<OperationState>, Error> {
    let (given_up, left, outcome) = if external {
        let uncertain = make_uncertain(idem, holder, Uncertainty::EXHAUSTED, None).await?;
        (uncertain, OperationState::Uncertain, "uncertain")
    } else {
        let released = release(idem, holder, Release::Delete).await?;
        (released, OperationState::NotStarted, "released")
    };
    if !given_up {
        return Ok(None);
    }
    observe::completer(outcome);
    Ok(Some(left))
}

/// Makes `holder`'s key uncertain for `reason` (an `Uncertainty` reason,
/// with its `step`), counted and logged: whether it did (`false`: another
/// attempt holds the key now).
pub(crate) async fn make_uncertain<DB: Phased>(
    idem: &Idem<DB>,
    holder: &Holder,
    reason: &'static str,
    step: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let record = Uncertainty::encode(reason, step);
    let uncertain = release(idem, holder, Release::Uncertain(&record)).await?;
    if uncertain {
        observe::uncertain(&holder.scope, &holder.key, reason, step);
    }
    Ok(uncertain)
}

/// Leaves `holder`'s key as `how` says, in a statement of its own:
/// whether the row still carried the holder's token.
pub(crate) async fn release<DB: Phased>(
    idem: &Idem<DB>,
    holder: &Holder,
    how: Release<'_>,
) -> Result<bool, sqlx::Error> {
    in_autocommit(idem.pool(), idem.acquire(), |mut conn| async move {
        let released = DB::release(&mut conn, idem.table_name(), holder, how).await;
        (conn, released)
    })
    .await
}

/// `key` as an RFC 9651 sf-string, which `idem` reads back as the key.
fn quoted(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// A caller rebuilt from the scope its key was stored under: how the
/// completer resumes a phased request without the caller's credentials.
///
/// A phased handler's scope parameter implements it. An ordinary request
/// runs the parameter's extractor (which authenticates the caller); a
/// request the completer sends carries no credentials and gets the
/// parameter from `from_scope` instead.
///
/// ```
/// # use idem_runtime as idem;
/// use std::borrow::Cow;
///
/// struct Account(String);
///
/// impl idem::Scope for Account {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.0)
///     }
/// }
///
/// impl idem::FromScope for Account {
///     fn from_scope(scope: &str) -> Self {
///         Account(scope.to_owned())
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be rebuilt from a stored scope: it does not implement `idem::FromScope`",
    label = "the scope of a phased handler must implement `idem::FromScope`",
    note = "the completer resumes abandoned requests without their credentials (idem never stores \
            them): it names the caller by the scope the key was stored under, and builds this \
            parameter with `FromScope::from_scope`"
)]
pub trait FromScope: Scope + Sized {
    /// The caller whose [`Scope::scope`] is `scope`.
    fn from_scope(scope: &str) -> Self;
}

impl FromScope for String {
    fn from_scope(scope: &str) -> Self {
        scope.to_owned()
    }
}

impl<T: FromScope> FromScope for axum::Extension<T> {
    fn from_scope(scope: &str) -> Self {
        axum::Extension(T::from_scope(scope))
    }
}

/// Marks a request the completer sends to resume an abandoned key, in its
/// extensions: the caller's scope, and the reservation the request takes
/// the key over with. Only `idem` makes one. A middleware that authenticates
/// requests lets one through without credentials, as the phased handler's
/// scope comes from [`FromScope`] for it.
#[derive(Debug, Clone)]
pub struct Resumed {
    pub(crate) scope: String,
    pub(crate) token: i64,
    /// How long a failed attempt keeps the key from the next one.
    pub(crate) backoff: Duration,
}

impl Resumed {
    /// The scope the key was claimed in, in the clear (also where the key
    /// table keeps it hashed, [`Idem::hash_keys`]).
    pub fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.scope)
    }
}

#[cfg(test)]
mod tests {
    use super::quoted;
    use crate::key::parse_key_value;

    #[test]
    fn a_quoted_key_reads_back_as_itself() {
        for key in ["plain", "with,comma", "q\"uote", "back\\slash", "\"lead"] {
            assert_eq!(parse_key_value(quoted(key).as_bytes()).unwrap(), key);
        }
    }
}
