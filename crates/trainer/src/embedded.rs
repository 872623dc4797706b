//! The embedded model (`model.path = "embedded:tiny"`): a byte-level BPE tokenizer trained
//! on the run's own task text and a tiny randomly initialised Qwen3-shape model, so
//! `floe train` needs no download.

use std::path::Path;

use floe_env::dataset::Row;
use floe_model::config::Architecture;
use floe_model::tokenizer::{train_bpe, Tokenizer, QWEN3_SPECIAL_TOKENS};
use floe_model::ModelConfig;

use crate::error::Result;

/// `model.path` of the embedded tiny model.
pub const EMBEDDED_TINY: &str = "embedded:tiny";

/// Folder of a run directory holding the embedded model's tokenizer.
pub const TOKENIZER_DIR: &str = "tokenizer";

/// Ids of the embedded tokenizer: the Qwen3 special tokens, 256 bytes, then merges learnt
/// from the task (its prompts repeat one schema, so a small vocabulary already compresses
/// them several-fold).
pub const EMBEDDED_VOCAB_SIZE: usize = 1024;

/// Longest sequence the embedded model accepts (its RoPE table).
pub const EMBEDDED_CONTEXT: usize = 2048;

/// The tokenizer of an embedded run: the one saved in `<run_dir>/tokenizer/` when there is
/// one (a resumed run must keep its ids), else one trained on the prompts and reference
/// answers of `rows` and saved there.
pub fn embedded_tokenizer(run_dir: &Path, rows: &[Row]) -> Result<Tokenizer> {
    let dir = run_dir.join(TOKENIZER_DIR);
    if dir.join("tokenizer.json").is_file() {
        return Ok(Tokenizer::from_dir(&dir)?);
    }
    let mut texts: Vec<String> = Vec::with_capacity(rows.len() * 3);
    for row in rows {
        texts.extend(row.prompt.iter().map(|m| m.content.clone()));
        if let Some(answer) = reference_answer(row) {
            texts.push(answer.to_string());
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

/// The tiny Qwen3 shape (hidden 128, 4 layers, 4 query and 2 key/value heads of 32, tied
/// embeddings; about 1M parameters with a 1k vocabulary) over `tokenizer`'s ids.
pub fn embedded_model_config(tokenizer: &Tokenizer) -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Qwen3,
        vocab_size: tokenizer.vocab_size(),
        hidden_size: 128,
        intermediate_size: 384,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_scaling: None,
        max_position_embeddings: EMBEDDED_CONTEXT,
        tie_word_embeddings: true,
        attention_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: tokenizer.eos_token_ids.clone(),
    }
}
