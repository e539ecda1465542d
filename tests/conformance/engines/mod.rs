//! The engines the suite runs on, one file each. A missing server fails its
//! tests loudly; an engine whose cargo feature is off is not compiled.

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

/// The `TestDb` methods every engine writes alike, but for its
/// placeholder (`$1` or `?`).
#[macro_export]
macro_rules! test_db_queries {
    ($placeholder:literal) => {
        async fn lock_effect(pool: &Pool<Self>, id: i64) -> sqlx::Transaction<'static, Self> {
            let mut tx = pool.begin().await.unwrap();
            sqlx::query(Self::TOUCH_EFFECT)
                .bind(id)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx
        }

        async fn count_effects(pool: &Pool<Self>, scope: &str) -> i64 {
            sqlx::query_scalar(concat!(
                "SELECT count(*) FROM idem_test_effects WHERE scope = ",
                $placeholder
            ))
            .bind(scope)
            .fetch_one(pool)
            .await
            .unwrap()
        }

        async fn count_keys(pool: &Pool<Self>, scope: &str) -> i64 {
            sqlx::query_scalar(concat!(
                "SELECT count(*) FROM idem_keys WHERE scope = ",
                $placeholder
            ))
            .bind(scope.as_bytes())
            .fetch_one(pool)
            .await
            .unwrap()
        }
    };
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}
