//! Encryption at rest on every engine ([`Idem::encryption`]): requests run
//! through the protocol as the generated handlers run them, and the key
//! table's raw columns read back with the engine's own statements.

use std::borrow::Cow;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use http_body_util::BodyExt;
use sqlx::Pool;

use crate::backend::{Acquire, Admin, ClaimOutcome, KeyState, Param, Phased, Write};
use crate::idem::Idem;
use crate::phases::{PhaseError, Phases};
use crate::protocol::{Answer, Config, KeyMode, prepare, run, run_phased};
use crate::resolve::{Resolution, Resolved};
use crate::response::EncodedResponse;
use crate::seal::{Envelope, KeyRing};
use crate::tx::Tx;

/// What the tests store: a secret in the body, the request and the
/// recovery point, which must never reach the table in the clear.
const SECRET: &str = "sk_live_do_not_store";
/// The stored response's `Location`, as secret as its body.
const LOCATION: &str = "/v1/charges/ch_hidden_location";

const ATOMIC: Config = Config::new(60_000, 0, 30_000, KeyMode::Required);
const TOMBSTONED: Config = ATOMIC.tombstone(120_000);
const PHASED: Config = Config::new(60_000, 0, 30_000, KeyMode::Required).phased(30_000);

/// A finished response: status, `Location` and body.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    status: StatusCode,
    location: Option<HeaderValue>,
    replayed: bool,
    body: Vec<u8>,
}

async fn seen(response: Response) -> Seen {
    let (parts, body) = response.into_parts();
    Seen {
        status: parts.status,
        location: parts.headers.get(header::LOCATION).cloned(),
        replayed: parts.headers.contains_key("idempotent-replayed"),
        body: body.collect().await.unwrap().to_bytes().to_vec(),
    }
}

fn request(key: &str, body: &str) -> (http::request::Parts, Body) {
    http::Request::post("/v1/charges")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
        .into_parts()
}

/// A request of `key` to an atomic handler answering 201 with `id` and
/// the secret.
async fn charge<DB: Phased>(idem: &Idem<DB>, key: &str, id: &str) -> Seen {
    charge_under(&ATOMIC, idem, key, id).await
}

