//! Checkpoints: `<run_dir>/checkpoints/global_step_N/` holding `engine/` (weights, optimizer
//! moments, reference model, from [`Engine::save_state`]) and `trainer_state.json` (step,
//! data cursor, KL coefficient, metrics so far), plus a `latest` pointer file. A one-step-off
//! run's checkpoint also holds `pending_batch.json`: the batch sampled for the next step,
//! scored, with the policy version that sampled it, so a resume trains exactly it.
//!
//! A checkpoint is written into a `.partial` folder and renamed into place, then `latest` is
//! replaced atomically, so a run killed at any moment leaves either the old or the new
//! checkpoint, never a torn one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use floe_env::dataset::DataCursor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::config::Resume;
use crate::error::{Error, Result};
use floe_engine::Engine;

/// Folder of a run directory holding the checkpoints.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// File in [`CHECKPOINTS_DIR`] naming the newest complete checkpoint folder.
pub const LATEST_FILE: &str = "latest";
/// The trainer's state inside a checkpoint folder.
pub const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// The engine's state inside a checkpoint folder.
pub const ENGINE_DIR: &str = "engine";
/// The batch sampled ahead inside a one-step-off run's checkpoint folder. Its absence
/// (a sync run, the last step, or a checkpoint of floe before it saved the batch) leaves
/// the trainer state's cursor before that batch, so a resume samples it again.
pub const PENDING_BATCH_FILE: &str = "pending_batch.json";
/// Prefix of checkpoint folder names (`global_step_12`).
const STEP_PREFIX: &str = "global_step_";

/// Everything besides the engine that a resumed run needs to continue exactly. Sampling
/// seeds are derived from `(seed, step, prompt, sample)`, so the seed and the step are the
/// whole random state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// The RL step this checkpoint follows (0 = after the warm start, before any RL step).
    pub global_step: u64,
    /// RL optimiser steps taken, the position in the learning-rate schedule.
    pub optimizer_steps: u64,
    /// Where the training data order stands.
    pub data_cursor: DataCursor,
    /// `trainer.seed` of the run.
    pub seed: u64,
    /// The KL-in-reward coefficient (moved by the adaptive controller).
    pub kl_coef: f64,
    /// The last value of every metric logged so far.
    pub metrics: BTreeMap<String, f64>,
    /// The eval metrics before the first RL step (after the warm start), for the summary.
    pub initial_eval: BTreeMap<String, f64>,
}

/// The folder of the checkpoint of `step`.
pub fn checkpoint_dir(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join(CHECKPOINTS_DIR)
        .join(format!("{STEP_PREFIX}{step}"))
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io { path, source }
}

/// Writes the checkpoint of `state.global_step` (with `pending`, the batch sampled for the
/// next step, when there is one), points `latest` at it and removes the oldest checkpoints
/// beyond `keep` (`-1` keeps all). Returns the checkpoint folder.
pub fn save_checkpoint<E: Engine, P: Serialize>(
    engine: &mut E,
    run_dir: &Path,
    state: &TrainerState,
    pending: Option<&P>,
    keep: i64,
) -> Result<PathBuf> {
    let partial = prepare_checkpoint(run_dir, state.global_step)?;
    save_engine_state(engine, &partial)?;
    commit_checkpoint(run_dir, &partial, state, pending, keep)
}

/// The empty folder the checkpoint of `step` is written into before
/// [`commit_checkpoint`] renames it into place (a leftover of a killed save is removed).
pub fn prepare_checkpoint(run_dir: &Path, step: u64) -> Result<PathBuf> {
    let dir = checkpoint_dir(run_dir, step);
    let root = dir.parent().expect("a checkpoint folder has a parent");
    let partial = root.join(format!(".{STEP_PREFIX}{step}.partial"));
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io_error(&partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io_error(&partial))?;
    Ok(partial)
}

/// Writes the engine's state into the folder [`prepare_checkpoint`] made. Every rank of
/// a data-parallel run calls it (each writes its shard of a sharded optimizer).
pub fn save_engine_state<E: Engine>(engine: &mut E, partial: &Path) -> Result<()> {
    engine
        .save_state(&partial.join(ENGINE_DIR))
        .map_err(Error::verb("save_state"))
}

