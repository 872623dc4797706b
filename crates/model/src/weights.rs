//! Weights on the host: Hugging Face safetensors in and out (single file or sharded;
//! f32, bf16, f16), with the tensor names and shapes each architecture expects.

/// One tensor on the host, in f32, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}
