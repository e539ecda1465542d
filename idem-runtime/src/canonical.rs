//! RFC 8785, the JSON Canonicalization Scheme: one spelling for every
//! JSON text, the form [`Fingerprint`](crate::Fingerprint) hashes a JSON
//! body in.
//!
//! [`canonicalize`] writes members in the order of their names' UTF-16
//! code units, strings with only the escapes JSON requires, numbers as
//! ECMAScript prints the double, and no whitespace, so two spellings of
//! one value (key order, spacing, `1.0` and `1`, `"\u00e9"` and `"é"`)
//! have one canonical form:
//!
//! ```
//! # use idem_runtime as idem;
//! use idem::canonical::canonicalize;
//!
//! let a = canonicalize(br#"{"b": [1.0, 2e3], "a": "\u00e9"}"#)?;
//! let b = canonicalize(r#"{"a":"é", "b":[1, 2000]}"#.as_bytes())?;
//! assert_eq!(a, b);
//! assert_eq!(a, r#"{"a":"é","b":[1,2000]}"#.as_bytes());
//! # Ok::<(), idem::canonical::CanonicalError>(())
//! ```
//!
//! # Cost
//!
//! The text is read twice, with no parsed tree and without building the
//! form whole when it is hashed: a first pass checks it, counts the form's
//! length and finds the objects whose members are out of order; a second
//! writes the form, in order. Beside the text that costs 4 bytes per member
//! and 8 per object of the objects out of order, nothing for members
//! already in order (a serializer's field order, or sorted), nothing for
//! numbers however long they are written (`1e20` is 21 digits), plus 4
//! bytes per member of the objects open at once during the first pass.

// Inside the crate, both passes write to a `Sink` (a hash, or a `Vec` for
// `canonicalize`); members a handler's `fingerprint(exclude = [...])` names
// (`Exclusions`) are read and checked by both passes but written by
// neither.

use std::cmp::Ordering;

/// The RFC 8785 canonical form of a JSON text.
///
/// Members in the order of their names' UTF-16 code units, strings escaped
/// as JSON requires and no further, numbers as ECMAScript prints the
/// double, except integers beyond 2^53: those keep their digits, so two
/// integers a double cannot tell apart stay two values. Where serde_json's
/// `arbitrary_precision` is on in the build (any crate of it may turn it
/// on, so that handlers read a number's exact digits), a number with a
/// fraction or an exponent is written as its exact decimal value instead
/// (`1.000000000000000001` is not `1`; `1.50` is `1.5`).
///
/// # Errors
///
/// [`CanonicalError`] for a text that is not JSON, and for what serde_json
/// refuses to read (nesting deeper than 127, a lone surrogate, a number
/// beyond the doubles); also for an object naming one member twice, whose
/// meaning JSON leaves open (parsers disagree on which of the two counts),
/// and for a text of 512 MiB or more. [`Fingerprint`](crate::Fingerprint)
/// hashes such a body byte for byte.
///
/// ```
/// # use idem_runtime as idem;
/// use idem::canonical::canonicalize;
///
/// let canonical = canonicalize(br#"{ "b": [1.0, 2e3], "a": "\u00e9" }"#).unwrap();
/// assert_eq!(canonical, r#"{"a":"é","b":[1,2000]}"#.as_bytes());
/// assert_eq!(canonicalize(b"[9007199254740993]").unwrap(), b"[9007199254740993]");
/// assert!(canonicalize(br#"{"a": 1, "a": 2}"#).is_err());
/// assert!(canonicalize(b"{").is_err());
/// ```
pub fn canonicalize(json: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    canonicalize_numbers(json, Numbers::of_this_build()).ok_or(CanonicalError)
}

/// Why [`canonicalize`] gave no canonical form: the text is not JSON that
/// RFC 8785 can write (see its errors). It carries no detail; the text is
/// the caller's to inspect (serde_json's error says where it stops
/// parsing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct CanonicalError;

impl std::fmt::Display for CanonicalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not JSON that RFC 8785 can canonicalize")
    }
}

impl std::error::Error for CanonicalError {}

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
    canonicalize_excluding(body, numbers, Exclusions::NONE)
}

