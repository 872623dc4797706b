//! Evaluation: sample every validation prompt `k` times with the eval sampling parameters,
//! score, and report per data source (`eval/<ds>/avg_score`, `pass_at_<k>`,
//! `mean_positive_reward`, `accuracy`) and over all (`eval/all/...`); generations go to a
//! JSONL file.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use floe_engine::SamplingParams as EngineSamplingParams;
use floe_rl::metrics::{eval_metrics, names, pass_at_k};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::data::Prompt;
use crate::error::{Error, Result};
use crate::rollout::{derive_seed, Rollouts, Trajectory};
use floe_engine::Engine;

/// Folder of a run directory holding eval generations (`global_step_N.jsonl`).
pub const EVALS_DIR: &str = "evals";

/// Stream of eval sampling seeds, apart from the training samples of the same step.
const EVAL_SEED_STREAM: u64 = 0xE7A1;

/// A reward at least this high counts as a correct answer (execution match for SQL,
/// the right number for math); `accuracy` and the unbiased `pass@k` count these.
pub const CORRECT_REWARD: f64 = 1.0;

/// One eval generation, as written to the JSONL file.
#[derive(Clone, Debug, Serialize)]
pub struct EvalRecord {
    /// The step evaluated (0 = before RL).
    pub step: u64,
    /// The row's data source.
    pub data_source: String,
    /// The row's index in its file.
    pub index: usize,
    /// Which sample of the prompt.
    pub sample: usize,
    /// The prompt as the model saw it.
    pub prompt: String,
    /// The completion (all turns).
    pub response: String,
    /// The environment's reward.
    pub reward: f64,
    /// Response tokens.
    pub num_tokens: usize,
    /// The row's `extra_info` (template, difficulty, ...), so accuracy can be split by any
    /// of its keys (`tools/eval_breakdown.py`).
    pub extra_info: serde_json::Map<String, serde_json::Value>,
}

/// What an evaluation produced.
#[derive(Clone, Debug)]
pub struct EvalOutput {
    /// `eval/...` metrics and `timing/eval`.
    pub metrics: BTreeMap<String, f64>,
    /// One record per generation, by (prompt, sample).
    pub records: Vec<EvalRecord>,
}

/// How to evaluate.
#[derive(Clone, Debug)]
pub struct EvalSpec {
    /// Sampling parameters (greedy by default).
    pub params: EngineSamplingParams,
    /// Samples per prompt.
    pub k: usize,
    /// Prompts per generation batch.
    pub batch_size: usize,
    /// The run's seed.
    pub seed: u64,
}

