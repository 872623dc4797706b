//! Weights on the host: Hugging Face safetensors in and out (single file or sharded;
//! f32, bf16, f16), with the tensor names and shapes each architecture expects.
//!
//! [`tensor_specs`] is the single source of the Hugging Face names and shapes;
//! [`load_model_dir`] reads a `save_pretrained` folder (memory-mapped, converted to f32)
//! and checks it against them; [`save_model_dir`] writes a folder transformers'
//! `from_pretrained` loads.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::config::{ConfigError, ModelConfig};

/// One tensor on the host, in f32, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

/// A tensor borrowed for writing: its shape and f32 values, wherever they live (a
/// [`HostTensor`], or an optimizer's masters and moments in host memory, which a save
/// must not copy: at 8B they are 78 GB).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Dimensions, outermost first.
    pub shape: &'a [usize],
    /// `shape.iter().product()` values.
    pub data: &'a [f32],
}

impl HostTensor {
    /// The tensor borrowed for writing.
    pub fn view(&self) -> TensorView<'_> {
        TensorView {
            shape: &self.shape,
            data: &self.data,
        }
    }

    /// A tensor of `shape` holding `data`; `None` when the lengths disagree.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Option<Self> {
        (shape.iter().product::<usize>() == data.len()).then_some(Self { shape, data })
    }

    /// A zero-filled tensor of `shape`.
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self {
            shape,
            data: vec![0.0; n],
        }
    }
}

/// Storage dtype of a saved model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDType {
    /// 4 bytes per value, exact.
    F32,
    /// 2 bytes per value, rounded to nearest even (what training in bf16 publishes).
    BF16,
}

impl SaveDType {
    /// Bytes per value.
    fn width(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::BF16 => 2,
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::BF16 => Dtype::BF16,
        }
    }

    /// The `torch_dtype` string of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
        }
    }
}

/// Why weights could not be read or written. Every variant names the file or tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// `config.json` is missing or wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The folder holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{dir}: no model.safetensors or model.safetensors.index.json")]
    NoWeights {
        /// The folder.
        dir: PathBuf,
    },
    /// A safetensors file is corrupt or could not be written.
    #[error("{path}: safetensors: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The library's message.
        msg: String,
    },
    /// The shard index is malformed.
    #[error("{path}: {msg}")]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// What is wrong with it.
        msg: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("{origin}: missing tensor `{tensor}`")]
    MissingTensor {
        /// The file or folder searched (or `<weights>` for an in-memory map).
        origin: String,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor's shape differs from [`tensor_specs`].
    #[error("{origin}: tensor `{tensor}` has shape {got:?}, expected {expected:?}")]
    Shape {
        /// The file (or `<weights>`).
        origin: String,
        /// The tensor's name.
        tensor: String,
        /// The shape the config implies.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A tensor is stored in a dtype floe does not read.
    #[error("{path}: tensor `{tensor}` has dtype {dtype}; supported: F32, BF16, F16")]
    DType {
        /// The file.
        path: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The dtype found.
        dtype: String,
    },
}

/// Result of weight I/O.
pub type Result<T> = std::result::Result<T, WeightsError>;

/// The Hugging Face name and shape of every parameter of `config`, in canonical order:
/// embedding, each layer (norm, attention, norm, MLP), final norm, then the lm-head
/// unless it is tied to the embedding.
pub fn tensor_specs(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let h = config.hidden_size;
    let (q, kv, d) = (config.q_dim(), config.kv_dim(), config.head_dim);
    let inter = config.intermediate_size;
    let mut specs = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![config.vocab_size, h],
    )];
    for i in 0..config.num_hidden_layers {
        let p = format!("model.layers.{i}");
        specs.push((format!("{p}.input_layernorm.weight"), vec![h]));
        specs.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        if config.attention_bias {
            specs.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
        }
        specs.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        if config.attention_bias {
            specs.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
        }
        specs.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        if config.attention_bias {
            specs.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        }
        specs.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        if config.qk_norm {
            specs.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
            specs.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
        }
        specs.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        specs.push((format!("{p}.mlp.gate_proj.weight"), vec![inter, h]));
        specs.push((format!("{p}.mlp.up_proj.weight"), vec![inter, h]));
        specs.push((format!("{p}.mlp.down_proj.weight"), vec![h, inter]));
    }
    specs.push(("model.norm.weight".to_string(), vec![h]));
    if !config.tie_word_embeddings {
        specs.push(("lm_head.weight".to_string(), vec![config.vocab_size, h]));
    }
    specs
}

/// Checks that `weights` holds every tensor of [`tensor_specs`] with its shape and a
/// matching data length. Extra tensors are allowed.
pub fn check_weights(config: &ModelConfig, weights: &BTreeMap<String, HostTensor>) -> Result<()> {
    check_views(config, &views(weights))
}

