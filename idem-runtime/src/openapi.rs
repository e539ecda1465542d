//! OpenAPI for idempotent routes, through [`utoipa`] (the `openapi`
//! feature): each route's `Idempotency-Key` parameter, the problems `idem`
//! answers in the handler's place, the replay header and the policy.
//!
//! An `#[idempotent]` handler implements [`IdempotentHandler`], which
//! carries its [`Policy`] (key required or optional, `ttl`, fingerprint
//! exclusions, lease). [`IdempotentRoutes`] names each idempotent route by
//! its method and path and adds to its operation in an OpenAPI document
//! (creating the operation if the document lacks it):
//!
//! - the `Idempotency-Key` header parameter, required unless `key =
//!   "optional"`, with the key's syntax as a pattern: an RFC 9651
//!   sf-string or a bare token, 1 to [`MAX_KEY_LEN`] visible ASCII
//!   characters;
//! - the `application/problem+json` responses `idem` answers itself, each
//!   with the `code` values it carries: 400 (`idempotency_key_missing`,
//!   `idempotency_key_invalid`, `request_body_unreadable`), 409
//!   (`idempotency_key_in_use`, with `Retry-After`; on a phased route also
//!   `idempotency_outcome_uncertain`, without), 422
//!   (`idempotency_key_reused`), 503 (`idempotency_store_unavailable`, with
//!   `Retry-After`), and 408, 413 and 504 for a slow or large body and a
//!   handler past its deadline. Where the operation already documents one
//!   of these statuses (its own 400, say), the problem is added beside it
//!   as one more content type;
//! - the replay header (`Idempotent-Replayed`, or the name given to
//!   [`Idem::replay_header`]) on every response of the operation that can
//!   be stored and replayed;
//! - the policy, in words at the end of the operation's `description` and
//!   as data in an `x-idempotency` extension: the key's syntax, that keys
//!   are kept per caller, the retention (`ttl`), what the fingerprint
//!   covers and leaves out, the replay header, and a phased handler's lease.
//!
//! ```
//! # #[cfg(feature = "postgres")]
//! # fn demo(idem: &idem_runtime::Idem<sqlx::Postgres>, create_charge: impl idem_runtime::IdempotentHandler) {
//! use idem_runtime::openapi::utoipa::openapi::{HttpMethod, OpenApi};
//!
//! # let mut api = idem_runtime::openapi::utoipa::openapi::OpenApiBuilder::new().build();
//! // `api`: a document built by `#[derive(utoipa::OpenApi)]` or by hand.
//! idem.openapi()
//!     .route(HttpMethod::Post, "/v1/charges", create_charge)
//!     .apply(&mut api);
//! # }
//! ```
//!
//! The guide's OpenAPI chapter (`docs/guide/openapi.md`) has a complete
//! service, with `#[utoipa::path]` on a handler (above `#[idempotent]`).

use std::time::Duration;

use http::{HeaderName, StatusCode};
use serde_json::{Value, json};
use utoipa::Modify;
use utoipa::openapi::extensions::Extensions;
use utoipa::openapi::header::Header;
use utoipa::openapi::path::{HttpMethod, Operation, Parameter, ParameterIn, PathItem};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::{Components, Content, OpenApi, Ref, RefOr, Required};

/// The utoipa this module builds on (5.x), for a service's own
/// `#[derive(OpenApi)]` to match.
pub use utoipa;

use crate::backend::Backend;
use crate::idem::Idem;
use crate::key::{IDEMPOTENCY_KEY, MAX_KEY_LEN};
use crate::policy::{IdempotentHandler, Policy};
use crate::problem::Problem;
use crate::response::{IDEMPOTENT_REPLAYED, is_storable};

/// The name of the problem schema added to the document's components.
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// The `Idempotency-Key` value's syntax (RFC 9651 sf-string, or a bare
/// token without a comma), as `idem` parses it: 1 to 255 visible ASCII
/// characters, counted after unquoting.
const KEY_PATTERN: &str = concat!(
    r#"^(?:[\x21\x23-\x2B\x2D-\x7E][\x21-\x2B\x2D-\x7E]{0,254}"#,
    r#"|"(?:[\x21\x23-\x5B\x5D-\x7E]|\\[\x22\x5C]){1,255}")$"#,
);

/// How the policy's text in an operation's description begins.
const POLICY_MARK: &str = "**Idempotent.**";

