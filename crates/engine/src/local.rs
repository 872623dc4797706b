//! [`LocalEngine`]: the [`Engine`] verbs in this process, on one device.
//!
//! One [`Policy`] holds the weights, their gradients and the AdamW moments; the
//! [`Sampler`] generates from those very buffers (no second copy, no weight transfer);
//! an optional frozen reference [`Transformer`] scores the KL term.
//!
//! Training calls pack their groups with [`pack_rollouts`] (each prompt once per
//! micro-batch, shared as a prefix by its responses) under
//! [`LocalEngineOptions::max_tokens_per_microbatch`], run the model per micro-batch and
//! scatter the per-row outputs back to (group, response, token). The policy loss of every
//! micro-batch is normalised by one [`GlobalNorm`] of the whole call, so how a call is
//! split changes neither its loss nor its gradients (up to float summation order).
//!
//! [`AnyLocalEngine`] picks the backend from the configured device, so the RL loop holds
//! one concrete type whatever the device.

use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use floe_backend::cpu::CpuBackend;
use floe_backend::cuda::{CudaBackend, NcclCollective};
use floe_backend::{Backend, Collective, InProcessCollective};
use floe_dist::{Liveness, World};
use floe_model::batch::TokenStats;
use floe_model::lora::{load_adapter_dir, read_adapter_config, LoraConfig};
use floe_model::tokenizer::Tokenizer;
use floe_model::transformer::{BaseStorage, ModelError, Result as ModelResult, Transformer};
use floe_model::weights::{self, HostTensor, SaveDType};
use floe_model::ModelConfig;
use floe_rl::metrics::reduce_micro_batch_metrics;
use floe_rl::tinker::{tinker_loss, TinkerInputs, TinkerLoss, TinkerLossConfig};
use floe_rl::{compute_policy_loss, AlgorithmConfig, GlobalNorm, LossInputs};

use crate::admission::{Gate, Reservation};
use crate::data_parallel::{DataParallel, RankExchange};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory_plan::{MemoryPlan, PlanInputs, Recompute};
use crate::packing::{
    pack_rollouts, MicroBatch, PackingConfig, PackingMode, Response, RolloutGroup,
};
use crate::policy::{
    is_lora_state, OptimParams, OptimizerPlacement, Policy, StepOutcome, ADAPTER_DIR, MODEL_DIR,
};
use crate::sampler::{
    Generation, SampleError, SampleEvent, SampleFeed, SampleFlow, SampleRequest, Sampler,
    SamplerConfig, SamplerStats,
};
use crate::speculative::NgramSpec;
// The two sides are named by path: in scope, their methods would clash with the
// `Engine` verbs they forward to.
use crate::verbs::{
    self, one_after_the_other, Engine, EngineInfo, ForwardBackwardOutput, Loss, SequenceGroup,
    TokenOutputs, TrainGroup, Weights,
};

/// Sub-folder of a saved engine state holding the frozen reference model.
const REFERENCE_DIR: &str = "reference";
/// KV-cache budget when the device cannot report its memory (the CPU).
const DEFAULT_HOST_KV_BYTES: usize = 512 << 20;

/// The sub-folder of a saved engine state that holds the policy's weights as an f32
/// Hugging Face folder (what `floe export` reads).
pub fn saved_model_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(MODEL_DIR)
}

/// How a [`LocalEngine`] is sized.
#[derive(Clone, Debug, PartialEq)]
pub struct LocalEngineOptions {
    /// `cpu` or `cuda:N`.
    pub device: Device,
    /// CPU threads for the process-wide pool; 0 uses every core.
    pub threads: usize,
    /// Which layers' activations the backward recomputes (less memory, same results);
    /// the memory plan resolves [`Recompute::Auto`].
    pub recompute: Recompute,
    /// Tokens the sampler's KV cache should hold at once (a run's concurrent samples at
    /// their longest): [`Recompute::Auto`] recomputes layers rather than leave it less
    /// room; 0 asks only for the smallest useful cache.
    pub kv_cache_tokens_wanted: usize,
    /// Most tokens in one training or scoring micro-batch.
    pub max_tokens_per_microbatch: usize,
    /// Bytes of KV cache; `None` gives it what the engine's memory plan leaves of
    /// `memory_fraction` of the device's free memory, or 512 MiB on the CPU.
    pub kv_cache_bytes: Option<usize>,
    /// Fraction of the device's free memory the engine may use.
    pub memory_fraction: f64,
    /// Token slots per KV block.
    pub block_size: usize,
    /// Most tokens (prefill plus decode) in one sampler step.
    pub max_tokens_per_step: usize,
    /// Most samples generating at once.
    pub max_running_seqs: usize,
    /// Speculative decoding with prompt-lookup drafts (`engine.speculative_ngram`).
    pub speculative_ngram: Option<NgramSpec>,
    /// Batch-invariant kernels on the log-prob path (`engine.exact_logprobs`): a sampled
    /// token's log-prob equals, bit for bit, the one `forward` and `forward_backward`
    /// compute for it (`docs/exact-logprobs.md`). The CPU has them; a device without
    /// them refuses the engine.
    pub exact_logprobs: bool,
    /// Seed of sampling requests that bring none.
    pub seed: u64,
    /// Storage dtype of [`Engine::export_hf`].
    pub export_dtype: SaveDType,
    /// Where the optimizer keeps the f32 master weights and AdamW moments
    /// ([`OptimizerPlacement::Host`]: host memory, for models whose optimizer state does
    /// not fit the device).
    pub optimizer_placement: OptimizerPlacement,
    /// ZeRO stage of a data-parallel engine (`engine.zero_stage`): 0 keeps the whole
    /// optimizer state on every rank; 1 splits the f32 masters and AdamW moments over the
    /// ranks ([`Policy::shard_optimizer`]); 2 splits the f32 gradients too
    /// ([`Policy::shard_gradients`]). An engine without a collective has nothing to
    /// split and ignores it; a group of one rank runs the sharded code on whole shards.
    pub zero_stage: u8,
}

impl Default for LocalEngineOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            threads: 0,
            recompute: Recompute::Auto,
            kv_cache_tokens_wanted: 0,
            max_tokens_per_microbatch: 4096,
            kv_cache_bytes: None,
            memory_fraction: 0.8,
            block_size: 16,
            max_tokens_per_step: 2048,
            max_running_seqs: 256,
            speculative_ngram: None,
            exact_logprobs: false,
            seed: 0,
            export_dtype: SaveDType::BF16,
            optimizer_placement: OptimizerPlacement::Device,
            zero_stage: 0,
        }
    }
}

/// Where the initial weights come from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A Hugging Face folder (`config.json` and safetensors).
    Dir(PathBuf),
    /// Normal(0, 0.02) weights of this shape from `seed` (tests, benchmarks, the
    /// embedded model before its warm start).
    Random {
        /// The shape.
        config: ModelConfig,
        /// Seed of the weights.
        seed: u64,
    },
    /// Weights already on the host.
    Host {
        /// The shape.
        config: ModelConfig,
        /// Tensors named as in [`floe_model::weights::tensor_specs`].
        weights: BTreeMap<String, HostTensor>,
    },
    /// Base weights loaded once and shared by every engine built from the handle.
    Shared(SharedBase),
    /// LoRA adapters on a frozen base: only the adapters train.
    Lora {
        /// The base weights.
        base: Box<ModelSource>,
        /// The adapters.
        adapters: AdapterSource,
    },
}

/// Where the adapters of a [`ModelSource::Lora`] come from.
#[derive(Clone, Debug)]
pub enum AdapterSource {
    /// Fresh adapters (B zero: the model starts equal to its base).
    Fresh(LoraConfig),
    /// A PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`).
    Dir(PathBuf),
}

