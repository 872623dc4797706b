//! floe's native JSON API under `/floe/v1`: one route per [`Engine`] verb, for
//! the remote engine (`floe_engine::remote`, `floe train engine.remote=...`) and the Python package in `python/`.
//! The wire types live in [`floe_engine::native_api`]; `docs/server.md` lists the routes.
//!
//! A client creates an engine (`POST /engines`, naming a base model or sending the
//! embedded model's tokenizer) and drives it through `/engines/{id}/{verb}`. Each engine is
//! a [`Worker`] thread like a Tinker training model's, so verbs run one at a time in
//! arrival order; a blocking client sees each answer before it sends the next verb.
//! `sample` streams newline-delimited [`SampleEvent`]s as samples finish, so the client
//! scores while the rest generate. Saved states and exports stay under the server's data
//! folder (`native/states/{id}`, `native/exports/{id}`) and are named by id.
//!
//! [`Engine`]: floe_engine::Engine

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::{Body as HttpBody, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use floe_engine::native_api::{
    CreateEngineRequest, CreateEngineResponse, EngineSettings, ExportResponse, ExportedFile,
    ForwardBackwardBody, ForwardBackwardResponse, ForwardBody, ForwardResponse, LoadStateBody,
    ModelSpec, OptimStepResponse, SampleBody, SampleEvent, SaveStateResponse, ServerInfo,
    SyncResponse,
};
use floe_engine::policy::OptimParams;
use floe_engine::Error as EngineError;
use floe_engine::{AnyLocalEngine, Generation, ModelSource};
use floe_engine::{Engine, EngineInfo};
use floe_model::embedded::embedded_model;
use floe_model::tokenizer::Tokenizer;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::catalog::{load_tokenizer, BaseWeights};
use crate::error::ApiError;
use crate::futures::{Outcome, Poll};
use crate::routes::{AppRef, Body};
use crate::sample_batch::{SampleFailure, SampleJob, SampleSink};
use crate::state::random_id;
use crate::worker::{EngineBuilder, Job, Worker};

/// Tokenizer files a client may send for the embedded model, and that the server sends
/// back for a base model.
const TOKENIZER_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// Largest vocabulary of a client-sent embedded tokenizer: the embedded model is tiny,
/// and its embedding grows with the vocabulary.
const MAX_EMBEDDED_VOCAB: usize = 1 << 17;

/// Folder of the server's data folder holding native engines' files.
const NATIVE_DIR: &str = "native";

/// State of the native routes.
struct Native {
    app: AppRef,
    engines: Mutex<HashMap<String, Arc<NativeEngine>>>,
}

/// An engine created through the native API.
struct NativeEngine {
    worker: Arc<Worker>,
}

type NativeRef = Arc<Native>;

/// The native routes over the server's state; the caller nests them under
/// [`floe_engine::native_api::NATIVE_PREFIX`] behind the API-key check.
pub fn router<S: Clone + Send + Sync + 'static>(app: AppRef) -> Router<S> {
    let native = Arc::new(Native {
        app,
        engines: Mutex::new(HashMap::new()),
    });
    Router::new()
        .route("/info", get(info))
        .route("/stats", get(stats))
        .route("/engines", post(create_engine))
        .route("/engines/{engine_id}", axum::routing::delete(delete_engine))
        .route("/engines/{engine_id}/sample", post(sample))
        .route("/engines/{engine_id}/forward", post(forward))
        .route(
            "/engines/{engine_id}/forward_backward",
            post(forward_backward),
        )
        .route("/engines/{engine_id}/optim_step", post(optim_step))
        .route(
            "/engines/{engine_id}/sync_sampler_weights",
            post(sync_sampler_weights),
        )
        .route(
            "/engines/{engine_id}/freeze_reference",
            post(freeze_reference),
        )
        .route(
            "/engines/{engine_id}/reset_optimizer",
            post(reset_optimizer),
        )
        .route("/engines/{engine_id}/save_state", post(save_state))
        .route("/engines/{engine_id}/load_state", post(load_state))
        .route("/engines/{engine_id}/export_hf", post(export_hf))
        .route("/exports/{export_id}/{file}", get(export_file))
        .with_state(native)
}

