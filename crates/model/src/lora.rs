//! LoRA: low-rank adapters trained on a frozen base. An adapted projection computes
//! `y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ` with `A: [rank, in]`, `B: [out, rank]` and `s = alpha / rank`.
//!
//! # Where adapters sit
//! The attention projections q, k, v, o (`train_attn`), the MLP's gate, up and down
//! (`train_mlp`) and the lm-head (`train_unembed`). The layers never build a merged
//! weight: each adapted projection adds its low-rank term to the base product, so many
//! adapter sets can run on one base ([`Transformer::share_base`]). The fused lm-head op
//! takes a single weight, so scoring and training with an unembed adapter build
//! `W + s·B·A` as a temporary of that one matrix per call; cached decoding (the sampler)
//! adds the low-rank term to the logits instead. With tied embeddings the unembed adapter
//! changes the lm-head only, never the input embedding.
//!
//! # Backward
//! Gradients exist only for A and B. With `u = s·x·Aᵀ` and `v = s·dy·B`:
//! `dB += dyᵀ·u`, `dA += vᵀ·x`, `dx += v·A`. The base's weight-gradient products are
//! skipped (the time and memory LoRA saves); the fused backend ops that always emit a
//! weight gradient (RMSNorm, lm-head) write theirs into discard buffers (`FrozenGrads`).
//! The unembed adapter's gradient is projected from the lm-head's weight gradient `G`:
//! `dB += s·G·Aᵀ`, `dA += s·Bᵀ·G`.
//!
//! # Initialisation and files
//! A is Kaiming-uniform, `U(-1/√in, 1/√in)` as PEFT draws it, from [`LoraConfig::seed`];
//! B is zero, so a fresh adapter leaves the model exactly equal to its base. Tensors carry
//! PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), and
//! [`save_adapter_dir`] writes the `adapter_model.safetensors` + `adapter_config.json`
//! pair PEFT loads.

use std::collections::BTreeMap;
use std::path::Path;

use floe_backend::{Backend, BufKind, Matmul};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::transformer::{
    GradReceiverFn, Layer, ModelError, Params, Result, SplitMix, StreamedGrads, Transformer,
};
use crate::weights::{self, HostTensor, WeightsError};

/// The scale numerator floe uses when a client gives none (Tinker's `lora_config` has
/// no alpha): the low-rank term is multiplied by `32 / rank`.
pub const DEFAULT_LORA_ALPHA: f32 = 32.0;
/// File of the adapter weights in an adapter folder (PEFT's name).
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// File of the adapter settings in an adapter folder (PEFT's name).
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// Which projections get adapters, their rank and scale, and the seed of A.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank of every adapter.
    pub rank: usize,
    /// The low-rank term is multiplied by `alpha / rank`.
    pub alpha: f32,
    /// Adapters on the attention projections q, k, v, o.
    pub train_attn: bool,
    /// Adapters on the MLP projections gate, up, down.
    pub train_mlp: bool,
    /// An adapter on the lm-head.
    pub train_unembed: bool,
    /// Seed of the initial A matrices.
    pub seed: u64,
}

impl LoraConfig {
    /// Rank `rank` on every projection and the lm-head, alpha [`DEFAULT_LORA_ALPHA`],
    /// seed 0.
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            alpha: DEFAULT_LORA_ALPHA,
            train_attn: true,
            train_mlp: true,
            train_unembed: true,
            seed: 0,
        }
    }

    /// The factor `alpha / rank` of the low-rank term.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }

    /// Rejects a zero rank, a non-positive alpha, and a config that adapts nothing.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(ModelError::Config(format!("lora: {msg}")));
        if self.rank == 0 {
            return bad("rank must be at least 1".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("alpha {} must be positive and finite", self.alpha));
        }
        if !(self.train_attn || self.train_mlp || self.train_unembed) {
            return bad(
                "train_attn, train_mlp and train_unembed are all false: nothing would train".into(),
            );
        }
        Ok(())
    }
}

/// A projection of a decoder layer that may carry an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// Every layer projection, in the order adapters are listed.
const PROJS: [Proj; 7] = [
    Proj::Q,
    Proj::K,
    Proj::V,
    Proj::O,
    Proj::Gate,
    Proj::Up,
    Proj::Down,
];

