//! Hashed scopes and keys: the [`KeyHasher`] a service gives
//! [`Idem::hash_keys`](crate::Idem::hash_keys), so that the key table
//! keeps no caller's scope (an account id) and no key in the clear.
//!
//! A stored scope is `base64url(HMAC-SHA256(secret, "idem-scope-v1",
//! scope))` and a stored key `base64url(HMAC-SHA256(secret, "idem-key-v1",
//! scope, key))`, each part length-prefixed: 43 characters each, a key's
//! bound to its scope (one key of two callers is two rows), neither
//! reversible without the secret, and neither equal to the other's for
//! any input. HMAC from RustCrypto's `hmac` over `sha2`, as the admin
//! sessions sign with.

use std::str::FromStr;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The length of a hashed scope or key: 32 bytes in unpadded base64url.
pub(crate) const HASHED_LEN: usize = 43;

/// What a hashed scope's input begins with.
const SCOPE_LABEL: &[u8] = b"idem-scope-v1";
/// What a hashed key's input begins with.
const KEY_LABEL: &[u8] = b"idem-key-v1";

/// The secret the key table's scopes and keys are hashed with
/// (HMAC-SHA256): see [`Idem::hash_keys`](crate::Idem::hash_keys).
///
/// Build one from 32 random bytes, or from their standard base64 (as
/// `openssl rand -base64 32` prints them, and an environment variable holds
/// them). Its `Debug` form never shows the secret.
///
/// ```
/// use idem_runtime::KeyHasher;
///
/// let hasher: KeyHasher = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".parse()?;
/// let same = KeyHasher::new(std::array::from_fn(|i| i as u8));
/// assert_eq!(hasher.scope("acct_1"), same.scope("acct_1"));
///
/// // What the key table keeps for `order-42` of `acct_1`: 43 characters
/// // each, the clear values nowhere in them.
/// let (scope, key) = (hasher.scope("acct_1"), hasher.key("acct_1", "order-42"));
/// assert_eq!((scope.len(), key.len()), (43, 43));
/// // One key of two callers is two rows.
/// assert_ne!(key, hasher.key("acct_2", "order-42"));
/// assert!(!format!("{hasher:?}").contains("AAEC"));
/// # Ok::<(), idem_runtime::KeyHasherError>(())
/// ```
#[derive(Clone)]
pub struct KeyHasher {
    /// HMAC keyed with the secret once; cloned for each hash.
    mac: HmacSha256,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyHasher").finish_non_exhaustive()
    }
}

/// Why a key hasher could not be built: never shows the secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHasherError {
    /// No secret at all.
    #[error("the key hasher's secret is empty")]
    Empty,
    /// A secret that is not standard base64 (`A-Z a-z 0-9 + /`, padded).
    #[error("the key hasher's secret is not valid base64: {reason}")]
    BadBase64 {
        /// What is wrong, without the secret's characters.
        reason: String,
    },
    /// A secret that is not 32 bytes.
    #[error("the key hasher's secret is {len} bytes; it takes 32")]
    WrongLength {
        /// Its length in bytes.
        len: usize,
    },
}

impl KeyHasher {
    /// A hasher with `secret`: 32 random bytes, kept as long as the keys it
    /// hashed live (a hasher with another secret finds none of them).
    pub fn new(secret: [u8; 32]) -> Self {
        Self {
            mac: HmacSha256::new_from_slice(&secret).expect("HMAC takes any key length"),
        }
    }

