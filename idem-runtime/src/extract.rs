//! The traits a generated `Handler` impl reaches the router's state, the
//! extractors and the store through: `__IdemS: __IdemFromParts<T>` rather
//! than `T: FromRequestParts<__IdemS>`. While the router's state type is
//! still being inferred at `post(handler)`, a bound whose self type is that
//! state stays open, so rustc picks the handler's impl and then names the
//! extractor that fails, at its parameter, instead of reporting that
//! `Handler<_, _>` is not implemented.
//!
//! Defined once here, not in each handler's expansion: every handler of a
//! service then shares one compiled copy of each (state, extractor) pair's
//! extraction, and the compiler checks the traits once.

use axum::extract::{FromRef, FromRequest, FromRequestParts, Request};
use axum::response::{IntoResponse, Response};

/// The store taken from the state by [`FromRef`]. The blanket impl is not
/// recommended in diagnostics, so a state without the store is reported
/// with this trait's message, not as axum's `FromRef` bound.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "the router's state `{Self}` holds no `{T}`",
    label = "an `#[idempotent]` handler takes its key store from the router's state",
    note = "add a field of type `{T}` to `{Self}` and derive `Clone, FromRef` on it \
            (axum's `macros` feature), or implement `FromRef<{Self}> for {T}`"
)]
pub trait __IdemFromRef<T> {
    /// `T::from_ref(state)`.
    fn from_ref(state: &Self) -> T;
}

#[diagnostic::do_not_recommend]
impl<S, T: FromRef<S>> __IdemFromRef<T> for S {
    fn from_ref(state: &Self) -> T {
        T::from_ref(state)
    }
}

/// A [`FromRequestParts`] extractor, run on a whole request that is handed
/// back with the value; a rejection is already a response.
#[doc(hidden)]
pub trait __IdemFromParts<T> {
    /// Runs `T`'s extractor on `request`'s head.
    fn extract(
        request: Request,
        state: &Self,
    ) -> impl Future<Output = Result<(Request, T), Response>> + Send;
}

impl<S, T> __IdemFromParts<T> for S
where
    S: Send + Sync,
    T: FromRequestParts<S>,
{
    async fn extract(request: Request, state: &Self) -> Result<(Request, T), Response> {
        let (mut parts, body) = request.into_parts();
        match T::from_request_parts(&mut parts, state).await {
            Ok(value) => Ok((Request::from_parts(parts, body), value)),
            Err(rejection) => Err(rejection.into_response()),
        }
    }
}

/// A [`FromRequest`] extractor with axum's marker `M` (a parts extractor
/// in a handler without a body extractor).
#[doc(hidden)]
pub trait __IdemFromRequest<T, M> {
    /// Runs `T`'s extractor on `request`.
    fn extract(request: Request, state: &Self) -> impl Future<Output = Result<T, Response>> + Send;
}

impl<S, T, M> __IdemFromRequest<T, M> for S
where
    S: Send + Sync,
    T: FromRequest<S, M>,
{
    async fn extract(request: Request, state: &Self) -> Result<T, Response> {
        T::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)
    }
}

/// The body extractor, the handler's last parameter.
#[doc(hidden)]
pub trait __IdemFromBody<T> {
    /// Runs `T`'s extractor on `request`, body included.
    fn extract(request: Request, state: &Self) -> impl Future<Output = Result<T, Response>> + Send;
}

impl<S, T> __IdemFromBody<T> for S
where
    S: Send + Sync,
    T: FromRequest<S>,
{
    async fn extract(request: Request, state: &Self) -> Result<T, Response> {
        T::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)
    }
}