impl Proj {
    /// The module's path inside a Hugging Face decoder layer.
    fn module(self) -> &'static str {
        match self {
            Proj::Q => "self_attn.q_proj",
            Proj::K => "self_attn.k_proj",
            Proj::V => "self_attn.v_proj",
            Proj::O => "self_attn.o_proj",
            Proj::Gate => "mlp.gate_proj",
            Proj::Up => "mlp.up_proj",
            Proj::Down => "mlp.down_proj",
        }
    }

    /// `(out, in)` features of the base weight.
    pub(crate) fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        match self {
            Proj::Q => (c.q_dim(), h),
            Proj::K | Proj::V => (c.kv_dim(), h),
            Proj::O => (h, c.q_dim()),
            Proj::Gate | Proj::Up => (i, h),
            Proj::Down => (h, i),
        }
    }

    fn is_attention(self) -> bool {
        matches!(self, Proj::Q | Proj::K | Proj::V | Proj::O)
    }
}

impl<Buf> Layer<Buf> {
    /// The base weight of projection `p`.
    pub(crate) fn proj_mut(&mut self, p: Proj) -> &mut Buf {
        match p {
            Proj::Q => &mut self.wq,
            Proj::K => &mut self.wk,
            Proj::V => &mut self.wv,
            Proj::O => &mut self.wo,
            Proj::Gate => &mut self.w_gate,
            Proj::Up => &mut self.w_up,
            Proj::Down => &mut self.w_down,
        }
    }
}

/// One adapter's tensors (weights or gradients).
pub(crate) struct Adapter<Buf> {
    /// `[rank, in]` `lora_A`.
    pub a: Buf,
    /// `[out, rank]` `lora_B`.
    pub b: Buf,
}

/// The adapters of one decoder layer, indexed by `Proj as usize`; `None` where the
/// projection is not adapted.
pub(crate) type LayerAdapters<Buf> = Vec<Option<Adapter<Buf>>>;

/// Where an adapter sits.
#[derive(Clone, Copy)]
enum Site {
    Layer(usize, Proj),
    Unembed,
}

/// One adapted module: its PEFT prefix, site and base shape.
struct Target {
    prefix: String,
    site: Site,
    n_out: usize,
    n_in: usize,
}

/// Every adapted module, layers first (projections in [`PROJS`] order), then the lm-head.
fn targets(c: &ModelConfig, lora: &LoraConfig) -> Vec<Target> {
    let mut out = Vec::new();
    for l in 0..c.num_hidden_layers {
        for p in PROJS {
            if (p.is_attention() && lora.train_attn) || (!p.is_attention() && lora.train_mlp) {
                let (n_out, n_in) = p.dims(c);
                out.push(Target {
                    prefix: format!("base_model.model.model.layers.{l}.{}", p.module()),
                    site: Site::Layer(l, p),
                    n_out,
                    n_in,
                });
            }
        }
    }
    if lora.train_unembed {
        out.push(Target {
            prefix: "base_model.model.lm_head".into(),
            site: Site::Unembed,
            n_out: c.vocab_size,
            n_in: c.hidden_size,
        });
    }
    out
}

/// Name and shape of every adapter tensor (`lora_A` then `lora_B` per module), in the
/// order [`Transformer::visit_params`] visits them on a LoRA model.
pub fn adapter_specs(c: &ModelConfig, lora: &LoraConfig) -> Vec<(String, Vec<usize>)> {
    let r = lora.rank;
    targets(c, lora)
        .into_iter()
        .flat_map(|t| {
            [
                (format!("{}.lora_A.weight", t.prefix), vec![r, t.n_in]),
                (format!("{}.lora_B.weight", t.prefix), vec![t.n_out, r]),
            ]
        })
        .collect()
}

/// Every adapter of a model (weights or gradients).
pub(crate) struct AdapterSet<Buf> {
    /// Per decoder layer.
    pub layers: Vec<LayerAdapters<Buf>>,
    /// The lm-head's adapter (`train_unembed`).
    pub unembed: Option<Adapter<Buf>>,
}

impl<Buf> AdapterSet<Buf> {
    /// Builds every adapter tensor in [`adapter_specs`] order with `make(name, shape)`.
    fn build(
        c: &ModelConfig,
        lora: &LoraConfig,
        mut make: impl FnMut(&str, &[usize]) -> Result<Buf>,
    ) -> Result<Self> {
        let mut set = AdapterSet {
            layers: (0..c.num_hidden_layers)
                .map(|_| PROJS.iter().map(|_| None).collect())
                .collect(),
            unembed: None,
        };
        let r = lora.rank;
        for t in targets(c, lora) {
            let adapter = Adapter {
                a: make(&format!("{}.lora_A.weight", t.prefix), &[r, t.n_in])?,
                b: make(&format!("{}.lora_B.weight", t.prefix), &[t.n_out, r])?,
            };
            match t.site {
                Site::Layer(l, p) => set.layers[l][p as usize] = Some(adapter),
                Site::Unembed => set.unembed = Some(adapter),
            }
        }
        Ok(set)
    }

