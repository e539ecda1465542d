//! Who may use the admin routes: the bearer token, the page's signed
//! sessions and their form tokens, and the refusal of cross-site posts.
//!
//! A session cookie is `<expiry>.<nonce>.<mac>`: the expiry in seconds
//! since the epoch, 16 random bytes, and HMAC-SHA256 over both under a key
//! derived from the token. The token itself never leaves the server, and
//! the server keeps nothing per session but the nonces signed out early.
//! A form's token is the HMAC of its session's nonce under the same key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Form;
use axum::extract::{FromRef, FromRequestParts, Query};
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::format::{encode, problem};
use super::html;

type HmacSha256 = Hmac<Sha256>;

/// The session cookie's name.
pub(super) const COOKIE: &str = "idem_admin";

/// The most early sign-outs remembered at once; past it the oldest are
/// dropped (their sessions then last until they expire).
const MAX_REVOKED: usize = 10_000;

/// The token's digest and the keys derived from it.
pub(super) struct Auth {
    /// SHA-256 of the token: a sent token's digest is compared with it in
    /// constant time, whatever the two lengths.
    token: [u8; 32],
    /// HMAC-SHA256(token, "idem admin session v1"): signs sessions and form
    /// tokens.
    key: [u8; 32],
    pub(super) ttl: Duration,
    pub(super) always_secure: bool,
    /// Nonces of sessions signed out before their expiry, with it.
    revoked: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("ttl", &self.ttl)
            .field("always_secure", &self.always_secure)
            .finish_non_exhaustive()
    }
}

/// Who is asking, as the request showed it.
pub(super) enum Operator {
    /// `Authorization: Bearer <token>`: a script, never a form a browser
    /// sends on its own.
    Bearer,
    /// A signed-in browser, by its session's nonce.
    Session(String),
}

