//! Off-policy correction for the rollout/training log-prob gap.
//!
//! With `ρ_t = exp(logπ_old − logπ_rollout)` (the sampler's log-probs differ from the
//! trainer's even for the same weights), each token's loss is multiplied by a constant
//! factor built in this order: outlier-sequence mask, token mask, truncated importance
//! sampling (TIS), sequence mask. The factors do not depend on `logπ_θ`, so they scale
//! the gradient exactly like the loss (the stop-gradient of the spec).

use std::collections::BTreeMap;

use crate::advantage::sequences;
use crate::config::{OffPolicyCorrection, SequenceMaskMetric, TisRatioType};
use crate::kl::LOG_RATIO_CLAMP;
use crate::metrics::names;

/// Per-token loss multipliers and what they did.
#[derive(Clone, Debug, PartialEq)]
pub struct OffPolicyWeights {
    /// Multiplies each token's loss term; 1 where no correction applies.
    pub factors_t: Vec<f64>,
    /// `policy/loss_metrics/*` diagnostics (fractions over valid tokens or sequences).
    pub metrics: BTreeMap<String, f64>,
}

/// Computes the correction factors for one micro-batch.
///
/// # Panics
/// If a slice's length differs from `Σ seq_lens`.
pub fn off_policy_weights(
    config: &OffPolicyCorrection,
    old_logprobs: &[f64],
    rollout_logprobs: &[f64],
    loss_mask: &[f64],
    seq_lens: &[usize],
) -> OffPolicyWeights {
    let n: usize = seq_lens.iter().sum();
    assert_eq!(old_logprobs.len(), n, "old_logprobs length");
    assert_eq!(rollout_logprobs.len(), n, "rollout_logprobs length");
    assert_eq!(loss_mask.len(), n, "loss_mask length");
    let log_rho_t: Vec<f64> = old_logprobs
        .iter()
        .zip(rollout_logprobs)
        .zip(loss_mask)
        .map(|((o, r), &m)| {
            if m == 0.0 {
                0.0
            } else {
                (o - r).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            }
        })
        .collect();
    let mut factors_t = vec![1.0; n];
    let mut counts = Counts::default();
    for range in sequences(seq_lens) {
        let valid: Vec<usize> = range.clone().filter(|&t| loss_mask[t] != 0.0).collect();
        if valid.is_empty() {
            continue;
        }
        counts.sequences += 1.0;
        counts.tokens += valid.len() as f64;
        let out_of = |rho: f64, low: Option<f64>, high: Option<f64>| {
            low.is_some_and(|l| rho < l) || high.is_some_and(|h| rho > h)
        };
        let mut seq_factor = 1.0;
        if valid.iter().any(|&t| {
            out_of(
                log_rho_t[t].exp(),
                config.outlier_token_is_threshold_low,
                config.outlier_token_is_threshold_high,
            )
        }) {
            seq_factor = 0.0;
            counts.outlier_sequences += 1.0;
        }
        for &t in &valid {
            let rho = log_rho_t[t].exp();
            counts.rho.push(rho);
            if out_of(
                rho,
                config.token_mask_is_threshold_low,
                config.token_mask_is_threshold_high,
            ) {
                factors_t[t] = 0.0;
                counts.masked_tokens += 1.0;
            }
            if config.tis_ratio_type == Some(TisRatioType::Token) {
                if rho > config.token_tis_ratio_clip_high {
                    counts.tis_clipped += 1.0;
                }
                factors_t[t] *= rho.min(config.token_tis_ratio_clip_high);
            }
        }
        let sum_log_rho: f64 = valid.iter().map(|&t| log_rho_t[t]).sum();
        if config.tis_ratio_type == Some(TisRatioType::Sequence) {
            let seq_rho = sum_log_rho.exp();
            if seq_rho > config.sequence_tis_ratio_clip_high {
                counts.tis_clipped += 1.0;
            }
            seq_factor *= seq_rho.min(config.sequence_tis_ratio_clip_high);
        }
        let keep = match config.sequence_mask_metric {
            None => true,
            Some(SequenceMaskMetric::Geometric) => {
                let g = (sum_log_rho / valid.len() as f64).exp();
                (config.geo_mask_low..=config.geo_mask_high).contains(&g)
            }
            Some(SequenceMaskMetric::Product) => {
                let p = sum_log_rho.exp();
                (config.product_mask_low..=config.product_mask_high).contains(&p)
            }
        };
        if !keep {
            seq_factor = 0.0;
            counts.masked_sequences += 1.0;
        }
        for t in range {
            factors_t[t] *= seq_factor;
        }
    }
    OffPolicyWeights {
        factors_t,
        metrics: counts.into_metrics(config),
    }
}

#[derive(Default)]
struct Counts {
    sequences: f64,
    tokens: f64,
    rho: Vec<f64>,
    outlier_sequences: f64,
    masked_tokens: f64,
    tis_clipped: f64,
    masked_sequences: f64,
}

