//! Advantage estimators: rewards in, per-token advantages out.
//!
//! Layout: sequences lie end to end in every per-token slice; `seq_lens[i]` is the number of
//! response positions of sequence `i`. Outcome estimators score a sequence by the sum of its
//! token rewards, group sequences by `group_ids` (one id per sequence, shared by the samples
//! of one prompt), and broadcast one advantage over the sequence's response tokens times
//! `response_mask`. For outcome estimators the returns equal the advantages.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::AlgorithmConfig;

/// Added to the group std before dividing, as SkyRL/verl do.
pub const GRPO_STD_EPSILON: f64 = 1e-6;

/// Added to the variance before whitening (REINFORCE++, batch normalisation).
pub const WHITEN_EPSILON: f64 = 1e-8;

/// The advantage estimator, by its SkyRL/verl config name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Group-relative: `(r − μ_g) / (σ_g + ε)`, or `r − μ_g` without std normalisation.
    Grpo,
    /// Leave-one-out baseline: `r_i − mean_{j≠i} r_j`.
    Rloo,
    /// Discounted token returns whitened over the whole batch; no group baseline.
    #[serde(rename = "reinforce_plus_plus", alias = "reinforce++")]
    ReinforcePlusPlus,
    /// Group mean as baseline and scale: `(r − μ_g)/(μ_g + ε)`.
    Maxrl,
}

/// What every estimator reads; all per-token slices have length `Σ seq_lens`.
#[derive(Clone, Copy, Debug)]
pub struct AdvantageInputs<'a> {
    /// Response positions per sequence.
    pub seq_lens: &'a [usize],
    /// Per-token rewards (an outcome reward sits on the last response token).
    pub token_rewards: &'a [f64],
    /// 1 on response tokens, 0 on padding (and, multi-turn, on observation tokens).
    pub response_mask: &'a [f64],
    /// One group id per sequence.
    pub group_ids: &'a [u64],
}

/// Per-token advantages for `config.advantage_estimator`, then the optional batch z-score.
///
/// # Panics
/// If the slice lengths disagree with `seq_lens` / the number of sequences.
pub fn compute_advantages(config: &AlgorithmConfig, inputs: &AdvantageInputs) -> Vec<f64> {
    let num_tokens: usize = inputs.seq_lens.iter().sum();
    assert_eq!(
        inputs.token_rewards.len(),
        num_tokens,
        "token_rewards length"
    );
    assert_eq!(
        inputs.response_mask.len(),
        num_tokens,
        "response_mask length"
    );
    assert_eq!(
        inputs.group_ids.len(),
        inputs.seq_lens.len(),
        "group_ids length"
    );
    let advantages_t = match config.advantage_estimator {
        AdvantageEstimator::Grpo => {
            let scores_s = sequence_scores(inputs.token_rewards, inputs.seq_lens);
            let adv_s = grpo_advantages(
                &scores_s,
                inputs.group_ids,
                config.grpo_norm_by_std,
                GRPO_STD_EPSILON,
            );
            broadcast_to_tokens(&adv_s, inputs.response_mask, inputs.seq_lens)
        }
        AdvantageEstimator::Rloo => {
            let scores_s = sequence_scores(inputs.token_rewards, inputs.seq_lens);
            let adv_s = rloo_advantages(&scores_s, inputs.group_ids);
            broadcast_to_tokens(&adv_s, inputs.response_mask, inputs.seq_lens)
        }
        AdvantageEstimator::Maxrl => {
            let scores_s = sequence_scores(inputs.token_rewards, inputs.seq_lens);
            let adv_s = maxrl_advantages(&scores_s, inputs.group_ids, GRPO_STD_EPSILON);
            broadcast_to_tokens(&adv_s, inputs.response_mask, inputs.seq_lens)
        }
        AdvantageEstimator::ReinforcePlusPlus => reinforce_plus_plus_advantages(
            inputs.token_rewards,
            inputs.response_mask,
            inputs.seq_lens,
            config.gamma,
        ),
    };
    if config.advantage_batch_normalize {
        masked_whiten(&advantages_t, inputs.response_mask)
    } else {
        advantages_t
    }
}

/// A sequence's score: the sum of its token rewards.
pub fn sequence_scores(token_rewards: &[f64], seq_lens: &[usize]) -> Vec<f64> {
    sequences(seq_lens)
        .map(|range| token_rewards[range].iter().sum())
        .collect()
}