/// The canonical form without the members `exclude` names.
pub(crate) fn canonicalize_excluding(
    body: &[u8],
    numbers: Numbers,
    exclude: &Exclusions,
) -> Option<Vec<u8>> {
    let canonical = Canonical::read_excluding(body, numbers, exclude)?;
    let mut out = Vec::with_capacity(canonical.len());
    canonical.write(&mut out)?;
    debug_assert_eq!(out.len(), canonical.len());
    Some(out)
}

/// Where the canonical form goes, piece by piece and in order.
pub(crate) trait Sink {
    fn put(&mut self, bytes: &[u8]);

    fn byte(&mut self, byte: u8) {
        self.put(&[byte]);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn byte(&mut self, byte: u8) {
        self.push(byte);
    }
}

/// The walk's sink: passes on what it is given unless it is muted, as it
/// is over the members a pointer excludes (still read, and so checked).
struct Out<'w, S: Sink> {
    sink: &'w mut S,
    muted: bool,
}

impl<S: Sink> Sink for Out<'_, S> {
    fn put(&mut self, bytes: &[u8]) {
        if !self.muted {
            self.sink.put(bytes);
        }
    }

    fn byte(&mut self, byte: u8) {
        if !self.muted {
            self.sink.byte(byte);
        }
    }
}

/// Members left out of the canonical form: RFC 6901 JSON Pointers, each
/// as its reference tokens.
#[derive(Default)]
pub(crate) struct Exclusions {
    pointers: Vec<Vec<Token>>,
}

static NO_EXCLUSIONS: Exclusions = Exclusions {
    pointers: Vec::new(),
};

/// One reference token of a pointer: the member name it matches, as
/// [`Walk::string`] writes a name (so `"\u0061"` in a body is `a`), and
/// the array index it matches, if it spells one.
struct Token {
    name: Vec<u8>,
    index: Option<usize>,
}

impl Exclusions {
    /// No member left out.
    pub(crate) const NONE: &'static Self = &NO_EXCLUSIONS;

    /// The pointers, as `#[idempotent]` has checked them. One that is not
    /// a pointer to a member or element (not starting with `/`: the root
    /// `""` would exclude the whole body) is ignored; a `~` that is not
    /// `~0` or `~1` is taken as it is.
    pub(crate) fn new(pointers: &[&str]) -> Self {
        let pointers = pointers
            .iter()
            .filter_map(|pointer| pointer.strip_prefix('/'))
            .map(|pointer| pointer.split('/').map(Token::new).collect())
            .collect();
        Self { pointers }
    }
}

impl Token {
    fn new(escaped: &str) -> Self {
        let text = escaped.replace("~1", "/").replace("~0", "~");
        let mut name = vec![b'"'];
        for char in text.chars() {
            write_char(char, &mut name);
        }
        name.push(b'"');
        // RFC 6901's array-index: `0`, or digits without a leading zero.
        let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
        let index = (digits && (text == "0" || !text.starts_with('0')))
            .then(|| text.parse().ok())
            .flatten();
        Self { name, index }
    }
}

/// Where a member or an element is in its container.
#[derive(Clone, Copy)]
enum Step {
    /// A member, by the offset of its name's opening quote.
    Name(usize),
    Index(usize),
}

/// The first pass's sink: the length of what it was given.
struct Count(usize);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }

    fn byte(&mut self, _: u8) {
        self.0 += 1;
    }
}

/// A JSON text, checked, with its canonical length and the order of the
/// members of its objects that are out of order: what writing its
/// canonical form needs.
pub(crate) struct Canonical<'a> {
    text: &'a [u8],
    numbers: Numbers,
    exclude: &'a Exclusions,
    len: usize,
    order: Order,
}

impl<'a> Canonical<'a> {
    /// The first pass. `None` if the text is not JSON that RFC 8785 can
    /// write (see [`canonicalize`]).
    #[cfg(test)]
    pub(crate) fn read(text: &'a [u8], numbers: Numbers) -> Option<Self> {
        Self::read_excluding(text, numbers, Exclusions::NONE)
    }

    /// The first pass, leaving out the members `exclude` names.
    pub(crate) fn read_excluding(
        text: &'a [u8],
        numbers: Numbers,
        exclude: &'a Exclusions,
    ) -> Option<Self> {
        if text.len() > MAX_BODY {
            return None;
        }
        let mut count = Count(0);
        let mut walk = Walk {
            text,
            at: 0,
            numbers,
            sink: Out {
                sink: &mut count,
                muted: false,
            },
            objects: Objects::Find(Finder::default()),
            live: exclude.pointers.iter().map(Vec::as_slice).collect(),
        };
        walk.value(0)?;
        walk.skip_whitespace();
        (walk.at == text.len()).then_some(())?;
        let Objects::Find(Finder { mut order, .. }) = walk.objects else {
            unreachable!("the first pass finds")
        };
        order.objects.sort_unstable_by_key(|&(open, _)| open);
        Some(Self {
            text,
            numbers,
            exclude,
            len: count.0,
            order,
        })
    }