    /// The hasher whose secret an environment variable holds (standard
    /// base64 of 32 bytes); `None` when it is unset or blank.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # fn demo() -> Result<(), idem::KeyHasherError> {
    /// // `IDEM_HASH_SECRET=$(openssl rand -base64 32)`
    /// let hasher = idem::KeyHasher::from_env("IDEM_HASH_SECRET")?;
    /// # Ok(()) }
    /// ```
    pub fn from_env(name: &str) -> Result<Option<Self>, KeyHasherError> {
        match std::env::var(name) {
            Ok(value) if !value.trim().is_empty() => value.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// `scope` as the key table keeps it: 43 characters of unpadded
    /// base64url.
    pub fn scope(&self, scope: &str) -> String {
        self.hash(&[SCOPE_LABEL, scope.as_bytes()])
    }

    /// `scope`'s `key` as the key table keeps it: 43 characters of
    /// unpadded base64url, bound to the scope.
    pub fn key(&self, scope: &str, key: &str) -> String {
        self.hash(&[KEY_LABEL, scope.as_bytes(), key.as_bytes()])
    }

    /// The HMAC of `parts`, each length-prefixed so that no two lists of
    /// parts run together.
    fn hash(&self, parts: &[&[u8]]) -> String {
        let mut mac = self.mac.clone();
        for part in parts {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    }
}

/// Parses the standard base64 of a 32-byte secret (spaces around it are
/// ignored).
impl FromStr for KeyHasher {
    type Err = KeyHasherError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text.is_empty() {
            return Err(KeyHasherError::Empty);
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|error| KeyHasherError::BadBase64 {
                reason: crate::seal::base64_reason(&error),
            })?;
        let secret: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| KeyHasherError::WrongLength { len: bytes.len() })?;
        Ok(Self::new(secret))
    }
}

/// Whether `text` may be a hashed scope or key, as a listing shows it.
pub(crate) fn looks_hashed(text: &str) -> bool {
    text.len() == HASHED_LEN
        && text
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> KeyHasher {
        KeyHasher::new([7; 32])
    }

    /// The stored forms are fixed by the secret and the input alone: a
    /// change of them would make every stored key unknown. (The values
    /// were computed apart, with Python's `hmac`.)
    #[test]
    fn hashes_are_stable() {
        let scope = hasher().scope("acct_1");
        assert_eq!(scope, hasher().scope("acct_1"));
        assert_eq!(scope, "GjvBOB96HW6Zphc37PcWn6XIijESkWxJ69oB7gdIl3Y");
        assert_eq!(
            hasher().key("acct_1", "order-42"),
            "T_kOv4vX6XPmh0S9RNt_0lwdfKtobD0f3mjiL-h3W0U"
        );
        for hashed in [scope, hasher().key("", "")] {
            assert!(looks_hashed(&hashed), "{hashed}");
        }
        assert_ne!(
            KeyHasher::new([8; 32]).scope("acct_1"),
            hasher().scope("acct_1")
        );
    }

    /// A scope's hash is never a key's, a key's is bound to its scope, and
    /// the parts' lengths are bound too.
    #[test]
    fn hashes_are_separated() {
        let hasher = hasher();
        assert_ne!(hasher.scope("a"), hasher.key("a", ""));
        assert_ne!(hasher.key("acct_1", "k"), hasher.key("acct_2", "k"));
        assert_ne!(hasher.key("acct_1", "k"), hasher.key("acct_", "1k"));
        assert_ne!(hasher.key("ab", ""), hasher.key("a", "b"));
        assert_ne!(hasher.scope("k"), hasher.scope("k "));
    }

    #[test]
    fn secrets_parse_from_base64_and_never_show() {
        use base64::engine::general_purpose::STANDARD;
        let encoded = STANDARD.encode([7; 32]);
        let parsed: KeyHasher = format!("  {encoded}\n").parse().unwrap();
        assert_eq!(parsed.scope("s"), hasher().scope("s"));
        assert_eq!(" ".parse::<KeyHasher>().unwrap_err(), KeyHasherError::Empty);
        assert_eq!(
            STANDARD.encode([7; 16]).parse::<KeyHasher>().unwrap_err(),
            KeyHasherError::WrongLength { len: 16 }
        );
        let secret = "c2VjcmV0*c2VjcmV0";
        let bad = secret.parse::<KeyHasher>().unwrap_err();
        assert!(matches!(bad, KeyHasherError::BadBase64 { .. }), "{bad:?}");
        assert!(!bad.to_string().contains("c2Vj"), "{bad}");
        assert_eq!(format!("{parsed:?}"), "KeyHasher { .. }");
        // Unset or blank: no hasher.
        assert!(matches!(
            KeyHasher::from_env("IDEM_TEST_UNSET_SECRET"),
            Ok(None)
        ));
    }

    #[test]
    fn only_hashed_forms_look_hashed() {
        assert!(!looks_hashed("acct_1"));
        assert!(!looks_hashed(&"a".repeat(44)));
        assert!(!looks_hashed(&format!("{}=", "a".repeat(42))));
        assert!(looks_hashed(&"a-_9".repeat(11)[..43]));
    }
}
