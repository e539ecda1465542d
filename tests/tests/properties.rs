//! Property tests of the pure public parts: the fingerprint and its JSON
//! canonicaliser, the key header parser. (The stored-response encoding,
//! crate-private, has its own in `idem-runtime/src/response.rs`.)
//!
//! Each property runs `PROPTEST_CASES` cases (256 unless set), so CI runs a
//! bounded number; `PROPTEST_CASES=100000 cargo test --test properties`
//! digs deeper. The fuzz targets in `fuzz/` cover the same ground with
//! coverage guidance.

use axum::http::{HeaderMap, HeaderValue, Method, header::CONTENT_TYPE};
use idem::MAX_KEY_LEN;
use idem::redact;
use idem::{Fingerprint, IdempotencyKey, KeyError};
use proptest::prelude::*;
use proptest::test_runner::Config;
use serde_json::{Map, Value};

fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(256);
    Config {
        cases,
        // A failure prints its minimal case; nothing is written to the tree.
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------- JSON

/// [`idem::canonical::canonicalize`] as an `Option`: these properties
/// compare forms, and its error says nothing more than `None`.
fn canonicalize(json: &[u8]) -> Option<Vec<u8>> {
    idem::canonical::canonicalize(json).ok()
}

/// Any JSON value: scalars (unicode strings included), nested arrays and
/// objects, integers kept within 2^53 so that every two different values
/// are different doubles (RFC 8785 compares numbers as doubles).
fn json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
        (-1.0e300f64..1.0e300).prop_map(Value::from),
        any::<String>().prop_map(Value::String),
        "[a-z\"\\\\/\u{0}-\u{1f}\u{e9}\u{1F600}]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            // Names beyond U+E000 and beyond the BMP sort apart in UTF-16.
            prop::collection::btree_map(
                "[a-zA-Z0-9_\u{e9}\u{e000}\u{ff5e}\u{1F600}\n\"]{0,5}",
                inner,
                0..6
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// One spelling of `value`: object members in an order drawn from `order`
/// and whitespace drawn from `spaces` between every two tokens.
fn spell(value: &Value, order: &mut impl Iterator<Item = u64>, spaces: &[&str]) -> String {
    let mut out = String::new();
    let mut pick = |order: &mut dyn Iterator<Item = u64>| {
        spaces[order.next().unwrap_or(0) as usize % spaces.len()].to_owned()
    };
    fn go(
        value: &Value,
        out: &mut String,
        order: &mut dyn Iterator<Item = u64>,
        ws: &mut dyn FnMut(&mut dyn Iterator<Item = u64>) -> String,
    ) {
        out.push_str(&ws(order));
        match value {
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&ws(order));
                        out.push(',');
                    }
                    go(item, out, order, ws);
                }
                out.push_str(&ws(order));
                out.push(']');
            }
            Value::Object(members) => {
                let mut members: Vec<(&String, &Value)> = members.iter().collect();
                // A Fisher-Yates shuffle driven by the drawn numbers.
                for i in (1..members.len()).rev() {
                    let j = order.next().unwrap_or(0) as usize % (i + 1);
                    members.swap(i, j);
                }
                out.push('{');
                for (i, (name, item)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&ws(order));
                        out.push(',');
                    }
                    out.push_str(&ws(order));
                    out.push_str(&serde_json::to_string(name).unwrap());
                    out.push_str(&ws(order));
                    out.push(':');
                    go(item, out, order, ws);
                }
                out.push_str(&ws(order));
                out.push('}');
            }
            scalar => out.push_str(&serde_json::to_string(scalar).unwrap()),
        }
        out.push_str(&ws(order));
    }
    go(value, &mut out, order, &mut pick);
    out
}

const WHITESPACE: &[&str] = &["", " ", "\n", "\t", "\r\n", "  \n\t "];

fn json_headers(content_type: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
    headers
}

fn content_type() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/merge-patch+json",
        "application/problem+json ; charset=UTF-8",
    ])
}

