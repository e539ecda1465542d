//! The charge handler written three ways, once for every engine: `baseline`
//! (a plain transaction), `idempotent` (the attribute) and `two_phase` (the
//! hand-written recipe); and the provider scenarios' payment (see
//! `provider`) written four ways: `plain_provider`, `atomic_provider`,
//! `two_phase_provider` and `phased`; with their state and routes.
//! `service!` stamps them out per engine, as `examples/charges.rs` does (an
//! `#[idempotent]` handler names its `Tx<DB>` or `Phases<DB>`, so it cannot
//! be generic). PostgreSQL's `peer` (see [`peer`]) is `baseline` behind the
//! `idempotent` crate's store on Redis. What differs
//! between engines is the [`Dialect`] below: how a write transaction opens,
//! how the two-phase claim computes its expiry, and on MySQL every
//! statement's text (`?` placeholders, `INSERT IGNORE`, a quoted `key`);
//! PostgreSQL and SQLite share the rest of the SQL.

use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::routing::post;
use idem_tests::peer::{self as idem_peer, Leases, Peer};

/// What the handlers' SQL looks like on one engine. The statements with a
/// default are PostgreSQL's and SQLite's (`$n` placeholders, `RETURNING`);
/// MySQL overrides every one. Each statement's doc names its binds, in
/// text order on every engine, so MySQL's `?`s bind alike.
pub trait Dialect: sqlx::Database {
    /// Opens every write transaction. PostgreSQL: `BEGIN`, the statement
    /// sqlx's `begin()` sends. SQLite serializes writers: `BEGIN IMMEDIATE`
    /// takes the write lock up front, as the runtime's claim does (a
    /// deferred `BEGIN` would fail with `SQLITE_BUSY` under load).
    const BEGIN: &'static str;
    /// Phase 1 of `two_phase`: claims `(scope, key)` with its fingerprint
    /// for 24 hours, autocommitted; no row is affected if the key is taken.
    const CLAIM: &'static str;
    /// Phase 2 of `two_phase`: the claimed key's response, 201 and
    /// `body`. Binds body, scope, key.
    const STORE: &'static str = "UPDATE bench_two_phase_keys SET status = 201, body = $1 \
         WHERE scope = $2 AND key = $3";
    /// Releases a claim whose work failed. Binds scope, key.
    const RELEASE: &'static str = "DELETE FROM bench_two_phase_keys WHERE scope = $1 AND key = $2";
    /// A taken key's status, fingerprint and body. Binds scope, key.
    const REPLAY: &'static str = "SELECT status, fingerprint, body FROM bench_two_phase_keys \
         WHERE scope = $1 AND key = $2";
    /// `work`'s charge; its id. Binds account, amount, currency.
    const INSERT_CHARGE: &'static str =
        "INSERT INTO bench_charges (account, amount, currency) VALUES ($1, $2, $3) RETURNING id";
    /// `work`'s balance update. Binds amount, account.
    const UPDATE_ACCOUNT: &'static str = "UPDATE bench_accounts SET balance = balance + $1, charges = charges + 1 WHERE account = $2";
    /// `work`'s ledger line. Binds charge id, account, amount.
    const INSERT_LEDGER: &'static str =
        "INSERT INTO bench_ledger (charge_id, account, amount) VALUES ($1, $2, $3)";
    /// A pending payment; its id. Binds account, amount, currency.
    const INSERT_PAYMENT: &'static str = "INSERT INTO bench_payments (account, amount, currency, status) \
         VALUES ($1, $2, $3, 'pending') RETURNING id";
    /// Marks a payment paid. Binds provider id, payment id.
    const MARK_PAID: &'static str =
        "UPDATE bench_payments SET status = 'succeeded', provider_id = $1 WHERE id = $2";
}

impl Dialect for sqlx::Postgres {
    const BEGIN: &'static str = "BEGIN";
    const CLAIM: &'static str = "INSERT INTO bench_two_phase_keys (scope, key, fingerprint, expires_at) \
         VALUES ($1, $2, $3, now() + interval '24 hours') ON CONFLICT (scope, key) DO NOTHING";
}

