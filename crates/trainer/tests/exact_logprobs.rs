//! `engine.exact_logprobs` on a very small embedded run: each step takes its old log-probs
//! from the sampler instead of a forward, the first update's ratio is exactly 1, and the
//! same seed gives the same metrics twice.

use std::collections::BTreeMap;
use std::path::Path;

use floe_trainer::outputs::metrics::read_metrics;
use floe_trainer::run::train;
use floe_trainer::Config;

/// Two GRPO steps of one mini-batch each on the tiny embedded model, exact log-probs.
fn run(run_dir: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    let overrides: Vec<String> = vec![
        format!("trainer.run_dir={}", run_dir.display()),
        "engine.exact_logprobs=true".into(),
        "data.synthetic_train_size=16".into(),
        "data.synthetic_val_size=4".into(),
        "trainer.max_training_steps=2".into(),
        "trainer.max_prompt_length=1024".into(),
        "trainer.train_batch_size=4".into(),
        "trainer.policy_mini_batch_size=4".into(),
        "trainer.micro_train_batch_size_per_gpu=2".into(),
        "trainer.eval_before_train=false".into(),
        "trainer.eval_interval=-1".into(),
        "trainer.ckpt_interval=-1".into(),
        "trainer.logger=[]".into(),
        "generator.n_samples_per_prompt=3".into(),
        "generator.sampling_params.max_generate_length=16".into(),
        "sft.enabled=false".into(),
    ];
    let config = Config::load(None, &overrides).unwrap();
    train(&config).unwrap();
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|r| (r.step, r.metrics))
        .collect()
}

#[test]
fn exact_runs_skip_the_old_logprob_forward_and_replay_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let first = run(&dir.path().join("a"));
    let steps: Vec<&BTreeMap<String, f64>> = first
        .iter()
        .filter(|(step, m)| *step > 0 && m.contains_key("policy/ppo_kl"))
        .map(|(_, m)| m)
        .collect();
    assert_eq!(steps.len(), 2);
    for m in &steps {
        // One mini-batch a step: its update is the first, at the sampling weights.
        assert_eq!(m["policy/ppo_log_ratio_abs_max"], 0.0, "{m:?}");
        assert_eq!(m["policy/ppo_kl"], 0.0);
        assert_eq!(m["policy/clipfrac"], 0.0);
        assert_eq!(m["policy/rollout_train_logprobs_abs_diff_max"], 0.0);
    }

    let second = run(&dir.path().join("b"));
    assert_eq!(without_timing(&first), without_timing(&second));
}

/// Each step's metrics but wall times, as bits.
fn without_timing(records: &[(u64, BTreeMap<String, f64>)]) -> Vec<(u64, BTreeMap<&str, u64>)> {
    records
        .iter()
        .map(|(step, m)| {
            let m = m
                .iter()
                .filter(|(k, _)| !k.starts_with("timing/") && !k.contains("per_second"))
                .map(|(k, v)| (k.as_str(), v.to_bits()))
                .collect();
            (*step, m)
        })
        .collect()
}