/// A value that differs from `value` in one place, as RFC 8785 sees it.
fn mutate(value: &Value, path: &mut impl Iterator<Item = u64>) -> Value {
    match value {
        Value::Null => Value::from(0),
        Value::Bool(b) => Value::Bool(!b),
        Value::Number(n) => match n.as_i64() {
            Some(i) if i.unsigned_abs() < (1u64 << 53) => Value::from(i + 1),
            _ => Value::from(n.as_f64().unwrap() * 2.0 + 1.0),
        },
        Value::String(s) => Value::String(format!("{s}x")),
        Value::Array(items) if items.is_empty() => Value::Array(vec![Value::Null]),
        Value::Array(items) => {
            let mut items = items.clone();
            let at = path.next().unwrap_or(0) as usize % items.len();
            if path.next().unwrap_or(0).is_multiple_of(4) {
                items.remove(at);
            } else {
                items[at] = mutate(&items[at], path);
            }
            Value::Array(items)
        }
        Value::Object(members) if members.is_empty() => {
            Value::Object(Map::from_iter([("k".to_owned(), Value::Null)]))
        }
        Value::Object(members) => {
            let mut members = members.clone();
            let name = members
                .keys()
                .nth(path.next().unwrap_or(0) as usize % members.len())
                .unwrap()
                .clone();
            match path.next().unwrap_or(0) % 4 {
                0 => {
                    members.remove(&name);
                }
                1 => {
                    let item = members.remove(&name).unwrap();
                    members.insert(format!("{name}~"), item);
                }
                _ => {
                    let item = mutate(&members[&name], path);
                    members.insert(name, item);
                }
            }
            Value::Object(members)
        }
    }
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        prop::sample::select(vec![
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::GET
        ]),
        "[A-Z]{1,8}".prop_map(|m| Method::from_bytes(m.as_bytes()).unwrap()),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn json_spellings_share_one_fingerprint(
        value in json(),
        order_a in prop::collection::vec(any::<u64>(), 64),
        order_b in prop::collection::vec(any::<u64>(), 64),
        ct_a in content_type(),
        ct_b in content_type(),
    ) {
        let a = spell(&value, &mut order_a.into_iter().cycle(), WHITESPACE);
        let b = spell(&value, &mut order_b.into_iter().cycle(), WHITESPACE);
        prop_assert_eq!(canonicalize(a.as_bytes()), canonicalize(b.as_bytes()));
        prop_assert!(canonicalize(a.as_bytes()).is_some(), "not JSON: {}", a);
        let fa = Fingerprint::of(&Method::POST, "/v1/x", Some("q=1"), &json_headers(ct_a), a.as_bytes());
        let fb = Fingerprint::of(&Method::POST, "/v1/x", Some("q=1"), &json_headers(ct_b), b.as_bytes());
        prop_assert_eq!(fa, fb, "{} vs {}", a, b);
    }

    #[test]
    fn a_changed_value_changes_the_fingerprint(
        value in json(),
        path in prop::collection::vec(any::<u64>(), 32),
        order in prop::collection::vec(any::<u64>(), 64),
    ) {
        let changed = mutate(&value, &mut path.into_iter().cycle());
        let a = spell(&value, &mut order.clone().into_iter().cycle(), WHITESPACE);
        let b = spell(&changed, &mut order.into_iter().cycle(), WHITESPACE);
        let headers = json_headers("application/json");
        prop_assert_ne!(
            Fingerprint::of(&Method::POST, "/p", None, &headers, a.as_bytes()),
            Fingerprint::of(&Method::POST, "/p", None, &headers, b.as_bytes()),
            "{} vs {}", a, b
        );
    }

    #[test]
    fn method_path_and_query_each_count(
        (m1, m2) in (method(), method()).prop_filter("two methods", |(a, b)| a != b),
        (p1, p2) in (".{0,12}", ".{0,12}").prop_filter("two paths", |(a, b)| a != b),
        (q1, q2) in (proptest::option::of(".{0,12}"), proptest::option::of(".{0,12}"))
            .prop_filter("two queries", |(a, b)| a != b),
        body in prop::collection::vec(any::<u8>(), 0..64),
        ct in prop_oneof![content_type().prop_map(Some), Just(None)],
    ) {
        let headers = ct.map(json_headers).unwrap_or_default();
        let base = Fingerprint::of(&m1, &p1, q1.as_deref(), &headers, &body);
        prop_assert_eq!(base, Fingerprint::of(&m1, &p1, q1.as_deref(), &headers, &body));
        prop_assert_ne!(base, Fingerprint::of(&m2, &p1, q1.as_deref(), &headers, &body));
        prop_assert_ne!(base, Fingerprint::of(&m1, &p2, q1.as_deref(), &headers, &body));
        prop_assert_ne!(base, Fingerprint::of(&m1, &p1, q2.as_deref(), &headers, &body));
        // Bytes moved between the path and the query are another request.
        if let Some(q) = &q1 {
            let moved_path = format!("{p1}?{q}");
            prop_assert_ne!(base, Fingerprint::of(&m1, &moved_path, None, &headers, &body));
        }
    }

    #[test]
    fn a_changed_raw_body_changes_the_fingerprint(
        body in prop::collection::vec(any::<u8>(), 0..64),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let text = json_headers("text/plain");
        let base = Fingerprint::of(&Method::POST, "/p", None, &text, &body);
        let mut other = body.clone();
        if other.is_empty() {
            other.push(0);
        } else {
            let at = flip.index(other.len());
            other[at] ^= 1 << bit;
        }
        prop_assert_ne!(base, Fingerprint::of(&Method::POST, "/p", None, &text, &other));
    }

    #[test]
    fn canonical_form_is_stable(value in json(), order in prop::collection::vec(any::<u64>(), 64)) {
        let text = spell(&value, &mut order.into_iter().cycle(), WHITESPACE);
        let once = canonicalize(text.as_bytes()).expect("valid JSON canonicalises");
        let twice = canonicalize(&once).expect("canonical JSON is JSON");
        prop_assert_eq!(&once, &twice);
        // And it still means the same thing.
        let back: Value = serde_json::from_slice(&once).unwrap();
        prop_assert_eq!(canonicalize(serde_json::to_string(&back).unwrap().as_bytes()), Some(once));
    }

    /// For JSON whose integers are all exact as doubles (every value
    /// `json()` makes), the canonicaliser writes what the reference crate
    /// writes, byte for byte. Not beyond 2^53, on purpose: there idem keeps
    /// an integer's digits where RFC 8785 and the crate round it to a
    /// double (`integers_beyond_doubles_keep_their_digits`).
    #[test]
    fn canonical_form_is_the_reference_crates(value in json(), order in prop::collection::vec(any::<u64>(), 64)) {
        let text = spell(&value, &mut order.into_iter().cycle(), WHITESPACE);
        let parsed: Value = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(
            canonicalize(text.as_bytes()),
            Some(serde_json_canonicalizer::to_vec(&parsed).unwrap())
        );
    }

    /// Any bytes: no panic, a fixed point, JSON exactly when the reference
    /// crate finds JSON, and its bytes but for the numbers where idem
    /// differs on purpose (`matches_reference`). The arrays of integers make
    /// those common, not a rare accident.
    #[test]
    fn canonicaliser_never_panics_and_is_stable_on_any_bytes(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..128),
            "[\\[\\]{}:,\" 0-9.eE+\\-tfnrulase\\\\u]{0,48}".prop_map(String::into_bytes),
            prop::collection::vec(
                prop_oneof![
                    any::<u64>().prop_map(|n| n.to_string()),
                    any::<i64>().prop_map(|n| n.to_string()),
                    (-(1i64 << 53)..=(1i64 << 53)).prop_map(|n| n.to_string()),
                    // Beyond 64 bits: serde_json holds only a double.
                    "-?[1-9][0-9]{19,30}",
                ],
                0..6,
            )
            .prop_map(|numbers| format!("[{}]", numbers.join(", ")).into_bytes()),
        ]
    ) {
        if let Some(once) = canonicalize(&bytes) {
            prop_assert_eq!(canonicalize(&once), Some(once.clone()));
        }
        let reference = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .filter(|value| serde_json_canonicalizer::to_vec(value).is_ok());
        match (canonicalize(&bytes), reference) {
            (Some(written), Some(value)) => {
                let checked = matches_reference(&written, &value);
                prop_assert!(checked.is_ok(), "{:?}: {:?}", String::from_utf8_lossy(&bytes), checked);
            }
            // JSON idem does not canonicalise: it names a member twice.
            (None, Some(_)) => prop_assert!(names_a_member_twice(&bytes), "{:?}", String::from_utf8_lossy(&bytes)),
            (written, value) => prop_assert_eq!(written.is_some(), value.is_some()),
        }
    }
}

