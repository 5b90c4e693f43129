//! One generation as the API node sees it: subscribe to
//! `chunks/{command_id}`, send the TextGeneration command, then read chunks
//! until the finish or an error. Dropping an unfinished generation cancels
//! it (a client that disconnects stops the work on every rank).
//!
//! A generation watches its way to the end:
//! - the command is sent again, under the same id, until its task is in
//!   the state (a command put while the master is being replaced is lost;
//!   the master applies an id once, so a repeat does nothing twice);
//! - once the task names its instance, the generation fails within a
//!   fraction of a second, with an error chunk naming the cause, if that
//!   instance leaves the state or the node of its rank 0 loses its
//!   liveliness token, instead of waiting out the chunk timeout.

use std::time::{Duration, Instant};

use tessera_protos::v1::{self, command, generation_chunk, Command};
use zenoh::handlers::FifoChannelHandler;
use zenoh::pubsub::Subscriber;
use zenoh::sample::{Sample, SampleKind};

use crate::bus::Bus;
use crate::cluster::replica::StateView;

/// How often a generation looks at the state.
const WATCH_EVERY: Duration = Duration::from_millis(200);
/// How long a command may go unseen before it is sent again.
const RESEND_AFTER: Duration = Duration::from_secs(1);
/// A liveliness token can vanish for a moment while the link it was
/// learnt through changes (a failover); gone this long, the node is gone.
const GONE_GRACE: Duration = Duration::from_millis(300);

/// The error kind of a generation whose instance went away; the API
/// answers 503 and, before any token was sent, tries again.
pub const INSTANCE_LOST: &str = "instance_lost";

/// Why a generation could not go on, before or between chunks (the
/// cluster's own errors come as error chunks).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// The cluster could not take or answer it now: retrying may help.
    #[error("{0}")]
    Unavailable(String),
    /// This node failed at its own part (a subscription, a key).
    #[error("{0}")]
    Internal(String),
}

type Liveliness = Subscriber<FifoChannelHandler<Sample>>;

/// Where the watched generation runs, once its task is known.
struct Assigned {
    instance_id: String,
    rank0_node: String,
    liveliness: Option<Liveliness>,
}

pub struct Generation {
    bus: Bus,
    state: StateView,
    node_id: String,
    pub command_id: String,
    command: Command,
    chunks: Subscriber<FifoChannelHandler<Sample>>,
    /// How long to wait for the next chunk.
    timeout: Duration,
    done: bool,
    sent_at: Instant,
    /// When the state is looked at next (kept across chunks: a stream of
    /// tokens must not read the state once a token).
    watch_at: tokio::time::Instant,
    /// Times the command was sent again.
    pub resends: u32,
    /// Whether any chunk came (then nothing is sent again).
    answered: bool,
    assigned: Option<Assigned>,
}

impl Generation {
    /// Starts generating `params` on `instance_id` (empty: any ready
    /// instance of the model).
    pub async fn start(
        bus: &Bus,
        state: &StateView,
        node_id: &str,
        instance_id: &str,
        params: v1::TextGenerationParams,
        timeout: Duration,
    ) -> Result<Self, GenerationError> {
        let command_id = uuid::Uuid::now_v7().to_string();
        let key = bus
            .keys
            .chunks(&command_id)
            .map_err(|e| GenerationError::Internal(e.to_string()))?;
        let chunks = bus
            .subscribe(key)
            .await
            .map_err(|e| GenerationError::Internal(format!("subscribing to chunks: {e}")))?;
        let command = Command {
            command_id: command_id.clone(),
            origin_node_id: node_id.to_string(),
            kind: Some(command::Kind::TextGeneration(v1::TextGeneration {
                instance_id: instance_id.to_string(),
                params: Some(params),
            })),
        };
        tracing::debug!(command_id, "generation command sent");
        bus.put(&bus.keys.commands(), &command)
            .await
            .map_err(|e| GenerationError::Unavailable(format!("sending the request: {e}")))?;
        Ok(Self {
            bus: bus.clone(),
            state: state.clone(),
            node_id: node_id.to_string(),
            command_id,
            command,
            chunks,
            timeout,
            done: false,
            sent_at: Instant::now(),
            watch_at: tokio::time::Instant::now() + WATCH_EVERY,
            resends: 0,
            answered: false,
            assigned: None,
        })
    }

    /// The instance the master gave the generation to, once known.
    pub fn instance_id(&self) -> Option<&str> {
        self.assigned.as_ref().map(|a| a.instance_id.as_str())
    }

