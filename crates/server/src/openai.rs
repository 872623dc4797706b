//! The OpenAI-compatible routes under `/v1`: `chat/completions`, `completions` and
//! `models`, so black-box agents that speak the OpenAI API roll out against the policy a
//! server holds.
//!
//! `model` names a base model of the catalog (the server keeps one sampling engine per
//! base model, made on first use), a Tinker sampling session (`{session}:sample:{n}`) or
//! a Tinker training model (`{session}:train:{n}`: its current weights). Sampling goes
//! through the same engine workers and [`floe_engine::Engine::sample`] as `/asample`, so
//! the tokens and log-probs are the engine's own. Every choice carries the sampled
//! `token_ids` and their log-probs (OpenAI's `logprobs` shape, always filled), and the
//! response the rendered `prompt_token_ids`, so training uses exactly the sampled tokens.
//!
//! Streaming (`stream: true`) answers server-sent events in OpenAI's chunk format as the
//! engine decodes: after each engine step a chunk per choice carries its new tokens' ids
//! and log-probs and the text they complete. Text waits while it ends inside a UTF-8
//! character or could be the start of a stop string (or, with tools, of a tool call), so
//! the chunks' text adds up to the non-streamed content. Errors use OpenAI's
//! `{"error": {"message", "type", "param", "code"}}` shape.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body as HttpBody, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use floe_engine::{
    AnyLocalEngine, Engine, Generation, SampleProgress, SampleRequest, SamplingParams, StopReason,
};
use floe_model::chat_template::ChatTemplate;
use floe_model::tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::futures::Outcome;
use crate::routes::{self, AppRef, Body};
use crate::sample_batch::{SampleFailure, SampleJob, SampleSink};
use crate::state::{random_id, ModelFacts};
use crate::worker::Worker;

/// Most choices (`n`) one request may ask for.
const MAX_N: usize = 128;
/// Most top alternatives per token: OpenAI's caps, chat's `top_logprobs` and the legacy
/// completions' `logprobs`.
const MAX_CHAT_TOP_LOGPROBS: u32 = 20;
const MAX_COMPLETION_TOP_LOGPROBS: u32 = 5;
/// `max_tokens` of `/v1/completions` when absent (OpenAI's default).
const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// State of the OpenAI routes.
struct OpenAi {
    app: AppRef,
    /// The sampling engine of each catalog base model, made on first use.
    bases: Mutex<HashMap<String, Arc<Target>>>,
    /// The tokenizer and chat template of each base model, loaded on first use.
    texts: Mutex<HashMap<String, Arc<Text>>>,
    next_request: AtomicU64,
}

type OpenAiRef = Arc<OpenAi>;

/// An engine to sample from.
struct Target {
    worker: Arc<Worker>,
    facts: ModelFacts,
    base_model: String,
    /// A training model: sync its sampler to the latest weights first.
    training: bool,
}

/// How a base model's text becomes tokens.
struct Text {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct OpenAiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl OpenAiError {
    fn bad(message: impl Into<String>, param: &'static str) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param),
            code: None,
        }
    }
}

impl From<ApiError> for OpenAiError {
    fn from(error: ApiError) -> Self {
        Self {
            status: error.status,
            message: error.detail,
            param: None,
            code: None,
        }
    }
}

/// OpenAI's `error.type` for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

fn error_body(status: StatusCode, message: &str, param: Option<&str>, code: Option<&str>) -> Value {
    json!({ "error": {
        "message": message,
        "type": error_type(status),
        "param": param,
        "code": code,
    }})
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, "{}", self.message);
        } else {
            tracing::debug!(status = %self.status, "{}", self.message);
        }
        let body = error_body(self.status, &self.message, self.param, self.code);
        (self.status, Json(body)).into_response()
    }
}

/// The `/v1` routes over the server's state, behind the API-key check (`X-API-Key` or
/// `Authorization: Bearer`), every error in OpenAI's shape.
pub fn router<S: Clone + Send + Sync + 'static>(app: AppRef) -> Router<S> {
    let state = Arc::new(OpenAi {
        app,
        bases: Mutex::new(HashMap::new()),
        texts: Mutex::new(HashMap::new()),
        next_request: AtomicU64::new(1),
    });
    Router::new()
        .route("/chat/completions", post(chat_completions))
        .route("/completions", post(completions))
        .route("/models", get(models))
        .route("/tokenize", post(tokenize))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authenticate,
        ))
        .fallback(|| async {
            OpenAiError {
                status: StatusCode::NOT_FOUND,
                message: "no such route; this server offers /v1/chat/completions, /v1/completions, /v1/models and /v1/tokenize".into(),
                param: None,
                code: None,
            }
        })
        .with_state(state)
}

async fn authenticate(
    State(state): State<OpenAiRef>,
    request: Request,
    next: Next,
) -> Result<Response, OpenAiError> {
    crate::check_key(&state.app, request.headers())?;
    Ok(next.run(request).await)
}

/// `GET /v1/models`: the catalog's base models, then the sampling sessions and training
/// models this server holds.
async fn models(State(state): State<OpenAiRef>) -> Json<Value> {
    let mut data: Vec<Value> = state
        .app
        .config
        .catalog
        .iter()
        .map(|(name, _)| json!({ "id": name, "object": "model", "created": 0, "owned_by": "floe" }))
        .collect();
    let registry = state.app.registry();
    let mut held: Vec<&String> = registry
        .samplers
        .keys()
        .chain(registry.models.keys())
        .collect();
    held.sort();
    data.extend(
        held.into_iter()
            .map(|id| json!({ "id": id, "object": "model", "created": 0, "owned_by": "floe" })),
    );
    Json(json!({ "object": "list", "data": data }))
}

