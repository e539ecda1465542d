//! Durations as the attribute spells them: `"500ms"`, `"30s"`, `"15m"`, `"24h"`, `"7d"`.
//!
//! One spelling only (a whole number, then `ms`, `s`, `m`, `h` or `d`, no
//! space), so the arguments read the same in every handler and in the
//! published policy. Other spellings a reader would understand (`1 day`,
//! `24hours`, `1.5h`, `2w`) are refused with the accepted spelling of the
//! same duration, which always parses.

/// The longest `ttl`: a year. Keys kept longer are a storage leak, not a
/// retry window.
pub const MAX_TTL_MS: u64 = 365 * DAY_MS;

/// The longest `tombstone`: ten years. A tombstone refuses a late retry;
/// past that it is an archive, which belongs elsewhere.
pub const MAX_TOMBSTONE_MS: u64 = 3650 * DAY_MS;

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

/// The units, largest first, and their length in milliseconds.
const UNITS: [(&str, u64); 5] = [
    ("d", DAY_MS),
    ("h", 60 * 60 * 1000),
    ("m", 60 * 1000),
    ("s", 1000),
    ("ms", 1),
];

const HINT: &str = "expected a duration like \"500ms\", \"30s\", \"15m\", \"24h\" or \"7d\"";

/// Parses `<digits><unit>` into milliseconds; the error says what is wrong
/// and, where the text reads as a duration, what to write instead.
pub fn parse_ms(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(format!("`{text}` is negative; durations must be positive"));
    }
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if let (false, Some(per_unit)) = (digits.is_empty(), unit_ms(unit)) {
        return digits
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(per_unit))
            .ok_or_else(|| format!("`{text}` is too long a duration"));
    }
    let unit = unit.trim_start();
    match respelled(text) {
        Some(Ok(tight)) if !digits.is_empty() && unit_ms(unit).is_some() => Err(format!(
            "`{text}` has a space before its unit: write `{tight}`"
        )),
        Some(Ok(accepted)) => Err(format!(
            "`{text}` is not how a duration is written here: write `{accepted}` (a whole \
             number, then `ms`, `s`, `m`, `h` or `d`, with no space)"
        )),
        Some(Err(TooLong)) => Err(format!("`{text}` is too long a duration")),
        None if digits.is_empty() => Err(format!("`{text}` is not a duration: {HINT}")),
        // `24`, `1.5`: a number alone.
        None if unit.chars().all(|c| c == '.' || c.is_ascii_digit()) => {
            Err(format!("`{text}` has no unit: {HINT}"))
        }
        None => Err(format!("`{unit}` is not a unit of time: {HINT}")),
    }
}

/// A duration past `u64` milliseconds.
#[derive(Debug, PartialEq, Eq)]
pub struct TooLong;

/// The accepted spelling of a duration, however it is written, if it
/// reads as one: `"1 day"` and `"1days"` are `1d`, `"90 Minutes"` is
/// `90m`, `"2w"` is `14d`, `"1.5h"` is `90m`, and an accepted spelling is
/// itself.
pub fn respelled(text: &str) -> Option<Result<String, TooLong>> {
    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_end);
    let unit = unit.trim_start();
    let per_unit = unit_ms(unit).or_else(|| unit_word_ms(unit))?;
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') || fraction.len() > 9 {
        return None;
    }
    let whole: u128 = match whole {
        "" => 0,
        digits => match digits.parse() {
            Ok(whole) => whole,
            Err(_) => return Some(Err(TooLong)),
        },
    };
    let fraction_digits = u32::try_from(fraction.len()).ok()?;
    let scale = 10u128.pow(fraction_digits);
    let fraction: u128 = fraction.parse().unwrap_or(0);
    let Some(scaled) = whole
        .checked_mul(scale)
        .and_then(|n| n.checked_add(fraction))
        .and_then(|n| n.checked_mul(u128::from(per_unit)))
    else {
        return Some(Err(TooLong));
    };
    if scaled % scale != 0 {
        // Finer than a millisecond: no whole number of any unit.
        return None;
    }
    let Ok(ms) = u64::try_from(scaled / scale) else {
        return Some(Err(TooLong));
    };
    // A whole number of one of the accepted units keeps its number (`90
    // minutes` is `90m`, not `1h30m`); a converted one takes the largest
    // unit it is a whole number of (`2w` is `14d`).
    let (unit, unit_ms) = UNITS
        .iter()
        .find(|&&(_, unit_ms)| unit_ms == per_unit && fraction == 0)
        .or_else(|| UNITS.iter().find(|&&(_, unit_ms)| ms % unit_ms == 0))
        .copied()?;
    Some(Ok(format!("{}{unit}", ms / unit_ms)))
}

/// The length of an accepted unit.
fn unit_ms(unit: &str) -> Option<u64> {
    UNITS
        .iter()
        .find(|&&(name, _)| name == unit)
        .map(|&(_, ms)| ms)
}

