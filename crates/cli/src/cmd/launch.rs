//! `floe launch`: N processes of one program on this node, each with the environment
//! torchrun gives its workers (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), their output prefixed with their rank. When one rank
//! fails the others are stopped (SIGTERM, SIGKILL after a grace period) and the launcher
//! exits naming the rank; SIGINT and SIGTERM sent to the launcher go to every rank.
//! Several nodes: `floe launch` on each with `--nnodes M --node-rank K`, the same
//! `--master-addr` (node 0's) and `--master-port`; node K's ranks are K·N to K·N + N − 1.

use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::CommandFactory;
use rustix::process::{kill_process_group, Pid, Signal};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// How long the launcher waits, after every rank has exited, for output still in the
/// pipes: a rank's own children may keep a pipe open long after it exited.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// Flags of `floe launch`, named as torchrun names them (with torchrun's underscore
/// spellings accepted too).
#[derive(clap::Args)]
pub struct Args {
    /// Processes to start on this node, one per GPU; each gets its LOCAL_RANK (0 to N-1)
    /// to pick its GPU by.
    #[arg(
        long = "nproc-per-node",
        visible_aliases = ["nproc", "gpus"],
        alias = "nproc_per_node",
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    nproc_per_node: u32,
    /// Nodes in the job: run `floe launch` on each with the same flags and its own
    /// `--node-rank`; node K's processes are ranks K·N to K·N + N − 1.
    #[arg(long, default_value_t = 1, value_name = "M", value_parser = clap::value_parser!(u32).range(1..))]
    nnodes: u32,
    /// This node, `0 .. --nnodes`; node 0 runs rank 0, whose address is `--master-addr`.
    #[arg(long, alias = "node_rank", default_value_t = 0, value_name = "K")]
    node_rank: u32,
    /// Rank 0's address, as MASTER_ADDR.
    #[arg(long, alias = "master_addr", default_value = "127.0.0.1")]
    master_addr: String,
    /// Rank 0's rendezvous port, as MASTER_PORT; a free port when not given.
    #[arg(long, alias = "master_port")]
    master_port: Option<u16>,
    /// Also write each rank's output, unprefixed, to DIR/rank-R.log.
    #[arg(long, alias = "log_dir", value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Start every rank again, up to this many times, when one fails (as torchrun's
    /// `--max-restarts`; each rank sees `TORCHELASTIC_RESTART_COUNT`). With
    /// `trainer.resume = "latest"` a run goes on from its last checkpoint.
    #[arg(long, alias = "max_restarts", default_value_t = 0, value_name = "N")]
    max_restarts: u32,
    /// Seconds a rank has to exit after SIGTERM (or a forwarded SIGINT) before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value = "30", value_parser = parse_seconds)]
    grace_period: Duration,
    /// The program and its arguments (after `--` or after the flags). A floe subcommand
    /// (`train`, `eval`, ...) runs this floe binary with those arguments.
    #[arg(
        value_name = "PROGRAM",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    program: Vec<OsString>,
}

fn parse_seconds(text: &str) -> Result<Duration, String> {
    text.parse::<f64>()
        .ok()
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
        .ok_or_else(|| format!("{text:?} is not a number of seconds"))
}

/// The launcher's failure: a rank that failed or a signal that stopped the job. `floe`
/// exits with [`LaunchFailed::exit_code`], so a script or scheduler sees the rank's own
/// code (or 128 + the signal, as a shell reports it).
#[derive(Debug)]
pub struct LaunchFailed {
    message: String,
    exit_code: u8,
    /// A rank failed while running (not a rank that could not start, nor a signal to the
    /// launcher): `--max-restarts` starts the group again.
    restartable: bool,
}

impl LaunchFailed {
    /// The launcher's exit status.
    pub fn exit_code(&self) -> u8 {
        self.exit_code
    }
}

impl fmt::Display for LaunchFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LaunchFailed {}

/// What the launcher waits for.
enum Event {
    Exited {
        /// The rank's index on this node.
        local: usize,
        status: io::Result<ExitStatus>,
    },
    Signal(i32),
}

