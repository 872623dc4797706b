//! What a run builds before its loop: the model (tokenizer, chat template, initial
//! weights) and the engine's options, from the run's config.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use floe_engine::policy::OptimizerPlacement;
use floe_engine::{AdapterSource, LocalEngineOptions, MemoryPlan, ModelSource, PlanInputs};
use floe_env::dataset::Row;
use floe_model::chat_template::ChatTemplate;
use floe_model::embedded::{
    embedded_model, is_embedded, over_embedded_tokenizer, train_embedded_tokenizer,
    UnknownEmbeddedModel, EMBEDDED_PREFIX, EMBEDDED_VOCAB_SIZE,
};
use floe_model::lora::adapter_specs;
use floe_model::tokenizer::Tokenizer;
use floe_model::ModelConfig;

use crate::config::Config;
use crate::data::{reference_answer, row_database};
use crate::error::{Error, Result};

/// Folder of a run directory holding an embedded model's tokenizer.
pub const TOKENIZER_DIR: &str = "tokenizer";

/// The local engine's options a run's config implies. The micro-batch token budget is
/// `trainer.max_tokens_per_microbatch`, or, when that is `-1`,
/// `micro_train_batch_size_per_gpu` sequences of the longest length the run can
/// produce; either way at least one longest sequence, so every rollout fits. The KV cache
/// that `engine.recompute = "auto"` keeps room for holds as many longest sequences as the
/// sampler runs at once for a training or an eval batch.
pub fn engine_options(config: &Config) -> LocalEngineOptions {
    let trainer = &config.trainer;
    let generator = &config.generator;
    let generate = generator
        .sampling_params
        .max_generate_length
        .max(generator.eval_sampling_params.max_generate_length);
    let longest = (trainer.max_prompt_length + generator.max_turns.max(1) * generate).max(
        generator
            .max_input_length
            .map_or(0, |input| input + generate),
    );
    let budget = if trainer.max_tokens_per_microbatch > 0 {
        trainer.max_tokens_per_microbatch as usize
    } else {
        trainer.micro_train_batch_size_per_gpu.max(1) * longest
    };
    let defaults = LocalEngineOptions::default();
    let concurrent_samples = (trainer.train_batch_size * generator.n_samples_per_prompt)
        .max(trainer.eval_batch_size * generator.eval_n_samples_per_prompt)
        .min(defaults.max_running_seqs);
    LocalEngineOptions {
        device: config.engine.device,
        threads: config.engine.threads,
        recompute: config.engine.recompute,
        kv_cache_tokens_wanted: concurrent_samples * longest,
        max_tokens_per_microbatch: budget.max(longest),
        memory_fraction: config.engine.memory_fraction,
        optimizer_placement: if config.engine.offload_optimizer {
            OptimizerPlacement::Host
        } else {
            OptimizerPlacement::Device
        },
        seed: trainer.seed,
        speculative_ngram: config.engine.speculative_ngram,
        exact_logprobs: config.engine.exact_logprobs,
        zero_stage: config.engine.zero_stage,
        ..defaults
    }
}

/// A model ready to load: tokenizer, chat template and where the weights come from.
pub struct ModelSetup {
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template prompts are rendered with.
    pub template: ChatTemplate,
    /// The initial weights.
    pub source: ModelSource,
}

/// The model `config.model.path` names: `embedded:tiny` (tokenizer trained on `train_rows`
/// and saved in the run directory unless `fresh` is false and one is there) or a Hugging
/// Face folder.
pub fn model_setup(
    config: &Config,
    run_dir: &Path,
    train_rows: &[Row],
    fresh: bool,
) -> Result<ModelSetup> {
    let path = &config.model.path;
    if !is_embedded(path) && !Path::new(path).is_dir() {
        return Err(missing_folder(path));
    }
    if !is_embedded(path) && !config.model.random_weights && !has_weights(Path::new(path)) {
        return Err(Error::Model(format!(
            "{path}: no model.safetensors or model.safetensors.index.json; to train this \
             shape from random weights, set model.random_weights = true"
        )));
    }
    let (tokenizer, source) = if config.model.uses_embedded_tokenizer() {
        let tokenizer_dir = run_dir.join(TOKENIZER_DIR);
        if fresh && tokenizer_dir.exists() {
            std::fs::remove_dir_all(&tokenizer_dir).map_err(|source| Error::Io {
                path: tokenizer_dir.clone(),
                source,
            })?;
        }
        let labelled = labelled_rows(config, train_rows.iter())?;
        let tokenizer = embedded_tokenizer(run_dir, train_rows, &labelled)?;
        let source = base_source(config, &tokenizer)?;
        (tokenizer, source)
    } else {
        let tokenizer = Tokenizer::from_dir(path)?;
        let source = base_source(config, &tokenizer)?;
        (tokenizer, source)
    };
    let template = ChatTemplate::from_tokenizer(&tokenizer)?.unwrap_or_else(ChatTemplate::qwen3);
    Ok(ModelSetup {
        tokenizer,
        template,
        source: with_adapters(config, source),
    })
}

