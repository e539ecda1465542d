//! The MySQL/MariaDB test server as `mysql_chaos.rs` reaches it: its
//! URL, run-unique names, a direct pool and a one-connection pool through
//! a proxy.

use std::net::SocketAddr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions, MySqlSslMode};
use sqlx::{AssertSqlSafe, MySqlPool};

use crate::mysql_proxy::MySqlProxy;

pub fn database_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

pub use crate::unique::unique;

/// A direct pool, for setup and checks, and the server's address; fails
/// loudly without a server.
pub async fn direct() -> (MySqlPool, SocketAddr) {
    let url = database_url();
    let pool = MySqlPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
        .unwrap_or_else(|error| {
            panic!("MySQL/MariaDB is required at {url} (set IDEM_TEST_MYSQL_URL): {error}")
        });
    let options: MySqlConnectOptions = url.parse().expect("database URL");
    let server = format!("{}:{}", options.get_host(), options.get_port());
    let addr = tokio::net::lookup_host(&server)
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .unwrap_or_else(|| panic!("cannot resolve {server} (from {url})"));
    (pool, addr)
}

/// A one-connection pool through `proxy`, without TLS, so the proxy reads
/// every command.
pub async fn through(proxy: &MySqlProxy) -> MySqlPool {
    let options: MySqlConnectOptions = database_url().parse().expect("database URL");
    let options = options
        .host("127.0.0.1")
        .port(proxy.addr().port())
        .ssl_mode(MySqlSslMode::Disabled);
    MySqlPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .expect("connect through the proxy")
}

/// Runs `sql` as text, failing the test with the statement.
pub async fn run(pool: &MySqlPool, sql: String) {
    sqlx::raw_sql(AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
}