/// Runs `floe launch`.
pub fn run(args: Args) -> Result<()> {
    let nproc = args.nproc_per_node as usize;
    let (nnodes, node_rank) = (args.nnodes as usize, args.node_rank as usize);
    if node_rank >= nnodes {
        bail!(
            "--node-rank {node_rank} is not a node of --nnodes {nnodes} (0 to {})",
            nnodes - 1
        );
    }
    if nnodes > 1 && args.master_port.is_none() {
        bail!(
            "--nnodes {nnodes}: give every node the same --master-port (and --master-addr, \
             node 0's address)"
        );
    }
    if nnodes > 1 && is_loopback(&args.master_addr) {
        eprintln!(
            "floe launch: --master-addr {} is this machine's loopback: ranks on other \
             machines cannot reach it (fine when every node runs here)",
            args.master_addr
        );
    }
    let world_size = nnodes * nproc;
    let first_rank = node_rank * nproc;
    let master_port = match args.master_port {
        Some(port) => port,
        None => free_port().context("finding a free port for MASTER_PORT")?,
    };
    let (program, program_args) = resolve_program(&args.program)?;
    // Made before any rank starts, so that failing here leaves nothing running.
    let mut logs = Vec::new();
    if let Some(dir) = &args.log_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the log directory {}", dir.display()))?;
        for rank in first_rank..first_rank + nproc {
            let path = dir.join(format!("rank-{rank}.log"));
            let file =
                File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            logs.push(Arc::new(Mutex::new(file)));
        }
    }

    let (events, event_rx) = mpsc::channel();
    // Registered before any rank starts, so a Ctrl-C during start-up is forwarded too.
    let mut signals = Signals::new([SIGINT, SIGTERM]).context("handling SIGINT and SIGTERM")?;
    let signal_events = events.clone();
    thread::spawn(move || {
        for signal in signals.forever() {
            if signal_events.send(Event::Signal(signal)).is_err() {
                break;
            }
        }
    });

    for restart in 0..=args.max_restarts {
        let mut ranks = Vec::with_capacity(nproc);
        let mut output_threads = Vec::new();
        let mut failure = None;
        for local in 0..nproc {
            let rank = first_rank + local;
            let mut command = Command::new(&program);
            command
                .args(&program_args)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("GROUP_RANK", node_rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("MASTER_ADDR", &args.master_addr)
                .env("MASTER_PORT", master_port.to_string())
                .env("TORCHELASTIC_RESTART_COUNT", restart.to_string())
                // Ranks run in their own process groups (as torchrun's workers run in their
                // own sessions): a terminal's Ctrl-C then reaches only the launcher, which
                // forwards it once, and stopping a rank signals its whole group, so a shell
                // wrapper's children stop too. Out of the terminal's foreground group a rank
                // must not read the terminal, hence no stdin.
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            die_with_launcher(&mut command);
            let mut child = match command.spawn() {
                Ok(child) => child,
                Err(err) => {
                    failure = Some(LaunchFailed {
                        message: format!("rank {rank}: starting {program:?}: {err}"),
                        exit_code: 2,
                        restartable: false,
                    });
                    break;
                }
            };
            let log = logs.get(local).cloned();
            let stdout = child.stdout.take().expect("stdout is piped");
            let stderr = child.stderr.take().expect("stderr is piped");
            output_threads.push(copy_lines(rank, stdout, io::stdout, log.clone()));
            output_threads.push(copy_lines(rank, stderr, io::stderr, log));
            let pid = Pid::from_child(&child);
            let exited = events.clone();
            thread::spawn(move || {
                let status = child.wait();
                exited
                    .send(Event::Exited { local, status })
                    .expect("the launcher waits for every rank");
            });
            ranks.push(pid);
        }

        let result = supervise(&ranks, first_rank, &event_rx, failure, args.grace_period);
        let drain_deadline = Instant::now() + OUTPUT_DRAIN;
        while output_threads.iter().any(|thread| !thread.is_finished())
            && Instant::now() < drain_deadline
        {
            thread::sleep(Duration::from_millis(10));
        }
        match result {
            Err(failure) if failure.restartable && restart < args.max_restarts => {
                eprintln!(
                    "floe launch: {failure}; restarting every rank ({} of {} restarts)",
                    restart + 1,
                    args.max_restarts
                );
            }
            result => return result.map_err(anyhow::Error::new),
        }
    }
    unreachable!("the last attempt returns")
}

