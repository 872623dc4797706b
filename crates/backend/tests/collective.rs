//! The in-process collective: world sizes 1-4 as threads, sums in rank order (bit for
//! bit), and failures that name the rank.

use std::thread;
use std::time::{Duration, Instant};

use floe_backend::cpu::{CpuBackend, CpuBuf};
use floe_backend::{Backend, BufKind, Collective, Error, InProcessCollective};

type Rank = InProcessCollective<f32>;

/// Runs `f` on every rank of a group of `world_size` threads; results in rank order.
fn on_ranks<R: Send + 'static>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(Rank, &CpuBackend) -> R + Send + Sync + Copy + 'static,
) -> Vec<R> {
    let handles: Vec<_> = Rank::group(world_size, timeout)
        .into_iter()
        .map(|rank| thread::spawn(move || f(rank, &CpuBackend::new())))
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Rank `r`'s values: different per rank, with magnitudes whose sum rounds differently
/// in another order.
fn values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((rank * 31 + i * 7) % 13) as f32 * 0.1 + if rank % 2 == 0 { 1e7 } else { -1e7 + 0.3 }
        })
        .collect()
}

const LONG: Duration = Duration::from_secs(30);

#[test]
fn all_reduce_sums_in_rank_order() {
    for world_size in 1..=4 {
        let n = 37;
        let got = on_ranks(world_size, LONG, move |c, b| {
            let mut buf = b.upload(&values(c.rank(), n), BufKind::Full).unwrap();
            c.all_reduce_sum(&mut buf).unwrap();
            b.download(&buf).unwrap()
        });
        let mut want = values(0, n);
        for r in 1..world_size {
            for (w, v) in want.iter_mut().zip(values(r, n)) {
                *w += v;
            }
        }
        for (rank, g) in got.iter().enumerate() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(g), bits(&want), "world size {world_size}, rank {rank}");
        }
    }
}

#[test]
fn all_gather_reduce_scatter_broadcast_barrier() {
    for world_size in 1..=4 {
        let got = on_ranks(world_size, LONG, move |c, b| {
            let w = c.world_size();
            let r = c.rank();
            let send = b.upload(&values(r, 3), BufKind::Compute).unwrap();
            let mut gathered = b.zeros(3 * w, BufKind::Compute).unwrap();
            c.all_gather(&send, &mut gathered).unwrap();
            let ids = b.upload_index(&[r as u32, u32::MAX - r as u32]).unwrap();
            let mut all_ids = b.upload_index(&vec![0; 2 * w]).unwrap();
            c.all_gather(&ids, &mut all_ids).unwrap();
            let full = b.upload(&values(r, 2 * w), BufKind::Full).unwrap();
            let mut block = b.zeros(2, BufKind::Full).unwrap();
            c.reduce_scatter_sum(&full, &mut block).unwrap();
            let root = w - 1;
            let mut bcast = b.upload(&values(r, 4), BufKind::Full).unwrap();
            c.broadcast(&mut bcast, root).unwrap();
            c.barrier().unwrap();
            (
                b.download(&gathered).unwrap(),
                b.download_index(&all_ids).unwrap(),
                b.download(&block).unwrap(),
                b.download(&bcast).unwrap(),
            )
        });
        let gathered: Vec<f32> = (0..world_size).flat_map(|r| values(r, 3)).collect();
        let ids: Vec<u32> = (0..world_size as u32)
            .flat_map(|r| [r, u32::MAX - r])
            .collect();
        let mut sum = values(0, 2 * world_size);
        for r in 1..world_size {
            for (s, v) in sum.iter_mut().zip(values(r, 2 * world_size)) {
                *s += v;
            }
        }
        for (rank, (g, i, block, bcast)) in got.into_iter().enumerate() {
            assert_eq!(g, gathered, "all_gather, rank {rank} of {world_size}");
            assert_eq!(i, ids, "all_gather of ids, rank {rank} of {world_size}");
            assert_eq!(
                block,
                sum[2 * rank..2 * rank + 2],
                "reduce_scatter, rank {rank}"
            );
            assert_eq!(bcast, values(world_size - 1, 4), "broadcast, rank {rank}");
        }
    }
}

