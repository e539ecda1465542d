//! The `Intent`: one logical operation and the `Idempotency-Key` every one of
//! its attempts carries.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use http::HeaderValue;
use uuid::Uuid;

/// The longest key the server accepts, in bytes (visible ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// The UUID namespace of [`Intent::derived`]: the UUIDv5 of the URL
/// `https://docs.rs/idem-client/intent` in the RFC 9562 URL namespace.
const DERIVATION_NAMESPACE: Uuid = Uuid::from_u128(0x3887_844f_fea7_5259_96c2_da81_fada_0ae9);

/// One logical operation, named by the `Idempotency-Key` that every attempt
/// of it carries.
///
/// Make one *before* the first attempt and keep it until the operation has
/// an answer: the server deduplicates by key, so a key minted per attempt
/// turns every retry into a new operation. The senders in this crate take an
/// `&Intent` and never make one.
///
/// Three ways to get one:
///
/// - [`Intent::new`]: a fresh random key (a UUIDv7, so keys minted close in
///   time sit close together in the server's index);
/// - [`Intent::derived`]: the same key every time for the same operation
///   name, for operations that have a natural identity (a billing period);
/// - [`Intent::restore`] (or [`str::parse`], or serde): a key stored earlier,
///   for operations that must survive a restart of the client.
///
/// It serializes as its key, a plain string, and [`Display`](fmt::Display)
/// and [`FromStr`] round-trip:
///
/// ```
/// use idem_client::Intent;
///
/// let intent = Intent::new();
/// let stored = intent.to_string();
/// let restored: Intent = stored.parse()?;
/// assert_eq!(restored, intent);
///
/// let json = serde_json::to_string(&intent)?;
/// assert_eq!(json, format!("\"{intent}\""));
/// assert_eq!(serde_json::from_str::<Intent>(&json)?, intent);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Intent {
    key: Arc<str>,
}

impl Intent {
    /// A new operation with a random key: a UUIDv7 in its hyphenated
    /// lowercase form (36 characters).
    ///
    /// ```
    /// use idem_client::Intent;
    ///
    /// let (a, b) = (Intent::new(), Intent::new());
    /// assert_ne!(a, b);
    /// assert_eq!(a.as_str().len(), 36);
    /// ```
    #[allow(clippy::new_without_default)] // a default that is random would surprise
    pub fn new() -> Self {
        Self::from_uuid(Uuid::now_v7())
    }

    /// The key of a named operation: the same `operation` always gives the
    /// same key, so a client that restarts and runs the operation again is
    /// deduplicated by the server without storing anything.
    ///
    /// The key is the UUIDv5 (RFC 9562: SHA-1, truncated) of the UTF-8 bytes
    /// of `operation` in the namespace `3887844f-fea7-5259-96c2-da81fada0ae9`
    /// (itself the UUIDv5 of the URL `https://docs.rs/idem-client/intent`),
    /// hyphenated and lowercase; another language derives the same key with
    /// its own UUIDv5 function (Python: `uuid.uuid5(uuid.UUID(
    /// "3887844f-fea7-5259-96c2-da81fada0ae9"), "sub_123:2026-10")`). Name the
    /// operation fully (the customer, the period, what is done), because two
    /// operations with one name are one operation to the server.
    ///
    /// ```
    /// use idem_client::Intent;
    ///
    /// let october = Intent::derived("sub_123:2026-10");
    /// assert_eq!(october, Intent::derived("sub_123:2026-10"));
    /// assert_ne!(october, Intent::derived("sub_123:2026-11"));
    /// assert_eq!(october.as_str(), "bb797199-74d9-59fa-a1b4-643923afc66e");
    /// ```
    pub fn derived(operation: &str) -> Self {
        Self::from_uuid(Uuid::new_v5(&DERIVATION_NAMESPACE, operation.as_bytes()))
    }

