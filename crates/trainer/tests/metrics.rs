//! `metrics.jsonl` and TensorBoard event files, checked by reading them back independently.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use floe_trainer::config::Logger;
use floe_trainer::outputs::metrics::{read_metrics, MetricsSink, METRICS_FILE, TENSORBOARD_DIR};
use floe_trainer::outputs::tensorboard::masked_crc32c;

fn metrics(step: u64) -> BTreeMap<String, f64> {
    let step = step as f64;
    BTreeMap::from([
        ("reward/avg_raw_reward".to_string(), 0.1 * step),
        ("policy/grad_norm".to_string(), 1.0 / (step + 1.0)),
        ("timing/step".to_string(), 2.5),
    ])
}

fn steps_and_metrics(run_dir: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    read_metrics(&run_dir.join(METRICS_FILE))
        .unwrap()
        .into_iter()
        .map(|record| (record.step, record.metrics))
        .collect()
}

fn event_files(run_dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(run_dir.join(TENSORBOARD_DIR))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    files
}

#[test]
fn jsonl_has_one_flushed_line_per_log_call() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(dir.path(), None).unwrap();
    sink.log(
        0,
        &BTreeMap::from([("eval/all/avg_score".to_string(), 0.25)]),
    )
    .unwrap();
    sink.log(1, &metrics(1)).unwrap();
    // Readable while the sink is still open: every line is flushed.
    let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["step"], 0);
    assert_eq!(lines[0]["metrics"]["eval/all/avg_score"], 0.25);
    assert_eq!(lines[1]["metrics"]["timing/step"], 2.5);
    assert!(lines[1]["time"].as_f64().unwrap() > 1.7e9);
}

#[test]
fn non_finite_values_round_trip_as_null() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create_with(dir.path(), None, &[]).unwrap();
    sink.log(
        1,
        &BTreeMap::from([("policy/grad_norm".to_string(), f64::NAN)]),
    )
    .unwrap();
    let text = std::fs::read_to_string(dir.path().join(METRICS_FILE)).unwrap();
    assert!(text.contains("\"policy/grad_norm\":null"), "{text}");
    let records = read_metrics(&dir.path().join(METRICS_FILE)).unwrap();
    assert!(records[0].metrics["policy/grad_norm"].is_nan());
}

#[test]
fn resumed_run_file_equals_uninterrupted_run() {
    let uninterrupted = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(uninterrupted.path(), None).unwrap();
    for step in 1..=6 {
        sink.log(step, &metrics(step)).unwrap();
    }

    // Crash after step 5 with the last checkpoint at step 3; resume from it.
    let resumed = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(resumed.path(), None).unwrap();
    for step in 1..=5 {
        sink.log(step, &metrics(step)).unwrap();
    }
    drop(sink);
    let mut sink = MetricsSink::create(resumed.path(), Some(3)).unwrap();
    for step in 4..=6 {
        sink.log(step, &metrics(step)).unwrap();
    }
    assert_eq!(
        steps_and_metrics(resumed.path()),
        steps_and_metrics(uninterrupted.path())
    );
    // The resumed run starts a second event file rather than rewriting the first.
    assert_eq!(event_files(resumed.path()).len(), 2);
}

#[test]
fn fresh_run_starts_empty_logs() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(dir.path(), None).unwrap();
    sink.log(1, &metrics(1)).unwrap();
    drop(sink);
    let mut sink = MetricsSink::create(dir.path(), None).unwrap();
    sink.log(1, &metrics(2)).unwrap();
    assert_eq!(steps_and_metrics(dir.path()), vec![(1, metrics(2))]);
    assert_eq!(event_files(dir.path()).len(), 1);
}

#[test]
fn torn_last_line_is_skipped_but_corrupt_middle_line_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(METRICS_FILE);
    let good = r#"{"step":1,"time":1.0,"metrics":{"a":1.0}}"#;
    std::fs::write(&path, format!("{good}\n{{\"step\":2,\"ti")).unwrap();
    assert_eq!(read_metrics(&path).unwrap().len(), 1);

    std::fs::write(&path, format!("{good}\nnot json\n{good}\n")).unwrap();
    let message = read_metrics(&path).unwrap_err().to_string();
    assert!(
        message.contains("metrics.jsonl:2: not a metrics record"),
        "{message}"
    );
}

#[test]
fn tensorboard_can_be_turned_off() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create_with(dir.path(), None, &[Logger::Console]).unwrap();
    sink.log(1, &metrics(1)).unwrap();
    assert!(!dir.path().join(TENSORBOARD_DIR).exists());
}

/// A decoded `Event`: step, `file_version`, scalar `(tag, value)`s and `SessionLog` status.
#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: u64,
    file_version: Option<String>,
    scalars: Vec<(String, f32)>,
    session_status: Option<u64>,
}

/// Splits a TFRecord file into payloads, checking both masked CRCs of every record.
fn read_records(bytes: &[u8]) -> Vec<&[u8]> {
    let mut records = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let length_bytes = &bytes[at..at + 8];
        let length = u64::from_le_bytes(length_bytes.try_into().unwrap()) as usize;
        let length_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(
            length_crc,
            masked_crc32c(length_bytes),
            "length CRC at byte {at}"
        );
        let payload = &bytes[at + 12..at + 12 + length];
        let payload_crc = u32::from_le_bytes(
            bytes[at + 12 + length..at + 16 + length]
                .try_into()
                .unwrap(),
        );
        assert_eq!(
            payload_crc,
            masked_crc32c(payload),
            "payload CRC at byte {at}"
        );
        records.push(payload);
        at += 16 + length;
    }
    records
}

