//! `floe bench`: throughput of training steps and of generation, on the shapes
//! the peer script `peer_torch.py` (PyTorch + Hugging Face) measures, so the two print comparable numbers.
//!
//! - `train`: tokens/s of forward + backward + AdamW step (global-norm clip 1.0) on random
//!   tokens, `batch × seq` per optimizer step, loss `−mean(0.01 · log p(token))` over every
//!   position, the peer's loss.
//! - `generate`: new tokens/s of the sampler at temperature 1 (`--temperature`) with every
//!   sequence forced to `--new` tokens, all `batch` prompts submitted at once (continuous
//!   batching, paged KV), optionally with prompt-lookup speculative decoding
//!   (`--speculative-ngram K`: its acceptance rate and new tokens per model call).
//!
//! Under `floe launch --gpus N` (or torchrun, Slurm), `train` is data parallel: every rank
//! trains `batch × seq` tokens on `cuda:{LOCAL_RANK}` and the gradients are summed over
//! NCCL before each step (`--zero-stage 1` splits the optimizer state, `2` the gradients
//! too, reduced during the backward); rank 0 prints
//! tokens/s per GPU and in all. `generate` runs on every rank's GPU on its own.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use floe_backend::cpu::CpuBackend;
use floe_backend::cuda::{CudaBackend, KernelTime};
use floe_backend::sampling::GAMMA;
use floe_backend::{Backend, Collective};
use floe_dist::World;
use floe_engine::policy::{OptimParams, OptimizerPlacement, Policy};
use floe_engine::{DataParallelGroup, Device};
use floe_engine::{MemoryPlan, PlanInputs, Recompute};
use floe_engine::{NgramSpec, SampleRequest, Sampler, SamplerConfig, SamplingParams};
use floe_model::batch::PackedBatch;
use floe_model::tensor_parallel;
use floe_model::transformer::Transformer;
use floe_model::{weights, ModelConfig};
use serde_json::{json, Value};

/// Peak dense bf16 throughput the MFU figure divides by, the peer script's ceiling.
const PEAK_FLOPS: f64 = 790e12;

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Forward, backward and optimizer step.
    Train,
    /// Sampling with the continuous-batching sampler.
    Generate,
}

/// Flags of `floe bench`.
#[derive(clap::Args)]
pub struct Args {
    /// `train` or `generate`.
    mode: Mode,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// A Qwen3 shape (`tiny`, `small`, `0.6B`, `1.7B`, `4B`, `8B`, `14B`, `32B`: the names of
    /// `embedded:<name>`) or a Hugging Face folder; `tiny` is the shape `floe train` trains
    /// by default. (Before issue 17, `tiny` was called `embedded` and `small` was `tiny`.)
    #[arg(long, default_value = "small")]
    model: String,
    /// Random weights (a folder's `config.json` gives only the shape); shapes named by
    /// preset always use random weights.
    #[arg(long)]
    random_init: bool,
    /// Sequences per step; a comma-separated list measures each. Default: 8 for train,
    /// 64,256 for generate.
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Prompt tokens per generated sequence.
    #[arg(long, default_value_t = 256)]
    prompt: usize,
    /// New tokens per generated sequence.
    #[arg(long, default_value_t = 256)]
    new: usize,
    /// Samples of each prompt (generate), as GRPO draws a group per prompt: `--batch`
    /// sequences are `batch / N` prompts of `N` samples each, which share their prompt's
    /// KV blocks (prefix sharing) and, on CUDA, read them once per group (cascade
    /// attention; `FLOE_CASCADE=0` reads them per sample).
    #[arg(long, default_value_t = 1, value_name = "N")]
    samples_per_prompt: usize,
    /// Which layers' activations the backward recomputes (train; `engine.recompute`):
    /// `true` all (the peer's gradient checkpointing), `false` none, `auto` the fewest
    /// that fit the device's free memory, or a number of layers. The plan printed first
    /// says how many.
    #[arg(long, default_value = "true", num_args = 0..=1, default_missing_value = "true")]
    recompute: Recompute,
    /// Most tokens per sampler step (prefill chunks plus decodes).
    #[arg(long, default_value_t = 8192)]
    max_tokens_per_step: usize,
    /// Sampling temperature (generate); 0 is greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Speculative decoding with prompt-lookup drafts of up to K tokens, matching the
    /// last 3 down to 1 tokens (generate; `engine.speculative_ngram`).
    #[arg(long, value_name = "K")]
    speculative_ngram: Option<usize>,
    /// Batch-invariant kernels on the log-prob path (`engine.exact_logprobs`), to
    /// measure their cost.
    #[arg(long)]
    exact_logprobs: bool,
    /// Timed iterations (train).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed iterations first (train; generate always warms up with one short run).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// CPU threads; 0 uses every core.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print only the `RESULT {...}` lines.
    #[arg(long)]
    json: bool,
    /// After the timed runs, one more (a train step, or the generation) with every CUDA
    /// kernel and GEMM timed by events: prints GPU time per kernel (CUDA only).
    #[arg(long)]
    profile: bool,
    /// Keep the f32 master weights and AdamW moments in host memory (train; see
    /// `engine.offload_optimizer`).
    #[arg(long)]
    offload_optimizer: bool,
    /// Under `floe launch`: split the model's layers over the ranks (generate; tensor
    /// parallel, for models whose weights do not fit one card) instead of giving each
    /// rank a whole model.
    #[arg(long)]
    tensor_parallel: bool,
    /// Under `floe launch`: 1 splits the optimizer state over the ranks, 2 the f32
    /// gradients too (train; see `engine.zero_stage`).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    zero_stage: u8,
}

