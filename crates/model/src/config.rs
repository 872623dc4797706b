//! Model hyper-parameters, read from and written to Hugging Face `config.json`.
//!
//! [`ModelConfig::from_hf_json`] accepts `Qwen3ForCausalLM`, `Qwen2ForCausalLM` and
//! `LlamaForCausalLM` configs as transformers writes them (4.x with `rope_theta` /
//! `rope_scaling`, 5.x with `rope_parameters`), filling absent optional keys with
//! transformers' defaults. The five shape keys (`vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`) are required: a
//! config without them is broken, and transformers' defaults would silently build a
//! different model.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::embedded::EMBEDDED_CONTEXT;

/// The decoder families floe runs; they differ only in a few switches of [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// `Qwen3ForCausalLM`: RMSNorm on each query and key head, no qkv bias.
    Qwen3,
    /// `Qwen2ForCausalLM`: bias on the q, k and v projections.
    Qwen2,
    /// `LlamaForCausalLM`: neither.
    Llama,
}

impl Architecture {
    /// Every supported family.
    pub const ALL: [Architecture; 3] = [Self::Qwen3, Self::Qwen2, Self::Llama];

    /// The transformers class name (`architectures[0]` in `config.json`).
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Llama => "LlamaForCausalLM",
        }
    }

    /// The transformers `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3 => "qwen3",
            Self::Qwen2 => "qwen2",
            Self::Llama => "llama",
        }
    }
}

/// RoPE frequency scaling of the `llama3` kind (`rope_scaling` in `config.json`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f32,
    /// `low_freq_factor`.
    pub low_freq_factor: f32,
    /// `high_freq_factor`.
    pub high_freq_factor: f32,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

/// Everything the model needs to know about its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Which family.
    pub architecture: Architecture,
    /// Rows of the embedding table.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Size of each head (Qwen3 sets it explicitly; otherwise hidden / heads).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Optional llama3-style RoPE scaling.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest sequence the model was trained for.
    pub max_position_embeddings: usize,
    /// The lm-head shares the embedding table.
    pub tie_word_embeddings: bool,
    /// Bias on q, k, v projections (Qwen2).
    pub attention_bias: bool,
    /// RMSNorm on each q and k head (Qwen3).
    pub qk_norm: bool,
    /// `bos_token_id`, where given.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id` (one or several).
    pub eos_token_ids: Vec<u32>,
}

/// Most layers a `config.json` may declare (the largest open models have about 100).
pub const MAX_LAYERS: usize = 1 << 16;

/// Why a `config.json` could not be turned into a [`ModelConfig`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("{path}: not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// A required key is absent.
    #[error("{origin}: missing required key `{key}`")]
    MissingKey {
        /// The file (or `<json>` for an in-memory value).
        origin: String,
        /// The key.
        key: &'static str,
    },
    /// A key holds a value of the wrong type or out of range.
    #[error("{origin}: key `{key}`: {msg}")]
    BadValue {
        /// The file (or `<json>`).
        origin: String,
        /// The key.
        key: String,
        /// What is wrong with it.
        msg: String,
    },
    /// `architectures` / `model_type` name a family floe does not run.
    #[error(
        "{origin}: unsupported architecture `{found}`; supported: \
         Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM"
    )]
    UnsupportedArchitecture {
        /// The file (or `<json>`).
        origin: String,
        /// What the config names.
        found: String,
    },
    /// A feature of the config that floe does not implement (sliding window, RoPE kind…).
    #[error("{origin}: key `{key}`: unsupported: {msg}")]
    Unsupported {
        /// The file (or `<json>`).
        origin: String,
        /// The key.
        key: String,
        /// What is unsupported.
        msg: String,
    },
    /// `ModelConfig::preset` got a name it does not know.
    #[error("unknown model preset `{0}`; known: tiny, small, 0.6B, 1.7B, 4B, 8B, 14B, 32B")]
    UnknownPreset(String),
}

/// Result of config parsing.
pub type Result<T> = std::result::Result<T, ConfigError>;

/// Reads typed keys out of one `config.json` object, naming the origin in every error.
struct Keys<'a> {
    origin: &'a str,
    /// The object's own key with a dot (`rope_parameters.`) for a nested one, so errors
    /// name the full path; empty at the top level.
    prefix: &'a str,
    map: &'a Map<String, Value>,
}

