//! Policy surrogates: per-token losses of the log-probs and their exact gradients.
//!
//! Shared definition: `r_t = exp(clamp(logπ_t − logπ_old,t, ±20))`; where the clamp is
//! active the ratio is constant, so its gradient is 0. Each surrogate is evaluated with
//! per-token weights `w_t` (reduction × off-policy correction) and returns
//! `L = Σ_t w_t·ℓ_t` with `dL/dlogπ_t`; a token with `w_t = 0` contributes exactly 0, even
//! if its inputs are NaN.

use serde::{Deserialize, Serialize};

use crate::advantage::sequences;
use crate::config::AlgorithmConfig;
use crate::kl::LOG_RATIO_CLAMP;

/// The per-token surrogate, by its SkyRL `policy_loss_type` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLoss {
    /// PPO clip: `ℓ = −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)`.
    Regular,
    /// PPO clip, and for `A < 0` additionally `ℓ ← min(ℓ, −c·A)`.
    DualClip,
    /// PPO clip on the sequence ratio `s_i = exp(mean_t (logπ − logπ_old))` over the
    /// sequence's valid tokens. The gradient is that of the sequence ratio itself, which
    /// equals GSPO-token's when the advantage is constant over the sequence.
    Gspo,
    /// `ℓ = −A·sg(clip(r, lo, hi))·logπ`: a clipped, stop-gradient importance weight on
    /// REINFORCE, so clipped tokens still get a gradient.
    Cispo,
    /// `ℓ = −r·A`, unclipped.
    ImportanceSampling,
    /// `ℓ = −logπ` (SFT); advantages and old log-probs are ignored.
    CrossEntropy,
}

/// Absolute bounds on the ratio, and the dual-clip constant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SurrogateParams {
    /// Lower bound of the clipped ratio (`1 − ε_low`).
    pub ratio_low: f64,
    /// Upper bound of the clipped ratio (`1 + ε_high`).
    pub ratio_high: f64,
    /// Dual-clip `c`; used by [`PolicyLoss::DualClip`] only.
    pub clip_ratio_c: f64,
}

impl SurrogateParams {
    /// The bounds `config.policy_loss_type` uses (CISPO has its own).
    pub fn from_config(config: &AlgorithmConfig) -> Self {
        let (low, high) = match config.policy_loss_type {
            PolicyLoss::Cispo => (
                config.cispo.cispo_eps_clip_low,
                config.cispo.cispo_eps_clip_high,
            ),
            _ => (config.eps_clip_low, config.eps_clip_high),
        };
        Self {
            ratio_low: 1.0 - low,
            ratio_high: 1.0 + high,
            clip_ratio_c: config.clip_ratio_c,
        }
    }
}

/// Per-token inputs of a surrogate; sequences lie end to end, `seq_lens` gives their lengths.
#[derive(Clone, Copy, Debug)]
pub struct SurrogateInputs<'a> {
    /// Tokens per sequence.
    pub seq_lens: &'a [usize],
    /// `logπ_θ` of each token, under the current weights.
    pub logprobs: &'a [f64],
    /// `logπ_old`: the anchor of the ratio.
    pub old_logprobs: &'a [f64],
    /// Per-token advantages.
    pub advantages: &'a [f64],
    /// Tokens that enter GSPO's sequence ratio (the loss mask; Tinker's `sequence_ratio_mask`).
    pub ratio_mask: &'a [f64],
}

/// A surrogate evaluated with weights.
#[derive(Clone, Debug, PartialEq)]
pub struct SurrogateOutput {
    /// `w_t·ℓ_t`; sums to the loss.
    pub loss_t: Vec<f64>,
    /// `dL/dlogπ_t` of `L = Σ_t w_t·ℓ_t`.
    pub dlogprobs_t: Vec<f64>,
    /// The clip bound was the selected term (PPO/GSPO), or the ratio was clipped (CISPO).
    pub clipped_t: Vec<bool>,
    /// Dual clip: the `−c·A` bound was selected.
    pub clipped_lower_t: Vec<bool>,
}

