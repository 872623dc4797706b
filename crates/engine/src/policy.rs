//! The policy under training: the transformer, its AdamW moments and the step count.
//!
//! A policy over a LoRA model ([`Transformer::with_lora`]) trains only the adapters: the
//! optimizer visits them alone, so AdamW moments exist only for them, and a saved state
//! holds the adapters (a PEFT folder) instead of the weights; the base is whatever the
//! restoring engine loads ([`Policy::load_lora`]).
//!
//! Gradients accumulate across [`Policy::forward_backward`] calls (micro-batches, or
//! chunks sent by a remote driver) until [`Policy::optim_step`], which clips by the
//! global norm, skips a step whose norm is not finite, updates every parameter with
//! AdamW and clears the gradients. The sampler reads the same weights: on the CPU the
//! Full weights are the compute weights, on CUDA AdamW writes the bf16 copy in the same
//! kernel, so handing the new weights to the sampler moves no bytes.
//!
//! A rank of a data-parallel group steps with [`Policy::optim_step_data_parallel`]: the
//! gradients of every rank are summed first, so clipping, the non-finite skip and the
//! update are the same on every rank; [`Policy::broadcast_weights`] starts the ranks from
//! one rank's weights.
//!
//! # Optimizer in host memory
//!
//! On a device, full-weight AdamW keeps about 16 bytes a parameter (f32 master, gradient
//! and two moments) beside the bf16 weights: an 8B model needs ~130 GB before its first
//! activation. [`OptimizerPlacement::Host`] keeps the f32 master weights and the moments
//! in host memory instead (as DeepSpeed's ZeRO-Offload does): the device holds the bf16
//! weights and the f32 gradients; each step streams a parameter's gradient down, applies
//! AdamW on the CPU cores (the rule of the device's kernel, term for term) and streams the
//! new weights up in the device's compute precision, the copies overlapped with the update
//! ([`Backend::adamw_host`]). The result equals the on-device optimizer's up to f32
//! rounding.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use floe_backend::{AdamW, Backend, BufKind, Collective};
use floe_model::batch::{PackedBatch, TokenStats};
use floe_model::lora::{self, ADAPTER_CONFIG_FILE};
use floe_model::transformer::{BaseStorage, ModelError, Transformer};
use floe_model::weights::{self, HostTensor, SaveDType, TensorView};
use floe_rl::optim::{clip_coef, should_skip_step};
use serde::{Deserialize, Serialize};

use crate::sharded::{read_full_state, ShardedOptimizer, ShardingMeta};
use crate::{Error, Result};

/// Turns a micro-batch's per-row stats into `(dL/dlogprob, dL/dentropy)` per row.
pub type LossGrad<'a> =
    dyn FnMut(&TokenStats) -> floe_model::transformer::Result<(Vec<f64>, Vec<f64>)> + 'a;

/// AdamW hyper-parameters and clipping of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimParams {
    /// Learning rate of this step (the caller applies the schedule).
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Clip the global gradient norm to this; 0 or less disables clipping.
    pub max_grad_norm: f32,
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// True when the norm was not finite and no parameter changed.
    pub skipped: bool,
    /// Optimizer steps taken so far (skipped steps not counted).
    pub step: u64,
}

/// Where the optimizer keeps the f32 master weights and the AdamW moments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerPlacement {
    /// Beside the weights, on the model's device.
    #[default]
    Device,
    /// In host memory; the device keeps only the weights in compute precision and the
    /// gradients (see the module docs).
    Host,
}

/// AdamW first and second moments of one parameter (Full buffers).
struct Moments<Buf> {
    m: Buf,
    v: Buf,
}

/// The optimizer's state of one parameter kept in host memory.
struct HostParam {
    /// The f32 master weights.
    master: Vec<f32>,
    /// Allocated on the first optimizer step.
    moments: Option<Moments<Vec<f32>>>,
}

/// The optimizer state, keyed by HF tensor name, where [`OptimizerPlacement`] says.
enum OptimizerState<B: Backend> {
    /// Moments on the device, allocated by [`Policy::allocate_training_state`] or the
    /// first optimizer step; the masters are the model's own Full weights.
    Device(BTreeMap<String, Moments<B::Buf>>),
    /// Masters and moments in host memory, updated there ([`Backend::adamw_host`]).
    Host { params: BTreeMap<String, HostParam> },
    /// This rank's shard of the masters and moments of a data-parallel group
    /// ([`Policy::shard_optimizer`]), on the device or the host.
    Sharded(ShardedOptimizer<B>),
}

/// The transformer being trained with its optimizer state.
pub struct Policy<B: Backend> {
    model: Transformer<B>,
    state: OptimizerState<B>,
    step: u64,
}

/// Sub-folder of a saved state holding the weights as a Hugging Face folder.
pub const MODEL_DIR: &str = "model";
/// Sub-folder of a saved LoRA state holding the adapters as a PEFT folder
/// (`adapter_model.safetensors`, `adapter_config.json`).
pub const ADAPTER_DIR: &str = "adapter";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const OPTIMIZER_META: &str = "optimizer.json";
/// Suffixes of the moment tensors, as PyTorch's AdamW names its state.
const EXP_AVG: &str = "exp_avg";
const EXP_AVG_SQ: &str = "exp_avg_sq";

#[derive(Serialize, Deserialize)]
struct OptimizerMeta {
    step: u64,
    /// Present when the masters and moments were saved in shards, one file per rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sharding: Option<ShardingMeta>,
}

impl<B: Backend> Policy<B> {
    /// Wraps a model with fresh optimizer state on its device.
    pub fn new(model: Transformer<B>) -> Self {
        Policy {
            model,
            state: OptimizerState::Device(BTreeMap::new()),
            step: 0,
        }
    }

    /// Where the optimizer state lives.
    pub fn optimizer_placement(&self) -> OptimizerPlacement {
        match &self.state {
            OptimizerState::Device(_) => OptimizerPlacement::Device,
            OptimizerState::Host { .. } => OptimizerPlacement::Host,
            OptimizerState::Sharded(sharded) => sharded.placement(),
        }
    }

    /// Whether the optimizer state is split over the ranks of a data-parallel group.
    pub fn is_sharded(&self) -> bool {
        matches!(self.state, OptimizerState::Sharded(_))
    }

    /// Splits the optimizer state over the ranks of `collective` (ZeRO stage 1,
    /// `docs/distributed.md`): each rank keeps the f32 masters and AdamW moments of its
    /// shard of the parameters at `placement`; the model keeps its weights in compute
    /// precision (where the backend has a lower one) and full gradients. Every rank must
    /// hold the same weights (after [`Policy::broadcast_weights`]) and call it together.
    /// Moments already on the device are split too; a state on the host is refused.
    pub fn shard_optimizer(
        &mut self,
        collective: Arc<dyn Collective<B>>,
        placement: OptimizerPlacement,
    ) -> Result<()> {
        self.shard_optimizer_in_buckets(collective, placement, SHARD_BUCKET_ELEMENTS)
    }

    fn shard_optimizer_in_buckets(
        &mut self,
        collective: Arc<dyn Collective<B>>,
        placement: OptimizerPlacement,
        bucket_elements: usize,
    ) -> Result<()> {
        let OptimizerState::Device(moments) = &mut self.state else {
            return Err(Error::InvalidRequest(
                "shard_optimizer: the optimizer state is already on the host or sharded; \
                 shard it from the device"
                    .into(),
            ));
        };
        let moments: BTreeMap<String, (B::Buf, B::Buf)> = std::mem::take(moments)
            .into_iter()
            .map(|(name, Moments { m, v })| (name, (m, v)))
            .collect();
        let sharded = ShardedOptimizer::new(
            &mut self.model,
            collective,
            placement,
            bucket_elements,
            &moments,
        )?;
        self.state = OptimizerState::Sharded(sharded);
        Ok(())
    }

    /// Shards the gradients too (ZeRO stage 2, `docs/distributed.md`), once the optimizer
    /// state is ([`Policy::shard_optimizer`]): the model keeps no full gradients, its
    /// backward hands each over as soon as it is complete and they are reduce-scattered
    /// in buckets into this rank's shard, summed over micro-batches. Every rank calls it
    /// together, and then runs the same number of backwards between two steps.
    pub fn shard_gradients(&mut self) -> Result<()> {
        let OptimizerState::Sharded(sharded) = &mut self.state else {
            return Err(Error::InvalidRequest(
                "shard_gradients: shard the optimizer state first (shard_optimizer)".into(),
            ));
        };
        sharded.stream_gradients(&mut self.model)
    }

