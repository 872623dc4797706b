//! Datasets: parquet and JSONL round trips, layouts written by other tools, error messages,
//! prompt-budget filtering and the resumable cursor.

use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, ListArray, RecordBatch, StringArray, StructArray};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Fields, Schema};
use floe_env::dataset::{
    filter_by_prompt_budget, load_rows, write_rows, DataCursor, DatasetError, Row,
};
use floe_env::env::Message;
use parquet::arrow::ArrowWriter;
use serde_json::{json, Map, Value};

fn object(value: Value) -> Map<String, Value> {
    value.as_object().cloned().expect("an object")
}

fn sample_rows(dir: &Path) -> Vec<Row> {
    let db = dir.join("dbs").join("shop.sqlite");
    vec![
        Row::new(
            vec![
                Message::new("system", "You write SQL."),
                Message::user("How many orders?\nAnswer in SQL."),
            ],
            "bird",
            Some("bird".into()),
            Some(json!("SELECT COUNT(*) FROM orders")),
            object(json!({
                "db_id": "shop",
                "db_path": db.to_string_lossy(),
                "difficulty": 2,
                "tags": ["count", "single-table"],
            })),
            0,
        ),
        Row::new(
            vec![Message::user("What is 2 + 3?")],
            "gsm8k",
            None,
            Some(json!({"target": 5, "alternatives": ["5.0"]})),
            object(json!({"split": "test", "difficulty": 1.5})),
            1,
        ),
        Row::new(
            vec![Message::user("Say hi.")],
            "chat",
            Some("gsm8k".into()),
            None,
            Map::new(),
            2,
        ),
    ]
}

#[test]
fn parquet_and_jsonl_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let rows = sample_rows(dir.path());
    for name in ["rows.parquet", "rows.jsonl"] {
        let path = dir.path().join(name);
        write_rows(&path, &rows).unwrap();
        let back = load_rows(&path).unwrap();
        assert_eq!(back, rows, "{name} changed the rows");
    }
}

#[test]
fn db_path_is_written_relative_and_read_absolute() {
    let dir = tempfile::tempdir().unwrap();
    let rows = sample_rows(dir.path());
    let path = dir.path().join("rows.jsonl");
    write_rows(&path, &rows).unwrap();
    let first_line: Value = serde_json::from_str(
        std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        first_line["extra_info"]["db_path"],
        json!("dbs/shop.sqlite")
    );
    assert_eq!(
        first_line["reward_spec"]["ground_truth"],
        json!("SELECT COUNT(*) FROM orders")
    );

    // Moving the folder keeps the dataset working.
    let moved = tempfile::tempdir().unwrap();
    let moved_path = moved.path().join("rows.jsonl");
    std::fs::copy(&path, &moved_path).unwrap();
    let back = load_rows(&moved_path).unwrap();
    let expected = moved.path().join("dbs").join("shop.sqlite");
    assert_eq!(back[0].db_path(), Some(expected.to_str().unwrap()));
}

