//! RFC 8785 (JSON Canonicalization Scheme), written in one pass over the
//! body's bytes: no parsed tree, so an ordinary body costs about its own
//! size again (the output; 16 bytes for each member of an object being
//! written; a scratch buffer for objects whose members come out of order),
//! at worst about eight times it (numbers such as `1e20`, written out as
//! 21 digits), where a `serde_json::Value` took up to a hundred times it
//! (`[{"":0},...]`) and one allocation per string, array and object.

use std::borrow::Cow;
use std::cmp::Ordering;

/// RFC 8785 canonical form of any JSON text, `None` if it does not parse.
///
/// Members in the order of their names' UTF-16 code units, strings escaped
/// as JSON requires and no further, numbers as ECMAScript prints the
/// double, except integers beyond 2^53: those keep their digits (see
/// [`Fingerprint`](crate::fingerprint::Fingerprint)). Where serde_json's
/// `arbitrary_precision` is on in the build, so that handlers read a
/// number's exact digits, a number with a fraction or an exponent is
/// written as its exact decimal value instead (`1.000000000000000001` is
/// not `1`; `1.50` is `1.5`). `None` also for what serde_json
/// refuses (nesting deeper than 127, a lone surrogate, a number beyond
/// the doubles) and for an object naming one member twice: handlers
/// disagree on which of the two counts, so such a body is hashed byte for
/// byte, and another spelling of it is another request.
///
/// ```
/// # use idem_runtime as idem;
/// let canonical = idem::canonicalize(br#"{ "b": [1.0, 2e3], "a": "\u00e9" }"#).unwrap();
/// assert_eq!(canonical, "{\"a\":\"é\",\"b\":[1,2000]}".as_bytes());
/// assert_eq!(idem::canonicalize(br#"{"a": 1, "a": 2}"#), None);
/// ```
pub fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    canonicalize_numbers(body, Numbers::of_this_build())
}

/// How the handler reads a number with a fraction or an exponent, and so
/// how its canonical form is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Numbers {
    /// As the nearest double (serde_json's default): two spellings of one
    /// double are one number, written as RFC 8785 writes the double.
    Doubles,
    /// As its exact digits (serde_json's `arbitrary_precision`, which any
    /// crate of the build may turn on, a decimal crate for one): two
    /// numbers are one only if their decimal values are; see
    /// [`write_decimal`].
    Exact,
}

impl Numbers {
    /// What serde_json does in this build, found once: with
    /// `arbitrary_precision` a number keeps digits its double has not.
    pub(crate) fn of_this_build() -> Self {
        static NUMBERS: std::sync::OnceLock<Numbers> = std::sync::OnceLock::new();
        *NUMBERS.get_or_init(|| {
            let digits = "0.30000000000000001";
            match serde_json::from_str::<serde_json::Number>(digits) {
                Ok(number) if number.to_string() == digits => Self::Exact,
                _ => Self::Doubles,
            }
        })
    }
}

pub(crate) fn canonicalize_numbers(body: &[u8], numbers: Numbers) -> Option<Vec<u8>> {
    if body.len() > MAX_BODY {
        return None;
    }
    let mut writer = Writer {
        text: body,
        at: 0,
        out: Vec::with_capacity(body.len()),
        members: Vec::new(),
        names: Vec::new(),
        scratch: Vec::new(),
        numbers,
    };
    writer.value(0)?;
    writer.skip_whitespace();
    (writer.at == body.len()).then_some(writer.out)
}

/// serde_json's limit for a `Value`. A body nesting deeper is hashed byte
/// for byte (a typed extractor may still take it, skipping the deep part):
/// safe, as another spelling of it is another request, and it bounds this
/// writer's recursion.
const MAX_DEPTH: usize = 127;

/// The largest magnitude up to which every integer is exact as a double.
const EXACT_INTEGERS: f64 = 9_007_199_254_740_992.0; // 2^53

/// Beyond this magnitude RFC 8785 writes a double with an exponent.
const EXPONENT_FORM: f64 = 1e21;

