//! [`Collective`] over NCCL (cudarc's bindings, loaded at run time like the rest of
//! cudarc, so building needs no NCCL). Ops run on the backend's stream: they are ordered
//! with its other ops and overlap nothing by themselves.
//!
//! A watchdog thread per communicator turns a dead or stuck peer into an error instead
//! of a hang: it aborts the communicator when NCCL reports an asynchronous error or a
//! collective is older than `FLOE_NCCL_TIMEOUT_SECS`, and exits the process if it is
//! still running `FLOE_NCCL_ABORT_GRACE_SECS` later (`docs/distributed.md`, "Failure").

use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::device::{CudaBackend, CudaBuf, Storage};
use crate::collective::{check, Args};
use crate::collective_watchdog::{seconds_setting, CollectiveWatch};
use crate::{Collective, Error, Result};

/// Bytes of NCCL's unique id, what the rendezvous hands from rank 0 to every rank.
pub const NCCL_ID_BYTES: usize = 128;

/// How often the watchdog looks at the communicator and the oldest pending collective.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How long the watchdog waits for an enqueue in progress before aborting anyway: a
/// healthy one takes microseconds, one that takes longer is stuck inside NCCL on the dead
/// peer, and the abort is what ends it.
const ENQUEUE_WAIT: Duration = Duration::from_secs(1);

/// One rank's NCCL communicator on a [`CudaBackend`]'s device and stream, watched by a
/// thread of its own.
pub struct NcclCollective {
    shared: Arc<Shared>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// The one element [`Collective::barrier`] all-reduces.
    token: Mutex<CudaSlice<f32>>,
    /// Dropping it stops the watchdog at once, not at its next poll.
    stop_watchdog: Option<mpsc::Sender<()>>,
    watchdog: Option<JoinHandle<()>>,
    /// How long the process may run after an abort.
    grace: Duration,
}

/// What the ops and the watchdog thread share.
struct Shared {
    comm: Comm,
    /// Held by an op from its failure check until its collective is enqueued and handed
    /// to the watchdog: NCCL takes one call on a communicator at a time.
    enqueue: Mutex<()>,
    watch: Mutex<CollectiveWatch<CudaEvent>>,
}

struct Comm {
    raw: sys::ncclComm_t,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread. The ops call it one at a
// time (under `Shared::enqueue`); the watchdog calls only ncclCommGetAsyncError and
// ncclCommAbort, which NCCL provides for a thread that watches a communicator another
// thread is using (PyTorch's ProcessGroupNCCL watchdog does the same). The watchdog is
// joined before the communicator is aborted on drop.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// What NCCL reports of the communicator's asynchronous work: an error (a peer gone, a
    /// network failure) or `None` while healthy.
    fn async_error(&self) -> Option<String> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator lives until the watchdog is joined (see `Sync` above).
        let call = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        call.result().and(state.result()).err().map(nccl_text)
    }

    /// Aborts the communicator the first time only: NCCL frees it in the abort.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the communicator was initialised and is aborted only here.
            let _ = unsafe { nccl::comm_abort(self.raw) };
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Abort rather than finalize: finalize waits for every peer, which hangs when one
        // died; the process is done with the communicator either way.
        self.abort();
    }
}

fn nccl_text(e: nccl::NcclError) -> String {
    // SAFETY: NCCL returns a static NUL-terminated string for every result code.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    text.to_string_lossy().into_owned()
}

fn nccl_error(op: &'static str, what: String) -> impl Fn(nccl::NcclError) -> Error {
    move |e| Error::Collective {
        op,
        msg: format!("{what}: NCCL: {}", nccl_text(e)),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The lock, unless another thread holds it for longer than `wait`.
fn lock_within<T>(mutex: &Mutex<T>, wait: Duration) -> Option<MutexGuard<'_, T>> {
    let deadline = Instant::now() + wait;
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Some(guard),
            Err(TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(TryLockError::WouldBlock) => return None,
        }
    }
}

/// The watchdog thread: every [`POLL_INTERVAL`] until `stop` is dropped, asks NCCL for an
/// asynchronous error and the oldest pending collective's event whether it finished; on
/// the first failure, gives up the communicator ([`abort_for`]) and ends.
fn watch_collectives(shared: Arc<Shared>, stop: mpsc::Receiver<()>, grace: Duration) {
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(POLL_INTERVAL) {
        let async_error = shared.comm.async_error();
        let failure = lock(&shared.watch).poll(Instant::now(), async_error.as_deref(), |event| {
            event.try_is_complete().map_err(|e| e.to_string())
        });
        if let Some(failure) = failure {
            abort_for(&shared, &failure, grace);
            return;
        }
    }
}

