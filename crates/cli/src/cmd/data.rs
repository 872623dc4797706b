//! `floe data`: convert BIRD, generate the synthetic tasks, look inside a dataset.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Context;
use floe_env::bird::{convert_bird, BirdOptions, BirdSplit};
use floe_env::dataset::{load_rows, write_rows};
use floe_env::{synth_math, synth_sql};

/// Subcommands of `floe data`.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Convert a BIRD split into a parquet (or JSONL) dataset with Arctic's prompt.
    Bird {
        /// The BIRD folder: `train.json` / `dev.json` next to `train_databases/` /
        /// `dev_databases/`.
        #[arg(long)]
        bird_dir: PathBuf,
        /// Which split to convert.
        #[arg(long, value_enum)]
        split: Split,
        /// Output file (`.parquet` or `.jsonl`); `db_path` is written relative to it.
        #[arg(long)]
        out: PathBuf,
        /// Convert only the first N questions.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Generate the synthetic text-to-SQL task: databases, `train.parquet`, `test.parquet`.
    SynthSql {
        /// Folder for the `.sqlite` files and the two splits.
        #[arg(long)]
        out_dir: PathBuf,
        /// Seed for contents, held-out values and order.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Training rows.
        #[arg(long, default_value_t = 2000)]
        train: usize,
        /// Test rows.
        #[arg(long, default_value_t = 200)]
        test: usize,
        /// What the test split holds out: `values` (no test constant appears in a training
        /// question) or `questions` (unseen combinations of values training mentions).
        #[arg(long, default_value = "values")]
        holdout: synth_sql::Holdout,
        /// Fraction of the training rows with a deciding word (aggregate, sort direction,
        /// comparison) whose reference answer mistakes it for another, as a confused
        /// teacher would; the gold SQL stays right.
        #[arg(long, default_value_t = 0.0, value_parser = fraction)]
        decision_confusion: f64,
        /// Fraction of the training rows whose reference answer also selects the column
        /// the question filters, sorts or joins on, as a chatty teacher would; the extra
        /// column fails execution match.
        #[arg(long, default_value_t = 0.0, value_parser = fraction)]
        extra_column: f64,
        /// Annotated BIRD-style schema instead of the compact one-line-per-table schema.
        #[arg(long)]
        full_schema: bool,
    },
    /// Generate GSM8K-format arithmetic word problems.
    SynthMath {
        /// Output file (`.parquet` or `.jsonl`).
        #[arg(long)]
        out: PathBuf,
        /// Seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Number of problems.
        #[arg(long, default_value_t = 1000)]
        n: usize,
    },
    /// Check that a dataset loads and summarize it; print its first rows as JSON.
    Show {
        /// A `.parquet`, `.jsonl` or `.json` dataset.
        file: PathBuf,
        /// How many rows to print.
        #[arg(long, default_value_t = 1)]
        rows: usize,
    },
}

/// A BIRD split.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Split {
    /// `train.json`, annotated schema.
    Train,
    /// `dev.json`, clean schema.
    Dev,
}

/// Runs `floe data`.
pub fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Bird {
            bird_dir,
            split,
            out,
            limit,
        } => {
            let split = match split {
                Split::Train => BirdSplit::Train,
                Split::Dev => BirdSplit::Dev,
            };
            let options = BirdOptions {
                limit,
                ..BirdOptions::new(split)
            };
            let rows = convert_bird(&bird_dir, &options)?;
            create_parent(&out)?;
            write_rows(&out, &rows)?;
            let databases: std::collections::BTreeSet<&str> = rows
                .iter()
                .filter_map(|r| r.extra_info().get("db_id").and_then(|v| v.as_str()))
                .collect();
            println!(
                "wrote {} rows over {} databases to {}",
                rows.len(),
                databases.len(),
                out.display()
            );
        }
        Command::SynthSql {
            out_dir,
            seed,
            train,
            test,
            holdout,
            decision_confusion,
            extra_column,
            full_schema,
        } => {
            let options = synth_sql::SynthSqlOptions {
                seed,
                train,
                test,
                holdout,
                decision_confusion,
                extra_column,
                compact: !full_schema,
                ..Default::default()
            };
            let task = synth_sql::write_synth_sql(&out_dir, &options)?;
            println!("{}", synth_sql::summary(&task));
            println!(
                "wrote {} databases, train.parquet and test.parquet to {}",
                task.databases.len(),
                out_dir.display()
            );
        }
        Command::SynthMath { out, seed, n } => {
            let rows = synth_math::rows(seed, n);
            create_parent(&out)?;
            write_rows(&out, &rows)?;
            println!("wrote {} problems to {}", rows.len(), out.display());
        }
        Command::Show { file, rows: shown } => {
            let rows = load_rows(&file)?;
            let mut by_source: BTreeMap<(&str, Option<&str>), usize> = BTreeMap::new();
            for row in &rows {
                *by_source
                    .entry((row.data_source.as_str(), row.env_class.as_deref()))
                    .or_default() += 1;
            }
            println!("{}: {} rows", file.display(), rows.len());
            for ((source, env), count) in by_source {
                println!(
                    "  data_source {source}, env_class {}: {count}",
                    env.unwrap_or("(default)")
                );
            }
            let longest = rows
                .iter()
                .map(|r| r.prompt.iter().map(|m| m.content.len()).sum::<usize>())
                .max()
                .unwrap_or(0);
            println!("  longest prompt: {longest} characters");
            for row in rows.iter().take(shown) {
                println!("{}", serde_json::to_string_pretty(row)?);
            }
        }
    }
    Ok(())
}

fn create_parent(path: &std::path::Path) -> anyhow::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the folder {}", dir.display())),
        _ => Ok(()),
    }
}

/// Parses a fraction from 0 to 1.
fn fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("`{text}` is not a fraction from 0 to 1")),
    }
}