/// Waits for every rank in `ranks` (their process ids, by local rank; the first is rank
/// `first_rank`) to exit, stopping them all when one fails or the launcher is signalled.
/// `failure` is a failure before the wait began (a rank that did not start); the ranks
/// are then stopped at once.
fn supervise(
    ranks: &[Pid],
    first_rank: usize,
    events: &Receiver<Event>,
    mut failure: Option<LaunchFailed>,
    grace_period: Duration,
) -> Result<(), LaunchFailed> {
    let mut running = vec![true; ranks.len()];
    let mut interrupted = None;
    let mut kill_at = None;
    let mut stopped_others = false;
    // Signals the ranks still running; whether there were any.
    let signal_running = |running: &[bool], signal: Signal| {
        let mut any = false;
        for (pid, _) in ranks.iter().zip(running).filter(|(_, &running)| running) {
            // An error can only be ESRCH: the rank exited after its wait thread reported.
            let _ = kill_process_group(*pid, signal);
            any = true;
        }
        any
    };
    if failure.is_some() {
        stopped_others = signal_running(&running, Signal::TERM);
        kill_at = Some(Instant::now() + grace_period);
    }
    while running.contains(&true) {
        let event = match kill_at {
            Some(deadline) => {
                match events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(event) => event,
                    Err(RecvTimeoutError::Timeout) => {
                        eprintln!(
                            "floe launch: {} still running {grace_period:?} after \
                             SIGTERM; sending SIGKILL",
                            running_ranks(&running, first_rank)
                        );
                        signal_running(&running, Signal::KILL);
                        kill_at = None;
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => unreachable!("run holds a sender"),
                }
            }
            None => events.recv().expect("run holds a sender"),
        };
        match event {
            Event::Exited { local, status } => {
                running[local] = false;
                let rank = first_rank + local;
                let stopping = failure.is_some() || interrupted.is_some();
                let failed = match &status {
                    Ok(status) => !status.success(),
                    Err(_) => true,
                };
                if failed && !stopping {
                    let (what, exit_code) = describe_exit(&status);
                    eprintln!("floe launch: rank {rank} {what}; stopping the other ranks");
                    failure = Some(LaunchFailed {
                        message: format!("rank {rank} {what}"),
                        exit_code,
                        restartable: true,
                    });
                    stopped_others = signal_running(&running, Signal::TERM);
                    kill_at = Some(Instant::now() + grace_period);
                }
            }
            Event::Signal(signal) => {
                let name = signal_name(signal);
                if failure.is_some() || interrupted.is_some() {
                    // Ctrl-C while the ranks stop: the user does not want to wait for the
                    // grace period.
                    eprintln!(
                        "floe launch: {name} while the ranks stop; sending SIGKILL to {}",
                        running_ranks(&running, first_rank)
                    );
                    signal_running(&running, Signal::KILL);
                    kill_at = None;
                } else {
                    eprintln!("floe launch: {name}; forwarding it to every rank");
                    let forwarded = Signal::from_named_raw(signal).unwrap_or(Signal::TERM);
                    signal_running(&running, forwarded);
                    interrupted = Some(signal);
                    kill_at = Some(Instant::now() + grace_period);
                }
            }
        }
    }
    if let Some(mut failure) = failure {
        if stopped_others {
            failure.message.push_str("; the other ranks were stopped");
        }
        return Err(failure);
    }
    if let Some(signal) = interrupted {
        return Err(LaunchFailed {
            message: format!("stopped by {}", signal_name(signal)),
            exit_code: shell_status(signal),
            restartable: false,
        });
    }
    Ok(())
}

/// "exited with code 3" or "was killed by SIGKILL (signal 9)", and the status a shell
/// reports for it.
fn describe_exit(status: &io::Result<ExitStatus>) -> (String, u8) {
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => (format!("exited with code {code}"), code as u8),
            (None, Some(signal)) => (
                format!("was killed by {} (signal {signal})", signal_name(signal)),
                shell_status(signal),
            ),
            (None, None) => (format!("ended with {status}"), 1),
        },
        Err(err) => (format!("could not be waited for: {err}"), 2),
    }
}