impl OpenAi {
    /// The engine `model` names: a sampling session, a training model, or a base model.
    fn target(&self, model: &str) -> Result<Arc<Target>, OpenAiError> {
        {
            let registry = self.app.registry();
            if let Some(sampler) = registry.samplers.get(model) {
                return Ok(Arc::new(Target {
                    worker: Arc::clone(&sampler.worker),
                    facts: sampler.facts.clone(),
                    base_model: sampler.base_model.clone(),
                    training: false,
                }));
            }
            if let Some(trained) = registry.models.get(model) {
                return Ok(Arc::new(Target {
                    worker: Arc::clone(&trained.worker),
                    facts: trained.facts.clone(),
                    base_model: trained.base_model.clone(),
                    training: true,
                }));
            }
        }
        if self.app.config.catalog.get(model).is_err() {
            let known: Vec<&str> = self
                .app
                .config
                .catalog
                .iter()
                .map(|(n, _)| n.as_str())
                .collect();
            return Err(OpenAiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "the model {model:?} does not exist: name a base model ({}), a sampling session or a training model id",
                    known.join(", ")
                ),
                param: Some("model"),
                code: Some("model_not_found"),
            });
        }
        let mut bases = self.bases.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(target) = bases.get(model) {
            return Ok(Arc::clone(target));
        }
        let base = routes::load_base(&self.app, model)?;
        let facts = routes::facts(&base);
        let worker = routes::spawn_engine(
            &self.app,
            format!("engine openai:{model}"),
            base,
            None,
            None,
        )?;
        let target = Arc::new(Target {
            worker,
            facts,
            base_model: model.to_string(),
            training: false,
        });
        bases.insert(model.to_string(), Arc::clone(&target));
        Ok(target)
    }

    /// The tokenizer and chat template of base model `name`.
    fn text(&self, name: &str) -> Result<Arc<Text>, OpenAiError> {
        let mut texts = self.texts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(text) = texts.get(name) {
            return Ok(Arc::clone(text));
        }
        let base = routes::load_base(&self.app, name)?;
        let tokenizer = base.tokenizer.ok_or_else(|| {
            OpenAiError::bad(
                format!("the model {name:?} has no tokenizer, so it cannot take text; sample token ids through /api/v1/asample"),
                "model",
            )
        })?;
        let template = ChatTemplate::from_tokenizer(&tokenizer).map_err(|e| OpenAiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("the chat template of {name:?}: {e}"),
            param: None,
            code: None,
        })?;
        let text = Arc::new(Text {
            tokenizer,
            template,
        });
        texts.insert(name.to_string(), Arc::clone(&text));
        Ok(text)
    }
}

/// `stop`: a string or strings.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

/// The fields both routes share.
#[derive(Debug, Deserialize)]
struct Common {
    model: String,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// vLLM's extension.
    top_k: Option<i32>,
    n: Option<usize>,
    stop: Option<StopField>,
    /// vLLM's extension: token ids that end a sample (besides EOS).
    #[serde(default)]
    stop_token_ids: Vec<u32>,
    /// vLLM's extension: keep the matched stop string at the end of the text.
    #[serde(default)]
    include_stop_str_in_output: bool,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(flatten)]
    common: Common,
    messages: Value,
    /// How many of the most likely tokens to report at each token, besides its log-prob
    /// (which every choice carries, with or without `logprobs: true`).
    top_logprobs: Option<u32>,
    tools: Option<Value>,
    /// vLLM's extension: more template variables (e.g. `enable_thinking`).
    chat_template_kwargs: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    #[serde(flatten)]
    common: Common,
    prompt: Value,
    /// OpenAI's `logprobs` is the number of top alternatives per token.
    logprobs: Option<u32>,
    #[serde(default)]
    echo: bool,
}

fn parse<T: serde::de::DeserializeOwned>(route: &str, body: Body) -> Result<T, OpenAiError> {
    let body = body.map_err(|e| OpenAiError {
        status: e.status(),
        message: format!("{route}: {}", e.body_text()),
        param: None,
        code: None,
    })?;
    serde_json::from_slice(&body).map_err(|e| OpenAiError {
        status: StatusCode::BAD_REQUEST,
        message: format!("{route}: invalid request body: {e}"),
        param: None,
        code: None,
    })
}

/// The number of top alternatives per token a request asks for in `field`, at most `cap`.
fn top_logprobs(asked: Option<u32>, cap: u32, field: &'static str) -> Result<usize, OpenAiError> {
    let asked = asked.unwrap_or(0);
    if asked > cap {
        return Err(OpenAiError::bad(
            format!("{field} {asked} is not in [0, {cap}]"),
            field,
        ));
    }
    Ok(asked as usize)
}