/// Reads JSON text at `at` and writes its canonical form to `out`.
struct Writer<'a> {
    text: &'a [u8],
    at: usize,
    out: Vec<u8>,
    /// The members of the objects being written, innermost object last.
    members: Vec<Member>,
    /// The names among them that had escapes, unescaped.
    names: Vec<u8>,
    /// Where an object's members are put in order.
    scratch: Vec<u8>,
    numbers: Numbers,
}

/// One member written to `out[start..end]` as `"name":value`, its
/// unescaped name at `name` (an offset into the body, or past its end into
/// `names`), `name_len` bytes long. Sixteen bytes: a body of small members
/// (`"a":0,`) costs about three times its size here, not eight.
struct Member {
    name: u32,
    name_len: u32,
    start: u32,
    end: u32,
}

/// Offsets are kept in 32 bits: a longer body (or one whose canonical form
/// may be, at up to about five times the body) is hashed byte for byte.
const MAX_BODY: usize = u32::MAX as usize / 8;

impl<'a> Writer<'a> {
    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.text.get(self.at) {
            self.at += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    /// A value inside `depth` containers.
    fn value(&mut self, depth: usize) -> Option<()> {
        self.skip_whitespace();
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => {
                let string = self.string()?;
                write_string(&string, &mut self.out);
                Some(())
            }
            b'-' | b'0'..=b'9' => self.number(),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.at + word.len();
        (self.text.get(self.at..end)? == word).then_some(())?;
        self.at = end;
        self.out.extend_from_slice(word);
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.at += 1;
        self.out.push(b'[');
        self.skip_whitespace();
        if self.peek()? == b']' {
            self.at += 1;
        } else {
            loop {
                self.value(depth)?;
                self.skip_whitespace();
                match self.next()? {
                    b',' => self.out.push(b','),
                    b']' => break,
                    _ => return None,
                }
            }
        }
        self.out.push(b']');
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.at += 1;
        self.out.push(b'{');
        let start = self.out.len();
        let first = self.members.len();
        let names = self.names.len();
        self.skip_whitespace();
        if self.peek()? == b'}' {
            self.at += 1;
        } else {
            loop {
                self.skip_whitespace();
                if self.peek()? != b'"' {
                    return None;
                }
                // Past the quote: where a name without escapes is.
                let unescaped = self.at + 1;
                let name = self.string()?;
                let member = self.out.len();
                write_string(&name, &mut self.out);
                let (at, name_len) = match name {
                    Cow::Borrowed(name) => (unescaped, name.len()),
                    Cow::Owned(name) => {
                        let at = self.text.len() + self.names.len();
                        self.names.extend_from_slice(name.as_bytes());
                        (at, name.len())
                    }
                };
                self.skip_whitespace();
                (self.next()? == b':').then_some(())?;
                self.out.push(b':');
                self.value(depth)?;
                // In range: the body and its canonical form are within
                // MAX_BODY and eight times it.
                self.members.push(Member {
                    name: at as u32,
                    name_len: name_len as u32,
                    start: member as u32,
                    end: self.out.len() as u32,
                });
                self.skip_whitespace();
                match self.next()? {
                    b',' => self.out.push(b','),
                    b'}' => break,
                    _ => return None,
                }
            }
            self.order(first, start)?;
            self.names.truncate(names);
        }
        self.out.push(b'}');
        Some(())
    }

    /// Puts the members from `first` on, written from `out[start..]`, in
    /// order. Most bodies come in order already (a serializer's field
    /// order, or sorted), and then nothing moves.
    fn order(&mut self, first: usize, start: usize) -> Option<()> {
        let Self {
            text,
            members,
            names,
            out,
            scratch,
            ..
        } = self;
        let name = |member: &Member| {
            let (at, len) = (member.name as usize, member.name_len as usize);
            match at.checked_sub(text.len()) {
                None => &text[at..at + len],
                Some(at) => &names[at..at + len],
            }
        };
        let these = &mut members[first..];
        if !these
            .windows(2)
            .all(|pair| name_order(name(&pair[0]), name(&pair[1])).is_lt())
        {
            these.sort_unstable_by(|a, b| name_order(name(a), name(b)));
            if these
                .windows(2)
                .any(|pair| name(&pair[0]) == name(&pair[1]))
            {
                return None;
            }
            scratch.clear();
            for (index, member) in these.iter().enumerate() {
                if index > 0 {
                    scratch.push(b',');
                }
                scratch.extend_from_slice(&out[member.start as usize..member.end as usize]);
            }
            out.truncate(start);
            out.extend_from_slice(scratch);
        }
        members.truncate(first);
        Some(())
    }

    /// A string at its opening quote, unescaped; borrowed unless it has
    /// escapes. `None` for what JSON forbids: raw control characters, bad
    /// escapes, lone surrogates, bytes that are not UTF-8.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        let text = self.text;
        self.at += 1;
        let start = self.at;
        loop {
            match *text.get(self.at)? {
                b'"' => {
                    let string = std::str::from_utf8(&text[start..self.at]).ok()?;
                    self.at += 1;
                    return Some(Cow::Borrowed(string));
                }
                b'\\' => break,
                0x00..=0x1f => return None,
                _ => self.at += 1,
            }
        }
        let mut unescaped = text[start..self.at].to_vec();
        loop {
            match self.next()? {
                b'"' => return String::from_utf8(unescaped).ok().map(Cow::Owned),
                b'\\' => {
                    let byte = match self.next()? {
                        byte @ (b'"' | b'\\' | b'/') => byte,
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'u' => {
                            let char = self.escaped_char()?;
                            let mut utf8 = [0; 4];
                            unescaped.extend_from_slice(char.encode_utf8(&mut utf8).as_bytes());
                            continue;
                        }
                        _ => return None,
                    };
                    unescaped.push(byte);
                }
                0x00..=0x1f => return None,
                byte => unescaped.push(byte),
            }
        }
    }