    /// Every tensor, in [`adapter_specs`] order.
    fn tensors(&self) -> Vec<&Buf> {
        let adapters = self.layers.iter().flatten().flatten().chain(&self.unembed);
        adapters.flat_map(|a| [&a.a, &a.b]).collect()
    }

    /// Every tensor mutably, in [`adapter_specs`] order.
    fn tensors_mut(&mut self) -> Vec<&mut Buf> {
        let adapters = self
            .layers
            .iter_mut()
            .flatten()
            .flatten()
            .chain(&mut self.unembed);
        adapters.flat_map(|a| [&mut a.a, &mut a.b]).collect()
    }
}

/// Weight gradients the fused backend ops always produce, kept apart and discarded when
/// the base is frozen.
pub(crate) struct FrozenGrads<Buf> {
    /// `[hidden]` (Full) gradient of an RMSNorm weight (layer norms, final norm).
    pub norm: Buf,
    /// `[head_dim]` (Full) gradient of a q/k norm weight (`qk_norm`).
    pub head_norm: Buf,
    /// `[vocab, hidden]` (Full) the lm-head weight's gradient; the unembed adapter's
    /// gradient is projected from it.
    pub lm_head: Buf,
}

/// The gradient state of a LoRA model.
pub(crate) struct LoraGrads<Buf> {
    /// Full gradients of every adapter.
    pub adapters: AdapterSet<Buf>,
    /// Discarded base gradients.
    pub frozen: FrozenGrads<Buf>,
}

/// The adapters of a model.
pub(crate) struct Lora<Buf> {
    /// Ranks, targets, scale.
    pub config: LoraConfig,
    /// Full master weights the optimizer updates.
    params: AdapterSet<Buf>,
    /// Compute copies forwards read (only when `!backend.compute_is_full()`).
    compute: Option<AdapterSet<Buf>>,
    /// Allocated on the first backward; taken out while a backward runs.
    pub grads: Option<LoraGrads<Buf>>,
}

/// Where a backward pass accumulates parameter gradients.
pub(crate) enum GradSink<'a, Buf> {
    /// Every base weight (full-weight training).
    Full(&'a mut Params<Buf>),
    /// Every base weight, one layer at a time: each completed gradient goes to
    /// `receive` and its buffer is reused (ZeRO stage 2).
    Streamed {
        grads: &'a mut StreamedGrads<Buf>,
        receive: &'a mut GradReceiverFn<'a, Buf>,
    },
    /// Only the adapters; the base is frozen.
    Adapters(&'a mut LoraGrads<Buf>),
}

/// Where one layer's backward accumulates parameter gradients.
pub(crate) enum LayerGrad<'a, Buf> {
    /// The layer's base weights.
    Full(&'a mut Layer<Buf>),
    /// The layer's adapters (`weights` are what the forward read).
    Adapters {
        weights: &'a [Option<Adapter<Buf>>],
        grads: &'a mut [Option<Adapter<Buf>>],
        frozen: &'a mut FrozenGrads<Buf>,
    },
}

impl<'a, Buf> GradSink<'a, Buf> {
    /// The destinations of layer `l`'s gradients; `weights` are its adapters.
    pub(crate) fn layer<'s>(
        &'s mut self,
        l: usize,
        weights: Option<&'s [Option<Adapter<Buf>>]>,
    ) -> LayerGrad<'s, Buf> {
        match self {
            GradSink::Full(g) => LayerGrad::Full(&mut g.layers[l]),
            GradSink::Streamed { grads, .. } => LayerGrad::Full(&mut grads.layer),
            GradSink::Adapters(g) => LayerGrad::Adapters {
                weights: weights.unwrap_or(&[]),
                grads: &mut g.adapters.layers[l],
                frozen: &mut g.frozen,
            },
        }
    }

    /// Where the final norm's weight gradient goes.
    pub(crate) fn final_norm(&mut self) -> &mut Buf {
        match self {
            GradSink::Full(g) => &mut g.final_norm,
            GradSink::Streamed { grads, .. } => &mut grads.final_norm,
            GradSink::Adapters(g) => &mut g.frozen.norm,
        }
    }
}

impl<Buf> LayerGrad<'_, Buf> {
    /// Where `input_layernorm`'s (`post == false`) or `post_attention_layernorm`'s
    /// weight gradient goes.
    pub(crate) fn norm(&mut self, post: bool) -> &mut Buf {
        match self {
            LayerGrad::Full(g) => {
                if post {
                    &mut g.post_norm
                } else {
                    &mut g.input_norm
                }
            }
            LayerGrad::Adapters { frozen, .. } => &mut frozen.norm,
        }
    }

    /// Where the q norm's (`key == false`) or k norm's weight gradient goes, when the
    /// model has them (`present`).
    pub(crate) fn head_norm(&mut self, key: bool, present: bool) -> Option<&mut Buf> {
        match self {
            LayerGrad::Full(g) => {
                if key {
                    g.k_norm.as_mut()
                } else {
                    g.q_norm.as_mut()
                }
            }
            LayerGrad::Adapters { frozen, .. } => present.then_some(&mut frozen.head_norm),
        }
    }

    /// The gradients of the q, k, v biases (full-weight training only).
    pub(crate) fn biases(&mut self) -> [Option<&mut Buf>; 3] {
        match self {
            LayerGrad::Full(g) => [g.bq.as_mut(), g.bk.as_mut(), g.bv.as_mut()],
            LayerGrad::Adapters { .. } => [None, None, None],
        }
    }
}

