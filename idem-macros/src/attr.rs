//! Parsing `#[idempotent(...)]`'s arguments: one slot per key.

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprArray, ExprLit, Ident, Lit, LitStr, MetaNameValue, Token, token};

use crate::duration::{
    MAX_LEASE_MS, MAX_TIMEOUT_MS, MAX_TOMBSTONE_MS, MAX_TTL_MS, MAX_WAIT_MS, MIN_LEASE_MS,
    parse_ms, respelled,
};
use crate::errors::Errors;

const KEYS: &[&str] = &[
    "scope",
    "ttl",
    "tombstone",
    "key",
    "wait",
    "timeout",
    "lease",
    "fingerprint",
    "crate",
];
const VALID_KEYS: &str = "valid arguments are `scope`, `ttl`, `tombstone`, `key`, `wait`, \
                          `timeout`, `lease`, `fingerprint` and `crate`";

/// The keys whose value is a duration.
const DURATION_KEYS: &[&str] = &["ttl", "tombstone", "wait", "timeout", "lease"];

/// How `fingerprint` is written.
const FINGERPRINT: &str = "fingerprint(exclude = [\"/member\", ...])";

/// The default `ttl`: 24 hours.
pub const DEFAULT_TTL_MS: u64 = 24 * 60 * 60 * 1000;

/// The default `timeout`: 30 seconds.
pub const DEFAULT_TIMEOUT_MS: u64 = 30 * 1000;

/// The default `lease` of a phased handler: 30 seconds.
pub const DEFAULT_LEASE_MS: u64 = 30 * 1000;

/// Whether requests must carry a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyMode {
    Required,
    Optional,
}

/// The parsed arguments; every slot set at most once.
#[derive(Default)]
pub struct Args {
    pub scope: Option<LitStr>,
    /// Whether `scope` was written, even wrongly (or as a bare string):
    /// only an absent `scope` is reported as missing.
    pub scope_written: bool,
    pub ttl: Option<(u64, Span)>,
    /// How long a key outlives its `ttl` as a tombstone; `None`: not at all.
    pub tombstone: Option<(u64, Span)>,
    pub wait: Option<(u64, Span)>,
    pub timeout: Option<(u64, Span)>,
    pub lease: Option<(u64, Span)>,
    pub key: Option<KeyMode>,
    /// Where `key` was written, for errors about its combination with phases.
    pub key_span: Option<Span>,
    pub krate: Option<syn::Path>,
    /// `fingerprint(exclude = [...])`'s JSON Pointers, checked; empty
    /// without it.
    pub exclude: Vec<LitStr>,
}

impl Args {
    pub fn ttl_ms(&self) -> u64 {
        self.ttl.map_or(DEFAULT_TTL_MS, |(ms, _)| ms)
    }

    pub fn wait_ms(&self) -> u64 {
        self.wait.map_or(0, |(ms, _)| ms)
    }

    pub fn timeout_ms(&self) -> u64 {
        self.timeout.map_or(DEFAULT_TIMEOUT_MS, |(ms, _)| ms)
    }

    pub fn lease_ms(&self) -> u64 {
        self.lease.map_or(DEFAULT_LEASE_MS, |(ms, _)| ms)
    }

    /// Fills the slot of a known `key` written once, from its value.
    fn set(&mut self, key: &str, value: Value) -> syn::Result<()> {
        let value = match (key, value) {
            ("fingerprint", Value::List(span, tokens)) => {
                self.exclude = fingerprint(span, tokens)?;
                return Ok(());
            }
            ("fingerprint", Value::Expr(value)) => {
                return Err(syn::Error::new(
                    value_span(&value),
                    format!("`fingerprint` takes a list: write `{FINGERPRINT}`"),
                ));
            }
            (_, Value::Expr(value)) => value,
            (_, Value::List(span, _)) => unreachable!("only `fingerprint` at {span:?} is a list"),
        };
        let value = &value;
        match key {
            "scope" => self.scope = Some(scope(value)?),
            "ttl" => self.ttl = Some((duration(key, value)?, value_span(value))),
            "tombstone" => self.tombstone = Some((duration(key, value)?, value_span(value))),
            "wait" => self.wait = Some((duration(key, value)?, value_span(value))),
            "timeout" => self.timeout = Some((duration(key, value)?, value_span(value))),
            "lease" => self.lease = Some((duration(key, value)?, value_span(value))),
            "key" => {
                self.key = Some(key_mode(value)?);
                self.key_span = Some(value_span(value));
            }
            _ => self.krate = Some(krate(value)?),
        }
        Ok(())
    }
}

