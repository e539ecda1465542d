//! The service under test: one idempotent handler with knobs, stamped out
//! once per engine by `define_app!` (handlers cannot be generic, the SQL
//! dialect can: see `TestDb`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// What each engine supplies: a pool, its SQL dialect and its router.
pub trait TestDb: idem::Backend + Sized {
    /// Engine name in messages.
    const ENGINE: &'static str;
    /// One writer at a time (SQLite): while a handler's transaction is
    /// open, every other claim waits for it, whatever its key.
    const SERIAL_WRITES: bool = false;
    /// Inserts one effect: (scope, key, note, nonce), returning its id.
    const INSERT_EFFECT: &'static str;
    /// Rewrites one effect row in place (takes its row lock): `$1`/`?` = id.
    const TOUCH_EFFECT: &'static str;
    /// Opens a transaction holding the row lock of effect `id`.
    fn lock_effect(
        pool: &sqlx::Pool<Self>,
        id: i64,
    ) -> impl std::future::Future<Output = sqlx::Transaction<'static, Self>> + Send;
    /// Connects (failing loudly when the server is missing) and migrates.
    fn connect() -> impl std::future::Future<Output = sqlx::Pool<Self>> + Send;
    /// A pool whose server cannot be reached.
    fn unreachable_pool() -> sqlx::Pool<Self>;
    /// The test service on this engine.
    fn router(state: AppState<Self>) -> axum::Router;
    /// Effects recorded for one scope.
    fn count_effects(
        pool: &sqlx::Pool<Self>,
        scope: &str,
    ) -> impl std::future::Future<Output = i64> + Send;
    /// Idempotency rows stored for one scope (default table).
    fn count_keys(
        pool: &sqlx::Pool<Self>,
        scope: &str,
    ) -> impl std::future::Future<Output = i64> + Send;
}

/// Shared by the test and the server it starts.
pub struct AppState<DB: idem::Backend> {
    pub idem: idem::Idem<DB>,
    pub holds: Holds,
}

impl<DB: idem::Backend> Clone for AppState<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            holds: self.holds.clone(),
        }
    }
}

impl<DB: idem::Backend> axum::extract::FromRef<AppState<DB>> for idem::Idem<DB> {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.idem.clone()
    }
}

impl<DB: idem::Backend> axum::extract::FromRef<AppState<DB>> for Holds {
    fn from_ref(state: &AppState<DB>) -> Self {
        state.holds.clone()
    }
}

/// Handlers in `hold` mode park here after their write until the test
/// releases them: the test drives the timing, not sleeps.
#[derive(Clone, Default)]
pub struct Holds(Arc<Mutex<HashMap<String, Arc<Hold>>>>);

#[derive(Default)]
pub struct Hold {
    pub entered: Notify,
    pub release: Notify,
    /// Notified when a held handler's future is dropped unfinished.
    pub dropped: Notify,
}

/// Signals `Hold::dropped` if the handler is cancelled while parked.
pub struct DropSignal(pub Option<Arc<Hold>>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        if let Some(hold) = self.0.take() {
            hold.dropped.notify_one();
        }
    }
}

impl Holds {
    pub fn get(&self, name: &str) -> Arc<Hold> {
        self.0
            .lock()
            .unwrap()
            .entry(name.to_owned())
            .or_default()
            .clone()
    }
}

/// The caller, from `x-caller`; 401 without it.
pub struct Caller(pub String);

impl idem::Scope for Caller {
    fn scope(&self) -> std::borrow::Cow<'_, str> {
        self.0.as_str().into()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let caller = parts
            .headers
            .get("x-caller")
            .ok_or(StatusCode::UNAUTHORIZED)?;
        let caller =
            String::from_utf8(caller.as_bytes().to_vec()).map_err(|_| StatusCode::UNAUTHORIZED)?;
        Ok(Caller(caller))
    }
}

