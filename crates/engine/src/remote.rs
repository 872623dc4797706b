//! [`RemoteEngine`]: the [`Engine`] verbs sent to `floe serve`'s native API
//! ([`crate::native_api`]) over blocking HTTP (feature `remote`), so `floe train
//! engine.remote=http://host:port` runs the loop here and the model on the server.
//!
//! The engine is created for a [`ModelSpec`] with [`EngineSettings`]; a caller that sends
//! its run's micro-batch budget and seeds gets the numbers a local engine would give (same
//! seed, same metrics on the same device).
//!
//! `save_state` leaves the state on the server and writes only its id into the folder
//! ([`REMOTE_STATE_FILE`]); `load_state` sends the id back, so resuming needs the same
//! server (its data folder). `export_hf` downloads the exported files.
//!
//! Samples: one `sample` call is one HTTP request, so the engine takes no requests while
//! it runs; [`Engine::sample_streaming`] and [`Engine::sample_joining`] are the trait's
//! defaults (finished samples only; one poll of the feed, its requests sampled as one
//! call). The server batches the requests of concurrent callers itself, and there they
//! join its engine's running batch.
//!
//! # A server restarted under a live run
//! A server that does not answer connections (restarting) is waited for, up to
//! [`RECONNECT_WAIT_ENV`] seconds (60 by default). A server that answers but no longer
//! has the engine (it restarted: engines live in memory, saved states on disk) gets it
//! back as it was when nothing changed it since it was created or since its state was
//! last saved or loaded: the engine is created again, that state loaded, and the request
//! sent again, so the run goes on exactly. When a training verb changed it since, those
//! changes are lost with the engine, and the verb fails with [`RemoteError::EngineLost`],
//! which names the saved state to resume from (a trainer with a checkpoint rewinds to it:
//! `engine.max_remote_recoveries`). A read-only request cut off mid-way (the server died
//! while it ran) is sent again the same way, and so is `load_state`, which replaces the
//! whole state; a seeded sample's samples already delivered are not delivered twice. A
//! training verb cut off mid-way fails with [`RemoteError::Transport`]: whether it ran is
//! unknown.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::native_api::{
    CreateEngineRequest, CreateEngineResponse, EngineSettings, ExportResponse, ForwardBackwardBody,
    ForwardBackwardResponse, ForwardBody, ForwardResponse, LoadStateBody, ModelSpec,
    OptimStepResponse, SampleBody, SampleEvent, SaveStateResponse, SyncResponse, NATIVE_PREFIX,
};
use crate::policy::{OptimParams, StepOutcome};
use crate::sampler::{Generation, SampleRequest};
use crate::verbs::{
    Engine, EngineInfo, ForwardBackwardOutput, Loss, SequenceGroup, TokenOutputs, TrainGroup,
    Weights,
};

/// Environment variable holding the API key sent as `X-API-Key` (kept out of configs,
/// which are saved in the run directory).
pub const API_KEY_ENV: &str = "FLOE_API_KEY";

/// File a remote `save_state` writes into its folder: the server and the saved state's id.
pub const REMOTE_STATE_FILE: &str = "remote_state.json";

/// How long connecting to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Environment variable: how many seconds to wait for a server that refuses connections
/// (e.g. while it restarts) before a request fails; 60 when unset.
pub const RECONNECT_WAIT_ENV: &str = "FLOE_RECONNECT_WAIT_SECS";

/// The first words of the server's 404 for an engine it does not hold.
const UNKNOWN_ENGINE: &str = "unknown engine_id";

