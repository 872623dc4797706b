//! `floe launch` with `sh -c` programs as ranks: the torchrun environment of every rank,
//! prefixed output and rank logs, a failing rank stopping the others (SIGTERM, then
//! SIGKILL for a rank that ignores it), SIGTERM to the launcher reaching every rank, and
//! a floe subcommand run by this floe binary.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Longer than any of these runs takes on a loaded machine, far shorter than the ranks'
/// sleeps, so a launcher that fails to stop them is caught.
const DEADLINE: Duration = Duration::from_secs(20);
/// What the ranks that should be stopped sleep.
const LONG_SLEEP: &str = "sleep 120";

fn floe_launch(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_floe"));
    command
        .arg("launch")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A running `floe launch` whose stdout arrives line by line.
struct Launcher {
    child: Child,
    started: Instant,
    stdout: mpsc::Receiver<String>,
    stderr: JoinHandle<String>,
}

/// How a launcher ended.
struct Ended {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl Launcher {
    fn start(mut command: Command) -> Launcher {
        let started = Instant::now();
        let mut child = command.spawn().expect("starting floe launch");
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut stderr = child.stderr.take().unwrap();
        let (lines, stdout_lines) = mpsc::channel();
        thread::spawn(move || {
            for line in stdout.lines() {
                let _ = lines.send(line.unwrap());
            }
        });
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            stderr.read_to_string(&mut text).unwrap();
            text
        });
        Launcher {
            child,
            started,
            stdout: stdout_lines,
            stderr,
        }
    }

    /// The next line of stdout.
    fn next_line(&self) -> String {
        self.stdout
            .recv_timeout(DEADLINE)
            .expect("a line from floe launch")
    }

    /// Waits for the launcher to exit, failing the test (and killing it) past
    /// [`DEADLINE`]; `seen` is the stdout already taken with [`Launcher::next_line`].
    fn finish(mut self, seen: &[String]) -> Ended {
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if self.started.elapsed() > DEADLINE {
                self.child.kill().ok();
                panic!("floe launch still running after {DEADLINE:?}");
            }
            thread::sleep(Duration::from_millis(20));
        };
        let elapsed = self.started.elapsed();
        let mut stdout: Vec<String> = seen.to_vec();
        // The reader's sender goes away when the launcher's stdout closes.
        stdout.extend(self.stdout.iter());
        Ended {
            status,
            stdout: stdout.iter().map(|line| format!("{line}\n")).collect(),
            stderr: self.stderr.join().unwrap(),
            elapsed,
        }
    }
}

fn run_to_end(command: Command) -> Ended {
    Launcher::start(command).finish(&[])
}

#[test]
fn every_rank_gets_the_torchrun_environment_and_its_output_is_prefixed() {
    let logs = tempfile::tempdir().unwrap();
    let log_dir = logs.path().join("logs");
    let output = run_to_end(floe_launch(&[
        "--nproc-per-node",
        "3",
        "--master-port",
        "29533",
        "--log-dir",
        log_dir.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $GROUP_RANK\"; \
         echo \"to stderr $1\" >&2; printf 'no newline'",
        "sh",
        "--flag-like-arg",
    ]));
    let stdout = &output.stdout;
    let stderr = &output.stderr;
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for rank in 0..3 {
        let env = format!("[rank {rank}] env {rank} {rank} 3 3 127.0.0.1 29533 0\n");
        assert!(stdout.contains(&env), "no {env:?} in:\n{stdout}");
        let partial = format!("[rank {rank}] no newline\n");
        assert!(stdout.contains(&partial), "no {partial:?} in:\n{stdout}");
        let err = format!("[rank {rank}] to stderr --flag-like-arg\n");
        assert!(stderr.contains(&err), "no {err:?} in:\n{stderr}");

        let log = std::fs::read_to_string(log_dir.join(format!("rank-{rank}.log"))).unwrap();
        let mut lines: Vec<&str> = log.lines().collect();
        lines.sort_unstable();
        let env = format!("env {rank} {rank} 3 3 127.0.0.1 29533 0");
        let mut expected = vec![env.as_str(), "no newline", "to stderr --flag-like-arg"];
        expected.sort_unstable();
        assert_eq!(lines, expected, "rank {rank}'s log");
    }
}

