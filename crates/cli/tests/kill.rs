//! Issue 20, resume everywhere: the real `floe train` killed with SIGKILL at random points
//! (during the SFT warm start, in the middle of an RL step, right after a checkpoint write
//! began), of a local run and of a remote-engine run, and the real `floe serve` killed
//! under a remote run. Each time `trainer.resume=latest` must end with the metrics.jsonl of
//! an uninterrupted run, bit for bit (timings aside), and no checkpoint may be left
//! half-written or unreadable; a server that lost the saved state must be named in the
//! trainer's error (with `engine.max_remote_recoveries=0`); a server restarted under a live
//! remote run, right after a checkpoint or in the middle of a step, is survived.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::{assert_same_metrics, metrics_without_timing, MetricsLine, Server};

const STEPS: u64 = 4;
const API_KEY: &str = "tml-kill-test";
/// How long one `floe train` may run before the test calls it stuck.
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

/// A small run checkpointing after every step (the two newest kept), with an eval on
/// step 2 and the last, two engine threads (so a remote run matches a local one).
fn floe_train(run_dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floe"));
    command
        .arg("train")
        .args([
            format!("trainer.run_dir={}", run_dir.display()),
            "data.synthetic_train_size=16".into(),
            "data.synthetic_val_size=4".into(),
            format!("trainer.max_training_steps={STEPS}"),
            "trainer.max_prompt_length=1024".into(),
            "trainer.train_batch_size=2".into(),
            "trainer.policy_mini_batch_size=1".into(),
            "trainer.micro_train_batch_size_per_gpu=2".into(),
            "trainer.eval_interval=2".into(),
            "trainer.eval_batch_size=4".into(),
            "trainer.ckpt_interval=1".into(),
            "trainer.max_ckpts_to_keep=2".into(),
            "trainer.resume=latest".into(),
            "trainer.logger=[\"tensorboard\"]".into(),
            "generator.n_samples_per_prompt=2".into(),
            "generator.sampling_params.max_generate_length=12".into(),
            "generator.eval_sampling_params.max_generate_length=12".into(),
            "sft.epochs=1".into(),
            "sft.batch_size=8".into(),
            "engine.threads=2".into(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    command
}

/// [`floe_train`] against the server at `url`.
fn remote_train(run_dir: &Path, url: &str) -> Command {
    let mut command = floe_train(run_dir);
    command
        .arg(format!("engine.remote={url}"))
        .env("FLOE_API_KEY", API_KEY);
    command
}

/// Runs `command` to its end; its output.
fn run(mut command: Command) -> Output {
    command.output().expect("running floe train")
}

/// Runs `command` and asserts it succeeded.
fn run_ok(command: Command, what: &str) {
    let output = run(command);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The uninterrupted local run every killed run is compared with, run once per test
/// binary: its metrics and its mean step time.
fn reference() -> &'static (Vec<MetricsLine>, Duration, String) {
    static REFERENCE: OnceLock<(Vec<MetricsLine>, Duration, String)> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("whole");
        run_ok(floe_train(&run_dir), "the uninterrupted run");
        let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
        let step_secs: Vec<f64> = text
            .lines()
            .filter_map(|line| {
                let record: serde_json::Value = serde_json::from_str(line).unwrap();
                record["metrics"]["timing/step"].as_f64()
            })
            .collect();
        let mean = step_secs.iter().sum::<f64>() / step_secs.len().max(1) as f64;
        (
            metrics_without_timing(&run_dir),
            Duration::from_secs_f64(mean),
            samples(&run_dir),
        )
    })
}

/// The run's `samples.jsonl` (the generations its report shows).
fn samples(run_dir: &Path) -> String {
    std::fs::read_to_string(run_dir.join("samples.jsonl")).unwrap_or_default()
}

/// Asserts the resumed run's metrics and report samples are the uninterrupted run's.
fn assert_same_run(run_dir: &Path, what: &str) {
    let (metrics, _, reference_samples) = reference();
    assert_same_metrics(&metrics_without_timing(run_dir), metrics, what);
    assert!(
        samples(run_dir) == *reference_samples,
        "{what}: samples.jsonl differs:\n{}\nvs\n{reference_samples}",
        samples(run_dir)
    );
}

/// A pseudo-random number below `n` (the clock's nanoseconds mixed; the test prints what it
/// drew so a failure can be replayed by reading the log).
fn random_below(n: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut x = nanos ^ 0x9e37_79b9_7f4a_7c15;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x % n.max(1)
}

/// Lines of `run_dir/metrics.jsonl` so far.
fn metrics_lines(run_dir: &Path) -> Vec<String> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// RL steps logged so far.
fn logged_steps(run_dir: &Path) -> u64 {
    metrics_lines(run_dir)
        .iter()
        .filter(|line| line.contains("reward/avg_raw_reward"))
        .count() as u64
}

/// Whether a checkpoint is being written (its `.partial` folder exists).
fn checkpoint_in_progress(run_dir: &Path) -> bool {
    std::fs::read_dir(run_dir.join("checkpoints")).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with(".global_step_") && name.ends_with(".partial")
        })
    })
}

