//! What the server holds: sessions, training models (one engine thread each, requests
//! run strictly by `seq_id`), sampling sessions, the futures table, and the mapping of
//! `tinker://` paths to checkpoint folders.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use floe_engine::policy::{is_lora_state, ADAPTER_DIR};
use floe_engine::{LocalEngineOptions, ModelSource, SharedBase};
use floe_model::lora::{read_adapter_config, LoraConfig};
use serde::{Deserialize, Serialize};

use crate::catalog::Catalog;
use crate::error::ApiError;
use crate::futures::{Futures, Outcome};
use crate::sample_batch::{SampleBatchLimits, SampleJob, SampleStats};
use crate::worker::{Job, QueueError, Worker, WorkerContext};

/// How clients authenticate.
#[derive(Clone, Debug)]
pub enum Auth {
    /// `X-API-Key` must be one of these.
    Keys(std::sync::Arc<crate::keys::ApiKeys>),
    /// No key needed; only allowed on a loopback address.
    InsecureLoopback,
}

/// Everything a server is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Base models by the name clients send.
    pub catalog: Catalog,
    /// Where checkpoints are written (`checkpoints/{model_id}/{kind}/{name}`).
    pub data_dir: PathBuf,
    /// Client authentication.
    pub auth: Auth,
    /// Sizes of every engine the server builds.
    pub engine: LocalEngineOptions,
    /// How long `retrieve_future` holds a poll before answering `try_again`.
    pub long_poll: Duration,
    /// How long a finished future stays retrievable (then 410).
    pub future_expiry: Duration,
    /// How long a session lives without a heartbeat before it is dropped with its
    /// models and samplers.
    pub session_expiry: Duration,
    /// Largest request body, after decompression.
    pub max_body_bytes: usize,
    /// Most unfinished requests per engine before answering 429.
    pub max_queued_per_engine: usize,
    /// How large one engine's batch of concurrent sample requests may grow.
    pub sample_batch: SampleBatchLimits,
}

/// A client session.
pub struct Session {
    /// When the client last showed it was alive.
    pub last_heartbeat: Instant,
}

/// Requests of one training model, released to its engine strictly by `seq_id`.
#[derive(Default)]
pub struct SeqOrder {
    /// The next `seq_id` the engine runs.
    next: i64,
    /// Requests that arrived before their turn.
    held: BTreeMap<i64, (u64, Job)>,
    /// Future of every `seq_id` seen, so a re-sent request gets its original id.
    issued: HashMap<i64, u64>,
}

/// A model being trained.
pub struct TrainingModel {
    /// `{session_id}:train:{model_seq_id}`.
    pub id: String,
    /// The owning session.
    pub session_id: String,
    /// The base model name the client asked for.
    pub base_model: String,
    /// Its adapters' settings when it trains LoRA adapters on a frozen base; `None`
    /// for full-weight training.
    pub lora: Option<LoraConfig>,
    /// The model's facts.
    pub facts: ModelFacts,
    /// The future of its creation (answered again to a re-sent create).
    pub created: u64,
    /// Its engine.
    pub worker: Arc<Worker>,
    order: Mutex<SeqOrder>,
}

/// Facts about a loaded model that requests are checked against.
#[derive(Clone, Debug)]
pub struct ModelFacts {
    /// Rows of the vocabulary.
    pub vocab_size: usize,
    /// Longest sequence.
    pub max_context: usize,
    /// Token ids that end a sample by default.
    pub eos_token_ids: Vec<u32>,
    /// Whether stop strings can be matched (a tokenizer is loaded).
    pub has_tokenizer: bool,
    /// `qwen3`, `llama`, ...
    pub arch: String,
}

