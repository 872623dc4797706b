//! `floe train`.

use std::path::PathBuf;

use anyhow::Context;
use floe_trainer::config::Config;
use floe_trainer::run::{train, RunOutcome};

/// Flags of `floe train`.
#[derive(clap::Args)]
pub struct Args {
    /// A recipe (`.toml`) followed by `key=value` overrides, e.g.
    /// `floe train recipes/bird.toml trainer.train_batch_size=16`. Without a recipe, the
    /// embedded default (a tiny model on a synthetic SQL task).
    #[arg(value_name = "RECIPE.toml] [KEY=VALUE")]
    args: Vec<String>,
}

/// Runs `floe train`. A killed run loses at most the steps since its last checkpoint:
/// run the same command again (`trainer.resume = "latest"`) to continue.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (recipe, overrides) = recipe_and_overrides(&args.args);
    let config = Config::load(recipe.as_deref(), overrides)?;
    config.validate()?;
    let recipe_name = recipe
        .as_ref()
        .map_or("the embedded recipe".to_string(), |r| {
            r.display().to_string()
        });
    println!(
        "floe train: {recipe_name} → run dir {}",
        config.trainer.run_dir.display()
    );
    let outcome = train(&config).with_context(|| format!("training with {recipe_name}"))?;
    print_summary(&outcome);
    Ok(())
}

/// The recipe (a first argument that is no `key=value`) and the overrides after it.
pub fn recipe_and_overrides(args: &[String]) -> (Option<PathBuf>, &[String]) {
    match args.split_first() {
        Some((first, rest)) if !first.contains('=') => (Some(PathBuf::from(first)), rest),
        _ => (None, args),
    }
}

fn print_summary(outcome: &RunOutcome) {
    let metric = |m: &std::collections::BTreeMap<String, f64>, key: &str| {
        m.get(key).map_or("n/a".to_string(), |v| format!("{v:.3}"))
    };
    println!(
        "\nfloe train: done, {} RL steps in {:.0}s",
        outcome.steps, outcome.wall_seconds
    );
    if let Some(from) = &outcome.resumed_from {
        println!("  resumed from       {}", from.display());
    }
    for (label, key) in [
        ("accuracy", "eval/all/accuracy"),
        ("avg score", "eval/all/avg_score"),
    ] {
        println!(
            "  {label:<10} start {} → final {}",
            metric(&outcome.initial_eval, key),
            metric(&outcome.final_eval, key)
        );
    }
    println!("  report             {}", outcome.report.display());
}
