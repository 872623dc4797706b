//! `floe eval`.

/// Flags of `floe eval`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `floe eval`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`floe eval` is not built yet")
}