impl Auth {
    pub(super) fn new(token: &[u8], ttl: Duration) -> Self {
        let mut derive = HmacSha256::new_from_slice(token).expect("HMAC takes any key length");
        derive.update(b"idem admin session v1");
        Self {
            token: Sha256::digest(token).into(),
            key: derive.finalize().into_bytes().into(),
            ttl,
            always_secure: false,
            revoked: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `sent` is the token, in time independent of both.
    pub(super) fn is_token(&self, sent: &[u8]) -> bool {
        let sent: [u8; 32] = Sha256::digest(sent).into();
        sent.ct_eq(&self.token).into()
    }

    /// The operator `headers` show: the bearer token first, else a live
    /// session cookie.
    pub(super) fn operator(&self, headers: &HeaderMap) -> Option<Operator> {
        if let Some(sent) = bearer(headers) {
            // A wrong bearer is refused outright, cookie or not.
            return self.is_token(sent).then_some(Operator::Bearer);
        }
        cookies(headers)
            .find_map(|value| self.session(value))
            .map(Operator::Session)
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.key).expect("HMAC takes any key length")
    }

    /// A new session's cookie value.
    fn issue(&self) -> String {
        let expiry = now_secs().saturating_add(self.ttl.as_secs());
        let nonce = hex::encode(rand::random::<[u8; 16]>());
        let mut mac = self.mac();
        mac.update(format!("session\0{expiry}.{nonce}").as_bytes());
        let signature = hex::encode(mac.finalize().into_bytes());
        format!("{expiry}.{nonce}.{signature}")
    }

    /// The nonce of the session `value` holds, if it is one this token
    /// signed, unexpired and not signed out.
    fn session(&self, value: &str) -> Option<String> {
        let mut parts = value.splitn(3, '.');
        let (expiry, nonce, signature) = (parts.next()?, parts.next()?, parts.next()?);
        let mut mac = self.mac();
        mac.update(format!("session\0{expiry}.{nonce}").as_bytes());
        mac.verify_slice(&hex::decode(signature).ok()?).ok()?;
        let expiry: u64 = expiry.parse().ok()?;
        let revoked = self.revoked.lock().unwrap_or_else(PoisonError::into_inner);
        (expiry > now_secs() && !revoked.contains_key(nonce)).then(|| nonce.to_owned())
    }

    /// Signs the session `nonce` out before its expiry, in this process.
    fn revoke(&self, nonce: &str) {
        let now = now_secs();
        let mut revoked = self.revoked.lock().unwrap_or_else(PoisonError::into_inner);
        revoked.retain(|_, expiry| *expiry > now);
        // The session ending soonest is the one least worth remembering.
        if revoked.len() >= MAX_REVOKED
            && let Some(first) = revoked
                .iter()
                .min_by_key(|(_, expiry)| **expiry)
                .map(|(nonce, _)| nonce.clone())
        {
            revoked.remove(&first);
        }
        revoked.insert(nonce.to_owned(), now.saturating_add(self.ttl.as_secs()));
    }

    /// The form token of `operator`'s forms: empty for a bearer, whose
    /// requests no browser sends by itself.
    pub(super) fn csrf(&self, operator: &Operator) -> String {
        match operator {
            Operator::Bearer => String::new(),
            Operator::Session(nonce) => {
                let mut mac = self.mac();
                mac.update(format!("csrf\0{nonce}").as_bytes());
                hex::encode(mac.finalize().into_bytes())
            }
        }
    }

    /// Whether a form `operator` posted with `sent` as its token may act.
    pub(super) fn csrf_ok(&self, operator: &Operator, sent: &str) -> bool {
        match operator {
            Operator::Bearer => true,
            Operator::Session(nonce) => {
                let Ok(sent) = hex::decode(sent) else {
                    return false;
                };
                let mut mac = self.mac();
                mac.update(format!("csrf\0{nonce}").as_bytes());
                mac.verify_slice(&sent).is_ok()
            }
        }
    }

    /// The `Set-Cookie` of a new session for `parts`' request.
    fn cookie(&self, value: &str, parts: &Parts) -> HeaderValue {
        let secure = if self.always_secure || over_https(parts) {
            "; Secure"
        } else {
            ""
        };
        let max_age = self.ttl.as_secs();
        HeaderValue::try_from(format!(
            "{COOKIE}={value}; Path=/admin; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
        ))
        .expect("digits, hex and ASCII attributes")
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs())
}

/// The credentials of `Authorization: Bearer <credentials>` (the scheme
/// in any case, as RFC 9110 has it).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| rest.trim_ascii())
}

/// The values of every `idem_admin` cookie the request carries.
fn cookies(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
}

/// Whether the request came over HTTPS, as far as the server can tell.
fn over_https(parts: &Parts) -> bool {
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase()
    };
    parts.uri.scheme_str() == Some("https")
        || header("origin").starts_with("https://")
        || header("x-forwarded-proto").split(',').next().map(str::trim) == Some("https")
        || header("forwarded").contains("proto=https")
}

/// Whether a browser sent this request from the admin's own origin, as
/// its `Sec-Fetch-Site` (or, from older browsers, its `Origin`) says. A
/// request with neither header is not a browser's cross-site post
/// (browsers send `Origin` with every `POST`); the form token stands
/// guard as well.
pub(super) fn same_origin(parts: &Parts) -> bool {
    if let Some(site) = parts.headers.get("sec-fetch-site") {
        return matches!(site.as_bytes(), b"same-origin" | b"none");
    }
    let Some(origin) = parts.headers.get(header::ORIGIN) else {
        return true;
    };
    let host = parts
        .headers
        .get(header::HOST)
        .map(HeaderValue::as_bytes)
        .or_else(|| parts.uri.authority().map(|a| a.as_str().as_bytes()));
    let authority = origin
        .to_str()
        .ok()
        .and_then(|origin| origin.split_once("://"))
        .map(|(_, authority)| authority.as_bytes());
    matches!((authority, host), (Some(a), Some(h)) if a.eq_ignore_ascii_case(h))
}

fn safe_method(method: &Method) -> bool {
    method == Method::GET || method == Method::HEAD
}

