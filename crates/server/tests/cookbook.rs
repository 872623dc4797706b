//! Issue 6: tinker-cookbook's RL loop (`rl.train.main`, `ArithmeticDatasetBuilder`,
//! `importance_sampling`), unmodified and offline, against the server on the embedded
//! tiny model (`cookbook_rl.py` drives it). Skipped, with the install command, when the
//! cookbook cannot be imported.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use floe_server::Catalog;

/// How to install what the cookbook's RL path imports (its full dependency set pins
/// packages this index does not have; torch is imported at module level).
const INSTALL: &str = "pip install --no-deps tinker-cookbook==0.6.1 && pip install torch chz termcolor blobfile cloudpickle datasets pyrage tiktoken aiohttp pillow safetensors tqdm";

/// RL steps the loop runs (one dataset batch each).
const RL_STEPS: usize = 12;
/// Longest the whole run may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(20 * 60);

#[test]
fn cookbook_rl_loop_completes_and_its_reward_rises() {
    let probe = Command::new("python3")
        .args([
            "-c",
            "import tinker_cookbook.rl.train, tinker_cookbook.recipes.math_rl.arithmetic_env",
        ])
        .output();
    match probe {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr.lines().last().unwrap_or("import failed");
            eprintln!(
                "skipped: tinker-cookbook is not importable ({why}); install it with: {INSTALL}"
            );
            return;
        }
        Err(e) => {
            eprintln!("skipped: python3 cannot run ({e})");
            return;
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let catalog = Catalog::from_specs(&[format!("{BASE_MODEL}=embedded:tiny")]).unwrap();
    let tokenizers = catalog
        .tokenizer_dirs(&dir.path().join("tokenizers"))
        .unwrap();
    let (_, tokenizer_dir) = &tokenizers[0];
    let mut config = config(&dir.path().join("data"));
    // Every rollout of a step is one asample request, sent all at once.
    config.max_queued_per_engine = 1024;
    let addr = start(config);

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cookbook_rl.py");
    let log_dir = dir.path().join("cookbook-log");
    let mut child = Command::new("python3")
        .arg(script)
        .env("TINKER_BASE_URL", format!("http://{addr}"))
        .env("TINKER_API_KEY", KEY)
        .env("TINKER_TELEMETRY", "0")
        .env("HF_HUB_OFFLINE", "1")
        .env("FLOE_BASE_MODEL", BASE_MODEL)
        .env("FLOE_TOKENIZER_DIR", tokenizer_dir)
        .env("FLOE_LOG_DIR", &log_dir)
        .env("FLOE_RL_STEPS", RL_STEPS.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes on threads so a chatty child never blocks on a full pipe.
    let read = |pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let mut pipe = pipe;
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > DEADLINE {
            child.kill().unwrap();
            panic!("the cookbook run did not finish within {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    let tail = |text: &str| {
        text.lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert!(
        status.success(),
        "cookbook run failed ({status})\nstdout tail:\n{}\nstderr tail:\n{}",
        tail(&stdout),
        tail(&stderr)
    );
    println!("cookbook run took {:.0} s", started.elapsed().as_secs_f64());

    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix("COOKBOOK_RESULT "))
        .unwrap_or_else(|| panic!("no COOKBOOK_RESULT line\n{}", tail(&stdout)));
    println!("{line}");
    let result: serde_json::Value = serde_json::from_str(line).unwrap();
    let rewards: Vec<f64> = serde_json::from_value(result["rewards"].clone()).unwrap();
    assert_eq!(
        rewards.len(),
        RL_STEPS,
        "one reward per RL step: {rewards:?}"
    );
    assert!(rewards.iter().all(|r| r.is_finite()), "{rewards:?}");

    // The run's metadata round-trips through training_runs/{id}; periodic checkpoints
    // stay; each rolling one (steps 3, 6, 9) was deleted by the cookbook after the next.
    assert_eq!(result["renderer_name"], "role_colon", "{result}");
    let checkpoints: Vec<String> = serde_json::from_value(result["checkpoints"].clone()).unwrap();
    for expected in [
        "weights/000005",
        "weights/000010",
        "weights/final",
        "sampler_weights/000005",
        "sampler_weights/000010",
        "sampler_weights/final",
    ] {
        assert!(
            checkpoints.iter().any(|c| c == expected),
            "{expected} missing: {checkpoints:?}"
        );
    }
    for rolling in ["weights/000003", "weights/000006", "weights/000009"] {
        assert!(
            !checkpoints.iter().any(|c| c == rolling),
            "{rolling} not deleted: {checkpoints:?}"
        );
    }

    // GRPO on the warm-started model: the last steps score better than the first ones.
    let third = RL_STEPS / 3;
    let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
    let (first, last) = (mean(&rewards[..third]), mean(&rewards[RL_STEPS - third..]));
    assert!(
        last > first,
        "reward did not rise: first {third} steps {first:.3}, last {third} steps {last:.3}: {rewards:?}"
    );
}
