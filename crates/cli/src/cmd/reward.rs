//! `floe reward`.

/// Subcommands of `floe reward`.
#[derive(clap::Subcommand)]
pub enum Command {}

/// Runs `floe reward`.
pub fn run(command: Command) -> anyhow::Result<()> {
    match command {}
}