/// The idempotent routes of a service, to document in its OpenAPI
/// document: see the [module](self) for what each route's operation gets.
///
/// Build it from the service's key store with [`Idem::openapi`], so the
/// replay header's name and the problems' `type` are the ones the service
/// answers, name each `#[idempotent]` route with [`route`](Self::route),
/// and [`apply`](Self::apply) it to the document (it is also a
/// [`utoipa::Modify`]).
///
/// ```
/// use idem_runtime::openapi::IdempotentRoutes;
/// use idem_runtime::openapi::utoipa::openapi::{HttpMethod, OpenApiBuilder};
/// use idem_runtime::Policy;
/// use std::time::Duration;
///
/// // An `#[idempotent]` handler's policy is `Policy::of(handler)`.
/// let policy = Policy::new(true, Duration::from_secs(24 * 60 * 60));
/// let mut api = OpenApiBuilder::new().build();
/// IdempotentRoutes::new()
///     .route_policy(HttpMethod::Post, "/v1/charges", policy)
///     .apply(&mut api);
///
/// let operation = api.paths.get_path_operation("/v1/charges", HttpMethod::Post).unwrap();
/// let key = &operation.parameters.as_ref().unwrap()[0];
/// assert_eq!(key.name, "Idempotency-Key");
/// for status in ["400", "409", "422", "503"] {
///     assert!(operation.responses.responses.contains_key(status));
/// }
/// assert!(operation.description.as_deref().unwrap().contains("24 hours"));
/// ```
#[derive(Clone)]
pub struct IdempotentRoutes {
    replay_header: HeaderName,
    problem_type_base: Option<String>,
    routes: Vec<Route>,
}

#[derive(Clone)]
struct Route {
    method: HttpMethod,
    path: String,
    policy: Policy,
}

// utoipa's `HttpMethod` is `Debug` only with its `debug` feature.
impl std::fmt::Debug for IdempotentRoutes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let routes: Vec<_> = self
            .routes
            .iter()
            .map(|route| (method_name(&route.method), &route.path, &route.policy))
            .collect();
        f.debug_struct("IdempotentRoutes")
            .field("replay_header", &self.replay_header)
            .field("problem_type_base", &self.problem_type_base)
            .field("routes", &routes)
            .finish()
    }
}

impl Default for IdempotentRoutes {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentRoutes {
    /// No routes yet, with `idem`'s defaults: `Idempotent-Replayed` marks a
    /// replay and problems have `type: about:blank`. Prefer
    /// [`Idem::openapi`], which takes both from the service's store.
    pub fn new() -> Self {
        Self {
            replay_header: IDEMPOTENT_REPLAYED,
            problem_type_base: None,
            routes: Vec::new(),
        }
    }

    /// The header that marks a replay, as set with [`Idem::replay_header`].
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.replay_header = name;
        self
    }