/// After `failure` (already recorded in the watch, so every later op returns it): says it
/// on stderr, starts a timer that exits the process after `grace`, and aborts the
/// communicator, so NCCL's kernels end and the host's waits on the stream return. The
/// exit is there because the main thread may wait on the stream in a way the abort does
/// not end, and ncclCommAbort itself has hung in some NCCL versions: a rank must never
/// hang.
fn abort_for(shared: &Shared, failure: &str, grace: Duration) {
    let grace_secs = grace.as_secs();
    eprintln!(
        "error: {failure}; aborting the NCCL communicator; the process exits in {grace_secs} s \
         if it has not by then"
    );
    let message = failure.to_owned();
    let exit_timer = thread::Builder::new()
        .name("floe-nccl-exit".into())
        .spawn(move || {
            thread::sleep(grace);
            eprintln!("error: {message}; still running {grace_secs} s after the abort, exiting");
            std::process::exit(1);
        });
    if exit_timer.is_err() {
        eprintln!("error: {failure}; no thread for the exit timer, exiting now");
        std::process::exit(1);
    }
    // With the lock no op is inside NCCL; without it (see ENQUEUE_WAIT) the op that holds
    // it is stuck in NCCL, and aborting is how NCCL lets it out.
    let _enqueue = lock_within(&shared.enqueue, ENQUEUE_WAIT);
    shared.comm.abort();
}

impl NcclCollective {
    /// A fresh NCCL unique id; rank 0 makes it and the rendezvous hands it out.
    pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
        let id = nccl::get_uniqueid().map_err(nccl_error("unique_id", "ncclGetUniqueId".into()))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on
    /// `backend`'s device and stream, and starts its watchdog. Blocks until every rank has
    /// joined. Reads `FLOE_NCCL_TIMEOUT_SECS` (600 by default: how long a collective may
    /// take before the watchdog aborts the communicator) and `FLOE_NCCL_ABORT_GRACE_SECS`
    /// (30: how long after the abort the process may still run); a value that is not a
    /// positive whole number is an error.
    pub fn new(backend: &CudaBackend, rank: usize, world_size: usize, id: &[u8]) -> Result<Self> {
        let op = "init";
        let setting = |name: &str, default: u64| {
            let value = std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
            seconds_setting(name, value.as_deref(), default)
        };
        let timeout = setting("FLOE_NCCL_TIMEOUT_SECS", 600)?;
        let grace = setting("FLOE_NCCL_ABORT_GRACE_SECS", 30)?;
        let internal: [u8; NCCL_ID_BYTES] = id.try_into().map_err(|_| Error::Collective {
            op,
            msg: format!(
                "an NCCL unique id has {NCCL_ID_BYTES} bytes, the rendezvous gave {}",
                id.len()
            ),
        })?;
        if rank >= world_size {
            return Err(Error::Collective {
                op,
                msg: format!("rank {rank} is not a rank of world size {world_size}"),
            });
        }
        let id = sys::ncclUniqueId {
            internal: internal.map(|b| b as c_char),
        };
        backend.ctx.bind_to_thread()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL on success; the counts fit i32 (checked below).
        unsafe {
            nccl::comm_init_rank(
                &mut comm,
                i32::try_from(world_size).expect("world size fits i32"),
                id,
                i32::try_from(rank).expect("rank fits i32"),
            )
        }
        .map_err(nccl_error(
            op,
            format!("ncclCommInitRank as rank {rank} of {world_size}"),
        ))?;
        let shared = Arc::new(Shared {
            comm: Comm {
                raw: comm,
                aborted: AtomicBool::new(false),
            },
            enqueue: Mutex::new(()),
            watch: Mutex::new(CollectiveWatch::new(rank, world_size, timeout)),
        });
        let token = backend.stream.alloc_zeros::<f32>(1)?;
        let (stop_watchdog, stop) = mpsc::channel();
        let watched = shared.clone();
        let watchdog = thread::Builder::new()
            .name(format!("nccl-watch-{rank}"))
            .spawn(move || watch_collectives(watched, stop, grace))
            .map_err(|e| Error::Collective {
                op,
                msg: format!("starting the NCCL watchdog thread: {e}"),
            })?;
        Ok(Self {
            shared,
            stream: backend.stream.clone(),
            rank,
            world_size,
            token: Mutex::new(token),
            stop_watchdog: Some(stop_watchdog),
            watchdog: Some(watchdog),
            grace,
        })
    }

    /// Gives the communicator up because of `reason` (another rank stopped, as the job's
    /// liveness links report): as the watchdog does on a timeout, says so on stderr,
    /// aborts the communicator so waits on NCCL end, makes every later op return the
    /// reason, and exits the process after the grace period if it is still running. Only
    /// the first failure acts.
    pub fn abort(&self, reason: &str) {
        let failure = format!("rank {} of {}: {reason}", self.rank, self.world_size);
        if lock(&self.shared.watch).fail(&failure) {
            abort_for(&self.shared, &failure, self.grace);
        }
    }

    /// The communicator for one NCCL call, unless the watchdog has aborted it.
    fn comm(&self, op: &'static str) -> Result<(MutexGuard<'_, ()>, sys::ncclComm_t)> {
        let enqueue = lock(&self.shared.enqueue);
        lock(&self.shared.watch).check(op)?;
        Ok((enqueue, self.shared.comm.raw))
    }

