//! The world read from torchrun's and Slurm's variables, and the errors that name them.

use std::collections::HashMap;
use std::net::SocketAddr;

use floe_dist::{World, WorldError, DEFAULT_MASTER_PORT};

fn world(vars: &[(&str, &str)], master: Option<&str>) -> Result<World, WorldError> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    World::from_vars(|name| vars.get(name).cloned(), master)
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "3"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_RANK", "3"),
    ("MASTER_ADDR", "127.0.0.1"),
    ("MASTER_PORT", "29400"),
];

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn no_launcher_is_a_single_process() {
    assert_eq!(world(&[], None).unwrap(), World::single());
    let w = world(&[("MASTER_ADDR", "10.0.0.1")], None).unwrap();
    assert_eq!(w, World::single(), "MASTER_ADDR alone starts no job");
    assert!(w.is_master());
}

#[test]
fn torchrun_variables() {
    let w = world(TORCHRUN, None).unwrap();
    assert_eq!(
        w,
        World {
            rank: 3,
            world_size: 8,
            local_rank: 3,
            master: addr("127.0.0.1:29400"),
        }
    );
    assert!(!w.is_master());
    let w = world(TORCHRUN, Some("127.0.0.1:1234")).unwrap();
    assert_eq!(w.master, addr("127.0.0.1:1234"), "--master overrides");
    let w = world(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "29500"),
        ],
        None,
    )
    .unwrap();
    assert!(
        w.master.ip().is_loopback() && w.master.port() == 29500,
        "{w:?}"
    );
}

#[test]
fn slurm_variables() {
    let slurm = [
        ("SLURM_PROCID", "9"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"),
    ];
    let w = world(&slurm, None).unwrap();
    assert_eq!((w.rank, w.world_size, w.local_rank), (9, 16, 1));
    assert_eq!(
        w.master,
        SocketAddr::new("10.1.2.3".parse().unwrap(), DEFAULT_MASTER_PORT)
    );
    let mut with_master = slurm.to_vec();
    with_master.extend([("MASTER_ADDR", "10.9.9.9"), ("MASTER_PORT", "4000")]);
    assert_eq!(
        world(&with_master, None).unwrap().master,
        addr("10.9.9.9:4000")
    );
    assert_eq!(
        world(&slurm, Some("10.7.7.7:5000")).unwrap().master,
        addr("10.7.7.7:5000")
    );
    // torchrun inside a Slurm allocation: torchrun's variables win.
    let mut both = slurm.to_vec();
    both.extend_from_slice(TORCHRUN);
    assert_eq!(world(&both, None).unwrap().rank, 3);
}

fn message(vars: &[(&str, &str)], master: Option<&str>) -> String {
    world(vars, master).unwrap_err().to_string()
}

fn replaced(name: &str, value: Option<&str>) -> Vec<(&'static str, String)> {
    TORCHRUN
        .iter()
        .filter(|(k, _)| *k != name)
        .map(|(k, v)| (*k, v.to_string()))
        .chain(value.map(|v| {
            (
                TORCHRUN.iter().find(|(k, _)| *k == name).unwrap().0,
                v.into(),
            )
        }))
        .collect()
}

fn torchrun_error(name: &str, value: Option<&str>) -> String {
    let vars = replaced(name, value);
    let vars: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    message(&vars, None)
}

#[test]
fn errors_name_the_variable() {
    for missing in ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
        let m = torchrun_error(missing, None);
        assert!(
            m.starts_with(&format!("{missing} is not set, but RANK is")),
            "{m}"
        );
    }
    let m = torchrun_error("RANK", Some("two"));
    assert_eq!(m, "RANK=\"two\": not a non-negative integer");
    let m = torchrun_error("RANK", Some("8"));
    assert_eq!(m, "RANK=\"8\": ranks run 0 .. WORLD_SIZE=8");
    let m = torchrun_error("WORLD_SIZE", Some("0"));
    assert!(m.starts_with("WORLD_SIZE=\"0\""), "{m}");
    let m = torchrun_error("LOCAL_RANK", Some("-1"));
    assert!(m.starts_with("LOCAL_RANK=\"-1\""), "{m}");
    for port in ["0", "70000", "http"] {
        let m = torchrun_error("MASTER_PORT", Some(port));
        assert!(
            m.starts_with(&format!("MASTER_PORT=\"{port}\": not a port")),
            "{m}"
        );
    }
    let m = torchrun_error("MASTER_ADDR", Some("no such host.invalid"));
    assert!(
        m.starts_with("MASTER_ADDR=\"no such host.invalid\": does not resolve"),
        "{m}"
    );
    let m = message(TORCHRUN, Some("nonsense"));
    assert!(
        m.starts_with("--master=\"nonsense\": does not resolve"),
        "{m}"
    );

    let m = message(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")], None);
    assert!(
        m.starts_with("SLURM_LOCALID is not set, but SLURM_PROCID is"),
        "{m}"
    );
    let m = message(
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
        ],
        None,
    );
    assert!(m.starts_with("SLURM_LAUNCH_NODE_IPADDR is not set"), "{m}");
    let m = message(
        &[
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.1"),
        ],
        None,
    );
    assert_eq!(m, "SLURM_PROCID=\"2\": ranks run 0 .. SLURM_NTASKS=2");
}
