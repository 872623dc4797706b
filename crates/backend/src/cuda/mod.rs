//! The CUDA backend (feature `cuda`): NVRTC-compiled kernels and cuBLAS, bf16 storage for
//! Compute buffers, f32 for Full ones, f32 accumulation everywhere.
//!
//! Without the feature, [`CudaBackend`] is an uninhabited stub whose constructor returns
//! [`crate::Error::NotCompiledWithCuda`], so callers need no `cfg`.
//!
//! Layout (with the feature):
//! - `device.rs`: context, stream, cuBLAS handle and workspace, buffers, the per-process
//!   NVRTC cache (one program per `kernels/*.cu`, compiled for the device's `sm_XY` on
//!   first use) and the row-major GEMM wrapper over `cublasGemmEx`.
//! - `gemm_lt.rs`: the same GEMMs through cuBLASLt with the algorithm chosen per shape
//!   (heuristic or timed), selected by `FLOE_GEMM`.
//! - `ops.rs`: the [`crate::Backend`] implementation: host-side checks (the shapes by
//!   [`crate::contract`]), then launches.
//! - `graph.rs`: CUDA graphs of [`crate::Backend::graphed`] regions: a check pass signs
//!   the region's launches, a kept graph of the same signature replays, else one is
//!   captured.
//! - `nccl.rs`: [`NcclCollective`], the [`crate::Collective`] ops over NCCL on the
//!   backend's stream, and the watchdog thread that aborts a communicator whose peer
//!   died or hung (its decisions are `crate::collective_watchdog`'s).
//! - `attention.rs`: the work lists (query tiles, key tiles and the query ranges that
//!   read each key tile) of the packed-segment attention kernels.
//! - `kernels/`: CUDA C sources, one file per family of ops, each with its reference in
//!   `crate::cpu` (compared op by op in `tests/cuda_ops.rs`).

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod gemm_lt;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(not(feature = "cuda"))]
mod stub;

#[cfg(feature = "cuda")]
pub use device::{CudaBackend, CudaBuf};
#[cfg(feature = "cuda")]
pub use nccl::{NcclCollective, NCCL_ID_BYTES};
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaBackend, CudaBuf, NcclCollective, NCCL_ID_BYTES};

/// Bytes one element of a buffer of `kind` takes on a CUDA device (bf16 Compute, f32
/// Full, u32 Index); known without a device, for memory plans.
pub fn element_bytes(kind: crate::BufKind) -> usize {
    match kind {
        crate::BufKind::Compute => 2,
        crate::BufKind::Full | crate::BufKind::Index => 4,
    }
}

/// How often each path ran, for benchmarks (`floe bench generate`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCounts {
    /// Graphs captured.
    pub captured: usize,
    /// Replays of a kept graph.
    pub replayed: usize,
    /// Regions that could not be graphed and ran eagerly.
    pub eager: usize,
}

/// GPU time of one kernel (or one GEMM shape) over a profiled stretch.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    /// The kernel's name, or `gemm MxNxK` with the transposes and output type.
    pub name: String,
    /// Launches (or GEMM calls) timed.
    pub calls: usize,
    /// Their summed GPU time in milliseconds.
    pub total_ms: f64,
}