/// Runs `floe bench`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (config, host_dir) = model_shape(&args)?;
    let world = World::from_env(None).context("reading the ranks' environment")?;
    if world.world_size > 1 {
        return run_rank(args, &world, config, host_dir);
    }
    if args.tensor_parallel {
        bail!(
            "--tensor-parallel splits the model over the ranks of `floe launch --gpus N` \
             (N ≥ 2); alone there is nothing to split"
        );
    }
    match args.device {
        Device::Cpu => {
            if args.threads > 0 {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(args.threads)
                    .build_global()
                    .context("setting the CPU thread pool")?;
            }
            if args.profile {
                bail!("--profile times CUDA kernels; use it with --device cuda:N");
            }
            bench(
                Arc::new(CpuBackend::<f32>::new()),
                &args,
                config,
                host_dir,
                None,
                None,
                None,
            )
        }
        Device::Cuda(ordinal) => {
            let backend = Arc::new(
                CudaBackend::new(ordinal)
                    .with_context(|| format!("opening device {}", args.device))?,
            );
            bench_cuda(backend, &args, config, host_dir, None)
        }
    }
}

/// `floe bench` as rank `world.rank` of a data-parallel group on `cuda:{LOCAL_RANK}`.
fn run_rank(
    args: Args,
    world: &World,
    config: ModelConfig,
    host_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    let (rank, size) = (world.rank, world.world_size);
    if args.device == Device::Cpu {
        bail!(
            "rank {rank} of WORLD_SIZE={size} on --device cpu: the CPU has no collective \
             across processes; bench several GPUs with --device cuda"
        );
    }
    if args.tensor_parallel && args.mode == Mode::Train {
        bail!("--tensor-parallel splits a model for generation; train data parallel without it");
    }
    let (backend, collective, group) = match args.mode {
        Mode::Generate if !args.tensor_parallel => {
            let device = Device::Cuda(world.local_rank);
            let backend = CudaBackend::new(world.local_rank)
                .with_context(|| format!("opening device {device}"))?;
            (Arc::new(backend), None, None)
        }
        Mode::Train | Mode::Generate => {
            let group = DataParallelGroup::join_nccl(world, Duration::from_secs(300))
                .with_context(|| format!("joining the NCCL group as rank {rank} of {size}"))?;
            let (backend, collective) = group.cuda_parts().expect("a CUDA group");
            (backend, Some(collective), Some(group))
        }
    };
    eprintln!("rank {rank} of {size} on {}", backend.name());
    let outcome = bench_cuda(backend, &args, config, host_dir, collective);
    // The other ranks learn at once how this one ended: an error stops them naming it.
    if let Some(group) = group {
        match &outcome {
            Ok(()) => group.leave(),
            Err(err) => group.fail(&format!("{err:#}")),
        }
    }
    outcome
}

