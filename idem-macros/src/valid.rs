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
    if !sig.generics.params.is_empty() || sig.generics.where_clause.is_some() {
        errors.push(syn::Error::new(
            sig.generics.span(),
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
    for (index, input) in sig.inputs.iter().enumerate() {
        match input {
            FnArg::Receiver(receiver) => errors.push(syn::Error::new(
                receiver.span(),
                "`#[idempotent]` handlers cannot take `self`: make it a free function",
            )),
            FnArg::Typed(typed) => match tx_database(&typed.ty) {
                Some(db) => txs.push((index, db, typed.ty.span())),
                None => params.push(Param {
                    pat: (*typed.pat).clone(),
                    ty: (*typed.ty).clone(),
                    local: quote::format_ident!("__idem_arg{}", index),
                }),
            },
        }
    }

    let tx = match txs.as_slice() {
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

    let scope_index = args
        .scope
        .as_ref()
        .and_then(|scope| find_scope(scope, &params, errors));
    if args.scope.is_none() {
        errors.push(syn::Error::new(
            proc_macro2::Span::call_site(),
            "missing `scope = \"<parameter>\"`: keys must never be shared across callers, so name the \
             parameter that identifies the caller (its type implements `idem::Scope`)",
        ));
    }

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

/// `Tx<DB>` (any path ending in `Tx` with one type argument) yields `DB`.
fn tx_database(ty: &Type) -> Option<Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Tx" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(db)] => Some(db.clone()),
        _ => None,
    }
}

fn body_extractor(ty: &Type) -> Option<String> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    BODY_EXTRACTORS
        .contains(&last.ident.to_string().as_str())
        .then(|| last.ident.to_string())
}

fn find_scope(scope: &syn::LitStr, params: &[Param], errors: &mut Errors) -> Option<usize> {
    let wanted = scope.value();
    let mut names = Vec::new();
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
            Pat::Ident(ident) => names.push(format!("`{}`", ident.ident)),
            other => {
                if binds(other, &wanted) {
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
            }
        }
    }
    let listing = if names.is_empty() {
        "the handler has no parameter bound to a plain name".to_owned()
    } else {
        format!("it could name {}", names.join(", "))
    };
    errors.push(syn::Error::new(
        scope.span(),
        format!("`scope = \"{wanted}\"` names no parameter of this handler; {listing}"),
    ));
    None
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