impl Dialect for sqlx::Sqlite {
    const BEGIN: &'static str = "BEGIN IMMEDIATE";
    /// `expires_at` is in Unix seconds: SQLite has no timestamp type.
    const CLAIM: &'static str = "INSERT INTO bench_two_phase_keys (scope, key, fingerprint, expires_at) \
         VALUES ($1, $2, $3, unixepoch() + 86400) ON CONFLICT (scope, key) DO NOTHING";
}

/// MariaDB (10.5+ for `INSERT ... RETURNING`; MySQL proper has none): `?`
/// placeholders, `key` quoted (a reserved word).
#[cfg(feature = "mysql")]
impl Dialect for sqlx::MySql {
    const BEGIN: &'static str = "BEGIN";
    /// `INSERT IGNORE`, not `ON DUPLICATE KEY UPDATE`: sqlx's connections
    /// count a row found unchanged as affected, so only an ignored insert
    /// reports a taken key as 0 rows. `expires_at` is UTC, as the runtime's.
    const CLAIM: &'static str = "INSERT IGNORE INTO bench_two_phase_keys \
         (scope, `key`, fingerprint, expires_at) \
         VALUES (?, ?, ?, UTC_TIMESTAMP(6) + INTERVAL 24 HOUR)";
    const STORE: &'static str = "UPDATE bench_two_phase_keys SET status = 201, body = ? \
         WHERE scope = ? AND `key` = ?";
    const RELEASE: &'static str = "DELETE FROM bench_two_phase_keys WHERE scope = ? AND `key` = ?";
    const REPLAY: &'static str = "SELECT status, fingerprint, body FROM bench_two_phase_keys \
         WHERE scope = ? AND `key` = ?";
    const INSERT_CHARGE: &'static str =
        "INSERT INTO bench_charges (account, amount, currency) VALUES (?, ?, ?) RETURNING id";
    const UPDATE_ACCOUNT: &'static str =
        "UPDATE bench_accounts SET balance = balance + ?, charges = charges + 1 WHERE account = ?";
    const INSERT_LEDGER: &'static str =
        "INSERT INTO bench_ledger (charge_id, account, amount) VALUES (?, ?, ?)";
    const INSERT_PAYMENT: &'static str = "INSERT INTO bench_payments (account, amount, currency, status) \
         VALUES (?, ?, ?, 'pending') RETURNING id";
    const MARK_PAID: &'static str =
        "UPDATE bench_payments SET status = 'succeeded', provider_id = ? WHERE id = ?";
}

