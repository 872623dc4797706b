//! `floe`: reinforcement-learning post-training of language models, in one engine.

mod cmd;

use clap::{Parser, Subcommand};

/// floe: RL post-training (GRPO and relatives) of Qwen-family models, in one Rust engine.
#[derive(Parser)]
#[command(name = "floe", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the RL pipeline (SFT warm start, GRPO, eval, report); with no recipe, the
    /// embedded default on a tiny model and a synthetic SQL task.
    Train(cmd::train::Args),
    /// Evaluate a checkpoint: pass@k and average score per data source.
    Eval(cmd::eval::Args),
    /// Export a checkpoint's weights as a Hugging Face folder.
    Export(cmd::export::Args),
    /// Score a reward function over a JSONL file of cases.
    #[command(subcommand)]
    Reward(cmd::reward::Command),
    /// Build datasets: BIRD conversion and synthetic tasks.
    #[command(subcommand)]
    Data(cmd::data::Command),
    /// Step one of floe's environments over JSON lines on stdin and stdout (for agents
    /// outside floe).
    Env(cmd::env::Args),
    /// Measure training and generation throughput.
    Bench(cmd::bench::Args),
    /// Print what a recipe's engine will hold on the GPU and in host memory, and whether
    /// it fits (no GPU needed).
    Plan(cmd::plan::Args),
    /// Serve the Tinker HTTP API (training and sampling) for the `tinker` SDK.
    Serve(cmd::serve::Args),
    /// Issue, revoke and list the API keys of a server's `--api-key-file`.
    #[command(subcommand)]
    Keys(cmd::keys::Command),
    /// Start N processes of a program (or of a floe subcommand) on this node with
    /// torchrun's environment, one per GPU; stop them all when one fails.
    Launch(cmd::launch::Args),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => cmd::train::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Reward(command) => cmd::reward::run(command),
        Command::Data(command) => cmd::data::run(command),
        Command::Env(args) => cmd::env::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Plan(args) => cmd::plan::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Keys(command) => cmd::keys::run(command),
        Command::Launch(args) => cmd::launch::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_chain(&err));
            // `floe launch` exits as its failed rank did, so a script sees the rank's code.
            let code = err
                .downcast_ref::<cmd::launch::LaunchFailed>()
                .map_or(2, cmd::launch::LaunchFailed::exit_code);
            std::process::ExitCode::from(code)
        }
    }
}

/// The error and its causes joined by ": ", leaving out a cause that the message before it
/// already ends with: floe's errors put their source in their own message, so anyhow's
/// `{:#}` would print each cause twice.
fn error_chain(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