impl ModelFacts {
    /// The new-token budget of a sample of a `prompt_len`-token prompt: `asked`, else
    /// `default` (cut to the room the context leaves), else all that room; the error
    /// says why it does not fit.
    pub fn new_token_budget(
        &self,
        prompt_len: usize,
        asked: Option<usize>,
        default: Option<usize>,
    ) -> Result<usize, String> {
        let room = self.max_context.saturating_sub(prompt_len);
        let budget = asked.or(default.map(|d| d.min(room))).unwrap_or(room);
        if budget == 0 || budget > room {
            return Err(format!(
                "max_tokens {budget} does not fit: the prompt has {prompt_len} tokens and the model's context is {}",
                self.max_context
            ));
        }
        Ok(budget)
    }
}

/// Where a sampling session's samples come from.
pub struct SamplingSession {
    /// The session's id.
    pub id: String,
    /// The owning client session.
    pub session_id: String,
    /// The base model name.
    pub base_model: String,
    /// The saved sampler weights it samples, if any.
    pub model_path: Option<String>,
    /// The model's facts.
    pub facts: ModelFacts,
    /// The engine that samples (a training model's own, or one loaded for it).
    pub worker: Arc<Worker>,
}

/// Mutable tables of the server.
#[derive(Default)]
pub struct Registry {
    /// Sessions by id.
    pub sessions: HashMap<String, Session>,
    /// Training models by id.
    pub models: HashMap<String, Arc<TrainingModel>>,
    /// Sampling sessions by id.
    pub samplers: HashMap<String, Arc<SamplingSession>>,
}

/// Shared state of the handlers.
pub struct AppState {
    /// The start-up configuration.
    pub config: ServerConfig,
    /// Futures of every slow request.
    pub futures: Arc<Futures>,
    registry: Mutex<Registry>,
    /// The base weights LoRA models read, one copy per base model name.
    shared_bases: Mutex<HashMap<String, SharedBase>>,
    /// The sample batches of every engine.
    pub sample_stats: Arc<SampleStats>,
}

impl AppState {
    /// Fresh state.
    pub fn new(config: ServerConfig) -> Self {
        let futures = Arc::new(Futures::new(config.future_expiry));
        Self {
            config,
            futures,
            registry: Mutex::new(Registry::default()),
            shared_bases: Mutex::new(HashMap::new()),
            sample_stats: Arc::default(),
        }
    }

    /// What a new engine thread needs of the server.
    pub fn worker_context(&self) -> WorkerContext {
        WorkerContext {
            futures: Arc::clone(&self.futures),
            max_queued: self.config.max_queued_per_engine,
            batch_limits: self.config.sample_batch,
            sample_stats: Arc::clone(&self.sample_stats),
        }
    }

    /// The one in-memory copy of base model `name` that LoRA models share, loaded from
    /// `source` by the first engine that needs it; it stays resident while the server runs.
    pub fn shared_base(&self, name: &str, source: ModelSource) -> ModelSource {
        let mut bases = self.shared_bases.lock().unwrap_or_else(|e| e.into_inner());
        let shared = bases
            .entry(name.to_string())
            .or_insert_with(|| SharedBase::new(source));
        ModelSource::Shared(shared.clone())
    }

