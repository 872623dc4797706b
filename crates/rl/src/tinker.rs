//! Tinker's built-in `forward_backward` losses: plain **sums** over tokens and datums, no
//! averaging and no loss mask beyond the inputs themselves (prompt positions carry zero
//! advantages or weights). Inputs come from the network, so they are checked, not assumed.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::loss::LossOutput;
use crate::policy_loss::{surrogate_loss, PolicyLoss, SurrogateInputs, SurrogateParams};
use crate::RlError;

/// Metric key Tinker clients require (`name:reduction`).
pub const LOSS_SUM_METRIC: &str = "loss:sum";

/// A Tinker `loss_fn` this crate computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TinkerLoss {
    /// `−Σ weights·logp`; weights may be any real (custom losses send −dC/dlogp).
    CrossEntropy,
    /// `−Σ exp(logp − sampling_logp)·A`.
    ImportanceSampling,
    /// `−Σ min(r·A, clip(r, clip_low_threshold, clip_high_threshold)·A)`.
    Ppo,
    /// `−Σ A·sg(clip(r, low, high))·logp`.
    Cispo,
    /// PPO clip on each datum's length-normalised sequence ratio over `sequence_ratio_mask`.
    Gspo,
    /// Direct reward optimisation: `−Σ (logp·A − β/2·(logp − sampling_logp)²)`, a
    /// quadratic penalty instead of a clip keeping the update near the sampler.
    Dro,
}

impl TinkerLoss {
    /// The wire name.
    pub fn name(self) -> &'static str {
        match self {
            TinkerLoss::CrossEntropy => "cross_entropy",
            TinkerLoss::ImportanceSampling => "importance_sampling",
            TinkerLoss::Ppo => "ppo",
            TinkerLoss::Cispo => "cispo",
            TinkerLoss::Gspo => "gspo",
            TinkerLoss::Dro => "dro",
        }
    }
}

impl FromStr for TinkerLoss {
    type Err = RlError;

    fn from_str(name: &str) -> Result<Self, RlError> {
        [
            TinkerLoss::CrossEntropy,
            TinkerLoss::ImportanceSampling,
            TinkerLoss::Ppo,
            TinkerLoss::Cispo,
            TinkerLoss::Gspo,
            TinkerLoss::Dro,
        ]
        .into_iter()
        .find(|l| l.name() == name)
        .ok_or_else(|| {
            RlError::Input(format!(
                "unsupported loss_fn {name:?}; supported: cross_entropy, importance_sampling, ppo, cispo, gspo, dro"
            ))
        })
    }
}

/// `loss_fn_config`: the clipped losses' ratio bounds and `dro`'s penalty.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TinkerLossConfig {
    /// Lower ratio bound (absolute, default 0.8).
    pub clip_low_threshold: f64,
    /// Upper ratio bound (absolute, default 1.2).
    pub clip_high_threshold: f64,
    /// `dro`'s quadratic penalty coefficient (default 0.05, the value Tinker's docs use).
    pub beta: f64,
}

impl Default for TinkerLossConfig {
    fn default() -> Self {
        Self {
            clip_low_threshold: 0.8,
            clip_high_threshold: 1.2,
            beta: 0.05,
        }
    }
}

