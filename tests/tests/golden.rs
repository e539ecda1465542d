//! Golden values: the hashes idem computes, pinned as literals.
//!
//! These outputs must never change between releases. A fingerprint is
//! stored with every key and compared with the fingerprint of each retry,
//! for as long as the key lives: if an upgrade computed another one for the
//! same request, every retry of a key stored before it would be refused
//! with 422. A derived key (`IdempotencyKey::derive`) is handed to
//! downstream APIs, which deduplicate on it: if it changed, a retry that
//! spans the upgrade would run the downstream operation (a payment) twice.
//!
//! So a failure here is not fixed by updating the literal. Changing either
//! hash needs a storage-revision plan: a new version in the hashed prefix
//! (`idem-fingerprint-v1`, `idem-derive-v1`), old rows still matched, and
//! old derived keys still produced, until every key made before the change
//! has expired.
//!
//! Each literal is also derived here from the layout written out with
//! `sha2` (see [`spelled`]), not from idem's code: a change to the
//! implementation cannot carry the expected values along with it.
//!
//! No database server is needed. Fingerprints are pure functions; derived
//! keys come from a handler's `Tx` (the runtime alone makes an
//! `IdempotencyKey`), so that half runs one request against SQLite in
//! memory: no server, no file.

use axum::http::{HeaderMap, HeaderValue, Method, header::CONTENT_TYPE};
use idem::Fingerprint;
use idem::canonical::canonicalize;

/// The fingerprint as it shows: its bytes in lowercase hex, so the
/// literals pin `Display` too.
fn hex(fingerprint: Fingerprint) -> String {
    let shown = fingerprint.to_string();
    assert_eq!(shown, hex::encode(fingerprint.as_bytes()));
    shown
}

/// The hashed layouts, spelled out: a version prefix, then each part as
/// its length (8 bytes, big-endian) and its bytes.
mod spelled {
    use sha2::{Digest, Sha256};

    /// What a body is hashed as.
    pub enum Body<'a> {
        /// JSON by its content type, in this canonical form.
        Json(&'a str),
        /// Anything else, byte for byte.
        Raw(&'a [u8]),
    }

    fn framed(hasher: &mut Sha256, part: &[u8]) {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }

    /// `idem-fingerprint-v1`, the method, the path, `0` without a query or
    /// `1` and the query, then `json` and the canonical body or `raw` and
    /// the body.
    pub fn fingerprint(method: &str, path: &str, query: Option<&str>, body: Body<'_>) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-fingerprint-v1");
        framed(&mut hasher, method.as_bytes());
        framed(&mut hasher, path.as_bytes());
        match query {
            None => hasher.update([0]),
            Some(query) => {
                hasher.update([1]);
                framed(&mut hasher, query.as_bytes());
            }
        }
        match body {
            Body::Json(canonical) => {
                hasher.update(b"json");
                framed(&mut hasher, canonical.as_bytes());
            }
            Body::Raw(bytes) => {
                hasher.update(b"raw");
                framed(&mut hasher, bytes);
            }
        }
        hex::encode(hasher.finalize())
    }

    /// `idem-derive-v1`, then the scope, the key and the label.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub fn derived(scope: &str, key: &str, label: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-derive-v1");
        for part in [scope, key, label] {
            framed(&mut hasher, part.as_bytes());
        }
        hex::encode(hasher.finalize())
    }
}

use spelled::Body::{Json, Raw};

fn content_type(value: &'static str) -> HeaderMap {
    HeaderMap::from_iter([(CONTENT_TYPE, HeaderValue::from_static(value))])
}

/// JSON with nested members out of canonical order, spaces, a float with
/// a trailing zero, a non-ASCII string and a large integer.
const NESTED: &str = r#"{ "z": {"b": [1, 2.50, {"y": null, "x": true}], "a": "é"},
    "amount": 1250, "account": 9007199254740993 }"#;

/// The same JSON, written canonically.
const NESTED_CANONICAL: &str =
    r#"{"account":9007199254740993,"amount":1250,"z":{"a":"é","b":[1,2.5,{"x":true,"y":null}]}}"#;

