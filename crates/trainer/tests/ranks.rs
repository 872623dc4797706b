//! The RL loop across ranks: world sizes 1, 2 and 4 as threads of this process over
//! `InProcessCollective`, on the embedded tiny model with rewards scripted from the
//! response text. A run at several ranks trains as one process does (metrics and
//! weights), only rank 0 writes the run's files, groups stay whole on a rank, and a run
//! resumes from rank 0's checkpoint.
//!
//! Tolerance: the engine's DDP bounds for the f32 backend at 4 ranks
//! (`crates/engine/tests/ddp.rs`): 1e-6 relative on metrics, 2e-5 on the weights. The
//! f32 CPU products round differently for other batch shapes (`docs/benchmarks.md`), so a
//! rank's share of the log-prob forwards differs from one process's whole batch in the
//! last bits, and metrics that are means over micro-batches add them in another order.
//! Measured: at most 4e-8 (`policy/loss_metrics/is_ratio_*`,
//! `policy/rollout_train_logprobs_abs_diff_mean`), everything else and the weights equal;
//! one rank through the group equals the plain run bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use floe_backend::InProcessCollective;
use floe_dist::World;
use floe_engine::{DataParallelGroup, RankExchange, TrainGroup, TrainResponse};
use floe_env::env::{Env, EnvError, Registry, StepOutput};
use floe_model::weights::load_model_dir;
use floe_trainer::checkpoint::CHECKPOINTS_DIR;
use floe_trainer::outputs::metrics::read_metrics;
use floe_trainer::ranks::Ranks;
use floe_trainer::run::{train_as_rank, train_in_world, RunOutcome};
use floe_trainer::Config;

/// Samples per prompt.
const N: usize = 2;
/// Prompts per training batch, two mini-batches of two.
const BATCH: usize = 4;
/// Validation prompts, evaluated after the last step.
const VAL: usize = 4;
/// Relative, on metrics.
const METRICS_TOLERANCE: f64 = 1e-6;
/// Absolute, on the f32 weights.
const WEIGHTS_TOLERANCE: f32 = 2e-5;

/// Reward 1 for an even-length answer: the same whichever rank scores it.
struct EvenLength;

impl Env for EvenLength {
    fn step(&mut self, action: &str) -> Result<StepOutput, EnvError> {
        Ok(StepOutput {
            reward: (action.len() % 2 == 0) as u8 as f64,
            done: true,
            ..StepOutput::default()
        })
    }
}

fn registry() -> Registry {
    let mut registry = Registry::new();
    registry
        .register(
            floe_env::env::TEXT2SQL,
            Arc::new(|_extras| Ok(Box::new(EvenLength) as Box<dyn Env>)),
        )
        .unwrap();
    registry
}

/// A run of `steps` steps in `run_dir`: no warm start, `prompt_mean` (which reads whole
/// groups), an eval after the last step, a checkpoint every step.
fn config(run_dir: &Path, steps: u64, extra: &[String]) -> Config {
    let mut overrides: Vec<String> = [
        format!("trainer.run_dir={}", run_dir.display()),
        "data.synthetic_train_size=16".into(),
        format!("data.synthetic_val_size={VAL}"),
        "trainer.eval_before_train=false".into(),
        format!("trainer.max_training_steps={steps}"),
        "trainer.max_prompt_length=1024".into(),
        format!("trainer.train_batch_size={BATCH}"),
        "trainer.policy_mini_batch_size=2".into(),
        "trainer.micro_train_batch_size_per_gpu=1".into(),
        "trainer.algorithm.loss_reduction=prompt_mean".into(),
        "trainer.ckpt_interval=1".into(),
        "trainer.logger=[]".into(),
        "trainer.policy.optimizer_config.lr=1e-3".into(),
        "trainer.policy.optimizer_config.num_warmup_steps=0".into(),
        format!("generator.n_samples_per_prompt={N}"),
        "generator.sampling_params.max_generate_length=8".into(),
        "generator.eval_sampling_params.max_generate_length=8".into(),
        "generator.sampling_params.temperature=1.0".into(),
        "sft.enabled=false".into(),
    ]
    .into_iter()
    .collect();
    overrides.extend(extra.iter().cloned());
    Config::load(None, &overrides).unwrap()
}

/// Runs `config` at `world_size` ranks, threads over one in-process group; every rank's
/// outcome, in rank order.
fn run_ranks(config: &Config, world_size: usize) -> Vec<RunOutcome> {
    let group = InProcessCollective::<f32>::group(world_size, Duration::from_secs(120));
    std::thread::scope(|scope| {
        let ranks: Vec<_> = group
            .into_iter()
            .map(|collective| {
                scope.spawn(move || {
                    let group = DataParallelGroup::in_process(collective);
                    train_as_rank(config, registry(), Some(group))
                })
            })
            .collect();
        ranks
            .into_iter()
            .map(|rank| rank.join().unwrap().unwrap())
            .collect()
    })
}

