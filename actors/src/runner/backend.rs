//! The narrow interface between the Runner actor and the engine, in the
//! spirit of TGI's `Backend`: join the ring, load with progress, warm up,
//! queue and cancel generations, run the batch one step at a time (each
//! generation a stream of chunks), follow rank 0, shut down. Every call
//! blocks, so the backend lives on a thread of its own ([`spawn_engine`]),
//! which steps the batch while it has work and takes the actor's commands
//! between steps; the actor only ever sends commands and takes events.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use tessera_engine::serve::GenerateRequest;
use tessera_protos::v1::generation_chunk;

use super::request::EmbedRequest;
use crate::worker::runner_protocol::DraftOrder;

/// Loading progress is reported at most this often (it goes into the log).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The request cannot run as asked (a prompt beyond the context, a
    /// template that fails on these messages): the client's 400.
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    Engine(String),
}

impl BackendError {
    /// The `ErrorChunk.kind` a client sees.
    pub fn chunk_kind(&self) -> &'static str {
        match self {
            Self::InvalidRequest(_) => "invalid_request",
            Self::Engine(_) => "engine",
        }
    }
}

/// One rank's engine. Rank 0 generates; the other ranks follow its steps.
pub trait Backend {
    /// Joins the instance's ring (instances of several ranks).
    fn connect(&mut self) -> Result<(), BackendError>;
    /// Loads this rank's shard, reporting `(done, total)` layers; returns
    /// the bytes of weights resident.
    fn load(&mut self, progress: &mut dyn FnMut(usize, usize)) -> Result<u64, BackendError>;
    /// Makes the rank ready (rank 0 runs a tiny generation).
    fn warm_up(&mut self) -> Result<(), BackendError>;
    /// Rank 0: queues a generation; what makes it impossible (a prompt
    /// beyond the context or the KV cache, a template error) is its error
    /// now, and nothing else is touched.
    fn submit(
        &mut self,
        task_id: &str,
        command_id: &str,
        request: GenerateRequest,
    ) -> Result<(), BackendError>;
    /// Rank 0: queues an embedding request (an embedding model's
    /// instance); what makes it impossible is its error now. A backend
    /// without an embedding model refuses it.
    fn submit_embedding(
        &mut self,
        task_id: &str,
        request: EmbedRequest,
    ) -> Result<(), BackendError> {
        let _ = (task_id, request);
        Err(BackendError::InvalidRequest(
            "this model does not make embeddings".into(),
        ))
    }
    /// Rank 0: ends a generation at the next step, finishing as cancelled.
    fn cancel(&mut self, task_id: &str);
    /// Rank 0: speculative decoding from the next step on (`None`: off);
    /// generations in the batch keep going. A draft model is loaded (once:
    /// the same files again are not) and refused when its vocabulary is
    /// not the target's, which leaves speculation off. Returns the bytes
    /// of the draft's weights resident.
    fn set_draft(&mut self, draft: Option<&DraftOrder>) -> Result<u64, BackendError>;
    /// Rank 0: generations are waiting or running.
    fn busy(&self) -> bool;
    /// Rank 0: one forward pass over the batch. Each generation's chunks
    /// go to `sink` as [`EngineEvent::Chunk`], its end (the finish chunk
    /// sent, or its error) as [`EngineEvent::Generated`].
    fn step(&mut self, sink: &mut dyn FnMut(EngineEvent));
    /// Other ranks: follows rank 0's steps until it shuts down.
    fn follow(&mut self) -> Result<(), BackendError>;
    /// Rank 0: tells the other ranks to stop.
    fn shutdown(&mut self) -> Result<(), BackendError>;
}

/// What the actor asks of the engine thread.
pub enum EngineCommand {
    Connect,
    Load,
    WarmUp,
    Generate {
        task_id: String,
        command_id: String,
        request: Box<GenerateRequest>,
    },
    Embed {
        task_id: String,
        request: EmbedRequest,
    },
    Cancel {
        task_id: String,
    },
    SetDraft(Option<DraftOrder>),
    Follow,
    Shutdown,
}

