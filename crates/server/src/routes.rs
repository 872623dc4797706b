//! The `/api/v1` routes: thin handlers that check a request, turn it into an engine job
//! (a future) or answer from the tables at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use floe_engine::policy::OptimParams;
use floe_engine::{saved_weights_source, AdapterSource, AnyLocalEngine, ModelSource};
use floe_engine::{Engine, Loss, Weights};
use floe_engine::{Generation, SampleRequest, SamplingParams};
use floe_model::lora::LoraConfig;
use floe_rl::tinker::{tinker_loss, TinkerInputs, TinkerLoss, TinkerLossConfig, LOSS_SUM_METRIC};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::api;
use crate::catalog::LoadedBase;
use crate::convert::{self, TinkerDatum};
use crate::error::ApiError;
use crate::futures::{parse_request_id, request_id_string, CancelTicket, Outcome, Poll};
use crate::proto;
use crate::rest;
use crate::sample_batch::{SampleFailure, SampleJob, SampleSink};
use crate::state::{
    checkpoint_lora, random_id, AppState, CheckpointMeta, ModelFacts, SamplingSession, Session,
    TinkerPath, TrainingModel, WeightsKind,
};
use crate::worker::{EngineBuilder, Job, Worker};

/// Shared handler state.
pub type AppRef = Arc<AppState>;
/// A body that may have failed to arrive (too large, cut off).
pub type Body = Result<Bytes, BytesRejection>;

/// Parses a JSON body; a malformed one is a 400 naming the route and the problem.
pub(crate) fn json_body<T: DeserializeOwned>(route: &str, body: Body) -> Result<T, ApiError> {
    let body =
        body.map_err(|e| ApiError::new(e.status(), format!("{route}: {}", e.body_text())))?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("{route}: invalid JSON body: {e}")))
}

/// The answer of a submit route.
fn future_response(id: u64, extra: Value) -> Json<Value> {
    let mut body = json!({ "request_id": request_id_string(id) });
    if let (Value::Object(body), Value::Object(extra)) = (&mut body, extra) {
        body.extend(extra);
    }
    Json(body)
}

/// `POST /client/config`: plain API keys, defaults for everything else.
pub async fn client_config() -> Json<Value> {
    Json(json!({ "pjwt_auth_enabled": false, "credential_default_source": "api_key" }))
}

/// `POST /client/dynamic_config`.
pub async fn dynamic_config() -> Json<Value> {
    Json(json!({
        "refresh_interval_sec": 300,
        "sample_cancel_enabled": false,
        "sample_cancel_max_batch_size": 0,
    }))
}

/// `GET /healthz`.
pub async fn healthz() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// `POST /telemetry`: accepted and dropped.
pub async fn telemetry() -> Json<Value> {
    Json(json!({ "status": "accepted" }))
}

/// `GET /get_server_capabilities`.
pub async fn capabilities(State(app): State<AppRef>) -> Json<Value> {
    let models: Vec<Value> = app
        .config
        .catalog
        .iter()
        .map(|(name, _)| json!({ "model_name": name, "trainable": true, "sampleable": true }))
        .collect();
    Json(json!({ "supported_models": models }))
}

/// `POST /create_session`.
pub async fn create_session(
    State(app): State<AppRef>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let request: api::CreateSession = json_body("create_session", body)?;
    let id = random_id("sess");
    tracing::info!(session = %id, tags = ?request.tags, metadata = ?request.user_metadata, "session created");
    app.registry().sessions.insert(
        id.clone(),
        Session {
            last_heartbeat: Instant::now(),
        },
    );
    Ok(Json(json!({ "type": "create_session", "session_id": id })))
}

/// `POST /session_heartbeat`: 410 for a session this server does not hold.
pub async fn session_heartbeat(
    State(app): State<AppRef>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let request: api::SessionHeartbeat = json_body("session_heartbeat", body)?;
    match app.registry().sessions.get_mut(&request.session_id) {
        Some(session) => session.last_heartbeat = Instant::now(),
        None => {
            return Err(ApiError::new(
                StatusCode::GONE,
                format!(
                    "session {:?} is not held by this server",
                    request.session_id
                ),
            ))
        }
    }
    Ok(Json(json!({ "type": "session_heartbeat" })))
}

/// `POST /sessions/{id}/finish`: drops the session with its models and samplers (each
/// engine thread ends once its queued requests are done).
pub async fn finish_session(
    State(app): State<AppRef>,
    UrlPath(session_id): UrlPath<String>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let reason: Value = json_body("finish", body)?;
    if !remove_session(&app, &session_id, "the session finished") {
        return Err(ApiError::not_found(format!(
            "unknown session_id {session_id:?}"
        )));
    }
    tracing::info!(session = %session_id, reason = %reason, "session finished");
    Ok(Json(json!({ "status": "finished" })))
}