/// Polls until `ready` holds for `run_dir`, then kills `child` with SIGKILL. Fails when the
/// child ends first (it was meant to be killed mid-run).
fn kill_when(child: &mut Child, run_dir: &Path, what: &str, ready: impl Fn(&Path) -> bool) {
    let deadline = Instant::now() + RUN_TIMEOUT;
    while !ready(run_dir) {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
            }
            panic!("floe train ended ({status}) before the kill point {what}:\n{stderr}");
        }
        assert!(Instant::now() < deadline, "no kill point {what} in time");
        std::thread::sleep(Duration::from_micros(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    eprintln!("killed floe train {what}");
}

/// The kill points of one run, in order: during the SFT warm start, in the middle of a
/// random RL step, and right after a checkpoint write of a later step began. The run is
/// resumed after each.
fn kill_and_resume_everywhere(run_dir: &Path, train: impl Fn() -> Command) {
    let (_, step_time, _) = reference();

    // 1. During SFT: the data metrics are logged just before the warm start begins.
    let mut child = train().spawn().unwrap();
    kill_when(&mut child, run_dir, "during SFT", |dir| {
        !metrics_lines(dir).is_empty()
    });
    let sft_logged = metrics_lines(run_dir).iter().any(|l| l.contains("sft/"));
    eprintln!(
        "(the SFT epoch had {}been logged)",
        if sft_logged { "" } else { "not " }
    );
    check_checkpoints(run_dir);

    // 2. In the middle of RL step k + 1: step k is logged (and checkpointed), then a random
    //    fraction of a step's time passes.
    let k = 1 + random_below(STEPS - 2);
    let pause = step_time.mul_f64(random_below(100) as f64 / 100.0);
    let mut child = train().spawn().unwrap();
    kill_when(
        &mut child,
        run_dir,
        &format!("in step {} ({pause:?} after step {k})", k + 1),
        |dir| {
            if logged_steps(dir) < k {
                return false;
            }
            std::thread::sleep(pause);
            true
        },
    );
    check_checkpoints(run_dir);

    // 3. Right after the checkpoint write of a later step began (its `.partial` folder is
    //    there); a step is logged just before its checkpoint is written.
    let resumed_at = latest_step(run_dir).unwrap_or(0);
    let target = resumed_at + 1 + random_below(STEPS.saturating_sub(resumed_at + 1));
    let mut child = train().spawn().unwrap();
    kill_when(
        &mut child,
        run_dir,
        &format!("as checkpoint {target} began (resumed from {resumed_at})"),
        |dir| logged_steps(dir) >= target && checkpoint_in_progress(dir),
    );
    check_checkpoints(run_dir);

    run_ok(train(), "the resumed run");
    check_checkpoints(run_dir);
    assert!(
        !checkpoint_in_progress(run_dir),
        "a finished run left a .partial checkpoint"
    );
}

/// The step `checkpoints/latest` names, if any.
fn latest_step(run_dir: &Path) -> Option<u64> {
    let name = std::fs::read_to_string(run_dir.join("checkpoints/latest")).ok()?;
    name.trim().strip_prefix("global_step_")?.parse().ok()
}

/// Every checkpoint folder is whole and readable: `latest` names one, each
/// `global_step_N/trainer_state.json` parses with step N, and each file under `engine/`
/// is complete (JSON parses, a safetensors file holds every byte its header names).
fn check_checkpoints(run_dir: &Path) {
    let root = run_dir.join("checkpoints");
    let Ok(entries) = std::fs::read_dir(&root) else {
        return;
    };
    if let Some(step) = latest_step(run_dir) {
        assert!(
            root.join(format!("global_step_{step}/trainer_state.json"))
                .is_file(),
            "latest names global_step_{step}, which is not a whole checkpoint"
        );
    }
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = name.strip_prefix("global_step_") else {
            continue;
        };
        let dir = entry.path();
        let state = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state)
            .unwrap_or_else(|e| panic!("{}: {e} (a half-written checkpoint)", state.display()));
        let state_json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: unreadable: {e}", state.display()));
        assert_eq!(
            state_json["global_step"].to_string(),
            step,
            "{}",
            state.display()
        );
        let engine = dir.join("engine");
        let files = files_under(&engine);
        assert!(!files.is_empty(), "{}: no engine state", engine.display());
        for file in files {
            check_file(&file);
        }
    }
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// A JSON file parses; a safetensors file is as long as its header says.
fn check_file(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let name = path.to_string_lossy();
    if name.ends_with(".json") {
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .unwrap_or_else(|e| panic!("{name}: unreadable JSON: {e}"));
    } else if name.ends_with(".safetensors") {
        assert!(bytes.len() >= 8, "{name}: truncated");
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert!(bytes.len() >= 8 + n, "{name}: truncated header");
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n])
            .unwrap_or_else(|e| panic!("{name}: unreadable header: {e}"));
        let end = header
            .as_object()
            .unwrap()
            .values()
            .filter_map(|t| t["data_offsets"][1].as_u64())
            .max()
            .unwrap_or(0) as usize;
        assert_eq!(bytes.len(), 8 + n + end, "{name}: truncated tensor data");
    }
}

