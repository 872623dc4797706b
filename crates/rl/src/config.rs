//! `AlgorithmConfig`: the `trainer.algorithm.*` block, with SkyRL's key names and defaults.

use serde::{Deserialize, Serialize};

use crate::advantage::AdvantageEstimator;
use crate::kl::KlEstimator;
use crate::policy_loss::PolicyLoss;
use crate::reduction::LossReduction;
use crate::RlError;

/// Every knob of the RL math. Unknown keys are rejected so a typo in an override fails loudly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// How advantages are estimated from rewards.
    pub advantage_estimator: AdvantageEstimator,
    /// GRPO: divide by the group std (`false` is Dr. GRPO's plain mean-centring).
    pub grpo_norm_by_std: bool,
    /// Global z-score of the advantages over response tokens, after the estimator.
    pub advantage_batch_normalize: bool,
    /// Discount of REINFORCE++ returns.
    pub gamma: f64,
    /// Zero the loss mask of groups whose rewards are all equal (they carry no signal).
    pub zero_variance_filter: bool,
    /// Per-token surrogate.
    pub policy_loss_type: PolicyLoss,
    /// PPO ratio lower clip: `r >= 1 - eps_clip_low`.
    pub eps_clip_low: f64,
    /// PPO ratio upper clip: `r <= 1 + eps_clip_high` (DAPO clip-higher sets it above `eps_clip_low`).
    pub eps_clip_high: f64,
    /// Dual-clip bound `c`: for negative advantages the loss is at most `-c·A`.
    pub clip_ratio_c: f64,
    /// CISPO's ratio clip range.
    pub cispo: CispoConfig,
    /// How per-token losses become one scalar per mini-batch.
    pub loss_reduction: LossReduction,
    /// Constant length `L` of `seq_mean_token_sum_norm`; required by it.
    pub max_seq_len: Option<usize>,
    /// Add `kl_loss_coef · KL(π‖π_ref)` to the loss.
    pub use_kl_loss: bool,
    /// Coefficient of the KL loss, and the fixed KL-in-reward coefficient.
    pub kl_loss_coef: f64,
    /// Estimator of the per-token KL, for both placements.
    pub kl_estimator_type: KlEstimator,
    /// Subtract `β · kl_t` from each token's reward instead of adding a KL loss.
    pub use_kl_in_reward: bool,
    /// How β evolves when the KL is in the reward.
    pub kl_ctrl: KlControllerConfig,
    /// Entropy bonus: the loss becomes `loss - entropy_coeff · entropy`. 0 turns it off.
    pub entropy_coeff: f64,
    /// Corrections for the gap between rollout (sampler) and training log-probs.
    pub off_policy_correction: OffPolicyCorrection,
    /// DAPO dynamic sampling: drop the groups whose rewards are all equal and sample more
    /// prompts until the batch is full (the trainer's loop; off by default).
    pub dynamic_sampling: DynamicSamplingConfig,
    /// DAPO soft overlong punishment of responses near the length limit (off by default).
    pub overlong_buffer: OverlongBufferConfig,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            advantage_estimator: AdvantageEstimator::Grpo,
            grpo_norm_by_std: true,
            advantage_batch_normalize: false,
            gamma: 1.0,
            zero_variance_filter: false,
            policy_loss_type: PolicyLoss::Regular,
            eps_clip_low: 0.2,
            eps_clip_high: 0.2,
            clip_ratio_c: 3.0,
            cispo: CispoConfig::default(),
            loss_reduction: LossReduction::TokenMean,
            max_seq_len: None,
            use_kl_loss: true,
            kl_loss_coef: 0.001,
            kl_estimator_type: KlEstimator::K3,
            use_kl_in_reward: false,
            kl_ctrl: KlControllerConfig::default(),
            entropy_coeff: 0.0,
            off_policy_correction: OffPolicyCorrection::default(),
            dynamic_sampling: DynamicSamplingConfig::default(),
            overlong_buffer: OverlongBufferConfig::default(),
        }
    }
}

