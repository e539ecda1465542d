//! The `#[idempotent]` attribute of [`idem`](https://docs.rs/idem).
//!
//! Depend on `idem`, which re-exports this attribute; the expansion names
//! only `::idem::__private` paths (or the `crate = "..."` override).

#![warn(missing_docs)]

mod attr;
mod duration;
mod errors;
mod expand;
mod shell;
mod valid;

use proc_macro::TokenStream;

/// Makes an axum write handler safe to retry with an `Idempotency-Key`.
///
/// See the `idem` crate for the arguments and the full contract.
///
/// A handler declared to return a `Result` (under any alias) rolls its
/// transaction back on `Err`, whatever the error's status; any answer
/// rolls back on a transient status (5xx, 408, 429). The return type must
/// name the `Result` for that: behind `-> impl IntoResponse` only the
/// status is seen.
///
/// The handler's name becomes a unit struct (the value `post(name)`
/// routes) in the function's module, so a handler is a free function (not
/// in an `impl` block) and no module or type beside it has its name. Doc
/// comments and `#[deprecated]` go onto that struct; other attributes
/// below `#[idempotent]` (lints, `#[tracing::instrument]`) onto the body,
/// kept as the struct's associated function of the same name. axum's
/// `#[debug_handler]` is refused: the `Tx` is not one of its extractors. Inside the handler, parameters and
/// locals may still be named like it: there, the name is a plain function,
/// not the handler. Elsewhere in that module a pattern of that name
/// matches the struct instead of binding, as with any unit struct.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    idempotent_impl(args.into(), item.into()).into()
}

fn idempotent_impl(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let item: syn::ItemFn = match syn::parse2(item.clone()) {
        Ok(item) => item,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "`#[idempotent]` applies to an `async fn` handler",
            );
            let error = error.to_compile_error();
            return quote::quote!(#error #item);
        }
    };
    let mut errors = errors::Errors::default();
    let args = attr::parse(args, &mut errors);
    let handler = valid::check(&item, &args, &mut errors);
    let error = errors
        .into_result()
        .err()
        .map(|error| error.to_compile_error());
    match handler {
        // Argument errors alone still expand (with defaults in their place),
        // so the route that uses the handler compiles and only the real
        // mistakes are reported.
        Some(handler) => {
            let expanded = expand::expand(&item, &args, &handler);
            quote::quote!(#error #expanded)
        }
        // A receiver means the function sits in an `impl` block, where a
        // struct cannot go: keep the function exactly as written.
        None if item.sig.receiver().is_some() => quote::quote!(#error #item),
        // The signature itself is wrong: keep the user's function beside
        // the errors (IDEs keep working on its body) behind a handler that
        // still routes, so no secondary errors follow.
        None => {
            let stub = expand::stub(&item, &args);
            quote::quote!(#error #stub)
        }
    }
}