/// Drops session `id` with its models and samplers, failing requests its models held
/// for `seq_id`s that never came; false when the session is not held.
fn remove_session(app: &AppState, id: &str, why: &str) -> bool {
    let mut registry = app.registry();
    if registry.sessions.remove(id).is_none() {
        return false;
    }
    let reason = format!("{why} before this request's turn came");
    registry.models.retain(|_, model| {
        let keep = model.session_id != id;
        if !keep {
            model.fail_held(&app.futures, &reason);
        }
        keep
    });
    registry.samplers.retain(|_, s| s.session_id != id);
    true
}

/// Drops every session whose last heartbeat is older than `max_idle` (a crashed client
/// stops sending them), freeing its engines; returns the dropped ids.
pub fn expire_sessions(app: &AppState, max_idle: Duration) -> Vec<String> {
    let now = Instant::now();
    let idle: Vec<String> = app
        .registry()
        .sessions
        .iter()
        .filter(|(_, session)| now.duration_since(session.last_heartbeat) > max_idle)
        .map(|(id, _)| id.clone())
        .collect();
    for id in &idle {
        let why = format!("the session expired (no heartbeat for {max_idle:?})");
        if remove_session(app, id, &why) {
            tracing::info!(session = %id, "{why}");
        }
    }
    idle
}

/// Loads a base model's shape and tokenizer; the engine builds on its own thread.
pub(crate) fn load_base(app: &AppState, name: &str) -> Result<LoadedBase, ApiError> {
    let weights = app
        .config
        .catalog
        .get(name)
        .map_err(ApiError::bad_request)?;
    weights.load().map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("base model {name:?}: {e}"),
        )
    })
}

pub(crate) fn facts(base: &LoadedBase) -> ModelFacts {
    ModelFacts {
        vocab_size: base.config.vocab_size,
        max_context: base.config.max_position_embeddings,
        eos_token_ids: match &base.tokenizer {
            Some(tokenizer) if !tokenizer.eos_token_ids.is_empty() => {
                tokenizer.eos_token_ids.clone()
            }
            _ => base.config.eos_token_ids.clone(),
        },
        has_tokenizer: base.tokenizer.is_some(),
        arch: base.config.architecture.model_type().to_string(),
    }
}

/// Spawns an engine thread for `source`, optionally loading a saved state after it.
pub(crate) fn spawn_engine(
    app: &AppState,
    name: String,
    base: LoadedBase,
    state_dir: Option<std::path::PathBuf>,
    ready: Option<(u64, Outcome)>,
) -> Result<Arc<Worker>, ApiError> {
    let options = app.config.engine.clone();
    let LoadedBase {
        source, tokenizer, ..
    } = base;
    let build: EngineBuilder = Box::new(move || {
        let mut engine = crate::worker::open_engine(source, tokenizer, options)?;
        if let Some(dir) = state_dir {
            engine.load_state(&dir).map_err(|e| e.to_string())?;
        }
        Ok(engine)
    });
    Worker::spawn(name, build, ready, &app.worker_context())
        .map(Arc::new)
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("engine thread: {e}"),
            )
        })
}

/// Registers training model `{session}:train:{seq}` on a new engine and returns the
/// future of its creation; a re-sent create answers the first one's future.
#[allow(clippy::too_many_arguments)]
fn create_training_model(
    app: &AppState,
    session_id: &str,
    model_seq_id: u64,
    base_model: &str,
    lora: Option<LoraConfig>,
    base: LoadedBase,
    state_dir: Option<std::path::PathBuf>,
    ready: impl FnOnce(&str) -> Value,
) -> Result<(u64, String), ApiError> {
    app.check_session(session_id)?;
    let model_id = format!("{session_id}:train:{model_seq_id}");
    if let Some(model) = app.registry().models.get(&model_id) {
        return Ok((model.created, model_id));
    }
    let facts = facts(&base);
    let created = app.futures.issue();
    let worker = spawn_engine(
        app,
        format!("engine {model_id}"),
        base,
        state_dir,
        Some((created, Outcome::Json(ready(&model_id)))),
    )?;
    let model = TrainingModel::new(
        model_id.clone(),
        session_id.to_string(),
        base_model.to_string(),
        lora,
        facts,
        created,
        worker,
    );
    app.registry()
        .models
        .insert(model_id.clone(), Arc::new(model));
    Ok((created, model_id))
}

