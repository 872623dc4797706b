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

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// An engine on a `floe serve` server; see the module docs.
pub struct RemoteEngine {
    agent: ureq::Agent,
    /// `http://host:port`, no trailing slash.
    server: String,
    api_key: Option<String>,
    engine_id: String,
    info: EngineInfo,
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
        let mut this = Self {
            agent,
            server,
            api_key,
            engine_id: String::new(),
            info: EngineInfo {
                device: String::new(),
                vocab_size: 0,
                max_seq_len: 0,
            },
        };
        let created: CreateEngineResponse = this.call_json(
            &format!("{}{NATIVE_PREFIX}/engines", this.server),
            &CreateEngineRequest { model, settings },
        )?;
        this.engine_id = created.engine_id;
        this.info = created.info;
        Ok((this, created.tokenizer_files))
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

    /// POSTs `body` as JSON and returns the raw answer after checking its status.
    fn post(
        &self,
        url: &str,
        body: &impl Serialize,
    ) -> std::result::Result<ureq::http::Response<ureq::Body>, RemoteError> {
        let body = serde_json::to_vec(body).map_err(|e| RemoteError::Protocol {
            url: url.to_string(),
            message: format!("the request does not serialise: {e}"),
        })?;
        let mut request = self
            .agent
            .post(url)
            .header("content-type", "application/json");
        if let Some(key) = &self.api_key {
            request = request.header("x-api-key", key);
        }
        let response = request.send(&body[..]).map_err(|e| transport(url, e))?;
        checked(url, response)
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

    fn verb<R: DeserializeOwned>(
        &self,
        verb: &str,
        body: &impl Serialize,
    ) -> std::result::Result<R, RemoteError> {
        self.call_json(&self.verb_url(verb), body)
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
        let url = self.verb_url("sample");
        let mut response = self.post(&url, &SampleBody { requests })?;
        let lines = BufReader::new(response.body_mut().as_reader());
        for line in lines.lines() {
            let line = line.map_err(|e| transport(&url, e))?;
            if line.is_empty() {
                continue;
            }
            let event: SampleEvent =
                serde_json::from_str(&line).map_err(|e| RemoteError::Protocol {
                    url: url.clone(),
                    message: format!("sample stream line {line:?}: {e}"),
                })?;
            match event {
                SampleEvent::Generation(generation) => on_generation(generation),
                SampleEvent::Done {} => return Ok(()),
                SampleEvent::Error(message) => return Err(RemoteError::Sample { url, message }),
            }
        }
        Err(RemoteError::Transport {
            url,
            message: "the sample stream ended before its `done` line (the server's engine \
                      stopped or the connection dropped)"
                .to_string(),
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
        let answer: ForwardResponse = self.verb("forward", &body)?;
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
        let answer: ForwardBackwardResponse = self.verb("forward_backward", &body)?;
        Ok(answer.into())
    }

    fn optim_step(
        &mut self,
        params: &OptimParams,
    ) -> std::result::Result<StepOutcome, RemoteError> {
        let answer: OptimStepResponse = self.verb("optim_step", params)?;
        Ok(answer.into())
    }

    fn sync_sampler_weights(&mut self) -> std::result::Result<Duration, RemoteError> {
        let answer: SyncResponse = self.verb("sync_sampler_weights", &serde_json::json!({}))?;
        Ok(Duration::from_secs_f64(answer.seconds.max(0.0)))
    }

    fn freeze_reference(&mut self) -> std::result::Result<(), RemoteError> {
        let _: serde_json::Value = self.verb("freeze_reference", &serde_json::json!({}))?;
        Ok(())
    }

    fn reset_optimizer(&mut self) -> std::result::Result<(), RemoteError> {
        let _: serde_json::Value = self.verb("reset_optimizer", &serde_json::json!({}))?;
        Ok(())
    }

    fn save_state(&mut self, dir: &Path) -> std::result::Result<(), RemoteError> {
        let answer: SaveStateResponse = self.verb("save_state", &serde_json::json!({}))?;
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
        self.info = self.verb(
            "load_state",
            &LoadStateBody {
                state_id: record.state_id,
            },
        )?;
        Ok(())
    }

    fn export_hf(&mut self, dir: &Path) -> std::result::Result<(), RemoteError> {
        let export: ExportResponse = self.verb("export_hf", &serde_json::json!({}))?;
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
