//! Exactly-once when the process dies and the database connection is cut,
//! on every engine with a server: the random chaos run (`run.rs`) and the
//! cut at the commit, one request at a time (`cuts.rs`), each written once
//! and instantiated per engine in a module named after it (`cargo test
//! --test chaos mysql::`).

mod cuts;
mod run;

/// Instantiates every test of the suite for each engine whose cargo
/// feature is on (`--all-features` runs both).
macro_rules! chaos {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            mod $engine {
                chaos!(@tests $db:
                    run::exactly_once_under_kills_and_cut_connections,
                    cuts::a_commit_cut_before_the_server_sees_it_is_503_and_the_retry_runs_once,
                    cuts::a_commit_cut_after_the_server_answered_is_503_and_the_retry_replays,
                    cuts::the_pool_reconnects_after_cut_commits,
                    cuts::a_keyless_commit_cut_is_503_and_stores_nothing,
                );
            }
        )*

        /// Not a test: the server half of the chaos run, started by the run
        /// in a child process that it SIGKILLs. Run without its parent's
        /// setup, it fails.
        #[tokio::test]
        #[ignore = "run by the chaos run as a child process"]
        async fn chaos_child_server() {
            let engine = std::env::var(run::CHILD_ENGINE).unwrap_or_else(|_| {
                panic!("{} is not set: run by the chaos run only", run::CHILD_ENGINE)
            });
            match engine.as_str() {
                $(
                    #[cfg(feature = $feature)]
                    stringify!($engine) => run::serve_as_child::<$db>().await,
                )*
                other => panic!("no engine {other} in this build"),
            }
        }
    };
    (@tests $db:ty: $($suite:ident::$test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                crate::$suite::$test::<$db>().await;
            }
        )*
    };
}

chaos!(
    postgres: sqlx::Postgres, feature = "postgres";
    mysql: sqlx::MySql, feature = "mysql";
);