/// Completes the checkpoint of `state.global_step` in `partial` (the engine's state
/// already there): writes the trainer state and `pending`, renames it into place,
/// points `latest` at it and removes the oldest beyond `keep`.
pub fn commit_checkpoint<P: Serialize>(
    run_dir: &Path,
    partial: &Path,
    state: &TrainerState,
    pending: Option<&P>,
    keep: i64,
) -> Result<PathBuf> {
    let dir = checkpoint_dir(run_dir, state.global_step);
    let root = dir.parent().expect("a checkpoint folder has a parent");
    let state_path = partial.join(TRAINER_STATE_FILE);
    let text = serde_json::to_string_pretty(state).expect("trainer state serialises to JSON");
    std::fs::write(&state_path, text).map_err(io_error(&state_path))?;
    if let Some(pending) = pending {
        let path = partial.join(PENDING_BATCH_FILE);
        let text = serde_json::to_vec(pending).expect("a sampled batch serialises to JSON");
        std::fs::write(&path, text).map_err(io_error(&path))?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io_error(&dir))?;
    }
    std::fs::rename(partial, &dir).map_err(io_error(&dir))?;
    let latest = root.join(LATEST_FILE);
    let latest_partial = root.join(format!(".{LATEST_FILE}.partial"));
    let name = format!("{STEP_PREFIX}{}", state.global_step);
    std::fs::write(&latest_partial, &name).map_err(io_error(&latest_partial))?;
    std::fs::rename(&latest_partial, &latest).map_err(io_error(&latest))?;
    if keep > 0 {
        let steps = checkpoint_steps(root)?;
        let excess = steps.len().saturating_sub(keep as usize);
        for step in steps.into_iter().take(excess) {
            if step != state.global_step {
                let old = checkpoint_dir(run_dir, step);
                std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
            }
        }
    }
    Ok(dir)
}

/// The steps of the complete checkpoints under `root`, ascending.
fn checkpoint_steps(root: &Path) -> Result<Vec<u64>> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let mut steps: Vec<u64> = entries
        .flatten()
        .filter(|e| e.path().join(TRAINER_STATE_FILE).is_file())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix(STEP_PREFIX)?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable();
    Ok(steps)
}

/// The checkpoint a run resumes from: `latest` reads the pointer file of `run_dir` (or,
/// without one, the highest complete checkpoint), `none` gives none, a path must be a
/// checkpoint folder.
pub fn resume_checkpoint(run_dir: &Path, resume: &Resume) -> Result<Option<PathBuf>> {
    match resume {
        Resume::None => Ok(None),
        Resume::Path(path) => {
            if path.join(TRAINER_STATE_FILE).is_file() {
                Ok(Some(path.clone()))
            } else {
                Err(Error::Checkpoint {
                    path: path.clone(),
                    message: format!(
                        "not a checkpoint folder (no {TRAINER_STATE_FILE}); give a \
                         {CHECKPOINTS_DIR}/{STEP_PREFIX}N folder, `latest` or `none`"
                    ),
                })
            }
        }
        Resume::Latest => latest_checkpoint(run_dir),
    }
}

/// The newest complete checkpoint of `run_dir`, if any.
pub fn latest_checkpoint(run_dir: &Path) -> Result<Option<PathBuf>> {
    let root = run_dir.join(CHECKPOINTS_DIR);
    if let Ok(name) = std::fs::read_to_string(root.join(LATEST_FILE)) {
        let dir = root.join(name.trim());
        if dir.join(TRAINER_STATE_FILE).is_file() {
            return Ok(Some(dir));
        }
    }
    Ok(checkpoint_steps(&root)?
        .last()
        .map(|&step| checkpoint_dir(run_dir, step)))
}

/// Reads a checkpoint's trainer state.
pub fn load_trainer_state(checkpoint: &Path) -> Result<TrainerState> {
    let path = checkpoint.join(TRAINER_STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
    serde_json::from_str(&text).map_err(|err| Error::Checkpoint {
        path,
        message: format!("unreadable trainer state: {err}"),
    })
}

/// Reads a checkpoint's batch sampled ahead ([`PENDING_BATCH_FILE`]), if it has one.
pub fn load_pending_batch<P: DeserializeOwned>(checkpoint: &Path) -> Result<Option<P>> {
    let path = checkpoint.join(PENDING_BATCH_FILE);
    let text = match std::fs::read(&path) {
        Ok(text) => text,
        Err(source) if source.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(Error::Io { path, source }),
    };
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|err| Error::Checkpoint {
            path,
            message: format!("unreadable batch sampled ahead: {err}"),
        })
}

/// Serde for a `Vec<f64>` whose values may be non-finite, each as
/// [`floe_engine::native_api::float`] writes it (exact, `"NaN"` and the infinities as text).
pub(crate) mod float_vec {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(transparent)]
    struct Exact(#[serde(with = "floe_engine::native_api::float")] f64);

    /// Writes `values`.
    pub fn serialize<S: Serializer>(values: &[f64], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(values.iter().map(|&v| Exact(v)))
    }

    /// Reads a list of numbers or texts.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<f64>, D::Error> {
        Ok(Vec::<Exact>::deserialize(deserializer)?
            .into_iter()
            .map(|Exact(v)| v)
            .collect())
    }
}
