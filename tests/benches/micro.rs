//! Micro-benchmarks of the pure parts every idempotent request pays for,
//! through their public API: key parsing and fingerprinting. (Response
//! capture and the stored encoding are crate-private, left out.)
//!
//! `cargo bench --bench micro`

use std::hint::black_box;

use axum::http::{HeaderMap, Method, header};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idem::canonical::canonicalize;
use idem::{Fingerprint, IdempotencyKey};

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
    // The group keeps the parser's old name: earlier baselines compare.
    let mut group = c.benchmark_group("parse_key_value");
    let cases: [(&str, &[u8]); 3] = [
        ("token", b"8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ("sf_string", b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\""),
        ("sf_string_255", &[b'k'; 255]),
    ];
    for (name, raw) in cases {
        group.bench_function(name, |b| b.iter(|| IdempotencyKey::parse(black_box(raw))));
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
        b.iter(|| canonicalize(black_box(&big)).unwrap())
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

criterion_group!(benches, key_parsing, fingerprinting);
criterion_main!(benches);
