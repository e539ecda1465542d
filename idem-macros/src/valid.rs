//! Checking the handler's signature: every misuse reported on its own token.

use quote::ToTokens;
use syn::{FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, Signature, Type};

use crate::attr::{Args, KeyMode};
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
    /// The `Tx<...>` parameter's type, as written.
    pub tx_ty: Type,
    /// The database type inside `Tx<...>`; `None` for a bare `Tx` (an
    /// alias such as `type Tx = idem::Tx<Postgres>`), whose database the
    /// expansion reads off the type itself.
    pub db: Option<Type>,
    /// Index into `extractors` of the scope parameter.
    pub scope_index: usize,
    /// The handler takes `Phases<DB>` (the phased mode) rather than a `Tx`.
    pub phased: bool,
}

pub fn check(item: &ItemFn, args: &Args, errors: &mut Errors) -> Option<Handler> {
    let before = errors.count();
    check_attributes(item, errors);
    check_qualifiers(&item.sig, errors);
    let Params {
        extractors,
        tx,
        tx_names,
    } = Params::split(&item.sig, errors);
    check_body_is_last(&extractors, errors);
    let scope_index = match &args.scope {
        Some(scope) => find_scope(scope, &extractors, &tx_names, errors),
        // Written with a wrong value: that error is already reported.
        None if args.scope_written => None,
        None => {
            errors.push(syn::Error::new(
                proc_macro2::Span::call_site(),
                format!(
                    "missing `scope = \"<parameter>\"`: keys must never be shared across callers, so \
                     name the parameter that identifies the caller (its type implements `idem::Scope`); {}",
                    candidates(&extractors)
                ),
            ));
            None
        }
    };
    if errors.count() != before {
        return None;
    }
    let (tx_index, db, tx_ty) = tx?;
    let phased = matches!(tx_database(&tx_ty), TxParam::Tx(_, Kind::Phases));
    check_mode_arguments(args, phased, errors);
    if errors.count() != before {
        return None;
    }
    Some(Handler {
        extractors,
        tx_index,
        tx_ty,
        db,
        scope_index: scope_index?,
        phased,
    })
}

/// The arguments that belong to one mode only.
fn check_mode_arguments(args: &Args, phased: bool, errors: &mut Errors) {
    if let (false, Some((_, span))) = (phased, args.lease) {
        errors.push(syn::Error::new(
            span,
            "`lease` is for phased handlers (a `Phases<DB>` parameter): this handler runs in one \
             transaction (`Tx`), which holds its key until it commits or rolls back; remove \
             `lease`",
        ));
    }
    if !phased {
        return;
    }
    if let (Some(KeyMode::Optional), Some(span)) = (args.key, args.key_span) {
        errors.push(syn::Error::new(
            span,
            "a phased handler needs a key: its phases are recorded under it, so it cannot be \
             optional; remove `key = \"optional\"`",
        ));
    }
    if let Some((_, span)) = args.wait {
        errors.push(syn::Error::new(
            span,
            "`wait` is for handlers with a `Tx`: a duplicate of a phased request is answered 409 \
             at once, with `Retry-After` from the first attempt's lease; remove `wait`",
        ));
    }
}

/// axum's `#[debug_handler]`, under any path: it checks a function's
/// parameters as axum extractors, which the `Tx` is not, and the expansion
/// drops it (`Shell`).
pub fn is_debug_handler(attr: &syn::Attribute) -> bool {
    attr.path()
        .segments
        .last()
        .is_some_and(|segment| segment.ident == "debug_handler")
}

/// `#[utoipa::path]`: below `#[idempotent]` it would expand on the function
/// kept inside the handler's `impl` block, where its items cannot go.
pub fn is_utoipa_path(attr: &syn::Attribute) -> bool {
    let segments: Vec<String> = attr
        .path()
        .segments
        .iter()
        .map(|segment| segment.ident.to_string())
        .collect();
    segments == ["utoipa", "path"]
}