/// The layout verl's preprocessing writes through pandas: `prompt` a list of structs,
/// `reward_model` and `extra_info` structs, an extra `ability` column, no `env_class`.
#[test]
fn reads_verl_struct_layout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("verl.parquet");
    let message_fields = Fields::from(vec![
        Field::new("content", DataType::Utf8, true),
        Field::new("role", DataType::Utf8, true),
    ]);
    let messages = StructArray::new(
        message_fields.clone(),
        vec![
            Arc::new(StringArray::from(vec![
                "sys",
                "question one",
                "question two",
            ])) as ArrayRef,
            Arc::new(StringArray::from(vec!["system", "user", "user"])),
        ],
        None,
    );
    let item = Arc::new(Field::new(
        "element",
        DataType::Struct(message_fields),
        true,
    ));
    let prompt = ListArray::new(
        item,
        OffsetBuffer::from_lengths([2, 1]),
        Arc::new(messages),
        None,
    );
    let reward_fields = Fields::from(vec![
        Field::new("ground_truth", DataType::Utf8, true),
        Field::new("style", DataType::Utf8, true),
    ]);
    let reward_model = StructArray::new(
        reward_fields,
        vec![
            Arc::new(StringArray::from(vec!["SELECT 1", "SELECT 2"])) as ArrayRef,
            Arc::new(StringArray::from(vec!["rule", "rule"])),
        ],
        None,
    );
    let info_fields = Fields::from(vec![
        Field::new("db_path", DataType::Utf8, true),
        Field::new("index", DataType::Int64, true),
    ]);
    let extra_info = StructArray::new(
        info_fields,
        vec![
            Arc::new(StringArray::from(vec![Some("/data/a.sqlite"), None])) as ArrayRef,
            Arc::new(Int64Array::from(vec![7, 8])),
        ],
        None,
    );
    let columns: Vec<(&str, ArrayRef)> = vec![
        (
            "data_source",
            Arc::new(StringArray::from(vec!["bird", "bird"])),
        ),
        ("prompt", Arc::new(prompt)),
        ("ability", Arc::new(StringArray::from(vec!["sql", "sql"]))),
        ("reward_model", Arc::new(reward_model)),
        ("extra_info", Arc::new(extra_info)),
    ];
    write_batch(&path, columns);

    let rows = load_rows(&path).unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[0].prompt,
        vec![Message::new("system", "sys"), Message::user("question one")]
    );
    assert_eq!(rows[0].env_class, None);
    assert_eq!(rows[1].ground_truth, Some(json!("SELECT 2")));
    assert_eq!(rows[0].db_path(), Some("/data/a.sqlite"));
    assert_eq!(
        rows[1].db_path(),
        None,
        "a null struct field reads as absent"
    );
    assert_eq!(rows[1].extras["extra_info"]["index"], json!(8));
    assert_eq!(rows[0].extras["ability"], json!("sql"));
    assert_eq!(rows[0].extras["reward_model"]["style"], json!("rule"));
    assert_eq!(
        rows[0].extras["reward_spec"]["ground_truth"],
        json!("SELECT 1")
    );
    assert_eq!(rows[1].index, 1);
}