    /// The character of a `\u` escape (after the `u`), with the low half
    /// of a surrogate pair.
    fn escaped_char(&mut self) -> Option<char> {
        let high = self.hex4()?;
        let code = match high {
            0xd800..=0xdbff => {
                let end = self.at + 2;
                (self.text.get(self.at..end)? == b"\\u").then_some(())?;
                self.at = end;
                let low = self.hex4()?;
                if !(0xdc00..=0xdfff).contains(&low) {
                    return None;
                }
                0x10000 + ((u32::from(high) - 0xd800) << 10) + (u32::from(low) - 0xdc00)
            }
            0xdc00..=0xdfff => return None,
            _ => u32::from(high),
        };
        char::from_u32(code)
    }

    fn hex4(&mut self) -> Option<u16> {
        let end = self.at + 4;
        let digits = self.text.get(self.at..end)?;
        self.at = end;
        digits.iter().try_fold(0, |code, &digit| {
            let digit = char::from(digit).to_digit(16)?;
            Some(code << 4 | digit as u16)
        })
    }

    /// Consumes a run of ASCII digits: whether there was one.
    fn digits(&mut self) -> bool {
        let start = self.at;
        while let Some(b'0'..=b'9') = self.peek() {
            self.at += 1;
        }
        self.at > start
    }

    /// A number, as JSON's grammar has it (no `+`, no leading zeros, no
    /// bare `.`). An integer is written as its digits; any other number
    /// as RFC 8785 writes its double, or, where the handler reads exact
    /// digits ([`Numbers::Exact`]), as its exact decimal value.
    fn number(&mut self) -> Option<()> {
        let text = self.text;
        let start = self.at;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.at += 1;
        }
        let int_start = self.at;
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        let int = &text[int_start..self.at];
        let mut fraction: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.at += 1;
            let fraction_start = self.at;
            self.digits().then_some(())?;
            fraction = &text[fraction_start..self.at];
        }
        let mut exponent = None;
        if let Some(b'e' | b'E') = self.peek() {
            self.at += 1;
            let exponent_start = self.at;
            if let Some(b'+' | b'-') = self.peek() {
                self.at += 1;
            }
            self.digits().then_some(())?;
            exponent = Some(&text[exponent_start..self.at]);
        }
        let number = &text[start..self.at];
        let integer = exponent.is_none() && fraction.is_empty();
        // Read by serde_json itself, as it reads the number for the handler
        // (correctly rounded with `float_roundtrip`), and refused where it
        // refuses one beyond the doubles. Not by `str::parse`: it stops
        // counting an exponent at 65,536, so `1` and 65,536 zeros then
        // `e-655360`, which is 1 to the handler, read as 0 (found by
        // review: a wrong replay). Up to 300 digits an integer is never
        // beyond the doubles, and its digits are its form.
        let double = if integer && number.len() <= 300 {
            0.0
        } else {
            serde_json::from_slice::<f64>(number).ok()?
        };
        if integer {
            // JSON's integers are written as their digits and nothing else,
            // which is the canonical form: exactly, up to 2^53, where a
            // double prints as its integer; and beyond, where idem keeps
            // the digits a double would lose.
            match number {
                b"-0" => self.out.push(b'0'),
                _ => self.out.extend_from_slice(number),
            }
        } else if self.numbers == Numbers::Exact {
            write_decimal(negative, int, fraction, exponent, &mut self.out)?;
        } else {
            write_double(double, &mut self.out);
        }
        Some(())
    }
}

