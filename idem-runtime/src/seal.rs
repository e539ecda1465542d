//! Encryption at rest: the [`KeyRing`] a service gives
//! [`Idem::encryption`](crate::Idem::encryption), and the sealed envelope
//! its stored responses, requests and recovery points are kept in.
//!
//! AES-256-GCM from RustCrypto's `aes-gcm`: pure Rust (nothing in C or
//! assembly to build or cross-compile, unlike `ring`), kept by the
//! RustCrypto project with audited releases, and used through the `aead`
//! traits, so another AEAD could take its place behind the same envelope.
//!
//! A sealed value is an envelope:
//!
//! ```text
//! [0xC1][version 1][id length: u8][key id][nonce: 12 bytes][ciphertext + 16-byte tag]
//! ```
//!
//! `0xC1` never begins a value `idem` writes in the clear (a JSON recovery
//! point begins with `{`, a stored request with its version byte 1, stored
//! headers with a name length's high byte, 0), so a sealed value is told
//! from a plain one by its first byte. The associated data binds each value
//! to its table, scope, key and column (and to the envelope's own header),
//! so a sealed value copied to another row, or another column, does not
//! open.

use std::borrow::Cow;
use std::str::FromStr;
use std::sync::Arc;

use aes_gcm::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine as _;

/// The envelope's first byte.
const MAGIC: u8 = 0xC1;
/// The envelope's version, its second byte.
const VERSION: u8 = 1;
/// AES-GCM's nonce: 96 bits, fresh and random for every value sealed.
const NONCE_LEN: usize = 12;
/// AES-GCM's tag.
const TAG_LEN: usize = 16;
/// The longest key id: its length is one byte.
pub const MAX_KEY_ID_LEN: usize = 255;

/// Which column of the key table a sealed value is kept in: part of its
/// associated data, so a value moved to another column does not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Column {
    /// A stored response's headers.
    Headers,
    /// A stored response's body.
    Body,
    /// A phased request kept for the completer.
    Request,
    /// A phased key's recovery point.
    Recovery,
    /// A tombstone's `Location` header.
    Location,
}

impl Column {
    fn tag(self) -> u8 {
        match self {
            Self::Headers => 1,
            Self::Body => 2,
            Self::Request => 3,
            Self::Recovery => 4,
            Self::Location => 5,
        }
    }

    /// The column's name, as logs and metrics label it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Headers => "headers",
            Self::Body => "body",
            Self::Request => "request",
            Self::Recovery => "recovery",
            Self::Location => "location",
        }
    }
}

/// The row a value belongs to: its table, scope and key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row<'a> {
    pub(crate) table: &'a str,
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
}

/// Why a stored value did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum OpenError {
    /// Not an envelope this version of `idem` reads (cut short, or not
    /// one at all).
    #[error("not a sealed value")]
    Malformed,
    /// Sealed with a key the ring does not hold (removed from it), or read
    /// with no ring at all.
    #[error("sealed with a key the ring does not hold")]
    UnknownKey,
    /// The tag did not verify: sealed for another row or column, or
    /// changed since.
    #[error("does not open: sealed for another row or column, or corrupted")]
    Forged,
    /// A plain value where the ring refuses plain values
    /// ([`KeyRing::refuse_plaintext`]).
    #[error("a plain value where only sealed values are read")]
    Plain,
}

impl OpenError {
    /// The reason, as logs and metrics label it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::UnknownKey => "unknown_key",
            Self::Forged => "forged",
            Self::Plain => "plain",
        }
    }
}

