//! Training runs and their checkpoints as the REST routes (`training_runs*`,
//! `checkpoints`, `weights_info`) list them. Everything is read from the checkpoint
//! folders, so runs and checkpoints outlive the server process: a restarted server lists
//! and loads what an earlier one saved.
//!
//! A run is a training model: `{data_dir}/checkpoints/{run_id}/` holds its
//! [`RunRecord`] and one folder per saved checkpoint
//! (`{weights|sampler_weights}/{name}/`, see [`crate::state::TinkerPath`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::state::{TinkerPath, WeightsKind, META_FILE};

/// File of a [`RunRecord`] in its run folder.
const RUN_FILE: &str = "floe-run.json";

/// What a run records about itself when its model is created.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    /// The training model's id (`{session}:train:{n}`).
    pub training_run_id: String,
    /// The base model name the client asked for.
    pub base_model: String,
    /// Whether the run trains adapters.
    pub is_lora: bool,
    /// The adapters' rank, when it does.
    pub lora_rank: Option<u64>,
    /// The client's `user_metadata`, values as text (Tinker's `TrainingRun` holds
    /// `dict[str, str]`; the cookbook reads `renderer_name` back from it on resume).
    pub user_metadata: BTreeMap<String, String>,
}

/// One saved checkpoint of a run.
#[derive(Debug, Clone)]
pub struct CheckpointInfo {
    /// Where it lives.
    pub path: TinkerPath,
    /// When its save finished.
    pub time: SystemTime,
    /// Bytes of every file in it.
    pub size_bytes: u64,
}

/// The folder of run `run_id`, checking the id is one folder name.
pub fn run_dir(data_dir: &Path, run_id: &str) -> Result<PathBuf, ApiError> {
    let bad =
        run_id.is_empty() || run_id == "." || run_id == ".." || run_id.contains(['/', '\\', '\0']);
    if bad {
        return Err(ApiError::bad_request(format!(
            "training run id {run_id:?} must be one non-empty folder name"
        )));
    }
    Ok(data_dir.join("checkpoints").join(run_id))
}

impl RunRecord {
    /// A record of a new run; metadata values that are not strings keep their JSON text.
    pub fn new(
        training_run_id: &str,
        base_model: &str,
        is_lora: bool,
        lora_rank: Option<u64>,
        user_metadata: Option<&Value>,
    ) -> Self {
        let user_metadata = match user_metadata {
            Some(Value::Object(map)) => map
                .iter()
                .map(|(key, value)| {
                    let text = match value {
                        Value::String(text) => text.clone(),
                        other => other.to_string(),
                    };
                    (key.clone(), text)
                })
                .collect(),
            _ => BTreeMap::new(),
        };
        Self {
            training_run_id: training_run_id.to_string(),
            base_model: base_model.to_string(),
            is_lora,
            lora_rank,
            user_metadata,
        }
    }

    /// Writes the record into its run folder under `data_dir`.
    pub fn write(&self, data_dir: &Path) -> Result<(), ApiError> {
        let dir = run_dir(data_dir, &self.training_run_id)?;
        let file = dir.join(RUN_FILE);
        let text = serde_json::to_vec_pretty(self).expect("a run record serializes");
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&file, text))
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("writing {}: {e}", file.display()),
                )
            })
    }

    /// Reads run `run_id`; 404 when no such run was ever created here.
    pub fn read(data_dir: &Path, run_id: &str) -> Result<Self, ApiError> {
        let file = run_dir(data_dir, run_id)?.join(RUN_FILE);
        let text = std::fs::read(&file)
            .map_err(|_| ApiError::not_found(format!("unknown training run {run_id:?}")))?;
        serde_json::from_slice(&text).map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{}: {e}", file.display()),
            )
        })
    }

    /// When the run was created (its record's modification time).
    fn created(&self, data_dir: &Path) -> SystemTime {
        run_dir(data_dir, &self.training_run_id)
            .ok()
            .and_then(|dir| std::fs::metadata(dir.join(RUN_FILE)).ok())
            .and_then(|meta| meta.modified().ok())
            .unwrap_or(UNIX_EPOCH)
    }

    /// The `TrainingRun` JSON: the last request time is the newest of its creation and
    /// its checkpoints (the server keeps no per-request clock on disk).
    pub fn to_json(&self, data_dir: &Path) -> Result<Value, ApiError> {
        let checkpoints = list_checkpoints(data_dir, &self.training_run_id)?;
        let newest = |kind: WeightsKind| {
            checkpoints
                .iter()
                .find(|c| c.path.kind == kind)
                .map(CheckpointInfo::to_json)
        };
        let last = checkpoints
            .iter()
            .map(|c| c.time)
            .chain([self.created(data_dir)])
            .max()
            .unwrap_or(UNIX_EPOCH);
        let mut run = json!({
            "training_run_id": self.training_run_id,
            "base_model": self.base_model,
            "model_owner": "floe",
            "is_lora": self.is_lora,
            "corrupted": false,
            "last_request_time": rfc3339(last),
            "user_metadata": self.user_metadata,
        });
        if let Some(rank) = self.lora_rank {
            run["lora_rank"] = json!(rank);
        }
        if let Some(checkpoint) = newest(WeightsKind::Weights) {
            run["last_checkpoint"] = checkpoint;
        }
        if let Some(checkpoint) = newest(WeightsKind::SamplerWeights) {
            run["last_sampler_checkpoint"] = checkpoint;
        }
        Ok(run)
    }
}

