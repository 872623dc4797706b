//! Issue 20: the env crate's parsers of outside input, fed random and mutated input.
//! Dataset rows (JSONL, JSON and parquet files with one field broken or bytes mangled)
//! load or give an error naming the file and the line or row; SQL extraction from any
//! model response (fences, JSON, think tags, multibyte text, huge inputs) never panics.

use std::time::{Duration, Instant};

use floe_env::dataset::{load_rows, write_rows, DatasetError, Row};
use floe_env::env::Message;
use floe_env::{gsm8k, multiturn_sql, text2sql};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Map, Value};

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

const ROW_KEYS: &[&str] = &[
    "prompt",
    "role",
    "content",
    "data_source",
    "env_class",
    "reward_model",
    "reward_spec",
    "ground_truth",
    "extra_info",
    "db_path",
    "db_id",
];

/// Any JSON value, at most three levels deep, its keys often a row's.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|x| json!(x)),
        ".{0,8}".prop_map(Value::from),
        Just(json!("[{\"role\": \"user\", \"content\": \"hi\"}]")),
        Just(json!("{\"ground_truth\": 1")),
    ];
    let key = prop_oneof![
        3 => proptest::sample::select(ROW_KEYS).prop_map(str::to_string),
        1 => ".{0,6}",
    ];
    leaf.prop_recursive(3, 24, 4, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(key.clone(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn valid_row(i: usize) -> Value {
    json!({
        "data_source": "bird",
        "prompt": [
            {"role": "system", "content": "You write SQL."},
            {"role": "user", "content": format!("Question {i}: ¿cuántos? 🚀")},
        ],
        "env_class": "text2sql",
        "reward_model": {"ground_truth": "SELECT 1"},
        "extra_info": {"db_id": "shop", "db_path": "dbs/shop.sqlite"},
    })
}

/// Where in a row a value is replaced or removed.
const PATHS: &[&[&str]] = &[
    &["prompt"],
    &["prompt", "0"],
    &["prompt", "1", "role"],
    &["prompt", "1", "content"],
    &["data_source"],
    &["env_class"],
    &["reward_model"],
    &["reward_model", "ground_truth"],
    &["reward_spec"],
    &["extra_info"],
    &["extra_info", "db_path"],
    &["extra_info", "db_id"],
];

/// `row` with the value at `path` replaced (`Some`) or removed (`None`).
fn break_row(mut row: Value, path: &[&str], value: Option<Value>) -> Value {
    let (last, parents) = path.split_last().unwrap();
    let mut cursor = &mut row;
    for segment in parents {
        cursor = match segment.parse::<usize>() {
            Ok(i) => &mut cursor[i],
            Err(_) => &mut cursor[*segment],
        };
    }
    match (cursor, last.parse::<usize>(), value) {
        (Value::Array(items), Ok(i), Some(v)) => items[i] = v,
        (Value::Array(items), Ok(i), None) => {
            items.remove(i);
        }
        (Value::Object(map), _, Some(v)) => {
            map.insert(last.to_string(), v);
        }
        (Value::Object(map), _, None) => {
            map.remove(*last);
        }
        _ => unreachable!("the paths fit the valid row"),
    }
    row
}

/// The error's text names the file, and `at` (`line 3`, `row 2`) when given.
fn check_error(err: &DatasetError, file: &str, at: Option<&str>) -> Result<(), TestCaseError> {
    let text = err.to_string();
    prop_assert!(text.contains(file), "{}", text);
    if let Some(at) = at {
        prop_assert!(
            text.contains(&format!("{at}:")),
            "expected `{}` in {}",
            at,
            text
        );
    }
    Ok(())
}

fn broken_row() -> impl Strategy<Value = (usize, &'static [&'static str], Option<Value>)> {
    (
        0usize..4,
        proptest::sample::select(PATHS),
        proptest::option::weighted(0.85, json_value()),
    )
}

proptest! {
    #![proptest_config(config(256))]

    /// A JSONL file of four rows, one with a field replaced or removed, loads or errs
    /// naming the file and that row's line.
    #[test]
    fn jsonl_with_a_broken_row_errs_naming_file_and_line((bad, path, value) in broken_row()) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.jsonl");
        let lines: Vec<String> = (0..4)
            .map(|i| {
                let row = valid_row(i);
                if i == bad { break_row(row, path, value.clone()) } else { row }.to_string()
            })
            .collect();
        std::fs::write(&file, lines.join("\n")).unwrap();
        if let Err(err) = load_rows(&file) {
            check_error(&err, "train.jsonl", Some(&format!("line {}", bad + 1)))?;
        }
    }

    /// The same as a JSON array: the error names the file and the row.
    #[test]
    fn json_with_a_broken_row_errs_naming_file_and_row((bad, path, value) in broken_row()) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.json");
        let rows: Vec<Value> = (0..4)
            .map(|i| {
                let row = valid_row(i);
                if i == bad { break_row(row, path, value.clone()) } else { row }
            })
            .collect();
        std::fs::write(&file, Value::Array(rows).to_string()).unwrap();
        if let Err(err) = load_rows(&file) {
            check_error(&err, "train.json", Some(&format!("row {bad}")))?;
        }
    }

    /// A JSONL file with a byte changed (invalid UTF-8 included) or cut off loads or errs
    /// naming the file and the line.
    #[test]
    fn mangled_jsonl_bytes_err_naming_file_and_line(
        at in any::<Index>(),
        byte in prop_oneof![any::<u8>(), Just(0xff), Just(b'"'), Just(b'\n'), Just(b'{')],
        truncate in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.jsonl");
        let text: Vec<String> = (0..4).map(|i| valid_row(i).to_string()).collect();
        let mut bytes = text.join("\n").into_bytes();
        let i = at.index(bytes.len());
        if truncate {
            bytes.truncate(i);
        } else {
            bytes[i] = byte;
        }
        std::fs::write(&file, &bytes).unwrap();
        if let Err(err) = load_rows(&file) {
            check_error(&err, "train.jsonl", None)?;
            prop_assert!(err.to_string().contains("line "), "{}", err);
        }
    }
}