    /// The next chunk; after a finish or an error chunk, `None`.
    pub async fn next(&mut self) -> Option<Result<generation_chunk::Kind, GenerationError>> {
        if self.done {
            return None;
        }
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let gone = async {
                match self.assigned.as_ref().and_then(|a| a.liveliness.as_ref()) {
                    Some(sub) => sub.recv_async().await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    self.done = true;
                    return Some(Err(GenerationError::Unavailable(format!(
                        "no answer from the instance within {:?}",
                        self.timeout
                    ))));
                }
                sample = self.chunks.recv_async() => {
                    let sample = match sample {
                        Ok(sample) => sample,
                        Err(error) => {
                            self.done = true;
                            return Some(Err(GenerationError::Internal(format!(
                                "chunk stream closed: {error}"
                            ))));
                        }
                    };
                    if let Some(kind) = self.take(&sample) {
                        return Some(Ok(kind));
                    }
                }
                _ = tokio::time::sleep_until(self.watch_at) => {
                    self.watch_at = tokio::time::Instant::now() + WATCH_EVERY;
                    if let Some(lost) = self.watch().await {
                        return Some(Ok(self.lost(lost)));
                    }
                }
                sample = gone => {
                    if let Some(lost) = self.on_liveliness(sample).await {
                        return Some(Ok(self.lost(lost)));
                    }
                }
            }
        }
    }

    /// A chunk of ours, if the sample holds one.
    fn take(&mut self, sample: &Sample) -> Option<generation_chunk::Kind> {
        // Chunks come from nodes (their runners), never an admin machine.
        let chunk = self
            .bus
            .take::<v1::GenerationChunk>(sample, |_| crate::bus::Author::AnyNode)?;
        let kind = chunk.kind?;
        self.answered = true;
        if matches!(
            kind,
            generation_chunk::Kind::Finish(_) | generation_chunk::Kind::Error(_)
        ) {
            self.done = true;
        }
        Some(kind)
    }

    fn lost(&mut self, message: String) -> generation_chunk::Kind {
        tracing::warn!(command_id = self.command_id, message, "generation lost");
        self.done = true;
        generation_chunk::Kind::Error(v1::ErrorChunk {
            kind: INSTANCE_LOST.into(),
            message,
        })
    }

    /// Looks at the state: sends the command again while its task is not
    /// there, and says why the generation is lost once its instance is gone.
    async fn watch(&mut self) -> Option<String> {
        let state = self.state.borrow().clone();
        let Some(assigned) = &self.assigned else {
            let task = state
                .tasks
                .values()
                .find(|t| t.command_id == self.command_id);
            match task {
                Some(task) => self.assign(&state, &task.instance_id).await,
                None if !self.answered && self.sent_at.elapsed() >= RESEND_AFTER => {
                    self.resend().await
                }
                None => {}
            }
            return None;
        };
        if !state.instances.contains_key(&assigned.instance_id) {
            return Some(format!(
                "the instance {} was deleted while it answered (a node it runs on was lost, \
                 or it was deleted); try again once the model is placed again",
                assigned.instance_id
            ));
        }
        None
    }

    async fn assign(&mut self, state: &v1::ClusterState, instance_id: &str) {
        let rank0_node = state
            .instances
            .get(instance_id)
            .and_then(|i| i.ranks.first())
            .map(|r| r.node_id.clone())
            .unwrap_or_default();
        let liveliness = match self.bus.keys.alive(&rank0_node) {
            Ok(key) => self
                .bus
                .subscribe_liveliness(key, false)
                .await
                .map_err(|error| tracing::debug!(%error, "watching rank 0's node"))
                .ok(),
            Err(_) => None,
        };
        tracing::debug!(
            command_id = self.command_id,
            instance_id,
            rank0_node,
            "generation assigned"
        );
        self.assigned = Some(Assigned {
            instance_id: instance_id.to_string(),
            rank0_node,
            liveliness,
        });
    }

    async fn resend(&mut self) {
        self.resends += 1;
        self.sent_at = Instant::now();
        tracing::info!(
            command_id = self.command_id,
            resends = self.resends,
            "no task for the generation yet; sending it again"
        );
        if let Err(error) = self.bus.put(&self.bus.keys.commands(), &self.command).await {
            tracing::debug!(%error, "sending a generation again");
        }
    }

    /// Rank 0's node lost its token: gone for good if it does not show it
    /// again within [`GONE_GRACE`].
    async fn on_liveliness(&mut self, sample: Option<Sample>) -> Option<String> {
        let assigned = self.assigned.as_mut()?;
        let Some(sample) = sample else {
            // The subscriber closed; the state watch still covers this.
            assigned.liveliness = None;
            return None;
        };
        if sample.kind() != SampleKind::Delete {
            return None;
        }
        tokio::time::sleep(GONE_GRACE).await;
        let back = self
            .bus
            .is_alive(&assigned.rank0_node, Duration::from_millis(500))
            .await;
        (!back).then(|| {
            format!(
                "the node {} that runs rank 0 of instance {} is gone",
                assigned.rank0_node, assigned.instance_id
            )
        })
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // The client went away mid-generation: cancel it.
        let bus = self.bus.clone();
        let command = Command {
            command_id: uuid::Uuid::now_v7().to_string(),
            origin_node_id: self.node_id.clone(),
            kind: Some(command::Kind::CancelTask(v1::CancelTask {
                task_id: String::new(),
                command_id: self.command_id.clone(),
            })),
        };
        tracing::info!(command_id = self.command_id, "client gone; cancelling");
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = bus.put(&bus.keys.commands(), &command).await;
            });
        }
    }
}
