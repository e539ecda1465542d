//! What the wrapper costs on the wire: database round trips of one request,
//! counted exactly through each engine's proxy, for the same handler with
//! and without `#[idempotent]`. A regression here is paid on every write,
//! so it fails CI.
//!
//! Also checks the proxies themselves (counting, cutting at a commit,
//! cutting and refusing connections), which the chaos suite relies on.
//!
//! The suite is written once (`suite.rs`) and runs on every engine with a
//! server, in a module named after it (`cargo test --test round_trips
//! mysql::`); what only one protocol shows is in `postgres_only.rs` and
//! `mysql_only.rs`.

#[cfg(feature = "mysql")]
mod mysql_only;
#[cfg(feature = "postgres")]
mod postgres_only;
mod suite;

/// Instantiates every test of `suite` for each engine whose cargo feature
/// is on.
macro_rules! round_trips {
    ($($engine:ident: $db:ty, feature = $feature:literal);* $(;)?) => {
        $(
            #[cfg(feature = $feature)]
            mod $engine {
                round_trips!(@tests $db:
                    an_idempotent_first_attempt_adds_no_round_trip_of_its_own,
                    the_proxy_counts_round_trips,
                    the_proxy_cuts_and_refuses,
                    the_proxy_cuts_at_commit_before_or_after_forwarding,
                );
            }
        )*
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

round_trips!(
    postgres: sqlx::Postgres, feature = "postgres";
    mysql: sqlx::MySql, feature = "mysql";
);