/// What went wrong talking to the server.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// `engine.remote` is not a usable URL.
    #[error("engine.remote = {url:?}: {why}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong and how to fix it.
        why: String,
    },
    /// The request did not reach the server or its answer was cut off.
    #[error("{url}: {message}")]
    Transport {
        /// The request's URL.
        url: String,
        /// The client's error.
        message: String,
    },
    /// The server answered an error status; `detail` is its message.
    #[error("{url}: HTTP {status}: {detail}")]
    Status {
        /// The request's URL.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The server's `detail`, or its raw body.
        detail: String,
    },
    /// The answer is not what the native API sends.
    #[error("{url}: unexpected answer: {message}")]
    Protocol {
        /// The request's URL.
        url: String,
        /// What did not parse.
        message: String,
    },
    /// The engine failed while streaming samples.
    #[error("{url}: {message}")]
    Sample {
        /// The request's URL.
        url: String,
        /// The server's message.
        message: String,
    },
    /// The server no longer holds the engine (it restarted), and a training verb had
    /// changed the engine since it was created or last saved, so it cannot be rebuilt.
    #[error(
        "{server}: the server no longer has engine {engine_id} (it restarted?), and the \
         training done since {since} went with it; {resume}"
    )]
    EngineLost {
        /// The server.
        server: String,
        /// The lost engine's id.
        engine_id: String,
        /// Since when: the engine's creation or its last saved state.
        since: String,
        /// What to do.
        resume: String,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// What [`REMOTE_STATE_FILE`] holds.
#[derive(Debug, Serialize, Deserialize)]
struct RemoteState {
    /// The server that holds the state (for the reader's information).
    server: String,
    /// Its id there.
    state_id: String,
}

/// How to get the server's engine back as it is now, should the server lose it.
#[derive(Clone, Debug, PartialEq)]
enum Recovery {
    /// Nothing changed it since it was created: create it again.
    Create,
    /// Nothing changed it since this saved state was saved or loaded: create it again and
    /// load the state.
    Load(String),
    /// A training verb changed it since; the last state saved or loaded, if any.
    Lost(Option<String>),
}

/// An engine on a `floe serve` server; see the module docs.
pub struct RemoteEngine {
    agent: ureq::Agent,
    /// `http://host:port`, no trailing slash.
    server: String,
    api_key: Option<String>,
    /// What the engine was created from, to create it again.
    model: ModelSpec,
    settings: EngineSettings,
    engine_id: String,
    info: EngineInfo,
    recovery: Recovery,
    /// How long to wait for a server that refuses connections.
    reconnect_wait: Duration,
}

/// Whether a verb changes the engine's state (weights, optimizer, gradients, reference).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effect {
    ReadOnly,
    Trains,
    /// Replaces the whole state (`load_state`): a cut-off request is sent again, as a
    /// read-only one is, since sending it twice gives the same engine.
    Replaces,
}

impl RemoteEngine {
    /// Creates an engine for `model` on the server at `url` (`http://host:port`) and
    /// returns it with the model's tokenizer files (by file name).
    pub fn connect(
        url: &str,
        api_key: Option<String>,
        model: ModelSpec,
        settings: EngineSettings,
    ) -> std::result::Result<(Self, BTreeMap<String, String>), RemoteError> {
        let server = check_url(url)?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .build()
            .into();
        let reconnect_wait = reconnect_wait()?;
        let mut this = Self {
            agent,
            server,
            api_key,
            model,
            settings,
            engine_id: String::new(),
            info: EngineInfo {
                device: String::new(),
                vocab_size: 0,
                max_seq_len: 0,
            },
            recovery: Recovery::Create,
            reconnect_wait,
        };
        let tokenizer_files = this.create()?;
        Ok((this, tokenizer_files))
    }

    /// Creates the engine on the server from its model and settings; returns the
    /// tokenizer files.
    fn create(&mut self) -> std::result::Result<BTreeMap<String, String>, RemoteError> {
        let created: CreateEngineResponse = self.call_json(
            &format!("{}{NATIVE_PREFIX}/engines", self.server),
            &CreateEngineRequest {
                model: self.model.clone(),
                settings: self.settings.clone(),
            },
        )?;
        self.engine_id = created.engine_id;
        self.info = created.info;
        Ok(created.tokenizer_files)
    }