/// `POST /create_model` (future ⇒ `{model_id}`). With `lora_config` the model trains
/// adapters on a frozen base; without it, every weight.
pub async fn create_model(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::CreateModel = json_body("create_model", body)?;
    let mut base = load_base(&app, &request.base_model)?;
    let lora = request
        .lora_config
        .as_ref()
        .map(convert::lora_config)
        .transpose()
        .map_err(ApiError::bad_request)?;
    if let Some(lora) = &lora {
        let shared = app.shared_base(&request.base_model, base.source);
        base.source = ModelSource::Lora {
            base: Box::new(shared),
            adapters: AdapterSource::Fresh(lora.clone()),
        };
    }
    tracing::info!(metadata = ?request.user_metadata, base = %request.base_model, "create_model");
    let (id, model_id) = create_training_model(
        &app,
        &request.session_id,
        request.model_seq_id,
        &request.base_model,
        lora,
        base,
        None,
        |model_id| json!({ "model_id": model_id, "type": "create_model" }),
    )?;
    rest::record_run(&app, &model_id, request.user_metadata.as_ref())?;
    Ok(future_response(id, json!({ "model_id": model_id })))
}

/// `POST /get_info`.
pub async fn get_info(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::ModelRequest = json_body("get_info", body)?;
    let model = app.model(&request.model_id)?;
    Ok(Json(json!({
        "type": "get_info",
        "model_id": model.id,
        "model_data": {
            "arch": model.facts.arch,
            "model_name": model.base_model,
            "tokenizer_id": model.base_model,
        },
        "model_name": model.base_model,
        "is_lora": model.lora.is_some(),
        "lora_rank": model.lora.as_ref().map(|l| l.rank),
        "max_context_length": model.facts.max_context,
    })))
}

/// `POST /forward_backward` (protobuf, optionally zstd; `forward_only` for `forward`).
pub async fn forward_backward(
    State(app): State<AppRef>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let body = body
        .map_err(|e| ApiError::new(e.status(), format!("forward_backward: {}", e.body_text())))?;
    let bytes = match headers.get(header::CONTENT_ENCODING).map(|v| v.to_str()) {
        None => body.to_vec(),
        Some(Ok("zstd")) => decompress(&body, app.config.max_body_bytes)?,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                "forward_backward: Content-Encoding {other:?} is not supported; send zstd or none"
            ),
            ))
        }
    };
    let request: proto::ForwardBackwardRequest =
        prost::Message::decode(&bytes[..]).map_err(|e| {
            ApiError::bad_request(format!("forward_backward: invalid protobuf body: {e}"))
        })?;
    let model = app.model(&request.model_id)?;
    let job = or_failed(fwdbwd_request_job(&request, &model.facts));
    let id = app.submit_ordered(&model, i64::from(request.seq_id), job)?;
    Ok(future_response(id, json!({ "model_id": model.id })))
}

/// The job of a decoded `forward_backward` request, or why it is invalid.
fn fwdbwd_request_job(
    request: &proto::ForwardBackwardRequest,
    facts: &ModelFacts,
) -> Result<Job, ApiError> {
    let datums = convert::decode_datums(&request.data, facts.vocab_size)
        .map_err(|e| ApiError::bad_request(format!("forward_backward: {e}")))?;
    // stable_reinforce's server side is proprietary; its documented local stand-in is
    // importance_sampling over the same inputs.
    let loss_fn = match request.loss_fn.as_str() {
        "stable_reinforce" => "importance_sampling",
        other => other,
    };
    let loss: TinkerLoss = loss_fn
        .parse()
        .map_err(|e| ApiError::bad_request(format!("forward_backward: {e}")))?;
    let config = loss_config(request)?;
    Ok(fwdbwd_job(datums, loss, config, !request.forward_only))
}

/// A request that names its model and `seq_id` but is otherwise invalid still takes its
/// turn: its future fails (`category: user`), so the model's later requests are not held
/// behind a gap in the `seq_id`s forever.
fn or_failed(job: Result<Job, ApiError>) -> Job {
    match job {
        Ok(job) => job,
        Err(error) => Box::new(move |_| Outcome::user_error(error.detail)),
    }
}

fn decompress(body: &[u8], limit: usize) -> Result<Vec<u8>, ApiError> {
    use std::io::Read;
    let decoder = zstd::stream::Decoder::new(body)
        .map_err(|e| ApiError::bad_request(format!("forward_backward: invalid zstd body: {e}")))?;
    let mut out = Vec::new();
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ApiError::bad_request(format!("forward_backward: invalid zstd body: {e}")))?;
    if out.len() > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("forward_backward: the decompressed body exceeds {limit} bytes"),
        ));
    }
    Ok(out)
}

