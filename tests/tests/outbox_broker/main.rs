//! The outbox and its consumer against the real broker, NATS JetStream on
//! 127.0.0.1:4222 (started by `.ci/run`; the tests fail without it): the
//! charges example's relay killed mid-batch, the broker unreachable for a
//! while, and the consumer example killed between its effect and its
//! acknowledgement. Needs the examples built (`cargo build --examples`).

mod broker_cut;
mod consumer_killed;
mod harness;
mod relay_killed;