/// The service on one engine: its state, the handlers and `router`.
/// `"/path" => handler` pairs add routes this engine alone serves.
macro_rules! service {
    ($engine:ident, $db:ty $(, $path:literal => $handler:path)* $(,)?) => {
        pub mod $engine {
            use axum::Json;
            use axum::body::Bytes;
            use axum::extract::{FromRef, Path, State};
            use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
            use axum::response::{IntoResponse, Response};
            use axum::routing::post;
            use idem::{Fingerprint, Idem, Phases, Tx, idempotent};
            use sqlx::{Connection, Pool};

            use super::Dialect;
            use crate::app::{Account, ApiError, KEYS_TABLE, NewCharge, created, read_request, work};
            use crate::provider::{
                self, PayError, Payment, Provider, ProviderCharge, insert_pending, mark_paid,
            };

            #[derive(Clone, FromRef)]
            struct AppState {
                idem: Idem<$db>,
                pool: Pool<$db>,
                provider: Provider,
            }

            /// The routes, `{statements}` being 1 or 3; the provider
            /// scenarios' at `/provider/{scenario}`, calling `provider`.
            pub fn router(pool: Pool<$db>, provider: Provider) -> axum::Router {
                // `IDEM_BENCH_ADVISORY_LOCKS=0`: the portable claim, for an A/B.
                let advisory = std::env::var("IDEM_BENCH_ADVISORY_LOCKS").as_deref() != Ok("0");
                let idem = Idem::new(pool.clone())
                    .table(KEYS_TABLE)
                    .expect("table name")
                    .advisory_locks(advisory)
                    .pooler(crate::app::pooler());
                // `IDEM_BENCH_ENCRYPTION=1`: stored data sealed at rest.
                let idem = match std::env::var("IDEM_BENCH_ENCRYPTION").as_deref() {
                    Ok("1") => {
                        idem.encryption(idem::KeyRing::new("bench", [7; 32]).expect("a key id"))
                    }
                    _ => idem,
                };
                // `IDEM_BENCH_HASH_KEYS=1`: scopes and keys stored hashed.
                let idem = match std::env::var("IDEM_BENCH_HASH_KEYS").as_deref() {
                    Ok("1") => idem.hash_keys(idem::KeyHasher::new([9; 32])),
                    _ => idem,
                };
                axum::Router::new()
                    .route("/{statements}/baseline", post(baseline))
                    .route("/{statements}/idempotent", post(idempotent))
                    .route("/{statements}/two_phase", post(two_phase::<false>))
                    .route("/{statements}/two_phase_tx", post(two_phase::<true>))
                    .route("/provider/plain_provider", post(plain_provider))
                    .route("/provider/atomic_provider", post(atomic_provider))
                    .route("/provider/two_phase_provider", post(two_phase_provider))
                    .route("/provider/phased", post(phased))
                    $(.route($path, post($handler)))*
                    .with_state(AppState { idem, pool, provider })
            }

            /// baseline: the handler as it would be written without idempotency.
            pub(super) async fn baseline(
                account: Account,
                Path(statements): Path<u32>,
                State(pool): State<Pool<$db>>,
                Json(new): Json<NewCharge>,
            ) -> Result<Response, ApiError> {
                let mut tx = pool.begin_with(<$db as Dialect>::BEGIN).await?;
                let charge = work::<$db>(&mut tx, &account.0, &new, statements).await?;
                tx.commit().await?;
                Ok(created(charge))
            }

            /// idempotent (and replay): the same handler with the attribute.
            #[idempotent(scope = "account")]
            async fn idempotent(
                account: Account,
                Path(statements): Path<u32>,
                mut tx: Tx<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<Response, ApiError> {
                Ok(created(
                    work::<$db>(&mut tx, &account.0, &new, statements).await?,
                ))
            }

            /// two_phase: the recipe blog posts publish. Claim the key in its
            /// own transaction and commit it (here an autocommitted `INSERT`,
            /// the cheapest form: one round trip, on the connection phase 2
            /// reuses), then do the work and record the response in a second
            /// transaction. `CLAIM_IN_TRANSACTION` is the diagnostic
            /// two_phase_tx: the same recipe as it is usually written, the
            /// claim in a `begin()`/`commit()` transaction of its own (two
            /// more round trips).
            async fn two_phase<const CLAIM_IN_TRANSACTION: bool>(
                account: Account,
                Path(statements): Path<u32>,
                State(pool): State<Pool<$db>>,
                method: Method,
                uri: Uri,
                headers: HeaderMap,
                body: Bytes,
            ) -> Result<Response, ApiError> {
                let (key, fingerprint, new) =
                    match read_request(&method, &uri, &headers, &body) {
                        Ok(read) => read,
                        Err(refusal) => return Ok(refusal.into_response()),
                    };
                let mut conn = pool.acquire().await?;
                // Phase 1: the claim, committed on its own.
                let insert = sqlx::query(<$db as Dialect>::CLAIM)
                    .bind(&account.0)
                    .bind(key)
                    .bind(&fingerprint.as_bytes()[..]);
                let inserted = if CLAIM_IN_TRANSACTION {
                    let mut tx = Connection::begin_with(&mut *conn, <$db as Dialect>::BEGIN).await?;
                    let inserted = insert.execute(&mut *tx).await?;
                    tx.commit().await?;
                    inserted
                } else {
                    insert.execute(&mut *conn).await?
                };
                let claimed = inserted.rows_affected() == 1;
                if !claimed {
                    return replay_two_phase(&mut conn, &account.0, key, &fingerprint).await;
                }
                // Phase 2: the work and the response, together.
                let result = async {
                    let mut tx = Connection::begin_with(&mut *conn, <$db as Dialect>::BEGIN).await?;
                    let charge = work::<$db>(&mut tx, &account.0, &new, statements).await?;
                    let stored = serde_json::to_vec(&charge).expect("serializable");
                    store(&mut tx, &account.0, key, stored).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(charge)
                }
                .await;
                match result {
                    Ok(charge) => Ok(created(charge)),
                    Err(error) => {
                        // Release the claim so a retry can run.
                        sqlx::query(<$db as Dialect>::RELEASE)
                            .bind(&account.0)
                            .bind(key)
                            .execute(&mut *conn)
                            .await?;
                        Err(error.into())
                    }
                }
            }

            /// plain_provider: the payment without idempotency. The pending
            /// payment commits before the call and the mark after it, each
            /// transaction on a connection of its own, so none is held over
            /// the call. The provider's key is derived from the request's
            /// all the same, so every scenario does the same work.
            async fn plain_provider(
                account: Account,
                State(pool): State<Pool<$db>>,
                State(provider): State<Provider>,
                headers: HeaderMap,
                Json(new): Json<NewCharge>,
            ) -> Result<Response, PayError> {
                let key = headers
                    .get("idempotency-key")
                    .and_then(|value| value.to_str().ok())
                    .unwrap_or_default();
                let mut tx = pool.begin_with(<$db as Dialect>::BEGIN).await?;
                let id = insert_pending::<$db>(&mut tx, &account.0, &new).await?;
                tx.commit().await?;
                let key = provider::derive(&account.0, key, provider::STEP);
                let charge = provider.charge(&key, &new).await?;
                let mut tx = pool.begin_with(<$db as Dialect>::BEGIN).await?;
                mark_paid::<$db>(&mut tx, &charge.id, id).await?;
                tx.commit().await?;
                Ok(provider::created(&Payment::paid(id, &account.0, &new, charge)))
            }

            /// atomic_provider: the atomic mode, the provider called inside
            /// the request's one transaction (and its connection held over
            /// the call), the mark committed with the stored response.
            #[idempotent(scope = "account")]
            async fn atomic_provider(
                account: Account,
                State(provider): State<Provider>,
                mut tx: Tx<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<Response, PayError> {
                let key = tx
                    .key()
                    .map(|key| key.derive(provider::STEP))
                    .unwrap_or_default();
                let id = insert_pending::<$db>(&mut tx, &account.0, &new).await?;
                let charge = provider.charge(&key, &new).await?;
                mark_paid::<$db>(&mut tx, &charge.id, id).await?;
                Ok(provider::created(&Payment::paid(id, &account.0, &new, charge)))
            }

            /// two_phase_provider: the hand-written recipe for a call
            /// outside the database. Phase 1 claims the key and writes the
            /// pending payment, committed together; then the call; phase 2
            /// marks the payment and stores the response, committed
            /// together; each transaction on a connection of its own. A
            /// sketch of the fast path: if the call fails, the key stays
            /// claimed without a response and a retry answers 409 until it
            /// expires (no recovery point, no lease: what `phased` adds).
            async fn two_phase_provider(
                account: Account,
                State(pool): State<Pool<$db>>,
                State(provider): State<Provider>,
                method: Method,
                uri: Uri,
                headers: HeaderMap,
                body: Bytes,
            ) -> Result<Response, PayError> {
                let (key, fingerprint, new) =
                    match read_request(&method, &uri, &headers, &body) {
                        Ok(read) => read,
                        Err(refusal) => return Ok(refusal.into_response()),
                    };
                // Phase 1: the claim and the pending payment.
                let mut tx = pool.begin_with(<$db as Dialect>::BEGIN).await?;
                let claimed = sqlx::query(<$db as Dialect>::CLAIM)
                    .bind(&account.0)
                    .bind(key)
                    .bind(&fingerprint.as_bytes()[..])
                    .execute(&mut *tx)
                    .await?
                    .rows_affected()
                    == 1;
                if !claimed {
                    // Read in the transaction, which then rolls back.
                    return Ok(replay_two_phase(&mut tx, &account.0, key, &fingerprint)
                        .await
                        .unwrap_or_else(IntoResponse::into_response));
                }
                let id = insert_pending::<$db>(&mut tx, &account.0, &new).await?;
                tx.commit().await?;
                let derived = provider::derive(&account.0, key, provider::STEP);
                let charge = provider.charge(&derived, &new).await?;
                let payment = Payment::paid(id, &account.0, &new, charge);
                // Phase 2: the mark and the response.
                let mut tx = pool.begin_with(<$db as Dialect>::BEGIN).await?;
                mark_paid::<$db>(&mut tx, &payment.provider_id, id).await?;
                let stored = serde_json::to_vec(&payment).expect("serializable");
                store(&mut tx, &account.0, key, stored).await?;
                tx.commit().await?;
                Ok(provider::created(&payment))
            }

            /// phased: the phased mode. A local phase writes the pending
            /// payment (committed with its recovery point), the provider is
            /// an external step, and the last phase's mark commits with the
            /// stored response.
            #[idempotent(scope = "account", lease = "30s")]
            async fn phased(
                account: Account,
                State(provider): State<Provider>,
                mut phases: Phases<$db>,
                Json(new): Json<NewCharge>,
            ) -> Result<Response, PayError> {
                let id: i64 = phases
                    .local("pending", async |tx| -> Result<_, PayError> {
                        Ok(insert_pending::<$db>(tx, &account.0, &new).await?)
                    })
                    .await?;
                let charge: ProviderCharge = phases
                    .external(provider::STEP, async |key| provider.charge(&key, &new).await)
                    .await?;
                let tx = phases.last_phase().await?;
                mark_paid::<$db>(tx, &charge.id, id).await?;
                Ok(provider::created(&Payment::paid(id, &account.0, &new, charge)))
            }

            /// Stores a claimed two-phase key's response: 201 and `body`.
            async fn store(
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                key: &str,
                body: Vec<u8>,
            ) -> Result<(), sqlx::Error> {
                sqlx::query(<$db as Dialect>::STORE)
                    .bind(body)
                    .bind(scope)
                    .bind(key)
                    .execute(conn)
                    .await?;
                Ok(())
            }

            /// A two-phase key row: status, fingerprint, body.
            type StoredRow = (Option<i16>, Vec<u8>, Option<Vec<u8>>);

            /// A taken key: the stored response if the request matches it,
            /// 422 if it does not, 409 while the first attempt runs.
            async fn replay_two_phase(
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &str,
                key: &str,
                fingerprint: &Fingerprint,
            ) -> Result<Response, ApiError> {
                let row: Option<StoredRow> = sqlx::query_as(<$db as Dialect>::REPLAY)
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(conn)
                    .await?;
                Ok(match row {
                    Some((Some(status), stored, Some(body)))
                        if stored == fingerprint.as_bytes() =>
                    {
                        (
                            StatusCode::from_u16(status as u16).unwrap_or(StatusCode::OK),
                            [(header::CONTENT_TYPE, "application/json")],
                            body,
                        )
                            .into_response()
                    }
                    Some((Some(_), _, _)) => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
                    _ => StatusCode::CONFLICT.into_response(),
                })
            }
        }
    };
}

service!(
    postgres,
    sqlx::Postgres,
    "/{statements}/read_floor" => crate::floor::read_floor,
    "/{statements}/optimistic" => crate::optimistic::optimistic,
);
service!(sqlite, sqlx::Sqlite);
#[cfg(feature = "mysql")]
service!(mysql, sqlx::MySql);

/// The `peer` scenario's route, on PostgreSQL alone: `baseline`, unchanged,
/// behind the middleware a team writes around the `idempotent` crate
/// (`idem_tests::peer`). Without Redis it answers 503 with the reason, so
/// only a run that loads it fails.
pub fn peer(pool: sqlx::PgPool, peer: Result<Peer, String>) -> axum::Router {
    let route = match peer {
        Ok(peer) => post(postgres::baseline).layer(from_fn_with_state(peer, idem_peer::middleware)),
        Err(error) => post(async move || (StatusCode::SERVICE_UNAVAILABLE, error)),
    };
    axum::Router::new()
        .route("/{statements}/peer", route)
        .with_state(pool)
}

/// The peer's store at `redis_url`, under a key prefix of this server
/// process alone (its pid and start time), so no run meets another's keys.
/// The crate's later guidance for its leases: a minute to a dead worker's
/// claim, a day to a completed entry.
pub async fn connect_peer(redis_url: &str) -> Result<Peer, String> {
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis();
    let prefix = format!("idem-bench-peer-{}-{started}", std::process::id());
    Peer::connect(redis_url, &prefix, Leases::default())
        .await
        .map(|peer| peer.scoped(idem_peer::account))
        .map_err(|error| format!("peer: Redis is required at {redis_url}: {error:?}"))
}