/// Every run created under `data_dir`, newest first.
pub fn list_runs(data_dir: &Path) -> Vec<RunRecord> {
    let Ok(entries) = std::fs::read_dir(data_dir.join("checkpoints")) else {
        return Vec::new();
    };
    let mut runs: Vec<(SystemTime, RunRecord)> = entries
        .filter_map(|entry| {
            let name = entry.ok()?.file_name().into_string().ok()?;
            let run = RunRecord::read(data_dir, &name).ok()?;
            Some((run.created(data_dir), run))
        })
        .collect();
    runs.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then_with(|| a.1.training_run_id.cmp(&b.1.training_run_id))
    });
    runs.into_iter().map(|(_, run)| run).collect()
}

/// The finished checkpoints of run `run_id`, newest first (a folder without its meta
/// file is a save in progress or a failed one, and is left out).
pub fn list_checkpoints(data_dir: &Path, run_id: &str) -> Result<Vec<CheckpointInfo>, ApiError> {
    let dir = run_dir(data_dir, run_id)?;
    let mut checkpoints = Vec::new();
    for kind in [WeightsKind::Weights, WeightsKind::SamplerWeights] {
        let Ok(entries) = std::fs::read_dir(dir.join(kind.dir_name())) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let Ok(time) =
                std::fs::metadata(entry.path().join(META_FILE)).and_then(|meta| meta.modified())
            else {
                continue;
            };
            checkpoints.push(CheckpointInfo {
                path: TinkerPath::new(run_id, kind, &name)?,
                time,
                size_bytes: folder_size(&entry.path()),
            });
        }
    }
    checkpoints.sort_by(|a, b| {
        b.time
            .cmp(&a.time)
            .then_with(|| a.path.name.cmp(&b.path.name))
    });
    Ok(checkpoints)
}

/// Deletes the checkpoint folder of `path`; 404 when there is none.
pub fn delete_checkpoint(checkpoint_dir: &Path, path: &TinkerPath) -> Result<(), ApiError> {
    if !checkpoint_dir.is_dir() {
        return Err(ApiError::not_found(format!("no checkpoint at {path}")));
    }
    std::fs::remove_dir_all(checkpoint_dir).map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("deleting {path}: {e}"),
        )
    })
}

impl CheckpointInfo {
    /// The `Checkpoint` JSON.
    pub fn to_json(&self) -> Value {
        let checkpoint_type = match self.path.kind {
            WeightsKind::Weights => "training",
            WeightsKind::SamplerWeights => "sampler",
        };
        json!({
            "checkpoint_id": format!("{}/{}", self.path.kind.dir_name(), self.path.name),
            "checkpoint_type": checkpoint_type,
            "time": rfc3339(self.time),
            "tinker_path": self.path.to_string(),
            "size_bytes": self.size_bytes,
            "public": false,
        })
    }
}

fn folder_size(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => folder_size(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

/// A time as RFC 3339 UTC with whole seconds (`2026-12-03T07:30:00Z`).
pub fn rfc3339(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let of_day = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`: 400-year eras starting in March, so leap days fall at era ends).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let at = |secs| rfc3339(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(1_700_000_000), "2023-11-14T22:13:20Z");
        // Leap days: 2000 is a leap year (divisible by 400), 2100 is not.
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(4_107_542_400), "2100-03-01T00:00:00Z");
        assert_eq!(at(1_798_761_599), "2026-12-31T23:59:59Z");
    }

    #[test]
    fn run_ids_must_be_one_folder_name() {
        let data = Path::new("/data");
        assert!(run_dir(data, "sess-1:train:0").is_ok());
        for bad in ["", "..", "a/b", "a\\b"] {
            let error = run_dir(data, bad).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn metadata_values_are_kept_as_text() {
        let metadata = json!({"renderer_name": "role_colon", "step": 3, "nested": {"a": true}});
        let run = RunRecord::new("r", "base", false, None, Some(&metadata));
        assert_eq!(run.user_metadata["renderer_name"], "role_colon");
        assert_eq!(run.user_metadata["step"], "3");
        assert_eq!(run.user_metadata["nested"], r#"{"a":true}"#);
    }
}
