//! The REST routes around training and futures: `weights_info`, `training_runs*`,
//! `checkpoints` (list and delete), `retrieve_futures` and `cancel_future`. Runs and
//! checkpoints are read from disk ([`crate::runs`]), so they answer for what earlier
//! server processes saved too.

use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path as UrlPath, Query, State};
use axum::Json;
use serde_json::{json, Value};

use crate::api;
use crate::error::ApiError;
use crate::futures::{parse_request_id, request_id_string};
use crate::routes::{json_body, AppRef, Body};
use crate::runs::{self, RunRecord};
use crate::state::{AppState, CheckpointMeta, TinkerPath};

/// Page size of `GET /training_runs` when the client gives none (the SDK's default).
const DEFAULT_RUNS_PAGE: usize = 20;
/// Page size of the checkpoint listings when the client gives none (the SDK's default).
const DEFAULT_CHECKPOINTS_PAGE: usize = 100;

/// Records training run `model_id` (base model, adapters, the client's metadata) in its
/// run folder, where the listing routes find it after a restart too.
pub fn record_run(
    app: &AppState,
    model_id: &str,
    user_metadata: Option<&Value>,
) -> Result<(), ApiError> {
    let model = app.model(model_id)?;
    let lora_rank = model.lora.as_ref().map(|lora| lora.rank as u64);
    RunRecord::new(
        model_id,
        &model.base_model,
        lora_rank.is_some(),
        lora_rank,
        user_metadata,
    )
    .write(&app.config.data_dir)
}

/// `POST /weights_info`: what a checkpoint was trained from.
pub async fn weights_info(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::WeightsInfo = json_body("weights_info", body)?;
    let path = TinkerPath::parse(&request.tinker_path)?;
    let meta = CheckpointMeta::read(&app.checkpoint_dir(&path), &path)?;
    let run = RunRecord::read(&app.config.data_dir, &meta.model_id).ok();
    let mut info = json!({
        "base_model": meta.base_model,
        "is_lora": run.as_ref().is_some_and(|run| run.is_lora),
        "optimizer_config": { "type": "adamw" },
    });
    if let Some(rank) = run.and_then(|run| run.lora_rank) {
        info["lora_rank"] = json!(rank);
    }
    Ok(Json(info))
}

fn page(
    route: &str,
    query: Result<Query<api::Page>, QueryRejection>,
) -> Result<api::Page, ApiError> {
    query
        .map(|Query(page)| page)
        .map_err(|e| ApiError::bad_request(format!("{route}: {}", e.body_text())))
}

/// One page of `items` with Tinker's cursor.
fn paginate(items: Vec<Value>, page: &api::Page, default_limit: usize) -> (Vec<Value>, Value) {
    let limit = page.limit.unwrap_or(default_limit);
    let total = items.len();
    let items: Vec<Value> = items.into_iter().skip(page.offset).take(limit).collect();
    let cursor = json!({ "offset": page.offset, "limit": limit, "total_count": total });
    (items, cursor)
}

/// `GET /training_runs`: every run created on this data folder, newest first.
pub async fn list_training_runs(
    State(app): State<AppRef>,
    query: Result<Query<api::Page>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let page = page("training_runs", query)?;
    let data_dir = &app.config.data_dir;
    let runs = runs::list_runs(data_dir)
        .iter()
        .map(|run| run.to_json(data_dir))
        .collect::<Result<Vec<_>, _>>()?;
    let (runs, cursor) = paginate(runs, &page, DEFAULT_RUNS_PAGE);
    Ok(Json(json!({ "training_runs": runs, "cursor": cursor })))
}

/// `GET /training_runs/{id}`.
pub async fn get_training_run(
    State(app): State<AppRef>,
    UrlPath(run_id): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let data_dir = &app.config.data_dir;
    Ok(Json(RunRecord::read(data_dir, &run_id)?.to_json(data_dir)?))
}

/// `GET /training_runs/{id}/checkpoints`: the run's checkpoints, newest first.
pub async fn list_run_checkpoints(
    State(app): State<AppRef>,
    UrlPath(run_id): UrlPath<String>,
    query: Result<Query<api::Page>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let page = page("checkpoints", query)?;
    let data_dir = &app.config.data_dir;
    RunRecord::read(data_dir, &run_id)?;
    let checkpoints = runs::list_checkpoints(data_dir, &run_id)?
        .iter()
        .map(runs::CheckpointInfo::to_json)
        .collect();
    let (checkpoints, cursor) = paginate(checkpoints, &page, DEFAULT_CHECKPOINTS_PAGE);
    Ok(Json(
        json!({ "checkpoints": checkpoints, "cursor": cursor }),
    ))
}

