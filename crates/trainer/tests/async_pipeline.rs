//! `trainer.pipeline` on tiny embedded runs with scripted rewards: one-step-off trains
//! step 1 exactly as sync does and later steps one step stale, drops samples beyond
//! `max_staleness` and counts them, replays bit for bit (resumed from a checkpoint too),
//! and leaves sync runs as they were.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use floe_env::env::{Env, EnvError, Registry, StepOutput};
use floe_trainer::checkpoint::{
    load_trainer_state, TrainerState, CHECKPOINTS_DIR, PENDING_BATCH_FILE,
};
use floe_trainer::outputs::metrics::read_metrics;
use floe_trainer::run::train_with_registry;
use floe_trainer::Config;

/// Samples per prompt.
const N: usize = 2;
/// Prompts per training batch.
const BATCH: usize = 4;

/// Rewards 1, 0, 1, 0, ... by the order environments are built in, so every group has a
/// learning signal.
struct Alternating {
    reward: f64,
}

impl Env for Alternating {
    fn step(&mut self, _action: &str) -> Result<StepOutput, EnvError> {
        Ok(StepOutput {
            reward: self.reward,
            done: true,
            ..StepOutput::default()
        })
    }
}

fn alternating_registry() -> Registry {
    let built = Arc::new(AtomicUsize::new(0));
    let mut registry = Registry::new();
    registry
        .register(
            floe_env::env::TEXT2SQL,
            Arc::new(move |_extras| {
                let c = built.fetch_add(1, Ordering::SeqCst);
                Ok(Box::new(Alternating {
                    reward: (c % 2 == 0) as u8 as f64,
                }) as Box<dyn Env>)
            }),
        )
        .unwrap();
    registry
}

/// The overrides of a run of `steps` RL steps of the embedded recipe in `run_dir`, no
/// warm start and no evals (only training rollouts build environments).
fn overrides(run_dir: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut overrides: Vec<String> = [
        format!("trainer.run_dir={}", run_dir.display()),
        "data.synthetic_train_size=32".into(),
        "data.synthetic_val_size=8".into(),
        "data.val_data=[]".into(),
        "trainer.eval_before_train=false".into(),
        format!("trainer.max_training_steps={steps}"),
        "trainer.max_prompt_length=1024".into(),
        format!("trainer.train_batch_size={BATCH}"),
        "trainer.policy_mini_batch_size=2".into(),
        "trainer.micro_train_batch_size_per_gpu=4".into(),
        "trainer.ckpt_interval=1".into(),
        "trainer.logger=[]".into(),
        // Large enough that a few steps move the weights visibly.
        "trainer.policy.optimizer_config.lr=1e-2".into(),
        "trainer.policy.optimizer_config.num_warmup_steps=0".into(),
        format!("generator.n_samples_per_prompt={N}"),
        "generator.sampling_params.max_generate_length=12".into(),
        "generator.sampling_params.temperature=1.0".into(),
        "sft.enabled=false".into(),
    ]
    .into_iter()
    .collect();
    overrides.extend(extra.iter().map(|s| s.to_string()));
    overrides
}

/// The metrics of each RL step of a fresh run.
fn run(run_dir: &Path, steps: u64, extra: &[&str]) -> Vec<BTreeMap<String, f64>> {
    let config = Config::load(None, &overrides(run_dir, steps, extra)).unwrap();
    let outcome = train_with_registry(&config, alternating_registry()).unwrap();
    assert_eq!(outcome.steps, steps);
    step_metrics(run_dir)
}

fn step_metrics(run_dir: &Path) -> Vec<BTreeMap<String, f64>> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r.step >= 1)
        .map(|r| r.metrics)
        .collect()
}

fn state(run_dir: &Path, step: u64) -> TrainerState {
    load_trainer_state(
        &run_dir
            .join(CHECKPOINTS_DIR)
            .join(format!("global_step_{step}")),
    )
    .unwrap()
}