/// 128 + the signal, as a shell reports a process the signal killed.
fn shell_status(signal: i32) -> u8 {
    (128 + signal).clamp(0, 255) as u8
}

fn signal_name(signal: i32) -> String {
    use signal_hook::consts::signal::*;
    let name = match signal {
        SIGHUP => "SIGHUP",
        SIGINT => "SIGINT",
        SIGQUIT => "SIGQUIT",
        SIGILL => "SIGILL",
        SIGTRAP => "SIGTRAP",
        SIGABRT => "SIGABRT",
        SIGBUS => "SIGBUS",
        SIGFPE => "SIGFPE",
        SIGKILL => "SIGKILL",
        SIGUSR1 => "SIGUSR1",
        SIGSEGV => "SIGSEGV",
        SIGUSR2 => "SIGUSR2",
        SIGPIPE => "SIGPIPE",
        SIGALRM => "SIGALRM",
        SIGTERM => "SIGTERM",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// "rank 1" or "ranks 1, 3": the ranks still running (`running` by local rank).
fn running_ranks(running: &[bool], first_rank: usize) -> String {
    let ranks: Vec<String> = (0..running.len())
        .filter(|&local| running[local])
        .map(|local| (first_rank + local).to_string())
        .collect();
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", ranks.join(", "))
}

/// Whether `addr` names this machine only, which other nodes cannot reach.
fn is_loopback(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A port free right now, found by binding port 0 and letting go of it. Another process
/// may take it before rank 0 binds it; rank 0 then fails naming the address, and
/// `--master-port` avoids the race.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind(("0.0.0.0", 0))?.local_addr()?.port())
}

/// The program to start and its arguments: a floe subcommand name runs this floe binary
/// (what `floe launch --gpus 2 -- train recipe.toml` means); anything else is a program
/// found as the shell would find it (`./train` for a file named like a subcommand).
fn resolve_program(words: &[OsString]) -> Result<(OsString, Vec<OsString>)> {
    let (first, rest) = words.split_first().expect("clap requires a program");
    let is_subcommand = first.to_str().is_some_and(|word| {
        crate::Cli::command()
            .get_subcommands()
            .any(|subcommand| subcommand.get_name() == word)
    });
    if is_subcommand {
        let floe = std::env::current_exe().context("finding this floe binary")?;
        Ok((floe.into_os_string(), words.to_vec()))
    } else {
        Ok((first.clone(), rest.to_vec()))
    }
}

/// Copies `source` line by line to the launcher's `sink` (stdout or stderr), each line
/// prefixed with `[rank R] `, and unprefixed to `log`. Lines stay whole when ranks write
/// at once; a rank's partial last line gets its newline.
fn copy_lines<W: Write + 'static>(
    rank: usize,
    source: impl Read + Send + 'static,
    sink: fn() -> W,
    log: Option<Arc<Mutex<File>>>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut line = Vec::new();
        let mut prefixed = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            prefixed.clear();
            write!(prefixed, "[rank {rank}] ").expect("writing to a Vec");
            prefixed.extend_from_slice(&line);
            // Write errors (a closed terminal, a full disk) must not stop the copy: a rank
            // whose pipe is no longer read blocks.
            let _ = sink().write_all(&prefixed);
            if let Some(log) = &log {
                let _ = log.lock().expect("a log writer panicked").write_all(&line);
            }
        }
    })
}

/// On Linux, a rank gets SIGKILL when the launcher dies without stopping it (itself
/// killed by SIGKILL or the OOM killer), instead of holding its GPU as an orphan.
#[cfg(target_os = "linux")]
fn die_with_launcher(command: &mut Command) {
    let launcher = rustix::process::getpid();
    // SAFETY: the closure runs in the forked child before exec; it makes two system
    // calls (async-signal-safe) and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            // The launcher may have died between the fork and the line above.
            if rustix::process::getppid() != Some(launcher) {
                return Err(rustix::io::Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_launcher(_command: &mut Command) {}