    /// The base of the problems' `type`, as set with
    /// [`Idem::problem_type_base`]: each problem's `type` is documented as
    /// that URL followed by its `code`.
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        self.problem_type_base = Some(base.into());
        self
    }

    /// The `#[idempotent]` handler routed at `method` and `path` (as the
    /// document writes it: `/v1/charges/{id}`).
    pub fn route<H: IdempotentHandler>(self, method: HttpMethod, path: &str, handler: H) -> Self {
        self.route_policy(method, path, Policy::of(handler))
    }

    /// A route by its policy, for one the attribute does not generate.
    pub fn route_policy(mut self, method: HttpMethod, path: &str, policy: Policy) -> Self {
        self.routes.push(Route {
            method,
            path: path.to_owned(),
            policy,
        });
        self
    }

    /// Documents every route in `openapi`, creating an operation the
    /// document lacks, and adds the problem schema to its components.
    ///
    /// Apply it once the operations carry their own responses (after
    /// `#[derive(OpenApi)]`'s `openapi()`, or `OpenApiRouter`'s
    /// `split_for_parts`), so the replay header reaches each of them.
    pub fn apply(&self, openapi: &mut OpenApi) {
        if self.routes.is_empty() {
            return;
        }
        let components = openapi.components.get_or_insert_with(Components::new);
        components
            .schemas
            .insert(PROBLEM_SCHEMA.to_owned(), problem_schema().into());
        let components = components.clone();
        for route in &self.routes {
            let item = openapi
                .paths
                .paths
                .entry(route.path.clone())
                .or_insert_with(|| PathItem::new(route.method.clone(), Operation::new()));
            let operation = operation_mut(item, &route.method).get_or_insert_with(Operation::new);
            self.document(operation, &route.policy, &components);
        }
    }

    /// One operation: the parameter, the responses, the description and
    /// the extension.
    fn document(&self, operation: &mut Operation, policy: &Policy, components: &Components) {
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        parameters.retain(|parameter| {
            !(parameter.parameter_in == ParameterIn::Header
                && parameter
                    .name
                    .eq_ignore_ascii_case(IDEMPOTENCY_KEY.as_str()))
        });
        parameters.push(key_parameter(policy));

        let replay_header = title_case(&self.replay_header);
        let responses = &mut operation.responses.responses;
        for (status, response) in responses.iter_mut() {
            if !replayable(status) {
                continue;
            }
            if let Some(response) = inlined(response, components) {
                response
                    .headers
                    .insert(replay_header.clone(), replay_marker_header());
            }
        }
        for (status, codes, retry_after) in problems(policy) {
            let content = self.problem_content(status, &codes);
            let key = status.as_str().to_owned();
            let entry = responses
                .entry(key)
                .or_insert_with(|| Response::new(problem_description(status)).into());
            let Some(response) = inlined(entry, components) else {
                continue;
            };
            response
                .content
                .insert("application/problem+json".to_owned(), content);
            if let Some(header) = retry_after {
                response.headers.insert("Retry-After".to_owned(), header);
            }
        }

        // Applied again, the policy replaces its earlier text.
        let text = describe(policy, &replay_header);
        let own = operation.description.take().unwrap_or_default();
        let own = own.split(POLICY_MARK).next().unwrap_or_default().trim_end();
        operation.description = Some(if own.is_empty() {
            text
        } else {
            format!("{own}\n\n{text}")
        });
        operation
            .extensions
            .get_or_insert_with(Extensions::default)
            .insert("x-idempotency".to_owned(), self.extension(policy));
    }

    /// The problem's content: the shared schema, with this status and its
    /// codes (and `type`s, where a base is set).
    fn problem_content(&self, status: StatusCode, codes: &[&str]) -> Content {
        let kinds: Vec<Value> = match &self.problem_type_base {
            Some(base) => codes
                .iter()
                .map(|code| json!(format!("{base}{code}")))
                .collect(),
            None => vec![json!("about:blank")],
        };
        let narrowed = ObjectBuilder::new()
            .property(
                "type",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(kinds)),
            )
            .property(
                "status",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .enum_values(Some([status.as_u16()])),
            )
            .property(
                "code",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(codes.iter().copied())),
            );
        let schema = AllOfBuilder::new()
            .item(Ref::from_schema_name(PROBLEM_SCHEMA))
            .item(narrowed);
        let example = json!({
            "type": match &self.problem_type_base {
                Some(base) => format!("{base}{}", codes[0]),
                None => "about:blank".to_owned(),
            },
            "title": problem_description(status),
            "status": status.as_u16(),
            "code": codes[0],
            "operation_state": "not_started",
            "safe_new_key": true,
        });
        Content::builder()
            .schema(Some(schema))
            .example(Some(example))
            .build()
    }

    /// The policy as data, for tools.
    fn extension(&self, policy: &Policy) -> Value {
        let mut extension = json!({
            "header": "Idempotency-Key",
            "required": policy.key_required(),
            "keySyntax": "RFC 9651 sf-string or bare token",
            "keyPattern": KEY_PATTERN,
            "maxKeyLength": MAX_KEY_LEN,
            "scope": "caller",
            "retention": iso8601(policy.ttl()),
            "fingerprint": {
                "covers": ["method", "path", "query", "body"],
                "jsonBody": "RFC 8785",
                "exclude": policy.excluded(),
            },
            "replayHeader": title_case(&self.replay_header),
        });
        match policy.lease() {
            Some(lease) => extension["lease"] = json!(iso8601(lease)),
            None => extension["wait"] = json!(iso8601(policy.wait())),
        }
        if let Some(tombstone) = policy.tombstone() {
            extension["tombstone"] = json!(iso8601(tombstone));
        }
        extension
    }
}