#[test]
fn without_a_master_port_ranks_share_a_free_one() {
    let output = run_to_end(floe_launch(&[
        "--gpus",
        "2",
        "--",
        "sh",
        "-c",
        "echo \"port $MASTER_PORT\"",
    ]));
    let stdout = &output.stdout;
    assert!(output.status.success(), "{stdout}\n{}", output.stderr);
    let ports: Vec<u16> = stdout
        .lines()
        .map(|line| line.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(ports.len(), 2, "{stdout}");
    assert_eq!(ports[0], ports[1], "{stdout}");
    assert_ne!(ports[0], 0);
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let program = format!("if [ \"$RANK\" = 1 ]; then exit 3; fi; {LONG_SLEEP}");
    let output = run_to_end(floe_launch(&["--nproc", "3", "--", "sh", "-c", &program]));
    let stderr = &output.stderr;
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("error: rank 1 exited with code 3; the other ranks were stopped"),
        "{stderr}"
    );
    assert!(output.elapsed < DEADLINE, "took {:?}", output.elapsed);
}

#[test]
fn a_rank_that_ignores_sigterm_gets_sigkill_after_the_grace_period() {
    // Rank 1 ignores SIGTERM (`trap '' TERM` holds for its sleep too), then says so with
    // a file; rank 0 then dies as the OOM killer would kill it.
    let dir = tempfile::tempdir().unwrap();
    let program = format!(
        "if [ \"$RANK\" = 0 ]; then while [ ! -e \"$1/ignoring\" ]; do sleep 0.01; done; \
         kill -KILL $$; fi; trap '' TERM; touch \"$1/ignoring\"; {LONG_SLEEP}"
    );
    let output = run_to_end(floe_launch(&[
        "--nproc",
        "2",
        "--grace-period",
        "0.5",
        "--",
        "sh",
        "-c",
        &program,
        "sh",
        dir.path().to_str().unwrap(),
    ]));
    let stderr = &output.stderr;
    assert_eq!(output.status.code(), Some(128 + 9), "{stderr}");
    assert!(
        stderr.contains("rank 0 was killed by SIGKILL (signal 9)"),
        "{stderr}"
    );
    assert!(stderr.contains("rank 1 still running"), "{stderr}");
    assert!(stderr.contains("sending SIGKILL"), "{stderr}");
    assert!(output.elapsed < DEADLINE, "took {:?}", output.elapsed);
}

#[test]
fn sigterm_to_the_launcher_reaches_every_rank() {
    let launcher = Launcher::start(floe_launch(&[
        "--nproc",
        "2",
        "--",
        "sh",
        "-c",
        "trap 'echo got TERM; exit 0' TERM; echo ready; while :; do sleep 0.05; done",
    ]));
    let seen = vec![launcher.next_line(), launcher.next_line()];
    assert!(
        seen.iter().all(|line| line.ends_with("] ready")),
        "{seen:?}"
    );
    let kill = Command::new("kill")
        .args(["-TERM", &launcher.child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());

    let output = launcher.finish(&seen);
    let (stdout, stderr) = (&output.stdout, &output.stderr);
    for rank in 0..2 {
        let got = format!("[rank {rank}] got TERM");
        assert!(stdout.contains(&got), "no {got:?} in:\n{stdout}\n{stderr}");
    }
    assert_eq!(output.status.code(), Some(128 + 15), "{stderr}");
    assert!(stderr.contains("error: stopped by SIGTERM"), "{stderr}");
}

#[test]
fn a_floe_subcommand_runs_this_floe_binary() {
    let output = run_to_end(floe_launch(&["--gpus", "2", "--", "keys", "--help"]));
    let stdout = &output.stdout;
    assert!(output.status.success(), "{stdout}\n{}", output.stderr);
    for rank in 0..2 {
        let usage = format!("[rank {rank}] Usage: floe keys");
        assert!(stdout.contains(&usage), "no {usage:?} in:\n{stdout}");
    }
}

#[test]
fn a_program_that_cannot_start_is_named() {
    let output = run_to_end(floe_launch(&[
        "--nproc",
        "2",
        "--",
        "/nonexistent/floe-launch-test-program",
    ]));
    let stderr = &output.stderr;
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("rank 0: starting \"/nonexistent/floe-launch-test-program\""),
        "{stderr}"
    );
}

