//! The rendezvous on loopback, ranks as threads: every rank gets rank 0's blob, and a rank
//! that never comes fails everyone with its name.

use std::net::{Ipv4Addr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use floe_dist::{join, rendezvous, Master, RendezvousError, World};

/// Rank 0 bound to a free loopback port, and the world every rank of `world_size` sees.
fn bound(world_size: usize) -> (Master, World) {
    let mut world = World {
        rank: 0,
        world_size,
        local_rank: 0,
        master: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
    };
    let master = Master::bind(&world).unwrap();
    world.master = master.addr();
    (master, world)
}

fn blob() -> Vec<u8> {
    (0..128u32).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn every_rank_receives_the_blob() {
    for world_size in 1..=4 {
        let (master, world) = bound(world_size);
        let joiners: Vec<_> = (1..world_size)
            .map(|rank| {
                let world = World {
                    rank,
                    local_rank: rank,
                    ..world
                };
                thread::spawn(move || join(&world, Duration::from_secs(20)))
            })
            .collect();
        let addrs = master.serve(&blob(), Duration::from_secs(20)).unwrap();
        assert_eq!(addrs.len(), world_size);
        assert_eq!(addrs[0], world.master);
        for joiner in joiners {
            assert_eq!(
                joiner.join().unwrap().unwrap(),
                blob(),
                "world size {world_size}"
            );
        }
    }
}

#[test]
fn ranks_may_start_before_rank_zero() {
    let (master, world) = bound(3);
    let port_owner = master.addr();
    drop(master); // nobody listens yet; the joiners retry
    let joiners: Vec<_> = (1..3)
        .map(|rank| {
            let world = World { rank, ..world };
            thread::spawn(move || join(&world, Duration::from_secs(20)))
        })
        .collect();
    thread::sleep(Duration::from_millis(200));
    let got = rendezvous(&world, blob, Duration::from_secs(20)).unwrap();
    assert_eq!(got, blob());
    assert_eq!(world.master, port_owner);
    for joiner in joiners {
        assert_eq!(joiner.join().unwrap().unwrap(), blob());
    }
}

#[test]
fn a_world_of_one_opens_no_socket() {
    let got = rendezvous(&World::single(), blob, Duration::ZERO).unwrap();
    assert_eq!(got, blob());
}

#[test]
fn a_rank_that_never_comes_is_named_by_every_rank() {
    let (master, world) = bound(4);
    let timeout = Duration::from_millis(600);
    // Ranks 1 and 2 come; rank 3 never does.
    let joiners: Vec<_> = (1..3)
        .map(|rank| {
            let world = World { rank, ..world };
            thread::spawn(move || join(&world, timeout))
        })
        .collect();
    let start = Instant::now();
    let error = master.serve(&blob(), timeout).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(5));
    match &error {
        RendezvousError::Timeout {
            missing,
            world_size,
            ..
        } => {
            assert_eq!((missing.as_slice(), *world_size), (&[3][..], 4));
        }
        other => panic!("expected a timeout, got {other}"),
    }
    let message = error.to_string();
    assert!(
        message.contains("rank(s) 3 of world size 4 never joined"),
        "{message}"
    );
    for (rank, joiner) in (1..3).zip(joiners) {
        let error = joiner.join().unwrap().unwrap_err();
        let text = error.to_string();
        assert!(
            matches!(error, RendezvousError::FailedAtMaster { .. }),
            "{text}"
        );
        assert!(
            text.starts_with(&format!("rank {rank}: the rendezvous at rank 0")),
            "{text}"
        );
        assert!(
            text.contains("rank(s) 3 of world size 4 never joined"),
            "{text}"
        );
    }
}

#[test]
fn several_missing_ranks_are_all_named() {
    let (master, world) = bound(4);
    let joiner =
        thread::spawn(move || join(&World { rank: 2, ..world }, Duration::from_millis(300)));
    let error = master
        .serve(&blob(), Duration::from_millis(300))
        .unwrap_err();
    assert!(
        error.to_string().contains("rank(s) 1, 3 of world size 4"),
        "{error}"
    );
    assert!(joiner.join().unwrap().is_err());
}

#[test]
fn rank_zero_that_never_comes_is_named() {
    let (master, world) = bound(2);
    drop(master);
    let error = join(&World { rank: 1, ..world }, Duration::from_millis(300)).unwrap_err();
    let text = error.to_string();
    assert!(
        matches!(error, RendezvousError::Unreachable { rank: 1, .. }),
        "{text}"
    );
    assert!(
        text.contains(&format!("rank 0 at {}", world.master)),
        "{text}"
    );
}

#[test]
fn a_rank_of_another_world_fails_the_rendezvous() {
    let (master, world) = bound(3);
    let stray = thread::spawn(move || {
        join(
            &World {
                rank: 1,
                world_size: 2,
                ..world
            },
            Duration::from_secs(20),
        )
    });
    let error = master.serve(&blob(), Duration::from_secs(20)).unwrap_err();
    let text = error.to_string();
    assert!(
        text.contains("rank 1 at") && text.contains("world size 2, rank 0 with 3"),
        "{text}"
    );
    let stray = stray.join().unwrap().unwrap_err().to_string();
    assert!(stray.contains("world size 2, rank 0 with 3"), "{stray}");
}

#[test]
fn a_rank_twice_fails_the_rendezvous() {
    let (master, world) = bound(3);
    let twins: Vec<_> = (0..2)
        .map(|_| thread::spawn(move || join(&World { rank: 1, ..world }, Duration::from_secs(20))))
        .collect();
    let error = master.serve(&blob(), Duration::from_secs(20)).unwrap_err();
    assert!(error.to_string().contains("rank 1 joined twice"), "{error}");
    for twin in twins {
        assert!(twin.join().unwrap().is_err());
    }
}