#[test]
fn a_local_run_killed_anywhere_resumes_to_the_same_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("killed");
    kill_and_resume_everywhere(&run_dir, || floe_train(&run_dir));
    assert_same_run(
        &run_dir,
        "local run killed three times vs the uninterrupted run",
    );
}

#[test]
fn a_remote_run_killed_anywhere_resumes_to_the_same_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("serve"), API_KEY);
    let run_dir = dir.path().join("killed");
    kill_and_resume_everywhere(&run_dir, || remote_train(&run_dir, &server.url));
    assert_same_run(
        &run_dir,
        "remote run killed three times vs the uninterrupted local run",
    );
}

/// The state id `checkpoints/latest`'s remote engine state names.
fn latest_state_id(run_dir: &Path) -> String {
    let step = latest_step(run_dir).expect("a checkpoint");
    let record = run_dir.join(format!(
        "checkpoints/global_step_{step}/engine/remote_state.json"
    ));
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(record).unwrap()).unwrap();
    record["state_id"].as_str().unwrap().to_string()
}

#[test]
fn a_killed_server_fails_the_run_clearly_and_a_restart_resumes_it() {
    let (_, step_time, _) = reference();
    let dir = tempfile::tempdir().unwrap();
    let serve_dir = dir.path().join("serve");
    let mut server = Server::start(&serve_dir, API_KEY);
    let port = server.port();
    let run_dir = dir.path().join("run");

    // SIGKILL the server in the middle of a random step after the first checkpoint.
    let k = 1 + random_below(STEPS - 1);
    let pause = step_time.mul_f64(random_below(100) as f64 / 100.0);
    // Not waiting for a server that does not come back, nor rewinding to a checkpoint.
    let mut child = remote_train(&run_dir, &server.url)
        .arg("engine.max_remote_recoveries=0")
        .env(floe_engine::remote::RECONNECT_WAIT_ENV, "0")
        .spawn()
        .unwrap();
    let deadline = Instant::now() + RUN_TIMEOUT;
    while logged_steps(&run_dir) < k || latest_step(&run_dir).is_none() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "floe train ended early"
        );
        assert!(Instant::now() < deadline, "floe train made no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(pause);
    server.kill();
    eprintln!("killed floe serve {pause:?} after step {k}");
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.success() {
        // The run's last request was answered before the kill.
        eprintln!("floe train had finished");
    } else {
        assert!(
            stderr.contains(&server.url),
            "the error names no server: {stderr}"
        );
        eprintln!(
            "floe train failed: {}",
            stderr.trim().lines().last().unwrap()
        );
    }
    check_checkpoints(&run_dir);

    // A server restarted on another (empty) data folder lost the saved state: the resume
    // fails naming it.
    let state_id = latest_state_id(&run_dir);
    let empty = Server::start_at(port, &dir.path().join("empty"), Some(API_KEY), &[]);
    let output = run(remote_train(&run_dir, &empty.url));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "resumed without the server's state"
    );
    assert!(
        stderr.contains("unknown state_id") && stderr.contains(&state_id),
        "the error does not name the lost state {state_id}: {stderr}"
    );
    drop(empty);

    // Restarted on its own data folder at its address: the run resumes exactly.
    let restarted = Server::start_at(port, &serve_dir, Some(API_KEY), &[]);
    run_ok(remote_train(&run_dir, &restarted.url), "the resumed run");
    check_checkpoints(&run_dir);
    assert_same_run(
        &run_dir,
        "remote run resumed on a restarted server vs the uninterrupted local run",
    );
}

