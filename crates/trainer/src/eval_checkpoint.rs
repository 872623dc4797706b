//! `floe eval`: a saved checkpoint of a floe run evaluated with the run's own config.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use floe_engine::{saved_weights_source, AnyLocalEngine, SamplerStats};
use floe_model::chat_template::ChatTemplate;
use floe_model::tokenizer::Tokenizer;

use crate::checkpoint::{
    latest_checkpoint, load_trainer_state, CHECKPOINTS_DIR, ENGINE_DIR, TRAINER_STATE_FILE,
};
use crate::config::{Config, EFFECTIVE_CONFIG_FILE};
use crate::data::{load_split, prepare_prompts, Split};
use crate::error::{Error, Result};
use crate::eval::{evaluate, write_records, EvalSpec, EVALS_DIR};
use crate::rollout::engine_sampling_params;
use crate::run::rollouts_for;
use crate::setup::{base_source, engine_options, TOKENIZER_DIR};

/// What `floe eval` evaluates and where it writes.
#[derive(Clone, Debug)]
pub struct EvalRequest {
    /// A checkpoint folder (`.../checkpoints/global_step_N`) or a run directory (its
    /// latest checkpoint).
    pub target: PathBuf,
    /// A dataset file to evaluate on instead of the run's validation data.
    pub data: Option<PathBuf>,
    /// Samples per prompt instead of the run's `generator.eval_n_samples_per_prompt`.
    pub n: Option<usize>,
    /// Sampling temperature instead of the run's `generator.eval_sampling_params` (0 is
    /// greedy).
    pub temperature: Option<f64>,
    /// Where to write the generations (JSONL) instead of `<run_dir>/evals/`.
    pub out: Option<PathBuf>,
}

/// What `floe eval` measured.
#[derive(Clone, Debug)]
pub struct EvalReport {
    /// The checkpoint evaluated.
    pub checkpoint: PathBuf,
    /// `eval/...` metrics.
    pub metrics: BTreeMap<String, f64>,
    /// The generations file.
    pub generations: PathBuf,
    /// Prompts evaluated.
    pub num_prompts: usize,
    /// The sampler's work: model calls, time, speculative drafts.
    pub sampling: SamplerStats,
}

/// Evaluates a checkpoint of a floe run with the run's own config (tokenizer, template,
/// environments, eval sampling parameters).
pub fn eval_checkpoint(request: &EvalRequest) -> Result<EvalReport> {
    let target = &request.target;
    let checkpoint = if target.join(TRAINER_STATE_FILE).is_file() {
        target.clone()
    } else {
        latest_checkpoint(target)?.ok_or_else(|| Error::Checkpoint {
            path: target.clone(),
            message: "neither a checkpoint folder nor a run directory with checkpoints".into(),
        })?
    };
    let run_dir = checkpoint
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| Error::Checkpoint {
            path: checkpoint.clone(),
            message: format!("not inside <run_dir>/{CHECKPOINTS_DIR}/"),
        })?
        .to_path_buf();
    let config = Config::load(Some(&run_dir.join(EFFECTIVE_CONFIG_FILE)), &[])?;
    let state = load_trainer_state(&checkpoint)?;
    let tokenizer = if config.model.uses_embedded_tokenizer() {
        Tokenizer::from_dir(run_dir.join(TOKENIZER_DIR))?
    } else {
        Tokenizer::from_dir(&config.model.path)?
    };
    let template = ChatTemplate::from_tokenizer(&tokenizer)?.unwrap_or_else(ChatTemplate::qwen3);
    let rows = match &request.data {
        Some(path) => floe_env::dataset::load_rows(path)?,
        None => load_split(&config, &run_dir, Split::Val)?,
    };
    let enable_thinking = config.model.chat_template.enable_thinking;
    let (prompts, _) = prepare_prompts(
        rows,
        &tokenizer,
        &template,
        enable_thinking,
        config.trainer.max_prompt_length,
    )?;
    if prompts.is_empty() {
        return Err(Error::Data(
            "no eval prompts (none given, or all longer than trainer.max_prompt_length)".into(),
        ));
    }
    let mut engine = AnyLocalEngine::open(
        saved_weights_source(
            &checkpoint.join(ENGINE_DIR),
            base_source(&config, &tokenizer)?,
        ),
        Some(tokenizer.clone()),
        engine_options(&config),
    )?;
    let g = &config.generator;
    let tokenizer = Arc::new(tokenizer);
    let mut rollouts = rollouts_for(&config, template, &tokenizer)?;
    let mut sampling = g.eval_sampling_params.clone();
    if let Some(temperature) = request.temperature {
        sampling.temperature = temperature;
    }
    let spec = EvalSpec {
        params: engine_sampling_params(&sampling, &tokenizer),
        k: request.n.unwrap_or(g.eval_n_samples_per_prompt).max(1),
        batch_size: config.trainer.eval_batch_size,
        seed: config.trainer.seed,
    };
    let out = evaluate(
        &mut engine,
        &mut rollouts,
        &prompts,
        &spec,
        state.global_step,
    )?;
    let generations = request.out.clone().unwrap_or_else(|| {
        run_dir
            .join(EVALS_DIR)
            .join(format!("eval_global_step_{}.jsonl", state.global_step))
    });
    write_records(&generations, &out.records)?;
    Ok(EvalReport {
        checkpoint,
        metrics: out.metrics,
        generations,
        num_prompts: prompts.len(),
        sampling: engine.sampler_stats().clone(),
    })
}