/// Every record of `metrics.jsonl` from step 1 on (a step's, then its eval's), without
/// wall times. A second writer would add records.
fn step_metrics(run_dir: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    read_metrics(&run_dir.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|r| r.step >= 1)
        .map(|r| {
            let metrics = r
                .metrics
                .into_iter()
                .filter(|(k, _)| !k.starts_with("timing/") && !k.ends_with("_s"))
                .collect();
            (r.step, metrics)
        })
        .collect()
}

fn checkpoint(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join(CHECKPOINTS_DIR)
        .join(format!("global_step_{step}"))
}

fn weights(run_dir: &Path, step: u64) -> BTreeMap<String, Vec<f32>> {
    let (_, tensors) = load_model_dir(checkpoint(run_dir, step).join("engine/model")).unwrap();
    tensors.into_iter().map(|(k, t)| (k, t.data)).collect()
}

fn assert_metrics_close(
    a: &[(u64, BTreeMap<String, f64>)],
    b: &[(u64, BTreeMap<String, f64>)],
    what: &str,
) {
    let steps = |records: &[(u64, BTreeMap<String, f64>)]| -> Vec<u64> {
        records.iter().map(|(step, _)| *step).collect()
    };
    assert_eq!(steps(a), steps(b), "{what}: records");
    for ((step, a), (_, b)) in a.iter().zip(b) {
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{what}: step {step} keys"
        );
        for (key, &x) in a {
            let y = b[key];
            let close = (x - y).abs() <= METRICS_TOLERANCE * x.abs().max(y.abs()).max(1.0);
            assert!(close, "{what}: step {step} {key}: {x} vs {y}");
        }
    }
}

fn assert_weights_close(a: &Path, b: &Path, step: u64, what: &str) {
    let (a, b) = (weights(a, step), weights(b, step));
    assert_eq!(a.len(), b.len());
    for (name, x) in &a {
        let worst = x
            .iter()
            .zip(&b[name])
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= WEIGHTS_TOLERANCE,
            "{what}: {name} differs by {worst}"
        );
    }
}

/// The files a finished run leaves, relative to its directory.
fn files(run_dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut out = Vec::new();
    walk(run_dir, run_dir, &mut out);
    out.sort();
    out
}

#[test]
fn ranks_train_as_one_process_does_and_only_rank_zero_writes() {
    let dir = tempfile::tempdir().unwrap();
    let single_dir = dir.path().join("single");
    train_as_rank(&config(&single_dir, 2, &[]), registry(), None).unwrap();
    let expected = step_metrics(&single_dir);
    assert!(expected[0].1["policy/grad_norm"] > 0.0, "the run trains");

    for world_size in [1, 2, 4] {
        let run_dir = dir.path().join(format!("ranks-{world_size}"));
        let outcomes = run_ranks(&config(&run_dir, 2, &[]), world_size);
        let what = format!("world size {world_size}");
        let metrics = step_metrics(&run_dir);
        if world_size == 1 {
            // Through the group at one rank: the plain run, bit for bit.
            assert_eq!(metrics, expected, "{what}");
            assert_eq!(weights(&run_dir, 2), weights(&single_dir, 2), "{what}");
        } else {
            assert_metrics_close(&metrics, &expected, &what);
            assert_weights_close(&run_dir, &single_dir, 2, &what);
        }
        // Every rank ran every step and saw the same eval.
        let eval = |outcome: &RunOutcome| -> BTreeMap<String, f64> {
            let mut eval = outcome.final_eval.clone();
            eval.remove("timing/eval");
            eval
        };
        for outcome in &outcomes {
            assert_eq!(outcome.steps, 2);
            assert_eq!(eval(outcome), eval(&outcomes[0]), "{what}");
        }
        // One writer: the files of a one-process run, each written once (two writers
        // would log steps and eval records twice).
        assert_eq!(files(&run_dir), files(&single_dir), "{what}");
        let evals = std::fs::read_to_string(run_dir.join("evals/global_step_2.jsonl")).unwrap();
        assert_eq!(evals.lines().count(), VAL, "{what}");
    }
}

#[test]
fn a_run_across_ranks_resumes_from_rank_zeros_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    run_ranks(&config(&run_dir, 2, &[]), 2);
    let straight = step_metrics(&run_dir);
    let straight_weights = weights(&run_dir, 2);
    let resume = format!("trainer.resume={}", checkpoint(&run_dir, 1).display());
    let outcomes = run_ranks(&config(&run_dir, 2, &[resume]), 2);
    for outcome in &outcomes {
        assert_eq!(
            outcome.resumed_from.as_deref(),
            Some(&*checkpoint(&run_dir, 1))
        );
    }
    // Same ranks, same shares: the resumed step 2 is the straight one, bit for bit.
    assert_eq!(step_metrics(&run_dir), straight);
    assert_eq!(weights(&run_dir, 2), straight_weights);
}

