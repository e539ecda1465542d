//! The items that stand for a handler: a unit struct named like the
//! function (the value `post(name)` routes) and the user's function kept
//! beside it as the struct's associated function of the same name (so
//! `#[tracing::instrument]` below the attribute names its span after the
//! handler).

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote};
use syn::ext::IdentExt;
use syn::{Attribute, FnArg, Ident, ItemFn, Pat, PatIdent};

/// The unit struct standing for the handler, and the user's function kept
/// beside it.
pub struct Shell {
    /// `#[cfg]`s of the function, which every generated item inherits.
    pub cfgs: Vec<Attribute>,
    /// `#[allow(deprecated)]` if the handler is `#[deprecated]` (its own
    /// impls name it), else nothing: the body's uses of deprecated items
    /// still warn.
    pub allow_deprecated: TokenStream,
    pub declaration: TokenStream,
    pub name: Ident,
}

impl Shell {
    pub fn new(item: &ItemFn) -> Self {
        let vis = &item.vis;
        let name = item.sig.ident.clone();
        // Docs and `#[deprecated]` belong to what users name, the struct;
        // a `#[cfg]` to everything.
        let mut on_struct = Vec::new();
        let mut cfgs = Vec::new();
        let mut attrs = Vec::new();
        for attr in &item.attrs {
            if attr.path().is_ident("doc") || attr.path().is_ident("deprecated") {
                on_struct.push(attr);
            } else if attr.path().is_ident("cfg") {
                cfgs.push(attr.clone());
            } else if crate::valid::is_debug_handler(attr) || crate::valid::is_utoipa_path(attr) {
                // Reported by `valid`; kept, it would add errors of its own.
            } else {
                attrs.push(attr);
            }
        }
        let function = kept_function(item, &name);
        let allow_deprecated = if on_struct
            .iter()
            .any(|attr| attr.path().is_ident("deprecated"))
        {
            quote!(#[allow(deprecated)])
        } else {
            TokenStream::new()
        };
        // `async` is required by the attribute, so `clippy::unused_async`'s
        // advice cannot be followed (it is silent for a plain axum handler,
        // which is passed by value rather than called). The user's own
        // attributes come after these, so their `#[expect]` or `#[deny]` of
        // one of these lints is what holds.
        let declaration = quote! {
            #(#cfgs)*
            #(#on_struct)*
            #[allow(non_camel_case_types)]
            #[derive(
                ::core::clone::Clone,
                ::core::marker::Copy,
                ::core::fmt::Debug,
                ::core::default::Default,
            )]
            #vis struct #name;

            #(#cfgs)*
            #allow_deprecated
            impl #name {
                #[allow(dead_code, clippy::too_many_arguments, clippy::unused_async)]
                #(#attrs)*
                #function
            }
        };
        Self {
            cfgs,
            allow_deprecated,
            declaration,
            name,
        }
    }
}

/// The user's function as an associated function: its signature and body
/// as written, so errors in them point at the user's code. Only a `const`
/// and a variadic `...` (both already reported) go: rustc would add errors
/// of its own about them.
///
/// The unit struct is also a value named like the handler, and a pattern
/// naming a unit struct matches it instead of binding (`let refund = ..`
/// in `fn refund` would not compile). Where the function uses its own
/// name, a local `fn` of that name shadows the struct's value: patterns
/// bind over a function. Parameters are then bound at the top of the
/// body, where that `fn` is in scope, in their order (as rustc binds an
/// `async fn`'s parameters, so the drop order is the same).
fn kept_function(item: &ItemFn, name: &Ident) -> TokenStream {
    let mut sig = item.sig.clone();
    sig.constness = None;
    sig.variadic = None;
    let block = &item.block;
    let in_params = sig.inputs.iter().any(|input| match input {
        FnArg::Typed(typed) => mentions(typed.pat.to_token_stream(), name),
        FnArg::Receiver(_) => false,
    });
    if !in_params && !mentions(block.to_token_stream(), name) {
        return quote!(#sig #block);
    }
    let mut bindings = Vec::new();
    if in_params {
        for (index, input) in sig.inputs.iter_mut().enumerate() {
            let FnArg::Typed(typed) = input else { continue };
            let param = format_ident!("__idem_param{}", index, span = Span::mixed_site());
            let pat = std::mem::replace(
                &mut *typed.pat,
                Pat::Ident(PatIdent {
                    attrs: Vec::new(),
                    by_ref: None,
                    mutability: None,
                    ident: param.clone(),
                    subpat: None,
                }),
            );
            // Lint attributes concern the binding, which is now the `let`.
            let attrs = std::mem::take(&mut typed.attrs);
            bindings.push(quote!(#(#attrs)* let #pat = #param;));
        }
    }
    quote! {
        #sig {
            #[allow(dead_code, non_snake_case)]
            fn #name() {}
            #(#bindings)*
            #block
        }
    }
}

/// Whether `name` occurs anywhere in `tokens`, macro arguments included.
fn mentions(tokens: TokenStream, name: &Ident) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident.unraw() == name.unraw(),
        TokenTree::Group(group) => mentions(group.stream(), name),
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use quote::quote;

    fn kept(item: proc_macro2::TokenStream) -> String {
        let item: syn::ItemFn = syn::parse2(item).unwrap();
        super::kept_function(&item, &item.sig.ident).to_string()
    }

    #[test]
    fn a_function_that_never_names_itself_is_kept_verbatim() {
        let text = kept(quote!(
            async fn refund(a: A, Json(b): Json<B>) -> R {
                let c = a.refunds;
                c
            }
        ));
        assert_eq!(
            text,
            quote!(
                async fn refund(a: A, Json(b): Json<B>) -> R {
                    let c = a.refunds;
                    c
                }
            )
            .to_string()
        );
    }

    #[test]
    fn its_own_name_is_shadowed_by_a_function() {
        let text = kept(quote!(
            async fn refund(a: A) -> R {
                let refund = a;
                refund
            }
        ));
        assert!(text.contains("fn refund () { }"), "{text}");
        assert!(text.contains("(a : A)"), "{text}");
    }

    #[test]
    fn parameters_that_name_it_are_bound_in_the_body() {
        let text = kept(quote!(
            async fn transfer(a: A, #[allow(unused_mut)] mut transfer: T, Json(b): Json<B>) {}
        ));
        assert!(
            text.contains("(__idem_param0 : A , __idem_param1 : T , __idem_param2 : Json < B >)"),
            "{text}"
        );
        assert!(text.contains("fn transfer () { }"), "{text}");
        assert!(
            text.contains(
                "let a = __idem_param0 ; # [allow (unused_mut)] let mut transfer = __idem_param1 ; \
                 let Json (b) = __idem_param2 ;"
            ),
            "{text}"
        );
    }
}
