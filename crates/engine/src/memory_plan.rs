//! The memory plan of a local engine: what the device and the host will hold once the
//! engine trains and samples, computed from the model's shape before anything is
//! allocated, so a run that cannot fit says so at start, naming the knob that frees
//! memory, instead of running out of memory in the middle of a step.
//!
//! The device holds the weights (and, unless the optimizer lives on the host, their f32
//! masters and AdamW moments), the f32 gradients of what trains, one micro-batch's
//! activations (counted by the model's own constructors,
//! [`Transformer::training_activation_bytes`]), the backend's workspaces and the
//! sampler's KV cache, which gets what is left of the budget. Items used only while a
//! step runs are marked [`PlanItem::per_step`]: other engines on the device must leave
//! them free (see the `admission` module).
//!
//! The plan also decides how many layers the backward recomputes ([`Recompute`]): with
//! `auto`, the fewest that leave the KV cache the room it wants.

use std::fmt;
use std::str::FromStr;

use floe_backend::BufKind;
use floe_model::lora::{adapter_specs, LoraConfig};
use floe_model::transformer::{max_recomputed_layers, Transformer};
use floe_model::weights::tensor_specs;
use floe_model::ModelConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::device::Device;
use crate::policy::OptimizerPlacement;

/// The CUDA backend's lm-head works through logits of at most this many elements at a
/// time (f32; the backward holds a second such chunk), as `floe_model` sizes its chunks.
const DEVICE_LM_HEAD_CHUNK_LOGITS: usize = 1 << 26;
/// Elements of a sharded optimizer's staging bucket (`policy::SHARD_BUCKET_ELEMENTS`):
/// one of gradients (Full) and one of weights (compute precision) are held.
const SHARD_STAGING_ELEMENTS: usize = 25 << 20;
/// cuBLAS workspace and the CUDA context's own allocations, kept free.
const DEVICE_RESERVE_BYTES: usize = 1 << 30;
/// The smallest KV cache worth sampling with: a plan that leaves less does not fit.
pub const MIN_KV_CACHE_BYTES: usize = 256 << 20;

/// What a plan is made from.
#[derive(Clone, Debug)]
pub struct PlanInputs<'a> {
    /// The model's shape.
    pub model: &'a ModelConfig,
    /// Adapters that train on a frozen base, if any.
    pub lora: Option<&'a LoraConfig>,
    /// The base weights are already on the device (a base shared by several engines, or
    /// a model already loaded) and cost this engine nothing.
    pub base_resident: bool,
    /// The device.
    pub device: Device,
    /// Where the optimizer keeps masters and moments.
    pub placement: OptimizerPlacement,
    /// Ranks the optimizer state is split over (`engine.zero_stage = 1` on a
    /// data-parallel group; 1: each rank holds all of it). Adapters are never split.
    pub optimizer_shards: usize,
    /// The f32 gradients are split over those ranks too (`engine.zero_stage = 2`): a
    /// rank holds its shard and one layer's and one `[vocab, hidden]` tensor's
    /// gradients, which the backward reuses.
    pub gradient_shards: bool,
    /// Ranks of the data-parallel group (1: alone): with more, a refusal names
    /// `engine.zero_stage` when the optimizer state is whole.
    pub data_parallel_ranks: usize,
    /// Which layers' activations the backward recomputes.
    pub recompute: Recompute,
    /// Tokens the sampler's KV cache should hold; [`Recompute::Auto`] recomputes layers
    /// rather than leave it less room (0: only [`MIN_KV_CACHE_BYTES`]).
    pub kv_cache_tokens_wanted: usize,
    /// A KV cache of a fixed size instead of what the plan leaves (`floe serve
    /// --kv-cache-gib`); [`Recompute::Auto`] leaves it room too.
    pub kv_cache_bytes: Option<usize>,
    /// Most tokens in one training micro-batch.
    pub max_tokens_per_microbatch: usize,
    /// Bytes the engine may use on the device (`engine.memory_fraction` of its free
    /// memory, less what other engines reserve for their steps); `None` on the CPU,
    /// whose KV cache has a fixed size.
    pub budget_bytes: Option<usize>,
    /// Of the device's free memory, bytes that other engines on it reserve for their
    /// steps (already taken out of `budget_bytes`; shown, and named in a refusal).
    pub reserved_by_others: usize,
}