/// [`check_weights`] of borrowed tensors.
fn check_views(config: &ModelConfig, weights: &BTreeMap<String, TensorView<'_>>) -> Result<()> {
    for (name, shape) in tensor_specs(config) {
        let t = weights
            .get(&name)
            .ok_or_else(|| WeightsError::MissingTensor {
                origin: "<weights>".into(),
                tensor: name.clone(),
            })?;
        if t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
            return Err(WeightsError::Shape {
                origin: "<weights>".into(),
                tensor: name,
                expected: shape,
                got: t.shape.to_vec(),
            });
        }
    }
    Ok(())
}

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
/// Shards above this many bytes are split, like transformers' default `max_shard_size`.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 4 << 30;
/// Tensors at least this large convert on all cores.
const PARALLEL_ELEMENTS: usize = 1 << 20;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError + '_ {
    move |source| WeightsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Loads a Hugging Face model folder: `config.json` plus `model.safetensors` or the
/// shards listed in `model.safetensors.index.json`. Files are memory-mapped and each
/// tensor of [`tensor_specs`] is converted to f32; other tensors are ignored.
pub fn load_model_dir(
    dir: impl AsRef<Path>,
) -> Result<(ModelConfig, BTreeMap<String, HostTensor>)> {
    let mut weights = BTreeMap::new();
    let config = visit_model_dir(dir, true, &mut |name, tensor| -> Result<()> {
        weights.insert(name, tensor);
        Ok(())
    })?;
    Ok((config, weights))
}

/// [`load_model_dir`] one tensor at a time, so the caller holds at most one in host
/// memory (an 8B model's f32 weights are 33 GB): `f` gets every tensor of the config's
/// specs, file by file. With `convert` false only the headers are checked (every tensor
/// present, of its shape and a supported dtype) and `f` is not called: a caller that
/// overwrites weights in place checks first, so a bad folder changes nothing.
pub fn visit_model_dir<E: From<WeightsError>>(
    dir: impl AsRef<Path>,
    convert: bool,
    f: &mut dyn FnMut(String, HostTensor) -> std::result::Result<(), E>,
) -> std::result::Result<ModelConfig, E> {
    let (config, by_file) = model_dir_files(dir.as_ref())?;
    for (path, wanted) in by_file {
        with_safetensors(&path, |st| visit_wanted(&path, st, wanted, convert, f))?;
    }
    Ok(config)
}

/// The `wanted` tensors of the file `path` (read as `st`) to `f`, checked and converted.
fn visit_wanted<E: From<WeightsError>>(
    path: &Path,
    st: &SafeTensors<'_>,
    wanted: Vec<(String, Vec<usize>)>,
    convert: bool,
    f: &mut dyn FnMut(String, HostTensor) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    for (name, shape) in wanted {
        let view = st.tensor(&name).map_err(|_| WeightsError::MissingTensor {
            origin: path.display().to_string(),
            tensor: name.clone(),
        })?;
        if view.shape() != shape.as_slice() {
            return Err(WeightsError::Shape {
                origin: path.display().to_string(),
                tensor: name,
                expected: shape,
                got: view.shape().to_vec(),
            }
            .into());
        }
        let dtype_error = || WeightsError::DType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            dtype: format!("{:?}", view.dtype()),
        };
        if !convert {
            to_f32(view.dtype(), &[]).ok_or_else(dtype_error)?;
            continue;
        }
        let data = to_f32(view.dtype(), view.data()).ok_or_else(dtype_error)?;
        f(name, HostTensor { shape, data })?;
    }
    Ok(())
}

/// The config of the model folder `dir`, and which file holds each tensor of its specs.
#[allow(clippy::type_complexity)]
fn model_dir_files(
    dir: &Path,
) -> Result<(ModelConfig, BTreeMap<PathBuf, Vec<(String, Vec<usize>)>>)> {
    let config = ModelConfig::from_hf_file(dir.join("config.json"))?;
    let specs = tensor_specs(&config);
    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    let mut by_file: BTreeMap<PathBuf, Vec<(String, Vec<usize>)>> = BTreeMap::new();
    if single.is_file() {
        by_file.insert(single, specs);
    } else if index.is_file() {
        let map = read_index(&index)?;
        for (name, shape) in specs {
            let file = map.get(&name).ok_or_else(|| WeightsError::MissingTensor {
                origin: index.display().to_string(),
                tensor: name.clone(),
            })?;
            by_file
                .entry(dir.join(file))
                .or_default()
                .push((name, shape));
        }
    } else {
        return Err(WeightsError::NoWeights {
            dir: dir.to_path_buf(),
        });
    }
    Ok((config, by_file))
}