/// A path under `/admin` to go to after signing in; anything else (another
/// site, a path elsewhere, a header's control bytes) is `/admin`.
fn next_or_home(next: Option<&str>) -> &str {
    next.filter(|next| {
        let under = next
            .strip_prefix("/admin")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']));
        under
            && !next.contains("//")
            && !next.contains('\\')
            && next.bytes().all(|b| b > 0x20 && b < 0x7f)
    })
    .unwrap_or("/admin")
}

/// A 303 to `location`, not kept by caches.
pub(super) fn see_other(location: &str) -> Response {
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, location),
            (header::CACHE_CONTROL, "no-store"),
        ],
    )
        .into_response()
}

/// An operator of the page: a browser that is not signed in is sent to
/// the login page (and back here after); a post from another site is
/// refused.
pub(super) struct PageOperator(pub(super) Operator);

impl<S: Send + Sync> FromRequestParts<S> for PageOperator
where
    Arc<Auth>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let auth = Arc::<Auth>::from_ref(state);
        let Some(operator) = auth.operator(&parts.headers) else {
            let here = parts.uri.path_and_query().map_or("/admin", |p| p.as_str());
            let back = if safe_method(&parts.method) {
                here
            } else {
                "/admin"
            };
            return Err(see_other(&format!("/admin/login?next={}", encode(back))));
        };
        if matches!(operator, Operator::Session(_))
            && !safe_method(&parts.method)
            && !same_origin(parts)
        {
            return Err(html::cross_site());
        }
        Ok(Self(operator))
    }
}

/// An operator of the JSON routes: the bearer token, or a signed-in
/// browser reading (`GET`). Anything else is answered 401 with
/// `WWW-Authenticate: Bearer`.
pub(super) struct ApiOperator;

impl<S: Send + Sync> FromRequestParts<S> for ApiOperator
where
    Arc<Auth>: FromRef<S>,
{
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let auth = Arc::<Auth>::from_ref(state);
        match auth.operator(&parts.headers) {
            Some(Operator::Bearer) => Ok(Self),
            Some(Operator::Session(_)) if safe_method(&parts.method) => Ok(Self),
            _ => Err(unauthorized()),
        }
    }
}

