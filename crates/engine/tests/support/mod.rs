//! What the engine's CPU tests share.

use floe_model::{Architecture, ModelConfig};

/// The model of the engine's CPU tests: floe-model's test shape twice as wide (hidden 32,
/// MLP 48), over 64 token ids and 128 positions.
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        max_position_embeddings: 128,
        ..ModelConfig::test_shape(Architecture::Qwen3)
    }
}