    /// The canonical form's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The second pass: writes the canonical form to `sink`, [`len`]
    /// bytes. `None` only if the first pass was wrong about the text (it
    /// reads it the same way), and then `sink` has part of the form.
    ///
    /// [`len`]: Self::len
    pub(crate) fn write<S: Sink>(&self, sink: &mut S) -> Option<()> {
        let mut walk = Walk {
            text: self.text,
            at: 0,
            numbers: self.numbers,
            sink: Out { sink, muted: false },
            objects: Objects::Follow(&self.order, 0),
            live: self.exclude.pointers.iter().map(Vec::as_slice).collect(),
        };
        walk.value(0)
    }

    /// What the first pass kept, in bytes written: the bookkeeping a body
    /// costs. (A `Vec` reserves up to twice what it holds, untouched.)
    #[cfg(test)]
    fn order_bytes(&self) -> usize {
        self.order.objects.len() * size_of::<(u32, u32)>()
            + self.order.names.len() * size_of::<u32>()
    }
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

/// Offsets are kept in 31 bits (the 32nd is [`FIRST`]); a longer body is
/// hashed byte for byte. (The bound, an eighth of 4 GiB, is the one of the
/// writer that kept the form whole.)
const MAX_BODY: usize = u32::MAX as usize / 8;

/// Marks the first member of an object in [`Order::names`].
const FIRST: u32 = 1 << 31;

/// The objects whose members are not in canonical order, and their order.
/// Every other object is written as it comes.
#[derive(Default)]
struct Order {
    /// Each such object's offset (its `{`) and where its members start in
    /// `names`, by offset.
    objects: Vec<(u32, u32)>,
    /// The members of those objects, each object's in canonical order and
    /// the first of each marked [`FIRST`]: the offsets of their names'
    /// opening quotes.
    names: Vec<u32>,
}

/// What [`Walk::name_at`] follows: it reads no object.
static NO_ORDER: Order = Order {
    objects: Vec::new(),
    names: Vec::new(),
};

impl Order {
    /// Where the object at `open` is in `objects`, or where it would be:
    /// looked for at `hint` first, where the previous object's search
    /// ended, since the second pass meets objects in the text's order
    /// except inside one whose members it reorders.
    fn find(&self, open: u32, hint: usize) -> Result<usize, usize> {
        let at = |index: usize| self.objects.get(index).map(|&(at, _)| at);
        match (hint.checked_sub(1).and_then(at), at(hint)) {
            (_, Some(here)) if here == open => Ok(hint),
            (before, after) if before < Some(open) && after.is_none_or(|after| open < after) => {
                Err(hint)
            }
            _ => self.objects.binary_search_by_key(&open, |&(at, _)| at),
        }
    }
}

/// The first pass's bookkeeping for objects.
#[derive(Default)]
struct Finder {
    order: Order,
    /// The names of the members of the objects being read, innermost
    /// object last.
    open: Vec<u32>,
}

impl Finder {
    /// The object at `open` has been read, its members' names from
    /// `self.open[first..]`: keeps their order if they are out of it.
    /// `None` if the object names a member twice.
    fn close(&mut self, text: &[u8], open: usize, first: usize) -> Option<()> {
        let these = &mut self.open[first..];
        if !these
            .windows(2)
            .all(|pair| name_order(text, pair[0], pair[1]).is_lt())
        {
            these.sort_unstable_by(|&a, &b| name_order(text, a, b));
            if these
                .windows(2)
                .any(|pair| name_order(text, pair[0], pair[1]).is_eq())
            {
                return None;
            }
            let start = self.order.names.len();
            // In range: offsets are below MAX_BODY, so is their count.
            self.order.objects.push((open as u32, start as u32));
            self.order.names.extend_from_slice(these);
            self.order.names[start] |= FIRST;
        }
        self.open.truncate(first);
        Some(())
    }
}

/// What a pass does with objects: the first finds the ones out of order,
/// the second follows what it found (where in `objects` to look first).
enum Objects<'w> {
    Find(Finder),
    Follow(&'w Order, usize),
}

/// Reads JSON text at `at` and writes its canonical form to `sink`.
struct Walk<'a, 'w, S: Sink> {
    text: &'a [u8],
    at: usize,
    numbers: Numbers,
    sink: Out<'w, S>,
    objects: Objects<'w>,
    /// What is left of the pointers that lead into the value being read:
    /// each one's tokens past the containers it is in.
    live: Vec<&'a [Token]>,
}

impl<'a, S: Sink> Walk<'a, '_, S> {
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
            b'"' => self.string(),
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
        self.sink.put(word);
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.at += 1;
        self.sink.byte(b'[');
        self.skip_whitespace();
        if self.peek()? == b']' {
            self.at += 1;
        } else {
            let mut written = false;
            for index in 0.. {
                self.skip_whitespace();
                self.followed(Step::Index(index), &mut written, |walk| walk.value(depth))?;
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b']' => break,
                    _ => return None,
                }
            }
        }
        self.sink.byte(b']');
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        let open = self.at;
        self.at += 1;
        self.sink.byte(b'{');
        let first = match &mut self.objects {
            Objects::Find(finder) => finder.open.len(),
            &mut Objects::Follow(order, ref mut next) => {
                let found = order.find(open as u32, *next);
                *next = found.unwrap_or_else(|at| at);
                if let Ok(found) = found {
                    *next += 1;
                    return self.reordered(order, order.objects[found].1 as usize, depth);
                }
                0
            }
        };
        self.skip_whitespace();
        if self.peek()? == b'}' {
            self.at += 1;
        } else {
            let mut written = false;
            loop {
                self.skip_whitespace();
                let name = self.at;
                self.followed(Step::Name(name), &mut written, |walk| walk.member(depth))?;
                if let Objects::Find(finder) = &mut self.objects {
                    finder.open.push(name as u32);
                }
                self.skip_whitespace();
                match self.next()? {
                    b',' => {}
                    b'}' => break,
                    _ => return None,
                }
            }
            if let Objects::Find(finder) = &mut self.objects {
                finder.close(self.text, open, first)?;
            }
        }
        self.sink.byte(b'}');
        Some(())
    }

    /// The members of an object out of order, past its `{`: in the order
    /// the first pass found, from `order.names[start]`; then past its `}`.
    fn reordered(&mut self, order: &Order, start: usize, depth: usize) -> Option<()> {
        // Past the member that came last in the text is the `}`.
        let mut end = self.at;
        let mut written = false;
        for (index, &name) in order.names[start..].iter().enumerate() {
            if index > 0 && name & FIRST != 0 {
                break;
            }
            self.at = (name & !FIRST) as usize;
            self.followed(Step::Name(self.at), &mut written, |walk| walk.member(depth))?;
            end = end.max(self.at);
        }
        self.at = end;
        self.skip_whitespace();
        (self.next()? == b'}').then_some(())?;
        self.sink.byte(b'}');
        Some(())
    }

    /// Reads a member or element with `read`, written after a comma if
    /// one was `written` before it, or muted if a pointer excludes it; the
    /// pointers that go on into it followed while it is read.
    fn followed(
        &mut self,
        step: Step,
        written: &mut bool,
        read: impl FnOnce(&mut Self) -> Option<()>,
    ) -> Option<()> {
        let (excluded, inner) = self.follow(step)?;
        let outer = std::mem::replace(&mut self.live, inner);
        let muted = self.sink.muted;
        if excluded {
            self.sink.muted = true;
        } else if *written {
            self.sink.byte(b',');
        }
        let read = read(self);
        self.sink.muted = muted;
        self.live = outer;
        *written |= !excluded;
        read
    }

    /// Whether a live pointer ends at `step`, and the ones that go on
    /// past it. Free when no pointer leads here.
    fn follow(&self, step: Step) -> Option<(bool, Vec<&'a [Token]>)> {
        if self.live.is_empty() {
            return Some((false, Vec::new()));
        }
        let name = match step {
            Step::Name(at) => Some(self.name_at(at)?),
            Step::Index(_) => None,
        };
        let matches = |token: &Token| match (step, &name) {
            (Step::Name(_), Some(name)) => token.name == *name,
            (Step::Index(index), _) => token.index == Some(index),
            _ => false,
        };
        let mut inner = Vec::new();
        for tokens in &self.live {
            let Some((first, rest)) = tokens.split_first() else {
                continue;
            };
            if matches(first) {
                if rest.is_empty() {
                    return Some((true, Vec::new()));
                }
                inner.push(rest);
            }
        }
        Some((false, inner))
    }

    /// The name at `at` as [`string`](Self::string) writes it.
    fn name_at(&self, at: usize) -> Option<Vec<u8>> {
        let mut name = Vec::new();
        let mut walk = Walk {
            text: self.text,
            at,
            numbers: self.numbers,
            sink: Out {
                sink: &mut name,
                muted: false,
            },
            objects: Objects::Follow(&NO_ORDER, 0),
            live: Vec::new(),
        };
        (walk.peek()? == b'"').then_some(())?;
        walk.string()?;
        Some(name)
    }

    /// `"name":value`, from the name's opening quote.
    fn member(&mut self, depth: usize) -> Option<()> {
        if self.peek()? != b'"' {
            return None;
        }
        self.string()?;
        self.skip_whitespace();
        (self.next()? == b':').then_some(())?;
        self.sink.byte(b':');
        self.value(depth)
    }

    /// A string from its opening quote, written as RFC 8785 writes it: `"`
    /// and `\` escaped, control characters as their short escapes or
    /// `\u00xx`, everything else (`/`, DEL, any non-ASCII) as it is. `None`
    /// for what JSON forbids: raw control characters, bad escapes, lone
    /// surrogates, bytes that are not UTF-8.
    fn string(&mut self) -> Option<()> {
        let text = self.text;
        self.at += 1;
        self.sink.byte(b'"');
        loop {
            let start = self.at;
            let (end, ascii) = plain_run(text, start);
            self.at = end;
            // Escapes end with a whole character, so the text between them
            // is UTF-8 if the string is; ASCII is.
            let plain = &text[start..end];
            if !ascii {
                std::str::from_utf8(plain).ok()?;
            }
            self.sink.put(plain);
            match self.next()? {
                b'"' => break,
                b'\\' => {
                    let char = match self.next()? {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.escaped_char()?,
                        _ => return None,
                    };
                    write_char(char, &mut self.sink);
                }
                _ => return None,
            }
        }
        self.sink.byte(b'"');
        Some(())
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
        hex4(digits)
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
                b"-0" => self.sink.byte(b'0'),
                _ => self.sink.put(number),
            }
        } else if self.numbers == Numbers::Exact {
            write_decimal(negative, int, fraction, exponent, &mut self.sink)?;
        } else {
            write_double(double, &mut self.sink);
        }
        Some(())
    }
}

