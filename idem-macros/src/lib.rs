//! The `#[idempotent]` attribute of [`idem`](https://docs.rs/idem).
//!
//! Depend on `idem`, which re-exports this attribute; the expansion names
//! only `::idem::__private` paths (or the `crate = "..."` override).

#![warn(missing_docs)]

mod attr;
mod duration;
mod errors;
mod expand;
mod shell;
mod valid;

use proc_macro::TokenStream;

/// Makes an axum write handler safe to retry with an `Idempotency-Key`.
///
/// The client sends one key per logical operation on every attempt. The
/// first attempt claims the key in the handler's own transaction, runs the
/// handler, and stores its response in the same commit as its writes; every
/// retry with the same key and the same request gets that response again,
/// with `Idempotent-Replayed: true`, and the handler does not run.
///
/// ```ignore
/// use idem::{Tx, idempotent};
/// use sqlx::Postgres;
///
/// #[idempotent(scope = "account", ttl = "24h")]
/// async fn create_charge(
///     account: Account,           // the caller: implements `idem::Scope`
///     mut tx: Tx<Postgres>,       // the request's transaction; exactly one
///     Json(new): Json<NewCharge>, // other extractors; the body's last
/// ) -> Result<(StatusCode, Json<Charge>), ApiError> {
///     let charge = insert_charge(&mut *tx, &account, new).await?; // `Err`: rolled back
///     Ok((StatusCode::CREATED, Json(charge)))                    // committed and stored
/// }
///
/// let app = Router::new()
///     .route("/v1/charges", post(create_charge))
///     .with_state(state); // any state where `Idem<Postgres>: FromRef<State>`
/// ```
///
/// # The handler
///
/// - A free `async fn`: not a method (`self`), not in an `impl` block, not
///   generic (nor taking `impl Trait`), `const`, `unsafe`, `extern` or
///   variadic.
/// - Exactly one `Tx<DB>` parameter, by value, anywhere among the others:
///   `DB` is one of the enabled engines (`sqlx::Postgres`, `sqlx::Sqlite`,
///   `sqlx::MySql`). An alias works if it is named `Tx`
///   (`type Tx = idem::Tx<Postgres>;`, then `tx: db::Tx`). Or, in its
///   place, exactly one `Phases<DB>` (see [Phased handlers](#phased-handlers)).
/// - Every other parameter is an axum extractor, run in order. One that
///   consumes the body (`Json`, `Form`, `Bytes`, `String`, `Body`,
///   `Request`, `Multipart`, `RawForm`, ...) comes last.
/// - `scope` names one of them, bound to a plain name; its type implements
///   `idem::Scope` and reads the request's head (`FromRequestParts`), never
///   its body.
/// - No `#[cfg]` on a parameter (put it on the whole handler), and no
///   `#[debug_handler]`: the `Tx` is not one of axum's extractors.
/// - The return type is any `IntoResponse`. The transaction commits, with
///   the stored response, when the handler answers a storable status
///   (below 500, not 408 or 429); it rolls back on a transient status, on a
///   panic and on any `Err`, whatever the error's status, if the return
///   type names a `Result` (under any alias): behind `-> impl IntoResponse`
///   only the status is seen.
///
/// The handler works in any `Router<S>` where `Idem<DB>: FromRef<S>`; the
/// state is never named here.
///
/// # Phased handlers
///
/// A handler that calls something outside its database (a payment
/// provider, a mailer) cannot put that call in its transaction: it takes a
/// `Phases<DB>` parameter in place of the `Tx`. The key is then claimed in
/// a commit of its own, held by a lease ([`lease`](#lease), below), and the handler
/// runs in steps it names, each recorded under the key as it ends:
/// `phases.local(name, ..)` runs a local phase in a transaction of its
/// own, `phases.external(label, ..)` calls out with a key derived from the
/// request's, the same on every attempt, and `phases.last_phase()` returns
/// the connection whose writes commit with the stored response. An attempt
/// that fails (an `Err`, a transient status, a panic, its `timeout`) before
/// any external step gives its key up, and the next one starts afresh;
/// once an external step may have happened, the key and its recorded steps
/// stay, and the next attempt (the client's retry, or `idem::completer::Completer`
/// for one that stopped) resumes, skipping the steps already recorded.
///
/// ```ignore
/// use idem::{Phases, idempotent};
/// use sqlx::Postgres;
///
/// #[idempotent(scope = "account", lease = "10s")]
/// async fn create_payment(
///     account: Account,             // implements `idem::Scope` and `idem::FromScope`
///     mut phases: Phases<Postgres>, // in place of `Tx<Postgres>`; exactly one
///     Json(new): Json<NewPayment>,
/// ) -> Result<(StatusCode, Json<Payment>), ApiError> {
///     let id = phases.local("pending", async |tx| insert_pending(tx, &new).await).await?;
///     let charge = phases
///         .external("provider", async |key| provider.charge(key, &new).await)
///         .await?;
///     let payment = mark_paid(phases.last_phase().await?, id, &charge).await?;
///     Ok((StatusCode::CREATED, Json(payment)))
/// }
/// ```
///
/// - `DB` is one of the enabled engines (`sqlx::Postgres`, `sqlx::Sqlite`,
///   `sqlx::MySql`), as for `Tx`.
/// - The scope's type implements `idem::FromScope` as well as
///   `idem::Scope`: the completer resumes a request without the caller's
///   credentials (`idem` never stores them) and builds the scope parameter
///   from the scope the key was stored under (`FromScope::from_scope`).
///   `Extension<T>` does where `T: FromScope`.
/// - A handler takes a `Tx` or a `Phases`, never both, and one `Phases` at
///   most.
/// - `key = "optional"` and `wait` are refused: the phases are recorded
///   under the key, and a duplicate is answered 409 at once, with
///   `Retry-After` from the lease.
/// - Everything else (the other extractors, `scope`, `ttl`, `timeout`, the
///   return type) is as for a `Tx`; the last phase commits, with the stored
///   response, when a `Tx` would.
///
/// # Arguments
///
/// Every argument is `name = "string literal"`, separated by commas, each
/// at most once.
///
/// ## `scope` (required)
///
/// `scope = "<parameter>"`: the parameter that identifies the caller, such
/// as the authenticated account. Keys are looked up per (scope, key), so two
/// callers never share a key and a stored response is never replayed to
/// another caller. It cannot name the `Tx`, a body extractor, or a binding
/// inside a pattern (`Json(x)`, `account @ Account(..)`): bind the
/// extractor whole. A scope longer than 2,048 bytes (`idem::MAX_SCOPE_LEN`)
/// is answered 500.
/// A caller that authentication middleware puts in the request's
/// extensions scopes through `Extension<User>` where `User: idem::Scope`.
///
/// ```ignore
/// #[idempotent(scope = "user")]
/// async fn refund(user: Extension<User>, mut tx: Tx<Postgres>, Json(r): Json<Refund>) -> Response { ... }
/// ```
///
/// ## `ttl`
///
/// `ttl = "<whole number><unit>"`, the unit one of `ms`, `s`, `m`, `h`,
/// `d`, with no space (`"1 day"` or `"24hours"` is refused with the
/// spelling to write): how long a key and its response are kept and
/// replayed. Default `"24h"`; more than zero, at most `"365d"`. The time
/// counts from the claim, or from the response for a request that ran a
/// tenth of its `ttl` or longer. After it the key is free again: a retry
/// with it runs as a first attempt.
///
/// ```ignore
/// #[idempotent(scope = "account", ttl = "7d")]
/// ```
///
/// ## `tombstone`
///
/// `tombstone = "<whole number><unit>"`, written as `ttl` is: keeps the
/// key past its `ttl`, without its response, until this long after the
/// response. Meanwhile a retry with the same request gets 409
/// `idempotency_key_expired` (no `Retry-After`) with the first status and
/// `Location` (the problem's `original_status` and `location`), and
/// nothing runs; another request gets 422. After it the key runs as new.
/// Longer than `ttl` (24h unless set), at most `"3650d"`. Without it a
/// key is forgotten after its `ttl`.
///
/// ```ignore
/// #[idempotent(scope = "account", ttl = "24h", tombstone = "30d")]
/// ```
///
/// ## `key`
///
/// `key = "required"` (the default) or `key = "optional"`: whether a
/// request without an `Idempotency-Key` header is refused (400,
/// `idempotency_key_missing`) or runs in a plain transaction, with nothing
/// claimed or stored (`tx.key()` is then `None`). A phased handler refuses
/// `key = "optional"`: its phases are recorded under the key.
///
/// ```ignore
/// #[idempotent(scope = "account", key = "optional")]
/// ```
///
/// ## `wait`
///
/// `wait = "<whole number><unit>"`, written as `ttl` is: how long a
/// concurrent duplicate (a retry that arrives while the first attempt with
/// its key is still running) waits for that attempt to end. It gets the
/// replay if the first attempt finishes in time, runs as the first attempt
/// if that one rolls back, and gets 409 (`idempotency_key_in_use`,
/// `Retry-After`) otherwise. Default `"0s"`: 409 at once. At most `"60s"`
/// (a waiting duplicate may hold a connection), and not longer than `ttl`.
/// How long a duplicate in another process waits depends on the engine:
/// MySQL counts whole seconds (and waits at least one), SQLite waits for
/// its write lock up to the pool's `busy_timeout` and answers 503 after it.
/// A phased handler refuses `wait`, even `"0s"`: a duplicate of a phased
/// request is answered 409 at once, with `Retry-After` from the lease.
///
/// ```ignore
/// #[idempotent(scope = "account", wait = "2s")]
/// ```
///
/// ## `timeout`
///
/// `timeout = "<whole number><unit>"`, written as `ttl` is: the handler's
/// deadline, counted from the claim. Past it the handler's future is
/// dropped where it stands, its connection closed (the server rolls the
/// transaction back), and the client answered 504 (`handler_timeout`,
/// `Retry-After`); nothing is stored, so a retry runs again. Default
/// `"30s"`; more than zero, at most `"1h"`. On PostgreSQL and MariaDB the
/// claim also bounds a database session left idle by a vanished client (a
/// half-open connection) by the deadline plus 2 s, releasing its key then;
/// on MySQL the server's `wait_timeout` is the bound.
///
/// ```ignore
/// #[idempotent(scope = "account", timeout = "10s")]
/// ```
///
/// ## `lease`
///
/// `lease = "<whole number><unit>"`, written as `ttl` is, for phased
/// handlers only (a `Phases<DB>` parameter; refused beside a `Tx`): how
/// long the claim, and each step recorded after it, holds the key for the
/// attempt that made it. A duplicate that arrives meanwhile is answered
/// 409 (`Retry-After`: the lease's time left); an attempt that stopped
/// keeps its key until its lease ends, and then the client's retry or the
/// completer takes it over, and the stopped attempt, if it was only slow,
/// can record nothing more. Longer than the longest step (a local phase,
/// an external call), which each renew it. Default `"30s"`; at least
/// `"1s"`, at most `"1h"`.
///
/// ```ignore
/// #[idempotent(scope = "account", lease = "2m")]
/// ```
///
/// ## `fingerprint`
///
/// `fingerprint(exclude = ["<pointer>", ...])`: members of a JSON body that
/// do not take part in the request's fingerprint, named by RFC 6901 JSON
/// Pointers (`"/client_ts"` is a top-level member, `"/trace/id"` the `id`
/// of `trace`, `~1` a `/` in a name and `~0` a `~`). A retry whose body
/// differs from the first attempt's only in those members (changed,
/// added or missing) is a replay; any other difference, in the rest of
/// the body, the method, the path or the query, is still 422. Default: the
/// whole body counts. A token that is an array index names an element
/// (`"/items/0/ts"` is the `ts` of the first item; `"/items/0"` leaves that
/// element out of its array, and the ones after it move up). The members
/// left out are still read (a broken one is a broken body), never hashed:
/// the rest is hashed in the same canonical form, no tree built. A body
/// that is not JSON (by its content type) is unaffected: it is hashed byte
/// for byte, whole. Each pointer must start with `/` (the root `""` would
/// leave out the whole body), use no `~` but `~0` and `~1`, and appear
/// once; the list may not be empty.
///
/// ```ignore
/// #[idempotent(scope = "account", fingerprint(exclude = ["/client_ts", "/trace/id"]))]
/// ```
///
/// ## `crate`
///
/// `crate = "<path>"`: the path of the `idem` crate, for a service that
/// renamed the dependency (`my_idem = { package = "idem", ... }` in
/// `Cargo.toml`). Default `"::idem"`. The generated code names only paths
/// under it.
///
/// ```ignore
/// #[idempotent(scope = "account", crate = "::my_idem")]
/// ```
///
/// # Errors
///
/// Every mistake in the arguments or the handler's shape is a compile
/// error on the token that is wrong, all of them at once:
///
/// ```text
/// error: `scope = "acount"` names no parameter of this handler; it could name `account`
///   --> src/charges.rs:10:22
///    |
/// 10 | #[idempotent(scope = "acount")]
///    |                      ^^^^^^^^
/// ```
///
/// Once those are fixed, rustc reports a scope type that does not implement
/// `idem::Scope` (or, for a phased handler, `idem::FromScope`), a parameter
/// that is not an extractor (where the handler is routed, with the
/// parameter labelled), or a return type that is not a response.
///
/// # What the handler becomes
///
/// The handler's name becomes a unit struct (the value `post(name)`
/// routes) in the function's module, so no module or type beside it may
/// have its name. Doc comments and `#[deprecated]` go onto that struct;
/// other attributes below `#[idempotent]` (lints, `#[tracing::instrument]`)
/// onto the body, kept as the struct's associated function of the same
/// name, so a span is named after the handler; a `#[cfg]` onto everything
/// generated. Inside the handler, parameters and locals may still be named
/// like it: there, the name is a plain function, not the handler. Elsewhere
/// in that module a pattern of that name matches the struct instead of
/// binding, as with any unit struct.
///
/// The struct implements `idem::IdempotentHandler`, whose `POLICY` holds
/// these arguments (`idem::Policy::of(name)` reads it): `idem::openapi`
/// (the `openapi` feature) documents the route from it. A
/// `#[utoipa::path]` goes above `#[idempotent]`, where it sees the function
/// as written; below it is a compile error.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    idempotent_impl(args.into(), item.into()).into()
}

fn idempotent_impl(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let item: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(item) => item,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "`#[idempotent]` applies to an `async fn` handler",
            );
            let error = error.to_compile_error();
            return quote::quote!(#error #item);
        }
    };
    let mut errors = errors::Errors::default();
    let args = attr::parse(args, &mut errors);
    let handler = valid::check(&item, &args, &mut errors);
    let error = errors
        .into_result()
        .err()
        .map(|error| error.to_compile_error());
    match handler {
        // Argument errors alone still expand (with defaults in their place),
        // so the route that uses the handler compiles and only the real
        // mistakes are reported.
        Some(handler) => {
            let expanded = expand::expand(&item, &args, &handler);
            quote::quote!(#error #expanded)
        }
        // A receiver means the function sits in an `impl` block, where a
        // struct cannot go: keep the function exactly as written.
        None if item.sig.receiver().is_some() => quote::quote!(#error #item),
        // The signature itself is wrong: keep the user's function beside
        // the errors (IDEs keep working on its body) behind a handler that
        // still routes, so no secondary errors follow.
        None => {
            let stub = expand::stub(&item, &args);
            quote::quote!(#error #stub)
        }
    }
}
