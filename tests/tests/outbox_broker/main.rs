//! The outbox and its consumer against the real brokers, NATS JetStream on
//! 127.0.0.1:4222 and RabbitMQ on 127.0.0.1:5672 (started by `.ci/run`;
//! the tests fail without them): the charges example's relay killed
//! mid-batch, the broker unreachable for a while, the consumer example
//! killed between its effect and its acknowledgement, and a message the
//! relay publishes again after its mark was lost. Each scenario is written
//! once, generic over [`harness::TestBroker`], and instantiated per broker
//! in a module named after it (`cargo test --test outbox_broker
//! rabbitmq::`). Needs the examples built (`cargo build --examples`).

mod broker_cut;
mod consumer_killed;
mod harness;
mod published_again;
mod relay_killed;

/// Instantiates every scenario for one broker.
macro_rules! broker_suite {
    ($($broker:ident: $ty:ty $(, feature = $feature:literal)?);* $(;)?) => {
        $(
            $(#[cfg(feature = $feature)])?
            mod $broker {
                broker_suite!(@tests $ty:
                    relay_killed::relay_killed_mid_batch_then_restarted_delivers_every_message,
                    broker_cut::broker_unreachable_for_a_while_loses_nothing_and_slows_nothing,
                    consumer_killed::consumer_killed_after_its_effect_applies_each_message_once,
                    published_again::a_message_published_again_after_its_mark_was_lost_is_applied_once,
                );
            }
        )*
    };
    (@tests $ty:ty: $($module:ident::$test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                crate::$module::$test::<$ty>().await;
            }
        )*
    };
}

broker_suite!(
    nats: crate::harness::Nats;
    rabbitmq: crate::harness::RabbitMq, feature = "rabbitmq";
);
