//! Between Tinker's wire data and the engine's types: datums to training groups,
//! per-token outputs to batched tensors, generations to sample responses.
//!
//! A datum's position `i` of the model input predicts `target_tokens[i]`. The engine
//! scores responses given a prompt, so a datum becomes the one-token prompt
//! `model_input[0]` and the response `model_input[1..]` plus the last target. When
//! `target_tokens` is the model input shifted by one, as the SDK and cookbook send it,
//! the response's own tokens are what it scores; otherwise (some clients fill masked
//! prompt positions with 0, or score other tokens on purpose) the datum's targets go
//! along as the positions' scored tokens, as the hosted service computes them.

use std::collections::{BTreeMap, HashMap};

use floe_engine::{Generation, StopReason};
use floe_engine::{SequenceGroup, TokenOutputs, TrainGroup, TrainResponse};
use floe_model::lora::{LoraConfig, DEFAULT_LORA_ALPHA};
use serde::Deserialize;

use crate::proto;

/// A datum's tokens and loss inputs, decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct TinkerDatum {
    /// The model input's tokens.
    pub input: Vec<u32>,
    /// `target_tokens`: what each input position scores (usually the input shifted by
    /// one plus the next token).
    pub targets: Vec<u32>,
    /// Float loss inputs by name (`weights`, `logprobs`, `advantages`, ...).
    pub inputs: BTreeMap<String, Vec<f64>>,
}

impl TinkerDatum {
    /// The tokens after the first input token, plus the last target (read by nothing):
    /// the response whose positions follow the input.
    fn response(&self) -> Vec<u32> {
        let mut tokens = self.input[1..].to_vec();
        tokens.extend(self.targets.last());
        tokens
    }

    /// The targets, when they are not the response itself.
    fn scored(&self, response: &[u32]) -> Option<Vec<u32>> {
        (response != self.targets.as_slice()).then(|| self.targets.clone())
    }

    /// The datum as one group of one response.
    pub fn sequence_group(&self) -> SequenceGroup {
        let response = self.response();
        SequenceGroup {
            targets: self.scored(&response).map(|t| vec![t]),
            prompt: vec![self.input[0]],
            responses: vec![response],
        }
    }

    /// The datum as a training group: `weights` go to the loss mask, the client's
    /// `logprobs` (the sampler's) to `old_logprobs`; absent inputs are zeros (the loss
    /// checks which ones it needs).
    pub fn train_group(&self) -> TrainGroup {
        let n = self.targets.len();
        let input = |name: &str, default: f64| {
            self.inputs
                .get(name)
                .cloned()
                .unwrap_or_else(|| vec![default; n])
        };
        let response = self.response();
        TrainGroup {
            prompt: vec![self.input[0]],
            responses: vec![TrainResponse {
                targets: self.scored(&response),
                tokens: response,
                loss_mask: input("weights", 1.0),
                advantages: input("advantages", 0.0),
                old_logprobs: input("logprobs", 0.0),
                rollout_logprobs: None,
                ref_logprobs: None,
            }],
        }
    }
}

/// Tinker's `lora_config` as it arrives; absent fields take the protocol's defaults and
/// unknown ones are ignored, as everywhere in the protocol.
#[derive(Deserialize)]
struct TinkerLoraConfig {
    #[serde(default = "default_lora_rank")]
    rank: i64,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default = "yes")]
    train_attn: bool,
    #[serde(default = "yes")]
    train_mlp: bool,
    #[serde(default = "yes")]
    train_unembed: bool,
}

/// Tinker's default rank.
fn default_lora_rank() -> i64 {
    32
}

fn yes() -> bool {
    true
}

