//! CUDA graphs of a stretch of ops that repeats (a decode step's layers): one graph
//! launch where there were hundreds of kernel launches and GEMM calls, each of which
//! costs the host several microseconds.
//!
//! [`CudaBackend::graphed`] first runs the stretch's host code without enqueueing
//! anything (the *check* pass): every launch, GEMM and work-list upload appends what it
//! would do (kernel, grid, arguments, operand addresses) to a signature. A graph captured
//! earlier with the same signature does exactly what enqueueing the ops would do now, so
//! it is replayed. Otherwise the stretch runs again under stream capture (the *record*
//! pass) and the new graph is kept. Nothing but the signature decides, so a buffer that
//! moved, a grid that grew or a kernel switched by a mode can never replay a stale graph.
//!
//! The work lists of attention change from step to step while their sizes stay: a graph
//! copies each one in itself, from a page-locked host buffer the host refills before
//! each replay. Those buffers are shared by every graph (list `i` of a pass always lives
//! in staging slot `i`), so their addresses are part of the signature too.
//!
//! In either pass only launches, GEMMs and list uploads are allowed: any other stream
//! operation (a copy, a fill, a download, an allocation while capturing) fails the pass,
//! and the stretch runs eagerly instead.

use std::sync::atomic::Ordering;

use cudarc::driver::{sys as driver_sys, CudaEvent, CudaGraph, CudaSlice, PinnedHostSlice};

use super::device::{Arg, CudaBackend};
use super::GraphCounts;
use crate::{BufKind, Error, Matmul, Result};

/// Graphs kept at once; the least recently replayed goes first. A decode step needs one
/// per batch size (padded to a few buckets) and attention split.
const GRAPHS_KEPT: usize = 32;

/// What the ops of the backend do with what they enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Pass {
    /// Enqueue it: no graph region is running.
    Eager = 0,
    /// Append it to the signature and enqueue nothing.
    Check = 1,
    /// Append it to the signature and enqueue it into the stream's capture.
    Record = 2,
}

impl Pass {
    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            1 => Pass::Check,
            2 => Pass::Record,
            _ => Pass::Eager,
        }
    }
}

/// Signature tags, so that a launch can never read as a GEMM of the same numbers.
const TAG_LAUNCH: u64 = 1;
const TAG_GEMM: u64 = 2;
const TAG_LIST: u64 = 3;

/// One staging slot of a work list: page-locked host memory the graph copies from, and
/// the device buffer the kernels read.
struct StagedList {
    host: PinnedHostSlice<u32>,
    /// `host`'s address, taken when made: asking for it waits on an event, which a
    /// capture does not allow.
    host_ptr: u64,
    device: CudaSlice<u32>,
}

/// A captured graph and the signature of the ops it holds.
struct Captured {
    signature: Vec<u64>,
    graph: CudaGraph,
}

// SAFETY: the graph is only touched under the backend's `graphs` mutex, one thread at a
// time, as the driver requires of graph objects.
unsafe impl Send for Captured {}

/// The graph state of one backend (one stream).
#[derive(Default)]
pub(crate) struct Graphs {
    /// The current pass's signature.
    signature: Vec<u64>,
    /// The current pass's work lists, in upload order, with the name each came under.
    lists: Vec<(&'static str, Vec<u32>)>,
    /// Staging slot `i` holds list `i` of a pass.
    staging: Vec<StagedList>,
    /// Kept graphs, most recently replayed last.
    kept: Vec<Captured>,
    /// Recorded after the last replay: the host may refill the staging slots only once
    /// the graphs that read them are done.
    last_replay: Option<CudaEvent>,
    counts: GraphCounts,
    /// Whether a region has fallen back to eager yet (reported once).
    warned: bool,
}

impl CudaBackend {
    /// The pass the ops are in.
    pub(crate) fn pass(&self) -> Pass {
        Pass::from_u8(self.graph_pass.load(Ordering::Relaxed))
    }

    /// Fails when a graph pass is running: `what` (a copy, a fill, a download, ...) has
    /// no place in a graph region.
    pub(crate) fn eager_only(&self, what: &str) -> Result<()> {
        match self.pass() {
            Pass::Eager => Ok(()),
            pass => Err(Error::Cuda(format!(
                "{what} inside a CUDA graph region ({pass:?} pass)"
            ))),
        }
    }