/// The weights a run starts from, before any adapters: a Hugging Face folder; for
/// `embedded:<shape>` random weights of that shape over `tokenizer` (the run's); with
/// `model.random_weights`, random weights of the folder's shape (over the embedded
/// `tokenizer` when the folder has none).
pub fn base_source(config: &Config, tokenizer: &Tokenizer) -> Result<ModelSource> {
    let path = &config.model.path;
    let random = match embedded_model(path, tokenizer).map_err(|e| Error::Model(e.to_string()))? {
        Some(model) => Some(model),
        None if config.model.random_weights => {
            let model = folder_config(path)?;
            Some(if config.model.uses_embedded_tokenizer() {
                over_embedded_tokenizer(model, tokenizer)
            } else {
                model
            })
        }
        None => None,
    };
    match random {
        Some(model) => {
            config.validate_context_length(model.max_position_embeddings)?;
            Ok(ModelSource::Random {
                config: model,
                seed: config.trainer.seed,
            })
        }
        None => Ok(ModelSource::Dir(PathBuf::from(path))),
    }
}

/// The `config.json` of the model folder `path`; when the folder is not there, the error
/// says how to run or plan its shape without it.
fn folder_config(path: &str) -> Result<ModelConfig> {
    ModelConfig::from_hf_file(Path::new(path).join("config.json")).map_err(|e| {
        if Path::new(path).is_dir() {
            Error::Model(e.to_string())
        } else {
            missing_folder(path)
        }
    })
}

/// `model.path` names no folder.
fn missing_folder(path: &str) -> Error {
    Error::Model(format!(
        "model.path = {path:?}: no such folder; point it at a Hugging Face model folder, or \
         run a Qwen3 shape on random weights with model.path=embedded:<shape> (tiny, small, \
         0.6B, 1.7B, 4B, 8B, 14B or 32B; over the run's own small tokenizer)"
    ))
}

/// Whether a model folder holds safetensors weights (one file or an index of shards).
fn has_weights(dir: &Path) -> bool {
    dir.join("model.safetensors").is_file() || dir.join("model.safetensors.index.json").is_file()
}

/// `base` with fresh adapters on it when `model.lora.rank` asks for them.
pub fn with_adapters(config: &Config, base: ModelSource) -> ModelSource {
    match config.model.lora.adapters(config.trainer.seed) {
        Some(adapters) => ModelSource::Lora {
            base: Box::new(base),
            adapters: AdapterSource::Fresh(adapters),
        },
        None => base,
    }
}

