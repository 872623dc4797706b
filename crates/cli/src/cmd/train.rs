//! `floe train`.

/// Flags of `floe train`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `floe train`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`floe train` is not built yet")
}
