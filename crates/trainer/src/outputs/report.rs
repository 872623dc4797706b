//! The run report: one self-contained `report.html` (inline CSS and SVG, no scripts, no
//! network) built from a run directory's `metrics.jsonl`, `config.toml` and, if present,
//! `samples.jsonl`, so it can be rebuilt from disk at any time (`floe report RUN_DIR`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::metrics::{read_metrics, MetricsError, MetricsRecord, METRICS_FILE};
use crate::config::EFFECTIVE_CONFIG_FILE;

/// File name of the report inside a run directory.
pub const REPORT_FILE: &str = "report.html";

/// File name of the sample generations inside a run directory (one JSON [`Sample`] a line).
pub const SAMPLES_FILE: &str = "samples.jsonl";

/// Samples shown per step in the report (the first and the last step that has samples).
const SAMPLES_SHOWN_PER_STEP: usize = 6;

/// One generation worth showing in the report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The RL step it was generated at (0 = before training).
    pub step: u64,
    /// The row's `data_source`, if any.
    #[serde(default)]
    pub data_source: Option<String>,
    /// The prompt as the model saw it (chat template applied) or its last user message.
    pub prompt: String,
    /// The model's completion.
    pub response: String,
    /// The environment's reward.
    pub reward: f64,
}

/// Why the report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The run directory has no metrics to report.
    #[error("{0} has no {METRICS_FILE}; is it a floe run directory?")]
    NoMetrics(PathBuf),
    /// `metrics.jsonl` could not be read.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line of `samples.jsonl` is not a [`Sample`].
    #[error("{path}:{line}: not a sample ({message})")]
    BadSample {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The JSON parser's message.
        message: String,
    },
}

/// Appends generations to `run_dir/samples.jsonl` for the report to show.
pub fn append_samples(run_dir: &Path, samples: &[Sample]) -> Result<(), ReportError> {
    let path = run_dir.join(SAMPLES_FILE);
    let mut text = String::new();
    for sample in samples {
        text.push_str(&serde_json::to_string(sample).expect("a sample serialises to JSON"));
        text.push('\n');
    }
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|source| ReportError::Io { path, source })
}

/// Writes `run_dir/report.html` from the run's files and returns its path.
pub fn write_report(run_dir: &Path) -> Result<PathBuf, ReportError> {
    let metrics_path = run_dir.join(METRICS_FILE);
    if !metrics_path.exists() {
        return Err(ReportError::NoMetrics(run_dir.to_path_buf()));
    }
    let records = read_metrics(&metrics_path)?;
    // The config only adds highlights to the summary; a missing or unreadable one is left out.
    let config = std::fs::read_to_string(run_dir.join(EFFECTIVE_CONFIG_FILE))
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok());
    let samples = read_samples(&run_dir.join(SAMPLES_FILE))?;
    let title = run_dir
        .canonicalize()
        .unwrap_or_else(|_| run_dir.to_path_buf())
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| run_dir.display().to_string());
    let html = render_report(&title, &records, config.as_ref(), &samples);
    let path = run_dir.join(REPORT_FILE);
    let partial = run_dir.join(format!("{REPORT_FILE}.partial"));
    std::fs::write(&partial, html)
        .and_then(|()| std::fs::rename(&partial, &path))
        .map_err(|source| ReportError::Io {
            path: path.clone(),
            source,
        })?;
    Ok(path)
}

fn read_samples(path: &Path) -> Result<Vec<Sample>, ReportError> {
    let Ok(file) = std::fs::File::open(path) else {
        return Ok(Vec::new());
    };
    let mut samples = Vec::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| ReportError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let sample = serde_json::from_str(&line).map_err(|err| ReportError::BadSample {
            path: path.to_path_buf(),
            line: index + 1,
            message: err.to_string(),
        })?;
        samples.push(sample);
    }
    Ok(samples)
}

/// Every metric as a series of `(step, value)`, sorted by step; a later line for the same
/// step wins.
struct MetricTable {
    series: BTreeMap<String, BTreeMap<u64, f64>>,
}

impl MetricTable {
    fn new(records: &[MetricsRecord]) -> MetricTable {
        let mut series: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
        for record in records {
            for (name, value) in &record.metrics {
                series
                    .entry(name.clone())
                    .or_default()
                    .insert(record.step, *value);
            }
        }
        MetricTable { series }
    }

