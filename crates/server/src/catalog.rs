//! The base models a server offers: each `--model NAME=PATH` maps the `base_model` string
//! clients send (e.g. `Qwen/Qwen3-0.6B`) to a Hugging Face folder, or to `embedded:tiny`,
//! a small random Qwen3-shape model for tests and demos.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use floe_engine::ModelSource;
use floe_model::embedded::{embedded_model_config, EMBEDDED_TINY, EMBEDDED_VOCAB_SIZE};
use floe_model::tokenizer::{train_bpe, Tokenizer, QWEN3_SPECIAL_TOKENS};
use floe_model::ModelConfig;

/// Text the embedded model's tokenizer is trained on (any fixed text: its ids only have
/// to be stable across server restarts).
const EMBEDDED_TOKENIZER_TEXT: &[&str] = &[
    "User: What is 2 + 3?\n\nAssistant: 5",
    "User: Name a colour.\n\nAssistant: blue",
    "SELECT name FROM users WHERE id = 1;",
];

/// Where a base model's weights come from.
#[derive(Clone, Debug, PartialEq)]
pub enum BaseWeights {
    /// A Hugging Face folder.
    Dir(PathBuf),
    /// The embedded tiny model with random weights from this seed.
    EmbeddedTiny,
}

/// A base model, loaded into the pieces an engine is built from.
pub struct LoadedBase {
    /// The weights.
    pub source: ModelSource,
    /// Its tokenizer, when it has one (stop strings need it).
    pub tokenizer: Option<Tokenizer>,
    /// Its shape.
    pub config: ModelConfig,
}

impl BaseWeights {
    /// Parses the `PATH` of `--model NAME=PATH`.
    pub fn parse(path: &str) -> Self {
        if path == EMBEDDED_TINY {
            BaseWeights::EmbeddedTiny
        } else {
            BaseWeights::Dir(PathBuf::from(path))
        }
    }

    /// Reads the shape and tokenizer; the weights load when the engine is built.
    pub fn load(&self) -> Result<LoadedBase, String> {
        match self {
            BaseWeights::Dir(dir) => {
                let config = ModelConfig::from_hf_file(dir.join("config.json"))
                    .map_err(|e| format!("{}: {e}", dir.display()))?;
                let tokenizer = load_tokenizer(dir)?;
                Ok(LoadedBase {
                    source: ModelSource::Dir(dir.clone()),
                    tokenizer,
                    config,
                })
            }
            BaseWeights::EmbeddedTiny => {
                let tokenizer = train_bpe(
                    EMBEDDED_TOKENIZER_TEXT,
                    EMBEDDED_VOCAB_SIZE,
                    &QWEN3_SPECIAL_TOKENS,
                )
                .map_err(|e| format!("embedded tokenizer: {e}"))?;
                let config = embedded_model_config(&tokenizer);
                Ok(LoadedBase {
                    source: ModelSource::Random {
                        config: config.clone(),
                        seed: 0,
                    },
                    tokenizer: Some(tokenizer),
                    config,
                })
            }
        }
    }

    /// The path as given on the command line.
    pub fn describe(&self) -> String {
        match self {
            BaseWeights::Dir(dir) => dir.display().to_string(),
            BaseWeights::EmbeddedTiny => EMBEDDED_TINY.to_string(),
        }
    }
}

/// The tokenizer of a Hugging Face folder, when it has a `tokenizer.json`.
pub fn load_tokenizer(dir: &Path) -> Result<Option<Tokenizer>, String> {
    if !dir.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    Tokenizer::from_dir(dir)
        .map(Some)
        .map_err(|e| format!("{}: {e}", dir.display()))
}

/// Base models by the name clients use.
#[derive(Clone, Debug, Default)]
pub struct Catalog {
    models: BTreeMap<String, BaseWeights>,
}

impl Catalog {
    /// Parses `NAME=PATH` entries; a name given twice is an error.
    pub fn from_specs<S: AsRef<str>>(specs: &[S]) -> Result<Self, String> {
        let mut models = BTreeMap::new();
        for spec in specs {
            let spec = spec.as_ref();
            let (name, path) = spec
                .split_once('=')
                .filter(|(name, path)| !name.is_empty() && !path.is_empty())
                .ok_or_else(|| {
                    format!("--model {spec:?}: expected NAME=PATH (e.g. Qwen/Qwen3-0.6B=/models/qwen3-0.6b or tiny=embedded:tiny)")
                })?;
            if models
                .insert(name.to_string(), BaseWeights::parse(path))
                .is_some()
            {
                return Err(format!("--model {name:?} is given twice"));
            }
        }
        Ok(Self { models })
    }

    /// The model named `name`.
    pub fn get(&self, name: &str) -> Result<&BaseWeights, String> {
        self.models.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.models.keys().map(String::as_str).collect();
            format!(
                "unknown base_model {name:?}; this server offers: {}",
                known.join(", ")
            )
        })
    }

    /// Every name and its weights.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &BaseWeights)> {
        self.models.iter()
    }

    /// Whether no model is offered.
    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }

    /// Where each model's tokenizer can be loaded from as a Hugging Face folder (clients
    /// tokenize; the server never does): a model folder is its own, an embedded model's
    /// tokenizer is written to `{dir}/{NAME}/` first. Models without a tokenizer are
    /// left out.
    pub fn tokenizer_dirs(&self, dir: &Path) -> Result<Vec<(String, PathBuf)>, String> {
        let mut dirs = Vec::new();
        for (name, weights) in &self.models {
            match weights {
                BaseWeights::Dir(model_dir) => {
                    if model_dir.join("tokenizer.json").is_file() {
                        dirs.push((name.clone(), model_dir.clone()));
                    }
                }
                BaseWeights::EmbeddedTiny => {
                    let out = dir.join(name);
                    let loaded = weights.load()?;
                    let tokenizer = loaded
                        .tokenizer
                        .expect("the embedded model has a tokenizer");
                    tokenizer
                        .save_dir(&out)
                        .map_err(|e| format!("writing the tokenizer of {name:?}: {e}"))?;
                    dirs.push((name.clone(), out));
                }
            }
        }
        Ok(dirs)
    }
}