    /// Records an event after `op`, just enqueued with `elements` as its count, and hands
    /// it to the watchdog.
    fn watch(&self, op: &'static str, elements: usize) -> Result<()> {
        let event = self.stream.record_event(None)?;
        lock(&self.shared.watch).enqueued(op, elements, Instant::now(), event)?;
        Ok(())
    }

    fn cu_stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn read(&self, buf: &CudaBuf) -> *const c_void {
        let ptr = match &buf.storage {
            Storage::Bf16(s) => s.device_ptr(&self.stream).0,
            Storage::F32(s) => s.device_ptr(&self.stream).0,
            Storage::U32(s) => s.device_ptr(&self.stream).0,
        };
        ptr as *const c_void
    }

    fn write(&self, buf: &mut CudaBuf) -> *mut c_void {
        let ptr = match &mut buf.storage {
            Storage::Bf16(s) => s.device_ptr_mut(&self.stream).0,
            Storage::F32(s) => s.device_ptr_mut(&self.stream).0,
            Storage::U32(s) => s.device_ptr_mut(&self.stream).0,
        };
        ptr as *mut c_void
    }
}

fn dtype(buf: &CudaBuf) -> sys::ncclDataType_t {
    match buf.storage {
        Storage::Bf16(_) => sys::ncclDataType_t::ncclBfloat16,
        Storage::F32(_) => sys::ncclDataType_t::ncclFloat32,
        Storage::U32(_) => sys::ncclDataType_t::ncclUint32,
    }
}

impl Collective<CudaBackend> for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, buf: &mut CudaBuf) -> Result<()> {
        let op = "all_reduce_sum";
        check(op, self.world_size, Args::AllReduce { kind: buf.kind })?;
        let (_enqueue, comm) = self.comm(op)?;
        let ptr = self.write(buf);
        // SAFETY: in place over `buf.len` elements of its own type, on the backend's stream.
        unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                buf.len,
                dtype(buf),
                sys::ncclRedOp_t::ncclSum,
                comm,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements", buf.len)))?;
        self.watch(op, buf.len)
    }

    fn all_gather(&self, send: &CudaBuf, recv: &mut CudaBuf) -> Result<()> {
        let op = "all_gather";
        let args = Args::AllGather {
            send: (send.len, send.kind),
            recv: (recv.len, recv.kind),
        };
        check(op, self.world_size, args)?;
        let (_enqueue, comm) = self.comm(op)?;
        // SAFETY: lengths and types checked: recv holds world_size blocks of send's length.
        unsafe {
            nccl::all_gather(
                self.read(send),
                self.write(recv),
                send.len,
                dtype(send),
                comm,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements per rank", send.len)))?;
        self.watch(op, send.len)
    }

    fn reduce_scatter_sum(&self, send: &CudaBuf, recv: &mut CudaBuf) -> Result<()> {
        let op = "reduce_scatter_sum";
        let args = Args::ReduceScatter {
            send: (send.len, send.kind),
            recv: (recv.len, recv.kind),
        };
        check(op, self.world_size, args)?;
        let (_enqueue, comm) = self.comm(op)?;
        // SAFETY: lengths and types checked: send holds world_size blocks of recv's length.
        unsafe {
            nccl::reduce_scatter(
                self.read(send),
                self.write(recv),
                recv.len,
                dtype(recv),
                sys::ncclRedOp_t::ncclSum,
                comm,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements per rank", recv.len)))?;
        self.watch(op, recv.len)
    }

    fn broadcast(&self, buf: &mut CudaBuf, root: usize) -> Result<()> {
        let op = "broadcast";
        check(op, self.world_size, Args::Broadcast { root })?;
        let (_enqueue, comm) = self.comm(op)?;
        let ptr = self.write(buf);
        // SAFETY: in place over `buf.len` elements of its own type; root is a rank.
        unsafe {
            nccl::broadcast(
                ptr,
                ptr,
                buf.len,
                dtype(buf),
                root as i32,
                comm,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(
            op,
            format!("{} elements from rank {root}", buf.len),
        ))?;
        self.watch(op, buf.len)
    }

    fn barrier(&self) -> Result<()> {
        let op = "barrier";
        {
            let (_enqueue, comm) = self.comm(op)?;
            let mut token = lock(&self.token);
            let ptr = token.device_ptr_mut(&self.stream).0 as *mut c_void;
            // SAFETY: one f32 of the communicator's own device, on the backend's stream.
            unsafe {
                nccl::all_reduce(
                    ptr,
                    ptr,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    self.cu_stream(),
                )
            }
            .map_err(nccl_error(op, "one element".into()))?;
            self.watch(op, 1)?;
        }
        let synced = self.stream.synchronize();
        // A wait the watchdog ended by aborting returns its message, not CUDA's.
        lock(&self.shared.watch).check(op)?;
        synced?;
        Ok(())
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // The watchdog reads the communicator until it stops; `shared`, whose last holder
        // is then this, aborts the communicator unless the watchdog already did.
        drop(self.stop_watchdog.take());
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
    }
}