/// What the engine thread tells the actor.
#[derive(Debug)]
pub enum EngineEvent {
    Connected,
    Loading {
        done: usize,
        total: usize,
    },
    Loaded {
        resident_bytes: u64,
    },
    WarmedUp,
    Chunk {
        task_id: String,
        kind: generation_chunk::Kind,
    },
    Generated {
        task_id: String,
        result: Result<(), BackendError>,
    },
    /// A draft was set (as asked), or why not: the draft's resident bytes.
    DraftSet {
        asked: Option<DraftOrder>,
        result: Result<u64, BackendError>,
    },
    /// Following rank 0 has ended.
    Followed(Result<(), BackendError>),
    ShutDown(Result<(), BackendError>),
    /// Joining, loading or warming up failed: the runner cannot go on.
    Failed(BackendError),
}

/// The actor's end of the engine thread.
pub struct EngineHandle {
    commands: mpsc::Sender<EngineCommand>,
}

impl EngineHandle {
    /// Queues a command; false once the engine thread is gone.
    pub fn send(&self, command: EngineCommand) -> bool {
        self.commands.send(command).is_ok()
    }
}

/// Starts the engine thread: `make` builds the backend there (an engine
/// holds borrows and threads that never move). It runs each command in
/// turn, and while generations are queued it steps the batch, taking the
/// commands that came in between steps; events go to `events`.
pub fn spawn_engine<B, F>(
    make: F,
    events: impl Fn(EngineEvent) + Send + 'static,
) -> std::io::Result<EngineHandle>
where
    B: Backend,
    F: FnOnce() -> B + Send + 'static,
{
    let (commands, inbox) = mpsc::channel();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || {
            let mut backend = make();
            loop {
                let command = if backend.busy() {
                    match inbox.try_recv() {
                        Ok(command) => Some(command),
                        Err(mpsc::TryRecvError::Empty) => None,
                        Err(mpsc::TryRecvError::Disconnected) => return,
                    }
                } else {
                    match inbox.recv() {
                        Ok(command) => Some(command),
                        Err(_) => return,
                    }
                };
                match command {
                    Some(command) => run_command(&mut backend, command, &events),
                    None => backend.step(&mut |event| events(event)),
                }
            }
        })?;
    Ok(EngineHandle { commands })
}

fn run_command<B: Backend>(backend: &mut B, command: EngineCommand, events: &dyn Fn(EngineEvent)) {
    let or_failed = |result: Result<EngineEvent, BackendError>| match result {
        Ok(event) => event,
        Err(error) => EngineEvent::Failed(error),
    };
    let event = match command {
        EngineCommand::Connect => or_failed(backend.connect().map(|()| EngineEvent::Connected)),
        EngineCommand::Load => {
            let mut last: Option<Instant> = None;
            let mut progress = |done: usize, total: usize| {
                if done < total && last.is_some_and(|at| at.elapsed() < PROGRESS_EVERY) {
                    return;
                }
                last = Some(Instant::now());
                events(EngineEvent::Loading { done, total });
            };
            or_failed(
                backend
                    .load(&mut progress)
                    .map(|resident_bytes| EngineEvent::Loaded { resident_bytes }),
            )
        }
        EngineCommand::WarmUp => or_failed(backend.warm_up().map(|()| EngineEvent::WarmedUp)),
        EngineCommand::Generate {
            task_id,
            command_id,
            request,
        } => match backend.submit(&task_id, &command_id, *request) {
            Ok(()) => return,
            Err(error) => EngineEvent::Generated {
                task_id,
                result: Err(error),
            },
        },
        EngineCommand::Embed { task_id, request } => {
            match backend.submit_embedding(&task_id, request) {
                Ok(()) => return,
                Err(error) => EngineEvent::Generated {
                    task_id,
                    result: Err(error),
                },
            }
        }
        EngineCommand::Cancel { task_id } => {
            backend.cancel(&task_id);
            return;
        }
        EngineCommand::SetDraft(asked) => {
            let result = backend.set_draft(asked.as_ref());
            EngineEvent::DraftSet { asked, result }
        }
        EngineCommand::Follow => EngineEvent::Followed(backend.follow()),
        EngineCommand::Shutdown => EngineEvent::ShutDown(backend.shutdown()),
    };
    events(event);
}