/// Base weights that several engines read without copies (LoRA sessions on one base).
///
/// The first engine built from the handle loads the weights (others wait for it), and
/// every engine gets a model that shares them ([`Transformer::share_base`]), so they stay
/// frozen while shared: build LoRA policies on it ([`ModelSource::Lora`]). Clones are
/// the same handle; the weights live as long as any handle or model holds them. The
/// engines must run on one kind of device (the first one's).
#[derive(Clone)]
pub struct SharedBase {
    source: Arc<ModelSource>,
    loaded: Arc<OnceLock<std::result::Result<Arc<dyn Any + Send + Sync>, String>>>,
}

impl std::fmt::Debug for SharedBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBase")
            .field("source", &self.source)
            .field("loaded", &self.loaded.get().map(|l| l.is_ok()))
            .finish()
    }
}

impl SharedBase {
    /// A handle on the weights of `source`, loaded when the first engine needs them.
    pub fn new(source: ModelSource) -> Self {
        Self {
            source: Arc::new(source),
            loaded: Arc::new(OnceLock::new()),
        }
    }

    /// A model over the shared weights, loading them onto `backend` on first use.
    fn model<B: Backend>(&self, backend: Arc<B>) -> Result<Transformer<B>> {
        let loaded = self.loaded.get_or_init(|| {
            // Frozen while shared, so the Full masters would never be read.
            let model = (*self.source)
                .clone()
                .load(backend, BaseStorage::ComputeOnly)
                .map_err(|e| e.to_string())?;
            Ok(Arc::new(model) as Arc<dyn Any + Send + Sync>)
        });
        let loaded = loaded
            .as_ref()
            .map_err(|e| Error::InvalidRequest(format!("loading the shared base failed: {e}")))?;
        let base = loaded.downcast_ref::<Transformer<B>>().ok_or_else(|| {
            Error::InvalidRequest(
                "the shared base was loaded on another kind of device than this engine's".into(),
            )
        })?;
        Ok(base.share_base()?)
    }
}

/// The weights of a saved engine state as a [`ModelSource`]: its Hugging Face folder,
/// or for a LoRA state its adapters on `base` (the base model it was trained from).
pub fn saved_weights_source(state_dir: &Path, base: ModelSource) -> ModelSource {
    if is_lora_state(state_dir) {
        ModelSource::Lora {
            base: Box::new(base),
            adapters: AdapterSource::Dir(state_dir.join(ADAPTER_DIR)),
        }
    } else {
        ModelSource::Dir(saved_model_dir(state_dir))
    }
}

impl ModelSource {
    /// The model's shape and the adapters that train on it, read without loading weights.
    fn shape(&self) -> Result<(ModelConfig, Option<LoraConfig>)> {
        Ok(match self {
            ModelSource::Dir(dir) => (ModelConfig::from_hf_file(dir.join("config.json"))?, None),
            ModelSource::Random { config, .. } | ModelSource::Host { config, .. } => {
                (config.clone(), None)
            }
            ModelSource::Shared(shared) => shared.source.shape()?,
            ModelSource::Lora { base, adapters } => {
                let lora = match adapters {
                    AdapterSource::Fresh(config) => config.clone(),
                    AdapterSource::Dir(dir) => read_adapter_config(dir)?,
                };
                (base.shape()?.0, Some(lora))
            }
        })
    }

    /// Whether the base weights are already on the device (a shared base another engine
    /// loaded), so they cost this engine nothing.
    fn base_is_resident(&self) -> bool {
        match self {
            ModelSource::Shared(shared) => shared.loaded.get().is_some(),
            ModelSource::Lora { base, .. } => base.base_is_resident(),
            _ => false,
        }
    }

    /// The model on `backend`, its base weights kept as `storage` says.
    fn load<B: Backend>(self, backend: Arc<B>, storage: BaseStorage) -> Result<Transformer<B>> {
        Ok(match self {
            ModelSource::Dir(dir) => {
                let (config, host) = weights::load_model_dir(&dir)?;
                Transformer::from_host_weights_stored(backend, config, &host, storage)?
            }
            ModelSource::Random { config, seed } => {
                Transformer::new_random_stored(backend, config, seed, storage)?
            }
            ModelSource::Host { config, weights } => {
                Transformer::from_host_weights_stored(backend, config, &weights, storage)?
            }
            ModelSource::Shared(shared) => shared.model(backend)?,
            ModelSource::Lora { base, adapters } => {
                // The base stays frozen under the adapters.
                let base = base.load(backend, BaseStorage::ComputeOnly)?;
                match adapters {
                    AdapterSource::Fresh(config) => base.with_lora(config)?,
                    AdapterSource::Dir(dir) => {
                        let (config, tensors) = load_adapter_dir(&dir)?;
                        base.with_lora_weights(config, &tensors)?
                    }
                }
            }
        })
    }
}

/// The [`Engine`] verbs in this process, over one backend; see the module docs.
pub struct LocalEngine<B: Backend> {
    info: EngineInfo,
    options: LocalEngineOptions,
    policy: Policy<B>,
    reference: Option<Transformer<B>>,
    /// `None` only while [`Engine::overlap`] lends it to its sampling thread.
    sampler: Option<Sampler<Transformer<B>>>,
    sampler_config: SamplerConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    plan: MemoryPlan,
    /// The device memory kept free for this engine's steps (GPU engines).
    admission: Option<Reservation>,
    /// The data-parallel group this engine is one rank of, if any.
    data_parallel: Option<DataParallel<B>>,
    /// The second queue [`Engine::overlap`] samples on ([`Backend::fork`] of the policy's
    /// backend: on CUDA a stream with its own cuBLAS handle), made on first use.
    sampling_backend: Option<Arc<B>>,
}

impl<B: Backend> LocalEngine<B> {
    /// An engine over `backend` with the weights of `source`. The tokenizer, when given,
    /// detokenizes for stop strings and is exported with the weights.
    pub fn new(
        backend: Arc<B>,
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        options: LocalEngineOptions,
    ) -> Result<Self> {
        Self::build(backend, source, tokenizer, options, None)
    }

    /// An engine that is rank `collective.rank()` of a data-parallel group (DDP
    /// semantics; `docs/distributed.md`): it starts from rank 0's weights, each
    /// `forward_backward` takes this rank's share of the mini-batch (every rank calls it,
    /// a rank with no share with no groups) and reports the whole mini-batch's loss and
    /// metrics, and each `optim_step` applies the step one engine would take on the
    /// whole mini-batch, the same on every rank. Every rank calls the training verbs in
    /// the same order; sampling and scoring stay per rank. Errors on one rank fail the
    /// group's next collective on the others.
    pub fn new_data_parallel(
        backend: Arc<B>,
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        options: LocalEngineOptions,
        collective: Arc<dyn Collective<B>>,
    ) -> Result<Self> {
        Self::build(backend, source, tokenizer, options, Some(collective))
    }