/// A step's metrics without wall times, which no two runs share.
fn without_timings(metrics: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    metrics
        .iter()
        .filter(|(k, _)| !k.starts_with("timing/") && !k.ends_with("_s"))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// The keys whose values differ between two steps' metrics, with both values.
fn differences(
    a: &BTreeMap<String, f64>,
    b: &BTreeMap<String, f64>,
) -> Vec<(String, Option<f64>, Option<f64>)> {
    a.keys()
        .chain(b.keys())
        .filter(|k| a.get(*k).map(|v| v.to_bits()) != b.get(*k).map(|v| v.to_bits()))
        .map(|k| (k.clone(), a.get(k).copied(), b.get(k).copied()))
        .collect()
}

#[test]
fn one_step_off_trains_step_one_as_sync_does_and_later_steps_one_step_stale() {
    let dir = tempfile::tempdir().unwrap();
    let sync = run(&dir.path().join("sync"), 3, &[]);
    let off = run(
        &dir.path().join("off"),
        3,
        &["trainer.pipeline.mode=one_step_off"],
    );
    // Sync runs log no pipeline metrics.
    assert!(sync
        .iter()
        .flat_map(|m| m.keys())
        .all(|k| !k.starts_with("async/")));
    // Step 1 trains the same batch on the same weights: the next batch's sampling beside
    // it changes nothing.
    let pipeline_free = |m: &BTreeMap<String, f64>| {
        let mut m = without_timings(m);
        m.retain(|k, _| !k.starts_with("async/"));
        m
    };
    let step1 = differences(&pipeline_free(&sync[0]), &pipeline_free(&off[0]));
    assert!(step1.is_empty(), "step 1 differs: {step1:?}");
    // Step 2 trains prompts sampled by step 1's weights after step 1's two optimizer steps.
    assert_ne!(
        sync[1]["policy/final_loss"], off[1]["policy/final_loss"],
        "step 2 of one-step-off trains stale samples"
    );
    // Two mini-batches per step: staleness 0 and 1 in step 1, 2 and 3 after.
    assert_eq!(off[0]["async/staleness_mean"], 0.5);
    assert_eq!(off[0]["async/staleness_max"], 1.0);
    for step in &off[1..] {
        assert_eq!(step["async/staleness_mean"], 2.5);
        assert_eq!(step["async/staleness_max"], 3.0);
    }
    assert!(off.iter().all(|m| m["async/dropped_stale"] == 0.0));
    // Steps 1 and 2 sample their successor beside training; the last samples nothing.
    for step in &off[..2] {
        assert!(step["async/sample_next_s"] > 0.0);
        assert!(step["async/overlapped_s"] <= step["async/sample_next_s"]);
    }
    assert!(!off[2].contains_key("async/sample_next_s"));
    // Both runs took every optimizer step and walked the same prompts.
    let (sync_state, off_state) = (
        state(&dir.path().join("sync"), 3),
        state(&dir.path().join("off"), 3),
    );
    assert_eq!(off_state.optimizer_steps, 6);
    assert_eq!(sync_state.data_cursor, off_state.data_cursor);
}

#[test]
fn samples_beyond_max_staleness_are_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    // Four optimizer steps per step: step 2 trains at staleness 4, 5, then 6 and 7 are
    // over the bound.
    let off = run(
        &run_dir,
        2,
        &[
            "trainer.policy_mini_batch_size=1",
            "trainer.micro_train_batch_size_per_gpu=2",
            "trainer.pipeline.mode=one_step_off",
            "trainer.pipeline.max_staleness=5",
        ],
    );
    assert_eq!(off[0]["async/dropped_stale"], 0.0);
    assert_eq!(off[0]["async/staleness_mean"], 1.5);
    assert_eq!(off[0]["async/staleness_max"], 3.0);
    assert_eq!(off[1]["async/dropped_stale"], (2 * N) as f64);
    assert_eq!(off[1]["async/staleness_mean"], 4.5);
    assert_eq!(off[1]["async/staleness_max"], 5.0);
    // The dropped mini-batches took no optimizer step.
    assert_eq!(state(&run_dir, 2).optimizer_steps, 4 + 2);
}

#[test]
fn max_staleness_bounds_the_later_mini_batches_of_a_sync_step_too() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let sync = run(&run_dir, 1, &["trainer.pipeline.max_staleness=0"]);
    // Only the first of the two mini-batches is on-policy.
    assert_eq!(sync[0]["async/dropped_stale"], (2 * N) as f64);
    assert_eq!(sync[0]["async/staleness_max"], 0.0);
    assert_eq!(state(&run_dir, 1).optimizer_steps, 1);
}

#[test]
fn one_step_off_replays_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["trainer.pipeline.mode=one_step_off"];
    let first = run(&dir.path().join("a"), 2, &args);
    let second = run(&dir.path().join("b"), 2, &args);
    for (step, (a, b)) in first.iter().zip(&second).enumerate() {
        let diff = differences(&without_timings(a), &without_timings(b));
        assert!(diff.is_empty(), "step {} differs: {diff:?}", step + 1);
    }
}

#[test]
fn sync_named_or_by_default_logs_the_same_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let default = run(&dir.path().join("default"), 2, &[]);
    let named = run(
        &dir.path().join("named"),
        2,
        &["trainer.pipeline.mode=sync"],
    );
    for (a, b) in default.iter().zip(&named) {
        let diff = differences(&without_timings(a), &without_timings(b));
        assert!(diff.is_empty(), "{diff:?}");
    }
}

/// Keeps every checkpoint, so a test can resume from an early one.
const KEEP_ALL: &str = "trainer.max_ckpts_to_keep=-1";