/// Which of the training rows the warm start learns from (none when `sft.enabled` is
/// off); fails when `sft.max_examples_per_database` names a database no row has.
pub fn labelled_rows<'a>(
    config: &Config,
    rows: impl Iterator<Item = &'a Row> + Clone,
) -> Result<Vec<bool>> {
    if let Some(caps) = &config.sft.max_examples_per_database {
        let databases: BTreeSet<&str> = rows.clone().filter_map(row_database).collect();
        if let Some(missing) = caps.keys().find(|db| !databases.contains(db.as_str())) {
            return Err(Error::Data(format!(
                "sft.max_examples_per_database names `{missing}`, a database no training row \
                 has (extra_info.db_id: {})",
                databases.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
    }
    if !config.sft.enabled {
        return Ok(rows.map(|_| false).collect());
    }
    Ok(config.sft.example_mask(rows))
}

/// The tokenizer of an embedded run: the one saved in `<run_dir>/tokenizer/` when there is
/// one (a resumed run must keep its ids), else one trained on the prompts of `rows` and
/// the reference answers of the rows marked in `labelled` (the warm start's examples) and saved
/// there. The rows' `extra_info.constants` stay out of the merges, so every value splits
/// into the same kind of small pieces and copying one teaches copying the others: with a
/// value a single token, the model must learn to copy each value on its own, and held-out
/// accuracy falls several-fold (`docs/benchmarks.md`).
fn embedded_tokenizer(run_dir: &Path, rows: &[Row], labelled: &[bool]) -> Result<Tokenizer> {
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
    let tokenizer = train_embedded_tokenizer(&texts)?;
    tokenizer.save_dir(&dir)?;
    Ok(tokenizer)
}

/// The memory plan of a run's local engine, from the recipe alone (no device, no
/// weights): the shape of `model.path` (an embedded shape over the embedded vocabulary,
/// or a folder's `config.json`) with a device budget of `engine.memory_fraction` of
/// `device_bytes` (`None`: the CPU), on each of `world_size` data-parallel ranks.
pub fn memory_plan(
    config: &Config,
    device_bytes: Option<usize>,
    world_size: usize,
) -> Result<MemoryPlan> {
    let model = planned_model(config)?;
    let options = engine_options(config);
    let lora = config.model.lora.adapters(config.trainer.seed);
    Ok(MemoryPlan::new(&PlanInputs {
        model: &model,
        base_resident: false,
        lora: lora.as_ref(),
        device: options.device,
        placement: options.optimizer_placement,
        optimizer_shards: if options.zero_stage >= 1 {
            world_size
        } else {
            1
        },
        gradient_shards: options.zero_stage == 2,
        data_parallel_ranks: world_size,
        recompute: options.recompute,
        kv_cache_tokens_wanted: options.kv_cache_tokens_wanted,
        kv_cache_bytes: options.kv_cache_bytes,
        max_tokens_per_microbatch: options.max_tokens_per_microbatch,
        budget_bytes: device_bytes.map(|bytes| (bytes as f64 * options.memory_fraction) as usize),
        reserved_by_others: 0,
    }))
}

/// Room a checkpoint's trainer state, metrics and tokenizer may take beyond the engine's.
const CHECKPOINT_SLACK_BYTES: u64 = 64 << 20;

/// Bytes one checkpoint of a local run takes on disk: the f32 weights (for LoRA, the
/// adapters) and their two AdamW moments, plus slack for the trainer's own files.
pub fn checkpoint_bytes(config: &Config) -> Result<u64> {
    let model = planned_model(config)?;
    let (weights, trained) = match config.model.lora.adapters(config.trainer.seed) {
        Some(lora) => {
            let adapters: usize = adapter_specs(&model, &lora)
                .iter()
                .map(|(_, shape)| shape.iter().product::<usize>())
                .sum();
            (adapters, adapters)
        }
        None => (model.num_parameters(), model.num_parameters()),
    };
    Ok(4 * weights as u64 + 8 * trained as u64 + CHECKPOINT_SLACK_BYTES)
}

/// Refuses to write a checkpoint of `bytes` where the run directory's file system has
/// less free space, naming the numbers and the knobs (a full disk mid-write would end
/// the run with a half-written checkpoint after hours of training).
pub fn check_checkpoint_space(config: &Config, bytes: u64) -> Result<()> {
    let run_dir = &config.trainer.run_dir;
    let Some(free) = free_bytes(run_dir) else {
        return Ok(());
    };
    if free >= bytes {
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    Err(Error::Checkpoint {
        path: run_dir.clone(),
        message: format!(
            "a checkpoint of this run takes {:.2} GB (f32 weights and AdamW moments) but the \
             run directory's disk has {:.2} GB free; free space there, point trainer.run_dir \
             at a larger disk, keep fewer checkpoints (trainer.max_ckpts_to_keep), or train \
             LoRA adapters (model.lora.rank), whose checkpoints hold only the adapters",
            gb(bytes),
            gb(free)
        ),
    })
}

/// Free bytes of the file system holding `dir` for an unprivileged writer; `None` where
/// that cannot be known.
#[cfg(unix)]
fn free_bytes(dir: &Path) -> Option<u64> {
    let stat = rustix::fs::statvfs(dir).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

#[cfg(not(unix))]
fn free_bytes(_dir: &Path) -> Option<u64> {
    None
}

/// The shape a run's model will have: an embedded shape over the embedded vocabulary, or
/// a folder's `config.json`.
fn planned_model(config: &Config) -> Result<ModelConfig> {
    let path = &config.model.path;
    let model = match path.strip_prefix(EMBEDDED_PREFIX) {
        Some(name) => {
            let mut model = ModelConfig::preset(name)
                .map_err(|_| Error::Model(UnknownEmbeddedModel(path.clone()).to_string()))?;
            model.vocab_size = EMBEDDED_VOCAB_SIZE;
            model
        }
        None => {
            let mut model = folder_config(path)?;
            if config.model.uses_embedded_tokenizer() {
                model.vocab_size = EMBEDDED_VOCAB_SIZE;
            }
            model
        }
    };
    Ok(model)
}
