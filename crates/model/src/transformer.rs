//! The decoder (Qwen3, Qwen2, Llama) on any [`Backend`], forward and hand-written
//! backward side by side.
//!
//! # Buffers
//! - **Parameters** (`Params`): one struct per layer (`Layer`) with a shape comment on
//!   each field, in Full storage (the master weights the optimizer updates). When the
//!   backend's Compute storage differs (`!compute_is_full()`, e.g. bf16 on CUDA) a second
//!   `Params` holds Compute copies that every forward reads; the optimizer refreshes them.
//! - **Gradients**: a `Params` of Full buffers, allocated on the first backward;
//!   every backward accumulates into them, so micro-batches sum until [`Transformer::zero_grad`].
//!   A model that streams its gradients ([`Transformer::stream_gradients`], ZeRO stage
//!   2) keeps one layer's instead and hands each parameter's to a receiver as soon as the
//!   backward completes it ([`Transformer::forward_backward_streamed`]).
//! - **Activations** (`Activations`): per call, `[T, …]` token-major. Training keeps the
//!   residual stream entering each layer, and each layer's internals (`LayerActs`) for
//!   every layer, except that the first `r` layers ([`Transformer::set_recomputed_layers`])
//!   keep none: the backward runs them again from their inputs, in the slot of layer
//!   `r`, whose own backward has then already run. They are reused while the batch keeps
//!   its size. A scoring [`Transformer::forward`] keeps one layer's internals and two
//!   residual buffers.
//!
//! # Forward, per layer (`x` is the residual stream `[T, hidden]`)
//! `ln1 = rmsnorm(x)` → `q, k, v = ln1·Wᵀ (+ bias)` → (`qk_norm`) per-head RMSNorm of q
//! and k → RoPE on q, k → causal attention over the batch's segments → `resid = x +
//! att·Woᵀ` → `ln2 = rmsnorm(resid)` → `gate, up = ln2·Wᵀ` → `act = silu(gate)·up` →
//! `out = resid + act·W_downᵀ`. Then the final RMSNorm and the fused lm-head, which yields
//! per-token log-probs and entropies without materialising `[T, vocab]` logits.
//!
//! # Backward
//! The same steps in reverse with one running gradient of the residual stream: lm-head →
//! final norm → per layer (last first): `W_down` → SwiGLU → `W_gate`, `W_up` → `ln2`
//! (added to the residual gradient) → `Wo` → attention → inverse RoPE → q/k norms →
//! biases → `Wq`, `Wk`, `Wv` → `ln1` (added to the residual gradient) → embedding. With a
//! tied lm-head the embedding table's gradient receives both contributions.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_backend::{
    AttnShape, Backend, BufKind, Collective, LmHead, Matmul, NormedHeads, PagedLayout, Segment,
};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::SplitMix64;

use crate::batch::{BatchError, PackedBatch, TokenStats};
use crate::config::ModelConfig;
use crate::lora::{GradSink, LayerGrad, Lora, Proj};
use crate::weights::{check_weights, tensor_specs, HostTensor, WeightsError};

/// Why a model operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A backend op rejected its arguments or the device failed.
    #[error(transparent)]
    Backend(#[from] floe_backend::Error),
    /// Host weights are missing a tensor or have a wrong shape.
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The packed batch is malformed.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// The configuration cannot be run.
    #[error("model config: {0}")]
    Config(String),
    /// An input is out of range (names the field and row).
    #[error("{0}")]
    Input(String),
    /// The loss-gradient callback of [`Transformer::forward_backward`] failed.
    #[error("loss gradient: {0}")]
    LossGrad(Box<dyn std::error::Error + Send + Sync>),
}

/// Result of model operations.
pub type Result<T> = std::result::Result<T, ModelError>;

/// One decoder layer's tensors: its weights, or their gradients. Rows are output features
/// (Hugging Face `[out, in]` layout).
pub(crate) struct Layer<Buf> {
    /// `[hidden]` `input_layernorm`.
    pub input_norm: Buf,
    /// `[q_heads · head_dim, hidden]` `q_proj`.
    pub wq: Buf,
    /// `[q_heads · head_dim]` `q_proj.bias` (`attention_bias`).
    pub bq: Option<Buf>,
    /// `[kv_heads · head_dim, hidden]` `k_proj`.
    pub wk: Buf,
    /// `[kv_heads · head_dim]` `k_proj.bias` (`attention_bias`).
    pub bk: Option<Buf>,
    /// `[kv_heads · head_dim, hidden]` `v_proj`.
    pub wv: Buf,
    /// `[kv_heads · head_dim]` `v_proj.bias` (`attention_bias`).
    pub bv: Option<Buf>,
    /// `[hidden, q_heads · head_dim]` `o_proj`.
    pub wo: Buf,
    /// `[head_dim]` `q_norm` (`qk_norm`).
    pub q_norm: Option<Buf>,
    /// `[head_dim]` `k_norm` (`qk_norm`).
    pub k_norm: Option<Buf>,
    /// `[hidden]` `post_attention_layernorm`.
    pub post_norm: Buf,
    /// `[intermediate, hidden]` `gate_proj`.
    pub w_gate: Buf,
    /// `[intermediate, hidden]` `up_proj`.
    pub w_up: Buf,
    /// `[hidden, intermediate]` `down_proj`.
    pub w_down: Buf,
}

impl<Buf> Layer<Buf> {
    /// One layer from `next()`, called once per tensor in [`tensor_specs`] order.
    fn build(config: &ModelConfig, next: &mut impl FnMut() -> Result<Buf>) -> Result<Self> {
        let (bias, qk) = (config.attention_bias, config.qk_norm);
        let input_norm = next()?;
        let wq = next()?;
        let bq = bias.then(&mut *next).transpose()?;
        let wk = next()?;
        let bk = bias.then(&mut *next).transpose()?;
        let wv = next()?;
        let bv = bias.then(&mut *next).transpose()?;
        let wo = next()?;
        let q_norm = qk.then(&mut *next).transpose()?;
        let k_norm = qk.then(&mut *next).transpose()?;
        Ok(Layer {
            input_norm,
            wq,
            bq,
            wk,
            bk,
            wv,
            bv,
            wo,
            q_norm,
            k_norm,
            post_norm: next()?,
            w_gate: next()?,
            w_up: next()?,
            w_down: next()?,
        })
    }

    /// The layer's tensors, in [`tensor_specs`] order.
    fn tensors(&self) -> Vec<&Buf> {
        let mut all = vec![&self.input_norm, &self.wq];
        all.extend(&self.bq);
        all.push(&self.wk);
        all.extend(&self.bk);
        all.push(&self.wv);
        all.extend(&self.bv);
        all.push(&self.wo);
        all.extend(&self.q_norm);
        all.extend(&self.k_norm);
        all.extend([&self.post_norm, &self.w_gate, &self.w_up, &self.w_down]);
        all
    }

    /// The layer's tensors mutably, in [`tensor_specs`] order.
    fn tensors_mut(&mut self) -> Vec<&mut Buf> {
        let mut all = vec![&mut self.input_norm, &mut self.wq];
        all.extend(&mut self.bq);
        all.push(&mut self.wk);
        all.extend(&mut self.bk);
        all.push(&mut self.wv);
        all.extend(&mut self.bv);
        all.push(&mut self.wo);
        all.extend(&mut self.q_norm);
        all.extend(&mut self.k_norm);
        all.extend([
            &mut self.post_norm,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]);
        all
    }
}

/// Every tensor of the model (weights or gradients), in the order of [`tensor_specs`].
pub(crate) struct Params<Buf> {
    /// `[vocab, hidden]` `embed_tokens`.
    pub embed: Buf,
    /// The decoder layers.
    pub layers: Vec<Layer<Buf>>,
    /// `[hidden]` `model.norm`.
    pub final_norm: Buf,
    /// `[vocab, hidden]` `lm_head`, absent when tied to `embed`.
    pub lm_head: Option<Buf>,
}