    fn points(&self, name: &str) -> Vec<(f64, f64)> {
        self.series
            .get(name)
            .map(|points| {
                points
                    .iter()
                    .map(|(step, value)| (*step as f64, *value))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn names_matching<'a>(
        &'a self,
        pattern: impl Fn(&str) -> bool + 'a,
    ) -> impl Iterator<Item = &'a String> + 'a {
        self.series.keys().filter(move |name| pattern(name))
    }

    /// First and last finite value with their steps.
    fn first_last(&self, name: &str) -> Option<((u64, f64), (u64, f64))> {
        let points = self.series.get(name)?;
        let mut finite = points.iter().filter(|(_, value)| value.is_finite());
        let first = finite.next()?;
        let last = finite.next_back().unwrap_or(first);
        Some(((*first.0, *first.1), (*last.0, *last.1)))
    }
}

/// A figure in the report: a title, a y label and the metrics it draws.
struct Figure {
    title: String,
    y_label: String,
    series: Vec<Series>,
}

fn render_report(
    title: &str,
    records: &[MetricsRecord],
    config: Option<&toml::Table>,
    samples: &[Sample],
) -> String {
    let table = MetricTable::new(records);
    let mut shown = BTreeSet::new();
    let figures = main_figures(&table, &mut shown);

    let mut html = String::new();
    let _ = write!(
        html,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>floe report: {title}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n\
         <h1>floe run report <span class=\"run\">{title}</span></h1>\n",
        title = escape(title)
    );
    render_summary(&mut html, records, &table, config);
    html.push_str("<h2>Training curves</h2>\n<div class=\"grid\">\n");
    for figure in &figures {
        let svg = LinePlot {
            title: &figure.title,
            x_label: "step",
            y_label: &figure.y_label,
            series: &figure.series,
            width: 540.0,
            height: 300.0,
        }
        .render();
        let _ = writeln!(html, "<figure>{svg}{}</figure>", legend(&figure.series));
    }
    html.push_str("</div>\n");

    let others: Vec<&String> = table.names_matching(|name| !shown.contains(name)).collect();
    if !others.is_empty() {
        html.push_str("<h2>All other metrics</h2>\n<div class=\"grid small\">\n");
        for name in others {
            let series = vec![Series::new(name, table.points(name), 0)];
            let svg = LinePlot {
                title: name,
                x_label: "step",
                y_label: "",
                series: &series,
                width: 350.0,
                height: 200.0,
            }
            .render();
            let _ = writeln!(html, "<figure>{svg}</figure>");
        }
        html.push_str("</div>\n");
    }
    render_samples(&mut html, samples);
    let _ = write!(
        html,
        "<footer>Generated by floe from {METRICS_FILE} ({} records). Rebuild with <code>floe report RUN_DIR</code>.</footer>\n</body>\n</html>\n",
        records.len()
    );
    html
}

/// The curves every RL run has, grouped the way one reads them; names drawn here are added
/// to `shown` so the "all other metrics" grid skips them.
fn main_figures(table: &MetricTable, shown: &mut BTreeSet<String>) -> Vec<Figure> {
    let mut figures = Vec::new();
    let mut figure = |title: &str, y_label: &str, names: Vec<(String, String)>| {
        let series: Vec<Series> = names
            .into_iter()
            .filter(|(name, _)| table.series.contains_key(name))
            .enumerate()
            .map(|(index, (name, label))| {
                shown.insert(name.clone());
                Series::new(&label, table.points(&name), index)
            })
            .collect();
        if !series.is_empty() {
            figures.push(Figure {
                title: title.into(),
                y_label: y_label.into(),
                series,
            });
        }
    };
    let same = |names: &[&str]| -> Vec<(String, String)> {
        names
            .iter()
            .map(|name| (name.to_string(), name.to_string()))
            .collect()
    };
    let reward_names: Vec<(String, String)> =
        ["reward/avg_raw_reward", "reward/mean_positive_reward"]
            .into_iter()
            .map(String::from)
            .chain(
                table
                    .names_matching(|name| name.starts_with("reward/avg_pass_at_"))
                    .cloned(),
            )
            .map(|name| (name.clone(), name))
            .collect();
    figure("Training reward", "reward", reward_names);
    let eval_metric = |suffix: &str| -> Vec<(String, String)> {
        table
            .names_matching(|name| name.starts_with("eval/") && name.ends_with(suffix))
            .map(|name| {
                let source = name["eval/".len()..name.len() - suffix.len()].to_string();
                (name.clone(), source)
            })
            .collect()
    };
    figure(
        "Eval accuracy by data source (share of correct answers)",
        "accuracy",
        eval_metric("/accuracy"),
    );
    figure(
        "Eval average score by data source (with format credit)",
        "score",
        eval_metric("/avg_score"),
    );
    let pass_suffixes: BTreeSet<String> = table
        .names_matching(|name| name.starts_with("eval/") && name.contains("/pass_at_"))
        .filter_map(|name| name.rsplit('/').next().map(|suffix| format!("/{suffix}")))
        .collect();
    for suffix in pass_suffixes {
        figure(
            &format!("Eval {} by data source", &suffix[1..]),
            "fraction of prompts",
            eval_metric(&suffix),
        );
    }
    figure(
        "KL to the reference",
        "KL",
        same(&["policy/policy_kl", "loss/avg_kl"]),
    );
    figure(
        "Policy entropy",
        "nats / token",
        same(&["policy/policy_entropy"]),
    );
    figure(
        "Response length",
        "tokens",
        same(&[
            "generate/avg_num_tokens",
            "generate/max_num_tokens",
            "generate/min_num_tokens",
            "policy/response_length",
        ]),
    );
    figure(
        "Policy loss and gradient norm",
        "",
        same(&[
            "policy/policy_loss",
            "policy/final_loss",
            "policy/grad_norm",
        ]),
    );
    let sft: Vec<(String, String)> = table
        .names_matching(|name| name.starts_with("sft/"))
        .map(|name| (name.clone(), name.clone()))
        .collect();
    figure("SFT warm start", "", sft);
    let timing: Vec<(String, String)> = table
        .names_matching(|name| name.starts_with("timing/"))
        .map(|name| (name.clone(), name["timing/".len()..].to_string()))
        .collect();
    figure("Step timing", "seconds", timing);
    figures
}

fn render_summary(
    html: &mut String,
    records: &[MetricsRecord],
    table: &MetricTable,
    config: Option<&toml::Table>,
) {
    html.push_str(
        "<h2>Summary</h2>\n<div class=\"cards\">\n<table class=\"kv\">\n<caption>Run</caption>\n",
    );
    let max_step = records.iter().map(|record| record.step).max().unwrap_or(0);
    row(html, "steps", &max_step.to_string());
    if let Some(step_times) = table.series.get("timing/step") {
        let total: f64 = step_times
            .values()
            .filter(|seconds| seconds.is_finite())
            .sum();
        row(
            html,
            "training time (Σ timing/step)",
            &format_duration(total),
        );
    }
    let times: Vec<f64> = records.iter().map(|record| record.time).collect();
    if let (Some(first), Some(last)) = (
        times.iter().copied().reduce(f64::min),
        times.iter().copied().reduce(f64::max),
    ) {
        row(
            html,
            "wall time (first to last record)",
            &format_duration(last - first),
        );
    }
    html.push_str("</table>\n");

    if let Some(config) = config {
        html.push_str("<table class=\"kv\">\n<caption>Config highlights</caption>\n");
        for key in CONFIG_HIGHLIGHTS {
            if let Some(value) = lookup(config, key) {
                let text = match value {
                    toml::Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                row(html, key, &text);
            }
        }
        html.push_str("</table>\n");
    }
    html.push_str("</div>\n");

    let compared: Vec<&String> = table
        .names_matching(|name| {
            name == "reward/avg_raw_reward"
                || (name.starts_with("eval/")
                    && (name.ends_with("/accuracy")
                        || name.ends_with("/avg_score")
                        || name.contains("/pass_at_")))
        })
        .collect();
    if !compared.is_empty() {
        html.push_str(
            "<table class=\"compare\">\n<caption>First vs last</caption>\n\
             <tr><th>metric</th><th>first</th><th>last</th><th>change</th></tr>\n",
        );
        for name in compared {
            if let Some(((first_step, first), (last_step, last))) = table.first_last(name) {
                let change = last - first;
                let class = if change > 0.0 {
                    "up"
                } else if change < 0.0 {
                    "down"
                } else {
                    ""
                };
                let _ = writeln!(
                    html,
                    "<tr><td>{}</td><td>{} <small>(step {first_step})</small></td>\
                     <td>{} <small>(step {last_step})</small></td><td class=\"{class}\">{:+.4}</td></tr>",
                    escape(name),
                    format_value(first),
                    format_value(last),
                    change
                );
            }
        }
        html.push_str("</table>\n");
    }
}

/// Config keys worth a glance in the summary, when the run saved its config.
const CONFIG_HIGHLIGHTS: &[&str] = &[
    "model.path",
    "data.train_data",
    "data.val_data",
    "environment.env_class",
    "engine.device",
    "sft.enabled",
    "trainer.epochs",
    "trainer.train_batch_size",
    "trainer.policy_mini_batch_size",
    "generator.n_samples_per_prompt",
    "generator.sampling_params.max_generate_length",
    "generator.sampling_params.temperature",
    "trainer.policy.optimizer_config.lr",
    "trainer.algorithm.advantage_estimator",
    "trainer.algorithm.loss_reduction",
    "trainer.algorithm.use_kl_loss",
    "trainer.seed",
];

fn lookup<'a>(table: &'a toml::Table, dotted: &str) -> Option<&'a toml::Value> {
    let mut segments = dotted.split('.');
    let mut value = table.get(segments.next()?)?;
    for segment in segments {
        value = value.as_table()?.get(segment)?;
    }
    Some(value)
}

fn row(html: &mut String, key: &str, value: &str) {
    let _ = writeln!(
        html,
        "<tr><th>{}</th><td>{}</td></tr>",
        escape(key),
        escape(value)
    );
}

fn render_samples(html: &mut String, samples: &[Sample]) {
    let steps: BTreeSet<u64> = samples.iter().map(|sample| sample.step).collect();
    let shown_steps: BTreeSet<u64> = steps
        .first()
        .into_iter()
        .chain(steps.last())
        .copied()
        .collect();
    if shown_steps.is_empty() {
        return;
    }
    html.push_str("<h2>Sample generations</h2>\n");
    for step in shown_steps {
        let _ = writeln!(html, "<h3>Step {step}</h3>");
        for sample in samples
            .iter()
            .filter(|sample| sample.step == step)
            .take(SAMPLES_SHOWN_PER_STEP)
        {
            let source = sample
                .data_source
                .as_deref()
                .map(|source| format!(" · {}", escape(source)))
                .unwrap_or_default();
            let class = if sample.reward > 0.0 { "good" } else { "bad" };
            let _ = writeln!(
                html,
                "<div class=\"sample\"><div class=\"meta\"><span class=\"{class}\">reward {}</span>{source}</div>\
                 <details><summary>prompt</summary><pre>{}</pre></details><pre>{}</pre></div>",
                format_value(sample.reward),
                escape(&sample.prompt),
                escape(&sample.response)
            );
        }
    }
}

fn legend(series: &[Series]) -> String {
    let mut html = String::from("<figcaption>");
    for line in series {
        let _ = write!(
            html,
            "<span class=\"key\"><i style=\"background:{}\"></i>{}</span>",
            line.color,
            escape(&line.name)
        );
    }
    html.push_str("</figcaption>");
    html
}

const STYLE: &str = "\
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#1f2328;\
max-width:1160px;margin:24px auto;padding:0 16px;background:#fff}\
h1{font-size:22px;margin:0 0 8px}h1 .run{color:#57606a;font-weight:400}\
h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #d0d7de;padding-bottom:4px}\
h3{font-size:14px;margin:16px 0 6px}\
.cards{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}\
table{border-collapse:collapse;margin:8px 0}caption{text-align:left;font-weight:600;padding:4px 0}\
th,td{padding:3px 10px;border-bottom:1px solid #eaeef2;text-align:left;vertical-align:top}\
table.kv th{color:#57606a;font-weight:500}td small{color:#6e7781}\
td.up{color:#1a7f37}td.down{color:#cf222e}\
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:12px}\
.grid.small{grid-template-columns:repeat(auto-fill,minmax(350px,1fr))}\
figure{margin:0;border:1px solid #d0d7de;border-radius:6px;padding:6px}\
figure svg{display:block;width:100%;height:auto}\
figcaption{font-size:12px;padding:2px 6px}\
.key{display:inline-block;margin-right:12px;white-space:nowrap}\
.key i{display:inline-block;width:14px;height:3px;margin-right:5px;vertical-align:middle}\
.sample{border:1px solid #d0d7de;border-radius:6px;margin:8px 0;padding:6px 10px}\
.sample pre{white-space:pre-wrap;margin:4px 0;font-size:12px;background:#f6f8fa;padding:6px}\
.meta{font-size:12px;color:#57606a}.good{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}\
footer{margin:32px 0 8px;color:#6e7781;font-size:12px}";

/// Escapes text for HTML and SVG content and attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

fn format_duration(seconds: f64) -> String {
    if !seconds.is_finite() || seconds < 0.0 {
        return "-".into();
    }
    let whole = seconds.round() as u64;
    match whole {
        0..=59 => format!("{seconds:.1} s"),
        60..=3599 => format!("{} min {} s", whole / 60, whole % 60),
        _ => format!("{} h {} min", whole / 3600, (whole % 3600) / 60),
    }
}

fn format_value(value: f64) -> String {
    if !value.is_finite() {
        return value.to_string();
    }
    let magnitude = value.abs();
    if magnitude != 0.0 && !(1e-3..1e6).contains(&magnitude) {
        format!("{value:.3e}")
    } else if value.fract() == 0.0 {
        format!("{value}")
    } else {
        format!("{value:.4}")
    }
}

/// Line colours (Tableau 10): distinct and readable on white.
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

/// One line of a plot.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    color: &'static str,
}