/// [`bench`] on a GPU: its kernel profiler when asked, its graph counts, the roofline
/// from its bandwidth.
fn bench_cuda(
    backend: Arc<CudaBackend>,
    args: &Args,
    config: ModelConfig,
    host_dir: Option<PathBuf>,
    collective: Option<Arc<dyn Collective<CudaBackend>>>,
) -> anyhow::Result<()> {
    let cuda = Some(Arc::clone(&backend));
    let bandwidth = backend.memory_bandwidth();
    bench(
        backend,
        args,
        config,
        host_dir,
        cuda,
        Some(bandwidth),
        collective,
    )
}

/// The model's shape, and the folder to load weights from unless they are random.
fn model_shape(args: &Args) -> anyhow::Result<(ModelConfig, Option<PathBuf>)> {
    if let Ok(config) = ModelConfig::preset(&args.model) {
        return Ok((config, None));
    }
    let dir = PathBuf::from(&args.model);
    if !dir.join("config.json").is_file() {
        let renamed = if args.model == "embedded" {
            " (the shape once called `embedded` is now `tiny`; the old `tiny` is `small`)"
        } else {
            ""
        };
        bail!(
            "--model `{}` is neither a preset (tiny, small, 0.6B, 1.7B, 4B, 8B, 14B, 32B) nor a folder with a \
             config.json{renamed}",
            args.model
        );
    }
    let config = ModelConfig::from_hf_file(dir.join("config.json"))
        .with_context(|| format!("reading {}", dir.join("config.json").display()))?;
    Ok((config, (!args.random_init).then_some(dir)))
}

fn load_model<B: Backend>(
    backend: Arc<B>,
    config: ModelConfig,
    dir: Option<&PathBuf>,
) -> anyhow::Result<Transformer<B>> {
    Ok(match dir {
        Some(dir) => {
            let (config, host) = weights::load_model_dir(dir)
                .with_context(|| format!("loading weights from {}", dir.display()))?;
            Transformer::from_host_weights(backend, config, &host)?
        }
        None => Transformer::new_random(backend, config, 0)?,
    })
}