/// The numeric loss configuration; `loss_fn_config_v2` wins over `loss_fn_config`.
fn loss_config(request: &proto::ForwardBackwardRequest) -> Result<TinkerLossConfig, ApiError> {
    let mut map: BTreeMap<String, f64> = request.loss_fn_config.clone().into_iter().collect();
    for (key, value) in &request.loss_fn_config_v2 {
        match &value.value {
            Some(proto::loss_config_value::Value::Number(number)) => {
                map.insert(key.clone(), *number);
            }
            _ => {
                return Err(ApiError::bad_request(format!(
                    "forward_backward: loss_fn_config_v2[{key:?}] is not a number; only numeric settings are supported"
                )))
            }
        }
    }
    TinkerLossConfig::from_map(&map)
        .map_err(|e| ApiError::bad_request(format!("forward_backward: {e}")))
}

/// Scores the datums (per-token log-probs for the answer), then, unless `forward_only`,
/// runs forward and backward under the loss so gradients accumulate until `optim_step`.
fn fwdbwd_job(
    datums: Vec<TinkerDatum>,
    loss: TinkerLoss,
    config: TinkerLossConfig,
    backward: bool,
) -> Job {
    Box::new(move |engine| {
        let groups: Vec<_> = datums.iter().map(TinkerDatum::sequence_group).collect();
        let outputs = match engine.forward(&groups, Weights::Policy, 1.0) {
            Ok(outputs) => outputs,
            Err(e) => return Outcome::user_error(format!("forward: {e}")),
        };
        let total = if backward {
            let train: Vec<_> = datums.iter().map(TinkerDatum::train_group).collect();
            let loss = Loss::Tinker {
                loss,
                clip_low_threshold: config.clip_low_threshold,
                clip_high_threshold: config.clip_high_threshold,
                beta: config.beta,
            };
            match engine.forward_backward(&train, &loss, 1.0) {
                Ok(out) => out.loss,
                Err(e) => return Outcome::user_error(format!("forward_backward: {e}")),
            }
        } else {
            match forward_loss(&datums, &outputs, loss, &config) {
                Ok(total) => total,
                Err(e) => return Outcome::user_error(format!("forward: {e}")),
            }
        };
        let metrics = HashMap::from([(LOSS_SUM_METRIC.to_string(), total)]);
        Outcome::Proto(convert::forward_backward_output(&outputs, metrics))
    })
}

/// The loss of a `forward` from its scored log-probs (no gradients).
fn forward_loss(
    datums: &[TinkerDatum],
    outputs: &[Vec<floe_engine::TokenOutputs>],
    loss: TinkerLoss,
    config: &TinkerLossConfig,
) -> Result<f64, floe_rl::RlError> {
    let seq_lens: Vec<usize> = datums.iter().map(|d| d.targets.len()).collect();
    let logprobs: Vec<f64> = outputs
        .iter()
        .flat_map(|g| g.iter().flat_map(|r| r.logprobs.iter().copied()))
        .collect();
    let concat = |name: &str| -> Option<Vec<f64>> {
        datums
            .iter()
            .map(|d| d.inputs.get(name).cloned())
            .collect::<Option<Vec<_>>>()
            .map(|v| v.concat())
    };
    let (weights, sampling, advantages, mask) = (
        concat("weights"),
        concat("logprobs"),
        concat("advantages"),
        concat("sequence_ratio_mask"),
    );
    let out = tinker_loss(
        loss,
        config,
        &TinkerInputs {
            seq_lens: &seq_lens,
            logprobs: &logprobs,
            weights: weights.as_deref(),
            sampling_logprobs: sampling.as_deref(),
            advantages: advantages.as_deref(),
            sequence_ratio_mask: mask.as_deref(),
        },
    )?;
    Ok(out.loss)
}

/// `POST /optim_step` (future ⇒ `{metrics}`): decoupled AdamW with the request's
/// hyper-parameters over the gradients accumulated since the last step.
pub async fn optim_step(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::OptimStep = json_body("optim_step", body)?;
    let adam = request.adam_params.unwrap_or_default();
    let params = OptimParams {
        lr: adam.learning_rate as f32,
        beta1: adam.beta1 as f32,
        beta2: adam.beta2 as f32,
        eps: adam.eps as f32,
        weight_decay: adam.weight_decay as f32,
        max_grad_norm: adam.grad_clip_norm as f32,
    };
    let model = app.model(&request.model_id)?;
    if request.optimizer_params.is_some() {
        let error = "optim_step: only adam_params (AdamW) is supported; optimizer_params is not";
        let id = app.submit_ordered(
            &model,
            request.seq_id,
            or_failed(Err(ApiError::bad_request(error))),
        )?;
        return Ok(future_response(id, json!({ "model_id": model.id })));
    }
    let job: Job = Box::new(move |engine| match engine.optim_step(&params) {
        Ok(step) => Outcome::Json(json!({
            "type": "optim_step",
            "metrics": {
                "grad_norm:mean": step.grad_norm,
                "optim_step_skipped:sum": if step.skipped { 1.0 } else { 0.0 },
            },
        })),
        Err(e) => Outcome::server_error(format!("optim_step: {e}")),
    });
    let id = app.submit_ordered(&model, request.seq_id, job)?;
    Ok(future_response(id, json!({ "model_id": model.id })))
}