    /// The tables (a poisoned lock still holds consistent maps: no code panics mid-edit).
    pub fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The training model `id`.
    pub fn model(&self, id: &str) -> Result<Arc<TrainingModel>, ApiError> {
        self.registry()
            .models
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("unknown model_id {id:?}")))
    }

    /// Checks that session `id` exists.
    pub fn check_session(&self, id: &str) -> Result<(), ApiError> {
        if self.registry().sessions.contains_key(id) {
            Ok(())
        } else {
            Err(ApiError::not_found(format!(
                "unknown session_id {id:?}; call create_session first"
            )))
        }
    }

    /// Queues `job` as request `seq_id` of `model`; it runs after every lower `seq_id`.
    /// A `seq_id` seen before answers its original future.
    pub fn submit_ordered(
        &self,
        model: &TrainingModel,
        seq_id: i64,
        job: Job,
    ) -> Result<u64, ApiError> {
        let mut guard = model.order.lock().unwrap_or_else(|e| e.into_inner());
        let order = &mut *guard;
        if let Some(&id) = order.issued.get(&seq_id) {
            return Ok(id);
        }
        if seq_id < order.next {
            return Err(ApiError::bad_request(format!(
                "seq_id {seq_id} of model {:?} is below {}, the next request it expects",
                model.id, order.next
            )));
        }
        if order.held.len() >= self.config.max_queued_per_engine {
            return Err(queue_error(QueueError::Full(
                self.config.max_queued_per_engine,
            )));
        }
        model.worker.has_room().map_err(queue_error)?;
        let id = self.futures.issue();
        order.issued.insert(seq_id, id);
        order.held.insert(seq_id, (id, job));
        while let Some((id, job)) = order.held.remove(&order.next) {
            order.next += 1;
            if model.worker.send(id, job).is_err() {
                self.futures.complete(
                    id,
                    Outcome::server_error(format!("the engine of model {:?} is gone", model.id)),
                );
            }
        }
        Ok(id)
    }

    /// Queues `job` on `worker` in arrival order (sampling has no `seq_id` order).
    pub fn submit_unordered(&self, worker: &Worker, job: Job) -> Result<u64, ApiError> {
        worker.has_room().map_err(queue_error)?;
        let id = self.futures.issue();
        if let Err(error) = worker.send(id, job) {
            self.futures
                .complete(id, Outcome::server_error("the engine is gone"));
            return Err(queue_error(error));
        }
        Ok(id)
    }

    /// Queues sample `job` on `worker` in arrival order; it joins the sample jobs queued
    /// beside it in one engine call.
    pub fn submit_sample(&self, worker: &Worker, job: SampleJob) -> Result<u64, ApiError> {
        worker.has_room().map_err(queue_error)?;
        let id = self.futures.issue();
        if let Err(error) = worker.send_sample(id, job) {
            self.futures
                .complete(id, Outcome::server_error("the engine is gone"));
            return Err(queue_error(error));
        }
        Ok(id)
    }

    /// The folder of a `tinker://` path.
    pub fn checkpoint_dir(&self, path: &TinkerPath) -> PathBuf {
        self.config
            .data_dir
            .join("checkpoints")
            .join(&path.model_id)
            .join(path.kind.dir_name())
            .join(&path.name)
    }
}

impl TrainingModel {
    /// Fails every request held for a missing earlier `seq_id` with `reason` (the model
    /// is being dropped, so they would never run).
    pub fn fail_held(&self, futures: &Futures, reason: &str) {
        let mut order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        for (_, (id, _)) in std::mem::take(&mut order.held) {
            futures.complete(id, Outcome::user_error(reason));
        }
    }

    /// A model whose request `0` (its creation, future `created`) is done.
    pub fn new(
        id: String,
        session_id: String,
        base_model: String,
        lora: Option<LoraConfig>,
        facts: ModelFacts,
        created: u64,
        worker: Arc<Worker>,
    ) -> Self {
        let order = SeqOrder {
            next: 1,
            held: BTreeMap::new(),
            issued: HashMap::from([(0, created)]),
        };
        Self {
            id,
            session_id,
            base_model,
            lora,
            facts,
            created,
            worker,
            order: Mutex::new(order),
        }
    }
}

fn queue_error(error: QueueError) -> ApiError {
    match error {
        QueueError::Full(limit) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the engine has {limit} unfinished requests; retry later"),
        ),
        QueueError::Gone => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine is gone (its model failed to load)",
        ),
    }
}

/// A fresh random id with a prefix (`sess-…`).
pub fn random_id(prefix: &str) -> String {
    format!(
        "{prefix}-{:016x}",
        RandomState::new().hash_one(Instant::now())
    )
}

/// The kinds of saved weights a `tinker://` path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightsKind {
    /// `weights`: full training state (weights and optimizer).
    Weights,
    /// `sampler_weights`: weights to sample from.
    SamplerWeights,
}

impl WeightsKind {
    /// The path segment and folder name of this kind.
    pub fn dir_name(self) -> &'static str {
        match self {
            WeightsKind::Weights => "weights",
            WeightsKind::SamplerWeights => "sampler_weights",
        }
    }
}

