//! The charges example's outbox relay: with `BROKER=rabbitmq`, to the
//! RabbitMQ queue `broker::Amqp` names; otherwise to NATS JetStream at
//! `NATS_URL` (the stream and subjects from `broker`), or, unset, to a sink
//! printing one line per message.

use std::error::Error;
use std::time::Duration;

use idem::outbox::{Relay, Sink};
use idem::{Backend, Idem};

use crate::broker::{Amqp, Broker, Which};

/// Spawns the relay of `idem`'s outbox. A broker that is down delays the
/// messages, not the API.
pub async fn spawn<DB: Backend>(idem: &Idem<DB>) -> Result<(), Box<dyn Error>> {
    if crate::broker::which()? == Which::RabbitMq {
        let amqp = Amqp::from_env();
        tracing::info!("outbox relay publishing to RabbitMQ queue {}", amqp.queue);
        let idem = idem.clone();
        // Until the broker answers, messages wait in the outbox.
        tokio::spawn(async move {
            let declared = amqp.connect().await;
            let _ = declared.close(200, "queue declared".into()).await;
            loop {
                match idem::outbox::rabbitmq::RabbitMq::to_queue(&amqp.url, &amqp.queue).await {
                    Ok(sink) => {
                        tuned(idem.relay(sink)).spawn();
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "RabbitMQ not ready; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        return Ok(());
    }
    match std::env::var("NATS_URL") {
        Ok(url) if !url.is_empty() => {
            let broker = Broker::from_env(url);
            let jetstream = broker.connect().await?;
            let sink = idem::outbox::nats::JetStream::new(jetstream.clone())
                .subject_prefix(&broker.prefix);
            tracing::info!(
                "outbox relay publishing to NATS stream {} (subjects {})",
                broker.stream,
                broker.subject("charge.>")
            );
            // Until the stream exists, publishes fail and are retried.
            tokio::spawn(async move { broker.stream(&jetstream).await });
            tuned(idem.relay(sink)).spawn();
        }
        _ => {
            tracing::info!("NATS_URL is not set: the outbox relay prints each message");
            let print = idem::outbox::sink_fn(async |message: idem::outbox::Message| {
                let payload = String::from_utf8_lossy(&message.payload);
                println!("outbox {} {} {payload}", message.topic, message.id);
                Ok(())
            });
            tuned(idem.relay(print)).spawn();
        }
    }
    Ok(())
}

/// Short waits, for a demo: a lease twice the delivery timeout (its
/// minimum) plus margin, so a killed server's messages go out again within
/// 10 s of its restart; a message failing to go is retried after 0.5 s,
/// 1 s, 2 s, ... at most 5 s apart.
fn tuned<DB: Backend, S: Sink>(relay: Relay<DB, S>) -> Relay<DB, S> {
    relay
        .every(Duration::from_millis(200))
        .delivery_timeout(Duration::from_secs(3))
        .lease(Duration::from_secs(10))
        .backoff(Duration::from_millis(500))
        .max_backoff(Duration::from_secs(5))
}
