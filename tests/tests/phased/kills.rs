//! The server process SIGKILLed at each point of a phased request, then
//! the request finished by the client's retry or, with no client, by the
//! completer of the next server process: one charge at the provider, one
//! payment succeeded, written with the stored response, which every
//! retry replays.

use std::time::Duration;

use futures::future::join_all;
use idem_tests::phased::{Boundary, ChildOptions, LEASE, PhasedDb};
use idem_tests::service::unique;
use reqwest::StatusCode;

use crate::harness::{Fixture, retry_while_in_use, send};

/// Where the first server process dies.
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// Stopped at a boundary.
    At(Boundary),
    /// While the provider (which has charged) holds its answer back.
    DuringCall,
}

const KILLS: [Kill; 6] = [
    Kill::At(Boundary::Claimed),
    Kill::At(Boundary::Local),
    Kill::At(Boundary::Calling),
    Kill::DuringCall,
    Kill::At(Boundary::Called),
    Kill::At(Boundary::Final),
];

/// How long the provider holds each answer back in the `DuringCall` case.
const PROVIDER_DELAY: Duration = Duration::from_millis(2500);

/// How often the completer of the next server process looks.
const COMPLETER_EVERY: Duration = Duration::from_millis(300);

/// Who finishes the killed request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Finisher {
    /// The client retries with the key; the next server runs no completer.
    Client,
    /// The next server's completer; the client retries only afterwards.
    Completer,
}

impl Kill {
    /// The provider's calls in all: a second one (answered from its
    /// memory of the key) when the first attempt died after it sent one.
    fn calls(self) -> u64 {
        match self {
            Kill::At(Boundary::Claimed | Boundary::Local | Boundary::Calling) => 1,
            Kill::DuringCall | Kill::At(Boundary::Called | Boundary::Final) => 2,
        }
    }
}

pub async fn killed_servers_are_finished_by_the_clients_retry<DB: PhasedDb>() {
    join_all(KILLS.map(|kill| killed_then_finished::<DB>(kill, Finisher::Client))).await;
}

pub async fn killed_servers_are_finished_by_the_completer<DB: PhasedDb>() {
    join_all(KILLS.map(|kill| killed_then_finished::<DB>(kill, Finisher::Completer))).await;
}

async fn killed_then_finished<DB: PhasedDb>(kill: Kill, finisher: Finisher) {
    let context = format!("{} killed {kill:?}, finished by {finisher:?}", DB::ENGINE);
    let delay = match kill {
        Kill::DuringCall => PROVIDER_DELAY,
        Kill::At(_) => Duration::ZERO,
    };
    let fixture = Fixture::<DB>::new(delay, 0).await;
    let key = unique("killed");

    let stop_at = match kill {
        Kill::At(boundary) => Some(boundary),
        Kill::DuringCall => None,
    };
    let mut first = fixture
        .child(ChildOptions {
            stop_at,
            complete_every: None,
        })
        .await;
    let lost = tokio::spawn(fixture.post(first.addr, &key).send());
    match kill {
        Kill::At(boundary) => first.until_boundary(boundary).await,
        Kill::DuringCall => {
            first.until_boundary(Boundary::Calling).await;
            fixture.provider.until("the call", |s| s.calls == 1).await;
        }
    }
    let seen = first.kill().await;
    if let Kill::DuringCall = kill {
        assert!(
            !seen.contains(&Boundary::Called),
            "{context}: the call returned before the kill: {seen:?}"
        );
    }
    let lost = lost.await.unwrap();
    assert!(
        lost.is_err(),
        "{context}: the killed server answered {lost:?}"
    );
    let left = fixture.key_row(&key).await;
    assert!(
        left.is_some_and(|row| row.status.is_none()),
        "{context}: the kill leaves the key claimed and unfinished: {left:?}"
    );

    let complete_every = (finisher == Finisher::Completer).then_some(COMPLETER_EVERY);
    let second = fixture
        .child(ChildOptions {
            stop_at: None,
            complete_every,
        })
        .await;
    let answer = match finisher {
        Finisher::Client => {
            let (answer, _) = retry_while_in_use(|| fixture.post(second.addr, &key), LEASE).await;
            assert!(
                !answer.replayed(),
                "{context}: the retry did the work: {answer:?}"
            );
            answer
        }
        Finisher::Completer => {
            fixture.until_finished(&key).await;
            let answer = send(fixture.post(second.addr, &key)).await;
            assert!(
                answer.replayed(),
                "{context}: the completer did the work: {answer:?}"
            );
            answer
        }
    };
    fixture.assert_one_payment(&answer, &context).await;
    let stats = fixture.provider.stats().await;
    assert_eq!(stats.charges, 1, "{context}: {stats:?}");
    assert_eq!(stats.calls, kill.calls(), "{context}: {stats:?}");
    let row = fixture.key_row(&key).await.expect("the key's row");
    assert_eq!(row.status, Some(201), "{context}");
    // One resumption, whoever made it: a client's retry that takes over
    // an ended lease counts toward `Idem::max_attempts` as the
    // completer's does.
    assert_eq!(row.attempts, 1, "{context}: resumptions");

    let replay = send(fixture.post(second.addr, &key)).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{context}: {replay:?}");
    assert!(replay.replayed(), "{context}: {replay:?}");
    assert_eq!(
        replay.body, answer.body,
        "{context}: the replay is verbatim"
    );
    assert_eq!(
        fixture.provider.stats().await,
        stats,
        "{context}: a replay calls no one"
    );
    drop(second);
    fixture.discard().await;
}