fn varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = bytes[*at];
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            break;
        }
    }
    value
}

/// Yields `(field, wire type, payload)` with the payload's bytes for fixed and length-delimited
/// fields and the value (as LE bytes) for varints.
fn fields(bytes: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let key = varint(bytes, &mut at);
        let (field, wire) = (key >> 3, key & 7);
        let payload = match wire {
            0 => varint(bytes, &mut at).to_le_bytes().to_vec(),
            1 => {
                at += 8;
                bytes[at - 8..at].to_vec()
            }
            2 => {
                let length = varint(bytes, &mut at) as usize;
                at += length;
                bytes[at - length..at].to_vec()
            }
            5 => {
                at += 4;
                bytes[at - 4..at].to_vec()
            }
            other => panic!("unexpected wire type {other}"),
        };
        out.push((field, wire, payload));
    }
    out
}

fn decode_event(payload: &[u8]) -> Event {
    let mut event = Event::default();
    for (field, _, bytes) in fields(payload) {
        match field {
            1 => event.wall_time = f64::from_le_bytes(bytes.try_into().unwrap()),
            2 => event.step = u64::from_le_bytes(bytes.try_into().unwrap()),
            3 => event.file_version = Some(String::from_utf8(bytes).unwrap()),
            5 => {
                for (_, _, value) in fields(&bytes) {
                    let mut tag = String::new();
                    let mut simple_value = f32::NAN;
                    for (field, _, bytes) in fields(&value) {
                        match field {
                            1 => tag = String::from_utf8(bytes).unwrap(),
                            2 => simple_value = f32::from_le_bytes(bytes.try_into().unwrap()),
                            _ => {}
                        }
                    }
                    event.scalars.push((tag, simple_value));
                }
            }
            7 => {
                let (_, _, status) = &fields(&bytes)[0];
                event.session_status = Some(u64::from_le_bytes(status.clone().try_into().unwrap()));
            }
            other => panic!("unexpected Event field {other}"),
        }
    }
    event
}

#[test]
fn event_file_decodes_to_the_logged_scalars() {
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(dir.path(), None).unwrap();
    for step in 1..=3 {
        sink.log(step, &metrics(step)).unwrap();
    }
    let files = event_files(dir.path());
    assert_eq!(files.len(), 1);
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");

    let bytes = std::fs::read(&files[0]).unwrap();
    let events: Vec<Event> = read_records(&bytes).into_iter().map(decode_event).collect();
    assert_eq!(events.len(), 4);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    for (index, event) in events[1..].iter().enumerate() {
        let step = index as u64 + 1;
        assert_eq!(event.step, step);
        assert!(event.wall_time > 1.7e9);
        let expected: Vec<(String, f32)> = metrics(step)
            .into_iter()
            .map(|(tag, value)| (tag, value as f32))
            .collect();
        assert_eq!(event.scalars, expected);
    }
}

#[test]
fn resumed_event_file_starts_with_a_restart_marker() {
    let dir = tempfile::tempdir().unwrap();
    MetricsSink::create(dir.path(), None)
        .unwrap()
        .log(1, &metrics(1))
        .unwrap();
    let mut sink = MetricsSink::create(dir.path(), Some(1)).unwrap();
    sink.log(2, &metrics(2)).unwrap();
    let newest = event_files(dir.path()).pop().unwrap();
    let bytes = std::fs::read(newest).unwrap();
    let events: Vec<Event> = read_records(&bytes).into_iter().map(decode_event).collect();
    assert!(events[0].file_version.is_some());
    assert_eq!((events[1].session_status, events[1].step), (Some(1), 2));
    assert_eq!(events[2].step, 2);
}

/// TensorBoard's own reader parses the file. Skipped when `python3 -c "import tensorboard"`
/// fails (`pip install tensorboard` to run it).
#[test]
fn tensorboard_reader_parses_the_file() {
    let has_tensorboard = std::process::Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output()
        .map(|output| output.status.success())
        .unwrap_or(false);
    if !has_tensorboard {
        eprintln!("skipped: python3 with the tensorboard package is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut sink = MetricsSink::create(dir.path(), None).unwrap();
    for step in 1..=5 {
        sink.log(step, &metrics(step)).unwrap();
    }
    drop(sink);
    // Resume from step 3: TensorBoard must drop the old steps 4 and 5 and keep the new ones.
    let mut sink = MetricsSink::create(dir.path(), Some(3)).unwrap();
    for step in 4..=6 {
        let mut values = metrics(step);
        values.insert("reward/avg_raw_reward".into(), 10.0 * step as f64);
        sink.log(step, &values).unwrap();
    }
    let script = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
for event in acc.Scalars("reward/avg_raw_reward"):
    print(event.step, round(event.value, 4))
"#;
    let output = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir.path().join(TENSORBOARD_DIR))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8(output.stdout).unwrap();
    assert_eq!(printed, "1 0.1\n2 0.2\n3 0.3\n4 40.0\n5 50.0\n6 60.0\n");
}
