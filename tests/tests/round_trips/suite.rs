//! The round-trip suite, generic over the engine ([`Proxied`]): each test
//! is instantiated per engine by `main.rs`.

use idem_tests::proxied::{self, Proxied};
use idem_tests::proxy::{CutOnCommit, Cuts};
use idem_tests::round_trip_service::{Service, Wired, create_table, drop_table, settle, unique};
use idem_tests::service::until_session_ends;

use std::time::Duration;

use sqlx::pool::PoolOptions;

/// Round trips of a first attempt and of its replays, against the same
/// handler without the attribute, on a pool that pings a connection as it
/// hands it out (sqlx's default `test_before_acquire`) and as it takes it
/// back. By default `idem` takes an idle connection without the first
/// ping, since its first statement tests the connection anyway; with
/// `checked_acquire(true)` it pays the ping, as the plain handler does.
///
/// The claim rides on BEGIN and the stored response on COMMIT, so the
/// wrapper adds no round trip of its own. What is left is sqlx's: the
/// finish ends with an empty transaction that stands for the one sqlx
/// counts, and sqlx queues its `ROLLBACK`. Its PostgreSQL driver sends it
/// with the pool's return ping (one round trip); its MySQL driver sends it
/// and waits for the answer first (`wait_until_ready`): one round trip
/// more, which sqlx offers no way to avoid without a statement of its
/// own. That, and exactly that, less the ping saved.
pub async fn an_idempotent_first_attempt_adds_no_round_trip_of_its_own<DB: Proxied>() {
    for checked in [false, true] {
        first_attempts_and_replays::<DB>(checked).await;
    }
}

async fn first_attempts_and_replays<DB: Proxied>(checked: bool) {
    let fixture = Wired::<DB>::start_configured("rt", |idem| idem.checked_acquire(checked)).await;
    let service = &fixture.service;
    // The pool's own ping as a connection is handed out, which `idem`
    // saves unless `checked`.
    let saved = u64::from(!checked);
    // (statements, extra round trips, what each route sent): asserted last,
    // once every figure is printed and the tables are dropped.
    let mut extras = Vec::new();

    for statements in [1, 3] {
        // Steady state: statements prepared and cached on the connection,
        // for both routes.
        for warm in 0..3 {
            let key = unique("warm");
            for route in ["/baseline", "/idempotent", "/idempotent"] {
                let status = service.post(route, &key, statements).await.status();
                assert_eq!(status, 201, "warm-up {warm} {route}");
            }
        }

        let (base, base_sent, response) = fixture
            .count(service, "/baseline", &unique("b"), statements)
            .await;
        assert_eq!(response.status(), 201);
        let key = unique("k");
        let (idem, idem_sent, response) = fixture
            .count(service, "/idempotent", &key, statements)
            .await;
        assert_eq!(response.status(), 201);
        assert!(response.headers().get("idempotent-replayed").is_none());
        let (replay, replay_sent, response) = fixture
            .count(service, "/idempotent", &key, statements)
            .await;
        assert_eq!(response.status(), 201);
        assert_eq!(response.headers()["idempotent-replayed"], "true");

        let extra = idem as i64 - base as i64;
        println!(
            "{} checked_acquire({checked}), statements={statements}: baseline {base} round \
             trips, idempotent {idem} (extra_round_trips = {extra}), replay {replay}",
            DB::ENGINE
        );
        println!("  baseline:   {:?}", short(&base_sent, 3));
        println!("  idempotent: {:?}", short(&idem_sent, 3));
        println!("  replay:     {:?}", short(&replay_sent, 3));
        extras.push((statements, extra, base_sent, idem_sent));
        // The baseline is its pool pings, BEGIN, the statements, COMMIT.
        let pings = base - statements as u64 - 2;
        assert_eq!(pings, 2, "the pool pings on the way out and back");
        // A replay in the process that stored the response: one plain
        // (prepared, cached) read, no transaction, and the pool's pings.
        assert_eq!(
            replay,
            pings - saved + 1,
            "a replay takes {replay} round trips: {replay_sent:#?}"
        );

        // Another instance never saw the key finish, so it claims: the
        // claim finds the finished row and fails on it inside the
        // transaction it opened; one more round trip ends it and reads the
        // stored response: pings + 2. From then on this instance knows the
        // key finished and replays with the read.
        let mut other = Service::start_configured(
            fixture.pool.clone(),
            &fixture.keys,
            &fixture.table,
            |idem| idem.checked_acquire(checked),
        )
        .await;
        other.account.clone_from(&service.account);
        let before = fixture.rows().await;
        for (attempt, expected) in [(1, pings - saved + 2), (2, pings - saved + 1)] {
            let (round_trips, sent, answer) =
                fixture.count(&other, "/idempotent", &key, statements).await;
            assert_eq!(answer.status(), 201);
            assert_eq!(answer.headers()["idempotent-replayed"], "true");
            println!(
                "  replay {attempt} on another instance: {round_trips} round trips {:?}",
                short(&sent, 3)
            );
            assert_eq!(
                round_trips, expected,
                "replay {attempt} on another instance: {sent:#?}"
            );
            if attempt == 1 {
                assert!(
                    sent.iter().any(|round_trip| round_trip
                        .iter()
                        .any(|command| command.starts_with(DB::TAKEN_KEY_READ))),
                    "the claim's read of the taken key: {sent:#?}"
                );
            }
        }
        assert_eq!(fixture.rows().await, before, "replayed, not rerun");
        drop(other);
    }

    fixture.stop().await;
    let sqlx_own = DB::QUEUED_ROLLBACK_ROUND_TRIPS;
    for (statements, extra, base_sent, idem_sent) in extras {
        // The design's budget is one.
        assert!(extra <= 1, "the wrapper adds {extra} round trips");
        assert_eq!(
            extra,
            sqlx_own as i64 - saved as i64,
            "with {statements} statements the wrapper adds {extra} round trips: \
             baseline {base_sent:#?}, idempotent {idem_sent:#?}"
        );
        let lone_rollbacks = idem_sent
            .iter()
            .filter(|round_trip| round_trip.len() == 1 && round_trip[0] == "QUERY ROLLBACK")
            .count();
        assert_eq!(
            lone_rollbacks as u64, sqlx_own,
            "sqlx's queued ROLLBACK, a round trip of its own or with the ping: {idem_sent:#?}"
        );
    }
}

