//! Collective ops across the ranks of a data-parallel job (`docs/distributed.md`).
//!
//! [`Collective`] sits beside [`Backend`]: the primitive ops data parallelism needs, over
//! the backend's own buffers, enqueued in order with its other ops. Implementations:
//! `cuda::NcclCollective` (NCCL on the backend's stream) and [`InProcessCollective`], threads of
//! one process over [`CpuBackend`](crate::cpu::CpuBackend) buffers, for tests.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::cpu::{CpuBuf, CpuFloat};
use crate::{Backend, BufKind, Error, Result};

/// The collective ops of one rank in a group of `world_size` ranks. Every rank calls the
/// same ops in the same order with buffers of the same lengths and kinds.
pub trait Collective<B: Backend>: Send + Sync {
    /// This rank, `0 .. world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// `buf = Σ over ranks of buf`, in the buffer's precision: Full for gradients (sums in
    /// bf16 would lose their low bits), Compute for the partial activations of a
    /// tensor-parallel layer (as every tensor-parallel engine sums them).
    fn all_reduce_sum(&self, buf: &mut B::Buf) -> Result<()>;
    /// `recv[r·n .. (r+1)·n] = rank r's send` with `n = len(send)`; both of one kind.
    fn all_gather(&self, send: &B::Buf, recv: &mut B::Buf) -> Result<()>;
    /// `recv = block rank of (Σ over ranks of send)`, blocks of `len(recv)`; `send` is
    /// `world_size · len(recv)`. Full buffers only.
    fn reduce_scatter_sum(&self, send: &B::Buf, recv: &mut B::Buf) -> Result<()>;
    /// `buf = root's buf`.
    fn broadcast(&self, buf: &mut B::Buf, root: usize) -> Result<()>;
    /// Returns once every rank has called it and every op enqueued before it is done.
    fn barrier(&self) -> Result<()>;
}

/// Checks the lengths and kinds of a call, the same for every implementation.
pub(crate) fn check(op: &'static str, world_size: usize, args: Args) -> Result<()> {
    let shape = |msg: String| Err(Error::Shape { op, msg });
    let full = |arg: &'static str, got: BufKind| {
        if got == BufKind::Full {
            Ok(())
        } else {
            Err(Error::Kind {
                op,
                arg,
                expected: BufKind::Full,
                got,
            })
        }
    };
    match args {
        Args::AllReduce {
            kind: BufKind::Compute,
        } => Ok(()),
        Args::AllReduce { kind } => full("buf", kind),
        Args::AllGather { send, recv } => {
            if send.1 != recv.1 {
                return Err(Error::Kind {
                    op,
                    arg: "recv",
                    expected: send.1,
                    got: recv.1,
                });
            }
            if recv.0 != world_size * send.0 {
                return shape(format!(
                    "recv has {} elements, world size {world_size} × send's {} = {}",
                    recv.0,
                    send.0,
                    world_size * send.0
                ));
            }
            Ok(())
        }
        Args::ReduceScatter { send, recv } => {
            full("send", send.1)?;
            full("recv", recv.1)?;
            if send.0 != world_size * recv.0 {
                return shape(format!(
                    "send has {} elements, world size {world_size} × recv's {} = {}",
                    send.0,
                    recv.0,
                    world_size * recv.0
                ));
            }
            Ok(())
        }
        Args::Broadcast { root } => {
            if root >= world_size {
                return shape(format!(
                    "root {root} is not a rank of world size {world_size}"
                ));
            }
            Ok(())
        }
    }
}

/// The lengths and kinds of a call's buffers, for [`check`].
pub(crate) enum Args {
    AllReduce {
        kind: BufKind,
    },
    AllGather {
        send: (usize, BufKind),
        recv: (usize, BufKind),
    },
    ReduceScatter {
        send: (usize, BufKind),
        recv: (usize, BufKind),
    },
    Broadcast {
        root: usize,
    },
}

/// One rank of a group whose ranks are threads of one process, over CPU buffers; for
/// tests of the data-parallel logic without GPUs. Sums run in rank order, so every rank
/// gets the same bits and results compare bit for bit. A rank that does not arrive within
/// the timeout fails the op on every other rank, naming it; so does a rank whose handle
/// is dropped.
pub struct InProcessCollective<T: CpuFloat> {
    rank: usize,
    shared: Arc<Shared<T>>,
}

