//! The charges example's checks of a request body, run as it is
//! deserialized: a value that fails one is answered 422 before any work.

use serde::Deserialize;

/// A currency is an ISO 4217 code, three ASCII letters (`eur`): any other
/// string is answered 422, where a database would refuse it (a NUL in
/// PostgreSQL, more than the column holds in MySQL) with a 500.
pub fn currency_code<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<String, D::Error> {
    let code = String::deserialize(deserializer)?;
    if code.len() == 3 && code.bytes().all(|b| b.is_ascii_alphabetic()) {
        Ok(code)
    } else {
        Err(serde::de::Error::custom(
            "expected a currency code of three letters, such as \"eur\"",
        ))
    }
}

/// An amount is a whole number above zero (`1250`, or `1250.0`, the same
/// number in JSON): anything else is the client's mistake, answered 422
/// before any work, rather than the provider's refusal answered 502.
pub fn positive_amount<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    let amount = number.as_i64().or_else(|| {
        // Below 2^63, where an integral double is exactly an i64.
        let float = number.as_f64()?;
        (float.fract() == 0.0 && float.abs() < 9.2e18).then_some(float as i64)
    });
    match amount {
        Some(amount) if amount > 0 => Ok(amount),
        _ => Err(serde::de::Error::custom(format!(
            "expected a whole number above 0, found {number}"
        ))),
    }
}