/// Why a key ring could not be built: never shows key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRingError {
    /// No keys at all.
    #[error("the key ring has no keys")]
    Empty,
    /// An entry without the `:` between its id and its key.
    #[error("key ring entry {position} is not `id:base64-of-32-bytes`")]
    NotAnEntry {
        /// The entry's position, from 1.
        position: usize,
    },
    /// An empty key id.
    #[error("key ring entry {position} has an empty id")]
    EmptyId {
        /// The entry's position, from 1.
        position: usize,
    },
    /// A key id longer than [`MAX_KEY_ID_LEN`] bytes, or with a character
    /// other than visible ASCII, or with `:` or `,`.
    #[error("key id `{id}` is not 1 to 255 visible ASCII characters without `:` or `,`")]
    InvalidId {
        /// The id (shown up to its first 64 bytes).
        id: String,
    },
    /// A key that is not standard base64 (`A-Z a-z 0-9 + /`, padded).
    #[error("key `{id}` is not valid base64: {reason}")]
    BadBase64 {
        /// The key's id.
        id: String,
        /// What the decoder said.
        reason: String,
    },
    /// A key that is not 32 bytes (AES-256).
    #[error("key `{id}` is {len} bytes; AES-256 takes 32")]
    WrongLength {
        /// The key's id.
        id: String,
        /// Its length in bytes.
        len: usize,
    },
    /// Two keys with one id: a value's id must name one key.
    #[error("key id `{id}` is in the ring twice")]
    DuplicateId {
        /// The id.
        id: String,
    },
}

/// One key of a ring.
#[derive(Clone)]
struct RingKey {
    id: Box<str>,
    cipher: Aes256Gcm,
}

/// The keys stored values are sealed with (AES-256-GCM), each named by an
/// id kept with every value it seals: values are written with the newest
/// key and read with whichever key their id names, so a key is rotated by
/// adding a newer one, and an older one is removed once no live value
/// needs it (after the longest TTL since the rotation).
///
/// Build one from the environment's `id:base64-of-32-bytes` list (newest
/// last, as the `IDEM_ENCRYPTION_KEYS` variable of the examples holds it)
/// or key by key:
///
/// ```
/// use idem_runtime::KeyRing;
///
/// // `openssl rand -base64 32` makes a key.
/// let ring: KeyRing = "2026-11:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=,\
///                      2026-12:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8="
///     .parse()?;
/// assert_eq!(ring.current_id(), "2026-12");
///
/// let same = KeyRing::new("2026-11", [0; 32])?.with_key("2026-12", [1; 32])?;
/// assert_eq!(same.ids().collect::<Vec<_>>(), ["2026-11", "2026-12"]);
/// # Ok::<(), idem_runtime::KeyRingError>(())
/// ```
#[derive(Clone)]
pub struct KeyRing {
    /// Oldest first; the last seals.
    keys: Arc<[RingKey]>,
    plaintext: bool,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing")
            .field("ids", &self.ids().collect::<Vec<_>>())
            .field("plaintext_reads", &self.plaintext)
            .finish()
    }
}

