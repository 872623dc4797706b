//! The engine of a run with `engine.remote = url`: a [`RemoteEngine`] on `floe serve`
//! holding the model a local run would build.
//!
//! For an embedded `model.path` (`embedded:tiny`, `embedded:0.6B`, ...) the trainer trains
//! its tokenizer as usual and sends it with `trainer.seed`, and the server builds the
//! embedded model from exactly those; any other `model.path` names a base model the server
//! offers (`floe serve --model NAME=PATH`), whose tokenizer files the server sends back into
//! `<run_dir>/tokenizer/`. The run's micro-batch budget and seeds go with the request, so a
//! remote run packs, rounds and samples as a local run does.

use std::collections::BTreeMap;
use std::path::Path;

use floe_engine::native_api::{EngineSettings, ModelSpec};
use floe_engine::remote::{RemoteEngine, API_KEY_ENV};
use floe_engine::Engine;
use floe_env::dataset::Row;
use floe_model::chat_template::ChatTemplate;
use floe_model::embedded::is_embedded;
use floe_model::tokenizer::Tokenizer;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::setup::{engine_options, model_setup, TOKENIZER_DIR};

/// The model and engine of a run with `engine.remote = url`: the tokenizer and chat
/// template the loop encodes with and an engine on the server holding the same model
/// (see the module docs). The API key comes from [`API_KEY_ENV`].
pub fn connect_for_run(
    config: &Config,
    url: &str,
    run_dir: &Path,
    train_rows: &[Row],
    fresh: bool,
) -> Result<(Tokenizer, ChatTemplate, RemoteEngine)> {
    if config.model.lora.rank > 0 {
        return Err(Error::Data(
            "model.lora.rank > 0 with engine.remote: the native API creates full-parameter \
             engines only (LoRA over HTTP is the Tinker API's); train LoRA locally"
                .into(),
        ));
    }
    if config.model.random_weights && !is_embedded(&config.model.path) {
        return Err(Error::Data(
            "model.random_weights with engine.remote: the server names its base models \
             (`floe serve --model NAME=embedded:<shape>` serves random weights of a shape)"
                .into(),
        ));
    }
    let api_key = std::env::var(API_KEY_ENV)
        .ok()
        .filter(|key| !key.is_empty());
    let options = engine_options(config);
    let settings = EngineSettings {
        max_tokens_per_microbatch: Some(options.max_tokens_per_microbatch),
        recompute: Some(options.recompute),
        kv_cache_tokens_wanted: Some(options.kv_cache_tokens_wanted),
        seed: Some(options.seed),
    };
    let tokenizer_dir = run_dir.join(TOKENIZER_DIR);
    if is_embedded(&config.model.path) {
        let setup = model_setup(config, run_dir, train_rows, fresh)?;
        let model = ModelSpec::Embedded {
            path: config.model.path.clone(),
            tokenizer_files: read_tokenizer_files(&tokenizer_dir)?,
            // The seed `model_setup` gives the embedded weights.
            seed: config.trainer.seed,
        };
        let (engine, _) = RemoteEngine::connect(url, api_key, model, settings)
            .map_err(Error::verb("create engine"))?;
        return Ok((setup.tokenizer, setup.template, engine));
    }
    let model = ModelSpec::BaseModel(config.model.path.clone());
    let (engine, files) = RemoteEngine::connect(url, api_key, model, settings)
        .map_err(Error::verb("create engine"))?;
    if files.is_empty() {
        return Err(Error::Data(format!(
            "the server's model {:?} has no tokenizer; floe train needs one",
            config.model.path
        )));
    }
    config.validate_context_length(engine.info().max_seq_len)?;
    // The server's files replace any earlier copy, so ids always match its model.
    if tokenizer_dir.exists() {
        std::fs::remove_dir_all(&tokenizer_dir).map_err(|source| Error::Io {
            path: tokenizer_dir.clone(),
            source,
        })?;
    }
    std::fs::create_dir_all(&tokenizer_dir).map_err(|source| Error::Io {
        path: tokenizer_dir.clone(),
        source,
    })?;
    for (name, text) in &files {
        let plain = !name.starts_with('.') && !name.contains(['/', '\\']);
        if !plain {
            return Err(Error::Data(format!(
                "the server sent tokenizer file {name:?}, which is not a plain file name"
            )));
        }
        let path = tokenizer_dir.join(name);
        std::fs::write(&path, text).map_err(|source| Error::Io { path, source })?;
    }
    let tokenizer = Tokenizer::from_dir(&tokenizer_dir)?;
    let template = ChatTemplate::from_tokenizer(&tokenizer)?.unwrap_or_else(ChatTemplate::qwen3);
    Ok((tokenizer, template, engine))
}

/// The tokenizer files `Tokenizer::save_dir` wrote into `dir`.
fn read_tokenizer_files(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut files = BTreeMap::new();
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        files.insert(name.to_string(), text);
    }
    Ok(files)
}
