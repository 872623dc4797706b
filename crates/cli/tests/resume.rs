//! `floe train` killed with SIGKILL after its first checkpoint and started again resumes
//! exactly: its metrics.jsonl equals that of an uninterrupted run (timing excluded), in
//! both pipeline modes (a one-step-off checkpoint holds the batch sampled ahead).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{assert_same_metrics, metrics_without_timing};

const STEPS: u64 = 6;

fn floe_train(run_dir: &Path, mode: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floe"));
    command
        .arg("train")
        .args([
            format!("trainer.pipeline.mode={mode}"),
            format!("trainer.run_dir={}", run_dir.display()),
            "data.synthetic_train_size=32".into(),
            "data.synthetic_val_size=8".into(),
            format!("trainer.max_training_steps={STEPS}"),
            "trainer.max_prompt_length=1024".into(),
            "trainer.train_batch_size=4".into(),
            "trainer.policy_mini_batch_size=2".into(),
            "trainer.micro_train_batch_size_per_gpu=4".into(),
            "trainer.eval_interval=3".into(),
            "trainer.eval_batch_size=8".into(),
            "trainer.ckpt_interval=2".into(),
            "trainer.max_ckpts_to_keep=2".into(),
            "trainer.resume=latest".into(),
            "trainer.logger=[\"tensorboard\"]".into(),
            "generator.n_samples_per_prompt=2".into(),
            "generator.sampling_params.max_generate_length=16".into(),
            "generator.eval_sampling_params.max_generate_length=16".into(),
            "sft.epochs=1".into(),
            "sft.batch_size=8".into(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    command
}

/// Steps with training metrics logged so far.
fn logged_steps(run_dir: &Path) -> u64 {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains("reward/avg_raw_reward"))
        .count() as u64
}

/// Runs the uninterrupted and the killed run of pipeline `mode` and compares them.
fn killed_run_resumes_to_the_same_metrics(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let whole: PathBuf = dir.path().join("whole");
    let killed: PathBuf = dir.path().join("killed");
    assert!(floe_train(&whole, mode).status().unwrap().success());

    // Kill at a random step after the first checkpoint (step 2), before the last.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    let kill_after = 2 + nanos % (STEPS - 2);
    let mut child = floe_train(&killed, mode).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while logged_steps(&killed) < kill_after || !killed.join("checkpoints/latest").is_file() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "floe train ended early"
        );
        assert!(Instant::now() < deadline, "floe train made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(killed.join("checkpoints/latest").is_file());

    assert!(floe_train(&killed, mode).status().unwrap().success());
    assert_same_metrics(
        &metrics_without_timing(&killed),
        &metrics_without_timing(&whole),
        &format!("{mode} run resumed (killed after step {kill_after}) vs the uninterrupted run"),
    );
    assert!(killed.join("report.html").is_file());
}

#[test]
fn a_killed_sync_run_resumes_to_the_same_metrics() {
    killed_run_resumes_to_the_same_metrics("sync");
}

#[test]
fn a_killed_one_step_off_run_resumes_to_the_same_metrics() {
    killed_run_resumes_to_the_same_metrics("one_step_off");
}
