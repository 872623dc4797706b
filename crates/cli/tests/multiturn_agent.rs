//! Issue 24: `python/examples/multiturn_sql_agent.py`, an agent on the unmodified `openai`
//! SDK, plays floe's multi-turn SQL env (through `floe env`) against `floe serve`'s `/v1`
//! for two training steps on the embedded tiny model, with `--check`: every turn's token
//! ids and log-probs are what the engine samples for that prompt and seed, the spliced
//! episodes score to them in one forward pass, and each Tinker `importance_sampling` step
//! changes the weights. Skipped, with a note, without python3 and both SDKs.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use support::Server;

const API_KEY: &str = "tml-agent-test";

#[test]
fn the_multiturn_sql_agent_example_trains_on_the_tokens_it_sampled() {
    let installed = Command::new("python3")
        .args(["-c", "import openai, tinker"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !installed {
        eprintln!("skipped: python3 with the openai and tinker packages is needed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("serve"), API_KEY);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../python/examples/multiturn_sql_agent.py");
    let output = Command::new("python3")
        .arg(script)
        .args([
            "--server",
            &server.url,
            "--model",
            "tiny",
            "--steps",
            "2",
            "--check",
        ])
        .args(["--floe", env!("CARGO_BIN_EXE_floe")])
        .env("FLOE_API_KEY", API_KEY)
        .env("TINKER_TELEMETRY", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("multi-turn SQL agent OK"),
        "the agent failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    assert_eq!(
        stdout
            .matches("sampled tokens and log-probs check out")
            .count(),
        2,
        "{stdout}"
    );
    eprintln!("{stdout}");
}

/// `floe env` answers every line, bad ones with an error naming what is wrong.
#[test]
fn floe_env_answers_each_line_and_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = Command::new(env!("CARGO_BIN_EXE_floe"))
        .arg("env")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = env.stdin.take().unwrap();
    let mut output = BufReader::new(env.stdout.take().unwrap());
    let mut ask = |line: &str| {
        writeln!(input, "{line}").unwrap();
        let mut answer = String::new();
        output.read_line(&mut answer).unwrap();
        serde_json::from_str::<serde_json::Value>(&answer).unwrap()
    };
    let error =
        |answer: serde_json::Value| answer["error"].as_str().unwrap_or_default().to_string();
    assert!(error(ask("{not json")).contains("expected"));
    assert!(error(ask(r#"{"step": "x"}"#)).contains("send {\"reset\""));
    let reset = r#"{"reset": {"env_class": "text2sql_multiturn", "prompt": [], "extras": {}}}"#;
    assert!(error(ask(reset)).contains("reward_spec.ground_truth"));
    let db = dir.path().join("one.sqlite");
    std::fs::write(&db, b"").unwrap();
    let reset = serde_json::json!({"reset": {"env_class": "text2sql_multiturn",
        "prompt": [{"role": "user", "content": "How many?"}],
        "extras": {"db_path": db, "reward_spec": {"ground_truth": "SELECT 1"}, "max_turns": 2}}});
    let started = ask(&reset.to_string());
    assert_eq!(started["prompt"][0]["content"], "How many?", "{started}");
    let step = ask(r#"{"step": "<think>look</think><sql>SELECT 1</sql>"}"#);
    assert_eq!(step["done"], false, "{step}");
    assert!(step["observations"][0]["content"]
        .as_str()
        .unwrap()
        .contains("<observation>"));
    let last = ask(r#"{"step": "<think>so</think><solution>SELECT 1</solution>"}"#);
    assert_eq!(
        (last["done"].clone(), last["reward"].clone()),
        (true.into(), 1.0.into()),
        "{last}"
    );
    drop(input);
    assert!(env.wait().unwrap().success());
}