impl Native {
    fn engine(&self, id: &str) -> Result<Arc<NativeEngine>, ApiError> {
        self.engines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "unknown engine_id {id:?}; create one with POST /floe/v1/engines"
                ))
            })
    }

    fn dir(&self, kind: &str) -> PathBuf {
        self.app.config.data_dir.join(NATIVE_DIR).join(kind)
    }

    /// Runs `verb` on `worker`'s engine after the jobs queued before it; its answer comes
    /// straight back (the futures table only records that it finished).
    async fn run<T: Send + 'static>(
        &self,
        worker: &Worker,
        verb: impl FnOnce(&mut AnyLocalEngine) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |engine| {
            let result = verb(engine);
            let outcome = match &result {
                Ok(_) => Outcome::Json(Value::Null),
                Err(error) => Outcome::user_error(error.detail.clone()),
            };
            let _ = answer.send(result);
            outcome
        });
        let id = self.app.submit_unordered(worker, job)?;
        match answered.await {
            Ok(result) => result,
            // The job was dropped unrun (the engine failed to load) or panicked; its
            // future holds why.
            Err(_) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                self.failure(id).await,
            )),
        }
    }

    /// Why future `id` failed, once it finished.
    async fn failure(&self, id: u64) -> String {
        match self.outcome(id).await {
            Some(outcome) => match &*outcome {
                Outcome::Failed { error, .. } => error.clone(),
                _ => "the engine stopped".to_string(),
            },
            None => "the engine stopped".to_string(),
        }
    }

    /// The outcome of future `id`, however long it takes; `None` when it is gone.
    async fn outcome(&self, id: u64) -> Option<Arc<Outcome>> {
        loop {
            match self.app.futures.poll(id, self.app.config.long_poll).await {
                Poll::Ready(outcome) => return Some(outcome),
                Poll::Pending => continue,
                Poll::Expired | Poll::Unknown => return None,
            }
        }
    }
}

/// Parses a JSON body; a malformed one is a 400 naming the route and the problem.
fn parse<T: DeserializeOwned>(route: &str, body: Body) -> Result<T, ApiError> {
    let body =
        body.map_err(|e| ApiError::new(e.status(), format!("{route}: {}", e.body_text())))?;
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("{route}: invalid JSON body: {e}")))
}

/// A verb's error: 400 when the request was at fault, 500 when the engine was.
fn verb_failed(verb: &str, error: EngineError) -> ApiError {
    let status = if error.is_invalid_request() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    ApiError::new(status, format!("{verb}: {error}"))
}

fn internal(what: &str, error: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("{what}: {error}"),
    )
}

/// Checks that an id from a URL or body is one plain folder name.
fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    let plain = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if plain {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "{what} {name:?} is not a plain name (letters, digits, '-', '_', '.')"
        )))
    }
}

/// `GET /floe/v1/info`.
async fn info(State(native): State<NativeRef>) -> Json<ServerInfo> {
    Json(ServerInfo {
        server: "floe".to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        models: native
            .app
            .config
            .catalog
            .iter()
            .map(|(name, _)| name.clone())
            .collect(),
    })
}

/// `GET /floe/v1/stats`: the sample batches the server's engines ran.
async fn stats(State(native): State<NativeRef>) -> Json<Value> {
    Json(serde_json::json!({ "sampling": native.app.sample_stats.snapshot() }))
}

/// What an engine is built from.
struct Prepared {
    source: ModelSource,
    tokenizer: Option<Tokenizer>,
    tokenizer_files: BTreeMap<String, String>,
}