/// One argument as written: the key it names, if it names one, and its
/// value or what is wrong with it.
struct Piece {
    name: Option<Ident>,
    /// A bare string literal, which can only have meant the `scope`.
    positional: bool,
    value: syn::Result<Value>,
}

/// What follows an argument's name.
enum Value {
    /// `name = value`.
    Expr(Expr),
    /// `fingerprint(...)`: where the parentheses are, and what is in them.
    List(Span, TokenStream),
}

impl Piece {
    fn parse(chunk: TokenStream) -> Self {
        let (mut name, mut positional) = (None, false);
        let parser = |input: ParseStream<'_>| -> syn::Result<Value> {
            if input.peek(LitStr) {
                positional = true;
                let lit: LitStr = input.parse()?;
                return Err(syn::Error::new(
                    lit.span(),
                    format!(
                        "arguments are named: write `scope = \"{}\"`; {VALID_KEYS}",
                        lit.value()
                    ),
                ));
            }
            let ident = Ident::parse_any(input)?;
            name = Some(ident.clone());
            let list = ident.unraw() == "fingerprint";
            if list && input.peek(token::Paren) {
                let content;
                let paren = syn::parenthesized!(content in input);
                return Ok(Value::List(paren.span.join(), content.parse()?));
            }
            if list && !input.peek(Token![=]) {
                return Err(syn::Error::new(
                    ident.span(),
                    format!("expected `{FINGERPRINT}`"),
                ));
            }
            if !input.peek(Token![=]) {
                return Err(syn::Error::new(
                    ident.span(),
                    format!("expected `{ident} = \"...\"`; {VALID_KEYS}"),
                ));
            }
            input.parse::<Token![=]>()?;
            input.parse().map(Value::Expr)
        };
        let value = parser.parse2(chunk);
        Self {
            name,
            positional,
            value,
        }
    }
}

/// Parses the attribute's tokens, collecting every error rather than
/// stopping at the first.
pub fn parse(tokens: TokenStream, errors: &mut Errors) -> Args {
    let mut args = Args::default();
    // Keys written so far, even with a wrong value: a second one is a
    // duplicate whether or not the first could be used.
    let mut seen: Vec<String> = Vec::new();
    for chunk in split_commas(tokens, errors) {
        let Piece {
            name,
            positional,
            value,
        } = Piece::parse(chunk);
        args.scope_written |= positional;
        let Some(name) = name else {
            // Not even a key to tell which argument it meant.
            if let Err(error) = value {
                errors.push(error);
            }
            continue;
        };
        let key = name.unraw().to_string();
        if !KEYS.contains(&key.as_str()) {
            errors.push(syn::Error::new(
                name.span(),
                format!("unknown argument `{key}`; {VALID_KEYS}"),
            ));
            continue;
        }
        if seen.contains(&key) {
            errors.push(syn::Error::new(
                name.span(),
                format!("`{key}` set multiple times"),
            ));
            continue;
        }
        args.scope_written |= key == "scope";
        if let Err(error) = value.and_then(|value| args.set(&key, value)) {
            errors.push(error);
        }
        seen.push(key);
    }
    if let (Some((ttl, _)), Some((wait, span))) = (args.ttl, args.wait)
        && wait > ttl
    {
        errors.push(syn::Error::new(
            span,
            "`wait` is longer than `ttl`: a duplicate would outwait the key it is waiting for",
        ));
    }
    if let Some((tombstone, span)) = args.tombstone
        && tombstone <= args.ttl_ms()
    {
        errors.push(syn::Error::new(
            span,
            "`tombstone` must be longer than `ttl` (24h unless set): the tombstone is what \
             is left of a key after its `ttl`, until `tombstone` after its response",
        ));
    }
    args
}

