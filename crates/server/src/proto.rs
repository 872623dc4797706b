//! The `tinker_public` protobuf messages the server reads and writes, written by hand
//! with `prost` derives from `proto/tinker_public.proto` (rebuilt from the descriptor
//! embedded in the tinker 0.38.0 SDK), so building needs no `protoc`. Field numbers must
//! match that file; messages the server never touches (images, top-k, alt tokens) are
//! left out, and prost skips their fields when decoding.

use std::collections::HashMap;

/// `DType.DTYPE_FLOAT32`.
pub const DTYPE_FLOAT32: i32 = 1;
/// `DType.DTYPE_INT64`.
pub const DTYPE_INT64: i32 = 2;
/// `DType.DTYPE_INT32`.
pub const DTYPE_INT32: i32 = 3;

/// `StopReason.STOP_REASON_STOP`: a stop sequence or EOS ended the sample.
pub const STOP_REASON_STOP: i32 = 0;
/// `StopReason.STOP_REASON_LENGTH`: `max_tokens` ended the sample.
pub const STOP_REASON_LENGTH: i32 = 1;

/// One `forward_backward` (or `forward`, with `forward_only`) request.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardRequest {
    /// The training model.
    #[prost(string, tag = "1")]
    pub model_id: String,
    /// Position in the model's request order.
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    /// The datums.
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    /// `cross_entropy`, `importance_sampling`, ...
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    /// Numeric loss configuration.
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    /// Score only; no gradients.
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    /// Loss configuration with text values; wins over `loss_fn_config`.
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

/// A number or a text value of `loss_fn_config_v2`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LossConfigValue {
    /// The value.
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

/// The oneof of [`LossConfigValue`].
pub mod loss_config_value {
    /// A number or a text.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        /// A number.
        #[prost(double, tag = "1")]
        Number(f64),
        /// A text.
        #[prost(string, tag = "2")]
        Text(String),
    }
}

/// One training example: the model input and the loss inputs aligned with it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Datum {
    /// Input chunks, concatenated.
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    /// `target_tokens`, `weights`, `logprobs`, `advantages`, ...
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
}

/// A piece of model input.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Chunk {
    /// Which kind of chunk.
    #[prost(oneof = "chunk::Chunk", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Chunk>,
}

/// The oneof of [`Chunk`].
pub mod chunk {
    /// Text tokens, or a modality the server rejects.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Chunk {
        /// Token ids.
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        /// An image (bytes not kept).
        #[prost(message, tag = "2")]
        Image(super::Skipped),
        /// Audio features (bytes not kept).
        #[prost(message, tag = "3")]
        Dmel(super::Skipped),
    }
}

/// Token ids as little-endian int32 bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EncodedTextChunk {
    /// Little-endian int32 token ids.
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

/// A message whose content the server does not read.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Skipped {}

/// A dense or sparse tensor.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Tensor {
    /// Dense bytes or CSR parts.
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    /// Element type (`DTYPE_*`).
    #[prost(int32, tag = "3")]
    pub dtype: i32,
    /// Shape.
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

/// The oneof of [`Tensor`].
pub mod tensor {
    /// How the elements are stored.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        /// Little-endian elements, row-major.
        #[prost(bytes, tag = "1")]
        Dense(Vec<u8>),
        /// Compressed sparse rows (not supported yet).
        #[prost(message, tag = "2")]
        SparseCsr(super::Skipped),
    }
}

/// Result of a `forward_backward` or `forward`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardOutput {
    /// Class name of the outputs (`ArrayRecord`).
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    /// Per-datum outputs, batched.
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    /// `name:reduction` metrics.
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

/// Named per-datum tensors of several datums.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayRecord {
    /// Record class tag.
    #[prost(string, tag = "1")]
    pub type_tag: String,
    /// Field name to its datums' values.
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    /// Datums in the record.
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

/// Datums' values laid end to end with byte offsets.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BatchedTensor {
    /// All datums' elements.
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    /// Little-endian int64 byte offsets, datums + 1 of them.
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    /// Element type (`DTYPE_*`).
    #[prost(int32, tag = "3")]
    pub dtype: i32,
    /// Shape after each datum's leading dimension.
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

/// Result of an `asample`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampleResponse {
    /// The samples, in order.
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// Little-endian f32 log-prob of each prompt token, NaN at position 0.
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
    /// Prompt tokens served from a prefix cache.
    #[prost(int32, tag = "4")]
    pub prompt_cache_hit_tokens: i32,
}

/// One sample.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampledSequence {
    /// `STOP_REASON_*`.
    #[prost(int32, tag = "1")]
    pub stop_reason: i32,
    /// Little-endian int32 token ids.
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    /// Little-endian f32 log-prob of each token.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
    /// The most likely tokens at each position, when the request asked for them.
    #[prost(message, optional, tag = "4")]
    pub topk_sampled_logprobs: Option<TopkLogprobs>,
}

/// `k` tokens and log-probs per position, row-major `[length, k]`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TopkLogprobs {
    /// Little-endian int32 token ids.
    #[prost(bytes = "vec", tag = "1")]
    pub token_ids: Vec<u8>,
    /// Little-endian f32 log-probs.
    #[prost(bytes = "vec", tag = "2")]
    pub logprobs: Vec<u8>,
    /// Entries per position.
    #[prost(uint32, tag = "3")]
    pub k: u32,
    /// Positions.
    #[prost(uint32, tag = "4")]
    pub length: u32,
}