impl TinkerLossConfig {
    /// Reads the numeric `loss_fn_config` map; unknown keys are an error naming them.
    pub fn from_map(map: &BTreeMap<String, f64>) -> Result<Self, RlError> {
        let mut config = Self::default();
        for (key, &value) in map {
            match key.as_str() {
                "clip_low_threshold" => config.clip_low_threshold = value,
                "clip_high_threshold" => config.clip_high_threshold = value,
                "beta" => config.beta = value,
                other => {
                    return Err(RlError::Input(format!(
                        "unknown loss_fn_config key {other:?}; known: clip_low_threshold, clip_high_threshold, beta"
                    )))
                }
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the values, whichever way they came: ratio bounds that are numbers with
    /// `low <= high`, and a finite non-negative `beta`.
    pub fn validate(&self) -> Result<(), RlError> {
        let (low, high) = (self.clip_low_threshold, self.clip_high_threshold);
        if low.is_nan() || high.is_nan() {
            return Err(RlError::Input(format!(
                "clip thresholds must be numbers, not {low} and {high}"
            )));
        }
        if low > high {
            return Err(RlError::Input(format!(
                "clip_low_threshold {low} is above clip_high_threshold {high}"
            )));
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return Err(RlError::Input(format!(
                "loss_fn_config beta {} is not a finite non-negative number",
                self.beta
            )));
        }
        Ok(())
    }
}

/// The datums of one `forward_backward`, laid end to end (`seq_lens[i]` positions each).
#[derive(Clone, Copy, Debug)]
pub struct TinkerInputs<'a> {
    /// Positions per datum.
    pub seq_lens: &'a [usize],
    /// The model's log-probs of `target_tokens`.
    pub logprobs: &'a [f64],
    /// `weights` (cross_entropy).
    pub weights: Option<&'a [f64]>,
    /// `logprobs` sent by the client: the sampler's log-probs (policy-gradient losses).
    pub sampling_logprobs: Option<&'a [f64]>,
    /// `advantages` (policy-gradient losses).
    pub advantages: Option<&'a [f64]>,
    /// `sequence_ratio_mask` (gspo); all positions when absent.
    pub sequence_ratio_mask: Option<&'a [f64]>,
}

/// Computes a Tinker loss with sum semantics; `metrics` holds [`LOSS_SUM_METRIC`].
pub fn tinker_loss(
    loss: TinkerLoss,
    config: &TinkerLossConfig,
    inputs: &TinkerInputs,
) -> Result<LossOutput, RlError> {
    config.validate()?;
    let n: usize = inputs.seq_lens.iter().sum();
    let check = |name: &str, slice: Option<&[f64]>| -> Result<(), RlError> {
        match slice {
            Some(s) if s.len() != n => Err(RlError::Input(format!(
                "{name} has {} positions, the model input has {n}",
                s.len()
            ))),
            _ => Ok(()),
        }
    };
    check("logprobs (model)", Some(inputs.logprobs))?;
    check("weights", inputs.weights)?;
    check("logprobs", inputs.sampling_logprobs)?;
    check("advantages", inputs.advantages)?;
    check("sequence_ratio_mask", inputs.sequence_ratio_mask)?;
    fn require<'a>(
        loss: TinkerLoss,
        name: &str,
        slice: Option<&'a [f64]>,
    ) -> Result<&'a [f64], RlError> {
        slice.ok_or_else(|| {
            RlError::Input(format!(
                "loss_fn {} needs loss_fn_inputs[{name:?}]",
                loss.name()
            ))
        })
    }
    let ones = vec![1.0; n];
    let zeros = vec![0.0; n];
    let kind = match loss {
        TinkerLoss::CrossEntropy => PolicyLoss::CrossEntropy,
        TinkerLoss::ImportanceSampling => PolicyLoss::ImportanceSampling,
        TinkerLoss::Ppo => PolicyLoss::Regular,
        TinkerLoss::Cispo => PolicyLoss::Cispo,
        TinkerLoss::Gspo => PolicyLoss::Gspo,
        TinkerLoss::Dro => {
            return Ok(dro_loss(
                config.beta,
                inputs.logprobs,
                require(loss, "logprobs", inputs.sampling_logprobs)?,
                require(loss, "advantages", inputs.advantages)?,
            ))
        }
    };
    let (weights, old, advantages) = if loss == TinkerLoss::CrossEntropy {
        (
            require(loss, "weights", inputs.weights)?,
            &zeros[..],
            &zeros[..],
        )
    } else {
        (
            &ones[..],
            require(loss, "logprobs", inputs.sampling_logprobs)?,
            require(loss, "advantages", inputs.advantages)?,
        )
    };
    let out = surrogate_loss(
        kind,
        &SurrogateParams {
            ratio_low: config.clip_low_threshold,
            ratio_high: config.clip_high_threshold,
            clip_ratio_c: f64::INFINITY,
        },
        &SurrogateInputs {
            seq_lens: inputs.seq_lens,
            logprobs: inputs.logprobs,
            old_logprobs: old,
            advantages,
            ratio_mask: inputs.sequence_ratio_mask.unwrap_or(&ones),
        },
        weights,
    );
    let total: f64 = out.loss_t.iter().sum();
    Ok(LossOutput {
        loss: total,
        dlogprobs: out.dlogprobs_t,
        dentropy: zeros,
        elementwise_loss: out.loss_t,
        metrics: BTreeMap::from([(LOSS_SUM_METRIC.to_string(), total)]),
    })
}