/// The arguments between top-level commas, each parsed on its own so that
/// one malformed argument does not hide the errors of the others. One
/// trailing comma is fine; an empty argument is an error on its comma.
fn split_commas(tokens: TokenStream, errors: &mut Errors) -> Vec<TokenStream> {
    let mut chunks = Vec::new();
    let mut chunk = TokenStream::new();
    for token in tokens {
        match &token {
            TokenTree::Punct(punct) if punct.as_char() == ',' => {
                if chunk.is_empty() {
                    errors.push(syn::Error::new(
                        punct.span(),
                        "expected an argument before this `,`; remove the stray comma",
                    ));
                } else {
                    chunks.push(std::mem::take(&mut chunk));
                }
            }
            _ => chunk.extend([token]),
        }
    }
    if !chunk.is_empty() {
        chunks.push(chunk);
    }
    chunks
}

fn value_span(value: &Expr) -> Span {
    syn::spanned::Spanned::span(value)
}

/// The value as a string literal, or an error on it that says what to
/// write: a bare word or a number with a unit gets the quoted spelling.
fn string(key: &str, value: &Expr, expected: &str) -> syn::Result<LitStr> {
    let quoted = match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => return Ok(lit.clone()),
        Expr::Path(path) if path.qself.is_none() => Some(
            quote::ToTokens::to_token_stream(path)
                .to_string()
                .replace(' ', ""),
        ),
        Expr::Lit(ExprLit {
            lit: Lit::Int(int), ..
        }) if !int.suffix().is_empty() => Some(int.to_string()),
        Expr::Lit(ExprLit {
            lit: Lit::Float(float),
            ..
        }) if !float.suffix().is_empty() => Some(float.to_string()),
        _ => None,
    };
    // `ttl = 1day` is told the spelling that parses, not `"1day"`.
    let quoted = match quoted {
        Some(text) if DURATION_KEYS.contains(&key) => match respelled(&text) {
            Some(Ok(accepted)) => Some(accepted),
            _ => None,
        },
        quoted => quoted,
    };
    let message = match quoted {
        Some(text) => format!("`{key}` takes a string literal: write `{key} = \"{text}\"`"),
        None => format!("`{key}` takes a string literal: {expected}"),
    };
    Err(syn::Error::new(value_span(value), message))
}

fn scope(value: &Expr) -> syn::Result<LitStr> {
    string(
        "scope",
        value,
        "the name of the parameter that identifies the caller, e.g. `scope = \"account\"`",
    )
}

fn key_mode(value: &Expr) -> syn::Result<KeyMode> {
    let lit = string("key", value, "`key = \"required\"` or `key = \"optional\"`")?;
    match lit.value().as_str() {
        "required" => Ok(KeyMode::Required),
        "optional" => Ok(KeyMode::Optional),
        other => Err(syn::Error::new(
            lit.span(),
            format!("`key = \"{other}\"` is not a key mode: expected \"required\" or \"optional\""),
        )),
    }
}

fn krate(value: &Expr) -> syn::Result<syn::Path> {
    let lit = string(
        "crate",
        value,
        "the path of the `idem` crate, e.g. `crate = \"::my_idem\"`",
    )?;
    lit.parse::<syn::Path>().map_err(|_| {
        syn::Error::new(
            lit.span(),
            format!(
                "`crate = \"{}\"` is not a path to the `idem` crate, such as \"::my_idem\"",
                lit.value()
            ),
        )
    })
}

/// `fingerprint(exclude = [...])`'s pointers, from what is between its
/// parentheses (at `span`). Every error at once, each on its own token.
fn fingerprint(span: Span, tokens: TokenStream) -> syn::Result<Vec<LitStr>> {
    let arguments = Punctuated::<MetaNameValue, Token![,]>::parse_terminated.parse2(tokens)?;
    let mut errors: Option<syn::Error> = None;
    let mut push = |error: syn::Error| match &mut errors {
        Some(all) => all.combine(error),
        None => errors = Some(error),
    };
    let mut exclude: Option<Vec<LitStr>> = None;
    for argument in &arguments {
        let path = &argument.path;
        if !path.is_ident("exclude") {
            let name = quote::ToTokens::to_token_stream(path).to_string();
            push(syn::Error::new_spanned(
                path,
                format!(
                    "unknown `fingerprint` argument `{name}`; the only one is \
                     `exclude = [\"/member\", ...]`"
                ),
            ));
        } else if exclude.is_some() {
            push(syn::Error::new_spanned(
                path,
                "`exclude` set multiple times",
            ));
        } else {
            exclude = Some(pointers(&argument.value, &mut push));
        }
    }
    if let Some(errors) = errors {
        return Err(errors);
    }
    exclude.ok_or_else(|| {
        syn::Error::new(
            span,
            "`fingerprint(...)` needs `exclude = [\"/member\", ...]`: the JSON Pointers of \
             the members to leave out of the fingerprint",
        )
    })
}

