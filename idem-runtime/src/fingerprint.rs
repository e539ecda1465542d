//! What makes two attempts "the same request": the [`Fingerprint`].

use http::{HeaderMap, Method, header::CONTENT_TYPE};
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

/// SHA-256 over the method, path, query and body of a request.
///
/// A JSON body (`application/json` or any `+json` type) is hashed in its
/// RFC 8785 canonical form, so key order and whitespace do not matter; any
/// other body is hashed byte for byte. Each part is length-prefixed, so
/// moving bytes between the path and the query yields another fingerprint.
///
/// JSON numbers are compared as RFC 8785 compares them, as IEEE-754 doubles:
/// `1.0` and `1` are the same value. Integers beyond 2^53, which doubles
/// cannot all tell apart, are compared by their digits instead (up to 16
/// levels deep for those beyond 64 bits; deeper, such a body is hashed
/// byte for byte), so two account numbers or `u128` amounts never share a
/// fingerprint.
///
/// ```
/// # use idem_runtime as idem;
/// use http::{HeaderMap, Method, header::CONTENT_TYPE};
/// use idem::Fingerprint;
///
/// let mut json = HeaderMap::new();
/// json.insert(CONTENT_TYPE, "application/json".parse().unwrap());
/// let a = Fingerprint::of(&Method::POST, "/v1/charges", None, &json, br#"{"a":1,"b":2}"#);
/// let b = Fingerprint::of(&Method::POST, "/v1/charges", None, &json, b"{ \"b\": 2, \"a\": 1 }");
/// assert_eq!(a, b);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of one request.
    pub fn of(
        method: &Method,
        path: &str,
        query: Option<&str>,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"idem-fingerprint-v1");
        frame(&mut hasher, method.as_str().as_bytes());
        frame(&mut hasher, path.as_bytes());
        match query {
            Some(query) => {
                hasher.update([1]);
                frame(&mut hasher, query.as_bytes());
            }
            None => hasher.update([0]),
        }
        match canonical_json(headers, body) {
            Some(canonical) => {
                hasher.update(b"json");
                frame(&mut hasher, &canonical);
            }
            None => {
                hasher.update(b"raw");
                frame(&mut hasher, body);
            }
        }
        Self(hasher.finalize().into())
    }

    /// The 32 bytes of the digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a fingerprint read back from the store.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

fn frame(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// The RFC 8785 form of a JSON body, or `None` when the body is not JSON
/// (by content type) or does not parse: such bodies are hashed verbatim.
pub fn canonical_json(headers: &HeaderMap, body: &[u8]) -> Option<Vec<u8>> {
    if !is_json(headers) {
        return None;
    }
    canonicalize(body)
}

/// RFC 8785 canonical form of any JSON text, `None` if it does not parse.
///
/// Written straight from the parsed value into one buffer: members in the
/// order of their names' UTF-16 code units, strings escaped as JSON
/// requires and no further, numbers as ECMAScript prints the double. The
/// bytes are those of the `serde_json_canonicalizer` crate (a property test
/// holds them equal), which buffers every member and parses every name
/// again to sort them: about 10k more instructions for a small body, and
/// 4.1 against 3.3 ms for 256 KiB (most of what is left is the parse).
///
/// An integer beyond 64 bits, which serde_json reads as a double (losing
/// digits), sends the body down a slower path that keeps its digits (see
/// `write_number`).
pub fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    match write_canonical(&value, &mut out) {
        Ok(()) => Some(out),
        Err(Unwritten::Inexact) => {
            out.clear();
            let raw: &RawValue = serde_json::from_slice(body).ok()?;
            write_exact(raw, &mut out, 0)?;
            Some(out)
        }
        Err(Unwritten::NotJson) => None,
    }
}

/// Why [`write_canonical`] stopped.
enum Unwritten {
    /// A number JSON cannot hold (only reachable with serde_json's
    /// `arbitrary_precision`): the body is hashed verbatim.
    NotJson,
    /// A double at least 2^63 in magnitude, which may have been an integer
    /// too long for serde_json to keep: [`write_exact`] reads it again.
    Inexact,
}