/// Checks `host` holds exactly the tensors of `specs`, with their shapes; errors name
/// the first missing, misshapen or extra tensor.
fn check_adapter_tensors(
    specs: &[(String, Vec<usize>)],
    host: &BTreeMap<String, HostTensor>,
    origin: &str,
) -> Result<()> {
    for (name, shape) in specs {
        match host.get(name) {
            None => {
                return Err(WeightsError::MissingTensor {
                    origin: origin.to_string(),
                    tensor: name.clone(),
                }
                .into())
            }
            Some(t) if &t.shape != shape => {
                return Err(ModelError::Input(format!(
                    "{origin}: adapter `{name}` has shape {:?}; the model needs {shape:?}",
                    t.shape
                )))
            }
            Some(_) => {}
        }
    }
    if let Some(extra) = host.keys().find(|k| !specs.iter().any(|(n, _)| n == *k)) {
        return Err(ModelError::Input(format!(
            "{origin}: tensor `{extra}` is no adapter of this model and LoRA config"
        )));
    }
    Ok(())
}

impl<B: Backend> Transformer<B> {
    /// This model with fresh adapters: A Kaiming-uniform from `config.seed`, B zero, so
    /// it computes exactly what the base computes. Training then updates only the
    /// adapters; gradients of the base are neither computed nor stored.
    pub fn with_lora(self, config: LoraConfig) -> Result<Self> {
        config.validate()?;
        let mut rng = SplitMix::new(config.seed);
        let b = &*self.backend;
        let params = AdapterSet::build(&self.config, &config, |name, shape| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with("lora_A.weight") {
                let bound = 1.0 / (shape[1] as f64).sqrt();
                (0..n)
                    .map(|_| ((2.0 * rng.unit() - 1.0) * bound) as f32)
                    .collect()
            } else {
                vec![0.0; n]
            };
            Ok(b.upload(&data, BufKind::Full)?)
        })?;
        self.attach_lora(config, params)
    }

    /// This model with adapters from host tensors named as in [`adapter_specs`] (for
    /// `config`); errors name the missing, extra or misshapen tensor.
    pub fn with_lora_weights(
        self,
        config: LoraConfig,
        adapters: &BTreeMap<String, HostTensor>,
    ) -> Result<Self> {
        config.validate()?;
        check_adapter_tensors(
            &adapter_specs(&self.config, &config),
            adapters,
            "<adapters>",
        )?;
        let b = &*self.backend;
        let params = AdapterSet::build(&self.config, &config, |name, _| {
            Ok(b.upload(&adapters[name].data, BufKind::Full)?)
        })?;
        self.attach_lora(config, params)
    }

    fn attach_lora(mut self, config: LoraConfig, params: AdapterSet<B::Buf>) -> Result<Self> {
        if self.tensor_parallel.is_some() {
            return Err(ModelError::Input(
                "LoRA adapters on a tensor-parallel model are not supported yet".into(),
            ));
        }
        let b = &*self.backend;
        let compute = if b.compute_is_full() {
            None
        } else {
            let masters = params.tensors();
            let mut at = 0;
            Some(AdapterSet::build(&self.config, &config, |_, shape| {
                let mut buf = b.zeros(shape.iter().product(), BufKind::Compute)?;
                b.copy(&mut buf, masters[at])?;
                at += 1;
                Ok(buf)
            })?)
        };
        self.lora = Some(Lora {
            config,
            params,
            compute,
            grads: None,
        });
        // The base is frozen from now on: its gradients would only take memory.
        self.drop_base_grads();
        Ok(self)
    }

    /// The adapters' settings, when this is a LoRA model.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref().map(|l| &l.config)
    }

    /// Name and shape of every trained tensor: the adapters of a LoRA model, else every
    /// weight ([`crate::weights::tensor_specs`]).
    pub fn trainable_specs(&self) -> Vec<(String, Vec<usize>)> {
        match &self.lora {
            Some(lora) => adapter_specs(&self.config, &lora.config),
            None => weights::tensor_specs(&self.config),
        }
    }

    /// Every adapter as a host tensor named as in [`adapter_specs`]; an error on a model
    /// without adapters.
    pub fn adapters_to_host(&self) -> Result<BTreeMap<String, HostTensor>> {
        let lora = self.lora_or_err("adapters_to_host")?;
        let b = &*self.backend;
        adapter_specs(&self.config, &lora.config)
            .into_iter()
            .zip(lora.params.tensors())
            .map(|((name, shape), buf)| {
                Ok((
                    name,
                    HostTensor {
                        shape,
                        data: b.download(buf)?,
                    },
                ))
            })
            .collect()
    }

    /// The model as a plain Hugging Face one, adapters folded in (`W + s·B·A`): its
    /// config and weights named as in [`crate::weights::tensor_specs`] for that config.
    /// Equals the config and [`Transformer::to_host_weights`] on a model without
    /// adapters. A tied model with an unembed adapter comes back untied (its merged
    /// lm-head differs from the input embedding, which stays as is).
    pub fn merged_host_weights(&self) -> Result<(ModelConfig, BTreeMap<String, HostTensor>)> {
        let mut host = self.to_host_weights()?;
        let mut config = self.config.clone();
        let Some(lora) = &self.lora else {
            return Ok((config, host));
        };
        let b = &*self.backend;
        let (s, r) = (lora.config.scale(), lora.config.rank);
        for t in targets(&self.config, &lora.config) {
            let (adapter, base_name) = match t.site {
                Site::Layer(l, p) => {
                    let name = format!("model.layers.{l}.{}.weight", p.module());
                    (&lora.params.layers[l][p as usize], name)
                }
                Site::Unembed => (&lora.params.unembed, "lm_head.weight".to_string()),
            };
            let adapter = adapter.as_ref().expect("targets lists only built adapters");
            // A tied lm-head starts from the embedding.
            let source = match (t.site, config.tie_word_embeddings) {
                (Site::Unembed, true) => "model.embed_tokens.weight",
                _ => base_name.as_str(),
            };
            let mut merged = b.upload(&host[source].data, BufKind::Full)?;
            let mut scaled_b = b.zeros(t.n_out * r, BufKind::Full)?;
            b.copy(&mut scaled_b, &adapter.b)?;
            b.scale(&mut scaled_b, s)?;
            let dims = Matmul {
                m: t.n_out,
                n: t.n_in,
                k: r,
                trans_a: false,
                trans_b: false,
            };
            b.matmul(&mut merged, &scaled_b, &adapter.a, dims, true)?;
            let data = b.download(&merged)?;
            let shape = vec![t.n_out, t.n_in];
            host.insert(base_name, HostTensor { shape, data });
        }
        if lora.config.train_unembed {
            config.tie_word_embeddings = false;
        }
        Ok((config, host))
    }

    fn lora_or_err(&self, what: &str) -> Result<&Lora<B::Buf>> {
        self.lora.as_ref().ok_or_else(|| {
            ModelError::Input(format!(
                "{what}: the model has no LoRA adapters (build it with with_lora)"
            ))
        })
    }

    /// The adapters of layer `l` as forwards read them, on a LoRA model.
    pub(crate) fn layer_adapters(&self, l: usize) -> Option<&[Option<Adapter<B::Buf>>]> {
        let lora = self.lora.as_ref()?;
        let set = lora.compute.as_ref().unwrap_or(&lora.params);
        Some(&set.layers[l])
    }

    /// The lm-head adapter as forwards read it, when there is one.
    fn unembed_adapter(&self) -> Option<&Adapter<B::Buf>> {
        let lora = self.lora.as_ref()?;
        let set = lora.compute.as_ref().unwrap_or(&lora.params);
        set.unembed.as_ref()
    }

    /// `y += s·(x·Aᵀ)·Bᵀ` for `x: [rows, n_in]`, `y: [rows, n_out]`; `x·Aᵀ` goes to
    /// `low_rank` (`[rows, rank]`) when given, else to a fresh buffer.
    fn lora_forward(
        &self,
        y: &mut B::Buf,
        x: &B::Buf,
        adapter: &Adapter<B::Buf>,
        rows: usize,
        (n_out, n_in): (usize, usize),
        low_rank: Option<&mut B::Buf>,
    ) -> Result<()> {
        let b = &*self.backend;
        let lora = self.lora.as_ref().expect("adapters exist on a LoRA model");
        let r = lora.config.rank;
        let mut fresh = None;
        let u = match low_rank {
            Some(u) => u,
            None => fresh.insert(b.zeros(rows * r, BufKind::Compute)?),
        };
        self.linear(u, x, &adapter.a, rows, r, n_in, false)?;
        b.scale(u, lora.config.scale())?;
        self.linear(y, u, &adapter.b, rows, n_out, r, true)
    }

    /// Adds projection `p`'s low-rank term to its output `y` when `adapters` (one
    /// layer's) adapt it, through `low_rank` when given (see [`Self::lora_forward`]); a
    /// no-op otherwise.
    pub(crate) fn adapt(
        &self,
        y: &mut B::Buf,
        x: &B::Buf,
        adapters: Option<&[Option<Adapter<B::Buf>>]>,
        p: Proj,
        rows: usize,
        low_rank: Option<&mut B::Buf>,
    ) -> Result<()> {
        match adapters.and_then(|a| a[p as usize].as_ref()) {
            Some(adapter) => self.lora_forward(y, x, adapter, rows, p.dims(&self.config), low_rank),
            None => Ok(()),
        }
    }

    /// Adds the unembed adapter's term to `logits: [rows, vocab]` of `hidden` (cached
    /// decoding); a no-op without one.
    pub(crate) fn adapt_logits(
        &self,
        logits: &mut B::Buf,
        hidden: &B::Buf,
        rows: usize,
    ) -> Result<()> {
        match self.unembed_adapter() {
            Some(adapter) => {
                let dims = (self.config.vocab_size, self.config.hidden_size);
                self.lora_forward(logits, hidden, adapter, rows, dims, None)
            }
            None => Ok(()),
        }
    }

    /// `W + s·B·A` for the fused lm-head ops when there is an unembed adapter (a
    /// temporary of the one matrix; see the module docs), else `None`: use `base`.
    pub(crate) fn merged_unembed(&self, base: &B::Buf) -> Result<Option<B::Buf>> {
        let Some(adapter) = self.unembed_adapter() else {
            return Ok(None);
        };
        let b = &*self.backend;
        let c = &self.config;
        let lora = self
            .lora
            .as_ref()
            .expect("an unembed adapter belongs to a LoRA model");
        let (vocab, h, r) = (c.vocab_size, c.hidden_size, lora.config.rank);
        let mut merged = b.zeros(vocab * h, BufKind::Compute)?;
        b.copy(&mut merged, base)?;
        let mut scaled_b = b.zeros(vocab * r, BufKind::Compute)?;
        b.copy(&mut scaled_b, &adapter.b)?;
        b.scale(&mut scaled_b, lora.config.scale())?;
        let dims = Matmul {
            m: vocab,
            n: h,
            k: r,
            trans_a: false,
            trans_b: false,
        };
        b.matmul(&mut merged, &scaled_b, &adapter.a, dims, true)?;
        Ok(Some(merged))
    }

    /// Backward of projection `p` (`y = x·wᵀ` plus its adapter, if any): `dx (+)= dy·w`
    /// plus the adapter's part, and the gradient of `w` (full training) or of the
    /// adapter (LoRA) accumulates into `g`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn proj_backward(
        &self,
        dx: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        w: &B::Buf,
        g: &mut LayerGrad<'_, B::Buf>,
        p: Proj,
        rows: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (n_out, n_in) = p.dims(&self.config);
        self.linear_dx(dx, dy, w, rows, n_out, n_in, accumulate)?;
        match g {
            LayerGrad::Full(layer) => {
                self.linear_dw(layer.proj_mut(p), dy, x, rows, n_out, n_in)?
            }
            LayerGrad::Adapters { weights, grads, .. } => {
                let i = p as usize;
                if let (Some(a), Some(ga)) = (
                    weights.get(i).and_then(Option::as_ref),
                    grads.get_mut(i).and_then(Option::as_mut),
                ) {
                    self.lora_backward(dx, dy, x, a, ga, rows, (n_out, n_in))?;
                }
            }
        }
        Ok(())
    }

    /// Adapter part of a projection's backward: `dB += dyᵀ·(s·x·Aᵀ)`,
    /// `dA += (s·dy·B)ᵀ·x`, `dx += (s·dy·B)·A`.
    #[allow(clippy::too_many_arguments)]
    fn lora_backward(
        &self,
        dx: &mut B::Buf,
        dy: &B::Buf,
        x: &B::Buf,
        adapter: &Adapter<B::Buf>,
        grad: &mut Adapter<B::Buf>,
        rows: usize,
        (n_out, n_in): (usize, usize),
    ) -> Result<()> {
        let b = &*self.backend;
        let lora = self.lora.as_ref().expect("adapters exist on a LoRA model");
        let (r, s) = (lora.config.rank, lora.config.scale());
        let mut u = b.zeros(rows * r, BufKind::Compute)?;
        self.linear(&mut u, x, &adapter.a, rows, r, n_in, false)?;
        b.scale(&mut u, s)?;
        self.linear_dw(&mut grad.b, dy, &u, rows, n_out, r)?;
        // v = s·dy·B reuses u's buffer.
        self.linear_dx(&mut u, dy, &adapter.b, rows, n_out, r, false)?;
        b.scale(&mut u, s)?;
        self.linear_dw(&mut grad.a, &u, x, rows, r, n_in)?;
        self.linear_dx(dx, &u, &adapter.a, rows, r, n_in, true)
    }

    /// Projects the lm-head weight gradient `G` (in `g.frozen.lm_head`, consumed) onto
    /// the unembed adapter: `dB += s·G·Aᵀ`, `dA += s·Bᵀ·G`. A no-op without one.
    pub(crate) fn unembed_backward(&self, g: &mut LoraGrads<B::Buf>) -> Result<()> {
        let (Some(lora), Some(grad)) = (&self.lora, g.adapters.unembed.as_mut()) else {
            return Ok(());
        };
        let adapter = lora
            .params
            .unembed
            .as_ref()
            .expect("an unembed gradient has its adapter");
        let b = &*self.backend;
        let c = &self.config;
        let (vocab, h, r) = (c.vocab_size, c.hidden_size, lora.config.rank);
        // The Full masters: G is Full, and products read operands of one kind.
        let lm = &mut g.frozen.lm_head;
        b.scale(lm, lora.config.scale())?;
        let db = Matmul {
            m: vocab,
            n: r,
            k: h,
            trans_a: false,
            trans_b: true,
        };
        b.matmul(&mut grad.b, lm, &adapter.a, db, true)?;
        let da = Matmul {
            m: r,
            n: h,
            k: vocab,
            trans_a: true,
            trans_b: false,
        };
        b.matmul(&mut grad.a, &adapter.b, lm, da, true)?;
        Ok(())
    }

    /// The gradient state of a LoRA model, allocated (zero) on first use.
    pub(crate) fn take_lora_grads(&mut self) -> Result<LoraGrads<B::Buf>> {
        let b = &*self.backend;
        let c = &self.config;
        let lora = self.lora.as_mut().expect("called on a LoRA model");
        if let Some(g) = lora.grads.take() {
            return Ok(g);
        }
        let full = |n: usize| b.zeros(n, BufKind::Full);
        Ok(LoraGrads {
            adapters: AdapterSet::build(c, &lora.config, |_, shape| {
                Ok(full(shape.iter().product())?)
            })?,
            frozen: FrozenGrads {
                norm: full(c.hidden_size)?,
                head_norm: full(c.head_dim)?,
                lm_head: full(c.vocab_size * c.hidden_size)?,
            },
        })
    }

    /// Zeroes the adapters' gradients (LoRA models).
    pub(crate) fn zero_lora_grads(&mut self) -> Result<()> {
        if let Some(g) = self.lora.as_mut().and_then(|l| l.grads.as_mut()) {
            for buf in g.adapters.tensors_mut() {
                self.backend.fill_zero(buf)?;
            }
        }
        Ok(())
    }

    /// `Σ g²` over the adapters' gradients (0 before the first backward).
    pub(crate) fn lora_grad_sum_squares(&self) -> Result<f64> {
        let mut sum = 0.0;
        if let Some(g) = self.lora.as_ref().and_then(|l| l.grads.as_ref()) {
            for buf in g.adapters.tensors() {
                sum += self.backend.sum_squares(buf)?;
            }
        }
        Ok(sum)
    }

    /// [`Transformer::visit_params`] on a LoRA model: the adapters only.
    pub(crate) fn visit_adapters(
        &mut self,
        f: &mut dyn FnMut(&str, crate::transformer::ParamSlot<'_, B>) -> Result<()>,
    ) -> Result<()> {
        if self.lora.as_ref().is_some_and(|l| l.grads.is_none()) {
            let grads = self.take_lora_grads()?;
            self.lora.as_mut().expect("LoRA model").grads = Some(grads);
        }
        let lora = self.lora.as_mut().expect("called on a LoRA model");
        let specs = adapter_specs(&self.config, &lora.config);
        let grads = lora
            .grads
            .as_mut()
            .expect("allocated above")
            .adapters
            .tensors_mut();
        let mut computes = lora.compute.as_mut().map(|c| c.tensors_mut().into_iter());
        for (((name, _), param), grad) in specs.iter().zip(lora.params.tensors_mut()).zip(grads) {
            let compute = computes.as_mut().and_then(|c| c.next());
            f(
                name,
                crate::transformer::ParamSlot {
                    param,
                    grad,
                    compute,
                },
            )?;
        }
        Ok(())
    }

    /// The adapters' gradients as host tensors named as in [`adapter_specs`] (zeros
    /// before the first backward).
    pub(crate) fn lora_grads_to_host(&self) -> Result<BTreeMap<String, HostTensor>> {
        let lora = self.lora_or_err("grads_to_host")?;
        let specs = adapter_specs(&self.config, &lora.config);
        match &lora.grads {
            None => Ok(specs
                .into_iter()
                .map(|(name, shape)| (name, HostTensor::zeros(shape)))
                .collect()),
            Some(g) => specs
                .into_iter()
                .zip(g.adapters.tensors())
                .map(|((name, shape), buf)| {
                    let data = self.backend.download(buf)?;
                    Ok((name, HostTensor { shape, data }))
                })
                .collect(),
        }
    }
}