/// Reads the model a create request names (blocking: loads files, may train the
/// embedded catalog model's tokenizer).
fn prepare(native: &Native, engine_dir: &Path, model: ModelSpec) -> Result<Prepared, ApiError> {
    match model {
        ModelSpec::BaseModel(name) => {
            let weights = native
                .app
                .config
                .catalog
                .get(&name)
                .map_err(|e| ApiError::bad_request(format!("create engine: {e}")))?;
            let base = weights
                .load()
                .map_err(|e| internal(&format!("base model {name:?}"), e))?;
            let tokenizer_files = match (weights, &base.tokenizer) {
                (BaseWeights::Dir(dir), _) => read_tokenizer_files(dir)?,
                (BaseWeights::Embedded(_), Some(tokenizer)) => {
                    let dir = engine_dir.join("tokenizer");
                    tokenizer
                        .save_dir(&dir)
                        .map_err(|e| internal("saving the tokenizer", e))?;
                    read_tokenizer_files(&dir)?
                }
                (BaseWeights::Embedded(_), None) => BTreeMap::new(),
            };
            Ok(Prepared {
                source: base.source,
                tokenizer: base.tokenizer,
                tokenizer_files,
            })
        }
        ModelSpec::Embedded {
            path,
            tokenizer_files,
            seed,
        } => {
            if !tokenizer_files.contains_key("tokenizer.json") {
                return Err(ApiError::bad_request(
                    "create engine: embedded.tokenizer_files has no \"tokenizer.json\"",
                ));
            }
            let dir = engine_dir.join("tokenizer");
            std::fs::create_dir_all(&dir).map_err(|e| internal(&dir.display().to_string(), e))?;
            for (name, text) in &tokenizer_files {
                if !TOKENIZER_FILES.contains(&name.as_str()) {
                    return Err(ApiError::bad_request(format!(
                        "create engine: tokenizer file {name:?} is not one of {TOKENIZER_FILES:?}"
                    )));
                }
                std::fs::write(dir.join(name), text)
                    .map_err(|e| internal(&dir.join(name).display().to_string(), e))?;
            }
            let tokenizer = Tokenizer::from_dir(&dir).map_err(|e| {
                ApiError::bad_request(format!("create engine: the embedded tokenizer: {e}"))
            })?;
            if tokenizer.vocab_size() > MAX_EMBEDDED_VOCAB {
                return Err(ApiError::bad_request(format!(
                    "create engine: the embedded tokenizer has {} ids; the embedded model takes at most {MAX_EMBEDDED_VOCAB}",
                    tokenizer.vocab_size()
                )));
            }
            let config = embedded_model(&path, &tokenizer)
                .map_err(|e| ApiError::bad_request(format!("create engine: {e}")))?
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "create engine: embedded.path {path:?} is not an embedded model (embedded:tiny, embedded:0.6B, ...)"
                    ))
                })?;
            Ok(Prepared {
                source: ModelSource::Random { config, seed },
                tokenizer: Some(tokenizer),
                tokenizer_files,
            })
        }
    }
}

fn read_tokenizer_files(dir: &Path) -> Result<BTreeMap<String, String>, ApiError> {
    let mut files = BTreeMap::new();
    for name in TOKENIZER_FILES {
        let path = dir.join(name);
        if path.is_file() {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| internal(&path.display().to_string(), e))?;
            files.insert(name.to_string(), text);
        }
    }
    // Validates what the client will load.
    load_tokenizer(dir).map_err(|e| internal("the model's tokenizer", e))?;
    Ok(files)
}

/// `POST /floe/v1/engines`: builds an engine and answers once it is loaded.
async fn create_engine(
    State(native): State<NativeRef>,
    body: Body,
) -> Result<Json<CreateEngineResponse>, ApiError> {
    let request: CreateEngineRequest = parse("create engine", body)?;
    let engine_id = random_id("engine");
    let engine_dir = native.dir("engines").join(&engine_id);
    let prepared = {
        let native = Arc::clone(&native);
        let engine_dir = engine_dir.clone();
        tokio::task::spawn_blocking(move || prepare(&native, &engine_dir, request.model))
            .await
            .map_err(|e| internal("create engine", e))??
    };
    let options = engine_options(&native, &request.settings);
    let Prepared {
        source,
        tokenizer,
        tokenizer_files,
    } = prepared;
    let build: EngineBuilder =
        Box::new(move || crate::worker::open_engine(source, tokenizer, options));
    // The `loaded` future carries a load failure's message.
    let loaded = native.app.futures.issue();
    let worker = Worker::spawn(
        format!("engine {engine_id}"),
        build,
        Some((loaded, Outcome::Json(Value::Null))),
        &native.app.worker_context(),
    )
    .map(Arc::new)
    .map_err(|e| internal("engine thread", e))?;
    if let Some(Outcome::Failed { .. }) | None = native.outcome(loaded).await.as_deref() {
        return Err(internal("create engine", native.failure(loaded).await));
    }
    let info: EngineInfo = native
        .run(&worker, |engine| Ok(engine.info().clone()))
        .await?;
    native
        .engines
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(engine_id.clone(), Arc::new(NativeEngine { worker }));
    tracing::info!(engine = %engine_id, device = %info.device, "native engine created");
    Ok(Json(CreateEngineResponse {
        engine_id,
        info,
        tokenizer_files,
    }))
}

/// The server's engine options with the client's settings applied.
fn engine_options(native: &Native, settings: &EngineSettings) -> floe_engine::LocalEngineOptions {
    let mut options = native.app.config.engine.clone();
    if let Some(tokens) = settings.max_tokens_per_microbatch {
        options.max_tokens_per_microbatch = tokens;
    }
    if let Some(recompute) = settings.recompute {
        options.recompute = recompute;
    }
    if let Some(tokens) = settings.kv_cache_tokens_wanted {
        options.kv_cache_tokens_wanted = tokens;
    }
    if let Some(seed) = settings.seed {
        options.seed = seed;
    }
    options
}

