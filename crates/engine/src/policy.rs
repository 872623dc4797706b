//! The policy under training: the transformer, its AdamW moments and the step count.
//!
//! Gradients accumulate across [`Policy::forward_backward`] calls (micro-batches, or
//! chunks sent by a remote driver) until [`Policy::optim_step`], which clips by the
//! global norm, skips a step whose norm is not finite, updates every parameter with
//! AdamW and clears the gradients. The sampler reads the same weights: on the CPU the
//! Full weights are the compute weights, on CUDA AdamW writes the bf16 copy in the same
//! kernel, so handing the new weights to the sampler moves no bytes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use floe_backend::{AdamW, Backend, BufKind};
use floe_model::batch::{PackedBatch, TokenStats};
use floe_model::transformer::Transformer;
use floe_model::weights::{self, HostTensor, SaveDType};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

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

/// AdamW first and second moments of one parameter (Full buffers).
struct Moments<B: Backend> {
    m: B::Buf,
    v: B::Buf,
}

/// The transformer being trained with its optimizer state.
pub struct Policy<B: Backend> {
    model: Transformer<B>,
    /// Keyed by HF tensor name; allocated on the first optimizer step.
    moments: BTreeMap<String, Moments<B>>,
    step: u64,
}

const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const OPTIMIZER_META: &str = "optimizer.json";

#[derive(Serialize, Deserialize)]
struct OptimizerMeta {
    step: u64,
}

impl<B: Backend> Policy<B> {
    /// Wraps a model with fresh optimizer state.
    pub fn new(model: Transformer<B>) -> Self {
        Policy {
            model,
            moments: BTreeMap::new(),
            step: 0,
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

    /// Forward and backward of one micro-batch; gradients add to those already held.
    pub fn forward_backward(
        &mut self,
        batch: &PackedBatch,
        logit_scale: f32,
        loss_grad: &mut dyn FnMut(&TokenStats) -> floe_model::Result<(Vec<f64>, Vec<f64>)>,
    ) -> Result<TokenStats> {
        Ok(self.model.forward_backward(batch, logit_scale, loss_grad)?)
    }

    /// Clips, applies AdamW to every parameter and clears the gradients.
    pub fn optim_step(&mut self, params: &OptimParams) -> Result<StepOutcome> {
        let grad_norm = self.model.grad_norm()?;
        if !grad_norm.is_finite() {
            self.model.zero_grad()?;
            return Ok(StepOutcome {
                grad_norm,
                skipped: true,
                step: self.step,
            });
        }
        let clip = if params.max_grad_norm > 0.0 && grad_norm > params.max_grad_norm as f64 {
            params.max_grad_norm as f64 / (grad_norm + 1e-6)
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
            grad_scale: clip as f32,
        };
        let backend = Arc::clone(self.model.backend());
        let moments = &mut self.moments;
        self.model.visit_params(&mut |name, slot| {
            if !moments.contains_key(name) {
                let len = backend.len(slot.param);
                let state = Moments {
                    m: backend.zeros(len, BufKind::Full)?,
                    v: backend.zeros(len, BufKind::Full)?,
                };
                moments.insert(name.to_string(), state);
            }
            let state = moments.get_mut(name).expect("inserted above");
            backend.adamw(
                slot.param,
                slot.grad,
                &mut state.m,
                &mut state.v,
                slot.compute,
                hp,
            )?;
            Ok(())
        })?;
        self.model.zero_grad()?;
        Ok(StepOutcome {
            grad_norm,
            skipped: false,
            step: self.step,
        })
    }

    /// Writes the weights as an HF folder under `dir/model` and the optimizer state
    /// beside it. Each file is written under a temporary name and renamed.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let host = self.model.to_host_weights()?;
        weights::save_model_dir(
            dir.join("model"),
            self.model.config(),
            &host,
            SaveDType::F32,
        )?;
        let backend = self.model.backend();
        let mut tensors = BTreeMap::new();
        for (name, state) in &self.moments {
            for (suffix, buf) in [("exp_avg", &state.m), ("exp_avg_sq", &state.v)] {
                let data = backend.download(buf)?;
                let shape = vec![data.len()];
                tensors.insert(format!("{name}.{suffix}"), HostTensor { shape, data });
            }
        }
        weights::save_tensors(&dir.join(OPTIMIZER_FILE), &tensors)?;
        let meta = serde_json::to_string(&OptimizerMeta { step: self.step })
            .expect("optimizer meta serializes");
        write_atomically(&dir.join(OPTIMIZER_META), meta.as_bytes())?;
        Ok(())
    }

    /// Restores a policy written by [`Policy::save`].
    pub fn load(backend: Arc<B>, dir: &Path) -> Result<Self> {
        let (config, host) = weights::load_model_dir(dir.join("model"))?;
        let model = Transformer::from_host_weights(Arc::clone(&backend), config, &host)?;
        let meta_path = dir.join(OPTIMIZER_META);
        let meta_text = std::fs::read_to_string(&meta_path).map_err(|source| Error::Io {
            path: meta_path.clone(),
            source,
        })?;
        let meta: OptimizerMeta =
            serde_json::from_str(&meta_text).map_err(|err| Error::Corrupt {
                path: meta_path,
                msg: err.to_string(),
            })?;
        let tensors = weights::load_tensors(&dir.join(OPTIMIZER_FILE))?;
        let mut moments = BTreeMap::new();
        for (key, tensor) in &tensors {
            let Some(name) = key.strip_suffix(".exp_avg") else {
                continue;
            };
            let v_key = format!("{name}.exp_avg_sq");
            let v = tensors.get(&v_key).ok_or_else(|| Error::Corrupt {
                path: dir.join(OPTIMIZER_FILE),
                msg: format!("tensor `{v_key}` is missing"),
            })?;
            moments.insert(
                name.to_string(),
                Moments {
                    m: backend.upload(&tensor.data, BufKind::Full)?,
                    v: backend.upload(&v.data, BufKind::Full)?,
                },
            );
        }
        Ok(Policy {
            model,
            moments,
            step: meta.step,
        })
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash never
/// leaves a half-written file under the final name.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}