/// One line of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanItem {
    /// What the bytes hold.
    pub what: &'static str,
    /// How many.
    pub bytes: usize,
    /// Used only while a step runs (freed between steps); the rest is allocated when
    /// the engine is built and held.
    pub per_step: bool,
}

/// What the device and the host will hold; see the module docs.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Resident on the device besides the KV cache.
    pub device: Vec<PlanItem>,
    /// Resident in host memory (the optimizer, when it lives there).
    pub host: Vec<PlanItem>,
    /// The device budget, when the device has one.
    pub budget_bytes: Option<usize>,
    /// Bytes other engines on the device reserve for their steps.
    pub reserved_by_others: usize,
    /// Layers whose activations the backward recomputes (the first ones).
    pub recomputed_layers: usize,
    /// The model's layers.
    pub num_layers: usize,
    /// What was asked for ([`Recompute::Auto`] resolved into `recomputed_layers`).
    pub recompute: Recompute,
    /// The settings a refusal names as knobs.
    knobs: Knobs,
}

impl MemoryPlan {
    /// The plan of `inputs`, recomputing as many layers as `inputs.recompute` says; for
    /// [`Recompute::Auto`], the fewest that leave the KV cache the room it wants (every
    /// layer that can be when none do, and none without a device budget).
    pub fn new(inputs: &PlanInputs<'_>) -> Self {
        let most = max_recomputed_layers(inputs.model);
        match inputs.recompute {
            Recompute::None => Self::recomputing(inputs, 0),
            Recompute::All => Self::recomputing(inputs, most),
            Recompute::Layers(layers) => Self::recomputing(inputs, layers.min(most)),
            Recompute::Auto => {
                let wanted = MIN_KV_CACHE_BYTES
                    .max(inputs.kv_cache_tokens_wanted * kv_cache_bytes_per_token(inputs))
                    .max(inputs.kv_cache_bytes.unwrap_or(0));
                (0..=most)
                    .map(|layers| Self::recomputing(inputs, layers))
                    .find(|plan| plan.kv_cache_bytes().is_none_or(|kv| kv >= wanted))
                    .unwrap_or_else(|| Self::recomputing(inputs, most))
            }
        }
    }