/// The engine's parameters for `common`, a prompt of `prompt_len` tokens, with
/// `top_logprobs` alternatives per token.
fn sampling_params(
    common: &Common,
    facts: &ModelFacts,
    prompt_len: usize,
    default_max: Option<usize>,
    top_logprobs: usize,
) -> Result<SamplingParams, OpenAiError> {
    let max_new_tokens = facts
        .new_token_budget(
            prompt_len,
            common.max_completion_tokens.or(common.max_tokens),
            default_max,
        )
        .map_err(|e| OpenAiError::bad(e, "max_tokens"))?;
    let temperature = common.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(OpenAiError::bad(
            format!("temperature {temperature} is not in [0, 2]"),
            "temperature",
        ));
    }
    let top_p = common.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(OpenAiError::bad(
            format!("top_p {top_p} is not in (0, 1]"),
            "top_p",
        ));
    }
    let stop_strings = match &common.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(list)) => list.clone(),
    };
    if stop_strings.iter().any(String::is_empty) {
        return Err(OpenAiError::bad("stop strings must not be empty", "stop"));
    }
    if let Some(bad) = common
        .stop_token_ids
        .iter()
        .find(|&&t| t as usize >= facts.vocab_size)
    {
        return Err(OpenAiError::bad(
            format!(
                "stop token {bad} is outside the vocabulary of {}",
                facts.vocab_size
            ),
            "stop_token_ids",
        ));
    }
    let mut stop_token_ids = facts.eos_token_ids.clone();
    stop_token_ids.extend(&common.stop_token_ids);
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k: common.top_k.unwrap_or(-1).max(0),
        max_new_tokens,
        stop_token_ids,
        stop_strings,
        include_stop_str_in_output: common.include_stop_str_in_output,
        seed: common.seed,
        logprobs: true,
        top_logprobs,
        ..SamplingParams::default()
    })
}

fn choices(common: &Common) -> Result<usize, OpenAiError> {
    let n = common.n.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(OpenAiError::bad(
            format!("n {n} is not in [1, {MAX_N}]"),
            "n",
        ));
    }
    Ok(n)
}

/// What the engine job reports.
enum Event {
    /// New tokens of a running sample (streams only).
    Tokens {
        index: usize,
        tokens: Vec<u32>,
        logprobs: Vec<f32>,
        top_logprobs: Vec<Vec<(u32, f32)>>,
    },
    Generation(Generation),
    Done,
    Failed(StatusCode, String),
}

