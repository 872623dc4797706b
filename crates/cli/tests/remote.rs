//! Issue 6: `floe train engine.remote=http://…` runs the RL loop against `floe serve` and
//! logs exactly the metrics of a local run with the same seed (CPU, same thread count):
//! rewards, losses, gradient norms and eval scores; only timings differ.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use support::{assert_same_metrics, metrics_without_timing, Server};

const API_KEY: &str = "tml-remote-test";

fn floe_train(run_dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floe"));
    command
        .arg("train")
        .args([
            format!("trainer.run_dir={}", run_dir.display()),
            "data.synthetic_train_size=16".into(),
            "data.synthetic_val_size=4".into(),
            "trainer.max_training_steps=3".into(),
            "trainer.max_prompt_length=1024".into(),
            "trainer.train_batch_size=2".into(),
            "trainer.policy_mini_batch_size=1".into(),
            "trainer.micro_train_batch_size_per_gpu=2".into(),
            "trainer.eval_interval=3".into(),
            "trainer.eval_batch_size=4".into(),
            "trainer.ckpt_interval=2".into(),
            "trainer.logger=[\"tensorboard\"]".into(),
            "generator.n_samples_per_prompt=2".into(),
            "generator.sampling_params.max_generate_length=12".into(),
            "generator.eval_sampling_params.max_generate_length=12".into(),
            "sft.epochs=1".into(),
            "sft.batch_size=8".into(),
            "engine.threads=2".into(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    command
}

#[test]
fn remote_run_logs_the_local_runs_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let remote = dir.path().join("remote");
    assert!(floe_train(&local).status().unwrap().success());

    let server = Server::start(&dir.path().join("serve"), API_KEY);
    let status = floe_train(&remote)
        .arg(format!("engine.remote={}", server.url))
        .env("FLOE_API_KEY", API_KEY)
        .status()
        .unwrap();
    assert!(status.success(), "remote floe train failed: {status}");

    let local_metrics = metrics_without_timing(&local);
    let remote_metrics = metrics_without_timing(&remote);
    let logged: Vec<&String> = local_metrics.iter().flat_map(|(_, m)| m.keys()).collect();
    for prefix in ["reward/", "policy/", "grad_norm", "eval/"] {
        assert!(
            logged.iter().any(|name| name.contains(prefix)),
            "no {prefix}* metric in the local run: {logged:?}"
        );
    }
    assert_same_metrics(&remote_metrics, &local_metrics, "remote run vs local run");
    // The checkpoint names the state the server keeps.
    let record = remote.join("checkpoints/global_step_2/engine/remote_state.json");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    assert_eq!(record["server"], server.url.as_str());
    let state_id = record["state_id"].as_str().unwrap();
    assert!(dir
        .path()
        .join("serve/native/states")
        .join(state_id)
        .is_dir());
}

#[test]
fn a_wrong_api_key_is_refused_with_the_servers_reason() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("serve"), API_KEY);
    let output = floe_train(&dir.path().join("run"))
        .arg(format!("engine.remote={}", server.url))
        .env("FLOE_API_KEY", "tml-wrong")
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("HTTP 401") && stderr.contains("is not accepted by this server"),
        "{stderr}"
    );
}