/// Copies the run folder `from` to `to` (what a run killed after a checkpoint leaves).
fn copy_run(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_run(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Resumes the copy `to` of the 3-step run `from` at its step-1 checkpoint, after `edit`
/// changed that checkpoint; the metrics of every step, or the error.
fn resume_copy_at_step_1(
    from: &Path,
    to: &Path,
    edit: impl FnOnce(&Path),
) -> Result<Vec<BTreeMap<String, f64>>, String> {
    copy_run(from, to);
    let checkpoint = to.join(CHECKPOINTS_DIR).join("global_step_1");
    edit(&checkpoint);
    let resume = format!("trainer.resume={}", checkpoint.display());
    let extra = [
        KEEP_ALL,
        "trainer.pipeline.mode=one_step_off",
        resume.as_str(),
    ];
    let config = Config::load(None, &overrides(to, 3, &extra)).unwrap();
    train_with_registry(&config, alternating_registry()).map_err(|e| e.to_string())?;
    Ok(step_metrics(to))
}

#[test]
fn a_resumed_one_step_off_run_trains_the_saved_batch_and_replays_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let whole_dir = dir.path().join("whole");
    let whole = run(
        &whole_dir,
        3,
        &[KEEP_ALL, "trainer.pipeline.mode=one_step_off"],
    );
    let checkpoint = whole_dir.join(CHECKPOINTS_DIR).join("global_step_1");
    assert!(
        checkpoint.join(PENDING_BATCH_FILE).is_file(),
        "a one-step-off checkpoint holds the batch sampled ahead"
    );
    assert!(
        !whole_dir
            .join(CHECKPOINTS_DIR)
            .join("global_step_3")
            .join(PENDING_BATCH_FILE)
            .exists(),
        "the last step samples nothing ahead"
    );

    let resumed = resume_copy_at_step_1(&whole_dir, &dir.path().join("resumed"), |_| {}).unwrap();
    assert_eq!(resumed.len(), 3);
    for step in 1..3 {
        let diff = differences(
            &without_timings(&whole[step]),
            &without_timings(&resumed[step]),
        );
        assert!(diff.is_empty(), "step {} differs: {diff:?}", step + 1);
    }
    assert_eq!(
        state(&dir.path().join("resumed"), 3),
        TrainerState {
            metrics: state(&dir.path().join("resumed"), 3).metrics,
            ..state(&whole_dir, 3)
        }
    );
}

#[test]
fn a_checkpoint_without_the_batch_sampled_ahead_still_resumes_by_sampling_it_again() {
    let dir = tempfile::tempdir().unwrap();
    let whole_dir = dir.path().join("whole");
    let whole = run(
        &whole_dir,
        3,
        &[KEEP_ALL, "trainer.pipeline.mode=one_step_off"],
    );
    // A checkpoint as floe wrote it before it saved the batch: its cursor stands before
    // the batch, so the resume samples the same prompts with the checkpoint's weights.
    let old = dir.path().join("old");
    let resumed = resume_copy_at_step_1(&whole_dir, &old, |checkpoint| {
        std::fs::remove_file(checkpoint.join(PENDING_BATCH_FILE)).unwrap();
    })
    .unwrap();
    assert_eq!(state(&old, 3).data_cursor, state(&whole_dir, 3).data_cursor);
    // Step 2 trains a batch sampled by the weights it trains (staleness 0 and 1), not the
    // one step 1's weights sampled.
    assert_eq!(resumed[1]["async/staleness_max"], 1.0);
    assert_eq!(whole[1]["async/staleness_max"], 3.0);

    // A batch that is not this checkpoint's is refused, naming the file.
    let err = resume_copy_at_step_1(&whole_dir, &dir.path().join("mixed"), |checkpoint| {
        let step_2 = checkpoint.with_file_name("global_step_2");
        std::fs::copy(
            step_2.join(PENDING_BATCH_FILE),
            checkpoint.join(PENDING_BATCH_FILE),
        )
        .unwrap();
    })
    .unwrap_err();
    assert!(
        err.contains(PENDING_BATCH_FILE) && err.contains("another checkpoint"),
        "{err}"
    );
    let err = resume_copy_at_step_1(&whole_dir, &dir.path().join("torn"), |checkpoint| {
        std::fs::write(checkpoint.join(PENDING_BATCH_FILE), "{\"trajs\": [").unwrap();
    })
    .unwrap_err();
    assert!(
        err.contains(PENDING_BATCH_FILE) && err.contains("unreadable batch sampled ahead"),
        "{err}"
    );
}

#[test]
fn pipeline_settings_that_cannot_work_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |extra: &[&str]| {
        let config = Config::load(None, &overrides(dir.path(), 1, extra));
        match config {
            Err(err) => err.to_string(),
            Ok(config) => config.validate().unwrap_err().to_string(),
        }
    };
    let err = refused(&[
        "trainer.pipeline.mode=one_step_off",
        "trainer.pipeline.max_staleness=1",
    ]);
    assert!(
        err.contains("trainer.pipeline.max_staleness is 1") && err.contains("at least 2"),
        "{err}"
    );
    let err = refused(&[
        "trainer.pipeline.mode=one_step_off",
        "trainer.algorithm.off_policy_correction.tis_ratio_type=token",
        "generator.sampling_params.logprobs=0",
    ]);
    assert!(
        err.contains("generator.sampling_params.logprobs = 1"),
        "{err}"
    );
    let err = refused(&["trainer.pipeline.mode=two_steps_off"]);
    assert!(err.contains("trainer.pipeline.mode"), "{err}");
}