/// Runs the benchmark on `backend`; with `collective`, as one rank of a data-parallel
/// group (train: gradients summed before each step; only rank 0 prints).
fn bench<B: Backend>(
    backend: Arc<B>,
    args: &Args,
    config: ModelConfig,
    dir: Option<PathBuf>,
    cuda: Option<Arc<CudaBackend>>,
    bandwidth: Option<f64>,
    collective: Option<Arc<dyn Collective<B>>>,
) -> anyhow::Result<()> {
    let world_size = collective.as_ref().map_or(1, |c| c.world_size());
    let rank = collective.as_ref().map_or(0, |c| c.rank());
    let batches = match (args.batch.is_empty(), args.mode) {
        (false, _) => args.batch.clone(),
        (true, Mode::Train) => vec![8],
        (true, Mode::Generate) => vec![64, 256],
    };
    if batches.contains(&0) {
        bail!("--batch must be positive");
    }
    backend
        .set_batch_invariant(args.exact_logprobs)
        .context("--exact-logprobs")?;
    let device = backend.name();
    let params = config.num_parameters();
    let num_layers = config.num_hidden_layers;
    let mut recomputed_layers = 0;
    if args.mode == Mode::Train {
        let placement = if args.offload_optimizer {
            OptimizerPlacement::Host
        } else {
            OptimizerPlacement::Device
        };
        let plan = MemoryPlan::new(&PlanInputs {
            model: &config,
            lora: None,
            base_resident: false,
            device: args.device,
            placement,
            optimizer_shards: if args.zero_stage >= 1 { world_size } else { 1 },
            gradient_shards: args.zero_stage == 2,
            data_parallel_ranks: world_size,
            recompute: args.recompute,
            // No sampler runs, so the KV cache needs no room.
            kv_cache_tokens_wanted: 0,
            kv_cache_bytes: None,
            max_tokens_per_microbatch: batches.iter().max().copied().unwrap_or(1) * args.seq,
            budget_bytes: backend.memory_info().map(|(free, _)| free),
            reserved_by_others: 0,
        });
        if rank == 0 {
            eprintln!("{plan}");
        }
        plan.check()?;
        recomputed_layers = plan.recomputed_layers;
    }
    let loading = Instant::now();
    let model = match &collective {
        Some(ranks) if args.tensor_parallel => {
            let ranks = Arc::clone(ranks);
            match &dir {
                Some(dir) => tensor_parallel::load_dir(Arc::clone(&backend), dir, ranks)
                    .with_context(|| {
                        format!("loading rank {rank}'s slices of {}", dir.display())
                    })?,
                None => tensor_parallel::new_random(Arc::clone(&backend), &config, 0, ranks)?,
            }
        }
        _ => load_model(Arc::clone(&backend), config, dir.as_ref())?,
    };
    backend.synchronize()?;
    eprintln!(
        "weights {} in {:.1}s",
        if dir.is_some() { "loaded" } else { "made" },
        loading.elapsed().as_secs_f64()
    );
    let mut results = Vec::new();
    match args.mode {
        Mode::Train => {
            if args.seq < 2 || args.iters == 0 {
                bail!("train needs --seq of at least 2 and --iters of at least 1");
            }
            let mut policy = Policy::new(model);
            let placement = if args.offload_optimizer {
                OptimizerPlacement::Host
            } else {
                OptimizerPlacement::Device
            };
            if let Some(collective) = &collective {
                policy.broadcast_weights(&**collective, 0)?;
            }
            match &collective {
                Some(collective) if args.zero_stage >= 1 => {
                    policy.shard_optimizer(Arc::clone(collective), placement)?;
                    if args.zero_stage == 2 {
                        policy.shard_gradients()?;
                    }
                }
                _ => policy.set_optimizer_placement(placement)?,
            }
            policy.set_recomputed_layers(recomputed_layers);
            for &batch in &batches {
                let mut result = bench_train(
                    &mut policy,
                    args,
                    batch,
                    cuda.as_deref(),
                    collective.as_deref(),
                )?;
                result["recomputed_layers"] = json!(recomputed_layers);
                result["recomputed"] = json!(format!("{recomputed_layers}/{num_layers}"));
                results.push(result);
            }
        }
        Mode::Generate => {
            if args.prompt == 0 || args.new == 0 {
                bail!("generate needs --prompt and --new of at least 1");
            }
            for &batch in &batches {
                let mut result = bench_generate(&model, args, batch, cuda.as_deref())?;
                if let Some(bandwidth) = bandwidth {
                    let shape = DecodeShape {
                        batch,
                        samples_per_prompt: args.samples_per_prompt,
                        prompt: args.prompt,
                        new: args.new,
                    };
                    let roofline = decode_roofline(model.config(), shape, bandwidth);
                    result["bandwidth_gb_s"] = json!(bandwidth / 1e9);
                    result["roofline_new_tok_s"] = json!(roofline);
                    result["roofline_share"] =
                        json!(result["new_tok_s"].as_f64().unwrap_or(0.0) / roofline);
                }
                results.push(result);
            }
        }
    }
    if rank != 0 && (args.mode == Mode::Train || args.tensor_parallel) {
        // Rank 0 reports the group: its steps wait for every rank's gradients, or every
        // rank ran the same steps over its part of the model.
        return Ok(());
    }
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_string));
    for result in &mut results {
        let extra = json!({
            "model": args.model,
            "params": params,
            "device": device,
            "load_avg_1m": load,
            "rank": rank,
            "world_size": world_size,
        });
        result
            .as_object_mut()
            .expect("results are objects")
            .extend(extra.as_object().expect("object").clone());
    }
    if !args.json {
        print_table(args.mode, &results);
    }
    for result in &results {
        println!("RESULT {result}");
    }
    Ok(())
}

/// Tokens in `1..vocab − 100` from a fixed xorshift stream (the peer draws below
/// `vocab − 100` too).
fn random_tokens(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let range = vocab.saturating_sub(101).max(1) as u64;
    let mut x = seed.wrapping_mul(GAMMA) | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            1 + (x % range) as u32
        })
        .collect()
}