/// Queues `n` samples of `prompt` on the target's engine; events arrive on the receiver.
fn submit(
    state: &OpenAi,
    target: &Target,
    prompt: Vec<u32>,
    n: usize,
    params: SamplingParams,
    stream: bool,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, OpenAiError> {
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel();
    let request = SampleRequest {
        id: state.next_request.fetch_add(1, Ordering::Relaxed),
        prompt,
        n,
        params,
    };
    let job = SampleJob {
        requests: vec![request],
        cancel: None,
        sink: Box::new(OpenAiSample {
            events,
            training: target.training,
            stream,
            reported: Vec::new(),
        }),
    };
    state.app.submit_sample(&target.worker, job)?;
    Ok(receiver)
}

/// One `/v1` request's events.
struct OpenAiSample {
    events: tokio::sync::mpsc::UnboundedSender<Event>,
    /// A training model: sync its sampler to the latest weights first.
    training: bool,
    /// Send tokens as they are decoded.
    stream: bool,
    /// Tokens sent so far, by sample index.
    reported: Vec<usize>,
}

impl SampleSink for OpenAiSample {
    /// Always: the progress reports are also where a client that hung up (streaming or
    /// not) is noticed and its samples cancelled.
    fn streams(&self) -> bool {
        true
    }

    /// The receiving end is dropped with the handler (a non-streaming client gone) or by
    /// the stream's writer (a streaming client gone).
    fn hung_up(&self) -> bool {
        self.events.is_closed()
    }

    fn progress(&mut self, progress: SampleProgress<'_>) {
        if !self.stream {
            return;
        }
        let index = progress.sample_index;
        if self.reported.len() <= index {
            self.reported.resize(index + 1, 0);
        }
        let from = self.reported[index];
        if progress.tokens.len() > from {
            self.reported[index] = progress.tokens.len();
            let _ = self.events.send(Event::Tokens {
                index,
                tokens: progress.tokens[from..].to_vec(),
                logprobs: progress.logprobs.get(from..).unwrap_or_default().to_vec(),
                top_logprobs: progress
                    .top_logprobs
                    .get(from..)
                    .unwrap_or_default()
                    .to_vec(),
            });
        }
    }

    /// A training model's sampler synced to its latest weights. Not needed by a job that
    /// joins a running batch ([`SampleSink::needs_prepare`] is false): that batch already
    /// samples the latest weights, since no verb runs while it does.
    fn prepare(&mut self, engine: &mut AnyLocalEngine) -> Result<(), SampleFailure> {
        if self.training {
            engine.sync_sampler_weights().map_err(|e| SampleFailure {
                message: format!("syncing the sampler to the latest weights: {e}"),
                by_request: false,
            })?;
        }
        Ok(())
    }

    fn generation(&mut self, generation: Generation) {
        let _ = self.events.send(Event::Generation(generation));
    }

    fn finish(self: Box<Self>, result: Result<(), SampleFailure>) -> Outcome {
        match result {
            Ok(()) => {
                let _ = self.events.send(Event::Done);
                Outcome::Json(Value::Null)
            }
            Err(failure) => {
                let status = if failure.by_request {
                    StatusCode::BAD_REQUEST
                } else {
                    StatusCode::INTERNAL_SERVER_ERROR
                };
                let error = format!("sample: {}", failure.message);
                let _ = self.events.send(Event::Failed(status, error.clone()));
                Outcome::user_error(error)
            }
        }
    }
}

/// Every generation, by sample index, once all are done.
async fn collect(
    mut receiver: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Result<Vec<Generation>, OpenAiError> {
    let mut generations = Vec::new();
    loop {
        match receiver.recv().await {
            Some(Event::Generation(g)) => generations.push(g),
            Some(Event::Tokens { .. }) => {}
            Some(Event::Done) => break,
            Some(Event::Failed(status, message)) => {
                return Err(OpenAiError {
                    status,
                    message,
                    param: None,
                    code: None,
                })
            }
            None => {
                return Err(OpenAiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "the engine stopped before the samples were done".into(),
                    param: None,
                    code: None,
                })
            }
        }
    }
    generations.sort_by_key(|g| g.sample_index);
    Ok(generations)
}

/// A generation's text, tokens without the stop token, and OpenAI finish reason.
struct Finished {
    content: String,
    finish_reason: &'static str,
}

fn finish(text: &Text, g: &Generation) -> Finished {
    let content = match &g.text {
        // Stop strings: the sampler's text, cut before the matched one.
        Some(cut) => cut.clone(),
        None => text.tokenizer.decode(&g.tokens, true).unwrap_or_default(),
    };
    let finish_reason = match g.stop_reason {
        StopReason::Length => "length",
        StopReason::Stop(_) => "stop",
    };
    Finished {
        content,
        finish_reason,
    }
}

/// The text of one token, for `logprobs` (special tokens kept, so EOS shows).
fn token_text(text: &Text, id: u32) -> String {
    text.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// OpenAI chat `logprobs` of `tokens`, with their top alternatives `tops` (one list per
/// token; empty when the request asked for none).
fn chat_logprobs(text: &Text, tokens: &[u32], logprobs: &[f32], tops: &[Vec<(u32, f32)>]) -> Value {
    let entry = |id: u32, lp: f32| {
        let token = token_text(text, id);
        json!({ "token": token, "logprob": lp, "bytes": token.as_bytes() })
    };
    let content: Vec<Value> = tokens
        .iter()
        .zip(logprobs)
        .enumerate()
        .map(|(i, (&id, &lp))| {
            let top: Vec<Value> = tops
                .get(i)
                .map(|top| top.iter().map(|&(id, lp)| entry(id, lp)).collect())
                .unwrap_or_default();
            let mut item = entry(id, lp);
            item["top_logprobs"] = json!(top);
            item
        })
        .collect();
    json!({ "content": content })
}

/// OpenAI completions `logprobs` of `tokens`, the first at text offset `at` (moved past
/// them), with their top alternatives `tops` as token-text → log-prob maps (`null` when
/// the request asked for none).
fn completion_logprobs(
    text: &Text,
    tokens: &[u32],
    logprobs: &[f32],
    tops: &[Vec<(u32, f32)>],
    at: &mut usize,
) -> Value {
    let mut offsets = Vec::with_capacity(tokens.len());
    let pieces: Vec<String> = tokens
        .iter()
        .map(|&id| {
            let piece = token_text(text, id);
            offsets.push(*at);
            *at += piece.len();
            piece
        })
        .collect();
    let top_logprobs = if tops.is_empty() {
        Value::Null
    } else {
        tops.iter()
            .map(|top| {
                top.iter()
                    .map(|&(id, lp)| (token_text(text, id), json!(lp)))
                    .collect::<serde_json::Map<_, _>>()
                    .into()
            })
            .collect::<Vec<Value>>()
            .into()
    };
    json!({
        "tokens": pieces,
        "token_logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    })
}

fn usage(prompt_len: usize, generations: &[Generation]) -> Value {
    let completion: usize = generations.iter().map(|g| g.tokens.len()).sum();
    json!({
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    })
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Where a Hermes/Qwen-style tool call starts.
const TOOL_CALL_OPEN: &str = "<tool_call>";

/// The tool calls of Hermes/Qwen-style output (`<tool_call>{"name", "arguments"}</tool_call>`),
/// and the content before the first one; `None` when it has none that parse.
fn parse_tool_calls(content: &str) -> Option<(Option<String>, Vec<Value>)> {
    const OPEN: &str = TOOL_CALL_OPEN;
    const CLOSE: &str = "</tool_call>";
    let first = content.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &content[first..];
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let end = after.find(CLOSE).unwrap_or(after.len());
        let call: Value = serde_json::from_str(after[..end].trim()).ok()?;
        let name = call.get("name")?.as_str()?.to_string();
        let arguments = match call.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => "{}".to_string(),
        };
        calls.push(json!({
            "id": random_id("call"),
            "type": "function",
            "function": { "name": name, "arguments": arguments },
        }));
        rest = &after[(end + CLOSE.len()).min(after.len())..];
    }
    let before = content[..first].trim();
    Some(((!before.is_empty()).then(|| before.to_string()), calls))
}

/// The rendered, tokenized prompt of a chat request.
fn chat_prompt(text: &Text, request: &ChatRequest) -> Result<Vec<u32>, OpenAiError> {
    let rendered = render_chat(
        text,
        &request.common.model,
        &request.messages,
        request.tools.as_ref(),
        request.chat_template_kwargs.as_ref(),
        true,
    )?;
    text.tokenizer
        .encode(&rendered, false)
        .map_err(|e| OpenAiError::bad(format!("tokenizing the prompt: {e}"), "messages"))
}

/// `messages` (with `tools` and template variables) rendered through the chat template
/// of `model`, ending with the assistant's generation prompt when `generation_prompt`.
fn render_chat(
    text: &Text,
    model: &str,
    messages: &Value,
    tools: Option<&Value>,
    chat_template_kwargs: Option<&Value>,
    generation_prompt: bool,
) -> Result<String, OpenAiError> {
    let Some(template) = &text.template else {
        return Err(OpenAiError::bad(
            format!("the model {model:?} has no chat template; use /v1/completions"),
            "model",
        ));
    };
    let Value::Array(raw) = messages else {
        return Err(OpenAiError::bad("messages must be an array", "messages"));
    };
    if raw.is_empty() {
        return Err(OpenAiError::bad("messages must not be empty", "messages"));
    }
    let mut messages = Vec::with_capacity(raw.len());
    for (i, message) in raw.iter().enumerate() {
        let Value::Object(fields) = message else {
            return Err(OpenAiError::bad(
                format!("messages[{i}] is not an object"),
                "messages",
            ));
        };
        let mut fields = fields.clone();
        match fields.get("role") {
            Some(Value::String(role))
                if ["system", "developer", "user", "assistant", "tool"]
                    .contains(&role.as_str()) => {}
            other => {
                return Err(OpenAiError::bad(
                    format!("messages[{i}].role {other:?} is not one of system, developer, user, assistant, tool"),
                    "messages",
                ))
            }
        }
        // Content parts: the text parts, joined; images and audio are not supported.
        match fields.get("content").cloned() {
            Some(Value::Array(parts)) => {
                let mut joined = String::new();
                for part in parts {
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => joined.push_str(t),
                        _ => {
                            return Err(OpenAiError::bad(
                                format!("messages[{i}].content: only text parts are supported"),
                                "messages",
                            ))
                        }
                    }
                }
                fields.insert("content".into(), Value::String(joined));
            }
            Some(Value::String(_)) => {}
            None | Some(Value::Null) => {
                fields.insert("content".into(), Value::String(String::new()));
            }
            Some(_) => {
                return Err(OpenAiError::bad(
                    format!("messages[{i}].content must be a string or an array of text parts"),
                    "messages",
                ))
            }
        }
        messages.push(Value::Object(fields));
    }
    let mut extra = serde_json::Map::new();
    if let Some(tools) = tools {
        if !matches!(tools, Value::Array(_)) {
            return Err(OpenAiError::bad("tools must be an array", "tools"));
        }
        if !template.source().contains("tools") {
            return Err(OpenAiError::bad(
                format!("the chat template of {model:?} does not render tools"),
                "tools",
            ));
        }
        extra.insert("tools".into(), tools.clone());
    }
    match chat_template_kwargs {
        None | Some(Value::Null) => {}
        Some(Value::Object(kwargs)) => extra.extend(kwargs.clone()),
        Some(_) => {
            return Err(OpenAiError::bad(
                "chat_template_kwargs must be an object",
                "chat_template_kwargs",
            ))
        }
    }
    template
        .render(&messages, generation_prompt, &Value::Object(extra))
        .map_err(|e| OpenAiError::bad(format!("rendering the chat template: {e}"), "messages"))
}

/// `POST /v1/tokenize` (vLLM's route, under `/v1`): the token ids of a text `prompt`
/// (`add_special_tokens`, default true) or of chat `messages` rendered through the
/// template (`add_generation_prompt`, default true; the rendered text comes back as
/// `prompt`), so an agent can splice a multi-turn episode's tokens itself.
async fn tokenize(State(state): State<OpenAiRef>, body: Body) -> Result<Response, OpenAiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct TokenizeRequest {
        model: String,
        prompt: Option<String>,
        messages: Option<Value>,
        tools: Option<Value>,
        chat_template_kwargs: Option<Value>,
        add_special_tokens: Option<bool>,
        add_generation_prompt: Option<bool>,
    }
    let request: TokenizeRequest = parse("tokenize", body)?;
    let target = state.target(&request.model)?;
    let text = state.text(&target.base_model)?;
    let (rendered, special) = match (&request.prompt, &request.messages) {
        (Some(prompt), None) => (prompt.clone(), request.add_special_tokens.unwrap_or(true)),
        (None, Some(messages)) => (
            render_chat(
                &text,
                &request.model,
                messages,
                request.tools.as_ref(),
                request.chat_template_kwargs.as_ref(),
                request.add_generation_prompt.unwrap_or(true),
            )?,
            request.add_special_tokens.unwrap_or(false),
        ),
        _ => {
            return Err(OpenAiError::bad(
                "give exactly one of prompt (a string) and messages",
                "prompt",
            ))
        }
    };
    let tokens = text
        .tokenizer
        .encode(&rendered, special)
        .map_err(|e| OpenAiError::bad(format!("tokenizing: {e}"), "prompt"))?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": target.facts.max_context,
        "tokens": tokens,
        "prompt": rendered,
    }))
    .into_response())
}