    /// The plan with the first `recomputed_layers` layers recomputed.
    fn recomputing(inputs: &PlanInputs<'_>, recomputed_layers: usize) -> Self {
        let bytes = |kind: BufKind| element_bytes(inputs.device, kind);
        let on_device = matches!(inputs.device, Device::Cuda(_));
        let (compute, full) = (bytes(BufKind::Compute), bytes(BufKind::Full));
        let base = inputs.model.num_parameters();
        let trained = match inputs.lora {
            Some(lora) => adapter_specs(inputs.model, lora)
                .iter()
                .map(|(_, shape)| shape.iter().product::<usize>())
                .sum(),
            None => base,
        };
        let host_optimizer = inputs.placement == OptimizerPlacement::Host;
        let frozen_base = inputs.lora.is_some();
        let shards = if frozen_base {
            1
        } else {
            inputs.optimizer_shards.max(1)
        };
        let mut device = Vec::new();
        let mut host = Vec::new();
        // The weights forwards read; on the CPU they are the masters themselves.
        let separate_compute = on_device && compute != full;
        if separate_compute && !inputs.base_resident {
            device.push(item("weights (compute precision)", base * compute));
        }
        // The base's Full masters stay on the device unless a host or sharded optimizer
        // of the full weights took them or the base is frozen under adapters (on the CPU
        // they are the weights themselves).
        let device_masters = !separate_compute || !(frozen_base || host_optimizer || shards > 1);
        if device_masters && !inputs.base_resident {
            device.push(item("master weights (f32)", base * full));
        }
        if frozen_base {
            device.push(item(
                "adapters (f32 + compute copy)",
                trained * (full + compute),
            ));
            // The fused lm-head backward always writes the head's weight gradient; the
            // unembed adapter's is projected from it, and otherwise it is discarded.
            device.push(item(
                "lm-head weight gradient (f32)",
                inputs.model.vocab_size * inputs.model.hidden_size * full,
            ));
        }
        let streamed = shards > 1 && inputs.gradient_shards;
        if streamed {
            let model = inputs.model;
            let layer: usize = tensor_specs(model)
                .iter()
                .filter(|(name, _)| name.starts_with("model.layers.0."))
                .map(|(_, shape)| shape.iter().product::<usize>())
                .sum();
            let vocab = model.vocab_size * model.hidden_size;
            device.push(item(
                "one layer's gradients + vocab (f32)",
                (layer + vocab + model.hidden_size) * full,
            ));
        } else {
            device.push(item("gradients (f32)", trained * full));
        }
        let optimizer = if host_optimizer {
            &mut host
        } else {
            &mut device
        };
        if shards > 1 {
            optimizer.push(item(
                "master weights, 1/N shard (f32)",
                base.div_ceil(shards) * full,
            ));
            optimizer.push(item(
                "AdamW moments, 1/N shard (f32)",
                2 * trained.div_ceil(shards) * full,
            ));
            // Stage 2 sums a later micro-batch's reduce-scatter through one more shard
            // of a bucket.
            let scratch = if streamed {
                SHARD_STAGING_ELEMENTS.div_ceil(shards) * full
            } else {
                0
            };
            device.push(item(
                "gradient shard, staging buckets",
                trained.div_ceil(shards) * full
                    + SHARD_STAGING_ELEMENTS * (full + compute)
                    + scratch,
            ));
        } else {
            if host_optimizer && !frozen_base {
                optimizer.push(item("master weights (f32)", base * full));
            }
            optimizer.push(item("AdamW moments (f32)", 2 * trained * full));
        }
        let tokens = inputs.max_tokens_per_microbatch;
        device.push(per_step(
            "activations of one micro-batch",
            Transformer::<floe_backend::cpu::CpuBackend>::training_activation_bytes(
                inputs.model,
                tokens,
                recomputed_layers,
                &bytes,
            ),
        ));
        if on_device {
            let chunk = DEVICE_LM_HEAD_CHUNK_LOGITS.min(tokens * inputs.model.vocab_size);
            device.push(per_step("lm-head logits chunks (f32)", 2 * chunk * full));
            device.push(per_step(
                "CUDA context and workspaces",
                DEVICE_RESERVE_BYTES,
            ));
        }
        MemoryPlan {
            device,
            host,
            budget_bytes: inputs.budget_bytes,
            reserved_by_others: inputs.reserved_by_others,
            recomputed_layers,
            num_layers: inputs.model.num_hidden_layers,
            recompute: inputs.recompute,
            knobs: Knobs {
                max_tokens_per_microbatch: tokens,
                recompute_more: recomputed_layers < max_recomputed_layers(inputs.model),
                placement: inputs.placement,
                lora: frozen_base,
                ranks: inputs.data_parallel_ranks.max(1),
                sharded: shards > 1,
                gradients_sharded: streamed,
            },
        }
    }

    /// Bytes on the device besides the KV cache.
    pub fn device_bytes(&self) -> usize {
        self.device.iter().map(|i| i.bytes).sum()
    }

    /// Bytes on the device used only while a step runs.
    pub fn per_step_bytes(&self) -> usize {
        self.device
            .iter()
            .filter(|i| i.per_step)
            .map(|i| i.bytes)
            .sum()
    }

    /// Bytes in host memory.
    pub fn host_bytes(&self) -> usize {
        self.host.iter().map(|i| i.bytes).sum()
    }

    /// What the budget leaves for the KV cache (`None` without a budget).
    pub fn kv_cache_bytes(&self) -> Option<usize> {
        self.budget_bytes
            .map(|budget| budget.saturating_sub(self.device_bytes()))
    }

    /// `Ok` when the plan leaves at least [`MIN_KV_CACHE_BYTES`] for the KV cache, else
    /// an error that gives the plan and names the settings that free memory.
    pub fn check(&self) -> Result<(), PlanError> {
        match (self.budget_bytes, self.kv_cache_bytes()) {
            (Some(budget), Some(kv)) if kv < MIN_KV_CACHE_BYTES => {
                let Knobs {
                    max_tokens_per_microbatch: tokens,
                    recompute_more,
                    placement,
                    lora,
                    ranks,
                    sharded,
                    gradients_sharded,
                } = self.knobs;
                let mut knobs = vec![Knob::MicrobatchTokens(tokens)];
                if recompute_more {
                    knobs.push(Knob::Recompute);
                }
                // Adapters' optimizer state is too small for moving it to help.
                if ranks > 1 && !gradients_sharded && !lora {
                    knobs.push(Knob::ZeroStage {
                        ranks,
                        stage: if sharded { 2 } else { 1 },
                    });
                }
                if placement == OptimizerPlacement::Device && !lora {
                    knobs.push(Knob::OffloadOptimizer);
                }
                if !lora {
                    knobs.push(Knob::Lora);
                }
                if self.reserved_by_others > 0 {
                    knobs.push(Knob::OtherEngines(self.reserved_by_others));
                }
                knobs.push(Knob::MemoryFraction);
                Err(PlanError {
                    needed: self.device_bytes() + MIN_KV_CACHE_BYTES,
                    budget,
                    plan: self.to_string(),
                    knobs,
                    names: KnobNames::Recipe,
                })
            }
            _ => Ok(()),
        }
    }
}

