//! `floe env`: one of floe's environments as a JSON-lines session on stdin and stdout, so
//! an agent outside floe (e.g. `python/examples/multiturn_sql_agent.py`, which plays the
//! multi-turn SQL env through `floe serve`'s `/v1`) steps exactly the env `floe train`
//! steps.
//!
//! Each input line is one command, answered by one output line:
//! - `{"reset": {"env_class": "text2sql_multiturn", "prompt": [messages], "extras": {...}}}`
//!   starts an episode (`extras`: the dataset row's other columns) and answers
//!   `{"prompt": [messages]}`, the first prompt the env makes of it;
//! - `{"step": "<the model's turn>"}` answers `{"observations": [messages], "reward",
//!   "done", "metrics"}`.
//!
//! A command that fails answers `{"error": "..."}` and the session goes on.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use floe_env::env::{BuiltinConfig, Env, Message, Registry};
use serde::Deserialize;
use serde_json::{json, Value};

/// Flags of `floe env`.
#[derive(clap::Args)]
pub struct Args {
    /// Root folder of the multi-turn SQL databases, for rows that name `db_id` and `data`
    /// instead of a `db_path`.
    #[arg(long)]
    sql_db_root: Option<PathBuf>,
}

/// One input line.
#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Command {
    Reset(Reset),
    Step(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Reset {
    env_class: String,
    #[serde(default)]
    prompt: Vec<Message>,
    #[serde(default)]
    extras: Value,
}

pub fn run(args: Args) -> Result<()> {
    let registry = Registry::with_builtins_config(BuiltinConfig {
        sql_db_root: args.sql_db_root,
        ..BuiltinConfig::default()
    });
    let mut env: Option<Box<dyn Env>> = None;
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let answer = answer(&registry, &mut env, &line).unwrap_or_else(|e| json!({ "error": e }));
        let mut out = stdout.lock();
        writeln!(out, "{answer}").context("writing stdout")?;
        out.flush().context("writing stdout")?;
    }
    Ok(())
}

/// The answer to one command line, or what is wrong with it.
fn answer(
    registry: &Registry,
    env: &mut Option<Box<dyn Env>>,
    line: &str,
) -> Result<Value, String> {
    let command: Command = serde_json::from_str(line).map_err(|e| {
        format!("{e}: expected {{\"reset\": {{\"env_class\", \"prompt\", \"extras\"}}}} or {{\"step\": \"text\"}}")
    })?;
    match command {
        Command::Reset(reset) => {
            *env = None;
            let mut made = registry
                .make(&reset.env_class, &reset.extras)
                .map_err(|e| e.to_string())?;
            let prompt = made.init(&reset.prompt).map_err(|e| e.to_string())?;
            *env = Some(made);
            Ok(json!({ "prompt": prompt }))
        }
        Command::Step(action) => {
            let env = env
                .as_mut()
                .ok_or("no episode: send {\"reset\": ...} first")?;
            let out = env.step(&action).map_err(|e| e.to_string())?;
            Ok(json!({
                "observations": out.observations,
                "reward": out.reward,
                "done": out.done,
                "metrics": out.metrics,
            }))
        }
    }
}