    fn build(
        backend: Arc<B>,
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        options: LocalEngineOptions,
        collective: Option<Arc<dyn Collective<B>>>,
    ) -> Result<Self> {
        if options.max_tokens_per_microbatch == 0 {
            return Err(Error::InvalidRequest(
                "max_tokens_per_microbatch is 0; give a positive token budget".into(),
            ));
        }
        if let Some(problem) = options
            .speculative_ngram
            .as_ref()
            .and_then(NgramSpec::problem)
        {
            return Err(Error::InvalidRequest(format!(
                "speculative_ngram: {problem}"
            )));
        }
        if options.zero_stage > 2 {
            return Err(Error::InvalidRequest(format!(
                "engine.zero_stage = {}: stages 0 (replicated optimizer state), 1 \
                 (optimizer state split over the ranks) and 2 (gradients split too) exist; \
                 stage 3 is planned (docs/distributed.md)",
                options.zero_stage
            )));
        }
        let (model, lora) = source.shape()?;
        if options.exact_logprobs && lora.as_ref().is_some_and(|l| l.train_unembed) {
            // Sampling adds the unembed adapter's term to the logits, training merges it
            // into the weight: two products, two roundings.
            return Err(Error::InvalidRequest(
                "exact_logprobs with a LoRA unembed adapter: the sampler and the trainer \
                 apply it differently; set train_unembed = false or exact_logprobs = false"
                    .into(),
            ));
        }
        backend
            .set_batch_invariant(options.exact_logprobs)
            .map_err(|source| Error::Device {
                device: options.device.to_string(),
                source,
            })?;
        // One engine at a time is built on a GPU, planning with what the others leave.
        let gate = match options.device {
            Device::Cuda(ordinal) => Some(Gate::enter(ordinal)),
            Device::Cpu => None,
        };
        let plan = memory_plan(
            &*backend,
            &model,
            lora.as_ref(),
            source.base_is_resident(),
            &options,
            gate.as_ref().map_or(0, Gate::reserved),
            match &collective {
                Some(c) if options.zero_stage >= 1 => (c.world_size(), c.world_size()),
                Some(c) => (1, c.world_size()),
                None => (1, 1),
            },
        );
        plan.check()?;
        let mut policy = Policy::new(source.load(Arc::clone(&backend), BaseStorage::Trainable)?);
        if let Some(collective) = &collective {
            policy.broadcast_weights(&**collective, 0)?;
        }
        match &collective {
            Some(collective) if options.zero_stage >= 1 => {
                policy.shard_optimizer(Arc::clone(collective), options.optimizer_placement)?;
                if options.zero_stage == 2 {
                    policy.shard_gradients()?;
                }
            }
            _ => policy.set_optimizer_placement(options.optimizer_placement)?,
        }
        let data_parallel = collective.map(|c| DataParallel::new(c, backend));
        policy.set_recomputed_layers(plan.recomputed_layers);
        // What the plan holds for good is taken now, so the next engine sees it gone.
        policy.allocate_training_state()?;
        let sampler_config = sampler_config(policy.model(), &options, &plan);
        let tokenizer = tokenizer.map(Arc::new);
        let sampler = new_sampler(policy.model(), &sampler_config, &tokenizer)?;
        let info = engine_info(policy.model(), &options, &sampler_config);
        let admission = gate.map(|gate| gate.admit(plan.per_step_bytes()));
        Ok(Self {
            info,
            options,
            policy,
            reference: None,
            sampler: Some(sampler),
            sampler_config,
            tokenizer,
            plan,
            admission,
            data_parallel,
            sampling_backend: None,
        })
    }

    /// The policy: weights and optimizer state (benchmarks, export).
    pub fn policy(&self) -> &Policy<B> {
        &self.policy
    }