impl<'a> Keys<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, msg: impl Into<String>) -> ConfigError {
        ConfigError::BadValue {
            origin: self.origin.to_string(),
            key: format!("{}{key}", self.prefix),
            msg: msg.into(),
        }
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.bad(key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn usize_req(&self, key: &'static str) -> Result<usize> {
        let n = self
            .usize_opt(key)?
            .ok_or_else(|| ConfigError::MissingKey {
                origin: self.origin.to_string(),
                key,
            })?;
        if n == 0 {
            return Err(self.bad(key, "must be positive"));
        }
        Ok(n)
    }

    fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.bad(key, format!("expected a number, got {v}"))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.bad(key, format!("expected a string, got {v}"))),
        }
    }

    /// A token id given as an integer, a list of integers, or null.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let as_id = |v: &Value| {
            v.as_u64()
                .filter(|&n| n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| self.bad(key, format!("expected a token id, got {v}")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(as_id).collect(),
            Some(v) => Ok(vec![as_id(v)?]),
        }
    }
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&value, &path.display().to_string())
    }

    /// Parses a Hugging Face config already in memory (errors name `<json>` as origin).
    pub fn from_hf_json(value: &Value) -> Result<Self> {
        Self::parse(value, "<json>")
    }

    fn parse(value: &Value, origin: &str) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| ConfigError::BadValue {
            origin: origin.to_string(),
            key: "<root>".into(),
            msg: "expected a JSON object".into(),
        })?;
        let keys = Keys {
            origin,
            prefix: "",
            map,
        };
        let architecture = Self::architecture_of(&keys)?;

        if let Some(act) = keys.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(ConfigError::Unsupported {
                    origin: origin.into(),
                    key: "hidden_act".into(),
                    msg: format!("`{act}` (only silu)"),
                });
            }
        }
        if keys.bool_opt("use_sliding_window")? == Some(true) {
            return Err(ConfigError::Unsupported {
                origin: origin.into(),
                key: "use_sliding_window".into(),
                msg: "sliding-window attention".into(),
            });
        }
        if keys.bool_opt("mlp_bias")? == Some(true) {
            return Err(ConfigError::Unsupported {
                origin: origin.into(),
                key: "mlp_bias".into(),
                msg: "bias on the MLP projections".into(),
            });
        }

        let vocab_size = keys.usize_req("vocab_size")?;
        let hidden_size = keys.usize_req("hidden_size")?;
        let intermediate_size = keys.usize_req("intermediate_size")?;
        let num_hidden_layers = keys.usize_req("num_hidden_layers")?;
        let num_attention_heads = keys.usize_req("num_attention_heads")?;
        let num_key_value_heads = keys
            .usize_opt("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(keys.bad(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide num_attention_heads = {num_attention_heads}"),
            ));
        }
        let head_dim = match keys.usize_opt("head_dim")? {
            Some(d) => d,
            None if architecture == Architecture::Qwen3 => 128,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(keys.bad(
                        "head_dim",
                        format!("absent, and hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(keys.bad(
                "head_dim",
                format!("{head_dim} must be positive and even (RoPE)"),
            ));
        }

        let (rope_theta, rope_scaling) = Self::rope_of(&keys)?;
        let defaults = match architecture {
            // (max_position_embeddings, rms_norm_eps, bos)
            Architecture::Qwen3 | Architecture::Qwen2 => (32768, 1e-6, None),
            Architecture::Llama => (2048, 1e-6, Some(1)),
        };
        let bos_token_id = match keys.get("bos_token_id") {
            Some(_) => keys.token_ids("bos_token_id")?.first().copied(),
            None if map.contains_key("bos_token_id") => None,
            None => defaults.2,
        };
        let eos_token_ids = match keys.get("eos_token_id") {
            Some(_) => keys.token_ids("eos_token_id")?,
            None if !map.contains_key("eos_token_id") && architecture == Architecture::Llama => {
                vec![2]
            }
            None => Vec::new(),
        };
        // Qwen2 hard-codes bias on q/k/v in transformers. For Llama and Qwen3,
        // `attention_bias` also puts a bias on o_proj, which floe does not implement.
        let attention_bias = architecture == Architecture::Qwen2;
        if !attention_bias && keys.bool_opt("attention_bias")? == Some(true) {
            return Err(ConfigError::Unsupported {
                origin: origin.into(),
                key: "attention_bias".into(),
                msg: format!(
                    "bias on the attention projections of {}",
                    architecture.hf_class()
                ),
            });
        }

        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: keys.f32_opt("rms_norm_eps")?.unwrap_or(defaults.1),
            rope_theta,
            rope_scaling,
            max_position_embeddings: keys
                .usize_opt("max_position_embeddings")?
                .unwrap_or(defaults.0),
            tie_word_embeddings: keys.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            attention_bias,
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id,
            eos_token_ids,
        };
        config.check_sizes(&keys)?;
        Ok(config)
    }

    /// Rejects sizes whose tensors could not exist: more than [`MAX_LAYERS`] layers, or a
    /// parameter count past `usize` (which would overflow, or loop for ages, in
    /// [`crate::weights::tensor_specs`] and [`ModelConfig::num_parameters`]). The error
    /// names the largest size key, the likely culprit.
    fn check_sizes(&self, keys: &Keys<'_>) -> Result<()> {
        if self.num_hidden_layers > MAX_LAYERS {
            return Err(keys.bad(
                "num_hidden_layers",
                format!(
                    "{} is more than {MAX_LAYERS} layers",
                    self.num_hidden_layers
                ),
            ));
        }
        let per_layer = || -> Option<usize> {
            let (h, inter) = (self.hidden_size, self.intermediate_size);
            let q = self.num_attention_heads.checked_mul(self.head_dim)?;
            let kv = self.num_key_value_heads.checked_mul(self.head_dim)?;
            let attention = q.checked_add(kv)?.checked_mul(2)?.checked_mul(h)?;
            let mlp = inter.checked_mul(h)?.checked_mul(3)?;
            let small = h
                .checked_mul(2)?
                .checked_add(q)?
                .checked_add(kv.checked_mul(2)?)?;
            attention.checked_add(mlp)?.checked_add(small)
        };
        let total = per_layer()
            .and_then(|layer| layer.checked_mul(self.num_hidden_layers))
            .and_then(|layers| {
                let embedding = self.vocab_size.checked_mul(self.hidden_size)?;
                layers.checked_add(embedding.checked_mul(2)?)
            })
            .and_then(|n| n.checked_mul(4));
        if total.is_none() {
            let (key, value) = [
                ("vocab_size", self.vocab_size),
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_attention_heads", self.num_attention_heads),
                ("num_key_value_heads", self.num_key_value_heads),
                ("head_dim", self.head_dim),
                ("num_hidden_layers", self.num_hidden_layers),
            ]
            .into_iter()
            .max_by_key(|&(_, value)| value)
            .expect("a non-empty list");
            return Err(keys.bad(
                key,
                format!("{value} makes the model's f32 parameters overflow the address space"),
            ));
        }
        Ok(())
    }

    fn architecture_of(keys: &Keys<'_>) -> Result<Architecture> {
        let unsupported = |found: &str| ConfigError::UnsupportedArchitecture {
            origin: keys.origin.to_string(),
            found: found.to_string(),
        };
        if let Some(list) = keys.get("architectures") {
            let first = list
                .as_array()
                .and_then(|l| l.first())
                .and_then(Value::as_str)
                .ok_or_else(|| keys.bad("architectures", "expected a list of class names"))?;
            return Architecture::ALL
                .into_iter()
                .find(|a| a.hf_class() == first)
                .ok_or_else(|| unsupported(first));
        }
        let model_type = keys.str_opt("model_type")?.ok_or(ConfigError::MissingKey {
            origin: keys.origin.to_string(),
            key: "architectures",
        })?;
        Architecture::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type)
            .ok_or_else(|| unsupported(model_type))
    }

    /// RoPE base and scaling, from `rope_theta` + `rope_scaling` (transformers 4.x) or
    /// `rope_parameters` (5.x).
    fn rope_of(keys: &Keys<'_>) -> Result<(f32, Option<Llama3RopeScaling>)> {
        let (params_key, prefix, params) = match keys.get("rope_parameters") {
            Some(p) => ("rope_parameters", "rope_parameters.", Some(p)),
            None => ("rope_scaling", "rope_scaling.", keys.get("rope_scaling")),
        };
        let params = match params {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(v) => return Err(keys.bad(params_key, format!("expected an object, got {v}"))),
        };
        let sub = params.map(|map| Keys {
            origin: keys.origin,
            prefix,
            map,
        });
        let theta = match sub
            .as_ref()
            .map(|s| s.f32_opt("rope_theta"))
            .transpose()?
            .flatten()
        {
            Some(t) => t,
            None => keys.f32_opt("rope_theta")?.unwrap_or(10000.0),
        };
        let Some(sub) = sub else {
            return Ok((theta, None));
        };
        let kind = match sub.str_opt("rope_type")? {
            Some(k) => Some(k),
            None => sub.str_opt("type")?,
        };
        let key = |k: &str| format!("{params_key}.{k}");
        match kind.unwrap_or("default") {
            "default" => Ok((theta, None)),
            "llama3" => {
                let need = |k: &'static str| -> Result<f32> {
                    sub.f32_opt(k)?.ok_or_else(|| ConfigError::BadValue {
                        origin: keys.origin.to_string(),
                        key: key(k),
                        msg: "required for llama3 RoPE scaling".into(),
                    })
                };
                let original = sub
                    .usize_opt("original_max_position_embeddings")?
                    .ok_or_else(|| ConfigError::BadValue {
                        origin: keys.origin.to_string(),
                        key: key("original_max_position_embeddings"),
                        msg: "required for llama3 RoPE scaling".into(),
                    })?;
                Ok((
                    theta,
                    Some(Llama3RopeScaling {
                        factor: need("factor")?,
                        low_freq_factor: need("low_freq_factor")?,
                        high_freq_factor: need("high_freq_factor")?,
                        original_max_position_embeddings: original,
                    }),
                ))
            }
            other => Err(ConfigError::Unsupported {
                origin: keys.origin.to_string(),
                key: key("rope_type"),
                msg: format!("RoPE kind `{other}` (only default and llama3)"),
            }),
        }
    }

    /// The `config.json` transformers loads back into the same model. `torch_dtype`
    /// records the dtype the weights are saved in (`"float32"` or `"bfloat16"`).
    pub fn to_hf_json(&self, torch_dtype: &str) -> Value {
        let eos = match self.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        let rope_scaling = self.rope_scaling.map(|s| {
            json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            })
        });
        let mut v = json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "torch_dtype": torch_dtype,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        });
        if self.architecture == Architecture::Llama {
            v["mlp_bias"] = json!(false);
        } else {
            v["use_sliding_window"] = json!(false);
            v["sliding_window"] = Value::Null;
            v["max_window_layers"] = json!(self.num_hidden_layers);
        }
        v
    }

    /// A Qwen3 shape by name, the same names as the embedded models (`embedded:<name>`):
    /// - `tiny`: the shape of `floe train`'s default embedded model, hidden 128, 4 layers,
    ///   4 query and 2 key/value heads of 32, vocabulary 1024, RoPE base 1e4, eos id 2, no
    ///   bos (about 1M parameters);
    /// - `small`: floe's own 4-layer size twice as wide (hidden 256, heads of 64);
    /// - `0.6B`, `1.7B`, `4B`, `8B`, `14B`, `32B`: the public Qwen3 configs.
    ///
    /// Except for `tiny`: vocabulary 151936, head size 128 (64 for `small`), RoPE base 1e6,
    /// bos 151643, eos 151645. RMSNorm eps 1e-6 throughout; the embeddings are tied up to 4B.
    /// The context is Qwen3's 40960 tokens, [`EMBEDDED_CONTEXT`] for floe's own `tiny` and
    /// `small`.
    pub fn preset(name: &str) -> Result<Self> {
        let tiny = name == "tiny";
        // (hidden, intermediate, layers, heads, kv_heads)
        let (hidden, inter, layers, heads, kv) = match name {
            "tiny" => (128, 384, 4, 4, 2),
            "small" => (256, 768, 4, 4, 2),
            "0.6B" => (1024, 3072, 28, 16, 8),
            "1.7B" => (2048, 6144, 28, 16, 8),
            "4B" => (2560, 9728, 36, 32, 8),
            "8B" => (4096, 12288, 36, 32, 8),
            "14B" => (5120, 17408, 40, 40, 8),
            "32B" => (5120, 25600, 64, 64, 8),
            _ => return Err(ConfigError::UnknownPreset(name.to_string())),
        };
        Ok(ModelConfig {
            architecture: Architecture::Qwen3,
            vocab_size: if tiny { 1024 } else { 151936 },
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: match name {
                "tiny" => 32,
                "small" => 64,
                _ => 128,
            },
            rms_norm_eps: 1e-6,
            rope_theta: if tiny { 1e4 } else { 1e6 },
            rope_scaling: None,
            max_position_embeddings: if matches!(name, "tiny" | "small") {
                EMBEDDED_CONTEXT
            } else {
                40960
            },
            tie_word_embeddings: !matches!(name, "8B" | "14B" | "32B"),
            attention_bias: false,
            qk_norm: true,
            bos_token_id: (!tiny).then_some(151643),
            eos_token_ids: vec![if tiny { 2 } else { 151645 }],
        })
    }

    /// The shape the model's and the engine's tests build on, small enough that a gradient
    /// check takes f64 finite differences over every parameter: vocabulary 32, hidden 16,
    /// MLP 24, 2 layers, 4 query and 2 key/value heads of 8 (6,000 parameters), tied
    /// embeddings, RoPE base 1e4, 64 positions, eos id 1, no bos, RMSNorm eps 1e-6, and
    /// `architecture`'s switches (q/k/v bias for Qwen2, q/k norms for Qwen3).
    ///
    /// A test that needs another size or id changes only that field:
    /// `ModelConfig { vocab_size: 64, ..ModelConfig::test_shape(Architecture::Qwen3) }`.
    pub fn test_shape(architecture: Architecture) -> Self {
        ModelConfig {
            architecture,
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 1e4,
            rope_scaling: None,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            attention_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: None,
            eos_token_ids: vec![1],
        }
    }

    /// Number of scalar parameters (every tensor of [`crate::weights::tensor_specs`]).
    pub fn num_parameters(&self) -> usize {
        crate::weights::tensor_specs(self)
            .iter()
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum()
    }

    /// Rows of `q_proj` (`heads × head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Rows of `k_proj` and `v_proj` (`kv_heads × head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}