/// A setting that frees device memory, as a refusal names it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Knob {
    /// Fewer tokens in a training micro-batch (now this many).
    MicrobatchTokens(usize),
    /// Recompute every layer's activations in the backward (some are stored now).
    Recompute,
    /// Masters and AdamW moments in host memory.
    OffloadOptimizer,
    /// LoRA adapters on a frozen base.
    Lora,
    /// The optimizer state (stage 1) and the gradients (stage 2) split over the
    /// data-parallel group's ranks.
    ZeroStage {
        /// Ranks of the group.
        ranks: usize,
        /// The stage that frees memory now (the next one up).
        stage: u8,
    },
    /// Other engines on the device, which reserve these bytes for their steps.
    OtherEngines(usize),
    /// A larger share of the device's memory.
    MemoryFraction,
}

/// Whose names a refusal gives its knobs: a recipe's keys or `floe serve`'s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KnobNames {
    /// `floe train` / `floe bench` / `floe plan`: recipe keys.
    Recipe,
    /// `floe serve`: its flags and the clients' requests.
    Serve,
}

impl Knob {
    /// How to turn this knob, in `names`' terms.
    pub fn describe(self, names: KnobNames) -> String {
        let serve = names == KnobNames::Serve;
        match self {
            Knob::MicrobatchTokens(tokens) if serve => format!(
                "lower the micro-batch tokens (floe serve --max-tokens-per-microbatch, or the \
                 engine setting max_tokens_per_microbatch; now {tokens})"
            ),
            Knob::MicrobatchTokens(tokens) => format!(
                "lower the micro-batch tokens (trainer.max_tokens_per_microbatch, now {tokens})"
            ),
            Knob::Recompute if serve => {
                "start floe serve with --recompute (or --recompute=auto)".into()
            }
            Knob::Recompute => {
                "set engine.recompute = true (or \"auto\": recompute only what must be)".into()
            }
            Knob::OffloadOptimizer if serve => {
                "start floe serve with --offload-optimizer (masters and AdamW moments in host \
                 memory)"
                    .into()
            }
            Knob::OffloadOptimizer => "set engine.offload_optimizer = true (masters and AdamW \
                                       moments in host memory)"
                .into(),
            Knob::Lora if serve => {
                "train LoRA adapters on the shared frozen base (a LoRA training client, e.g. \
                 rank 32)"
                    .into()
            }
            Knob::Lora => {
                "train LoRA adapters on a frozen bf16 base (model.lora.rank, e.g. 32)".into()
            }
            Knob::ZeroStage { ranks, stage: 1 } => format!(
                "set engine.zero_stage = 1 (each of the {ranks} ranks keeps 1/{ranks} of the \
                 masters and AdamW moments)"
            ),
            Knob::ZeroStage { ranks, .. } => format!(
                "set engine.zero_stage = 2 (each of the {ranks} ranks also keeps only \
                 1/{ranks} of the f32 gradients)"
            ),
            Knob::OtherEngines(bytes) => format!(
                "close other engines on this device (they reserve {:.2} GiB for their steps)",
                gib(bytes)
            ),
            Knob::MemoryFraction if serve => {
                "raise floe serve --memory-fraction, or give each engine a smaller KV cache \
                 (--kv-cache-gib)"
                    .into()
            }
            Knob::MemoryFraction => "raise engine.memory_fraction".into(),
        }
    }
}