/// The bytes a string holds as they are: all but `"`, `\` and controls.
static PLAIN: [bool; 256] = {
    let mut plain = [true; 256];
    let mut byte = 0;
    while byte < 0x20 {
        plain[byte] = false;
        byte += 1;
    }
    plain[b'"' as usize] = false;
    plain[b'\\' as usize] = false;
    plain
};

/// Where the run of [`PLAIN`] bytes from `at` ends, and whether it is
/// ASCII. Eight bytes at a time while none of them ends it.
fn plain_run(text: &[u8], mut at: usize) -> (usize, bool) {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // Whether a byte of `word` is below `n` (n <= 0x80): exact as a whole.
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGH;
    let mut high = 0;
    while let Some(chunk) = text.get(at..at + 8) {
        let word = u64::from_ne_bytes(chunk.try_into().expect("eight bytes"));
        let ends = below(word, 0x20)
            | below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1);
        if ends != 0 {
            break;
        }
        high |= word & HIGH;
        at += 8;
    }
    let mut bits = 0;
    while let Some(&byte) = text.get(at)
        && PLAIN[usize::from(byte)]
    {
        bits |= byte;
        at += 1;
    }
    (at, high == 0 && bits < 0x80)
}

fn hex4(digits: &[u8]) -> Option<u16> {
    digits.iter().try_fold(0, |code, &digit| {
        let digit = char::from(digit).to_digit(16)?;
        Some(code << 4 | digit as u16)
    })
}