/// The `adapter_config.json` PEFT reads, with floe's seed kept beside.
#[derive(Serialize, Deserialize)]
struct PeftAdapterConfig {
    peft_type: String,
    task_type: String,
    r: usize,
    lora_alpha: f32,
    lora_dropout: f32,
    bias: String,
    fan_in_fan_out: bool,
    target_modules: Vec<String>,
    #[serde(default)]
    base_model_name_or_path: Option<String>,
    /// floe: the seed A was drawn from.
    #[serde(default)]
    floe_seed: u64,
}

fn target_modules(lora: &LoraConfig) -> Vec<String> {
    let mut out = Vec::new();
    for p in PROJS {
        if (p.is_attention() && lora.train_attn) || (!p.is_attention() && lora.train_mlp) {
            let module = p.module();
            out.push(module[module.find('.').map_or(0, |i| i + 1)..].to_string());
        }
    }
    if lora.train_unembed {
        out.push("lm_head".into());
    }
    out
}

/// Writes `adapters` (named as in [`adapter_specs`]) into `dir` as PEFT's
/// `adapter_model.safetensors` (f32) and `adapter_config.json`.
pub fn save_adapter_dir(
    dir: &Path,
    lora: &LoraConfig,
    base_model: Option<&str>,
    adapters: &BTreeMap<String, HostTensor>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| WeightsError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    weights::save_tensors(dir.join(ADAPTER_WEIGHTS_FILE), adapters)?;
    let config = PeftAdapterConfig {
        peft_type: "LORA".into(),
        task_type: "CAUSAL_LM".into(),
        r: lora.rank,
        lora_alpha: lora.alpha,
        lora_dropout: 0.0,
        bias: "none".into(),
        fan_in_fan_out: false,
        target_modules: target_modules(lora),
        base_model_name_or_path: base_model.map(str::to_string),
        floe_seed: lora.seed,
    };
    let text = serde_json::to_vec_pretty(&config).expect("adapter config serializes");
    let path = dir.join(ADAPTER_CONFIG_FILE);
    std::fs::write(&path, text).map_err(|source| WeightsError::Io { path, source })?;
    Ok(())
}

