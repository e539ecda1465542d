#![doc = include_str!("../docs/crate.md")]
#![warn(missing_docs)]

pub use idem_macros::idempotent;
pub use idem_runtime::*;

/// The client half: intents and a retrying reqwest sender (`client` feature).
#[cfg(feature = "client")]
pub use idem_client as client;

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The guide's chapters (`docs/guide/`), their examples compiled as
/// doctests.
#[cfg(doctest)]
pub mod guide {
    #[doc = include_str!("../docs/guide/getting-started.md")]
    pub struct GettingStarted;
    #[doc = include_str!("../docs/guide/attribute.md")]
    pub struct Attribute;
    #[doc = include_str!("../docs/guide/phases.md")]
    pub struct Phases;
    #[doc = include_str!("../docs/guide/outbox.md")]
    pub struct Outbox;
    #[doc = include_str!("../docs/guide/client.md")]
    pub struct Client;
    #[doc = include_str!("../docs/guide/openapi.md")]
    pub struct Openapi;
    #[doc = include_str!("../docs/guide/operations.md")]
    pub struct Operations;
    #[doc = include_str!("../docs/guide/operator-page.md")]
    pub struct OperatorPage;
    #[doc = include_str!("../docs/guide/configuration.md")]
    pub struct Configuration;
    #[doc = include_str!("../docs/guide/engines.md")]
    pub struct Engines;
    #[doc = include_str!("../docs/guide/encryption.md")]
    pub struct Encryption;
    // Its client example needs the `client` feature.
    #[cfg(feature = "client")]
    #[doc = include_str!("../docs/guide/designing.md")]
    pub struct Designing;
}
