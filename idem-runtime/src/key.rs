//! The `Idempotency-Key` header: parsing, validation and derived keys.

use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in bytes (visible ASCII, so also characters).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key and the scope it was claimed in.
///
/// Handlers reach it through [`Tx::key`](crate::Tx::key); use
/// [`derive`](Self::derive) to get a key for a downstream API that accepts
/// one, so a retry of this request reuses the downstream operation too.
///
/// Only a claimed request has one (its scope comes from the handler's
/// [`Scope`](crate::Scope)); [`parse`](Self::parse) and
/// [`from_headers`](Self::from_headers) read the key half from a header as
/// `#[idempotent]` does, for a proxy, a client or a test that checks a key
/// before sending it.
#[derive(Clone, PartialEq, Eq)]
pub struct IdempotencyKey {
    scope: String,
    key: String,
}

impl IdempotencyKey {
    pub(crate) fn new(scope: String, key: String) -> Self {
        Self { scope, key }
    }

    /// The key one `Idempotency-Key` field value carries, as
    /// [`as_str`](Self::as_str) gives it once claimed.
    ///
    /// Accepts an RFC 9651 sf-string (`"abc"`, as the IETF draft writes
    /// it, with `\"` and `\\` its only escapes) and a bare token (`abc`, as
    /// most client libraries send it), either with ASCII whitespace
    /// around it. The key must be 1 to [`MAX_KEY_LEN`] visible ASCII characters
    /// (`!` to `~`). A bare value with a comma is refused as
    /// [`KeyError::Multiple`]: a proxy joins two headers into one that way
    /// (RFC 9110); a quoted key may hold a comma.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::{IdempotencyKey, KeyError};
    ///
    /// assert_eq!(IdempotencyKey::parse("order-17").unwrap(), "order-17");
    /// assert_eq!(IdempotencyKey::parse(r#" "order-17" "#).unwrap(), "order-17");
    /// assert_eq!(IdempotencyKey::parse(r#""a,\"b\"""#).unwrap(), r#"a,"b""#);
    /// assert_eq!(IdempotencyKey::parse("a, b"), Err(KeyError::Multiple));
    /// assert_eq!(IdempotencyKey::parse("a b"), Err(KeyError::InvalidCharacter));
    /// assert_eq!(IdempotencyKey::parse("k".repeat(256)), Err(KeyError::TooLong));
    /// // A header value, as a request carries it.
    /// let value = http::HeaderValue::from_static("\"order-17\"");
    /// assert_eq!(IdempotencyKey::parse(&value).unwrap(), "order-17");
    /// ```
    pub fn parse(value: impl AsRef<[u8]>) -> Result<String, KeyError> {
        parse_key_value(value.as_ref())
    }

    /// The key a request's headers carry: `Ok(None)` without an
    /// `Idempotency-Key` header, [`KeyError::Multiple`] with more than one,
    /// and otherwise what [`parse`](Self::parse) makes of its value.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use http::HeaderMap;
    /// use idem::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError};
    ///
    /// let mut headers = HeaderMap::new();
    /// assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
    /// headers.insert(IDEMPOTENCY_KEY, "order-17".parse().unwrap());
    /// assert_eq!(IdempotencyKey::from_headers(&headers), Ok(Some("order-17".into())));
    /// headers.append(IDEMPOTENCY_KEY, "order-18".parse().unwrap());
    /// assert_eq!(IdempotencyKey::from_headers(&headers), Err(KeyError::Multiple));
    /// ```
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
        parse_key(headers)
    }

    /// The key as the client sent it (unquoted if it was an RFC 9651 string).
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The scope the key was claimed in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// A stable key for a downstream call, distinct per `label`.
    ///
    /// The result is 64 lowercase hex characters: the SHA-256 of the scope,
    /// the key and the label, each length-prefixed so no two different
    /// triples can produce the same input. Every retry of the same request
    /// derives the same value; another scope or another label never does.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// # fn demo(key: &idem::IdempotencyKey) {
    /// let stripe_key = key.derive("stripe-charge");
    /// assert_eq!(stripe_key.len(), 64);
    /// assert_eq!(stripe_key, key.derive("stripe-charge"));
    /// assert_ne!(stripe_key, key.derive("ledger"));
    /// # }
    /// ```
    pub fn derive(&self, label: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-derive-v1");
        for part in [self.scope.as_bytes(), self.key.as_bytes(), label.as_bytes()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        hex::encode(hasher.finalize())
    }
}

impl std::fmt::Debug for IdempotencyKey {
    // Keys can be guessable secrets of the caller; keep them out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("len", &self.key.len())
            .finish_non_exhaustive()
    }
}

