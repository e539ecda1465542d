//! Emitting the handler: a unit struct named like the function, with an
//! axum `Handler` impl generic over the router state.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemFn, ReturnType};

use crate::attr::{Args, KeyMode};
use crate::valid::Handler;

pub fn expand(item: &ItemFn, args: &Args, handler: &Handler) -> TokenStream {
    let krate = match &args.krate {
        Some(path) => quote!(#path),
        None => quote!(::idem),
    };
    let private = quote!(#krate::__private);
    let vis = &item.vis;
    let name = &item.sig.ident;
    let (docs, attrs): (Vec<_>, Vec<_>) = item
        .attrs
        .iter()
        .partition(|attr| attr.path().is_ident("doc"));

    // The user's function, verbatim, as an associated function: type errors
    // in its body point at the user's code.
    let mut inner_sig = item.sig.clone();
    inner_sig.ident = syn::Ident::new("__idem_handler", name.span());
    let block = &item.block;

    let db = &handler.db;
    let ttl = args.ttl_ms();
    let wait = args.wait_ms();
    let mode = match args.key.unwrap_or(KeyMode::Required) {
        KeyMode::Required => quote!(Required),
        KeyMode::Optional => quote!(Optional),
    };

    let (last, parts) = handler
        .extractors
        .split_last()
        .expect("the scope parameter is an extractor");
    let part_bounds = parts.iter().map(|param| {
        let ty = &param.ty;
        quote_spanned!(ty.span()=> #ty: #private::FromRequestParts<__IdemS>,)
    });
    let last_ty = &last.ty;
    let last_bound =
        quote_spanned!(last_ty.span()=> #last_ty: #private::FromRequest<__IdemS, __IdemM>,);
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
    let last_local = &last.local;

    let scope = &handler.extractors[handler.scope_index];
    let (scope_ty, scope_local) = (&scope.ty, &scope.local);
    let scope_check = quote_spanned!(scope_ty.span()=> __idem_is_scope::<#scope_ty>(););
    // A return type that is not `IntoResponse` fails the `run` call's
    // bound; spanning the call at the return type puts the error there.
    let output_span = match &item.sig.output {
        ReturnType::Default => item.sig.ident.span(),
        ReturnType::Type(_, ty) => ty.span(),
    };
    let run = quote_spanned!(output_span=> #private::run);

    let mut call_args: Vec<TokenStream> = handler
        .extractors
        .iter()
        .map(|p| {
            let local = &p.local;
            quote!(#local)
        })
        .collect();
    call_args.insert(handler.tx_index, quote!(__idem_tx));

    quote! {
        #(#docs)*
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #name;

        impl #name {
            #(#attrs)*
            #[allow(clippy::too_many_arguments)]
            #inner_sig #block

            #[doc(hidden)]
            #[allow(dead_code)]
            fn __idem_checks() {
                fn __idem_is_scope<T: ?::core::marker::Sized + #krate::Scope>() {}
                #scope_check
            }
        }

        #[automatically_derived]
        impl<__IdemS, __IdemM> #private::Handler<(__IdemM,), __IdemS> for #name
        where
            __IdemS: ::core::clone::Clone + ::core::marker::Send + ::core::marker::Sync + 'static,
            #krate::Idem<#db>: #private::FromRef<__IdemS>,
            #(#part_bounds)*
            #last_bound
        {
            type Future = #private::BoxFuture;

            fn call(self, __idem_request: #private::Request, __idem_state: __IdemS) -> Self::Future {
                ::std::boxed::Box::pin(async move {
                    const __IDEM_CONFIG: #private::Config =
                        #private::Config::new(#ttl, #wait, #private::KeyMode::#mode);
                    let (mut __idem_parts, __idem_body) = #private::into_parts(__idem_request);
                    #(#extract_parts)*
                    let (__idem_prepared, __idem_request) =
                        match #private::prepare(__idem_parts, __idem_body, &__IDEM_CONFIG).await {
                            ::core::result::Result::Ok(prepared) => prepared,
                            ::core::result::Result::Err(response) => return response,
                        };
                    let #last_local =
                        match <#last_ty as #private::FromRequest<__IdemS, __IdemM>>::from_request(
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
                    let __idem_scope = ::std::borrow::Cow::<'static, str>::Owned(
                        #krate::Scope::scope(&#scope_local).into_owned(),
                    );
                    let __idem_store = <#krate::Idem<#db> as #private::FromRef<__IdemS>>::from_ref(&__idem_state);
                    #run(__idem_store, __idem_prepared, __idem_scope, move |__idem_tx| {
                        Self::__idem_handler(#(#call_args),*)
                    })
                    .await
                })
            }
        }
    }
}