/// The adapters a `create_model` `lora_config` asks for: `rank` (default 32), `seed`
/// (absent: a random one, as the SDK documents), `train_attn`, `train_mlp`,
/// `train_unembed` (default true). Tinker sends no alpha; floe scales the low-rank term
/// by [`DEFAULT_LORA_ALPHA`]` / rank`.
pub fn lora_config(value: &serde_json::Value) -> Result<LoraConfig, String> {
    let wire: TinkerLoraConfig =
        serde::Deserialize::deserialize(value).map_err(|e| format!("lora_config {value}: {e}"))?;
    let rank = usize::try_from(wire.rank)
        .map_err(|_| format!("lora_config: rank {} must be at least 1", wire.rank))?;
    let config = LoraConfig {
        rank,
        alpha: DEFAULT_LORA_ALPHA,
        train_attn: wire.train_attn,
        train_mlp: wire.train_mlp,
        train_unembed: wire.train_unembed,
        seed: wire.seed.unwrap_or_else(|| {
            use std::hash::BuildHasher;
            std::hash::RandomState::new().hash_one(std::time::Instant::now())
        }),
    };
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Decodes the datums of a request, checking shapes and token ranges.
pub fn decode_datums(data: &[proto::Datum], vocab_size: usize) -> Result<Vec<TinkerDatum>, String> {
    data.iter()
        .enumerate()
        .map(|(i, datum)| decode_datum(datum, vocab_size).map_err(|e| format!("datum {i}: {e}")))
        .collect()
}

fn decode_datum(datum: &proto::Datum, vocab_size: usize) -> Result<TinkerDatum, String> {
    let input = chunk_tokens(&datum.model_input)?;
    if input.is_empty() {
        return Err("model_input has no tokens".into());
    }
    let n = input.len();
    let mut targets = None;
    let mut inputs = BTreeMap::new();
    for (name, tensor) in &datum.loss_fn_inputs {
        let values = tensor_values(tensor).map_err(|e| format!("loss_fn_inputs[{name:?}]: {e}"))?;
        if values.len() != n {
            return Err(format!(
                "loss_fn_inputs[{name:?}] has {} values for {n} model_input tokens",
                values.len()
            ));
        }
        if name == "target_tokens" {
            targets = Some(to_tokens(&values, vocab_size, "target_tokens")?);
        } else {
            inputs.insert(name.clone(), values);
        }
    }
    let targets = targets.ok_or("loss_fn_inputs has no target_tokens")?;
    check_tokens(&input, vocab_size, "model_input")?;
    Ok(TinkerDatum {
        input,
        targets,
        inputs,
    })
}

/// Concatenated token ids of encoded-text chunks.
pub fn chunk_tokens(chunks: &[proto::Chunk]) -> Result<Vec<u32>, String> {
    let mut tokens = Vec::new();
    for chunk in chunks {
        match &chunk.chunk {
            Some(proto::chunk::Chunk::EncodedText(text)) => {
                if text.tokens.len() % 4 != 0 {
                    return Err(format!(
                        "an encoded_text chunk has {} bytes, not a multiple of 4",
                        text.tokens.len()
                    ));
                }
                for bytes in text.tokens.chunks_exact(4) {
                    let id = i32::from_le_bytes(bytes.try_into().expect("4 bytes"));
                    tokens
                        .push(u32::try_from(id).map_err(|_| format!("token id {id} is negative"))?);
                }
            }
            Some(_) => {
                return Err("only encoded_text chunks are supported (no images or audio)".into())
            }
            None => return Err("a model_input chunk is empty".into()),
        }
    }
    Ok(tokens)
}

/// The elements of a dense 1-D tensor as f64.
fn tensor_values(tensor: &proto::Tensor) -> Result<Vec<f64>, String> {
    let bytes = match &tensor.encoding {
        Some(proto::tensor::Encoding::Dense(bytes)) => bytes,
        Some(proto::tensor::Encoding::SparseCsr(_)) => {
            return Err("sparse tensors are not supported yet; send dense 1-D tensors".into())
        }
        None => return Err("the tensor has no data".into()),
    };
    if tensor.shape.len() > 1 {
        return Err(format!(
            "shape {:?}: only 1-D tensors are supported yet",
            tensor.shape
        ));
    }
    let (width, read): (usize, fn(&[u8]) -> f64) = match tensor.dtype {
        proto::DTYPE_FLOAT32 => (4, |b| f32::from_le_bytes(b.try_into().expect("4")) as f64),
        proto::DTYPE_INT64 => (8, |b| i64::from_le_bytes(b.try_into().expect("8")) as f64),
        proto::DTYPE_INT32 => (4, |b| i32::from_le_bytes(b.try_into().expect("4")) as f64),
        other => return Err(format!("unsupported dtype {other}")),
    };
    if bytes.len() % width != 0 {
        return Err(format!(
            "{} bytes are not a whole number of {width}-byte elements",
            bytes.len()
        ));
    }
    let values: Vec<f64> = bytes.chunks_exact(width).map(read).collect();
    if let Some(&[len]) = tensor.shape.get(..1) {
        if len as usize != values.len() {
            return Err(format!("shape [{len}] but {} elements", values.len()));
        }
    }
    Ok(values)
}

fn to_tokens(values: &[f64], vocab_size: usize, what: &str) -> Result<Vec<u32>, String> {
    let tokens: Vec<u32> = values
        .iter()
        .map(|&v| {
            if v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f64 {
                Ok(v as u32)
            } else {
                Err(format!("{what} holds {v}, not a token id"))
            }
        })
        .collect::<Result<_, _>>()?;
    check_tokens(&tokens, vocab_size, what)?;
    Ok(tokens)
}

/// Checks every id is below the vocabulary size.
pub fn check_tokens(tokens: &[u32], vocab_size: usize, what: &str) -> Result<(), String> {
    match tokens.iter().position(|&t| t as usize >= vocab_size) {
        Some(i) => Err(format!(
            "{what}[{i}] is {}, not below the vocabulary size {vocab_size}",
            tokens[i]
        )),
        None => Ok(()),
    }
}

/// The `ForwardBackwardOutput` of per-datum log-probs and `name:reduction` metrics.
pub fn forward_backward_output(
    outputs: &[Vec<TokenOutputs>],
    metrics: HashMap<String, f64>,
) -> Vec<u8> {
    let mut data = Vec::new();
    let mut offsets = Vec::with_capacity((outputs.len() + 1) * 8);
    offsets.extend_from_slice(&0i64.to_le_bytes());
    for group in outputs {
        for response in group {
            for &logprob in &response.logprobs {
                data.extend_from_slice(&(logprob as f32).to_le_bytes());
            }
        }
        offsets.extend_from_slice(&(data.len() as i64).to_le_bytes());
    }
    let record = proto::ArrayRecord {
        type_tag: "ArrayRecord".into(),
        fields: HashMap::from([(
            "logprobs".to_string(),
            proto::BatchedTensor {
                data,
                offsets,
                dtype: proto::DTYPE_FLOAT32,
                trailing_shape: Vec::new(),
            },
        )]),
        num_datums: outputs.len() as i64,
    };
    prost::Message::encode_to_vec(&proto::ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![record],
        metrics,
    })
}

