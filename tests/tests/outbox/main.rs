//! The transactional outbox and idempotent consumers, on every engine,
//! against a real database and a real axum server: a handler sends an
//! "email" through the outbox to a recording sink; relays deliver; a
//! consumer records what it processed. Written once and instantiated per
//! engine in a module named after it (`cargo test --test outbox sqlite::`).
//! `relay.rs` holds the relay's wake-up on commit and its concurrent
//! delivery of scopes; `status.rs` the backlog an operator's page shows. The kill test serves from a child process (this
//! test binary, run as `outbox_child_server`) that aborts right after a
//! commit, before its response.

mod handlers;
mod relay;
mod status;
mod suite;

macro_rules! outbox {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            mod $engine {
                outbox!(@tests $db:
                    emails_go_once_per_committed_request,
                    a_commit_before_a_kill_is_delivered_by_the_restarted_server,
                    relays_keep_each_scope_in_order_and_never_overlap,
                    a_failing_delivery_holds_its_scope_and_is_retried,
                    consumers_apply_each_message_once,
                    a_commit_wakes_the_relay_at_once,
                    an_aborted_relay_finishes_its_pass,
                    a_pass_delivers_scopes_at_once_each_in_order,
                    the_status_shows_each_failing_scope_with_its_error,
                );
            }
        )*

        /// Not a test: the server the kill test starts in a child process.
        /// Run without its parent's environment, it fails.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "run by the kill test as a child process"]
        async fn outbox_child_server() {
            let engine = std::env::var(suite::CHILD_ENGINE).unwrap_or_else(|_| {
                panic!("{} is not set: run by the kill test only", suite::CHILD_ENGINE)
            });
            match engine.as_str() {
                $(
                    #[cfg(feature = $feature)]
                    stringify!($engine) => suite::serve_as_child::<$db>().await,
                )*
                other => panic!("no engine {other} in this build"),
            }
        }
    };
    (@tests $db:ty: $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                crate::suite::$test::<$db>().await;
            }
        )*
    };
}

outbox!(
    postgres: sqlx::Postgres, feature = "postgres";
    sqlite: sqlx::Sqlite, feature = "sqlite";
    mysql: sqlx::MySql, feature = "mysql";
);
