//! Loss reductions against global (mini-batch) counts.
//!
//! SkyRL reduces the policy loss as a plain masked sum and gets the mean it wants by
//! dividing each mini-batch's advantages by a constant beforehand. Every surrogate here is
//! positively homogeneous in `A` (`ℓ(c·A) = c·ℓ(A)` for `c > 0`), so scaling the advantage of
//! token `t` by `w_t` is the same as scaling its loss term by `w_t`. floe applies `w_t` to the
//! loss term: `L = Σ_t w_t·mask_t·ℓ_t`. The weights depend only on the token's own sequence and
//! the mini-batch totals in [`GlobalNorm`], never on the micro-batch, so the micro-batch
//! losses and gradients of a split mini-batch sum to those of one call.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::advantage::sequences;

/// How per-token losses are averaged over a mini-batch (SkyRL `loss_reduction`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossReduction {
    /// Mean over every valid token of the mini-batch: `w_t = 1/N` (DAPO; verl `token-mean`).
    TokenMean,
    /// Mean over sequences of each sequence's token mean: `w_t = 1/(B·n_i)`
    /// (verl `seq-mean-token-mean`).
    SequenceMean,
    /// Dr. GRPO: `w_t = 1/(B·L)` with a constant `L = max_seq_len`
    /// (verl `seq-mean-token-sum-norm`).
    SeqMeanTokenSumNorm,
    /// Mean over sequences of each sequence's token sum: `w_t = 1/B` (verl
    /// `seq-mean-token-sum`; no SkyRL preset, one of the two modes Arctic computes correctly).
    SeqMeanTokenSum,
    /// Mean over prompt groups of each group's token mean: `w_t = 1/(P·N_p)` with `P`
    /// groups in the mini-batch and `N_p` valid tokens in the token's group.
    PromptMean,
}

/// Mini-batch totals the reduction divides by; the same value is passed with every
/// micro-batch of one mini-batch (one optimizer step).
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalNorm {
    /// `N`: the sum of the loss mask over the whole mini-batch.
    pub num_tokens: f64,
    /// `B`: sequences in the mini-batch, counting those whose mask is all zero.
    pub num_sequences: usize,
    /// `N_p` for each prompt group of the mini-batch (`P` is the number of entries).
    pub group_tokens: BTreeMap<u64, f64>,
}

impl GlobalNorm {
    /// Totals of a whole mini-batch laid out as in [`crate::LossInputs`], with one group id
    /// per sequence.
    pub fn of_mini_batch(loss_mask: &[f64], seq_lens: &[usize], group_ids: &[u64]) -> Self {
        assert_eq!(group_ids.len(), seq_lens.len(), "one group id per sequence");
        let mut group_tokens = BTreeMap::new();
        for (range, &g) in sequences(seq_lens).zip(group_ids) {
            *group_tokens.entry(g).or_insert(0.0) += loss_mask[range].iter().sum::<f64>();
        }
        Self {
            num_tokens: loss_mask.iter().sum(),
            num_sequences: seq_lens.len(),
            group_tokens,
        }
    }
}

/// `w_t·mask_t` for every token of a micro-batch. Sequences with no valid token, and an
/// empty mini-batch, get weight 0 rather than a division by zero.
///
/// # Panics
/// For `SeqMeanTokenSumNorm` without `max_seq_len` ([`crate::AlgorithmConfig::validate`]
/// rejects that config), and for `PromptMean` with a group id missing from `norm`.
pub fn token_weights(
    reduction: LossReduction,
    loss_mask: &[f64],
    seq_lens: &[usize],
    group_ids: &[u64],
    norm: &GlobalNorm,
    max_seq_len: Option<usize>,
) -> Vec<f64> {
    assert_eq!(
        loss_mask.len(),
        seq_lens.iter().sum::<usize>(),
        "loss_mask length"
    );
    assert_eq!(group_ids.len(), seq_lens.len(), "one group id per sequence");
    let b = norm.num_sequences as f64;
    let p = norm.group_tokens.len() as f64;
    let mut weights_t = vec![0.0; loss_mask.len()];
    for (range, group) in sequences(seq_lens).zip(group_ids) {
        let seq_weight = match reduction {
            LossReduction::TokenMean => safe_inv(norm.num_tokens),
            LossReduction::SequenceMean => {
                safe_inv(b * loss_mask[range.clone()].iter().sum::<f64>())
            }
            LossReduction::SeqMeanTokenSumNorm => {
                let len = max_seq_len.expect("seq_mean_token_sum_norm requires max_seq_len");
                safe_inv(b * len as f64)
            }
            LossReduction::SeqMeanTokenSum => safe_inv(b),
            LossReduction::PromptMean => {
                let group_tokens = norm.group_tokens.get(group).unwrap_or_else(|| {
                    panic!("group {group} of this micro-batch is not in the GlobalNorm")
                });
                safe_inv(p * group_tokens)
            }
        };
        for t in range {
            weights_t[t] = seq_weight * loss_mask[t];
        }
    }
    weights_t
}