    /// Appends what `sign` writes to the running pass's signature; true when the op is
    /// to be enqueued (eager or recording), false in the check pass.
    fn sign(&self, sign: impl FnOnce(&mut Vec<u64>)) -> bool {
        let pass = self.pass();
        if pass != Pass::Eager {
            sign(&mut self.graphs.lock().expect("poisoned").signature);
        }
        pass != Pass::Check
    }

    /// Signs a launch; true when it is to be enqueued.
    pub(crate) fn graph_launch(
        &self,
        kernel: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        slots: &[u64],
    ) -> bool {
        self.sign(|s| {
            s.extend([
                TAG_LAUNCH,
                kernel.as_ptr() as u64,
                kernel.len() as u64,
                u64::from(grid.0),
                u64::from(grid.1),
                u64::from(grid.2),
                u64::from(block.0) | u64::from(block.1) << 20 | u64::from(block.2) << 40,
                u64::from(shared),
                slots.len() as u64,
            ]);
            s.extend_from_slice(slots);
        })
    }

    /// Signs a GEMM; true when it is to be enqueued.
    pub(crate) fn graph_gemm(
        &self,
        operands: [(u64, BufKind); 3],
        dims: Matmul,
        alpha: f32,
        beta: f32,
    ) -> bool {
        self.sign(|s| {
            s.push(TAG_GEMM);
            for (ptr, kind) in operands {
                s.extend([ptr, kind as u64]);
            }
            s.extend([
                dims.m as u64,
                dims.n as u64,
                dims.k as u64,
                u64::from(dims.trans_a) | u64::from(dims.trans_b) << 1,
                u64::from(alpha.to_bits()) | u64::from(beta.to_bits()) << 32,
            ]);
        })
    }

    /// The device address of work list `data` inside a graph pass: the same list under
    /// `name` as the last one reuses its slot, a new one takes the next staging slot
    /// (grown in the check pass, copied in by the graph in the record pass).
    pub(crate) fn graph_list(&self, name: &'static str, data: &[u32]) -> Result<Arg> {
        let pass = self.pass();
        let mut guard = self.graphs.lock().expect("poisoned");
        let graphs = &mut *guard;
        if let Some(i) = graphs.lists.iter().rposition(|(n, _)| *n == name) {
            if graphs.lists[i].1 == data {
                let ptr = self.ptr_of(&graphs.staging[i].device);
                graphs.signature.extend([TAG_LIST, i as u64, ptr]);
                return Ok(Arg::Ptr(ptr));
            }
        }
        let i = graphs.lists.len();
        let len = data.len().max(1);
        let fits = graphs.staging.get(i).is_some_and(|s| s.host.len() >= len);
        if !fits {
            if pass == Pass::Record {
                return Err(Error::Cuda(
                    "a work list outgrew its staging slot while capturing".into(),
                ));
            }
            // The slot's old buffers may still be read by a replay in flight.
            if let Some(event) = &graphs.last_replay {
                event.synchronize()?;
            }
            // SAFETY: the host writes a list's elements before any graph reads them.
            let host = unsafe { self.ctx.alloc_pinned::<u32>(len)? };
            let slot = StagedList {
                host_ptr: host.as_ptr()? as u64,
                host,
                // SAFETY: as above, the graph copies in before its kernels read.
                device: unsafe { self.stream.alloc::<u32>(len)? },
            };
            if i < graphs.staging.len() {
                graphs.staging[i] = slot;
            } else {
                graphs.staging.push(slot);
            }
        }
        let slot = &graphs.staging[i];
        let ptr = self.ptr_of(&slot.device);
        // The slot's host address is baked into a graph's copy, so it is signed too.
        let host = slot.host_ptr;
        graphs
            .signature
            .extend([TAG_LIST, i as u64, ptr, host, data.len() as u64]);
        if pass == Pass::Record && !data.is_empty() {
            let bytes = std::mem::size_of_val(data);
            // SAFETY: host and device hold at least `data.len()` elements; the copy runs
            // when the graph does, after the host refilled the host side.
            unsafe {
                driver_sys::cuMemcpyHtoDAsync_v2(
                    ptr,
                    host as *const std::ffi::c_void,
                    bytes,
                    self.stream.cu_stream(),
                )
                .result()?;
            }
        }
        graphs.lists.push((name, data.to_vec()));
        Ok(Arg::Ptr(ptr))
    }