/// `DELETE /floe/v1/engines/{id}`: its thread ends once its queued verbs are done.
async fn delete_engine(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let removed = native
        .engines
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&engine_id);
    match removed {
        Some(_) => Ok(Json(serde_json::json!({ "deleted": engine_id }))),
        None => Err(ApiError::not_found(format!(
            "unknown engine_id {engine_id:?}"
        ))),
    }
}

/// `POST /engines/{id}/sample`: newline-delimited [`SampleEvent`]s as samples finish.
async fn sample(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
    body: Body,
) -> Result<Response, ApiError> {
    let request: SampleBody = parse("sample", body)?;
    let engine = native.engine(&engine_id)?;
    let (lines, mut receiver) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
    let job = SampleJob {
        requests: request.requests,
        cancel: None,
        sink: Box::new(NativeSample { lines }),
    };
    native.app.submit_sample(&engine.worker, job)?;
    let stream = futures_util::stream::poll_fn(move |cx| {
        receiver
            .poll_recv(cx)
            .map(|line| line.map(Ok::<_, Infallible>))
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        HttpBody::from_stream(stream),
    )
        .into_response())
}

/// A native `sample` call's stream: a line per generation, then `done` or `error`.
struct NativeSample {
    lines: tokio::sync::mpsc::UnboundedSender<Bytes>,
}

impl NativeSample {
    fn send(&self, event: &SampleEvent) {
        let mut line = serde_json::to_vec(event).expect("sample events serialise");
        line.push(b'\n');
        // A client that hung up no longer reads; sampling still finishes.
        let _ = self.lines.send(Bytes::from(line));
    }
}

impl SampleSink for NativeSample {
    fn generation(&mut self, generation: Generation) {
        self.send(&SampleEvent::Generation(generation));
    }

    fn finish(self: Box<Self>, result: Result<(), SampleFailure>) -> Outcome {
        match result {
            Ok(()) => {
                self.send(&SampleEvent::Done {});
                Outcome::Json(Value::Null)
            }
            Err(failure) => {
                let error = format!("sample: {}", failure.message);
                self.send(&SampleEvent::Error(error.clone()));
                Outcome::user_error(error)
            }
        }
    }
}

/// `POST /engines/{id}/forward`.
async fn forward(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
    body: Body,
) -> Result<Json<ForwardResponse>, ApiError> {
    let request: ForwardBody = parse("forward", body)?;
    let engine = native.engine(&engine_id)?;
    let outputs = native
        .run(&engine.worker, move |engine| {
            engine
                .forward(&request.groups, request.weights, request.temperature)
                .map_err(|e| verb_failed("forward", e))
        })
        .await?;
    Ok(Json(ForwardResponse { outputs }))
}

/// `POST /engines/{id}/forward_backward`.
async fn forward_backward(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
    body: Body,
) -> Result<Json<ForwardBackwardResponse>, ApiError> {
    let request: ForwardBackwardBody = parse("forward_backward", body)?;
    let engine = native.engine(&engine_id)?;
    let output = native
        .run(&engine.worker, move |engine| {
            engine
                .forward_backward(&request.groups, &request.loss, request.temperature)
                .map_err(|e| verb_failed("forward_backward", e))
        })
        .await?;
    Ok(Json(output.into()))
}

/// `POST /engines/{id}/optim_step` (body: [`OptimParams`]).
async fn optim_step(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
    body: Body,
) -> Result<Json<OptimStepResponse>, ApiError> {
    let params: OptimParams = parse("optim_step", body)?;
    let engine = native.engine(&engine_id)?;
    let outcome = native
        .run(&engine.worker, move |engine| {
            engine
                .optim_step(&params)
                .map_err(|e| verb_failed("optim_step", e))
        })
        .await?;
    Ok(Json(outcome.into()))
}