impl Modify for IdempotentRoutes {
    fn modify(&self, openapi: &mut OpenApi) {
        self.apply(openapi);
    }
}

impl<DB: Backend> Idem<DB> {
    /// The service's idempotent routes for its OpenAPI document, with this
    /// store's replay header and problem `type` base (`openapi` feature):
    /// see [`IdempotentRoutes`].
    ///
    /// ```
    /// # #[cfg(feature = "postgres")]
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use axum::http::HeaderName;
    /// use idem_runtime::openapi::utoipa::openapi::{HttpMethod, OpenApiBuilder};
    /// use idem_runtime::{Idem, Policy};
    ///
    /// let pool = sqlx::PgPool::connect_lazy("postgres://localhost/app")?;
    /// let idem = Idem::new(pool)
    ///     .replay_header(HeaderName::from_static("idempotent-replay"))?
    ///     .problem_type_base("https://docs.example.com/errors/")?;
    /// let mut api = OpenApiBuilder::new().build();
    /// let policy = Policy::new(true, std::time::Duration::from_secs(3600));
    /// idem.openapi()
    ///     .route_policy(HttpMethod::Post, "/v1/refunds", policy)
    ///     .apply(&mut api);
    /// let json = api.to_json()?;
    /// assert!(json.contains("Idempotent-Replay"));
    /// assert!(json.contains("https://docs.example.com/errors/idempotency_key_reused"));
    /// # Ok(())
    /// # }
    /// # #[cfg(not(feature = "postgres"))]
    /// # fn main() {}
    /// ```
    pub fn openapi(&self) -> IdempotentRoutes {
        let routes = IdempotentRoutes::new().replay_header(self.replay_marker().clone());
        match self.problem_type_prefix() {
            Some(base) => routes.problem_type_base(base),
            None => routes,
        }
    }
}

fn method_name(method: &HttpMethod) -> &'static str {
    match method {
        HttpMethod::Get => "GET",
        HttpMethod::Put => "PUT",
        HttpMethod::Post => "POST",
        HttpMethod::Delete => "DELETE",
        HttpMethod::Options => "OPTIONS",
        HttpMethod::Head => "HEAD",
        HttpMethod::Patch => "PATCH",
        HttpMethod::Trace => "TRACE",
    }
}

/// The operation of `method` in `item`.
fn operation_mut<'a>(item: &'a mut PathItem, method: &HttpMethod) -> &'a mut Option<Operation> {
    match method {
        HttpMethod::Get => &mut item.get,
        HttpMethod::Put => &mut item.put,
        HttpMethod::Post => &mut item.post,
        HttpMethod::Delete => &mut item.delete,
        HttpMethod::Options => &mut item.options,
        HttpMethod::Head => &mut item.head,
        HttpMethod::Patch => &mut item.patch,
        HttpMethod::Trace => &mut item.trace,
    }
}

/// The response itself: one the document defines among its components
/// (`$ref`) is copied in, so this operation's additions stay its own; a
/// reference that resolves to nothing is left alone.
fn inlined<'a>(
    response: &'a mut RefOr<Response>,
    components: &Components,
) -> Option<&'a mut Response> {
    if let RefOr::Ref(reference) = response {
        let name = reference
            .ref_location
            .strip_prefix("#/components/responses/")?;
        let Some(RefOr::T(found)) = components.responses.get(name) else {
            return None;
        };
        *response = RefOr::T(found.clone());
    }
    match response {
        RefOr::T(response) => Some(response),
        RefOr::Ref(_) => None,
    }
}

/// Whether a documented status (`201`, `4XX`, `default`) may be a stored
/// response, and so a replay.
fn replayable(status: &str) -> bool {
    match status.as_bytes() {
        b"default" => true,
        [b'2'..=b'4', b'X' | b'x', b'X' | b'x'] => true,
        _ => status
            .parse::<u16>()
            .ok()
            .and_then(|code| StatusCode::from_u16(code).ok())
            .is_some_and(is_storable),
    }
}