    /// Gets back the engine the server lost, as it was (see [`Recovery`]).
    fn recover(&mut self) -> std::result::Result<(), RemoteError> {
        let lost = self.engine_id.clone();
        match self.recovery.clone() {
            Recovery::Create => {
                self.create()?;
            }
            Recovery::Load(state_id) => {
                self.create()?;
                self.info =
                    self.call_json(&self.verb_url("load_state"), &LoadStateBody { state_id })?;
            }
            Recovery::Lost(saved) => {
                let (since, resume) = match saved {
                    Some(state_id) => (
                        format!("its state {state_id} was saved"),
                        format!(
                            "resume from the checkpoint whose engine/{REMOTE_STATE_FILE} names \
                             {state_id} (a run's latest: `floe train ... trainer.resume=latest`) \
                             on a server with the same data folder"
                        ),
                    ),
                    None => (
                        "it was created".to_string(),
                        "no saved state holds it: start the run again".to_string(),
                    ),
                };
                return Err(RemoteError::EngineLost {
                    server: self.server.clone(),
                    engine_id: lost,
                    since,
                    resume,
                });
            }
        }
        tracing::warn!(
            "{}: the server had lost engine {lost} (it restarted?); created it again as {} \
             from {:?}",
            self.server,
            self.engine_id,
            self.recovery
        );
        Ok(())
    }

    /// Sends `verb` through `call` (which posts to the URL it is given). When the server
    /// lost the engine, or cut off a read-only request, the engine is got back as it was
    /// and the verb sent again (module docs). A verb that trains marks the engine as
    /// changed since its last saved state.
    fn send_verb<R>(
        &mut self,
        verb: &str,
        effect: Effect,
        mut call: impl FnMut(&Self, &str) -> std::result::Result<R, RemoteError>,
    ) -> std::result::Result<R, RemoteError> {
        // A cut-off request may take a few tries to find the server gone (its connection
        // reset, then refused until it is back); the engine is got back once.
        const RESENDS: usize = 4;
        let before = self.recovery.clone();
        let (mut resent, mut recovered) = (0, false);
        loop {
            if effect != Effect::ReadOnly {
                self.recovery = match &before {
                    Recovery::Create => Recovery::Lost(None),
                    Recovery::Load(id) => Recovery::Lost(Some(id.clone())),
                    lost => lost.clone(),
                };
            }
            let error = match call(self, &self.verb_url(verb)) {
                Ok(answer) => return Ok(answer),
                Err(error) => error,
            };
            match &error {
                RemoteError::Status {
                    status: 404,
                    detail,
                    ..
                } if detail.starts_with(UNKNOWN_ENGINE) && !recovered => {
                    // The verb never ran: the engine the server lost was as before it.
                    self.recovery = before.clone();
                    self.recover()?;
                    recovered = true;
                }
                // It changed nothing, or what it changes does not depend on the engine's
                // state: send it again (to a restarted server, a later try answers 404 for
                // the engine).
                RemoteError::Transport { .. } if effect != Effect::Trains && resent < RESENDS => {
                    tracing::warn!("{error}; sending it again");
                    resent += 1;
                }
                _ => return Err(error),
            }
        }
    }

    /// The engine's id on the server.
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    fn verb_url(&self, verb: &str) -> String {
        format!(
            "{}{NATIVE_PREFIX}/engines/{}/{verb}",
            self.server, self.engine_id
        )
    }