/// Why an `Idempotency-Key` header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// No header, on a handler with `key = "required"`.
    #[error("this endpoint requires an Idempotency-Key header")]
    Missing,
    /// More than one `Idempotency-Key` header, or one that a proxy folded
    /// from two (a bare key with a comma in it: RFC 9110 joins repeated
    /// fields with commas; a quoted key may hold one).
    #[error(
        "send exactly one Idempotency-Key header (a comma may appear only inside a quoted key)"
    )]
    Multiple,
    /// The key is empty.
    #[error("the Idempotency-Key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the Idempotency-Key is longer than 255 characters")]
    TooLong,
    /// The key has a character outside visible ASCII (`!` to `~`).
    #[error("the Idempotency-Key may contain only visible ASCII characters")]
    InvalidCharacter,
    /// A quoted key is not a well-formed RFC 9651 string.
    #[error("the Idempotency-Key is not a well-formed quoted string")]
    Malformed,
}

/// [`IdempotencyKey::from_headers`].
pub(crate) fn parse_key(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Multiple);
    }
    parse_key_value(value.as_bytes()).map(Some)
}

/// [`IdempotencyKey::parse`].
pub(crate) fn parse_key_value(raw: &[u8]) -> Result<String, KeyError> {
    let raw = raw.trim_ascii();
    let key = match raw.first() {
        Some(b'"') => unquote(raw)?,
        _ if raw.contains(&b',') => return Err(KeyError::Multiple),
        _ => raw.to_vec(),
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| b.is_ascii_graphic()) {
        return Err(KeyError::InvalidCharacter);
    }
    // Only visible ASCII remains, which is valid UTF-8.
    Ok(String::from_utf8(key).expect("visible ASCII is UTF-8"))
}

/// RFC 9651 section 4.2.5: `"` chars with `\"` and `\\` escapes, then `"`.
fn unquote(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw[1..].iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(KeyError::Malformed),
            },
            b'"' => {
                return if bytes.as_slice().is_empty() {
                    Ok(out)
                } else {
                    Err(KeyError::Malformed)
                };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err(KeyError::InvalidCharacter),
        }
    }
    Err(KeyError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(parse_key_value(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse_key_value(b"\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse_key_value(b"  abc  ").unwrap(), "abc");
        assert_eq!(parse_key_value(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
    }

    #[test]
    fn rejects_what_the_design_lists() {
        assert_eq!(parse_key_value(b""), Err(KeyError::Empty));
        assert_eq!(parse_key_value(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse_key_value(&[b'k'; 256]), Err(KeyError::TooLong));
        assert!(parse_key_value(&[b'k'; 255]).is_ok());
        assert_eq!(parse_key_value(b"a\x01b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse_key_value(b"a b"), Err(KeyError::InvalidCharacter));
        assert_eq!(
            parse_key_value("ключ".as_bytes()),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(parse_key_value(b"\"open"), Err(KeyError::Malformed));
        assert_eq!(parse_key_value(b"\"a\"b"), Err(KeyError::Malformed));
        assert_eq!(parse_key_value(br#""a\n""#), Err(KeyError::Malformed));
        assert_eq!(parse_key_value(b"\"a b\""), Err(KeyError::InvalidCharacter));
    }

    #[test]
    fn two_headers_are_refused_and_none_is_absent() {
        let mut headers = HeaderMap::new();
        assert_eq!(parse_key(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert_eq!(parse_key(&headers), Ok(Some("a".into())));
        headers.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
        assert_eq!(parse_key(&headers), Err(KeyError::Multiple));
        // Two headers a proxy folded into one, with or without the space.
        assert_eq!(parse_key_value(b"a,b"), Err(KeyError::Multiple));
        assert_eq!(parse_key_value(b"a, a"), Err(KeyError::Multiple));
        assert_eq!(parse_key_value(b"\"a\", \"b\""), Err(KeyError::Malformed));
        assert_eq!(parse_key_value(b"\"a,b\"").unwrap(), "a,b");
    }

    #[test]
    fn derived_keys_are_stable_and_separated() {
        let key = IdempotencyKey::new("acct".into(), "k1".into());
        assert_eq!(key.derive("psp"), key.derive("psp"));
        assert_ne!(key.derive("psp"), key.derive("ledger"));
        let other = IdempotencyKey::new("acctk".into(), "1".into());
        assert_ne!(key.derive("psp"), other.derive("psp"));
        assert!(!format!("{key:?}").contains("k1"));
    }
}
