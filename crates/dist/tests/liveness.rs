//! The liveness links on loopback, ranks as threads: a rank killed without a goodbye, or
//! failing with its error, is reported to every other rank at once, named; ranks that
//! leave normally report nothing.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use floe_dist::{rendezvous_linked, Liveness, RankStopped, World};

/// Long enough for a loaded machine, far below any collective timeout.
const NOTICE: Duration = Duration::from_secs(10);

/// `world_size` ranks joined with liveness links: each rank's end and what it hears.
fn linked(world_size: usize) -> Vec<(Liveness, Receiver<RankStopped>)> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..world_size)
        .map(|rank| {
            thread::spawn(move || {
                let world = World {
                    rank,
                    world_size,
                    local_rank: rank,
                    master: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                };
                let (heard, rx) = mpsc::channel();
                let on_stop = Arc::new(move |stopped| {
                    let _ = heard.send(stopped);
                });
                let (blob, liveness) =
                    rendezvous_linked(&world, || b"id".to_vec(), NOTICE, on_stop).unwrap();
                assert_eq!(blob, b"id");
                (liveness, rx)
            })
        })
        .collect();
    ranks.into_iter().map(|r| r.join().unwrap()).collect()
}

fn heard(rx: &Receiver<RankStopped>, rank: usize) -> RankStopped {
    rx.recv_timeout(NOTICE)
        .unwrap_or_else(|_| panic!("rank {rank} heard of no stop"))
}

fn hears_nothing(rx: &Receiver<RankStopped>, rank: usize) {
    if let Ok(stopped) = rx.recv_timeout(Duration::from_millis(300)) {
        panic!("rank {rank} heard: {stopped}");
    }
}

#[test]
fn a_rank_gone_without_a_goodbye_is_named_to_every_other_rank_once() {
    let mut ranks = linked(3);
    let (gone, _) = ranks.remove(2);
    drop(gone); // what the OS does to a killed process's sockets
    for (rank, (_, rx)) in ranks.iter().enumerate() {
        let stopped = heard(rx, rank);
        assert_eq!(stopped.rank, 2, "rank {rank}: {stopped}");
        assert!(stopped.reason.contains("without a goodbye"), "{stopped}");
    }
    // Rank 1 stopping next is not reported again: the first stop is the cause.
    let (second, _) = ranks.remove(1);
    drop(second);
    hears_nothing(&ranks[0].1, 0);
}

#[test]
fn a_failing_rank_tells_everyone_its_error() {
    let mut ranks = linked(4);
    let (failing, own) = ranks.remove(1);
    failing.fail("CUDA out of memory allocating 2.0 GiB");
    for (i, (_, rx)) in ranks.iter().enumerate() {
        let stopped = heard(rx, i);
        assert_eq!(stopped.rank, 1, "{stopped}");
        assert_eq!(stopped.reason, "CUDA out of memory allocating 2.0 GiB");
    }
    hears_nothing(&own, 1);
}

#[test]
fn rank_zero_gone_is_named_to_the_others() {
    let mut ranks = linked(3);
    let (zero, _) = ranks.remove(0);
    drop(zero);
    for (i, (_, rx)) in ranks.iter().enumerate() {
        let stopped = heard(rx, i + 1);
        assert_eq!(stopped.rank, 0, "{stopped}");
    }
}

#[test]
fn ranks_that_leave_report_nothing_whatever_the_order() {
    let mut ranks = linked(3);
    let (one, rx1) = ranks.remove(1);
    one.leave();
    let (zero, rx0) = ranks.remove(0);
    hears_nothing(&rx0, 0);
    zero.leave();
    let (two, rx2) = ranks.remove(0);
    hears_nothing(&rx2, 2);
    two.leave();
    hears_nothing(&rx1, 1);
    // A world of one watches nobody.
    let alone = linked(1);
    hears_nothing(&alone[0].1, 0);
}