#[derive(Deserialize)]
pub struct EffectRequest {
    pub note: String,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Effect {
    pub id: i64,
    pub note: String,
    /// Random per execution: a replay repeats it, a re-execution cannot.
    pub nonce: String,
}

/// The handler's knob, from `x-test-mode` (not part of the fingerprint, so
/// a retry without it is the same request).
pub fn mode(headers: &HeaderMap) -> String {
    headers
        .get("x-test-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

pub fn nonce() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos(),
    );
    format!("{:016x}", hasher.finish())
}

/// Stamps out the handlers and router for one engine.
#[macro_export]
macro_rules! define_app {
    ($db:ty) => {
        pub mod handlers {
            use axum::Json;
            use axum::extract::State;
            use axum::http::{HeaderMap, StatusCode, header};
            use axum::response::{IntoResponse, Response};
            use idem::{Tx, idempotent};

            use $crate::app::{Caller, Effect, EffectRequest, Holds, TestDb, mode, nonce};

            async fn effect(
                caller: &Caller,
                headers: &HeaderMap,
                holds: &Holds,
                tx: &mut Tx<$db>,
                note: String,
            ) -> Response {
                let nonce = nonce();
                let key = tx.key().map(|k| k.as_str().to_owned()).unwrap_or_default();
                let id: i64 = sqlx::query_scalar(<$db as TestDb>::INSERT_EFFECT)
                    .bind(&caller.0)
                    .bind(&key)
                    .bind(&note)
                    .bind(&nonce)
                    .fetch_one(&mut **tx)
                    .await
                    .expect("insert effect");
                let mode = mode(headers);
                match mode.as_str() {
                    "fail-503" => {
                        return (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response()
                    }
                    "panic" => panic!("handler panicked on purpose"),
                    "big" => return "x".repeat(64 * 1024).into_response(),
                    "announce" => {
                        // The kill test waits for this line, then SIGKILLs us.
                        println!("EFFECT_WRITTEN {key}");
                        std::future::pending::<()>().await;
                    }
                    m if m.starts_with("hold:") => {
                        let hold = holds.get(&m[5..]);
                        let mut signal = $crate::app::DropSignal(Some(hold.clone()));
                        hold.entered.notify_one();
                        hold.release.notified().await;
                        signal.0 = None;
                    }
                    m if m.starts_with("touch:") => {
                        let target: i64 = m[6..].parse().unwrap();
                        sqlx::query(<$db as TestDb>::TOUCH_EFFECT)
                            .bind(target)
                            .execute(&mut **tx)
                            .await
                            .expect("touch effect");
                    }
                    m if m.starts_with("status:") => {
                        let status = StatusCode::from_u16(m[7..].parse().unwrap()).unwrap();
                        return (status, Json(Effect { id, note, nonce })).into_response();
                    }
                    _ => {}
                }
                let location = format!("/effects/{id}");
                (
                    StatusCode::CREATED,
                    [
                        (header::LOCATION, location),
                        (header::ETAG, format!("\"{nonce}\"")),
                    ],
                    Json(Effect { id, note, nonce }),
                )
                    .into_response()
            }

            #[idempotent(scope = "caller")]
            pub async fn create(
                caller: Caller,
                headers: HeaderMap,
                State(holds): State<Holds>,
                mut tx: Tx<$db>,
                Json(req): Json<EffectRequest>,
            ) -> Response {
                effect(&caller, &headers, &holds, &mut tx, req.note).await
            }

            #[idempotent(scope = "caller", wait = "10s")]
            pub async fn create_waiting(
                caller: Caller,
                headers: HeaderMap,
                State(holds): State<Holds>,
                mut tx: Tx<$db>,
                Json(req): Json<EffectRequest>,
            ) -> Response {
                effect(&caller, &headers, &holds, &mut tx, req.note).await
            }

            #[idempotent(scope = "caller", wait = "300ms")]
            pub async fn create_brief(
                caller: Caller,
                headers: HeaderMap,
                State(holds): State<Holds>,
                mut tx: Tx<$db>,
                Json(req): Json<EffectRequest>,
            ) -> Response {
                effect(&caller, &headers, &holds, &mut tx, req.note).await
            }

            #[idempotent(scope = "caller", ttl = "1s")]
            pub async fn create_short(
                caller: Caller,
                headers: HeaderMap,
                State(holds): State<Holds>,
                mut tx: Tx<$db>,
                Json(req): Json<EffectRequest>,
            ) -> Response {
                effect(&caller, &headers, &holds, &mut tx, req.note).await
            }

            #[idempotent(scope = "caller", key = "optional")]
            pub async fn create_optional(
                caller: Caller,
                headers: HeaderMap,
                State(holds): State<Holds>,
                mut tx: Tx<$db>,
                Json(req): Json<EffectRequest>,
            ) -> Response {
                effect(&caller, &headers, &holds, &mut tx, req.note).await
            }

            pub fn router(state: $crate::app::AppState<$db>) -> axum::Router {
                use axum::routing::post;
                axum::Router::new()
                    .route("/effects", post(create).put(create))
                    .route("/other", post(create))
                    .route("/effects/wait", post(create_waiting))
                    .route("/effects/brief", post(create_brief))
                    .route("/effects/short", post(create_short))
                    .route("/effects/optional", post(create_optional))
                    .layer(axum::extract::DefaultBodyLimit::max(64 * 1024))
                    .with_state(state)
            }
        }
    };
}
