//! Shared by the CLI tests: `floe serve` on a free loopback port for the duration of a
//! test, and a run's metrics compared line by line.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long the server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running `floe serve`; killed when dropped.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Server {
    /// Starts `floe serve --model tiny=embedded:tiny` with `data_dir`, accepting the
    /// API key `api_key`, and waits until it accepts connections.
    pub fn start(data_dir: &Path, api_key: &str) -> Server {
        Self::start_with(data_dir, Some(api_key), &[])
    }

    /// [`Server::start`] with the keys of `FLOE_API_KEYS` (none when `None`) and more
    /// flags.
    pub fn start_with(data_dir: &Path, api_keys: Option<&str>, flags: &[&str]) -> Server {
        // A port the OS just handed out is free; another process could take it before
        // the server binds, which the connect loop below would report.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
        Self::start_at(port, data_dir, api_keys, flags)
    }

    /// [`Server::start_with`] on `port` (a restart at the address clients know).
    pub fn start_at(port: u16, data_dir: &Path, api_keys: Option<&str>, flags: &[&str]) -> Server {
        let child = Command::new(env!("CARGO_BIN_EXE_floe"))
            .args([
                "serve",
                "--model",
                "tiny=embedded:tiny",
                "--host",
                "127.0.0.1",
            ])
            .args(["--port", &port.to_string(), "--threads", "2"])
            .arg("--data-dir")
            .arg(data_dir)
            .args(flags)
            .env("FLOE_API_KEYS", api_keys.unwrap_or(""))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting floe serve");
        let mut server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let started = Instant::now();
        // Another server (of a test beside this one) may have taken the port first: wait
        // until this child holds the listening socket, not merely until the port answers.
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err()
            || !listens(server.child.id(), port)
        {
            if let Some(status) = server.child.try_wait().expect("polling floe serve") {
                panic!("floe serve exited with {status} before listening on {addr}");
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "floe serve did not listen on {addr} within {START_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }
}

/// Whether process `pid` holds the socket listening on 127.0.0.1:`port` (Linux: its
/// inode in /proc/net/tcp among the process's open files). Elsewhere, true.
fn listens(pid: u32, port: u16) -> bool {
    let Ok(table) = std::fs::read_to_string("/proc/net/tcp") else {
        return true;
    };
    let local = format!("0100007F:{port:04X}");
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 9 && f[1] == local && f[3] == "0A")
        .map(|f| format!("socket:[{}]", f[9]))
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .any(|target| {
            inodes
                .iter()
                .any(|inode| target.as_os_str() == inode.as_str())
        })
}

impl Server {
    /// Kills the process with SIGKILL (no shutdown of any kind) and reaps it.
    pub fn kill(&mut self) {
        self.child.kill().expect("killing floe serve");
        self.child.wait().expect("reaping floe serve");
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.url.rsplit(':').next().unwrap().parse().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of a run's `metrics.jsonl`: its step and metrics, wall times left out.
pub type MetricsLine = (u64, BTreeMap<String, Option<f64>>);

/// The lines of `run_dir/metrics.jsonl` without their wall times (`timing/*` and the
/// pipeline's `async/*_s`), which no two runs share.
pub fn metrics_without_timing(run_dir: &Path) -> Vec<MetricsLine> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let metrics = record["metrics"]
                .as_object()
                .unwrap()
                .iter()
                .filter(|(name, _)| {
                    !(name.starts_with("timing/")
                        || name.starts_with("async/") && name.ends_with("_s"))
                })
                .map(|(name, value)| (name.clone(), value.as_f64()))
                .collect();
            (record["step"].as_u64().unwrap(), metrics)
        })
        .collect()
}

/// Asserts that two runs logged the same lines with bit-identical metrics; on failure lists
/// every metric that differs (`got` vs `want`), with `what` naming the comparison.
pub fn assert_same_metrics(got: &[MetricsLine], want: &[MetricsLine], what: &str) {
    let steps = |lines: &[MetricsLine]| lines.iter().map(|(s, _)| *s).collect::<Vec<_>>();
    assert_eq!(
        steps(got),
        steps(want),
        "{what}: the runs logged other lines"
    );
    let differing: Vec<String> = got
        .iter()
        .zip(want)
        .flat_map(|((step, got), (_, want))| {
            let names: BTreeSet<&String> = got.keys().chain(want.keys()).collect();
            names
                .into_iter()
                .filter(|name| got.get(*name) != want.get(*name))
                .map(|name| {
                    format!(
                        "step {step} {name}: {:?} vs {:?}",
                        got.get(name),
                        want.get(name)
                    )
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(differing.is_empty(), "{what}:\n{}", differing.join("\n"));
}