/// 401, asking for the bearer token.
fn unauthorized() -> Response {
    let mut response = problem(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "send Authorization: Bearer <admin token>",
    );
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

#[derive(Deserialize)]
pub(super) struct Next {
    next: Option<String>,
}

/// `GET /admin/login`: the sign-in form (or, signed in already, onwards).
pub(super) async fn login_page(
    axum::extract::State(auth): axum::extract::State<Arc<Auth>>,
    headers: HeaderMap,
    Query(Next { next }): Query<Next>,
) -> Response {
    let next = next_or_home(next.as_deref());
    if auth.operator(&headers).is_some() {
        return see_other(next);
    }
    html::login(StatusCode::OK, next, None)
}

#[derive(Deserialize)]
pub(super) struct LoginForm {
    #[serde(default)]
    token: String,
    next: Option<String>,
}

/// `POST /admin/login`: with the token, a session cookie and onwards;
/// without it, 401 and the form again, and no cookie.
pub(super) async fn login(
    axum::extract::State(auth): axum::extract::State<Arc<Auth>>,
    parts: Parts,
    Form(form): Form<LoginForm>,
) -> Response {
    // Signing a browser in from another site (login CSRF) is refused too.
    if !same_origin(&parts) {
        return html::cross_site();
    }
    let next = next_or_home(form.next.as_deref());
    if !auth.is_token(form.token.as_bytes()) {
        tracing::warn!("idempotency admin sign-in with a wrong token");
        return html::login(
            StatusCode::UNAUTHORIZED,
            next,
            Some("That is not the admin token."),
        );
    }
    tracing::info!("idempotency admin signed in");
    let mut response = see_other(next);
    let cookie = auth.cookie(&auth.issue(), &parts);
    response.headers_mut().insert(header::SET_COOKIE, cookie);
    response
}

#[derive(Deserialize)]
pub(super) struct LogoutForm {
    #[serde(default)]
    csrf: String,
}

/// `POST /admin/logout`: the session ends (everywhere for its cookie, in
/// this process for a copy of it) and the cookie is cleared.
pub(super) async fn logout(
    axum::extract::State(auth): axum::extract::State<Arc<Auth>>,
    PageOperator(operator): PageOperator,
    Form(form): Form<LogoutForm>,
) -> Response {
    if !auth.csrf_ok(&operator, &form.csrf) {
        return html::stale_form();
    }
    if let Operator::Session(nonce) = &operator {
        auth.revoke(nonce);
    }
    let mut response = see_other("/admin/login");
    response.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("idem_admin=; Path=/admin; HttpOnly; SameSite=Strict; Max-Age=0"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut request = http::Request::post("/admin/key/resolve");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_token_and_only_it_is_an_operator() {
        let auth = Auth::new(b"s3cret", Duration::from_secs(60));
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            auth.operator(&headers).is_some()
        };
        assert!(with("Bearer s3cret"));
        assert!(with("bearer s3cret"));
        assert!(!with("Bearer s3cre"));
        assert!(!with("Bearer s3cret2"));
        assert!(!with("Basic s3cret"));
    }

    #[test]
    fn sessions_are_signed_expire_and_end() {
        let auth = Auth::new(b"s3cret", Duration::from_secs(60));
        let value = auth.issue();
        assert!(!value.contains("s3cret"));
        let nonce = auth.session(&value).expect("a fresh session");
        // Another token's key, a changed expiry, a changed nonce: refused.
        assert!(
            Auth::new(b"other", Duration::from_secs(60))
                .session(&value)
                .is_none()
        );
        let (expiry, rest) = value.split_once('.').unwrap();
        let later = expiry.parse::<u64>().unwrap() + 1000;
        assert!(auth.session(&format!("{later}.{rest}")).is_none());
        let other_nonce = "0".repeat(nonce.len());
        assert!(
            auth.session(&value.replacen(&nonce, &other_nonce, 1))
                .is_none()
        );
        // Its form token is its own; signed out, it is over.
        let operator = Operator::Session(nonce.clone());
        let csrf = auth.csrf(&operator);
        assert!(auth.csrf_ok(&operator, &csrf));
        assert!(!auth.csrf_ok(&operator, ""));
        assert!(!auth.csrf_ok(&Operator::Session("other".into()), &csrf));
        auth.revoke(&nonce);
        assert!(auth.session(&value).is_none());
        // Expired.
        let brief = Auth::new(b"s3cret", Duration::ZERO);
        assert!(brief.session(&brief.issue()).is_none());
    }

    #[test]
    fn cross_site_posts_are_told_apart() {
        assert!(same_origin(&parts(&[])));
        assert!(same_origin(&parts(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&parts(&[("sec-fetch-site", "same-site")])));
        assert!(!same_origin(&parts(&[("sec-fetch-site", "cross-site")])));
        let host = ("host", "127.0.0.1:3000");
        assert!(same_origin(&parts(&[
            host,
            ("origin", "http://127.0.0.1:3000")
        ])));
        assert!(!same_origin(&parts(&[
            host,
            ("origin", "http://127.0.0.1:3001")
        ])));
        assert!(!same_origin(&parts(&[host, ("origin", "null")])));
    }

    #[test]
    fn only_admin_paths_are_next() {
        assert_eq!(
            next_or_home(Some("/admin/key?scope=a")),
            "/admin/key?scope=a"
        );
        assert_eq!(next_or_home(Some("/admin")), "/admin");
        for elsewhere in [
            "//evil.example",
            "https://evil.example/admin",
            "/adminx",
            "/admin//x",
            "/admin\r\nX: y",
        ] {
            assert_eq!(next_or_home(Some(elsewhere)), "/admin", "{elsewhere}");
        }
        assert_eq!(next_or_home(None), "/admin");
    }
}