/// Evaluates `loss` over every token with weights `weights_t`.
///
/// # Panics
/// If a slice's length differs from `Σ seq_lens`.
pub fn surrogate_loss(
    loss: PolicyLoss,
    params: &SurrogateParams,
    inputs: &SurrogateInputs,
    weights_t: &[f64],
) -> SurrogateOutput {
    let n: usize = inputs.seq_lens.iter().sum();
    for (name, len) in [
        ("logprobs", inputs.logprobs.len()),
        ("old_logprobs", inputs.old_logprobs.len()),
        ("advantages", inputs.advantages.len()),
        ("ratio_mask", inputs.ratio_mask.len()),
        ("weights", weights_t.len()),
    ] {
        assert_eq!(len, n, "{name} has {len} tokens, seq_lens sum to {n}");
    }
    let mut out = SurrogateOutput {
        loss_t: vec![0.0; n],
        dlogprobs_t: vec![0.0; n],
        clipped_t: vec![false; n],
        clipped_lower_t: vec![false; n],
    };
    match loss {
        PolicyLoss::Gspo => gspo(params, inputs, weights_t, &mut out),
        _ => {
            for (t, &w) in weights_t.iter().enumerate() {
                if w == 0.0 {
                    continue;
                }
                let term = token_term(loss, params, inputs, t);
                out.loss_t[t] = w * term.loss;
                out.dlogprobs_t[t] = w * term.dloss;
                out.clipped_t[t] = term.clipped;
                out.clipped_lower_t[t] = term.clipped_lower;
            }
        }
    }
    out
}

struct TokenTerm {
    loss: f64,
    dloss: f64,
    clipped: bool,
    clipped_lower: bool,
}

/// `(r, dr/dlogπ)` from a log-ratio.
fn ratio(log_ratio: f64) -> (f64, f64) {
    let clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
    let r = clamped.exp();
    (r, if clamped == log_ratio { r } else { 0.0 })
}

/// PPO clip for one token given its ratio: `(ℓ, dℓ/dr, clipped)`.
fn ppo_clip(r: f64, advantage: f64, params: &SurrogateParams) -> (f64, f64, bool) {
    let unclipped = -advantage * r;
    let clipped = -advantage * r.clamp(params.ratio_low, params.ratio_high);
    // The clipped term only wins strictly when r is outside the bounds, where it is
    // constant in r; at r = 1 the two are equal and nothing counts as clipped.
    if clipped > unclipped {
        (clipped, 0.0, true)
    } else {
        (unclipped, -advantage, false)
    }
}

fn token_term(
    loss: PolicyLoss,
    params: &SurrogateParams,
    inputs: &SurrogateInputs,
    t: usize,
) -> TokenTerm {
    let lp = inputs.logprobs[t];
    let a = inputs.advantages[t];
    let (r, dr) = ratio(lp - inputs.old_logprobs[t]);
    let term = |loss, dloss, clipped| TokenTerm {
        loss,
        dloss,
        clipped,
        clipped_lower: false,
    };
    match loss {
        PolicyLoss::Regular => {
            let (l, dl_dr, clipped) = ppo_clip(r, a, params);
            term(l, dl_dr * dr, clipped)
        }
        PolicyLoss::Gspo => unreachable!("gspo couples the tokens of a sequence; see gspo()"),
        PolicyLoss::DualClip => {
            let (l, dl_dr, clipped) = ppo_clip(r, a, params);
            let bound = -params.clip_ratio_c * a;
            if a < 0.0 && l > bound {
                TokenTerm {
                    loss: bound,
                    dloss: 0.0,
                    clipped,
                    clipped_lower: true,
                }
            } else {
                term(l, dl_dr * dr, clipped)
            }
        }
        PolicyLoss::Cispo => {
            let weight = r.clamp(params.ratio_low, params.ratio_high);
            term(-a * weight * lp, -a * weight, weight != r)
        }
        PolicyLoss::ImportanceSampling => term(-a * r, -a * dr, false),
        PolicyLoss::CrossEntropy => term(-lp, -1.0, false),
    }
}