/// `dro` per token: loss `−(logp·A − β/2·(logp − q)²)`, gradient `−A + β·(logp − q)`.
fn dro_loss(beta: f64, logprobs: &[f64], sampling: &[f64], advantages: &[f64]) -> LossOutput {
    let (elementwise_loss, dlogprobs): (Vec<f64>, Vec<f64>) = logprobs
        .iter()
        .zip(sampling)
        .zip(advantages)
        .map(|((&lp, &q), &a)| {
            let delta = lp - q;
            (-(lp * a - 0.5 * beta * delta * delta), -a + beta * delta)
        })
        .unzip();
    let total: f64 = elementwise_loss.iter().sum();
    LossOutput {
        loss: total,
        dentropy: vec![0.0; dlogprobs.len()],
        dlogprobs,
        elementwise_loss,
        metrics: BTreeMap::from([(LOSS_SUM_METRIC.to_string(), total)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_is_weighted_negative_logprob_sum() {
        let out = tinker_loss(
            TinkerLoss::CrossEntropy,
            &TinkerLossConfig::default(),
            &TinkerInputs {
                seq_lens: &[3],
                logprobs: &[-1.0, -2.0, -0.5],
                weights: Some(&[0.0, 1.0, -2.0]),
                sampling_logprobs: None,
                advantages: None,
                sequence_ratio_mask: None,
            },
        )
        .unwrap();
        // 0 + 2 − 1 = 1.
        assert_eq!(out.loss, 1.0);
        assert_eq!(out.dlogprobs, vec![0.0, -1.0, 2.0]);
        assert_eq!(out.metrics[LOSS_SUM_METRIC], 1.0);
    }

    #[test]
    fn importance_sampling_and_ppo_sum_over_datums() {
        // Two datums of one position each; ratios 2 and 1, advantages 1 and −1.
        let inputs = TinkerInputs {
            seq_lens: &[1, 1],
            logprobs: &[2.0f64.ln() - 1.0, -1.0],
            weights: None,
            sampling_logprobs: Some(&[-1.0, -1.0]),
            advantages: Some(&[1.0, -1.0]),
            sequence_ratio_mask: None,
        };
        let is = tinker_loss(
            TinkerLoss::ImportanceSampling,
            &TinkerLossConfig::default(),
            &inputs,
        )
        .unwrap();
        assert!((is.loss - (-2.0 + 1.0)).abs() < 1e-12);
        assert!((is.dlogprobs[0] + 2.0).abs() < 1e-12);
        // PPO clips ratio 2 to 1.2 for A > 0.
        let ppo = tinker_loss(TinkerLoss::Ppo, &TinkerLossConfig::default(), &inputs).unwrap();
        assert!((ppo.loss - (-1.2 + 1.0)).abs() < 1e-12);
        assert_eq!(ppo.dlogprobs[0], 0.0);
    }

    #[test]
    fn dro_is_the_published_objective() {
        // Tinker's docs: −Σ (logp·A − ½β(logp − q)²).
        let config = TinkerLossConfig {
            beta: 0.5,
            ..TinkerLossConfig::default()
        };
        let out = tinker_loss(
            TinkerLoss::Dro,
            &config,
            &TinkerInputs {
                seq_lens: &[2],
                logprobs: &[-1.0, -2.0],
                weights: None,
                sampling_logprobs: Some(&[-1.5, -2.0]),
                advantages: Some(&[2.0, -1.0]),
                sequence_ratio_mask: None,
            },
        )
        .unwrap();
        // Token 0: −(−2 − 0.25·0.25) = 2.0625; token 1: −(2 − 0) = −2.
        assert!((out.elementwise_loss[0] - 2.0625).abs() < 1e-12);
        assert!((out.elementwise_loss[1] + 2.0).abs() < 1e-12);
        assert!((out.loss - 0.0625).abs() < 1e-12);
        // dL/dlogp = −A + β(logp − q).
        assert!((out.dlogprobs[0] - (-2.0 + 0.25)).abs() < 1e-12);
        assert!((out.dlogprobs[1] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn config_and_inputs_are_checked() {
        let map = BTreeMap::from([("clip_low_threshold".to_string(), 0.9)]);
        assert_eq!(
            TinkerLossConfig::from_map(&map).unwrap().clip_low_threshold,
            0.9
        );
        let beta = BTreeMap::from([("beta".to_string(), 0.1)]);
        assert_eq!(TinkerLossConfig::from_map(&beta).unwrap().beta, 0.1);
        let bad = BTreeMap::from([("kl_coef".to_string(), 0.1)]);
        let err = TinkerLossConfig::from_map(&bad).unwrap_err().to_string();
        assert!(err.contains("kl_coef") && err.contains("beta"), "{err}");
        let negative = BTreeMap::from([("beta".to_string(), -1.0)]);
        assert!(TinkerLossConfig::from_map(&negative).is_err());
        assert_eq!("dro".parse::<TinkerLoss>().unwrap(), TinkerLoss::Dro);
        assert_eq!("gspo".parse::<TinkerLoss>().unwrap(), TinkerLoss::Gspo);
        let missing = tinker_loss(
            TinkerLoss::Ppo,
            &TinkerLossConfig::default(),
            &TinkerInputs {
                seq_lens: &[1],
                logprobs: &[-1.0],
                weights: None,
                sampling_logprobs: Some(&[-1.0]),
                advantages: None,
                sequence_ratio_mask: None,
            },
        );
        assert!(missing.unwrap_err().to_string().contains("advantages"));
    }
}
