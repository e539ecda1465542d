//! Parsing `#[idempotent(...)]`'s arguments: one slot per key.

use proc_macro2::{Span, TokenStream, TokenTree};
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

use crate::duration::{
    MAX_LEASE_MS, MAX_TIMEOUT_MS, MAX_TTL_MS, MAX_WAIT_MS, MIN_LEASE_MS, parse_ms,
};
use crate::errors::Errors;

const KEYS: &[&str] = &["scope", "ttl", "key", "wait", "timeout", "lease", "crate"];
const VALID_KEYS: &str =
    "valid arguments are `scope`, `ttl`, `key`, `wait`, `timeout`, `lease` and `crate`";

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
    pub wait: Option<(u64, Span)>,
    pub timeout: Option<(u64, Span)>,
    pub lease: Option<(u64, Span)>,
    pub key: Option<KeyMode>,
    /// Where `key` was written, for errors about its combination with phases.
    pub key_span: Option<Span>,
    pub krate: Option<syn::Path>,
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
    fn set(&mut self, key: &str, value: &Expr) -> syn::Result<()> {
        match key {
            "scope" => self.scope = Some(scope(value)?),
            "ttl" => self.ttl = Some((duration(key, value)?, value_span(value))),
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
    value: syn::Result<Expr>,
}

impl Piece {
    fn parse(chunk: TokenStream) -> Self {
        let (mut name, mut positional) = (None, false);
        let parser = |input: ParseStream<'_>| -> syn::Result<Expr> {
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
            if !input.peek(Token![=]) {
                return Err(syn::Error::new(
                    ident.span(),
                    format!("expected `{ident} = \"...\"`; {VALID_KEYS}"),
                ));
            }
            input.parse::<Token![=]>()?;
            input.parse()
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
        if let Err(error) = value.and_then(|value| args.set(&key, &value)) {
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
        _ => None,
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

fn duration(key: &str, value: &Expr) -> syn::Result<u64> {
    let example = match key {
        "ttl" => "24h",
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
        let why = if key == "ttl" {
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
            crate = "::my_idem"
        ));
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
                "key" => "required",
                "crate" => "::idem",
                _ => "a",
            };
            let name: TokenStream = key.parse().unwrap();
            let found = messages(quote!(#name = #value, #name = #value));
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
        for key in KEYS {
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
            "unknown argument `colour`; valid arguments are `scope`, `ttl`, `key`, `wait`, \
             `timeout`, `lease` and `crate`"
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
}