/// The inputs of a plan that settings can change to free device memory.
#[derive(Clone, Debug, PartialEq)]
struct Knobs {
    max_tokens_per_microbatch: usize,
    /// Some layers' activations are stored, which recomputing them would free.
    recompute_more: bool,
    placement: OptimizerPlacement,
    lora: bool,
    /// Data-parallel ranks, and whether the optimizer state and the gradients are split
    /// over them.
    ranks: usize,
    sharded: bool,
    gradients_sharded: bool,
}

/// Which layers' activations the backward recomputes from their inputs instead of
/// storing them (activation checkpointing): each recomputed layer frees one layer's
/// activations and costs one more layer forward. Written `false`, `true`, `"auto"` or a
/// number of layers (in recipes `engine.recompute`, in `floe bench` and `floe serve`
/// `--recompute`, in the native API the engine setting `recompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Store every layer's activations (`false`).
    None,
    /// Recompute every layer's but the last, whose activations are still in memory when
    /// the backward starts (`true`): the least memory.
    All,
    /// Recompute the first this many layers' (past [`Recompute::All`]'s count, the same).
    Layers(usize),
    /// The fewest layers that leave the KV cache the room it wants (`"auto"`;
    /// [`MemoryPlan::new`]); none on the CPU.
    #[default]
    Auto,
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => write!(f, "false"),
            Recompute::All => write!(f, "true"),
            Recompute::Layers(layers) => write!(f, "{layers}"),
            Recompute::Auto => write!(f, "auto"),
        }
    }
}

const RECOMPUTE_VALUES: &str = "true, false, \"auto\" or a number of layers";

impl FromStr for Recompute {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "false" => Ok(Recompute::None),
            "true" => Ok(Recompute::All),
            "auto" => Ok(Recompute::Auto),
            _ => text
                .parse()
                .map(Recompute::Layers)
                .map_err(|_| format!("recompute `{text}`: expected {RECOMPUTE_VALUES}")),
        }
    }
}

impl Serialize for Recompute {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Recompute::None => serializer.serialize_bool(false),
            Recompute::All => serializer.serialize_bool(true),
            Recompute::Layers(layers) => serializer.serialize_u64(*layers as u64),
            Recompute::Auto => serializer.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Recompute;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(RECOMPUTE_VALUES)
            }

            fn visit_bool<E>(self, value: bool) -> Result<Recompute, E> {
                Ok(if value {
                    Recompute::All
                } else {
                    Recompute::None
                })
            }

            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<Recompute, E> {
                usize::try_from(value)
                    .map(Recompute::Layers)
                    .map_err(|_| E::custom(format!("{value} layers is too many")))
            }

            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<Recompute, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(
                        serde::de::Unexpected::Signed(value),
                        &self,
                    )),
                }
            }

            fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<Recompute, E> {
                match value {
                    "auto" => Ok(Recompute::Auto),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(value), &self)),
                }
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// Bytes of an element of `kind` on `device`.
fn element_bytes(device: Device, kind: BufKind) -> usize {
    match device {
        Device::Cpu => 4,
        Device::Cuda(_) => floe_backend::cuda::element_bytes(kind),
    }
}

/// KV cache bytes of one token (keys and values of every layer), as the sampler's cache
/// stores them.
fn kv_cache_bytes_per_token(inputs: &PlanInputs<'_>) -> usize {
    let model = inputs.model;
    2 * model.num_hidden_layers * model.kv_dim() * element_bytes(inputs.device, BufKind::Compute)
}

fn item(what: &'static str, bytes: usize) -> PlanItem {
    PlanItem {
        what,
        bytes,
        per_step: false,
    }
}

fn per_step(what: &'static str, bytes: usize) -> PlanItem {
    PlanItem {
        what,
        bytes,
        per_step: true,
    }
}