impl AlgorithmConfig {
    /// Checks the combinations the math cannot run with; call it once after parsing.
    pub fn validate(&self) -> Result<(), RlError> {
        if self.use_kl_loss && self.use_kl_in_reward {
            return Err(RlError::Config(
                "use_kl_loss and use_kl_in_reward are mutually exclusive; set one of them to false"
                    .into(),
            ));
        }
        if self.loss_reduction == LossReduction::SeqMeanTokenSumNorm && self.max_seq_len.is_none() {
            return Err(RlError::Config(
                "loss_reduction=seq_mean_token_sum_norm requires max_seq_len".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.eps_clip_low) || self.eps_clip_high < 0.0 {
            return Err(RlError::Config(format!(
                "eps_clip_low must be in [0, 1] and eps_clip_high >= 0 (got {} and {})",
                self.eps_clip_low, self.eps_clip_high
            )));
        }
        if self.policy_loss_type == PolicyLoss::DualClip && self.clip_ratio_c <= 1.0 {
            return Err(RlError::Config(format!(
                "clip_ratio_c must be > 1 for dual_clip (got {})",
                self.clip_ratio_c
            )));
        }
        if !(0.0..=1.0).contains(&self.gamma) {
            return Err(RlError::Config(format!(
                "gamma must be in [0, 1] (got {})",
                self.gamma
            )));
        }
        if self.dynamic_sampling.kind.is_some() && self.dynamic_sampling.max_sample_batches == 0 {
            return Err(RlError::Config(
                "dynamic_sampling.max_sample_batches is 0; it is the most batches of prompts a \
                 step samples, at least 1"
                    .into(),
            ));
        }
        let ratio = self.dynamic_sampling.min_replace_ratio;
        if !(0.0..1.0).contains(&ratio) {
            return Err(RlError::Config(format!(
                "dynamic_sampling.min_replace_ratio is {ratio}; it must be in [0, 1) (the share \
                 of groups with a learning signal above which the rest are replaced)"
            )));
        }
        let factor = self.overlong_buffer.penalty_factor;
        if !(factor.is_finite() && factor >= 0.0) {
            return Err(RlError::Config(format!(
                "overlong_buffer.penalty_factor is {factor}; it must be a finite number >= 0"
            )));
        }
        self.off_policy_correction.validate()
    }
}

/// What dynamic sampling does with groups that carry no learning signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DynamicSamplingType {
    /// DAPO's (verl's `filter_groups`): drop them and sample further batches of prompts
    /// until `train_batch_size` groups with a signal are kept.
    Filter,
    /// SkyRL's (after POLARIS): when more than `min_replace_ratio` of the batch's groups
    /// carry a signal, replace the others with copies of those; otherwise sample another
    /// batch ([`crate::dapo::replacement_groups`]).
    Replace,
}

/// `dynamic_sampling.*` (SkyRL's keys; verl's `algorithm.filter_groups`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicSamplingConfig {
    /// `"filter"` or `"replace"`, or unset for off.
    #[serde(rename = "type")]
    pub kind: Option<DynamicSamplingType>,
    /// Most batches of prompts one step samples, the first included (verl's
    /// `max_num_gen_batches`); a step that reaches it trains on the groups it kept
    /// (`replace`: on its last batch as sampled).
    pub max_sample_batches: usize,
    /// `replace`: the share of a batch's groups that must carry a signal before the others
    /// are replaced by copies of them (SkyRL's default 0.3).
    pub min_replace_ratio: f64,
}

impl Default for DynamicSamplingConfig {
    fn default() -> Self {
        Self {
            kind: None,
            max_sample_batches: 30,
            min_replace_ratio: 0.3,
        }
    }
}

/// `overlong_buffer.*` (verl's `reward_model.overlong_buffer`): a response longer than
/// `max_generate_length - len` tokens loses up to `penalty_factor` reward, linearly
/// ([`crate::dapo::overlong_penalty`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverlongBufferConfig {
    /// Tokens before the length limit over which the penalty grows; 0 is off.
    pub len: usize,
    /// The penalty at the limit.
    pub penalty_factor: f64,
}

impl Default for OverlongBufferConfig {
    fn default() -> Self {
        Self {
            len: 0,
            penalty_factor: 1.0,
        }
    }
}

/// CISPO clips the (stop-gradient) ratio to `[1 - low, 1 + high]`; the defaults leave it
/// unbounded below, as the CISPO paper does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CispoConfig {
    /// Lower clip offset.
    pub cispo_eps_clip_low: f64,
    /// Upper clip offset.
    pub cispo_eps_clip_high: f64,
}

impl Default for CispoConfig {
    fn default() -> Self {
        Self {
            cispo_eps_clip_low: 1.0,
            cispo_eps_clip_high: 4.0,
        }
    }
}

/// The KL-in-reward coefficient controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlControllerKind {
    /// β stays at `kl_loss_coef`.
    Fixed,
    /// β moves toward `kl_target` (proportional control).
    Adaptive,
}

/// `kl_ctrl.*`: how β is chosen when `use_kl_in_reward` is on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlControllerConfig {
    /// Fixed or adaptive.
    #[serde(rename = "type")]
    pub kind: KlControllerKind,
    /// Adaptive: the KL the controller steers toward.
    pub kl_target: f64,
    /// Adaptive: samples over which a full correction is spread.
    pub horizon: f64,
}