/// The `weight_map` of a shard index: tensor name → shard file name.
fn read_index(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).map_err(io_err(path))?;
    let bad = |msg: String| WeightsError::BadIndex {
        path: path.to_path_buf(),
        msg,
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("missing object `weight_map`".into()))?;
    map.iter()
        .map(|(name, file)| {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[`{name}`] is not a file name")))?;
            // Shards must sit beside the index.
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(bad(format!(
                    "weight_map[`{name}`] = `{file}` leaves the folder"
                )));
            }
            Ok((name.clone(), file.to_string()))
        })
        .collect()
}

/// Little-endian `bytes` of `dtype` as f32, or `None` for an unsupported dtype.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let convert = |width: usize, f: fn(&[u8]) -> f32| -> Vec<f32> {
        let n = bytes.len() / width;
        if n >= PARALLEL_ELEMENTS {
            bytes.par_chunks_exact(width).map(f).collect()
        } else {
            bytes.chunks_exact(width).map(f).collect()
        }
    };
    // Chunks are read byte-wise: tensors inside a safetensors file need not be aligned.
    Some(match dtype {
        Dtype::F32 => convert(4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::BF16 => convert(2, |b| {
            half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
        }),
        Dtype::F16 => convert(2, |b| {
            half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
        }),
        _ => return None,
    })
}

/// Borrowed views of `tensors`.
fn views(tensors: &BTreeMap<String, HostTensor>) -> BTreeMap<String, TensorView<'_>> {
    tensors
        .iter()
        .map(|(name, tensor)| (name.clone(), tensor.view()))
        .collect()
}

/// A tensor viewed as safetensors data of one dtype, encoded when written so that at most
/// one tensor's bytes exist at a time.
struct Encoded<'a> {
    tensor: TensorView<'a>,
    dtype: SaveDType,
}

impl View for Encoded<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        self.tensor.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let values = self.tensor.data;
        let bytes: Vec<u8> = match self.dtype {
            SaveDType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            SaveDType::BF16 if values.len() >= PARALLEL_ELEMENTS => values
                .par_iter()
                .flat_map_iter(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            SaveDType::BF16 => values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        std::borrow::Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.data.len() * self.dtype.width()
    }
}

/// Writes `config.json` and `model.safetensors` (or shards of at most 4 GiB with an
/// index, as transformers does) into `dir`, creating it. See [`save_model_dir_sharded`].
pub fn save_model_dir(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    weights: &BTreeMap<String, HostTensor>,
    dtype: SaveDType,
) -> Result<()> {
    save_model_dir_sharded(dir, config, weights, dtype, DEFAULT_MAX_SHARD_BYTES)
}

/// Like [`save_model_dir`] with an explicit shard size. Only the tensors of
/// [`tensor_specs`] are written, in canonical order (a tied model gets no
/// `lm_head.weight`); each file is written under a temporary name and renamed, and
/// `config.json` is written last, so a reader never sees a half-written model. A
/// leftover single file or index of the other layout is removed.
pub fn save_model_dir_sharded(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    weights: &BTreeMap<String, HostTensor>,
    dtype: SaveDType,
    max_shard_bytes: usize,
) -> Result<()> {
    save_model_dir_views(dir, config, &views(weights), dtype, max_shard_bytes)
}

/// [`save_model_dir_sharded`] of borrowed tensors: nothing is copied but one tensor's
/// encoded bytes at a time.
pub fn save_model_dir_views(
    dir: impl AsRef<Path>,
    config: &ModelConfig,
    weights: &BTreeMap<String, TensorView<'_>>,
    dtype: SaveDType,
    max_shard_bytes: usize,
) -> Result<()> {
    let dir = dir.as_ref();
    check_views(config, weights)?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;

    // Greedy shards in canonical order; a tensor larger than the limit gets its own.
    let specs = tensor_specs(config);
    let width = dtype.width();
    let mut shards: Vec<Vec<&str>> = vec![Vec::new()];
    let mut shard_bytes = 0usize;
    let mut total_bytes = 0usize;
    for (name, shape) in &specs {
        let bytes = shape.iter().product::<usize>() * width;
        if shard_bytes + bytes > max_shard_bytes && shard_bytes > 0 {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        shards.last_mut().expect("non-empty").push(name);
        shard_bytes += bytes;
        total_bytes += bytes;
    }

    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let write = |path: &Path, names: &[&str]| -> Result<()> {
        let views = names.iter().map(|&name| {
            (
                name.to_string(),
                Encoded {
                    tensor: weights[name],
                    dtype,
                },
            )
        });
        // serialize_to_file writes a sibling temporary file and renames it.
        safetensors::tensor::serialize_to_file(views, Some(metadata.clone()), path).map_err(|e| {
            WeightsError::Safetensors {
                path: path.to_path_buf(),
                msg: e.to_string(),
            }
        })
    };

    let single = dir.join(SINGLE_FILE);
    let index = dir.join(INDEX_FILE);
    if shards.len() == 1 {
        write(&single, &shards[0])?;
        remove_if_present(&index)?;
    } else {
        let n = shards.len();
        let mut weight_map = serde_json::Map::new();
        for (i, names) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            write(&dir.join(&file), names)?;
            for &name in names {
                weight_map.insert(name.to_string(), file.clone().into());
            }
        }
        let index_json = serde_json::json!({
            "metadata": { "total_size": total_bytes },
            "weight_map": weight_map,
        });
        write_atomically(&index, &pretty(&index_json))?;
        remove_if_present(&single)?;
    }
    write_atomically(
        &dir.join("config.json"),
        &pretty(&config.to_hf_json(dtype.torch_name())),
    )
}

