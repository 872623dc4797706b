//! `compute_policy_loss`: hand-computed values, finite-difference gradients, micro-batch
//! invariance, equivalence with SkyRL's pre-scaled advantages, and the first-epoch invariant.

mod common;

use common::{check_gradients, Batch};
use floe_rl::config::TisRatioType;
use floe_rl::metrics::{names, reduce_micro_batch_metrics};
use floe_rl::policy_loss::{surrogate_loss, SurrogateInputs, SurrogateParams};
use floe_rl::reduction::token_weights;
use floe_rl::{
    compute_policy_loss, AlgorithmConfig, GlobalNorm, KlEstimator, LossInputs, LossReduction,
    PolicyLoss,
};

const LOSSES: [PolicyLoss; 6] = [
    PolicyLoss::Regular,
    PolicyLoss::DualClip,
    PolicyLoss::Gspo,
    PolicyLoss::Cispo,
    PolicyLoss::ImportanceSampling,
    PolicyLoss::CrossEntropy,
];
const REDUCTIONS: [LossReduction; 5] = [
    LossReduction::TokenMean,
    LossReduction::SequenceMean,
    LossReduction::SeqMeanTokenSumNorm,
    LossReduction::SeqMeanTokenSum,
    LossReduction::PromptMean,
];

fn config(loss: PolicyLoss, reduction: LossReduction) -> AlgorithmConfig {
    let mut config = AlgorithmConfig {
        policy_loss_type: loss,
        loss_reduction: reduction,
        max_seq_len: Some(6),
        // Low enough that the dual-clip bound is selected for some tokens of the batch.
        clip_ratio_c: 1.1,
        entropy_coeff: 0.01,
        kl_loss_coef: 0.05,
        ..AlgorithmConfig::default()
    };
    config.off_policy_correction.tis_ratio_type = Some(TisRatioType::Token);
    config.validate().unwrap();
    config
}

#[test]
fn hand_computed_loss_and_gradients() {
    // Ratios are 1; A = 1, 1, −2; token_mean over N = 3 → pg_loss = (−1 − 1 + 2)/3 = 0.
    // k1 KL with Δ = 0.5, 0, 0.5 and sequence-mean weights 1/4, 1/4, 1/2 → 0.375.
    // Entropy bonus 0.3·mean(1, 2, 3) = 0.6.
    let config = AlgorithmConfig {
        kl_estimator_type: KlEstimator::K1,
        kl_loss_coef: 0.1,
        entropy_coeff: 0.3,
        ..AlgorithmConfig::default()
    };
    let inputs = LossInputs {
        seq_lens: &[2, 1],
        group_ids: &[0, 0],
        logprobs: &[-1.0, -2.0, -0.5],
        old_logprobs: &[-1.0, -2.0, -0.5],
        advantages: &[1.0, 1.0, -2.0],
        loss_mask: &[1.0, 1.0, 1.0],
        entropies: Some(&[1.0, 2.0, 3.0]),
        ref_logprobs: Some(&[-1.5, -2.0, -1.0]),
        rollout_logprobs: None,
    };
    let norm = GlobalNorm::of_mini_batch(inputs.loss_mask, inputs.seq_lens, inputs.group_ids);
    let out = compute_policy_loss(&config, &inputs, &norm);
    let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    close(out.loss, 0.0375 - 0.6);
    close(out.metrics[names::POLICY_PG_LOSS], 0.0);
    close(out.metrics[names::POLICY_KL_LOSS], 0.375);
    close(out.metrics[names::POLICY_ENTROPY], 2.0);
    close(out.metrics[names::POLICY_FINAL_LOSS], out.loss);
    for (g, e) in
        out.dlogprobs
            .iter()
            .zip([-1.0 / 3.0 + 0.025, -1.0 / 3.0 + 0.025, 2.0 / 3.0 + 0.05])
    {
        close(*g, e);
    }
    for g in &out.dentropy {
        close(*g, -0.1);
    }
    close(out.elementwise_loss.iter().sum(), out.loss);
}

#[test]
fn gradients_match_finite_differences_for_every_loss_and_reduction() {
    let batch = Batch::new();
    for loss in LOSSES {
        for reduction in REDUCTIONS {
            let out = check_gradients(
                &config(loss, reduction),
                &batch,
                &format!("{loss:?}/{reduction:?}"),
            );
            assert!(out.loss.is_finite());
        }
    }
}

#[test]
fn gradients_match_finite_differences_for_every_kl_estimator_and_tis_kind() {
    let batch = Batch::new();
    for estimator in [
        KlEstimator::K1,
        KlEstimator::Abs,
        KlEstimator::K2,
        KlEstimator::K3,
    ] {
        for tis in [
            None,
            Some(TisRatioType::Token),
            Some(TisRatioType::Sequence),
        ] {
            let mut config = config(PolicyLoss::Regular, LossReduction::TokenMean);
            config.kl_estimator_type = estimator;
            config.off_policy_correction.tis_ratio_type = tis;
            check_gradients(&config, &batch, &format!("{estimator:?}/{tis:?}"));
        }
    }
}

#[test]
fn dual_clip_bound_is_exercised_by_the_batch() {
    let batch = Batch::new();
    let out = compute_policy_loss(
        &config(PolicyLoss::DualClip, LossReduction::TokenMean),
        &batch.inputs(),
        &batch.norm(),
    );
    assert!(out.metrics[names::POLICY_CLIPFRAC_LOWER] > 0.0);
    assert!(out.metrics[names::POLICY_CLIPFRAC] > 0.0);
}

