//! The operator page's HTML: one layout (landmarks, a skip link, inline
//! responsive CSS, no script), the sign-in form and the short pages that
//! say no. Every value is escaped by maud; nothing is marked pre-escaped
//! but the constant style sheet.

mod keys;
#[cfg(test)]
mod tests;

pub(super) use keys::{KeyView, Overview, key, overview};

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use maud::{DOCTYPE, Markup, PreEscaped, html};

/// Scripts are refused outright; styles are the inline sheet's; forms post
/// only here; no framing (clickjacking).
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";

const CSS: &str = r#"
:root{color-scheme:light dark;--fg:#1b1f24;--bg:#fff;--muted:#57606a;--line:#d0d7de;--accent:#0b5cad;--warn:#9a3412;--warnbg:#fff4e5;--okbg:#e9f7ef;--badbg:#fdecea}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--bg:#0d1117;--muted:#9da7b3;--line:#30363d;--accent:#6cb6ff;--warn:#f0a35e;--warnbg:#2d1f0e;--okbg:#12261a;--badbg:#2d1214}}
*{box-sizing:border-box}
body{margin:0;font:16px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
a{color:var(--accent)}
:focus-visible{outline:3px solid var(--accent);outline-offset:2px}
.skip{position:absolute;left:-999px;top:0;background:var(--bg);padding:.5rem 1rem}
.skip:focus{left:.5rem}
header.top{display:flex;flex-wrap:wrap;gap:.5rem 1.5rem;align-items:center;justify-content:space-between;padding:.75rem 1rem;border-bottom:1px solid var(--line)}
.brand{margin:0;font-weight:700}
.brand a{color:inherit;text-decoration:none}
nav ul{display:flex;flex-wrap:wrap;gap:.5rem 1rem;list-style:none;margin:0;padding:0;align-items:center}
main{max-width:72rem;margin:0 auto;padding:1rem}
main:focus{outline:none}
h1{font-size:1.6rem;margin:.5rem 0 1rem;overflow-wrap:anywhere}
h2{font-size:1.25rem;margin:2rem 0 .5rem;border-bottom:1px solid var(--line);padding-bottom:.25rem}
h3{font-size:1.05rem;margin:1.25rem 0 .5rem}
.hint{color:var(--muted);margin:.25rem 0 .75rem}
.table{overflow-x:auto;border:1px solid var(--line);border-radius:6px}
table{border-collapse:collapse;width:100%;font-size:.95rem}
caption{text-align:left;padding:.5rem;color:var(--muted)}
th,td{text-align:left;vertical-align:top;padding:.4rem .6rem;border-top:1px solid var(--line)}
thead th{border-top:0;white-space:nowrap}
td code,th code{overflow-wrap:break-word}
dd code{overflow-wrap:anywhere}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.9em}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:.25rem 1rem;margin:0}
dl.facts dt{font-weight:600}
dl.facts dd{margin:0;overflow-wrap:anywhere}
.state{font-weight:700}
.notice,.error{padding:.75rem 1rem;border-radius:6px;margin:0 0 1rem}
.notice{background:var(--okbg)}
.error{background:var(--badbg)}
.error h2{margin-top:0;border:0;font-size:1.1rem}
.uncertain{background:var(--warnbg);color:var(--warn);padding:0 .3rem;border-radius:4px}
form.act{border:1px solid var(--line);border-radius:6px;padding:1rem;margin:0 0 1rem}
form.act>h3:first-child{margin-top:0}
form.act button{display:block}
form.inline{display:inline}
label{display:block;font-weight:600;margin:.5rem 0 .2rem}
input,textarea,button{font:inherit}
input[type=text],input[type=search],input[type=password],input[type=number],textarea{width:100%;max-width:36rem;padding:.45rem .5rem;border:1px solid var(--muted);border-radius:4px;background:var(--bg);color:var(--fg)}
textarea{min-height:8rem;font-family:ui-monospace,monospace}
button{margin-top:.75rem;padding:.5rem 1rem;border-radius:6px;border:1px solid var(--accent);background:var(--accent);color:var(--bg);cursor:pointer;min-height:44px}
nav button{margin:0;background:none;color:var(--accent);border-color:var(--line)}
button.danger{background:var(--warn);border-color:var(--warn)}
.search{display:flex;flex-wrap:wrap;gap:0 1rem;align-items:end}
.search div{flex:1 1 14rem}
@media (max-width:40rem){dl.facts{grid-template-columns:1fr}dl.facts dd{margin-bottom:.5rem}h1{font-size:1.3rem}main{padding:.75rem}}
"#;

