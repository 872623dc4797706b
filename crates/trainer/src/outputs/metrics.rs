//! Per-step metrics: `metrics.jsonl` in the run directory, plus TensorBoard event files.
//!
//! Each line of `metrics.jsonl` is one call of [`MetricsSink::log`]:
//! `{"step": 3, "time": 1764670000.5, "metrics": {"reward/avg_raw_reward": 0.25, …}}`, with
//! `time` in seconds since the Unix epoch and non-finite values written as `null`. A step may
//! have several lines (training metrics, then eval metrics). The file is the source of truth
//! for the HTML report, so `floe report RUN_DIR` can rebuild it at any time.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::tensorboard::{self, EventWriter};
use crate::config::Logger;

/// File name of the metrics log inside a run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Folder of the TensorBoard event files inside a run directory.
pub const TENSORBOARD_DIR: &str = "tensorboard";

/// Why metrics could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line of `metrics.jsonl` is not a metrics record.
    #[error("{path}:{line}: not a metrics record ({message}); each line must be {{\"step\": N, \"time\": T, \"metrics\": {{…}}}}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The JSON parser's message.
        message: String,
    },
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MetricsRecord {
    /// The RL step the metrics belong to (0 = before training).
    pub step: u64,
    /// Seconds since the Unix epoch when the line was written.
    pub time: f64,
    /// Metric name (SkyRL names: `reward/avg_raw_reward`, `timing/step`, …) to value;
    /// `NaN` stands for a non-finite value, stored as `null`.
    #[serde(with = "nullable_values")]
    pub metrics: BTreeMap<String, f64>,
}

/// Writes every logged step to `metrics.jsonl` and, if enabled, TensorBoard.
pub struct MetricsSink {
    jsonl: File,
    jsonl_path: PathBuf,
    tensorboard: Option<EventWriter>,
}

impl MetricsSink {
    /// Opens the sinks of `run_dir`: `metrics.jsonl` and TensorBoard events under
    /// `run_dir/tensorboard/`. See [`MetricsSink::create_with`] for what `resume_step` does.
    pub fn create(run_dir: &Path, resume_step: Option<u64>) -> Result<MetricsSink, MetricsError> {
        MetricsSink::create_with(run_dir, resume_step, &[Logger::Tensorboard])
    }

    /// Opens `metrics.jsonl` plus the sinks named in `loggers` (`trainer.logger`; `console`
    /// is the caller's progress display and ignored here).
    ///
    /// A fresh run (`resume_step` `None`) starts both logs empty. A run resumed from the
    /// checkpoint of step `s` keeps the lines of steps `≤ s` and drops later ones (they
    /// belonged to the abandoned tail), so the file ends up equal to an uninterrupted run's;
    /// log a step's metrics before checkpointing it. TensorBoard gets a new event file that
    /// tells it to discard points after `s` from the older files.
    pub fn create_with(
        run_dir: &Path,
        resume_step: Option<u64>,
        loggers: &[Logger],
    ) -> Result<MetricsSink, MetricsError> {
        std::fs::create_dir_all(run_dir).map_err(io_error(run_dir))?;
        let jsonl_path = run_dir.join(METRICS_FILE);
        match resume_step {
            Some(step) => keep_steps_up_to(&jsonl_path, step)?,
            None => File::create(&jsonl_path)
                .map(drop)
                .map_err(io_error(&jsonl_path))?,
        }
        let jsonl = OpenOptions::new()
            .append(true)
            .create(true)
            .open(&jsonl_path)
            .map_err(io_error(&jsonl_path))?;
        let tensorboard = if loggers.contains(&Logger::Tensorboard) {
            let dir = run_dir.join(TENSORBOARD_DIR);
            if resume_step.is_none() {
                remove_event_files(&dir)?;
            }
            let mut writer = EventWriter::create(&dir).map_err(io_error(&dir))?;
            if let Some(step) = resume_step {
                writer
                    .mark_restart(step + 1)
                    .map_err(io_error(writer.path()))?;
            }
            Some(writer)
        } else {
            None
        };
        Ok(MetricsSink {
            jsonl,
            jsonl_path,
            tensorboard,
        })
    }

    /// Path of `metrics.jsonl`.
    pub fn jsonl_path(&self) -> &Path {
        &self.jsonl_path
    }

    /// Appends one record for `step` to every sink and flushes it, so a crash loses nothing
    /// already logged.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) -> Result<(), MetricsError> {
        let record = MetricsRecord {
            step,
            time: tensorboard::unix_time(),
            metrics: metrics.clone(),
        };
        let mut line = serde_json::to_string(&record).expect("a metrics record serialises to JSON");
        line.push('\n');
        self.jsonl
            .write_all(line.as_bytes())
            .and_then(|()| self.jsonl.flush())
            .map_err(io_error(&self.jsonl_path))?;
        if let Some(writer) = &mut self.tensorboard {
            writer
                .add_scalars(step, record.time, metrics)
                .map_err(io_error(writer.path()))?;
        }
        Ok(())
    }
}

/// Reads every record of a `metrics.jsonl`. A torn last line (the process died mid-write) is
/// skipped; a bad line anywhere else is an error.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsRecord>, MetricsError> {
    let file = File::open(path).map_err(io_error(path))?;
    let lines: Vec<String> = BufReader::new(file)
        .lines()
        .collect::<Result<_, _>>()
        .map_err(io_error(path))?;
    let mut records = Vec::with_capacity(lines.len());
    for (index, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<MetricsRecord>(line) {
            Ok(record) => records.push(record),
            Err(_) if index + 1 == lines.len() => {}
            Err(err) => {
                return Err(MetricsError::Corrupt {
                    path: path.to_path_buf(),
                    line: index + 1,
                    message: err.to_string(),
                })
            }
        }
    }
    Ok(records)
}

/// Rewrites `path` with only the records of steps `≤ step` (atomically, via a rename).
fn keep_steps_up_to(path: &Path, step: u64) -> Result<(), MetricsError> {
    if !path.exists() {
        return Ok(());
    }
    let kept: String = read_metrics(path)?
        .into_iter()
        .filter(|record| record.step <= step)
        .map(|record| {
            serde_json::to_string(&record).expect("a metrics record serialises to JSON") + "\n"
        })
        .collect();
    let partial = path.with_extension("jsonl.partial");
    std::fs::write(&partial, kept).map_err(io_error(&partial))?;
    std::fs::rename(&partial, path).map_err(io_error(path))
}

fn remove_event_files(dir: &Path) -> Result<(), MetricsError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(tensorboard::EVENT_FILE_PREFIX)
        {
            std::fs::remove_file(entry.path()).map_err(io_error(&entry.path()))?;
        }
    }
    Ok(())
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> MetricsError {
    let path = path.to_path_buf();
    move |source| MetricsError::Io { path, source }
}

/// JSON has no NaN or infinity: such values are written as `null` and read back as NaN.
mod nullable_values {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        metrics: &BTreeMap<String, f64>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let values: BTreeMap<&str, Option<f64>> = metrics
            .iter()
            .map(|(name, value)| (name.as_str(), value.is_finite().then_some(*value)))
            .collect();
        values.serialize(serializer)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<String, f64>, D::Error> {
        let values = BTreeMap::<String, Option<f64>>::deserialize(deserializer)?;
        Ok(values
            .into_iter()
            .map(|(name, value)| (name, value.unwrap_or(f64::NAN)))
            .collect())
    }
}
