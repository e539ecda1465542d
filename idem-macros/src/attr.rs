//! Parsing `#[idempotent(...)]`'s arguments: one slot per key.

use proc_macro2::{Span, TokenStream};
use syn::ext::IdentExt;
use syn::parse::{Parse, ParseStream, Parser};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

use crate::duration::{MAX_TTL_MS, MAX_WAIT_MS, parse_ms};
use crate::errors::Errors;

const VALID_KEYS: &str = "valid arguments are `scope`, `ttl`, `key`, `wait` and `crate`";

/// The default `ttl`: 24 hours.
pub const DEFAULT_TTL_MS: u64 = 24 * 60 * 60 * 1000;

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
    pub ttl: Option<(u64, Span)>,
    pub wait: Option<(u64, Span)>,
    pub key: Option<KeyMode>,
    pub krate: Option<syn::Path>,
}

impl Args {
    pub fn ttl_ms(&self) -> u64 {
        self.ttl.map_or(DEFAULT_TTL_MS, |(ms, _)| ms)
    }

    pub fn wait_ms(&self) -> u64 {
        self.wait.map_or(0, |(ms, _)| ms)
    }
}

struct Arg {
    name: Ident,
    value: Expr,
}

impl Parse for Arg {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let name = Ident::parse_any(input)?;
        if !input.peek(Token![=]) {
            return Err(syn::Error::new(
                name.span(),
                format!("expected `{name} = \"...\"`; {VALID_KEYS}"),
            ));
        }
        input.parse::<Token![=]>()?;
        Ok(Self {
            name,
            value: input.parse()?,
        })
    }
}

/// Parses the attribute's tokens, collecting every error rather than
/// stopping at the first.
pub fn parse(tokens: TokenStream, errors: &mut Errors) -> Args {
    let mut args = Args::default();
    let list = match Punctuated::<Arg, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(list) => list,
        Err(error) => {
            errors.push(error);
            return args;
        }
    };
    for Arg { name, value } in list {
        let key = name.unraw().to_string();
        let duplicate = || syn::Error::new(name.span(), format!("`{key}` set multiple times"));
        match key.as_str() {
            "scope" => match string(&value, "the name of the parameter that identifies the caller") {
                Ok(_) if args.scope.is_some() => errors.push(duplicate()),
                Ok(lit) => args.scope = Some(lit),
                Err(error) => errors.push(error),
            },
            "ttl" | "wait" => {
                let slot = if key == "ttl" { &mut args.ttl } else { &mut args.wait };
                if slot.is_some() {
                    errors.push(duplicate());
                    continue;
                }
                match string(&value, "a duration like \"24h\"").and_then(|lit| duration(&key, &lit)) {
                    Ok(ms) => *slot = Some((ms, value_span(&value))),
                    Err(error) => errors.push(error),
                }
            }
            "key" => match string(&value, "\"required\" or \"optional\"") {
                Ok(_) if args.key.is_some() => errors.push(duplicate()),
                Ok(lit) => match lit.value().as_str() {
                    "required" => args.key = Some(KeyMode::Required),
                    "optional" => args.key = Some(KeyMode::Optional),
                    other => errors.push(syn::Error::new(
                        lit.span(),
                        format!("`key = \"{other}\"` is not a key mode: expected \"required\" or \"optional\""),
                    )),
                },
                Err(error) => errors.push(error),
            },
            "crate" => match string(&value, "a path such as \"::my_idem\"") {
                Ok(_) if args.krate.is_some() => errors.push(duplicate()),
                Ok(lit) => match lit.parse::<syn::Path>() {
                    Ok(path) => args.krate = Some(path),
                    Err(_) => errors.push(syn::Error::new(
                        lit.span(),
                        format!("`crate = \"{}\"` is not a path", lit.value()),
                    )),
                },
                Err(error) => errors.push(error),
            },
            _ => errors.push(syn::Error::new(
                name.span(),
                format!("unknown argument `{key}`; {VALID_KEYS}"),
            )),
        }
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

fn value_span(value: &Expr) -> Span {
    syn::spanned::Spanned::span(value)
}

/// The value as a string literal, or an error on it that says what to write.
fn string(value: &Expr, expected: &str) -> syn::Result<LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => Ok(lit.clone()),
        other => Err(syn::Error::new(
            value_span(other),
            format!("expected a string literal: {expected}"),
        )),
    }
}

fn duration(key: &str, lit: &LitStr) -> syn::Result<u64> {
    let ms = parse_ms(&lit.value()).map_err(|message| syn::Error::new(lit.span(), message))?;
    let (max, max_text) = if key == "ttl" {
        (MAX_TTL_MS, "365d")
    } else {
        (MAX_WAIT_MS, "60s")
    };
    if key == "ttl" && ms == 0 {
        return Err(syn::Error::new(
            lit.span(),
            "`ttl` must be greater than zero",
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
        assert!(errors.into_result().is_ok());
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

    #[test]
    fn every_key_parses() {
        let args = parse_ok(quote!(
            scope = "account",
            ttl = "1h",
            key = "optional",
            wait = "2s",
            crate = "::my_idem"
        ));
        assert_eq!(args.scope.as_ref().unwrap().value(), "account");
        assert_eq!(args.ttl_ms(), 3_600_000);
        assert_eq!(args.wait_ms(), 2_000);
        assert_eq!(args.key, Some(KeyMode::Optional));
        assert!(args.krate.is_some());
        let defaults = parse_ok(quote!(scope = "a"));
        assert_eq!(
            (defaults.ttl_ms(), defaults.wait_ms(), defaults.key),
            (DEFAULT_TTL_MS, 0, None)
        );
    }

    #[test]
    fn every_duplicate_is_named() {
        for key in ["scope", "ttl", "key", "wait", "crate"] {
            let value = match key {
                "ttl" | "wait" => "1s",
                "key" => "required",
                "crate" => "::idem",
                _ => "a",
            };
            let name = Ident::new_raw(key, Span::call_site());
            let name = if key == "crate" {
                quote!(crate)
            } else {
                quote!(#name)
            };
            let found = messages(quote!(#name = #value, #name = #value));
            assert_eq!(found, vec![format!("`{key}` set multiple times")], "{key}");
        }
    }

    #[test]
    fn all_errors_are_reported_together() {
        let found = messages(quote!(
            scope = account,
            ttl = 24,
            colour = "red",
            key = "maybe"
        ));
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(found[0].contains("expected a string literal"));
        assert!(found[2].contains("unknown argument `colour`") && found[2].contains("`crate`"));
        assert!(found[3].contains("\"required\" or \"optional\""));
    }

    #[test]
    fn durations_are_bounded() {
        assert!(messages(quote!(scope = "a", ttl = "0s"))[0].contains("greater than zero"));
        assert!(messages(quote!(scope = "a", ttl = "366d"))[0].contains("at most 365d"));
        assert!(messages(quote!(scope = "a", wait = "61s"))[0].contains("at most 60s"));
        assert!(
            messages(quote!(scope = "a", ttl = "1s", wait = "2s"))[0].contains("longer than `ttl`")
        );
        assert!(messages(quote!(scope = "a", ttl = "-5m"))[0].contains("negative"));
        assert!(messages(quote!(scope = "a", wait = "0ms")).is_empty());
    }
}