#[test]
fn shapes_and_kinds_are_checked() {
    let errors = on_ranks(2, LONG, |c, b| {
        let mut ids = b.zeros(4, BufKind::Index).unwrap();
        let kind = c.all_reduce_sum(&mut ids).unwrap_err();
        let send = b.zeros(4, BufKind::Full).unwrap();
        let mut recv = b.zeros(4, BufKind::Full).unwrap();
        let gather = c.all_gather(&send, &mut recv).unwrap_err();
        let scatter = c.reduce_scatter_sum(&send, &mut recv).unwrap_err();
        let root = c.broadcast(&mut recv, 2).unwrap_err();
        (kind, gather, scatter, root)
    });
    let (kind, gather, scatter, root) = &errors[0];
    assert!(
        matches!(
            kind,
            Error::Kind {
                op: "all_reduce_sum",
                ..
            }
        ),
        "{kind}"
    );
    assert_eq!(
        gather.to_string(),
        "all_gather: recv has 4 elements, world size 2 × send's 4 = 8"
    );
    assert_eq!(
        scatter.to_string(),
        "reduce_scatter_sum: send has 4 elements, world size 2 × recv's 4 = 8"
    );
    assert_eq!(
        root.to_string(),
        "broadcast: root 2 is not a rank of world size 2"
    );
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let start = Instant::now();
    let results = on_ranks(3, Duration::from_millis(300), |c, b| {
        if c.rank() == 2 {
            // Keeps its handle but never calls: the others time out.
            thread::sleep(Duration::from_millis(800));
            return None;
        }
        let mut buf = b.zeros(2, BufKind::Full).unwrap();
        Some(c.all_reduce_sum(&mut buf).unwrap_err().to_string())
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for message in results.into_iter().flatten() {
        assert!(
            message.starts_with("all_reduce_sum: rank(s) 2 of world size 3 did not join"),
            "{message}"
        );
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_at_once() {
    let start = Instant::now();
    let results = on_ranks(4, LONG, |c, b| {
        if c.rank() == 1 {
            drop(c);
            return None;
        }
        let mut buf = b.zeros(2, BufKind::Full).unwrap();
        Some(c.all_reduce_sum(&mut buf).unwrap_err().to_string())
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "no waiting out the timeout"
    );
    for message in results.into_iter().flatten() {
        assert_eq!(message, "all_reduce_sum: rank 1 left the group");
    }
}

#[test]
fn ranks_calling_different_ops_fail() {
    let results = on_ranks(2, LONG, |c, b| {
        let mut buf = b.zeros(2, BufKind::Full).unwrap();
        if c.rank() == 0 {
            c.all_reduce_sum(&mut buf).unwrap_err().to_string()
        } else {
            c.broadcast(&mut buf, 0).unwrap_err().to_string()
        }
    });
    for message in results {
        assert!(
            message.contains("ranks disagree: rank 0 called all_reduce_sum")
                && message.contains("rank 1 called broadcast"),
            "{message}"
        );
    }
}

#[test]
fn the_cpu_buffers_are_what_the_collective_moves() {
    // The collective works on the backend's own buffers: no copies through the host API.
    let got = on_ranks(2, LONG, |c, _| {
        let mut buf = CpuBuf::Float {
            data: vec![c.rank() as f32 + 1.0],
            kind: BufKind::Full,
        };
        c.all_reduce_sum(&mut buf).unwrap();
        buf
    });
    for buf in got {
        assert_eq!(
            buf,
            CpuBuf::Float {
                data: vec![3.0],
                kind: BufKind::Full
            }
        );
    }
}