    /// Whether the gradients are split over the ranks too ([`Policy::shard_gradients`]).
    pub fn shards_gradients(&self) -> bool {
        matches!(&self.state, OptimizerState::Sharded(s) if s.streams_gradients())
    }

    /// Joins the gradient reduction of a backward the other ranks run, with zeros: a
    /// rank of a group whose gradients are sharded that has fewer micro-batches than
    /// another in a call runs this for each one it lacks.
    pub(crate) fn reduce_empty_backward(&mut self) -> Result<()> {
        match &mut self.state {
            OptimizerState::Sharded(sharded) if sharded.streams_gradients() => {
                sharded.reduce_empty_backward()
            }
            _ => Ok(()),
        }
    }

    /// Moves the optimizer state to `placement`. Going to the host copies the master
    /// weights and the moments there and frees the device's f32 masters (the model keeps
    /// its weights in compute precision); going back to the device is refused, since
    /// the device may not have room for what the host holds.
    pub fn set_optimizer_placement(&mut self, placement: OptimizerPlacement) -> Result<()> {
        match (placement, &mut self.state) {
            (OptimizerPlacement::Device, OptimizerState::Device(_))
            | (OptimizerPlacement::Host, OptimizerState::Host { .. }) => Ok(()),
            (_, OptimizerState::Sharded(sharded)) if sharded.placement() == placement => Ok(()),
            (_, OptimizerState::Sharded(_)) => Err(Error::InvalidRequest(
                "the optimizer state is sharded; its placement was chosen when it was split".into(),
            )),
            (OptimizerPlacement::Device, OptimizerState::Host { .. }) => {
                Err(Error::InvalidRequest(
                    "the optimizer state is in host memory; it does not move back to the \
                     device (build a new policy instead)"
                        .into(),
                ))
            }
            (OptimizerPlacement::Host, OptimizerState::Device(moments)) => {
                let backend = Arc::clone(self.model.backend());
                let host = |buf: &B::Buf| backend.download(buf);
                let mut params = BTreeMap::new();
                let mut device_moments = std::mem::take(moments);
                self.model.visit_params(&mut |name, slot| {
                    let moments = match device_moments.remove(name) {
                        Some(state) => Some(Moments {
                            m: host(&state.m)?,
                            v: host(&state.v)?,
                        }),
                        None => None,
                    };
                    let master = host(slot.param)?;
                    params.insert(name.to_string(), HostParam { master, moments });
                    Ok(())
                })?;
                if self.model.lora_config().is_none() {
                    self.model.drop_device_masters()?;
                }
                self.state = OptimizerState::Host { params };
                Ok(())
            }
        }
    }

    /// The weights, for sampling and scoring.
    pub fn model(&self) -> &Transformer<B> {
        &self.model
    }

    /// Optimizer steps taken so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Activation checkpointing of the backward's first `layers` layers (see
    /// [`Transformer::set_recomputed_layers`]); changes memory, not results.
    pub fn set_recomputed_layers(&mut self, layers: usize) {
        self.model.set_recomputed_layers(layers);
    }

    /// Forward and backward of one micro-batch; gradients add to those already held.
    /// `loss_grad` turns the micro-batch's per-row stats into `(dL/dlogprob, dL/dentropy)`.
    pub fn forward_backward(
        &mut self,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut LossGrad<'_>,
    ) -> Result<TokenStats> {
        match &mut self.state {
            OptimizerState::Sharded(sharded) if sharded.streams_gradients() => {
                Ok(self.model.forward_backward_streamed(
                    batch,
                    logit_scale,
                    loss_grad,
                    &mut |first, grads| sharded.receive(first, grads),
                )?)
            }
            _ => Ok(self.model.forward_backward(batch, logit_scale, loss_grad)?),
        }
    }

    /// Global L2 norm of the gradients accumulated so far; refused when they are
    /// sharded (each rank holds one shard: the optimizer step reports the norm).
    pub fn grad_norm(&self) -> Result<f64> {
        if self.shards_gradients() {
            return Err(Error::InvalidRequest(
                "grad_norm: the gradients are sharded over the ranks (zero_stage 2); \
                 optim_step reports their global norm"
                    .into(),
            ));
        }
        Ok(self.model.grad_norm()?)
    }

    /// Clears the accumulated gradients without stepping.
    pub fn zero_grad(&mut self) -> Result<()> {
        if let OptimizerState::Sharded(sharded) = &mut self.state {
            sharded.discard_gradients();
        }
        Ok(self.model.zero_grad()?)
    }

    /// Allocates the gradients and, when the optimizer lives on the device, the AdamW
    /// moments now rather than at the first step, so the device memory the engine's plan
    /// counts is taken when it is built (another engine cannot take it meanwhile) and a
    /// shortfall shows then.
    pub fn allocate_training_state(&mut self) -> Result<()> {
        if self.model.lora_config().is_none() && self.model.base_is_shared() {
            // Full weights shared with other models are frozen: nothing here trains.
            return Ok(());
        }
        let backend = Arc::clone(self.model.backend());
        match &mut self.state {
            OptimizerState::Device(moments) => self.model.visit_params(&mut |name, slot| {
                device_moments(&*backend, moments, name, slot.param)?;
                Ok(())
            })?,
            // Sharded gradients were allocated with the shards, and the model keeps none.
            OptimizerState::Sharded(sharded) if sharded.streams_gradients() => {}
            // Host and shard moments are allocated at the first step.
            OptimizerState::Host { .. } | OptimizerState::Sharded(_) => {
                self.model.visit_params(&mut |_, _| Ok(()))?
            }
        }
        Ok(())
    }

    /// Clips the global gradient norm, applies AdamW to every parameter and clears the
    /// gradients. A step whose norm is not finite changes no weight and no moment, is not
    /// counted, and still clears the gradients.
    pub fn optim_step(&mut self, params: &OptimParams) -> Result<StepOutcome> {
        self.step_with(params, None)
    }

    /// [`Policy::optim_step`] of one rank of a data-parallel group: first sums every
    /// rank's gradients (each rank's loss already divided by the whole mini-batch's
    /// totals), so every rank clips by the same global norm, skips the same steps and
    /// applies the same update. The sums run in place, in buckets of consecutive
    /// parameters (one all-reduce per bucket of up to 100 MB).
    pub fn optim_step_data_parallel(
        &mut self,
        params: &OptimParams,
        collective: &dyn Collective<B>,
    ) -> Result<StepOutcome> {
        self.step_with(params, Some(collective))
    }

