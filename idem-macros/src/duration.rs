//! Durations as the attribute spells them: `"500ms"`, `"30s"`, `"15m"`, `"24h"`, `"7d"`.

/// The longest `ttl`: a year. Keys kept longer are a storage leak, not a
/// retry window.
pub const MAX_TTL_MS: u64 = 365 * DAY_MS;

/// The longest `wait`: a minute. A duplicate holds a connection while it
/// waits; past a minute a 409 and a client retry serve everyone better.
pub const MAX_WAIT_MS: u64 = 60 * 1000;

/// The longest `timeout`: an hour. A handler holds its transaction, a
/// pooled connection and its key while it runs.
pub const MAX_TIMEOUT_MS: u64 = 60 * 60 * 1000;

/// The longest `lease`: an hour. An attempt that stopped holds its key
/// for its lease before another attempt (or the completer) takes over.
pub const MAX_LEASE_MS: u64 = 60 * 60 * 1000;

/// The shortest `lease`: a second.
pub const MIN_LEASE_MS: u64 = 1000;

const DAY_MS: u64 = 24 * 60 * 60 * 1000;

/// Parses `<digits><unit>` into milliseconds; the error says what is wrong.
pub fn parse_ms(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(format!("`{text}` is negative; durations must be positive"));
    }
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let hint = "expected a duration like \"500ms\", \"30s\", \"15m\", \"24h\" or \"7d\"";
    if digits.is_empty() {
        return Err(format!("`{text}` is not a duration: {hint}"));
    }
    if unit.starts_with(char::is_whitespace) {
        let tight = format!("{digits}{}", unit.trim_start());
        return Err(format!(
            "`{text}` has a space before its unit: write `{tight}`"
        ));
    }
    let per_unit = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60 * 1000,
        "h" => 60 * 60 * 1000,
        "d" => DAY_MS,
        "" => return Err(format!("`{text}` has no unit: {hint}")),
        _ => return Err(format!("`{unit}` is not a unit of time: {hint}")),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(per_unit))
        .ok_or_else(|| format!("`{text}` is too long a duration"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_ms("250ms"), Ok(250));
        assert_eq!(parse_ms("30s"), Ok(30_000));
        assert_eq!(parse_ms("15m"), Ok(900_000));
        assert_eq!(parse_ms("24h"), Ok(86_400_000));
        assert_eq!(parse_ms("7d"), Ok(604_800_000));
        assert_eq!(parse_ms("0s"), Ok(0));
        assert_eq!(parse_ms(" 2m "), Ok(120_000));
        assert_eq!(parse_ms("0365d"), Ok(MAX_TTL_MS));
    }

    #[test]
    fn explains_what_is_wrong() {
        assert!(parse_ms("24").unwrap_err().contains("no unit"));
        assert!(
            parse_ms("24hours")
                .unwrap_err()
                .contains("`hours` is not a unit")
        );
        assert_eq!(
            parse_ms("1 d").unwrap_err(),
            "`1 d` has a space before its unit: write `1d`"
        );
        assert!(parse_ms("1.5h").unwrap_err().contains("not a unit"));
        assert!(parse_ms("h").unwrap_err().contains("not a duration"));
        assert!(parse_ms("").unwrap_err().contains("not a duration"));
        assert!(parse_ms("-1s").unwrap_err().contains("negative"));
        assert!(
            parse_ms("99999999999999999999d")
                .unwrap_err()
                .contains("too long")
        );
        assert!(
            parse_ms("999999999999999999d")
                .unwrap_err()
                .contains("too long")
        );
    }
}