/// `POST /v1/chat/completions`.
async fn chat_completions(
    State(state): State<OpenAiRef>,
    body: Body,
) -> Result<Response, OpenAiError> {
    let request: ChatRequest = parse("chat/completions", body)?;
    let target = state.target(&request.common.model)?;
    let text = state.text(&target.base_model)?;
    let prompt = chat_prompt(&text, &request)?;
    let n = choices(&request.common)?;
    let top = top_logprobs(request.top_logprobs, MAX_CHAT_TOP_LOGPROBS, "top_logprobs")?;
    let params = sampling_params(&request.common, &target.facts, prompt.len(), None, top)?;
    let mut holds = params.stop_strings.clone();
    if request.tools.is_some() {
        holds.push(TOOL_CALL_OPEN.to_string());
    }
    let stream = request.common.stream;
    let receiver = submit(&state, &target, prompt.clone(), n, params, stream)?;
    let meta = Meta {
        id: random_id("chatcmpl"),
        model: request.common.model.clone(),
        created: now(),
        tools: request.tools.is_some(),
        include_usage: request
            .common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if stream {
        let spec = StreamSpec {
            kind: StreamKind::Chat,
            n,
            holds,
        };
        return Ok(sse(stream_choices(text, meta, spec, prompt, receiver)));
    }
    let generations = collect(receiver).await?;
    let choices: Vec<Value> = generations
        .iter()
        .map(|g| {
            let finished = finish(&text, g);
            let mut message = json!({ "role": "assistant", "content": finished.content });
            let mut finish_reason = finished.finish_reason;
            if meta.tools {
                if let Some((content, calls)) = parse_tool_calls(&finished.content) {
                    message =
                        json!({ "role": "assistant", "content": content, "tool_calls": calls });
                    if finish_reason == "stop" {
                        finish_reason = "tool_calls";
                    }
                }
            }
            json!({
                "index": g.sample_index,
                "message": message,
                "logprobs": chat_logprobs(&text, &g.tokens, &g.logprobs, &g.top_logprobs),
                "finish_reason": finish_reason,
                "token_ids": g.tokens,
            })
        })
        .collect();
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(prompt.len(), &generations),
        "prompt_token_ids": prompt,
    }))
    .into_response())
}