    /// Makes the trained weights (a LoRA policy's adapters) those of rank `root`, on
    /// every rank of `collective`. Frozen base weights are not sent: every rank loads
    /// them from the same source. Call it while the optimizer state is on the device
    /// (before [`Policy::set_optimizer_placement`] moves the masters to the host).
    pub fn broadcast_weights(&mut self, collective: &dyn Collective<B>, root: usize) -> Result<()> {
        if !matches!(self.state, OptimizerState::Device(_)) {
            return Err(Error::InvalidRequest(
                "broadcast_weights: the master weights are in host memory or sharded; \
                 broadcast them before moving or splitting the optimizer state"
                    .into(),
            ));
        }
        if self.model.lora_config().is_none() && self.model.base_is_shared() {
            return Ok(());
        }
        let backend = Arc::clone(self.model.backend());
        self.model.visit_params(&mut |_, slot| {
            collective.broadcast(slot.param, root)?;
            if let Some(compute) = slot.compute {
                backend.copy(compute, slot.param)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Sums every rank's gradients in place, in few large collectives: the gradients
    /// of consecutive parameters are packed end to end into one bucket of at most
    /// `capacity` elements ([`GRAD_BUCKET_ELEMENTS`]), summed with one `all_reduce_sum`,
    /// and copied back; a
    /// parameter larger than a bucket is summed alone, in place. The bucket is the only
    /// extra memory. Each element's sum is what a per-parameter all-reduce gives.
    fn all_reduce_gradients(
        &mut self,
        collective: &dyn Collective<B>,
        capacity: usize,
    ) -> Result<()> {
        let backend = Arc::clone(self.model.backend());
        let mut lens = Vec::new();
        self.model.visit_params(&mut |_, slot| {
            lens.push(backend.len(slot.grad));
            Ok(())
        })?;
        let buckets = grad_buckets(&lens, capacity);
        let bucket_len = |params: &std::ops::Range<usize>| lens[params.clone()].iter().sum();
        let largest_bucket = buckets
            .iter()
            .map(bucket_len)
            .filter(|&len| len <= capacity)
            .max();
        let mut bucket = largest_bucket
            .map(|len| backend.zeros(len, BufKind::Full))
            .transpose()?;
        for params in buckets {
            // The parameters of this bucket, with their offsets in it.
            let mut visit = |f: &mut dyn FnMut(&mut B::Buf, usize) -> floe_backend::Result<()>| {
                let (mut index, mut offset) = (0, 0);
                self.model.visit_params(&mut |_, slot| {
                    if params.contains(&index) {
                        f(slot.grad, offset)?;
                        offset += lens[index];
                    }
                    index += 1;
                    Ok(())
                })
            };
            match bucket.as_mut().filter(|_| bucket_len(&params) <= capacity) {
                // A shorter bucket leaves a stale tail, summed and never read.
                Some(bucket) => {
                    visit(&mut |grad, offset| backend.copy_into(bucket, offset, grad))?;
                    collective.all_reduce_sum(bucket)?;
                    visit(&mut |grad, offset| backend.copy_from(grad, bucket, offset))?;
                }
                None => visit(&mut |grad, _| collective.all_reduce_sum(grad))?,
            }
        }
        Ok(())
    }

    fn step_with(
        &mut self,
        params: &OptimParams,
        collective: Option<&dyn Collective<B>>,
    ) -> Result<StepOutcome> {
        let grad_norm = match (&mut self.state, collective) {
            // The shards' sums: the model's gradients are cleared.
            (OptimizerState::Sharded(sharded), _) => sharded.reduce_gradients(&mut self.model)?,
            (_, Some(collective)) => {
                self.all_reduce_gradients(collective, GRAD_BUCKET_ELEMENTS)?;
                self.model.grad_norm()?
            }
            (_, None) => self.model.grad_norm()?,
        };
        if should_skip_step(grad_norm) {
            self.model.zero_grad()?;
            return Ok(StepOutcome {
                grad_norm,
                skipped: true,
                step: self.step,
            });
        }
        let grad_scale = if params.max_grad_norm > 0.0 {
            clip_coef(grad_norm, f64::from(params.max_grad_norm))
        } else {
            1.0
        };
        self.step += 1;
        let hp = AdamW {
            lr: params.lr,
            beta1: params.beta1,
            beta2: params.beta2,
            eps: params.eps,
            weight_decay: params.weight_decay,
            step: self.step,
            grad_scale: grad_scale as f32,
        };
        let backend = Arc::clone(self.model.backend());
        match &mut self.state {
            OptimizerState::Device(moments) => self.model.visit_params(&mut |name, slot| {
                let state = device_moments(&*backend, moments, name, slot.param)?;
                backend.adamw(
                    slot.param,
                    slot.grad,
                    &mut state.m,
                    &mut state.v,
                    slot.compute,
                    hp,
                )?;
                Ok(())
            })?,
            OptimizerState::Host { params, .. } => self.model.visit_params(&mut |name, slot| {
                let host = params.get_mut(name).ok_or_else(|| {
                    ModelError::Input(format!("no host master weights for `{name}`"))
                })?;
                let len = host.master.len();
                let moments = host.moments.get_or_insert_with(|| Moments {
                    m: vec![0.0; len],
                    v: vec![0.0; len],
                });
                backend.adamw_host(
                    slot.param,
                    slot.grad,
                    &mut host.master,
                    &mut moments.m,
                    &mut moments.v,
                    hp,
                )?;
                if let Some(compute) = slot.compute {
                    backend.copy(compute, slot.param)?;
                }
                Ok(())
            })?,
            OptimizerState::Sharded(sharded) => sharded.apply(&mut self.model, hp)?,
        }
        self.model.zero_grad()?;
        Ok(StepOutcome {
            grad_norm,
            skipped: false,
            step: self.step,
        })
    }

    /// Drops the AdamW moments and the step count, as a fresh optimizer would start: a new
    /// phase of training (RL after a supervised warm start) keeps none of the previous
    /// phase's gradient statistics.
    pub fn reset_optimizer(&mut self) {
        match &mut self.state {
            OptimizerState::Device(moments) => moments.clear(),
            OptimizerState::Host { params, .. } => {
                params.values_mut().for_each(|p| p.moments = None);
            }
            OptimizerState::Sharded(sharded) => sharded.reset(),
        }
        self.step = 0;
    }

    /// The f32 weights under training (a LoRA policy's base and adapters are read with
    /// [`Transformer::to_host_weights`] and [`Transformer::adapters_to_host`]): the
    /// model's own Full weights, or the host masters when the optimizer keeps them. A
    /// sharded optimizer's masters are split over the ranks: this gives the model's
    /// weights, in compute precision where the backend has a lower one.
    pub fn master_weights_to_host(&self) -> Result<BTreeMap<String, HostTensor>> {
        let mut weights = self.model.to_host_weights()?;
        if let OptimizerState::Host { params, .. } = &self.state {
            for (name, tensor) in weights.iter_mut() {
                if let Some(param) = params.get(name) {
                    tensor.data.clone_from(&param.master);
                }
            }
        }
        Ok(weights)
    }

    /// Writes the f32 master weights as a Hugging Face folder `dir`: from host memory
    /// where a host optimizer keeps them (borrowed, not copied), else downloaded.
    fn save_masters(&self, dir: &Path) -> Result<()> {
        let config = self.model.config();
        let OptimizerState::Host { params } = &self.state else {
            let host = self.model.to_host_weights()?;
            return Ok(weights::save_model_dir(dir, config, &host, SaveDType::F32)?);
        };
        let specs = weights::tensor_specs(config);
        let mut views = BTreeMap::new();
        for (name, shape) in &specs {
            let param = params
                .get(name)
                .ok_or_else(|| ModelError::Input(format!("no host master weights for `{name}`")))?;
            let data = &param.master;
            views.insert(name.clone(), TensorView { shape, data });
        }
        Ok(weights::save_model_dir_views(
            dir,
            config,
            &views,
            SaveDType::F32,
            weights::DEFAULT_MAX_SHARD_BYTES,
        )?)
    }

    /// Writes the state into `dir` (created if needed): the weights as an f32 Hugging
    /// Face folder under `dir/model` (exact, so a resumed run continues bit for bit) —
    /// or, for a LoRA policy, the adapters as an f32 PEFT folder under `dir/adapter` —,
    /// the AdamW moments in `optimizer.safetensors` (`<param>.exp_avg`,
    /// `<param>.exp_avg_sq`) and the step count in `optimizer.json`. Each file is written
    /// under a temporary name and renamed; `optimizer.json` goes last, so its presence
    /// marks a complete save.
    ///
    /// A sharded state is saved by every rank of its group together: each rank writes its
    /// shard of the masters and moments (`optimizer-rank-R-of-W.safetensors`), then, once
    /// all have, rank 0 writes the weights (the model's own, in their storage precision:
    /// the exact masters are in the shards) and `optimizer.json` with the layout.
    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut sharding = None;
        if let OptimizerState::Sharded(sharded) = &self.state {
            sharding = Some(sharded.save(dir)?);
            sharded.barrier()?;
            if sharded.rank() != 0 {
                return Ok(());
            }
        }
        // A state holds weights or adapters, never both: an overwritten save of the other
        // kind must not leave its folder behind.
        match self.model.lora_config() {
            Some(config) => {
                remove_dir_if_present(&dir.join(MODEL_DIR))?;
                let adapters = self.model.adapters_to_host()?;
                lora::save_adapter_dir(&dir.join(ADAPTER_DIR), config, None, &adapters)?;
            }
            None => {
                remove_dir_if_present(&dir.join(ADAPTER_DIR))?;
                self.save_masters(&dir.join(MODEL_DIR))?;
            }
        }
        let optimizer_file = dir.join(OPTIMIZER_FILE);
        match &self.state {
            OptimizerState::Device(moments) => {
                let backend = self.model.backend();
                let mut tensors = BTreeMap::new();
                for (name, state) in moments {
                    for (suffix, buf) in [(EXP_AVG, &state.m), (EXP_AVG_SQ, &state.v)] {
                        let data = backend.download(buf)?;
                        let shape = vec![data.len()];
                        tensors.insert(format!("{name}.{suffix}"), HostTensor { shape, data });
                    }
                }
                weights::save_tensors(optimizer_file, &tensors)?;
            }
            // Written from where they live: a copy would double the host memory they take
            // (52 GB at 8B).
            OptimizerState::Host { params, .. } => {
                let lengths: Vec<(&str, [usize; 1])> = params
                    .iter()
                    .map(|(name, param)| (name.as_str(), [param.master.len()]))
                    .collect();
                let mut tensors = BTreeMap::new();
                for ((name, shape), param) in lengths.iter().zip(params.values()) {
                    if let Some(Moments { m, v }) = &param.moments {
                        for (suffix, data) in [(EXP_AVG, m), (EXP_AVG_SQ, v)] {
                            let view = TensorView { shape, data };
                            tensors.insert(format!("{name}.{suffix}"), view);
                        }
                    }
                }
                weights::save_tensor_views(optimizer_file, &tensors)?;
            }
            OptimizerState::Sharded(_) => match std::fs::remove_file(&optimizer_file) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::Io {
                        path: optimizer_file,
                        source: e,
                    })
                }
                _ => {}
            },
        }
        let meta = OptimizerMeta {
            step: self.step,
            sharding,
        };
        let meta = serde_json::to_string_pretty(&meta).expect("optimizer meta serializes");
        write_atomically(&dir.join(OPTIMIZER_META), meta.as_bytes())
    }