#[test]
fn micro_batches_sum_to_the_mini_batch() {
    let batch = Batch::new();
    let norm = batch.norm();
    for loss in LOSSES {
        for reduction in REDUCTIONS {
            for tis in [TisRatioType::Token, TisRatioType::Sequence] {
                let mut config = config(loss, reduction);
                config.off_policy_correction.tis_ratio_type = Some(tis);
                let whole = compute_policy_loss(&config, &batch.inputs(), &norm);
                for splits in [vec![0..2, 2..5], vec![0..1, 1..4, 4..5]] {
                    let parts: Vec<_> = splits
                        .iter()
                        .map(|r| {
                            compute_policy_loss(&config, &batch.slice(r.clone()).inputs(), &norm)
                        })
                        .collect();
                    let label = format!("{loss:?}/{reduction:?}/{tis:?}/{splits:?}");
                    let loss_sum: f64 = parts.iter().map(|p| p.loss).sum();
                    assert!((loss_sum - whole.loss).abs() < 1e-12, "{label}: loss");
                    let dlogprobs: Vec<f64> =
                        parts.iter().flat_map(|p| p.dlogprobs.clone()).collect();
                    let dentropy: Vec<f64> =
                        parts.iter().flat_map(|p| p.dentropy.clone()).collect();
                    for t in 0..dlogprobs.len() {
                        assert!(
                            (dlogprobs[t] - whole.dlogprobs[t]).abs() < 1e-12,
                            "{label}: dlogprobs[{t}]"
                        );
                        assert!(
                            (dentropy[t] - whole.dentropy[t]).abs() < 1e-12,
                            "{label}: dentropy[{t}]"
                        );
                    }
                    let metrics = reduce_micro_batch_metrics(
                        &parts.iter().map(|p| p.metrics.clone()).collect::<Vec<_>>(),
                    );
                    for key in [
                        names::POLICY_PG_LOSS,
                        names::POLICY_KL_LOSS,
                        names::POLICY_FINAL_LOSS,
                    ] {
                        assert!(
                            (metrics[key] - whole.metrics[key]).abs() < 1e-12,
                            "{label}: {key}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn weighting_the_loss_equals_skyrl_prescaled_advantages() {
    // SkyRL divides the advantages by the reduction constant and sums the per-token loss;
    // floe weights each token's loss instead. The surrogates are positively homogeneous in
    // A, so both give the same loss and gradients.
    let batch = Batch::new();
    let norm = batch.norm();
    for loss in LOSSES
        .into_iter()
        .filter(|l| *l != PolicyLoss::CrossEntropy)
    {
        for reduction in REDUCTIONS {
            let mut config = config(loss, reduction);
            config.use_kl_loss = false;
            config.entropy_coeff = 0.0;
            let inputs = LossInputs {
                rollout_logprobs: None,
                ..batch.inputs()
            };
            let ours = compute_policy_loss(&config, &inputs, &norm);
            let w = token_weights(
                reduction,
                &batch.loss_mask,
                &batch.seq_lens,
                &batch.group_ids,
                &norm,
                config.max_seq_len,
            );
            let prescaled: Vec<f64> = batch
                .advantages
                .iter()
                .zip(&w)
                .map(|(a, w)| a * w)
                .collect();
            let skyrl = surrogate_loss(
                loss,
                &SurrogateParams::from_config(&config),
                &SurrogateInputs {
                    seq_lens: &batch.seq_lens,
                    logprobs: &batch.logprobs,
                    old_logprobs: &batch.old_logprobs,
                    advantages: &prescaled,
                    ratio_mask: &batch.loss_mask,
                },
                &batch.loss_mask,
            );
            let skyrl_loss: f64 = skyrl.loss_t.iter().sum();
            assert!(
                (skyrl_loss - ours.loss).abs() < 1e-12,
                "{loss:?}/{reduction:?}"
            );
            for (a, b) in skyrl.dlogprobs_t.iter().zip(&ours.dlogprobs) {
                assert!((a - b).abs() < 1e-12, "{loss:?}/{reduction:?}");
            }
        }
    }
}

#[test]
fn first_update_of_one_epoch_has_zero_ppo_kl_and_clipfrac() {
    // update_epochs_per_batch = 1 and old log-probs recomputed with the same weights:
    // logπ == logπ_old, so every ratio is exactly 1.
    let mut batch = Batch::new();
    batch.logprobs = batch.old_logprobs.clone();
    for loss in LOSSES {
        let config = config(loss, LossReduction::TokenMean);
        let out = compute_policy_loss(&config, &batch.inputs(), &batch.norm());
        assert_eq!(out.metrics[names::POLICY_PPO_KL], 0.0, "{loss:?}");
        assert_eq!(out.metrics[names::POLICY_CLIPFRAC], 0.0, "{loss:?}");
    }
}

#[test]
fn masked_tokens_get_no_gradient() {
    let batch = Batch::new();
    let out = compute_policy_loss(
        &config(PolicyLoss::Regular, LossReduction::SequenceMean),
        &batch.inputs(),
        &batch.norm(),
    );
    for t in [6, 7, 8] {
        assert_eq!(
            (out.dlogprobs[t], out.dentropy[t], out.elementwise_loss[t]),
            (0.0, 0.0, 0.0)
        );
    }
}
