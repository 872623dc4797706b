//! A small fixed batch and a finite-difference checker shared by the integration tests.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use floe_rl::{compute_policy_loss, AlgorithmConfig, GlobalNorm, LossInputs, LossOutput};

/// Deterministic values in `[lo, hi)` (a fixed LCG keeps the tests reproducible).
pub fn values(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((state >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// Five sequences (lengths 3, 4, 2, 5, 3) in three prompt groups, with padding and a fully
/// masked sequence.
pub struct Batch {
    pub seq_lens: Vec<usize>,
    pub group_ids: Vec<u64>,
    pub logprobs: Vec<f64>,
    pub old_logprobs: Vec<f64>,
    pub advantages: Vec<f64>,
    pub loss_mask: Vec<f64>,
    pub entropies: Vec<f64>,
    pub ref_logprobs: Vec<f64>,
    pub rollout_logprobs: Vec<f64>,
}

impl Batch {
    pub fn new() -> Self {
        let seq_lens = vec![3, 4, 2, 5, 3];
        let n: usize = seq_lens.iter().sum();
        let old_logprobs = values(1, n, -3.0, -0.1);
        // Log-ratios in ±0.5 so some tokens clip at 0.8/1.2 and some do not.
        let logprobs: Vec<f64> = old_logprobs
            .iter()
            .zip(values(2, n, -0.5, 0.5))
            .map(|(o, d)| o + d)
            .collect();
        // One advantage per sequence, as outcome estimators give, with mixed signs.
        let adv_s = [1.3, -0.7, 0.4, -1.1, 0.9];
        let mut advantages = Vec::new();
        for (len, a) in seq_lens.iter().zip(adv_s) {
            advantages.extend(std::iter::repeat_n(a, *len));
        }
        let mut loss_mask = vec![1.0; n];
        loss_mask[6] = 0.0; // padding at the end of sequence 1
        loss_mask[7] = 0.0; // sequence 2 is fully masked
        loss_mask[8] = 0.0;
        Self {
            seq_lens,
            // Groups that the micro-batch splits of the tests cut through.
            group_ids: vec![3, 5, 5, 8, 8],
            logprobs,
            old_logprobs: old_logprobs.clone(),
            advantages,
            loss_mask,
            entropies: values(3, n, 0.5, 3.0),
            ref_logprobs: values(4, n, -3.0, -0.1),
            rollout_logprobs: old_logprobs
                .iter()
                .zip(values(5, n, -0.8, 0.8))
                .map(|(o, d)| o + d)
                .collect(),
        }
    }

    pub fn inputs(&self) -> LossInputs<'_> {
        LossInputs {
            seq_lens: &self.seq_lens,
            group_ids: &self.group_ids,
            logprobs: &self.logprobs,
            old_logprobs: &self.old_logprobs,
            advantages: &self.advantages,
            loss_mask: &self.loss_mask,
            entropies: Some(&self.entropies),
            ref_logprobs: Some(&self.ref_logprobs),
            rollout_logprobs: Some(&self.rollout_logprobs),
        }
    }

    pub fn norm(&self) -> GlobalNorm {
        GlobalNorm::of_mini_batch(&self.loss_mask, &self.seq_lens, &self.group_ids)
    }

    /// The micro-batch holding sequences `range`, as a batch of its own.
    pub fn slice(&self, seqs: std::ops::Range<usize>) -> Batch {
        let start: usize = self.seq_lens[..seqs.start].iter().sum();
        let end: usize = self.seq_lens[..seqs.end].iter().sum();
        let cut = |v: &Vec<f64>| v[start..end].to_vec();
        Batch {
            seq_lens: self.seq_lens[seqs.clone()].to_vec(),
            group_ids: self.group_ids[seqs].to_vec(),
            logprobs: cut(&self.logprobs),
            old_logprobs: cut(&self.old_logprobs),
            advantages: cut(&self.advantages),
            loss_mask: cut(&self.loss_mask),
            entropies: cut(&self.entropies),
            ref_logprobs: cut(&self.ref_logprobs),
            rollout_logprobs: cut(&self.rollout_logprobs),
        }
    }
}

/// Checks `dlogprobs` and `dentropy` against central differences of `loss`.
///
/// CISPO stops the gradient through its ratio, so its gradient is the derivative with the
/// ratio held fixed: for it the difference moves the old and rollout log-probs along with
/// `logπ`, which leaves every ratio (and the TIS weights) unchanged.
pub fn check_gradients(config: &AlgorithmConfig, batch: &Batch, label: &str) -> LossOutput {
    let frozen_ratio = config.policy_loss_type == floe_rl::PolicyLoss::Cispo;
    let norm = batch.norm();
    let out = compute_policy_loss(config, &batch.inputs(), &norm);
    let h = 1e-6;
    let loss_at = |b: &Batch| compute_policy_loss(config, &b.inputs(), &norm).loss;
    for t in 0..batch.logprobs.len() {
        let mut plus = batch.slice(0..batch.seq_lens.len());
        let mut minus = batch.slice(0..batch.seq_lens.len());
        plus.logprobs[t] += h;
        minus.logprobs[t] -= h;
        if frozen_ratio {
            plus.old_logprobs[t] += h;
            minus.old_logprobs[t] -= h;
            plus.rollout_logprobs[t] += h;
            minus.rollout_logprobs[t] -= h;
        }
        let fd = (loss_at(&plus) - loss_at(&minus)) / (2.0 * h);
        assert!(
            (fd - out.dlogprobs[t]).abs() < 1e-7,
            "{label}: dlogprobs[{t}] = {} but finite difference {fd}",
            out.dlogprobs[t]
        );
        let mut plus = batch.slice(0..batch.seq_lens.len());
        let mut minus = batch.slice(0..batch.seq_lens.len());
        plus.entropies[t] += h;
        minus.entropies[t] -= h;
        let fd = (loss_at(&plus) - loss_at(&minus)) / (2.0 * h);
        assert!(
            (fd - out.dentropy[t]).abs() < 1e-7,
            "{label}: dentropy[{t}] = {} but finite difference {fd}",
            out.dentropy[t]
        );
    }
    out
}