    /// Restores a full-weight policy written by [`Policy::save`] onto `backend`, with its
    /// optimizer state at `placement`. Errors name the file that is missing or does not
    /// match the model; a LoRA state is refused with a pointer to [`Policy::load_lora`].
    pub fn load(backend: Arc<B>, dir: &Path, placement: OptimizerPlacement) -> Result<Self> {
        if is_lora_state(dir) {
            return Err(Error::Corrupt {
                path: dir.to_path_buf(),
                msg: "this is a LoRA state (adapters only): restore it onto its base model \
                      with Policy::load_lora"
                    .into(),
            });
        }
        let meta = read_optimizer_meta(dir)?;
        let (config, mut host) = weights::load_model_dir(dir.join(MODEL_DIR))?;
        let Some(sharding) = &meta.sharding else {
            let model = Transformer::from_host_weights(Arc::clone(&backend), config, &host)?;
            // The weights are on the backend now; at 8B this host copy is 33 GB, which the
            // moments need next.
            drop(host);
            return Self::with_saved_optimizer(model, dir, meta, placement);
        };
        // Saved in shards: the exact masters and the moments come from every rank's file.
        let specs = weights::tensor_specs(&config);
        let lens: Vec<usize> = specs.iter().map(|(_, s)| s.iter().product()).collect();
        let (masters, moments) = read_full_state(dir, sharding, &lens)?;
        for ((name, _), master) in specs.iter().zip(masters) {
            if let Some(tensor) = host.get_mut(name) {
                tensor.data = master;
            }
        }
        let model = Transformer::from_host_weights(Arc::clone(&backend), config, &host)?;
        drop(host);
        let moments = moments.map(|moments| {
            specs
                .into_iter()
                .map(|(name, _)| name)
                .zip(moments)
                .collect::<BTreeMap<_, _>>()
        });
        Self::with_moments(model, meta.step, moments.unwrap_or_default(), placement)
    }

    /// Restores a full-weight state written by [`Policy::save`] into this policy's own
    /// buffers, one tensor at a time, when it has the same shape and the same kind of
    /// optimizer state (whole at any placement, or sharded in the same buckets: every rank
    /// then calls it together); `Ok(false)` when it cannot (a LoRA state, another shape,
    /// a whole state for a sharded policy or the reverse), and then nothing changed. Building a
    /// second policy beside this one, as [`Policy::load`] does, needs the weights, the
    /// gradients and the optimizer state twice at once: at 8B more than an 80 GB card
    /// and a 125 GB host hold. The files are checked before anything is overwritten.
    pub fn restore_in_place(&mut self, dir: &Path) -> Result<bool> {
        if is_lora_state(dir) || self.model.lora_config().is_some() || self.model.base_is_shared() {
            return Ok(false);
        }
        let meta = read_optimizer_meta(dir)?;
        let model_dir = dir.join(MODEL_DIR);
        let config = floe_model::ModelConfig::from_hf_file(model_dir.join("config.json"))?;
        if &config != self.model.config() {
            return Ok(false);
        }
        match (&mut self.state, &meta.sharding) {
            (OptimizerState::Sharded(sharded), Some(sharding)) => {
                let restored = sharded.restore(&mut self.model, dir, sharding)?;
                if restored {
                    self.step = meta.step;
                }
                return Ok(restored);
            }
            (OptimizerState::Sharded(_), None) | (_, Some(_)) => return Ok(false),
            _ => {}
        }
        // Checked first: every weight present with its shape, the moments complete.
        weights::visit_model_dir(&model_dir, false, &mut |_, _| -> Result<()> { Ok(()) })?;
        let optimizer_path = dir.join(OPTIMIZER_FILE);
        let saved = weights::tensor_shapes(&optimizer_path)?
            .into_iter()
            .map(|(key, shape)| (key, shape.iter().product()))
            .collect();
        check_saved_moments(
            &optimizer_path,
            &saved,
            &trained_lens(&self.model),
            meta.step,
        )?;

        let backend = Arc::clone(self.model.backend());
        let Policy { model, state, .. } = self;
        // The old moments go first: their memory is what the loaded ones take.
        match state {
            OptimizerState::Device(moments) => moments.clear(),
            OptimizerState::Host { params } => params.values_mut().for_each(|p| p.moments = None),
            OptimizerState::Sharded(_) => unreachable!("checked above"),
        }
        weights::visit_model_dir(&model_dir, true, &mut |name, tensor| -> Result<()> {
            let write = |param: &mut B::Buf, compute: Option<&mut B::Buf>| {
                let loaded = backend.upload(&tensor.data, backend.kind(param))?;
                backend.copy(param, &loaded)?;
                if let Some(compute) = compute {
                    backend.copy(compute, param)?;
                }
                Ok::<_, floe_backend::Error>(())
            };
            let mut found = false;
            model.visit_params(&mut |param_name, slot| {
                if param_name == name {
                    write(slot.param, slot.compute)?;
                    found = true;
                }
                Ok(())
            })?;
            if let OptimizerState::Host { params } = state {
                if let Some(param) = params.get_mut(&name) {
                    param.master.clone_from(&tensor.data);
                }
            }
            debug_assert!(found, "a checked tensor is a parameter");
            Ok(())
        })?;
        weights::visit_tensors(&optimizer_path, &mut |key, tensor| -> Result<()> {
            let (name, suffix) = key.rsplit_once('.').expect("checked above");
            match state {
                OptimizerState::Device(moments) => {
                    let len = tensor.data.len();
                    let mut restore = || -> floe_backend::Result<()> {
                        if !moments.contains_key(name) {
                            let fresh = Moments {
                                m: backend.zeros(len, BufKind::Full)?,
                                v: backend.zeros(len, BufKind::Full)?,
                            };
                            moments.insert(name.to_string(), fresh);
                        }
                        let state = moments.get_mut(name).expect("inserted above");
                        let target = if suffix == EXP_AVG {
                            &mut state.m
                        } else {
                            &mut state.v
                        };
                        backend.copy(target, &backend.upload(&tensor.data, BufKind::Full)?)
                    };
                    Ok(restore()?)
                }
                OptimizerState::Host { params } => {
                    let param = params.get_mut(name).expect("checked above");
                    let len = param.master.len();
                    let moments = param.moments.get_or_insert_with(|| Moments {
                        m: vec![0.0; len],
                        v: vec![0.0; len],
                    });
                    let target = if suffix == EXP_AVG {
                        &mut moments.m
                    } else {
                        &mut moments.v
                    };
                    *target = tensor.data;
                    Ok(())
                }
                OptimizerState::Sharded(_) => unreachable!("checked above"),
            }
        })?;
        self.step = meta.step;
        self.model.zero_grad()?;
        Ok(true)
    }

    /// [`Policy::load`] of one rank of a data-parallel group whose optimizer state is
    /// sharded ([`Policy::shard_optimizer`]): every rank calls it with the same `dir`,
    /// saved sharded at any world size (each rank reads the saved shards that overlap
    /// its own) or unsharded (each rank takes its shard of the whole state).
    pub fn load_sharded(
        backend: Arc<B>,
        dir: &Path,
        placement: OptimizerPlacement,
        collective: Arc<dyn Collective<B>>,
    ) -> Result<Self> {
        let meta = read_optimizer_meta(dir)?;
        let Some(sharding) = &meta.sharding else {
            let mut policy = Self::load(backend, dir, OptimizerPlacement::Device)?;
            policy.shard_optimizer(collective, placement)?;
            return Ok(policy);
        };
        let (config, host) = weights::load_model_dir(dir.join(MODEL_DIR))?;
        // The masters come from the shards: where Compute storage is narrower (bf16 on
        // CUDA), the model never holds Full weights, which at 8B would be 33 GB a rank.
        let storage = if backend.compute_is_full() {
            BaseStorage::Trainable
        } else {
            BaseStorage::ComputeOnly
        };
        let mut model = Transformer::from_host_weights_stored(backend, config, &host, storage)?;
        drop(host);
        let sharded = ShardedOptimizer::load(&mut model, collective, placement, dir, sharding)?;
        Ok(Policy {
            model,
            state: OptimizerState::Sharded(sharded),
            step: meta.step,
        })
    }

