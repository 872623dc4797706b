//! `floe plan`: what a recipe's engine will hold on the GPU and in host memory, printed
//! without a GPU, and whether it fits.

use anyhow::Context;
use floe_engine::Device;
use floe_trainer::config::Config;
use floe_trainer::setup::memory_plan;

/// Flags of `floe plan`.
#[derive(clap::Args)]
pub struct Args {
    /// A recipe (`.toml`) followed by `key=value` overrides, as `floe train` takes them.
    #[arg(value_name = "RECIPE.toml] [KEY=VALUE")]
    args: Vec<String>,
    /// Memory of the GPU to plan for, in GiB (an H100 has 80 GB, about 79.1 GiB usable;
    /// an H200 about 139.8 GiB).
    #[arg(long, default_value_t = 79.1)]
    gpu_memory_gib: f64,
    /// Data-parallel ranks (GPUs) the run will have: with `engine.zero_stage = 1` each
    /// holds 1/N of the optimizer state, with 2 also 1/N of the f32 gradients.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    world_size: u64,
}

/// Runs `floe plan`: prints the plan; fails, naming the knobs, when it does not fit.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (recipe, overrides) = super::train::recipe_and_overrides(&args.args);
    let config = Config::load(recipe.as_deref(), overrides)?;
    config.validate()?;
    let device_bytes = match config.engine.device {
        Device::Cpu => None,
        Device::Cuda(_) => Some((args.gpu_memory_gib * f64::from(1 << 30)) as usize),
    };
    let plan = memory_plan(&config, device_bytes, args.world_size as usize)
        .context("planning the run's memory")?;
    println!("{plan}");
    plan.check()?;
    println!("fits: yes");
    Ok(())
}