/// Appends a JSON number that has a fraction or an exponent as ECMAScript
/// writes a number (RFC 8785's form), but of the text's exact decimal
/// value rather than of the double nearest to it ([`Numbers::Exact`]).
///
/// For every text that is the shortest spelling of its double, which is
/// what serializers write (serde_json, JavaScript, Python, Go), these are
/// [`write_double`]'s bytes: the same digits and exponent, formatted alike.
/// A text with more digits than its double keeps them
/// (`1.000000000000000001` is not `1`): the handler reads those digits,
/// and two amounts must not share a fingerprint because one double holds
/// both.
///
/// `None` for an exponent beyond 2^50, which no body of a sane size can
/// need and which would not fit the arithmetic: hashed byte for byte.
fn write_decimal(
    negative: bool,
    int: &[u8],
    fraction: &[u8],
    exponent: Option<&[u8]>,
    out: &mut Vec<u8>,
) -> Option<()> {
    // The value is `digits` x 10^(exponent - fraction.len()), its digits
    // the integer's and the fraction's, less leading and trailing zeros.
    let digits: Vec<u8> = int.iter().chain(fraction).copied().collect();
    let Some(first) = digits.iter().position(|&digit| digit != b'0') else {
        out.push(b'0');
        return Some(());
    };
    let last = digits
        .iter()
        .rposition(|&digit| digit != b'0')
        .unwrap_or(first);
    let significant = &digits[first..=last];
    let exponent = match exponent {
        None => 0,
        Some(text) => {
            let (sign, digits) = match text.split_first() {
                Some((b'-', digits)) => (-1, digits),
                Some((b'+', digits)) => (1, digits),
                _ => (1, text),
            };
            let magnitude = digits.iter().try_fold(0_i64, |value, &digit| {
                Some(value * 10 + i64::from(digit - b'0')).filter(|&value| value <= 1 << 50)
            })?;
            sign * magnitude
        }
    };
    let k = significant.len() as i64;
    // ECMAScript's n: the value is 0.significant x 10^n.
    let n = k + exponent - fraction.len() as i64 + (digits.len() - 1 - last) as i64;
    if negative {
        out.push(b'-');
    }
    let zeros = |out: &mut Vec<u8>, count: i64| out.extend((0..count).map(|_| b'0'));
    if k <= n && n <= 21 {
        out.extend_from_slice(significant);
        zeros(out, n - k);
    } else if 0 < n && n <= 21 {
        let (whole, rest) = significant.split_at(n as usize);
        out.extend_from_slice(whole);
        out.push(b'.');
        out.extend_from_slice(rest);
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        zeros(out, -n);
        out.extend_from_slice(significant);
    } else {
        out.push(significant[0]);
        if k > 1 {
            out.push(b'.');
            out.extend_from_slice(&significant[1..]);
        }
        let e = n - 1;
        out.push(b'e');
        out.push(if e < 0 { b'-' } else { b'+' });
        out.extend_from_slice(e.unsigned_abs().to_string().as_bytes());
    }
    Some(())
}

