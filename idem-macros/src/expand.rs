//! Emitting the handler: a unit struct named like the function, with an
//! axum `Handler` impl generic over the router state.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote};
use syn::spanned::Spanned;
use syn::{Attribute, ItemFn, ReturnType};

use crate::attr::{Args, KeyMode};
use crate::valid::{self, Handler, Param};

/// The struct-and-impls expansion of a handler that passed every check.
pub fn expand(item: &ItemFn, args: &Args, handler: &Handler) -> TokenStream {
    let krate = krate(args);
    let private = quote!(#krate::__private);
    let db = &handler.db;
    let ttl = args.ttl_ms();
    let wait = args.wait_ms();
    let mode = match args.key.unwrap_or(KeyMode::Required) {
        KeyMode::Required => quote!(Required),
        KeyMode::Optional => quote!(Optional),
    };

    // The scope identifies the caller, so it comes from the request's
    // head, never from its body: it is always a parts extractor. Only a
    // last parameter that is not the scope may consume the body.
    let (parts, body) = match handler.extractors.split_last() {
        Some((last, rest)) if handler.scope_index != rest.len() => (rest, Some(last)),
        _ => (handler.extractors.as_slice(), None),
    };
    let part_bounds = parts.iter().map(|param| {
        let ty = &param.ty;
        let bound = respan(quote!(#private::FromRequestParts<__IdemS>), ty.span());
        quote!(#ty: #bound,)
    });
    let extract_parts = parts.iter().map(|param| {
        let (ty, local) = (&param.ty, &param.local);
        quote! {
            let #local = match <#ty as #private::FromRequestParts<__IdemS>>::from_request_parts(
                &mut __idem_parts,
                &__idem_state,
            )
            .await
            {
                ::core::result::Result::Ok(value) => value,
                ::core::result::Result::Err(rejection) => {
                    return #private::IntoResponse::into_response(rejection);
                }
            };
        }
    });
    let Body {
        marker_param,
        marker,
        bound: body_bound,
        extract: extract_body,
    } = Body::new(body, &private);

    let scope = &handler.extractors[handler.scope_index];
    let (scope_ty, scope_local) = (&scope.ty, &scope.local);
    // Spanned at the scope's type: a type without `Scope` is reported there,
    // with `Scope`'s own `on_unimplemented` message.
    let scope_call = respan(quote!(#krate::Scope>::scope), scope_ty.span());
    // The response is converted here, by a call spanned at the return
    // type, so a type that is not `IntoResponse` is reported there (and a
    // future that is not `Send` fails `run`'s bound, spanned there too).
    let output_span = match &item.sig.output {
        ReturnType::Default => item.sig.ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let into_response = respan(
        quote!(#private::IntoResponse::into_response(__idem_output)),
        output_span,
    );
    let run = respan(quote!(#private::run), output_span);

    let mut call_args: Vec<TokenStream> = handler
        .extractors
        .iter()
        .map(|p| p.local.to_token_stream())
        .collect();
    call_args.insert(handler.tx_index, quote!(__idem_tx));

    let Shell {
        cfgs,
        declaration,
        name,
    } = Shell::new(item);
    quote! {
        #declaration

        #(#cfgs)*
        #[automatically_derived]
        impl<__IdemS #marker_param> #private::Handler<(#marker,), __IdemS> for #name
        where
            __IdemS: ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static,
            #krate::Idem<#db>: #private::FromRef<__IdemS>,
            #(#part_bounds)*
            #body_bound
        {
            type Future = #private::BoxFuture;

            fn call(self, __idem_request: #private::Request, __idem_state: __IdemS) -> Self::Future {
                ::std::boxed::Box::pin(async move {
                    const __IDEM_CONFIG: #private::Config =
                        #private::Config::new(#ttl, #wait, #private::KeyMode::#mode);
                    let (mut __idem_parts, __idem_body) = #private::into_parts(__idem_request);
                    #(#extract_parts)*
                    let __idem_store =
                        <#krate::Idem<#db> as #private::FromRef<__IdemS>>::from_ref(&__idem_state);
                    let (__idem_prepared, __idem_request) =
                        match #private::prepare(&__idem_store, __idem_parts, __idem_body, &__IDEM_CONFIG).await {
                            ::core::result::Result::Ok(prepared) => prepared,
                            ::core::result::Result::Err(response) => return response,
                        };
                    #extract_body
                    let __idem_scope = ::std::borrow::Cow::<'static, str>::Owned(
                        <#scope_ty as #scope_call(&#scope_local).into_owned(),
                    );
                    #run(__idem_store, __idem_prepared, __idem_scope, move |__idem_tx| async move {
                        let __idem_output = Self::__idem_handler(#(#call_args),*).await;
                        #into_response
                    })
                    .await
                })
            }
        }
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
        declaration,
        name,
    } = Shell::new(item);
    quote! {
        #declaration

        #(#cfgs)*
        #[automatically_derived]
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
    /// well-known one such as `Json`) the impl names it, so rustc explains an
    /// unsatisfied bound instead of reporting an ambiguous `Handler`.
    fn new(body: Option<&Param>, private: &TokenStream) -> Self {
        let Some(param) = body else {
            return Self {
                marker_param: quote!(),
                marker: quote!(()),
                bound: quote!(),
                extract: quote!(::core::mem::drop(__idem_request);),
            };
        };
        let (ty, local) = (&param.ty, &param.local);
        let (marker_param, marker, via) = if valid::body_extractor(ty).is_some() {
            (quote!(), quote!(()), quote!())
        } else {
            (quote!(, __IdemM), quote!(__IdemM), quote!(, __IdemM))
        };
        let bound = respan(quote!(#private::FromRequest<__IdemS #via>), ty.span());
        Self {
            marker_param,
            marker,
            bound: quote!(#ty: #bound,),
            extract: quote! {
                let #local = match <#ty as #private::FromRequest<__IdemS #via>>::from_request(
                    __idem_request,
                    &__idem_state,
                )
                .await
                {
                    ::core::result::Result::Ok(value) => value,
                    ::core::result::Result::Err(rejection) => {
                        return #private::IntoResponse::into_response(rejection);
                    }
                };
            },
        }
    }
}

/// The unit struct standing for the handler, and the user's function kept
/// verbatim beside it as `__idem_handler`.
struct Shell {
    /// `#[cfg]`s of the function, which every generated item inherits.
    cfgs: Vec<Attribute>,
    declaration: TokenStream,
    name: syn::Ident,
}

impl Shell {
    fn new(item: &ItemFn) -> Self {
        let vis = &item.vis;
        let name = item.sig.ident.clone();
        let mut docs = Vec::new();
        let mut cfgs = Vec::new();
        let mut attrs = Vec::new();
        for attr in &item.attrs {
            if attr.path().is_ident("doc") {
                docs.push(attr);
            } else if attr.path().is_ident("cfg") {
                cfgs.push(attr.clone());
            } else {
                attrs.push(attr);
            }
        }
        // The user's function, verbatim, as an associated function: type
        // errors in its body point at the user's code.
        let mut sig = item.sig.clone();
        sig.ident = format_ident!("__idem_handler", span = name.span());
        let block = &item.block;
        let declaration = quote! {
            #(#cfgs)*
            #(#docs)*
            #[allow(non_camel_case_types)]
            #[derive(Clone, Copy, Debug, Default)]
            #vis struct #name;

            #(#cfgs)*
            impl #name {
                #(#attrs)*
                #[allow(dead_code, clippy::too_many_arguments)]
                #sig #block
            }
        };
        Self {
            cfgs,
            declaration,
            name,
        }
    }
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