const NESTED_FINGERPRINT: &str = "3c3e555f80a680b3d8ea52ebfe11ed0a537d2142e50a7e5c674b3ac0b7a35cc6";

#[test]
fn canonical_json_is_pinned() {
    assert_eq!(
        String::from_utf8(canonicalize(NESTED.as_bytes()).unwrap()).unwrap(),
        NESTED_CANONICAL
    );
}

#[test]
fn json_fingerprints_are_pinned() {
    let json = content_type("application/json");
    let of = |body: &str| {
        hex(Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            None,
            &json,
            body.as_bytes(),
        ))
    };
    assert_eq!(
        spelled::fingerprint("POST", "/v1/charges", None, Json(NESTED_CANONICAL)),
        NESTED_FINGERPRINT
    );
    assert_eq!(of(NESTED), NESTED_FINGERPRINT);
    // Every spelling and JSON media type is the one fingerprint.
    assert_eq!(of(NESTED_CANONICAL), NESTED_FINGERPRINT);
    let merge_patch = content_type("application/merge-patch+json; charset=utf-8");
    assert_eq!(
        hex(Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            None,
            &merge_patch,
            NESTED.as_bytes()
        )),
        NESTED_FINGERPRINT
    );
}

#[test]
fn query_fingerprints_are_pinned() {
    let json = content_type("application/json");
    let body = br#"{"amount":1250}"#;
    let of = |query| {
        hex(Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            query,
            &json,
            body,
        ))
    };
    // An empty query is present, not absent.
    for (query, golden) in [
        (
            None,
            "097aeb5d58af4641a2d3fe956a279bc76874f3706b5b2cc75e1b4697d691646f",
        ),
        (
            Some("expand=customer"),
            "92928fc2dc432ab86c8fa5b549643957b3aab3213f9cd22813f24e0556c579d8",
        ),
        (
            Some(""),
            "7583a676846bb7ed57a3edfff4df8c423db30ab2ecd45634f95f15d1ab8fb9be",
        ),
    ] {
        let layout = spelled::fingerprint("POST", "/v1/charges", query, Json(r#"{"amount":1250}"#));
        assert_eq!(layout, golden, "{query:?}: the layout");
        assert_eq!(of(query), golden, "{query:?}");
    }
}

#[test]
fn raw_fingerprints_are_pinned() {
    // Not JSON by its content type: hashed byte for byte.
    let text = content_type("text/plain");
    let golden = "b987351ad522800820878ed3b8315f189543141485f0b8be6ffa1bb07508d031";
    let layout = spelled::fingerprint("POST", "/v1/charges", None, Raw(br#"{"amount": 1250}"#));
    assert_eq!(layout, golden);
    assert_eq!(
        hex(Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            None,
            &text,
            br#"{"amount": 1250}"#
        )),
        golden
    );
    // JSON by its content type, but it does not parse: byte for byte too.
    let json = content_type("application/json");
    let golden = "bc8c71c12a1bf8db1adb29f67e58f5195c8d8312bebf6b09ea6fe6b8a5f4f1e4";
    let layout = spelled::fingerprint("POST", "/v1/charges", None, Raw(b"{\"amount\": 12"));
    assert_eq!(layout, golden);
    assert_eq!(
        hex(Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            None,
            &json,
            b"{\"amount\": 12"
        )),
        golden
    );
    // No body, no content type, another method.
    let golden = "d707e42080b60151c00cd65d959722cc7bcc95111b3adab70bc1747d4778fb9d";
    let layout = spelled::fingerprint("DELETE", "/v1/charges/ch_1", None, Raw(b""));
    assert_eq!(layout, golden);
    assert_eq!(
        hex(Fingerprint::of(
            &Method::DELETE,
            "/v1/charges/ch_1",
            None,
            &HeaderMap::new(),
            b""
        )),
        golden
    );
}

#[cfg(feature = "sqlite")]
use idem_tests::account;

/// Derived keys, and the fingerprint the runtime stores for a request.
#[cfg(feature = "sqlite")]
mod through_a_request {
    use axum::Json;
    use axum::body::Body;
    use axum::handler::Handler;
    use axum::http::{Method, Request};
    use idem::{Fingerprint, Idem, Tx, idempotent};
    use sqlx::Sqlite;
    use sqlx::sqlite::SqlitePoolOptions;

    use crate::account::Account;

    /// Answers the keys it would hand to a payment provider and a ledger.
    #[idempotent(scope = "account")]
    async fn pay(
        account: Account,
        tx: Tx<Sqlite>,
        Json(_): Json<serde_json::Value>,
    ) -> Json<[String; 2]> {
        drop(account);
        let key = tx.key().expect("a key is required");
        Json([key.derive("psp"), key.derive("ledger")])
    }

    async fn memory_idem() -> Idem<Sqlite> {
        // One connection: an in-memory database lives as long as it does.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        let idem = Idem::new(pool);
        idem.migrate().await.unwrap();
        idem
    }

    async fn derived(idem: &Idem<Sqlite>, account: &str, key: &str) -> [String; 2] {
        let request = Request::post("/v1/charges?expand=customer")
            .header("x-account", account)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Body::from(super::NESTED))
            .unwrap();
        let response = Handler::call(pay, request, idem.clone()).await;
        assert!(response.status().is_success(), "{response:?}");
        // Derived by this call's handler, not replayed from an earlier one.
        assert!(
            !response.headers().contains_key("idempotent-replayed"),
            "{response:?}"
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        serde_json::from_slice(&body).unwrap()
    }

    #[tokio::test]
    async fn derived_keys_are_pinned() {
        let idem = memory_idem().await;
        let [psp, ledger] = derived(&idem, "acct_123", "order-42").await;
        let golden = [
            (
                "acct_123",
                "psp",
                "e492c6e2fc2acb1d5ef694defdd9d8b4ede08d17f1df95fb740367849cbe3703",
            ),
            (
                "acct_123",
                "ledger",
                "0ec86c2beaef1b65f3c9f0611af9dc053ad4660e27be5d3454ddaab8d12edac7",
            ),
            (
                "acct_456",
                "psp",
                "0218a20f97be839100e8174a27f2ccae5b2e096fb6cbe33413e1f9ad5091ac7c",
            ),
        ];
        for (scope, label, literal) in golden {
            let layout = super::spelled::derived(scope, "order-42", label);
            assert_eq!(layout, literal, "{scope} {label}: the layout");
        }
        assert_eq!(psp, golden[0].2);
        assert_eq!(ledger, golden[1].2);
        // Another scope, same key and label: another derived key.
        let [other_psp, _] = derived(&idem, "acct_456", "order-42").await;
        assert_eq!(other_psp, golden[2].2);
        // The RFC 9651 string form is the same key, so the same derived
        // keys (run afresh, in a database that never saw the key: not a
        // replay of the answer above).
        let fresh = memory_idem().await;
        assert_eq!(
            derived(&fresh, "acct_123", "\"order-42\"").await,
            [psp, ledger]
        );
    }

    /// What the runtime stores is the pinned `Fingerprint::of` of the
    /// request's method, path (not the full URI), query, content type and
    /// body: another choice of inputs would change every stored value too.
    #[tokio::test]
    async fn stored_fingerprint_is_pinned() {
        let idem = memory_idem().await;
        derived(&idem, "acct_123", "order-42").await;
        let stored: Vec<u8> = sqlx::query_scalar("SELECT fingerprint FROM idem_keys")
            .fetch_one(idem.pool())
            .await
            .unwrap();
        let golden = "21bf810a4ee0ccb9ffbe69a8d4947261136136fbcfd2cb630e70478a0c11a050";
        let layout = super::spelled::fingerprint(
            "POST",
            "/v1/charges",
            Some("expand=customer"),
            super::Json(super::NESTED_CANONICAL),
        );
        assert_eq!(layout, golden);
        assert_eq!(hex::encode(&stored), golden);
        let json = super::content_type("application/json");
        let request = Fingerprint::of(
            &Method::POST,
            "/v1/charges",
            Some("expand=customer"),
            &json,
            super::NESTED.as_bytes(),
        );
        assert_eq!(super::hex(request), golden);
        assert_eq!(Fingerprint::from_bytes(&stored), Some(request));
    }
}
