//! An operator's resolution of an uncertain key, as the JSON route's body
//! or the page's form asks for it: checked whole before anything changes.

use http::StatusCode;
use serde::Deserialize;

use crate::resolve::Resolution;

/// The longest `by` taken, in characters.
pub(super) const MAX_BY: usize = 200;
/// The longest `note` taken, in characters.
pub(super) const MAX_NOTE: usize = 2000;

/// `POST /admin/idempotency/{scope}/{key}/resolve`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct JsonAsk {
    outcome: String,
    #[serde(default)]
    status: Option<serde_json::Value>,
    #[serde(default)]
    body: Option<serde_json::Value>,
    #[serde(default)]
    by: Option<String>,
    #[serde(default)]
    note: Option<String>,
}

/// The page's resolve form, as posted (every field a string; the form
/// token beside them).
#[derive(Debug, Default, Clone, Deserialize)]
pub(super) struct FormAsk {
    #[serde(default)]
    pub(super) scope: String,
    #[serde(default)]
    pub(super) key: String,
    #[serde(default)]
    pub(super) outcome: String,
    #[serde(default)]
    pub(super) status: String,
    #[serde(default)]
    pub(super) body: String,
    #[serde(default)]
    pub(super) by: String,
    #[serde(default)]
    pub(super) note: String,
    #[serde(default)]
    pub(super) csrf: String,
}

impl JsonAsk {
    /// The resolution asked for, or why it cannot be one.
    pub(super) fn resolution(self) -> Result<Resolution, String> {
        let status = match self.status {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Number(number)) => Some(
                number
                    .as_u64()
                    .and_then(|n| u16::try_from(n).ok())
                    .ok_or_else(|| format!("status {number} is not an HTTP status"))?,
            ),
            Some(other) => return Err(format!("status {other} is not a number")),
        };
        let body = self.body.filter(|body| !body.is_null());
        resolution(&self.outcome, status, body, self.by, self.note)
    }
}

impl FormAsk {
    /// The resolution asked for, or why it cannot be one.
    pub(super) fn resolution(&self) -> Result<Resolution, String> {
        let status = match self.status.trim() {
            "" => None,
            status => Some(
                status
                    .parse::<u16>()
                    .map_err(|_| format!("status {status:?} is not an HTTP status"))?,
            ),
        };
        let body = match self.body.trim() {
            "" => None,
            body => Some(
                serde_json::from_str(body)
                    .map_err(|error| format!("the body is not JSON: {error}"))?,
            ),
        };
        let text = |value: &str| Some(value.to_owned());
        resolution(
            &self.outcome,
            status,
            body,
            text(&self.by),
            text(&self.note),
        )
    }
}

fn resolution(
    outcome: &str,
    status: Option<u16>,
    body: Option<serde_json::Value>,
    by: Option<String>,
    note: Option<String>,
) -> Result<Resolution, String> {
    let resolution = match outcome {
        "completed" => {
            let status = status.ok_or("a completed resolution needs its status")?;
            let status = StatusCode::from_u16(status)
                .map_err(|_| format!("status {status} is not an HTTP status"))?;
            let body = body.ok_or("a completed resolution needs its JSON body")?;
            Resolution::completed(status, body)
        }
        "not_started" | "retry" if status.is_some() || body.is_some() => {
            return Err(format!(
                "status and body go with `completed` only, not `{outcome}`"
            ));
        }
        "not_started" => Resolution::not_started(),
        "retry" => Resolution::retry(),
        other => {
            return Err(format!(
                "unknown outcome {other:?}: `completed`, `not_started` or `retry`"
            ));
        }
    };
    let by = checked("by", by, MAX_BY)?;
    let note = checked("note", note, MAX_NOTE)?;
    let resolution = match by {
        Some(by) => resolution.by(by),
        None => resolution,
    };
    Ok(match note {
        Some(note) => resolution.note(note),
        None => resolution,
    })
}

/// `value` trimmed, `None` when empty; too long is an error.
fn checked(name: &str, value: Option<String>, max: usize) -> Result<Option<String>, String> {
    let Some(value) = value.map(|value| value.trim().to_owned()) else {
        return Ok(None);
    };
    if value.chars().count() > max {
        return Err(format!("{name} is longer than {max} characters"));
    }
    Ok((!value.is_empty()).then_some(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(value: serde_json::Value) -> Result<&'static str, String> {
        let ask: JsonAsk = serde_json::from_value(value).map_err(|e| e.to_string())?;
        ask.resolution().map(|resolution| resolution.outcome())
    }

    #[test]
    fn each_outcome_and_its_fields() {
        use serde_json::json as j;
        let done = j!({"outcome": "completed", "status": 201, "body": {"id": 1}, "by": "ana"});
        assert_eq!(json(done), Ok("completed"));
        assert_eq!(
            json(j!({"outcome": "not_started", "note": "n"})),
            Ok("not_started")
        );
        assert_eq!(json(j!({"outcome": "retry"})), Ok("retry"));
        for bad in [
            j!({"outcome": "finished"}),
            j!({"outcome": "completed", "status": 201}),
            j!({"outcome": "completed", "body": {}}),
            j!({"outcome": "completed", "status": 1000, "body": {}}),
            j!({"outcome": "completed", "status": "201", "body": {}}),
            j!({"outcome": "completed", "status": -1, "body": {}}),
            j!({"outcome": "completed", "status": 201, "body": null}),
            j!({"outcome": "retry", "status": 201}),
            j!({"outcome": "retry", "by": "x".repeat(MAX_BY + 1)}),
            j!({"outcome": "retry", "colour": "red"}),
            j!({"status": 201}),
        ] {
            assert!(json(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_form_reads_strings() {
        let form = FormAsk {
            outcome: "completed".into(),
            status: " 201 ".into(),
            body: r#"{"id": "pay_1"}"#.into(),
            ..FormAsk::default()
        };
        assert_eq!(form.resolution().map(|r| r.outcome()), Ok("completed"));
        let not_json = FormAsk {
            body: "{id".into(),
            ..form.clone()
        };
        assert!(not_json.resolution().unwrap_err().contains("not JSON"));
        let retry = FormAsk {
            outcome: "retry".into(),
            by: "  ".into(),
            ..FormAsk::default()
        };
        assert_eq!(retry.resolution().map(|r| r.outcome()), Ok("retry"));
    }
}