/// A job that saves the engine state into the folder of `path`.
fn save_job(
    app: &AppState,
    model: &TrainingModel,
    path: TinkerPath,
    overwrite: bool,
    kind: &'static str,
) -> Job {
    let dir = app.checkpoint_dir(&path);
    let meta = CheckpointMeta {
        base_model: model.base_model.clone(),
        model_id: model.id.clone(),
    };
    Box::new(move |engine| {
        if dir.exists() && !overwrite {
            return Outcome::user_error(format!(
                "{path} exists; save under another name or set overwrite"
            ));
        }
        let saved = std::fs::create_dir_all(&dir)
            .and_then(|()| CheckpointMeta::unmark(&dir))
            .map_err(|e| e.to_string())
            .and_then(|()| engine.save_state(&dir).map_err(|e| e.to_string()))
            .and_then(|()| meta.write(&dir).map_err(|e| e.to_string()));
        match saved {
            Ok(()) => Outcome::Json(json!({ "path": path.to_string(), "type": kind })),
            Err(e) => Outcome::server_error(format!("saving {path}: {e}")),
        }
    })
}

/// `POST /save_weights` (future ⇒ `{path}`): weights and optimizer state.
pub async fn save_weights(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::SaveWeights = json_body("save_weights", body)?;
    let model = app.model(&request.model_id)?;
    let job = request
        .path
        .as_deref()
        .ok_or_else(|| ApiError::bad_request("save_weights: path (the checkpoint name) is missing"))
        .and_then(|name| TinkerPath::new(&model.id, WeightsKind::Weights, name))
        .map(|path| save_job(&app, &model, path, request.overwrite, "save_weights"));
    let job = or_failed(job);
    let id = app.submit_ordered(&model, request.seq_id, job)?;
    Ok(future_response(id, json!({ "model_id": model.id })))
}

/// `POST /save_weights_for_sampler`. Named: saves under `sampler_weights/{name}`.
/// Unnamed (`sampling_session_seq_id`): opens sampling session
/// `{session}:sample:{n}` on the training model's own engine, which samples the live
/// weights (so it sees this and every earlier step, and later steps too).
pub async fn save_weights_for_sampler(
    State(app): State<AppRef>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let request: api::SaveWeights = json_body("save_weights_for_sampler", body)?;
    let model = app.model(&request.model_id)?;
    let job = match (&request.path, request.sampling_session_seq_id) {
        (Some(name), _) => or_failed(
            TinkerPath::new(&model.id, WeightsKind::SamplerWeights, name)
                .map(|path| save_job(&app, &model, path, true, "save_weights_for_sampler")),
        ),
        (None, Some(n)) => {
            let sampler_id = format!("{}:sample:{n}", model.session_id);
            let session = SamplingSession {
                id: sampler_id.clone(),
                session_id: model.session_id.clone(),
                base_model: model.base_model.clone(),
                model_path: None,
                facts: model.facts.clone(),
                worker: Arc::clone(&model.worker),
            };
            app.registry()
                .samplers
                .insert(sampler_id.clone(), Arc::new(session));
            Box::new(
                move |engine: &mut AnyLocalEngine| match engine.sync_sampler_weights() {
                    Ok(_) => Outcome::Json(json!({
                        "type": "save_weights_for_sampler",
                        "sampling_session_id": sampler_id,
                    })),
                    Err(e) => Outcome::server_error(format!("save_weights_for_sampler: {e}")),
                },
            ) as Job
        }
        (None, None) => or_failed(Err(ApiError::bad_request(
            "save_weights_for_sampler: give path (a name) or sampling_session_seq_id",
        ))),
    };
    let id = app.submit_ordered(&model, request.seq_id, job)?;
    Ok(future_response(id, json!({ "model_id": model.id })))
}

