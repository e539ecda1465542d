//! Checking the handler's signature: every misuse reported on its own token.

use syn::spanned::Spanned;
use syn::{FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, Type};

use crate::attr::Args;
use crate::errors::Errors;

/// Extractors that consume the request body, so must come last.
const BODY_EXTRACTORS: &[&str] = &[
    "Json",
    "Form",
    "Bytes",
    "BytesMut",
    "String",
    "Body",
    "Request",
    "Multipart",
    "RawForm",
];

/// A handler parameter, as the expansion needs it.
pub struct Param {
    pub pat: Pat,
    pub ty: Type,
    /// What the generated code calls the extracted value.
    pub local: Ident,
}

/// A handler shape that passed every check.
pub struct Handler {
    /// The extractors, in order (the `Tx` parameter removed).
    pub extractors: Vec<Param>,
    /// Where the `Tx` goes among the original parameters.
    pub tx_index: usize,
    /// The database type inside `Tx<...>`.
    pub db: Type,
    /// Index into `extractors` of the scope parameter.
    pub scope_index: usize,
}

pub fn check(item: &ItemFn, args: &Args, errors: &mut Errors) -> Option<Handler> {
    let before = errors.count();
    let sig = &item.sig;
    if let Some(token) = &sig.constness {
        errors.push(syn::Error::new(
            token.span,
            "`#[idempotent]` handlers cannot be `const`",
        ));
    }
    if let Some(token) = &sig.unsafety {
        errors.push(syn::Error::new(
            token.span,
            "`#[idempotent]` handlers cannot be `unsafe`",
        ));
    }
    if let Some(abi) = &sig.abi {
        errors.push(syn::Error::new(
            abi.span(),
            "`#[idempotent]` handlers cannot be `extern`",
        ));
    }
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` handlers must be `async fn`",
        ));
    }
    let generics = &sig.generics;
    let generic_span = match (&generics.lt_token, &generics.where_clause) {
        (Some(_), _) => Some(generics.span()),
        (None, Some(where_clause)) => Some(where_clause.span()),
        (None, None) => None,
    };
    if let Some(span) = generic_span {
        errors.push(syn::Error::new(
            span,
            "`#[idempotent]` handlers cannot be generic: axum needs one concrete handler type",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(syn::Error::new(
            variadic.span(),
            "`#[idempotent]` handlers cannot be variadic",
        ));
    }

    let mut params = Vec::new();
    let mut txs = Vec::new();
    let mut tx_names = Vec::new();
    let mut malformed_tx = false;
    for (index, input) in sig.inputs.iter().enumerate() {
        let typed = match input {
            FnArg::Receiver(receiver) => {
                errors.push(syn::Error::new(
                    receiver.span(),
                    "`#[idempotent]` handlers cannot take `self`: make it a free function",
                ));
                continue;
            }
            FnArg::Typed(typed) => typed,
        };
        if let Type::ImplTrait(impl_trait) = &*typed.ty {
            errors.push(syn::Error::new(
                impl_trait.span(),
                "`#[idempotent]` handlers cannot be generic: name the extractor's concrete type \
                 instead of `impl Trait`",
            ));
            continue;
        }
        match tx_database(&typed.ty) {
            TxParam::Tx(db) => {
                txs.push((index, db, typed.ty.span()));
                if let Pat::Ident(ident) = &*typed.pat {
                    tx_names.push(ident.ident.to_string());
                }
            }
            TxParam::Malformed(span) => {
                malformed_tx = true;
                errors.push(syn::Error::new(
                    span,
                    "`Tx` takes the database type: `Tx<sqlx::Postgres>`",
                ));
            }
            TxParam::No => params.push(Param {
                pat: (*typed.pat).clone(),
                ty: (*typed.ty).clone(),
                local: quote::format_ident!("__idem_arg{}", index),
            }),
        }
    }

    let tx = match txs.as_slice() {
        [] if malformed_tx => None,
        [] => {
            errors.push(syn::Error::new(
                sig.ident.span(),
                "`#[idempotent]` handlers take exactly one `Tx<DB>` parameter, the request's transaction; \
                 add one, e.g. `mut tx: idem::Tx<sqlx::Postgres>`",
            ));
            None
        }
        [(index, db, _)] => Some((*index, db.clone())),
        [_, rest @ ..] => {
            for (_, _, span) in rest {
                errors.push(syn::Error::new(
                    *span,
                    "a second `Tx` parameter: `#[idempotent]` handlers run in exactly one transaction",
                ));
            }
            None
        }
    };

    if let Some((_last, before_last)) = params.split_last() {
        for param in before_last {
            if let Some(name) = body_extractor(&param.ty) {
                errors.push(syn::Error::new(
                    param.ty.span(),
                    format!("`{name}` consumes the request body, so it must be the last extractor"),
                ));
            }
        }
    }

    let scope_index = match &args.scope {
        Some(scope) => find_scope(scope, &params, &tx_names, errors),
        // Written with a wrong value: that error is already reported.
        None if args.scope_written => None,
        None => {
            errors.push(syn::Error::new(
                proc_macro2::Span::call_site(),
                format!(
                    "missing `scope = \"<parameter>\"`: keys must never be shared across callers, so \
                     name the parameter that identifies the caller (its type implements `idem::Scope`); {}",
                    candidates(&params)
                ),
            ));
            None
        }
    };

    if errors.count() != before {
        return None;
    }
    let (tx_index, db) = tx?;
    Some(Handler {
        extractors: params,
        tx_index,
        db,
        scope_index: scope_index?,
    })
}

