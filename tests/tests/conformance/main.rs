//! The conformance suite: the design's contract, checked on every engine
//! against a real database and a real axum server over HTTP.
//!
//! Each engine's tests live in a module named after it
//! (`cargo test --test conformance postgres::`).

use idem_tests::engines;
use idem_tests::service as app;
mod bodies;
mod commits;
mod expiry;
mod harness;
#[cfg(feature = "sqlite")]
mod sqlite_only;
mod suite;
mod transactions;

/// Instantiates every test of `suite` for one engine.
macro_rules! conformance {
    ($engine:ident, $db:ty: $($test:ident),* $(,)?) => {
        mod $engine {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    let _slot = crate::harness::slot::<$db>().await;
                    crate::suite::$test::<$db>().await;
                }
            )*
        }
    };
}

/// Every engine whose cargo feature is on (`--all-features` runs all three).
macro_rules! all_engines {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            conformance!($engine, $db:
                replay_is_verbatim,
                quoted_and_bare_keys_match,
                concurrent_duplicates_make_one_effect,
                in_flight_duplicates_get_409_or_wait,
                short_waits_are_honoured,
                different_body_is_422,
                replay_marker_and_problem_type_are_configurable,
                every_instance_replays_the_same_answer,
                other_path_or_method_is_422,
                excluded_members_are_replays,
                scopes_are_independent,
                long_scopes_are_kept_or_refused_whole,
                transient_answers_roll_back,
                handlers_past_their_deadline_are_504,
                panics_roll_back,
                killed_server_leaves_nothing_behind,
                bad_keys_are_400,
                expired_keys_run_as_new,
                tombstones_refuse_late_retries,
                concurrent_retries_of_an_expired_key_make_one_effect,
                sweeping_spares_live_and_taken_over_keys,
                slow_first_attempts_are_kept_for_their_ttl,
                extractor_rejections_store_nothing,
                oversized_responses_roll_back,
                optional_keys,
                first_answer_is_the_handlers,
                unreachable_store_is_503,
                cancelled_requests_roll_back,
                handler_statements_may_wait_on_locks,
                nested_transactions_are_savepoints,
                connections_come_back_outside_any_transaction,
                ended_transactions_are_not_successes,
                handler_errors_roll_back,
                lost_transactions_are_not_successes,
                refused_bodies_get_their_problem,
                lost_commits_are_503,
                self_committed_failures_hold_the_key_until_it_expires,
                broken_endings_are_internal_errors,
            );
        )*

        /// Not a test: the server half of the kill test, run by
        /// `harness::ChildServer` in a child process.
        #[tokio::test]
        #[ignore = "run by the kill test as a child process"]
        async fn child_server() {
            let engine = std::env::var(harness::CHILD_ENGINE).expect("run by ChildServer only");
            match engine.as_str() {
                $(
                    #[cfg(feature = $feature)]
                    stringify!($engine) => harness::serve_as_child::<$db>().await,
                )*
                other => panic!("unknown engine {other}"),
            }
        }
    };
}

all_engines!(
    postgres: sqlx::Postgres, feature = "postgres";
    sqlite: sqlx::Sqlite, feature = "sqlite";
    mysql: sqlx::MySql, feature = "mysql";
);

/// Rows of the contract that apply to PostgreSQL alone.
mod postgres_only {
    /// Only sqlx's PostgreSQL driver rolls back the whole transaction when
    /// a nested `begin()` is cancelled (its guard counts the savepoint only
    /// once the server answered); elsewhere whether the savepoint was
    /// counted depends on when the cancellation came.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn cancelled_savepoints_are_internal_errors() {
        let _slot = crate::harness::slot::<sqlx::Postgres>().await;
        crate::suite::cancelled_savepoints_are_internal_errors::<sqlx::Postgres>().await;
    }

    /// Only PostgreSQL fails a commit for serialization (SERIALIZABLE is
    /// checked there at the end): InnoDB serializes with locks, which fail
    /// a statement in the handler (a deadlock) but never the commit, and
    /// SQLite has one writer at a time.
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn serialization_failures_at_commit_are_503() {
        let _slot = crate::harness::slot::<sqlx::Postgres>().await;
        let pool = crate::engines::postgres::serializable_pool(4).await;
        crate::suite::serialization_failures_at_commit_are_503(pool).await;
    }
}

/// Engines with a server: writers that do not wait for each other (not
/// SQLite, where the held first attempt's write lock stops every other
/// claim anyway), and sessions the server can end.
mod server_engines {
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_waiting_duplicates_hold_no_connection() {
        let _slot = crate::harness::slot::<sqlx::Postgres>().await;
        let pool = crate::engines::postgres::pool(2).await;
        crate::suite::waiting_duplicates_hold_no_connection(pool).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_waiting_duplicates_hold_no_connection() {
        let _slot = crate::harness::slot::<sqlx::MySql>().await;
        let pool = crate::engines::mysql::pool(2).await;
        crate::suite::waiting_duplicates_hold_no_connection(pool).await;
    }
    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_ended_idle_sessions_are_replaced() {
        let _slot = crate::harness::slot::<sqlx::Postgres>().await;
        use crate::engines::postgres::{pool, pool_ending_idle_sessions};
        use crate::suite::{Ending, ended_idle_sessions_are_replaced};
        for checked in [false, true] {
            let (ended, admin) = (pool(1).await, pool(1).await);
            ended_idle_sessions_are_replaced(ended, admin, checked, Ending::Terminated).await;
            // `idle_session_timeout` ends a session with `FATAL` 57P05.
            let idle = std::time::Duration::from_millis(100);
            let (ended, admin) = (pool_ending_idle_sessions(idle).await, pool(1).await);
            ended_idle_sessions_are_replaced(ended, admin, checked, Ending::IdleTimeout).await;
        }
    }

    #[cfg(feature = "postgres")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_handlers_that_lose_their_connection_are_503() {
        let _slot = crate::harness::slot::<sqlx::Postgres>().await;
        let server = crate::harness::start::<sqlx::Postgres>().await;
        let admin = crate::engines::postgres::pool(1).await;
        crate::commits::handlers_that_lose_their_connection_are_503(&server, &admin).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_handlers_that_lose_their_connection_are_503() {
        let _slot = crate::harness::slot::<sqlx::MySql>().await;
        let server = crate::harness::start::<sqlx::MySql>().await;
        let admin = crate::engines::mysql::pool(1).await;
        crate::commits::handlers_that_lose_their_connection_are_503(&server, &admin).await;
    }

    #[cfg(feature = "mysql")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn mysql_ended_idle_sessions_are_replaced() {
        let _slot = crate::harness::slot::<sqlx::MySql>().await;
        use crate::engines::mysql::pool;
        use crate::suite::{Ending, ended_idle_sessions_are_replaced};
        for checked in [false, true] {
            let (ended, admin) = (pool(1).await, pool(1).await);
            ended_idle_sessions_are_replaced(ended, admin, checked, Ending::Terminated).await;
        }
    }
}