/// The largest magnitude up to which every integer is exact as a double.
const EXACT_INTEGERS: u64 = 1 << 53;

/// From this magnitude on, serde_json holds an integer as a double.
const BEYOND_64_BITS: f64 = 9_223_372_036_854_775_808.0; // 2^63

/// How deep [`write_exact`] reads: each level parses its value's text
/// again, so the work grows with depth. Deeper bodies with an integer
/// beyond 64 bits are hashed verbatim instead (safe: another spelling of
/// them is another request, answered 422, never a wrong replay).
const EXACT_DEPTH: usize = 16;

/// Appends a number as RFC 8785 writes it (the shortest form that reads
/// back as the same double), except an integer beyond 2^53 that serde_json
/// holds exactly: its own digits. As doubles, 9007199254740993 and
/// 9007199254740992 are one number, but a handler reading a `u64` sees two
/// (an account number, say), so they must not share a fingerprint. Where
/// the double is exact, its shortest form is these same digits.
///
/// Integers beyond 64 bits (a `u128` amount in wei, say) keep their digits
/// too, but serde_json holds them as doubles: a double of 2^63 or more
/// stops the writer ([`Unwritten::Inexact`]), and the body is written again
/// by [`write_exact`], from its text.
fn write_number(number: &serde_json::Number, out: &mut Vec<u8>) -> Result<(), Unwritten> {
    if let Some(int) = number.as_u64().filter(|&int| int > EXACT_INTEGERS) {
        out.extend_from_slice(int.to_string().as_bytes());
    } else if let Some(int) = number
        .as_i64()
        .filter(|&int| int.unsigned_abs() > EXACT_INTEGERS)
    {
        out.extend_from_slice(int.to_string().as_bytes());
    } else {
        let double = number
            .as_f64()
            .filter(|double| double.is_finite())
            .ok_or(Unwritten::NotJson)?;
        if double.abs() >= BEYOND_64_BITS {
            return Err(Unwritten::Inexact);
        }
        write_double(double, out);
    }
    Ok(())
}

/// Beyond this magnitude RFC 8785 writes a double with an exponent.
const EXPONENT_FORM: f64 = 1e21;

/// Appends a finite double as RFC 8785 writes it, except one beyond 2^53
/// (and below 10^21, where RFC 8785 still writes digits): its exact
/// integer digits. Every double there is an integer, and RFC 8785's
/// shortest form pads it with zeros into what can be another integer's
/// digits: `1152921504606846976.0` (2^60) would be written
/// `1152921504606847000`, which [`write_number`] writes for the integer
/// 1152921504606847000, whose own digits it keeps. With the exact digits,
/// two spellings of one number share a form, and two numbers never do.
fn write_double(double: f64, out: &mut Vec<u8>) {
    let magnitude = double.abs();
    if magnitude > EXACT_INTEGERS as f64 && magnitude < EXPONENT_FORM {
        if double < 0.0 {
            out.push(b'-');
        }
        // Exact: an integral double below 10^21 (< 2^70) fits a u128.
        out.extend_from_slice((magnitude as u128).to_string().as_bytes());
    } else {
        out.extend_from_slice(ryu_js::Buffer::new().format_finite(double).as_bytes());
    }
}