impl Default for KlControllerConfig {
    fn default() -> Self {
        Self {
            kind: KlControllerKind::Fixed,
            kl_target: 0.1,
            horizon: 10000.0,
        }
    }
}

/// Granularity of truncated importance sampling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TisRatioType {
    /// Multiply each token's loss by `min(ρ_t, token_tis_ratio_clip_high)`.
    Token,
    /// Multiply every token of a sequence by `min(Π_t ρ_t, sequence_tis_ratio_clip_high)`.
    Sequence,
}

/// Which sequence statistic of ρ decides whether a sequence is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SequenceMaskMetric {
    /// `exp(mean_t log ρ_t)` within `[geo_mask_low, geo_mask_high]`.
    Geometric,
    /// `exp(Σ_t log ρ_t)` within `[product_mask_low, product_mask_high]`.
    Product,
}

/// `off_policy_correction.*`: with `ρ_t = exp(logπ_old − logπ_rollout)`, masks and truncated
/// importance weights applied to each per-token loss, in the order the fields are listed.
/// Everything is off by default; it only acts when rollout log-probs are supplied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OffPolicyCorrection {
    /// Drop a whole sequence if any valid token has ρ below this.
    pub outlier_token_is_threshold_low: Option<f64>,
    /// Drop a whole sequence if any valid token has ρ above this.
    pub outlier_token_is_threshold_high: Option<f64>,
    /// Zero single tokens whose ρ is below this.
    pub token_mask_is_threshold_low: Option<f64>,
    /// Zero single tokens whose ρ is above this.
    pub token_mask_is_threshold_high: Option<f64>,
    /// Truncated importance sampling; `None` is off.
    pub tis_ratio_type: Option<TisRatioType>,
    /// Cap of the token-level TIS weight.
    pub token_tis_ratio_clip_high: f64,
    /// Cap of the sequence-level TIS weight.
    pub sequence_tis_ratio_clip_high: f64,
    /// Sequence mask; `None` is off.
    pub sequence_mask_metric: Option<SequenceMaskMetric>,
    /// Geometric mask lower bound.
    pub geo_mask_low: f64,
    /// Geometric mask upper bound.
    pub geo_mask_high: f64,
    /// Product mask lower bound.
    pub product_mask_low: f64,
    /// Product mask upper bound.
    pub product_mask_high: f64,
}

impl Default for OffPolicyCorrection {
    fn default() -> Self {
        Self {
            outlier_token_is_threshold_low: None,
            outlier_token_is_threshold_high: None,
            token_mask_is_threshold_low: None,
            token_mask_is_threshold_high: None,
            tis_ratio_type: None,
            token_tis_ratio_clip_high: 2.0,
            sequence_tis_ratio_clip_high: 5.0,
            sequence_mask_metric: None,
            geo_mask_low: 0.99,
            geo_mask_high: 1.01,
            product_mask_low: 0.5,
            product_mask_high: 2.0,
        }
    }
}

impl OffPolicyCorrection {
    /// Whether any correction would change the loss.
    pub fn is_enabled(&self) -> bool {
        self.outlier_token_is_threshold_low.is_some()
            || self.outlier_token_is_threshold_high.is_some()
            || self.token_mask_is_threshold_low.is_some()
            || self.token_mask_is_threshold_high.is_some()
            || self.tis_ratio_type.is_some()
            || self.sequence_mask_metric.is_some()
    }

    fn validate(&self) -> Result<(), RlError> {
        let pairs = [
            (
                "outlier_token_is_threshold",
                self.outlier_token_is_threshold_low,
                self.outlier_token_is_threshold_high,
            ),
            (
                "token_mask_is_threshold",
                self.token_mask_is_threshold_low,
                self.token_mask_is_threshold_high,
            ),
            (
                "geo_mask",
                Some(self.geo_mask_low),
                Some(self.geo_mask_high),
            ),
            (
                "product_mask",
                Some(self.product_mask_low),
                Some(self.product_mask_high),
            ),
        ];
        for (name, low, high) in pairs {
            if let (Some(low), Some(high)) = (low, high) {
                if low > high {
                    return Err(RlError::Config(format!(
                        "off_policy_correction.{name}_low ({low}) is above {name}_high ({high})"
                    )));
                }
            }
        }
        if self.token_tis_ratio_clip_high <= 0.0 || self.sequence_tis_ratio_clip_high <= 0.0 {
            return Err(RlError::Config(
                "off_policy_correction TIS caps must be positive".into(),
            ));
        }
        Ok(())
    }
}