impl<Buf> Params<Buf> {
    /// Builds every tensor in [`tensor_specs`] order with `make(name, shape)`.
    pub(crate) fn build(
        config: &ModelConfig,
        mut make: impl FnMut(&str, &[usize]) -> Result<Buf>,
    ) -> Result<Self> {
        let specs = tensor_specs(config);
        let mut specs = specs.iter();
        let mut next = || -> Result<Buf> {
            let (name, shape) = specs
                .next()
                .expect("tensor_specs lists every tensor Params holds");
            make(name, shape)
        };
        let embed = next()?;
        let layers = (0..config.num_hidden_layers)
            .map(|_| Layer::build(config, &mut next))
            .collect::<Result<_>>()?;
        let final_norm = next()?;
        let lm_head = (!config.tie_word_embeddings).then(&mut next).transpose()?;
        Ok(Self {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }

    /// Every tensor, in [`tensor_specs`] order.
    fn tensors(&self) -> Vec<&Buf> {
        let mut all = vec![&self.embed];
        for l in &self.layers {
            all.extend(l.tensors());
        }
        all.push(&self.final_norm);
        all.extend(&self.lm_head);
        all
    }

    /// Every tensor mutably, in [`tensor_specs`] order.
    fn tensors_mut(&mut self) -> Vec<&mut Buf> {
        let mut all = vec![&mut self.embed];
        for l in &mut self.layers {
            all.extend(l.tensors_mut());
        }
        all.push(&mut self.final_norm);
        all.extend(&mut self.lm_head);
        all
    }

    /// The lm-head weight: its own tensor, or the embedding when tied.
    pub fn lm_head(&self) -> &Buf {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// What one layer's forward saves for its backward; rows are the `T` tokens.
pub(crate) struct LayerActs<Buf> {
    /// `[T, hidden]` `input_layernorm` output.
    pub ln1: Buf,
    /// `[T]` (Full) its `rstd`.
    pub ln1_rstd: Buf,
    /// `[T, q_heads, head_dim]` query projection (+ bias) before `q_norm` (`qk_norm`).
    pub q_raw: Option<Buf>,
    /// `[T, kv_heads, head_dim]` key projection (+ bias) before `k_norm` (`qk_norm`).
    pub k_raw: Option<Buf>,
    /// `[T · q_heads]` (Full) `q_norm` rstd (`qk_norm`).
    pub q_rstd: Option<Buf>,
    /// `[T · kv_heads]` (Full) `k_norm` rstd (`qk_norm`).
    pub k_rstd: Option<Buf>,
    /// `[T, q_heads, head_dim]` queries as attention reads them (normed, rotated).
    pub q: Buf,
    /// `[T, kv_heads, head_dim]` keys as attention reads them.
    pub k: Buf,
    /// `[T, kv_heads, head_dim]` values.
    pub v: Buf,
    /// `[T, q_heads, head_dim]` attention output.
    pub att: Buf,
    /// `[T, q_heads]` (Full) attention log-sum-exp.
    pub att_lse: Buf,
    /// `[T, hidden]` layer input + `o_proj(att)`.
    pub resid: Buf,
    /// `[T, hidden]` `post_attention_layernorm` output.
    pub ln2: Buf,
    /// `[T]` (Full) its `rstd`.
    pub ln2_rstd: Buf,
    /// `[T, intermediate]` `gate_proj` output.
    pub gate: Buf,
    /// `[T, intermediate]` `up_proj` output.
    pub up: Buf,
    /// `[T, intermediate]` `silu(gate) · up`.
    pub act: Buf,
    /// `[T, rank]` a LoRA adapter's `x·Aᵀ`, kept by decode steps so that it stays at
    /// one address (a graph's); `None`: each adapted projection allocates its own.
    pub low_rank: Option<Buf>,
}

/// Allocates a zeroed buffer of `len` elements and a kind: the backend's `zeros`, or a
/// counter of bytes when planning memory ([`Transformer::training_activation_bytes`]).
pub(crate) type Alloc<'a, Buf> = dyn FnMut(usize, BufKind) -> Result<Buf> + 'a;

/// An [`Alloc`] over backend `b`.
pub(crate) fn zeros_on<B: Backend>(b: &B) -> impl FnMut(usize, BufKind) -> Result<B::Buf> + '_ {
    move |n, kind| Ok(b.zeros(n, kind)?)
}

impl<Buf> LayerActs<Buf> {
    pub(crate) fn new(alloc: &mut Alloc<'_, Buf>, c: &ModelConfig, t: usize) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.q_dim(), c.kv_dim());
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let alloc = std::cell::RefCell::new(alloc);
        let compute = |n: usize| (alloc.borrow_mut())(n, BufKind::Compute);
        let full = |n: usize| (alloc.borrow_mut())(n, BufKind::Full);
        let qk = c.qk_norm;
        Ok(Self {
            ln1: compute(t * h)?,
            ln1_rstd: full(t)?,
            q_raw: qk.then(|| compute(t * q)).transpose()?,
            k_raw: qk.then(|| compute(t * kv)).transpose()?,
            q_rstd: qk.then(|| full(t * hq)).transpose()?,
            k_rstd: qk.then(|| full(t * hkv)).transpose()?,
            q: compute(t * q)?,
            k: compute(t * kv)?,
            v: compute(t * kv)?,
            att: compute(t * q)?,
            att_lse: full(t * hq)?,
            resid: compute(t * h)?,
            ln2: compute(t * h)?,
            ln2_rstd: full(t)?,
            gate: compute(t * i)?,
            up: compute(t * i)?,
            act: compute(t * i)?,
            low_rank: None,
        })
    }
}

/// Gradients of activations during the backward, reused across layers.
struct GradScratch<Buf> {
    /// `[T, hidden]` running gradient of the residual stream.
    d_resid: Buf,
    /// `[T, hidden]` gradient of a norm's input, before it joins `d_resid`.
    d_norm_in: Buf,
    /// `[T, hidden]` gradient of a norm's output (`ln1`, `ln2`, final norm).
    d_norm_out: Buf,
    /// `[T, q_heads, head_dim]` gradient of the attention output.
    d_att: Buf,
    /// `[T, q_heads, head_dim]` gradient of the queries attention read.
    d_q: Buf,
    /// `[T, kv_heads, head_dim]` gradient of the keys.
    d_k: Buf,
    /// `[T, kv_heads, head_dim]` gradient of the values.
    d_v: Buf,
    /// `[T, q_heads, head_dim]` gradient of the query projection (`qk_norm`).
    d_q_raw: Option<Buf>,
    /// `[T, kv_heads, head_dim]` gradient of the key projection (`qk_norm`).
    d_k_raw: Option<Buf>,
    /// `[T, intermediate]` gradient of `act`.
    d_act: Buf,
    /// `[T, intermediate]` gradient of `gate`.
    d_gate: Buf,
    /// `[T, intermediate]` gradient of `up`.
    d_up: Buf,
    /// `[T, hidden]` output of a recomputed layer (unused; only when some layers are
    /// recomputed).
    recompute_out: Option<Buf>,
}

impl<Buf> GradScratch<Buf> {
    fn new(alloc: &mut Alloc<'_, Buf>, c: &ModelConfig, t: usize, recompute: bool) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.q_dim(), c.kv_dim());
        let mut compute = |n: usize| alloc(n, BufKind::Compute);
        Ok(Self {
            d_resid: compute(t * h)?,
            d_norm_in: compute(t * h)?,
            d_norm_out: compute(t * h)?,
            d_att: compute(t * q)?,
            d_q: compute(t * q)?,
            d_k: compute(t * kv)?,
            d_v: compute(t * kv)?,
            d_q_raw: c.qk_norm.then(|| compute(t * q)).transpose()?,
            d_k_raw: c.qk_norm.then(|| compute(t * kv)).transpose()?,
            d_act: compute(t * i)?,
            d_gate: compute(t * i)?,
            d_up: compute(t * i)?,
            recompute_out: recompute.then(|| compute(t * h)).transpose()?,
        })
    }
}

/// The activations of one call over `T` tokens.
struct Activations<Buf> {
    /// Rows this set was allocated for.
    tokens: usize,
    /// `[L + 1] × [T, hidden]`: the input of each layer, then the last layer's output.
    /// A forward without backward keeps two and alternates (layer `l` reads `l % 2`).
    residual: Vec<Buf>,
    /// Per-layer internals: layer `l` uses slot `l - r` (saturating at 0), where `r =
    /// L - slots` layers share slot 0 with layer `r` (recomputed in a backward; a forward
    /// without backward keeps one slot).
    layers: Vec<LayerActs<Buf>>,
    /// `[T, hidden]` final RMSNorm output (the lm-head input).
    final_out: Buf,
    /// `[T]` (Full) its `rstd`.
    final_rstd: Buf,
    /// `[T]` (Full) log-prob of each target.
    logprobs: Buf,
    /// `[T]` (Full) entropy of each row.
    entropy: Buf,
    /// `[T]` (Full) lm-head log-sum-exp.
    lse: Buf,
    /// Backward scratch (training only).
    grad: Option<GradScratch<Buf>>,
}

impl<Buf> Activations<Buf> {
    fn new(
        alloc: &mut Alloc<'_, Buf>,
        c: &ModelConfig,
        t: usize,
        layer_slots: usize,
        grad: Option<bool>,
    ) -> Result<Self> {
        let h = c.hidden_size;
        Ok(Self {
            tokens: t,
            residual: (0..if grad.is_some() {
                c.num_hidden_layers + 1
            } else {
                2
            })
                .map(|_| alloc(t * h, BufKind::Compute))
                .collect::<Result<_>>()?,
            layers: (0..layer_slots)
                .map(|_| LayerActs::new(alloc, c, t))
                .collect::<Result<_>>()?,
            final_out: alloc(t * h, BufKind::Compute)?,
            final_rstd: alloc(t, BufKind::Full)?,
            logprobs: alloc(t, BufKind::Full)?,
            entropy: alloc(t, BufKind::Full)?,
            lse: alloc(t, BufKind::Full)?,
            grad: grad
                .map(|recompute| GradScratch::new(alloc, c, t, recompute))
                .transpose()?,
        })
    }
}

/// The slot of layer `l`'s internals among `slots` (see [`Activations::layers`]).
fn layer_slot(l: usize, num_layers: usize, slots: usize) -> usize {
    l.saturating_sub(num_layers.saturating_sub(slots))
}

/// How many of `config`'s layers the backward can recompute: all but the last, whose
/// internals are still in memory when the backward starts.
pub fn max_recomputed_layers(config: &ModelConfig) -> usize {
    config.num_hidden_layers.saturating_sub(1)
}

/// Per-layer activation sets a training pass keeps when the first `recomputed` layers are
/// recomputed (at most [`max_recomputed_layers`]): one per stored layer, the first of
/// which the recomputed layers share.
fn training_layer_slots(config: &ModelConfig, recomputed: usize) -> usize {
    config.num_hidden_layers.max(1) - recomputed
}

/// Where a layer reads the residual stream and writes the next one.
pub(crate) enum Residual<'a, Buf> {
    /// The backward reads `x` and the layer's `resid`: both are kept, the output goes to
    /// `out`.
    Kept {
        /// The layer's input.
        x: &'a Buf,
        /// The layer's output.
        out: &'a mut Buf,
    },
    /// No backward follows (decoding): the attention and MLP branches are added into the
    /// stream in place, with no copies.
    InPlace(&'a mut Buf),
}

impl<Buf> Residual<'_, Buf> {
    fn input(&self) -> &Buf {
        match self {
            Residual::Kept { x, .. } => x,
            Residual::InPlace(x) => x,
        }
    }
}

/// How a layer's attention finds its keys and values.
pub(crate) enum Attend<'a, B: Backend> {
    /// Packed training/scoring batch: attention within segments.
    Packed {
        /// The batch's segments.
        segments: &'a [Segment],
        /// Some rows belong to no segment, so the attention output must start zeroed.
        uncovered_rows: bool,
    },
    /// Cached decoding: write this call's keys and values at `slots`, then attend over the
    /// cache of this layer.
    Paged {
        /// `[T]` Index: cache slot of each new token.
        slots: &'a B::Buf,
        /// Block tables and token placement.
        layout: PagedLayout<'a, B>,
        /// `[num_blocks, block_size, kv_heads, head_dim]` this layer's key cache.
        k_cache: &'a mut B::Buf,
        /// Same shape: this layer's value cache.
        v_cache: &'a mut B::Buf,
    },
}

/// The callback of [`Transformer::forward_backward`]: from the forward's per-row stats,
/// `(dL/dlogprob, dL/dentropy)`, one entry per row.
pub type LossGradFn<'a> = dyn FnMut(&TokenStats) -> Result<(Vec<f64>, Vec<f64>)> + 'a;

/// One parameter as the optimizer sees it, from [`Transformer::visit_params`].
pub struct ParamSlot<'a, B: Backend> {
    /// The master weights: Full, or Compute after [`Transformer::drop_device_masters`].
    pub param: &'a mut B::Buf,
    /// Its accumulated gradient (Full); mutable so a data-parallel step can sum it
    /// across ranks in place.
    pub grad: &'a mut B::Buf,
    /// The Compute copy to refresh after an update, when the backend keeps one.
    pub compute: Option<&'a mut B::Buf>,
}