    /// POSTs `body` as JSON and returns the raw answer after checking its status; a
    /// server that refuses the connection is waited for (`reconnect_wait`).
    fn post(
        &self,
        url: &str,
        body: &impl Serialize,
    ) -> std::result::Result<ureq::http::Response<ureq::Body>, RemoteError> {
        let body = serde_json::to_vec(body).map_err(|e| RemoteError::Protocol {
            url: url.to_string(),
            message: format!("the request does not serialise: {e}"),
        })?;
        let started = Instant::now();
        let mut pause = Duration::from_millis(50);
        loop {
            let mut request = self
                .agent
                .post(url)
                .header("content-type", "application/json");
            if let Some(key) = &self.api_key {
                request = request.header("x-api-key", key);
            }
            match request.send(&body[..]) {
                Ok(response) => return checked(url, response),
                Err(error) if refused(&error) && started.elapsed() < self.reconnect_wait => {
                    if pause == Duration::from_millis(50) {
                        tracing::warn!(
                            "{url}: {error}; waiting up to {:?} for the server",
                            self.reconnect_wait
                        );
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(error) => return Err(transport(url, error)),
            }
        }
    }

    /// POSTs `body` and parses the JSON answer.
    fn call_json<R: DeserializeOwned>(
        &self,
        url: &str,
        body: &impl Serialize,
    ) -> std::result::Result<R, RemoteError> {
        let mut response = self.post(url, body)?;
        let mut bytes = Vec::new();
        response
            .body_mut()
            .as_reader()
            .read_to_end(&mut bytes)
            .map_err(|e| transport(url, e))?;
        serde_json::from_slice(&bytes).map_err(|e| RemoteError::Protocol {
            url: url.to_string(),
            message: e.to_string(),
        })
    }

    /// Sends `verb` with `body` ([`RemoteEngine::send_verb`]) and parses the answer.
    fn verb<R: DeserializeOwned>(
        &mut self,
        verb: &str,
        effect: Effect,
        body: &impl Serialize,
    ) -> std::result::Result<R, RemoteError> {
        self.send_verb(verb, effect, |this, url| this.call_json(url, body))
    }

    /// Streams `url`'s body into `path` (through a temporary file, renamed when whole).
    fn download(&self, url: &str, path: &Path) -> std::result::Result<u64, RemoteError> {
        let mut request = self.agent.get(url);
        if let Some(key) = &self.api_key {
            request = request.header("x-api-key", key);
        }
        let response = request.call().map_err(|e| transport(url, e))?;
        let mut response = checked(url, response)?;
        let partial = path.with_extension("partial");
        let io = |source| RemoteError::Io {
            path: partial.clone(),
            source,
        };
        let mut file = std::fs::File::create(&partial).map_err(io)?;
        let bytes = std::io::copy(&mut response.body_mut().as_reader(), &mut file)
            .map_err(|e| transport(url, e))?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&partial, path).map_err(|source| RemoteError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(bytes)
    }
}

/// `http://host:port` without a trailing slash, or why `url` is not one.
fn check_url(url: &str) -> std::result::Result<String, RemoteError> {
    let bad = |why: &str| RemoteError::Url {
        url: url.to_string(),
        why: why.to_string(),
    };
    let trimmed = url.trim_end_matches('/');
    if trimmed.starts_with("https://") {
        return Err(bad(
            "https is not supported by this build (plain HTTP only); reach the server over \
             http://, e.g. through an SSH tunnel",
        ));
    }
    match trimmed.strip_prefix("http://") {
        Some(rest) if rest.contains('/') => Err(bad(
            "give the server's root as http://host:port, without a path",
        )),
        Some(rest) if !rest.is_empty() => Ok(trimmed.to_string()),
        _ => Err(bad("expected http://host:port")),
    }
}

/// Whether the request never reached a server: nothing listens at its address (yet).
fn refused(error: &ureq::Error) -> bool {
    match error {
        ureq::Error::Io(e) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        ureq::Error::ConnectionFailed => true,
        _ => false,
    }
}

/// How long to wait for a server that refuses connections ([`RECONNECT_WAIT_ENV`]).
fn reconnect_wait() -> std::result::Result<Duration, RemoteError> {
    match std::env::var(RECONNECT_WAIT_ENV) {
        Err(_) => Ok(Duration::from_secs(60)),
        Ok(text) => text
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|secs| secs.is_finite() && *secs >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| RemoteError::Url {
                url: format!("{RECONNECT_WAIT_ENV}={text}"),
                why: "expected a number of seconds, 0 or more".to_string(),
            }),
    }
}

fn transport(url: &str, error: impl std::fmt::Display) -> RemoteError {
    RemoteError::Transport {
        url: url.to_string(),
        message: error.to_string(),
    }
}

/// The response when its status is a success, else the server's error as
/// [`RemoteError::Status`].
fn checked(
    url: &str,
    mut response: ureq::http::Response<ureq::Body>,
) -> std::result::Result<ureq::http::Response<ureq::Body>, RemoteError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = response
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| format!("(the error body could not be read: {e})"));
    let detail = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_string))
        .unwrap_or(text);
    Err(RemoteError::Status {
        url: url.to_string(),
        status: status.as_u16(),
        detail,
    })
}