/// Tinker's `[length, k]` table of each position's most likely tokens; positions with fewer
/// than `k` (a vocabulary smaller than `k`) are padded with id 0 and log-prob -99999, as the
/// service pads them. `None` when none were asked for.
fn topk_logprobs(per_token: &[Vec<(u32, f32)>]) -> Option<proto::TopkLogprobs> {
    let k = per_token.iter().map(Vec::len).max().filter(|&k| k > 0)?;
    let padded = |row: &Vec<(u32, f32)>| {
        let pad = std::iter::repeat_n((0, -99999.0), k - row.len());
        row.iter().copied().chain(pad).collect::<Vec<_>>()
    };
    let rows: Vec<Vec<(u32, f32)>> = per_token.iter().map(padded).collect();
    Some(proto::TopkLogprobs {
        token_ids: rows
            .iter()
            .flatten()
            .flat_map(|&(t, _)| (t as i32).to_le_bytes())
            .collect(),
        logprobs: rows
            .iter()
            .flatten()
            .flat_map(|&(_, l)| l.to_le_bytes())
            .collect(),
        k: k as u32,
        length: rows.len() as u32,
    })
}

/// The `SampleResponse` of finished samples (in sample order) and optional prompt
/// log-probs.
pub fn sample_response(generations: &[Generation], prompt_logprobs: Option<&[f64]>) -> Vec<u8> {
    let sequences = generations
        .iter()
        .map(|generation| proto::SampledSequence {
            stop_reason: match generation.stop_reason {
                StopReason::Length => proto::STOP_REASON_LENGTH,
                StopReason::Stop(_) => proto::STOP_REASON_STOP,
            },
            tokens: generation
                .tokens
                .iter()
                .flat_map(|&t| (t as i32).to_le_bytes())
                .collect(),
            logprobs: Some(
                generation
                    .logprobs
                    .iter()
                    .flat_map(|l| l.to_le_bytes())
                    .collect(),
            ),
            topk_sampled_logprobs: topk_logprobs(&generation.top_logprobs),
        })
        .collect();
    prost::Message::encode_to_vec(&proto::SampleResponse {
        sequences,
        prompt_logprobs: prompt_logprobs.map(|values| {
            values
                .iter()
                .flat_map(|&v| (v as f32).to_le_bytes())
                .collect()
        }),
        prompt_cache_hit_tokens: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(values: Vec<u8>, dtype: i32) -> proto::Tensor {
        proto::Tensor {
            encoding: Some(proto::tensor::Encoding::Dense(values)),
            dtype,
            shape: Vec::new(),
        }
    }

    fn datum(input: &[i32], targets: &[i64], weights: &[f32]) -> proto::Datum {
        proto::Datum {
            model_input: vec![proto::Chunk {
                chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                    tokens: input.iter().flat_map(|t| t.to_le_bytes()).collect(),
                })),
            }],
            loss_fn_inputs: HashMap::from([
                (
                    "target_tokens".to_string(),
                    dense(
                        targets.iter().flat_map(|t| t.to_le_bytes()).collect(),
                        proto::DTYPE_INT64,
                    ),
                ),
                (
                    "weights".to_string(),
                    dense(
                        weights.iter().flat_map(|w| w.to_le_bytes()).collect(),
                        proto::DTYPE_FLOAT32,
                    ),
                ),
            ]),
        }
    }

    #[test]
    fn a_datum_becomes_a_one_token_prompt_and_its_targets() {
        let decoded = decode_datums(&[datum(&[5, 6, 7], &[6, 7, 8], &[0.0, 1.0, -2.0])], 10)
            .unwrap()
            .remove(0);
        let group = decoded.train_group();
        assert_eq!(group.prompt, vec![5]);
        assert_eq!(group.responses[0].tokens, vec![6, 7, 8]);
        assert_eq!(group.responses[0].loss_mask, vec![0.0, 1.0, -2.0]);
        assert_eq!(group.responses[0].advantages, vec![0.0; 3]);
    }

    #[test]
    fn targets_that_are_not_the_shifted_input_are_scored_as_given() {
        // Position 1 reads 5, 6 and scores 9 instead of the next input token 7.
        let decoded = decode_datums(&[datum(&[5, 6, 7], &[6, 9, 8], &[1.0; 3])], 10)
            .unwrap()
            .remove(0);
        let group = decoded.train_group();
        assert_eq!(group.prompt, vec![5]);
        assert_eq!(group.responses[0].tokens, vec![6, 7, 8]);
        assert_eq!(group.responses[0].targets, Some(vec![6, 9, 8]));
        let scoring = decoded.sequence_group();
        assert_eq!(scoring.responses, vec![vec![6, 7, 8]]);
        assert_eq!(scoring.targets, Some(vec![vec![6, 9, 8]]));
        // The shifted input needs no override.
        let shifted = decode_datums(&[datum(&[5, 6, 7], &[6, 7, 8], &[1.0; 3])], 10).unwrap();
        assert_eq!(shifted[0].train_group().responses[0].targets, None);
    }

    #[test]
    fn malformed_datums_are_named() {
        let short = decode_datums(&[datum(&[5, 6, 7], &[6, 7], &[1.0; 3])], 10);
        assert!(short.unwrap_err().contains("has 2 values for 3"));
        let out_of_vocab = decode_datums(&[datum(&[5, 6, 7], &[6, 7, 12], &[1.0; 3])], 10);
        assert!(out_of_vocab.unwrap_err().contains("vocabulary size 10"));
    }

    #[test]
    fn lora_config_takes_tinker_defaults_and_names_bad_values() {
        let config = lora_config(&serde_json::json!({ "rank": 8, "seed": 5 })).unwrap();
        assert_eq!((config.rank, config.seed), (8, 5));
        assert!(config.train_attn && config.train_mlp && config.train_unembed);
        let config =
            lora_config(&serde_json::json!({ "seed": 3, "train_unembed": false })).unwrap();
        assert_eq!(
            (config.rank, config.seed, config.train_unembed),
            (32, 3, false)
        );
        let zero = lora_config(&serde_json::json!({ "rank": 0 })).unwrap_err();
        assert!(zero.contains("rank"), "{zero}");
        let negative = lora_config(&serde_json::json!({ "rank": -4 })).unwrap_err();
        assert!(negative.contains("rank -4"), "{negative}");
        let nothing =
            serde_json::json!({ "train_attn": false, "train_mlp": false, "train_unembed": false });
        assert!(lora_config(&nothing)
            .unwrap_err()
            .contains("nothing would train"));
    }

    #[test]
    fn outputs_carry_byte_offsets_per_datum() {
        let outputs = vec![
            vec![TokenOutputs {
                logprobs: vec![-1.0, -2.0],
                entropy: vec![0.0; 2],
            }],
            vec![TokenOutputs {
                logprobs: vec![-0.5],
                entropy: vec![0.0],
            }],
        ];
        let bytes = forward_backward_output(&outputs, HashMap::from([("loss:sum".into(), 3.5)]));
        let decoded: proto::ForwardBackwardOutput = prost::Message::decode(&bytes[..]).unwrap();
        let logprobs = &decoded.loss_fn_outputs[0].fields["logprobs"];
        let offsets: Vec<i64> = logprobs
            .offsets
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(offsets, vec![0, 8, 12]);
        assert_eq!(decoded.loss_fn_outputs[0].num_datums, 2);
        assert_eq!(decoded.metrics["loss:sum"], 3.5);
    }
}