/// A character of a string, as RFC 8785 writes it (see [`Walk::string`]).
fn write_char<S: Sink + ?Sized>(char: char, out: &mut S) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let short: &[u8] = match char {
        '"' => b"\\\"",
        '\\' => b"\\\\",
        '\u{8}' => b"\\b",
        '\u{c}' => b"\\f",
        '\n' => b"\\n",
        '\r' => b"\\r",
        '\t' => b"\\t",
        '\0'..='\u{1f}' => {
            let byte = char as u8;
            &[
                b'\\',
                b'u',
                b'0',
                b'0',
                DIGITS[usize::from(byte >> 4)],
                DIGITS[usize::from(byte & 0xf)],
            ]
        }
        _ => return out.put(char.encode_utf8(&mut [0; 4]).as_bytes()),
    };
    out.put(short);
}

/// The digits of a number's integer part then of its fraction, as one run.
#[derive(Clone, Copy)]
struct Digits<'a> {
    int: &'a [u8],
    fraction: &'a [u8],
}

impl Digits<'_> {
    fn len(&self) -> usize {
        self.int.len() + self.fraction.len()
    }

    fn all(&self) -> impl DoubleEndedIterator<Item = &u8> {
        self.int.iter().chain(self.fraction)
    }

    /// Writes the digits `from..to`.
    fn write<S: Sink + ?Sized>(&self, from: usize, to: usize, out: &mut S) {
        let split = self.int.len();
        if from < split {
            out.put(&self.int[from..to.min(split)]);
        }
        if to > split {
            out.put(&self.fraction[from.max(split) - split..to - split]);
        }
    }
}