    /// The memory plan the engine was admitted with (what it holds, and its KV cache).
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.plan
    }

    /// The sampler's sizes.
    pub fn sampler_config(&self) -> &SamplerConfig {
        &self.sampler_config
    }

    /// The options the engine was built with.
    pub fn options(&self) -> &LocalEngineOptions {
        &self.options
    }

    /// The sampler with what it samples from, outside [`Engine::overlap`].
    fn sampling_view(&mut self) -> SamplingView<'_, B> {
        SamplingView {
            sampler: self
                .sampler
                .as_mut()
                .expect("the sampler is lent out only inside overlap"),
            model: self.policy.model(),
            config: &self.sampler_config,
            tokenizer: &self.tokenizer,
        }
    }

    /// The sampler's work counters since it was last built (reports, benchmarks).
    pub fn sampler_stats(&self) -> &SamplerStats {
        self.sampler
            .as_ref()
            .expect("the sampler is lent out only inside overlap")
            .stats()
    }

    /// Whether [`Engine::overlap`] runs its sides on two threads, each on its own queue of
    /// the device ([`Backend::fork`]: on the CPU both share rayon's pool, on CUDA each has
    /// a stream and cuBLAS handle): for a full-weight policy of one rank. Elsewhere it runs
    /// them one after the other: a LoRA policy's adapters are not in the shared handle,
    /// and a data-parallel rank keeps its collectives on one thread.
    fn overlaps_sampling(&self) -> bool {
        self.policy.model().lora_config().is_none() && self.data_parallel.is_none()
    }

    /// The queue the sampling side of [`Engine::overlap`] runs on.
    fn sampling_backend(&mut self) -> Result<Arc<B>> {
        if self.sampling_backend.is_none() {
            let fork = self.policy.model().backend().fork()?;
            self.sampling_backend = Some(Arc::new(fork));
        }
        Ok(Arc::clone(
            self.sampling_backend.as_ref().expect("set above"),
        ))
    }

    fn packing(&self) -> PackingConfig {
        PackingConfig {
            max_tokens_per_microbatch: self.options.max_tokens_per_microbatch,
            mode: PackingMode::Shared,
        }
    }

    /// A rank whose gradients are sharded reduces them at every backward, with every
    /// other rank, so all run as many backwards in a call: after its own `backwards` it
    /// runs this many of zeros (the most any rank runs, less its own). Every rank asks
    /// before its first backward; 0 where gradients are not sharded.
    fn backwards_short_of_most(&self, backwards: usize) -> Result<usize> {
        match &self.data_parallel {
            Some(dp) if self.policy.shards_gradients() => Ok(dp.max(backwards)? - backwards),
            _ => Ok(0),
        }
    }

    /// Ranks the optimizer state is split over (1 when it is whole), and ranks in all.
    fn optimizer_shards(&self) -> (usize, usize) {
        match &self.data_parallel {
            Some(dp) if self.policy.is_sharded() => {
                (dp.collective.world_size(), dp.collective.world_size())
            }
            Some(dp) => (1, dp.collective.world_size()),
            None => (1, 1),
        }
    }

    /// Rebuilds sampler and info after the model's shape may have changed.
    fn resize_for_model(&mut self) -> Result<()> {
        let model = self.policy.model();
        // The old cache goes first, so the new one can have its memory.
        let smallest = SamplerConfig {
            num_blocks: 1,
            ..SamplerConfig::default()
        };
        self.sampler = Some(new_sampler(model, &smallest, &None)?);
        let plan = memory_plan(
            &**model.backend(),
            model.config(),
            model.lora_config(),
            true,
            &self.options,
            self.admission
                .as_ref()
                .map_or(0, Reservation::reserved_by_others),
            self.optimizer_shards(),
        );
        self.sampler_config = sampler_config(model, &self.options, &plan);
        self.sampler = Some(new_sampler(model, &self.sampler_config, &self.tokenizer)?);
        self.policy.set_recomputed_layers(plan.recomputed_layers);
        self.info = engine_info(self.policy.model(), &self.options, &self.sampler_config);
        Ok(())
    }

    fn check_tokens(&self, what: &str, tokens: &[u32]) -> Result<()> {
        let vocab = self.info.vocab_size;
        match tokens.iter().position(|&t| t as usize >= vocab) {
            Some(i) => Err(Error::InvalidRequest(format!(
                "{what} token {i} is {}, not below the vocabulary size {vocab}",
                tokens[i]
            ))),
            None => Ok(()),
        }
    }

    fn forward_backward_policy(
        &mut self,
        groups: &[TrainGroup],
        config: &AlgorithmConfig,
        logit_scale: f32,
    ) -> Result<ForwardBackwardOutput> {
        config.validate()?;
        let with_rollout = check_train_groups(groups, config)?;
        let mut masks = Vec::new();
        let mut seq_lens = Vec::new();
        let mut group_ids = Vec::new();
        for (g, group) in groups.iter().enumerate() {
            for response in &group.responses {
                masks.extend_from_slice(&response.loss_mask);
                seq_lens.push(response.tokens.len());
                group_ids.push(g as u64);
            }
        }
        let norm = GlobalNorm::of_mini_batch(&masks, &seq_lens, &group_ids);
        let (norm, first_group_id) = match &self.data_parallel {
            Some(dp) => dp.global_norm(&norm, groups.len())?,
            None => (norm, 0),
        };
        let micro_batches = pack_rollouts(&rollout_groups(groups), self.packing())?;
        let missing = self.backwards_short_of_most(micro_batches.len())?;
        let mut loss = 0.0;
        let mut metrics = Vec::with_capacity(micro_batches.len());
        for mb in &micro_batches {
            let mut grad = |stats: &TokenStats| -> ModelResult<(Vec<f64>, Vec<f64>)> {
                let inputs = MicroInputs::gather(
                    groups,
                    first_group_id,
                    mb,
                    &stats.logprobs,
                    &stats.entropy,
                );
                let out = compute_policy_loss(
                    config,
                    &LossInputs {
                        seq_lens: &inputs.seq_lens,
                        group_ids: &inputs.group_ids,
                        logprobs: &inputs.logprobs,
                        old_logprobs: &inputs.old_logprobs,
                        advantages: &inputs.advantages,
                        loss_mask: &inputs.loss_mask,
                        entropies: Some(&inputs.entropy),
                        ref_logprobs: config.use_kl_loss.then_some(&inputs.ref_logprobs[..]),
                        rollout_logprobs: with_rollout.then_some(&inputs.rollout_logprobs[..]),
                    },
                    &norm,
                );
                loss += out.loss;
                metrics.push(out.metrics);
                Ok((
                    inputs.scatter(mb, &out.dlogprobs),
                    inputs.scatter(mb, &out.dentropy),
                ))
            };
            self.policy
                .forward_backward(&mb.batch, logit_scale, &mut grad)?;
        }
        for _ in 0..missing {
            self.policy.reduce_empty_backward()?;
        }
        match &self.data_parallel {
            Some(dp) => dp.policy_output(loss, &metrics),
            None => Ok(ForwardBackwardOutput {
                loss,
                metrics: reduce_micro_batch_metrics(&metrics),
            }),
        }
    }

    fn forward_backward_cross_entropy(
        &mut self,
        groups: &[TrainGroup],
        logit_scale: f32,
    ) -> Result<ForwardBackwardOutput> {
        for (g, group) in groups.iter().enumerate() {
            for (r, response) in group.responses.iter().enumerate() {
                check_len(
                    g,
                    r,
                    "loss_mask",
                    response.loss_mask.len(),
                    response.tokens.len(),
                )?;
            }
        }
        let mut num_tokens: f64 = groups
            .iter()
            .flat_map(|g| &g.responses)
            .flat_map(|r| &r.loss_mask)
            .sum();
        if let Some(dp) = &self.data_parallel {
            num_tokens = dp.sum(num_tokens)?;
        }
        // Mean NLL over the call's masked tokens; an all-masked call has loss 0.
        let weight = if num_tokens > 0.0 {
            1.0 / num_tokens
        } else {
            0.0
        };
        let micro_batches = pack_rollouts(&rollout_groups(groups), self.packing())?;
        let missing = self.backwards_short_of_most(micro_batches.len())?;
        let mut loss = 0.0;
        for mb in &micro_batches {
            let mut grad = |stats: &TokenStats| -> ModelResult<(Vec<f64>, Vec<f64>)> {
                let mut d_logprobs = vec![0.0; mb.len()];
                mb.for_each_scored_row(|row, token| {
                    let response = &groups[token.group as usize].responses[token.response as usize];
                    let w = weight * response.loss_mask[token.token as usize];
                    loss -= w * stats.logprobs[row];
                    d_logprobs[row] = -w;
                });
                Ok((d_logprobs, vec![0.0; mb.len()]))
            };
            self.policy
                .forward_backward(&mb.batch, logit_scale, &mut grad)?;
        }
        for _ in 0..missing {
            self.policy.reduce_empty_backward()?;
        }
        if let Some(dp) = &self.data_parallel {
            loss = dp.sum(loss)?;
        }
        let mut metrics = BTreeMap::new();
        metrics.insert("sft/num_tokens".to_string(), num_tokens);
        Ok(ForwardBackwardOutput { loss, metrics })
    }

    /// A Tinker loss: sums over tokens and responses, no normalisation, so calls
    /// accumulate exactly as Tinker's do. `loss_mask` carries the weights.
    fn forward_backward_tinker(
        &mut self,
        groups: &[TrainGroup],
        kind: TinkerLoss,
        config: &TinkerLossConfig,
        logit_scale: f32,
    ) -> Result<ForwardBackwardOutput> {
        for (g, group) in groups.iter().enumerate() {
            for (r, response) in group.responses.iter().enumerate() {
                let n = response.tokens.len();
                check_len(g, r, "loss_mask", response.loss_mask.len(), n)?;
                check_len(g, r, "advantages", response.advantages.len(), n)?;
                check_len(g, r, "old_logprobs", response.old_logprobs.len(), n)?;
            }
        }
        let micro_batches = pack_rollouts(&rollout_groups(groups), self.packing())?;
        let missing = self.backwards_short_of_most(micro_batches.len())?;
        let mut loss = 0.0;
        for mb in &micro_batches {
            let mut grad = |stats: &TokenStats| -> ModelResult<(Vec<f64>, Vec<f64>)> {
                let inputs = MicroInputs::gather(groups, 0, mb, &stats.logprobs, &stats.entropy);
                let out = tinker_loss(
                    kind,
                    config,
                    &TinkerInputs {
                        seq_lens: &inputs.seq_lens,
                        logprobs: &inputs.logprobs,
                        weights: Some(&inputs.loss_mask),
                        sampling_logprobs: Some(&inputs.old_logprobs),
                        advantages: Some(&inputs.advantages),
                        sequence_ratio_mask: None,
                    },
                )
                .map_err(|e| ModelError::LossGrad(Box::new(e)))?;
                loss += out.loss;
                Ok((inputs.scatter(mb, &out.dlogprobs), vec![0.0; mb.len()]))
            };
            self.policy
                .forward_backward(&mb.batch, logit_scale, &mut grad)?;
        }
        for _ in 0..missing {
            self.policy.reduce_empty_backward()?;
        }
        if let Some(dp) = &self.data_parallel {
            loss = dp.sum(loss)?;
        }
        let metrics = BTreeMap::from([(floe_rl::tinker::LOSS_SUM_METRIC.to_string(), loss)]);
        Ok(ForwardBackwardOutput { loss, metrics })
    }
}

impl<B: Backend> Engine for LocalEngine<B> {
    type Error = Error;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<()> {
        verbs::SamplingSide::sample(&mut self.sampling_view(), requests, on_generation)
    }

