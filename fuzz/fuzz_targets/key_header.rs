//! The `Idempotency-Key` parser on any bytes: no panic, and what it accepts
//! is 1 to 255 visible ASCII characters that parse again, quoted (and bare
//! where a bare token can carry them), to themselves.
#![no_main]

use http::{HeaderMap, HeaderValue};
use idem_runtime::{IDEMPOTENCY_KEY, IdempotencyKey, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let parsed = IdempotencyKey::parse(data);
    if let Ok(key) = &parsed {
        assert!((1..=MAX_KEY_LEN).contains(&key.len()), "{key:?}");
        assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{key:?}");
        let mut quoted = String::from("\"");
        for c in key.chars() {
            if c == '"' || c == '\\' {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        assert_eq!(IdempotencyKey::parse(&quoted).as_ref(), Ok(key));
        // Bare, a key reads as itself unless it starts with a quote, or
        // has a comma (a list of keys, refused): those only travel quoted.
        if !key.starts_with('"') && !key.contains(',') {
            assert_eq!(IdempotencyKey::parse(key).as_ref(), Ok(key));
        }
    }
    // Through a header map, as a request delivers it.
    if let Ok(value) = HeaderValue::from_bytes(data) {
        let mut headers = HeaderMap::new();
        headers.insert(IDEMPOTENCY_KEY, value);
        assert_eq!(IdempotencyKey::from_headers(&headers), parsed.map(Some));
    }
});
