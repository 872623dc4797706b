//! Tokenizers: Hugging Face `tokenizer.json` files through the `tokenizers` crate, and a
//! byte-level BPE trained on a corpus for floe's embedded tiny model.
//!
//! A [`Tokenizer`] also knows its end-of-sequence and padding tokens, read from the
//! `tokenizer_config.json` and `generation_config.json` beside `tokenizer.json` (as
//! transformers does), and its chat template, if any. [`Tokenizer::save_dir`] writes a
//! folder transformers' `AutoTokenizer.from_pretrained` loads.

use std::path::{Path, PathBuf};

use serde_json::json;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, ModelWrapper};

use crate::chat_template::QWEN3_CHAT_TEMPLATE;

/// The special tokens of Qwen3's chat format, in Qwen's id order.
pub const QWEN3_SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The thinking tags. Like Qwen3, [`train_bpe`] adds them as ordinary (non-special)
/// added tokens: one id each, kept by `decode(.., skip_special_tokens = true)`.
pub const THINK_TOKENS: [&str; 2] = ["<think>", "</think>"];

/// Why a tokenizer could not be loaded, used or saved.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `tokenizer.json` (or a config beside it) is malformed.
    #[error("{path}: {msg}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        msg: String,
    },
    /// Encoding, decoding, training or serializing failed inside `tokenizers`.
    #[error("tokenizer: {0}")]
    Tokenizers(String),
    /// A special token named in a config is not in the vocabulary.
    #[error("{origin}: {key} `{token}` is not in the vocabulary")]
    UnknownToken {
        /// The file (or `train_bpe`).
        origin: String,
        /// `eos_token`, `pad_token`, …
        key: &'static str,
        /// The token's text.
        token: String,
    },
}

/// Result of tokenizer operations.
pub type Result<T> = std::result::Result<T, TokenizerError>;

fn tk_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Tokenizers(e.to_string())
}

/// A Hugging Face tokenizer with its end-of-sequence and padding tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Text of the end-of-sequence token (`eos_token` of `tokenizer_config.json`).
    pub eos_token: Option<String>,
    /// Text of the padding token.
    pub pad_token: Option<String>,
    /// Every id that ends a sequence: `eos_token`'s, then those of
    /// `generation_config.json`'s `eos_token_id` (Qwen3 lists both `<|im_end|>` and
    /// `<|endoftext|>` there).
    pub eos_token_ids: Vec<u32>,
    /// Id of the padding token.
    pub pad_token_id: Option<u32>,
    /// The Jinja chat template from `tokenizer_config.json` or `chat_template.jinja`.
    pub chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token", &self.pad_token)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` at `path`, plus `tokenizer_config.json`,
    /// `generation_config.json` and `chat_template.jinja` beside it when present.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let load_err = |msg: String| TokenizerError::Load {
            path: path.to_path_buf(),
            msg,
        };
        // `tokenizers` panics (`expect("Helper")`) on a JSON syntax error inside the
        // `decoder` object, so the syntax is checked first.
        serde_json::from_str::<serde::de::IgnoredAny>(&text)
            .map_err(|e| load_err(format!("not valid JSON: {e}")))?;
        let inner: tokenizers::Tokenizer = text.parse().map_err(|e| load_err(format!("{e}")))?;
        let mut this = Self::wrap(inner);

        let config_path = path.with_file_name("tokenizer_config.json");
        if let Some(config) = read_json_if_present(&config_path)? {
            let token = |key: &str| match config.get(key) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Object(o)) => o
                    .get("content")
                    .and_then(|c| c.as_str())
                    .map(str::to_string),
                _ => None,
            };
            this.eos_token = token("eos_token");
            this.pad_token = token("pad_token");
            this.chat_template = match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                _ => None,
            };
            let origin = config_path.display().to_string();
            if let Some(eos) = &this.eos_token {
                this.eos_token_ids
                    .push(this.require_id(eos, "eos_token", &origin)?);
            }
            if let Some(pad) = &this.pad_token {
                this.pad_token_id = Some(this.require_id(pad, "pad_token", &origin)?);
            }
        }
        if this.chat_template.is_none() {
            let jinja = path.with_file_name("chat_template.jinja");
            if jinja.is_file() {
                this.chat_template =
                    Some(
                        std::fs::read_to_string(&jinja).map_err(|source| TokenizerError::Io {
                            path: jinja,
                            source,
                        })?,
                    );
            }
        }
        let generation_path = path.with_file_name("generation_config.json");
        if let Some(generation) = read_json_if_present(&generation_path)? {
            let ids = |key: &str| -> Vec<u32> {
                match generation.get(key) {
                    Some(serde_json::Value::Array(list)) => list
                        .iter()
                        .filter_map(|v| v.as_u64())
                        .map(|v| v as u32)
                        .collect(),
                    Some(v) => v.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
                    None => Vec::new(),
                }
            };
            for id in ids("eos_token_id") {
                if !this.eos_token_ids.contains(&id) {
                    this.eos_token_ids.push(id);
                }
            }
            if this.pad_token_id.is_none() {
                this.pad_token_id = ids("pad_token_id").first().copied();
            }
        }
        Ok(this)
    }

    /// Loads `dir/tokenizer.json` and the configs beside it (see [`Tokenizer::from_file`]).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("tokenizer.json"))
    }

    fn wrap(inner: tokenizers::Tokenizer) -> Self {
        Self {
            inner,
            eos_token: None,
            pad_token: None,
            eos_token_ids: Vec::new(),
            pad_token_id: None,
            chat_template: None,
        }
    }

    fn require_id(&self, token: &str, key: &'static str, origin: &str) -> Result<u32> {
        self.token_to_id(token)
            .ok_or_else(|| TokenizerError::UnknownToken {
                origin: origin.to_string(),
                key,
                token: token.to_string(),
            })
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (BOS etc.).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, add_special_tokens)
            .map_err(tk_err)?
            .get_ids()
            .to_vec())
    }

    /// The text of `ids`; `skip_special_tokens` drops special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tk_err)
    }

    /// The id of a token's text (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of a token id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of ids, added tokens included (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The `tokenizer.json` text (pretty-printed, deterministic for a given tokenizer).
    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(tk_err)
    }

    /// Writes `tokenizer.json` and a `tokenizer_config.json` (added tokens, `eos_token`,
    /// `pad_token`, the chat template) that transformers' `AutoTokenizer` loads as a
    /// `PreTrainedTokenizerFast`. Files are written to temporary names, then renamed.
    pub fn save_dir(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| TokenizerError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut added: Vec<(u32, AddedToken)> =
            self.inner.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        let added_tokens_decoder: serde_json::Map<String, serde_json::Value> = added
            .into_iter()
            .map(|(id, t)| {
                (
                    id.to_string(),
                    json!({
                        "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special,
                    }),
                )
            })
            .collect();
        let config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": false,
            "add_prefix_space": false,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": null,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": null,
            "chat_template": self.chat_template,
            "clean_up_tokenization_spaces": false,
            "errors": "replace",
            "model_max_length": 131072,
            "split_special_tokens": false,
        });
        write_atomically(&dir.join("tokenizer.json"), &(self.to_json()? + "\n"))?;
        let config_text = serde_json::to_string_pretty(&config).expect("JSON values serialize");
        write_atomically(&dir.join("tokenizer_config.json"), &(config_text + "\n"))
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            msg: format!("not valid JSON: {e}"),
        })
}