/// Reads an adapter folder written by [`save_adapter_dir`] (or by PEFT, for the
/// targets floe adapts): its settings and tensors.
pub fn load_adapter_dir(dir: &Path) -> Result<(LoraConfig, BTreeMap<String, HostTensor>)> {
    let lora = read_adapter_config(dir)?;
    let tensors = weights::load_tensors(dir.join(ADAPTER_WEIGHTS_FILE))?;
    Ok((lora, tensors))
}

/// The settings in an adapter folder's `adapter_config.json`.
pub fn read_adapter_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|source| WeightsError::Io {
        path: path.clone(),
        source,
    })?;
    let peft: PeftAdapterConfig = serde_json::from_slice(&text)
        .map_err(|e| ModelError::Input(format!("{}: {e}", path.display())))?;
    if peft.peft_type != "LORA" {
        return Err(ModelError::Input(format!(
            "{}: peft_type {:?} is not LORA",
            path.display(),
            peft.peft_type
        )));
    }
    let has = |m: &str| peft.target_modules.iter().any(|t| t == m);
    let attn = ["q_proj", "k_proj", "v_proj", "o_proj"];
    let mlp = ["gate_proj", "up_proj", "down_proj"];
    let all_or_none = |group: &[&str], what: &str| -> Result<bool> {
        let n = group.iter().filter(|m| has(m)).count();
        if n != 0 && n != group.len() {
            return Err(ModelError::Input(format!(
                "{}: target_modules adapt only some {what} projections; floe adapts all or none of {group:?}",
                path.display()
            )));
        }
        Ok(n == group.len())
    };
    let lora = LoraConfig {
        rank: peft.r,
        alpha: peft.lora_alpha,
        train_attn: all_or_none(&attn, "attention")?,
        train_mlp: all_or_none(&mlp, "MLP")?,
        train_unembed: has("lm_head"),
        seed: peft.floe_seed,
    };
    lora.validate()?;
    Ok(lora)
}