/// The statuses `idem` answers itself on this route, with their codes and
/// whether they carry `Retry-After`.
fn problems(policy: &Policy) -> Vec<(StatusCode, Vec<&'static str>, Option<Header>)> {
    let code = |problem: Problem| problem.code();
    let mut bad_request = Vec::new();
    if policy.key_required() {
        bad_request.push(code(Problem::KeyMissing));
    }
    bad_request.extend([
        code(Problem::KeyInvalid(crate::key::KeyError::Empty)),
        code(Problem::BodyUnreadable),
    ]);
    let retry_after = |text: &str| {
        let mut header = Header::new(
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(0)),
        );
        header.description = Some(text.to_owned());
        Some(header)
    };
    let (in_use, mut conflicts) = match policy.lease() {
        // A phased key can also become uncertain, which no wait resolves.
        Some(_) => (
            "Seconds until the first attempt's lease ends: retry then, with the same key \
             (absent for `idempotency_outcome_uncertain`: retrying does not help until a person \
             resolves the key).",
            vec![code(Problem::KeyInUse), code(Problem::OutcomeUncertain)],
        ),
        None => (
            "Seconds to wait before retrying with the same key.",
            vec![code(Problem::KeyInUse)],
        ),
    };
    if policy.tombstone().is_some() {
        conflicts.push(code(Problem::KeyExpired { status: 201 }));
    }
    vec![
        (StatusCode::BAD_REQUEST, bad_request, None),
        (StatusCode::CONFLICT, conflicts, retry_after(in_use)),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            vec![code(Problem::KeyReused)],
            None,
        ),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            vec![code(Problem::StoreUnavailable)],
            retry_after(
                "Seconds to wait before retrying with the same key (absent when a request \
                 without a key may or may not have been done).",
            ),
        ),
        (
            StatusCode::REQUEST_TIMEOUT,
            vec![code(Problem::BodyTimeout)],
            None,
        ),
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            vec![code(Problem::BodyTooLarge)],
            None,
        ),
        (
            StatusCode::GATEWAY_TIMEOUT,
            vec![code(Problem::HandlerTimeout)],
            retry_after("Seconds to wait before retrying with the same key."),
        ),
    ]
}

/// A response's description, for a status the operation did not document.
fn problem_description(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => {
            "The Idempotency-Key header is missing or malformed, or the body was cut off."
        }
        StatusCode::CONFLICT => "Another attempt with this Idempotency-Key is in progress.",
        StatusCode::UNPROCESSABLE_ENTITY => {
            "This Idempotency-Key was used with a different request."
        }
        StatusCode::SERVICE_UNAVAILABLE => {
            "The idempotency key store is unavailable; nothing was done."
        }
        StatusCode::REQUEST_TIMEOUT => "The request body did not arrive in time; nothing was done.",
        StatusCode::PAYLOAD_TOO_LARGE => "The request body is larger than this endpoint accepts.",
        StatusCode::GATEWAY_TIMEOUT => {
            "The request did not finish within the server's deadline; nothing was done."
        }
        _ => "A problem.",
    }
}

/// RFC 9457 members and `idem`'s `code`.
fn problem_schema() -> Schema {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
    };
    ObjectBuilder::new()
        .description(Some(
            "An RFC 9457 problem answered by idem in place of the handler, with a stable `code`.",
        ))
        .property(
            "type",
            string(
                "A URI reference identifying the problem type (`about:blank` unless configured).",
            ),
        )
        .property("title", string("A short summary of the problem type."))
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .description(Some("The HTTP status code.")),
        )
        .property("detail", string("What happened and what to do about it."))
        .property("code", string("A stable code clients can branch on."))
        .property(
            "operation_state",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some([
                    "not_started",
                    "in_progress",
                    "uncertain",
                    "completed",
                ]))
                .description(Some(
                    "The state of the operation the request's key names: `not_started` \
                     (nothing was done), `in_progress` (running, kept to be resumed, or known \
                     only to a retry with the same key), `uncertain` (it may or may not have \
                     happened; a person decides) or `completed`.",
                )),
        )
        .property(
            "safe_new_key",
            ObjectBuilder::new()
                .schema_type(Type::Boolean)
                .description(Some(
                    "True only when a new key cannot duplicate an effect of this key's \
                     operation.",
                )),
        )
        .required("type")
        .required("title")
        .required("status")
        .required("code")
        .required("operation_state")
        .required("safe_new_key")
        .into()
}