/// Token rewards for outcome scores: each score on its sequence's last response position.
/// Zero-length sequences contribute nothing.
pub fn outcome_token_rewards(scores_s: &[f64], seq_lens: &[usize]) -> Vec<f64> {
    assert_eq!(scores_s.len(), seq_lens.len(), "one score per sequence");
    let mut rewards_t = vec![0.0; seq_lens.iter().sum()];
    for (range, &score) in sequences(seq_lens).zip(scores_s) {
        if let Some(last) = range.last() {
            rewards_t[last] = score;
        }
    }
    rewards_t
}

/// GRPO outcome advantages, one per sequence. `μ_g` is the group mean and `σ_g` the unbiased
/// (n−1) std; a group of one sample uses `μ = 0, σ = 1`. With `norm_by_std`,
/// `A = (r − μ)/(σ + epsilon)`, so a group of equal rewards gets exactly 0; without, `A = r − μ`.
pub fn grpo_advantages(
    scores_s: &[f64],
    group_ids: &[u64],
    norm_by_std: bool,
    epsilon: f64,
) -> Vec<f64> {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let groups = group_members(group_ids);
    let mut advantages_s = vec![0.0; scores_s.len()];
    for members in groups.values() {
        let (mean, std) = if members.len() == 1 {
            (0.0, 1.0)
        } else {
            let n = members.len() as f64;
            let mean = group_mean(scores_s, members);
            let var = members
                .iter()
                .map(|&i| (scores_s[i] - mean).powi(2))
                .sum::<f64>()
                / (n - 1.0);
            (mean, var.sqrt())
        };
        for &i in members {
            advantages_s[i] = if norm_by_std {
                (scores_s[i] - mean) / (std + epsilon)
            } else {
                scores_s[i] - mean
            };
        }
    }
    advantages_s
}

/// RLOO outcome advantages: `(r_i − μ_g)·G/(G−1) = r_i − mean_{j≠i} r_j`; a group of one gets 0.
pub fn rloo_advantages(scores_s: &[f64], group_ids: &[u64]) -> Vec<f64> {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let mut advantages_s = vec![0.0; scores_s.len()];
    for members in group_members(group_ids).values() {
        if members.len() < 2 {
            continue;
        }
        let n = members.len() as f64;
        let mean = group_mean(scores_s, members);
        for &i in members {
            advantages_s[i] = (scores_s[i] - mean) * n / (n - 1.0);
        }
    }
    advantages_s
}

/// MaxRL outcome advantages: `(r − μ_g)/(μ_g + epsilon)`, the group mean both as baseline
/// and as scale (a group of one, or of equal scores, gets 0).
pub fn maxrl_advantages(scores_s: &[f64], group_ids: &[u64], epsilon: f64) -> Vec<f64> {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let mut advantages_s = vec![0.0; scores_s.len()];
    for members in group_members(group_ids).values() {
        let mean = group_mean(scores_s, members);
        for &i in members {
            advantages_s[i] = (scores_s[i] - mean) / (mean + epsilon);
        }
    }
    advantages_s
}

/// REINFORCE++: per sequence, `G_t = r_t + γ·G_{t+1}` computed backwards, the running return
/// multiplied by `response_mask[t]` after each step (so padding resets it); then
/// [`masked_whiten`] over the whole batch.
pub fn reinforce_plus_plus_advantages(
    token_rewards: &[f64],
    response_mask: &[f64],
    seq_lens: &[usize],
    gamma: f64,
) -> Vec<f64> {
    let mut returns_t = vec![0.0; token_rewards.len()];
    for range in sequences(seq_lens) {
        let mut running = 0.0;
        for t in range.rev() {
            running = token_rewards[t] + gamma * running;
            returns_t[t] = running;
            running *= response_mask[t];
        }
    }
    masked_whiten(&returns_t, response_mask)
}