/// `tinker://{model_id}/{weights|sampler_weights}/{name}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TinkerPath {
    /// The training model that saved it.
    pub model_id: String,
    /// Which kind.
    pub kind: WeightsKind,
    /// The checkpoint name.
    pub name: String,
}

impl TinkerPath {
    /// A path for `model_id`'s checkpoint `name`, checking `name` is one folder name.
    pub fn new(model_id: &str, kind: WeightsKind, name: &str) -> Result<Self, ApiError> {
        check_segment("checkpoint name", name)?;
        check_segment("model_id", model_id)?;
        Ok(Self {
            model_id: model_id.to_string(),
            kind,
            name: name.to_string(),
        })
    }

    /// Parses a `tinker://` path.
    pub fn parse(text: &str) -> Result<Self, ApiError> {
        let bad = |why: &str| {
            ApiError::bad_request(format!(
                "path {text:?} {why}; expected tinker://{{model_id}}/{{weights|sampler_weights}}/{{name}}"
            ))
        };
        let rest = text
            .strip_prefix("tinker://")
            .ok_or_else(|| bad("is not a tinker:// path"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [model_id, kind, name] = parts[..] else {
            return Err(bad("does not have three segments"));
        };
        let kind = match kind {
            "weights" => WeightsKind::Weights,
            "sampler_weights" => WeightsKind::SamplerWeights,
            _ => return Err(bad("names no weights kind this server saves")),
        };
        Self::new(model_id, kind, name)
    }
}

impl std::fmt::Display for TinkerPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tinker://{}/{}/{}",
            self.model_id,
            self.kind.dir_name(),
            self.name
        )
    }
}

fn check_segment(what: &str, segment: &str) -> Result<(), ApiError> {
    let bad = segment.is_empty()
        || segment == "."
        || segment == ".."
        || segment.contains(['/', '\\', '\0']);
    if bad {
        return Err(ApiError::bad_request(format!(
            "{what} {segment:?} must be one non-empty folder name"
        )));
    }
    Ok(())
}

/// The adapters' settings of a saved LoRA state in `dir` (read from its PEFT
/// `adapter_config.json`), or `None` for a full-weight state.
pub fn checkpoint_lora(dir: &Path) -> Result<Option<LoraConfig>, ApiError> {
    if !is_lora_state(dir) {
        return Ok(None);
    }
    let adapters = dir.join(ADAPTER_DIR);
    let config = read_adapter_config(&adapters).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{}: {e}", adapters.display()),
        )
    })?;
    Ok(Some(config))
}

/// What a checkpoint folder records about itself, beside the engine's files.
#[derive(Debug, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The base model name it was trained from.
    pub base_model: String,
    /// The training model that saved it.
    pub model_id: String,
}

/// File of [`CheckpointMeta`] in a checkpoint folder: written last, so its presence marks
/// a complete save.
pub const META_FILE: &str = "floe-serve.json";

impl CheckpointMeta {
    /// Writes the record into `dir` (through a sibling and a rename: never half a file).
    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let partial = dir.join(format!("{META_FILE}.partial"));
        std::fs::write(&partial, text)?;
        std::fs::rename(partial, dir.join(META_FILE))
    }

    /// Marks `dir` as a save in progress before it is overwritten, so a save killed
    /// midway leaves a folder that reads as unfinished, never old and new files mixed
    /// under the old record.
    pub fn unmark(dir: &Path) -> std::io::Result<()> {
        match std::fs::remove_file(dir.join(META_FILE)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Reads the record of `dir`; a missing folder is a 404 naming `path`.
    pub fn read(dir: &Path, path: &TinkerPath) -> Result<Self, ApiError> {
        let text = std::fs::read(dir.join(META_FILE))
            .map_err(|_| ApiError::not_found(format!("no saved weights at {path}")))?;
        serde_json::from_slice(&text).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{}: {e}", dir.join(META_FILE).display()),
            )
        })
    }
}
