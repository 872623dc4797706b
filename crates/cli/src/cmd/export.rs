//! `floe export`: a checkpoint's policy weights as a Hugging Face folder that
//! transformers' `from_pretrained` loads, with the run's tokenizer files when it has them.
//!
//! The source may be a run directory (its newest checkpoint under `checkpoints/` is
//! used), a checkpoint folder (`checkpoints/global_step_N`, the engine state under
//! `engine/`), or an engine state folder itself (what `Engine::save_state` wrote:
//! `model/`, `optimizer.*`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use floe_model::weights::{self, SaveDType};
use floe_trainer::checkpoint::{latest_checkpoint, ENGINE_DIR};

/// Files of a Hugging Face tokenizer, copied when found beside the checkpoint or run.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
];

/// Storage dtype of the exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DType {
    /// bfloat16, what Qwen3 checkpoints ship in.
    Bf16,
    /// float32, exact.
    F32,
}

/// Flags of `floe export`.
#[derive(clap::Args)]
pub struct Args {
    /// A run directory, a `global_step_N` checkpoint folder, or an engine state folder.
    source: PathBuf,
    /// The Hugging Face folder to write (created if needed).
    #[arg(long)]
    out: PathBuf,
    /// Storage dtype of the weights.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DType,
}

/// Runs `floe export`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let state = engine_state_dir(&args.source)?;
    let model_dir = floe_engine::saved_model_dir(&state);
    let (config, host) = weights::load_model_dir(&model_dir)
        .with_context(|| format!("loading the policy from {}", model_dir.display()))?;
    let dtype = match args.dtype {
        DType::Bf16 => SaveDType::BF16,
        DType::F32 => SaveDType::F32,
    };
    weights::save_model_dir(&args.out, &config, &host, dtype)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let copied = copy_tokenizer(&state, &args.source, &args.out)?;
    println!(
        "exported {} ({} parameters, {}) to {}{}",
        state.display(),
        config.num_parameters(),
        dtype.torch_name(),
        args.out.display(),
        if copied.is_empty() {
            " (no tokenizer files found)".to_string()
        } else {
            format!(" with {}", copied.join(", "))
        }
    );
    Ok(())
}

/// True for a folder written by `Engine::save_state`.
fn is_engine_state(dir: &Path) -> bool {
    floe_engine::saved_model_dir(dir)
        .join("config.json")
        .is_file()
}

/// The engine state folder `source` names, directly or through its newest checkpoint.
fn engine_state_dir(source: &Path) -> anyhow::Result<PathBuf> {
    if !source.is_dir() {
        bail!("{}: no such folder", source.display());
    }
    if is_engine_state(source) {
        return Ok(source.to_path_buf());
    }
    if is_engine_state(&source.join(ENGINE_DIR)) {
        return Ok(source.join(ENGINE_DIR));
    }
    let latest = latest_checkpoint(source)
        .with_context(|| format!("looking for checkpoints in {}", source.display()))?;
    match latest {
        Some(checkpoint) if is_engine_state(&checkpoint.join(ENGINE_DIR)) => {
            Ok(checkpoint.join(ENGINE_DIR))
        }
        _ => bail!(
            "{}: not a run directory with checkpoints, a checkpoint folder \
             ({ENGINE_DIR}/model/config.json) or an engine state (model/config.json)",
            source.display()
        ),
    }
}

/// Copies the tokenizer files found in the first folder that has a `tokenizer.json`:
/// the engine state, the checkpoint, the run directory, or their `tokenizer/`
/// sub-folders. Returns the names copied.
fn copy_tokenizer(state: &Path, source: &Path, out: &Path) -> anyhow::Result<Vec<String>> {
    let mut candidates = Vec::new();
    for dir in state.ancestors().take(4).chain([source]) {
        candidates.push(dir.to_path_buf());
        candidates.push(dir.join("tokenizer"));
    }
    let Some(dir) = candidates
        .into_iter()
        .find(|dir| dir.join("tokenizer.json").is_file())
    else {
        return Ok(Vec::new());
    };
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let from = dir.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name))
                .with_context(|| format!("copying {}", from.display()))?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}