#[test]
fn zero_stage_1_trains_as_one_process_and_resumes_at_other_world_sizes() {
    zero_stage_trains_as_one_process_and_resumes(1, 1);
}

#[test]
fn zero_stage_2_trains_as_one_process_and_resumes_at_stage_1_and_other_world_sizes() {
    zero_stage_trains_as_one_process_and_resumes(2, 1);
}

/// `floe train` at ZeRO `stage` on 2 ranks against one process; resumed from its first
/// checkpoint at `resumed_stage` on 4 ranks, and by one process.
fn zero_stage_trains_as_one_process_and_resumes(stage: u8, resumed_stage: u8) {
    let dir = tempfile::tempdir().unwrap();
    let single_dir = dir.path().join("single");
    let keep_all = ["trainer.max_ckpts_to_keep=-1".to_string()];
    train_as_rank(&config(&single_dir, 3, &keep_all), registry(), None).unwrap();
    let zero = [
        format!("engine.zero_stage={stage}"),
        "trainer.max_ckpts_to_keep=-1".to_string(),
    ];
    let what = format!("zero stage {stage} on 2 ranks");
    let run_dir = dir.path().join("zero-2");
    run_ranks(&config(&run_dir, 3, &zero), 2);
    let straight = step_metrics(&run_dir);
    assert_metrics_close(&straight, &step_metrics(&single_dir), &what);
    assert_weights_close(&run_dir, &single_dir, 3, &what);
    // Each rank wrote its shard of the optimizer state.
    let engine_dir = checkpoint(&run_dir, 1).join("engine");
    for rank in 0..2 {
        let shard = engine_dir.join(format!("optimizer-rank-{rank}-of-2.safetensors"));
        assert!(shard.is_file(), "{}", shard.display());
    }
    assert!(!engine_dir.join("optimizer.safetensors").exists());

    // Resumed from step 1 on 4 ranks, and by one process: steps 2 and 3 as the straight run.
    for world_size in [4, 1] {
        let resumed_dir = dir.path().join(format!("resumed-{world_size}"));
        let resume = format!("trainer.resume={}", checkpoint(&run_dir, 1).display());
        let resumed_zero = format!("engine.zero_stage={resumed_stage}");
        let config = config(&resumed_dir, 3, &[resumed_zero, zero[1].clone(), resume]);
        match world_size {
            1 => drop(train_as_rank(&config, registry(), None).unwrap()),
            _ => drop(run_ranks(&config, world_size)),
        }
        let what = format!("resumed on {world_size}");
        assert_metrics_close(&step_metrics(&resumed_dir), &straight[1..], &what);
        assert_weights_close(&resumed_dir, &run_dir, 3, &what);
    }
}

/// A rank that exchanges nothing: only the shares are asked of it.
struct Place {
    rank: usize,
    world_size: usize,
}

impl RankExchange for Place {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn all_gather_bytes(&self, _bytes: &[u8]) -> floe_engine::Result<Vec<Vec<u8>>> {
        unreachable!("the shares exchange nothing")
    }
}

#[test]
fn a_mini_batch_is_split_in_whole_groups_even_with_fewer_groups_than_ranks() {
    let group = |prompt: usize, responses: &[usize]| TrainGroup {
        prompt: vec![1; prompt],
        responses: responses
            .iter()
            .map(|&len| TrainResponse {
                tokens: vec![2; len],
                targets: None,
                loss_mask: vec![1.0; len],
                advantages: vec![0.0; len],
                old_logprobs: vec![0.0; len],
                rollout_logprobs: None,
                ref_logprobs: None,
            })
            .collect(),
    };
    for groups in [
        vec![group(5, &[40, 3, 3, 3]), group(5, &[2, 2])],
        vec![
            group(3, &[4]),
            group(9, &[1, 1]),
            group(2, &[8, 8]),
            group(4, &[3]),
        ],
    ] {
        for world_size in 1..=4 {
            let shares: Vec<Vec<TrainGroup>> = (0..world_size)
                .map(|rank| Ranks::new(Arc::new(Place { rank, world_size })).train_share(&groups))
                .collect();
            // Every group exactly once, whole, on one rank.
            let mut seen: Vec<TrainGroup> = shares.concat();
            seen.sort_by_key(|g| groups.iter().position(|h| h == g).expect("a whole group"));
            assert_eq!(seen, groups, "world size {world_size}");
            if groups.len() < world_size {
                assert!(shares[groups.len()..].iter().all(Vec::is_empty));
            }
        }
    }
}

#[test]
fn ranks_in_separate_processes_on_the_cpu_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    let world = World {
        rank: 1,
        world_size: 2,
        ..World::single()
    };
    let err = train_in_world(&config(&run_dir, 1, &[]), registry(), &world).expect_err("refused");
    let message = err.to_string();
    assert!(
        message.contains("WORLD_SIZE=2") && message.contains("no collective across processes"),
        "{message}"
    );
    assert!(
        !run_dir.exists(),
        "refused before touching the run directory"
    );
}