    fn sample_streaming(
        &mut self,
        requests: Vec<SampleRequest>,
        on_event: &mut dyn FnMut(SampleEvent<'_>) -> SampleFlow,
    ) -> Result<()> {
        self.sampling_view().run(requests, |sampler, model| {
            sampler.run_streaming(model, on_event)
        })
    }

    /// Takes requests mid-run: [`Sampler::run_feed`] polls `feed` before every step.
    fn sample_joining(&mut self, feed: &mut dyn SampleFeed) -> Result<()> {
        self.sampling_view()
            .run(Vec::new(), |sampler, model| sampler.run_feed(model, feed))
    }

    /// On two threads when the engine overlaps sampling with training: the sampler generates from
    /// a second handle on the policy's weight buffers ([`Transformer::share_base_on`] the
    /// sampling queue, no copy) while `training` runs on this thread. The sampling queue
    /// starts after everything queued so far (the last optimizer step's weights), and
    /// what is queued after this returns starts after the sampling (the next optimizer
    /// step writes the weights it read). The handle is dropped before this returns; while
    /// it lives, the weights could not be changed even by mistake (a full-weight
    /// optimizer step on shared weights fails).
    fn overlap<RS: Send, RT>(
        &mut self,
        sampling: impl FnOnce(&mut dyn verbs::SamplingSide<Error = Error>) -> RS + Send,
        training: impl FnOnce(&mut dyn verbs::TrainingSide<Error = Error>) -> RT,
    ) -> Result<(RS, RT)> {
        if !self.overlaps_sampling() {
            return Ok(one_after_the_other(self, sampling, training));
        }
        let queue = self.sampling_backend()?;
        let training_queue = Arc::clone(self.policy.model().backend());
        queue.wait_for(&training_queue)?;
        let weights = self.policy.model().share_base_on(Arc::clone(&queue))?;
        let mut sampler = self
            .sampler
            .take()
            .expect("the sampler is lent out only inside overlap");
        let (config, tokenizer) = (self.sampler_config.clone(), self.tokenizer.clone());
        let (sampled, trained) = std::thread::scope(|scope| {
            let sampling_thread = scope.spawn(|| {
                let mut side = SamplingView {
                    sampler: &mut sampler,
                    model: &weights,
                    config: &config,
                    tokenizer: &tokenizer,
                };
                sampling(&mut side)
            });
            let trained = training(self);
            (sampling_thread.join(), trained)
        });
        drop(weights);
        self.sampler = Some(sampler);
        training_queue.wait_for(&queue)?;
        let sampled = sampled.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((sampled, trained))
    }

    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<TokenOutputs>>> {
        let logit_scale = logit_scale(temperature)?;
        for (g, group) in groups.iter().enumerate() {
            self.check_tokens(&format!("group {g} prompt"), &group.prompt)?;
            for (r, response) in group.responses.iter().enumerate() {
                self.check_tokens(&format!("group {g} response {r}"), response)?;
            }
            if let Some(targets) = &group.targets {
                if targets.len() != group.responses.len() {
                    return Err(Error::InvalidRequest(format!(
                        "group {g}: {} target lists for {} responses",
                        targets.len(),
                        group.responses.len()
                    )));
                }
                for (r, targets) in targets.iter().enumerate() {
                    self.check_tokens(&format!("group {g} response {r} targets"), targets)?;
                }
            }
        }
        let model = match weights {
            Weights::Policy => self.policy.model(),
            Weights::Reference => self.reference.as_ref().ok_or(Error::NoReference)?,
        };
        let rollouts: Vec<RolloutGroup> = groups
            .iter()
            .map(|group| RolloutGroup {
                prompt: group.prompt.clone(),
                responses: group
                    .responses
                    .iter()
                    .enumerate()
                    .map(|(r, tokens)| Response {
                        tokens: tokens.clone(),
                        targets: group.targets.as_ref().map(|t| t[r].clone()),
                        weights: vec![1.0; tokens.len()],
                    })
                    .collect(),
            })
            .collect();
        let mut outputs: Vec<Vec<TokenOutputs>> = groups
            .iter()
            .map(|group| {
                group
                    .responses
                    .iter()
                    .map(|tokens| TokenOutputs {
                        logprobs: vec![0.0; tokens.len()],
                        entropy: vec![0.0; tokens.len()],
                    })
                    .collect()
            })
            .collect();
        for mb in pack_rollouts(&rollouts, self.packing())? {
            let stats = model.forward(&mb.batch, logit_scale)?;
            mb.for_each_scored_row(|row, token| {
                let out = &mut outputs[token.group as usize][token.response as usize];
                out.logprobs[token.token as usize] = stats.logprobs[row];
                out.entropy[token.token as usize] = stats.entropy[row];
            });
        }
        Ok(outputs)
    }

    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> Result<ForwardBackwardOutput> {
        let logit_scale = logit_scale(temperature)?;
        for (g, group) in groups.iter().enumerate() {
            self.check_tokens(&format!("group {g} prompt"), &group.prompt)?;
            for (r, response) in group.responses.iter().enumerate() {
                self.check_tokens(&format!("group {g} response {r}"), &response.tokens)?;
                if let Some(targets) = &response.targets {
                    self.check_tokens(&format!("group {g} response {r} targets"), targets)?;
                }
            }
        }
        let out = match loss {
            Loss::Policy(config) => self.forward_backward_policy(groups, config, logit_scale),
            Loss::CrossEntropy => self.forward_backward_cross_entropy(groups, logit_scale),
            Loss::Tinker {
                loss,
                clip_low_threshold,
                clip_high_threshold,
                beta,
            } => {
                let config = TinkerLossConfig {
                    clip_low_threshold: *clip_low_threshold,
                    clip_high_threshold: *clip_high_threshold,
                    beta: *beta,
                };
                // A client's values: refused as its mistake before any compute.
                config
                    .validate()
                    .map_err(|e| Error::InvalidRequest(e.to_string()))?;
                self.forward_backward_tinker(groups, *loss, &config, logit_scale)
            }
        };
        out.map_err(|err| match err {
            source if source.is_out_of_memory() => Error::TrainingOutOfMemory {
                source: Box::new(source),
                tokens: self.options.max_tokens_per_microbatch,
                recomputed_layers: self.policy.model().recomputed_layers(),
                num_layers: self.policy.model().config().num_hidden_layers,
                kv_cache_gib: (self.sampler_config.num_blocks
                    * self
                        .policy
                        .model()
                        .kv_cache_bytes_per_block(self.sampler_config.block_size))
                    as f64
                    / f64::from(1 << 30),
            },
            err => err,
        })
    }

    fn optim_step(&mut self, params: &OptimParams) -> Result<StepOutcome> {
        match &self.data_parallel {
            Some(dp) => self
                .policy
                .optim_step_data_parallel(params, &*dp.collective),
            None => self.policy.optim_step(params),
        }
    }

    /// A no-op that reports its own duration: the sampler runs the policy's own weight
    /// buffers (on CUDA the optimizer writes the bf16 compute copy in the same kernel, on
    /// the same stream), so the next sample already sees the latest step.
    fn sync_sampler_weights(&mut self) -> Result<Duration> {
        let start = Instant::now();
        Ok(start.elapsed())
    }

    fn reset_optimizer(&mut self) -> Result<()> {
        self.policy.reset_optimizer();
        Ok(())
    }

    /// Copies the current weights (a LoRA policy's adapters folded in) as the reference.
    fn freeze_reference(&mut self) -> Result<()> {
        let model = self.policy.model();
        let (config, host) = model.merged_host_weights()?;
        let backend = Arc::clone(model.backend());
        // Only forwards read it: the Compute copies are all it needs.
        self.reference = Some(Transformer::from_host_weights_stored(
            backend,
            config,
            &host,
            BaseStorage::ComputeOnly,
        )?);
        Ok(())
    }

    /// Writes the policy (f32 weights under `model/`, AdamW moments, step) and, when
    /// frozen, the reference model as an f32 Hugging Face folder under `reference/`.
    ///
    /// In a data-parallel group every rank calls it with the same `dir`: rank 0 writes
    /// the replicated state, and each rank its shard of a sharded optimizer.
    fn save_state(&mut self, dir: &Path) -> Result<()> {
        let rank = self
            .data_parallel
            .as_ref()
            .map_or(0, |dp| dp.collective.rank());
        if rank != 0 && !self.policy.is_sharded() {
            return Ok(());
        }
        self.policy.save(dir)?;
        if rank != 0 {
            return Ok(());
        }
        let reference_dir = dir.join(REFERENCE_DIR);
        match &self.reference {
            Some(reference) => weights::save_model_dir(
                &reference_dir,
                reference.config(),
                &reference.to_host_weights()?,
                SaveDType::F32,
            )?,
            None => remove_dir_if_present(&reference_dir)?,
        }
        Ok(())
    }

    /// Restores what [`Engine::save_state`] wrote: policy, optimizer state, step, and the
    /// reference model exactly when one was saved. Gradients not yet applied are dropped.
    /// A LoRA state's adapters go onto this engine's base weights, which must be the
    /// ones they were trained on (an engine whose own weights were trained refuses).
    fn load_state(&mut self, dir: &Path) -> Result<()> {
        let backend = Arc::clone(self.policy.model().backend());
        // A state of this engine's shape goes into its own buffers: a second policy beside
        // this one would need the memory of both (more than an 80 GB card holds at 8B).
        if self.policy.restore_in_place(dir)? {
            self.reference = load_reference(&backend, dir)?;
            return Ok(());
        }
        let mut policy = if is_lora_state(dir) {
            let current = self.policy.model();
            if current.lora_config().is_none() && self.policy.step() > 0 {
                return Err(Error::InvalidRequest(format!(
                    "{} holds LoRA adapters, but this engine trained its full weights, so \
                     it no longer holds their base; load it into an engine on the base model",
                    dir.display()
                )));
            }
            Policy::load_lora(current.share_base()?, dir, self.options.optimizer_placement)?
        } else {
            match &self.data_parallel {
                Some(dp) if self.policy.is_sharded() => {
                    let mut policy = Policy::load_sharded(
                        Arc::clone(&backend),
                        dir,
                        self.options.optimizer_placement,
                        Arc::clone(&dp.collective),
                    )?;
                    if self.policy.shards_gradients() {
                        policy.shard_gradients()?;
                    }
                    policy
                }
                _ => Policy::load(Arc::clone(&backend), dir, self.options.optimizer_placement)?,
            }
        };
        policy.set_recomputed_layers(self.plan.recomputed_layers);
        let reference = load_reference(&backend, dir)?;
        let reshaped = policy.model().config() != self.policy.model().config();
        self.policy = policy;
        self.reference = reference;
        if reshaped {
            self.resize_for_model()?;
        }
        Ok(())
    }

    /// Writes the weights (a LoRA policy's adapters folded in; the f32 masters, wherever
    /// the optimizer keeps them) as a Hugging Face folder.
    fn export_hf(&mut self, dir: &Path) -> Result<()> {
        let model = self.policy.model();
        let (config, host) = if model.lora_config().is_some() {
            model.merged_host_weights()?
        } else {
            (
                model.config().clone(),
                self.policy.master_weights_to_host()?,
            )
        };
        weights::save_model_dir(dir, &config, &host, self.options.export_dtype)?;
        if let Some(tokenizer) = &self.tokenizer {
            tokenizer.save_dir(dir)?;
        }
        Ok(())
    }
}

/// A [`LocalEngine`] on the backend the configured device names, so callers hold one
/// type whatever the device.
pub enum AnyLocalEngine {
    /// The CPU reference backend (f32).
    Cpu(Box<LocalEngine<CpuBackend<f32>>>),
    /// A CUDA device.
    Cuda(Box<LocalEngine<CudaBackend>>),
}

impl AnyLocalEngine {
    /// Opens `options.device` and builds the engine on it. For the CPU, sets the
    /// process-wide thread pool to `options.threads` unless one was set already. A CUDA
    /// device in a build without the `cuda` feature is an [`Error::Device`] saying so.
    pub fn open(
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        options: LocalEngineOptions,
    ) -> Result<Self> {
        match options.device {
            Device::Cpu => {
                set_cpu_threads(options.threads);
                let backend = Arc::new(CpuBackend::<f32>::new());
                let engine = LocalEngine::new(backend, source, tokenizer, options)?;
                Ok(Self::Cpu(Box::new(engine)))
            }
            Device::Cuda(ordinal) => {
                let backend = CudaBackend::new(ordinal).map_err(|source| Error::Device {
                    device: options.device.to_string(),
                    source,
                })?;
                let engine = LocalEngine::new(Arc::new(backend), source, tokenizer, options)?;
                Ok(Self::Cuda(Box::new(engine)))
            }
        }
    }