impl Series {
    fn new(name: &str, points: Vec<(f64, f64)>, index: usize) -> Series {
        Series {
            name: name.into(),
            points,
            color: PALETTE[index % PALETTE.len()],
        }
    }
}

/// A line plot rendered as inline SVG: axes with round-number ticks, labels, one polyline
/// per series (broken at non-finite values), and dot markers with hover titles when the
/// series is sparse enough for them to be readable.
struct LinePlot<'a> {
    title: &'a str,
    x_label: &'a str,
    y_label: &'a str,
    series: &'a [Series],
    width: f64,
    height: f64,
}

/// Series with at most this many points get a dot per point.
const MARKER_LIMIT: usize = 60;

impl LinePlot<'_> {
    fn render(&self) -> String {
        let (left, right, top, bottom) = (62.0, 16.0, 30.0, 42.0);
        let plot_width = self.width - left - right;
        let plot_height = self.height - top - bottom;
        let finite: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|series| series.points.iter().copied())
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        let mut svg = String::new();
        let _ = write!(
            svg,
            "<svg viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" \
             font-family=\"system-ui,sans-serif\" font-size=\"11\">\
             <title>{title}</title>\
             <text x=\"{cx}\" y=\"18\" text-anchor=\"middle\" font-size=\"13\" font-weight=\"600\" fill=\"#1f2328\">{title}</text>",
            w = self.width,
            h = self.height,
            cx = left + plot_width / 2.0,
            title = escape(self.title),
        );
        if finite.is_empty() {
            let _ = write!(
                svg,
                "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#6e7781\">no finite values</text></svg>",
                left + plot_width / 2.0,
                top + plot_height / 2.0
            );
            return svg;
        }
        let x_axis = Axis::new(
            finite.iter().map(|p| p.0).fold(f64::INFINITY, f64::min),
            finite.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max),
            (plot_width / 90.0).max(2.0) as usize,
            true,
        );
        let y_axis = Axis::new(
            finite.iter().map(|p| p.1).fold(f64::INFINITY, f64::min),
            finite.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max),
            (plot_height / 45.0).max(2.0) as usize,
            false,
        );
        let to_x = |x: f64| left + (x - x_axis.low) / (x_axis.high - x_axis.low) * plot_width;
        let to_y = |y: f64| {
            top + plot_height - (y - y_axis.low) / (y_axis.high - y_axis.low) * plot_height
        };

        // Grid and tick labels.
        for &tick in &y_axis.ticks {
            let y = to_y(tick);
            let _ = write!(
                svg,
                "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#eaeef2\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#57606a\">{}</text>",
                left + plot_width,
                left - 6.0,
                y + 4.0,
                y_axis.label(tick)
            );
        }
        for &tick in &x_axis.ticks {
            let x = to_x(tick);
            let _ = write!(
                svg,
                "<line x1=\"{x:.1}\" x2=\"{x:.1}\" y1=\"{top}\" y2=\"{:.1}\" stroke=\"#eaeef2\"/>\
                 <text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#57606a\">{}</text>",
                top + plot_height,
                top + plot_height + 16.0,
                x_axis.label(tick)
            );
        }
        let _ = write!(
            svg,
            "<rect x=\"{left}\" y=\"{top}\" width=\"{plot_width:.1}\" height=\"{plot_height:.1}\" fill=\"none\" stroke=\"#8c959f\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#57606a\">{}</text>",
            left + plot_width / 2.0,
            self.height - 8.0,
            escape(self.x_label)
        );
        if !self.y_label.is_empty() {
            let (x, y) = (14.0, top + plot_height / 2.0);
            let _ = write!(
                svg,
                "<text x=\"{x}\" y=\"{y:.1}\" transform=\"rotate(-90 {x} {y:.1})\" text-anchor=\"middle\" fill=\"#57606a\">{}</text>",
                escape(self.y_label)
            );
        }

        for series in self.series {
            let _ = write!(svg, "<g data-series=\"{}\">", escape(&series.name));
            // One polyline per run of finite points, so a NaN shows as a gap.
            for run in series
                .points
                .split(|(x, y)| !(x.is_finite() && y.is_finite()))
            {
                if run.len() < 2 {
                    continue;
                }
                let coordinates: Vec<String> = run
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", to_x(x), to_y(y)))
                    .collect();
                let _ = write!(
                    svg,
                    "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\" stroke-linejoin=\"round\" points=\"{}\"/>",
                    series.color,
                    coordinates.join(" ")
                );
            }
            let finite_points = series
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite());
            if series.points.len() <= MARKER_LIMIT {
                for &(x, y) in finite_points {
                    let _ = write!(
                        svg,
                        "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.6\" fill=\"{}\"><title>{} · step {} = {}</title></circle>",
                        to_x(x),
                        to_y(y),
                        series.color,
                        escape(&series.name),
                        x,
                        format_value(y)
                    );
                }
            }
            svg.push_str("</g>");
        }
        svg.push_str("</svg>");
        svg
    }
}