/// Gibibytes, for people.
fn gib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 30)
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "recompute: {} of {} layers (recompute = {})",
            self.recomputed_layers, self.num_layers, self.recompute
        )?;
        writeln!(f, "device memory plan:")?;
        for i in &self.device {
            writeln!(f, "  {:<34} {:>9.2} GiB", i.what, gib(i.bytes))?;
        }
        match (self.budget_bytes, self.kv_cache_bytes()) {
            (Some(budget), Some(kv)) => {
                writeln!(
                    f,
                    "  {:<34} {:>9.2} GiB",
                    "KV cache (what is left)",
                    gib(kv)
                )?;
                if self.reserved_by_others > 0 {
                    writeln!(
                        f,
                        "  {:<34} {:>9.2} GiB (outside the budget)",
                        "other engines' steps",
                        gib(self.reserved_by_others)
                    )?;
                }
                write!(
                    f,
                    "  {:<34} {:>9.2} GiB of a {:.2} GiB budget",
                    "total",
                    gib(self.device_bytes() + kv),
                    gib(budget)
                )?;
            }
            _ => write!(f, "  {:<34} {:>9.2} GiB", "total", gib(self.device_bytes()))?,
        }
        if !self.host.is_empty() {
            writeln!(f, "\nhost memory plan:")?;
            for i in &self.host {
                writeln!(f, "  {:<34} {:>9.2} GiB", i.what, gib(i.bytes))?;
            }
            write!(f, "  {:<34} {:>9.2} GiB", "total", gib(self.host_bytes()))?;
        }
        Ok(())
    }
}

/// A plan that does not fit its device.
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "the run does not fit the device: it needs {:.2} GiB (with the smallest useful KV cache) \
     of a {:.2} GiB budget.\n{plan}\nto fit: {}",
    gib(*needed),
    gib(*budget),
    knobs.iter().map(|k| k.describe(*names)).collect::<Vec<_>>().join("; or ")
)]
pub struct PlanError {
    /// Bytes the plan needs on the device.
    pub needed: usize,
    /// Bytes the budget allows.
    pub budget: usize,
    /// The plan, printed.
    pub plan: String,
    /// Settings that free device memory.
    pub knobs: Vec<Knob>,
    /// Whose names the message gives the knobs.
    pub names: KnobNames,
}