    /// [`AnyLocalEngine::open`] as rank `group.exchange().rank()` of a data-parallel
    /// group ([`LocalEngine::new_data_parallel`]), on the group's device and backend;
    /// `options.device` must be the group's.
    pub fn open_data_parallel(
        group: &DataParallelGroup,
        source: ModelSource,
        tokenizer: Option<Tokenizer>,
        options: LocalEngineOptions,
    ) -> Result<Self> {
        if options.device != group.device {
            return Err(Error::InvalidRequest(format!(
                "the data-parallel group is on {} but the engine is asked for {}",
                group.device, options.device
            )));
        }
        match &group.ranks {
            GroupRanks::Cpu(dp) => {
                set_cpu_threads(options.threads);
                let (backend, collective) = (Arc::clone(&dp.backend), Arc::clone(&dp.collective));
                let engine = LocalEngine::new_data_parallel(
                    backend, source, tokenizer, options, collective,
                )?;
                Ok(Self::Cpu(Box::new(engine)))
            }
            GroupRanks::Cuda(dp) => {
                let (backend, collective) = (Arc::clone(&dp.backend), Arc::clone(&dp.collective));
                let engine = LocalEngine::new_data_parallel(
                    backend, source, tokenizer, options, collective,
                )?;
                Ok(Self::Cuda(Box::new(engine)))
            }
        }
    }
}

/// The reference model a state saved under `dir/reference`, if it saved one.
fn load_reference<B: Backend>(backend: &Arc<B>, dir: &Path) -> Result<Option<Transformer<B>>> {
    let reference_dir = dir.join(REFERENCE_DIR);
    if !reference_dir.is_dir() {
        return Ok(None);
    }
    let (config, host) = weights::load_model_dir(&reference_dir)?;
    Ok(Some(Transformer::from_host_weights(
        Arc::clone(backend),
        config,
        &host,
    )?))
}

/// Sets the process-wide CPU thread pool to `threads` (0: every core). Fails only when
/// the pool already exists (set by an earlier engine or by the caller), which is then
/// used.
fn set_cpu_threads(threads: usize) {
    if threads > 0 {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
}

/// This process's rank of a data-parallel group of local engines, joined before its
/// engine is built (a trainer exchanges with the other ranks before then: the prepared
/// data, the checkpoint to resume): the device's backend and the group's collective
/// over it. [`AnyLocalEngine::open_data_parallel`] builds the engine on both.
#[derive(Clone)]
pub struct DataParallelGroup {
    device: Device,
    ranks: GroupRanks,
    /// The job's liveness links (NCCL groups): taken by [`DataParallelGroup::leave`] or
    /// [`DataParallelGroup::fail`].
    liveness: Option<Arc<Mutex<Option<Liveness>>>>,
}

#[derive(Clone)]
enum GroupRanks {
    Cpu(Arc<DataParallel<CpuBackend<f32>>>),
    Cuda(Arc<DataParallel<CudaBackend>>),
}

impl DataParallelGroup {
    /// Rank `collective.rank()` of a group whose ranks are threads of this process on
    /// the CPU (tests: the CPU has no collective across processes).
    pub fn in_process(collective: InProcessCollective<f32>) -> Self {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let dp = DataParallel::new(Arc::new(collective), backend);
        Self {
            device: Device::Cpu,
            ranks: GroupRanks::Cpu(Arc::new(dp)),
            liveness: None,
        }
    }

    /// This process's rank of `world` on `cuda:{world.local_rank}`: rank 0 makes NCCL's
    /// unique id, the rendezvous at `world.master` hands it to every rank (all within
    /// `timeout`), and each rank joins the NCCL communicator on its device's stream.
    ///
    /// The rendezvous connections stay open as the job's liveness links
    /// (`floe_dist::Liveness`): when another rank stops (its error, or killed), this rank
    /// aborts its communicator naming that rank, so a collective waiting on it returns
    /// at once instead of at NCCL's timeout. End a run with [`DataParallelGroup::leave`]
    /// (or [`DataParallelGroup::fail`] with the error).
    pub fn join_nccl(world: &World, timeout: Duration) -> Result<Self> {
        let device = Device::Cuda(world.local_rank);
        let device_error = |source| Error::Device {
            device: device.to_string(),
            source,
        };
        let backend = Arc::new(CudaBackend::new(world.local_rank).map_err(device_error)?);
        // A stop heard before the communicator exists ends the process; after, it aborts
        // the communicator (which exits after its grace period if need be).
        let communicator: Arc<OnceLock<Weak<NcclCollective>>> = Arc::new(OnceLock::new());
        let on_stop: floe_dist::OnStop = {
            let (communicator, rank) = (Arc::clone(&communicator), world.rank);
            Arc::new(
                move |stopped| match communicator.get().and_then(Weak::upgrade) {
                    Some(collective) => collective.abort(&stopped.to_string()),
                    None => {
                        eprintln!("error: rank {rank}: {stopped}; exiting");
                        std::process::exit(1);
                    }
                },
            )
        };
        // A rank 0 that cannot make an id still serves (an empty one) so the others fail
        // at once naming its length, not at the timeout; rank 0 fails with the cause.
        let mut made = Ok(());
        let (id, liveness) = floe_dist::rendezvous_linked(
            world,
            || match NcclCollective::unique_id() {
                Ok(id) => id.to_vec(),
                Err(err) => {
                    made = Err(err);
                    Vec::new()
                }
            },
            timeout,
            on_stop,
        )?;
        made.map_err(device_error)?;
        let collective = Arc::new(
            NcclCollective::new(&backend, world.rank, world.world_size, &id)
                .map_err(device_error)?,
        );
        let _ = communicator.set(Arc::downgrade(&collective));
        Ok(Self {
            device,
            ranks: GroupRanks::Cuda(Arc::new(DataParallel::new(collective, backend))),
            liveness: Some(Arc::new(Mutex::new(Some(liveness)))),
        })
    }

    /// Ends this rank's part of the job normally: the other ranks stop watching it.
    pub fn leave(&self) {
        if let Some(liveness) = self.take_liveness() {
            liveness.leave();
        }
    }

    /// Tells the other ranks that this rank stops because of `reason` (its error), so they
    /// stop at once naming it.
    pub fn fail(&self, reason: &str) {
        if let Some(liveness) = self.take_liveness() {
            liveness.fail(reason);
        }
    }

    fn take_liveness(&self) -> Option<Liveness> {
        let slot = self.liveness.as_ref()?;
        slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The group's CUDA backend and collective, for a caller that runs its own
    /// data-parallel loop on them (`floe bench train` under `floe launch`); `None` for a
    /// group on the CPU.
    pub fn cuda_parts(&self) -> Option<(Arc<CudaBackend>, Arc<dyn Collective<CudaBackend>>)> {
        match &self.ranks {
            GroupRanks::Cuda(dp) => Some((Arc::clone(&dp.backend), Arc::clone(&dp.collective))),
            GroupRanks::Cpu(_) => None,
        }
    }

    /// The device the group's engine runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The exact exchange of small values among the group's ranks.
    pub fn exchange(&self) -> Arc<dyn RankExchange> {
        match &self.ranks {
            GroupRanks::Cpu(dp) => Arc::clone(dp) as Arc<dyn RankExchange>,
            GroupRanks::Cuda(dp) => Arc::clone(dp) as Arc<dyn RankExchange>,
        }
    }
}

impl AnyLocalEngine {
    /// The memory plan the engine was admitted with.
    pub fn memory_plan(&self) -> &MemoryPlan {
        match self {
            Self::Cpu(engine) => engine.memory_plan(),
            Self::Cuda(engine) => engine.memory_plan(),
        }
    }

    /// The sampler's work counters since it was last built.
    pub fn sampler_stats(&self) -> &SamplerStats {
        match self {
            Self::Cpu(engine) => engine.sampler_stats(),
            Self::Cuda(engine) => engine.sampler_stats(),
        }
    }
}

/// Forwards a verb to the engine inside an [`AnyLocalEngine`].
macro_rules! dispatch {
    ($self:ident, $engine:ident => $call:expr) => {
        match $self {
            AnyLocalEngine::Cpu($engine) => $call,
            AnyLocalEngine::Cuda($engine) => $call,
        }
    };
}

impl Engine for AnyLocalEngine {
    type Error = Error;

    fn info(&self) -> &EngineInfo {
        dispatch!(self, e => e.info())
    }

    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<()> {
        dispatch!(self, e => e.sample(requests, on_generation))
    }

    fn sample_streaming(
        &mut self,
        requests: Vec<SampleRequest>,
        on_event: &mut dyn FnMut(SampleEvent<'_>) -> SampleFlow,
    ) -> Result<()> {
        dispatch!(self, e => e.sample_streaming(requests, on_event))
    }

    fn sample_joining(&mut self, feed: &mut dyn SampleFeed) -> Result<()> {
        dispatch!(self, e => e.sample_joining(feed))
    }

    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<TokenOutputs>>> {
        dispatch!(self, e => e.forward(groups, weights, temperature))
    }

    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> Result<ForwardBackwardOutput> {
        dispatch!(self, e => e.forward_backward(groups, loss, temperature))
    }

    fn optim_step(&mut self, params: &OptimParams) -> Result<StepOutcome> {
        dispatch!(self, e => e.optim_step(params))
    }

    fn sync_sampler_weights(&mut self) -> Result<Duration> {
        dispatch!(self, e => e.sync_sampler_weights())
    }

    fn freeze_reference(&mut self) -> Result<()> {
        dispatch!(self, e => e.freeze_reference())
    }

    fn reset_optimizer(&mut self) -> Result<()> {
        dispatch!(self, e => e.reset_optimizer())
    }

    fn save_state(&mut self, dir: &Path) -> Result<()> {
        dispatch!(self, e => e.save_state(dir))
    }

    fn load_state(&mut self, dir: &Path) -> Result<()> {
        dispatch!(self, e => e.load_state(dir))
    }

    fn overlap<RS: Send, RT>(
        &mut self,
        sampling: impl FnOnce(&mut dyn verbs::SamplingSide<Error = Error>) -> RS + Send,
        training: impl FnOnce(&mut dyn verbs::TrainingSide<Error = Error>) -> RT,
    ) -> Result<(RS, RT)> {
        dispatch!(self, e => e.overlap(sampling, training))
    }

    fn export_hf(&mut self, dir: &Path) -> Result<()> {
        dispatch!(self, e => e.export_hf(dir))
    }
}

/// The per-token inputs of one micro-batch's responses, in packing order.
#[derive(Default)]
struct MicroInputs {
    seq_lens: Vec<usize>,
    group_ids: Vec<u64>,
    logprobs: Vec<f64>,
    entropy: Vec<f64>,
    old_logprobs: Vec<f64>,
    advantages: Vec<f64>,
    loss_mask: Vec<f64>,
    ref_logprobs: Vec<f64>,
    rollout_logprobs: Vec<f64>,
}

impl MicroInputs {
    /// Reads the model's per-row outputs and the caller's per-token inputs of every
    /// response of `mb`, response after response; group `g` of the call has id
    /// `first_group_id + g`. Optional inputs are read when present (the checks before
    /// packing make them all-or-none where the loss needs them).
    fn gather(
        groups: &[TrainGroup],
        first_group_id: u64,
        mb: &MicroBatch,
        logprobs: &[f64],
        entropy: &[f64],
    ) -> Self {
        let mut inputs = Self::default();
        for rows in &mb.responses {
            let response = &groups[rows.group as usize].responses[rows.response as usize];
            let scored = rows.first_row as usize..(rows.first_row + rows.len) as usize;
            inputs.seq_lens.push(rows.len as usize);
            inputs
                .group_ids
                .push(first_group_id + u64::from(rows.group));
            inputs.logprobs.extend_from_slice(&logprobs[scored.clone()]);
            inputs.entropy.extend_from_slice(&entropy[scored]);
            inputs
                .old_logprobs
                .extend_from_slice(&response.old_logprobs);
            inputs.advantages.extend_from_slice(&response.advantages);
            inputs.loss_mask.extend_from_slice(&response.loss_mask);
            if let Some(reference) = &response.ref_logprobs {
                inputs.ref_logprobs.extend_from_slice(reference);
            }
            if let Some(rollout) = &response.rollout_logprobs {
                inputs.rollout_logprobs.extend_from_slice(rollout);
            }
        }
        inputs
    }

    /// Per-token values (in [`MicroInputs::gather`] order) back to the micro-batch's rows.
    fn scatter(&self, mb: &MicroBatch, per_token: &[f64]) -> Vec<f64> {
        let mut rows = vec![0.0; mb.len()];
        let mut at = 0;
        for response in &mb.responses {
            let len = response.len as usize;
            let first = response.first_row as usize;
            rows[first..first + len].copy_from_slice(&per_token[at..at + len]);
            at += len;
        }
        rows
    }
}

/// Checks the per-token inputs of a policy-loss call; returns whether the sampler's
/// log-probs are given (for every response, or for none).
fn check_train_groups(groups: &[TrainGroup], config: &AlgorithmConfig) -> Result<bool> {
    let mut with_rollout = None;
    for (g, group) in groups.iter().enumerate() {
        for (r, response) in group.responses.iter().enumerate() {
            let n = response.tokens.len();
            check_len(g, r, "loss_mask", response.loss_mask.len(), n)?;
            check_len(g, r, "advantages", response.advantages.len(), n)?;
            check_len(g, r, "old_logprobs", response.old_logprobs.len(), n)?;
            match (&response.ref_logprobs, config.use_kl_loss) {
                (Some(reference), _) => check_len(g, r, "ref_logprobs", reference.len(), n)?,
                (None, true) => {
                    return Err(Error::InvalidRequest(format!(
                        "group {g} response {r}: ref_logprobs are missing and use_kl_loss is set"
                    )))
                }
                (None, false) => {}
            }
            if let Some(rollout) = &response.rollout_logprobs {
                check_len(g, r, "rollout_logprobs", rollout.len(), n)?;
            }
            let has = response.rollout_logprobs.is_some();
            if *with_rollout.get_or_insert(has) != has {
                return Err(Error::InvalidRequest(format!(
                    "group {g} response {r}: rollout_logprobs must be given for every response \
                     of a call or for none"
                )));
            }
        }
    }
    Ok(with_rollout.unwrap_or(false))
}

fn check_len(group: usize, response: usize, what: &str, len: usize, tokens: usize) -> Result<()> {
    if len == tokens {
        return Ok(());
    }
    Err(Error::InvalidRequest(format!(
        "group {group} response {response}: {what} has {len} values for {tokens} tokens"
    )))
}

/// The training groups as packing input; the packer's weights are unused (the losses
/// read the masks themselves).
fn rollout_groups(groups: &[TrainGroup]) -> Vec<RolloutGroup> {
    groups
        .iter()
        .map(|group| RolloutGroup {
            prompt: group.prompt.clone(),
            responses: group
                .responses
                .iter()
                .map(|response| Response {
                    tokens: response.tokens.clone(),
                    targets: response.targets.clone(),
                    weights: vec![1.0; response.tokens.len()],
                })
                .collect(),
        })
        .collect()
}

/// `1 / temperature`; temperature 0 (greedy) scores at temperature 1, the temperature
/// the sampler reports greedy log-probs at.
fn logit_scale(temperature: f32) -> Result<f32> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(Error::InvalidRequest(format!(
            "temperature {temperature} must be finite and non-negative"
        )));
    }
    Ok(if temperature == 0.0 {
        1.0
    } else {
        1.0 / temperature
    })
}

/// Sampler sizes: the KV blocks a byte budget buys, never more than the running
/// sequences could fill at the model's longest context.
/// The memory plan of an engine for `model` (with `lora` adapters) on `backend` (see
/// [`MemoryPlan`]): the device budget is `options.memory_fraction` of the memory free now
/// less `reserved_by_others`, what other engines on the device keep free for their steps.
fn memory_plan<B: Backend>(
    backend: &B,
    model: &ModelConfig,
    lora: Option<&LoraConfig>,
    base_resident: bool,
    options: &LocalEngineOptions,
    reserved_by_others: usize,
    (optimizer_shards, data_parallel_ranks): (usize, usize),
) -> MemoryPlan {
    let budget = backend.memory_info().map(|(free, _total)| {
        ((free as f64 * options.memory_fraction) as usize).saturating_sub(reserved_by_others)
    });
    MemoryPlan::new(&PlanInputs {
        model,
        lora,
        base_resident,
        device: options.device,
        placement: options.optimizer_placement,
        optimizer_shards,
        gradient_shards: options.zero_stage == 2,
        data_parallel_ranks,
        recompute: options.recompute,
        kv_cache_tokens_wanted: options.kv_cache_tokens_wanted,
        kv_cache_bytes: options.kv_cache_bytes,
        max_tokens_per_microbatch: options.max_tokens_per_microbatch,
        budget_bytes: budget,
        reserved_by_others,
    })
}

fn sampler_config<B: Backend>(
    model: &Transformer<B>,
    options: &LocalEngineOptions,
    plan: &MemoryPlan,
) -> SamplerConfig {
    let bytes = options
        .kv_cache_bytes
        .or(plan.kv_cache_bytes())
        .unwrap_or(DEFAULT_HOST_KV_BYTES);
    let block_size = options.block_size.max(1);
    let per_block = model.kv_cache_bytes_per_block(block_size).max(1);
    let longest = model.config().max_position_embeddings.max(1);
    let most_useful = options.max_running_seqs.max(1) * longest.div_ceil(block_size);
    SamplerConfig {
        num_blocks: (bytes / per_block).clamp(1, most_useful),
        block_size,
        max_tokens_per_step: options.max_tokens_per_step.max(1),
        max_running_seqs: options.max_running_seqs.max(1),
        seed: options.seed,
        speculative: options.speculative_ngram,
    }
}

/// The sampler over a model: the engine's own for [`Engine::sample`], or over the shared
/// handle on its weights on [`Engine::overlap`]'s sampling thread.
struct SamplingView<'a, B: Backend> {
    sampler: &'a mut Sampler<Transformer<B>>,
    model: &'a Transformer<B>,
    config: &'a SamplerConfig,
    tokenizer: &'a Option<Arc<Tokenizer>>,
}

impl<B: Backend> verbs::SamplingSide for SamplingView<'_, B> {
    type Error = Error;

    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> Result<()> {
        self.run(requests, |sampler, model| sampler.run(model, on_generation))
    }
}