    /// Restores a LoRA policy written by [`Policy::save`]: the adapters under
    /// `dir/adapter` on `base` (a model without adapters, holding the weights the
    /// adapters were trained on), with their AdamW moments and step count.
    pub fn load_lora(
        base: Transformer<B>,
        dir: &Path,
        placement: OptimizerPlacement,
    ) -> Result<Self> {
        if base.lora_config().is_some() {
            return Err(Error::Model(ModelError::Input(
                "load_lora: the base model already has adapters; give it without".into(),
            )));
        }
        let meta = read_optimizer_meta(dir)?;
        let (config, adapters) = lora::load_adapter_dir(&dir.join(ADAPTER_DIR))?;
        let model = base.with_lora_weights(config, &adapters)?;
        Self::with_saved_optimizer(model, dir, meta, placement)
    }

    /// `model` with the AdamW moments saved in `dir` and the step count of `meta`, the
    /// optimizer state at `placement` (host moments never visit the device).
    fn with_saved_optimizer(
        model: Transformer<B>,
        dir: &Path,
        meta: OptimizerMeta,
        placement: OptimizerPlacement,
    ) -> Result<Self> {
        let optimizer_path = dir.join(OPTIMIZER_FILE);
        let mut tensors = weights::load_tensors(&optimizer_path)?;
        let saved = tensors
            .iter()
            .map(|(key, t)| (key.clone(), t.data.len()))
            .collect();
        check_saved_moments(&optimizer_path, &saved, &trained_lens(&model), meta.step)?;
        let mut moments = BTreeMap::new();
        for (name, _) in model.trainable_specs() {
            let mut take = |suffix: &str| tensors.remove(&format!("{name}.{suffix}"));
            if let (Some(m), Some(v)) = (take(EXP_AVG), take(EXP_AVG_SQ)) {
                moments.insert(name, (m.data, v.data));
            }
        }
        Self::with_moments(model, meta.step, moments, placement)
    }

    /// `model` after `step` optimizer steps with these AdamW `moments` (by parameter
    /// name), the optimizer state at `placement`.
    fn with_moments(
        model: Transformer<B>,
        step: u64,
        moments: BTreeMap<String, (Vec<f32>, Vec<f32>)>,
        placement: OptimizerPlacement,
    ) -> Result<Self> {
        let mut policy = Policy::new(model);
        policy.step = step;
        policy.set_optimizer_placement(placement)?;
        let backend = Arc::clone(policy.model.backend());
        for (name, (m, v)) in moments {
            match &mut policy.state {
                OptimizerState::Device(device) => {
                    let state = Moments {
                        m: backend.upload(&m, BufKind::Full)?,
                        v: backend.upload(&v, BufKind::Full)?,
                    };
                    device.insert(name, state);
                }
                OptimizerState::Host { params, .. } => {
                    let param = params.get_mut(&name).expect("a trainable parameter");
                    param.moments = Some(Moments { m, v });
                }
                OptimizerState::Sharded(_) => unreachable!("a new policy is not sharded"),
            }
        }
        Ok(policy)
    }
}

/// Elements of one bucket of a sharded optimizer: 100 MB of f32 gradients staged for each
/// reduce-scatter. Saved with the state, so a checkpoint keeps its layout.
const SHARD_BUCKET_ELEMENTS: usize = 25 << 20;

/// Elements of one bucket of the data-parallel gradient sum: 100 MB of f32, about what
/// PyTorch's DDP buckets hold (25 MB by default) times four, since floe sums once per
/// step, after the backward, rather than overlapping buckets with it.
const GRAD_BUCKET_ELEMENTS: usize = 25 << 20;

/// Consecutive parameters (by their gradients' `lens`) grouped into buckets of at most
/// `capacity` elements; a parameter larger than that is a bucket alone.
fn grad_buckets(lens: &[usize], capacity: usize) -> Vec<std::ops::Range<usize>> {
    let mut buckets = Vec::new();
    let (mut start, mut filled) = (0, 0);
    for (i, &len) in lens.iter().enumerate() {
        if i > start && filled + len > capacity {
            buckets.push(start..i);
            (start, filled) = (i, 0);
        }
        filled += len;
    }
    if start < lens.len() {
        buckets.push(start..lens.len());
    }
    buckets
}

/// The device moments of parameter `name`, zeros of `param`'s length the first time.
fn device_moments<'m, B: Backend>(
    backend: &B,
    moments: &'m mut BTreeMap<String, Moments<B::Buf>>,
    name: &str,
    param: &B::Buf,
) -> floe_model::transformer::Result<&'m mut Moments<B::Buf>> {
    if !moments.contains_key(name) {
        let len = backend.len(param);
        let state = Moments {
            m: backend.zeros(len, BufKind::Full)?,
            v: backend.zeros(len, BufKind::Full)?,
        };
        moments.insert(name.to_string(), state);
    }
    Ok(moments.get_mut(name).expect("inserted above"))
}

/// Elements of each trained parameter of `model`, by name.
fn trained_lens<B: Backend>(model: &Transformer<B>) -> BTreeMap<String, usize> {
    model
        .trainable_specs()
        .into_iter()
        .map(|(name, shape)| (name, shape.iter().product()))
        .collect()
}

/// Checks the AdamW moments saved in `path` (`saved`: tensor name to its elements)
/// against the parameters' `lens` after `step` steps: every tensor a moment of a
/// parameter, of its length, both moments or neither, and some once a step was taken.
fn check_saved_moments(
    path: &Path,
    saved: &BTreeMap<String, usize>,
    lens: &BTreeMap<String, usize>,
    step: u64,
) -> Result<()> {
    let corrupt = |msg: String| Error::Corrupt {
        path: path.to_path_buf(),
        msg,
    };
    for (key, &elements) in saved {
        let (name, suffix) = key.rsplit_once('.').unwrap_or((key, ""));
        let Some(&len) = lens.get(name) else {
            return Err(corrupt(format!(
                "tensor `{key}` belongs to no parameter of the model"
            )));
        };
        let other = match suffix {
            EXP_AVG => EXP_AVG_SQ,
            EXP_AVG_SQ => EXP_AVG,
            _ => return Err(corrupt(format!("tensor `{key}` is not an AdamW moment"))),
        };
        if elements != len {
            return Err(corrupt(format!(
                "tensor `{key}` has {elements} values; the parameter has {len}"
            )));
        }
        if !saved.contains_key(&format!("{name}.{other}")) {
            return Err(corrupt(format!(
                "`{name}` has only one of its two AdamW moments"
            )));
        }
    }
    if step > 0 && saved.is_empty() {
        return Err(corrupt(format!("no AdamW moments after {step} steps")));
    }
    Ok(())
}

fn read_optimizer_meta(dir: &Path) -> Result<OptimizerMeta> {
    let meta_path = dir.join(OPTIMIZER_META);
    let meta_text = std::fs::read_to_string(&meta_path).map_err(|source| Error::Io {
        path: meta_path.clone(),
        source,
    })?;
    serde_json::from_str(&meta_text).map_err(|err| Error::Corrupt {
        path: meta_path,
        msg: err.to_string(),
    })
}