#[test]
fn a_node_of_several_numbers_its_ranks_after_the_nodes_before_it() {
    let output = run_to_end(floe_launch(&[
        "--nnodes",
        "3",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29534",
        "sh",
        "-c",
        "echo \"env $RANK $LOCAL_RANK $GROUP_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE\"",
    ]));
    let (stdout, stderr) = (&output.stdout, &output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for (rank, local) in [(2, 0), (3, 1)] {
        let env = format!("[rank {rank}] env {rank} {local} 1 6 2\n");
        assert!(stdout.contains(&env), "no {env:?} in:\n{stdout}");
    }
    assert!(stderr.contains("loopback"), "{stderr}");

    let no_port = run_to_end(floe_launch(&["--nnodes", "2", "--gpus", "1", "true"]));
    assert!(!no_port.status.success());
    assert!(
        no_port.stderr.contains("--master-port"),
        "{}",
        no_port.stderr
    );
    let outside = run_to_end(floe_launch(&[
        "--nnodes",
        "2",
        "--node-rank",
        "2",
        "--gpus",
        "1",
        "--master-port",
        "29535",
        "true",
    ]));
    assert!(!outside.status.success());
    assert!(
        outside.stderr.contains("--node-rank 2"),
        "{}",
        outside.stderr
    );
}

#[test]
fn max_restarts_starts_every_rank_again_after_a_failure() {
    // Rank 1 fails in the first attempt while rank 0 is still running; both succeed in
    // the second.
    let script = "echo \"attempt $TORCHELASTIC_RESTART_COUNT\"; \
                  if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                    if [ \"$RANK\" = 1 ]; then exit 3; else sleep 10; fi; \
                  fi";
    let output = run_to_end(floe_launch(&[
        "--gpus",
        "2",
        "--max-restarts",
        "2",
        "--grace-period",
        "2",
        "sh",
        "-c",
        script,
    ]));
    let (stdout, stderr) = (&output.stdout, &output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for line in [
        "[rank 1] attempt 0",
        "[rank 0] attempt 1",
        "[rank 1] attempt 1",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    assert!(
        stderr.contains("rank 1 exited with code 3; the other ranks were stopped; restarting every rank (1 of 2 restarts)"),
        "{stderr}"
    );

    // A rank that always fails ends the launcher after the last restart, with its code.
    let output = run_to_end(floe_launch(&[
        "--gpus",
        "1",
        "--max-restarts",
        "1",
        "sh",
        "-c",
        "echo \"attempt $TORCHELASTIC_RESTART_COUNT\"; exit 4",
    ]));
    assert_eq!(output.status.code(), Some(4), "{}", output.stderr);
    assert!(
        output.stdout.contains("[rank 0] attempt 1"),
        "{}",
        output.stdout
    );
    assert_eq!(
        output.stderr.matches("restarting every rank").count(),
        1,
        "{}",
        output.stderr
    );
}

#[test]
fn a_tensor_parallel_bench_needs_the_ranks_of_a_launch() {
    let output = Command::new(env!("CARGO_BIN_EXE_floe"))
        .args(["bench", "generate", "--model", "tiny", "--tensor-parallel"])
        .env_remove("WORLD_SIZE")
        .env_remove("SLURM_NTASKS")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--tensor-parallel splits the model over the ranks of `floe launch"),
        "{stderr}"
    );
}
