//! Who a key belongs to: the [`Scope`] trait.

use std::borrow::Cow;

/// The caller an idempotency key belongs to.
///
/// Keys are looked up per `(scope, key)`, never by key alone: two callers who
/// happen to pick the same key get two independent operations, and a stored
/// response is never replayed to another caller. Implement it on the
/// extractor that authenticates the caller (an account, a tenant, an API key
/// id) and name that parameter in `#[idempotent(scope = "...")]`.
///
/// ```
/// # use idem_runtime as idem;
/// use std::borrow::Cow;
///
/// struct Account { id: String }
///
/// impl idem::Scope for Account {
///     fn scope(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.id)
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot scope idempotency keys: it does not implement `idem::Scope`",
    label = "the parameter named by `scope = \"...\"` must implement `idem::Scope`",
    note = "implement `idem::Scope for {Self}` and return the authenticated caller's stable id from `fn scope(&self) -> Cow<'_, str>`"
)]
pub trait Scope {
    /// A stable identifier of the caller, such as an account id.
    fn scope(&self) -> Cow<'_, str>;
}

impl Scope for String {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl Scope for str {
    fn scope(&self) -> Cow<'_, str> {
        Cow::Borrowed(self)
    }
}

impl<T: Scope + ?Sized> Scope for &T {
    fn scope(&self) -> Cow<'_, str> {
        (**self).scope()
    }
}

impl<T: Scope + ?Sized> Scope for Box<T> {
    fn scope(&self) -> Cow<'_, str> {
        (**self).scope()
    }
}

impl<T: Scope + ?Sized> Scope for std::sync::Arc<T> {
    fn scope(&self) -> Cow<'_, str> {
        (**self).scope()
    }
}
