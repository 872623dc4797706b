//! `floe serve`: the Tinker-protocol server, so the `tinker` SDK and cookbook train and
//! sample floe models over HTTP (`TINKER_BASE_URL=http://HOST:PORT`).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use floe_engine::policy::OptimizerPlacement;
use floe_engine::Device;
use floe_engine::{LocalEngineOptions, NgramSpec, Recompute};
use floe_server::{ApiKeys, Auth, Catalog, SampleBatchLimits, ServerConfig};

/// Environment variable with comma-separated accepted API keys.
const API_KEYS_ENV: &str = "FLOE_API_KEYS";

/// Flags of `floe serve`.
#[derive(clap::Args)]
pub struct Args {
    /// A base model clients may train: `NAME=PATH`, where NAME is the `base_model` string
    /// clients send (e.g. `Qwen/Qwen3-0.6B`) and PATH a Hugging Face folder or an
    /// embedded model (`embedded:tiny`, `embedded:1.7B`, ...: random weights of that
    /// shape). Every model is checked at start. Repeat for several.
    #[arg(long = "model", value_name = "NAME=PATH", required = true)]
    models: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// File of accepted API keys, `KEY  # NAME` a line, re-read when it changes: `floe
    /// keys issue|revoke|list --file` manages it while the server runs. Keys in
    /// FLOE_API_KEYS (comma-separated) are accepted too.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Accept requests without a key; only on a loopback host.
    #[arg(long)]
    insecure_loopback: bool,
    /// Folder for checkpoints saved by clients.
    #[arg(long, default_value = "floe-serve-data")]
    data_dir: PathBuf,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// CPU threads; 0 uses every core.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Share of the GPU memory free when an engine is built that it may use; its KV
    /// cache gets what its weights, optimizer and one step leave. Engines are admitted
    /// one at a time and refused at creation, naming what to change, when they do not fit
    /// beside those already resident.
    #[arg(long, default_value_t = 0.8)]
    memory_fraction: f64,
    /// KV cache of each engine in GiB, instead of all that its memory share leaves: set
    /// it to host several engines on one GPU.
    #[arg(long)]
    kv_cache_gib: Option<f64>,
    /// Most tokens in one training micro-batch (a client's engine setting overrides it).
    #[arg(long, default_value_t = 4096)]
    max_tokens_per_microbatch: usize,
    /// Which layers' activations each engine's backward recomputes (less memory, a layer's
    /// forward more per recomputed layer): `auto` the fewest that fit beside the KV cache's
    /// minimum or `--kv-cache-gib`, `true` (or the bare flag) all, `false` none, or a
    /// number of layers. A client's engine setting `recompute` overrides it.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "true")]
    recompute: Recompute,
    /// Keep f32 master weights and AdamW moments of full-parameter engines in host
    /// memory (an 8B model on one 80 GB card).
    #[arg(long)]
    offload_optimizer: bool,
    /// Speculative decoding with prompt-lookup drafts of up to K tokens, matching the
    /// last 3 down to 1 tokens: the same samples in fewer model calls when outputs repeat
    /// their prompt (`engine.speculative_ngram`).
    #[arg(long, value_name = "K")]
    speculative_ngram: Option<usize>,
    /// Seconds `retrieve_future` holds a poll before answering `try_again`.
    #[arg(long, default_value_t = 30)]
    long_poll_secs: u64,
    /// Seconds a finished request's result stays retrievable.
    #[arg(long, default_value_t = 3600)]
    future_expiry_secs: u64,
    /// Seconds a session lives without a heartbeat (the SDK sends one every 10 s); an
    /// expired session's models and samplers are dropped.
    #[arg(long, default_value_t = 600)]
    session_expiry_secs: u64,
    /// Largest request body in MiB (after decompression).
    #[arg(long, default_value_t = 256)]
    max_body_mib: usize,
    /// Unfinished requests per model before answering 429.
    #[arg(long, default_value_t = 1024)]
    max_queued: usize,
    /// Most samples (`n` summed over requests) of unanswered requests in one engine's
    /// running batch; a request beyond waits and joins as the batch's requests finish.
    #[arg(long, default_value_t = SampleBatchLimits::default().max_samples)]
    max_batch_samples: usize,
    /// Most KV positions (`n × (prompt + max new tokens)` summed) of unanswered requests
    /// in one such batch.
    #[arg(long, default_value_t = SampleBatchLimits::default().max_tokens)]
    max_batch_tokens: usize,
}