    /// An intent whose key was stored earlier (by [`Display`](fmt::Display)
    /// or serde), or that another system chose.
    ///
    /// Any key the server accepts restores: 1 to 255 visible ASCII
    /// characters (`!` to `~`).
    ///
    /// ```
    /// use idem_client::{Intent, InvalidKey};
    ///
    /// let intent = Intent::restore("order-42")?;
    /// assert_eq!(intent.as_str(), "order-42");
    /// assert_eq!(Intent::restore(""), Err(InvalidKey::Empty));
    /// assert_eq!(Intent::restore("order 42"), Err(InvalidKey::InvalidCharacter));
    /// # Ok::<(), InvalidKey>(())
    /// ```
    pub fn restore(key: &str) -> Result<Self, InvalidKey> {
        if key.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong);
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(InvalidKey::InvalidCharacter);
        }
        Ok(Self { key: key.into() })
    }

    /// The key.
    ///
    /// ```
    /// # use idem_client::Intent;
    /// assert_eq!(Intent::restore("order-42")?.as_str(), "order-42");
    /// # Ok::<(), idem_client::InvalidKey>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The `Idempotency-Key` header value that carries this key.
    ///
    /// A bare token, as most clients send it, unless the server would read a
    /// bare value differently: a key that starts with `"` or holds a comma
    /// goes as an RFC 9651 string (`"..."`, with `"` and `\` escaped).
    ///
    /// ```
    /// # use idem_client::Intent;
    /// assert_eq!(Intent::restore("order-42")?.header_value(), "order-42");
    /// assert_eq!(Intent::restore("a,b")?.header_value(), r#""a,b""#);
    /// # Ok::<(), idem_client::InvalidKey>(())
    /// ```
    pub fn header_value(&self) -> HeaderValue {
        let value = if self.key.starts_with('"') || self.key.contains(',') {
            let mut quoted = String::with_capacity(self.key.len() + 2);
            quoted.push('"');
            for c in self.key.chars() {
                if matches!(c, '"' | '\\') {
                    quoted.push('\\');
                }
                quoted.push(c);
            }
            quoted.push('"');
            HeaderValue::from_str(&quoted)
        } else {
            HeaderValue::from_str(&self.key)
        };
        value.expect("visible ASCII is a valid header value")
    }

    fn from_uuid(uuid: Uuid) -> Self {
        let mut buf = Uuid::encode_buffer();
        Self {
            key: (*uuid.hyphenated().encode_lower(&mut buf)).into(),
        }
    }
}

impl fmt::Display for Intent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

impl fmt::Debug for Intent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Intent").field(&&*self.key).finish()
    }
}

impl FromStr for Intent {
    type Err = InvalidKey;

    fn from_str(key: &str) -> Result<Self, Self::Err> {
        Self::restore(key)
    }
}

impl serde::Serialize for Intent {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.key)
    }
}

impl<'de> serde::Deserialize<'de> for Intent {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl serde::de::Visitor<'_> for Visitor {
            type Value = Intent;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an idempotency key: 1 to 255 visible ASCII characters")
            }

            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<Intent, E> {
                Intent::restore(key).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(Visitor)
    }
}

/// Why a stored key cannot be an [`Intent`]: the server would refuse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The key is empty.
    #[error("an idempotency key cannot be empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("an idempotency key is at most 255 characters long")]
    TooLong,
    /// The key has a character outside visible ASCII (`!` to `~`).
    #[error("an idempotency key may contain only visible ASCII characters (`!` to `~`)")]
    InvalidCharacter,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_derivation_namespace_is_the_documented_uuid() {
        let url = Uuid::new_v5(&Uuid::NAMESPACE_URL, b"https://docs.rs/idem-client/intent");
        assert_eq!(DERIVATION_NAMESPACE, url);
    }

    #[test]
    fn new_keys_are_uuid_v7() {
        let key = Uuid::parse_str(Intent::new().as_str()).unwrap();
        assert_eq!(key.get_version_num(), 7);
    }

    #[test]
    fn restore_takes_exactly_what_the_server_accepts() {
        assert!(Intent::restore(&"k".repeat(255)).is_ok());
        assert_eq!(Intent::restore(&"k".repeat(256)), Err(InvalidKey::TooLong));
        assert!(Intent::restore("!~\"\\,").is_ok());
        for bad in ["a b", "tab\t", "é", "nul\0"] {
            assert_eq!(Intent::restore(bad), Err(InvalidKey::InvalidCharacter));
        }
    }

    #[test]
    fn a_quoted_header_unquotes_to_the_key() {
        let intent = Intent::restore(r#""a\b,c"#).unwrap();
        assert_eq!(intent.header_value(), r#""\"a\\b,c""#);
    }

    #[test]
    fn deserializing_an_invalid_key_fails() {
        let error = serde_json::from_str::<Intent>("\"a b\"").unwrap_err();
        assert!(error.to_string().contains("visible ASCII"), "{error}");
    }
}
