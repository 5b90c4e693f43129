//! What a node's worker and its `tessera runner` child processes say to each
//! other: one JSON object a line, over the child's stdin and stdout. Pipes
//! rather than zenoh keep one zenoh session per node, and a child that dies
//! closes them at once, so its death is noticed without a timeout.

use serde::{Deserialize, Serialize};
use tessera_protos::v1;

/// Worker → runner.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum ToRunner {
    /// Join the instance's ring (multi-rank instances).
    Connect,
    /// Load this rank's shard.
    Load,
    /// Warm up; ranks other than 0 then follow rank 0's steps.
    WarmUp,
    /// Rank 0: run a generation, streaming chunks.
    Generate {
        task_id: String,
        command_id: String,
        params: Box<v1::TextGenerationParams>,
    },
    /// Rank 0: stop the generation of `task_id`.
    Cancel { task_id: String },
    /// Stop and exit.
    Shutdown,
}

/// Runner → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FromRunner {
    Status {
        status: v1::RunnerStatus,
    },
    Chunk {
        chunk: v1::GenerationChunk,
    },
    /// A generation ended (`error` set if it failed).
    Finished {
        task_id: String,
        error: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let messages = [
            ToRunner::Connect,
            ToRunner::Generate {
                task_id: "t".into(),
                command_id: "c".into(),
                params: Box::new(v1::TextGenerationParams {
                    model_id: "m".into(),
                    raw_prompt: Some("hi".into()),
                    ..Default::default()
                }),
            },
        ];
        for message in messages {
            let line = serde_json::to_string(&message).expect("encodes");
            let back: ToRunner = serde_json::from_str(&line).expect("decodes");
            assert_eq!(
                serde_json::to_string(&back).expect("encodes"),
                line,
                "{line}"
            );
        }
        assert!(serde_json::from_str::<ToRunner>("{\"op\":\"explode\"}").is_err());
    }
}