/// A recorded round trip's commands, each cut to its first `words` words
/// (the claim and the finish are long batches of inlined hex).
fn short(round_trips: &[Vec<String>], words: usize) -> Vec<Vec<String>> {
    round_trips
        .iter()
        .map(|commands| {
            commands
                .iter()
                .map(|command| {
                    let mut cut: Vec<&str> = command.split_whitespace().take(words).collect();
                    if cut.len() < command.split_whitespace().count() {
                        cut.push("...");
                    }
                    cut.join(" ")
                })
                .collect()
        })
        .collect()
}

// ----------------------------------------------------------- the proxy itself

/// Through a real server: sqlx's pool pings a connection on its way out of
/// the pool (`test_before_acquire`) and on its way back, each a round trip;
/// a text query is one more, a prepared statement two the first time on a
/// connection (prepare, then execute) and one after. A dropped
/// transaction's queued `ROLLBACK` goes out with the return ping, in the
/// same round trip or (MySQL) one of its own.
pub async fn the_proxy_counts_round_trips<DB: Proxied>() {
    let proxy = proxied::start_proxy::<DB>().await;
    let pool = proxied::through::<DB>(&proxy, 1).await;
    settle(&pool).await;
    assert_eq!(proxy.connections(), 1, "the pool's one connection");
    let ping = || vec![DB::PING.to_owned()];
    let query = |sql: &str| format!("QUERY {sql}");

    proxy.reset();
    proxy.record();
    DB::run(&pool, "SELECT 1".to_owned()).await.unwrap();
    settle(&pool).await;
    let simple = proxy.round_trips();
    assert_eq!(proxy.recorded(), [ping(), vec![query("SELECT 1")], ping()]);
    assert_eq!(simple, 3, "SELECT 1 is one round trip beyond the two pings");

    let mut prepared = Vec::new();
    for _ in 0..2 {
        proxy.reset();
        proxy.record();
        DB::select_parameter(&pool).await;
        settle(&pool).await;
        prepared.push(proxy.round_trips());
        let sent = proxy.recorded();
        let commands = || sent.iter().flatten();
        assert!(
            !commands().any(|command| command.starts_with("QUERY")),
            "a prepared statement sends no text query: {sent:#?}"
        );
        assert!(
            commands().any(|command| command == DB::PING),
            "the pool's pings: {sent:#?}"
        );
    }
    assert_eq!(prepared, [simple + 1, simple], "cold, then cached");

    // A dropped transaction: sqlx queues its ROLLBACK, and the pool's
    // return ping sends it.
    proxy.reset();
    proxy.record();
    drop(pool.begin().await.unwrap());
    settle(&pool).await;
    let rollback = vec![query("ROLLBACK")];
    let mut expected = vec![ping(), vec![query("BEGIN")]];
    match DB::QUEUED_ROLLBACK_ROUND_TRIPS {
        0 => expected.push([rollback, ping()].concat()),
        _ => expected.extend([rollback, ping()]),
    }
    assert_eq!(proxy.recorded(), expected, "BEGIN and ROLLBACK");
    assert_eq!(
        proxy.round_trips(),
        simple + DB::QUEUED_ROLLBACK_ROUND_TRIPS
    );
    assert_eq!(proxy.accepted(), 0);

    pool.close().await;
    drop(proxy);
}

