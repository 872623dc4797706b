//! The per-micro-batch loss the trainer differentiates: policy surrogate + KL − entropy bonus.
//!
//! With reduction weights `w_t` ([`token_weights`]), off-policy factors `c_t`, sequence-mean
//! KL weights `v_t = mask_t/(B·n_i)`:
//!
//! `L = Σ_t w_t·c_t·ℓ_t + β_kl·Σ_t v_t·kl_t − β_H·Σ_t w_t·H_t`
//!
//! The KL term is SkyRL's per-sequence token mean averaged over sequences, whatever
//! `loss_reduction` is; the entropy term uses `loss_reduction` like verl's `agg_loss`.
//! All three use mini-batch totals only, so micro-batches sum to the mini-batch.

use std::collections::BTreeMap;

use crate::config::AlgorithmConfig;
use crate::kl::KlEstimator;
use crate::metrics::names;
use crate::off_policy::off_policy_weights;
use crate::policy_loss::{surrogate_loss, PolicyLoss, SurrogateInputs, SurrogateParams};
use crate::reduction::{token_weights, GlobalNorm, LossReduction};

/// One micro-batch: sequences end to end; every per-token slice has length `Σ seq_lens`.
#[derive(Clone, Copy, Debug)]
pub struct LossInputs<'a> {
    /// Response tokens per sequence.
    pub seq_lens: &'a [usize],
    /// Prompt group of each sequence (the GRPO group id); used by `prompt_mean`.
    pub group_ids: &'a [u64],
    /// `logπ_θ` of each response token under the weights being trained.
    pub logprobs: &'a [f64],
    /// `logπ_old`: log-probs recomputed before the first update of this batch.
    pub old_logprobs: &'a [f64],
    /// Per-token advantages (not pre-scaled; the reduction is applied here).
    pub advantages: &'a [f64],
    /// 1 for tokens that train, 0 for padding, observations and filtered sequences.
    pub loss_mask: &'a [f64],
    /// Per-token entropy of the policy; needed when `entropy_coeff != 0`, logged when given.
    pub entropies: Option<&'a [f64]>,
    /// Reference-model log-probs; needed when `use_kl_loss`.
    pub ref_logprobs: Option<&'a [f64]>,
    /// Sampler log-probs; enable the off-policy corrections when given.
    pub rollout_logprobs: Option<&'a [f64]>,
}

/// Loss of one micro-batch and its gradient with respect to the model's per-token outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct LossOutput {
    /// This micro-batch's share of the mini-batch loss.
    pub loss: f64,
    /// `dL/dlogπ_t`.
    pub dlogprobs: Vec<f64>,
    /// `dL/dH_t`.
    pub dentropy: Vec<f64>,
    /// Each token's share of `loss` (sums to it).
    pub elementwise_loss: Vec<f64>,
    /// Diagnostics keyed by [`names`]; combine micro-batches with
    /// [`crate::metrics::reduce_micro_batch_metrics`].
    pub metrics: BTreeMap<String, f64>,
}