/// The length of a unit written another way: a word (`second`, `Hours`),
/// an abbreviation (`sec`, `hr`), a capital (`H`), or weeks. Not `M`, which
/// may mean months, nor months or years, which have no fixed length.
fn unit_word_ms(unit: &str) -> Option<u64> {
    let canonical = match unit {
        "MS" => "ms",
        "S" => "s",
        "H" => "h",
        "D" => "d",
        _ => match unit.to_ascii_lowercase().as_str() {
            "msec" | "msecs" | "millis" | "millisecond" | "milliseconds" => "ms",
            "sec" | "secs" | "second" | "seconds" => "s",
            "min" | "mins" | "minute" | "minutes" => "m",
            "hr" | "hrs" | "hour" | "hours" => "h",
            "day" | "days" => "d",
            "w" | "wk" | "wks" | "week" | "weeks" => return Some(7 * DAY_MS),
            _ => return None,
        },
    };
    unit_ms(canonical)
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
        assert!(parse_ms("1.5").unwrap_err().contains("no unit"));
        assert_eq!(
            parse_ms("1 d").unwrap_err(),
            "`1 d` has a space before its unit: write `1d`"
        );
        assert!(
            parse_ms("2y")
                .unwrap_err()
                .starts_with("`y` is not a unit of time")
        );
        assert!(
            parse_ms("1 year")
                .unwrap_err()
                .starts_with("`year` is not a unit of time")
        );
        assert!(
            parse_ms("1M")
                .unwrap_err()
                .starts_with("`M` is not a unit of time")
        );
        assert!(parse_ms("h").unwrap_err().contains("not a duration"));
        assert!(parse_ms("").unwrap_err().contains("not a duration"));
        assert!(parse_ms("one day").unwrap_err().contains("not a duration"));
        assert!(parse_ms("-1s").unwrap_err().contains("negative"));
        assert!(parse_ms("0.0001s").unwrap_err().contains("not a unit"));
        for too_long in [
            "99999999999999999999d",
            "999999999999999999d",
            "999999999999999999 days",
            "99999999999999999999999999999999999999999999 weeks",
        ] {
            assert!(
                parse_ms(too_long).unwrap_err().contains("too long"),
                "{too_long}"
            );
        }
    }

    /// Every other spelling of every unit is refused with one that parses,
    /// to the same duration.
    #[test]
    fn other_spellings_are_respelled() {
        let spellings: [(&[&str], u64); 6] = [
            (
                &[
                    "ms",
                    "MS",
                    "msec",
                    "msecs",
                    "millis",
                    "millisecond",
                    "Milliseconds",
                ],
                1,
            ),
            (
                &["s", "S", "sec", "secs", "second", "seconds", "Seconds"],
                1000,
            ),
            (
                &["m", "min", "mins", "minute", "minutes", "MINUTES"],
                60_000,
            ),
            (
                &["h", "H", "hr", "hrs", "hour", "hours", "Hours"],
                3_600_000,
            ),
            (&["d", "D", "day", "days", "Days"], DAY_MS),
            (&["w", "wk", "wks", "week", "weeks"], 7 * DAY_MS),
        ];
        for (units, per_unit) in spellings {
            for unit in units {
                for space in ["", " ", "  "] {
                    let text = format!("3{space}{unit}");
                    if (space, units[0]) == ("", *unit) && unit_ms(unit).is_some() {
                        assert_eq!(parse_ms(&text), Ok(3 * per_unit));
                        continue;
                    }
                    let message = parse_ms(&text).unwrap_err();
                    let accepted = message
                        .split("write `")
                        .nth(1)
                        .and_then(|rest| rest.split('`').next())
                        .unwrap_or_else(|| panic!("{text}: {message}"));
                    assert_eq!(parse_ms(accepted), Ok(3 * per_unit), "{text}: {message}");
                }
            }
        }
        assert_eq!(
            parse_ms("1 day").unwrap_err(),
            "`1 day` is not how a duration is written here: write `1d` (a whole number, then \
             `ms`, `s`, `m`, `h` or `d`, with no space)"
        );
        let accepted = |text: &str| respelled(text).unwrap().unwrap();
        assert_eq!(accepted("1day"), "1d");
        assert_eq!(accepted("90 minutes"), "90m");
        assert_eq!(accepted("60 minutes"), "60m");
        assert_eq!(accepted("2w"), "14d");
        assert_eq!(accepted("1.5h"), "90m");
        assert_eq!(accepted("1.0h"), "1h");
        assert_eq!(accepted("0.5s"), "500ms");
        assert_eq!(accepted(".25 days"), "6h");
        assert_eq!(accepted("24h"), "24h");
        assert_eq!(respelled("1.5.2h"), None);
        assert_eq!(respelled("0.0005s"), None);
        assert_eq!(respelled("soon"), None);
    }
}