/// Nested columns stored as JSON text, as some scripts write them.
#[test]
fn reads_json_string_columns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("strings.parquet");
    let columns: Vec<(&str, ArrayRef)> = vec![
        ("data_source", Arc::new(StringArray::from(vec!["gsm8k"]))),
        (
            "prompt",
            Arc::new(StringArray::from(vec![
                r#"[{"role": "user", "content": "What is 6 * 7?"}]"#,
            ])),
        ),
        (
            "env_class",
            Arc::new(StringArray::from(vec![Some("gsm8k")])),
        ),
        (
            "reward_spec",
            Arc::new(StringArray::from(vec![
                r#"{"method": "rule", "ground_truth": "42"}"#,
            ])),
        ),
        (
            "extra_info",
            Arc::new(StringArray::from(vec![r#"{"db_path": "dbs/x.sqlite"}"#])),
        ),
    ];
    write_batch(&path, columns);
    let rows = load_rows(&path).unwrap();
    assert_eq!(rows[0].prompt, vec![Message::user("What is 6 * 7?")]);
    assert_eq!(rows[0].env_class.as_deref(), Some("gsm8k"));
    assert_eq!(rows[0].ground_truth, Some(json!("42")));
    assert_eq!(rows[0].extras["reward_spec"]["method"], json!("rule"));
    let expected = dir.path().join("dbs").join("x.sqlite");
    assert_eq!(rows[0].db_path(), Some(expected.to_str().unwrap()));
}

fn write_batch(path: &Path, columns: Vec<(&str, ArrayRef)>) {
    let fields: Vec<Field> = columns
        .iter()
        .map(|(name, array)| Field::new(*name, array.data_type().clone(), true))
        .collect();
    let batch = RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap();
    let mut writer =
        ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

fn error_text(path: &Path, content: &str) -> String {
    std::fs::write(path, content).unwrap();
    load_rows(path).unwrap_err().to_string()
}

#[test]
fn malformed_rows_name_file_line_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.jsonl");
    let good = r#"{"data_source": "x", "prompt": [{"role": "user", "content": "hi"}]}"#;

    let err = error_text(
        &path,
        &format!("{good}\n{good}\n{{\"data_source\": \"x\"}}\n"),
    );
    assert!(err.contains("bad.jsonl"), "{err}");
    assert!(err.contains("line 3"), "{err}");
    assert!(err.contains("missing key `prompt`"), "{err}");

    let err = error_text(&path, &format!("{good}\n{{\"prompt\": [\n"));
    assert!(err.contains("bad.jsonl, line 2: invalid JSON"), "{err}");

    let err = error_text(
        &path,
        &format!(
            "{good}\n\n{}\n",
            r#"{"prompt": [{"role": 1, "content": "hi"}]}"#
        ),
    );
    assert!(err.contains("line 3"), "{err}");
    assert!(
        err.contains("`prompt[0].role` must be a string, found a number"),
        "{err}"
    );

    let err = error_text(&path, r#"{"prompt": "not json", "data_source": "x"}"#);
    assert!(
        err.contains("`prompt` is a string that is not valid JSON"),
        "{err}"
    );

    let err = error_text(
        &path,
        r#"{"prompt": [{"role": "user", "content": "hi"}], "extra_info": 3}"#,
    );
    assert!(
        err.contains("`extra_info` must be an object, found a number"),
        "{err}"
    );

    let err = error_text(&dir.path().join("rows.csv"), "a,b\n");
    assert!(err.contains("rows.csv: unknown dataset format"), "{err}");

    let parquet = dir.path().join("noprompt.parquet");
    write_batch(
        &parquet,
        vec![(
            "data_source",
            Arc::new(StringArray::from(vec!["a", "b"])) as ArrayRef,
        )],
    );
    let err = load_rows(&parquet).unwrap_err();
    assert!(matches!(err, DatasetError::MissingKey { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("noprompt.parquet, row 0: missing key `prompt`"),
        "{err}"
    );

    let err = load_rows(dir.path().join("absent.parquet"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent.parquet"), "{err}");
}

#[test]
fn prompt_budget_drops_and_counts_rows_over_budget() {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Row> = (0..10)
        .map(|i| {
            Row::new(
                vec![Message::user("w ".repeat(i))],
                "x",
                None,
                None,
                Map::new(),
                i,
            )
        })
        .collect();
    let words = |row: &Row| -> Result<usize, std::convert::Infallible> {
        Ok(row.prompt[0].content.split_whitespace().count())
    };
    let (kept, dropped) = filter_by_prompt_budget(rows.clone(), 6, words).unwrap();
    assert_eq!(dropped, 3);
    assert_eq!(
        kept.iter().map(|r| r.index).collect::<Vec<_>>(),
        (0..=6).collect::<Vec<_>>()
    );
    assert_eq!(kept[6], rows[6], "kept rows are untouched, never truncated");

    let failing = |_: &Row| -> Result<usize, String> { Err("tokenizer failed".into()) };
    assert_eq!(
        filter_by_prompt_budget(rows, 6, failing).unwrap_err(),
        "tokenizer failed"
    );
    drop(dir);
}

#[test]
fn cursor_resumes_exactly_and_covers_each_epoch() {
    let mut uninterrupted = DataCursor::new(10, 42);
    let expected: Vec<Vec<usize>> = (0..9).map(|_| uninterrupted.next_batch(4)).collect();

    let mut cursor = DataCursor::new(10, 42);
    let mut resumed: Vec<Vec<usize>> = (0..4).map(|_| cursor.next_batch(4)).collect();
    let saved = serde_json::to_string(&cursor).unwrap();
    let mut restored: DataCursor = serde_json::from_str(&saved).unwrap();
    resumed.extend((0..5).map(|_| restored.next_batch(4)));
    assert_eq!(resumed, expected);
    assert_eq!(restored, uninterrupted);

    // 36 rows handed out: epochs 0, 1 and 2 complete, 6 rows into epoch 3.
    let flat: Vec<usize> = expected.concat();
    for epoch in flat.chunks(10).take(3) {
        let mut sorted = epoch.to_vec();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    }
    assert_eq!((uninterrupted.epoch, uninterrupted.position), (3, 6));
    assert_ne!(flat[..10], flat[10..20], "each epoch has its own order");

    let other_seed: Vec<usize> = DataCursor::new(10, 43).next_batch(10);
    assert_ne!(other_seed, flat[..10]);
    assert!(DataCursor::new(0, 1).next_batch(3).is_empty());
}