    fn ptr_of(&self, s: &CudaSlice<u32>) -> u64 {
        use cudarc::driver::DevicePtr;
        s.device_ptr(&self.stream).0
    }

    /// Runs `ops` as a replayed graph where it can (see the module docs), else eagerly.
    pub(crate) fn run_graphed<E: From<Error> + std::fmt::Display>(
        &self,
        ops: &mut dyn FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if !self.graphs_enabled || self.profiling() || self.pass() != Pass::Eager {
            return ops();
        }
        if let Err(e) = self.graph_pass_run(Pass::Check, ops) {
            return self.eager_fallback(ops, &e.to_string());
        }
        if self.replay_kept()? {
            return Ok(());
        }
        self.stream
            .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(Error::from)?;
        let recorded = self.graph_pass_run(Pass::Record, ops);
        let ended = self
            .stream
            .end_capture(driver_sys::CUgraphInstantiate_flags(0));
        let graph = match (recorded, ended) {
            (Ok(()), Ok(Some(graph))) => graph,
            (Err(e), _) => return self.eager_fallback(ops, &e.to_string()),
            (Ok(()), Err(e)) => {
                return self.eager_fallback(ops, &format!("ending the capture: {e}"))
            }
            (Ok(()), Ok(None)) => return self.eager_fallback(ops, "the capture is empty"),
        };
        graph.upload().map_err(Error::from)?;
        let mut graphs = self.graphs.lock().expect("poisoned");
        let signature = graphs.signature.clone();
        graphs.counts.captured += 1;
        if graphs.kept.len() == GRAPHS_KEPT {
            graphs.kept.remove(0);
        }
        graphs.kept.push(Captured { signature, graph });
        drop(graphs);
        if !self.replay_kept()? {
            // Not launched, so running the ops eagerly is still right.
            return self.eager_fallback(ops, "the capture's launches differ from the check's");
        }
        Ok(())
    }

    /// Runs `ops` in `pass`, starting a fresh signature; the backend is back to eager
    /// after, whatever happened.
    fn graph_pass_run<E>(
        &self,
        pass: Pass,
        ops: &mut dyn FnMut() -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        {
            let mut graphs = self.graphs.lock().expect("poisoned");
            graphs.signature.clear();
            graphs.lists.clear();
        }
        self.graph_pass.store(pass as u8, Ordering::Relaxed);
        let result = ops();
        self.graph_pass.store(Pass::Eager as u8, Ordering::Relaxed);
        result
    }

    /// Replays the kept graph whose signature is the last pass's, refilling the staging
    /// slots with the pass's lists first; false when none matches.
    fn replay_kept(&self) -> Result<bool> {
        let mut guard = self.graphs.lock().expect("poisoned");
        let graphs = &mut *guard;
        let Some(i) = graphs
            .kept
            .iter()
            .rposition(|c| c.signature == graphs.signature)
        else {
            return Ok(false);
        };
        if let Some(event) = &graphs.last_replay {
            event.synchronize()?;
        }
        for ((_, data), slot) in graphs.lists.iter().zip(&mut graphs.staging) {
            slot.host.as_mut_slice()?[..data.len()].copy_from_slice(data);
        }
        let captured = graphs.kept.remove(i);
        captured.graph.launch()?;
        graphs.kept.push(captured);
        graphs.last_replay = Some(self.stream.record_event(None)?);
        graphs.counts.replayed += 1;
        Ok(true)
    }

    /// Runs `ops` eagerly after a graph pass failed for `why`; when it then succeeds,
    /// the region holds something graphs cannot (reported once).
    fn eager_fallback<E: From<Error>>(
        &self,
        ops: &mut dyn FnMut() -> std::result::Result<(), E>,
        why: &str,
    ) -> std::result::Result<(), E> {
        ops()?;
        let mut graphs = self.graphs.lock().expect("poisoned");
        graphs.counts.eager += 1;
        if !std::mem::replace(&mut graphs.warned, true) {
            eprintln!("floe: a CUDA graph region runs eagerly: {why}");
        }
        Ok(())
    }

    /// How often graph regions were captured, replayed, or ran eagerly.
    pub fn graph_counts(&self) -> GraphCounts {
        self.graphs.lock().expect("poisoned").counts
    }
}