/// One parameter's weights, from [`Transformer::visit_weights`].
pub struct WeightSlot<'a, B: Backend> {
    /// The master weights: Full, or Compute after [`Transformer::drop_device_masters`].
    pub param: &'a mut B::Buf,
    /// The Compute copy to refresh after an update, when the backend keeps one.
    pub compute: Option<&'a mut B::Buf>,
}

/// Where [`Transformer::forward_backward_streamed`] hands the gradients as the backward
/// completes them: `(first, grads)` are the gradients of this backward alone (not summed
/// with earlier ones) of the parameters `first .. first + grads.len()` in
/// [`Transformer::visit_params`] order. Calls come in reverse visit order (the lm-head
/// and final norm, the layers from the last, the embedding), each parameter once a
/// backward; the model reuses the buffers once the call returns.
pub type GradReceiverFn<'a, Buf> = dyn FnMut(usize, &[&Buf]) -> Result<()> + 'a;

/// The gradient buffers of a model that streams its gradients
/// ([`Transformer::stream_gradients`]): one layer's, reused by every layer, the final
/// norm's, and one `[vocab, hidden]` buffer reused by the lm-head and the embedding (or
/// shared by both when they are tied). Each is zeroed before a backward writes it.
pub(crate) struct StreamedGrads<Buf> {
    pub layer: Layer<Buf>,
    pub final_norm: Buf,
    pub vocab: Buf,
}

/// How a model keeps its base weights where the backend computes in a lower precision
/// than it stores (CUDA: bf16 and f32; on the CPU both are the same f32 weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseStorage {
    /// Full (f32) masters that an optimizer updates, and their Compute copies.
    Trainable,
    /// Only Compute copies, half the memory: a base that stays frozen (under LoRA
    /// adapters), the state [`Transformer::drop_device_masters`] leaves, reached without
    /// holding the masters first.
    ComputeOnly,
}

impl BaseStorage {
    pub(crate) fn kind(self) -> BufKind {
        match self {
            BaseStorage::Trainable => BufKind::Full,
            BaseStorage::ComputeOnly => BufKind::Compute,
        }
    }
}

/// Standard deviation of [`Transformer::new_random`]'s weights.
pub(crate) const INIT_STD: f64 = 0.02;

/// A decoder-only transformer on backend `B`, with its gradients and activations.
pub struct Transformer<B: Backend> {
    pub(crate) backend: Arc<B>,
    pub(crate) config: ModelConfig,
    /// Full master weights (Compute after [`Transformer::drop_device_masters`]); shared
    /// with the models made by [`Transformer::share_base`].
    params: Arc<Params<B::Buf>>,
    /// Compute copies of the weights (only when `!backend.compute_is_full()`).
    compute: Option<Arc<Params<B::Buf>>>,
    /// Full gradients, allocated on the first backward (full-weight training only).
    grads: Option<Params<B::Buf>>,
    /// Present when the backward hands its gradients to a receiver instead of keeping
    /// them ([`Transformer::stream_gradients`]); `grads` is then `None`.
    streamed: Option<StreamedGrads<B::Buf>>,
    /// LoRA adapters: when present only they train, and the base stays frozen.
    pub(crate) lora: Option<Lora<B::Buf>>,
    /// `[head_dim / 2]` (Full) RoPE inverse frequencies.
    pub(crate) inv_freq: B::Buf,
    /// The first this many layers keep only their inputs and run again in the backward
    /// (at most [`max_recomputed_layers`]).
    recomputed_layers: usize,
    /// Training activations, reused while the batch size stays the same.
    acts: Option<Activations<B::Buf>>,
    /// Most logits one lm-head chunk may hold.
    lm_head_chunk_logits: usize,
    /// The ranks this model's layers are split over ([`crate::tensor_parallel`]).
    pub(crate) tensor_parallel: Option<Arc<dyn Collective<B>>>,
}

