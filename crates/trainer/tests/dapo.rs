//! DAPO on a tiny embedded run with scripted rewards: dynamic sampling drops the groups
//! whose rewards are all equal and samples more prompts until the batch is full, up to its
//! cap (or, `replace`, copies groups with a signal into the places of those without);
//! overlong filtering and the soft overlong punishment shape truncated responses.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use floe_env::env::{Env, EnvError, Registry, StepOutput};
use floe_trainer::checkpoint::{load_trainer_state, CHECKPOINTS_DIR};
use floe_trainer::outputs::metrics::read_metrics;
use floe_trainer::run::train_with_registry;
use floe_trainer::Config;

/// Samples per prompt.
const N: usize = 2;
/// Prompts per training batch.
const BATCH: usize = 4;

/// Rewards by the order environments are built in, which is (prompt, sample) within a
/// batch: the even groups of every batch are all correct (reward 1 for each sample), the
/// odd ones alternate 1, 0 over their samples.
struct Scripted {
    reward: f64,
}

impl Env for Scripted {
    fn step(&mut self, _action: &str) -> Result<StepOutput, EnvError> {
        Ok(StepOutput {
            reward: self.reward,
            done: true,
            ..StepOutput::default()
        })
    }
}

fn scripted_registry() -> Registry {
    registry_of(|c| {
        let all_correct = (c / N) % 2 == 0;
        if all_correct || c % 2 == 0 {
            1.0
        } else {
            0.0
        }
    })
}

/// A registry whose `c`-th environment built rewards `reward(c)`.
fn registry_of(reward: fn(usize) -> f64) -> Registry {
    let built = Arc::new(AtomicUsize::new(0));
    let mut registry = Registry::new();
    // The synthetic rows name the `text2sql` environment; the scripted one stands in.
    registry
        .register(
            floe_env::env::TEXT2SQL,
            Arc::new(move |_extras| {
                let c = built.fetch_add(1, Ordering::SeqCst);
                Ok(Box::new(Scripted { reward: reward(c) }) as Box<dyn Env>)
            }),
        )
        .unwrap();
    registry
}

/// Two RL steps of the embedded recipe, no warm start and no evals (only training
/// rollouts build environments), scored by [`scripted_registry`].
fn run(run_dir: &Path, extra: &[&str]) -> Vec<BTreeMap<String, f64>> {
    run_with(run_dir, extra, scripted_registry())
}

fn run_with(run_dir: &Path, extra: &[&str], registry: Registry) -> Vec<BTreeMap<String, f64>> {
    let mut overrides: Vec<String> = [
        format!("trainer.run_dir={}", run_dir.display()),
        "data.synthetic_train_size=32".into(),
        "data.synthetic_val_size=8".into(),
        "data.val_data=[]".into(),
        "trainer.eval_before_train=false".into(),
        "trainer.max_training_steps=2".into(),
        "trainer.max_prompt_length=1024".into(),
        format!("trainer.train_batch_size={BATCH}"),
        "trainer.policy_mini_batch_size=2".into(),
        "trainer.micro_train_batch_size_per_gpu=4".into(),
        "trainer.ckpt_interval=2".into(),
        "trainer.logger=[]".into(),
        format!("generator.n_samples_per_prompt={N}"),
        "generator.sampling_params.max_generate_length=16".into(),
        "generator.sampling_params.temperature=1.0".into(),
        "sft.enabled=false".into(),
    ]
    .into_iter()
    .collect();
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let config = Config::load(None, &overrides).unwrap();
    let outcome = train_with_registry(&config, registry).unwrap();
    assert_eq!(outcome.steps, 2);
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r.step >= 1)
        .map(|r| r.metrics)
        .collect()
}

fn state(run_dir: &Path) -> floe_trainer::checkpoint::TrainerState {
    load_trainer_state(&run_dir.join(CHECKPOINTS_DIR).join("global_step_2")).unwrap()
}

#[test]
fn dynamic_sampling_drops_all_correct_groups_and_refills_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run(
        dir.path(),
        &["trainer.algorithm.dynamic_sampling.type=\"filter\""],
    );
    assert_eq!(steps.len(), 2);
    for m in &steps {
        // Each batch of 4 prompts keeps its 2 mixed groups: two batches fill the step.
        assert_eq!(m["dynamic_sampling/num_gen_batches"], 2.0, "{m:?}");
        assert_eq!(m["dynamic_sampling/num_sampled_groups"], 8.0);
        assert_eq!(m["dynamic_sampling/num_filtered_groups"], 4.0);
        assert_eq!(m["dynamic_sampling/filtered_groups_frac"], 0.5);
        assert_eq!(m["dynamic_sampling/num_trained_groups"], BATCH as f64);
        // Rewards are reported over every sampled group: 4 all-correct, 4 half-correct.
        assert_eq!(m["reward/avg_raw_reward"], 0.75);
        assert_eq!(m["generate/batch_num_seq"], (2 * BATCH * N) as f64);
        // Only groups with a signal trained: every trained token has a non-zero advantage
        // of the same size (a 1/0 pair is ±a).
        let abs = m["loss/avg_raw_advantages_abs"];
        assert!(abs > 0.5, "{abs}");
        assert!((m["loss/avg_raw_advantages"]).abs() < abs);
    }
    let state = state(dir.path());
    // Two full batches per step: two mini-batches of 2 prompts each, and 16 prompts read.
    assert_eq!(state.optimizer_steps, 4);
    assert_eq!(state.data_cursor.position, 2 * 2 * BATCH);
}