/// Loss, per-token gradients and metrics of one micro-batch.
///
/// `norm` holds the totals of the whole mini-batch (one optimizer step), so summing the
/// outputs of its micro-batches gives exactly the outputs of one call on the mini-batch.
///
/// ```
/// use floe_rl::{compute_policy_loss, AlgorithmConfig, GlobalNorm, LossInputs};
///
/// let config = AlgorithmConfig { use_kl_loss: false, ..AlgorithmConfig::default() };
/// // Two sequences of 2 and 1 response tokens; first update, so logπ == logπ_old.
/// let inputs = LossInputs {
///     seq_lens: &[2, 1],
///     group_ids: &[0, 0],
///     logprobs: &[-1.0, -2.0, -0.5],
///     old_logprobs: &[-1.0, -2.0, -0.5],
///     advantages: &[1.0, 1.0, -1.0],
///     loss_mask: &[1.0, 1.0, 1.0],
///     entropies: None,
///     ref_logprobs: None,
///     rollout_logprobs: None,
/// };
/// let norm = GlobalNorm::of_mini_batch(inputs.loss_mask, inputs.seq_lens, inputs.group_ids);
/// let out = compute_policy_loss(&config, &inputs, &norm);
/// // token_mean of −r·A with r = 1: (−1 − 1 + 1)/3; dL/dlogπ_t = −A_t/3.
/// assert!((out.loss + 1.0 / 3.0).abs() < 1e-12);
/// assert!((out.dlogprobs[2] - 1.0 / 3.0).abs() < 1e-12);
/// ```
///
/// # Panics
/// If a slice's length differs from `Σ seq_lens`, if `use_kl_loss` is set without
/// `ref_logprobs`, or `entropy_coeff != 0` without `entropies`, or the config fails
/// [`AlgorithmConfig::validate`] on `max_seq_len`.
pub fn compute_policy_loss(
    config: &AlgorithmConfig,
    inputs: &LossInputs,
    norm: &GlobalNorm,
) -> LossOutput {
    let n: usize = inputs.seq_lens.iter().sum();
    assert_eq!(inputs.loss_mask.len(), n, "loss_mask length");
    let reduction_w_t = token_weights(
        config.loss_reduction,
        inputs.loss_mask,
        inputs.seq_lens,
        inputs.group_ids,
        norm,
        config.max_seq_len,
    );
    let mut metrics = BTreeMap::new();
    let mut weights_t = reduction_w_t.clone();
    if let Some(rollout) = inputs.rollout_logprobs {
        let correction = off_policy_weights(
            &config.off_policy_correction,
            inputs.old_logprobs,
            rollout,
            inputs.loss_mask,
            inputs.seq_lens,
        );
        for (w, c) in weights_t.iter_mut().zip(&correction.factors_t) {
            *w *= c;
        }
        metrics.extend(correction.metrics);
    }
    let surrogate = surrogate_loss(
        config.policy_loss_type,
        &SurrogateParams::from_config(config),
        &SurrogateInputs {
            seq_lens: inputs.seq_lens,
            logprobs: inputs.logprobs,
            old_logprobs: inputs.old_logprobs,
            advantages: inputs.advantages,
            ratio_mask: inputs.loss_mask,
        },
        &weights_t,
    );
    let mut elementwise_loss = surrogate.loss_t;
    let mut dlogprobs = surrogate.dlogprobs_t;
    let pg_loss: f64 = elementwise_loss.iter().sum();
    let mut loss = pg_loss;
    metrics.insert(names::POLICY_PG_LOSS.into(), pg_loss);

    let valid = |t: usize| inputs.loss_mask[t] != 0.0;
    let masked_mean = |values: &dyn Fn(usize) -> f64| {
        let (sum, count) = (0..n)
            .filter(|&t| valid(t))
            .fold((0.0, 0.0), |(s, c), t| (s + values(t), c + 1.0));
        if count == 0.0 {
            0.0
        } else {
            sum / count
        }
    };
    metrics.insert(
        names::POLICY_PPO_KL.into(),
        masked_mean(&|t| inputs.old_logprobs[t] - inputs.logprobs[t]),
    );
    metrics.insert(
        names::POLICY_PPO_LOG_RATIO_ABS_MAX.into(),
        (0..n)
            .filter(|&t| valid(t))
            .map(|t| (inputs.logprobs[t] - inputs.old_logprobs[t]).abs())
            .fold(0.0, f64::max),
    );
    metrics.insert(
        names::POLICY_CLIPFRAC.into(),
        masked_mean(&|t| f64::from(u8::from(surrogate.clipped_t[t]))),
    );
    if config.policy_loss_type == PolicyLoss::DualClip {
        metrics.insert(
            names::POLICY_CLIPFRAC_LOWER.into(),
            masked_mean(&|t| f64::from(u8::from(surrogate.clipped_lower_t[t]))),
        );
    }

    if config.use_kl_loss {
        let ref_logprobs = inputs
            .ref_logprobs
            .expect("use_kl_loss is set but LossInputs.ref_logprobs is None");
        let kl_loss = add_kl_loss(
            config.kl_estimator_type,
            config.kl_loss_coef,
            inputs,
            ref_logprobs,
            norm,
            &mut elementwise_loss,
            &mut dlogprobs,
        );
        loss += config.kl_loss_coef * kl_loss;
        metrics.insert(names::POLICY_KL_LOSS.into(), kl_loss);
    }

    let mut dentropy = vec![0.0; n];
    match inputs.entropies {
        Some(entropies) => {
            assert_eq!(entropies.len(), n, "entropies length");
            metrics.insert(names::POLICY_ENTROPY.into(), masked_mean(&|t| entropies[t]));
            if config.entropy_coeff != 0.0 {
                for t in (0..n).filter(|&t| reduction_w_t[t] != 0.0) {
                    let bonus = config.entropy_coeff * reduction_w_t[t];
                    dentropy[t] = -bonus;
                    elementwise_loss[t] -= bonus * entropies[t];
                    loss -= bonus * entropies[t];
                }
            }
        }
        None => assert!(
            config.entropy_coeff == 0.0,
            "entropy_coeff is {} but LossInputs.entropies is None",
            config.entropy_coeff
        ),
    }
    metrics.insert(names::POLICY_FINAL_LOSS.into(), loss);
    LossOutput {
        loss,
        dlogprobs,
        dentropy,
        elementwise_loss,
        metrics,
    }
}

/// Adds `coef·v_t·kl_t` to the per-token loss and gradient; returns `Σ v_t·kl_t`.
fn add_kl_loss(
    estimator: KlEstimator,
    coef: f64,
    inputs: &LossInputs,
    ref_logprobs: &[f64],
    norm: &GlobalNorm,
    elementwise_loss: &mut [f64],
    dlogprobs: &mut [f64],
) -> f64 {
    assert_eq!(
        ref_logprobs.len(),
        inputs.logprobs.len(),
        "ref_logprobs length"
    );
    let seq_mean_w_t = token_weights(
        LossReduction::SequenceMean,
        inputs.loss_mask,
        inputs.seq_lens,
        inputs.group_ids,
        norm,
        None,
    );
    let mut kl_loss = 0.0;
    for (t, &v) in seq_mean_w_t.iter().enumerate() {
        if v == 0.0 {
            continue;
        }
        let (kl, dkl) = estimator.value_and_grad(inputs.logprobs[t], ref_logprobs[t]);
        kl_loss += v * kl;
        elementwise_loss[t] += coef * v * kl;
        dlogprobs[t] += coef * v * dkl;
    }
    kl_loss
}