/// No attribute below `#[idempotent]` that cannot apply to what it keeps.
fn check_attributes(item: &ItemFn, errors: &mut Errors) {
    for attr in item.attrs.iter().filter(|attr| is_utoipa_path(attr)) {
        errors.push(syn::Error::new_spanned(
            attr,
            "`#[utoipa::path]` goes above `#[idempotent]`: below it, it would document the \
             function `#[idempotent]` keeps inside the handler's `impl` block, where utoipa \
             cannot put its items; move it up (the handler's key, problems and policy are added \
             to the document by `idem::openapi`)",
        ));
    }
    for attr in item.attrs.iter().filter(|attr| is_debug_handler(attr)) {
        errors.push(syn::Error::new_spanned(
            attr,
            "`#[debug_handler]` cannot check an `#[idempotent]` handler: the `Tx` parameter is \
             not one of axum's extractors; remove it (above `#[idempotent]` it fails with errors \
             of its own); `#[idempotent]` checks the extractors itself, each on its own parameter",
        ));
    }
}

/// `async`, and nothing axum cannot call: no `const`, `unsafe`, `extern`,
/// generics or variadics.
fn check_qualifiers(sig: &Signature, errors: &mut Errors) {
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
        errors.push(syn::Error::new_spanned(
            abi,
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
    let generic = match (&generics.lt_token, &generics.where_clause) {
        (Some(_), _) => Some(generics.to_token_stream()),
        (None, Some(where_clause)) => Some(where_clause.to_token_stream()),
        (None, None) => None,
    };
    if let Some(generic) = generic {
        errors.push(syn::Error::new_spanned(
            generic,
            "`#[idempotent]` handlers cannot be generic: the handler becomes a unit struct, \
             which has no parameters to instantiate; take a concrete type (a state such as \
             `State<Arc<dyn Store>>`, say)",
        ));
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(syn::Error::new_spanned(
            variadic.dots,
            "`#[idempotent]` handlers cannot be variadic: remove the `...` (axum calls a \
             handler with one extractor per parameter)",
        ));
    }
}

/// The parameters, split into the extractors and the one `Tx`.
struct Params {
    extractors: Vec<Param>,
    /// Position, database type and written type of the single `Tx`.
    tx: Option<(usize, Option<Type>, Type)>,
    /// The names the `Tx` parameters are bound to.
    tx_names: Vec<String>,
}

impl Params {
    fn split(sig: &Signature, errors: &mut Errors) -> Self {
        let mut extractors = Vec::new();
        let mut txs = Vec::new();
        let mut tx_names = Vec::new();
        for (index, input) in sig.inputs.iter().enumerate() {
            let typed = match input {
                FnArg::Receiver(receiver) => {
                    errors.push(syn::Error::new_spanned(
                        receiver,
                        "`#[idempotent]` handlers cannot take `self`: make it a free function",
                    ));
                    continue;
                }
                FnArg::Typed(typed) => typed,
            };
            for attr in &typed.attrs {
                if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
                    errors.push(syn::Error::new_spanned(
                        attr,
                        "`#[idempotent]` does not support `#[cfg]` on a parameter: it extracts \
                         every parameter it sees. Put the `#[cfg]` on whole handlers instead",
                    ));
                }
            }
            if let Type::ImplTrait(impl_trait) = &*typed.ty {
                errors.push(syn::Error::new_spanned(
                    impl_trait,
                    "`#[idempotent]` handlers cannot be generic: name the extractor's concrete type \
                     instead of `impl Trait`",
                ));
                continue;
            }
            let ty = match &*typed.ty {
                Type::Reference(reference)
                    if !matches!(tx_database(&reference.elem), TxParam::No) =>
                {
                    errors.push(by_reference(reference, &typed.pat));
                    // Counted as the transaction, so no "add one" follows.
                    &*reference.elem
                }
                ty => ty,
            };
            let db = match tx_database(ty) {
                TxParam::No => {
                    extractors.push(Param {
                        pat: (*typed.pat).clone(),
                        ty: (*typed.ty).clone(),
                        local: quote::format_ident!("__idem_arg{}", index),
                    });
                    continue;
                }
                TxParam::Tx(db, _) => Some(Some(db)),
                TxParam::Alias => Some(None),
                TxParam::Malformed => None,
            };
            txs.push((index, db, ty));
            if let Pat::Ident(ident) = &*typed.pat {
                tx_names.push(ident.ident.to_string());
            }
        }
        let tx = the_one_tx(sig, &txs, errors);
        Self {
            extractors,
            tx,
            tx_names,
        }
    }
}

/// A `Tx` or `Phases` taken by reference (`tx: &mut Tx<DB>`), reported on
/// the `&mut`: the handler is handed the request's transaction, and the
/// runtime commits it with the stored response, so the handler owns it.
fn by_reference(reference: &syn::TypeReference, pat: &Pat) -> syn::Error {
    let ty = type_text(&reference.elem);
    let name = match pat {
        Pat::Ident(ident) => ident.ident.to_string(),
        other => other.to_token_stream().to_string(),
    };
    let (and, lifetime, mutability) = (
        &reference.and_token,
        &reference.lifetime,
        &reference.mutability,
    );
    let owns = match tx_database(&reference.elem) {
        TxParam::Tx(_, Kind::Phases) => "the handler owns the request's phases, as it owns a `Tx`",
        _ => "the handler owns the request's transaction, which commits with the stored response",
    };
    syn::Error::new_spanned(
        quote::quote!(#and #lifetime #mutability),
        format!("take `{ty}` by value: `mut {name}: {ty}`; {owns}"),
    )
}

/// The single `Tx<DB>` among the parameters that look like one (with the
/// database type each names, `Some(None)` for a bare `Tx`, `None` if it is
/// malformed): a malformed `Tx` is reported on its token, and every `Tx`
/// after the first, whatever its form, is a second transaction.
fn the_one_tx(
    sig: &Signature,
    txs: &[(usize, Option<Option<&Type>>, &Type)],
    errors: &mut Errors,
) -> Option<(usize, Option<Type>, Type)> {
    if txs.is_empty() {
        errors.push(syn::Error::new(
            sig.ident.span(),
            "`#[idempotent]` handlers take exactly one `Tx<DB>` parameter, the request's \
             transaction; add one, e.g. `mut tx: idem::Tx<sqlx::Postgres>` (an alias of it \
             must be named `Tx`), or `phases: idem::Phases<DB>` for effects outside the database",
        ));
        return None;
    }
    // The one that names its database is the transaction when only one
    // does: a bare `Tx` beside it is the odd one (an own type named `Tx`,
    // say), and is reported as such. Otherwise the first one is.
    let explicit: Vec<usize> = (0..txs.len())
        .filter(|&at| matches!(txs[at].1, Some(Some(_))))
        .collect();
    let chosen = match explicit.as_slice() {
        [only] => *only,
        _ => 0,
    };
    let (index, db, ty) = &txs[chosen];
    let kind_of = |ty: &Type| match tx_database(ty) {
        TxParam::Tx(_, kind) => Some(kind),
        _ if last_ident_is(ty, "Phases") => Some(Kind::Phases),
        _ => Some(Kind::Tx),
    };
    let chosen_kind = kind_of(ty);
    if db.is_none() {
        let message = if chosen_kind == Some(Kind::Phases) {
            "`Phases` takes the database as its one type argument, e.g. `Phases<sqlx::Postgres>`"
        } else {
            "`Tx` takes the database as its one type argument, e.g. `Tx<sqlx::Postgres>`"
        };
        errors.push(syn::Error::new_spanned(ty, message));
    }
    for (at, (_, other_db, other)) in txs.iter().enumerate() {
        if at == chosen {
            continue;
        }
        let message = if kind_of(other) != chosen_kind {
            "a handler runs either in one transaction (`Tx<DB>`, the atomic mode) or in phases \
             (`Phases<DB>`, for effects outside the database), not both: remove one"
        } else if chosen_kind == Some(Kind::Phases) {
            "a second `Phases` parameter: a phased handler has exactly one; remove this one"
        } else if explicit.len() == 1 && matches!(other_db, Some(None)) {
            "a second `Tx` parameter: `#[idempotent]` handlers run in exactly one transaction, \
             and read a bare `Tx` as an alias of `idem::Tx` (rename another type named `Tx`)"
        } else {
            "a second `Tx` parameter: `#[idempotent]` handlers run in exactly one transaction"
        };
        errors.push(syn::Error::new_spanned(other, message));
    }
    match (db, txs.len()) {
        (Some(db), 1) => Some((*index, db.cloned(), (*ty).clone())),
        _ => None,
    }
}

/// Whether `ty` is a path whose last segment is `name`.
fn last_ident_is(ty: &Type, name: &str) -> bool {
    matches!(ty, Type::Path(path) if path.path.segments.last().is_some_and(|last| last.ident == name))
}

/// A well-known body extractor anywhere but last.
fn check_body_is_last(extractors: &[Param], errors: &mut Errors) {
    if let Some((_last, before_last)) = extractors.split_last() {
        for param in before_last {
            if let Some(name) = body_extractor(&param.ty) {
                errors.push(syn::Error::new_spanned(
                    &param.ty,
                    format!("`{name}` consumes the request body, so it must be the last extractor"),
                ));
            }
        }
    }
}

/// Which of the two modes' parameters a type is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `Tx<DB>`: the atomic mode.
    Tx,
    /// `Phases<DB>`: the phased mode.
    Phases,
}

/// What a parameter's type says about the transaction.
enum TxParam<'a> {
    /// `Tx<DB>` or `Phases<DB>`: the request's transaction (or phases)
    /// over `DB`.
    Tx(&'a Type, Kind),
    /// A bare `Tx`: an alias naming its database, or `idem::Tx` without
    /// one (which rustc then reports on the token).
    Alias,
    /// `Tx` with arguments other than one type.
    Malformed,
    No,
}

/// `Tx<DB>` or `Phases<DB>` (any path ending in either) yields `DB`; a
/// bare `Tx` is an alias. (`Phases` has no alias form.)
fn tx_database(ty: &Type) -> TxParam<'_> {
    let Type::Path(path) = ty else {
        return TxParam::No;
    };
    let Some(last) = path.path.segments.last() else {
        return TxParam::No;
    };
    let kind = if last.ident == "Tx" {
        Kind::Tx
    } else if last.ident == "Phases" {
        Kind::Phases
    } else {
        return TxParam::No;
    };
    let args = match &last.arguments {
        PathArguments::None if kind == Kind::Tx => return TxParam::Alias,
        PathArguments::AngleBracketed(args) => args,
        _ => return TxParam::Malformed,
    };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(db)] => TxParam::Tx(db, kind),
        _ => TxParam::Malformed,
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
                    errors.push(syn::Error::new_spanned(
                        &param.pat,
                        format!("bind the scope parameter `{wanted}` whole, without a `@` pattern"),
                    ));
                    return None;
                }
                if let Some(name) = body_extractor(&param.ty) {
                    errors.push(syn::Error::new_spanned(
                        &param.ty,
                        format!(
                            "the scope cannot come from the request body (`{name}`), which the \
                             client writes freely; name the authenticated caller, an extractor of \
                             the request's head (`FromRequestParts`) that implements `idem::Scope`"
                        ),
                    ));
                    return None;
                }
                return Some(index);
            }
            Pat::Ident(_) => {}
            other if binds(other, &wanted) => {
                errors.push(syn::Error::new_spanned(
                    other,
                    format!(
                        "`scope = \"{wanted}\"` names a binding inside a pattern; bind the whole \
                         extractor to a name (e.g. `{wanted}: {}`) and name that",
                        type_text(&param.ty)
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

/// A type as the user would write it, for suggestions in messages.
fn type_text(ty: &Type) -> String {
    let mut text = ty.to_token_stream().to_string();
    for (spaced, tight) in [
        (" <", "<"),
        ("< ", "<"),
        (" >", ">"),
        (" ::", "::"),
        (":: ", "::"),
        (" ,", ","),
        ("& ", "&"),
    ] {
        text = text.replace(spaced, tight);
    }
    text
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;
    use crate::attr;

    fn messages(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> Vec<String> {
        let item: ItemFn = syn::parse2(item).unwrap();
        let mut errors = Errors::default();
        let args = attr::parse(args, &mut errors);
        let handler = check(&item, &args, &mut errors);
        match errors.into_result() {
            Ok(()) => vec![],
            Err(error) => {
                assert!(handler.is_none(), "errors, yet a handler to expand");
                error.into_iter().map(|e| e.to_string()).collect()
            }
        }
    }

    #[test]
    fn a_valid_handler_is_described() {
        let item: ItemFn = syn::parse2(quote! {
            async fn create(h: HeaderMap, mut tx: idem::Tx<Postgres>, account: Account, Json(b): Json<B>) {}
        })
        .unwrap();
        let mut errors = Errors::default();
        let args = attr::parse(quote!(scope = "account"), &mut errors);
        let handler = check(&item, &args, &mut errors).unwrap();
        assert_eq!(handler.extractors.len(), 3);
        assert_eq!((handler.tx_index, handler.scope_index), (1, 1));
        assert_eq!(type_text(handler.db.as_ref().unwrap()), "Postgres");
        assert_eq!(type_text(&handler.tx_ty), "idem::Tx<Postgres>");
    }

    /// A bare `Tx` is an alias (`type Tx = idem::Tx<Postgres>;`): its
    /// database is left for the expansion to read off the type.
    #[test]
    fn a_bare_tx_is_an_alias() {
        let item: ItemFn = syn::parse2(quote! {
            async fn create(account: Account, tx: crate::db::Tx, Json(b): Json<B>) {}
        })
        .unwrap();
        let mut errors = Errors::default();
        let args = attr::parse(quote!(scope = "account"), &mut errors);
        let handler = check(&item, &args, &mut errors).unwrap();
        assert!(errors.into_result().is_ok());
        assert!(handler.db.is_none());
        assert_eq!(type_text(&handler.tx_ty), "crate::db::Tx");
        assert_eq!(handler.tx_index, 1);
    }

    #[test]
    fn every_signature_error_is_reported_at_once() {
        let found = messages(
            quote!(scope = "account"),
            quote! {
                const unsafe extern "C" fn create<T>(Json(b): Json<T>, account: Account, id: impl Send) {}
            },
        );
        assert_eq!(found.len(), 8, "{found:?}");
        for expected in [
            "`const`",
            "`unsafe`",
            "`extern`",
            "`async fn`",
            "generic",
            "`impl Trait`",
            "`Tx<DB>`",
            "`Json` consumes",
        ] {
            assert!(
                found.iter().any(|m| m.contains(expected)),
                "{expected}: {found:?}"
            );
        }
    }

    #[test]
    fn transactions_are_counted() {
        let two = messages(
            quote!(scope = "a"),
            quote!(
                async fn f(a: A, x: Tx<Pg>, y: Tx<Pg>) {}
            ),
        );
        assert_eq!(two.len(), 1);
        assert!(two[0].starts_with("a second `Tx`"));
        let needs_db =
            "`Tx` takes the database as its one type argument, e.g. `Tx<sqlx::Postgres>`";
        for malformed in [
            quote!(Tx<Pg, Pg>),
            quote!(idem::Tx<'a>),
            quote!(Tx<DB = Pg>),
        ] {
            let found = messages(
                quote!(scope = "a"),
                quote!(async fn f(a: A, x: #malformed) {}),
            );
            assert_eq!(found, [needs_db], "{malformed}");
        }
        // Beside the one `Tx<DB>`, a bare `Tx` (before or after it) is the
        // second one, and is told why.
        let bare_second = "a second `Tx` parameter: `#[idempotent]` handlers run in exactly \
                           one transaction, and read a bare `Tx` as an alias of `idem::Tx` \
                           (rename another type named `Tx`)";
        assert_eq!(
            messages(
                quote!(scope = "a"),
                quote!(
                    async fn f(a: A, y: Tx, x: Tx<Pg>) {}
                )
            ),
            [bare_second]
        );
        assert_eq!(
            messages(
                quote!(scope = "a"),
                quote!(
                    async fn f(a: A, x: Tx<Pg>, y: Tx) {}
                )
            ),
            [bare_second]
        );
    }

    #[test]
    fn a_tx_by_reference_is_taken_by_value() {
        let by_value = |item: proc_macro2::TokenStream| messages(quote!(scope = "a"), item);
        assert_eq!(
            by_value(quote!(
                async fn f(a: A, tx: &mut Tx<Postgres>) {}
            )),
            [
                "take `Tx<Postgres>` by value: `mut tx: Tx<Postgres>`; the handler owns the \
                 request's transaction, which commits with the stored response"
            ]
        );
        for item in [
            quote!(
                async fn f(a: A, mut tx: &'static mut idem::Tx<Pg>) {}
            ),
            quote!(
                async fn f(a: A, tx: &idem::Tx<Pg>) {}
            ),
            quote!(
                async fn f(a: A, tx: &mut db::Tx) {}
            ),
        ] {
            let found = by_value(item.clone());
            assert_eq!(found.len(), 1, "{item}: {found:?}");
            assert!(found[0].starts_with("take `"), "{item}: {found:?}");
            assert!(found[0].contains(": `mut tx: "), "{item}: {found:?}");
        }
        let phases = by_value(quote!(
            async fn f(a: A, phases: &mut Phases<Pg>) {}
        ));
        assert_eq!(phases.len(), 1, "{phases:?}");
        assert!(phases[0].starts_with("take `Phases<Pg>` by value: `mut phases: Phases<Pg>`"));
        // Other references are extractors (and rustc's to refuse).
        assert!(
            by_value(quote!(
                async fn f(a: A, s: &str, tx: Tx<Pg>) {}
            ))
            .is_empty()
        );
    }

    #[test]
    fn scope_messages_list_the_candidates() {
        let item = quote!(
            async fn f(account: A, headers: H, (x, y): P, tx: Tx<Pg>) {}
        );
        assert_eq!(
            messages(quote!(scope = "acount"), item.clone()),
            [
                "`scope = \"acount\"` names no parameter of this handler; it could name `account` or `headers`"
            ]
        );
        assert!(messages(quote!(scope = "tx"), item.clone())[0].contains("names the transaction"));
        assert!(
            messages(quote!(scope = "y"), item.clone())[0].contains("binding inside a pattern")
        );
        assert!(messages(quote!(), item)[0].contains("it could name `account` or `headers`"));
        let body = messages(
            quote!(scope = "s"),
            quote!(
                async fn f(tx: Tx<Pg>, s: String) {}
            ),
        );
        assert!(body[0].starts_with("the scope cannot come from the request body (`String`)"));
    }

    #[test]
    fn body_extractors_come_last() {
        let found = messages(
            quote!(scope = "a"),
            quote!(
                async fn f(b: axum::body::Bytes, a: A, tx: Tx<Pg>) {}
            ),
        );
        assert_eq!(
            found,
            ["`Bytes` consumes the request body, so it must be the last extractor"]
        );
        // The `Tx` is no extractor: it may follow the body.
        assert!(
            messages(
                quote!(scope = "a"),
                quote!(
                    async fn f(a: A, b: Json<B>, tx: Tx<Pg>) {}
                )
            )
            .is_empty()
        );
    }

    #[test]
    fn types_read_as_written() {
        let ty: Type = syn::parse2(quote!(Option<Vec<(i64, &'static str)>>)).unwrap();
        assert_eq!(type_text(&ty), "Option<Vec<(i64, &'static str)>>");
    }

    #[test]
    fn a_phased_handler_is_described() {
        let item: ItemFn = syn::parse2(quote! {
            async fn pay(account: Account, mut phases: idem::Phases<Postgres>, Json(b): Json<B>) {}
        })
        .unwrap();
        let mut errors = Errors::default();
        let args = attr::parse(quote!(scope = "account", lease = "5s"), &mut errors);
        let handler = check(&item, &args, &mut errors).unwrap();
        assert!(errors.into_result().is_ok());
        assert!(handler.phased);
        assert_eq!(handler.extractors.len(), 2);
        assert_eq!((handler.tx_index, handler.scope_index), (1, 0));
        assert_eq!(type_text(handler.db.as_ref().unwrap()), "Postgres");
        assert_eq!(type_text(&handler.tx_ty), "idem::Phases<Postgres>");
        // Without `lease`, and with the arguments both modes take.
        let plain = quote!(
            async fn pay(account: Account, phases: Phases<Pg>) {}
        );
        for args in [
            quote!(scope = "account"),
            quote!(
                scope = "account",
                key = "required",
                ttl = "1h",
                timeout = "5s"
            ),
        ] {
            assert!(messages(args.clone(), plain.clone()).is_empty(), "{args}");
        }
    }

    #[test]
    fn mode_arguments_fit_the_mode() {
        let atomic = quote!(
            async fn f(a: A, tx: Tx<Pg>) {}
        );
        let phased = quote!(
            async fn f(a: A, phases: Phases<Pg>) {}
        );
        let lease = messages(quote!(scope = "a", lease = "5s"), atomic.clone());
        assert_eq!(lease.len(), 1);
        assert!(
            lease[0].starts_with("`lease` is for phased handlers")
                && lease[0].ends_with("remove `lease`"),
            "{lease:?}"
        );
        // Both modes take these.
        assert!(messages(quote!(scope = "a", key = "optional", wait = "2s"), atomic).is_empty());
        let optional = messages(quote!(scope = "a", key = "optional"), phased.clone());
        assert_eq!(
            optional,
            [
                "a phased handler needs a key: its phases are recorded under it, so it cannot \
                 be optional; remove `key = \"optional\"`"
            ]
        );
        let wait = messages(quote!(scope = "a", wait = "2s"), phased.clone());
        assert_eq!(wait.len(), 1);
        assert!(
            wait[0].starts_with("`wait` is for handlers with a `Tx`"),
            "{wait:?}"
        );
        // Even the default, written out.
        assert_eq!(
            messages(quote!(scope = "a", wait = "0s"), phased.clone()),
            wait
        );
        // Every misfit at once.
        let both = messages(
            quote!(scope = "a", key = "optional", wait = "1s", lease = "2s"),
            phased.clone(),
        );
        assert_eq!(both.len(), 2, "{both:?}");
        // An argument error leaves the mode to be checked once it is fixed:
        // the handler still expands, with the default lease.
        let mut errors = Errors::default();
        let args = attr::parse(quote!(scope = "a", lease = "1d"), &mut errors);
        let handler = check(&syn::parse2(phased).unwrap(), &args, &mut errors).unwrap();
        assert!(handler.phased);
        assert_eq!(
            (errors.count(), args.lease_ms()),
            (1, attr::DEFAULT_LEASE_MS)
        );
    }

    #[test]
    fn one_mode_and_one_parameter_of_it() {
        let not_both = "a handler runs either in one transaction (`Tx<DB>`, the atomic mode) or \
                        in phases (`Phases<DB>`, for effects outside the database), not both: \
                        remove one";
        // Whichever mode comes first, the other is the odd one (the
        // trybuild case `tx_and_phases` shows it on the second's type).
        for item in [
            quote!(
                async fn f(a: A, x: Tx<Pg>, p: Phases<Pg>) {}
            ),
            quote!(
                async fn f(a: A, p: Phases<Pg>, x: Tx<Pg>) {}
            ),
            quote!(
                async fn f(a: A, p: Phases<Pg>, x: Tx) {}
            ),
        ] {
            assert_eq!(
                messages(quote!(scope = "a"), item.clone()),
                [not_both],
                "{item}"
            );
        }
        assert_eq!(
            messages(
                quote!(scope = "a"),
                quote!(
                    async fn f(a: A, p: Phases<Pg>, q: Phases<Pg>) {}
                )
            ),
            ["a second `Phases` parameter: a phased handler has exactly one; remove this one"]
        );
        let needs_db =
            "`Phases` takes the database as its one type argument, e.g. `Phases<sqlx::Postgres>`";
        for malformed in [
            quote!(Phases),
            quote!(idem::Phases<Pg, Pg>),
            quote!(Phases<'a>),
        ] {
            let found = messages(
                quote!(scope = "a"),
                quote!(async fn f(a: A, p: #malformed) {}),
            );
            assert_eq!(found, [needs_db], "{malformed}");
        }
        let none = messages(
            quote!(scope = "a"),
            quote!(
                async fn f(a: A) {}
            ),
        );
        assert!(none[0].contains("`phases: idem::Phases<DB>`"), "{none:?}");
        // The scope cannot name the phases either.
        assert!(
            messages(
                quote!(scope = "p"),
                quote!(
                    async fn f(a: A, p: Phases<Pg>) {}
                )
            )[0]
            .contains("names the transaction")
        );
    }
}
