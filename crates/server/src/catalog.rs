//! The base models a server offers: each `--model NAME=PATH` maps the `base_model` string
//! clients send (e.g. `Qwen/Qwen3-0.6B`) to a Hugging Face folder, or to an embedded model
//! (`embedded:tiny`, `embedded:1.7B`, ...): random weights of a Qwen3 shape over a small
//! tokenizer, for tests, demos and benchmarks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use floe_engine::ModelSource;
use floe_model::embedded::{embedded_model, is_embedded, EMBEDDED_VOCAB_SIZE};
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
    /// An embedded model (`embedded:<shape>`): random weights from seed 0.
    Embedded(String),
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
        if is_embedded(path) {
            BaseWeights::Embedded(path.to_string())
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
            BaseWeights::Embedded(path) => {
                let tokenizer = train_bpe(
                    EMBEDDED_TOKENIZER_TEXT,
                    EMBEDDED_VOCAB_SIZE,
                    &QWEN3_SPECIAL_TOKENS,
                )
                .map_err(|e| format!("embedded tokenizer: {e}"))?;
                let config = embedded_model(path, &tokenizer)
                    .map_err(|e| e.to_string())?
                    .expect("parsed as embedded");
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
            BaseWeights::Embedded(path) => path.clone(),
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

    /// Reads every model's shape and tokenizer, so a bad `--model` fails when the server
    /// starts (naming it), not when a client first asks for it.
    pub fn check(&self) -> Result<(), String> {
        for (name, weights) in &self.models {
            weights
                .load()
                .map_err(|e| format!("--model {name}={}: {e}", weights.describe()))?;
        }
        Ok(())
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
                BaseWeights::Embedded(_) => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_is_checked_at_start_and_a_bad_one_is_named() {
        let good =
            Catalog::from_specs(&["Qwen/Qwen3-1.7B=embedded:1.7B", "tiny=embedded:tiny"]).unwrap();
        good.check().unwrap();
        let shape = good.get("Qwen/Qwen3-1.7B").unwrap().load().unwrap().config;
        assert_eq!((shape.hidden_size, shape.num_hidden_layers), (2048, 28));

        let missing = Catalog::from_specs(&["tiny=embedded:tiny", "q=/no/such/model"]).unwrap();
        let err = missing.check().unwrap_err();
        assert!(err.contains("--model q=/no/such/model"), "{err}");
        assert!(err.contains("config.json"), "{err}");

        let unknown = Catalog::from_specs(&["big=embedded:huge"]).unwrap();
        let err = unknown.check().unwrap_err();
        assert!(
            err.contains("--model big=embedded:huge") && err.contains("32B"),
            "{err}"
        );
    }
}