impl Drop for RemoteEngine {
    /// Frees the server's engine; a server that is gone has nothing to free.
    fn drop(&mut self) {
        if self.engine_id.is_empty() {
            return;
        }
        let url = format!("{}{NATIVE_PREFIX}/engines/{}", self.server, self.engine_id);
        let mut request = self.agent.delete(&url);
        if let Some(key) = &self.api_key {
            request = request.header("x-api-key", key);
        }
        if let Err(error) = request.call() {
            tracing::debug!("freeing remote engine {}: {error}", self.engine_id);
        }
    }
}

impl Engine for RemoteEngine {
    type Error = RemoteError;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn sample(
        &mut self,
        requests: Vec<SampleRequest>,
        on_generation: &mut dyn FnMut(Generation),
    ) -> std::result::Result<(), RemoteError> {
        let body = SampleBody { requests };
        // Samples delivered before a cut-off, not delivered again when it is sent again.
        let mut delivered = HashSet::new();
        self.send_verb("sample", Effect::ReadOnly, |this, url| {
            let mut response = this.post(url, &body)?;
            let lines = BufReader::new(response.body_mut().as_reader());
            for line in lines.lines() {
                let line = line.map_err(|e| transport(url, e))?;
                if line.is_empty() {
                    continue;
                }
                let event: SampleEvent =
                    serde_json::from_str(&line).map_err(|e| RemoteError::Protocol {
                        url: url.to_string(),
                        message: format!("sample stream line {line:?}: {e}"),
                    })?;
                match event {
                    SampleEvent::Generation(generation) => {
                        if delivered.insert((generation.request_id, generation.sample_index)) {
                            on_generation(generation);
                        }
                    }
                    SampleEvent::Done {} => return Ok(()),
                    SampleEvent::Error(message) => {
                        return Err(RemoteError::Sample {
                            url: url.to_string(),
                            message,
                        })
                    }
                }
            }
            Err(RemoteError::Transport {
                url: url.to_string(),
                message: "the sample stream ended before its `done` line (the server's engine \
                          stopped or the connection dropped)"
                    .to_string(),
            })
        })
    }