/// `exclude`'s list: RFC 6901 JSON Pointers, each to a member (or an array
/// element), none twice.
fn pointers(value: &Expr, push: &mut impl FnMut(syn::Error)) -> Vec<LitStr> {
    let Expr::Array(ExprArray {
        elems,
        bracket_token,
        ..
    }) = value
    else {
        push(syn::Error::new(
            value_span(value),
            "`exclude` takes a list of JSON Pointers: `exclude = [\"/client_ts\"]`",
        ));
        return Vec::new();
    };
    if elems.is_empty() {
        push(syn::Error::new(
            bracket_token.span.join(),
            "`exclude` lists no member: list the JSON Pointers of the members to leave out \
             of the fingerprint, such as `exclude = [\"/client_ts\"]`, or remove \
             `fingerprint(...)`",
        ));
    }
    let mut found: Vec<LitStr> = Vec::new();
    for elem in elems {
        let Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) = elem
        else {
            push(syn::Error::new(
                value_span(elem),
                "a JSON Pointer is a string literal, such as \"/client_ts\"",
            ));
            continue;
        };
        let pointer = lit.value();
        let problem = if pointer.is_empty() {
            Some(
                "`\"\"` is the whole body: a fingerprint without the body would replay any \
                 other request with the key; name the members to leave out, such as \
                 \"/client_ts\""
                    .to_owned(),
            )
        } else if !pointer.starts_with('/') {
            Some(format!(
                "`{pointer}` is not a JSON Pointer: one starts with `/`, as in \"/{pointer}\""
            ))
        } else if bad_escape(&pointer) {
            Some(format!(
                "`{pointer}` is not a JSON Pointer: `~` is written `~0`, and `/` in a name \
                 `~1` (RFC 6901)"
            ))
        } else if found.iter().any(|seen| seen.value() == pointer) {
            Some(format!("`{pointer}` is listed twice"))
        } else {
            None
        };
        match problem {
            Some(message) => push(syn::Error::new(lit.span(), message)),
            None => found.push(lit.clone()),
        }
    }
    found
}

/// Whether a `~` is followed by anything but `0` or `1`.
fn bad_escape(pointer: &str) -> bool {
    let mut rest = pointer;
    while let Some(at) = rest.find('~') {
        rest = &rest[at + 1..];
        if !rest.starts_with(['0', '1']) {
            return true;
        }
    }
    false
}