/// `(x − mean)/sqrt(var + 1e-8)` with mean and Bessel-corrected variance over masked
/// positions, then multiplied by the mask.
pub fn masked_whiten(values_t: &[f64], mask_t: &[f64]) -> Vec<f64> {
    assert_eq!(values_t.len(), mask_t.len(), "values and mask lengths");
    let count: f64 = mask_t.iter().sum();
    if count == 0.0 {
        return vec![0.0; values_t.len()];
    }
    let mean = values_t.iter().zip(mask_t).map(|(v, m)| v * m).sum::<f64>() / count;
    let sq = values_t
        .iter()
        .zip(mask_t)
        .map(|(v, m)| (v - mean).powi(2) * m)
        .sum::<f64>();
    // Bessel's correction; a single token has no spread to divide by.
    let var = if count > 1.0 { sq / (count - 1.0) } else { 0.0 };
    let inv_std = 1.0 / (var + WHITEN_EPSILON).sqrt();
    values_t
        .iter()
        .zip(mask_t)
        .map(|(v, m)| {
            if *m == 0.0 {
                0.0
            } else {
                (v - mean) * inv_std * m
            }
        })
        .collect()
}

/// Copies each sequence's value onto its response tokens, times `response_mask`.
pub fn broadcast_to_tokens(
    values_s: &[f64],
    response_mask: &[f64],
    seq_lens: &[usize],
) -> Vec<f64> {
    assert_eq!(values_s.len(), seq_lens.len(), "one value per sequence");
    let mut out_t = vec![0.0; response_mask.len()];
    for (range, &value) in sequences(seq_lens).zip(values_s) {
        for t in range {
            out_t[t] = value * response_mask[t];
        }
    }
    out_t
}

/// For `zero_variance_filter`: true for each sequence whose group's scores are all equal
/// (such a group has zero advantage under GRPO/RLOO and only dilutes the token count).
pub fn zero_variance_sequences(scores_s: &[f64], group_ids: &[u64]) -> Vec<bool> {
    assert_eq!(scores_s.len(), group_ids.len(), "one group id per score");
    let mut flat = vec![false; scores_s.len()];
    for members in group_members(group_ids).values() {
        let first = scores_s[members[0]];
        let all_equal = members.iter().all(|&i| scores_s[i] == first);
        for &i in members {
            flat[i] = all_equal;
        }
    }
    flat
}

/// Token ranges of consecutive sequences.
pub(crate) fn sequences(seq_lens: &[usize]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    seq_lens.iter().scan(0usize, |start, &len| {
        let range = *start..*start + len;
        *start += len;
        Some(range)
    })
}

/// Mean shifted by the first member, so a group of equal scores has exactly that mean
/// and its advantages are exactly 0.
fn group_mean(scores_s: &[f64], members: &[usize]) -> f64 {
    let first = scores_s[members[0]];
    first + members.iter().map(|&i| scores_s[i] - first).sum::<f64>() / members.len() as f64
}