    fn forward(
        &mut self,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> std::result::Result<Vec<Vec<TokenOutputs>>, RemoteError> {
        let body = ForwardBody {
            groups: groups.to_vec(),
            weights,
            temperature,
        };
        let answer: ForwardResponse = self.verb("forward", Effect::ReadOnly, &body)?;
        Ok(answer.outputs)
    }

    fn forward_backward(
        &mut self,
        groups: &[TrainGroup],
        loss: &Loss,
        temperature: f32,
    ) -> std::result::Result<ForwardBackwardOutput, RemoteError> {
        let body = ForwardBackwardBody {
            groups: groups.to_vec(),
            loss: loss.clone(),
            temperature,
        };
        let answer: ForwardBackwardResponse =
            self.verb("forward_backward", Effect::Trains, &body)?;
        Ok(answer.into())
    }

    fn optim_step(
        &mut self,
        params: &OptimParams,
    ) -> std::result::Result<StepOutcome, RemoteError> {
        let answer: OptimStepResponse = self.verb("optim_step", Effect::Trains, params)?;
        Ok(answer.into())
    }

    fn sync_sampler_weights(&mut self) -> std::result::Result<Duration, RemoteError> {
        let answer: SyncResponse = self.verb(
            "sync_sampler_weights",
            Effect::ReadOnly,
            &serde_json::json!({}),
        )?;
        Ok(Duration::from_secs_f64(answer.seconds.max(0.0)))
    }

    fn freeze_reference(&mut self) -> std::result::Result<(), RemoteError> {
        let _: serde_json::Value =
            self.verb("freeze_reference", Effect::Trains, &serde_json::json!({}))?;
        Ok(())
    }

    fn reset_optimizer(&mut self) -> std::result::Result<(), RemoteError> {
        let _: serde_json::Value =
            self.verb("reset_optimizer", Effect::Trains, &serde_json::json!({}))?;
        Ok(())
    }

    fn save_state(&mut self, dir: &Path) -> std::result::Result<(), RemoteError> {
        let answer: SaveStateResponse =
            self.verb("save_state", Effect::ReadOnly, &serde_json::json!({}))?;
        self.recovery = Recovery::Load(answer.state_id.clone());
        let record = RemoteState {
            server: self.server.clone(),
            state_id: answer.state_id,
        };
        let text = serde_json::to_string_pretty(&record).expect("the record serialises");
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| RemoteError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(REMOTE_STATE_FILE);
        let partial = path.with_extension("partial");
        std::fs::write(&partial, text + "\n").map_err(io(&partial))?;
        std::fs::rename(&partial, &path).map_err(io(&path))
    }

    fn load_state(&mut self, dir: &Path) -> std::result::Result<(), RemoteError> {
        let path = dir.join(REMOTE_STATE_FILE);
        let text = std::fs::read_to_string(&path).map_err(|source| RemoteError::Io {
            path: path.clone(),
            source,
        })?;
        let record: RemoteState =
            serde_json::from_str(&text).map_err(|e| RemoteError::Protocol {
                url: path.display().to_string(),
                message: e.to_string(),
            })?;
        if record.server != self.server {
            tracing::warn!(
                "{}: the state was saved on {}; loading it from {}",
                path.display(),
                record.server,
                self.server
            );
        }
        let body = LoadStateBody {
            state_id: record.state_id.clone(),
        };
        // Whatever the engine held is replaced: a lost engine is simply created again.
        self.recovery = Recovery::Create;
        self.info = self.verb("load_state", Effect::Replaces, &body)?;
        self.recovery = Recovery::Load(record.state_id);
        Ok(())
    }

    fn export_hf(&mut self, dir: &Path) -> std::result::Result<(), RemoteError> {
        let export: ExportResponse =
            self.verb("export_hf", Effect::ReadOnly, &serde_json::json!({}))?;
        std::fs::create_dir_all(dir).map_err(|source| RemoteError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for file in &export.files {
            let plain = !file.name.is_empty()
                && !file.name.starts_with('.')
                && !file.name.contains(['/', '\\']);
            let url = format!(
                "{}{NATIVE_PREFIX}/exports/{}/{}",
                self.server, export.export_id, file.name
            );
            if !plain {
                return Err(RemoteError::Protocol {
                    url,
                    message: format!("export file name {:?} is not a plain name", file.name),
                });
            }
            let got = self.download(&url, &dir.join(&file.name))?;
            if got != file.bytes {
                return Err(RemoteError::Transport {
                    url,
                    message: format!("got {got} bytes of {}", file.bytes),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert_eq!(
            check_url("http://127.0.0.1:8000/").unwrap(),
            "http://127.0.0.1:8000"
        );
        for (url, why) in [
            ("https://host:1", "https is not supported"),
            ("http://host:1/api", "without a path"),
            ("host:1", "expected http://host:port"),
            ("http://", "expected http://host:port"),
        ] {
            let err = check_url(url).unwrap_err().to_string();
            assert!(err.contains(why), "{url}: {err}");
        }
    }
}