/// The prompt of a completions request: a string or token ids.
fn completion_prompt(
    text: &Text,
    facts: &ModelFacts,
    prompt: &Value,
) -> Result<Vec<u32>, OpenAiError> {
    let tokens = match prompt {
        Value::String(s) => text
            .tokenizer
            .encode(s, true)
            .map_err(|e| OpenAiError::bad(format!("tokenizing the prompt: {e}"), "prompt"))?,
        Value::Array(items) if items.iter().all(Value::is_u64) => items
            .iter()
            .map(|v| u32::try_from(v.as_u64().unwrap_or(u64::MAX)).unwrap_or(u32::MAX))
            .collect(),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            return completion_prompt(text, facts, &items[0])
        }
        _ => {
            return Err(OpenAiError::bad(
                "prompt must be a string or an array of token ids (one prompt per request)",
                "prompt",
            ))
        }
    };
    if tokens.is_empty() {
        return Err(OpenAiError::bad("the prompt has no tokens", "prompt"));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= facts.vocab_size) {
        return Err(OpenAiError::bad(
            format!(
                "prompt token {bad} is outside the vocabulary of {}",
                facts.vocab_size
            ),
            "prompt",
        ));
    }
    Ok(tokens)
}

/// `POST /v1/completions`.
async fn completions(State(state): State<OpenAiRef>, body: Body) -> Result<Response, OpenAiError> {
    let request: CompletionRequest = parse("completions", body)?;
    let top = top_logprobs(request.logprobs, MAX_COMPLETION_TOP_LOGPROBS, "logprobs")?;
    if request.echo {
        return Err(OpenAiError::bad("echo is not supported", "echo"));
    }
    let target = state.target(&request.common.model)?;
    let text = state.text(&target.base_model)?;
    let prompt = completion_prompt(&text, &target.facts, &request.prompt)?;
    let n = choices(&request.common)?;
    let params = sampling_params(
        &request.common,
        &target.facts,
        prompt.len(),
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        top,
    )?;
    let holds = params.stop_strings.clone();
    let stream = request.common.stream;
    let receiver = submit(&state, &target, prompt.clone(), n, params, stream)?;
    let meta = Meta {
        id: random_id("cmpl"),
        model: request.common.model.clone(),
        created: now(),
        tools: false,
        include_usage: request
            .common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
    };
    if stream {
        let spec = StreamSpec {
            kind: StreamKind::Completion,
            n,
            holds,
        };
        return Ok(sse(stream_choices(text, meta, spec, prompt, receiver)));
    }
    let generations = collect(receiver).await?;
    let choices: Vec<Value> = generations
        .iter()
        .map(|g| {
            let finished = finish(&text, g);
            json!({
                "index": g.sample_index,
                "text": finished.content,
                "logprobs": completion_logprobs(
                    &text,
                    &g.tokens,
                    &g.logprobs,
                    &g.top_logprobs,
                    &mut 0,
                ),
                "finish_reason": finished.finish_reason,
                "token_ids": g.tokens,
            })
        })
        .collect();
    Ok(Json(json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(prompt.len(), &generations),
        "prompt_token_ids": prompt,
    }))
    .into_response())
}

/// What every chunk of a response repeats.
struct Meta {
    id: String,
    model: String,
    created: u64,
    tools: bool,
    include_usage: bool,
}

/// A server-sent-events response over `events` (each a `data:` payload).
fn sse(events: tokio::sync::mpsc::UnboundedReceiver<String>) -> Response {
    let mut events = events;
    let stream = futures_util::stream::poll_fn(move |cx| {
        events
            .poll_recv(cx)
            .map(|e| e.map(|e| Ok::<_, Infallible>(Bytes::from(format!("data: {e}\n\n")))))
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        HttpBody::from_stream(stream),
    )
        .into_response()
}

/// Which route a stream answers: the shape of its chunks.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StreamKind {
    Chat,
    Completion,
}

/// What a stream needs besides its events.
struct StreamSpec {
    kind: StreamKind,
    /// Choices (`n`).
    n: usize,
    /// Strings whose text waits until the choice ends: the stop strings (the engine cuts
    /// the content before them) and, with tools, the tool call's opening tag (the calls
    /// go out parsed at the end).
    holds: Vec<String>,
}

