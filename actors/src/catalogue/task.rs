//! What a card's model is asked to do, read from its `tasks`: the bottom
//! of the catalogue, which placement uses too.

use tessera_protos::v1::{ModelCard, ModelTask};

/// Whether a card's model makes embeddings and no text (a
/// sentence-transformers encoder): one rank, no generation.
pub fn is_embedding(card: &ModelCard) -> bool {
    let has = |task: ModelTask| card.tasks.contains(&(task as i32));
    has(ModelTask::Embedding) && !has(ModelTask::TextGeneration)
}

/// Whether a card's model makes embeddings (perhaps text too).
pub fn embeds(card: &ModelCard) -> bool {
    card.tasks.contains(&(ModelTask::Embedding as i32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_embeds_by_its_tasks() {
        let mut card = ModelCard {
            tasks: vec![ModelTask::Embedding as i32],
            ..Default::default()
        };
        assert!(is_embedding(&card) && embeds(&card));
        card.tasks.push(ModelTask::TextGeneration as i32);
        assert!(!is_embedding(&card) && embeds(&card));
        card.tasks = vec![ModelTask::TextGeneration as i32];
        assert!(!is_embedding(&card) && !embeds(&card));
    }
}
