//! How the admin routes write times, durations, URL parts and problems.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

/// Milliseconds since the Unix epoch (0 before it).
pub(super) fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    })
}

/// Milliseconds from `now` until `time` (0 once it passed).
pub(super) fn millis_left(time: SystemTime, now: SystemTime) -> u64 {
    time.duration_since(now).map_or(0, |left| {
        u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
    })
}

/// `time` in UTC as `2026-12-05 14:03:07 UTC`.
pub(super) fn utc(time: SystemTime) -> String {
    let (date, clock) = civil(time);
    format!("{date} {clock} UTC")
}

/// `time` as an HTML `datetime`: `2026-12-05T14:03:07Z`.
pub(super) fn iso(time: SystemTime) -> String {
    let (date, clock) = civil(time);
    format!("{date}T{clock}Z")
}

/// The date and the time of day of `time`, in UTC, to the second.
fn civil(time: SystemTime) -> (String, String) {
    let secs = time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
    });
    let (days, of_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days to a proleptic Gregorian date (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        format!("{year:04}-{month:02}-{day:02}"),
        format!(
            "{:02}:{:02}:{:02}",
            of_day / 3600,
            of_day % 3600 / 60,
            of_day % 60
        ),
    )
}

/// `time` against `now`: `in 4.2 s`, `3 min ago`.
pub(super) fn relative(time: SystemTime, now: SystemTime) -> String {
    match time.duration_since(now) {
        Ok(ahead) => format!("in {}", duration(ahead)),
        Err(behind) => format!("{} ago", duration(behind.duration())),
    }
}

/// A duration to read at a glance: `340 ms`, `4.2 s`, `12 min`, `3 h`,
/// `2 d`.
pub(super) fn duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", duration.as_secs_f64()),
        60_000..3_600_000 => format!("{} min", ms / 60_000),
        3_600_000..86_400_000 => format!("{} h", ms / 3_600_000),
        _ => format!("{} d", ms / 86_400_000),
    }
}

/// `value` with every byte outside RFC 3986's unreserved set as `%XX`: a
/// query value or a path segment.
pub(super) fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for &byte in value.as_bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The page of one key.
pub(super) fn key_page(scope: &str, key: &str) -> String {
    format!("/admin/key?scope={}&key={}", encode(scope), encode(key))
}

/// The JSON of one key.
pub(super) fn key_json(scope: &str, key: &str) -> String {
    format!("/admin/idempotency/{}/{}", encode(scope), encode(key))
}

/// An RFC 9457 problem with a `code` member, as `idem`'s own answers.
pub(super) fn problem(status: StatusCode, code: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "code": code,
        "detail": detail,
    });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc(UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_723);
        assert_eq!(iso(leap), "2000-02-29T01:02:03Z");
        let later = UNIX_EPOCH + Duration::from_secs(1_796_428_800);
        assert_eq!(iso(later), "2026-12-05T00:00:00Z");
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(Duration::from_millis(340)), "340 ms");
        assert_eq!(duration(Duration::from_millis(4_249)), "4.2 s");
        assert_eq!(duration(Duration::from_secs(750)), "12 min");
        let now = UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(relative(now + Duration::from_secs(2), now), "in 2.0 s");
        assert_eq!(relative(now - Duration::from_secs(2), now), "2.0 s ago");
    }

    #[test]
    fn urls_encode_what_is_not_unreserved() {
        assert_eq!(encode("acct 1/<x>"), "acct%201%2F%3Cx%3E");
        assert_eq!(key_page("a&b", "k=1"), "/admin/key?scope=a%26b&key=k%3D1");
        assert_eq!(key_json("é", "k"), "/admin/idempotency/%C3%A9/k");
    }
}
