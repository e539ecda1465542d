//! The phased mode (`Phases<DB>`), on every engine that has it, against a
//! real database, a real provider process and, for the kill tests, server
//! processes SIGKILLed at each point of a request. Written once and
//! instantiated per engine in a module named after it (`cargo test --test
//! phased sqlite::`).
//!
//! The provider is the `provider` example: build the examples first
//! (`cargo test --workspace` does).

mod harness;
mod kills;
mod metrics;
mod suite;
mod uncertain;

/// Instantiates every test of the suite for each engine whose cargo
/// feature is on (`--all-features` runs all three).
macro_rules! phased {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            mod $engine {
                phased!(@tests $db:
                    kills::killed_servers_are_finished_by_the_clients_retry,
                    kills::killed_servers_are_finished_by_the_completer,
                    suite::stalled_attempts_are_fenced_once_a_retry_took_over,
                    suite::leased_keys_are_409_and_finished_ones_replay,
                    suite::tombstones_refuse_late_retries,
                    suite::provider_failures_are_not_stored,
                    suite::failures_before_any_external_step_release_the_key,
                    uncertain::spent_attempts_make_the_key_uncertain,
                    uncertain::a_clients_retries_count_toward_the_attempts,
                    uncertain::external_once_steps_are_never_called_twice,
                );
            }
        )*

        /// Not a test: the server a kill test starts in a child process and
        /// SIGKILLs. Run without its parent's environment, it fails.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by the kill tests as a child process"]
        async fn phased_child_server() {
            let engine = std::env::var(idem_tests::phased::CHILD_ENGINE).unwrap_or_else(|_| {
                panic!("{} is not set: run by the kill tests only", idem_tests::phased::CHILD_ENGINE)
            });
            match engine.as_str() {
                $(
                    #[cfg(feature = $feature)]
                    stringify!($engine) => idem_tests::phased::serve_as_child::<$db>().await,
                )*
                other => panic!("no phased engine {other} in this build"),
            }
        }
    };
    (@tests $db:ty: $($suite:ident::$test:ident),* $(,)?) => {
        /// On a current-thread runtime of its own (see `metrics`).
        #[test]
        fn phases_are_counted() {
            crate::metrics::phases_are_counted::<$db>();
        }

        /// On a current-thread runtime of its own (see `metrics`).
        #[test]
        fn uncertainty_is_counted() {
            crate::metrics::uncertainty_is_counted::<$db>();
        }

        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                crate::$suite::$test::<$db>().await;
            }
        )*
    };
}

phased!(
    postgres: sqlx::Postgres, feature = "postgres";
    sqlite: sqlx::Sqlite, feature = "sqlite";
    mysql: sqlx::MySql, feature = "mysql";
);
