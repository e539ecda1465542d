//! The same retries as a `reqwest-middleware` middleware, for requests that
//! carry an [`Intent`] in their extensions.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, Method, StatusCode};
use rand::{Rng, SeedableRng, rngs::StdRng};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next as MiddlewareNext};

use crate::clock::Clock;
use crate::error::Problem;
use crate::intent::Intent;
use crate::policy::RetryPolicy;
use crate::retry::{Attempt, Flow, Next, Outcome, Retrier, Tried};
use crate::rules::{self, IDEMPOTENCY_KEY, Verdict};

/// Retries every request that carries an [`Intent`] in its extensions, with
/// the intent's `Idempotency-Key` on every attempt; passes every other
/// request through untouched (not keyed, not retried).
///
/// The rules are [`IdemClient`](crate::IdemClient)'s, but the answer is a
/// `reqwest::Response`, as a middleware must return: the final answer, a 4xx
/// or 5xx included, comes back as `Ok` for the caller to judge, and when
/// the budget runs out the last answer (or the last `reqwest::Error`) comes
/// back. Inspect `Idempotent-Replayed` on the response to see a replay.
///
/// ```no_run
/// use idem_client::{IdemMiddleware, Intent};
/// use reqwest_middleware::ClientBuilder;
///
/// # async fn demo() -> Result<(), reqwest_middleware::Error> {
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(IdemMiddleware::new())
///     .build();
/// let intent = Intent::new();
/// let response = client
///     .post("http://127.0.0.1:3000/v1/charges")
///     .bearer_auth("acct_1")
///     .header("content-type", "application/json")
///     .body(r#"{"amount": 4200, "currency": "eur"}"#)
///     .with_extension(intent)
///     .send()
///     .await?;
/// # Ok(()) }
/// ```
///
/// An uncertain outcome (`idempotency_outcome_uncertain`, or a problem
/// whose `operation_state` is `uncertain`) comes back at once, never
/// retried: read its body (or see [`Error::Uncertain`](crate::Error::Uncertain)
/// for what to do with the intent).
///
/// To read the problem of an answer its status alone would retry (409,
/// 429, 502, 503, 504) it reads that answer's body and hands on a rebuilt
/// response, whose `url()` and `remote_addr()` are then unknown.
#[derive(Clone)]
pub struct IdemMiddleware {
    retrier: Retrier,
    not_found_is_done: bool,
}

/// The mark [`IdemMiddleware`] puts in a response's extensions when
/// [`not_found_is_done`](IdemMiddleware::not_found_is_done) counts a
/// `DELETE`'s 404 on a retry as done: an earlier attempt may have deleted
/// the resource and lost its answer.
///
/// ```no_run
/// use idem_client::{AlreadyGone, IdemMiddleware, Intent};
/// use reqwest_middleware::ClientBuilder;
///
/// # async fn demo() -> Result<(), reqwest_middleware::Error> {
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(IdemMiddleware::new().not_found_is_done(true))
///     .build();
/// let response = client
///     .delete("http://127.0.0.1:3000/v1/cards/card_7")
///     .with_extension(Intent::new())
///     .send()
///     .await?;
/// let gone = response.extensions().get::<AlreadyGone>().is_some();
/// let done = response.status().is_success() || gone;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AlreadyGone;

impl IdemMiddleware {
    /// The default [`RetryPolicy`], the [`TokioClock`](crate::TokioClock)
    /// and randomness seeded by the OS.
    pub fn new() -> Self {
        Self {
            retrier: Retrier::new(),
            not_found_is_done: false,
        }
    }

    /// Retries by `policy`.
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.retrier.policy = policy;
        self
    }

    /// Takes the time and waits through `clock`.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.retrier.clock = Arc::new(clock);
        self
    }

    /// Draws the backoff jitter from `rng`.
    pub fn with_rng<R: Rng + Send + 'static>(mut self, rng: R) -> Self {
        self.retrier.set_rng(rng);
        self
    }

    /// Draws the backoff jitter from a generator seeded with `seed`.
    pub fn with_seed(self, seed: u64) -> Self {
        self.with_rng(StdRng::seed_from_u64(seed))
    }

    /// Calls `hook` after every attempt of a request with an intent.
    pub fn on_attempt(mut self, hook: impl Fn(&Attempt) + Send + Sync + 'static) -> Self {
        self.retrier.set_hook(Arc::new(hook));
        self
    }

    /// Whether a `DELETE`'s 404 on a retry counts as done (default:
    /// `false`). The rule is
    /// [`IdemClient::not_found_is_done`](crate::IdemClient::not_found_is_done)'s:
    /// not on the first attempt, only after an attempt that may have
    /// reached the server, never for a replayed 404. The 404 still comes
    /// back as the response (a middleware returns every final answer), with
    /// [`AlreadyGone`] in its extensions to tell it from one that means
    /// "there was nothing to delete".
    pub fn not_found_is_done(mut self, yes: bool) -> Self {
        self.not_found_is_done = yes;
        self
    }
}