/// RoPE inverse frequencies exactly as Hugging Face computes them in f32, including the
/// `llama3` rescaling of long wavelengths.
pub fn rope_inv_freq(config: &ModelConfig) -> Vec<f32> {
    let dim = config.head_dim;
    let base = config.rope_theta;
    let mut inv: Vec<f32> = (0..dim)
        .step_by(2)
        .map(|i| 1.0 / base.powf(i as f32 / dim as f32))
        .collect();
    if let Some(s) = &config.rope_scaling {
        let old = s.original_max_position_embeddings as f64;
        let low_freq_wavelen = (old / s.low_freq_factor as f64) as f32;
        let high_freq_wavelen = (old / s.high_freq_factor as f64) as f32;
        for f in &mut inv {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            let scaled = if wavelen > low_freq_wavelen {
                *f / s.factor
            } else {
                *f
            };
            let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
            *f = if medium {
                let smooth = (old as f32 / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * scaled / s.factor + smooth * scaled
            } else {
                scaled
            };
        }
    }
    inv
}

/// splitmix64 (`rand_xoshiro`'s), the seeded generator of fresh LoRA adapters (random
/// weights jump into its stream with [`floe_backend::sampling::normal`]).
pub(crate) struct SplitMix(SplitMix64);

impl SplitMix {
    /// The generator whose state is `state` (its first output is `mix64(state + γ)`).
    pub(crate) fn new(state: u64) -> Self {
        Self(SplitMix64::seed_from_u64(state))
    }

    /// Uniform in (0, 1].
    pub(crate) fn unit(&mut self) -> f64 {
        ((self.0.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
}

/// `(&v[input], &mut v[output])` for two distinct indices.
fn input_output<T>(v: &mut [T], input: usize, output: usize) -> (&T, &mut T) {
    if input < output {
        let (head, tail) = v.split_at_mut(output);
        (&head[input], &mut tail[0])
    } else {
        let (head, tail) = v.split_at_mut(input);
        (&tail[0], &mut head[output])
    }
}

/// Logits per lm-head chunk on a host backend: 2M (8 MB in f32), cache-friendly.
const HOST_LM_HEAD_CHUNK_LOGITS: usize = 1 << 21;
/// Logits per lm-head chunk on a device that reports its memory (a GPU): 64M, enough rows
/// per chunk to keep the products efficient.
const DEVICE_LM_HEAD_CHUNK_LOGITS: usize = 1 << 26;

fn check_config(c: &ModelConfig) -> Result<()> {
    let bad = |msg: String| Err(ModelError::Config(msg));
    if c.vocab_size == 0 || c.hidden_size == 0 || c.intermediate_size == 0 {
        return bad(format!(
            "vocab_size {}, hidden_size {} and intermediate_size {} must be positive",
            c.vocab_size, c.hidden_size, c.intermediate_size
        ));
    }
    if c.num_key_value_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0 {
        return bad(format!(
            "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
            c.num_attention_heads, c.num_key_value_heads
        ));
    }
    if c.head_dim == 0 || c.head_dim % 2 != 0 {
        return bad(format!("head_dim {} must be positive and even", c.head_dim));
    }
    Ok(())
}

impl<B: Backend> Transformer<B> {
    /// Builds the model around `params`: Compute copies where the backend needs them, and
    /// RoPE frequencies.
    pub(crate) fn with_params(
        backend: Arc<B>,
        config: ModelConfig,
        params: Params<B::Buf>,
        storage: BaseStorage,
    ) -> Result<Self> {
        let compute = if backend.compute_is_full() || storage == BaseStorage::ComputeOnly {
            None
        } else {
            let masters = params.tensors();
            let mut at = 0;
            Some(Params::build(&config, |_, shape| {
                let mut buf = backend.zeros(shape.iter().product(), BufKind::Compute)?;
                backend.copy(&mut buf, masters[at])?;
                at += 1;
                Ok(buf)
            })?)
        }
        .map(Arc::new);
        let inv_freq = backend.upload(&rope_inv_freq(&config), BufKind::Full)?;
        let lm_head_chunk_logits = if backend.memory_info().is_some() {
            DEVICE_LM_HEAD_CHUNK_LOGITS
        } else {
            HOST_LM_HEAD_CHUNK_LOGITS
        };
        Ok(Self {
            backend,
            config,
            params: Arc::new(params),
            compute,
            grads: None,
            streamed: None,
            lora: None,
            inv_freq,
            recomputed_layers: 0,
            acts: None,
            lm_head_chunk_logits,
            tensor_parallel: None,
        })
    }

    /// A second model over the same base weights, without copying them (LoRA sessions
    /// on one base): it starts with no gradients, activations or adapters. While the
    /// weights are shared, neither model may change them (full-weight optimizer steps
    /// and [`Transformer::load_host_weights`] fail); adapters train freely.
    pub fn share_base(&self) -> Result<Self> {
        self.share_base_on(Arc::clone(&self.backend))
    }

    /// [`Transformer::share_base`] whose ops run on `backend`, a [`Backend::fork`] of this
    /// model's: the one-step-off pipeline samples from it while this model trains. The
    /// caller orders the two queues ([`Backend::wait_for`]).
    pub fn share_base_on(&self, backend: Arc<B>) -> Result<Self> {
        Ok(Self {
            inv_freq: backend.upload(&rope_inv_freq(&self.config), BufKind::Full)?,
            backend,
            config: self.config.clone(),
            params: Arc::clone(&self.params),
            compute: self.compute.clone(),
            grads: None,
            streamed: None,
            lora: None,
            recomputed_layers: self.recomputed_layers,
            acts: None,
            lm_head_chunk_logits: self.lm_head_chunk_logits,
            tensor_parallel: self.tensor_parallel.clone(),
        })
    }

    /// Whether another model shares these base weights ([`Transformer::share_base`]).
    pub fn base_is_shared(&self) -> bool {
        Arc::strong_count(&self.params) > 1
    }

    /// The base weights and their Compute copies for writing; an error while another
    /// model shares them.
    #[allow(clippy::type_complexity)]
    fn base_mut(
        &mut self,
        what: &str,
    ) -> Result<(&mut Params<B::Buf>, Option<&mut Params<B::Buf>>)> {
        let shared = || {
            ModelError::Input(format!(
                "{what}: the base weights are shared with other models (share_base); \
                 they are frozen while shared"
            ))
        };
        let params = Arc::get_mut(&mut self.params).ok_or_else(shared)?;
        let compute = match &mut self.compute {
            Some(c) => Some(Arc::get_mut(c).ok_or_else(shared)?),
            None => None,
        };
        Ok((params, compute))
    }

    /// Frees the Full master weights on the device and keeps only their Compute copies
    /// (bf16 on CUDA), for an optimizer that keeps the masters in host memory: forwards
    /// read the Compute weights as before, [`Transformer::visit_params`] then hands out
    /// the Compute weights as `param` with no `compute` copy, and
    /// [`Transformer::to_host_weights`] reads them. A no-op where the two storages
    /// coincide (the CPU).
    pub fn drop_device_masters(&mut self) -> Result<()> {
        if self.compute.is_none() {
            return Ok(());
        }
        self.base_mut("drop_device_masters")?;
        self.params = self.compute.take().expect("checked above");
        Ok(())
    }

    /// Frees the base weights' gradients (a LoRA model never computes them).
    pub(crate) fn drop_base_grads(&mut self) {
        self.grads = None;
    }

    /// From now on the backward hands every gradient to a receiver as soon as it is
    /// complete ([`Transformer::forward_backward_streamed`]) instead of keeping the whole
    /// model's (ZeRO stage 2): the full gradients are freed (any accumulated ones are
    /// lost) and the model keeps only [`StreamedGrads`]' buffers, about one layer's and
    /// one `[vocab, hidden]` tensor's. Full-weight training only.
    pub fn stream_gradients(&mut self) -> Result<()> {
        if self.lora.is_some() {
            return Err(ModelError::Input(
                "stream_gradients: a LoRA model keeps only its adapters' gradients".into(),
            ));
        }
        if self.streamed.is_some() {
            return Ok(());
        }
        self.grads = None;
        let b = &*self.backend;
        let c = &self.config;
        let specs = tensor_specs(c);
        // Layer 0's tensors follow the embedding.
        let mut shapes = specs[1..].iter();
        let mut next = || -> Result<B::Buf> {
            let (_, shape) = shapes
                .next()
                .expect("a layer's tensors follow the embedding");
            Ok(b.zeros(shape.iter().product(), BufKind::Full)?)
        };
        let layer = Layer::build(c, &mut next)?;
        self.streamed = Some(StreamedGrads {
            layer,
            final_norm: b.zeros(c.hidden_size, BufKind::Full)?,
            vocab: b.zeros(c.vocab_size * c.hidden_size, BufKind::Full)?,
        });
        Ok(())
    }

    /// Whether the backward streams its gradients ([`Transformer::stream_gradients`]).
    pub fn streams_gradients(&self) -> bool {
        self.streamed.is_some()
    }

    /// Elements of the base weights' gradient buffers the model holds now: every
    /// parameter's once a backward ran (or [`Transformer::visit_params`] allocated
    /// them), the [`StreamedGrads`] when streaming, 0 otherwise.
    pub fn base_gradient_elements(&self) -> usize {
        let b = &*self.backend;
        let held = self
            .grads
            .as_ref()
            .map_or(0, |g| g.tensors().iter().map(|t| b.len(t)).sum());
        let streamed = self.streamed.as_ref().map_or(0, |g| {
            let layer: usize = g.layer.tensors().iter().map(|t| b.len(t)).sum();
            layer + b.len(&g.final_norm) + b.len(&g.vocab)
        });
        held + streamed
    }

    /// A model with normal(0, 0.02) weights from `seed`, norms at 1 and biases at 0.
    pub fn new_random(backend: Arc<B>, config: ModelConfig, seed: u64) -> Result<Self> {
        Self::new_random_stored(backend, config, seed, BaseStorage::Trainable)
    }

    /// [`Transformer::new_random`] with the base weights kept as `storage` says.
    pub fn new_random_stored(
        backend: Arc<B>,
        config: ModelConfig,
        seed: u64,
        storage: BaseStorage,
    ) -> Result<Self> {
        check_config(&config)?;
        let kind = storage.kind();
        // Normals drawn so far: the weights are one splitmix64 stream over the tensors in
        // order, each made where it lives by jumping to its place in the stream.
        let mut drawn = 0;
        let params = Params::build(&config, |name, shape| {
            let n: usize = shape.iter().product();
            if name.ends_with("norm.weight") {
                return Ok(backend.upload(&vec![1.0; n], kind)?);
            }
            let mut buf = backend.zeros(n, kind)?;
            if !name.ends_with(".bias") {
                backend.fill_normal(&mut buf, seed, drawn, INIT_STD)?;
                drawn += n as u64;
            }
            Ok(buf)
        })?;
        Self::with_params(backend, config, params, storage)
    }

    /// A model from host tensors named as in [`tensor_specs`]; errors name the missing
    /// tensor or the one with the wrong shape. Extra tensors are ignored.
    pub fn from_host_weights(
        backend: Arc<B>,
        config: ModelConfig,
        weights: &BTreeMap<String, HostTensor>,
    ) -> Result<Self> {
        Self::from_host_weights_stored(backend, config, weights, BaseStorage::Trainable)
    }

    /// [`Transformer::from_host_weights`] with the base weights kept as `storage` says.
    pub fn from_host_weights_stored(
        backend: Arc<B>,
        config: ModelConfig,
        weights: &BTreeMap<String, HostTensor>,
        storage: BaseStorage,
    ) -> Result<Self> {
        check_config(&config)?;
        check_weights(&config, weights)?;
        let params = Params::build(&config, |name, _| {
            Ok(backend.upload(&weights[name].data, storage.kind())?)
        })?;
        Self::with_params(backend, config, params, storage)
    }

    /// Replaces every weight (and its Compute copy) with host tensors named as in
    /// [`tensor_specs`]; gradients are kept.
    pub fn load_host_weights(&mut self, weights: &BTreeMap<String, HostTensor>) -> Result<()> {
        check_weights(&self.config, weights)?;
        let specs = tensor_specs(&self.config);
        let backend = Arc::clone(&self.backend);
        let b = &*backend;
        let (params, compute) = self.base_mut("load_host_weights")?;
        let mut computes = compute.map(|c| c.tensors_mut());
        for (i, (param, (name, _))) in params.tensors_mut().into_iter().zip(&specs).enumerate() {
            *param = b.upload(&weights[name].data, b.kind(param))?;
            if let Some(c) = computes.as_mut() {
                b.copy(c[i], param)?;
            }
        }
        Ok(())
    }

    /// Every weight as a host tensor named as in [`tensor_specs`].
    pub fn to_host_weights(&self) -> Result<BTreeMap<String, HostTensor>> {
        let b = &*self.backend;
        tensor_specs(&self.config)
            .into_iter()
            .zip(self.params.tensors())
            .map(|((name, shape), buf)| {
                let data = b.download(buf)?;
                Ok((name, HostTensor { shape, data }))
            })
            .collect()
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The backend the model runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Activation checkpointing of the first `layers` layers: they keep only their input
    /// and run again during the backward, capped at [`max_recomputed_layers`] (so
    /// `usize::MAX` recomputes all that can be). Each one saves one layer's internals
    /// and costs one layer's forward; which layers they are does not matter for either,
    /// and the first ones can share the slot of the first stored layer. Changes memory
    /// and time, not results.
    pub fn set_recomputed_layers(&mut self, layers: usize) {
        let layers = layers.min(max_recomputed_layers(&self.config));
        if layers != self.recomputed_layers {
            self.recomputed_layers = layers;
            self.acts = None;
        }
    }

    /// How many layers the backward recomputes ([`Transformer::set_recomputed_layers`]).
    pub fn recomputed_layers(&self) -> usize {
        self.recomputed_layers
    }

    /// The weights forwards read: the Compute copies, or the masters when they coincide.
    pub(crate) fn weights(&self) -> &Params<B::Buf> {
        self.compute.as_deref().unwrap_or(&self.params)
    }

    /// Checks a batch against the vocabulary.
    fn check_batch(&self, batch: &PackedBatch) -> Result<()> {
        batch.validate()?;
        if batch.is_empty() {
            return Err(ModelError::Input("batch: no rows".into()));
        }
        let vocab = self.config.vocab_size;
        for (what, ids) in [("tokens", &batch.tokens), ("targets", &batch.targets)] {
            if let Some(row) = ids.iter().position(|&id| id as usize >= vocab) {
                return Err(ModelError::Input(format!(
                    "batch: {what}[{row}] = {} is not below vocab_size {vocab}",
                    ids[row]
                )));
            }
        }
        Ok(())
    }

    fn attn_shape(&self, tokens: usize) -> AttnShape {
        let c = &self.config;
        AttnShape {
            tokens,
            q_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        }
    }

    /// `y (+)= x · wᵀ` for `x: [rows, n_in]`, `w: [n_out, n_in]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear(
        &self,
        y: &mut B::Buf,
        x: &B::Buf,
        w: &B::Buf,
        rows: usize,
        n_out: usize,
        n_in: usize,
        accumulate: bool,
    ) -> Result<()> {
        let dims = Matmul {
            m: rows,
            n: n_out,
            k: n_in,
            trans_a: false,
            trans_b: true,
        };
        Ok(self.backend.matmul(y, x, w, dims, accumulate)?)
    }

    /// Backward of [`Self::linear`]: `dx (+)= dy · w`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_dx(
        &self,
        dx: &mut B::Buf,
        dy: &B::Buf,
        w: &B::Buf,
        rows: usize,
        n_out: usize,
        n_in: usize,
        accumulate: bool,
    ) -> Result<()> {
        let dims = Matmul {
            m: rows,
            n: n_in,
            k: n_out,
            trans_a: false,
            trans_b: false,
        };
        Ok(self.backend.matmul(dx, dy, w, dims, accumulate)?)
    }

    /// Backward of [`Self::linear`]: `dw += dyᵀ · x`.
    pub(crate) fn linear_dw(
        &self,
        dw: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        rows: usize,
        n_out: usize,
        n_in: usize,
    ) -> Result<()> {
        let dims = Matmul {
            m: n_out,
            n: n_in,
            k: rows,
            trans_a: true,
            trans_b: false,
        };
        Ok(self.backend.matmul(dw, dy, x, dims, true)?)
    }

    /// Decoder layer `l`: `out = layer(x)` (plus its adapters' terms on a LoRA model),
    /// saving its internals in `a`.
    pub(crate) fn layer_forward(
        &self,
        l: usize,
        w: &Layer<B::Buf>,
        residual: Residual<'_, B::Buf>,
        a: &mut LayerActs<B::Buf>,
        positions: &B::Buf,
        attend: Attend<'_, B>,
    ) -> Result<()> {
        let b = &*self.backend;
        let c = &self.config;
        let t = self.backend.len(positions);
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let (q, kv, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let eps = c.rms_norm_eps;
        let adapters = self.layer_adapters(l);

        let x = residual.input();
        b.rmsnorm_forward(&mut a.ln1, &mut a.ln1_rstd, x, &w.input_norm, t, h, eps)?;
        // Projections land in q_raw/k_raw when a per-head norm follows, else in place.
        let q_proj = a.q_raw.as_mut().unwrap_or(&mut a.q);
        self.linear(q_proj, &a.ln1, &w.wq, t, q, h, false)?;
        self.adapt(q_proj, &a.ln1, adapters, Proj::Q, t, a.low_rank.as_mut())?;
        if let Some(bias) = &w.bq {
            b.add_bias(q_proj, bias, t, q)?;
        }
        let k_proj = a.k_raw.as_mut().unwrap_or(&mut a.k);
        self.linear(k_proj, &a.ln1, &w.wk, t, kv, h, false)?;
        self.adapt(k_proj, &a.ln1, adapters, Proj::K, t, a.low_rank.as_mut())?;
        if let Some(bias) = &w.bk {
            b.add_bias(k_proj, bias, t, kv)?;
        }
        self.linear(&mut a.v, &a.ln1, &w.wv, t, kv, h, false)?;
        self.adapt(&mut a.v, &a.ln1, adapters, Proj::V, t, a.low_rank.as_mut())?;
        if let Some(bias) = &w.bv {
            b.add_bias(&mut a.v, bias, t, kv)?;
        }
        match (
            (&a.q_raw, &mut a.q_rstd, &w.q_norm),
            (&a.k_raw, &mut a.k_rstd, &w.k_norm),
        ) {
            (
                (Some(q_raw), Some(q_rstd), Some(q_norm)),
                (Some(k_raw), Some(k_rstd), Some(k_norm)),
            ) => {
                let q = NormedHeads {
                    out: &mut a.q,
                    rstd: q_rstd,
                    raw: q_raw,
                    norm: q_norm,
                    heads: hq,
                };
                let k = NormedHeads {
                    out: &mut a.k,
                    rstd: k_rstd,
                    raw: k_raw,
                    norm: k_norm,
                    heads: hkv,
                };
                b.qk_norm_rope(q, k, positions, &self.inv_freq, t, hd, eps)?;
            }
            _ => {
                b.rope(&mut a.q, positions, &self.inv_freq, t, hq, hd, false)?;
                b.rope(&mut a.k, positions, &self.inv_freq, t, hkv, hd, false)?;
            }
        }
        let shape = self.attn_shape(t);
        match attend {
            Attend::Packed {
                segments,
                uncovered_rows,
            } => {
                if uncovered_rows {
                    b.fill_zero(&mut a.att)?;
                }
                b.attention_forward(
                    &mut a.att,
                    &mut a.att_lse,
                    &a.q,
                    &a.k,
                    &a.v,
                    segments,
                    shape,
                )?;
            }
            Attend::Paged {
                slots,
                layout,
                k_cache,
                v_cache,
            } => {
                b.kv_cache_write(k_cache, v_cache, &a.k, &a.v, slots, hkv, hd)?;
                b.paged_attention(&mut a.att, &a.q, k_cache, v_cache, &layout, shape)?;
            }
        }
        // resid = x + att·Woᵀ, then out = resid + act·W_downᵀ.
        let (resid, out) = match residual {
            Residual::Kept { x, out } => {
                b.copy(&mut a.resid, x)?;
                (&mut a.resid, Some(out))
            }
            Residual::InPlace(x) => (x, None),
        };
        // Under tensor parallelism the product is this rank's partial sum: rank 0 adds
        // it to the residual, the others start from zero, and the ranks sum.
        let adds_residual = self.tensor_parallel.as_ref().is_none_or(|c| c.rank() == 0);
        self.linear(resid, &a.att, &w.wo, t, h, q, adds_residual)?;
        self.adapt(resid, &a.att, adapters, Proj::O, t, a.low_rank.as_mut())?;
        if let Some(ranks) = &self.tensor_parallel {
            ranks.all_reduce_sum(resid)?;
        }
        b.rmsnorm_forward(&mut a.ln2, &mut a.ln2_rstd, resid, &w.post_norm, t, h, eps)?;
        self.linear(&mut a.gate, &a.ln2, &w.w_gate, t, inter, h, false)?;
        self.adapt(
            &mut a.gate,
            &a.ln2,
            adapters,
            Proj::Gate,
            t,
            a.low_rank.as_mut(),
        )?;
        self.linear(&mut a.up, &a.ln2, &w.w_up, t, inter, h, false)?;
        self.adapt(
            &mut a.up,
            &a.ln2,
            adapters,
            Proj::Up,
            t,
            a.low_rank.as_mut(),
        )?;
        b.swiglu_forward(&mut a.act, &a.gate, &a.up)?;
        let out = match out {
            Some(out) => {
                b.copy(out, resid)?;
                out
            }
            None => resid,
        };
        self.linear(out, &a.act, &w.w_down, t, h, inter, adds_residual)?;
        self.adapt(out, &a.act, adapters, Proj::Down, t, a.low_rank.as_mut())?;
        if let Some(ranks) = &self.tensor_parallel {
            ranks.all_reduce_sum(out)?;
        }
        Ok(())
    }

    /// Backward of layer `l`: on entry `s.d_resid` is the gradient of the layer's output,
    /// on exit that of its input `x`; parameter gradients accumulate into `g` (the base
    /// weights, or the adapters of a LoRA model).
    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        w: &Layer<B::Buf>,
        mut g: LayerGrad<'_, B::Buf>,
        x: &B::Buf,
        a: &LayerActs<B::Buf>,
        s: &mut GradScratch<B::Buf>,
        positions: &B::Buf,
        segments: &[Segment],
    ) -> Result<()> {
        let b = &*self.backend;
        let c = &self.config;
        let t = self.backend.len(positions);
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv) = (c.q_dim(), c.kv_dim());
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);

        // MLP: out = resid + act · W_downᵀ.
        self.proj_backward(
            &mut s.d_act,
            &s.d_resid,
            &a.act,
            &w.w_down,
            &mut g,
            Proj::Down,
            t,
            false,
        )?;
        b.swiglu_backward(&mut s.d_gate, &mut s.d_up, &s.d_act, &a.gate, &a.up)?;
        self.proj_backward(
            &mut s.d_norm_out,
            &s.d_gate,
            &a.ln2,
            &w.w_gate,
            &mut g,
            Proj::Gate,
            t,
            false,
        )?;
        self.proj_backward(
            &mut s.d_norm_out,
            &s.d_up,
            &a.ln2,
            &w.w_up,
            &mut g,
            Proj::Up,
            t,
            true,
        )?;
        b.rmsnorm_backward(
            &mut s.d_norm_in,
            g.norm(true),
            &s.d_norm_out,
            &a.resid,
            &w.post_norm,
            &a.ln2_rstd,
            t,
            h,
        )?;
        b.add_assign(&mut s.d_resid, &s.d_norm_in)?;

        // Attention: resid = x + att · Woᵀ.
        self.proj_backward(
            &mut s.d_att,
            &s.d_resid,
            &a.att,
            &w.wo,
            &mut g,
            Proj::O,
            t,
            false,
        )?;
        b.attention_backward(
            &mut s.d_q,
            &mut s.d_k,
            &mut s.d_v,
            &s.d_att,
            &a.att,
            &a.att_lse,
            &a.q,
            &a.k,
            &a.v,
            segments,
            self.attn_shape(t),
        )?;
        b.rope(&mut s.d_q, positions, &self.inv_freq, t, hq, hd, true)?;
        b.rope(&mut s.d_k, positions, &self.inv_freq, t, hkv, hd, true)?;
        if let (Some(d_raw), Some(gn), Some(wn), Some(raw), Some(rstd)) = (
            &mut s.d_q_raw,
            g.head_norm(false, c.qk_norm),
            &w.q_norm,
            &a.q_raw,
            &a.q_rstd,
        ) {
            b.rmsnorm_backward(d_raw, gn, &s.d_q, raw, wn, rstd, t * hq, hd)?;
        }
        if let (Some(d_raw), Some(gn), Some(wn), Some(raw), Some(rstd)) = (
            &mut s.d_k_raw,
            g.head_norm(true, c.qk_norm),
            &w.k_norm,
            &a.k_raw,
            &a.k_rstd,
        ) {
            b.rmsnorm_backward(d_raw, gn, &s.d_k, raw, wn, rstd, t * hkv, hd)?;
        }
        // Gradients of the projections' outputs.
        let d_qp = s.d_q_raw.as_ref().unwrap_or(&s.d_q);
        let d_kp = s.d_k_raw.as_ref().unwrap_or(&s.d_k);
        let [gbq, gbk, gbv] = g.biases();
        for (gb, dy, n) in [(gbq, d_qp, q), (gbk, d_kp, kv), (gbv, &s.d_v, kv)] {
            if let Some(gb) = gb {
                b.add_bias_backward(gb, dy, t, n)?;
            }
        }
        self.proj_backward(
            &mut s.d_norm_out,
            d_qp,
            &a.ln1,
            &w.wq,
            &mut g,
            Proj::Q,
            t,
            false,
        )?;
        self.proj_backward(
            &mut s.d_norm_out,
            d_kp,
            &a.ln1,
            &w.wk,
            &mut g,
            Proj::K,
            t,
            true,
        )?;
        self.proj_backward(
            &mut s.d_norm_out,
            &s.d_v,
            &a.ln1,
            &w.wv,
            &mut g,
            Proj::V,
            t,
            true,
        )?;
        b.rmsnorm_backward(
            &mut s.d_norm_in,
            g.norm(false),
            &s.d_norm_out,
            x,
            &w.input_norm,
            &a.ln1_rstd,
            t,
            h,
        )?;
        b.add_assign(&mut s.d_resid, &s.d_norm_in)?;
        Ok(())
    }

    /// Embedding, every layer, final norm and lm-head; internals of layer `l` go to its
    /// slot (see [`Activations::layers`]).
    fn run_forward(
        &self,
        acts: &mut Activations<B::Buf>,
        batch: &PackedBatch,
        ids: &B::Buf,
        targets: &B::Buf,
        positions: &B::Buf,
        logit_scale: f32,
    ) -> Result<()> {
        let b = &*self.backend;
        let c = &self.config;
        let (t, h) = (batch.len(), c.hidden_size);
        let w = self.weights();
        let covered: usize = batch.segments.iter().map(|s| s.len as usize).sum();
        b.embedding_forward(&mut acts.residual[0], &w.embed, ids, h)?;
        let kept = acts.residual.len();
        for (l, wl) in w.layers.iter().enumerate() {
            let slot = layer_slot(l, c.num_hidden_layers, acts.layers.len());
            let (x, out) = input_output(&mut acts.residual, l % kept, (l + 1) % kept);
            let attend = Attend::Packed {
                segments: &batch.segments,
                uncovered_rows: covered < t,
            };
            let residual = Residual::Kept { x, out };
            self.layer_forward(l, wl, residual, &mut acts.layers[slot], positions, attend)?;
        }
        let last = &acts.residual[c.num_hidden_layers % kept];
        b.rmsnorm_forward(
            &mut acts.final_out,
            &mut acts.final_rstd,
            last,
            &w.final_norm,
            t,
            h,
            c.rms_norm_eps,
        )?;
        let merged_unembed = self.merged_unembed(w.lm_head())?;
        b.lm_head_forward(
            &mut acts.logprobs,
            &mut acts.entropy,
            &mut acts.lse,
            &acts.final_out,
            merged_unembed.as_ref().unwrap_or(w.lm_head()),
            targets,
            self.lm_head_spec(t, logit_scale),
        )?;
        Ok(())
    }

    fn lm_head_spec(&self, tokens: usize, logit_scale: f32) -> LmHead {
        let vocab = self.config.vocab_size;
        LmHead {
            tokens,
            dim: self.config.hidden_size,
            vocab,
            logit_scale,
            chunk_rows: (self.lm_head_chunk_logits / vocab).clamp(1, tokens.max(1)),
        }
    }

    /// Caps the logits the fused lm-head materialises at once (`chunk_rows × vocab`); the
    /// default is 2M on a host backend and 64M on a device. Changes memory and speed, not
    /// results.
    pub fn set_lm_head_chunk_logits(&mut self, logits: usize) {
        self.lm_head_chunk_logits = logits.max(1);
    }

    fn stats(&self, acts: &Activations<B::Buf>) -> Result<TokenStats> {
        Ok(TokenStats {
            logprobs: self.backend.download_f64(&acts.logprobs)?,
            entropy: self.backend.download_f64(&acts.entropy)?,
        })
    }

    fn upload_batch(&self, batch: &PackedBatch) -> Result<[B::Buf; 3]> {
        let b = &*self.backend;
        Ok([
            b.upload_index(&batch.tokens)?,
            b.upload_index(&batch.targets)?,
            b.upload_index(&batch.positions)?,
        ])
    }

    /// Log-prob of each row's target and the entropy of each row under
    /// `softmax(logit_scale · logits)`; keeps no gradient state.
    pub fn forward(&self, batch: &PackedBatch, logit_scale: f32) -> Result<TokenStats> {
        self.check_batch(batch)?;
        let mut zeros = zeros_on(&*self.backend);
        let mut acts = Activations::new(&mut zeros, &self.config, batch.len(), 1, None)?;
        let [ids, targets, positions] = self.upload_batch(batch)?;
        self.run_forward(&mut acts, batch, &ids, &targets, &positions, logit_scale)?;
        self.stats(&acts)
    }

    /// Bytes of the activations [`Transformer::forward_backward`] keeps for a micro-batch
    /// of `tokens`, as the same constructors allocate them, with `element_bytes` per
    /// element of each buffer kind (see [`Backend::element_bytes`]). Not counted: the
    /// backend's own workspaces (lm-head chunks, GEMM workspace).
    /// `recomputed_layers` is capped as [`Transformer::set_recomputed_layers`] caps it.
    pub fn training_activation_bytes(
        config: &ModelConfig,
        tokens: usize,
        recomputed_layers: usize,
        element_bytes: &dyn Fn(BufKind) -> usize,
    ) -> usize {
        let mut bytes = 0;
        let mut count = |n: usize, kind: BufKind| {
            bytes += n * element_bytes(kind);
            Ok(())
        };
        let recomputed = recomputed_layers.min(max_recomputed_layers(config));
        let slots = training_layer_slots(config, recomputed);
        Activations::new(&mut count, config, tokens, slots, Some(recomputed > 0))
            .expect("counting never fails");
        bytes
    }

    /// Forward, then `loss_grad` turns the stats into `(dL/dlogprob, dL/dentropy)` per row,
    /// then the backward accumulates every parameter's gradient (so micro-batches sum).
    pub fn forward_backward(
        &mut self,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut LossGradFn<'_>,
    ) -> Result<TokenStats> {
        if self.streamed.is_some() {
            return Err(ModelError::Input(
                "forward_backward: this model streams its gradients (stream_gradients); \
                 call forward_backward_streamed"
                    .into(),
            ));
        }
        self.train(batch, logit_scale, loss_grad, None)
    }

    /// [`Transformer::forward_backward`] of a model that streams its gradients
    /// ([`Transformer::stream_gradients`]): `receive` gets each parameter's gradient of
    /// this backward as soon as it is complete ([`GradReceiverFn`]), and the model keeps
    /// none of them.
    pub fn forward_backward_streamed(
        &mut self,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut LossGradFn<'_>,
        receive: &mut GradReceiverFn<'_, B::Buf>,
    ) -> Result<TokenStats> {
        if self.streamed.is_none() {
            return Err(ModelError::Input(
                "forward_backward_streamed: call stream_gradients first".into(),
            ));
        }
        self.train(batch, logit_scale, loss_grad, Some(receive))
    }

    /// Forward and backward, the gradients kept or handed to `receive`.
    fn train(
        &mut self,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut LossGradFn<'_>,
        receive: Option<&mut GradReceiverFn<'_, B::Buf>>,
    ) -> Result<TokenStats> {
        self.check_batch(batch)?;
        let t = batch.len();
        // A set sized for another batch is freed before the next is allocated.
        if self.acts.as_ref().is_some_and(|acts| acts.tokens != t) {
            self.acts = None;
        }
        let mut acts = match self.acts.take() {
            Some(acts) => acts,
            None => {
                let mut zeros = zeros_on(&*self.backend);
                Activations::new(
                    &mut zeros,
                    &self.config,
                    t,
                    training_layer_slots(&self.config, self.recomputed_layers),
                    Some(self.recomputed_layers > 0),
                )?
            }
        };
        let result = self.train_pass(&mut acts, batch, logit_scale, loss_grad, receive);
        self.acts = Some(acts);
        result
    }

    /// [`Self::train`] on activations already sized for `batch`.
    fn train_pass(
        &mut self,
        acts: &mut Activations<B::Buf>,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut LossGradFn<'_>,
        receive: Option<&mut GradReceiverFn<'_, B::Buf>>,
    ) -> Result<TokenStats> {
        if self.tensor_parallel.is_some() {
            return Err(ModelError::Input(
                "a tensor-parallel model samples and scores; it does not train".into(),
            ));
        }
        let t = batch.len();
        let [ids, targets, positions] = self.upload_batch(batch)?;
        self.run_forward(acts, batch, &ids, &targets, &positions, logit_scale)?;
        let stats = self.stats(acts)?;
        let (d_logprobs, d_entropy) = loss_grad(&stats)?;
        for (what, len) in [
            ("dL/dlogprob", d_logprobs.len()),
            ("dL/dentropy", d_entropy.len()),
        ] {
            if len != t {
                return Err(ModelError::Input(format!(
                    "loss gradient: {what} has {len} entries for a batch of {t} rows"
                )));
            }
        }
        let inputs = [&ids, &targets, &positions];
        let result = if self.lora.is_some() {
            let mut grads = self.take_lora_grads()?;
            let sink = GradSink::Adapters(&mut grads);
            let result = self.run_backward(
                acts,
                sink,
                batch,
                inputs,
                logit_scale,
                &d_logprobs,
                &d_entropy,
            );
            self.lora.as_mut().expect("checked above").grads = Some(grads);
            result
        } else if let Some(receive) = receive {
            let mut grads = self.streamed.take().expect("checked by the caller");
            let sink = GradSink::Streamed {
                grads: &mut grads,
                receive,
            };
            let result = self.run_backward(
                acts,
                sink,
                batch,
                inputs,
                logit_scale,
                &d_logprobs,
                &d_entropy,
            );
            self.streamed = Some(grads);
            result
        } else {
            let mut grads = match self.grads.take() {
                Some(g) => g,
                None => self.zero_params()?,
            };
            let sink = GradSink::Full(&mut grads);
            let result = self.run_backward(
                acts,
                sink,
                batch,
                inputs,
                logit_scale,
                &d_logprobs,
                &d_entropy,
            );
            self.grads = Some(grads);
            result
        };
        result?;
        Ok(stats)
    }

    fn zero_params(&self) -> Result<Params<B::Buf>> {
        Params::build(&self.config, |_, shape| {
            Ok(self.backend.zeros(shape.iter().product(), BufKind::Full)?)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn run_backward(
        &self,
        acts: &mut Activations<B::Buf>,
        mut sink: GradSink<'_, B::Buf>,
        batch: &PackedBatch,
        [ids, targets, positions]: [&B::Buf; 3],
        logit_scale: f32,
        d_logprobs: &[f64],
        d_entropy: &[f64],
    ) -> Result<()> {
        let b = &*self.backend;
        let c = &self.config;
        let (t, h) = (batch.len(), c.hidden_size);
        let w = self.weights();
        let d_lp = b.upload_f64(d_logprobs, BufKind::Full)?;
        let d_ent = b.upload_f64(d_entropy, BufKind::Full)?;
        let Activations {
            residual,
            layers,
            final_out,
            final_rstd,
            lse,
            grad,
            ..
        } = acts;
        let s = grad
            .as_mut()
            .expect("training activations carry a gradient scratch");
        let merged_unembed = self.merged_unembed(w.lm_head())?;
        let g_lm = match &mut sink {
            GradSink::Full(g) => match &mut g.lm_head {
                Some(lm) => lm,
                None => &mut g.embed,
            },
            GradSink::Streamed { grads, .. } => {
                b.fill_zero(&mut grads.final_norm)?;
                b.fill_zero(&mut grads.vocab)?;
                &mut grads.vocab
            }
            GradSink::Adapters(g) => {
                b.fill_zero(&mut g.frozen.lm_head)?;
                &mut g.frozen.lm_head
            }
        };
        b.lm_head_backward(
            &mut s.d_norm_out,
            g_lm,
            &d_lp,
            &d_ent,
            final_out,
            merged_unembed.as_ref().unwrap_or(w.lm_head()),
            targets,
            lse,
            self.lm_head_spec(t, logit_scale),
        )?;
        if let GradSink::Adapters(g) = &mut sink {
            self.unembed_backward(g)?;
        }
        b.rmsnorm_backward(
            &mut s.d_resid,
            sink.final_norm(),
            &s.d_norm_out,
            &residual[c.num_hidden_layers],
            &w.final_norm,
            final_rstd,
            t,
            h,
        )?;
        let tied = c.tie_word_embeddings;
        // Visit-order index of layer 0's first tensor, and tensors a layer has.
        let (first_layer, layer_len) = (1, w.layers[0].tensors().len());
        if let GradSink::Streamed { grads, receive } = &mut sink {
            // Tied, the vocab buffer also takes the embedding's gradient, at the end.
            let final_norm = first_layer + c.num_hidden_layers * layer_len;
            if tied {
                receive(final_norm, &[&grads.final_norm])?;
            } else {
                receive(final_norm, &[&grads.final_norm, &grads.vocab])?;
            }
        }
        let covered: usize = batch.segments.iter().map(|s| s.len as usize).sum();
        for l in (0..c.num_hidden_layers).rev() {
            let slot = layer_slot(l, c.num_hidden_layers, layers.len());
            // Slot 0 holds the internals of layer `recomputed_layers` from the forward;
            // the layers below it are run again into it once that layer's backward ran.
            if l < self.recomputed_layers {
                let out = s
                    .recompute_out
                    .as_mut()
                    .expect("recompute scratch exists when recomputing");
                let attend = Attend::Packed {
                    segments: &batch.segments,
                    uncovered_rows: covered < t,
                };
                self.layer_forward(
                    l,
                    &w.layers[l],
                    Residual::Kept {
                        x: &residual[l],
                        out,
                    },
                    &mut layers[slot],
                    positions,
                    attend,
                )?;
            }
            if let GradSink::Streamed { grads, .. } = &mut sink {
                for g in grads.layer.tensors_mut() {
                    b.fill_zero(g)?;
                }
            }
            self.layer_backward(
                &w.layers[l],
                sink.layer(l, self.layer_adapters(l)),
                &residual[l],
                &layers[slot],
                s,
                positions,
                &batch.segments,
            )?;
            if let GradSink::Streamed { grads, receive } = &mut sink {
                receive(first_layer + l * layer_len, &grads.layer.tensors())?;
            }
        }
        match sink {
            GradSink::Full(g) => b.embedding_backward(&mut g.embed, &s.d_resid, ids, h)?,
            GradSink::Streamed { grads, receive } => {
                if !tied {
                    b.fill_zero(&mut grads.vocab)?;
                }
                b.embedding_backward(&mut grads.vocab, &s.d_resid, ids, h)?;
                receive(0, &[&grads.vocab])?;
            }
            GradSink::Adapters(_) => {}
        }
        Ok(())
    }

    /// Sets every gradient to zero (a no-op before the first backward).
    pub fn zero_grad(&mut self) -> Result<()> {
        self.zero_lora_grads()?;
        if let Some(grads) = &mut self.grads {
            for g in grads.tensors_mut() {
                self.backend.fill_zero(g)?;
            }
        }
        Ok(())
    }

    /// Global L2 norm over every gradient (0 before the first backward).
    pub fn grad_norm(&self) -> Result<f64> {
        let mut sum = self.lora_grad_sum_squares()?;
        let Some(grads) = &self.grads else {
            return Ok(sum.sqrt());
        };
        for g in grads.tensors() {
            sum += self.backend.sum_squares(g)?;
        }
        Ok(sum.sqrt())
    }

    /// Visits every trained parameter with its name, its gradient and its Compute copy
    /// (when the backend keeps one): every weight in [`tensor_specs`] order, or on a
    /// LoRA model the adapters in [`crate::lora::adapter_specs`] order (PEFT names).
    /// Allocates zero gradients if no backward has run yet.
    pub fn visit_params(
        &mut self,
        f: &mut dyn FnMut(&str, ParamSlot<'_, B>) -> Result<()>,
    ) -> Result<()> {
        if self.lora.is_some() {
            return self.visit_adapters(f);
        }
        if self.streamed.is_some() {
            return Err(ModelError::Input(
                "visit_params: this model streams its gradients and holds none; \
                 visit_weights visits the weights alone"
                    .into(),
            ));
        }
        if self.grads.is_none() {
            self.grads = Some(self.zero_params()?);
        }
        let specs = tensor_specs(&self.config);
        let mut grads = self.grads.take().expect("allocated above");
        let result = self.visit_base(&specs, &mut grads, f);
        self.grads = Some(grads);
        result
    }

    /// Visits every base weight with its name and its Compute copy (when the backend
    /// keeps one), in [`tensor_specs`] order, without allocating gradients; for
    /// full-weight training (a LoRA model's base is frozen).
    pub fn visit_weights(
        &mut self,
        f: &mut dyn FnMut(&str, WeightSlot<'_, B>) -> Result<()>,
    ) -> Result<()> {
        if self.lora.is_some() {
            return Err(ModelError::Input(
                "visit_weights: a LoRA model trains its adapters (visit_params)".into(),
            ));
        }
        let specs = tensor_specs(&self.config);
        let (params, compute) = self.base_mut("visit_weights")?;
        let mut computes = compute.map(|c| c.tensors_mut().into_iter());
        for ((name, _), param) in specs.iter().zip(params.tensors_mut()) {
            let compute = computes.as_mut().and_then(|c| c.next());
            f(name, WeightSlot { param, compute })?;
        }
        Ok(())
    }

    fn visit_base(
        &mut self,
        specs: &[(String, Vec<usize>)],
        grads: &mut Params<B::Buf>,
        f: &mut dyn FnMut(&str, ParamSlot<'_, B>) -> Result<()>,
    ) -> Result<()> {
        let (params, compute) = self.base_mut("visit_params")?;
        let mut computes = compute.map(|c| c.tensors_mut().into_iter());
        for (((name, _), param), grad) in specs
            .iter()
            .zip(params.tensors_mut())
            .zip(grads.tensors_mut())
        {
            let compute = computes.as_mut().and_then(|c| c.next());
            f(
                name,
                ParamSlot {
                    param,
                    grad,
                    compute,
                },
            )?;
        }
        Ok(())
    }

    /// Every trained parameter's gradient as a host tensor, named as
    /// [`Transformer::visit_params`] names them (zeros before the first backward); for
    /// checks and debugging.
    pub fn grads_to_host(&self) -> Result<BTreeMap<String, HostTensor>> {
        if self.lora.is_some() {
            return self.lora_grads_to_host();
        }
        let b = &*self.backend;
        let specs = tensor_specs(&self.config);
        match &self.grads {
            None => Ok(specs
                .into_iter()
                .map(|(name, shape)| (name, HostTensor::zeros(shape)))
                .collect()),
            Some(grads) => specs
                .into_iter()
                .zip(grads.tensors())
                .map(|((name, shape), buf)| {
                    Ok((
                        name,
                        HostTensor {
                            shape,
                            data: b.download(buf)?,
                        },
                    ))
                })
                .collect(),
        }
    }
}
