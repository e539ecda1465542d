//! Hashed scopes and keys on every engine ([`Idem::hash_keys`]): requests
//! run through the protocol as the generated handlers run them, the
//! completer resumes one, an operator resolves one, and the key table's
//! and its resolutions table's raw columns read back with the engine's own
//! statements.

use std::borrow::Cow;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{StatusCode, header};
use http_body_util::BodyExt;
use sqlx::Pool;

use crate::backend::{Admin, Forgotten, KeyState, Param, Phased, Write};
use crate::completer::Resumed;
use crate::hash::KeyHasher;
use crate::idem::Idem;
use crate::phases::{PhaseError, Phases};
use crate::protocol::{Answer, Config, KeyMode, prepare, run, run_phased};
use crate::resolve::{Resolution, Resolved};
use crate::seal::KeyRing;
use crate::table::resolutions_table;
use crate::tx::Tx;

/// The caller whose id must never reach the tables.
const SCOPE: &str = "acct_private_4711";
/// Another caller, who picks the same keys.
const OTHER: &str = "acct_private_0815";

const ATOMIC: Config = Config::new(60_000, 0, 30_000, KeyMode::Required);
const PHASED: Config = Config::new(60_000, 0, 30_000, KeyMode::Required).phased(30_000);

/// A finished response: its status, whether it was replayed, its body.
#[derive(Debug)]
struct Seen {
    status: StatusCode,
    replayed: bool,
    body: String,
}

async fn seen(response: Response) -> Seen {
    let (parts, body) = response.into_parts();
    Seen {
        status: parts.status,
        replayed: parts.headers.contains_key("idempotent-replayed"),
        body: String::from_utf8(body.collect().await.unwrap().to_bytes().to_vec()).unwrap(),
    }
}

fn request(key: &str) -> (http::request::Parts, Body) {
    http::Request::post("/v1/charges")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(r#"{"amount":1000}"#))
        .unwrap()
        .into_parts()
}

/// What a handler answers: the run's `id`, and the scope and key it was
/// handed.
fn answer(id: &str, key: &crate::key::IdempotencyKey) -> String {
    format!("{id} {} {}", key.scope(), key.as_str())
}

/// A request of `key` by `scope` to an atomic handler answering 201.
async fn charge<DB: Phased>(idem: &Idem<DB>, scope: &str, key: &str, id: &str) -> Seen {
    let (parts, body) = request(key);
    let (prepared, _) = prepare(idem, parts, body, &ATOMIC).await.unwrap();
    let id = id.to_owned();
    let handler = |tx: Tx<DB>| async move {
        let body = answer(&id, tx.key().expect("a keyed request"));
        Answer::new((StatusCode::CREATED, body).into_response(), false)
    };
    let scope = Cow::Owned(scope.to_owned());
    seen(run(idem.clone(), prepared, scope, handler).await).await
}

/// A request to a phased handler (a local phase, an external step), which
/// fails after its step (`fail`: its key kept for the next attempt) or
/// answers 201.
async fn payment<DB: Phased>(
    idem: &Idem<DB>,
    scope: &str,
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
                Ok("res".to_owned())
            })
            .await;
        let charged: Result<String, PhaseError> =
            phases.external("charge", async |derived| Ok(derived)).await;
        let (_, derived) = (reserved.unwrap(), charged.unwrap());
        if fail {
            return Answer::new(StatusCode::BAD_GATEWAY.into_response(), true);
        }
        let body = format!("{} {derived}", answer("pay", phases.key()));
        Answer::new((StatusCode::CREATED, body).into_response(), false)
    };
    let scope = Cow::Owned(scope.to_owned());
    run_phased(idem.clone(), prepared, scope, handler).await
}

async fn pay<DB: Phased>(idem: &Idem<DB>, key: &str, fail: bool) -> Seen {
    let (parts, body) = request(key);
    seen(payment(idem, SCOPE, parts, body, fail).await).await
}

/// Every row's scope and key columns, as the table holds them.
async fn raw_names<DB: Admin>(pool: &Pool<DB>, table: &str) -> Vec<(String, String)> {
    let crate::backend::KeyReads {
        columns,
        key,
        params: [first, second],
    } = DB::READS;
    let sql = format!("SELECT {columns} FROM {table} WHERE {key} <> {first} LIMIT {second}");
    let rows = DB::read_keys(pool, sql, [Param::Bytes(b""), Param::Int(1000)])
        .await
        .unwrap();
    rows.into_iter()
        .map(|row| {
            (
                String::from_utf8(row.scope).unwrap(),
                String::from_utf8(row.key).unwrap(),
            )
        })
        .collect()
}

