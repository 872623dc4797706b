//! `floe serve` on a free loopback port for the duration of a test.

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
        // A port the OS just handed out is free; another process could take it before
        // the server binds, which the connect loop below would report.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free loopback port")
            .port();
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
            .env("FLOE_API_KEYS", api_key)
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
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
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

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
