//! Issue 6: the Python package in `python/` (run from its source folder) against
//! `floe serve`: its unit tests, its server tests and the GRPO example script. Skipped, with
//! a message, where `python3` is missing.

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};

use support::Server;

const API_KEY: &str = "tml-python-test";

fn python_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python")
}

/// `python3 args…` with the package on its path and the server's URL and key in its
/// environment; `None` when there is no python3.
fn python(server: &Server, args: &[&str]) -> Option<Output> {
    let output = Command::new("python3")
        .args(args)
        .current_dir(python_dir())
        .env("PYTHONPATH", python_dir())
        .env("FLOE_TEST_URL", &server.url)
        .env("FLOE_TEST_MODEL", "tiny")
        .env("FLOE_API_KEY", API_KEY)
        .output();
    match output {
        Ok(output) => Some(output),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => None,
        Err(error) => panic!("running python3: {error}"),
    }
}

fn check(output: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn python_client_drives_floe_serve() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("serve"), API_KEY);
    let Some(tests) = python(
        &server,
        &["-m", "unittest", "discover", "-s", "tests", "-v"],
    ) else {
        eprintln!("skipped: python3 is not installed, so the Python client cannot be tested");
        return;
    };
    let report = String::from_utf8_lossy(&tests.stderr);
    check(&tests, "the Python tests");
    assert!(
        !report.contains("skipped"),
        "a Python test skipped although the server is up:\n{report}"
    );

    let example = python(
        &server,
        &[
            "examples/grpo_loop.py",
            "--url",
            &server.url,
            "--steps",
            "3",
        ],
    )
    .expect("python3 ran above");
    let stdout = check(&example, "examples/grpo_loop.py");
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .and_then(|line| line.get("summary").cloned())
        .unwrap_or_else(|| panic!("no summary line in:\n{stdout}"));
    assert_eq!(summary["steps"], 3);
    // The server's PPO loss equals the Python helper's on the same log-probs, and the
    // sampler's log-probs equal forward's for the same tokens.
    let loss_gap = summary["max_loss_gap"].as_f64().unwrap();
    assert!(loss_gap < 1e-9, "loss gap {loss_gap}");
    let logprob_gap = summary["max_sampler_logprob_gap"].as_f64().unwrap();
    assert!(logprob_gap < 1e-3, "sampler log-prob gap {logprob_gap}");
}
