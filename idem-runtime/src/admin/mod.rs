//! The operators' page and admin routes (feature `admin`): an HTML page to
//! see keys by state, resolve uncertain ones and forget finished ones, and
//! the JSON routes scripts use for the same, behind one token.
//!
//! [`router`] (or [`Console`] for its settings) serves, on absolute paths
//! under `/admin`:
//!
//! | route | what |
//! |---|---|
//! | `GET /admin` | the page: uncertain, in-flight and abandoned keys, the outbox's backlog and failing scopes, the completer's and relay's last passes; `?scope=` lists a scope's recent keys |
//! | `GET /admin/key?scope=&key=` | one key: its state, recovery point's phase names, external steps begun, resolutions, and the forms to resolve or forget it |
//! | `GET`, `POST /admin/login`; `POST /admin/logout` | signing in with the token, and out |
//! | `GET /admin/idempotency/{scope}` | JSON: the scope's recent keys (`?limit=`, default 50) |
//! | `GET`, `DELETE /admin/idempotency/{scope}/{key}` | JSON: one key; forgetting it (204; 404 absent; 409 in flight or uncertain) |
//! | `POST /admin/idempotency/{scope}/{key}/resolve` | JSON: resolving an uncertain key (200 with the key; 404 absent; 409 not uncertain; 400 or 422 for bad input, which changes nothing) |
//!
//! Every route answers only an operator: a request with
//! `Authorization: Bearer <token>`, or a browser signed in on the login
//! page. A sign-in sets the cookie `idem_admin` (`HttpOnly;
//! SameSite=Strict; Path=/admin`, and `Secure` when the request came over
//! HTTPS as far as the server can tell: see [`Console::secure_cookie`]).
//! The cookie holds a session, never the token: an expiry and a random
//! nonce signed with HMAC-SHA256 under a key derived from the token. So
//! sessions need no shared storage between a service's instances and
//! survive restarts, and changing the token signs every session out.
//! Every form carries a token derived from the session (HMAC-SHA256 again)
//! and a cross-site post is refused on its `Sec-Fetch-Site` or `Origin`
//! header as well. Tokens, sessions and form tokens are compared in
//! constant time.
//!
//! The JSON routes answer 401 with `WWW-Authenticate: Bearer` to a
//! request without the token; a signed-in browser may read them (`GET`)
//! but changes keys only through the page's forms. The page redirects a
//! browser that is not signed in to the login page.
//!
//! Nothing the page or the routes show comes from a stored request's or
//! response's headers or body: [`KeyInfo`](crate::KeyInfo) carries none.
//!
//! The router is one to [`merge`](axum::Router::merge) into the service's
//! own (after its `with_state`), not to `nest`: its links and its cookie's
//! path are absolute.
//!
//! ```no_run
//! # use idem_runtime as idem;
//! use axum::Router;
//! use idem::Idem;
//!
//! # fn demo(idem: Idem<sqlx::Postgres>, app: Router) -> Result<(), std::env::VarError> {
//! // A long random token, from the service's secrets.
//! let token = std::env::var("ADMIN_TOKEN")?;
//! let app = app.merge(idem::admin::router(idem, &token));
//! # let _ = app;
//! # Ok(()) }
//! ```

mod api;
mod auth;
mod format;
mod html;
mod page;
mod resolution;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::FromRef;
use axum::routing::{get, post};

use crate::backend::{Admin, Phased};
use crate::idem::Idem;

use auth::Auth;

/// How long a sign-in lasts by default: a working day.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(8 * 60 * 60);

/// The admin routes and page for `idem`'s keys, answering operators who
/// send `token` (see the [module](self)): [`Console::new`] with its
/// defaults.
///
/// # Panics
///
/// If `token` is empty: every request would then be an operator's.
pub fn router<DB: Admin + Phased>(idem: Idem<DB>, token: &str) -> Router {
    Console::new(idem, token).router()
}

/// The admin routes and page with their settings: [`router`] takes the
/// defaults.
///
/// ```no_run
/// # use idem_runtime as idem;
/// use std::time::Duration;
/// use idem::admin::Console;
///
/// # fn demo(idem: idem::Idem<sqlx::Postgres>, token: &str) {
/// let admin = Console::new(idem, token)
///     .session_ttl(Duration::from_secs(60 * 60))
///     .secure_cookie(true)
///     .router();
/// # let _: axum::Router = admin; }
/// ```
#[derive(Debug)]
pub struct Console<DB: Admin + Phased> {
    idem: Idem<DB>,
    auth: Auth,
}

impl<DB: Admin + Phased> Console<DB> {
    /// The routes for `idem`'s keys, answering operators who send `token`.
    ///
    /// # Panics
    ///
    /// If `token` is empty.
    pub fn new(idem: Idem<DB>, token: &str) -> Self {
        assert!(!token.is_empty(), "the admin token must not be empty");
        Self {
            idem,
            auth: Auth::new(token.as_bytes(), DEFAULT_SESSION_TTL),
        }
    }

    /// How long a sign-in lasts ([`DEFAULT_SESSION_TTL`] by default): past
    /// it the browser signs in again.
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.auth.ttl = ttl;
        self
    }

    /// Whether the session cookie is always `Secure` (`true`), or only
    /// when the sign-in came over HTTPS as the server can tell (`false`,
    /// the default): the request's URI says `https`, its `Origin` is an
    /// `https://` one, or a proxy said so in `X-Forwarded-Proto` or
    /// `Forwarded`. Set it behind a proxy that terminates TLS and says
    /// neither.
    pub fn secure_cookie(mut self, always: bool) -> Self {
        self.auth.always_secure = always;
        self
    }

    /// The routes, to merge into the service's router.
    pub fn router(self) -> Router {
        let shared = Shared {
            idem: self.idem,
            auth: Arc::new(self.auth),
        };
        Router::new()
            .route("/admin", get(page::overview::<DB>))
            .route("/admin/", get(page::overview::<DB>))
            .route("/admin/key", get(page::key::<DB>))
            .route("/admin/key/resolve", post(page::resolve::<DB>))
            .route("/admin/key/forget", post(page::forget::<DB>))
            .route("/admin/login", get(auth::login_page).post(auth::login))
            .route("/admin/logout", post(auth::logout))
            .route("/admin/idempotency/{scope}", get(api::recent::<DB>))
            .route(
                "/admin/idempotency/{scope}/{key}",
                get(api::lookup::<DB>).delete(api::forget::<DB>),
            )
            .route(
                "/admin/idempotency/{scope}/{key}/resolve",
                post(api::resolve::<DB>),
            )
            .with_state(shared)
    }
}

/// What the routes share: the store and who may use them.
struct Shared<DB: Admin + Phased> {
    idem: Idem<DB>,
    auth: Arc<Auth>,
}

// Written out: `derive(Clone)` would ask `DB: Clone`.
impl<DB: Admin + Phased> Clone for Shared<DB> {
    fn clone(&self) -> Self {
        Self {
            idem: self.idem.clone(),
            auth: Arc::clone(&self.auth),
        }
    }
}

impl<DB: Admin + Phased> FromRef<Shared<DB>> for Arc<Auth> {
    fn from_ref(shared: &Shared<DB>) -> Self {
        Arc::clone(&shared.auth)
    }
}