/// The `Idempotency-Key` header parameter.
fn key_parameter(policy: &Policy) -> Parameter {
    let (required, lead) = if policy.key_required() {
        (Required::True, "Required.")
    } else {
        (
            Required::False,
            "Optional: without one the request runs, but a retry of it is not recognised.",
        )
    };
    let schema = ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(KEY_PATTERN))
        .min_length(Some(1))
        .examples(["order-42"]);
    Parameter::builder()
        .name("Idempotency-Key")
        .parameter_in(ParameterIn::Header)
        .required(required)
        .description(Some(format!(
            "{lead} One key per logical operation, sent unchanged on every attempt of it: an RFC 9651 \
             sf-string (`\"order-42\"`) or a bare token (`order-42`, no comma), 1 to {MAX_KEY_LEN} \
             visible ASCII characters (`!` to `~`) once unquoted. Keys are kept per caller."
        )))
        .schema(Some(schema))
        .build()
}

/// The replay header on a response that can be a replay.
fn replay_marker_header() -> Header {
    let mut header = Header::new(
        ObjectBuilder::new()
            .schema_type(Type::String)
            .enum_values(Some(["true"])),
    );
    header.description = Some(
        "Present, `true`, when this is the stored response of an earlier attempt with the same \
         Idempotency-Key, replayed without running the request again."
            .to_owned(),
    );
    header
}

/// The policy in words, for the operation's description.
fn describe(policy: &Policy, replay_header: &str) -> String {
    let key = if policy.key_required() {
        "Send an `Idempotency-Key` header"
    } else {
        "Send an `Idempotency-Key` header (optional: without one, the request is not protected \
         against duplicates)"
    };
    let excluded = match policy.excluded() {
        [] => String::new(),
        pointers => {
            let list: Vec<String> = pointers.iter().map(|p| format!("`{p}`")).collect();
            format!(", leaving out the members {}", list.join(", "))
        }
    };
    let in_flight = match policy.lease() {
        Some(lease) => format!(
            "The first attempt holds the key for a lease of {}: a retry meanwhile gets 409 \
             (`idempotency_key_in_use`) with `Retry-After` until the lease ends; after it, a retry \
             takes the key over and resumes the work where it stopped. A key whose attempts run \
             out after a call outside the service may have happened gets 409 \
             (`idempotency_outcome_uncertain`, no `Retry-After`) until a person resolves it: do \
             not retry it with a new key.",
            human(lease)
        ),
        None if policy.wait().is_zero() => "A retry while the first attempt is still running \
             gets 409 (`idempotency_key_in_use`) with `Retry-After`."
            .to_owned(),
        None => format!(
            "A retry while the first attempt is still running waits up to {} for it, then gets \
             409 (`idempotency_key_in_use`) with `Retry-After`.",
            human(policy.wait())
        ),
    };
    format!(
        "{POLICY_MARK} {key}, one key per logical operation, the same on every attempt of it. \
         For {ttl}, a retry with the same key and the same request gets the first attempt's \
         response again (status, body and headers such as `Location`), marked \
         `{replay_header}: true`, without running it again; a response with status 5xx, 408 or \
         429 is not kept, so a retry after one runs afresh. The same request means the same \
         method, path, query and body (a JSON body in its RFC 8785 canonical form, so member \
         order and whitespace do not count{excluded}); the same key with another request gets \
         422 (`idempotency_key_reused`). {in_flight}{tombstone}",
        ttl = human(policy.ttl()),
        tombstone = match policy.tombstone() {
            Some(tombstone) => format!(
                " After those {ttl}, the key is kept without its response until {} after that response: a \
                 retry with it gets 409 (`idempotency_key_expired`, no `Retry-After`) with the \
                 first status (`original_status`) and `Location` (`location`), and nothing runs \
                 again.",
                human(tombstone),
                ttl = human(policy.ttl()),
            ),
            None => String::new(),
        },
    )
}

/// `24 hours`, `5 seconds`, `1500 milliseconds`.
fn human(duration: Duration) -> String {
    let ms = duration.as_millis();
    let (count, unit) = [
        (86_400_000, "day"),
        (3_600_000, "hour"),
        (60_000, "minute"),
        (1_000, "second"),
    ]
    .into_iter()
    .find(|(unit, _)| {
        ms >= *unit && ms.is_multiple_of(*unit) && (*unit != 86_400_000 || ms > *unit)
    })
    .map_or((ms, "millisecond"), |(unit, name)| (ms / unit, name));
    let plural = if count == 1 { "" } else { "s" };
    format!("{count} {unit}{plural}")
}