fn bench_train<B: Backend>(
    policy: &mut Policy<B>,
    args: &Args,
    batch: usize,
    cuda: Option<&CudaBackend>,
    collective: Option<&dyn Collective<B>>,
) -> anyhow::Result<Value> {
    let vocab = policy.model().config().vocab_size;
    let (rank, world_size) = collective.map_or((0, 1), |c| (c.rank(), c.world_size()));
    // Each rank trains its own sequences.
    let first = rank * batch;
    let sequences: Vec<Vec<u32>> = (first..first + batch)
        .map(|i| random_tokens(args.seq, vocab, i as u64 + 1))
        .collect();
    let packed = PackedBatch::from_sequences(&sequences)?;
    let rows = packed.len();
    let optim = OptimParams {
        lr: 1e-6,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        max_grad_norm: 1.0,
    };
    let backend = Arc::clone(policy.model().backend());
    // Seconds of the last step's optimizer update (after a synchronize, so the backward
    // is not counted in it).
    let mut optim_s = 0.0;
    let mut step = |policy: &mut Policy<B>| -> anyhow::Result<()> {
        policy.forward_backward(&packed, 1.0, &mut |_| {
            Ok((vec![-0.01 / rows as f64; rows], vec![0.0; rows]))
        })?;
        backend.synchronize()?;
        let start = Instant::now();
        match collective {
            Some(collective) => policy.optim_step_data_parallel(&optim, collective)?,
            None => policy.optim_step(&optim)?,
        };
        backend.synchronize()?;
        optim_s = start.elapsed().as_secs_f64();
        Ok(())
    };
    for i in 0..args.warmup {
        let start = Instant::now();
        step(policy)?;
        eprintln!(
            "warmup step {} of {}: {:.2}s",
            i + 1,
            args.warmup,
            start.elapsed().as_secs_f64()
        );
    }
    let start = Instant::now();
    for i in 0..args.iters {
        step(policy)?;
        eprintln!(
            "timed step {} of {}: {:.2}s so far",
            i + 1,
            args.iters,
            start.elapsed().as_secs_f64()
        );
    }
    let step_s = start.elapsed().as_secs_f64() / args.iters as f64;
    let in_use_gib = backend
        .memory_info()
        .map(|(free, total)| (total - free) as f64 / f64::from(1 << 30));
    let tok_s = (batch * args.seq) as f64 / step_s;
    let params = policy.model().config().num_parameters() as f64;
    if let Some(profiler) = cuda.filter(|_| args.profile) {
        let start = Instant::now();
        profiler.start_profile();
        step(policy)?;
        let kernels = profiler.finish_profile()?;
        print_profile(
            &format!("train step, batch {batch}"),
            &kernels,
            start.elapsed().as_secs_f64(),
        );
    }
    Ok(json!({
        "mode": "train",
        "batch": batch,
        "seq": args.seq,
        "recompute": args.recompute.to_string(),
        "offload_optimizer": args.offload_optimizer,
        "exact_logprobs": args.exact_logprobs,
        "zero_stage": args.zero_stage,
        "tok_s": tok_s,
        "tok_s_all_gpus": tok_s * world_size as f64,
        "step_s": step_s,
        "optim_s": optim_s,
        "device_gib_in_use": in_use_gib,
        "mfu_6n": 6.0 * params * tok_s / PEAK_FLOPS,
        "iters": args.iters,
        "warmup": args.warmup,
    }))
}