impl KeyRing {
    /// A ring of one key, `key` named `id`.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self, KeyRingError> {
        check_id(id, 1)?;
        Ok(Self {
            keys: Arc::from([ring_key(id, &key)]),
            plaintext: true,
        })
    }

    /// The ring with a newer key, which seals every value written from now
    /// on; the older ones still open what they sealed.
    pub fn with_key(self, id: &str, key: [u8; 32]) -> Result<Self, KeyRingError> {
        check_id(id, self.keys.len() + 1)?;
        if self.ids().any(|known| known == id) {
            return Err(KeyRingError::DuplicateId { id: id.to_owned() });
        }
        let mut keys = self.keys.to_vec();
        keys.push(ring_key(id, &key));
        Ok(Self {
            keys: keys.into(),
            plaintext: self.plaintext,
        })
    }

    /// The ring an environment variable holds (`id:base64-of-32-bytes`,
    /// comma-separated, newest last); `None` when it is unset or blank.
    pub fn from_env(name: &str) -> Result<Option<Self>, KeyRingError> {
        match std::env::var(name) {
            Ok(value) if !value.trim().is_empty() => value.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// Whether a plain value (written before encryption was turned on) is
    /// read as it is (`true`, the default, so turning encryption on breaks
    /// no key already stored), or refused as unreadable: set `false` once
    /// every key stored in the clear has expired, and a row written in the
    /// clear by anyone but `idem` is never replayed.
    pub fn refuse_plaintext(mut self, refuse: bool) -> Self {
        self.plaintext = !refuse;
        self
    }

    /// The keys' ids, oldest first.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|key| &*key.id)
    }

    /// The id of the key that seals new values: the newest.
    pub fn current_id(&self) -> &str {
        &self.current().id
    }

    fn current(&self) -> &RingKey {
        self.keys.last().expect("a ring has at least one key")
    }

    /// `plain` sealed with the newest key for `column` of `row`.
    pub(crate) fn seal(&self, row: Row<'_>, column: Column, plain: &[u8]) -> Vec<u8> {
        let key = self.current();
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let mut out = header(&key.id);
        let aad = associated_data(&out, row, column);
        let sealed = key
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: plain,
                    aad: &aad,
                },
            )
            .expect("AES-GCM seals any value under 64 GiB");
        out.reserve(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The plain bytes of `stored`, kept in `column` of `row`: opened if
    /// sealed, as it is if plain (unless the ring refuses plain values).
    pub(crate) fn open<'v>(
        &self,
        row: Row<'_>,
        column: Column,
        stored: &'v [u8],
    ) -> Result<Cow<'v, [u8]>, OpenError> {
        if !is_sealed(stored) {
            return if self.plaintext {
                Ok(Cow::Borrowed(stored))
            } else {
                Err(OpenError::Plain)
            };
        }
        let envelope = Envelope::parse(stored).ok_or(OpenError::Malformed)?;
        let key = self
            .keys
            .iter()
            .find(|key| key.id.as_bytes() == envelope.key_id)
            .ok_or(OpenError::UnknownKey)?;
        let aad = associated_data(envelope.header, row, column);
        key.cipher
            .decrypt(
                Nonce::from_slice(envelope.nonce),
                Payload {
                    msg: envelope.sealed,
                    aad: &aad,
                },
            )
            .map(Cow::Owned)
            .map_err(|_| OpenError::Forged)
    }
}

/// Parses `id:base64,id2:base64` (newest last; spaces around entries are
/// ignored).
impl FromStr for KeyRing {
    type Err = KeyRingError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim().is_empty() {
            return Err(KeyRingError::Empty);
        }
        let mut ring: Option<Self> = None;
        for (index, entry) in text.split(',').enumerate() {
            let position = index + 1;
            let entry = entry.trim();
            let (id, encoded) = entry
                .split_once(':')
                .ok_or(KeyRingError::NotAnEntry { position })?;
            let (id, encoded) = (id.trim(), encoded.trim());
            check_id(id, position)?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|error| KeyRingError::BadBase64 {
                    id: id.to_owned(),
                    reason: base64_reason(&error),
                })?;
            let key: [u8; 32] =
                bytes
                    .as_slice()
                    .try_into()
                    .map_err(|_| KeyRingError::WrongLength {
                        id: id.to_owned(),
                        len: bytes.len(),
                    })?;
            ring = Some(match ring {
                None => Self::new(id, key)?,
                Some(ring) => ring.with_key(id, key)?,
            });
        }
        ring.ok_or(KeyRingError::Empty)
    }
}

/// What is wrong with a key's base64, without the decoder's own words,
/// which quote the offending character (perhaps one of the key's).
pub(crate) fn base64_reason(error: &base64::DecodeError) -> String {
    use base64::DecodeError::{InvalidByte, InvalidLastSymbol, InvalidLength, InvalidPadding};
    match error {
        InvalidByte(offset, _) => format!("a character outside base64 at offset {offset}"),
        InvalidLastSymbol(offset, _) => format!("an impossible last character at offset {offset}"),
        InvalidLength(_) => "a length no base64 has".to_owned(),
        InvalidPadding => "wrong padding".to_owned(),
    }
}

fn ring_key(id: &str, key: &[u8; 32]) -> RingKey {
    RingKey {
        id: id.into(),
        cipher: Aes256Gcm::new(key.into()),
    }
}