/// An ISO 8601 duration in hours, minutes and seconds: `PT24H`, `PT1.5S`.
fn iso8601(duration: Duration) -> String {
    let ms = duration.as_millis();
    let (hours, minutes) = (ms / 3_600_000, ms / 60_000 % 60);
    let (seconds, millis) = (ms / 1_000 % 60, ms % 1_000);
    let mut text = String::from("PT");
    if hours > 0 {
        text.push_str(&format!("{hours}H"));
    }
    if minutes > 0 {
        text.push_str(&format!("{minutes}M"));
    }
    if millis > 0 {
        let fraction = format!("{millis:03}");
        text.push_str(&format!("{seconds}.{}S", fraction.trim_end_matches('0')));
    } else if seconds > 0 || text.len() == 2 {
        text.push_str(&format!("{seconds}S"));
    }
    text
}

/// `idempotent-replayed` as documents write header names.
fn title_case(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|word| {
            let mut chars = word.chars();
            match chars.next() {
                Some(first) => first.to_ascii_uppercase().to_string() + chars.as_str(),
                None => String::new(),
            }
        })
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Config, KeyMode};
    use utoipa::openapi::response::ResponseBuilder;

    fn document(routes: &IdempotentRoutes) -> Value {
        let mut api = utoipa::openapi::OpenApiBuilder::new().build();
        routes.apply(&mut api);
        serde_json::to_value(&api).unwrap()
    }

    #[test]
    fn durations_read_as_written() {
        assert_eq!(human(Duration::from_secs(86_400)), "24 hours");
        assert_eq!(human(Duration::from_secs(7 * 86_400)), "7 days");
        assert_eq!(human(Duration::from_secs(1)), "1 second");
        assert_eq!(human(Duration::from_millis(1_500)), "1500 milliseconds");
        assert_eq!(iso8601(Duration::from_secs(86_400)), "PT24H");
        assert_eq!(iso8601(Duration::from_millis(90_500)), "PT1M30.5S");
        assert_eq!(iso8601(Duration::ZERO), "PT0S");
    }

    /// Every string over the characters that matter (quotes, escapes,
    /// commas, spaces, non-ASCII), up to four long, and keys at the length
    /// limit: the pattern accepts exactly what the parser does. (Values
    /// with surrounding whitespace are left out: HTTP strips it.)
    #[test]
    fn the_key_pattern_is_what_the_parser_accepts() {
        let pattern = regex::Regex::new(KEY_PATTERN).unwrap();
        let alphabet = ["a", "~", "!", ",", "\"", "\\", " ", "\x7f", "é"];
        let mut samples = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..4 {
            last = last
                .iter()
                .flat_map(|prefix| alphabet.iter().map(move |c| format!("{prefix}{c}")))
                .collect();
            samples.extend(last.iter().cloned());
        }
        for n in [254, 255, 256] {
            samples.push("k".repeat(n));
            samples.push(format!("\"{}\"", "k".repeat(n)));
            samples.push(format!("\"{}\"", "\\\"".repeat(n)));
        }
        let mut checked = 0;
        for raw in samples.iter().filter(|raw| raw.trim() == raw.as_str()) {
            let parsed = crate::key::parse_key_value(raw.as_bytes()).is_ok();
            assert_eq!(pattern.is_match(raw), parsed, "{raw:?}");
            checked += 1;
        }
        assert!(checked > 5_000, "{checked}");
    }

    #[test]
    fn statuses_that_may_be_replays() {
        for status in ["200", "201", "302", "400", "404", "422", "4XX", "default"] {
            assert!(replayable(status), "{status}");
        }
        for status in ["408", "429", "500", "503", "5XX"] {
            assert!(!replayable(status), "{status}");
        }
    }

    #[test]
    fn an_operation_gets_the_key_the_problems_and_the_policy() {
        let policy = Config::new(3_600_000, 0, 30_000, KeyMode::Optional)
            .excluding(&["/client_ts"])
            .policy();
        let routes = IdempotentRoutes::new()
            .replay_header(HeaderName::from_static("idempotent-replay"))
            .problem_type_base("https://docs.example.com/errors/")
            .route_policy(HttpMethod::Post, "/v1/refunds", policy);
        let api = document(&routes);
        let operation = &api["paths"]["/v1/refunds"]["post"];
        let key = &operation["parameters"][0];
        assert_eq!(key["name"], "Idempotency-Key");
        assert_eq!(key["in"], "header");
        assert_eq!(key["required"], false);
        let bad = &operation["responses"]["400"]["content"]["application/problem+json"];
        let codes = &bad["schema"]["allOf"][1]["properties"]["code"]["enum"];
        assert_eq!(
            codes,
            &json!(["idempotency_key_invalid", "request_body_unreadable"])
        );
        let kinds = &bad["schema"]["allOf"][1]["properties"]["type"]["enum"];
        assert_eq!(
            kinds[0],
            "https://docs.example.com/errors/idempotency_key_invalid"
        );
        assert!(operation["responses"]["409"]["headers"]["Retry-After"].is_object());
        assert!(
            operation["responses"]["422"]["headers"]
                .get("Retry-After")
                .is_none()
        );
        let extension = &operation["x-idempotency"];
        assert_eq!(extension["retention"], "PT1H");
        assert_eq!(extension["fingerprint"]["exclude"], json!(["/client_ts"]));
        assert_eq!(extension["replayHeader"], "Idempotent-Replay");
        let description = operation["description"].as_str().unwrap();
        assert!(description.contains("1 hour"), "{description}");
        assert!(description.contains("`/client_ts`"), "{description}");
        assert!(api["components"]["schemas"][PROBLEM_SCHEMA].is_object());
    }

    /// A handler with `tombstone` documents it, its 409, and what a late
    /// retry gets.
    #[test]
    fn tombstones_are_documented() {
        let mut api = utoipa::openapi::OpenApiBuilder::new().build();
        let policy = Config::new(86_400_000, 0, 30_000, KeyMode::Required)
            .tombstone(30 * 86_400_000)
            .policy();
        IdempotentRoutes::new()
            .route_policy(HttpMethod::Post, "/v1/charges", policy)
            .apply(&mut api);
        let api = serde_json::to_value(&api).unwrap();
        let operation = &api["paths"]["/v1/charges"]["post"];
        assert_eq!(operation["x-idempotency"]["tombstone"], "PT720H");
        let conflict = operation["responses"]["409"].to_string();
        assert!(conflict.contains("idempotency_key_expired"), "{conflict}");
        let description = operation["description"].as_str().unwrap();
        assert!(description.contains("until 30 days after"), "{description}");
    }

    #[test]
    fn an_existing_operation_keeps_its_own_responses() {
        let mut api = utoipa::openapi::OpenApiBuilder::new().build();
        let own = Operation::builder()
            .description(Some("Creates a charge."))
            .response(
                "201",
                ResponseBuilder::new()
                    .description("Created")
                    .content("application/json", Content::new(None::<Schema>)),
            )
            .response(
                "400",
                ResponseBuilder::new()
                    .description("Malformed JSON")
                    .content("text/plain", Content::new(None::<Schema>)),
            )
            .response("500", Response::new("Internal error"))
            .build();
        api.paths
            .add_path_operation("/v1/charges", vec![HttpMethod::Post], own);
        let phased = Config::new(86_400_000, 0, 30_000, KeyMode::Required)
            .phased(5_000)
            .policy();
        let routes = IdempotentRoutes::new().route_policy(HttpMethod::Post, "/v1/charges", phased);
        routes.apply(&mut api);
        routes.apply(&mut api);
        let api = serde_json::to_value(&api).unwrap();
        let operation = &api["paths"]["/v1/charges"]["post"];
        let responses = &operation["responses"];
        assert!(responses["201"]["headers"]["Idempotent-Replayed"].is_object());
        assert!(responses["500"].get("headers").is_none());
        let bad = &responses["400"];
        assert_eq!(bad["description"], "Malformed JSON");
        assert!(bad["content"]["text/plain"].is_object());
        assert!(bad["content"]["application/problem+json"].is_object());
        let description = operation["description"].as_str().unwrap();
        assert!(description.starts_with("Creates a charge.\n\n**Idempotent.**"));
        assert!(description.contains("lease of 5 seconds"), "{description}");
        assert_eq!(operation["x-idempotency"]["lease"], "PT5S");
        assert!(operation["x-idempotency"].get("wait").is_none());
        // Applying twice documents once.
        assert_eq!(operation["parameters"].as_array().unwrap().len(), 1);
    }
}