/// Whether some object of `body` (JSON that serde_json reads) names a
/// member twice, which `Value` cannot tell (it keeps the last).
fn names_a_member_twice(body: &[u8]) -> bool {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

    /// Reads a JSON value, failing on an object that names a member twice.
    struct Once;
    impl<'de> serde::Deserialize<'de> for Once {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer.deserialize_any(Once)
        }
    }
    impl<'de> Visitor<'de> for Once {
        type Value = Once;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_bool<E>(self, _: bool) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_str<E>(self, _: &str) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_unit<E>(self) -> Result<Once, E> {
            Ok(Once)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Once, A::Error> {
            while items.next_element::<Once>()?.is_some() {}
            Ok(Once)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Once, A::Error> {
            let mut names = std::collections::HashSet::new();
            while let Some(name) = members.next_key::<String>()? {
                if !names.insert(name) {
                    return Err(serde::de::Error::custom("a member twice"));
                }
                members.next_value::<Once>()?;
            }
            Ok(Once)
        }
    }
    serde_json::from_slice::<IgnoredAny>(body).is_ok()
        && serde_json::from_slice::<Once>(body).is_err()
}

#[test]
fn a_member_named_twice_is_hashed_verbatim() {
    for body in [&br#"{"a":1,"a":2}"#[..], br#"[{"x":{"b":1,"\u0062":1}}]"#] {
        assert!(names_a_member_twice(body));
        assert_eq!(canonicalize(body), None);
    }
    assert!(!names_a_member_twice(br#"{"a":{"a":1}}"#));
}

/// Beyond this magnitude an integer may not be exact as a double.
const EXACT_INTEGERS: u64 = 1 << 53;

/// A number where idem may write other bytes than RFC 8785 (and the
/// reference crate): an integer beyond 2^53, whose digits idem keeps, or a
/// double beyond 2^53, which idem writes as its exact integer digits (and
/// which, from 2^63, may have been an integer literal too long for
/// serde_json to hold: its digits are gone from the parsed value).
fn exempt(number: &serde_json::Number) -> bool {
    number.as_u64().is_some_and(|n| n > EXACT_INTEGERS)
        || number
            .as_i64()
            .is_some_and(|n| n.unsigned_abs() > EXACT_INTEGERS)
        || (number.is_f64() && number.as_f64().unwrap().abs() > EXACT_INTEGERS as f64)
}

/// Checks that `written` (idem's canonical form of `value`) is the
/// reference crate's form of `value` but for the exempt numbers: an
/// integer beyond 2^53 with exactly its own digits, a double beyond 2^53
/// in any spelling of the same double. Each exempt number goes
/// through the crate as a marker string (values do not move members, only
/// names do); what idem wrote in its place is then read back.
fn matches_reference(written: &[u8], value: &Value) -> Result<(), String> {
    fn mark(value: &Value, exempted: &mut Vec<serde_json::Number>) -> Value {
        match value {
            Value::Number(number) if exempt(number) => {
                exempted.push(number.clone());
                Value::String(format!("\u{1}idem-exact-{}\u{1}", exempted.len() - 1))
            }
            Value::Array(items) => Value::Array(items.iter().map(|v| mark(v, exempted)).collect()),
            Value::Object(members) => Value::Object(
                members
                    .iter()
                    .map(|(name, v)| (name.clone(), mark(v, exempted)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }
    let mut exempted = Vec::new();
    let marked = mark(value, &mut exempted);
    let reference = serde_json_canonicalizer::to_vec(&marked).map_err(|e| e.to_string())?;
    let reference = String::from_utf8(reference).unwrap();
    let mut rest = std::str::from_utf8(written).map_err(|e| e.to_string())?;
    let mut segments = reference.as_str();
    for (index, number) in exempted.iter().enumerate() {
        let marker = format!("\"\\u0001idem-exact-{index}\\u0001\"");
        let (before, after) = segments
            .split_once(&marker)
            .ok_or(format!("{marker} not in {reference}"))?;
        rest = rest
            .strip_prefix(before)
            .ok_or(format!("{rest:?} does not go on with {before:?}"))?;
        let token_len = rest
            .find(|c: char| !matches!(c, '0'..='9' | '-' | '+' | '.' | 'e' | 'E'))
            .unwrap_or(rest.len());
        let (token, after_token) = rest.split_at(token_len);
        let same = if number.is_f64() {
            token.parse::<f64>().ok() == number.as_f64()
        } else {
            token == number.to_string()
        };
        if !same {
            return Err(format!("{number} written as {token:?}"));
        }
        (rest, segments) = (after_token, after);
    }
    if rest == segments {
        Ok(())
    } else {
        Err(format!("{rest:?} instead of {segments:?}"))
    }
}

/// The one intended difference from RFC 8785: integers a double cannot
/// tell apart keep their digits (two account numbers, two fingerprints),
/// where the reference crate, as the RFC says, writes the nearest double.
#[test]
fn integers_beyond_doubles_keep_their_digits() {
    let idem = |text: &str| String::from_utf8(canonicalize(text.as_bytes()).unwrap()).unwrap();
    let reference = |text: &str| {
        let value: Value = serde_json::from_str(text).unwrap();
        String::from_utf8(serde_json_canonicalizer::to_vec(&value).unwrap()).unwrap()
    };
    for (text, exact, rounded) in [
        (
            "[9007199254740993]",
            "[9007199254740993]",
            "[9007199254740992]",
        ),
        (
            "[-9007199254740993]",
            "[-9007199254740993]",
            "[-9007199254740992]",
        ),
        (
            "{\"to\": 18446744073709551615}",
            "{\"to\":18446744073709551615}",
            "{\"to\":18446744073709552000}",
        ),
    ] {
        assert_eq!(idem(text), exact, "{text}");
        assert_eq!(reference(text), rounded, "{text}");
        let value = serde_json::from_str(text).unwrap();
        assert_eq!(matches_reference(exact.as_bytes(), &value), Ok(()));
        assert!(matches_reference(rounded.as_bytes(), &value).is_err());
    }
    // Up to 2^53 every integer is a double of its own: the two agree.
    for text in [
        "[9007199254740992]",
        "[-9007199254740992]",
        "[9007199254740991]",
    ] {
        assert_eq!(idem(text), reference(text), "{text}");
    }
}

// ---------------------------------------------------------------- keys

/// The key language of the design, written independently of the parser:
/// after trimming ASCII whitespace, either an RFC 9651 sf-string
/// (`"`, then printable ASCII with `\"` and `\\` as the only escapes, then
/// `"` ending the value) or the bytes as they are; the resulting key must
/// be 1 to 255 visible ASCII characters (`!` to `~`).
fn key_model(raw: &[u8]) -> Option<String> {
    let trimmed: &[u8] = {
        let start = raw.iter().position(|b| !b.is_ascii_whitespace());
        let end = raw.iter().rposition(|b| !b.is_ascii_whitespace());
        match (start, end) {
            (Some(s), Some(e)) => &raw[s..=e],
            _ => &[],
        }
    };
    let key: Vec<u8> = if trimmed.first() == Some(&b'"') {
        // The closing quote is the first unescaped quote after the opening
        // one, and it must be the last byte.
        let inner = trimmed.get(1..trimmed.len().checked_sub(1)?)?;
        if trimmed.len() < 2 || trimmed.last() != Some(&b'"') {
            return None;
        }
        let mut out = Vec::new();
        let mut escaped = false;
        for &b in inner {
            if escaped {
                if b != b'"' && b != b'\\' {
                    return None;
                }
                out.push(b);
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' || !(0x20..=0x7e).contains(&b) {
                return None;
            } else {
                out.push(b);
            }
        }
        if escaped {
            return None;
        }
        out
    } else if trimmed.contains(&b',') {
        // A bare key with a comma is two headers a proxy folded into one.
        return None;
    } else {
        trimmed.to_vec()
    };
    let valid =
        (1..=MAX_KEY_LEN).contains(&key.len()) && key.iter().all(|b| (0x21..=0x7e).contains(b));
    valid.then(|| String::from_utf8(key).unwrap())
}

/// Bytes that exercise every branch of the grammar.
fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
    let interesting = prop_oneof![
        4 => 0x21u8..=0x7e,
        1 => Just(b'"'),
        1 => Just(b'\\'),
        1 => Just(b','),
        1 => Just(b' '),
        1 => Just(b'\t'),
        1 => Just(0u8),
        1 => Just(0x7f),
        1 => 0x80u8..=0xff,
    ];
    prop_oneof![
        prop::collection::vec(interesting.clone(), 0..12),
        prop::collection::vec(interesting, 250..262),
        prop::collection::vec(any::<u8>(), 0..300),
    ]
}

/// Any valid key: 1 to 255 visible ASCII characters.
fn valid_key() -> impl Strategy<Value = String> {
    prop_oneof![
        "[!-~]{1,16}",
        "[!-~]{250,255}",
        prop::collection::vec(
            prop::sample::select(vec![b'"', b'\\', b'a', b'-', b':']),
            1..8
        )
        .prop_map(|b| String::from_utf8(b).unwrap()),
    ]
}

fn quote(key: &str) -> String {
    let mut out = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn key_parser_accepts_exactly_the_documented_language(raw in key_bytes()) {
        let parsed = IdempotencyKey::parse(&raw);
        prop_assert_eq!(parsed.clone().ok(), key_model(&raw), "{:?} -> {:?}", String::from_utf8_lossy(&raw), parsed);
        if let Ok(key) = parsed {
            // What is accepted is a valid key in both spellings.
            prop_assert_eq!(IdempotencyKey::parse(quote(&key).as_bytes()), Ok(key.clone()));
            if !key.starts_with('"') && !key.contains(',') {
                prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()), Ok(key));
            }
        }
    }

    #[test]
    fn every_valid_key_parses_in_both_spellings(key in valid_key(), pad in "[ \t]{0,3}") {
        // Bare, unless it would read as two (a comma) or as quoted.
        if !key.starts_with('"') && !key.contains(',') {
            prop_assert_eq!(IdempotencyKey::parse(format!("{pad}{key}{pad}").as_bytes()), Ok(key.clone()));
        }
        prop_assert_eq!(IdempotencyKey::parse(format!("{pad}{}{pad}", quote(&key)).as_bytes()), Ok(key));
    }

    #[test]
    fn keys_over_255_characters_are_too_long(key in "[!-~]{256,300}") {
        prop_assume!(!key.starts_with('"'));
        if !key.contains(',') {
            prop_assert_eq!(IdempotencyKey::parse(key.as_bytes()), Err(KeyError::TooLong));
        }
        prop_assert_eq!(IdempotencyKey::parse(quote(&key).as_bytes()), Err(KeyError::TooLong));
    }

    #[test]
    fn redaction_never_shows_its_input(parts in prop::collection::vec("[a-z0-9:/]{4,20}", 1..3)) {
        let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
        let tag = redact(&parts);
        prop_assert_eq!(tag.len(), 16);
        prop_assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()));
        for part in parts {
            prop_assert!(!tag.contains(part));
        }
    }
}