fn check_id(id: &str, position: usize) -> Result<(), KeyRingError> {
    if id.is_empty() {
        return Err(KeyRingError::EmptyId { position });
    }
    let visible = id
        .bytes()
        .all(|byte| byte.is_ascii_graphic() && byte != b':' && byte != b',');
    if !visible || id.len() > MAX_KEY_ID_LEN {
        let shown: String = id.chars().take(64).collect();
        return Err(KeyRingError::InvalidId { id: shown });
    }
    Ok(())
}

/// Whether `stored` is an envelope (or claims to be one): its first byte.
pub(crate) fn is_sealed(stored: &[u8]) -> bool {
    stored.first() == Some(&MAGIC)
}

/// The envelope's header: magic, version, key id.
fn header(key_id: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(3 + key_id.len() + NONCE_LEN + TAG_LEN);
    out.push(MAGIC);
    out.push(VERSION);
    out.push(u8::try_from(key_id.len()).expect("ids are checked to fit a byte"));
    out.extend_from_slice(key_id.as_bytes());
    out
}

/// What a sealed value is bound to: a label, the envelope's header, and
/// the table, scope and key (each length-prefixed, so no two rows run
/// together) and the column.
fn associated_data(header: &[u8], row: Row<'_>, column: Column) -> Vec<u8> {
    let mut aad =
        Vec::with_capacity(16 + header.len() + row.table.len() + row.scope.len() + row.key.len());
    aad.extend_from_slice(b"idem-seal");
    for part in [
        header,
        row.table.as_bytes(),
        row.scope.as_bytes(),
        row.key.as_bytes(),
    ] {
        aad.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
        aad.extend_from_slice(part);
    }
    aad.push(column.tag());
    aad
}

/// An envelope's parts, borrowed from the stored bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Envelope<'a> {
    /// Magic, version and key id: bound into the associated data.
    pub(crate) header: &'a [u8],
    /// The key's id.
    pub(crate) key_id: &'a [u8],
    /// The nonce.
    pub(crate) nonce: &'a [u8],
    /// The ciphertext and its tag.
    pub(crate) sealed: &'a [u8],
}

impl<'a> Envelope<'a> {
    /// The envelope's parts; `None` for anything this version did not
    /// write. Never panics, whatever the bytes.
    pub(crate) fn parse(stored: &'a [u8]) -> Option<Self> {
        let (&[magic, version, id_len], rest) = stored.split_first_chunk::<3>()?;
        if magic != MAGIC || version != VERSION || id_len == 0 {
            return None;
        }
        let (key_id, rest) = rest.split_at_checked(usize::from(id_len))?;
        let (nonce, sealed) = rest.split_at_checked(NONCE_LEN)?;
        if sealed.len() < TAG_LEN {
            return None;
        }
        Some(Self {
            header: &stored[..3 + key_id.len()],
            key_id,
            nonce,
            sealed,
        })
    }
}

/// How a store keeps its values: sealed with its ring, or plain without
/// one. Borrowed from an [`Idem`](crate::Idem) for one operation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sealer<'a> {
    pub(crate) ring: Option<&'a KeyRing>,
    pub(crate) table: &'a str,
}

