//! The BIRD converter on a tiny BIRD-layout fixture built here: two databases, four questions,
//! one description CSV.

use std::path::Path;

use floe_env::bird::{convert_bird, BirdOptions, BirdSplit};
use floe_env::dataset::{load_rows, write_rows};
use rusqlite::Connection;
use serde_json::json;

fn make_db(path: &Path, sql: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    Connection::open(path).unwrap().execute_batch(sql).unwrap();
}

/// `<root>/train.json`, `train_databases/{school,music}/...`, and a description CSV for
/// `school.students` (Latin-1 encoded, with a quoted, multi-line field).
fn bird_fixture(root: &Path) {
    let dbs = root.join("train_databases");
    make_db(
        &dbs.join("school").join("school.sqlite"),
        "CREATE TABLE classes (id INTEGER PRIMARY KEY, title TEXT);
         CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, \"class id\" INTEGER,
             FOREIGN KEY (\"class id\") REFERENCES classes (id));
         INSERT INTO classes VALUES (1, 'Math'), (2, 'Art');
         INSERT INTO students VALUES (1, 'Ana', 1), (2, 'Bo', 2), (3, 'Cy', 1);",
    );
    make_db(
        &dbs.join("music").join("music.sqlite"),
        "CREATE TABLE songs (song_id INTEGER, album TEXT, plays REAL, PRIMARY KEY (song_id, album));
         INSERT INTO songs VALUES (1, 'Blue', 10.5), (2, 'Blue', 3.0);",
    );
    let desc = dbs.join("school").join("database_description");
    std::fs::create_dir_all(&desc).unwrap();
    let mut csv =
        b"original_column_name,column_name,column_description,data_format,value_description\n"
            .to_vec();
    csv.extend_from_slice(b"name,student name,\"The student's\nfull name\",text,caf\xE9 style\n");
    csv.extend_from_slice(b"class id,,class of the student,integer,\n");
    std::fs::write(desc.join("students.csv"), csv).unwrap();
    let questions = json!([
        {"question_id": 0, "db_id": "school", "question": "How many students are in Math?",
         "evidence": "Math refers to title = 'Math'",
         "SQL": "SELECT COUNT(*) FROM students AS T1 JOIN classes AS T2 ON T1.`class id` = T2.id WHERE T2.title = 'Math'"},
        {"question_id": 1, "db_id": "music", "question": "Which album has the most plays?",
         "evidence": "", "SQL": "SELECT album FROM songs ORDER BY plays DESC LIMIT 1"},
        {"question_id": 2, "db_id": "school", "question": "List all student names.",
         "SQL": "SELECT name FROM students"},
    ]);
    std::fs::write(root.join("train.json"), questions.to_string()).unwrap();
}

const EXPECTED_SCHOOL_SCHEMA: &str = "\
CREATE TABLE classes (
  id INTEGER PRIMARY KEY, -- example: [1, 2]
  title TEXT -- example: ['Math', 'Art']
);
-- Sample rows from \"classes\":
| id | title |
| --- | --- |
| 1 | Math |
| 2 | Art |

