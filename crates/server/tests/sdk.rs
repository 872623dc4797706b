//! The unmodified `tinker` SDK (`pip install tinker==0.38.0`) against the server: create
//! a training client, cross-entropy steps, save, sample. Skipped, with a message, when
//! the SDK is not installed.

mod common;

use std::process::Command;

use common::*;

#[test]
fn tinker_sdk_trains_and_samples() {
    let has_sdk = Command::new("python3")
        .args(["-c", "import tinker"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_sdk {
        eprintln!("skipped: the tinker SDK is not installed (pip install tinker==0.38.0)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tinker_sdk_roundtrip.py");
    let out = Command::new("python3")
        .arg(script)
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
        "SDK script failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    println!("{stdout}");
    assert!(stdout.contains("SDK round trip OK"), "{stdout}");
}

/// Issue 6: a LoRA training client on the embedded tiny model trains its adapters on the
/// frozen base, its samplers read base + adapters, and a restored client continues
/// identically (`tinker_sdk_lora.py` asserts the values).
#[test]
fn tinker_sdk_trains_lora_adapters() {
    let has_sdk = Command::new("python3")
        .args(["-c", "import tinker"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_sdk {
        eprintln!("skipped: the tinker SDK is not installed (pip install tinker==0.38.0)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let addr = start(config(dir.path()));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tinker_sdk_lora.py");
    let out = Command::new("python3")
        .arg(script)
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
        "SDK LoRA script failed ({})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    println!("{stdout}");
    assert!(stdout.contains("SDK LoRA OK"), "{stdout}");
}