/// `GET /checkpoints`: the checkpoints of every run, newest first.
pub async fn list_all_checkpoints(
    State(app): State<AppRef>,
    query: Result<Query<api::Page>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let page = page("checkpoints", query)?;
    let data_dir = &app.config.data_dir;
    let mut checkpoints = Vec::new();
    for run in runs::list_runs(data_dir) {
        checkpoints.extend(runs::list_checkpoints(data_dir, &run.training_run_id)?);
    }
    checkpoints.sort_by_key(|c| std::cmp::Reverse(c.time));
    let checkpoints = checkpoints
        .iter()
        .map(runs::CheckpointInfo::to_json)
        .collect();
    let (checkpoints, cursor) = paginate(checkpoints, &page, DEFAULT_CHECKPOINTS_PAGE);
    Ok(Json(
        json!({ "checkpoints": checkpoints, "cursor": cursor }),
    ))
}

/// `DELETE /training_runs/{id}/checkpoints/{kind}/{name}` (the checkpoint id is
/// `{weights|sampler_weights}/{name}`; the cookbook's rolling saves delete this way).
pub async fn delete_checkpoint(
    State(app): State<AppRef>,
    UrlPath((run_id, kind, name)): UrlPath<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let path = TinkerPath::parse(&format!("tinker://{run_id}/{kind}/{name}"))?;
    runs::delete_checkpoint(&app.checkpoint_dir(&path), &path)?;
    tracing::info!(%path, "checkpoint deleted");
    Ok(Json(
        json!({ "status": "deleted", "tinker_path": path.to_string() }),
    ))
}

/// Sample `seq_id`s of the `n`-th clone of a sampling client start at `n` times this
/// (the SDK's numbering), so each clone has its own completion log.
const CLONE_SEQ_STRIDE: u64 = 1_000_000_000;

/// The completion log of the sampling client that sent sample `seq_id`.
pub fn completion_log_key(sampling_session_id: &str, seq_id: u64) -> String {
    format!("{sampling_session_id}#{}", seq_id / CLONE_SEQ_STRIDE)
}

/// `POST /retrieve_futures`: the samples of one sampling client that finished since the
/// client's cursor, long-polled like `retrieve_future`; the client then fetches each
/// result with `retrieve_future`.
pub async fn retrieve_futures(
    State(app): State<AppRef>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let request: api::RetrieveFutures = json_body("retrieve_futures", body)?;
    let target = &request.target;
    if target.kind != "sampling_session" {
        return Err(ApiError::bad_request(format!(
            "retrieve_futures: target type {:?} is not supported; only sampling_session",
            target.kind
        )));
    }
    if !app
        .registry()
        .samplers
        .contains_key(&target.sampling_session_id)
    {
        return Err(ApiError::not_found(format!(
            "retrieve_futures: unknown sampling_session_id {:?}",
            target.sampling_session_id
        )));
    }
    let long_poll = app.config.long_poll;
    let wait = match request.timeout {
        // Beyond what a Duration holds is as good as forever, capped by the long poll.
        Some(secs) if secs.is_finite() && secs >= 0.0 => Duration::try_from_secs_f64(secs)
            .unwrap_or(Duration::MAX)
            .min(long_poll),
        Some(secs) => {
            return Err(ApiError::bad_request(format!(
                "retrieve_futures: timeout {secs} is not a number of seconds"
            )))
        }
        None => long_poll,
    };
    let key = completion_log_key(
        &target.sampling_session_id,
        target.cloned_sampler_id * CLONE_SEQ_STRIDE,
    );
    let (done, cursor) = app
        .futures
        .completions(&key, request.prev_cursor, wait)
        .await;
    let completions: Vec<Value> = done
        .iter()
        .map(|c| {
            let request_id = request_id_string(c.id);
            if c.failed {
                json!({ "state": "failed", "request_id": request_id })
            } else {
                json!({
                    "state": "finished",
                    "request_id": request_id,
                    "response_payload_uncompressed_size": c.payload_bytes,
                })
            }
        })
        .collect();
    Ok(Json(
        json!({ "completions": completions, "cursor": cursor }),
    ))
}

/// `POST /cancel_future`: a sample that has not started yet is dropped (its future
/// fails with `cancelled`); anything else runs to the end, as the protocol allows.
pub async fn cancel_future(State(app): State<AppRef>, body: Body) -> Result<Json<Value>, ApiError> {
    let request: api::CancelFuture = json_body("cancel_future", body)?;
    let id = parse_request_id(&request.request_id).ok_or_else(|| {
        ApiError::not_found(format!("unknown request_id {:?}", request.request_id))
    })?;
    let cancelled = app.futures.cancel(id);
    Ok(Json(
        json!({ "request_id": request.request_id, "cancelled": cancelled }),
    ))
}
