//! The twenty JSON schemas of the API test (`tests/api/schemas.json`,
//! whose answers the official client checks with `jsonschema`), eight at a
//! time in one batch, on one machine and through tensor world 2: the same
//! tokens, every answer complete JSON.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use serde_json::Value;
use tessera_engine::serve::batch::{Batch, BatchConfig, SeqEvent, SeqId};
use tessera_engine::serve::executor::Executor;
use tessera_engine::serve::{Constraint, FinishReason, GenerateRequest, GenerationOutput, Prompt};
use tessera_engine::text::chat_template::ChatMessage;

use super::distributed::{on_ranks, Sharding};

fn requests() -> Vec<GenerateRequest> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/api/schemas.json");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let cases: Vec<Value> = serde_json::from_str(&text).expect("JSON");
    assert_eq!(cases.len(), 20);
    cases
        .iter()
        .map(|case| {
            let prompt = case["prompt"].as_str().expect("a prompt");
            let mut request = GenerateRequest::new(Prompt::Chat {
                messages: vec![ChatMessage::new("user", prompt)],
                tools: None,
            });
            request.max_tokens = 300;
            request.constraint = Some(Constraint::JsonSchema(case["schema"].clone()));
            request
        })
        .collect()
}

/// Every request, eight in the batch at a time, to its end.
fn run(
    executor: Executor<'_>,
    model: &tessera_engine::serve::LoadedModel,
) -> BTreeMap<SeqId, GenerationOutput> {
    let requests = requests();
    let config = BatchConfig {
        max_sequences: 8,
        step_tokens: 64,
        kv_blocks: 512,
    };
    let mut batch = Batch::new(model, executor, config);
    for (i, request) in requests.iter().enumerate() {
        batch.submit(i as SeqId, request.clone()).expect("submits");
    }
    let mut outputs = BTreeMap::new();
    let mut steps = 0;
    while outputs.len() < requests.len() {
        batch
            .step(&mut |id, event| {
                match event {
                    SeqEvent::Finished(output) => {
                        outputs.insert(id, output);
                    }
                    SeqEvent::Failed(message) => panic!("sequence {id}: {message}"),
                    SeqEvent::Generation(_) => {}
                }
                ControlFlow::Continue(())
            })
            .expect("a step");
        steps += 1;
        assert!(steps < 20_000, "the batch does not finish");
    }
    outputs
}

#[test]
fn twenty_schemas_eight_at_once_on_one_machine_and_tensor_world_2() {
    let path = tessera_testkit::default_model_path();
    let model = tessera_engine::serve::LoadedModel::load(&path, |_, _| {}).expect("loads");
    let alone = run(Executor::single(&model.transformer, 2), &model);
    for (id, output) in &alone {
        assert_eq!(
            output.finish_reason,
            FinishReason::Stop,
            "schema {id}: {}",
            output.text
        );
        let parsed = serde_json::from_str::<Value>(&output.text);
        assert!(parsed.is_ok(), "schema {id}: {}", output.text);
    }
    let split = on_ranks(&path, Sharding::Tensor, 2, |model, executor| {
        run(executor, model)
    });
    for (id, output) in &alone {
        assert_eq!(
            split[id].tokens, output.tokens,
            "schema {id} on tensor world 2"
        );
    }
}