impl Sealer<'_> {
    /// `plain` as `column` of `scope`'s `key` keeps it.
    pub(crate) fn seal<'v>(
        &self,
        scope: &str,
        key: &str,
        column: Column,
        plain: &'v [u8],
    ) -> Cow<'v, [u8]> {
        match self.ring {
            Some(ring) => Cow::Owned(ring.seal(self.row(scope, key), column, plain)),
            None => Cow::Borrowed(plain),
        }
    }

    /// The plain bytes of `stored`, kept in `column` of `scope`'s `key`.
    /// Without a ring a sealed value does not open (`UnknownKey`): it is
    /// never taken for a plain one.
    pub(crate) fn open<'v>(
        &self,
        scope: &str,
        key: &str,
        column: Column,
        stored: &'v [u8],
    ) -> Result<Cow<'v, [u8]>, OpenError> {
        match self.ring {
            Some(ring) => ring.open(self.row(scope, key), column, stored),
            None if is_sealed(stored) => Err(OpenError::UnknownKey),
            None => Ok(Cow::Borrowed(stored)),
        }
    }

    /// [`open`](Self::open) of a value that may be absent (`NULL`), a
    /// failure counted and logged once per key (`observe::unreadable`).
    pub(crate) fn open_logged<'v>(
        &self,
        scope: &str,
        key: &str,
        column: Column,
        stored: Option<&'v [u8]>,
    ) -> Result<Option<Cow<'v, [u8]>>, OpenError> {
        let Some(stored) = stored else {
            return Ok(None);
        };
        self.open(scope, key, column, stored)
            .map(Some)
            .inspect_err(|error| {
                crate::observe::unreadable(self.table, scope, key, column.as_str(), error.as_str());
            })
    }

    fn row<'r>(&'r self, scope: &'r str, key: &'r str) -> Row<'r> {
        Row {
            table: self.table,
            scope,
            key,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: Row<'static> = Row {
        table: "idem_keys",
        scope: "acct_1",
        key: "order-42",
    };

    fn ring() -> KeyRing {
        KeyRing::new("k1", [7; 32]).unwrap()
    }

    #[test]
    fn a_sealed_value_round_trips_and_hides_its_plaintext() {
        let plain = br#"{"id":"ch_1","amount":1000}"#;
        let sealed = ring().seal(ROW, Column::Body, plain);
        assert!(is_sealed(&sealed));
        assert!(!sealed.windows(6).any(|w| w == b"amount"));
        assert_eq!(&ring().open(ROW, Column::Body, &sealed).unwrap()[..], plain);
        // A fresh nonce every time: the same value seals differently.
        assert_ne!(sealed, ring().seal(ROW, Column::Body, plain));
        let empty = ring().seal(ROW, Column::Headers, b"");
        assert_eq!(ring().open(ROW, Column::Headers, &empty).unwrap().len(), 0);
    }

    #[test]
    fn another_row_or_column_does_not_open() {
        let sealed = ring().seal(ROW, Column::Body, b"{}");
        let others = [
            Row {
                key: "order-43",
                ..ROW
            },
            Row {
                scope: "acct_2",
                ..ROW
            },
            Row {
                table: "other_keys",
                ..ROW
            },
            // The parts' lengths are bound too: no two rows run together.
            Row {
                scope: "acct_1o",
                key: "rder-42",
                ..ROW
            },
        ];
        for other in others {
            let opened = ring().open(other, Column::Body, &sealed);
            assert_eq!(opened, Err(OpenError::Forged), "{other:?}");
        }
        for column in [Column::Headers, Column::Request, Column::Recovery] {
            assert_eq!(ring().open(ROW, column, &sealed), Err(OpenError::Forged));
        }
        // A changed byte anywhere (the id's included) fails too. (With
        // the mark changed it is no envelope: a ring that reads plain
        // values hands it on as one, which no decoder takes, as no plain
        // encoding begins with ciphertext's bytes.)
        let strict = ring().refuse_plaintext(true);
        for at in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[at] ^= 1;
            assert!(strict.open(ROW, Column::Body, &changed).is_err(), "{at}");
            if at > 0 {
                assert!(ring().open(ROW, Column::Body, &changed).is_err(), "{at}");
            }
        }
    }

    #[test]
    fn unknown_keys_and_plain_values_are_told_apart() {
        let sealed = ring().seal(ROW, Column::Body, b"{}");
        let other = KeyRing::new("k2", [7; 32]).unwrap();
        assert_eq!(
            other.open(ROW, Column::Body, &sealed),
            Err(OpenError::UnknownKey)
        );
        // Plain values are read as they are, unless refused.
        assert_eq!(&ring().open(ROW, Column::Body, b"{}").unwrap()[..], b"{}");
        let strict = ring().refuse_plaintext(true);
        assert_eq!(strict.open(ROW, Column::Body, b"{}"), Err(OpenError::Plain));
        // Without a ring, a sealed value is never taken for a plain one.
        let plain = Sealer {
            ring: None,
            table: "idem_keys",
        };
        assert_eq!(
            plain.open("acct_1", "order-42", Column::Body, &sealed),
            Err(OpenError::UnknownKey)
        );
        assert_eq!(
            &plain.seal("acct_1", "order-42", Column::Body, b"{}")[..],
            b"{}"
        );
    }

    #[test]
    fn truncated_and_garbage_envelopes_fail_without_panicking() {
        let sealed = ring().seal(ROW, Column::Recovery, b"{\"steps\":{}}");
        // (Cut to nothing, it is a plain empty value.)
        for cut in 1..sealed.len() {
            let opened = ring().open(ROW, Column::Recovery, &sealed[..cut]);
            assert!(opened.is_err(), "cut at {cut}");
        }
        for garbage in [
            &[0xC1][..],
            &[0xC1, 1],
            &[0xC1, 2, 2, b'k', b'1'],
            &[0xC1, 1, 0],
        ] {
            assert_eq!(
                ring().open(ROW, Column::Body, garbage),
                Err(OpenError::Malformed)
            );
        }
        let mut long_id = vec![0xC1, 1, 255];
        long_id.extend_from_slice(&[b'k'; 300]);
        assert_eq!(
            ring().open(ROW, Column::Body, &long_id),
            Err(OpenError::UnknownKey)
        );
    }

    #[test]
    fn rotation_reads_old_values_and_seals_with_the_newest_key() {
        let old = ring();
        let sealed_before = old.seal(ROW, Column::Body, b"before");
        let rotated = old.with_key("k2", [9; 32]).unwrap();
        assert_eq!(rotated.current_id(), "k2");
        assert_eq!(
            &rotated.open(ROW, Column::Body, &sealed_before).unwrap()[..],
            b"before"
        );
        let sealed_after = rotated.seal(ROW, Column::Body, b"after");
        assert_eq!(Envelope::parse(&sealed_before).unwrap().key_id, b"k1");
        assert_eq!(Envelope::parse(&sealed_after).unwrap().key_id, b"k2");
        // The old key alone does not open the new value.
        assert_eq!(
            ring().open(ROW, Column::Body, &sealed_after),
            Err(OpenError::UnknownKey)
        );
    }

    #[test]
    fn key_rings_parse_from_the_environment_format() {
        use base64::engine::general_purpose::STANDARD;
        let (a, b) = (STANDARD.encode([1; 32]), STANDARD.encode([2; 32]));
        let ring: KeyRing = format!(" old:{a} , new:{b}").parse().unwrap();
        assert_eq!(ring.ids().collect::<Vec<_>>(), ["old", "new"]);
        assert_eq!(ring.current_id(), "new");
        let short = STANDARD.encode([1; 16]);
        let cases = [
            (" ".to_owned(), KeyRingError::Empty),
            ("a".to_owned(), KeyRingError::NotAnEntry { position: 1 }),
            (format!("a:{a},"), KeyRingError::NotAnEntry { position: 2 }),
            (format!(":{a}"), KeyRingError::EmptyId { position: 1 }),
            (
                format!("a:{a},a:{b}"),
                KeyRingError::DuplicateId { id: "a".into() },
            ),
            (
                format!("a:{short}"),
                KeyRingError::WrongLength {
                    id: "a".into(),
                    len: 16,
                },
            ),
            (
                format!("a b:{a}"),
                KeyRingError::InvalidId { id: "a b".into() },
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(text.parse::<KeyRing>().unwrap_err(), expected, "{text:?}");
        }
        let bad = "a:not*base64".parse::<KeyRing>().unwrap_err();
        assert!(
            matches!(bad, KeyRingError::BadBase64 { ref id, .. } if id == "a"),
            "{bad:?}"
        );
        // Errors and the ring's debug form never show a key.
        assert!(!format!("{ring:?}").contains(&a));
        assert!(matches!(
            KeyRing::new("", [0; 32]),
            Err(KeyRingError::EmptyId { .. })
        ));
        assert!(KeyRing::new(&"k".repeat(256), [0; 32]).is_err());
        assert!(KeyRing::new(&"k".repeat(255), [0; 32]).is_ok());
    }
}
