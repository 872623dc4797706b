//! `AlgorithmConfig`: spec defaults, strict parsing, validation.

use floe_rl::config::{DynamicSamplingType, KlControllerKind};
use floe_rl::{AdvantageEstimator, AlgorithmConfig, KlEstimator, LossReduction, PolicyLoss};

#[test]
fn empty_config_has_the_spec_defaults() {
    let config: AlgorithmConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(config, AlgorithmConfig::default());
    assert_eq!(config.advantage_estimator, AdvantageEstimator::Grpo);
    assert!(config.grpo_norm_by_std);
    assert_eq!(config.loss_reduction, LossReduction::TokenMean);
    assert!(config.use_kl_loss && !config.use_kl_in_reward);
    assert_eq!(config.kl_loss_coef, 0.001);
    assert_eq!(config.kl_estimator_type, KlEstimator::K3);
    assert_eq!((config.eps_clip_low, config.eps_clip_high), (0.2, 0.2));
    assert_eq!(config.policy_loss_type, PolicyLoss::Regular);
    assert_eq!(config.clip_ratio_c, 3.0);
    assert_eq!(config.kl_ctrl.kind, KlControllerKind::Fixed);
    assert_eq!(config.off_policy_correction.token_tis_ratio_clip_high, 2.0);
    assert_eq!(
        config.off_policy_correction.sequence_tis_ratio_clip_high,
        5.0
    );
    config.validate().unwrap();
}

#[test]
fn names_and_aliases_parse() {
    let config: AlgorithmConfig = serde_json::from_str(
        r#"{"advantage_estimator": "rloo", "policy_loss_type": "gspo",
            "loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 1024,
            "kl_estimator_type": "low_var_kl", "eps_clip_high": 0.28,
            "kl_ctrl": {"type": "adaptive"},
            "off_policy_correction": {"tis_ratio_type": "token"}}"#,
    )
    .unwrap();
    assert_eq!(config.advantage_estimator, AdvantageEstimator::Rloo);
    assert_eq!(config.kl_estimator_type, KlEstimator::K3);
    assert_eq!(config.kl_ctrl.kind, KlControllerKind::Adaptive);
    assert!(config.off_policy_correction.is_enabled());
    config.validate().unwrap();
}

#[test]
fn unknown_keys_are_rejected() {
    let err = serde_json::from_str::<AlgorithmConfig>(r#"{"eps_clip_hgih": 0.3}"#).unwrap_err();
    assert!(err.to_string().contains("eps_clip_hgih"), "{err}");
    let err = serde_json::from_str::<AlgorithmConfig>(r#"{"off_policy_correction": {"tis": 1}}"#)
        .unwrap_err();
    assert!(err.to_string().contains("tis"), "{err}");
}

#[test]
fn validation_rejects_impossible_combinations() {
    let both_kl = AlgorithmConfig {
        use_kl_in_reward: true,
        ..AlgorithmConfig::default()
    };
    assert!(both_kl
        .validate()
        .unwrap_err()
        .to_string()
        .contains("mutually exclusive"));
    let no_len = AlgorithmConfig {
        loss_reduction: LossReduction::SeqMeanTokenSumNorm,
        ..AlgorithmConfig::default()
    };
    assert!(no_len
        .validate()
        .unwrap_err()
        .to_string()
        .contains("max_seq_len"));
    let bad_c = AlgorithmConfig {
        policy_loss_type: PolicyLoss::DualClip,
        clip_ratio_c: 1.0,
        ..AlgorithmConfig::default()
    };
    assert!(bad_c.validate().is_err());
    let mut bad_mask = AlgorithmConfig::default();
    bad_mask.off_policy_correction.token_mask_is_threshold_low = Some(2.0);
    bad_mask.off_policy_correction.token_mask_is_threshold_high = Some(1.0);
    assert!(bad_mask
        .validate()
        .unwrap_err()
        .to_string()
        .contains("token_mask_is_threshold"));
}

#[test]
fn dapo_sections_parse_default_off_and_name_their_keys() {
    let config = AlgorithmConfig::default();
    assert_eq!(config.dynamic_sampling.kind, None);
    assert_eq!(config.overlong_buffer.len, 0);
    let config: AlgorithmConfig = serde_json::from_str(
        r#"{"dynamic_sampling": {"type": "filter", "max_sample_batches": 4},
            "overlong_buffer": {"len": 64, "penalty_factor": 0.5}}"#,
    )
    .unwrap();
    assert_eq!(
        config.dynamic_sampling.kind,
        Some(DynamicSamplingType::Filter)
    );
    assert_eq!(config.dynamic_sampling.max_sample_batches, 4);
    assert_eq!(config.overlong_buffer.len, 64);
    config.validate().unwrap();

    let mut no_batches = config.clone();
    no_batches.dynamic_sampling.max_sample_batches = 0;
    let err = no_batches.validate().unwrap_err().to_string();
    assert!(err.contains("dynamic_sampling.max_sample_batches"), "{err}");
    let mut negative = config;
    negative.overlong_buffer.penalty_factor = -1.0;
    let err = negative.validate().unwrap_err().to_string();
    assert!(err.contains("overlong_buffer.penalty_factor"), "{err}");
}
