//! Emitting the handler: a unit struct named like the function, with an
//! axum `Handler` impl generic over the router state.
//!
//! Extractors and the store are reached through small traits implemented
//! for the state (`__IdemS: __IdemFromParts<T>` rather than
//! `T: FromRequestParts<__IdemS>`), defined once in the runtime's
//! `__private` module, so that handlers share their compiled extraction.
//! While the router's state type is still being inferred at `post(handler)`,
//! a bound whose self type is that state stays open, so rustc picks this
//! impl and later names the extractor that fails, pointing at its
//! parameter, instead of reporting that `Handler<_, _>` is not implemented.

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, quote};
use syn::{ItemFn, ReturnType, Type};

use crate::attr::{Args, KeyMode};
use crate::shell::Shell;
use crate::valid::{self, Handler, Param};

/// The struct-and-impls expansion of a handler that passed every check.
pub fn expand(item: &ItemFn, args: &Args, handler: &Handler) -> TokenStream {
    let krate = krate(args);
    let private = quote!(#krate::__private);
    let tx_ty = &handler.tx_ty;
    // A bare `Tx` (an alias) names its database through the type itself,
    // asked of the state in one bound spanned over the parameter: a type
    // that is no `idem::Tx` is then that bound's one error, at the route
    // (as an extractor that fails), not one at every use of a database
    // the compiler could not name.
    let (db, db_bound) = match &handler.db {
        Some(db) => (quote!(#db), quote!()),
        None => {
            let (first, last) = first_last(tx_ty);
            let head = respan(quote!(__IdemS: #private::__IdemTxOf<), first);
            let tail = respan(quote!(>,), last);
            (
                quote!(<__IdemS as #private::__IdemTxOf<#tx_ty>>::Database),
                quote!(#head #tx_ty #tail),
            )
        }
    };

    // The scope identifies the caller, so it comes from the request's
    // head, never from its body: it is always a parts extractor. Only a
    // last parameter that is not the scope may consume the body.
    let (parts, body) = match handler.extractors.split_last() {
        Some((last, rest)) if handler.scope_index != rest.len() => (rest, Some(last)),
        _ => (handler.extractors.as_slice(), None),
    };
    let part_bounds = parts
        .iter()
        .map(|param| bound_over(quote!(__IdemFromParts), &param.ty, quote!()));
    let extract_parts = parts.iter().enumerate().map(|(index, param)| {
        let (ty, local) = (&param.ty, &param.local);
        let extract = quote! {
            match <__IdemS as __IdemFromParts<#ty>>::extract(__idem_request, &__idem_state).await {
                ::core::result::Result::Ok(__idem_extracted) => __idem_extracted,
                ::core::result::Result::Err(__idem_rejection) => return __idem_rejection,
            }
        };
        if !(handler.phased && index == handler.scope_index) {
            return quote!(let (__idem_request, #local) = #extract;);
        }
        // A phased handler's scope is rebuilt from the stored scope when
        // the completer resumes a request (which carries no credentials).
        // `FromScope` is asked for here, in the body and spanned over the
        // scope's type, not in the impl's bounds: a type without it is
        // then reported there, with `FromScope`'s own message, rather than
        // as a handler that cannot be routed.
        let from_scope = spanned_over(quote!(<#ty as #krate::FromScope>::from_scope), ty);
        quote! {
            let __idem_resumed = __idem_request
                .extensions()
                .get::<#krate::completer::Resumed>()
                .map(|__idem_resumed| #from_scope(&__idem_resumed.scope()));
            let (__idem_request, #local) = match __idem_resumed {
                ::core::option::Option::Some(__idem_scope) => (__idem_request, __idem_scope),
                ::core::option::Option::None => #extract,
            };
        }
    });
    let Body {
        marker_param,
        marker,
        bound: body_bound,
        extract: extract_body,
    } = Body::new(body);

    // Spanned over the `Tx<..>` parameter, which is what needs the store.
    let store_bound = {
        let (first, last) = first_last(&handler.tx_ty);
        let head = respan(quote!(__IdemS: __IdemFromRef<#krate::Idem<), first);
        let tail = respan(quote!(>>,), last);
        // A phased handler's database must support phases: said once, at
        // the `Phases<..>` parameter.
        let phased = if handler.phased {
            let head = respan(quote!(#db: #private::), first);
            let tail = respan(quote!(Phased,), last);
            quote!(#head #tail)
        } else {
            quote!()
        };
        quote!(#head #db #tail #phased)
    };

    let (config, finish) = (
        config(args, handler, &private),
        finish(item, handler, &krate),
    );
    let helpers = helper_traits(&private);
    let Shell {
        cfgs,
        allow_deprecated,
        declaration,
        name,
    } = Shell::new(item);
    let policy = policy(args, Some(handler), &krate, &name);
    quote! {
        #declaration

        #(#cfgs)*
        // A `#[deprecated]` handler warns where it is routed, not here.
        #allow_deprecated
        const _: () = {
            #helpers

            #[automatically_derived]
            impl<__IdemS #marker_param> #private::Handler<(#marker,), __IdemS> for #name
            where
                __IdemS: ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static,
                #db_bound
                #store_bound
                #(#part_bounds)*
                #body_bound
            {
                type Future = #private::BoxFuture;

                fn call(self, __idem_request: #private::Request, __idem_state: __IdemS) -> Self::Future {
                    ::std::boxed::Box::pin(async move {
                        #config
                        #(#extract_parts)*
                        let __idem_store =
                            <__IdemS as __IdemFromRef<#krate::Idem<#db>>>::from_ref(&__idem_state);
                        let (__idem_parts, __idem_body) = #private::into_parts(__idem_request);
                        let (__idem_prepared, __idem_request) =
                            match #private::prepare(&__idem_store, __idem_parts, __idem_body, &__IDEM_CONFIG).await {
                                ::core::result::Result::Ok(__idem_prepared) => __idem_prepared,
                                ::core::result::Result::Err(__idem_response) => return __idem_response,
                            };
                        #extract_body
                        #finish
                    })
                }
            }

            #policy
        };
    }
}

/// The handler's arguments, checked, as the runtime takes them.
fn config(args: &Args, handler: &Handler, private: &TokenStream) -> TokenStream {
    let config = config_expr(args, Some(handler), private);
    quote! {
        const __IDEM_CONFIG: #private::Config = #config;
    }
}

/// The handler's policy, for documentation (`idem::openapi`): its
/// arguments, as the runtime takes them.
fn policy(
    args: &Args,
    handler: Option<&Handler>,
    krate: &TokenStream,
    name: &Ident,
) -> TokenStream {
    let private = quote!(#krate::__private);
    let config = config_expr(args, handler, &private);
    quote! {
        #[automatically_derived]
        impl #krate::IdempotentHandler for #name {
            const POLICY: #krate::Policy = #config.policy();
        }
    }
}

/// The arguments as a `Config` expression; without the checked handler
/// (the stub of one with errors), as if it had a `Tx`.
fn config_expr(args: &Args, handler: Option<&Handler>, private: &TokenStream) -> TokenStream {
    let ttl = args.ttl_ms();
    let wait = args.wait_ms();
    let timeout = args.timeout_ms();
    let mode = match args.key.unwrap_or(KeyMode::Required) {
        KeyMode::Required => quote!(Required),
        KeyMode::Optional => quote!(Optional),
    };
    let phased = if handler.is_some_and(|handler| handler.phased) {
        let lease = args.lease_ms();
        quote!(.phased(#lease))
    } else {
        quote!()
    };
    let tombstone = match args.tombstone {
        Some((ms, _)) => quote!(.tombstone(#ms)),
        None => quote!(),
    };
    let excluding = if args.exclude.is_empty() {
        quote!()
    } else {
        let pointers = &args.exclude;
        quote!(.excluding(&[#(#pointers),*]))
    };
    quote! {
        #private::Config::new(#ttl, #wait, #timeout, #private::KeyMode::#mode)
            #phased #tombstone #excluding
    }
}

/// Once every extractor ran: the scope, then the user's function run
/// once through the runtime, its output turned into the response.
fn finish(item: &ItemFn, handler: &Handler, krate: &TokenStream) -> TokenStream {
    let private = quote!(#krate::__private);
    let scope = &handler.extractors[handler.scope_index];
    let (scope_ty, scope_local) = (&scope.ty, &scope.local);
    // Spanned over the scope's type: a type without `Scope` is reported
    // there, with `Scope`'s own `on_unimplemented` message.
    let scope_fn = spanned_over(quote!(<#scope_ty as #krate::Scope>::scope), scope_ty);
    // The response is converted here, by a call spanned over the return
    // type, so a type that is not `IntoResponse` is reported there (and a
    // future that is not `Send` fails `run`'s bound, spanned there too).
    let output: &dyn ToTokens = match &item.sig.output {
        ReturnType::Default => &item.sig.ident,
        ReturnType::Type(_, ty) => ty,
    };
    // The argument is a field access so that its span, where rustc puts
    // the error, can run from the type's first token to its last.
    let (first, last) = first_last(output);
    let into_response = {
        let callee = spanned_over(quote!(#private::IntoResponse::into_response), output);
        let base = respan(quote!(__idem_output), first);
        let field = respan(quote!(.0), last);
        let mut args = Group::new(Delimiter::Parenthesis, quote!(#base #field));
        args.set_span(Span::call_site().located_at(last));
        quote!(#callee #args)
    };
    let run = if handler.phased {
        spanned_over(quote!(#private::run_phased), output)
    } else {
        spanned_over(quote!(#private::run), output)
    };

    let mut call_args: Vec<TokenStream> = handler
        .extractors
        .iter()
        .map(|p| p.local.to_token_stream())
        .collect();
    // An alias's transaction is handed over through the bound that named
    // its database.
    let tx_arg = match &handler.db {
        Some(_) => quote!(__idem_tx),
        None => {
            let tx_ty = &handler.tx_ty;
            quote!(<__IdemS as #private::__IdemTxOf<#tx_ty>>::from_tx(__idem_tx))
        }
    };
    call_args.insert(handler.tx_index, tx_arg);
    // The user's function, kept under its own name (see `shell`).
    let kept = &item.sig.ident;

    quote! {
        let __idem_scope = ::std::borrow::Cow::<'static, str>::Owned(
            #scope_fn(&#scope_local).into_owned(),
        );
        #run(__idem_store, __idem_prepared, __idem_scope, move |__idem_tx| async move {
            let __idem_output = (Self::#kept(#(#call_args),*).await,);
            let __idem_failed = {
                #[allow(unused_imports)]
                use #private::{NotResult as _, ResultErr as _};
                (&#private::ErrProbe(&__idem_output.0)).__idem_is_err()
            };
            #private::Answer::new(#into_response, __idem_failed)
        })
        .await
    }
}

/// The traits the `Handler` impl reaches the state, the extractors and the
/// store through (see the module docs), defined once in the runtime and
/// brought into its `const _` block.
fn helper_traits(private: &TokenStream) -> TokenStream {
    quote! {
        #[allow(unused_imports)]
        use #private::{__IdemFromBody, __IdemFromParts, __IdemFromRef, __IdemFromRequest};
    }
}

/// What a handler whose signature is wrong expands to, beside its errors:
/// the user's function kept whole (so IDEs keep working on its body) and a
/// `Handler` impl that never runs, so routes that use the handler compile
/// and no secondary errors follow.
pub fn stub(item: &ItemFn, args: &Args) -> TokenStream {
    let krate = krate(args);
    let private = quote!(#krate::__private);
    let Shell {
        cfgs,
        allow_deprecated,
        declaration,
        name,
    } = Shell::new(item);
    let policy = policy(args, None, &krate, &name);
    quote! {
        #declaration

        #(#cfgs)*
        #allow_deprecated
        #policy

        #(#cfgs)*
        #[automatically_derived]
        #allow_deprecated
        impl<__IdemS> #private::Handler<((),), __IdemS> for #name
        where
            __IdemS: ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static,
        {
            type Future = #private::BoxFuture;

            fn call(self, _: #private::Request, _: __IdemS) -> Self::Future {
                ::core::unreachable!("`#[idempotent]` reported a compile error on this handler")
            }
        }
    }
}

fn krate(args: &Args) -> TokenStream {
    match &args.krate {
        Some(path) => quote!(#path),
        None => quote!(::idem),
    }
}

/// How the last extractor, if it may consume the body, is bound and run.
struct Body {
    marker_param: TokenStream,
    marker: TokenStream,
    bound: TokenStream,
    extract: TokenStream,
}

impl Body {
    /// A last extractor's `FromRequest` has a marker parameter that only the
    /// use site can infer. Where the macro knows it (no body extractor, or a
    /// well-known one such as `Json`) the impl does without, so rustc
    /// explains an unsatisfied bound instead of reporting ambiguity.
    fn new(body: Option<&Param>) -> Self {
        let Some(param) = body else {
            return Self {
                marker_param: quote!(),
                marker: quote!(()),
                bound: quote!(),
                extract: quote!(::core::mem::drop(__idem_request);),
            };
        };
        let (ty, local) = (&param.ty, &param.local);
        let (marker_param, marker, trait_, via) = if valid::body_extractor(ty).is_some() {
            (quote!(), quote!(()), quote!(__IdemFromBody), quote!())
        } else {
            (
                quote!(, __IdemM),
                quote!(__IdemM),
                quote!(__IdemFromRequest),
                quote!(, __IdemM),
            )
        };
        Self {
            marker_param,
            marker,
            bound: bound_over(trait_.clone(), ty, via.clone()),
            extract: quote! {
                let #local =
                    match <__IdemS as #trait_<#ty #via>>::extract(__idem_request, &__idem_state).await {
                        ::core::result::Result::Ok(__idem_value) => __idem_value,
                        ::core::result::Result::Err(__idem_rejection) => {
                            return __idem_prepared.rejected(__idem_rejection);
                        }
                    };
            },
        }
    }
}

/// `__IdemS: Trait<Ty, ..>,` spanned over the user's `Ty`, where rustc's
/// "unsatisfied trait bound introduced here" then points.
fn bound_over(trait_: TokenStream, ty: &Type, rest: TokenStream) -> TokenStream {
    let (first, last) = first_last(ty);
    let head = respan(quote!(__IdemS: #trait_<), first);
    let tail = respan(quote!(#rest>,), last);
    quote!(#head #ty #tail)
}

/// The spans of `tokens`' first and last token.
fn first_last(tokens: &dyn ToTokens) -> (Span, Span) {
    let mut iter = tokens.to_token_stream().into_iter();
    let first = iter
        .next()
        .map_or_else(Span::call_site, |token| token.span());
    let last = iter.last().map_or(first, |token| token.span());
    (first, last)
}

/// Spans `tokens` over all of `over`: every token at its first token but
/// the last at its last, so rustc underlines the whole of `over` (stable
/// proc macros cannot `join` spans; this is `syn::Error::new_spanned`'s trick).
fn spanned_over(tokens: TokenStream, over: &dyn ToTokens) -> TokenStream {
    let (first, last) = first_last(over);
    let mut tokens: Vec<TokenTree> = tokens.into_iter().collect();
    let tail = tokens.pop();
    let head = respan(tokens.into_iter().collect(), first);
    let tail = respan(tail.into_iter().collect(), last);
    quote!(#head #tail)
}

/// Puts every token at `span`'s location, so errors about generated paths
/// and bounds are reported on the user's token they concern. The tokens
/// keep the macro's own hygiene, so lints still see generated code.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    let span = Span::call_site().located_at(span);
    tokens
        .into_iter()
        .map(|token| match token {
            TokenTree::Group(group) => {
                let mut new = Group::new(group.delimiter(), respan(group.stream(), span));
                new.set_span(span);
                TokenTree::Group(new)
            }
            mut other => {
                other.set_span(span);
                other
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use crate::errors::Errors;
    use crate::{attr, valid};

    fn expansion(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        let item: syn::ItemFn = syn::parse2(item).unwrap();
        let mut errors = Errors::default();
        let args = attr::parse(args, &mut errors);
        let handler = valid::check(&item, &args, &mut errors).expect("a valid handler");
        assert!(errors.into_result().is_ok());
        super::expand(&item, &args, &handler).to_string()
    }

    #[test]
    fn the_crate_override_replaces_every_path_to_idem() {
        let handler = quote! {
            async fn create(account: Account, mut tx: Tx<Postgres>, Json(n): Json<i64>) -> String {
                String::new()
            }
        };
        let default = expansion(quote!(scope = "account"), handler.clone());
        assert!(default.contains(":: idem :: __private"));
        let renamed = expansion(quote!(scope = "account", crate = "::my_idem"), handler);
        assert!(renamed.contains(":: my_idem :: __private"));
        assert!(renamed.contains(":: my_idem :: Scope"));
        assert!(!renamed.contains(":: idem ::"), "{renamed}");
    }

    #[test]
    fn generated_names_are_prefixed() {
        let text = expansion(
            quote!(scope = "account"),
            quote! {
                async fn create(account: Account, tx: Tx<Postgres>, body: Body) {}
            },
        );
        for word in text.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
            if word.starts_with("__") {
                assert!(
                    word.starts_with("__idem")
                        || word.starts_with("__Idem")
                        || word == "__IDEM_CONFIG"
                        || word == "__private",
                    "unprefixed generated name {word}"
                );
            }
        }
        assert!(text.contains("struct create"));
        assert!(text.contains("impl create { # [allow"), "{text}");
        assert!(text.contains("Self :: create ("), "{text}");
    }

    #[test]
    fn a_phased_handler_runs_in_phases() {
        let handler = quote! {
            async fn pay(account: Account, phases: Phases<Postgres>, Json(n): Json<i64>) {}
        };
        let leased = expansion(quote!(scope = "account", lease = "5s"), handler.clone());
        assert!(leased.contains(". phased (5000u64)"), "{leased}");
        assert!(leased.contains("__private :: run_phased"), "{leased}");
        assert!(
            leased.contains("Postgres : :: idem :: __private :: Phased"),
            "{leased}"
        );
        // The scope is rebuilt by `FromScope` from a resumed request, asked
        // for in the body, not in the impl's bounds.
        assert!(leased.contains("< Account as :: idem :: FromScope > :: from_scope"));
        assert!(
            leased.contains("get :: < :: idem :: completer :: Resumed > ()"),
            "{leased}"
        );
        assert!(!leased.contains("FromScope >,"), "{leased}");
        let default = expansion(quote!(scope = "account"), handler);
        assert!(default.contains(&format!(". phased ({}u64)", attr::DEFAULT_LEASE_MS)));
        let atomic = expansion(
            quote!(scope = "account"),
            quote!(
                async fn pay(account: Account, tx: Tx<Postgres>) {}
            ),
        );
        for phased_only in ["phased", "Phased", "FromScope", "Resumed"] {
            assert!(!atomic.contains(phased_only), "{phased_only}: {atomic}");
        }
    }

    #[test]
    fn the_handler_publishes_its_policy() {
        let handler = quote! {
            async fn create(account: Account, tx: Tx<Postgres>, Json(n): Json<i64>) {}
        };
        let text = expansion(
            quote!(scope = "account", ttl = "1h", key = "optional"),
            handler,
        );
        assert!(
            text.contains("impl :: idem :: IdempotentHandler for create"),
            "{text}"
        );
        assert!(
            text.contains(
                "const POLICY : :: idem :: Policy = :: idem :: __private :: Config :: new \
                 (3600000u64"
            ),
            "{text}"
        );
        assert!(text.contains("KeyMode :: Optional) . policy ()"), "{text}");
    }

    #[test]
    fn exclusions_reach_the_config() {
        let handler = quote! {
            async fn create(account: Account, tx: Tx<Postgres>, Json(n): Json<i64>) {}
        };
        let excluding = expansion(
            quote!(
                scope = "account",
                fingerprint(exclude = ["/client_ts", "/trace/id"])
            ),
            handler.clone(),
        );
        assert!(
            excluding.contains(r#". excluding (& ["/client_ts" , "/trace/id"])"#),
            "{excluding}"
        );
        assert!(!expansion(quote!(scope = "account"), handler).contains("excluding"));
    }
}