/// Whether `dir` holds a LoRA state written by [`Policy::save`] (adapters, no weights).
pub fn is_lora_state(dir: &Path) -> bool {
    dir.join(ADAPTER_DIR).join(ADAPTER_CONFIG_FILE).is_file()
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

/// Writes `bytes` to `path` through a temporary sibling (`<name>.tmp`) and a rename, so
/// a crash never leaves a half-written file under the final name.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).map_err(|source| Error::Io {
        path: tmp.clone(),
        source,
    })?;
    std::fs::rename(&tmp, path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharded;
    use floe_backend::cpu::CpuBackend;
    use floe_backend::InProcessCollective;
    use floe_model::{Architecture, ModelConfig};

    fn tiny_config() -> ModelConfig {
        ModelConfig {
            tie_word_embeddings: false,
            ..ModelConfig::test_shape(Architecture::Qwen3)
        }
    }

    const PARAMS: OptimParams = OptimParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        max_grad_norm: 1.0,
    };

    /// One step of mean-NLL training on a fixed batch.
    fn train_step(policy: &mut Policy<CpuBackend>, batch: &PackedBatch) -> StepOutcome {
        let rows = batch.len();
        policy
            .forward_backward(batch, 1.0, &mut |_| {
                Ok((vec![-1.0 / rows as f64; rows], vec![0.0; rows]))
            })
            .unwrap();
        policy.optim_step(&PARAMS).unwrap()
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("floe-policy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn save_then_load_continues_bit_identically() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let model = Transformer::new_random(Arc::clone(&backend), tiny_config(), 7).unwrap();
        let mut straight = Policy::new(model);
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11], vec![2, 4, 6]]).unwrap();
        for _ in 0..2 {
            train_step(&mut straight, &batch);
        }
        let dir = temp_dir("resume");
        straight.save(&dir).unwrap();
        let mut resumed =
            Policy::load(Arc::clone(&backend), &dir, OptimizerPlacement::Device).unwrap();
        assert_eq!(resumed.step(), 2);
        let a = train_step(&mut straight, &batch);
        let b = train_step(&mut resumed, &batch);
        assert_eq!(a, b);
        assert_eq!(
            straight.model().to_host_weights().unwrap(),
            resumed.model().to_host_weights().unwrap()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn non_finite_gradient_skips_the_step_and_clears_gradients() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
        let mut policy = Policy::new(model);
        let before = policy.model().to_host_weights().unwrap();
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7]]).unwrap();
        policy
            .forward_backward(&batch, 1.0, &mut |_| Ok((vec![f64::NAN; 2], vec![0.0; 2])))
            .unwrap();
        let outcome = policy.optim_step(&PARAMS).unwrap();
        assert!(outcome.skipped && outcome.step == 0);
        assert_eq!(policy.model().to_host_weights().unwrap(), before);
        assert_eq!(policy.grad_norm().unwrap(), 0.0);
    }

    fn lora_policy(backend: &Arc<CpuBackend>, base_seed: u64) -> Policy<CpuBackend> {
        let model = Transformer::new_random(Arc::clone(backend), tiny_config(), base_seed).unwrap();
        Policy::new(model.with_lora(lora::LoraConfig::new(4)).unwrap())
    }

    #[test]
    fn a_lora_policy_trains_only_its_adapters() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let mut policy = lora_policy(&backend, 7);
        let base = policy.model().to_host_weights().unwrap();
        let adapters = policy.model().adapters_to_host().unwrap();
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11], vec![2, 4, 6]]).unwrap();
        let loss = |p: &Policy<CpuBackend>| -> f64 {
            -p.model()
                .forward(&batch, 1.0)
                .unwrap()
                .logprobs
                .iter()
                .sum::<f64>()
        };
        let before = loss(&policy);
        for _ in 0..3 {
            assert!(!train_step(&mut policy, &batch).skipped);
        }
        assert!(loss(&policy) < before, "{} !< {before}", loss(&policy));
        assert_eq!(
            policy.model().to_host_weights().unwrap(),
            base,
            "the base is frozen"
        );
        assert_ne!(policy.model().adapters_to_host().unwrap(), adapters);
        // AdamW moments exist for the adapters alone.
        let OptimizerState::Device(moments) = &policy.state else {
            unreachable!("a new policy's optimizer is on its device")
        };
        assert!(moments.keys().all(|name| name.contains(".lora_")));
        assert_eq!(moments.len(), policy.model().trainable_specs().len());
    }

    #[test]
    fn a_lora_state_saves_adapters_and_resumes_bit_identically_on_its_base() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let mut straight = lora_policy(&backend, 7);
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11], vec![2, 4, 6]]).unwrap();
        for _ in 0..2 {
            train_step(&mut straight, &batch);
        }
        let dir = temp_dir("lora-resume");
        straight.save(&dir).unwrap();
        assert!(is_lora_state(&dir) && !dir.join(MODEL_DIR).exists());
        let err =
            Policy::<CpuBackend>::load(Arc::clone(&backend), &dir, OptimizerPlacement::Device)
                .err()
                .unwrap();
        assert!(err.to_string().contains("load_lora"), "{err}");
        let base = Transformer::new_random(Arc::clone(&backend), tiny_config(), 7).unwrap();
        let mut resumed = Policy::load_lora(base, &dir, OptimizerPlacement::Device).unwrap();
        assert_eq!(resumed.step(), 2);
        assert_eq!(
            train_step(&mut straight, &batch),
            train_step(&mut resumed, &batch)
        );
        assert_eq!(
            straight.model().adapters_to_host().unwrap(),
            resumed.model().adapters_to_host().unwrap()
        );
        // Saving a full-weight state over it leaves no adapters behind.
        let model = Transformer::new_random(Arc::clone(&backend), tiny_config(), 7).unwrap();
        Policy::new(model).save(&dir).unwrap();
        assert!(!is_lora_state(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn load_names_a_missing_state_file() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let dir = temp_dir("missing");
        let err = Policy::<CpuBackend>::load(backend, &dir, OptimizerPlacement::Device)
            .err()
            .unwrap();
        assert!(err.to_string().contains(OPTIMIZER_META), "{err}");
    }

    #[test]
    fn the_host_optimizer_updates_as_the_device_optimizer_does() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let model = |seed| Transformer::new_random(Arc::clone(&backend), tiny_config(), seed);
        let mut device = Policy::new(model(7).unwrap());
        let mut host = Policy::new(model(7).unwrap());
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11], vec![2, 4, 6]]).unwrap();
        // One step on the device before moving: the moments move with the masters.
        assert_eq!(
            train_step(&mut device, &batch),
            train_step(&mut host, &batch)
        );
        host.set_optimizer_placement(OptimizerPlacement::Host)
            .unwrap();
        assert_eq!(host.optimizer_placement(), OptimizerPlacement::Host);
        for _ in 0..3 {
            assert_eq!(
                train_step(&mut device, &batch),
                train_step(&mut host, &batch)
            );
        }
        let weights = device.model().to_host_weights().unwrap();
        assert_eq!(host.model().to_host_weights().unwrap(), weights);
        assert_eq!(host.master_weights_to_host().unwrap(), weights);
        // A saved host state resumes on the host and on the device alike.
        let dir = temp_dir("host-optimizer");
        host.save(&dir).unwrap();
        let expected = train_step(&mut device, &batch);
        for placement in [OptimizerPlacement::Host, OptimizerPlacement::Device] {
            let mut resumed = Policy::load(Arc::clone(&backend), &dir, placement).unwrap();
            assert_eq!(resumed.optimizer_placement(), placement);
            assert_eq!(train_step(&mut resumed, &batch), expected);
            assert_eq!(
                resumed.master_weights_to_host().unwrap(),
                device.model().to_host_weights().unwrap()
            );
        }
        let err = host
            .set_optimizer_placement(OptimizerPlacement::Device)
            .unwrap_err();
        assert!(err.to_string().contains("host memory"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gradients_go_in_buckets_of_consecutive_parameters() {
        assert_eq!(
            grad_buckets(&[3, 4, 10, 2, 2, 8], 8),
            vec![0..2, 2..3, 3..5, 5..6]
        );
        assert!(grad_buckets(&[], 8).is_empty());
    }

    #[test]
    fn bucketed_gradient_sums_equal_each_parameters_sum_bit_for_bit() {
        let group = InProcessCollective::<f32>::group(2, std::time::Duration::from_secs(60));
        let batches = [vec![3, 5, 7, 9, 11], vec![2, 4, 6]];
        // Small buckets: norms share one, projections and embeddings are summed alone.
        let capacity = 300;
        let ranks: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = group
                .into_iter()
                .zip(&batches)
                .map(|(collective, tokens)| {
                    scope.spawn(move || {
                        let backend = Arc::new(CpuBackend::<f32>::new());
                        let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
                        let mut policy = Policy::new(model);
                        let batch =
                            PackedBatch::from_sequences(std::slice::from_ref(tokens)).unwrap();
                        let rows = batch.len();
                        policy
                            .forward_backward(&batch, 1.0, &mut |_| {
                                Ok((vec![-1.0; rows], vec![0.0; rows]))
                            })
                            .unwrap();
                        let own = policy.model().grads_to_host().unwrap();
                        policy.all_reduce_gradients(&collective, capacity).unwrap();
                        (own, policy.model().grads_to_host().unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let lens: Vec<usize> = ranks[0].0.values().map(|t| t.data.len()).collect();
        assert!(lens.iter().any(|&n| n <= capacity / 2) && lens.iter().any(|&n| n > capacity));
        for (name, own0) in &ranks[0].0 {
            let sum: Vec<f32> = own0
                .data
                .iter()
                .zip(&ranks[1].0[name].data)
                .map(|(a, b)| a + b)
                .collect();
            assert_eq!(ranks[0].1[name].data, sum, "{name}");
            assert_eq!(ranks[1].1[name].data, sum, "{name}");
        }
    }

    /// Sets the gradients to `grads` (by name).
    fn set_grads(policy: &mut Policy<CpuBackend>, grads: &BTreeMap<String, HostTensor>) {
        let backend = Arc::clone(policy.model.backend());
        policy
            .model
            .visit_params(&mut |name, slot| {
                let grad = backend.upload(&grads[name].data, BufKind::Full)?;
                Ok(backend.copy(slot.grad, &grad)?)
            })
            .unwrap();
    }

    /// Element-wise sum of every rank's gradients, in rank order (the in-process
    /// collective's order).
    fn summed(ranks: &[BTreeMap<String, HostTensor>]) -> BTreeMap<String, HostTensor> {
        let mut sum = ranks[0].clone();
        for rank in &ranks[1..] {
            for (name, tensor) in sum.iter_mut() {
                for (s, g) in tensor.data.iter_mut().zip(&rank[name].data) {
                    *s += g;
                }
            }
        }
        sum
    }

    /// What each rank of a sharded group did: its own gradients of every step, the step
    /// outcomes, and its weights at the end.
    type ShardedRun = (
        Vec<BTreeMap<String, HostTensor>>,
        Vec<StepOutcome>,
        BTreeMap<String, HostTensor>,
    );

    /// `steps` steps of `world_size` ranks (threads) whose optimizer is sharded in
    /// buckets of `bucket_elements`, each rank on its own batch; the policies start from
    /// `start(rank)` and end saved under `save` when given.
    fn sharded_ranks(
        world_size: usize,
        start: &(dyn Fn(Arc<dyn Collective<CpuBackend>>) -> Policy<CpuBackend> + Sync),
        steps: usize,
        params: &OptimParams,
        save: Option<&Path>,
    ) -> Vec<ShardedRun> {
        let group =
            InProcessCollective::<f32>::group(world_size, std::time::Duration::from_secs(60));
        std::thread::scope(|scope| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(rank, collective)| {
                    scope.spawn(move || {
                        let collective: Arc<dyn Collective<CpuBackend>> = Arc::new(collective);
                        let mut policy = start(Arc::clone(&collective));
                        assert!(policy.is_sharded());
                        let (mut grads, mut outcomes) = (Vec::new(), Vec::new());
                        for step in 0..steps {
                            let tokens: Vec<u32> = (0..4 + rank + step)
                                .map(|i| (3 + 5 * i + rank) as u32 % 30)
                                .collect();
                            let batch = PackedBatch::from_sequences(&[tokens]).unwrap();
                            let rows = batch.len();
                            policy
                                .forward_backward(&batch, 1.0, &mut |_| {
                                    Ok((vec![-1.0; rows], vec![0.0; rows]))
                                })
                                .unwrap();
                            grads.push(policy.model().grads_to_host().unwrap());
                            let outcome = policy
                                .optim_step_data_parallel(params, &*collective)
                                .unwrap();
                            outcomes.push(outcome);
                        }
                        if let Some(dir) = save {
                            policy.save(dir).unwrap();
                        }
                        (grads, outcomes, policy.master_weights_to_host().unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Steps `reference` with the summed gradients of `ranks`, checking that every rank
    /// reported the reference's outcome (its norm up to the order of the sums) and ends
    /// with its weights bit for bit.
    fn assert_steps_as_one(
        reference: &mut Policy<CpuBackend>,
        ranks: &[ShardedRun],
        params: &OptimParams,
    ) {
        for step in 0..ranks[0].1.len() {
            let grads: Vec<_> = ranks.iter().map(|r| r.0[step].clone()).collect();
            set_grads(reference, &summed(&grads));
            let expected = reference.optim_step(params).unwrap();
            for (rank, run) in ranks.iter().enumerate() {
                let got = run.1[step];
                assert_eq!((got.skipped, got.step), (expected.skipped, expected.step));
                let close = (got.grad_norm - expected.grad_norm).abs() <= 1e-6 * expected.grad_norm;
                assert!(
                    close,
                    "rank {rank} step {step}: norm {} vs {}",
                    got.grad_norm, expected.grad_norm
                );
            }
        }
        let weights = reference.model().to_host_weights().unwrap();
        for (rank, run) in ranks.iter().enumerate() {
            assert!(
                run.2 == weights,
                "rank {rank}'s weights differ from one optimizer's"
            );
        }
    }

    #[test]
    fn a_sharded_optimizer_steps_as_one_optimizer_and_resumes_at_any_world_size() {
        // No clipping, so the update sees the same gradient bits as one optimizer's.
        let params = OptimParams {
            max_grad_norm: 0.0,
            ..PARAMS
        };
        // Small buckets: parameters span buckets, and buckets are padded for 3 ranks.
        let bucket_elements = 301;
        let dir = temp_dir("sharded");
        for placement in [OptimizerPlacement::Device, OptimizerPlacement::Host] {
            let fresh = |collective: Arc<dyn Collective<CpuBackend>>| {
                let backend = Arc::new(CpuBackend::<f32>::new());
                let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
                let mut policy = Policy::new(model);
                policy
                    .shard_optimizer_in_buckets(collective, placement, bucket_elements)
                    .unwrap();
                policy
            };
            let ranks = sharded_ranks(3, &fresh, 3, &params, Some(&dir));
            let backend = Arc::new(CpuBackend::<f32>::new());
            let model = Transformer::new_random(Arc::clone(&backend), tiny_config(), 7).unwrap();
            let mut reference = Policy::new(model);
            assert_steps_as_one(&mut reference, &ranks, &params);
            assert!(dir.join(sharded::shard_file(2, 3)).is_file());
            assert!(!dir.join(OPTIMIZER_FILE).exists());

            // Saved over 3 ranks, resumed on 2 and on 4 ranks, and by one unsharded policy.
            for world_size in [2, 4] {
                let resume = |collective: Arc<dyn Collective<CpuBackend>>| {
                    let backend = Arc::new(CpuBackend::<f32>::new());
                    Policy::load_sharded(backend, &dir, placement, collective).unwrap()
                };
                let resumed = sharded_ranks(world_size, &resume, 1, &params, None);
                let mut next = Policy::load(Arc::clone(&backend), &dir, placement).unwrap();
                assert_eq!(next.step(), 3);
                assert!(next.master_weights_to_host().unwrap() == ranks[0].2);
                assert_steps_as_one(&mut next, &resumed, &params);
            }
        }
        // An unsharded state splits when loaded by a sharded group.
        let model = Transformer::new_random(
            Arc::clone(&Arc::new(CpuBackend::<f32>::new())),
            tiny_config(),
            7,
        )
        .unwrap();
        let mut single = Policy::new(model);
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11]]).unwrap();
        train_step(&mut single, &batch);
        single.save(&dir).unwrap();
        let resume = |collective: Arc<dyn Collective<CpuBackend>>| {
            let backend = Arc::new(CpuBackend::<f32>::new());
            Policy::load_sharded(backend, &dir, OptimizerPlacement::Device, collective).unwrap()
        };
        let resumed = sharded_ranks(2, &resume, 2, &params, None);
        assert_steps_as_one(&mut single, &resumed, &params);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn clipping_uses_the_norm_of_the_summed_shards() {
        let params = OptimParams {
            max_grad_norm: 0.01,
            ..PARAMS
        };
        let bucket_elements = 97;
        let fresh = |collective: Arc<dyn Collective<CpuBackend>>| {
            let backend = Arc::new(CpuBackend::<f32>::new());
            let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
            let mut policy = Policy::new(model);
            policy
                .shard_optimizer_in_buckets(collective, OptimizerPlacement::Device, bucket_elements)
                .unwrap();
            policy
        };
        let ranks = sharded_ranks(2, &fresh, 1, &params, None);
        let backend = Arc::new(CpuBackend::<f32>::new());
        let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
        let mut reference = Policy::new(model);
        let grads: Vec<_> = ranks.iter().map(|r| r.0[0].clone()).collect();
        set_grads(&mut reference, &summed(&grads));
        let expected = reference.optim_step(&params).unwrap();
        assert!(
            expected.grad_norm > f64::from(params.max_grad_norm),
            "the clip acts"
        );
        let weights = reference.model().to_host_weights().unwrap();
        for run in &ranks {
            assert!((run.1[0].grad_norm - expected.grad_norm).abs() <= 1e-6 * expected.grad_norm);
            for (name, tensor) in &weights {
                for (g, e) in run.2[name].data.iter().zip(&tensor.data) {
                    assert!((g - e).abs() <= 1e-6, "{name}: {g} vs {e}");
                }
            }
        }
        assert!(ranks[0].2 == ranks[1].2, "ranks agree bit for bit");
    }

    /// What a rank of [`staged_ranks`] did: its step outcomes, its weights at the end,
    /// and the gradient elements its model held.
    type StagedRun = (Vec<StepOutcome>, BTreeMap<String, HostTensor>, usize);

    /// `steps` steps of `world_size` ranks whose optimizer is sharded in buckets of
    /// `bucket_elements`, and the gradients too at `stage` 2. Rank r runs `1 + r % 2`
    /// micro-batches a step, the others joining with empty backwards as the engine has
    /// them do; at step `nan_step` rank 0's loss gradient is NaN.
    fn staged_ranks(
        world_size: usize,
        stage: u8,
        bucket_elements: usize,
        steps: usize,
        params: &OptimParams,
        nan_step: Option<usize>,
    ) -> Vec<StagedRun> {
        let group =
            InProcessCollective::<f32>::group(world_size, std::time::Duration::from_secs(60));
        let most = if world_size > 1 { 2 } else { 1 };
        std::thread::scope(|scope| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(rank, collective)| {
                    scope.spawn(move || {
                        let collective: Arc<dyn Collective<CpuBackend>> = Arc::new(collective);
                        let backend = Arc::new(CpuBackend::<f32>::new());
                        let model = Transformer::new_random(backend, tiny_config(), 7).unwrap();
                        let mut policy = Policy::new(model);
                        policy
                            .shard_optimizer_in_buckets(
                                Arc::clone(&collective),
                                OptimizerPlacement::Device,
                                bucket_elements,
                            )
                            .unwrap();
                        if stage == 2 {
                            policy.shard_gradients().unwrap();
                        }
                        let micro_batches = 1 + rank % 2;
                        let mut outcomes = Vec::new();
                        for step in 0..steps {
                            for mb in 0..micro_batches {
                                let tokens: Vec<u32> = (0..4 + rank + step + mb)
                                    .map(|i| (3 + 5 * i + rank + 7 * mb) as u32 % 30)
                                    .collect();
                                let batch = PackedBatch::from_sequences(&[tokens]).unwrap();
                                let rows = batch.len();
                                let poison = nan_step == Some(step) && rank == 0;
                                let d = if poison { f64::NAN } else { -1.0 };
                                policy
                                    .forward_backward(&batch, 1.0, &mut |_| {
                                        Ok((vec![d; rows], vec![0.0; rows]))
                                    })
                                    .unwrap();
                            }
                            for _ in micro_batches..most {
                                policy.reduce_empty_backward().unwrap();
                            }
                            outcomes.push(
                                policy
                                    .optim_step_data_parallel(params, &*collective)
                                    .unwrap(),
                            );
                        }
                        let held = policy.model().base_gradient_elements();
                        (outcomes, policy.master_weights_to_host().unwrap(), held)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn sharded_gradients_step_as_stage_1_over_micro_batches_clipping_and_skips() {
        let params = OptimParams {
            max_grad_norm: 0.05,
            ..PARAMS
        };
        let config = tiny_config();
        let elements = config.num_parameters();
        // Stage 2's model keeps one layer's, the final norm's and one [vocab, hidden]
        // tensor's gradients.
        let layer: usize = floe_model::weights::tensor_specs(&config)
            .iter()
            .filter(|(name, _)| name.starts_with("model.layers.0."))
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum();
        let streamed = layer + (config.vocab_size + 1) * config.hidden_size;
        assert!(streamed < elements);
        // Small buckets: parameters span buckets and buckets span layers.
        for (world_size, bucket_elements) in [(1, 97), (2, 97), (3, 301), (4, 1000)] {
            let stage_1 = staged_ranks(world_size, 1, bucket_elements, 4, &params, Some(2));
            let stage_2 = staged_ranks(world_size, 2, bucket_elements, 4, &params, Some(2));
            let what = format!("{world_size} ranks, buckets of {bucket_elements}");
            for (rank, (one, two)) in stage_1.iter().zip(&stage_2).enumerate() {
                assert_eq!(one.2, elements, "{what}: stage 1 holds every gradient");
                assert_eq!(
                    two.2, streamed,
                    "{what}: stage 2 rank {rank}'s gradient elements (of {elements})"
                );
                for (step, (a, b)) in one.0.iter().zip(&two.0).enumerate() {
                    assert_eq!(
                        (a.skipped, a.step),
                        (b.skipped, b.step),
                        "{what} step {step}"
                    );
                    assert_eq!(a.skipped, step == 2, "{what} step {step}: the NaN skips");
                    if !a.skipped {
                        assert!(
                            a.grad_norm > f64::from(params.max_grad_norm),
                            "the clip acts"
                        );
                        let close = (a.grad_norm - b.grad_norm).abs() <= 1e-6 * a.grad_norm;
                        assert!(
                            close,
                            "{what} rank {rank} step {step}: norm {} (stage 1) vs {} (stage 2)",
                            a.grad_norm, b.grad_norm
                        );
                    }
                }
                // One rank sums the micro-batches in stage 1's order: the same bits.
                if world_size == 1 {
                    // Bits, so the skipped step's NaN norms compare equal.
                    let bits = |o: &[StepOutcome]| -> Vec<(u64, bool, u64)> {
                        o.iter()
                            .map(|o| (o.grad_norm.to_bits(), o.skipped, o.step))
                            .collect()
                    };
                    assert!(
                        bits(&one.0) == bits(&two.0),
                        "{what}: outcomes {:?} (stage 1) vs {:?}",
                        one.0,
                        two.0
                    );
                    for (name, tensor) in &one.1 {
                        assert!(tensor == &two.1[name], "{what}: {name} not bit for bit");
                    }
                }
                for (name, tensor) in &one.1 {
                    for (a, b) in tensor.data.iter().zip(&two.1[name].data) {
                        assert!(
                            (a - b).abs() <= 2e-5,
                            "{what}: {name}: {a} (stage 1) vs {b}"
                        );
                    }
                }
            }
            assert!(
                stage_2.iter().all(|run| run.1 == stage_2[0].1),
                "{what}: ranks agree bit for bit"
            );
        }
    }

    #[test]
    fn a_state_restores_in_place_as_a_fresh_load_does_and_a_bad_one_changes_nothing() {
        let backend = Arc::new(CpuBackend::<f32>::new());
        let batch = PackedBatch::from_sequences(&[vec![3, 5, 7, 9, 11], vec![2, 4, 6]]).unwrap();
        let dir = temp_dir("in-place");
        for placement in [OptimizerPlacement::Device, OptimizerPlacement::Host] {
            let model = |seed| Transformer::new_random(Arc::clone(&backend), tiny_config(), seed);
            let mut saved = Policy::new(model(7).unwrap());
            saved.set_optimizer_placement(placement).unwrap();
            for _ in 0..2 {
                train_step(&mut saved, &batch);
            }
            saved.save(&dir).unwrap();
            let expected = train_step(&mut saved, &batch);
            // Another policy of the shape, trained elsewhere, takes the saved state.
            let mut other = Policy::new(model(11).unwrap());
            other.set_optimizer_placement(placement).unwrap();
            train_step(&mut other, &batch);
            assert!(other.restore_in_place(&dir).unwrap());
            assert_eq!(other.step(), 2);
            assert_eq!(train_step(&mut other, &batch), expected, "{placement:?}");
            assert_eq!(
                other.master_weights_to_host().unwrap(),
                saved.master_weights_to_host().unwrap()
            );
        }
        // A moment of the wrong length: refused before any weight changed.
        let mut tensors = weights::load_tensors(dir.join(OPTIMIZER_FILE)).unwrap();
        let key = tensors.keys().next().unwrap().clone();
        tensors.get_mut(&key).unwrap().data.pop();
        tensors.get_mut(&key).unwrap().shape = vec![tensors[&key].data.len()];
        weights::save_tensors(dir.join(OPTIMIZER_FILE), &tensors).unwrap();
        let mut policy =
            Policy::new(Transformer::new_random(Arc::clone(&backend), tiny_config(), 5).unwrap());
        let before = policy.master_weights_to_host().unwrap();
        let err = policy.restore_in_place(&dir).unwrap_err().to_string();
        assert!(err.contains(&key) && err.contains("values"), "{err}");
        assert_eq!(policy.master_weights_to_host().unwrap(), before);
        assert_eq!(policy.step(), 0);
        // Another shape is not restored in place.
        let config = ModelConfig {
            num_hidden_layers: tiny_config().num_hidden_layers + 1,
            ..tiny_config()
        };
        let mut deeper =
            Policy::new(Transformer::new_random(Arc::clone(&backend), config, 5).unwrap());
        assert!(!deeper.restore_in_place(&dir).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
