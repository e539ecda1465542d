//! Micro-benchmarks of the pure parts every idempotent request pays for:
//! key parsing, fingerprinting, response capture and the replay encoding.
//!
//! `cargo bench --bench micro`

use std::hint::black_box;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::__private::{Fingerprint, StoredResponse};
use idem::DEFAULT_REPLAY_HEADERS;

/// A JSON object of about `bytes` bytes: an array of small charge records.
fn json_body(bytes: usize) -> Vec<u8> {
    let mut body = String::from(r#"{"currency":"eur","customer":"cus_42","items":["#);
    let mut i = 0;
    while body.len() + 80 < bytes {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            r#"{{"sku":"sku-{i:06}","amount":{},"note":"line item {i}"}}"#,
            1000 + i
        ));
        i += 1;
    }
    body.push_str("]}");
    body.into_bytes()
}

fn key_parsing(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_key_value");
    let cases: [(&str, &[u8]); 3] = [
        ("token", b"8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("sf_string", b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\""),
        ("sf_string_255", &[b'k'; 255]),
    ];
    for (name, raw) in cases {
        group.bench_function(name, |b| {
            b.iter(|| idem::__private::parse_key_value(black_box(raw)))
        });
    }
    group.finish();
}

fn fingerprinting(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
    let method = Method::POST;
    for (name, size) in [("json_1KiB", 1024), ("json_256KiB", 256 * 1024)] {
        let body = json_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| {
                Fingerprint::of(
                    &method,
                    "/v1/charges",
                    None,
                    black_box(&headers),
                    black_box(body),
                )
            })
        });
    }
    // Where a JSON fingerprint's time goes: parsing alone, then the
    // RFC 8785 form (parse + canonical serialization).
    let big = json_body(256 * 1024);
    group.throughput(Throughput::Bytes(big.len() as u64));
    group.bench_function("serde_json_parse_256KiB", |b| {
        b.iter(|| serde_json::from_slice::<serde_json::Value>(black_box(&big)).unwrap())
    });
    group.bench_function("canonicalize_256KiB", |b| {
        b.iter(|| idem::__private::canonicalize(black_box(&big)).unwrap())
    });
    // The reference crate idem's canonicaliser replaced (same bytes).
    group.bench_function("reference_canonicalize_256KiB", |b| {
        b.iter(|| {
            let value: serde_json::Value = serde_json::from_slice(black_box(&big)).unwrap();
            serde_json_canonicalizer::to_vec(&value).unwrap()
        })
    });
    // The same 1 KiB body, not JSON: hashed raw, no canonical form.
    let raw = json_body(1024);
    let octets = HeaderMap::new();
    group.throughput(Throughput::Bytes(raw.len() as u64));
    group.bench_function("raw_1KiB", |b| {
        b.iter(|| Fingerprint::of(&method, "/v1/charges", None, &octets, black_box(&raw)))
    });
    group.finish();
}

/// What a typical handler answers: 201, JSON, Location, ETag, a cookie
/// that must not be stored.
fn handler_response(body: &'static [u8]) -> Response {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::CREATED;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(
        header::LOCATION,
        HeaderValue::from_static("/v1/charges/ch_1234567890"),
    );
    headers.insert(header::ETAG, HeaderValue::from_static("\"5f1e2d3c\""));
    headers.insert(
        header::SET_COOKIE,
        HeaderValue::from_static("session=abc; HttpOnly"),
    );
    response
}

const CHARGE: &[u8] =
    br#"{"id":"ch_1234567890","amount":1250,"currency":"eur","status":"succeeded","customer":"cus_42"}"#;

fn responses(c: &mut Criterion) {
    let mut group = c.benchmark_group("response");
    let allow: Vec<HeaderName> = DEFAULT_REPLAY_HEADERS.to_vec();
    // A `Full` body is ready at once: no runtime needed to drive it.
    group.bench_function("capture", |b| {
        b.iter(|| {
            futures::executor::block_on(StoredResponse::capture(
                handler_response(CHARGE),
                &allow,
                1024 * 1024,
            ))
            .unwrap()
        })
    });
    let (stored, _) = futures::executor::block_on(StoredResponse::capture(
        handler_response(CHARGE),
        &allow,
        1024 * 1024,
    ))
    .unwrap();
    group.bench_function("encode_headers", |b| {
        b.iter(|| black_box(&stored).encode_headers())
    });
    let encoded = stored.encode_headers();
    group.bench_function("decode", |b| {
        b.iter(|| StoredResponse::decode(201, black_box(&encoded), CHARGE.to_vec()).unwrap())
    });
    group.bench_function("replay", |b| {
        b.iter(|| black_box(stored.clone()).replay(&allow, &idem::IDEMPOTENT_REPLAYED))
    });
    group.finish();
}

criterion_group!(benches, key_parsing, fingerprinting, responses);
criterion_main!(benches);