fn pretty(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).expect("JSON values always serialize") + "\n"
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
    }
}

/// Writes `text` to `path` through a temporary sibling and a rename.
pub(crate) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Writes named f32 tensors (any names and shapes, e.g. optimizer moments) to one
/// safetensors file, through a temporary sibling and a rename.
pub fn save_tensors(path: impl AsRef<Path>, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    save_tensor_views(path, &views(tensors))
}

/// [`save_tensors`] of borrowed tensors.
pub fn save_tensor_views(
    path: impl AsRef<Path>,
    tensors: &BTreeMap<String, TensorView<'_>>,
) -> Result<()> {
    let path = path.as_ref();
    for (name, tensor) in tensors {
        if tensor.data.len() != tensor.shape.iter().product::<usize>() {
            return Err(WeightsError::Shape {
                origin: path.display().to_string(),
                tensor: name.clone(),
                expected: vec![tensor.data.len()],
                got: tensor.shape.to_vec(),
            });
        }
    }
    let views = tensors.iter().map(|(name, tensor)| {
        (
            name.clone(),
            Encoded {
                tensor: *tensor,
                dtype: SaveDType::F32,
            },
        )
    });
    safetensors::tensor::serialize_to_file(views, None, path).map_err(|e| {
        WeightsError::Safetensors {
            path: path.to_path_buf(),
            msg: e.to_string(),
        }
    })
}

/// Reads every tensor of a safetensors file as f32 (F32, BF16 or F16 storage), by name.
/// The file is mapped, not read, so only the f32 values take memory (an 8B model's AdamW
/// moments are a 56 GB file).
pub fn load_tensors(path: impl AsRef<Path>) -> Result<BTreeMap<String, HostTensor>> {
    let mut tensors = BTreeMap::new();
    visit_tensors(path, &mut |name, tensor| -> Result<()> {
        tensors.insert(name, tensor);
        Ok(())
    })?;
    Ok(tensors)
}

/// The shape of every tensor of the safetensors file at `path`, from its header alone.
pub fn tensor_shapes(path: impl AsRef<Path>) -> Result<BTreeMap<String, Vec<usize>>> {
    with_safetensors(path.as_ref(), |st| {
        Ok(st
            .tensors()
            .into_iter()
            .map(|(name, view)| (name, view.shape().to_vec()))
            .collect())
    })
}

/// `read` of the safetensors file at `path`, mapped read-only for the call.
fn with_safetensors<T, E: From<WeightsError>>(
    path: &Path,
    read: impl FnOnce(&SafeTensors<'_>) -> std::result::Result<T, E>,
) -> std::result::Result<T, E> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    // SAFETY: the map is read-only and lives only while `read` runs; a concurrent
    // writer would at worst corrupt values, which the shape and header checks of
    // safetensors bound.
    let bytes = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err(path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| WeightsError::Safetensors {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    read(&st)
}

/// [`load_tensors`] one tensor at a time (the caller holds at most one in host memory).
pub fn visit_tensors<E: From<WeightsError>>(
    path: impl AsRef<Path>,
    f: &mut dyn FnMut(String, HostTensor) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let path = path.as_ref();
    with_safetensors(path, |st| {
        for (name, view) in st.tensors() {
            let data = to_f32(view.dtype(), view.data()).ok_or_else(|| WeightsError::DType {
                path: path.to_path_buf(),
                tensor: name.clone(),
                dtype: format!("{:?}", view.dtype()),
            })?;
            let shape = view.shape().to_vec();
            f(name, HostTensor { shape, data })?;
        }
        Ok(())
    })
}