#[test]
fn dynamic_sampling_stops_at_its_cap_and_trains_on_the_groups_it_kept() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run(
        dir.path(),
        &[
            "trainer.algorithm.dynamic_sampling.type=\"filter\"",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=1",
        ],
    );
    for m in &steps {
        assert_eq!(m["dynamic_sampling/num_gen_batches"], 1.0, "{m:?}");
        assert_eq!(m["dynamic_sampling/filtered_groups_frac"], 0.5);
        assert_eq!(m["dynamic_sampling/num_trained_groups"], 2.0);
    }
    let state = state(dir.path());
    // A short batch of 2 prompts is one mini-batch; one batch of 4 prompts read a step.
    assert_eq!(state.optimizer_steps, 2);
    assert_eq!(state.data_cursor.position, 2 * BATCH);
}

#[test]
fn a_step_with_no_signal_in_any_batch_skips_its_update() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run_with(
        dir.path(),
        &[
            "trainer.algorithm.dynamic_sampling.type=\"filter\"",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=2",
        ],
        registry_of(|_| 1.0),
    );
    for m in &steps {
        assert_eq!(m["dynamic_sampling/num_gen_batches"], 2.0, "{m:?}");
        assert_eq!(m["dynamic_sampling/filtered_groups_frac"], 1.0);
        assert_eq!(m["dynamic_sampling/num_trained_groups"], 0.0);
        assert_eq!(m["reward/avg_raw_reward"], 1.0);
        assert!(!m.contains_key("policy/grad_norm"), "{m:?}");
    }
    assert_eq!(state(dir.path()).optimizer_steps, 0);
}

#[test]
fn overlong_shaping_penalises_and_masks_truncated_responses() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run(
        dir.path(),
        &[
            "generator.apply_overlong_filtering=true",
            "trainer.algorithm.overlong_buffer.len=8",
            "trainer.algorithm.overlong_buffer.penalty_factor=0.5",
        ],
    );
    let mut truncated_any = false;
    for m in &steps {
        assert!(
            !m.keys().any(|k| k.starts_with("dynamic_sampling/")),
            "dynamic sampling is off: {m:?}"
        );
        let truncated = m["overlong/truncated_frac"];
        let sequences = (BATCH * N) as f64;
        truncated_any |= truncated > 0.0;
        // Every truncated response is masked out of the loss ...
        assert_eq!(m["overlong/num_filtered"], truncated * sequences);
        // ... and, at the limit of 16 tokens with a buffer of 8, loses the full 0.5.
        let penalty = m["overlong/penalty_mean"];
        assert!(
            penalty <= -0.5 * truncated + 1e-12,
            "{penalty} vs {truncated}"
        );
        assert!(penalty >= -0.5);
        // The penalty is part of the reward: the scripted rewards average 0.75.
        let reward = m["reward/avg_raw_reward"];
        assert!(
            (reward - (0.75 + penalty)).abs() < 1e-9,
            "{reward} {penalty}"
        );
    }
    assert!(
        truncated_any,
        "an untrained model runs to 16 tokens at least once in 16 samples"
    );
}

#[test]
fn replace_sampling_fills_silent_groups_with_copies_of_groups_with_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run(
        dir.path(),
        &["trainer.algorithm.dynamic_sampling.type=\"replace\""],
    );
    for m in &steps {
        // Half of each batch's groups carry a signal (0.5 > 0.3): one batch, its 2 silent
        // groups replaced, a full batch trained.
        assert_eq!(m["dynamic_sampling/num_gen_batches"], 1.0, "{m:?}");
        assert_eq!(m["dynamic_sampling/num_sampled_groups"], BATCH as f64);
        assert_eq!(m["dynamic_sampling/num_replaced_groups"], 2.0);
        assert_eq!(m["dynamic_sampling/num_trained_groups"], BATCH as f64);
        // Rollout metrics cover the batch as sampled.
        assert_eq!(m["reward/avg_raw_reward"], 0.75);
        // Every trained group is a 1/0 pair: every advantage is ±a.
        let abs = m["loss/avg_raw_advantages_abs"];
        assert!(abs > 0.5, "{abs}");
        assert!(
            (m["loss/avg_raw_advantages"]).abs() < 1e-9 * abs.max(1.0),
            "{m:?}"
        );
    }
    let state = state(dir.path());
    assert_eq!(state.optimizer_steps, 4);
    assert_eq!(state.data_cursor.position, 2 * BATCH);
}

#[test]
fn replace_sampling_samples_again_below_its_ratio_and_trains_the_last_batch_at_its_cap() {
    let dir = tempfile::tempdir().unwrap();
    let steps = run(
        dir.path(),
        &[
            "trainer.algorithm.dynamic_sampling.type=\"replace\"",
            // Half the groups carry a signal, which is not more than half.
            "trainer.algorithm.dynamic_sampling.min_replace_ratio=0.5",
            "trainer.algorithm.dynamic_sampling.max_sample_batches=2",
        ],
    );
    for m in &steps {
        assert_eq!(m["dynamic_sampling/num_gen_batches"], 2.0, "{m:?}");
        assert_eq!(m["dynamic_sampling/num_sampled_groups"], 8.0);
        assert_eq!(m["dynamic_sampling/num_replaced_groups"], 0.0);
        assert_eq!(m["dynamic_sampling/num_trained_groups"], BATCH as f64);
    }
    let state = state(dir.path());
    assert_eq!(state.optimizer_steps, 4);
    assert_eq!(state.data_cursor.position, 2 * 2 * BATCH);
}