/// Appends a finite double as RFC 8785 writes it, except one beyond 2^53
/// (and below 10^21, where RFC 8785 still writes digits): its exact
/// integer digits. Every double there is an integer, and RFC 8785's
/// shortest form pads it with zeros into what can be another integer's
/// digits: `1152921504606846976.0` (2^60) would be written
/// `1152921504606847000`, the form of the integer 1152921504606847000,
/// whose own digits idem keeps. With the exact digits, two spellings of
/// one number share a form, and two numbers never do.
fn write_double(double: f64, out: &mut Vec<u8>) {
    let magnitude = double.abs();
    if magnitude > EXACT_INTEGERS && magnitude < EXPONENT_FORM {
        if double < 0.0 {
            out.push(b'-');
        }
        // Exact: an integral double below 10^21 (< 2^70) fits a u128.
        out.extend_from_slice((magnitude as u128).to_string().as_bytes());
    } else {
        out.extend_from_slice(ryu_js::Buffer::new().format_finite(double).as_bytes());
    }
}

/// RFC 8785's order of member names: by their UTF-16 code units. That is
/// the order of their UTF-8 bytes up to where they first differ, unless a
/// character there is U+E000 or beyond (UTF-8 lead byte 0xEE or above),
/// where UTF-16's surrogates sort supplementary characters first.
fn name_order(x: &[u8], y: &[u8]) -> Ordering {
    match x.iter().zip(y).position(|(p, q)| p != q) {
        None => x.len().cmp(&y.len()),
        Some(at) if x[at] < 0xee && y[at] < 0xee => x[at].cmp(&y[at]),
        // Names are UTF-8 (checked as they were read): nothing is lost.
        Some(_) => String::from_utf8_lossy(x)
            .encode_utf16()
            .cmp(String::from_utf8_lossy(y).encode_utf16()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The canonicaliser this one replaced (through `serde_json::Value`),
    /// kept as an oracle: keys claimed before an upgrade must keep their
    /// fingerprints after it.
    mod previous {
        use serde_json::Value;
        use serde_json::value::RawValue;

        // Unchanged by the one-pass writer: shared, so that what the oracle
        // checks is the rest (the traversal, the order, the numbers).
        use super::super::{write_double, write_string};

        pub(super) fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
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

        enum Unwritten {
            NotJson,
            Inexact,
        }

        const EXACT_INTEGERS: u64 = 1 << 53;

        const BEYOND_64_BITS: f64 = 9_223_372_036_854_775_808.0; // 2^63

        const EXACT_DEPTH: usize = 16;

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
                        Err(Unwritten::Inexact)
                            if text.bytes().skip(1).all(|b| b.is_ascii_digit()) =>
                        {
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
    }

    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn text(bytes: &[u8]) -> String {
        String::from_utf8_lossy(bytes).into_owned()
    }

    /// Whether serde_json reads `body` as JSON naming no member twice.
    fn json_without_duplicates(body: &[u8]) -> bool {
        use serde::de::{Deserialize, Deserializer, Error, MapAccess, SeqAccess, Visitor};

        struct Unique;
        impl<'de> Deserialize<'de> for Unique {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_any(Unique)
            }
        }
        impl<'de> Visitor<'de> for Unique {
            type Value = Unique;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_str<E>(self, _: &str) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_unit<E>(self) -> Result<Unique, E> {
                Ok(Unique)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Unique, A::Error> {
                while items.next_element::<Unique>()?.is_some() {}
                Ok(Unique)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Unique, A::Error> {
                let mut names = std::collections::HashSet::new();
                while let Some(name) = members.next_key::<String>()? {
                    if !names.insert(name) {
                        return Err(A::Error::custom("a name twice"));
                    }
                    members.next_value::<Unique>()?;
                }
                Ok(Unique)
            }
        }
        serde_json::from_slice::<Unique>(body).is_ok()
    }

    /// The one-pass writer and the one it replaced agree on `body`, but
    /// for the intended difference: a body naming a member twice is not
    /// canonicalised any more.
    fn agrees(body: &[u8]) {
        let now = canonicalize(body);
        let before = previous::canonicalize(body);
        if now.is_none() && before.is_some() && !json_without_duplicates(body) {
            return;
        }
        assert_eq!(
            now.as_deref().map(text),
            before.as_deref().map(text),
            "{}",
            text(body)
        );
        if let Some(once) = now {
            assert_eq!(canonicalize(&once).as_ref(), Some(&once), "{}", text(body));
        }
    }

    const NAMES: [&str; 12] = [
        "a",
        "b",
        "aa",
        "A",
        "\\u0062",
        "\\n",
        "\\\"",
        "\u{e9}",
        "\u{e000}",
        "\u{ff5e}",
        "\u{1f600}",
        "\\ud83d\\ude01",
    ];
    const NUMBERS: [&str; 24] = [
        "0",
        "-0",
        "7",
        "-12",
        "9007199254740992",
        "9007199254740993",
        "-9007199254740993",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        "340282366920938463463374607431768211457",
        "1.5",
        "-0.0",
        "1e3",
        "2.50E-7",
        "0.1",
        "1152921504606846976.0",
        "1e21",
        "1E+400",
        "5e-324",
        "1.7976931348623157e308",
        "123456789012345678901234.5",
    ];
    const STRINGS: [&str; 8] = [
        "",
        "plain",
        "\\n\\t\\\"\\\\\\/",
        "\\u00e9\\u0001\\u001F",
        "\u{7f}\u{2028}\u{1f600}",
        "\\ud83d\\ude00",
        "\\ud800",
        "\\uDFFF",
    ];
    const SPACES: [&str; 4] = ["", " ", "\n\t", "\r\n  "];

    fn value(rng: &mut StdRng, depth: usize, out: &mut String) {
        let space = |rng: &mut StdRng| SPACES[rng.random_range(0..SPACES.len())];
        match rng.random_range(0..if depth < 5 { 9 } else { 6 }) {
            0 => out.push_str(["null", "true", "false"][rng.random_range(0..3)]),
            1 | 2 => out.push_str(NUMBERS[rng.random_range(0..NUMBERS.len())]),
            3..=5 => {
                out.push('"');
                out.push_str(STRINGS[rng.random_range(0..STRINGS.len())]);
                out.push('"');
            }
            6 | 7 => {
                out.push('[');
                for index in 0..rng.random_range(0..5) {
                    if index > 0 {
                        out.push(',');
                    }
                    out.push_str(space(rng));
                    value(rng, depth + 1, out);
                    out.push_str(space(rng));
                }
                out.push(']');
            }
            _ => {
                out.push('{');
                // Distinct names, in a random order: `\u0062` is `b`, so
                // one of the two at most.
                let mut names: Vec<&str> = NAMES
                    .iter()
                    .copied()
                    .filter(|_| rng.random_bool(0.3))
                    .collect();
                if names.contains(&"b") {
                    names.retain(|name| *name != "\\u0062");
                }
                for index in (1..names.len()).rev() {
                    names.swap(index, rng.random_range(0..=index));
                }
                for (index, name) in names.into_iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    out.push_str(space(rng));
                    out.push('"');
                    out.push_str(name);
                    out.push('"');
                    out.push_str(space(rng));
                    out.push(':');
                    out.push_str(space(rng));
                    value(rng, depth + 1, out);
                }
                out.push('}');
            }
        }
    }

    /// Thousands of bodies from a fixed seed, and as many with a byte or
    /// two changed, deleted or added (most of them no longer JSON, some of
    /// them JSON of another shape): the bytes the previous writer wrote.
    #[test]
    fn writes_what_the_previous_writer_wrote() {
        let mut rng = StdRng::seed_from_u64(8785);
        for _ in 0..4000 {
            let mut body = String::new();
            value(&mut rng, 0, &mut body);
            agrees(body.as_bytes());
            let mut bytes = body.into_bytes();
            for _ in 0..rng.random_range(1..3) {
                let at = rng.random_range(0..=bytes.len());
                let byte = b"{}[],:\"\\ 0-.e9ntu\xff"[rng.random_range(0..17)];
                match rng.random_range(0..3) {
                    0 if at < bytes.len() => bytes[at] = byte,
                    1 if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    _ => bytes.insert(at, byte),
                }
            }
            agrees(&bytes);
        }
    }

    #[test]
    fn refuses_what_json_forbids() {
        for body in [
            &b""[..],
            b" ",
            b"\xef\xbb\xbf{}",
            b"{} x",
            b"[01]",
            b"[1.]",
            b"[.5]",
            b"[+1]",
            b"[1e]",
            b"[1,]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"[1e400]",
            b"[\"\\ud800\"]",
            b"[\"\\udc00\"]",
            b"[\"\\ud800\\u0041\"]",
            b"[\"\\u00\"]",
            b"[\"\\x\"]",
            b"[\"\x01\"]",
            b"[\"\xff\"]",
            b"[\"\xc0\xaf\"]",
            b"nul",
            b"[true false]",
        ] {
            assert_eq!(canonicalize(body), None, "{}", text(body));
            assert!(serde_json::from_slice::<serde_json::Value>(body).is_err());
        }
        let long = format!("[{}]", "9".repeat(400));
        assert_eq!(canonicalize(long.as_bytes()), None);
        agrees(long.as_bytes());
        let fits = format!("[{}]", "9".repeat(300));
        assert_eq!(canonicalize(fits.as_bytes()).unwrap(), fits.as_bytes());
    }

    /// serde_json's depth: 127 containers parse, 128 do not.
    #[test]
    fn nests_as_deep_as_serde_json() {
        for depth in [126, 127, 128] {
            for (open, close) in [("[", "]"), ("{\"a\":", "}")] {
                let body = format!("{}1{}", open.repeat(depth), close.repeat(depth));
                let parses = serde_json::from_str::<serde_json::Value>(&body).is_ok();
                assert_eq!(parses, depth <= 127);
                assert_eq!(canonicalize(body.as_bytes()).is_some(), parses, "{depth}");
            }
        }
    }

    #[test]
    fn a_name_twice_is_not_canonical() {
        for body in [
            &br#"{"a":1,"a":1}"#[..],
            br#"{"a":1,"b":2,"a":3}"#,
            br#"{"b":1,"\u0062":2}"#,
            br#"[{"x":{"a":1,"a":2}}]"#,
        ] {
            assert_eq!(canonicalize(body), None, "{}", text(body));
        }
        assert_eq!(
            canonicalize(br#"{"a":{"a":1},"b":{"a":2}}"#).unwrap(),
            br#"{"a":{"a":1},"b":{"a":2}}"#
        );
    }

    #[test]
    fn names_sort_by_utf_16() {
        let names = [
            "\u{e000}",
            "\u{1f600}",
            "\u{ff5e}",
            "z",
            "\u{e9}",
            "",
            "\u{10ffff}",
        ];
        for a in names {
            for b in names {
                assert_eq!(
                    name_order(a.as_bytes(), b.as_bytes()),
                    a.encode_utf16().cmp(b.encode_utf16()),
                    "{a:?} {b:?}"
                );
            }
        }
    }

    fn exact(body: &str) -> String {
        text(&canonicalize_numbers(body.as_bytes(), Numbers::Exact).unwrap())
    }

    /// This build's serde_json rounds numbers to doubles.
    #[test]
    fn this_build_reads_doubles() {
        assert_eq!(Numbers::of_this_build(), Numbers::Doubles);
    }

    /// Where the handler reads exact digits, two numbers that one double
    /// holds are two requests, and spellings of one decimal value are one.
    #[test]
    fn exact_numbers_keep_their_value() {
        for (a, b) in [
            ("[1.000000000000000001]", "[1]"),
            ("[0.1000000000000000055511151231257827]", "[0.1]"),
            ("[333333333.33333329]", "[333333333.3333333]"),
            ("[1.152921504606847e18]", "[1152921504606846976.0]"),
        ] {
            assert_ne!(exact(a), exact(b), "{a} {b}");
            assert_eq!(
                canonicalize_numbers(a.as_bytes(), Numbers::Doubles),
                canonicalize_numbers(b.as_bytes(), Numbers::Doubles),
            );
        }
        for (spellings, form) in [
            (&["1.5", "1.50", "15e-1", "0.15E1", "150E-2"][..], "1.5"),
            (&["1e2", "1.00e2", "10E1", "100.0"], "100"),
            (&["-0.0", "0e5", "0.0", "-0E-0"], "0"),
            (&["1e21", "10e20", "1.0E+21"], "1e+21"),
            (&["1e-7", "0.0000001", "100e-9"], "1e-7"),
            (&["0.000001", "1e-6"], "0.000001"),
            (
                &["-123456789012345678901234.5"],
                "-1.234567890123456789012345e+23",
            ),
            (&["1.000000000000000001"], "1.000000000000000001"),
            (&["1.152921504606847e18"], "1152921504606847000"),
            (&["4.2e-999999"], "4.2e-999999"),
        ] {
            for spelling in spellings {
                assert_eq!(
                    exact(&format!("[{spelling}]")),
                    format!("[{form}]"),
                    "{spelling}"
                );
            }
        }
        // Integers keep their digits in both, and beyond the doubles is
        // refused in both, as serde_json refuses it.
        assert_eq!(
            exact("[20000000000000000001, -0]"),
            "[20000000000000000001,0]"
        );
        assert_eq!(canonicalize_numbers(b"[1e400]", Numbers::Exact), None);
    }

    /// A double's ECMAScript spelling, which serializers write (serde_json
    /// too, but for its `.0` and exponent style), has the same form either
    /// way: RFC 8785's (but beyond 2^53, below 10^21, where the shortest
    /// digits are not the double's own). Where two shortest spellings tie,
    /// ECMAScript takes the even digit and others may not: those are two
    /// decimals, so two requests, where the handler reads exact digits.
    #[test]
    fn shortest_spellings_are_rfc_8785_either_way() {
        let mut rng = StdRng::seed_from_u64(754);
        let mut compared = 0;
        while compared < 20_000 {
            let double = f64::from_bits(rng.random());
            let magnitude = double.abs();
            if !double.is_finite() || (magnitude > EXACT_INTEGERS && magnitude < EXPONENT_FORM) {
                continue;
            }
            let ecmascript = ryu_js::Buffer::new().format_finite(double).to_owned();
            let serde = serde_json::to_string(&double).unwrap();
            for spelling in [ecmascript, serde] {
                let body = format!("[{spelling}]");
                assert_eq!(
                    canonicalize_numbers(body.as_bytes(), Numbers::Exact),
                    canonicalize_numbers(body.as_bytes(), Numbers::Doubles),
                    "{spelling}"
                );
            }
            compared += 1;
        }
    }

    /// Long digit runs against long exponents are read as serde_json reads
    /// them for the handler (found by review: `str::parse` stops counting
    /// an exponent at 65,536, so each of these read as another number, one
    /// a wrong replay of `{"amount":1}`).
    #[test]
    fn long_exponents_are_read_as_the_handler_reads_them() {
        let zeros = |count: usize| "0".repeat(count);
        for body in [
            format!("{{\"amount\":1{}e-655360}}", zeros(65_536)),
            format!("{{\"amount\":0.{}1e655364}}", zeros(655_359)),
            format!("{{\"amount\":0.{}1e6553600}}", zeros(65_535)),
            format!("{{\"amount\":1{}e-700000}}", zeros(700_000)),
        ] {
            let handler = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .map(|value| serde_json::to_vec(&value).unwrap());
            assert_eq!(
                canonicalize(body.as_bytes()),
                previous::canonicalize(body.as_bytes()),
                "{}",
                &body[..40]
            );
            // The handler's reading, canonical, is the body's form.
            assert_eq!(
                canonicalize(body.as_bytes()),
                handler.and_then(|text| canonicalize(&text)),
                "{}",
                &body[..40]
            );
        }
        assert_ne!(
            canonicalize(format!("{{\"amount\":1{}e-655360}}", zeros(65_536)).as_bytes()),
            canonicalize(br#"{"amount":1}"#)
        );
    }

    /// In exact mode an exponent beyond 2^50 is hashed byte for byte: capped,
    /// `1e-1125899906842625` and `1e-99999999999999999999999` shared a form.
    #[test]
    fn exact_exponents_beyond_2_to_the_50_are_not_canonical() {
        for body in [
            &b"[1e-1125899906842625]"[..],
            b"[1e-99999999999999999999999]",
        ] {
            assert_eq!(
                canonicalize_numbers(body, Numbers::Exact),
                None,
                "{}",
                text(body)
            );
        }
        assert_eq!(exact("[1e-1125899906842624]"), "[1e-1125899906842624]");
    }
}