/// What a page knows of who looks at it: a signed-in browser's form token
/// (and so a sign-out button), or a bearer's empty one.
pub(in crate::admin) struct Viewer {
    /// Posted back with every form.
    pub(in crate::admin) csrf: String,
    /// Whether a session is signed in (a bearer has none to end).
    pub(in crate::admin) session: bool,
}

/// `content` in the page's layout, answered with `status` and headers
/// that keep it out of frames and caches.
pub(super) fn respond(
    status: StatusCode,
    title: &str,
    viewer: Option<&Viewer>,
    content: Markup,
) -> Response {
    let page = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="robots" content="noindex";
                title { (title) " · idem operators" }
                style { (PreEscaped(CSS)) }
            }
            body {
                a.skip href="#main" { "Skip to the content" }
                header.top {
                    p.brand { a href="/admin" { "idem operators" } }
                    @if let Some(viewer) = viewer {
                        nav aria-label="Main" {
                            ul {
                                li { a href="/admin" { "Overview" } }
                                li { a href="/admin#find" { "Find keys" } }
                                @if viewer.session {
                                    li {
                                        form.inline method="post" action="/admin/logout" {
                                            input type="hidden" name="csrf" value=(viewer.csrf);
                                            button type="submit" { "Sign out" }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                main #main tabindex="-1" { (content) }
            }
        }
    };
    let mut response = (status, page.into_string()).into_response();
    let headers = response.headers_mut();
    let set = |headers: &mut http::HeaderMap, name, value| {
        headers.insert(name, HeaderValue::from_static(value));
    };
    set(headers, header::CONTENT_TYPE, "text/html; charset=utf-8");
    set(headers, header::CONTENT_SECURITY_POLICY, CSP);
    set(headers, header::X_FRAME_OPTIONS, "DENY");
    set(headers, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(headers, header::REFERRER_POLICY, "no-referrer");
    set(headers, header::CACHE_CONTROL, "no-store");
    response
}

/// The sign-in form, with `error` said first.
pub(super) fn login(status: StatusCode, next: &str, error: Option<&str>) -> Response {
    let content = html! {
        h1 { "Sign in" }
        @if let Some(error) = error {
            p.error role="alert" { (error) " Nothing was signed in." }
        }
        form.act method="post" action="/admin/login" {
            input type="hidden" name="next" value=(next);
            label for="token" { "Admin token" }
            input #token type="password" name="token" required autocomplete="current-password"
                aria-describedby="token-hint";
            p.hint #token-hint {
                "The token the service was given for its operators. Your browser keeps "
                "a signed session cookie, never the token."
            }
            button type="submit" { "Sign in" }
        }
    };
    respond(status, "Sign in", None, content)
}

/// 403: a post from another site (or a page of another origin).
pub(in crate::admin) fn cross_site() -> Response {
    let content = html! {
        h1 { "Refused" }
        p.error role="alert" {
            "This form was sent from another site, so nothing changed. "
            "Use the forms on this service's own pages."
        }
        p { a href="/admin" { "Back to the overview" } }
    };
    respond(StatusCode::FORBIDDEN, "Refused", None, content)
}

/// 403: a form whose token is not its session's (another site's, or from
/// before signing in again).
pub(in crate::admin) fn stale_form() -> Response {
    let content = html! {
        h1 { "Refused" }
        p.error role="alert" {
            "This form's token is not your session's (it is from an older "
            "session, or another site sent it), so nothing changed. Reload the "
            "page and try again."
        }
        p { a href="/admin" { "Back to the overview" } }
    };
    respond(StatusCode::FORBIDDEN, "Refused", None, content)
}

/// 404 for a key the store does not hold (`gone`: resolved just now and
/// released, which is no error).
pub(super) fn no_key(viewer: &Viewer, scope: &str, key: &str, gone: bool) -> Response {
    let scope_page = format!("/admin?scope={}", super::format::encode(scope));
    let content = html! {
        h1 { "Key " code { (key) } }
        @if gone {
            p.notice role="status" {
                "Resolved. The key is no longer stored: its next request runs afresh."
            }
        } @else {
            p.error role="alert" { "The store holds no such key in scope " code { (scope) } "." }
        }
        p { a href=(scope_page) { "The scope's recent keys" } }
    };
    let status = if gone {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    respond(status, "No such key", Some(viewer), content)
}

/// 500: the store failed (its cause is in the service's log).
pub(super) fn store_failed(viewer: &Viewer) -> Response {
    let content = html! {
        h1 { "The key store failed" }
        p.error role="alert" { "Nothing changed. The cause is in the service's log; try again." }
    };
    respond(
        StatusCode::INTERNAL_SERVER_ERROR,
        "Store error",
        Some(viewer),
        content,
    )
}