/// What a parameter's type says about the transaction.
enum TxParam {
    /// `Tx<DB>`: the request's transaction over `DB`.
    Tx(Type),
    /// `Tx` without exactly one type argument.
    Malformed(proc_macro2::Span),
    No,
}

/// `Tx<DB>` (any path ending in `Tx`) yields `DB`.
fn tx_database(ty: &Type) -> TxParam {
    let Type::Path(path) = ty else {
        return TxParam::No;
    };
    let Some(last) = path.path.segments.last() else {
        return TxParam::No;
    };
    if last.ident != "Tx" {
        return TxParam::No;
    }
    let malformed = TxParam::Malformed(ty.span());
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return malformed;
    };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(db)] => TxParam::Tx(db.clone()),
        _ => malformed,
    }
}

/// The name of a well-known extractor that consumes the request body.
pub fn body_extractor(ty: &Type) -> Option<String> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    BODY_EXTRACTORS
        .contains(&last.ident.to_string().as_str())
        .then(|| last.ident.to_string())
}

fn find_scope(
    scope: &syn::LitStr,
    params: &[Param],
    tx_names: &[String],
    errors: &mut Errors,
) -> Option<usize> {
    let wanted = scope.value();
    for (index, param) in params.iter().enumerate() {
        match &param.pat {
            Pat::Ident(ident) if ident.ident == wanted => {
                if ident.subpat.is_some() {
                    errors.push(syn::Error::new(
                        param.pat.span(),
                        format!("bind the scope parameter `{wanted}` whole, without a `@` pattern"),
                    ));
                    return None;
                }
                return Some(index);
            }
            Pat::Ident(_) => {}
            other if binds(other, &wanted) => {
                errors.push(syn::Error::new(
                    other.span(),
                    format!(
                        "`scope = \"{wanted}\"` names a binding inside a pattern; bind the whole \
                         extractor to a name (e.g. `{wanted}: {}`) and name that",
                        quote::ToTokens::to_token_stream(&param.ty)
                    ),
                ));
                return None;
            }
            _ => {}
        }
    }
    let message = if tx_names.contains(&wanted) {
        format!(
            "`scope = \"{wanted}\"` names the transaction; the scope is the caller the key belongs \
             to; {}",
            candidates(params)
        )
    } else {
        format!(
            "`scope = \"{wanted}\"` names no parameter of this handler; {}",
            candidates(params)
        )
    };
    errors.push(syn::Error::new(scope.span(), message));
    None
}

/// The parameters a `scope` could name, for error messages.
fn candidates(params: &[Param]) -> String {
    let names: Vec<String> = params
        .iter()
        .filter_map(|param| match &param.pat {
            Pat::Ident(ident) if ident.subpat.is_none() => Some(format!("`{}`", ident.ident)),
            _ => None,
        })
        .collect();
    match names.as_slice() {
        [] => "the handler has no parameter bound to a plain name".to_owned(),
        [one] => format!("it could name {one}"),
        [rest @ .., last] => format!("it could name {} or {last}", rest.join(", ")),
    }
}

/// Whether a destructuring pattern binds `name` somewhere inside.
fn binds(pat: &Pat, name: &str) -> bool {
    match pat {
        Pat::Ident(ident) => {
            ident.ident == name || ident.subpat.as_ref().is_some_and(|(_, p)| binds(p, name))
        }
        Pat::TupleStruct(p) => p.elems.iter().any(|p| binds(p, name)),
        Pat::Tuple(p) => p.elems.iter().any(|p| binds(p, name)),
        Pat::Struct(p) => p.fields.iter().any(|f| binds(&f.pat, name)),
        Pat::Reference(p) => binds(&p.pat, name),
        Pat::Paren(p) => binds(&p.pat, name),
        Pat::Type(p) => binds(&p.pat, name),
        _ => false,
    }
}