/// Appends `value` in canonical form.
fn write_canonical(value: &Value, out: &mut Vec<u8>) -> Result<(), Unwritten> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(number) => write_number(number, out)?,
        Value::String(string) => write_string(string, out),
        Value::Array(items) => {
            out.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            // serde_json's map iterates in UTF-8 order (or, with its
            // `preserve_order` feature, as written); UTF-16 order differs
            // only for names beyond U+E000, so sorting is rarely needed.
            if members
                .keys()
                .is_sorted_by(|a, b| utf16_order(a, b).is_le())
            {
                write_members(members.iter(), out)?;
            } else {
                let mut sorted: Vec<_> = members.iter().collect();
                sorted.sort_unstable_by(|(a, _), (b, _)| utf16_order(a, b));
                write_members(sorted.into_iter(), out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

fn write_members<'v>(
    members: impl Iterator<Item = (&'v String, &'v Value)>,
    out: &mut Vec<u8>,
) -> Result<(), Unwritten> {
    for (index, (name, value)) in members.enumerate() {
        if index > 0 {
            out.push(b',');
        }
        write_string(name, out);
        out.push(b':');
        write_canonical(value, out)?;
    }
    Ok(())
}

/// [`write_canonical`] from the text of a value, for a body with a number
/// serde_json cannot hold exactly: containers are parsed a level at a
/// time, down to each number's own text. The bytes are those
/// `write_canonical` writes wherever it is exact; an integer beyond 64
/// bits is written as its own digits. `None` past [`EXACT_DEPTH`].
fn write_exact(raw: &RawValue, out: &mut Vec<u8>, depth: usize) -> Option<()> {
    fn parse<'a, T: serde::Deserialize<'a>>(text: &'a str) -> Option<T> {
        serde_json::from_str(text).ok()
    }
    let text = raw.get();
    match text.as_bytes().first()? {
        b'{' if depth < EXACT_DEPTH => {
            // serde_json's own map keeps the last of duplicate names, as
            // `Value` does.
            let members: std::collections::BTreeMap<String, &RawValue> = parse(text)?;
            let mut sorted: Vec<_> = members.into_iter().collect();
            sorted.sort_unstable_by(|(a, _), (b, _)| utf16_order(a, b));
            out.push(b'{');
            for (index, (name, value)) in sorted.into_iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_string(&name, out);
                out.push(b':');
                write_exact(value, out, depth + 1)?;
            }
            out.push(b'}');
        }
        b'[' if depth < EXACT_DEPTH => {
            let items: Vec<&RawValue> = parse(text)?;
            out.push(b'[');
            for (index, item) in items.into_iter().enumerate() {
                if index > 0 {
                    out.push(b',');
                }
                write_exact(item, out, depth + 1)?;
            }
            out.push(b']');
        }
        b'{' | b'[' => return None,
        b'"' => write_string(&parse::<String>(text)?, out),
        b'-' | b'0'..=b'9' => {
            let number: serde_json::Number = parse(text)?;
            match write_number(&number, out) {
                Ok(()) => {}
                // JSON's integers have neither a leading zero nor a `+`:
                // their text is their canonical form.
                Err(Unwritten::Inexact) if text.bytes().skip(1).all(|b| b.is_ascii_digit()) => {
                    out.extend_from_slice(text.as_bytes());
                }
                Err(Unwritten::Inexact) => write_double(number.as_f64()?, out),
                Err(Unwritten::NotJson) => return None,
            }
        }
        // `null`, `true`, `false`: their text is their canonical form.
        _ => out.extend_from_slice(text.as_bytes()),
    }
    Some(())
}

fn utf16_order(a: &str, b: &str) -> std::cmp::Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// A JSON string as RFC 8785 writes it: `"` and `\` escaped, control
/// characters as their short escapes or `\u00xx`, everything else (`/`,
/// DEL, any non-ASCII) as it is.
fn write_string(string: &str, out: &mut Vec<u8>) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = string.as_bytes();
    let mut plain = 0;
    for (at, &byte) in bytes.iter().enumerate() {
        let short: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                DIGITS[usize::from(byte >> 4)],
                DIGITS[usize::from(byte & 0xf)],
            ],
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain..at]);
        out.extend_from_slice(short);
        plain = at + 1;
    }
    out.extend_from_slice(&bytes[plain..]);
    out.push(b'"');
}