/// Writes a JSON number that has a fraction or an exponent as ECMAScript
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
fn write_decimal<S: Sink + ?Sized>(
    negative: bool,
    int: &[u8],
    fraction: &[u8],
    exponent: Option<&[u8]>,
    out: &mut S,
) -> Option<()> {
    // The value is `digits` x 10^(exponent - fraction.len()), its digits
    // the integer's and the fraction's, less leading and trailing zeros.
    let digits = Digits { int, fraction };
    let Some(first) = digits.all().position(|&digit| digit != b'0') else {
        out.byte(b'0');
        return Some(());
    };
    let last = digits.len()
        - 1
        - digits
            .all()
            .rev()
            .position(|&digit| digit != b'0')
            .unwrap_or(0);
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
    let k = (last + 1 - first) as i64;
    // ECMAScript's n: the value is 0.significant x 10^n.
    let n = k + exponent - fraction.len() as i64 + (digits.len() - 1 - last) as i64;
    if negative {
        out.byte(b'-');
    }
    // At most 20 zeros: after the digits up to n <= 21, or 5 after `0.`.
    let zeros = |out: &mut S, count: i64| out.put(&[b'0'; 21][..count as usize]);
    let end = last + 1;
    if k <= n && n <= 21 {
        digits.write(first, end, out);
        zeros(out, n - k);
    } else if 0 < n && n <= 21 {
        let point = first + n as usize;
        digits.write(first, point, out);
        out.byte(b'.');
        digits.write(point, end, out);
    } else if -6 < n && n <= 0 {
        out.put(b"0.");
        zeros(out, -n);
        digits.write(first, end, out);
    } else {
        digits.write(first, first + 1, out);
        if k > 1 {
            out.byte(b'.');
            digits.write(first + 1, end, out);
        }
        let e = n - 1;
        out.byte(b'e');
        out.byte(if e < 0 { b'-' } else { b'+' });
        write_integer(u128::from(e.unsigned_abs()), out);
    }
    Some(())
}

/// Writes a finite double as RFC 8785 writes it, except one beyond 2^53
/// (and below 10^21, where RFC 8785 still writes digits): its exact
/// integer digits. Every double there is an integer, and RFC 8785's
/// shortest form pads it with zeros into what can be another integer's
/// digits: `1152921504606846976.0` (2^60) would be written
/// `1152921504606847000`, the form of the integer 1152921504606847000,
/// whose own digits idem keeps. With the exact digits, two spellings of
/// one number share a form, and two numbers never do.
fn write_double<S: Sink + ?Sized>(double: f64, out: &mut S) {
    let magnitude = double.abs();
    if magnitude > EXACT_INTEGERS && magnitude < EXPONENT_FORM {
        if double < 0.0 {
            out.byte(b'-');
        }
        // Exact: an integral double below 10^21 (< 2^70) fits a u128.
        write_integer(magnitude as u128, out);
    } else {
        out.put(ryu_js::Buffer::new().format_finite(double).as_bytes());
    }
}