fn bench_generate<B: Backend>(
    model: &Transformer<B>,
    args: &Args,
    batch: usize,
    cuda: Option<&CudaBackend>,
) -> anyhow::Result<Value> {
    let group = args.samples_per_prompt;
    if group == 0 || batch % group != 0 {
        bail!("--samples-per-prompt {group} must divide --batch {batch} (sequences = prompts × samples)");
    }
    let config = SamplerConfig {
        // Room for every sequence at full length, so nothing is preempted: a prompt's
        // blocks once per group, a block of it copied per sample, the new tokens' own.
        num_blocks: (batch / group) * args.prompt.div_ceil(16)
            + batch * (args.new.div_ceil(16) + 2),
        block_size: 16,
        max_tokens_per_step: args.max_tokens_per_step.max(batch),
        max_running_seqs: batch,
        seed: 0,
        speculative: args.speculative_ngram.map(NgramSpec::with_max_draft),
    };
    if let Some(problem) = config.speculative.as_ref().and_then(NgramSpec::problem) {
        bail!("--speculative-ngram: {problem}");
    }
    let vocab = model.config().vocab_size;
    let requests = |new: usize| -> Vec<SampleRequest> {
        (0..batch / group)
            .map(|i| SampleRequest {
                id: i as u64,
                prompt: random_tokens(args.prompt, vocab, 1000 + i as u64),
                n: group,
                params: SamplingParams {
                    temperature: args.temperature,
                    max_new_tokens: new,
                    seed: Some(i as u64),
                    force_full_length: true,
                    ..SamplingParams::default()
                },
            })
            .collect()
    };
    let mut sampler = Sampler::new(model, config)?;
    // Warm-up, as the peer does: the same batch for a few tokens.
    sampler.generate(model, requests(args.new.min(8)))?;
    sampler.reset_stats();
    model.backend().synchronize()?;
    let graphs_before = cuda.map(CudaBackend::graph_counts);
    let start = Instant::now();
    let generations = sampler.generate(model, requests(args.new))?;
    model.backend().synchronize()?;
    let seconds = start.elapsed().as_secs_f64();
    // Decode steps captured as CUDA graphs, replayed, or run eagerly in the timed run.
    let graphs = cuda.zip(graphs_before).map(|(cuda, before)| {
        let after = cuda.graph_counts();
        json!({
            "captured": after.captured - before.captured,
            "replayed": after.replayed - before.replayed,
            "eager": after.eager - before.eager,
        })
    });
    let new_tokens: usize = generations.iter().map(|g| g.tokens.len()).sum();
    let stats = sampler.stats();
    let result = json!({
        "mode": "gen",
        "batch": batch,
        "prompt": args.prompt,
        "samples_per_prompt": group,
        "new": args.new,
        "new_tok_s": new_tokens as f64 / seconds,
        "seconds": seconds,
        "temperature": args.temperature,
        "speculative_ngram": args.speculative_ngram,
        "exact_logprobs": args.exact_logprobs,
        "steps": stats.steps,
        "new_tokens_per_call": new_tokens as f64 / stats.steps as f64,
        "draft_tokens": stats.draft_tokens,
        "accepted_draft_tokens": stats.accepted_draft_tokens,
        "acceptance": stats.accepted_draft_tokens as f64 / stats.draft_tokens.max(1) as f64,
        "preemptions": stats.preemptions,
        "model_s": stats.model_time.as_secs_f64(),
        "enqueue_s": stats.enqueue_time.as_secs_f64(),
        "graphs": graphs,
    });
    if let Some(profiler) = cuda.filter(|_| args.profile) {
        let start = Instant::now();
        profiler.start_profile();
        sampler.generate(model, requests(args.new))?;
        let kernels = profiler.finish_profile()?;
        print_profile(
            &format!("generation, batch {batch}"),
            &kernels,
            start.elapsed().as_secs_f64(),
        );
    }
    Ok(result)
}

/// A generation benchmark's batch, as [`decode_roofline`] reads it.
#[derive(Clone, Copy, Debug)]
struct DecodeShape {
    batch: usize,
    samples_per_prompt: usize,
    prompt: usize,
    new: usize,
}

/// New tokens/s if every decode step read only what it must from device memory at
/// `bandwidth` bytes/s: the bf16 weights once, and the KV cache once, a shared prompt's
/// once for its group. With every sample decoding at once, step `j` of `new` holds the
/// prompts and `j` tokens of each sample. Prefill is left out (it is compute-bound).
fn decode_roofline(config: &ModelConfig, shape: DecodeShape, bandwidth: f64) -> f64 {
    let bf16 = 2.0;
    let weights = config.num_parameters() as f64 * bf16;
    // K and V of one token in every layer.
    let kv_per_token = (config.num_hidden_layers * config.num_key_value_heads * config.head_dim)
        as f64
        * 2.0
        * bf16;
    let (b, n) = (shape.batch as f64, shape.new as f64);
    let prompts = (shape.batch / shape.samples_per_prompt.max(1)) as f64;
    let kv_tokens = n * prompts * shape.prompt as f64 + b * n * (n + 1.0) / 2.0;
    let seconds = (n * weights + kv_tokens * kv_per_token) / bandwidth;
    b * n / seconds
}

