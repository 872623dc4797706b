//! KL estimators between the policy and a frozen reference, and the KL-in-reward placement.
//!
//! With `Δ = logπ − logπ_ref` per token: `k1 = Δ`, `abs = |Δ|`, `k2 = ½Δ²`,
//! `k3 = e^{−Δ'} + Δ' − 1` with `Δ' = clamp(Δ, ±20)` and the value clamped to ±10.
//! The KL *loss* lives in [`crate::compute_policy_loss`]; here are the per-token values and
//! their derivatives with respect to `logπ`.

use serde::{Deserialize, Serialize};

use crate::advantage::sequences;
use crate::config::{AlgorithmConfig, KlControllerKind};

/// The per-token KL estimator, by its SkyRL name (verl's names are accepted as aliases).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// `Δ`: unbiased, high variance, can be negative.
    #[serde(alias = "kl")]
    K1,
    /// `|Δ|`.
    Abs,
    /// `½Δ²`.
    #[serde(alias = "mse")]
    K2,
    /// `e^{−Δ} + Δ − 1`: non-negative, low variance.
    #[serde(alias = "low_var_kl")]
    K3,
}

/// Clamp of `Δ` inside k3, and of every log-ratio before `exp`.
pub const LOG_RATIO_CLAMP: f64 = 20.0;
/// Clamp of the k3 value.
const K3_VALUE_CLAMP: f64 = 10.0;

impl KlEstimator {
    /// The estimate for one token and its derivative with respect to `logprob`.
    /// Where a clamp is active the derivative is 0, as autograd through `clamp` gives.
    pub fn value_and_grad(self, logprob: f64, ref_logprob: f64) -> (f64, f64) {
        let delta = logprob - ref_logprob;
        match self {
            KlEstimator::K1 => (delta, 1.0),
            KlEstimator::Abs => (delta.abs(), delta.signum() * f64::from(delta != 0.0)),
            KlEstimator::K2 => (0.5 * delta * delta, delta),
            KlEstimator::K3 => {
                let clamped = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
                let value = (-clamped).exp() + clamped - 1.0;
                let grad = if clamped != delta || value.abs() > K3_VALUE_CLAMP {
                    0.0
                } else {
                    1.0 - (-clamped).exp()
                };
                (value.clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP), grad)
            }
        }
    }
}

/// Per-token KL; masked positions are set to 0 (not multiplied, so a NaN cannot leak).
pub fn kl_per_token(
    estimator: KlEstimator,
    logprobs: &[f64],
    ref_logprobs: &[f64],
    mask: &[f64],
) -> Vec<f64> {
    assert_eq!(logprobs.len(), ref_logprobs.len(), "ref_logprobs length");
    assert_eq!(logprobs.len(), mask.len(), "mask length");
    logprobs
        .iter()
        .zip(ref_logprobs)
        .zip(mask)
        .map(|((&lp, &rp), &m)| {
            if m == 0.0 {
                0.0
            } else {
                estimator.value_and_grad(lp, rp).0
            }
        })
        .collect()
}

/// Result of folding the KL into the rewards.
#[derive(Clone, Debug, PartialEq)]
pub struct KlInReward {
    /// `r_t − β·kl_t` per token.
    pub token_rewards: Vec<f64>,
    /// Mean over sequences of each sequence's masked token-mean KL (`loss/avg_kl`); the
    /// adaptive controller's input.
    pub avg_kl: f64,
    /// Mean over sequences of each sequence's largest masked KL (`loss/avg_kl_max`).
    pub avg_kl_max: f64,
}

/// KL in the reward: `r_t ← r_t − β·kl_t` on response tokens, with `kl_t` between the
/// policy that sampled (its recomputed log-probs) and the reference.
pub fn apply_kl_in_reward(
    estimator: KlEstimator,
    beta: f64,
    token_rewards: &[f64],
    logprobs: &[f64],
    ref_logprobs: &[f64],
    response_mask: &[f64],
    seq_lens: &[usize],
) -> KlInReward {
    let kl_t = kl_per_token(estimator, logprobs, ref_logprobs, response_mask);
    let rewards: Vec<f64> = token_rewards
        .iter()
        .zip(&kl_t)
        .map(|(r, kl)| r - beta * kl)
        .collect();
    let (mut sum_mean, mut sum_max) = (0.0, 0.0);
    for range in sequences(seq_lens) {
        let count: f64 = response_mask[range.clone()].iter().sum();
        if count > 0.0 {
            sum_mean += range
                .clone()
                .map(|t| kl_t[t] * response_mask[t])
                .sum::<f64>()
                / count;
            sum_max += range
                .filter(|&t| response_mask[t] != 0.0)
                .map(|t| kl_t[t])
                .fold(f64::NEG_INFINITY, f64::max);
        }
    }
    let n = seq_lens.len().max(1) as f64;
    KlInReward {
        token_rewards: rewards,
        avg_kl: sum_mean / n,
        avg_kl_max: sum_max / n,
    }
}

/// β for KL in the reward: fixed at `kl_loss_coef`, or adapted toward `kl_ctrl.kl_target`.
#[derive(Clone, Debug, PartialEq)]
pub struct KlController {
    /// The current β.
    pub coef: f64,
    kind: KlControllerKind,
    target: f64,
    horizon: f64,
}