/// `POST /load_weights`: create-via-load (`session_id`, `model_seq_id`: a new model at
/// implicit seq 0) or the legacy form into an existing model (`model_id`, `seq_id`).
pub async fn load_weights(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::LoadWeights = json_body("load_weights", body)?;
    let path = TinkerPath::parse(&request.path)?;
    let dir = app.checkpoint_dir(&path);
    let meta = CheckpointMeta::read(&dir, &path)?;
    match (&request.session_id, request.model_seq_id, &request.model_id, request.seq_id) {
        (Some(session_id), Some(model_seq_id), _, _) => {
            let mut base = load_base(&app, &meta.base_model)?;
            let lora = checkpoint_lora(&dir)?;
            if lora.is_some() {
                base.source = app.shared_base(&meta.base_model, base.source);
            }
            // Without the optimizer the engine starts from the saved weights (or
            // adapters) with fresh AdamW moments; with it the whole saved state is restored.
            let state_dir = if request.optimizer {
                Some(dir)
            } else {
                base.source = saved_weights_source(&dir, base.source);
                None
            };
            let path_text = path.to_string();
            let (id, model_id) = create_training_model(
                &app,
                session_id,
                model_seq_id,
                &meta.base_model,
                lora,
                base,
                state_dir,
                |model_id| json!({ "model_id": model_id, "path": path_text, "type": "load_weights" }),
            )?;
            rest::record_run(&app, &model_id, request.user_metadata.as_ref())?;
            Ok(future_response(id, json!({ "model_id": model_id })))
        }
        (_, _, Some(model_id), Some(seq_id)) => {
            let model = app.model(model_id)?;
            let job: Job = Box::new(move |engine| match engine.load_state(&dir) {
                Ok(()) => Outcome::Json(json!({ "path": path.to_string(), "type": "load_weights" })),
                Err(e) => Outcome::server_error(format!("load_weights {path}: {e}")),
            });
            let id = app.submit_ordered(&model, seq_id, job)?;
            Ok(future_response(id, json!({ "model_id": model.id })))
        }
        _ => Err(ApiError::bad_request(
            "load_weights: give session_id and model_seq_id (create from a checkpoint) or model_id and seq_id",
        )),
    }
}

/// `POST /create_sampling_session`: an engine of its own, loaded from saved weights
/// (`model_path`) or from a base model.
pub async fn create_sampling_session(
    State(app): State<AppRef>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let request: api::CreateSamplingSession = json_body("create_sampling_session", body)?;
    app.check_session(&request.session_id)?;
    let sampler_id = format!(
        "{}:sample:{}",
        request.session_id, request.sampling_session_seq_id
    );
    if app.registry().samplers.contains_key(&sampler_id) {
        return Ok(Json(
            json!({ "type": "create_sampling_session", "sampling_session_id": sampler_id }),
        ));
    }
    let (base_model, base) = match (&request.model_path, &request.base_model) {
        (Some(model_path), _) => {
            let path = TinkerPath::parse(model_path)?;
            let dir = app.checkpoint_dir(&path);
            let meta = CheckpointMeta::read(&dir, &path)?;
            let mut base = load_base(&app, &meta.base_model)?;
            if checkpoint_lora(&dir)?.is_some() {
                base.source = app.shared_base(&meta.base_model, base.source);
            }
            base.source = saved_weights_source(&dir, base.source);
            (meta.base_model, base)
        }
        (None, Some(base_model)) => (base_model.clone(), load_base(&app, base_model)?),
        (None, None) => {
            return Err(ApiError::bad_request(
                "create_sampling_session: give model_path or base_model",
            ))
        }
    };
    let facts = facts(&base);
    let worker = spawn_engine(&app, format!("engine {sampler_id}"), base, None, None)?;
    let session = SamplingSession {
        id: sampler_id.clone(),
        session_id: request.session_id.clone(),
        base_model,
        model_path: request.model_path.clone(),
        facts,
        worker,
    };
    app.registry()
        .samplers
        .insert(sampler_id.clone(), Arc::new(session));
    Ok(Json(
        json!({ "type": "create_sampling_session", "sampling_session_id": sampler_id }),
    ))
}