fn print_table(mode: Mode, results: &[Value]) {
    let field = |r: &Value, key: &str| r[key].to_string();
    match mode {
        Mode::Train => {
            println!(
                "{:<8} {:>6} {:>6} {:>10} {:>12} {:>9}",
                "model", "batch", "seq", "recomputed", "tokens/s", "step s"
            );
            for r in results {
                println!(
                    "{:<8} {:>6} {:>6} {:>10} {:>12.1} {:>9.3}",
                    r["model"].as_str().unwrap_or("?"),
                    field(r, "batch"),
                    field(r, "seq"),
                    r["recomputed"].as_str().unwrap_or("?"),
                    r["tok_s"].as_f64().unwrap_or(0.0),
                    r["step_s"].as_f64().unwrap_or(0.0),
                );
            }
        }
        Mode::Generate => {
            println!(
                "{:<8} {:>6} {:>7} {:>5} {:>14} {:>9} {:>10} {:>7} {:>9} {:>6}",
                "model",
                "batch",
                "prompt",
                "new",
                "new tokens/s",
                "seconds",
                "tok/call",
                "accept",
                "roofline",
                "host"
            );
            for r in results {
                let accept = if r["speculative_ngram"].is_null() {
                    "-".to_string()
                } else {
                    format!("{:.3}", r["acceptance"].as_f64().unwrap_or(0.0))
                };
                let roofline = r["roofline_share"]
                    .as_f64()
                    .map_or("-".to_string(), |share| format!("{:.0}%", share * 100.0));
                // The host's share of the model's time spent queueing its ops: near 100%
                // the device waits for the host (launch-bound).
                let host = r["enqueue_s"]
                    .as_f64()
                    .zip(r["model_s"].as_f64())
                    .map_or("-".to_string(), |(enqueue, model)| {
                        format!("{:.0}%", 100.0 * enqueue / model.max(1e-9))
                    });
                println!(
                    "{:<8} {:>6} {:>7} {:>5} {:>14.1} {:>9.3} {:>10.2} {:>7} {:>9} {:>6}",
                    r["model"].as_str().unwrap_or("?"),
                    field(r, "batch"),
                    field(r, "prompt"),
                    field(r, "new"),
                    r["new_tok_s"].as_f64().unwrap_or(0.0),
                    r["seconds"].as_f64().unwrap_or(0.0),
                    r["new_tokens_per_call"].as_f64().unwrap_or(0.0),
                    accept,
                    roofline,
                    host,
                );
            }
        }
    }
}

/// The per-kernel GPU times of one profiled run, largest first, with each one's share of
/// the summed kernel time; kernels under 0.5 % are folded into one line.
fn print_profile(what: &str, kernels: &[KernelTime], wall_s: f64) {
    let total_ms: f64 = kernels.iter().map(|k| k.total_ms).sum();
    println!(
        "profile of one {what}: {:.1} ms of kernels in {:.1} ms wall (events on)",
        total_ms,
        wall_s * 1e3
    );
    println!("{:>9} {:>6} {:>7}  kernel", "ms", "share", "calls");
    let (shown, folded): (Vec<&KernelTime>, Vec<&KernelTime>) =
        kernels.iter().partition(|k| k.total_ms >= 0.005 * total_ms);
    for k in shown {
        println!(
            "{:>9.2} {:>5.1}% {:>7}  {}",
            k.total_ms,
            100.0 * k.total_ms / total_ms,
            k.calls,
            k.name
        );
    }
    if !folded.is_empty() {
        let ms: f64 = folded.iter().map(|k| k.total_ms).sum();
        let calls: usize = folded.iter().map(|k| k.calls).sum();
        println!(
            "{:>9.2} {:>5.1}% {:>7}  ({} smaller kernels)",
            ms,
            100.0 * ms / total_ms,
            calls,
            folded.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_roofline_of_the_issue_shapes() {
        let config = ModelConfig::preset("1.7B").unwrap();
        let h100 = 3.35e12;
        let shape = |batch, samples_per_prompt, prompt, new| DecodeShape {
            batch,
            samples_per_prompt,
            prompt,
            new,
        };
        // Issue 23: ~58k new tokens/s at batch 256, 256 + 256 on an H100.
        let roofline = decode_roofline(&config, shape(256, 1, 256, 256), h100);
        assert!((57e3..59.5e3).contains(&roofline), "{roofline}");
        // Sharing a prompt between samples reads it once a group: 16 samples of a
        // 4096-token prompt are about 6x faster at the roofline than 128 distinct ones.
        let shared = decode_roofline(&config, shape(128, 16, 4096, 512), h100);
        let distinct = decode_roofline(&config, shape(128, 1, 4096, 512), h100);
        assert!((35e3..42e3).contains(&shared), "{shared}");
        assert!(shared > 5.0 * distinct, "{shared} {distinct}");
        // Twice the bandwidth, twice the roofline.
        let h200 = decode_roofline(&config, shape(256, 1, 256, 256), 2.0 * h100);
        assert!((h200 / roofline - 2.0).abs() < 1e-9);
    }
}