/// Writes an integer's decimal digits, from a buffer on the stack.
fn write_integer<S: Sink + ?Sized>(mut value: u128, out: &mut S) {
    let mut digits = [0; 39];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    out.put(&digits[at..]);
}

/// RFC 8785's order of the member names at `a` and `b` (their opening
/// quotes) in `text`, strings already read: by their UTF-16 code units.
/// That is the order of their UTF-8 bytes up to where they first differ,
/// unless a character there is U+E000 or beyond (UTF-8 lead byte 0xEE or
/// above), where UTF-16's surrogates sort supplementary characters first;
/// or an escape comes first, which is read.
fn name_order(text: &[u8], a: u32, b: u32) -> Ordering {
    let (x, y) = (&text[a as usize + 1..], &text[b as usize + 1..]);
    for (&p, &q) in x.iter().zip(y) {
        match (p, q) {
            (b'\\', _) | (_, b'\\') => break,
            (b'"', b'"') => return Ordering::Equal,
            // A name that ends first, before any escape, is a prefix.
            (b'"', _) => return Ordering::Less,
            (_, b'"') => return Ordering::Greater,
            _ if p == q => {}
            _ if p < 0xee && q < 0xee => return p.cmp(&q),
            _ => break,
        }
    }
    Utf16 {
        text: x,
        at: 0,
        low: None,
    }
    .cmp(Utf16 {
        text: y,
        at: 0,
        low: None,
    })
}

/// The UTF-16 code units of a string that has been read, from past its
/// opening quote: what its escapes and its UTF-8 spell.
struct Utf16<'a> {
    text: &'a [u8],
    at: usize,
    /// The second half of a surrogate pair, next.
    low: Option<u16>,
}

