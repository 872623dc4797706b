//! `floe serve`: the Tinker-protocol HTTP server over the engine's [`Engine`] verbs, so
//! the unmodified `tinker` SDK and cookbook can train and sample floe models.
//!
//! Each created model gets its own [`LocalEngine`] on its own thread; its requests run
//! strictly in `seq_id` order, so gradients of several `forward_backward` calls
//! accumulate until `optim_step`. Slow requests are futures that clients long-poll with
//! `retrieve_future`. See `docs/server.md` for the routes, the design and what is next.
//!
//! [`Engine`]: floe_engine::Engine
//! [`LocalEngine`]: floe_engine::LocalEngine

#![deny(missing_docs)]

pub mod api;
pub mod catalog;
pub mod convert;
pub mod error;
pub mod futures;
pub mod keys;
pub mod native;
pub mod openai;
pub mod proto;
pub mod rest;
pub mod routes;
pub mod runs;
pub mod sample_batch;
pub mod state;
pub mod worker;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::Router;

pub use catalog::Catalog;
pub use keys::ApiKeys;
pub use sample_batch::SampleBatchLimits;
pub use state::{Auth, ServerConfig};

use crate::error::ApiError;
use crate::routes::AppRef;
use crate::state::AppState;

/// Header carrying the client's API key.
pub const API_KEY_HEADER: &str = "x-api-key";

/// The router of every route over fresh state.
pub fn router(config: ServerConfig) -> Router {
    let max_body = config.max_body_bytes;
    let app: AppRef = Arc::new(AppState::new(config));
    spawn_expiry(&app);
    let api = Router::new()
        .route("/client/config", post(routes::client_config))
        .route("/client/dynamic_config", post(routes::dynamic_config))
        .route("/create_session", post(routes::create_session))
        .route("/session_heartbeat", post(routes::session_heartbeat))
        .route(
            "/sessions/{session_id}/finish",
            post(routes::finish_session),
        )
        .route("/telemetry", post(routes::telemetry))
        .route("/get_server_capabilities", get(routes::capabilities))
        .route("/create_model", post(routes::create_model))
        .route("/get_info", post(routes::get_info))
        .route("/forward_backward", post(routes::forward_backward))
        .route("/optim_step", post(routes::optim_step))
        .route("/save_weights", post(routes::save_weights))
        .route(
            "/save_weights_for_sampler",
            post(routes::save_weights_for_sampler),
        )
        .route("/load_weights", post(routes::load_weights))
        .route(
            "/create_sampling_session",
            post(routes::create_sampling_session),
        )
        .route("/samplers/{sampler_id}", get(routes::get_sampler))
        .route("/asample", post(routes::asample))
        .route("/retrieve_future", post(routes::retrieve_future))
        .route("/retrieve_futures", post(rest::retrieve_futures))
        .route("/cancel_future", post(rest::cancel_future))
        .route("/weights_info", post(rest::weights_info))
        .route("/training_runs", get(rest::list_training_runs))
        .route("/training_runs/{run_id}", get(rest::get_training_run))
        .route(
            "/training_runs/{run_id}/checkpoints",
            get(rest::list_run_checkpoints),
        )
        .route(
            "/training_runs/{run_id}/checkpoints/{kind}/{name}",
            delete(rest::delete_checkpoint),
        )
        .route("/checkpoints", get(rest::list_all_checkpoints))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&app),
            authenticate,
        ))
        // Health checks need no key.
        .route("/healthz", get(routes::healthz));
    let native = native::router(Arc::clone(&app)).route_layer(middleware::from_fn_with_state(
        Arc::clone(&app),
        authenticate,
    ));
    Router::new()
        .nest("/api/v1", api)
        .nest("/v1", openai::router(Arc::clone(&app)))
        .nest(floe_engine::native_api::NATIVE_PREFIX, native)
        .fallback(|| async {
            ApiError::not_found(
                "no such route; the Tinker API lives under /api/v1/, the OpenAI-compatible one under /v1/, floe's native API under /floe/v1/",
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(app)
}

/// Serves [`router`] on `listener` until the process ends. An insecure (keyless) server
/// must listen on a loopback address.
pub async fn serve(listener: tokio::net::TcpListener, config: ServerConfig) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    match &config.auth {
        Auth::InsecureLoopback if !addr.ip().is_loopback() => {
            anyhow::bail!("refusing to serve without API keys on {addr}: --insecure-loopback needs a loopback host such as 127.0.0.1")
        }
        Auth::Keys(keys) if keys.is_empty() => {
            anyhow::bail!("no API keys: give --api-key-file or FLOE_API_KEYS, or --insecure-loopback on 127.0.0.1")
        }
        _ => {}
    }
    tracing::info!("floe serve listening on http://{addr}/api/v1");
    axum::serve(listener, router(config)).await?;
    Ok(())
}

/// 401 unless the request carries an accepted key ([`check_key`]).
async fn authenticate(
    State(app): State<AppRef>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    check_key(&app, request.headers())?;
    Ok(next.run(request).await)
}

/// Accepts a request whose `X-API-Key` or `Authorization: Bearer <key>` (what OpenAI
/// clients send) is a key of this server; any key on a keyless loopback server.
pub(crate) fn check_key(app: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Auth::Keys(keys) = &app.config.auth else {
        return Ok(());
    };
    let key = headers
        .get(API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim)
        });
    match key {
        Some(key) if keys.accepts(key) => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "the API key (X-API-Key or Authorization: Bearer) is not accepted by this server",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "missing API key: send an X-API-Key header or Authorization: Bearer <key>",
        )),
    }
}

/// Drops expired futures and sessions in the background, a few times per expiry period.
fn spawn_expiry(app: &AppRef) {
    let app = Arc::clone(app);
    let session_expiry = app.config.session_expiry;
    let period = (app.futures.expiry().min(session_expiry) / 4).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(30),
    );
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(period);
            loop {
                ticks.tick().await;
                app.futures.expire();
                routes::expire_sessions(&app, session_expiry);
            }
        });
    }
}

/// Binds `host:port` and runs [`serve`] on a multi-threaded runtime of its own, for
/// callers without one (the CLI).
pub fn serve_blocking(host: &str, port: u16, config: ServerConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((host, port))
            .await
            .map_err(|e| anyhow::anyhow!("binding {host}:{port}: {e}"))?;
        serve(listener, config).await
    })
}