/// Kills `server` and starts it again on `serve_dir` at its port when `ready` holds for
/// `run_dir`, under the live remote run `child`; the run must end by itself with the
/// uninterrupted run's metrics and samples (the trainer gets its engine back from the
/// saved state, or rewinds to its last checkpoint when training since was lost). Returns
/// the run's stderr.
fn restart_server_under_live_run(
    mut server: Server,
    serve_dir: &Path,
    run_dir: &Path,
    mut child: Child,
    what: &str,
    ready: impl Fn(&Path) -> bool,
) -> String {
    let port = server.port();
    let deadline = Instant::now() + RUN_TIMEOUT;
    while !ready(run_dir) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "floe train ended early"
        );
        assert!(Instant::now() < deadline, "floe train made no progress");
        std::thread::sleep(Duration::from_millis(1));
    }
    server.kill();
    let _restarted = Server::start_at(port, serve_dir, Some(API_KEY), &[]);
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "floe serve restarted {what}: the run did not go on by itself:\n{stderr}"
    );
    match stderr.lines().find(|line| line.contains("rewinding to")) {
        Some(line) => eprintln!("floe serve restarted {what}: {}", line.trim()),
        None => eprintln!("floe serve restarted {what}: the engine came back as it was"),
    }
    check_checkpoints(run_dir);
    assert_same_run(
        run_dir,
        &format!("remote run with floe serve restarted {what} vs the uninterrupted local run"),
    );
    stderr.into_owned()
}

