//! Charges through the `charges` example with the retrying client.
//!
//! ```text
//! cargo run --example charges
//! cargo run --example pay -- --account acct_1 --amount 4200
//! cargo run --example pay -- --account acct_1 --amount 4200 --key <intent printed before>
//! ```
//!
//! Prints the intent (unless `--key` gave one) and every attempt on stderr,
//! the charge on stdout; exits 0 on success, 1 with the error otherwise (and,
//! when the server said, what became of the charge and whether a new key is
//! safe), 2 on a usage error.
//!
//! Environment: `IDEM_URL`, where the API is (default
//! `http://127.0.0.1:3000`).

use std::process::ExitCode;
use std::time::Duration;

use idem_client::{Error, IdemClient, Intent, RetryPolicy};

const USAGE: &str = "usage: pay --account <account> --amount <minor units> \
                     [--currency <code>] [--key <stored intent>]";

struct Args {
    account: String,
    amount: i64,
    currency: String,
    key: Option<Intent>,
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut account, mut amount, mut currency, mut key) = (None, None, None, None);
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--account" => account = Some(value),
            "--amount" => {
                amount = Some(
                    value
                        .parse()
                        .map_err(|_| format!("--amount {value:?} is not a whole number"))?,
                )
            }
            "--currency" => currency = Some(value),
            "--key" => {
                key = Some(
                    Intent::restore(&value).map_err(|error| format!("--key {value:?}: {error}"))?,
                )
            }
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(Args {
        account: account.ok_or_else(|| format!("--account is required\n{USAGE}"))?,
        amount: amount.ok_or_else(|| format!("--amount is required\n{USAGE}"))?,
        currency: currency.unwrap_or_else(|| "eur".into()),
        key,
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let base = std::env::var("IDEM_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());

    // The intent is made (or restored) once, before the first attempt.
    let intent = args.key.unwrap_or_else(|| {
        let intent = Intent::new();
        eprintln!("intent: {intent} (to send this charge again: --key {intent})");
        intent
    });

    let client = IdemClient::new(reqwest::Client::new())
        .with_policy(RetryPolicy::default().attempt_timeout(Duration::from_secs(10)))
        .on_attempt(|attempt| eprintln!("{attempt}"));
    let request = client
        .post(format!("{}/v1/charges", base.trim_end_matches('/')))
        .bearer_auth(&args.account)
        .json(&serde_json::json!({"amount": args.amount, "currency": args.currency}));

    match client.send(&intent, request).await {
        Ok(sent) => {
            println!("{}", String::from_utf8_lossy(&sent.body));
            ExitCode::SUCCESS
        }
        Err(error) => {
            report(&error);
            ExitCode::FAILURE
        }
    }
}

/// The error, its causes, and the body of a refusal.
fn report(error: &Error) {
    eprintln!("error: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        eprintln!("  caused by: {cause}");
        source = cause.source();
    }
    if let Error::Rejected { body, .. } | Error::ServerError { body, .. } = error {
        let body = String::from_utf8_lossy(body);
        if !body.trim().is_empty() {
            eprintln!("  body: {}", body.trim_end());
        }
    }
    // What the server said became of the charge, when it said.
    if let Some(state) = error.operation_state() {
        let new_key = match error.safe_new_key() {
            Some(true) => "safe",
            _ => "not safe: send this intent again with --key instead",
        };
        eprintln!("  operation: {state}; a new key is {new_key}");
    }
}
