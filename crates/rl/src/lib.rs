//! RL algorithm math as pure functions over slices: no I/O, no device code.
//!
//! What is here, following SkyRL/verl names and numbers:
//! - [`advantage`]: GRPO (with or without std normalisation), RLOO, REINFORCE++, MaxRL;
//!   outcome rewards broadcast over response tokens.
//! - [`policy_loss`]: PPO clip (`regular`, `dual_clip`), `gspo`, `cispo`,
//!   `importance_sampling`, `cross_entropy`; [`off_policy`]: masks and truncated importance
//!   sampling against the sampler's log-probs.
//! - [`reduction`]: `token_mean`, `sequence_mean`, `seq_mean_token_sum_norm`,
//!   `seq_mean_token_sum`, `prompt_mean` against mini-batch totals.
//! - [`kl`]: k1/abs/k2/k3 as a loss term or folded into the reward.
//! - [`dapo`]: which groups carry a learning signal (dynamic sampling) and the soft
//!   overlong punishment.
//! - [`tinker`]: Tinker's `forward_backward` losses with sum semantics.
//! - [`optim`]: LR schedules, grad-norm clipping; [`metrics`]: pass@k, summaries, metric names.
//!
//! How the trainer uses it, per optimizer step (mini-batch):
//! 1. once per batch: optionally [`kl::apply_kl_in_reward`], then rewards →
//!    [`compute_advantages`] (per token);
//! 2. [`GlobalNorm::of_mini_batch`] over the whole mini-batch;
//! 3. per micro-batch, the model's per-token log-probs and entropies →
//!    [`compute_policy_loss`] → [`LossOutput`] with `loss`, `dlogprobs` (dL/dlogπ_t) and
//!    `dentropy` (dL/dH_t), which the model's backward consumes. The micro-batch losses and
//!    gradients add up to those of the mini-batch in one call;
//! 4. [`metrics::reduce_micro_batch_metrics`], then [`optim::clip_coef`] and
//!    [`optim::lr_at`] for the step.

#![deny(missing_docs)]

pub mod advantage;
pub mod config;
pub mod dapo;
pub mod kl;
pub mod loss;
pub mod metrics;
pub mod off_policy;
pub mod optim;
pub mod policy_loss;
pub mod reduction;
pub mod tinker;

pub use advantage::{compute_advantages, AdvantageEstimator, AdvantageInputs};
pub use config::AlgorithmConfig;
pub use kl::KlEstimator;
pub use loss::{compute_policy_loss, LossInputs, LossOutput};
pub use policy_loss::PolicyLoss;
pub use reduction::{GlobalNorm, LossReduction};

/// Errors for configurations and inputs the math cannot use; each message names the field.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    /// An invalid `AlgorithmConfig` combination.
    #[error("invalid algorithm config: {0}")]
    Config(String),
    /// Inputs from outside (the Tinker server) that are missing or mis-shaped.
    #[error("invalid loss input: {0}")]
    Input(String),
}