/// Evaluates `prompts` at `step` in batches of `spec.batch_size`, `spec.k` samples each.
pub fn evaluate<E: Engine>(
    engine: &mut E,
    rollouts: &mut Rollouts,
    prompts: &[Prompt],
    spec: &EvalSpec,
    step: u64,
) -> Result<EvalOutput> {
    let EvalSpec {
        params,
        k,
        batch_size,
        seed,
    } = spec;
    let (k, batch_size, seed) = (*k, (*batch_size).max(1), *seed);
    let start = Instant::now();
    let bar = ProgressBar::new(prompts.len() as u64).with_style(
        ProgressStyle::with_template("eval  {bar:30} {pos}/{len} {elapsed} {msg}")
            .expect("a valid progress template"),
    );
    let mut trajectories: Vec<(usize, Trajectory)> = Vec::with_capacity(prompts.len() * k);
    for (b, chunk) in prompts.chunks(batch_size).enumerate() {
        let offset = b * batch_size;
        let batch: Vec<&Prompt> = chunk.iter().collect();
        let (out, _) = rollouts.run(
            engine,
            &batch,
            k,
            params,
            derive_seed(&[seed, EVAL_SEED_STREAM, step, b as u64]),
        )?;
        trajectories.extend(out.into_iter().map(|t| (offset + t.prompt, t)));
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    let sources: Vec<&str> = trajectories
        .iter()
        .map(|(p, _)| prompts[*p].row.data_source.as_str())
        .collect();
    let scores: Vec<f64> = trajectories.iter().map(|(_, t)| t.reward).collect();
    let groups: Vec<u64> = trajectories.iter().map(|(p, _)| *p as u64).collect();
    let mut metrics = eval_metrics(&sources, &scores, &groups, k);
    metrics.extend(correctness_metrics(&sources, &scores, &groups, k));
    metrics.insert("timing/eval".into(), start.elapsed().as_secs_f64());
    let records = trajectories
        .into_iter()
        .map(|(p, t)| EvalRecord {
            step,
            data_source: prompts[p].row.data_source.clone(),
            index: prompts[p].row.index,
            sample: t.sample,
            prompt: prompts[p].text.clone(),
            response: t.text,
            reward: t.reward,
            num_tokens: t.response.len(),
            extra_info: prompts[p].row.extra_info().clone(),
        })
        .collect();
    Ok(EvalOutput { metrics, records })
}

/// `eval/<ds>/accuracy` (share of samples with a correct answer) and, for `k > 1`, the
/// unbiased `eval/<ds>/pass_at_1` and `eval/<ds>/pass_at_{k}_correct` (share of prompts
/// with a correct answer among their `k` samples); the same over `all`. SkyRL's
/// `pass_at_{k}` counts any positive reward, which a format bonus already earns.
fn correctness_metrics(
    sources: &[&str],
    scores: &[f64],
    groups: &[u64],
    k: usize,
) -> BTreeMap<String, f64> {
    // (samples, correct) per (source, group).
    let mut per_group: BTreeMap<(&str, u64), (usize, usize)> = BTreeMap::new();
    for ((&ds, &score), &g) in sources.iter().zip(scores).zip(groups) {
        let entry = per_group.entry((ds, g)).or_default();
        entry.0 += 1;
        entry.1 += usize::from(score >= CORRECT_REWARD);
    }
    let mut by_source: BTreeMap<&str, Vec<(usize, usize)>> = BTreeMap::new();
    for (&(ds, _), &counts) in &per_group {
        by_source.entry(ds).or_default().push(counts);
        by_source.entry("all").or_default().push(counts);
    }
    let mut out = BTreeMap::new();
    for (ds, counts) in by_source {
        let samples: usize = counts.iter().map(|c| c.0).sum();
        let correct: usize = counts.iter().map(|c| c.1).sum();
        out.insert(
            names::eval(ds, "accuracy"),
            correct as f64 / samples.max(1) as f64,
        );
        if k > 1 {
            let pass1 =
                counts.iter().map(|&(n, c)| pass_at_k(n, c, 1)).sum::<f64>() / counts.len() as f64;
            out.insert(names::eval(ds, "pass_at_1"), pass1);
            let solved = counts.iter().filter(|&&(_, c)| c > 0).count();
            out.insert(
                names::eval(ds, &format!("pass_at_{k}_correct")),
                solved as f64 / counts.len() as f64,
            );
        }
    }
    out
}

/// Writes eval records as JSONL (creating the folder); returns the path.
pub fn write_records(path: &Path, records: &[EvalRecord]) -> Result<PathBuf> {
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut out = BufWriter::new(File::create(path).map_err(io)?);
    for record in records {
        serde_json::to_writer(&mut out, record).expect("an eval record serialises to JSON");
        out.write_all(b"\n").map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn correctness_counts_only_correct_answers() {
        // Two prompts × 4 samples: the first solved once, the second never (format credit only).
        let sources = ["sql"; 8];
        let scores = [1.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1];
        let groups = [0, 0, 0, 0, 1, 1, 1, 1];
        let m = correctness_metrics(&sources, &scores, &groups, 4);
        assert_eq!(m["eval/sql/accuracy"], 0.125);
        assert_eq!(m["eval/sql/pass_at_1"], 0.125);
        assert_eq!(m["eval/sql/pass_at_4_correct"], 0.5);
        assert_eq!(m["eval/all/pass_at_4_correct"], 0.5);
    }
}