CREATE TABLE students (
  id INTEGER PRIMARY KEY, -- example: [1, 2, 3]
  name TEXT, -- example: ['Ana', 'Bo', 'Cy'] | name: student name | desc: The student's full name | values: café style
  \"class id\" INTEGER, -- example: [1, 2] | desc: class of the student
  FOREIGN KEY (\"class id\") REFERENCES classes (id)
);
-- Foreign keys: \"class id\" -> classes.id
-- Sample rows from \"students\":
| id | name | class id |
| --- | --- | --- |
| 1 | Ana | 1 |
| 2 | Bo | 2 |
| 3 | Cy | 1 |";

#[test]
fn converts_train_split_into_arctic_prompts() {
    let bird = tempfile::tempdir().unwrap();
    bird_fixture(bird.path());
    let rows = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Train)).unwrap();
    assert_eq!(rows.len(), 3);

    let row = &rows[0];
    assert_eq!(row.data_source, "bird");
    assert_eq!(row.env_class.as_deref(), Some(floe_env::env::TEXT2SQL));
    assert_eq!(row.ground_truth, Some(json!(
        "SELECT COUNT(*) FROM students AS T1 JOIN classes AS T2 ON T1.`class id` = T2.id WHERE T2.title = 'Math'"
    )));
    assert_eq!(row.prompt.len(), 2);
    assert_eq!(row.prompt[0].role, "system");
    assert!(row.prompt[0]
        .content
        .starts_with("You are a data science expert."));
    assert_eq!(row.prompt[1].role, "user");
    let user = &row.prompt[1].content;
    let expected_start = format!(
        "Database Engine:\nSQLite\n\nDatabase Schema:\n{EXPECTED_SCHOOL_SCHEMA}\nThis schema describes"
    );
    assert!(user.starts_with(&expected_start), "user message:\n{user}");
    assert!(user.contains(
        "\n\nQuestion:\nHow many students are in Math?\n\nEvidence:\nMath refers to title = 'Math'\n\nInstructions:\n- "
    ));
    let sections: Vec<usize> = [
        "Database Engine:",
        "Database Schema:",
        "Question:",
        "Instructions:",
        "Output Format:",
    ]
    .iter()
    .map(|s| user.find(s).unwrap_or_else(|| panic!("no {s} section")))
    .collect();
    assert!(
        sections.windows(2).all(|w| w[0] < w[1]),
        "sections out of order"
    );
    assert!(user.contains("<think>") && user.contains("<answer>\n```sql\n"));

    let extra = row.extra_info();
    assert_eq!(extra["db_id"], json!("school"));
    assert_eq!(extra["index"], json!(0));
    assert_eq!(extra["split"], json!("train"));
    let db_path = bird.path().join("train_databases/school/school.sqlite");
    assert_eq!(row.db_path(), Some(db_path.to_str().unwrap()));

    // No evidence, composite key, real values; the music schema has no descriptions.
    let music = &rows[1].prompt[1].content;
    assert!(music.contains(
        "CREATE TABLE songs (\n  song_id INTEGER, -- example: [1, 2]\n  album TEXT, -- example: ['Blue']\n  plays REAL, -- example: [10.5, 3.0]\n  PRIMARY KEY (song_id, album)\n);"
    ), "{music}");
    assert!(music.contains("Question:\nWhich album has the most plays?\n\nInstructions:"));
    assert!(rows[2].prompt[1]
        .content
        .contains("Question:\nList all student names.\n\nInstructions:"));
}

#[test]
fn dev_split_is_clean_and_limit_applies() {
    let bird = tempfile::tempdir().unwrap();
    bird_fixture(bird.path());
    std::fs::rename(bird.path().join("train.json"), bird.path().join("dev.json")).unwrap();
    std::fs::rename(
        bird.path().join("train_databases"),
        bird.path().join("dev_databases"),
    )
    .unwrap();
    let options = BirdOptions {
        limit: Some(1),
        ..BirdOptions::new(BirdSplit::Dev)
    };
    let rows = convert_bird(bird.path(), &options).unwrap();
    assert_eq!(rows.len(), 1);
    let user = &rows[0].prompt[1].content;
    assert!(
        user.contains("  name TEXT, -- example: ['Ana', 'Bo', 'Cy']\n"),
        "{user}"
    );
    assert!(!user.contains("Sample rows"));
    assert!(!user.contains("-- Foreign keys"));
    assert!(!user.contains("desc:"));
}

#[test]
fn written_dataset_points_at_the_databases() {
    let bird = tempfile::tempdir().unwrap();
    bird_fixture(bird.path());
    let rows = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Train)).unwrap();
    let out = bird.path().join("converted").join("train.parquet");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    write_rows(&out, &rows).unwrap();
    let back = load_rows(&out).unwrap();
    assert_eq!(back, rows);
    let jsonl = bird.path().join("converted").join("train.jsonl");
    write_rows(&jsonl, &rows).unwrap();
    let text = std::fs::read_to_string(&jsonl).unwrap();
    assert!(
        text.contains("\"db_path\":\"../train_databases/school/school.sqlite\""),
        "{text}"
    );
}

#[test]
fn missing_database_and_malformed_json_are_named() {
    let bird = tempfile::tempdir().unwrap();
    bird_fixture(bird.path());
    let questions = json!([
        {"db_id": "school", "question": "q", "SQL": "SELECT 1"},
        {"db_id": "nowhere", "question": "q", "SQL": "SELECT 1"},
    ]);
    std::fs::write(bird.path().join("train.json"), questions.to_string()).unwrap();
    let err = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Train))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train.json, entry 1: database `nowhere` not found"),
        "{err}"
    );
    assert!(
        err.contains("train_databases/nowhere/nowhere.sqlite"),
        "{err}"
    );

    let questions = json!([{"db_id": "school", "question": "q"}]);
    std::fs::write(bird.path().join("train.json"), questions.to_string()).unwrap();
    let err = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Train))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train.json, entry 0: key `SQL` is missing"),
        "{err}"
    );

    std::fs::write(bird.path().join("train.json"), "[{\"db_id\": ").unwrap();
    let err = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Train))
        .unwrap_err()
        .to_string();
    assert!(err.contains("train.json: invalid JSON"), "{err}");

    let err = convert_bird(bird.path(), &BirdOptions::new(BirdSplit::Dev))
        .unwrap_err()
        .to_string();
    assert!(err.contains("dev.json"), "{err}");
}
