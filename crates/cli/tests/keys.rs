//! Issue 20's access control, as an operator runs it: `floe keys` issues and revokes the
//! keys of a running `floe serve --api-key-file`, which accepts and refuses them without a
//! restart.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;

use support::Server;

/// `floe keys ARGS...`'s stdout; panics, with its stderr, when it fails.
fn floe_keys(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_floe"))
        .arg("keys")
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "floe keys {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The HTTP status of `GET /api/v1/get_server_capabilities` with `key`.
fn status_with_key(url: &str, key: &str) -> u16 {
    let host = url.trim_start_matches("http://");
    let mut stream = TcpStream::connect(host).unwrap();
    write!(
        stream,
        "GET /api/v1/get_server_capabilities HTTP/1.1\r\nHost: {host}\r\nX-API-Key: {key}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"))
}

#[test]
fn keys_issued_and_revoked_while_the_server_runs_take_effect_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys.txt");
    let file_arg = file.to_str().unwrap();
    // A key file that does not exist is refused at start, naming the command that makes one.
    let missing = Command::new(env!("CARGO_BIN_EXE_floe"))
        .args([
            "serve",
            "--model",
            "tiny=embedded:tiny",
            "--api-key-file",
            file_arg,
        ])
        .env("FLOE_API_KEYS", "")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success() && stderr.contains("floe keys issue"),
        "{stderr}"
    );

    let alice = floe_keys(&["issue", "--file", file_arg, "--name", "alice"]);
    let alice = alice.trim();
    assert!(alice.starts_with("tml-"), "{alice}");
    let server = Server::start_with(
        &dir.path().join("serve"),
        None,
        &["--api-key-file", file_arg],
    );
    assert_eq!(status_with_key(&server.url, alice), 200);
    assert_eq!(status_with_key(&server.url, "tml-guess"), 401);

    let bob = floe_keys(&["issue", "--file", file_arg, "--name", "bob"]);
    assert_eq!(status_with_key(&server.url, bob.trim()), 200);
    floe_keys(&["revoke", "--file", file_arg, "alice"]);
    assert_eq!(status_with_key(&server.url, alice), 401);
    assert_eq!(status_with_key(&server.url, bob.trim()), 200);

    let listed = floe_keys(&["list", "--file", file_arg]);
    assert!(
        listed.contains("bob") && !listed.contains("alice"),
        "{listed}"
    );
    assert!(
        !listed.contains(bob.trim()),
        "a listing shows only a key's first characters"
    );
    assert!(Path::new(&file).is_file());
}
