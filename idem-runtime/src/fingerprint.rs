//! What makes two attempts "the same request": the [`Fingerprint`].

use http::{HeaderMap, Method, header::CONTENT_TYPE};
use sha2::{Digest, Sha256};

use crate::canonical::{Canonical, Exclusions, Numbers, Sink};

/// What makes two attempts "the same request": the SHA-256 of its method,
/// path, query and body.
///
/// `#[idempotent]` stores the fingerprint of the first request with its
/// key and compares each retry's with it: a retry whose fingerprint
/// differs is another request under the same key, refused with 422 and
/// never run. The path is the one the client sent (axum's `OriginalUri`,
/// so a nested router's prefix counts).
///
/// A JSON body (a content type axum's `Json` takes: `application/json`,
/// `application/*+json`, `application/json+*`) is hashed in its
/// RFC 8785 canonical form ([`canonical`](crate::canonical)), so key order
/// and whitespace do not matter; any other body is hashed byte for byte.
/// Each part is length-prefixed, so moving bytes between the path and the
/// query yields another fingerprint.
///
/// JSON numbers are compared as RFC 8785 compares them, as IEEE-754 doubles:
/// `1.0` and `1` are the same value. Integers beyond 2^53, which doubles
/// cannot all tell apart, are compared by their digits instead, so two
/// account numbers or `u128` amounts never share a fingerprint. A body
/// naming one member twice is hashed byte for byte (see
/// [`canonicalize`](crate::canonical::canonicalize)).
///
/// A handler's `#[idempotent(fingerprint(exclude = ["/client_ts"]))]`
/// leaves members of a JSON body out ([`of_excluding`](Self::of_excluding)).
///
/// The value is stable across releases: keys stored before an upgrade keep
/// matching their retries after it (the project's golden tests pin it).
/// It shows as 64 lowercase hex digits ([`Display`](std::fmt::Display)),
/// and is stored as its 32 bytes ([`as_bytes`](Self::as_bytes),
/// [`from_bytes`](Self::from_bytes)).
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
/// assert_ne!(a, Fingerprint::of(&Method::PUT, "/v1/charges", None, &json, br#"{"a":1,"b":2}"#));
/// assert_eq!(a.to_string().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of one request: `path` without its query, `query`
    /// without its `?` (`None` when the URI has none; `Some("")` for a bare
    /// `?` is another request).
    pub fn of(
        method: &Method,
        path: &str,
        query: Option<&str>,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Self {
        Self::of_excluding(method, path, query, headers, body, &[])
    }

    /// The fingerprint of one request to a handler whose fingerprint
    /// leaves out the members of a JSON body that `exclude`'s RFC 6901
    /// JSON Pointers name (`/client_ts`, `/trace/id`, `/items/0/ts`).
    ///
    /// The rest of the body is hashed in its canonical form as ever: a
    /// body holding none of those members has the fingerprint
    /// [`of`](Self::of) gives it. The excluded members are read and
    /// checked, never hashed; an element an index names is left out of
    /// its array, so the elements after it move up one. A body that is
    /// not JSON (by its content type, or as it reads) is hashed byte for
    /// byte, whole. `#[idempotent]` checks its pointers at compile time;
    /// here one that does not start with `/` is ignored.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use http::{HeaderMap, Method, header::CONTENT_TYPE};
    /// use idem::Fingerprint;
    ///
    /// let mut json = HeaderMap::new();
    /// json.insert(CONTENT_TYPE, "application/json".parse().unwrap());
    /// let exclude = ["/sent_at"];
    /// let of = |body: &str| {
    ///     let body = body.as_bytes();
    ///     Fingerprint::of_excluding(&Method::POST, "/v1/charges", None, &json, body, &exclude)
    /// };
    /// let first = of(r#"{"amount":1,"sent_at":"09:00"}"#);
    /// assert_eq!(first, of(r#"{"amount":1,"sent_at":"09:01"}"#));
    /// assert_ne!(first, of(r#"{"amount":2,"sent_at":"09:00"}"#));
    /// ```
    pub fn of_excluding(
        method: &Method,
        path: &str,
        query: Option<&str>,
        headers: &HeaderMap,
        body: &[u8],
        exclude: &[&str],
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
        let json = is_json(headers);
        let exclusions = match exclude {
            [_, ..] if json => Exclusions::new(exclude),
            _ => Exclusions::default(),
        };
        let canonical = json
            .then(|| Canonical::read_excluding(body, Numbers::of_this_build(), &exclusions))
            .flatten();
        if let Some(canonical) = canonical {
            // The form is hashed as it is written, never built whole.
            let mut json = hasher.clone();
            json.update(b"json");
            json.update((canonical.len() as u64).to_be_bytes());
            let mut sink = Hashing::new(&mut json);
            let written = canonical.write(&mut sink);
            sink.finish();
            debug_assert!(written.is_some(), "the second pass read as the first");
            if written.is_some() {
                return Self(json.finalize().into());
            }
        }
        hasher.update(b"raw");
        frame(&mut hasher, body);
        Self(hasher.finalize().into())
    }

    /// The 32 bytes of the digest, as the stores keep them.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a fingerprint from its 32 bytes (read back from a store);
    /// `None` for any other length.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::Fingerprint;
    ///
    /// let stored = Fingerprint::from_bytes(&[0xab; 32]).unwrap();
    /// assert_eq!(stored.as_bytes(), &[0xab; 32]);
    /// assert_eq!(stored.to_string(), "ab".repeat(32));
    /// assert_eq!(Fingerprint::from_bytes(&[0xab; 31]), None);
    /// ```
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

/// The first 8 bytes, in hex: enough to tell fingerprints apart in a log.
impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

/// The 32 bytes as 64 lowercase hex digits.
impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

fn frame(hasher: &mut Sha256, part: &[u8]) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part);
}

