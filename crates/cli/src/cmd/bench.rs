//! `floe bench`.

/// Flags of `floe bench`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `floe bench`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`floe bench` is not built yet")
}