/// Runs `floe serve` until the process is stopped.
pub fn run(args: Args) -> anyhow::Result<()> {
    if !(args.memory_fraction > 0.0 && args.memory_fraction <= 1.0) {
        bail!(
            "--memory-fraction {} is outside (0, 1]",
            args.memory_fraction
        );
    }
    if args
        .kv_cache_gib
        .is_some_and(|gib| gib.is_nan() || gib <= 0.0)
    {
        bail!("--kv-cache-gib must be a positive number of GiB");
    }
    if args.max_batch_samples == 0 || args.max_batch_tokens == 0 {
        bail!("--max-batch-samples and --max-batch-tokens must be positive");
    }
    if args.max_tokens_per_microbatch == 0 {
        bail!("--max-tokens-per-microbatch must be positive");
    }
    let catalog = Catalog::from_specs(&args.models).map_err(anyhow::Error::msg)?;
    catalog.check().map_err(anyhow::Error::msg)?;
    let auth = auth(&args)?;
    // Clients tokenize (the cookbook looks tokenizers up by model name), so say where
    // each served model's tokenizer loads from.
    let tokenizers = catalog
        .tokenizer_dirs(&args.data_dir.join("tokenizers"))
        .map_err(anyhow::Error::msg)?;
    for (name, dir) in tokenizers {
        eprintln!("tokenizer of {name}: {}", dir.display());
    }
    let config = ServerConfig {
        catalog,
        data_dir: args.data_dir,
        auth,
        engine: LocalEngineOptions {
            device: args.device,
            threads: args.threads,
            memory_fraction: args.memory_fraction,
            kv_cache_bytes: args
                .kv_cache_gib
                .map(|gib| (gib * f64::from(1 << 30)) as usize),
            max_tokens_per_microbatch: args.max_tokens_per_microbatch,
            recompute: args.recompute,
            optimizer_placement: if args.offload_optimizer {
                OptimizerPlacement::Host
            } else {
                OptimizerPlacement::Device
            },
            speculative_ngram: args.speculative_ngram.map(NgramSpec::with_max_draft),
            ..LocalEngineOptions::default()
        },
        long_poll: Duration::from_secs(args.long_poll_secs),
        future_expiry: Duration::from_secs(args.future_expiry_secs),
        session_expiry: Duration::from_secs(args.session_expiry_secs),
        max_body_bytes: args.max_body_mib << 20,
        max_queued_per_engine: args.max_queued.max(1),
        sample_batch: SampleBatchLimits {
            max_samples: args.max_batch_samples,
            max_tokens: args.max_batch_tokens,
        },
    };
    floe_server::serve_blocking(&args.host, args.port, config)
}

fn auth(args: &Args) -> anyhow::Result<Auth> {
    if args.insecure_loopback {
        let loopback = args.host == "localhost"
            || args.host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
        if !loopback {
            bail!(
                "--insecure-loopback serves without API keys, so it needs a loopback --host (127.0.0.1 or ::1), not {}",
                args.host
            );
        }
        return Ok(Auth::InsecureLoopback);
    }
    let env_keys: Vec<String> = std::env::var(API_KEYS_ENV)
        .map(|env| {
            env.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let keys = match &args.api_key_file {
        Some(file) => {
            if !file.is_file() {
                bail!(
                    "--api-key-file {}: no such file; issue a key into it with `floe keys issue --file {} --name NAME`",
                    file.display(),
                    file.display()
                );
            }
            ApiKeys::with_file(env_keys, file).map_err(|e| anyhow::anyhow!("--api-key-file {e}"))?
        }
        None if env_keys.is_empty() => {
            bail!("no API keys: give --api-key-file or {API_KEYS_ENV}, or --insecure-loopback on 127.0.0.1")
        }
        None => ApiKeys::fixed(env_keys),
    };
    Ok(Auth::Keys(Arc::new(keys)))
}