/// `floe serve` killed and started again on its data folder right after a random
/// checkpoint of a live `floe train`: the trainer waits for the server, gets its engine
/// back from the checkpoint's saved state (or, should the restart land after the next
/// step trained, rewinds to the checkpoint) and ends with the uninterrupted run's metrics.
#[test]
fn a_server_restarted_under_a_live_run_gives_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let serve_dir = dir.path().join("serve");
    let server = Server::start(&serve_dir, API_KEY);
    let run_dir = dir.path().join("run");
    let k = 1 + random_below(STEPS - 1);
    let child = remote_train(&run_dir, &server.url).spawn().unwrap();
    let _ = restart_server_under_live_run(
        server,
        &serve_dir,
        &run_dir,
        child,
        &format!("after checkpoint {k}"),
        |dir| latest_step(dir).is_some_and(|step| step >= k),
    );
}

/// A loopback TCP relay between `floe train` and `floe serve` that reports each training
/// verb (`forward_backward`, `optim_step`) as its request reaches the server, so a test can
/// kill the server while the verb runs. A connection that finds the server down waits for
/// it (as a refused connection would make the client do) before giving up.
struct Relay {
    /// `http://127.0.0.1:PORT` of the relay.
    url: String,
    /// One message per training verb sent on.
    training_verbs: std::sync::mpsc::Receiver<String>,
}

impl Relay {
    fn start(server_port: u16) -> Relay {
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (sender, training_verbs) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let sender = sender.clone();
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    let server = loop {
                        match TcpStream::connect(("127.0.0.1", server_port)) {
                            Ok(server) => break server,
                            Err(_) if Instant::now() < deadline => {
                                std::thread::sleep(Duration::from_millis(20))
                            }
                            Err(_) => return,
                        }
                    };
                    let (mut client_read, mut server_write) =
                        (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let (mut server_read, mut client_write) = (server, client);
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut server_read, &mut client_write);
                        let _ = client_write.shutdown(std::net::Shutdown::Both);
                    });
                    let mut buffer = [0u8; 64 * 1024];
                    loop {
                        let n = match std::io::Read::read(&mut client_read, &mut buffer) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if std::io::Write::write_all(&mut server_write, &buffer[..n]).is_err() {
                            break;
                        }
                        let text = String::from_utf8_lossy(&buffer[..n]);
                        for verb in ["/forward_backward ", "/optim_step "] {
                            if text.contains(verb) {
                                let _ = sender.send(verb.trim().to_string());
                            }
                        }
                    }
                    let _ = server_write.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Relay {
            url,
            training_verbs,
        }
    }
}

/// `floe serve` killed while a training verb of a live remote run runs on it (the verb's
/// request has reached the server; a relay between the two tells when), at a random verb
/// after the first checkpoint, and started again: the trainer's verb is cut off, so the
/// run rewinds to its last checkpoint and ends with the uninterrupted run's metrics.
#[test]
fn a_server_killed_mid_training_verb_and_restarted_gives_the_same_run() {
    let dir = tempfile::tempdir().unwrap();
    let serve_dir = dir.path().join("serve");
    let server = Server::start(&serve_dir, API_KEY);
    let relay = Relay::start(server.port());
    let run_dir = dir.path().join("run");
    // Training verbs of one step: two mini-batches, a forward_backward and an optim_step
    // each.
    let skip = random_below(4 * (STEPS - 1));
    let child = remote_train(&run_dir, &relay.url).spawn().unwrap();
    let deadline = Instant::now() + RUN_TIMEOUT;
    let mut seen = 0;
    let verb = loop {
        let verb = relay
            .training_verbs
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("no training verb in time");
        if latest_step(&run_dir).is_some() {
            if seen == skip {
                break verb;
            }
            seen += 1;
        }
    };
    // The request is on the server; give it a moment to start computing.
    std::thread::sleep(Duration::from_millis(random_below(20)));
    let what = format!("during {verb} ({skip} training verbs after the first checkpoint)");
    let stderr =
        restart_server_under_live_run(server, &serve_dir, &run_dir, child, &what, |_| true);
    assert!(
        stderr.contains("rewinding to"),
        "the lost training was not rewound:\n{stderr}"
    );
}