/// `cut_all` drops an open connection (and counts it); while refusing, a
/// new connection is closed as it arrives.
pub async fn the_proxy_cuts_and_refuses<DB: Proxied>() {
    let proxy = proxied::start_proxy::<DB>().await;
    let pool = proxied::through::<DB>(&proxy, 1).await;
    let mut conn = pool.acquire().await.unwrap();
    DB::run_on(&mut conn, "SELECT 1".to_owned()).await.unwrap();
    proxy.cut_all();
    assert!(DB::run_on(&mut conn, "SELECT 1".to_owned()).await.is_err());
    assert_eq!(proxy.cuts().all, 1, "cut_all cut the open connection");
    conn.close_on_drop();
    drop(conn);

    proxy.set_refuse(true);
    let refused = PoolOptions::<DB>::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&proxied::url_via::<DB>(proxy.addr()))
        .await;
    assert!(refused.is_err(), "connected while refusing");
    proxy.set_refuse(false);
    DB::run(&pool, "SELECT 1".to_owned()).await.unwrap();
    assert_eq!(proxy.cuts().all, 1, "nothing more to cut");
    pool.close().await;
}

/// Plain sqlx on a proxied pool: the cut before forwarding leaves nothing
/// (once the server has ended the session: an uncommitted row is
/// invisible anyway, so only then does a count of 0 say the commit never
/// ran), the cut after the answer leaves the commit with no wait (even in
/// a batch whose later results are a result set), the cut sessions are the
/// server's, each cut is counted, and `cut_all` drops an open connection.
pub async fn the_proxy_cuts_at_commit_before_or_after_forwarding<DB: Proxied>() {
    let admin = DB::pool(2).await;
    let table = unique("rt_cut");
    create_table(&admin, &table).await;
    let rows = || DB::count_rows(&admin, &table);
    let proxy = proxied::start_proxy::<DB>().await;
    let pool = proxied::through::<DB>(&proxy, 1).await;
    let insert = format!("INSERT INTO {table} (account, amount) VALUES ('proxy', 1)");
    let commit_one = || async {
        let mut tx = pool.begin().await?;
        DB::run_on(&mut tx, insert.clone()).await?;
        tx.commit().await
    };

    let session = {
        let mut conn = pool.acquire().await.unwrap();
        DB::session_id(&mut conn).await.expect("a server session")
    };
    proxy.set_cut_on_commit(CutOnCommit::BeforeForwarding);
    assert!(commit_one().await.is_err(), "the commit was cut");
    assert_eq!(proxy.cut_sessions(), [session as u32], "the server's id");
    until_session_ends::<DB>(&admin, session).await;
    assert_eq!(rows().await, 0, "the server never saw COMMIT");

    proxy.set_cut_on_commit(CutOnCommit::AfterForwarding);
    assert!(commit_one().await.is_err(), "the commit's answer was cut");
    // No wait: the proxy cut only once it had read the whole answer.
    assert_eq!(rows().await, 1, "the forwarded COMMIT landed");
    let batch =
        format!("START TRANSACTION; {insert}; SELECT 1; COMMIT; SELECT 2, 'x' UNION SELECT 3, 'y'");
    let cut = DB::run(&pool, batch).await;
    assert!(cut.is_err(), "the answer was withheld: {cut:?}");
    assert_eq!(rows().await, 2, "the forwarded COMMIT in a batch landed");
    assert_eq!(proxy.cut_sessions().len(), 3);

    proxy.set_cut_on_commit(CutOnCommit::Off);
    commit_one().await.expect("commits again once off");
    assert_eq!(rows().await, 3);
    assert_eq!(proxy.cut_sessions().len(), 3, "no cut while off");
    let at_commits = Cuts {
        all: 0,
        before_commit: 1,
        after_commit: 2,
    };
    assert_eq!(proxy.cuts(), at_commits, "the cuts, as they happened");

    let mut conn = pool.acquire().await.unwrap();
    DB::run_on(&mut conn, "SELECT 1".to_owned()).await.unwrap();
    proxy.cut_all();
    assert!(DB::run_on(&mut conn, "SELECT 1".to_owned()).await.is_err());
    conn.close_on_drop();
    drop(conn);
    DB::run(&pool, "SELECT 1".to_owned())
        .await
        .expect("a new connection after cut_all");
    assert_eq!(proxy.cuts().all, 1);

    pool.close().await;
    drop(proxy);
    drop_table(&admin, &table).await;
}