/// Sequence indices per group id, in first-seen order within each group.
fn group_members(group_ids: &[u64]) -> BTreeMap<u64, Vec<usize>> {
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, &g) in group_ids.iter().enumerate() {
        groups.entry(g).or_default().push(i);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn grpo_normalises_by_unbiased_group_std() {
        // Group 7: scores 1, 0, 0, 1 → μ = 0.5, σ = sqrt(1/3) ≈ 0.57735.
        // Group 9: 2, 4 → μ = 3, σ = sqrt(2).
        let adv = grpo_advantages(
            &[1.0, 0.0, 2.0, 0.0, 1.0, 4.0],
            &[7, 7, 9, 7, 7, 9],
            true,
            1e-6,
        );
        let a = 0.5 / (1.0f64 / 3.0).sqrt();
        let b = 1.0 / 2.0f64.sqrt();
        close(&adv, &[a, -a, -b, -a, a, b], 1e-5);
    }

    #[test]
    fn grpo_without_std_is_mean_centred() {
        let adv = grpo_advantages(&[1.0, 0.0, 0.5], &[1, 1, 1], false, 1e-6);
        close(&adv, &[0.5, -0.5, 0.0], 1e-12);
    }

    #[test]
    fn grpo_group_of_one_uses_zero_mean_unit_std() {
        let adv = grpo_advantages(&[0.8], &[3], true, 1e-6);
        close(&adv, &[0.8 / (1.0 + 1e-6)], 1e-15);
        let adv = grpo_advantages(&[0.8], &[3], false, 1e-6);
        close(&adv, &[0.8], 0.0);
    }

    #[test]
    fn grpo_equal_rewards_give_exact_zero() {
        let adv = grpo_advantages(&[0.1, 0.1, 0.1], &[0, 0, 0], true, 1e-6);
        assert_eq!(adv, vec![0.0, 0.0, 0.0]);
    }

    #[test]
    fn rloo_is_leave_one_out() {
        // r = 1, 0, 0: A_0 = 1 − 0 = 1, A_1 = 0 − 0.5 = −0.5.
        let adv = rloo_advantages(&[1.0, 0.0, 0.0, 5.0], &[0, 0, 0, 1]);
        close(&adv, &[1.0, -0.5, -0.5, 0.0], 1e-12);
    }

    #[test]
    fn maxrl_scales_by_group_mean() {
        // Group mean 0.25: A = (1 − 0.25)/0.25 = 3 and (0 − 0.25)/0.25 = −1.
        let adv = maxrl_advantages(&[1.0, 0.0, 0.0, 0.0, 0.7], &[0, 0, 0, 0, 1], 1e-6);
        close(&adv, &[3.0, -1.0, -1.0, -1.0, 0.0], 1e-4);
    }

    #[test]
    fn reinforce_plus_plus_discounts_then_whitens() {
        // One sequence [r=0, 0, 1] with γ = 0.5 → returns 0.25, 0.5, 1 (mask all 1);
        // a second sequence [2, pad] whose padding resets the running return.
        let rewards = [0.0, 0.0, 1.0, 2.0, 7.0];
        let mask = [1.0, 1.0, 1.0, 1.0, 0.0];
        let adv = reinforce_plus_plus_advantages(&rewards, &mask, &[3, 2], 0.5);
        // Returns of the second sequence: t=4 → 7 (masked), t=3 → 2 + 0.5·0 = 2.
        let g = [0.25, 0.5, 1.0, 2.0];
        let mean = g.iter().sum::<f64>() / 4.0;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 3.0;
        let s = (var + 1e-8).sqrt();
        close(
            &adv,
            &[
                (0.25 - mean) / s,
                (0.5 - mean) / s,
                (1.0 - mean) / s,
                (2.0 - mean) / s,
                0.0,
            ],
            1e-12,
        );
    }

    #[test]
    fn outcome_rewards_sit_on_last_token_and_broadcast_with_mask() {
        let rewards = outcome_token_rewards(&[1.0, 0.0], &[2, 3]);
        assert_eq!(rewards, vec![0.0, 1.0, 0.0, 0.0, 0.0]);
        let config = AlgorithmConfig::default();
        let mask = [1.0, 1.0, 1.0, 0.0, 1.0];
        let adv = compute_advantages(
            &config,
            &AdvantageInputs {
                seq_lens: &[2, 3],
                token_rewards: &rewards,
                response_mask: &mask,
                group_ids: &[5, 5],
            },
        );
        // Scores 1, 0: μ = 0.5, σ = sqrt(0.5).
        let a = 0.5 / (0.5f64.sqrt() + 1e-6);
        close(&adv, &[a, a, -a, 0.0, -a], 1e-12);
    }

    #[test]
    fn batch_normalize_whitens_over_response_tokens() {
        let config = AlgorithmConfig {
            advantage_estimator: AdvantageEstimator::Rloo,
            advantage_batch_normalize: true,
            ..AlgorithmConfig::default()
        };
        // RLOO advantages 1, −1 over one token each; whitened: mean 0, var 2 → ±1/sqrt(2).
        let adv = compute_advantages(
            &config,
            &AdvantageInputs {
                seq_lens: &[1, 1],
                token_rewards: &[1.0, 0.0],
                response_mask: &[1.0, 1.0],
                group_ids: &[0, 0],
            },
        );
        let s = (2.0f64 + 1e-8).sqrt();
        close(&adv, &[1.0 / s, -1.0 / s], 1e-12);
    }

    #[test]
    fn zero_variance_groups_are_flagged() {
        let flags = zero_variance_sequences(&[1.0, 1.0, 0.0, 1.0, 3.0], &[0, 0, 1, 1, 2]);
        assert_eq!(flags, vec![true, true, false, false, true]);
    }

    #[test]
    fn estimator_serde_names() {
        for (name, est) in [
            ("\"grpo\"", AdvantageEstimator::Grpo),
            ("\"rloo\"", AdvantageEstimator::Rloo),
            (
                "\"reinforce_plus_plus\"",
                AdvantageEstimator::ReinforcePlusPlus,
            ),
            ("\"reinforce++\"", AdvantageEstimator::ReinforcePlusPlus),
            ("\"maxrl\"", AdvantageEstimator::Maxrl),
        ] {
            assert_eq!(
                serde_json::from_str::<AdvantageEstimator>(name).unwrap(),
                est
            );
        }
    }
}