/// An axis range widened to round numbers, with ticks at 1, 2 or 5 × 10^k.
struct Axis {
    low: f64,
    high: f64,
    ticks: Vec<f64>,
    spacing: f64,
}

impl Axis {
    fn new(min: f64, max: f64, target_ticks: usize, integer: bool) -> Axis {
        let (mut min, mut max) = (min, max);
        if max - min <= f64::EPSILON * max.abs().max(1.0) {
            // A flat series: centre it in a small band instead of dividing by zero.
            let pad = if min == 0.0 { 1.0 } else { min.abs() * 0.1 };
            min -= pad;
            max += pad;
        }
        let raw = (max - min) / target_ticks.max(1) as f64;
        let magnitude = 10f64.powf(raw.log10().floor());
        let mut spacing = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|factor| factor * magnitude)
            .find(|spacing| *spacing >= raw)
            .unwrap_or(10.0 * magnitude);
        if integer {
            spacing = spacing.max(1.0).round();
        }
        let low = (min / spacing).floor() * spacing;
        let high = (max / spacing).ceil() * spacing;
        let count = ((high - low) / spacing).round() as usize;
        let ticks = (0..=count)
            .map(|index| low + index as f64 * spacing)
            .collect();
        Axis {
            low,
            high,
            ticks,
            spacing,
        }
    }

    fn label(&self, value: f64) -> String {
        let magnitude = value.abs().max(self.spacing);
        if value == 0.0 {
            "0".into()
        } else if !(1e-3..1e6).contains(&magnitude) {
            format!("{value:.1e}")
        } else {
            let decimals = (-self.spacing.log10().floor()).max(0.0) as usize;
            format!("{value:.decimals$}")
        }
    }
}