/// `POST /engines/{id}/sync_sampler_weights`.
async fn sync_sampler_weights(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<SyncResponse>, ApiError> {
    let engine = native.engine(&engine_id)?;
    let took = native
        .run(&engine.worker, |engine| {
            engine
                .sync_sampler_weights()
                .map_err(|e| verb_failed("sync_sampler_weights", e))
        })
        .await?;
    Ok(Json(SyncResponse {
        seconds: took.as_secs_f64(),
    }))
}

/// `POST /engines/{id}/freeze_reference`.
async fn freeze_reference(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    unit_verb(&native, &engine_id, "freeze_reference", |engine| {
        engine.freeze_reference()
    })
    .await
}

/// `POST /engines/{id}/reset_optimizer`.
async fn reset_optimizer(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    unit_verb(&native, &engine_id, "reset_optimizer", |engine| {
        engine.reset_optimizer()
    })
    .await
}

/// Runs a verb that takes no input and answers `{}`.
async fn unit_verb(
    native: &NativeRef,
    engine_id: &str,
    name: &'static str,
    verb: fn(&mut AnyLocalEngine) -> Result<(), EngineError>,
) -> Result<Json<Value>, ApiError> {
    let engine = native.engine(engine_id)?;
    native
        .run(&engine.worker, move |engine| {
            verb(engine).map_err(|e| verb_failed(name, e))
        })
        .await?;
    Ok(Json(serde_json::json!({})))
}

/// `POST /engines/{id}/save_state`: saves under `native/states/{state_id}`.
async fn save_state(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<SaveStateResponse>, ApiError> {
    let engine = native.engine(&engine_id)?;
    let state_id = random_id("state");
    let dir = native.dir("states").join(&state_id);
    native
        .run(&engine.worker, move |engine| {
            engine
                .save_state(&dir)
                .map_err(|e| verb_failed("save_state", e))
        })
        .await?;
    Ok(Json(SaveStateResponse { state_id }))
}

/// `POST /engines/{id}/load_state`: answers the engine's facts after the load (a saved
/// state may hold another shape).
async fn load_state(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
    body: Body,
) -> Result<Json<EngineInfo>, ApiError> {
    let request: LoadStateBody = parse("load_state", body)?;
    check_name("state_id", &request.state_id)?;
    let dir = native.dir("states").join(&request.state_id);
    if !dir.is_dir() {
        return Err(ApiError::not_found(format!(
            "load_state: unknown state_id {:?} (no saved state of that id on this server)",
            request.state_id
        )));
    }
    let engine = native.engine(&engine_id)?;
    let info = native
        .run(&engine.worker, move |engine| {
            engine
                .load_state(&dir)
                .map_err(|e| verb_failed("load_state", e))?;
            Ok(engine.info().clone())
        })
        .await?;
    Ok(Json(info))
}

/// `POST /engines/{id}/export_hf`: writes `native/exports/{export_id}` and lists its
/// files.
async fn export_hf(
    State(native): State<NativeRef>,
    UrlPath(engine_id): UrlPath<String>,
) -> Result<Json<ExportResponse>, ApiError> {
    let engine = native.engine(&engine_id)?;
    let export_id = random_id("export");
    let dir = native.dir("exports").join(&export_id);
    let files = native
        .run(&engine.worker, move |engine| {
            engine
                .export_hf(&dir)
                .map_err(|e| verb_failed("export_hf", e))?;
            list_files(&dir)
        })
        .await?;
    Ok(Json(ExportResponse { export_id, files }))
}

/// The plain files of an export folder, by name.
fn list_files(dir: &Path) -> Result<Vec<ExportedFile>, ApiError> {
    let entries = std::fs::read_dir(dir).map_err(|e| internal(&dir.display().to_string(), e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| internal(&dir.display().to_string(), e))?;
        let meta = entry
            .metadata()
            .map_err(|e| internal(&entry.path().display().to_string(), e))?;
        if meta.is_file() {
            files.push(ExportedFile {
                name: entry.file_name().to_string_lossy().into_owned(),
                bytes: meta.len(),
            });
        }
    }
    files.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(files)
}

/// `GET /floe/v1/exports/{export_id}/{file}`: the file's bytes, streamed.
async fn export_file(
    State(native): State<NativeRef>,
    UrlPath((export_id, file)): UrlPath<(String, String)>,
) -> Result<Response, ApiError> {
    check_name("export_id", &export_id)?;
    check_name("file", &file)?;
    let path = native.dir("exports").join(&export_id).join(&file);
    let opened = tokio::fs::File::open(&path)
        .await
        .map_err(|_| ApiError::not_found(format!("no file {file:?} in export {export_id:?}")))?;
    let chunks = futures_util::stream::unfold(Some(opened), |file| async move {
        use tokio::io::AsyncReadExt;
        let mut file = file?;
        let mut chunk = vec![0u8; 1 << 20];
        match file.read(&mut chunk).await {
            Ok(0) => None,
            Ok(n) => {
                chunk.truncate(n);
                Some((Ok(Bytes::from(chunk)), Some(file)))
            }
            // The error ends the body; nothing follows it.
            Err(error) => Some((Err(error), None)),
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        HttpBody::from_stream(chunks),
    )
        .into_response())
}
