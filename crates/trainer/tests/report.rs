//! The HTML report, built from a synthetic run directory.

use std::collections::BTreeMap;
use std::path::Path;

use floe_trainer::config::Config;
use floe_trainer::outputs::metrics::MetricsSink;
use floe_trainer::outputs::report::{append_samples, write_report, Sample, REPORT_FILE};

/// A 30-step run: training metrics every step, eval on two data sources every 10 steps.
fn synthetic_run(run_dir: &Path) {
    Config::load(None, &[])
        .unwrap()
        .save_effective(run_dir)
        .unwrap();
    let mut sink = MetricsSink::create(run_dir, None).unwrap();
    let eval = |step: u64| {
        let progress = step as f64 / 30.0;
        BTreeMap::from([
            ("eval/all/avg_score".to_string(), 0.2 + 0.5 * progress),
            ("eval/all/accuracy".to_string(), 0.1 + 0.5 * progress),
            (
                "eval/synth_sql/avg_score".to_string(),
                0.25 + 0.55 * progress,
            ),
            (
                "eval/synth_sql_joins/avg_score".to_string(),
                0.1 + 0.3 * progress,
            ),
            ("eval/all/pass_at_1".to_string(), 0.2 + 0.5 * progress),
            ("timing/eval".to_string(), 4.0),
        ])
    };
    sink.log(0, &eval(0)).unwrap();
    for step in 1..=30u64 {
        let t = step as f64;
        let metrics = BTreeMap::from([
            (
                "reward/avg_raw_reward".to_string(),
                0.8 * (1.0 - (-t / 10.0).exp()),
            ),
            (
                "reward/avg_pass_at_4".to_string(),
                0.9 * (1.0 - (-t / 8.0).exp()),
            ),
            ("policy/policy_kl".to_string(), 0.002 * t),
            ("policy/policy_entropy".to_string(), 1.5 - 0.03 * t),
            (
                "policy/policy_loss".to_string(),
                if step == 17 {
                    f64::NAN
                } else {
                    -0.01 * t.sin()
                },
            ),
            ("policy/grad_norm".to_string(), 0.5 + 0.1 * t.cos()),
            ("policy/policy_lr".to_string(), 1e-6),
            ("generate/avg_num_tokens".to_string(), 40.0 + t),
            ("generate/max_num_tokens".to_string(), 64.0),
            ("timing/step".to_string(), 12.0 + t.sin()),
            ("timing/generate".to_string(), 7.0),
            ("timing/policy_train".to_string(), 4.0 + t.sin()),
            ("trainer/epoch".to_string(), 0.0),
        ]);
        sink.log(step, &metrics).unwrap();
        if step % 10 == 0 {
            sink.log(step, &eval(step)).unwrap();
        }
    }
    let sample = |step: u64, reward: f64| Sample {
        step,
        data_source: Some("synth_sql".into()),
        prompt: "How many rows are in <table> users?".into(),
        response: "<answer>SELECT COUNT(*) FROM users & friends</answer>".into(),
        reward,
    };
    append_samples(run_dir, &[sample(1, 0.0), sample(1, 1.0)]).unwrap();
    append_samples(run_dir, &[sample(30, 1.0)]).unwrap();
}

#[test]
fn report_has_every_plot_and_series() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let path = write_report(dir.path()).unwrap();
    assert_eq!(path, dir.path().join(REPORT_FILE));
    let html = std::fs::read_to_string(&path).unwrap();

    for title in [
        "Training reward",
        "Eval accuracy by data source (share of correct answers)",
        "Eval average score by data source (with format credit)",
        "Eval pass_at_1 by data source",
        "KL to the reference",
        "Policy entropy",
        "Response length",
        "Step timing",
        "All other metrics",
    ] {
        assert!(html.contains(title), "missing plot {title}");
    }
    for series in [
        "reward/avg_raw_reward",
        "reward/avg_pass_at_4",
        "data-series=\"synth_sql_joins\"",
        "data-series=\"all\"",
        "data-series=\"generate\"",
        "data-series=\"policy_train\"",
        "data-series=\"eval\"",
        "policy/policy_lr",
    ] {
        assert!(html.contains(series), "missing series {series}");
    }
    assert_eq!(html.matches("<svg").count(), html.matches("</svg>").count());
    // The NaN at step 17 splits the policy-loss line in two.
    let loss_group = html
        .split("data-series=\"policy/policy_loss\"")
        .nth(1)
        .unwrap();
    let loss_group = &loss_group[..loss_group.find("</g>").unwrap()];
    assert_eq!(loss_group.matches("<polyline").count(), 2);
}

#[test]
fn report_summary_compares_first_and_last_eval() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let html = std::fs::read_to_string(write_report(dir.path()).unwrap()).unwrap();
    assert!(html.contains("First vs last"));
    assert!(html.contains(
        "<tr><td>eval/all/accuracy</td><td>0.1000 <small>(step 0)</small></td><td>0.6000 <small>(step 30)</small></td><td class=\"up\">+0.5000</td></tr>"
    ));
    assert!(html.contains(
        "<tr><td>eval/all/avg_score</td><td>0.2000 <small>(step 0)</small></td><td>0.7000 <small>(step 30)</small></td><td class=\"up\">+0.5000</td></tr>"
    ));
    // Config highlights come from the saved config.toml.
    assert!(html.contains("<tr><th>model.path</th><td>embedded:tiny</td></tr>"));
    assert!(html.contains("training time (Σ timing/step)"));
}

#[test]
fn report_is_self_contained_and_escapes_text() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let html = std::fs::read_to_string(write_report(dir.path()).unwrap()).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    for external in [
        "http://", "https://", "src=", "<script", "<link", "@import", "url(",
    ] {
        assert!(
            !html.contains(external),
            "report refers to something outside itself: {external}"
        );
    }
    // Samples are shown for the first and the last step, escaped.
    assert!(html.contains("<h3>Step 1</h3>") && html.contains("<h3>Step 30</h3>"));
    assert!(html.contains("SELECT COUNT(*) FROM users &amp; friends"));
    assert!(html.contains("&lt;table&gt; users"));
    assert!(!html.contains("<table> users"));
}

#[test]
fn report_can_be_regenerated_from_metrics_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create_with(dir.path(), None, &[]).unwrap();
    sink.log(
        1,
        &BTreeMap::from([("reward/avg_raw_reward".to_string(), 0.5)]),
    )
    .unwrap();
    let html = std::fs::read_to_string(write_report(dir.path()).unwrap()).unwrap();
    assert!(html.contains("Training reward"));
    assert!(!html.contains("Config highlights"));
    assert!(!html.contains("Sample generations"));
}

#[test]
fn missing_metrics_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let message = write_report(dir.path()).unwrap_err().to_string();
    assert!(
        message.ends_with("has no metrics.jsonl; is it a floe run directory?"),
        "{message}"
    );
}

/// Renders the report with headless Chromium when it is installed and keeps a screenshot in
/// `$FLOE_REPORT_SCREENSHOT` for a person to look at; skipped otherwise.
#[test]
fn report_renders_in_a_browser() {
    let Ok(screenshot) = std::env::var("FLOE_REPORT_SCREENSHOT") else {
        eprintln!("skipped: set FLOE_REPORT_SCREENSHOT=/path/shot.png to render with chromium");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path());
    let report = write_report(dir.path()).unwrap();
    let status = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1200,2600",
        ])
        .arg(format!("--screenshot={screenshot}"))
        .arg(format!("file://{}", report.display()))
        .status()
        .expect("chromium runs");
    assert!(status.success());
}
