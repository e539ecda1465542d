//! What makes two attempts "the same request": the [`Fingerprint`].

use http::{HeaderMap, Method, header::CONTENT_TYPE};
use sha2::{Digest, Sha256};

/// SHA-256 over the method, path, query and body of a request.
///
/// A JSON body (`application/json` or any `+json` type) is hashed in its
/// RFC 8785 canonical form, so key order and whitespace do not matter; any
/// other body is hashed byte for byte. Each part is length-prefixed, so
/// moving bytes between the path and the query yields another fingerprint.
///
/// JSON numbers are compared as RFC 8785 compares them, as IEEE-754 doubles:
/// `1.0` and `1` are the same value.
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
pub fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    serde_json_canonicalizer::to_vec(&value).ok()
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
