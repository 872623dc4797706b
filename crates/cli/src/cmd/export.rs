//! `floe export`.

/// Flags of `floe export`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `floe export`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`floe export` is not built yet")
}
