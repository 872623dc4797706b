//! Optimizer-step helpers: learning-rate schedules, global-norm clipping, skipping
//! non-finite steps. Steps count optimizer steps (one per mini-batch), not RL iterations.

use serde::{Deserialize, Serialize};

/// Learning-rate schedule shape after warmup (HF `get_scheduler` semantics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduleKind {
    /// Flat after warmup. HF's plain `constant` ignores warmup; floe always honours
    /// `warmup_steps`, which makes it HF's `constant_with_warmup` (SkyRL's default).
    #[serde(alias = "constant_with_warmup")]
    Constant,
    /// Linear decay from the peak to 0 at `total_steps`.
    Linear,
    /// Half-cosine decay from the peak to 0 at `total_steps`.
    Cosine,
}

/// Learning rate for the optimizer step that has `step` steps before it (0 for the first
/// step), as HF's `LambdaLR` gives it:
/// - warmup (`step < warmup_steps`): `base_lr · step / warmup_steps`, so the first step of a
///   warmup runs at 0;
/// - after warmup, with `p = (step − warmup)/(total − warmup)`: `constant` → `base_lr`,
///   `linear` → `base_lr · max(0, 1 − p)`, `cosine` → `base_lr · max(0, ½(1 + cos(π·p)))`.
///
/// Denominators are at least 1, as in HF.
pub fn lr_at(
    step: u64,
    kind: LrScheduleKind,
    base_lr: f64,
    warmup_steps: u64,
    total_steps: u64,
) -> f64 {
    if step < warmup_steps {
        return base_lr * step as f64 / warmup_steps.max(1) as f64;
    }
    let decay_steps = total_steps.saturating_sub(warmup_steps).max(1) as f64;
    let progress = (step - warmup_steps) as f64 / decay_steps;
    let factor = match kind {
        LrScheduleKind::Constant => 1.0,
        LrScheduleKind::Linear => (1.0 - progress).max(0.0),
        LrScheduleKind::Cosine => (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0),
    };
    base_lr * factor
}

/// Optimizer steps of a run: `training_steps × (train_batch_size / policy_mini_batch_size) ×
/// update_epochs_per_batch`, the `total_steps` of [`lr_at`].
pub fn num_optimizer_steps(
    training_steps: u64,
    train_batch_size: u64,
    policy_mini_batch_size: u64,
    update_epochs_per_batch: u64,
) -> u64 {
    training_steps * (train_batch_size / policy_mini_batch_size.max(1)) * update_epochs_per_batch
}

/// Global L2 norm from each parameter tensor's sum of squared gradients.
pub fn global_grad_norm(sq_sums: impl IntoIterator<Item = f64>) -> f64 {
    sq_sums.into_iter().sum::<f64>().sqrt()
}

/// Factor every gradient is multiplied by so the global norm is at most `max_norm`:
/// `min(1, max_norm/(total_norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`. The norm
/// reported as `policy/grad_norm` is `total_norm`, before clipping.
pub fn clip_coef(total_norm: f64, max_norm: f64) -> f64 {
    (max_norm / (total_norm + 1e-6)).min(1.0)
}

/// A step whose gradient norm is NaN or infinite is skipped: gradients are zeroed and
/// neither the optimizer nor the schedule advances.
pub fn should_skip_step(total_norm: f64) -> bool {
    !total_norm.is_finite()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_constant() {
        assert_eq!(lr_at(0, LrScheduleKind::Constant, 1e-3, 4, 100), 0.0);
        assert_eq!(lr_at(2, LrScheduleKind::Constant, 1e-3, 4, 100), 5e-4);
        assert_eq!(lr_at(4, LrScheduleKind::Constant, 1e-3, 4, 100), 1e-3);
        assert_eq!(lr_at(0, LrScheduleKind::Constant, 1e-3, 0, 100), 1e-3);
    }

    #[test]
    fn linear_and_cosine_decay() {
        // Warmup 2, total 12: p = (step − 2)/10.
        assert!((lr_at(7, LrScheduleKind::Linear, 1.0, 2, 12) - 0.5).abs() < 1e-15);
        assert_eq!(lr_at(12, LrScheduleKind::Linear, 1.0, 2, 12), 0.0);
        assert_eq!(lr_at(20, LrScheduleKind::Linear, 1.0, 2, 12), 0.0);
        assert!((lr_at(7, LrScheduleKind::Cosine, 1.0, 2, 12) - 0.5).abs() < 1e-15);
        assert_eq!(lr_at(2, LrScheduleKind::Cosine, 1.0, 2, 12), 1.0);
        // p = 0.25: ½(1 + cos(π/4)).
        let expect = 0.5 * (1.0 + (std::f64::consts::FRAC_PI_4).cos());
        assert!((lr_at(4, LrScheduleKind::Cosine, 1.0, 0, 16) - expect).abs() < 1e-15);
    }

    #[test]
    fn schedule_serde_names() {
        for (name, kind) in [
            ("\"constant\"", LrScheduleKind::Constant),
            ("\"constant_with_warmup\"", LrScheduleKind::Constant),
            ("\"linear\"", LrScheduleKind::Linear),
            ("\"cosine\"", LrScheduleKind::Cosine),
        ] {
            assert_eq!(serde_json::from_str::<LrScheduleKind>(name).unwrap(), kind);
        }
    }

    #[test]
    fn step_counting_and_clipping() {
        assert_eq!(num_optimizer_steps(10, 1024, 256, 2), 80);
        assert_eq!(global_grad_norm([9.0, 16.0]), 5.0);
        assert!((clip_coef(5.0, 1.0) - 1.0 / (5.0 + 1e-6)).abs() < 1e-15);
        assert_eq!(clip_coef(0.5, 1.0), 1.0);
        assert!(should_skip_step(f64::NAN));
        assert!(should_skip_step(f64::INFINITY));
        assert!(!should_skip_step(3.0));
    }
}