impl PlanError {
    /// The same refusal with the knobs in `names`' terms.
    pub fn named_for(self, names: KnobNames) -> Self {
        Self { names, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(model: &ModelConfig, placement: OptimizerPlacement) -> PlanInputs<'_> {
        PlanInputs {
            model,
            lora: None,
            base_resident: false,
            device: Device::Cuda(0),
            placement,
            optimizer_shards: 1,
            gradient_shards: false,
            data_parallel_ranks: 1,
            recompute: Recompute::All,
            kv_cache_tokens_wanted: 0,
            kv_cache_bytes: None,
            max_tokens_per_microbatch: 8192,
            budget_bytes: Some(76 << 30),
            reserved_by_others: 0,
        }
    }

    #[test]
    fn an_8b_model_fits_an_80_gb_card_only_with_the_optimizer_on_the_host() {
        let model = ModelConfig::preset("8B").unwrap();
        let on_device = MemoryPlan::new(&inputs(&model, OptimizerPlacement::Device));
        let err = on_device.check().unwrap_err().to_string();
        assert!(err.contains("engine.offload_optimizer = true"), "{err}");
        assert!(err.contains("AdamW moments"), "the plan is printed: {err}");
        let offloaded = MemoryPlan::new(&inputs(&model, OptimizerPlacement::Host));
        offloaded.check().unwrap();
        // bf16 weights and f32 gradients: 6 bytes a parameter on the device.
        let params = model.num_parameters();
        let weights: usize = offloaded
            .device
            .iter()
            .filter(|i| i.what.starts_with("weights") || i.what.starts_with("gradients"))
            .map(|i| i.bytes)
            .sum();
        assert_eq!(weights, 6 * params);
        assert_eq!(offloaded.host_bytes(), 12 * params);
        assert!(offloaded.kv_cache_bytes().unwrap() > 8 << 30);
    }

    #[test]
    fn a_lora_base_is_frozen_in_compute_precision_so_32b_fits_an_h200() {
        let model = ModelConfig::preset("32B").unwrap();
        let lora = LoraConfig::new(32);
        let h200 = PlanInputs {
            lora: Some(&lora),
            budget_bytes: Some(125 << 30),
            ..inputs(&model, OptimizerPlacement::Device)
        };
        let plan = MemoryPlan::new(&h200);
        plan.check().unwrap();
        assert!(plan.device.iter().all(|i| !i.what.starts_with("master")));
        let base = plan.device.iter().find(|i| i.what.starts_with("weights"));
        assert_eq!(base.unwrap().bytes, 2 * model.num_parameters());
        // The frozen head's weight gradient, which the fused backward writes, is counted.
        let head = plan
            .device
            .iter()
            .find(|i| i.what.starts_with("lm-head weight"));
        assert_eq!(
            head.unwrap().bytes,
            4 * model.vocab_size * model.hidden_size
        );
        // Full-parameter, it cannot fit, and the refusal names LoRA.
        let full = MemoryPlan::new(&PlanInputs {
            lora: None,
            ..h200.clone()
        });
        let err = full.check().unwrap_err().to_string();
        assert!(err.contains("model.lora.rank"), "{err}");
    }

    #[test]
    fn other_engines_reservations_are_shown_and_named_in_a_refusal() {
        let model = ModelConfig::preset("1.7B").unwrap();
        let alone = MemoryPlan::new(&inputs(&model, OptimizerPlacement::Device));
        alone.check().unwrap();
        assert!(!alone.to_string().contains("other engines"));
        // What the others keep for their steps is outside the budget it was taken from.
        let beside = MemoryPlan::new(&PlanInputs {
            budget_bytes: Some(alone.device_bytes()),
            reserved_by_others: 40 << 30,
            ..inputs(&model, OptimizerPlacement::Device)
        });
        assert!(beside.to_string().contains("other engines' steps"));
        let err = beside.check().unwrap_err();
        let recipe = err.to_string();
        assert!(recipe.contains("close other engines on this device (they reserve 40.00 GiB"));
        assert!(recipe.contains("engine.offload_optimizer"), "{recipe}");
        let serve = err.named_for(KnobNames::Serve).to_string();
        assert!(serve.contains("--offload-optimizer") && serve.contains("--kv-cache-gib"));
        assert!(!serve.contains("engine.offload_optimizer"), "{serve}");
        // Only what a step uses is kept free for it: activations, logits, workspaces.
        let per_step: Vec<&str> = alone
            .device
            .iter()
            .filter(|i| i.per_step)
            .map(|i| i.what)
            .collect();
        assert_eq!(per_step.len(), 3, "{per_step:?}");
        assert!(per_step
            .iter()
            .all(|w| !w.contains("weights") && !w.contains("moments")));
    }

    fn activations(plan: &MemoryPlan) -> usize {
        plan.device
            .iter()
            .find(|i| i.what.starts_with("activations"))
            .unwrap()
            .bytes
    }

    #[test]
    fn recompute_keeps_one_layer_of_activations() {
        let model = ModelConfig::preset("1.7B").unwrap();
        let mut with = inputs(&model, OptimizerPlacement::Device);
        let all = MemoryPlan::new(&with);
        assert_eq!(all.recomputed_layers, 27);
        let recomputed = activations(&all);
        with.recompute = Recompute::None;
        let stored = activations(&MemoryPlan::new(&with));
        // Every layer's internals against one set and the layer inputs.
        assert!(stored > 5 * recomputed, "{stored} vs {recomputed}");
        // Each recomputed layer frees one layer's internals.
        let layers = |n| {
            activations(&MemoryPlan::new(&PlanInputs {
                recompute: Recompute::Layers(n),
                ..with.clone()
            }))
        };
        let layer = layers(10) - layers(11);
        assert_eq!(layers(20) - layers(21), layer);
        assert_eq!(layers(1) - layers(27), 26 * layer);
        assert_eq!(layers(27), recomputed);
        assert_eq!(layers(1000), recomputed, "a count past all recomputes all");
    }

    /// The 1.7B shape at 8 x 2048 tokens a micro-batch, as `floe bench train` runs it.
    fn bench_1_7b(model: &ModelConfig, budget_gib: usize) -> PlanInputs<'_> {
        PlanInputs {
            recompute: Recompute::Auto,
            max_tokens_per_microbatch: 8 * 2048,
            budget_bytes: Some(budget_gib << 30),
            ..inputs(model, OptimizerPlacement::Device)
        }
    }