fn safe_inv(x: f64) -> f64 {
    if x == 0.0 {
        0.0
    } else {
        1.0 / x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_on_hand_computed_counts() {
        // Two sequences in this micro-batch (lens 2 and 3, one padded token) out of a
        // mini-batch of 4 sequences and 10 valid tokens in 2 prompt groups: sequence 0 is in
        // group 1 (4 valid tokens in the mini-batch), sequence 1 in group 2 (6).
        let mask = [1.0, 1.0, 1.0, 0.0, 1.0];
        let norm = GlobalNorm {
            num_tokens: 10.0,
            num_sequences: 4,
            group_tokens: BTreeMap::from([(1, 4.0), (2, 6.0)]),
        };
        let weights = |reduction| token_weights(reduction, &mask, &[2, 3], &[1, 2], &norm, Some(5));
        assert_eq!(weights(LossReduction::TokenMean), [0.1, 0.1, 0.1, 0.0, 0.1]);
        let w = weights(LossReduction::SequenceMean);
        assert_eq!(w, [0.125, 0.125, 0.125, 0.0, 0.125]);
        let w = weights(LossReduction::SeqMeanTokenSumNorm);
        assert_eq!(w, [0.05, 0.05, 0.05, 0.0, 0.05]);
        let w = weights(LossReduction::SeqMeanTokenSum);
        assert_eq!(w, [0.25, 0.25, 0.25, 0.0, 0.25]);
        // 1/(2·4) for group 1, 1/(2·6) for group 2.
        let w = weights(LossReduction::PromptMean);
        assert_eq!(w, [0.125, 0.125, 1.0 / 12.0, 0.0, 1.0 / 12.0]);
    }

    #[test]
    fn global_norm_counts_groups_across_the_mini_batch() {
        let norm =
            GlobalNorm::of_mini_batch(&[1.0, 1.0, 0.0, 1.0, 1.0, 1.0], &[3, 1, 2], &[7, 7, 9]);
        assert_eq!(norm.num_tokens, 5.0);
        assert_eq!(norm.num_sequences, 3);
        assert_eq!(norm.group_tokens, BTreeMap::from([(7, 3.0), (9, 2.0)]));
    }

    #[test]
    fn empty_sequences_and_batches_get_zero_weight() {
        let norm = GlobalNorm {
            num_tokens: 0.0,
            num_sequences: 1,
            group_tokens: BTreeMap::from([(0, 0.0)]),
        };
        for reduction in [
            LossReduction::TokenMean,
            LossReduction::SequenceMean,
            LossReduction::PromptMean,
        ] {
            let w = token_weights(reduction, &[0.0, 0.0], &[2], &[0], &norm, None);
            assert_eq!(w, vec![0.0, 0.0], "{reduction:?}");
        }
    }

    #[test]
    fn reduction_serde_names() {
        for (name, r) in [
            ("\"token_mean\"", LossReduction::TokenMean),
            ("\"sequence_mean\"", LossReduction::SequenceMean),
            (
                "\"seq_mean_token_sum_norm\"",
                LossReduction::SeqMeanTokenSumNorm,
            ),
            ("\"seq_mean_token_sum\"", LossReduction::SeqMeanTokenSum),
            ("\"prompt_mean\"", LossReduction::PromptMean),
        ] {
            assert_eq!(serde_json::from_str::<LossReduction>(name).unwrap(), r);
        }
    }
}