impl KlController {
    /// Starts at `kl_loss_coef`.
    pub fn new(config: &AlgorithmConfig) -> Self {
        Self {
            coef: config.kl_loss_coef,
            kind: config.kl_ctrl.kind,
            target: config.kl_ctrl.kl_target,
            horizon: config.kl_ctrl.horizon,
        }
    }

    /// After a step that observed `current_kl` over `num_samples` samples, the adaptive
    /// controller sets `β ← β·(1 + clip(KL/target − 1, ±0.2)·num_samples/horizon)`.
    pub fn update(&mut self, current_kl: f64, num_samples: usize) {
        if self.kind == KlControllerKind::Adaptive {
            let error = (current_kl / self.target - 1.0).clamp(-0.2, 0.2);
            self.coef *= 1.0 + error * num_samples as f64 / self.horizon;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KlControllerConfig;

    #[test]
    fn estimators_on_hand_computed_values() {
        // Δ = ln 2 − 0 ≈ 0.693147.
        let lp = 2.0f64.ln();
        assert_eq!(KlEstimator::K1.value_and_grad(lp, 0.0), (lp, 1.0));
        assert_eq!(KlEstimator::Abs.value_and_grad(-lp, 0.0), (lp, -1.0));
        assert_eq!(KlEstimator::K2.value_and_grad(lp, 0.0), (0.5 * lp * lp, lp));
        // k3 = e^{−ln 2} + ln 2 − 1 = 0.5 + ln 2 − 1; grad = 1 − 0.5.
        let (v, g) = KlEstimator::K3.value_and_grad(lp, 0.0);
        assert!((v - (lp - 0.5)).abs() < 1e-15);
        assert!((g - 0.5).abs() < 1e-15);
    }

    #[test]
    fn k3_clamps_value_and_zeroes_gradient() {
        // Δ = −30 → Δ' = −20, e^{20} − 21 is far above 10.
        assert_eq!(KlEstimator::K3.value_and_grad(-30.0, 0.0), (10.0, 0.0));
    }

    #[test]
    fn gradients_match_finite_differences() {
        let h = 1e-6;
        for est in [
            KlEstimator::K1,
            KlEstimator::Abs,
            KlEstimator::K2,
            KlEstimator::K3,
        ] {
            for (lp, rp) in [(-1.3, -0.9), (-0.2, -1.7), (-2.0, -2.5)] {
                let (_, g) = est.value_and_grad(lp, rp);
                let fd = (est.value_and_grad(lp + h, rp).0 - est.value_and_grad(lp - h, rp).0)
                    / (2.0 * h);
                assert!((g - fd).abs() < 1e-6, "{est:?} at {lp},{rp}: {g} vs {fd}");
            }
        }
    }

    #[test]
    fn estimator_names_and_verl_aliases() {
        for (name, est) in [
            ("k1", KlEstimator::K1),
            ("kl", KlEstimator::K1),
            ("abs", KlEstimator::Abs),
            ("k2", KlEstimator::K2),
            ("mse", KlEstimator::K2),
            ("k3", KlEstimator::K3),
            ("low_var_kl", KlEstimator::K3),
        ] {
            let parsed: KlEstimator = serde_json::from_str(&format!("\"{name}\"")).unwrap();
            assert_eq!(parsed, est, "{name}");
        }
    }

    #[test]
    fn masked_kl_is_zero_even_for_nan() {
        let kl = kl_per_token(
            KlEstimator::K3,
            &[f64::NAN, -1.0],
            &[0.0, -1.0],
            &[0.0, 1.0],
        );
        assert_eq!(kl, vec![0.0, 0.0]);
    }

    #[test]
    fn kl_in_reward_subtracts_beta_kl() {
        // Seq 0: Δ = 1, 0 (k1); seq 1: Δ = 2 then a padded token.
        let out = apply_kl_in_reward(
            KlEstimator::K1,
            0.1,
            &[0.0, 1.0, 0.5, 0.0],
            &[-1.0, -2.0, -1.0, -9.0],
            &[-2.0, -2.0, -3.0, 0.0],
            &[1.0, 1.0, 1.0, 0.0],
            &[2, 2],
        );
        assert_eq!(out.token_rewards, vec![-0.1, 1.0, 0.5 - 0.2, 0.0]);
        assert!((out.avg_kl - (0.5 + 2.0) / 2.0).abs() < 1e-15);
        assert!((out.avg_kl_max - (1.0 + 2.0) / 2.0).abs() < 1e-15);
    }

    #[test]
    fn adaptive_controller_moves_beta_toward_target() {
        let config = AlgorithmConfig {
            kl_ctrl: KlControllerConfig {
                kind: KlControllerKind::Adaptive,
                kl_target: 0.1,
                horizon: 100.0,
            },
            ..AlgorithmConfig::default()
        };
        let mut ctl = KlController::new(&config);
        // KL 0.5 ≫ target: error clips to +0.2; β ← 0.001·(1 + 0.2·10/100).
        ctl.update(0.5, 10);
        assert!((ctl.coef - 0.001 * 1.02).abs() < 1e-15);
        let mut fixed = KlController::new(&AlgorithmConfig::default());
        fixed.update(0.5, 10);
        assert_eq!(fixed.coef, 0.001);
    }
}