/// [`charge`] to a handler of `config`.
async fn charge_under<DB: Phased>(config: &Config, idem: &Idem<DB>, key: &str, id: &str) -> Seen {
    let (parts, body) = request(key, r#"{"amount":1000}"#);
    let (prepared, _) = prepare(idem, parts, body, config).await.unwrap();
    let answer = format!(r#"{{"id":"{id}","secret":"{SECRET}"}}"#);
    let handler = |_tx: Tx<DB>| async move {
        let response = (StatusCode::CREATED, [(header::LOCATION, LOCATION)], answer);
        Answer::new(response.into_response(), false)
    };
    seen(run(idem.clone(), prepared, Cow::Borrowed("acct"), handler).await).await
}

/// A request of `key` to a phased handler: a local phase and an external
/// step record the secret, then it fails (`fail`: its key kept, with its
/// recovery point and request, for the next attempt) or answers 201.
async fn pay<DB: Phased>(idem: &Idem<DB>, key: &str, fail: bool) -> Seen {
    let (parts, body) = request(key, &format!(r#"{{"card":"{SECRET}"}}"#));
    seen(payment(idem, parts, body, fail).await).await
}

/// The phased handler of [`pay`], on any request (a client's, or one the
/// completer sends).
async fn payment<DB: Phased>(
    idem: &Idem<DB>,
    parts: http::request::Parts,
    body: Body,
    fail: bool,
) -> Response {
    let prepared = match prepare(idem, parts, body, &PHASED).await {
        Ok((prepared, _)) => prepared,
        Err(refused) => return refused,
    };
    let handler = move |mut phases: Phases<DB>| async move {
        let reserved: Result<String, PhaseError> = phases
            .local("reserve", async |_conn: &mut DB::Connection| {
                Ok(format!("res_{SECRET}"))
            })
            .await;
        let charged: Result<String, PhaseError> = phases
            .external("charge", async |_key| Ok(format!("ch_{SECRET}")))
            .await;
        let (reserved, charged) = (reserved.unwrap(), charged.unwrap());
        if fail {
            return Answer::new(StatusCode::BAD_GATEWAY.into_response(), true);
        }
        let body = format!(r#"{{"reserved":"{reserved}","charged":"{charged}"}}"#);
        Answer::new((StatusCode::CREATED, body).into_response(), false)
    };
    run_phased(idem.clone(), prepared, Cow::Borrowed("acct"), handler).await
}

/// The key's stored response, its columns as the table holds them.
async fn raw_response<DB: Phased>(pool: &Pool<DB>, table: &str, key: &str) -> EncodedResponse {
    let claim = crate::backend::test_support::claim_of("acct", key, 0, std::time::Duration::ZERO);
    match DB::claim(pool, Acquire::default(), table, &claim)
        .await
        .unwrap()
    {
        ClaimOutcome::Finished { response, .. } => response,
        other => panic!("{key}: a finished key, not {other:?}"),
    }
}

fn holds(bytes: &[u8], text: &str) -> bool {
    bytes
        .windows(text.len())
        .any(|window| window == text.as_bytes())
}

fn key_id(sealed: &[u8]) -> Vec<u8> {
    Envelope::parse(sealed)
        .expect("a sealed value")
        .key_id
        .to_vec()
}

/// 500 `idempotency_response_unreadable`, the operation completed, a new
/// key not safe, and nothing of any stored response in it.
fn assert_unreadable(seen: &Seen, what: &str) {
    assert_eq!(seen.status, StatusCode::INTERNAL_SERVER_ERROR, "{what}");
    let json: serde_json::Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(json["code"], "idempotency_response_unreadable", "{what}");
    assert_eq!(json["operation_state"], "completed", "{what}");
    assert_eq!(json["safe_new_key"], false, "{what}");
    assert!(
        !holds(&seen.body, SECRET) && seen.location.is_none(),
        "{what}"
    );
}

/// With encryption on, the table holds no plaintext of a stored response,
/// a kept request or a recovery point, and replays are identical; a value
/// copied to another key's row, or sealed with a key removed from the
/// ring, is answered `idempotency_response_unreadable` (nothing runs, and
/// nothing of another key's response is replayed); a rotated ring reads
/// the old key's values and seals with the new one.
pub(crate) async fn encryption_contract<DB: Phased + Admin>(pool: &Pool<DB>, table: &str) {
    let plain = Idem::new(pool.clone()).table(table).unwrap();
    let old = KeyRing::new("k1", [1; 32]).unwrap();
    let rotated = old.clone().with_key("k2", [2; 32]).unwrap();
    let sealed = plain.clone().encryption(old);

    // A stored response: sealed, with the ring's key id; replayed as it was.
    let first = charge(&sealed, "a", "ch_a").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let raw = raw_response(pool, table, "a").await;
    assert_eq!(raw.status, StatusCode::CREATED, "the status stays plain");
    assert!(!holds(&raw.body, SECRET) && !holds(&raw.body, "ch_a"));
    assert!(!holds(&raw.headers, LOCATION) && !holds(&raw.headers, "location"));
    assert_eq!(key_id(&raw.headers), b"k1");
    assert_eq!(key_id(&raw.body), b"k1");
    let replay = charge(&sealed, "a", "ch_other").await;
    assert!(replay.replayed);
    assert_eq!(
        (replay.status, &replay.location),
        (first.status, &first.location)
    );
    assert_eq!(replay.body, first.body);

    // Another key's sealed response copied onto this key's row: refused,
    // and neither key's answer runs again or leaks.
    assert_eq!(
        charge(&sealed, "b", "ch_b").await.status,
        StatusCode::CREATED
    );
    let p = DB::param;
    let copy = Write {
        sql: format!(
            "UPDATE {table} SET headers = {}, body = {} WHERE scope = {} AND {} = {}",
            p(1),
            p(2),
            p(3),
            DB::READS.key,
            p(4)
        ),
        params: vec![
            Param::Bytes(&raw.headers),
            Param::Bytes(&raw.body),
            Param::Bytes(b"acct"),
            Param::Bytes(b"b"),
        ],
    };
    assert!(DB::write_all(pool, vec![copy]).await.unwrap());
    let copied = charge(&sealed, "b", "ch_b2").await;
    assert_unreadable(&copied, "a response copied from another row");
    assert!(!holds(&copied.body, "ch_a") && !holds(&copied.body, "ch_b"));

    // Rotation: the old key's values still replay, new ones carry the new id.
    let with_both = plain.clone().encryption(rotated);
    assert_eq!(charge(&with_both, "a", "ch_x").await.body, first.body);
    let newer = charge(&with_both, "c", "ch_c").await;
    assert_eq!(newer.status, StatusCode::CREATED);
    let raw_c = raw_response(pool, table, "c").await;
    assert_eq!(
        (key_id(&raw_c.headers), key_id(&raw_c.body)),
        (b"k2".to_vec(), b"k2".to_vec())
    );

    // A resolution's response is sealed as a handler's: `b` made uncertain
    // (by hand), then resolved completed.
    let uncertain = Write {
        sql: format!(
            "UPDATE {table} SET status = 0, body = {} WHERE scope = {} AND {} = {}",
            p(1),
            p(2),
            DB::READS.key,
            p(3)
        ),
        params: vec![
            Param::Bytes(br#"{"since_ms":0,"reason":"attempts_exhausted"}"#),
            Param::Bytes(b"acct"),
            Param::Bytes(b"b"),
        ],
    };
    assert!(DB::write_all(pool, vec![uncertain]).await.unwrap());
    let found = serde_json::json!({ "id": format!("ch_{SECRET}") });
    let resolution = Resolution::completed(StatusCode::CREATED, found);
    let resolved = with_both.resolve("acct", "b", resolution).await.unwrap();
    assert_eq!(resolved, Resolved::Resolved);
    let raw_b = raw_response(pool, table, "b").await;
    assert!(!holds(&raw_b.body, SECRET) && !holds(&raw_b.headers, "json"));
    assert_eq!(key_id(&raw_b.body), b"k2");
    let replayed = charge(&with_both, "b", "ch_b3").await;
    assert!(replayed.replayed && holds(&replayed.body, &format!("ch_{SECRET}")));

    // The old key removed: its values are unreadable, the new ones replay.
    let new_only = plain
        .clone()
        .encryption(KeyRing::new("k2", [2; 32]).unwrap());
    assert_unreadable(&charge(&new_only, "a", "ch_y").await, "a removed key");
    assert_eq!(charge(&new_only, "c", "ch_z").await.body, newer.body);
    // Without a ring, a sealed value is never replayed as if plain.
    assert_unreadable(&charge(&plain, "c", "ch_z").await, "no ring");
    // A key whose response does not open is completed, not run again.
    assert_eq!(
        plain.lookup("acct", "a").await.unwrap().unwrap().state,
        KeyState::Completed
    );

    // A phased key kept after an external step: its request and recovery
    // point are sealed, and the operators' view opens them.
    let failed = pay(&with_both, "p", true).await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    let row = DB::lookup(pool, table, "acct", "p")
        .await
        .unwrap()
        .expect("kept");
    let (request, recovery) = (row.request.unwrap(), row.recovery.unwrap());
    assert!(!holds(&request, SECRET) && !holds(&request, "/v1/charges"));
    assert!(!holds(&recovery, SECRET) && !holds(&recovery, "reserve"));
    assert_eq!(
        (key_id(&request), key_id(&recovery)),
        (b"k2".to_vec(), b"k2".to_vec())
    );
    let info = with_both.lookup("acct", "p").await.unwrap().unwrap();
    assert_eq!(info.phases, ["reserve"]);
    assert_eq!(
        (info.method.as_deref(), info.path.as_deref()),
        (Some("POST"), Some("/v1/charges"))
    );
    assert!(info.external && !info.unreadable);
    // Without the ring the operators see that it is sealed, not its steps.
    let unopened = plain.lookup("acct", "p").await.unwrap().unwrap();
    assert!(unopened.unreadable && unopened.phases.is_empty() && unopened.method.is_none());

    // A client's retry resumes from the sealed recovery point (the lease
    // ended at once) and its response is sealed in turn.
    let paid = pay(&with_both, "p", false).await;
    assert_eq!(paid.status, StatusCode::CREATED);
    assert!(holds(&paid.body, &format!("ch_{SECRET}")));
    let raw_p = raw_response(pool, table, "p").await;
    assert!(!holds(&raw_p.body, SECRET));
    assert_eq!(pay(&with_both, "p", false).await.body, paid.body);

    // So does the completer, from the sealed request it opens and sends.
    assert_eq!(
        pay(&with_both, "q", true).await.status,
        StatusCode::BAD_GATEWAY
    );
    let service = with_both.clone();
    let route = axum::routing::post(move |request: http::Request<Body>| async move {
        let (parts, body) = request.into_parts();
        payment(&service, parts, body, false).await
    });
    let router = axum::Router::new().route("/v1/charges", route);
    let pass = with_both.completer(router).run_once().await.unwrap();
    assert_eq!((pass.resumed, pass.completed), (1, 1), "{pass:?}");
    let finished = pay(&with_both, "q", false).await;
    assert!(finished.replayed && holds(&finished.body, &format!("ch_{SECRET}")));
    assert!(!holds(&raw_response(pool, table, "q").await.body, SECRET));

    // A tombstone's `Location` is sealed too, and opened for its answer:
    // `t`'s replay ended by hand (its end set to its claim's time).
    let kept = charge_under(&TOMBSTONED, &with_both, "t", "ch_t").await;
    assert_eq!(kept.status, StatusCode::CREATED);
    let ended = Write {
        sql: format!(
            "UPDATE {table} SET replay_until = created_at WHERE scope = {} AND {} = {}",
            p(1),
            DB::READS.key,
            p(2)
        ),
        params: vec![Param::Bytes(b"acct"), Param::Bytes(b"t")],
    };
    assert!(DB::write_all(pool, vec![ended]).await.unwrap());
    let claim = crate::backend::test_support::claim_of("acct", "t", 0, std::time::Duration::ZERO);
    let tombstone = match DB::claim(pool, Acquire::default(), table, &claim).await {
        Err(crate::backend::StoreError::Tombstone(tombstone)) => tombstone,
        other => panic!("a tombstone, not {other:?}"),
    };
    let location = tombstone.location.expect("the Location is kept");
    assert!(!holds(&location, LOCATION) && !holds(&location, "location"));
    assert_eq!(key_id(&location), b"k2");
    let late = charge_under(&TOMBSTONED, &with_both, "t", "ch_t2").await;
    assert_eq!(late.status, StatusCode::CONFLICT);
    let json: serde_json::Value = serde_json::from_slice(&late.body).unwrap();
    assert_eq!(json["code"], "idempotency_key_expired");
    assert_eq!(
        (json["original_status"].as_u64(), json["location"].as_str()),
        (Some(201), Some(LOCATION))
    );
    // Without the key, the answer holds: without the location.
    let late = charge_under(&TOMBSTONED, &plain, "t", "ch_t3").await;
    let json: serde_json::Value = serde_json::from_slice(&late.body).unwrap();
    assert_eq!(
        (json["code"].as_str(), &json["location"]),
        (Some("idempotency_key_expired"), &serde_json::Value::Null)
    );
}

crate::backend::test_support::contract_on_every_engine!(encryption_contract, "sealed":
    the_encryption_contract_holds_on_postgres,
    the_encryption_contract_holds_on_mysql,
    the_encryption_contract_holds_on_sqlite
);
