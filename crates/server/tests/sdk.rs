//! The unmodified `tinker` SDK (`pip install tinker==0.38.0`) against the server: create
//! a training client, cross-entropy steps, save, sample. Skipped, with a message, when
//! the SDK is not installed.

mod common;

use std::process::Command;

use common::*;

/// Runs `tests/<script>` with the SDK against a fresh server and checks it printed `done`;
/// skips, with a message, when the SDK is not installed.
fn run_sdk_script(script: &str, done: &str) {
    if !tinker_sdk_installed() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let out = Command::new("python3")
        .arg(format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR")))
        .env("TINKER_BASE_URL", format!("http://{addr}"))
        .env("TINKER_API_KEY", KEY)
        .env("FLOE_BASE_MODEL", BASE_MODEL)
        .env("TINKER_TELEMETRY", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{script} failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    println!("{stdout}");
    assert!(stdout.contains(done), "{stdout}");
}

#[test]
fn tinker_sdk_trains_and_samples() {
    run_sdk_script("tinker_sdk_roundtrip.py", "SDK round trip OK");
}

/// Issue 6: a LoRA training client on the embedded tiny model trains its adapters on the
/// frozen base, its samplers read base + adapters, and a restored client continues
/// identically (`tinker_sdk_lora.py` asserts the values).
#[test]
fn tinker_sdk_trains_lora_adapters() {
    run_sdk_script("tinker_sdk_lora.py", "SDK LoRA OK");
}