/// One choice of a stream while it is sampled: the tokens received, the text decoded
/// from them, and how much of that was sent.
#[derive(Default)]
struct ChoiceStream {
    tokens: Vec<u32>,
    /// Incremental detokenization (as vLLM's): `text` is the text of `tokens[..read]`;
    /// new tokens are decoded in the window `tokens[prefix..]` and what they add to the
    /// window's text is appended, unless it ends inside a UTF-8 character (`U+FFFD`), in
    /// which case it waits for the next token.
    prefix: usize,
    read: usize,
    text: String,
    /// Bytes of `text` sent.
    sent: usize,
    /// Completions' `text_offset` of the next token.
    offset: usize,
}

impl ChoiceStream {
    /// Takes new tokens and decodes what they complete.
    fn push(&mut self, text: &Text, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
        let decode = |ids: &[u32]| text.tokenizer.decode(ids, true).unwrap_or_default();
        let before = decode(&self.tokens[self.prefix..self.read]);
        let now = decode(&self.tokens[self.prefix..]);
        if now.len() > before.len() && now.starts_with(&before) && !now.ends_with('\u{FFFD}') {
            self.text.push_str(&now[before.len()..]);
            self.prefix = self.read;
            self.read = self.tokens.len();
        }
    }

    /// The decoded text not sent yet, up to where one of `holds` starts or may start
    /// (a suffix that is a prefix of one); marks it sent.
    fn release(&mut self, holds: &[String]) -> &str {
        let from = self.sent;
        let end = self.text[from..]
            .char_indices()
            .map(|(i, _)| from + i)
            .find(|&i| {
                let rest = &self.text[i..];
                holds
                    .iter()
                    .any(|h| rest.starts_with(h.as_str()) || h.starts_with(rest))
            })
            .unwrap_or(self.text.len());
        self.sent = end;
        &self.text[from..end]
    }

    /// What is left of the finished content after the text already sent.
    fn rest_of<'c>(&self, content: &'c str) -> &'c str {
        let sent = &self.text[..self.sent];
        content.strip_prefix(sent).unwrap_or_else(|| {
            // Incremental decoding gave other text than decoding the whole sample; what
            // went out cannot be taken back.
            tracing::warn!(
                sent,
                content,
                "a streamed choice's text differs from its content"
            );
            content.get(sent.len()..).unwrap_or_default()
        })
    }
}

/// Writes a stream's chunks; the first one carries the prompt's token ids.
struct ChunkWriter {
    meta: Meta,
    kind: StreamKind,
    out: tokio::sync::mpsc::UnboundedSender<String>,
    prompt: Option<Vec<u32>>,
}

impl ChunkWriter {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.kind {
            StreamKind::Chat => "chat.completion.chunk",
            StreamKind::Completion => "text_completion",
        };
        json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }

    fn send(&mut self, mut chunk: Value) {
        if let Some(prompt) = self.prompt.take() {
            chunk["prompt_token_ids"] = json!(prompt);
        }
        let _ = self.out.send(chunk.to_string());
    }

    /// A choice's text `piece` with the tokens it came with (possibly none, or text
    /// still held for tokens sent before).
    #[allow(clippy::too_many_arguments)]
    fn delta(
        &mut self,
        text: &Text,
        index: usize,
        choice: &mut ChoiceStream,
        piece: &str,
        tokens: &[u32],
        logprobs: &[f32],
        tops: &[Vec<(u32, f32)>],
    ) {
        let body = match self.kind {
            StreamKind::Chat => json!({
                "index": index,
                "delta": { "content": piece },
                "logprobs": chat_logprobs(text, tokens, logprobs, tops),
                "finish_reason": null,
                "token_ids": tokens,
            }),
            StreamKind::Completion => json!({
                "index": index,
                "text": piece,
                "logprobs": completion_logprobs(text, tokens, logprobs, tops, &mut choice.offset),
                "finish_reason": null,
                "token_ids": tokens,
            }),
        };
        let chunk = self.chunk(json!([body]));
        self.send(chunk);
    }

    /// The end of choice `g`: its tokens not streamed yet, the content still held (or
    /// its tool calls), then the finish reason.
    fn finish(&mut self, text: &Text, choice: &mut ChoiceStream, g: &Generation) {
        let index = g.sample_index;
        let streamed = choice.tokens.len().min(g.tokens.len());
        let tokens = &g.tokens[streamed..];
        let logprobs = g.logprobs.get(streamed..).unwrap_or_default();
        let tops = g.top_logprobs.get(streamed..).unwrap_or_default();
        let finished = finish(text, g);
        let rest = choice.rest_of(&finished.content).to_string();
        let mut finish_reason = finished.finish_reason;
        let calls = match self.kind {
            StreamKind::Chat if self.meta.tools => parse_tool_calls(&finished.content),
            _ => None,
        };
        if let Some((_, calls)) = calls {
            // The text before the first call, then the calls parsed, in one delta.
            let before = rest.find(TOOL_CALL_OPEN).map_or("", |at| &rest[..at]);
            let calls: Vec<Value> = calls
                .into_iter()
                .enumerate()
                .map(|(k, mut call)| {
                    call["index"] = json!(k);
                    call
                })
                .collect();
            let chunk = self.chunk(json!([{
                "index": index,
                "delta": { "content": before, "tool_calls": calls },
                "logprobs": chat_logprobs(text, tokens, logprobs, tops),
                "finish_reason": null,
                "token_ids": tokens,
            }]));
            self.send(chunk);
            if finish_reason == "stop" {
                finish_reason = "tool_calls";
            }
        } else if !tokens.is_empty() || !rest.is_empty() {
            self.delta(text, index, choice, &rest, tokens, logprobs, tops);
        }
        let last = match self.kind {
            StreamKind::Chat => {
                json!({ "index": index, "delta": {}, "logprobs": null, "finish_reason": finish_reason })
            }
            StreamKind::Completion => {
                json!({ "index": index, "text": "", "logprobs": null, "finish_reason": finish_reason })
            }
        };
        let chunk = self.chunk(json!([last]));
        self.send(chunk);
    }

    fn error(&self, status: StatusCode, message: &str) {
        let _ = self
            .out
            .send(error_body(status, message, None, None).to_string());
    }
}