/// `GET /samplers/{id}`.
pub async fn get_sampler(
    State(app): State<AppRef>,
    UrlPath(sampler_id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let sampler = app
        .registry()
        .samplers
        .get(&sampler_id)
        .cloned()
        .ok_or_else(|| ApiError::not_found(format!("unknown sampler {sampler_id:?}")))?;
    let mut body = json!({ "sampler_id": sampler.id, "base_model": sampler.base_model });
    if let Some(path) = &sampler.model_path {
        body["model_path"] = json!(path);
    }
    Ok(Json(body))
}

/// Most alternatives `asample` returns per sampled token (`topk_sample_logprobs`), as
/// `/v1/chat/completions` caps `top_logprobs`.
const MAX_TOPK_SAMPLE_LOGPROBS: u64 = 20;

/// `POST /asample` (future ⇒ protobuf `SampleResponse`, plus `sample_sequence_ids`).
pub async fn asample(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::Sample = json_body("asample", body)?;
    let sampler_id = request.sampling_session_id.as_deref().ok_or_else(|| {
        ApiError::bad_request(
            "asample: sampling_session_id is missing (sampling base_model or model_path directly is not supported yet; create a sampling session)",
        )
    })?;
    if request.base_model.is_some() || request.model_path.is_some() {
        tracing::debug!("asample: base_model/model_path ignored in favour of the sampling session");
    }
    let sampler = app
        .registry()
        .samplers
        .get(sampler_id)
        .cloned()
        .ok_or_else(|| {
            ApiError::not_found(format!("unknown sampling_session_id {sampler_id:?}"))
        })?;
    let unsupported = [
        ("topk_prompt_logprobs", request.topk_prompt_logprobs),
        ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
    ];
    if let Some((name, _)) = unsupported.iter().find(|(_, k)| *k > 0) {
        return Err(ApiError::bad_request(format!(
            "asample: {name} is not supported yet"
        )));
    }
    let prompt = prompt_tokens(&request.prompt, sampler.facts.vocab_size)?;
    if request.num_samples == 0 {
        return Err(ApiError::bad_request(
            "asample: num_samples must be at least 1",
        ));
    }
    if request.topk_sample_logprobs > MAX_TOPK_SAMPLE_LOGPROBS {
        return Err(ApiError::bad_request(format!(
            "asample: topk_sample_logprobs {} is not in [0, {MAX_TOPK_SAMPLE_LOGPROBS}]",
            request.topk_sample_logprobs
        )));
    }
    let params = SamplingParams {
        top_logprobs: request.topk_sample_logprobs as usize,
        ..sampling_params(&request.sampling_params, &sampler.facts, prompt.len())?
    };
    let sample = SampleRequest {
        id: request.seq_id,
        prompt,
        n: request.num_samples,
        params,
    };
    let sink = TinkerSample {
        scored_prompt: request.prompt_logprobs.then(|| sample.prompt.clone()),
        prompt_logprobs: None,
        generations: Vec::new(),
    };
    let ticket = CancelTicket::default();
    let job = SampleJob {
        requests: vec![sample],
        cancel: Some(ticket.clone()),
        sink: Box::new(sink),
    };
    let id = app.submit_sample(&sampler.worker, job)?;
    app.futures.set_cancel_ticket(id, ticket);
    app.futures
        .track(id, rest::completion_log_key(sampler_id, request.seq_id));
    let ids: Vec<String> = (0..request.num_samples)
        .map(|i| format!("{sampler_id}:{}:{i}", request.seq_id))
        .collect();
    Ok(future_response(id, json!({ "sample_sequence_ids": ids })))
}

fn prompt_tokens(prompt: &api::ModelInput, vocab_size: usize) -> Result<Vec<u32>, ApiError> {
    let mut tokens = Vec::new();
    for chunk in &prompt.chunks {
        if chunk.kind != "encoded_text" {
            return Err(ApiError::bad_request(format!(
                "asample: prompt chunk type {:?} is not supported; only encoded_text",
                chunk.kind
            )));
        }
        for &t in &chunk.tokens {
            tokens.push(u32::try_from(t).map_err(|_| {
                ApiError::bad_request(format!("asample: prompt token {t} is not a token id"))
            })?);
        }
    }
    if tokens.is_empty() {
        return Err(ApiError::bad_request("asample: the prompt has no tokens"));
    }
    convert::check_tokens(&tokens, vocab_size, "prompt")
        .map_err(|e| ApiError::bad_request(format!("asample: {e}")))?;
    Ok(tokens)
}

/// The engine's sampling parameters. Absent `stop` stops on EOS; `[]` never stops.
fn sampling_params(
    params: &api::TinkerSamplingParams,
    facts: &ModelFacts,
    prompt_len: usize,
) -> Result<SamplingParams, ApiError> {
    let max_new_tokens = facts
        .new_token_budget(prompt_len, params.max_tokens, None)
        .map_err(|e| ApiError::bad_request(format!("asample: {e}")))?;
    let (stop_token_ids, stop_strings) = match &params.stop {
        None => (facts.eos_token_ids.clone(), Vec::new()),
        Some(api::Stop::Tokens(ids)) => (ids.clone(), Vec::new()),
        Some(api::Stop::Text(text)) => (facts.eos_token_ids.clone(), vec![text.clone()]),
        Some(api::Stop::Texts(texts)) => (facts.eos_token_ids.clone(), texts.clone()),
    };
    if !stop_strings.is_empty() && !facts.has_tokenizer {
        return Err(ApiError::bad_request(
            "asample: stop strings need a tokenizer and this model has none; send stop token ids",
        ));
    }
    Ok(SamplingParams {
        temperature: params.temperature,
        top_p: params.top_p,
        top_k: params.top_k.max(0),
        max_new_tokens,
        stop_token_ids,
        stop_strings,
        include_stop_str_in_output: true,
        seed: params.seed,
        logprobs: true,
        ..SamplingParams::default()
    })
}

/// One `asample`'s results: its prompt log-probs (when asked for), then its samples.
struct TinkerSample {
    /// The prompt, when its log-probs are asked for.
    scored_prompt: Option<Vec<u32>>,
    prompt_logprobs: Option<Vec<f64>>,
    generations: Vec<Generation>,
}

impl SampleSink for TinkerSample {
    /// Scores the prompt in a forward of its own, so its log-probs do not depend on the
    /// batch: NaN for the first token, then each token's log-prob given those before it.
    fn prepare(&mut self, engine: &mut AnyLocalEngine) -> Result<(), SampleFailure> {
        let Some(prompt) = &self.scored_prompt else {
            return Ok(());
        };
        let mut logprobs = vec![f64::NAN];
        if prompt.len() > 1 {
            let group = floe_engine::SequenceGroup {
                targets: None,
                prompt: vec![prompt[0]],
                responses: vec![prompt[1..].to_vec()],
            };
            let mut outputs = engine
                .forward(&[group], Weights::Policy, 1.0)
                .map_err(|e| SampleFailure {
                    message: format!("prompt_logprobs: {e}"),
                    by_request: true,
                })?;
            logprobs.extend(outputs.swap_remove(0).swap_remove(0).logprobs);
        }
        self.prompt_logprobs = Some(logprobs);
        Ok(())
    }

    /// Only for prompt log-probs: such a job starts a batch rather than joining one.
    fn needs_prepare(&self) -> bool {
        self.scored_prompt.is_some()
    }

    fn generation(&mut self, generation: Generation) {
        self.generations.push(generation);
    }

    fn finish(mut self: Box<Self>, result: Result<(), SampleFailure>) -> Outcome {
        match result {
            Ok(()) => {
                self.generations.sort_by_key(|g| g.sample_index);
                Outcome::Proto(convert::sample_response(
                    &self.generations,
                    self.prompt_logprobs.as_deref(),
                ))
            }
            Err(failure) if failure.by_request => {
                Outcome::user_error(format!("sample: {}", failure.message))
            }
            Err(failure) => Outcome::server_error(format!("sample: {}", failure.message)),
        }
    }
}

/// The `complete_metadata` answer of a finished future whose payload has `size` bytes.
fn metadata_only(size: usize) -> Response {
    Json(json!({ "status": "complete_metadata", "response_payload_size": size })).into_response()
}

/// `POST /retrieve_future`: the result once ready, held up to the long-poll time, then
/// `try_again`; 410 for a future that expired.
pub async fn retrieve_future(State(app): State<AppRef>, body: Body) -> Result<Response, ApiError> {
    let request: api::RetrieveFuture = json_body("retrieve_future", body)?;
    let id = parse_request_id(&request.request_id).ok_or_else(|| {
        ApiError::not_found(format!("unknown request_id {:?}", request.request_id))
    })?;
    Ok(match app.futures.poll(id, app.config.long_poll).await {
        Poll::Ready(outcome) => match &*outcome {
            // The SDK reserves memory for the payload, then polls again for it.
            Outcome::Json(value) if request.allow_metadata_only => {
                metadata_only(value.to_string().len())
            }
            Outcome::Proto(bytes) if request.allow_metadata_only => metadata_only(bytes.len()),
            Outcome::Json(value) => Json(value.clone()).into_response(),
            Outcome::Proto(bytes) => (
                [(header::CONTENT_TYPE, "application/x-protobuf")],
                bytes.clone(),
            )
                .into_response(),
            Outcome::Failed { error, category } => {
                Json(json!({ "error": error, "category": category })).into_response()
            }
        },
        Poll::Pending => Json(json!({
            "type": "try_again",
            "request_id": request.request_id,
            "queue_state": "active",
        }))
        .into_response(),
        Poll::Expired => {
            return Err(ApiError::new(
                StatusCode::GONE,
                format!(
                    "request {} finished more than {} s ago and its result expired",
                    request.request_id,
                    app.futures.expiry().as_secs()
                ),
            ))
        }
        Poll::Unknown => {
            return Err(ApiError::not_found(format!(
                "unknown request_id {:?}",
                request.request_id
            )))
        }
    })
}
