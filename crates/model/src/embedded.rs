//! The embedded models (`model.path = "embedded:tiny"`, ...): a byte-level BPE tokenizer
//! trained on a run's own task text and a small randomly initialised Qwen3-shape model over
//! its ids, so `floe train` needs no download.

use crate::config::ModelConfig;
use crate::tokenizer::{train_bpe, Tokenizer, TokenizerError, QWEN3_SPECIAL_TOKENS};

/// `model.path` of the embedded tiny model.
pub const EMBEDDED_TINY: &str = "embedded:tiny";

/// Prefix of every embedded `model.path`: `embedded:<name>` is the shape
/// [`ModelConfig::preset`]`(name)` over the embedded tokenizer, randomly initialised:
/// `embedded:tiny` (hidden 128, the default), `embedded:small` (4 layers of 256, twice as
/// wide), or a real Qwen3 size (`embedded:0.6B`, `embedded:1.7B`, ...), the whole pipeline
/// at that size with no download.
pub const EMBEDDED_PREFIX: &str = "embedded:";

/// Whether `path` names an embedded model (its tokenizer lives in the run directory).
pub fn is_embedded(path: &str) -> bool {
    path.starts_with(EMBEDDED_PREFIX)
}

/// The model config an embedded `path` names over `tokenizer`'s ids; `Ok(None)` when
/// `path` is not embedded.
pub fn embedded_model(
    path: &str,
    tokenizer: &Tokenizer,
) -> Result<Option<ModelConfig>, UnknownEmbeddedModel> {
    let Some(name) = path.strip_prefix(EMBEDDED_PREFIX) else {
        return Ok(None);
    };
    let config = ModelConfig::preset(name).map_err(|_| UnknownEmbeddedModel(path.to_string()))?;
    Ok(Some(over_embedded_tokenizer(config, tokenizer)))
}

/// Ids of the embedded tokenizer: the Qwen3 special tokens, 256 bytes, then merges learnt
/// from the task (its prompts repeat one schema, so a small vocabulary already compresses
/// them several-fold).
pub const EMBEDDED_VOCAB_SIZE: usize = 1024;

/// Context of floe's own embedded shapes (`tiny`, `small`): what their tasks need. The
/// real Qwen3 sizes (`embedded:1.7B`, ...) keep Qwen3's, so a recipe's long prompts run on
/// them as on the real model.
pub const EMBEDDED_CONTEXT: usize = 2048;

/// A `model.path` with the embedded prefix whose name no preset has.
#[derive(Debug, thiserror::Error)]
#[error(
    "model.path = {0:?} names no embedded model; use \"embedded:<name>\" with a name of \
     tiny, small, 0.6B, 1.7B, 4B, 8B, 14B or 32B"
)]
pub struct UnknownEmbeddedModel(pub String);

/// A tokenizer for an embedded model, trained on `texts`: the Qwen3 special tokens, 256
/// bytes, then [`EMBEDDED_VOCAB_SIZE`] ids' worth of merges learnt from the texts.
pub fn train_embedded_tokenizer(texts: &[String]) -> Result<Tokenizer, TokenizerError> {
    train_bpe(texts, EMBEDDED_VOCAB_SIZE, &QWEN3_SPECIAL_TOKENS)
}

/// `config` with the vocabulary and special ids of `tokenizer` (an embedded one): the
/// shape of a random model over a task's own tokenizer.
pub fn over_embedded_tokenizer(mut config: ModelConfig, tokenizer: &Tokenizer) -> ModelConfig {
    config.vocab_size = tokenizer.vocab_size();
    config.bos_token_id = None;
    config.eos_token_ids = tokenizer.eos_token_ids.clone();
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_shapes_sit_over_the_tokenizer() {
        let texts = vec!["SELECT name FROM authors WHERE country = 'Chile'".to_string(); 4];
        let tokenizer = train_bpe(&texts, 300, &QWEN3_SPECIAL_TOKENS).unwrap();
        let tiny = embedded_model(EMBEDDED_TINY, &tokenizer).unwrap().unwrap();
        let small = embedded_model("embedded:small", &tokenizer)
            .unwrap()
            .unwrap();
        assert_eq!((tiny.hidden_size, small.hidden_size), (128, 256));
        assert_eq!(small.vocab_size, tokenizer.vocab_size());
        assert_eq!(small.max_position_embeddings, EMBEDDED_CONTEXT);
        // A real Qwen3 size keeps Qwen3's context: recipes with 32K prompts run on it.
        let qwen = embedded_model("embedded:1.7B", &tokenizer)
            .unwrap()
            .unwrap();
        assert_eq!(qwen.max_position_embeddings, 40960);
        assert!(embedded_model("/models/qwen", &tokenizer)
            .unwrap()
            .is_none());
        let err = embedded_model("embedded:huge", &tokenizer)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tiny, small, 0.6B"), "{err}");
        // `embedded:<name>` is preset `<name>` over the tokenizer, for every name.
        for name in ["tiny", "small", "0.6B"] {
            let config = embedded_model(&format!("{EMBEDDED_PREFIX}{name}"), &tokenizer)
                .unwrap()
                .unwrap();
            let preset = ModelConfig::preset(name).unwrap();
            assert_eq!(
                config,
                over_embedded_tokenizer(preset, &tokenizer),
                "{name}"
            );
        }
    }
}