fn is_json(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        headers
    }

    fn post(path: &str, query: Option<&str>, headers: &HeaderMap, body: &[u8]) -> Fingerprint {
        Fingerprint::of(&Method::POST, path, query, headers, body)
    }

    #[test]
    fn json_spellings_are_one_fingerprint() {
        let a = post(
            "/c",
            None,
            &json(),
            br#"{"amount":100,"currency":"eur","meta":{"x":[1,2]}}"#,
        );
        let b = post(
            "/c",
            None,
            &json(),
            b"{\n \"meta\" : {\"x\": [1, 2]},\n \"currency\":\"eur\", \"amount\": 100}\n",
        );
        assert_eq!(a, b);
        let problem = HeaderMap::from_iter([(
            CONTENT_TYPE,
            "application/merge-patch+json".parse().unwrap(),
        )]);
        assert_eq!(
            post("/c", None, &problem, br#"{"a":1, "b":2}"#),
            post("/c", None, &problem, br#"{"b":2,"a":1}"#)
        );
    }

    /// RFC 8785's own examples: members in UTF-16 order (U+1F600 before
    /// U+FB33, although its UTF-8 sorts after), numbers as ECMAScript
    /// prints them, only the escapes JSON requires.
    #[test]
    fn canonical_form_follows_rfc_8785() {
        let sorted = canonicalize(
            "{\"\u{20ac}\":\"Euro Sign\",\"\\r\":\"Carriage Return\",\"\u{fb33}\":\"Hebrew\",\
             \"1\":\"One\",\"\u{1f600}\":\"Emoji\",\"\u{80}\":\"Control\",\"\u{f6}\":\"Latin\"}"
                .as_bytes(),
        )
        .unwrap();
        let names: Vec<String> = String::from_utf8(sorted)
            .unwrap()
            .split(['{', ',', '}'])
            .filter(|member| !member.is_empty())
            .map(|member| member.split(':').nth(1).unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                "\"Carriage Return\"",
                "\"One\"",
                "\"Control\"",
                "\"Latin\"",
                "\"Euro Sign\"",
                "\"Emoji\"",
                "\"Hebrew\""
            ]
        );
        // Needs serde_json's `float_roundtrip`: its default parser can miss
        // the nearest double by one, giving one number two fingerprints.
        let numbers = canonicalize(b"[333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001, -0, 1e21, 1e20]");
        assert_eq!(
            String::from_utf8(numbers.unwrap()).unwrap(),
            "[333333333.3333333,1e+30,4.5,0.002,1e-27,0,1e+21,100000000000000000000]"
        );
        let strings = canonicalize(
            b"[\"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\", \"\\u007f\\u2028\"]",
        );
        assert_eq!(
            String::from_utf8(strings.unwrap()).unwrap(),
            "[\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\",\"\u{7f}\u{2028}\"]"
        );
    }

    #[test]
    fn every_part_counts() {
        let base = post("/c", Some("x=1"), &json(), br#"{"a":1}"#);
        assert_ne!(
            base,
            Fingerprint::of(&Method::PUT, "/c", Some("x=1"), &json(), br#"{"a":1}"#)
        );
        assert_ne!(base, post("/d", Some("x=1"), &json(), br#"{"a":1}"#));
        assert_ne!(base, post("/c", Some("x=2"), &json(), br#"{"a":1}"#));
        assert_ne!(base, post("/c", None, &json(), br#"{"a":1}"#));
        assert_ne!(base, post("/c", Some(""), &json(), br#"{"a":1}"#));
        assert_ne!(base, post("/c", Some("x=1"), &json(), br#"{"a":2}"#));
        assert_ne!(
            post("/ab", Some("c"), &json(), b"{}"),
            post("/a", Some("bc"), &json(), b"{}")
        );
    }

    /// Integers a double cannot tell apart are still two bodies; exact
    /// ones keep the canonical form.
    #[test]
    fn large_integers_keep_their_digits() {
        assert_ne!(
            post("/c", None, &json(), br#"{"to":9007199254740993}"#),
            post("/c", None, &json(), br#"{"to":9007199254740992}"#)
        );
        assert_ne!(
            post("/c", None, &json(), br#"{"to":-9007199254740993}"#),
            post("/c", None, &json(), br#"{"to":-9007199254740992}"#)
        );
        let canonical = |body: &[u8]| String::from_utf8(canonicalize(body).unwrap()).unwrap();
        assert_eq!(
            canonical(b"[18446744073709551615]"),
            "[18446744073709551615]"
        );
        assert_eq!(canonical(b"[1152921504606846976]"), "[1152921504606846976]");
        assert_eq!(
            canonical(b"[9007199254740992, 1e3]"),
            "[9007199254740992,1000]"
        );
        // A double beyond 2^53 is an integer: written as its own digits,
        // never as a zero-padded shortest form that spells another
        // integer. 2^60 as a double is 2^60 as an integer; the integer
        // 1152921504606847000, which it would have been padded into, stays
        // itself. (Both sides of 2^63, the slow path's too.)
        assert_eq!(
            canonical(b"[1152921504606846976.0, 1.152921504606847e18, -1152921504606846976.0]"),
            "[1152921504606846976,1152921504606846976,-1152921504606846976]"
        );
        assert_ne!(
            post("/c", None, &json(), br#"[1152921504606847000]"#),
            post("/c", None, &json(), br#"[1152921504606846976.0]"#)
        );
        assert_eq!(
            post("/c", None, &json(), br#"[1152921504606846976]"#),
            post("/c", None, &json(), br#"[1152921504606846976.0]"#)
        );
        assert_ne!(
            post("/c", None, &json(), br#"[18446744073709552000]"#),
            post("/c", None, &json(), br#"[18446744073709551616.0]"#)
        );
        assert_eq!(
            canonical(b"[18446744073709551616.0, 1e21]"),
            "[18446744073709551616,1e+21]"
        );
    }

    /// Beyond 64 bits serde_json holds an integer as a double, so such a
    /// body is written again from its text: `u128` amounts that differ in
    /// their last digit are two requests, and the rest of the body is
    /// canonical as ever.
    #[test]
    fn integers_beyond_64_bits_keep_their_digits() {
        assert_ne!(
            post("/c", None, &json(), br#"{"wei":20000000000000000001}"#),
            post("/c", None, &json(), br#"{"wei":20000000000000000002}"#)
        );
        assert_ne!(
            post("/c", None, &json(), br#"[-9223372036854775809]"#),
            post("/c", None, &json(), br#"[-9223372036854775810]"#)
        );
        assert_eq!(
            post(
                "/c",
                None,
                &json(),
                br#"{"b":[1, 20000000000000000001],"a":"x"}"#
            ),
            post(
                "/c",
                None,
                &json(),
                b"{ \"a\": \"x\",\n \"b\": [1,20000000000000000001] }"
            )
        );
        let canonical = |body: &[u8]| String::from_utf8(canonicalize(body).unwrap()).unwrap();
        // The slow path writes what the fast one writes, wherever that
        // is exact: names in UTF-16 order, escapes, doubles, literals.
        let rest = r#""\u00e9\n", 1.5, -0.0, 1e3, true, null, 9007199254740993, {"\ud800\udc00": 1, "\uffff": 2}"#;
        let fast = canonical(format!("[{rest}]").as_bytes());
        let slow =
            canonical(format!("[{rest}, 340282366920938463463374607431768211455]").as_bytes());
        assert_eq!(
            slow,
            format!(
                "{},340282366920938463463374607431768211455]",
                &fast[..fast.len() - 1]
            )
        );
        // A double that large is a double, however it is spelt.
        assert_eq!(
            canonical(b"[1e20, 1.5e300]"),
            "[100000000000000000000,1.5e+300]"
        );
        assert_eq!(
            canonical(b"[100000000000000000000]"),
            "[100000000000000000000]"
        );
        // Too deep to read again level by level: hashed verbatim.
        let deep = format!("{}20000000000000000001{}", "[".repeat(20), "]".repeat(20));
        assert_eq!(canonicalize(deep.as_bytes()), None);
        let shallow = format!("{}20000000000000000001{}", "[".repeat(16), "]".repeat(16));
        assert_eq!(canonical(shallow.as_bytes()), shallow);
    }

    #[test]
    fn non_json_bodies_are_hashed_verbatim() {
        let text = HeaderMap::from_iter([(CONTENT_TYPE, "text/plain".parse().unwrap())]);
        assert_ne!(
            post("/c", None, &text, br#"{"a":1,"b":2}"#),
            post("/c", None, &text, br#"{"b":2,"a":1}"#)
        );
        // Broken JSON cannot be canonicalised; it is still fingerprinted.
        assert_ne!(
            post("/c", None, &json(), b"{"),
            post("/c", None, &json(), b"{ ")
        );
    }
}