    #[test]
    fn auto_stores_every_layer_where_they_fit_and_recomputes_the_fewest_where_not() {
        let model = ModelConfig::preset("1.7B").unwrap();
        // An 80 GB card has about 79 GiB free: every layer's activations fit.
        let h100 = MemoryPlan::new(&bench_1_7b(&model, 79));
        assert_eq!(h100.recomputed_layers, 0, "{h100}");
        h100.check().unwrap();
        assert!(h100
            .to_string()
            .starts_with("recompute: 0 of 28 layers (recompute = auto)\n"));
        // A smaller budget: some layers, the fewest that fit.
        let smaller = bench_1_7b(&model, 56);
        let plan = MemoryPlan::new(&smaller);
        let k = plan.recomputed_layers;
        assert!(0 < k && k < 27, "{plan}");
        plan.check().unwrap();
        assert!(plan
            .to_string()
            .contains(&format!("recompute: {k} of 28 layers")));
        let one_fewer = MemoryPlan::new(&PlanInputs {
            recompute: Recompute::Layers(k - 1),
            ..smaller.clone()
        });
        assert!(one_fewer.check().is_err(), "{one_fewer}");
        // Too small even with every layer recomputed: refused, naming the other knobs.
        let err = MemoryPlan::new(&bench_1_7b(&model, 32))
            .check()
            .unwrap_err();
        let message = err.to_string();
        assert!(message.contains("recompute: 27 of 28 layers"), "{message}");
        assert!(!err.knobs.contains(&Knob::Recompute), "{message}");
        assert!(
            message.contains("trainer.max_tokens_per_microbatch"),
            "{message}"
        );
        assert!(message.contains("engine.offload_optimizer"), "{message}");
        // Storing some layers where all would fit names recomputing as a knob.
        let some = MemoryPlan::new(&PlanInputs {
            recompute: Recompute::Layers(3),
            ..bench_1_7b(&model, 32)
        });
        let message = some.check().unwrap_err().to_string();
        assert!(message.contains("engine.recompute = true"), "{message}");
    }

    #[test]
    fn auto_leaves_the_kv_cache_the_room_sampling_wants() {
        let model = ModelConfig::preset("1.7B").unwrap();
        let stored = MemoryPlan::new(&bench_1_7b(&model, 79));
        let room = stored.kv_cache_bytes().unwrap();
        // 2 (keys, values) x 28 layers x 8 heads x 128 x 2 bytes (bf16).
        let per_token = 2 * 28 * 1024 * 2;
        let wanting = |tokens: usize| {
            MemoryPlan::new(&PlanInputs {
                kv_cache_tokens_wanted: tokens,
                ..bench_1_7b(&model, 79)
            })
        };
        assert_eq!(wanting(room / per_token).recomputed_layers, 0);
        let more = wanting(room / per_token + 1);
        assert!(more.recomputed_layers > 0);
        assert!(more.kv_cache_bytes().unwrap() >= room + per_token);
        // More than any plan leaves: every layer recomputed, the KV cache gets the rest.
        let most = wanting(1 << 30);
        assert_eq!(most.recomputed_layers, 27);
        most.check().unwrap();
        // A fixed KV cache (floe serve --kv-cache-gib) is left room too.
        let fixed = MemoryPlan::new(&PlanInputs {
            kv_cache_bytes: Some(room + (4 << 30)),
            ..bench_1_7b(&model, 79)
        });
        assert!(fixed.recomputed_layers > 0);
        assert!(fixed.kv_cache_bytes().unwrap() >= room + (4 << 30));
    }

    #[test]
    fn recompute_reads_booleans_auto_and_layer_counts() {
        for (json, recompute) in [
            ("true", Recompute::All),
            ("false", Recompute::None),
            ("\"auto\"", Recompute::Auto),
            ("10", Recompute::Layers(10)),
        ] {
            assert_eq!(serde_json::from_str::<Recompute>(json).unwrap(), recompute);
            assert_eq!(serde_json::to_string(&recompute).unwrap(), json);
            let text = recompute.to_string();
            assert_eq!(text.parse::<Recompute>().unwrap(), recompute);
        }
        for bad in ["-1", "\"some\"", "1.5", "null"] {
            let err = serde_json::from_str::<Recompute>(bad)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("\"auto\" or a number of layers"),
                "{bad}: {err}"
            );
        }
        let err = "yes".parse::<Recompute>().unwrap_err();
        assert!(err.contains("\"auto\" or a number of layers"), "{err}");
    }

    #[test]
    fn the_cpu_has_no_budget_and_no_separate_compute_copy() {
        let model = ModelConfig::preset("0.6B").unwrap();
        let mut cpu = inputs(&model, OptimizerPlacement::Device);
        cpu.device = Device::Cpu;
        cpu.budget_bytes = None;
        let plan = MemoryPlan::new(&cpu);
        plan.check().unwrap();
        assert!(plan
            .device
            .iter()
            .all(|i| !i.what.starts_with("weights (compute")));
        assert_eq!(plan.kv_cache_bytes(), None);
    }
}