/// The resolutions kept under these raw names.
async fn raw_resolutions<DB: Admin>(pool: &Pool<DB>, table: &str, scope: &str, key: &str) -> usize {
    let sql = format!(
        "SELECT resolved_ms, outcome, status, by_name, note FROM {} \
         WHERE scope = {} OR {} = {}",
        resolutions_table(table),
        DB::param(1),
        DB::READS.key,
        DB::param(2),
    );
    let params = [Param::Bytes(scope.as_bytes()), Param::Bytes(key.as_bytes())];
    DB::read_resolutions(pool, sql, params).await.unwrap().len()
}

/// With scopes and keys hashed, the tables hold neither a scope nor a key
/// in the clear, after an atomic request, a phased one the completer
/// resumes and a resolution; handlers see them clear; retries replay;
/// another caller's same key is another row; the operations find a key by
/// its clear names (and by a listing's hashes), a hasher with another
/// secret does not; long scopes are kept.
pub(crate) async fn hashing_contract<DB: Phased + Admin>(pool: &Pool<DB>, table: &str) {
    let plain = Idem::new(pool.clone()).table(table).unwrap();
    let hasher = KeyHasher::new([3; 32]);
    let idem = plain.clone().hash_keys(hasher.clone());

    // An atomic request: its handler sees the clear scope and key, its
    // retry replays, another caller's same key runs on its own row.
    let first = charge(&idem, SCOPE, "order-a", "ch_1").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, format!("ch_1 {SCOPE} order-a"));
    let retry = charge(&idem, SCOPE, "order-a", "ch_2").await;
    assert!(retry.replayed && retry.body == first.body, "{retry:?}");
    let other = charge(&idem, OTHER, "order-a", "ch_3").await;
    assert!(!other.replayed && other.body == format!("ch_3 {OTHER} order-a"));

    // A phased request kept after its external step, then resumed by the
    // completer, which sends the clear scope and key: the same derived
    // key, the same row.
    assert_eq!(
        pay(&idem, "pay-q", true).await.status,
        StatusCode::BAD_GATEWAY
    );
    let service = idem.clone();
    let route = axum::routing::post(move |request: http::Request<Body>| async move {
        let scope = request
            .extensions()
            .get::<Resumed>()
            .expect("sent by the completer")
            .scope()
            .into_owned();
        let (parts, body) = request.into_parts();
        payment(&service, &scope, parts, body, false).await
    });
    let router = axum::Router::new().route("/v1/charges", route);
    let pass = idem.completer(router).run_once().await.unwrap();
    assert_eq!((pass.resumed, pass.completed), (1, 1), "{pass:?}");
    let paid = pay(&idem, "pay-q", false).await;
    assert!(paid.replayed, "{paid:?}");
    let derived = crate::key::IdempotencyKey::new(SCOPE.into(), "pay-q".into()).derive("charge");
    assert_eq!(paid.body, format!("pay {SCOPE} pay-q {derived}"));

    // A phased key made uncertain, resolved by its clear names.
    assert_eq!(
        pay(&idem, "pay-u", true).await.status,
        StatusCode::BAD_GATEWAY
    );
    let (scope_u, key_u) = (hasher.scope(SCOPE), hasher.key(SCOPE, "pay-u"));
    let uncertain = Write {
        sql: format!(
            "UPDATE {table} SET status = 0, body = {} WHERE scope = {} AND {} = {}",
            DB::param(1),
            DB::param(2),
            DB::READS.key,
            DB::param(3)
        ),
        params: vec![
            Param::Bytes(br#"{"since_ms":0,"reason":"attempts_exhausted"}"#),
            Param::Bytes(scope_u.as_bytes()),
            Param::Bytes(key_u.as_bytes()),
        ],
    };
    assert!(DB::write_all(pool, vec![uncertain]).await.unwrap());
    let resolution = Resolution::completed(StatusCode::CREATED, serde_json::json!({"id": "u"}));
    let resolved = idem.resolve(SCOPE, "pay-u", resolution).await.unwrap();
    assert_eq!(resolved, Resolved::Resolved);
    assert!(pay(&idem, "pay-u", false).await.replayed);

    // The raw columns: hashes only, of the scope and key the hasher makes.
    let names = raw_names(pool, table).await;
    assert_eq!(names.len(), 4, "{names:?}");
    for (scope, key) in &names {
        assert_eq!((scope.len(), key.len()), (43, 43), "{scope} {key}");
        for clear in [SCOPE, OTHER, "order-a", "pay-q", "pay-u", "acct_private"] {
            assert!(!scope.contains(clear) && !key.contains(clear), "{clear}");
        }
    }
    for (scope, key) in [
        (SCOPE, "order-a"),
        (OTHER, "order-a"),
        (SCOPE, "pay-q"),
        (SCOPE, "pay-u"),
    ] {
        let stored = (hasher.scope(scope), hasher.key(scope, key));
        assert!(names.contains(&stored), "{scope} {key}");
    }
    assert_ne!(hasher.key(SCOPE, "order-a"), hasher.key(OTHER, "order-a"));
    // The resolution is recorded under the hashes alone.
    assert_eq!(raw_resolutions(pool, table, SCOPE, "pay-u").await, 0);
    assert_eq!(raw_resolutions(pool, table, &scope_u, &key_u).await, 1);

    // The operations take the clear names, and show the hashes.
    let info = idem.lookup(SCOPE, "order-a").await.unwrap().expect("found");
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(
        (info.scope.as_str(), info.key.as_str()),
        (&*hasher.scope(SCOPE), &*hasher.key(SCOPE, "order-a"))
    );
    let resolved = idem.lookup(SCOPE, "pay-u").await.unwrap().expect("found");
    assert_eq!(resolved.resolutions.len(), 1);
    let recent = idem.recent(SCOPE, 10).await.unwrap();
    assert_eq!(recent.len(), 3);
    // A listing's hashes find the key too (the admin page links them).
    let listed = idem.lookup(&info.scope, &info.key).await.unwrap();
    assert_eq!(listed.map(|listed| listed.key), Some(info.key.clone()));
    assert_eq!(idem.recent(&info.scope, 10).await.unwrap().len(), 3);
    // Another secret, or none, finds nothing: the key is a new request.
    let other_secret = plain.clone().hash_keys(KeyHasher::new([4; 32]));
    assert!(
        other_secret
            .lookup(SCOPE, "order-a")
            .await
            .unwrap()
            .is_none()
    );
    assert!(plain.lookup(SCOPE, "order-a").await.unwrap().is_none());
    let again = charge(&other_secret, SCOPE, "order-a", "ch_4").await;
    assert!(!again.replayed && again.body.starts_with("ch_4"));

    // Forgotten by its clear names: the next request runs afresh.
    assert_eq!(
        idem.forget(SCOPE, "order-a").await.unwrap(),
        Forgotten::Deleted
    );
    assert!(idem.lookup(SCOPE, "order-a").await.unwrap().is_none());
    assert_eq!(
        idem.forget(SCOPE, "order-a").await.unwrap(),
        Forgotten::Absent
    );
    let fresh = charge(&idem, SCOPE, "order-a", "ch_5").await;
    assert!(!fresh.replayed && fresh.body.starts_with("ch_5"));
    // And by a listing's hashes.
    let listed = idem.lookup(OTHER, "order-a").await.unwrap().unwrap();
    assert_eq!(
        idem.forget(&listed.scope, &listed.key).await.unwrap(),
        Forgotten::Deleted
    );

    // A scope longer than any engine keeps in the clear is kept hashed.
    let long = "s".repeat(crate::scope::MAX_SCOPE_LEN + 1);
    assert_eq!(
        charge(&plain, &long, "k", "ch_6").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        charge(&idem, &long, "k", "ch_7").await.status,
        StatusCode::CREATED
    );
    assert!(charge(&idem, &long, "k", "ch_8").await.replayed);

    // With encryption too, a phased key's kept request, which names its
    // caller for the completer, is sealed: the row shows neither.
    let sealed = idem
        .clone()
        .encryption(KeyRing::new("k1", [1; 32]).unwrap());
    assert_eq!(
        pay(&sealed, "pay-s", true).await.status,
        StatusCode::BAD_GATEWAY
    );
    let row = DB::lookup(
        pool,
        table,
        &hasher.scope(SCOPE),
        &hasher.key(SCOPE, "pay-s"),
    )
    .await
    .unwrap()
    .expect("kept");
    let kept = row.request.expect("a kept request");
    let holds = |text: &str| kept.windows(text.len()).any(|w| w == text.as_bytes());
    assert!(!holds(SCOPE) && !holds("pay-s"));
    let paid = pay(&sealed, "pay-s", false).await;
    assert!(
        paid.status == StatusCode::CREATED && paid.body.starts_with(&format!("pay {SCOPE} pay-s"))
    );
}

crate::backend::test_support::contract_on_every_engine!(hashing_contract, "hashed":
    the_hashing_contract_holds_on_postgres,
    the_hashing_contract_holds_on_mysql,
    the_hashing_contract_holds_on_sqlite
);
