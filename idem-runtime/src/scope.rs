//! Who a key belongs to: the [`Scope`] trait.

use std::borrow::Cow;

use crate::error::Error;

/// The longest scope, in bytes, that `idem` stores: a request whose
/// [`Scope::scope`] is longer is refused with a 500 (problem code
/// `idempotency_scope_too_long`) before anything runs. Every engine keeps
/// scopes this long in its key index (PostgreSQL's btree entries stop at
/// about 2.7 KB, MySQL's column is `VARBINARY(2048)`), and an account or
/// tenant id is far shorter. A store that hashes scopes
/// ([`Idem::hash_keys`](crate::Idem::hash_keys)) keeps 43 bytes of any
/// scope, and refuses none.
pub const MAX_SCOPE_LEN: usize = 2048;

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
    note = "implement `idem::Scope` for the caller's type (a type of your crate: wrap another crate's) and return the authenticated caller's stable id from `fn scope(&self) -> Cow<'_, str>`; `axum::Extension<T>` scopes as its `T` does"
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

/// A caller that an authentication middleware put in the request's
/// extensions: `#[idempotent(scope = "user")]` on `user: Extension<User>`
/// scopes as `User` does.
impl<T: Scope> Scope for axum::Extension<T> {
    fn scope(&self) -> Cow<'_, str> {
        self.0.scope()
    }
}

/// Checks a scope for the stores' columns.
pub(crate) fn check_scope(scope: &str) -> Result<(), Error> {
    if scope.len() > MAX_SCOPE_LEN {
        return Err(Error::InvalidMessage {
            what: "scope",
            len: scope.len(),
            max: MAX_SCOPE_LEN,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_extension_scopes_as_what_it_holds() {
        let user = axum::Extension(String::from("acct_1"));
        assert_eq!(user.scope(), "acct_1");
        assert_eq!(Box::new(&user).scope(), "acct_1");
    }
}
