//! `floe eval`.

use std::path::PathBuf;

use floe_trainer::eval_checkpoint::{eval_checkpoint, EvalRequest};

/// Flags of `floe eval`.
#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint folder (`<run_dir>/checkpoints/global_step_N`) or a run directory
    /// (its latest checkpoint).
    #[arg(value_name = "CHECKPOINT_OR_RUN_DIR")]
    target: PathBuf,
    /// Evaluate on this dataset (`.parquet`, `.jsonl`, `.json`) instead of the run's
    /// validation data.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Samples per prompt (pass@k uses k = this); default: the run's
    /// `generator.eval_n_samples_per_prompt`.
    #[arg(long, value_name = "K")]
    n: Option<usize>,
    /// Sampling temperature; default: the run's `generator.eval_sampling_params` (0 is
    /// greedy). With `--n 8 --temperature 1`, `pass_at_8_correct` shows how far sampling
    /// reaches beyond the greedy answer.
    #[arg(long, value_name = "T", allow_negative_numbers = true)]
    temperature: Option<f64>,
    /// Write the generations here (JSONL); default: `<run_dir>/evals/`.
    #[arg(long, value_name = "FILE.jsonl")]
    out: Option<PathBuf>,
}

/// Runs `floe eval`: prints pass@k and the average score per data source.
pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(t) = args.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        anyhow::bail!("--temperature {t}: must be 0 (greedy) or positive");
    }
    let report = eval_checkpoint(&EvalRequest {
        target: args.target,
        data: args.data,
        n: args.n,
        temperature: args.temperature,
        out: args.out,
    })?;
    println!(
        "floe eval: {} ({} prompts)",
        report.checkpoint.display(),
        report.num_prompts
    );
    for (name, value) in &report.metrics {
        if name.starts_with("eval/") {
            println!("  {name:<40} {value:.4}");
        }
    }
    let sampling = &report.sampling;
    print!(
        "  sampling: {} model calls, {:.2} s in the model",
        sampling.steps,
        sampling.model_time.as_secs_f64()
    );
    if sampling.draft_tokens > 0 {
        print!(
            ", {} of {} draft tokens accepted",
            sampling.accepted_draft_tokens, sampling.draft_tokens
        );
    }
    println!();
    println!("  generations: {}", report.generations.display());
    Ok(())
}
