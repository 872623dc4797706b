use crate::BufKind;

/// Errors of backend ops. Each names the op and the argument at fault.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A buffer's length or kind does not match the dimensions given to an op.
    #[error("{op}: {msg}")]
    Shape {
        /// The op that rejected its arguments.
        op: &'static str,
        /// What was wrong, naming the argument and both sizes.
        msg: String,
    },
    /// A buffer of the wrong kind was passed.
    #[error("{op}: argument `{arg}` must be a {expected:?} buffer, got {got:?}")]
    Kind {
        /// The op that rejected its arguments.
        op: &'static str,
        /// The argument's name.
        arg: &'static str,
        /// The kind the op needs.
        expected: BufKind,
        /// The kind it got.
        got: BufKind,
    },
    /// The device has too little free memory for an allocation.
    #[error("out of device memory: {what} needs {requested} bytes, {free} bytes free")]
    OutOfMemory {
        /// What was being allocated.
        what: String,
        /// Bytes asked for.
        requested: usize,
        /// Bytes free when asked.
        free: usize,
    },
    /// A collective op failed: a rank did not arrive, the ranks disagree, or NCCL failed.
    #[error("{op}: {msg}")]
    Collective {
        /// The collective op.
        op: &'static str,
        /// What happened, naming the ranks concerned.
        msg: String,
    },
    /// The backend does not implement a mode it was asked for.
    #[error("{backend} does not implement {mode}")]
    Unsupported {
        /// The backend, as [`crate::Backend::name`] describes it.
        backend: String,
        /// The mode, e.g. `batch-invariant kernels`.
        mode: &'static str,
    },
    /// floe was built without the `cuda` feature.
    #[error("this floe was built without CUDA support; rebuild with `--features cuda`")]
    NotCompiledWithCuda,
    /// The CUDA driver, NVRTC, cuBLAS or a kernel failed.
    #[error("cuda: {0}")]
    Cuda(String),
}

impl Error {
    /// Whether the device ran out of memory (the caller may retry with smaller batches).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }
}

/// Result of a backend op.
pub type Result<T> = std::result::Result<T, Error>;