/// Runs a stream: chat's role chunk per choice, then each engine event's chunks as it
/// comes (new tokens, a finished choice), then, when every choice is done, the usage
/// chunk if asked for and `[DONE]`; an engine failure ends the stream with an error
/// chunk.
fn stream_choices(
    text: Arc<Text>,
    meta: Meta,
    spec: StreamSpec,
    prompt: Vec<u32>,
    mut receiver: tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (out, chunks) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let prompt_len = prompt.len();
        let mut writer = ChunkWriter {
            meta,
            kind: spec.kind,
            out,
            prompt: Some(prompt),
        };
        let mut choices: Vec<ChoiceStream> = (0..spec.n).map(|_| ChoiceStream::default()).collect();
        if spec.kind == StreamKind::Chat {
            for index in 0..spec.n {
                let chunk = writer.chunk(json!([{
                    "index": index,
                    "delta": { "role": "assistant", "content": "" },
                    "logprobs": null,
                    "finish_reason": null,
                }]));
                writer.send(chunk);
            }
        }
        let mut generations = Vec::new();
        while let Some(event) = receiver.recv().await {
            if writer.out.is_closed() {
                // The client hung up: dropping the receiver tells the engine's batch to
                // cancel the samples.
                return;
            }
            match event {
                Event::Tokens {
                    index,
                    tokens,
                    logprobs,
                    top_logprobs,
                } => {
                    let Some(choice) = choices.get_mut(index) else {
                        continue;
                    };
                    choice.push(&text, &tokens);
                    let piece = choice.release(&spec.holds).to_string();
                    writer.delta(
                        &text,
                        index,
                        choice,
                        &piece,
                        &tokens,
                        &logprobs,
                        &top_logprobs,
                    );
                }
                Event::Generation(g) => {
                    if let Some(choice) = choices.get_mut(g.sample_index) {
                        writer.finish(&text, choice, &g);
                    }
                    generations.push(g);
                }
                Event::Done => {
                    if writer.meta.include_usage {
                        let mut last = writer.chunk(json!([]));
                        last["usage"] = usage(prompt_len, &generations);
                        writer.send(last);
                    }
                    let _ = writer.out.send("[DONE]".to_string());
                    return;
                }
                Event::Failed(status, message) => {
                    writer.error(status, &message);
                    return;
                }
            }
        }
        writer.error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped before the samples were done",
        );
    });
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_tool_calls_parse_with_the_content_before_them() {
        let (content, calls) = parse_tool_calls(
            "Let me look.\n<tool_call>\n{\"name\": \"run_sql\", \"arguments\": {\"q\": \"SELECT 1\"}}\n</tool_call>",
        )
        .unwrap();
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls[0]["function"]["name"], "run_sql");
        assert_eq!(calls[0]["function"]["arguments"], "{\"q\":\"SELECT 1\"}");
        assert!(parse_tool_calls("no calls here").is_none());
        assert!(parse_tool_calls("<tool_call>not json</tool_call>").is_none());
    }

    /// Tokens fed one at a time: a character split across byte tokens waits for its last
    /// byte, and text that may start a held string waits until it cannot.
    #[test]
    fn streamed_text_waits_for_whole_characters_and_possible_stop_strings() {
        let texts = ["SELECT name FROM users WHERE age > 3".to_string()];
        let tokenizer = floe_model::embedded::train_embedded_tokenizer(&texts).unwrap();
        let text = Text {
            tokenizer,
            template: None,
        };
        let whole = "né WHERE café ENDING";
        let ids = text.tokenizer.encode(whole, false).unwrap();
        let e_acute = text.tokenizer.encode("é", false).unwrap();
        assert!(e_acute.len() > 1, "é is one token: {e_acute:?}");
        let holds = vec!["END".to_string()];
        let mut choice = ChoiceStream::default();
        let mut pieces = Vec::new();
        for &id in &ids {
            choice.push(&text, &[id]);
            let piece = choice.release(&holds).to_string();
            assert!(!piece.contains('\u{FFFD}'), "{piece:?} of {pieces:?}");
            pieces.push(piece);
        }
        // Some token ended inside é and gave nothing; the next one carried it whole.
        assert!(pieces.iter().any(String::is_empty), "{pieces:?}");
        assert!(pieces.iter().any(|p| p.contains('é')), "{pieces:?}");
        assert_eq!(pieces.concat(), "né WHERE café ", "{pieces:?}");
        // The engine cuts the content before the stop string: nothing more to send.
        assert_eq!(choice.rest_of("né WHERE café "), "");
        // Without the stop, the held text goes out at the end.
        assert_eq!(choice.rest_of(whole), "ENDING");
    }
}
