//! `floe data`.

/// Subcommands of `floe data`.
#[derive(clap::Subcommand)]
pub enum Command {}

/// Runs `floe data`.
pub fn run(command: Command) -> anyhow::Result<()> {
    match command {}
}