fn parquet_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<Row> = (0..3)
            .map(|i| {
                let mut extra = Map::new();
                extra.insert("db_id".into(), json!("shop"));
                extra.insert("difficulty".into(), json!(i));
                Row::new(
                    vec![
                        Message::new("system", "SQL"),
                        Message::user(format!("q{i} é")),
                    ],
                    "bird",
                    Some("text2sql".into()),
                    Some(json!("SELECT 1")),
                    extra,
                    i,
                )
            })
            .collect();
        let file = dir.path().join("rows.parquet");
        write_rows(&file, &rows).unwrap();
        std::fs::read(&file).unwrap()
    })
}

proptest! {
    #![proptest_config(config(256))]

    /// A parquet dataset with bytes changed or cut off loads or errs naming the file.
    #[test]
    fn mangled_parquet_errs_naming_the_file(
        at in any::<Index>(),
        byte in any::<u8>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = parquet_bytes().to_vec();
        let i = at.index(bytes.len());
        if truncate {
            bytes.truncate(i);
        } else {
            bytes[i] = byte;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.parquet");
        std::fs::write(&file, &bytes).unwrap();
        if let Err(err) = load_rows(&file) {
            check_error(&err, "train.parquet", None)?;
        }
    }
}

/// A byte the parquet crate panics on (a division by zero while decoding the mangled
/// dictionary page; 43 of 17,592 single-byte changes of this file do that) errs naming the
/// file instead.
#[test]
fn a_parquet_file_the_reader_panics_on_errs_naming_the_file() {
    let mut bytes = parquet_bytes().to_vec();
    bytes[12] = 0;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.parquet");
    std::fs::write(&file, &bytes).unwrap();
    let err = load_rows(&file).unwrap_err().to_string();
    assert!(
        err.contains("train.parquet") && err.contains("corrupt"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// SQL extraction.

/// A model response assembled from the pieces the extractors look for.
fn response() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("```sql"),
        Just("```SQL"),
        Just("```sqlite\n"),
        Just("```json"),
        Just("```"),
        Just("\n"),
        Just("\n\n"),
        Just(" "),
        Just("\x1c"),
        Just("\u{a0}"),
        Just("SELECT "),
        Just("select\t"),
        Just("SELECT"),
        Just("* FROM t"),
        Just(" LIMIT 3"),
        Just(";"),
        Just("{"),
        Just("}"),
        Just("\"sql\": "),
        Just("\""),
        Just("\\n"),
        Just("\\'"),
        Just("\\"),
        Just("<think>"),
        Just("</think>"),
        Just("<sql>"),
        Just("</sql>"),
        Just("<solution>"),
        Just("</solution>"),
        Just("<observation>"),
        Just("</observation>"),
        Just("#### "),
        Just("-1,234.5"),
        Just("é"),
        Just("🚀"),
        Just("ß"),
        Just("İ"),
        Just("\u{301}"),
    ];
    prop_oneof![
        6 => proptest::collection::vec(prop_oneof![
            8 => piece.prop_map(str::to_string),
            1 => any::<String>(),
        ], 0..24)
            .prop_map(|p| p.concat()),
        1 => any::<String>(),
    ]
}

fn check_extractors(text: &str) {
    let _ = text2sql::extract_sql(text).map(|sql| text2sql::with_limit(&sql));
    let _ = text2sql::think_tags_ok(text);
    let _ = text2sql::with_limit(text);
    if let Some(solution) = multiturn_sql::extract_solution(text) {
        assert!(text.contains(solution));
    }
    if let Some(action) = multiturn_sql::parse_sql_action(text) {
        assert!(text.contains(action));
    }
    let _ = gsm8k::extract_answer(text);
    let _ = gsm8k::compute_score(text, "1234.5");
}

proptest! {
    #![proptest_config(config(1024))]

    /// Every extractor takes any response without panicking.
    #[test]
    fn sql_extraction_takes_any_response(text in response()) {
        check_extractors(&text);
    }
}

/// Huge responses (a 2 MB run of fences, `SELECT`s, JSON braces and multibyte text) are
/// extracted in well under a few seconds each.
#[test]
fn sql_extraction_of_huge_responses_is_quick() {
    for unit in [
        "```sql\nSELECT é\n",
        "```json {\"sql\": \"SELECT 1\\n\"} ",
        "SELECT 🚀 ",
        "{{{{}}}}",
        "<think></think><solution></observation>",
        "\u{a0}\x1c\n",
    ] {
        let text = unit.repeat((2 << 20) / unit.len());
        let started = Instant::now();
        check_extractors(&text);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{unit:?}: {:?}",
            started.elapsed()
        );
    }
}

/// Found by the fuzzer: a JSONL line that is not UTF-8 gave the reader's bare "stream did
/// not contain valid UTF-8", naming no line; it now names the line.
#[test]
fn jsonl_line_that_is_not_utf8_errs_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.jsonl");
    let mut bytes = format!("{}\n", valid_row(0)).into_bytes();
    bytes.extend_from_slice(b"{\"prompt\": \"\xff\"}\n");
    std::fs::write(&file, &bytes).unwrap();
    let err = load_rows(&file).unwrap_err().to_string();
    assert!(
        err.contains("train.jsonl, line 2") && err.contains("not valid UTF-8"),
        "{err}"
    );
}