impl<B: Backend> SamplingView<'_, B> {
    /// Queues `requests` on the sampler and runs it with `run`; after a failure the
    /// sampler is rebuilt, so what the failed call left queued never reaches the next.
    fn run(
        &mut self,
        requests: Vec<SampleRequest>,
        run: impl FnOnce(
            &mut Sampler<Transformer<B>>,
            &Transformer<B>,
        ) -> std::result::Result<(), SampleError>,
    ) -> Result<()> {
        let mut result = requests
            .into_iter()
            .try_for_each(|request| self.sampler.submit(request));
        if result.is_ok() {
            result = run(self.sampler, self.model);
        }
        if let Err(err) = result {
            *self.sampler = new_sampler(self.model, self.config, self.tokenizer)?;
            return Err(err.into());
        }
        Ok(())
    }
}

fn new_sampler<B: Backend>(
    model: &Transformer<B>,
    config: &SamplerConfig,
    tokenizer: &Option<Arc<Tokenizer>>,
) -> Result<Sampler<Transformer<B>>> {
    let sampler = Sampler::new(model, config.clone())?;
    Ok(match tokenizer {
        Some(tokenizer) => {
            let tokenizer = Arc::clone(tokenizer);
            // Stop strings match the text a user would read: special tokens skipped, as
            // vLLM detokenizes by default.
            sampler.with_detokenizer(Box::new(move |ids: &[u32]| {
                tokenizer.decode(ids, true).unwrap_or_default()
            }))
        }
        None => sampler,
    })
}

fn engine_info<B: Backend>(
    model: &Transformer<B>,
    options: &LocalEngineOptions,
    sampler: &SamplerConfig,
) -> EngineInfo {
    let config = model.config();
    let cache_tokens = sampler.num_blocks * sampler.block_size;
    EngineInfo {
        device: model.backend().name(),
        vocab_size: config.vocab_size,
        // A whole sequence must fit the model's positions, the KV cache and (its prompt
        // counted once, less one token) a training micro-batch.
        max_seq_len: config
            .max_position_embeddings
            .min(cache_tokens)
            .min(options.max_tokens_per_microbatch + 1),
    }
}

fn remove_dir_if_present(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
            path: dir.to_path_buf(),
            source: e,
        }),
        _ => Ok(()),
    }
}