fn duration(key: &str, value: &Expr) -> syn::Result<u64> {
    let example = match key {
        "ttl" => "24h",
        "tombstone" => "30d",
        "timeout" | "lease" => "30s",
        _ => "2s",
    };
    let lit = string(
        key,
        value,
        &format!("a duration such as `{key} = \"{example}\"`"),
    )?;
    let ms = parse_ms(&lit.value()).map_err(|message| syn::Error::new(lit.span(), message))?;
    let (max, max_text) = match key {
        "ttl" => (
            MAX_TTL_MS,
            "365d: keys kept longer are a storage leak, not a retry window",
        ),
        "tombstone" => (
            MAX_TOMBSTONE_MS,
            "3650d: a tombstone is kept to refuse a late retry, not as an archive",
        ),
        "timeout" => (
            MAX_TIMEOUT_MS,
            "1h: a running handler holds its transaction, a connection and its key",
        ),
        "lease" => (
            MAX_LEASE_MS,
            "1h: an attempt that stopped holds its key for its lease before another takes over",
        ),
        _ => (
            MAX_WAIT_MS,
            "60s: a waiting duplicate holds a connection; past a minute, a 409 and a \
             client retry serve everyone better",
        ),
    };
    if key == "lease" && ms < MIN_LEASE_MS {
        return Err(syn::Error::new(
            lit.span(),
            "`lease` must be at least 1s: a shorter lease ends while a phase commits, and every \
             attempt would be taken over by the next",
        ));
    }
    if ms == 0 && key != "wait" {
        let why = if key == "ttl" || key == "tombstone" {
            "a key that expires at once protects nothing"
        } else {
            "a handler stopped at once never runs"
        };
        return Err(syn::Error::new(
            lit.span(),
            format!("`{key}` must be greater than zero: {why}"),
        ));
    }
    if ms > max {
        return Err(syn::Error::new(
            lit.span(),
            format!("`{key}` may be at most {max_text}"),
        ));
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn parse_ok(tokens: TokenStream) -> Args {
        let mut errors = Errors::default();
        let args = parse(tokens, &mut errors);
        if let Err(error) = errors.into_result() {
            panic!("unexpected error: {error}");
        }
        args
    }

    fn messages(tokens: TokenStream) -> Vec<String> {
        let mut errors = Errors::default();
        parse(tokens, &mut errors);
        match errors.into_result() {
            Ok(()) => vec![],
            Err(error) => error.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    fn one_message(tokens: TokenStream) -> String {
        let found = messages(tokens);
        assert_eq!(found.len(), 1, "{found:?}");
        found.into_iter().next().unwrap()
    }

    #[test]
    fn every_key_parses() {
        let args = parse_ok(quote!(
            scope = "account",
            ttl = "1h",
            key = "optional",
            wait = "2s",
            timeout = "5s",
            lease = "10s",
            fingerprint(exclude = ["/a", "/b~1c/0"]),
            crate = "::my_idem"
        ));
        let exclude: Vec<String> = args.exclude.iter().map(LitStr::value).collect();
        assert_eq!(exclude, ["/a", "/b~1c/0"]);
        assert_eq!(args.scope.as_ref().unwrap().value(), "account");
        assert_eq!(args.ttl_ms(), 3_600_000);
        assert_eq!(args.wait_ms(), 2_000);
        assert_eq!(args.timeout_ms(), 5_000);
        assert_eq!(args.lease_ms(), 10_000);
        assert_eq!(args.key, Some(KeyMode::Optional));
        let krate = args.krate.as_ref().unwrap();
        assert_eq!(quote!(#krate).to_string(), ":: my_idem");
        let required = parse_ok(quote!(scope = "a", key = "required"));
        assert_eq!(required.key, Some(KeyMode::Required));
    }

    #[test]
    fn defaults_and_trailing_comma() {
        let defaults = parse_ok(quote!(scope = "a",));
        assert_eq!(
            (defaults.ttl_ms(), defaults.wait_ms(), defaults.key),
            (DEFAULT_TTL_MS, 0, None)
        );
        assert_eq!(defaults.timeout_ms(), DEFAULT_TIMEOUT_MS);
        assert_eq!(defaults.lease_ms(), DEFAULT_LEASE_MS);
        assert!(defaults.lease.is_none() && defaults.key_span.is_none());
        assert!(defaults.krate.is_none());
        let args = parse_ok(quote!(r#scope = "a", crate = "my_idem"));
        assert_eq!(args.scope.unwrap().value(), "a");
    }

    #[test]
    fn every_duplicate_is_named() {
        for key in KEYS {
            let value = match *key {
                "ttl" | "wait" | "timeout" | "lease" => "1s",
                "tombstone" => "30d",
                "key" => "required",
                "crate" => "::idem",
                _ => "a",
            };
            let name: TokenStream = key.parse().unwrap();
            let argument = match *key {
                "fingerprint" => quote!(fingerprint(exclude = ["/a"])),
                _ => quote!(#name = #value),
            };
            let found = messages(quote!(#argument, #argument));
            assert_eq!(found, vec![format!("`{key}` set multiple times")], "{key}");
        }
    }

    #[test]
    fn a_duplicate_is_reported_even_when_its_value_is_wrong() {
        let found = messages(quote!(scope = "a", ttl = "1h", ttl = 5));
        assert_eq!(found, vec!["`ttl` set multiple times".to_owned()]);
    }

    #[test]
    fn a_duplicate_is_reported_even_when_the_first_value_is_wrong() {
        for key in KEYS.iter().filter(|&&key| key != "fingerprint") {
            let name: TokenStream = key.parse().unwrap();
            let found = messages(quote!(#name = 5, #name = "1s"));
            assert_eq!(found.len(), 2, "{key}: {found:?}");
            assert!(found[0].starts_with(&format!("`{key}` takes a string literal")));
            assert_eq!(found[1], format!("`{key}` set multiple times"));
        }
        let found = messages(quote!(scope = "a", ttl "1h", ttl = "2h"));
        assert!(found[0].contains("expected `ttl = \"...\"`"), "{found:?}");
        assert_eq!(found[1], "`ttl` set multiple times");
    }

    #[test]
    fn only_a_scope_written_wrongly_counts_as_written() {
        let written = |tokens: TokenStream| parse(tokens, &mut Errors::default()).scope_written;
        assert!(written(quote!(scope = 5)));
        assert!(written(quote!(scope "a")));
        assert!(written(quote!("account")));
        assert!(!written(quote!(ttl "1h")));
        assert!(!written(quote!(5, ttl = "1h")));
        assert!(!written(quote!(colour = "red")));
    }

    #[test]
    fn empty_arguments_are_errors() {
        let stray = "expected an argument before this `,`; remove the stray comma";
        assert_eq!(one_message(quote!(, scope = "a")), stray);
        assert_eq!(one_message(quote!(scope = "a",, ttl = "1h")), stray);
        assert_eq!(one_message(quote!(scope = "a",,)), stray);
        assert_eq!(messages(quote!(,)), [stray]);
        let args = parse_ok(quote!(scope = "a", ttl = "1h",));
        assert_eq!(args.ttl_ms(), 3_600_000);
    }

    #[test]
    fn unknown_keys_list_the_valid_ones() {
        let message = one_message(quote!(scope = "a", colour = "red"));
        assert_eq!(
            message,
            "unknown argument `colour`; valid arguments are `scope`, `ttl`, `tombstone`, `key`, \
             `wait`, `timeout`, `lease`, `fingerprint` and `crate`"
        );
        assert!(one_message(quote!(scope)).contains("expected `scope = \"...\"`"));
        assert!(one_message(quote!("account")).contains("write `scope = \"account\"`"));
    }

    #[test]
    fn wrong_literal_kinds_say_what_to_write() {
        assert_eq!(
            one_message(quote!(scope = account)),
            "`scope` takes a string literal: write `scope = \"account\"`"
        );
        assert_eq!(
            one_message(quote!(scope = "a", ttl = 24h)),
            "`ttl` takes a string literal: write `ttl = \"24h\"`"
        );
        assert!(one_message(quote!(scope = "a", ttl = 24)).contains("`ttl = \"24h\"`"));
        for (written, accepted) in [
            (quote!(1day), "1d"),
            (quote!(2hours), "2h"),
            (quote!(1.5h), "90m"),
            (quote!(3w), "21d"),
        ] {
            for key in DURATION_KEYS {
                let key: TokenStream = key.parse().unwrap();
                let message = one_message(quote!(scope = "a", #key = #written));
                assert_eq!(
                    message,
                    format!("`{key}` takes a string literal: write `{key} = \"{accepted}\"`")
                );
            }
        }
        // Not a duration in any spelling: the example instead.
        assert_eq!(
            one_message(quote!(scope = "a", ttl = 2y)),
            "`ttl` takes a string literal: a duration such as `ttl = \"24h\"`"
        );
        assert!(one_message(quote!(scope = "a", wait = 1.5)).contains("`wait = \"2s\"`"));
        assert!(one_message(quote!(scope = "a", key = required)).contains("`key = \"required\"`"));
        assert!(
            one_message(quote!(scope = "a", crate = ::my_idem)).contains("`crate = \"::my_idem\"`")
        );
        assert!(one_message(quote!(scope = "a", crate = "not a path")).contains("not a path"));
    }

    #[test]
    fn all_errors_are_reported_together() {
        let found = messages(quote!(
            scope = account,
            ttl = 24,
            colour = "red",
            key = "maybe",
            wait "1s",
            crate = "::idem"
        ));
        assert_eq!(found.len(), 5, "{found:?}");
        assert!(found[0].starts_with("`scope` takes a string literal"));
        assert!(found[1].starts_with("`ttl` takes a string literal"));
        assert!(found[2].contains("unknown argument `colour`") && found[2].contains("`crate`"));
        assert!(found[3].contains("\"required\" or \"optional\""));
        assert!(found[4].contains("expected `wait = \"...\"`"));
    }

    #[test]
    fn durations_are_bounded() {
        assert!(one_message(quote!(scope = "a", ttl = "0s")).contains("greater than zero"));
        assert!(one_message(quote!(scope = "a", ttl = "0ms")).contains("greater than zero"));
        assert!(one_message(quote!(scope = "a", ttl = "366d")).contains("at most 365d"));
        assert!(one_message(quote!(scope = "a", wait = "61s")).contains("at most 60s"));
        assert!(one_message(quote!(scope = "a", timeout = "0s")).contains("greater than zero"));
        assert!(one_message(quote!(scope = "a", timeout = "61m")).contains("at most 1h"));
        assert!(one_message(quote!(scope = "a", timeout = "-1s")).contains("negative"));
        assert_eq!(
            parse_ok(quote!(scope = "a", timeout = "1h")).timeout_ms(),
            MAX_TIMEOUT_MS
        );
        assert!(one_message(quote!(scope = "a", ttl = "-5m")).contains("negative"));
        assert!(one_message(quote!(scope = "a", wait = "-1s")).contains("negative"));
        assert!(one_message(quote!(scope = "a", ttl = "24")).contains("no unit"));
        assert!(
            one_message(quote!(scope = "a", ttl = "1s", wait = "2s")).contains("longer than `ttl`")
        );
        let edges = parse_ok(quote!(scope = "a", ttl = "365d", wait = "60s"));
        assert_eq!((edges.ttl_ms(), edges.wait_ms()), (MAX_TTL_MS, MAX_WAIT_MS));
        let zero_wait = parse_ok(quote!(scope = "a", wait = "0ms"));
        assert_eq!(zero_wait.wait_ms(), 0);
        let equal = parse_ok(quote!(scope = "a", ttl = "1s", wait = "1000ms"));
        assert_eq!(equal.wait_ms(), equal.ttl_ms());
    }

    #[test]
    fn leases_are_bounded() {
        let lease = |tokens: TokenStream| parse_ok(tokens).lease;
        assert_eq!(lease(quote!(scope = "a", lease = "5s")).unwrap().0, 5_000);
        assert_eq!(
            lease(quote!(scope = "a", lease = "1s")).unwrap().0,
            MIN_LEASE_MS
        );
        assert_eq!(
            lease(quote!(scope = "a", lease = "1000ms")).unwrap().0,
            MIN_LEASE_MS
        );
        assert_eq!(
            lease(quote!(scope = "a", lease = "1h")).unwrap().0,
            MAX_LEASE_MS
        );
        assert_eq!(
            lease(quote!(scope = "a", lease = "60m")).unwrap().0,
            MAX_LEASE_MS
        );
        let too_short = "`lease` must be at least 1s: a shorter lease ends while a phase \
                         commits, and every attempt would be taken over by the next";
        for short in ["0s", "0ms", "500ms", "999ms"] {
            assert_eq!(one_message(quote!(scope = "a", lease = #short)), too_short);
        }
        for long in ["2h", "61m", "3601s", "1d"] {
            assert!(
                one_message(quote!(scope = "a", lease = #long))
                    .starts_with("`lease` may be at most 1h"),
                "{long}"
            );
        }
        assert!(one_message(quote!(scope = "a", lease = "5")).starts_with("`5` has no unit"));
        assert!(
            one_message(quote!(scope = "a", lease = "abc")).starts_with("`abc` is not a duration")
        );
        assert!(one_message(quote!(scope = "a", lease = "-5s")).contains("negative"));
        assert!(one_message(quote!(scope = "a", lease = "5 s")).contains("write `5s`"));
    }

    #[test]
    fn a_lease_that_is_not_a_string_says_what_to_write() {
        assert_eq!(
            one_message(quote!(scope = "a", lease = 5)),
            "`lease` takes a string literal: a duration such as `lease = \"30s\"`"
        );
        assert_eq!(
            one_message(quote!(scope = "a", lease = 5s)),
            "`lease` takes a string literal: write `lease = \"5s\"`"
        );
    }

    /// `lease`, `key` and `wait` are each parsed on their own; which mode
    /// they fit is the signature's to say (`valid::check_mode_arguments`).
    #[test]
    fn mode_arguments_parse_together() {
        let args = parse_ok(quote!(
            scope = "a",
            lease = "5s",
            key = "optional",
            wait = "2s"
        ));
        assert_eq!(args.lease_ms(), 5_000);
        assert_eq!(args.key, Some(KeyMode::Optional));
        assert!(args.key_span.is_some());
        assert_eq!(args.wait_ms(), 2_000);
        let found = messages(quote!(scope = "a", lease = "0s", ttl = 5, lease = "9h"));
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found[0].contains("at least 1s"));
        assert!(found[1].starts_with("`ttl` takes a string literal"));
        assert_eq!(found[2], "`lease` set multiple times");
    }

    #[test]
    fn fingerprint_pointers_are_checked() {
        let exclude = |tokens: TokenStream| -> Vec<String> {
            parse_ok(tokens).exclude.iter().map(LitStr::value).collect()
        };
        assert_eq!(
            exclude(quote!(
                scope = "a",
                fingerprint(exclude = ["/ts", "/a~0b/~1", "/items/0/ts",],)
            )),
            ["/ts", "/a~0b/~1", "/items/0/ts"]
        );
        assert!(exclude(quote!(scope = "a")).is_empty());
        let one = |pointers: TokenStream| {
            one_message(quote!(scope = "a", fingerprint(exclude = #pointers)))
        };
        assert!(one(quote!([""])).starts_with("`\"\"` is the whole body"));
        assert_eq!(
            one(quote!(["ts"])),
            "`ts` is not a JSON Pointer: one starts with `/`, as in \"/ts\""
        );
        for bad in ["/a~", "/a~2", "/~/b", "/a~01~"] {
            assert!(one(quote!([#bad])).contains("`~` is written `~0`"), "{bad}");
        }
        assert_eq!(one(quote!(["/a", "/b", "/a"])), "`/a` is listed twice");
        assert!(one(quote!([])).starts_with("`exclude` lists no member"));
        assert!(one(quote!(["/a", ts])).starts_with("a JSON Pointer is a string literal"));
        assert!(one(quote!("/a")).starts_with("`exclude` takes a list"));
        // Every bad pointer at once.
        let found = messages(quote!(
            scope = "a",
            fingerprint(exclude = ["", "x", "/~", "/a", "/a"])
        ));
        assert_eq!(found.len(), 4, "{found:?}");
    }

    #[test]
    fn fingerprint_is_written_as_a_list() {
        let written = |tokens: TokenStream| one_message(quote!(scope = "a", #tokens));
        assert_eq!(
            written(quote!(fingerprint = "/ts")),
            "`fingerprint` takes a list: write `fingerprint(exclude = [\"/member\", ...])`"
        );
        assert_eq!(
            written(quote!(fingerprint)),
            "expected `fingerprint(exclude = [\"/member\", ...])`"
        );
        assert!(written(quote!(fingerprint())).starts_with("`fingerprint(...)` needs `exclude"));
        assert!(
            written(quote!(fingerprint(include = ["/a"])))
                .starts_with("unknown `fingerprint` argument `include`")
        );
        assert_eq!(
            written(quote!(fingerprint(exclude = ["/a"], exclude = ["/b"]))),
            "`exclude` set multiple times"
        );
        assert!(written(quote!(fingerprint(exclude))).contains("expected `=`"));
    }

    #[test]
    fn tombstones_outlive_the_ttl_within_ten_years() {
        let args = parse_ok(quote!(scope = "a", ttl = "1h", tombstone = "30d"));
        assert_eq!(args.tombstone.map(|(ms, _)| ms), Some(30 * 86_400_000));
        assert!(parse_ok(quote!(scope = "a")).tombstone.is_none());
        let longest = parse_ok(quote!(scope = "a", tombstone = "3650d"));
        assert_eq!(longest.tombstone.map(|(ms, _)| ms), Some(MAX_TOMBSTONE_MS));
        assert!(one_message(quote!(scope = "a", tombstone = "3651d")).contains("at most 3650d"),);
        // Not longer than the ttl, written or the default 24h.
        assert!(
            one_message(quote!(scope = "a", ttl = "2d", tombstone = "2d"))
                .contains("longer than `ttl`")
        );
        assert!(one_message(quote!(scope = "a", tombstone = "12h")).contains("longer than `ttl`"));
        assert!(one_message(quote!(scope = "a", tombstone = "0s")).contains("greater than zero"));
        assert_eq!(
            one_message(quote!(scope = "a", tombstone = 30d)),
            "`tombstone` takes a string literal: write `tombstone = \"30d\"`"
        );
    }
}
