//! [`Collective`] over NCCL (cudarc's bindings, loaded at run time like the rest of
//! cudarc, so building needs no NCCL). Ops run on the backend's stream: they are ordered
//! with its other ops and overlap nothing by themselves.

use std::ffi::{c_char, c_void, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};

use super::device::{CudaBackend, CudaBuf, Storage};
use crate::collective::{check, Args};
use crate::{Collective, Error, Result};

/// Bytes of NCCL's unique id, what the rendezvous hands from rank 0 to every rank.
pub const NCCL_ID_BYTES: usize = 128;

/// One rank's NCCL communicator on a [`CudaBackend`]'s device and stream.
pub struct NcclCollective {
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// The one element [`Collective::barrier`] all-reduces.
    token: Mutex<CudaSlice<f32>>,
}

struct Comm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time;
// `NcclCollective` keeps it behind a mutex.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // Abort rather than finalize: finalize waits for every peer, which hangs when one
        // died; the process is done with the communicator either way.
        // SAFETY: the communicator was initialised and is not used after this.
        let _ = unsafe { nccl::comm_abort(self.0) };
    }
}

fn nccl_error(op: &'static str, what: String) -> impl Fn(nccl::NcclError) -> Error {
    move |e| {
        // SAFETY: NCCL returns a static NUL-terminated string for every result code.
        let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
        Error::Collective {
            op,
            msg: format!("{what}: NCCL: {}", text.to_string_lossy()),
        }
    }
}

impl NcclCollective {
    /// A fresh NCCL unique id; rank 0 makes it and the rendezvous hands it out.
    pub fn unique_id() -> Result<[u8; NCCL_ID_BYTES]> {
        let id = nccl::get_uniqueid().map_err(nccl_error("unique_id", "ncclGetUniqueId".into()))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator of `world_size` ranks named by `id` as `rank`, on
    /// `backend`'s device and stream. Blocks until every rank has joined.
    pub fn new(backend: &CudaBackend, rank: usize, world_size: usize, id: &[u8]) -> Result<Self> {
        let op = "init";
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
        let comm = Comm(comm);
        let token = backend.stream.alloc_zeros::<f32>(1)?;
        Ok(Self {
            comm: Mutex::new(comm),
            stream: backend.stream.clone(),
            rank,
            world_size,
            token: Mutex::new(token),
        })
    }

    fn comm(&self) -> MutexGuard<'_, Comm> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
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
        let comm = self.comm();
        let ptr = self.write(buf);
        // SAFETY: in place over `buf.len` elements of its own type, on the backend's stream.
        unsafe {
            nccl::all_reduce(
                ptr,
                ptr,
                buf.len,
                dtype(buf),
                sys::ncclRedOp_t::ncclSum,
                comm.0,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements", buf.len)))?;
        Ok(())
    }

    fn all_gather(&self, send: &CudaBuf, recv: &mut CudaBuf) -> Result<()> {
        let op = "all_gather";
        let args = Args::AllGather {
            send: (send.len, send.kind),
            recv: (recv.len, recv.kind),
        };
        check(op, self.world_size, args)?;
        let comm = self.comm();
        // SAFETY: lengths and types checked: recv holds world_size blocks of send's length.
        unsafe {
            nccl::all_gather(
                self.read(send),
                self.write(recv),
                send.len,
                dtype(send),
                comm.0,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements per rank", send.len)))?;
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: &CudaBuf, recv: &mut CudaBuf) -> Result<()> {
        let op = "reduce_scatter_sum";
        let args = Args::ReduceScatter {
            send: (send.len, send.kind),
            recv: (recv.len, recv.kind),
        };
        check(op, self.world_size, args)?;
        let comm = self.comm();
        // SAFETY: lengths and types checked: send holds world_size blocks of recv's length.
        unsafe {
            nccl::reduce_scatter(
                self.read(send),
                self.write(recv),
                recv.len,
                dtype(recv),
                sys::ncclRedOp_t::ncclSum,
                comm.0,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(op, format!("{} elements per rank", recv.len)))?;
        Ok(())
    }

    fn broadcast(&self, buf: &mut CudaBuf, root: usize) -> Result<()> {
        let op = "broadcast";
        check(op, self.world_size, Args::Broadcast { root })?;
        let comm = self.comm();
        let ptr = self.write(buf);
        // SAFETY: in place over `buf.len` elements of its own type; root is a rank.
        unsafe {
            nccl::broadcast(
                ptr,
                ptr,
                buf.len,
                dtype(buf),
                root as i32,
                comm.0,
                self.cu_stream(),
            )
        }
        .map_err(nccl_error(
            op,
            format!("{} elements from rank {root}", buf.len),
        ))?;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let op = "barrier";
        {
            let comm = self.comm();
            let mut token = self.token.lock().unwrap_or_else(|e| e.into_inner());
            let ptr = token.device_ptr_mut(&self.stream).0 as *mut c_void;
            // SAFETY: one f32 of the communicator's own device, on the backend's stream.
            unsafe {
                nccl::all_reduce(
                    ptr,
                    ptr,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm.0,
                    self.cu_stream(),
                )
            }
            .map_err(nccl_error(op, "one element".into()))?;
        }
        self.stream.synchronize()?;
        Ok(())
    }
}
