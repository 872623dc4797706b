//! The embedded model (`model.path = "embedded:tiny"`): a byte-level BPE tokenizer trained
//! on the run's own task text and a tiny randomly initialised Qwen3-shape model, so
//! `floe train` needs no download.

use std::path::Path;

use floe_env::dataset::Row;
use floe_model::tokenizer::{train_bpe, Tokenizer, QWEN3_SPECIAL_TOKENS};
use floe_model::ModelConfig;

use crate::error::Result;

/// `model.path` of the embedded tiny model.
pub const EMBEDDED_TINY: &str = "embedded:tiny";

/// Prefix of every embedded `model.path`: `embedded:tiny`, `embedded:small` (4 layers of
/// 256, twice as wide), or `embedded:<shape>` with a Qwen3 shape of [`ModelConfig::preset`]
/// (`0.6B`, `1.7B`, ...) over the embedded tokenizer, randomly initialised: the whole
/// pipeline at a real model's size with no download.
pub const EMBEDDED_PREFIX: &str = "embedded:";

/// Whether `path` names an embedded model (its tokenizer lives in the run directory).
pub fn is_embedded(path: &str) -> bool {
    path.starts_with(EMBEDDED_PREFIX)
}

/// The model config an embedded `path` names over `tokenizer`'s ids; `Ok(None)` when
/// `path` is not embedded.
pub fn embedded_model(path: &str, tokenizer: &Tokenizer) -> Result<Option<ModelConfig>> {
    let Some(shape) = path.strip_prefix(EMBEDDED_PREFIX) else {
        return Ok(None);
    };
    if path == EMBEDDED_TINY {
        return Ok(Some(embedded_model_config(tokenizer)));
    }
    // `small` is the `tiny` preset's shape (4 layers of 256), the name `tiny` being taken.
    let preset = if shape == "small" { "tiny" } else { shape };
    let config = ModelConfig::preset(preset).map_err(|_| {
        crate::error::Error::Data(format!(
            "model.path = {path:?} names no embedded model; use {EMBEDDED_TINY:?} or \
             \"embedded:<shape>\" with a shape of small, 0.6B, 1.7B, 4B or 8B"
        ))
    })?;
    Ok(Some(over_tokenizer(config, tokenizer)))
}

/// Folder of a run directory holding the embedded model's tokenizer.
pub const TOKENIZER_DIR: &str = "tokenizer";

/// Ids of the embedded tokenizer: the Qwen3 special tokens, 256 bytes, then merges learnt
/// from the task (its prompts repeat one schema, so a small vocabulary already compresses
/// them several-fold).
pub const EMBEDDED_VOCAB_SIZE: usize = 1024;

/// Longest sequence the embedded model accepts (its RoPE table).
pub const EMBEDDED_CONTEXT: usize = 2048;

/// The tokenizer of an embedded run: the one saved in `<run_dir>/tokenizer/` when there is
/// one (a resumed run must keep its ids), else one trained on the prompts of `rows` and
/// the reference answers of the rows marked in `labelled` (the warm start's examples) and saved
/// there. The rows' `extra_info.constants` stay out of the merges, so every value splits
/// into the same kind of small pieces and copying one teaches copying the others: with a
/// value a single token, the model must learn to copy each value on its own, and held-out
/// accuracy falls several-fold (`docs/benchmarks.md`).
pub fn embedded_tokenizer(run_dir: &Path, rows: &[Row], labelled: &[bool]) -> Result<Tokenizer> {
    let dir = run_dir.join(TOKENIZER_DIR);
    if dir.join("tokenizer.json").is_file() {
        return Ok(Tokenizer::from_dir(&dir)?);
    }
    let mut texts: Vec<String> = Vec::with_capacity(rows.len() * 3);
    for (index, row) in rows.iter().enumerate() {
        let constants: Vec<&str> = row
            .extra_info()
            .get("constants")
            .and_then(|v| v.as_array())
            .map(|values| values.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        let without_constants = |text: &str| {
            constants
                .iter()
                .fold(text.to_string(), |t, c| t.replace(c, " "))
        };
        texts.extend(row.prompt.iter().map(|m| without_constants(&m.content)));
        if let Some(answer) = reference_answer(row).filter(|_| labelled[index]) {
            texts.push(without_constants(answer));
        }
    }
    let tokenizer = train_bpe(&texts, EMBEDDED_VOCAB_SIZE, &QWEN3_SPECIAL_TOKENS)?;
    tokenizer.save_dir(&dir)?;
    Ok(tokenizer)
}

/// The row's `extra_info.reference_answer`: a completion in the format the reward accepts.
pub fn reference_answer(row: &Row) -> Option<&str> {
    row.extra_info()
        .get("reference_answer")
        .and_then(|v| v.as_str())
}

/// The tiny Qwen3 shape (`ModelConfig::preset("embedded")`: hidden 128, 4 layers, 4 query
/// and 2 key/value heads of 32, tied embeddings; about 1M parameters with a 1k vocabulary)
/// over `tokenizer`'s ids.
pub fn embedded_model_config(tokenizer: &Tokenizer) -> ModelConfig {
    over_tokenizer(
        ModelConfig::preset("embedded").expect("a built-in preset"),
        tokenizer,
    )
}

/// `config` with the vocabulary and special ids of `tokenizer` and the embedded context.
fn over_tokenizer(mut config: ModelConfig, tokenizer: &Tokenizer) -> ModelConfig {
    config.vocab_size = tokenizer.vocab_size();
    config.max_position_embeddings = EMBEDDED_CONTEXT;
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
        assert!(embedded_model("/models/qwen", &tokenizer)
            .unwrap()
            .is_none());
        let err = embedded_model("embedded:huge", &tokenizer)
            .unwrap_err()
            .to_string();
        assert!(err.contains("small, 0.6B"), "{err}");
    }
}