struct Shared<T> {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State<T>>,
    changed: Condvar,
}

struct State<T> {
    /// Rounds completed; a rank waits for the round it joined to complete.
    round: u64,
    /// What each rank brought to the current round.
    deposits: Vec<Option<Deposit<T>>>,
    /// The last completed round's result (or why the ranks disagreed), read by every
    /// rank before the next round completes: a round completes only when every rank,
    /// readers included, has joined it.
    last: Option<std::result::Result<Arc<CpuBuf<T>>, String>>,
    /// Why the group broke; every later op fails with it.
    failed: Option<String>,
}

struct Deposit<T> {
    op: &'static str,
    root: usize,
    data: CpuBuf<T>,
}

impl<T: CpuFloat> InProcessCollective<T> {
    /// One handle per rank, `world_size` in all; hand each to its thread.
    pub fn group(world_size: usize, timeout: Duration) -> Vec<Self> {
        assert!(world_size > 0, "InProcessCollective: world size 0");
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                round: 0,
                deposits: (0..world_size).map(|_| None).collect(),
                last: None,
                failed: None,
            }),
            changed: Condvar::new(),
        });
        (0..world_size)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A rank that panicked holding the lock leaves a consistent state: every change
        // is made whole before the guard drops.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Brings `data` to a round of `op`, waits for every rank, returns the round's result.
    fn exchange(&self, op: &'static str, root: usize, data: CpuBuf<T>) -> Result<Arc<CpuBuf<T>>> {
        let failure = |msg: String| Error::Collective { op, msg };
        let mut state = self.lock();
        if let Some(why) = &state.failed {
            return Err(failure(why.clone()));
        }
        let round = state.round;
        state.deposits[self.rank] = Some(Deposit { op, root, data });
        if state.deposits.iter().all(Option::is_some) {
            let deposits: Vec<Deposit<T>> = state
                .deposits
                .iter_mut()
                .map(|d| d.take().expect("all arrived"))
                .collect();
            let outcome = combine(&deposits).map(Arc::new);
            if let Err(why) = &outcome {
                state.failed = Some(why.clone());
            }
            state.last = Some(outcome);
            state.round += 1;
            self.shared.changed.notify_all();
        } else {
            let deadline = Instant::now() + self.shared.timeout;
            while state.round == round && state.failed.is_none() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let missing: Vec<String> = (0..self.shared.world_size)
                        .filter(|&r| state.deposits[r].is_none())
                        .map(|r| r.to_string())
                        .collect();
                    state.failed = Some(format!(
                        "rank(s) {} of world size {} did not join within {:?} (rank {} waited)",
                        missing.join(", "),
                        self.shared.world_size,
                        self.shared.timeout,
                        self.rank
                    ));
                    self.shared.changed.notify_all();
                    break;
                }
                state = self
                    .shared
                    .changed
                    .wait_timeout(state, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        // A round that completed stands even if a rank left right after it.
        if state.round > round {
            state
                .last
                .clone()
                .expect("a completed round has an outcome")
                .map_err(failure)
        } else {
            Err(failure(
                state
                    .failed
                    .clone()
                    .expect("the wait ends on completion or failure"),
            ))
        }
    }
}