/// GSPO: every valid token of sequence `i` sees `s_i = exp(Σ_u m_u Δ_u / Σ_u m_u)`, so
/// `dL/dlogπ_t = m_t/Σm · ds · Σ_u w_u·∂ℓ_u/∂s`. A sequence with no ratio-mask token has
/// no ratio and contributes nothing.
fn gspo(
    params: &SurrogateParams,
    inputs: &SurrogateInputs,
    weights_t: &[f64],
    out: &mut SurrogateOutput,
) {
    for range in sequences(inputs.seq_lens) {
        let mask = &inputs.ratio_mask[range.clone()];
        let count: f64 = mask.iter().sum();
        if count == 0.0 {
            continue;
        }
        let mean_log_ratio = range
            .clone()
            .filter(|&t| inputs.ratio_mask[t] != 0.0)
            .map(|t| inputs.ratio_mask[t] * (inputs.logprobs[t] - inputs.old_logprobs[t]))
            .sum::<f64>()
            / count;
        let (s, ds) = ratio(mean_log_ratio);
        let mut dloss_ds = 0.0;
        for t in range.clone() {
            if weights_t[t] == 0.0 {
                continue;
            }
            let (l, dl_ds, clipped) = ppo_clip(s, inputs.advantages[t], params);
            out.loss_t[t] = weights_t[t] * l;
            out.clipped_t[t] = clipped;
            dloss_ds += weights_t[t] * dl_ds;
        }
        for t in range {
            if inputs.ratio_mask[t] != 0.0 {
                out.dlogprobs_t[t] = dloss_ds * ds * inputs.ratio_mask[t] / count;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: SurrogateParams = SurrogateParams {
        ratio_low: 0.8,
        ratio_high: 1.2,
        clip_ratio_c: 3.0,
    };

    fn eval(
        loss: PolicyLoss,
        lp: &[f64],
        old: &[f64],
        adv: &[f64],
        seq_lens: &[usize],
    ) -> SurrogateOutput {
        let ones = vec![1.0; lp.len()];
        let inputs = SurrogateInputs {
            seq_lens,
            logprobs: lp,
            old_logprobs: old,
            advantages: adv,
            ratio_mask: &ones,
        };
        surrogate_loss(loss, &PARAMS, &inputs, &ones)
    }

    #[test]
    fn regular_ppo_on_hand_computed_ratios() {
        // r = 1.5 (A>0: clipped at 1.2), r = 0.5 (A>0: unclipped), r = 0.5 (A<0: clipped at 0.8),
        // r = 1.1 (inside).
        let old = [0.0; 4];
        let lp = [1.5f64.ln(), 0.5f64.ln(), 0.5f64.ln(), 1.1f64.ln()];
        let adv = [2.0, 2.0, -1.0, -1.0];
        let out = eval(PolicyLoss::Regular, &lp, &old, &adv, &[4]);
        let expect_loss = [-2.4, -1.0, 0.8, 1.1];
        let expect_grad = [0.0, -1.0, 0.0, 1.1];
        for t in 0..4 {
            assert!((out.loss_t[t] - expect_loss[t]).abs() < 1e-12, "loss {t}");
            assert!(
                (out.dlogprobs_t[t] - expect_grad[t]).abs() < 1e-12,
                "grad {t}"
            );
        }
        assert_eq!(out.clipped_t, vec![true, false, true, false]);
    }

    #[test]
    fn dual_clip_bounds_negative_advantage_loss() {
        // r = 5, A = −1: PPO gives 5, dual clip caps it at c·|A| = 3.
        let out = eval(PolicyLoss::DualClip, &[5.0f64.ln()], &[0.0], &[-1.0], &[1]);
        assert!((out.loss_t[0] - 3.0).abs() < 1e-12);
        assert_eq!(out.dlogprobs_t[0], 0.0);
        assert!(out.clipped_lower_t[0]);
        // r = 2, A = −1: 2 < 3, the PPO term stands.
        let out = eval(PolicyLoss::DualClip, &[2.0f64.ln()], &[0.0], &[-1.0], &[1]);
        assert!((out.loss_t[0] - 2.0).abs() < 1e-12);
        assert!((out.dlogprobs_t[0] - 2.0).abs() < 1e-12);
        assert!(!out.clipped_lower_t[0]);
    }

    #[test]
    fn gspo_uses_the_sequence_ratio() {
        // Log-ratios 0.2 and 0.0 → s = exp(0.1); with A = 1 on both tokens and s inside the
        // bounds, each token's loss is −s and each gradient is 2·(−1)·s/2 = −s.
        let out = eval(
            PolicyLoss::Gspo,
            &[0.2, -1.0],
            &[0.0, -1.0],
            &[1.0, 1.0],
            &[2],
        );
        let s = 0.1f64.exp();
        for t in 0..2 {
            assert!((out.loss_t[t] + s).abs() < 1e-12);
            assert!((out.dlogprobs_t[t] + s).abs() < 1e-12);
        }
    }

    #[test]
    fn cispo_keeps_gradient_through_clipped_tokens() {
        // r = 6 clipped to 5 (bounds [0, 5]); ℓ = −A·5·logπ, dℓ = −A·5.
        let params = SurrogateParams {
            ratio_low: 0.0,
            ratio_high: 5.0,
            clip_ratio_c: 3.0,
        };
        let lp = -1.0;
        let old = lp - 6.0f64.ln();
        let inputs = SurrogateInputs {
            seq_lens: &[1],
            logprobs: &[lp],
            old_logprobs: &[old],
            advantages: &[0.5],
            ratio_mask: &[1.0],
        };
        let out = surrogate_loss(PolicyLoss::Cispo, &params, &inputs, &[1.0]);
        assert!((out.loss_t[0] - 2.5).abs() < 1e-12);
        assert!((out.dlogprobs_t[0] + 2.5).abs() < 1e-12);
        assert!(out.clipped_t[0]);
    }

    #[test]
    fn importance_sampling_and_cross_entropy() {
        let out = eval(
            PolicyLoss::ImportanceSampling,
            &[2.0f64.ln()],
            &[0.0],
            &[3.0],
            &[1],
        );
        assert!((out.loss_t[0] + 6.0).abs() < 1e-12);
        assert!((out.dlogprobs_t[0] + 6.0).abs() < 1e-12);
        let out = eval(PolicyLoss::CrossEntropy, &[-0.7], &[0.0], &[3.0], &[1]);
        assert_eq!((out.loss_t[0], out.dlogprobs_t[0]), (0.7, -1.0));
    }

    #[test]
    fn zero_weight_tokens_contribute_nothing_even_if_nan() {
        let ones = [1.0, 1.0];
        let inputs = SurrogateInputs {
            seq_lens: &[2],
            logprobs: &[f64::NAN, -1.0],
            old_logprobs: &[0.0, -1.0],
            advantages: &[1.0, 1.0],
            ratio_mask: &ones,
        };
        for loss in [
            PolicyLoss::Regular,
            PolicyLoss::Cispo,
            PolicyLoss::CrossEntropy,
        ] {
            let out = surrogate_loss(loss, &PARAMS, &inputs, &[0.0, 1.0]);
            assert_eq!(out.loss_t[0], 0.0);
            assert_eq!(out.dlogprobs_t[0], 0.0);
            assert!(out.loss_t[1].is_finite());
        }
    }

    #[test]
    fn extreme_log_ratio_is_clamped_with_zero_gradient() {
        let out = eval(
            PolicyLoss::ImportanceSampling,
            &[30.0],
            &[0.0],
            &[1.0],
            &[1],
        );
        assert_eq!(out.loss_t[0], -(20.0f64.exp()));
        assert_eq!(out.dlogprobs_t[0], 0.0);
    }

    #[test]
    fn policy_loss_serde_names() {
        for (name, loss) in [
            ("\"regular\"", PolicyLoss::Regular),
            ("\"dual_clip\"", PolicyLoss::DualClip),
            ("\"gspo\"", PolicyLoss::Gspo),
            ("\"cispo\"", PolicyLoss::Cispo),
            ("\"importance_sampling\"", PolicyLoss::ImportanceSampling),
            ("\"cross_entropy\"", PolicyLoss::CrossEntropy),
        ] {
            assert_eq!(serde_json::from_str::<PolicyLoss>(name).unwrap(), loss);
        }
    }
}