/// Feeds SHA-256 what it is given in blocks of [`BLOCK`] bytes: most
/// pieces of a canonical form are a few bytes long.
struct Hashing<'h> {
    hasher: &'h mut Sha256,
    buffer: [u8; BLOCK],
    len: usize,
}

/// Eight of SHA-256's blocks: enough to spare the hasher a call per piece,
/// small enough that zeroing the buffer is no part of a request's cost.
const BLOCK: usize = 512;

impl<'h> Hashing<'h> {
    fn new(hasher: &'h mut Sha256) -> Self {
        Self {
            hasher,
            buffer: [0; BLOCK],
            len: 0,
        }
    }

    fn finish(&mut self) {
        self.hasher.update(&self.buffer[..self.len]);
        self.len = 0;
    }
}

impl Sink for Hashing<'_> {
    fn put(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > BLOCK {
            self.finish();
            if bytes.len() >= BLOCK {
                self.hasher.update(bytes);
                return;
            }
        }
        self.buffer[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    fn byte(&mut self, byte: u8) {
        if self.len == BLOCK {
            self.finish();
        }
        self.buffer[self.len] = byte;
        self.len += 1;
    }
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
    // What axum's `Json` takes as JSON: `application/json`, or an
    // `application/` type whose subtype or suffix is `json`
    // (`application/merge-patch+json`, `application/json+x`).
    let Some(subtype) = essence.strip_prefix("application/") else {
        return false;
    };
    match subtype.split_once('+') {
        None => subtype == "json",
        Some((name, suffix)) => name == "json" || (!name.is_empty() && suffix == "json"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::canonicalize;

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

    /// Beyond 64 bits too: `u128` amounts that differ in their last digit
    /// are two requests, and the rest of the body is canonical as ever.
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
        // A body with such an integer is canonical like any other: names
        // in UTF-16 order, escapes, doubles, literals.
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
        // At any depth serde_json reads (the written form reads no number
        // back).
        let deep = format!("{}20000000000000000001{}", "[".repeat(127), "]".repeat(127));
        assert_eq!(canonical(deep.as_bytes()), deep);
    }

    fn excluding(exclude: &[&str], body: &str) -> Fingerprint {
        Fingerprint::of_excluding(&Method::POST, "/c", None, &json(), body.as_bytes(), exclude)
    }

    #[test]
    fn excluded_members_do_not_count() {
        let exclude = ["/client_ts", "/trace/id"];
        let base = excluding(
            &exclude,
            r#"{"amount":1,"client_ts":"09:00","trace":{"id":"a","hop":1}}"#,
        );
        // The excluded members changed, or gone, or reordered.
        for same in [
            r#"{"amount":1,"client_ts":"09:01","trace":{"id":"b","hop":1}}"#,
            r#"{"trace":{"hop":1,"id":{"x":[1]}},"amount":1.0,"client_ts":null}"#,
            r#"{"amount":1,"trace":{"hop":1}}"#,
        ] {
            assert_eq!(base, excluding(&exclude, same), "{same}");
        }
        // Any other member changed, or the parent of an excluded one.
        for other in [
            r#"{"amount":2,"client_ts":"09:00","trace":{"id":"a","hop":1}}"#,
            r#"{"amount":1,"client_ts":"09:00","trace":{"id":"a","hop":2}}"#,
            r#"{"amount":1,"client_ts":"09:00","trace":{"id":"a"}}"#,
            r#"{"amount":1,"client_ts":"09:00","trace":null}"#,
            r#"{"amount":1,"client_ts":"09:00","trace":{"id":"a","hop":1},"x":0}"#,
        ] {
            assert_ne!(base, excluding(&exclude, other), "{other}");
        }
        // What is left is hashed as a body without the members would be.
        assert_eq!(
            base,
            post("/c", None, &json(), br#"{"amount":1,"trace":{"hop":1}}"#)
        );
        assert_eq!(
            excluding(&exclude, r#"{"b":[1,{"z":1,"a":2}],"a":"x"}"#),
            post("/c", None, &json(), br#"{"a":"x","b":[1,{"a":2,"z":1}]}"#)
        );
        // The excluded member first, last, alone: no stray comma.
        for (body, rest) in [
            (r#"{"client_ts":1,"a":1,"b":2}"#, r#"{"a":1,"b":2}"#),
            (r#"{"a":1,"b":2,"client_ts":1}"#, r#"{"a":1,"b":2}"#),
            (r#"{"client_ts":1}"#, "{}"),
            (r#"{"b":2,"client_ts":1,"a":1}"#, r#"{"a":1,"b":2}"#),
        ] {
            assert_eq!(canonicalized(&exclude, body), rest, "{body}");
        }
    }

    fn canonicalized(exclude: &[&str], body: &str) -> String {
        let exclusions = crate::canonical::Exclusions::new(exclude);
        let form = crate::canonical::canonicalize_excluding(
            body.as_bytes(),
            Numbers::of_this_build(),
            &exclusions,
        );
        String::from_utf8(form.expect("canonical")).unwrap()
    }

    /// The canonical form is hashed in pieces through [`Hashing`]'s
    /// buffer: the digest is the form's written whole, at every size
    /// around the buffer's, with pieces shorter than it (many members) and
    /// as long as or longer than it (one long string).
    #[test]
    fn the_buffered_digest_is_the_whole_forms() {
        for len in [
            0,
            1,
            BLOCK - 9,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            2 * BLOCK + 7,
            9 * BLOCK,
        ] {
            let one_long = format!(r#"{{"a":"{}"}}"#, "x".repeat(len));
            let many = format!("[{}]", vec!["7"; len.max(1)].join(","));
            for body in [one_long, many] {
                let form = canonicalized(&[], &body);
                let mut whole = Sha256::new();
                whole.update(b"idem-fingerprint-v1");
                frame(&mut whole, b"POST");
                frame(&mut whole, b"/p");
                whole.update([0]);
                whole.update(b"json");
                frame(&mut whole, form.as_bytes());
                assert_eq!(
                    post("/p", None, &json(), body.as_bytes()),
                    Fingerprint(whole.finalize().into()),
                    "{len}"
                );
            }
        }
    }

    #[test]
    fn pointers_are_rfc_6901() {
        // `~1` is `/`, `~0` is `~`, and a name is matched however the body
        // escapes it.
        let exclude = ["/a~1b", "/m~0n", "/ê"];
        assert_eq!(
            canonicalized(&exclude, r#"{"a/b":1,"m~n":2,"\u00ea":3,"a":4,"m~0n":5}"#),
            r#"{"a":4,"m~0n":5}"#
        );
        assert_eq!(
            canonicalized(&["/a\"b"], r#"{"a\"b":1,"c":2}"#),
            r#"{"c":2}"#
        );
        // Deeper, through arrays: an index names an element, or a member
        // named by its digits.
        let exclude = ["/items/0/ts", "/items/2", "/by/0"];
        assert_eq!(
            canonicalized(
                &exclude,
                r#"{"items":[{"ts":1,"n":1},{"ts":2,"n":2},3,4],"by":{"0":1,"1":2}}"#
            ),
            r#"{"by":{"1":2},"items":[{"n":1},{"n":2,"ts":2},4]}"#
        );
        // Not an index: leading zeros, `-`.
        assert_eq!(canonicalized(&["/01", "/-"], r#"[1,2]"#), "[1,2]");
        assert_eq!(canonicalized(&["/0"], r#"[1,[2]]"#), "[[2]]");
        assert_eq!(canonicalized(&["/1/0"], r#"[1,[2,3]]"#), "[1,[3]]");
        // A pointer that names nothing here, or leads into a scalar.
        assert_eq!(
            canonicalized(&["/x/y", "/a/b"], r#"{"a":1,"b":{"x":2}}"#),
            r#"{"a":1,"b":{"x":2}}"#
        );
        // Excluded members are still read: a broken one is a broken body.
        assert!(
            crate::canonical::canonicalize_excluding(
                br#"{"a":tru,"b":1}"#,
                Numbers::Doubles,
                &crate::canonical::Exclusions::new(&["/a"])
            )
            .is_none()
        );
        assert_ne!(
            excluding(&["/a"], r#"{"a":1,"a":2}"#),
            excluding(&["/a"], r#"{"a":2}"#)
        );
    }

    /// Only a JSON body has members: any other is hashed whole.
    #[test]
    fn exclusions_leave_other_bodies_whole() {
        let text = HeaderMap::from_iter([(CONTENT_TYPE, "text/plain".parse().unwrap())]);
        let of = |body: &[u8]| {
            Fingerprint::of_excluding(&Method::POST, "/c", None, &text, body, &["/ts"])
        };
        assert_ne!(of(br#"{"ts":1}"#), of(br#"{"ts":2}"#));
        assert_eq!(of(b"abc"), post("/c", None, &text, b"abc"));
    }

    #[test]
    fn non_json_bodies_are_hashed_verbatim() {
        let text = HeaderMap::from_iter([(CONTENT_TYPE, "text/plain".parse().unwrap())]);
        assert_ne!(
            post("/c", None, &text, br#"{"a":1,"b":2}"#),
            post("/c", None, &text, br#"{"b":2,"a":1}"#)
        );
        // The content types axum's `Json` takes, and only those.
        for (content_type, json) in [
            ("application/json+x", true),
            ("Application/Problem+JSON; charset=utf-8", true),
            ("application/x-json", false),
            ("application/+json", false),
            ("text/json", false),
        ] {
            let headers = HeaderMap::from_iter([(CONTENT_TYPE, content_type.parse().unwrap())]);
            assert_eq!(is_json(&headers), json, "{content_type}");
        }
        // Broken JSON cannot be canonicalised; it is still fingerprinted.
        assert_ne!(
            post("/c", None, &json(), b"{"),
            post("/c", None, &json(), b"{ ")
        );
    }
}