impl Default for IdemMiddleware {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for IdemMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdemMiddleware")
            .field("policy", &self.retrier.policy)
            .field("not_found_is_done", &self.not_found_is_done)
            .finish_non_exhaustive()
    }
}

type Answer = reqwest_middleware::Result<Response>;

#[async_trait::async_trait]
impl Middleware for IdemMiddleware {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: MiddlewareNext<'_>,
    ) -> Answer {
        let Some(intent) = extensions.get::<Intent>().cloned() else {
            return next.run(request, extensions).await;
        };
        if request.try_clone().is_none() {
            return Err(reqwest_middleware::Error::middleware(
                crate::Error::NotCloneable,
            ));
        }
        let clock = &*self.retrier.clock;
        let deleting = self.not_found_is_done && request.method() == Method::DELETE;
        let mut run = self.retrier.start();
        loop {
            let gone_is_done = deleting && run.may_have_reached_server();
            let mut keyed = request
                .try_clone()
                .expect("checked the request clones before the first attempt");
            keyed
                .headers_mut()
                .insert(IDEMPOTENCY_KEY, intent.header_value());
            set_timeout(&mut keyed, run.timeout());
            let answer = next.clone().run(keyed, extensions).await;
            let tried = judge(answer, clock).await;
            match run.after(tried).await {
                Flow::Stop(Ok(mut response)) => {
                    if gone_is_done
                        && response.status() == StatusCode::NOT_FOUND
                        && !rules::replayed(response.headers())
                    {
                        response.extensions_mut().insert(AlreadyGone);
                    }
                    return Ok(response);
                }
                Flow::Stop(answer) => return answer,
                Flow::Again => {}
                Flow::Exhausted(exhausted) => return exhausted.last,
            }
        }
    }
}

fn set_timeout(request: &mut Request, timeout: Option<Duration>) {
    if let Some(timeout) = timeout {
        let current = request.timeout_mut();
        *current = Some(current.map_or(timeout, |t| t.min(timeout)));
    }
}

/// Whether an answer ends the operation. Both ways the answer itself is
/// what the middleware returns in the end.
async fn judge(answer: Answer, clock: &dyn Clock) -> Tried<Answer, Answer> {
    let response = match answer {
        Ok(response) => response,
        Err(reqwest_middleware::Error::Reqwest(error)) if rules::transport_retryable(&error) => {
            return Tried {
                outcome: Outcome::transport(&error),
                replayed: false,
                next: Next::Retry {
                    retry_after: None,
                    last: Err(error.into()),
                },
            };
        }
        Err(error) => {
            let outcome = match &error {
                reqwest_middleware::Error::Reqwest(error) => Outcome::transport(error),
                reqwest_middleware::Error::Middleware(error) => Outcome::Transport {
                    kind: crate::TransportKind::Other,
                    message: format!("{error:#}"),
                },
            };
            return Tried {
                outcome,
                replayed: false,
                next: Next::Stop(Err(error)),
            };
        }
    };
    let status = response.status();
    let replayed = rules::replayed(response.headers());
    // Only an answer its status alone would retry is read: its problem
    // may say otherwise (a 409 other than a key in use, an uncertain
    // outcome). Other bodies stay unread.
    let (response, problem) =
        if !replayed && retried_by_status(status) && rules::is_problem(response.headers()) {
            match read_problem(response).await {
                Ok(read) => read,
                Err(error) => {
                    return Tried {
                        outcome: Outcome::transport(&error),
                        replayed,
                        next: Next::Retry {
                            retry_after: None,
                            last: Err(error.into()),
                        },
                    };
                }
            }
        } else {
            (response, None)
        };
    let outcome = Outcome::Status(status);
    let next = match rules::verdict(status, replayed, problem.as_ref()) {
        Verdict::Retry => Next::Retry {
            retry_after: rules::retry_after(response.headers(), clock.wall()),
            last: Ok(response),
        },
        Verdict::Success
        | Verdict::KeyReused
        | Verdict::Uncertain
        | Verdict::Rejected
        | Verdict::ServerError => Next::Stop(Ok(response)),
    };
    Tried {
        outcome,
        replayed,
        next,
    }
}

/// Whether a status alone would have its answer retried: 409 (by its
/// code), 429, 502, 503 and 504.
fn retried_by_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 409 | 429 | 502 | 503 | 504)
}

/// Reads a problem body and puts it back into an equal response.
async fn read_problem(response: Response) -> reqwest::Result<(Response, Option<Problem>)> {
    let mut rebuilt = http::Response::builder()
        .status(response.status())
        .version(response.version());
    if let Some(headers) = rebuilt.headers_mut() {
        *headers = response.headers().clone();
    }
    let body = response.bytes().await?;
    let problem = Problem::parse(&body);
    let rebuilt = rebuilt
        .body(body)
        .expect("status, version and headers came from a valid response");
    Ok((Response::from(rebuilt), problem))
}