fn write_atomically(path: &Path, text: &str) -> Result<()> {
    crate::weights::write_atomically(path, text).map_err(|e| match e {
        crate::weights::WeightsError::Io { path, source } => TokenizerError::Io { path, source },
        other => TokenizerError::Tokenizers(other.to_string()),
    })
}

/// Trains a byte-level BPE tokenizer (GPT-2 pre-tokenization, byte-level decoding, every
/// byte in the base alphabet so any text encodes) of `vocab_size` ids on `texts`.
///
/// `special_tokens` take the first ids, in order; [`THINK_TOKENS`] follow the trained
/// vocabulary as non-special added tokens. When `<|im_end|>` and `<|endoftext|>` are
/// among the special tokens they become the end-of-sequence and padding tokens, and the
/// chat template is Qwen3's, so the result behaves like Qwen3's tokenizer. The same
/// corpus and arguments always give the same `tokenizer.json`.
pub fn train_bpe<S: AsRef<str> + Sync>(
    texts: &[S],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<Tokenizer> {
    let base = special_tokens.len() + ByteLevel::alphabet().len();
    if vocab_size < base {
        return Err(TokenizerError::Tokenizers(format!(
            "train_bpe: vocab_size {vocab_size} is below the {base} ids that the special \
             tokens and the 256 byte symbols need"
        )));
    }
    let mut inner = tokenizers::Tokenizer::new(ModelWrapper::BPE(BPE::default()));
    // One ByteLevel serves as pre-tokenizer, decoder and post-processor, as in GPT-2 and
    // Qwen: no prefix space, offsets untrimmed.
    let byte_level = ByteLevel::new(false, false, true);
    inner
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .with_post_processor(Some(byte_level));
    let specials: Vec<AddedToken> = special_tokens
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer = TrainerWrapper::BpeTrainer(
        BpeTrainer::builder()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(specials)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build(),
    );
    inner
        .train(&mut trainer, texts.iter().map(|t| t.as_ref()))
        .map_err(tk_err)?;
    inner
        .add_tokens(THINK_TOKENS.map(|t| AddedToken::from(t, false)))
        .map_err(tk_err)?;

    let mut tokenizer = Tokenizer::wrap(inner);
    let origin = "train_bpe".to_string();
    if special_tokens.contains(&"<|im_end|>") {
        tokenizer.eos_token = Some("<|im_end|>".into());
        tokenizer.eos_token_ids = vec![tokenizer.require_id("<|im_end|>", "eos_token", &origin)?];
        tokenizer.chat_template = Some(QWEN3_CHAT_TEMPLATE.to_string());
    }
    if special_tokens.contains(&"<|endoftext|>") {
        tokenizer.pad_token = Some("<|endoftext|>".into());
        tokenizer.pad_token_id =
            Some(tokenizer.require_id("<|endoftext|>", "pad_token", &origin)?);
    }
    Ok(tokenizer)
}