/// The result of one round, every rank having arrived: the sum in rank order, the
/// concatenation, or the root's buffer; or why the ranks disagree.
fn combine<T: CpuFloat>(deposits: &[Deposit<T>]) -> std::result::Result<CpuBuf<T>, String> {
    let first = &deposits[0];
    let (len, kind) = len_kind(&first.data);
    for (rank, d) in deposits.iter().enumerate().skip(1) {
        let (other_len, other_kind) = len_kind(&d.data);
        if d.op != first.op || other_len != len || other_kind != kind || d.root != first.root {
            return Err(format!(
                "ranks disagree: rank 0 called {} with {len} {kind:?} elements (root {}), \
                 rank {rank} called {} with {other_len} {other_kind:?} (root {})",
                first.op, first.root, d.op, d.root
            ));
        }
    }
    Ok(match (first.op, &first.data) {
        ("all_reduce_sum" | "reduce_scatter_sum", CpuBuf::Float { data, kind }) => {
            let mut sum = data.clone();
            for d in &deposits[1..] {
                if let CpuBuf::Float { data, .. } = &d.data {
                    for (s, &x) in sum.iter_mut().zip(data) {
                        *s += x;
                    }
                }
            }
            CpuBuf::Float {
                data: sum,
                kind: *kind,
            }
        }
        ("all_gather", CpuBuf::Float { kind, .. }) => CpuBuf::Float {
            data: deposits
                .iter()
                .flat_map(|d| match &d.data {
                    CpuBuf::Float { data, .. } => data.clone(),
                    CpuBuf::Index(_) => unreachable!("kinds agree"),
                })
                .collect(),
            kind: *kind,
        },
        ("all_gather", CpuBuf::Index(_)) => CpuBuf::Index(
            deposits
                .iter()
                .flat_map(|d| match &d.data {
                    CpuBuf::Index(ids) => ids.clone(),
                    CpuBuf::Float { .. } => unreachable!("kinds agree"),
                })
                .collect(),
        ),
        ("broadcast", _) => deposits[first.root].data.clone(),
        _ => CpuBuf::Index(Vec::new()),
    })
}

impl<T: CpuFloat> Drop for InProcessCollective<T> {
    fn drop(&mut self) {
        // A rank gone makes every later op of the others fail at once instead of waiting
        // out the timeout; after the last op nobody asks.
        let rank = self.rank;
        let mut state = self.lock();
        if state.failed.is_none() {
            state.failed = Some(format!("rank {rank} left the group"));
            self.shared.changed.notify_all();
        }
    }
}

/// Copies `values` into `buf`, which has its length and storage.
fn store<T: CpuFloat>(buf: &mut CpuBuf<T>, values: &CpuBuf<T>, range: std::ops::Range<usize>) {
    match (buf, values) {
        (CpuBuf::Float { data, .. }, CpuBuf::Float { data: values, .. }) => {
            data.copy_from_slice(&values[range])
        }
        (CpuBuf::Index(ids), CpuBuf::Index(values)) => ids.copy_from_slice(&values[range]),
        _ => unreachable!("the kinds were checked"),
    }
}

fn len_kind<T>(buf: &CpuBuf<T>) -> (usize, BufKind) {
    match buf {
        CpuBuf::Float { data, kind } => (data.len(), *kind),
        CpuBuf::Index(ids) => (ids.len(), BufKind::Index),
    }
}

impl<T: CpuFloat> Collective<crate::cpu::CpuBackend<T>> for InProcessCollective<T> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_reduce_sum(&self, buf: &mut CpuBuf<T>) -> Result<()> {
        let op = "all_reduce_sum";
        check(
            op,
            self.world_size(),
            Args::AllReduce {
                kind: len_kind(buf).1,
            },
        )?;
        let sum = self.exchange(op, 0, buf.clone())?;
        let n = len_kind(buf).0;
        store(buf, &sum, 0..n);
        Ok(())
    }

    fn all_gather(&self, send: &CpuBuf<T>, recv: &mut CpuBuf<T>) -> Result<()> {
        let op = "all_gather";
        let args = Args::AllGather {
            send: len_kind(send),
            recv: len_kind(recv),
        };
        check(op, self.world_size(), args)?;
        let all = self.exchange(op, 0, send.clone())?;
        let n = len_kind(recv).0;
        store(recv, &all, 0..n);
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &CpuBuf<T>, recv: &mut CpuBuf<T>) -> Result<()> {
        let op = "reduce_scatter_sum";
        let args = Args::ReduceScatter {
            send: len_kind(send),
            recv: len_kind(recv),
        };
        check(op, self.world_size(), args)?;
        let sum = self.exchange(op, 0, send.clone())?;
        let n = len_kind(recv).0;
        store(recv, &sum, self.rank * n..(self.rank + 1) * n);
        Ok(())
    }

    fn broadcast(&self, buf: &mut CpuBuf<T>, root: usize) -> Result<()> {
        let op = "broadcast";
        check(op, self.world_size(), Args::Broadcast { root })?;
        let data = self.exchange(op, root, buf.clone())?;
        let n = len_kind(buf).0;
        store(buf, &data, 0..n);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", 0, CpuBuf::Index(Vec::new()))
            .map(|_| ())
    }
}