impl Counts {
    fn into_metrics(self, config: &OffPolicyCorrection) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        if self.rho.is_empty() {
            return m;
        }
        let frac = |x: f64, of: f64| if of == 0.0 { 0.0 } else { x / of };
        let mean = self.rho.iter().sum::<f64>() / self.rho.len() as f64;
        let std = if self.rho.len() > 1 {
            (self.rho.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (self.rho.len() - 1) as f64)
                .sqrt()
        } else {
            0.0
        };
        let mut put = |key: &str, value: f64| {
            m.insert(key.to_string(), value);
        };
        put(names::IS_RATIO_MEAN, mean);
        put(names::IS_RATIO_STD, std);
        put(
            names::IS_RATIO_MIN,
            self.rho.iter().copied().fold(f64::INFINITY, f64::min),
        );
        put(
            names::IS_RATIO_MAX,
            self.rho.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        if config.outlier_token_is_threshold_low.is_some()
            || config.outlier_token_is_threshold_high.is_some()
        {
            put(
                names::OUTLIER_SEQ_MASKED_RATIO,
                frac(self.outlier_sequences, self.sequences),
            );
        }
        if config.token_mask_is_threshold_low.is_some()
            || config.token_mask_is_threshold_high.is_some()
        {
            put(
                names::TOKEN_MASKED_RATIO,
                frac(self.masked_tokens, self.tokens),
            );
        }
        match config.tis_ratio_type {
            Some(TisRatioType::Token) => put(
                names::TIS_TOKEN_CLIP_HIGH_RATIO,
                frac(self.tis_clipped, self.tokens),
            ),
            Some(TisRatioType::Sequence) => put(
                names::TIS_SEQ_CLIP_HIGH_RATIO,
                frac(self.tis_clipped, self.sequences),
            ),
            None => {}
        }
        if config.sequence_mask_metric.is_some() {
            put(
                names::SEQUENCE_MASKED_RATIO,
                frac(self.masked_sequences, self.sequences),
            );
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ln(x: f64) -> f64 {
        x.ln()
    }

    #[test]
    fn token_tis_caps_rho_at_two() {
        let config = OffPolicyCorrection {
            tis_ratio_type: Some(TisRatioType::Token),
            ..OffPolicyCorrection::default()
        };
        // ρ = 3 (capped to 2), 0.5, and a masked token.
        let out = off_policy_weights(
            &config,
            &[ln(3.0), ln(0.5), 9.0],
            &[0.0, 0.0, 0.0],
            &[1.0, 1.0, 0.0],
            &[3],
        );
        assert!((out.factors_t[0] - 2.0).abs() < 1e-12);
        assert!((out.factors_t[1] - 0.5).abs() < 1e-12);
        assert_eq!(out.factors_t[2], 1.0);
        assert_eq!(out.metrics[names::TIS_TOKEN_CLIP_HIGH_RATIO], 0.5);
        assert!((out.metrics[names::IS_RATIO_MAX] - 3.0).abs() < 1e-12);
        assert!((out.metrics[names::IS_RATIO_MEAN] - 1.75).abs() < 1e-12);
    }

    #[test]
    fn sequence_tis_uses_product_capped_at_five() {
        let config = OffPolicyCorrection {
            tis_ratio_type: Some(TisRatioType::Sequence),
            ..OffPolicyCorrection::default()
        };
        // Seq 0: ρ = 2·1.5 = 3; seq 1: ρ = 4·2 = 8 → capped at 5.
        let old = [ln(2.0), ln(1.5), ln(4.0), ln(2.0)];
        let out = off_policy_weights(&config, &old, &[0.0; 4], &[1.0; 4], &[2, 2]);
        for (f, e) in out.factors_t.iter().zip([3.0, 3.0, 5.0, 5.0]) {
            assert!((f - e).abs() < 1e-12);
        }
        assert_eq!(out.metrics[names::TIS_SEQ_CLIP_HIGH_RATIO], 0.5);
    }

    #[test]
    fn masks_drop_tokens_and_sequences() {
        let config = OffPolicyCorrection {
            outlier_token_is_threshold_high: Some(10.0),
            token_mask_is_threshold_low: Some(0.5),
            sequence_mask_metric: Some(SequenceMaskMetric::Geometric),
            geo_mask_low: 0.9,
            geo_mask_high: 1.1,
            ..OffPolicyCorrection::default()
        };
        // Seq 0 has a ρ = 20 outlier → dropped. Seq 1: ρ = 0.4 masked; geometric mean of
        // (0.4, 2.5) is 1 → kept. Seq 2: ρ = 1.5 alone → geometric 1.5 → dropped (seq 0's
        // geometric mean sqrt(20) fails the sequence mask too).
        let old = [ln(20.0), 0.0, ln(0.4), ln(2.5), ln(1.5)];
        let out = off_policy_weights(&config, &old, &[0.0; 5], &[1.0; 5], &[2, 2, 1]);
        assert_eq!(out.factors_t, vec![0.0, 0.0, 0.0, 1.0, 0.0]);
        assert!((out.metrics[names::OUTLIER_SEQ_MASKED_RATIO] - 1.0 / 3.0).abs() < 1e-12);
        assert!((out.metrics[names::TOKEN_MASKED_RATIO] - 0.2).abs() < 1e-12);
        assert!((out.metrics[names::SEQUENCE_MASKED_RATIO] - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn product_mask_bounds() {
        let config = OffPolicyCorrection {
            sequence_mask_metric: Some(SequenceMaskMetric::Product),
            ..OffPolicyCorrection::default()
        };
        // Products 1.8 (kept) and 2.2 (dropped) against [0.5, 2].
        let old = [ln(1.8), ln(2.2)];
        let out = off_policy_weights(&config, &old, &[0.0; 2], &[1.0; 2], &[1, 1]);
        assert_eq!(out.factors_t, vec![1.0, 0.0]);
    }
}