impl Iterator for Utf16<'_> {
    type Item = u16;

    fn next(&mut self) -> Option<u16> {
        if let Some(low) = self.low.take() {
            return Some(low);
        }
        let text = &self.text[self.at..];
        let (unit, len) = match *text.first()? {
            b'"' => return None,
            // `\uXXXX` is a UTF-16 code unit already, and a surrogate pair
            // two escapes.
            b'\\' => match *text.get(1)? {
                b'u' => (hex4(text.get(2..6)?)?, 6),
                b'b' => (0x08, 2),
                b'f' => (0x0c, 2),
                b'n' => (0x0a, 2),
                b'r' => (0x0d, 2),
                b't' => (0x09, 2),
                other => (u16::from(other), 2),
            },
            lead => {
                let len = match lead {
                    0x00..=0x7f => 1,
                    0xc0..=0xdf => 2,
                    0xe0..=0xef => 3,
                    _ => 4,
                };
                let char = std::str::from_utf8(text.get(..len)?).ok()?.chars().next()?;
                let mut units = [0; 2];
                let units = char.encode_utf16(&mut units);
                self.low = units.get(1).copied();
                (units[0], len)
            }
        };
        self.at += len;
        Some(unit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`super::canonicalize`] as an `Option`, as the oracle returns it.
    fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
        super::canonicalize(body).ok()
    }

    /// The canonicaliser this one replaced (through `serde_json::Value`),
    /// kept as an oracle: keys claimed before an upgrade must keep their
    /// fingerprints after it.
    mod previous {
        use serde_json::Value;
        use serde_json::value::RawValue;

        // Unchanged by the one-pass writer: shared, so that what the oracle
        // checks is the rest (the traversal, the order, the strings).
        use super::super::write_double;

        /// A JSON string as RFC 8785 writes it: `"` and `\` escaped, control
        /// characters as their short escapes or `\u00xx`, everything else
        /// (`/`, DEL, any non-ASCII) as it is. (The one-pass writer's until
        /// it wrote strings from their escaped text.)
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

    /// The fingerprint hashes the form in pieces as it is written, never
    /// whole: the digest of the canonical bytes framed as ever, for
    /// bodies from a fixed seed, and for long ones whose pieces cross the
    /// hasher's 4 KiB blocks or are longer than one.
    #[test]
    fn the_fingerprint_hashes_the_canonical_form() {
        use http::{HeaderMap, Method, header::CONTENT_TYPE};
        use sha2::{Digest, Sha256};

        let json = HeaderMap::from_iter([(CONTENT_TYPE, "application/json".parse().unwrap())]);
        let framed = |canonical: &[u8]| {
            let mut hasher = Sha256::new();
            hasher.update(b"idem-fingerprint-v1");
            for part in [&b"POST"[..], b"/f"] {
                hasher.update((part.len() as u64).to_be_bytes());
                hasher.update(part);
            }
            hasher.update([0]);
            hasher.update(b"json");
            hasher.update((canonical.len() as u64).to_be_bytes());
            hasher.update(canonical);
            <[u8; 32]>::from(hasher.finalize())
        };
        let mut rng = StdRng::seed_from_u64(25);
        let mut bodies = Vec::new();
        for _ in 0..2000 {
            let mut body = String::new();
            value(&mut rng, 0, &mut body);
            bodies.push(body);
        }
        for size in [5_000, 70_000, 300_000] {
            let mut body = String::from("{");
            let mut member = 0;
            while body.len() < size {
                let long = "\u{e9}\\n".repeat(rng.random_range(0..2000));
                body.push_str(&format!("\"m{}\":[\"{long}\",", 99_999 - member));
                value(&mut rng, 1, &mut body);
                body.push_str("],");
                member += 1;
            }
            body.push_str("\"\":0}");
            bodies.push(body);
        }
        let mut canonical = 0;
        for body in &bodies {
            let fingerprint = crate::fingerprint::Fingerprint::of(
                &Method::POST,
                "/f",
                None,
                &json,
                body.as_bytes(),
            );
            if let Some(form) = canonicalize(body.as_bytes()) {
                assert_eq!(fingerprint.as_bytes(), &framed(&form), "{body}");
                canonical += 1;
            }
        }
        assert!(canonical > 1000, "{canonical}");
    }

    /// What a body costs beside itself: nothing for numbers however they
    /// are spelt, nor for objects in order; for objects out of order at
    /// most about 1.25 times the body, in the shape that costs most (two
    /// members, as short as can be, per object).
    #[test]
    fn bookkeeping_is_at_most_about_the_body() {
        let array = |item: &str, count: usize| format!("[{}]", vec![item; count].join(","));
        let reversed = (0..20_000)
            .rev()
            .map(|name| format!("\"{name:x}\":0"))
            .collect::<Vec<_>>()
            .join(",");
        let items = (0..3000)
            .map(|i| {
                format!(
                    r#"{{"sku":"sku-{i:06}","amount":{},"note":"line item {i}"}}"#,
                    1000 + i
                )
            })
            .collect::<Vec<_>>()
            .join(",");
        for (shape, body, most) in [
            ("1e20s", array("1e20", 100_000), 0.0),
            (
                "in order",
                array(r#"{"amount":1,"currency":"eur"}"#, 10_000),
                0.0,
            ),
            ("tiny pairs", array(r#"{"a":0,"":0}"#, 10_000), 1.25),
            ("one object", format!("{{{reversed}}}"), 0.6),
            ("line items", format!("[{items}]"), 0.4),
        ] {
            let canonical = Canonical::read(body.as_bytes(), Numbers::Doubles).unwrap();
            let share = canonical.order_bytes() as f64 / body.len() as f64;
            assert!(share <= most, "{shape}: {share:.2} of the body");
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
            "a\n",
            "a\"",
            "a/",
            "a\u{1f600}b",
            "a\u{ffff}",
        ];
        // As written (escaping only what must be), with every character
        // escaped as `\uXXXX` (a surrogate pair beyond U+FFFF), and with
        // the short escapes `\n`, `\"`, `\/` where they apply.
        let spellings = |name: &str| {
            let escaped = |short: bool| {
                name.chars()
                    .map(|char| match char {
                        '\n' if short => "\\n".to_owned(),
                        '"' if short => "\\\"".to_owned(),
                        '/' if short => "\\/".to_owned(),
                        _ => char
                            .encode_utf16(&mut [0; 2])
                            .iter()
                            .map(|unit| format!("\\u{unit:04x}"))
                            .collect(),
                    })
                    .collect::<String>()
            };
            [
                name.replace('\n', "\\n").replace('"', "\\\""),
                escaped(false),
                escaped(true),
            ]
        };
        for a in names {
            for b in names {
                for x in spellings(a) {
                    for y in spellings(b) {
                        let text = format!("\"{x}\"\"{y}\"");
                        assert_eq!(
                            name_order(text.as_bytes(), 0, x.len() as u32 + 2),
                            a.encode_utf16().cmp(b.encode_utf16()),
                            "{x} {y}"
                        );
                    }
                }
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
