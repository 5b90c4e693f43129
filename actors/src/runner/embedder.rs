//! Rank 0 of an embedding model's instance: requests queue while a batch
//! runs, and each step embeds the queued inputs together (up to a token
//! budget), one `EmbeddingChunk` per input and a finish chunk per request.

use std::collections::VecDeque;
use std::time::Instant;

use tessera_engine::embed::{pooling, Embedder};
use tessera_engine::threadpool::ThreadPool;
use tessera_protos::v1::{self, generation_chunk};

use super::backend::{BackendError, EngineEvent};
use super::request::EmbedRequest;

/// Tokens one step embeds at most (a single request may go beyond it: it
/// is never split, so it runs alone).
const STEP_TOKENS: usize = 16_384;

/// A request tokenized and waiting.
struct Queued {
    task_id: String,
    sequences: Vec<Vec<u32>>,
    dimensions: usize,
    /// Cancelled while queued: its step only ends it.
    cancelled: bool,
}

pub(super) struct EmbedHead {
    embedder: &'static Embedder,
    pool: ThreadPool,
    queue: VecDeque<Queued>,
}

impl EmbedHead {
    /// Ready to embed; one tiny input first, so the first request pays no
    /// first-touch costs.
    pub(super) fn warm(embedder: &'static Embedder, threads: usize) -> Self {
        let pool = ThreadPool::new(threads);
        let hello = embedder.tokenize(0, &tessera_engine::embed::EmbedInput::Text("Hello".into()));
        if let Ok(sequence) = hello {
            let _ = embedder.embed_tokens(&[sequence], &pool);
        }
        Self {
            embedder,
            pool,
            queue: VecDeque::new(),
        }
    }

    /// Tokenizes `request` and queues it; a request the model cannot take
    /// (tokens beyond its vocabulary or limit, `dimensions` it cannot
    /// give) is refused now.
    pub(super) fn submit(
        &mut self,
        task_id: &str,
        request: EmbedRequest,
    ) -> Result<(), BackendError> {
        let invalid = |e: tessera_engine::embed::EmbedError| {
            if e.is_invalid_input() {
                BackendError::InvalidRequest(e.to_string())
            } else {
                BackendError::Engine(e.to_string())
            }
        };
        self.embedder
            .check_dimensions(request.dimensions)
            .map_err(invalid)?;
        let sequences = request
            .inputs
            .iter()
            .enumerate()
            .map(|(index, input)| {
                self.embedder
                    .tokenize_input(index, input, request.refuse_long)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        self.queue.push_back(Queued {
            task_id: task_id.to_string(),
            sequences,
            dimensions: request.dimensions,
            cancelled: false,
        });
        Ok(())
    }

    /// Marks a queued request cancelled: the next step ends it without
    /// embedding it.
    pub(super) fn cancel(&mut self, task_id: &str) {
        for queued in self.queue.iter_mut().filter(|q| q.task_id == task_id) {
            queued.cancelled = true;
        }
    }

    pub(super) fn busy(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Embeds the requests at the head of the queue that fit the step's
    /// token budget (at least one) as one batch, and sends their chunks.
    pub(super) fn step(&mut self, sink: &mut dyn FnMut(EngineEvent)) {
        let mut taken = Vec::new();
        let mut tokens = 0;
        while let Some(next) = self.queue.front() {
            let size: usize = if next.cancelled {
                0
            } else {
                next.sequences.iter().map(Vec::len).sum()
            };
            if !taken.is_empty() && tokens + size > STEP_TOKENS {
                break;
            }
            tokens += size;
            taken.extend(self.queue.pop_front());
        }
        let started = Instant::now();
        let all: Vec<Vec<u32>> = taken
            .iter()
            .filter(|q| !q.cancelled)
            .flat_map(|q| q.sequences.iter().cloned())
            .collect();
        let whole = match self.embedder.embed_tokens(&all, &self.pool) {
            Ok(whole) => whole,
            Err(error) => {
                for request in taken {
                    sink(EngineEvent::Generated {
                        task_id: request.task_id,
                        result: Err(BackendError::Engine(error.to_string())),
                    });
                }
                return;
            }
        };
        let seconds = started.elapsed().as_secs_f64().max(1e-9);
        let mut vectors = whole.into_iter();
        for request in taken {
            let task_id = request.task_id;
            if request.cancelled {
                sink(EngineEvent::Chunk {
                    task_id: task_id.clone(),
                    kind: finish(v1::FinishReason::Cancelled, 0, 0.0),
                });
                sink(EngineEvent::Generated {
                    task_id,
                    result: Ok(()),
                });
                continue;
            }
            let mut prompt_tokens = 0;
            for (index, sequence) in request.sequences.iter().enumerate() {
                let mut vector = vectors.next().unwrap_or_default();
                pooling::cut(&mut vector, request.dimensions);
                prompt_tokens += sequence.len();
                sink(EngineEvent::Chunk {
                    task_id: task_id.clone(),
                    kind: generation_chunk::Kind::Embedding(v1::EmbeddingChunk {
                        index: index as u32,
                        vector,
                        tokens: sequence.len() as u32,
                    }),
                });
            }
            sink(EngineEvent::Chunk {
                task_id: task_id.clone(),
                kind: finish(
                    v1::FinishReason::Stop,
                    prompt_tokens,
                    tokens as f64 / seconds,
                ),
            });
            sink(EngineEvent::Generated {
                task_id,
                result: Ok(()),
            });
        }
    }
}

fn finish(
    reason: v1::FinishReason,
    prompt_tokens: usize,
    tokens_per_second: f64,
) -> generation_chunk::Kind {
    generation_chunk::Kind::Finish(v1::FinishChunk {
        reason: reason as i32,
        usage: Some(v1::Usage {
            prompt_tokens: prompt_tokens as u32,
            ..Default::default()
        }),
        stats: Some(v1::GenerationStats {
            prefill_tokens_per_second: tokens_per_second,
            ..Default::default()
        }),
    })
}
