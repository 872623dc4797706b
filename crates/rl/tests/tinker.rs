//! Tinker losses: finite-difference gradients and sum semantics across datums.

mod common;

use common::values;
use floe_rl::tinker::{tinker_loss, TinkerInputs, TinkerLoss, TinkerLossConfig, LOSS_SUM_METRIC};

#[test]
fn tinker_gradients_match_finite_differences() {
    let seq_lens = [4, 3];
    let n = 7;
    let sampling = values(11, n, -3.0, -0.1);
    let logprobs: Vec<f64> = sampling
        .iter()
        .zip(values(12, n, -0.5, 0.5))
        .map(|(s, d)| s + d)
        .collect();
    // Prompt positions carry zero advantage; advantages vary within a datum.
    let advantages = [0.0, 0.8, 1.1, 0.6, 0.0, -0.9, -0.4];
    let ratio_mask = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0];
    let weights = values(13, n, -1.0, 1.0);
    let config = TinkerLossConfig::default();
    for loss in [
        TinkerLoss::CrossEntropy,
        TinkerLoss::ImportanceSampling,
        TinkerLoss::Ppo,
        TinkerLoss::Cispo,
        TinkerLoss::Gspo,
        TinkerLoss::Dro,
    ] {
        // CISPO stops the gradient through its ratio: differentiate with the ratio held
        // fixed by moving the sampling log-prob along.
        let eval = |lp: &[f64], sampling: &[f64]| {
            tinker_loss(
                loss,
                &config,
                &TinkerInputs {
                    seq_lens: &seq_lens,
                    logprobs: lp,
                    weights: Some(&weights),
                    sampling_logprobs: Some(sampling),
                    advantages: Some(&advantages),
                    sequence_ratio_mask: Some(&ratio_mask),
                },
            )
            .unwrap()
        };
        let out = eval(&logprobs, &sampling);
        assert_eq!(out.metrics[LOSS_SUM_METRIC], out.loss);
        assert!((out.elementwise_loss.iter().sum::<f64>() - out.loss).abs() < 1e-12);
        let h = 1e-6;
        for t in 0..n {
            let (mut plus, mut minus) = (logprobs.clone(), logprobs.clone());
            let (mut s_plus, mut s_minus) = (sampling.clone(), sampling.clone());
            plus[t] += h;
            minus[t] -= h;
            if loss == TinkerLoss::Cispo {
                s_plus[t] += h;
                s_minus[t] -= h;
            }
            let fd = (eval(&plus, &s_plus).loss - eval(&minus, &s_minus).loss) / (2.0 * h);
            assert!(
                (fd - out.dlogprobs[t]).abs() < 1e-7,
                "{loss:?}: dlogprobs[{t}] {} vs {fd}",
                out.dlogprobs[t]
            );
        }
    }
}

#[test]
fn datums_sum_without_normalisation() {
    // The same datum twice gives twice the loss: no averaging over datums or tokens.
    let one = TinkerInputs {
        seq_lens: &[2],
        logprobs: &[-1.0, -0.5],
        weights: None,
        sampling_logprobs: Some(&[-1.1, -0.4]),
        advantages: Some(&[1.0, 1.0]),
        sequence_ratio_mask: None,
    };
    let two = TinkerInputs {
        seq_lens: &[2, 2],
        logprobs: &[-1.0, -0.5, -1.0, -0.5],
        weights: None,
        sampling_logprobs: Some(&[-1.1, -0.4, -1.1, -0.4]),
        advantages: Some(&[1.0, 1.0, 1.0, 1.0]),
        sequence_ratio_mask: None,
    };
    let config = TinkerLossConfig::default();
    let a = tinker_loss(TinkerLoss::ImportanceSampling, &config, &one).unwrap();
    let b = tinker_loss(TinkerLoss::ImportanceSampling, &config, &two).unwrap();
    assert!((b.loss - 2.0 * a.loss).abs() < 1e-12);
    // −(e^{0.1} + e^{−0.1}).
    assert!((a.loss + 0.1f64.exp() + (-0.1f64).exp()).abs() < 1e-12);
}
