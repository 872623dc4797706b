//! The Arctic/BIRD reward, one case per branch of the reference, quirks included.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use floe_env::sandbox::{Sandbox, SandboxConfig};
use floe_env::text2sql::{
    extract_sql, think_tags_ok, with_limit, Text2SqlCase, Text2SqlReward, Text2SqlScore,
};

fn make_db(dir: &Path) -> PathBuf {
    let path = dir.join("concert.sqlite");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, rating REAL);
         INSERT INTO singer VALUES (1, 'Ann', 30, 4.0), (2, 'Bob', 41, 3.5), (3, 'Cy', 30, 5.0);
         CREATE TABLE big (x INTEGER);
         WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 6000)
         INSERT INTO big SELECT x FROM c;",
    )
    .unwrap();
    path
}

const GOLD: &str = "SELECT name FROM singer WHERE age = 30";

fn think(answer: &str) -> String {
    format!("<think>\nsingers aged 30\n</think>\n<answer>\n{answer}\n</answer>")
}

fn sql_block(sql: &str) -> String {
    format!("```sql\n{sql}\n```")
}

struct Case {
    name: &'static str,
    response: String,
    gold: &'static str,
    alternatives: &'static [&'static str],
    expected: (f64, bool, bool),
}

fn case(name: &'static str, response: String, expected: (f64, bool, bool)) -> Case {
    Case {
        name,
        response,
        gold: GOLD,
        alternatives: &[],
        expected,
    }
}

fn cases() -> Vec<Case> {
    let correct = "SELECT name FROM singer WHERE age = 30;";
    let wrong = "SELECT name FROM singer WHERE age = 41";
    let broken = "SELEC name FROM singer";
    let endless = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) \
                   SELECT count(*) FROM r";
    vec![
        case(
            "correct, formatted",
            think(&sql_block(correct)),
            (1.0, true, true),
        ),
        case(
            "correct, no think tags",
            sql_block(correct),
            (1.0, false, true),
        ),
        case(
            "wrong result, formatted",
            think(&sql_block(wrong)),
            (0.1, true, true),
        ),
        case(
            "wrong result, unformatted",
            sql_block(wrong),
            (0.1, false, true),
        ),
        case(
            "fails, formatted: format bonus",
            think(&sql_block(broken)),
            (0.1, true, false),
        ),
        case("fails, unformatted", sql_block(broken), (0.0, false, false)),
        case(
            "times out, formatted",
            think(&sql_block(endless)),
            (0.1, true, false),
        ),
        case(
            "times out, unformatted",
            sql_block(endless),
            (0.0, false, false),
        ),
        case(
            "no SQL at all",
            think("I do not know."),
            (0.0, false, false),
        ),
        case(
            "SQL only inside think is ignored",
            format!("<think>{}</think> done", sql_block(correct)),
            (0.0, false, false),
        ),
        case(
            "two <think> tags",
            format!("<think>a</think><think>b</think>{}", sql_block(correct)),
            (1.0, false, true),
        ),
        case(
            "</think> before <think>",
            format!("x</think><think>{}", sql_block(correct)),
            (1.0, false, true),
        ),
        case(
            "extraction starts after the first </think>",
            format!("<think>{}</think>{}", sql_block(wrong), sql_block(correct)),
            (1.0, true, true),
        ),
        case(
            "the last sql block wins",
            think(&format!("{}\n{}", sql_block(wrong), sql_block(correct))),
            (1.0, true, true),
        ),
        case(
            "the last sql block wins even when wrong",
            think(&format!("{}\n{}", sql_block(correct), sql_block(wrong))),
            (0.1, true, true),
        ),
        case(
            "sql blocks of 6 characters or fewer are skipped",
            think(&format!("{}\n{}", sql_block(correct), sql_block("SELECT"))),
            (1.0, true, true),
        ),
        case(
            "a generic block containing SELECT",
            think(&format!("```\n{correct}\n```")),
            (1.0, true, true),
        ),
        case(
            "a generic block without SELECT is not SQL",
            think("```\nnothing here\n```"),
            (0.0, false, false),
        ),
        case(
            "a json block's sql key, after a code block whose closing fence it shares",
            think(&format!(
                "```python\nplan = 1\n```json\n{{\"sql\": \"{correct}\"}}\n```"
            )),
            (1.0, true, true),
        ),
        case(
            "a raw SELECT up to a blank line",
            think(&format!(
                "The query is\n{correct}\n\nThat is all, SELECT nothing."
            )),
            (1.0, true, true),
        ),
        case(
            "<answer> tags are not a source",
            "<think>x</think><answer>Ann and Cy</answer>".to_string(),
            (0.0, false, false),
        ),
        case(
            "row order and duplicates are ignored",
            think(&sql_block(
                "SELECT name FROM singer WHERE age = 30 UNION ALL \
                 SELECT name FROM singer WHERE age = 30 ORDER BY name DESC",
            )),
            (1.0, true, true),
        ),
        case(
            "column order matters",
            think(&sql_block("SELECT name, age FROM singer WHERE age = 30")),
            (0.1, true, true),
        ),
        case(
            "writes fail in the read-only sandbox",
            think(&sql_block("DELETE FROM singer")),
            (0.1, true, false),
        ),
        case(
            "two statements fail",
            sql_block("SELECT 1; SELECT 2"),
            (0.0, false, false),
        ),
        Case {
            name: "an integer result equals the same float result",
            response: sql_block("SELECT 4.0 FROM singer WHERE id = 1"),
            gold: "SELECT 4 FROM singer WHERE id = 1",
            alternatives: &[],
            expected: (1.0, false, true),
        },
        Case {
            name: "a failing gold scores 0, even for a running prediction",
            response: sql_block(correct),
            gold: "SELECT missing FROM singer",
            alternatives: &[],
            expected: (0.0, false, true),
        },
        Case {
            name: "a failing gold with the format bonus",
            response: think(&sql_block(correct)),
            gold: "SELECT missing FROM singer",
            alternatives: &[],
            expected: (0.1, true, true),
        },
        Case {
            name: "an alternative answer matches",
            response: sql_block(correct),
            gold: "SELECT 'unused'",
            alternatives: &["SELECT id FROM singer", GOLD],
            expected: (1.0, false, true),
        },
        Case {
            name: "alternatives replace the ground truth",
            response: sql_block(correct),
            gold: GOLD,
            alternatives: &["SELECT id FROM singer"],
            expected: (0.1, false, true),
        },
        Case {
            name: "LIMIT 5000 is appended to both sides",
            response: sql_block("SELECT x FROM big"),
            gold: "SELECT x FROM big",
            alternatives: &[],
            expected: (1.0, false, true),
        },
        Case {
            name: "an explicit LIMIT keeps all rows, so 6000 rows differ from 5000",
            response: sql_block("SELECT x FROM big"),
            gold: "SELECT x FROM big LIMIT 6000",
            alternatives: &[],
            expected: (0.1, false, true),
        },
        Case {
            name: "a LIMIT in a subquery suppresses the appended LIMIT (substring test)",
            response: sql_block("SELECT x FROM big WHERE x IN (SELECT x FROM big LIMIT 6000)"),
            gold: "SELECT x FROM big LIMIT 6000",
            alternatives: &[],
            expected: (1.0, false, true),
        },
    ]
}

fn reward() -> Text2SqlReward {
    let sandbox = Arc::new(Sandbox::new(SandboxConfig::default()));
    Text2SqlReward::new(sandbox, Duration::from_millis(300))
}

#[test]
fn every_branch_scores_as_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let reward = reward();
    let mut failures = Vec::new();
    for case in cases() {
        let alternatives: Vec<String> = case.alternatives.iter().map(|s| s.to_string()).collect();
        let got = reward.score(&Text2SqlCase {
            response: &case.response,
            ground_truth: case.gold,
            alternative_answers: &alternatives,
            db_path: Some(&db),
        });
        let (score, format_correct, execution_success) = case.expected;
        let want = Text2SqlScore {
            score,
            format_correct,
            execution_success,
        };
        if got != want {
            failures.push(format!("{}: got {got:?}, want {want:?}", case.name));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn no_db_path_scores_zero() {
    let got = reward().score(&Text2SqlCase {
        response: &sql_block("SELECT 1"),
        ground_truth: "SELECT 1",
        alternative_answers: &[],
        db_path: None,
    });
    assert_eq!(
        got,
        Text2SqlScore {
            score: 0.0,
            format_correct: false,
            execution_success: false
        },
        "the reference checks nothing, not even the format, without a database"
    );
}

#[test]
fn limit_rule_is_a_substring_test() {
    assert_eq!(with_limit("SELECT a FROM t"), "SELECT a FROM t LIMIT 5000;");
    assert_eq!(
        with_limit("SELECT a FROM t;\n"),
        "SELECT a FROM t LIMIT 5000;"
    );
    assert_eq!(
        with_limit("SELECT a FROM t ; "),
        "SELECT a FROM t LIMIT 5000;",
        "whitespace before the dropped `;` goes too (Python's rstrip, rstrip(';'), rstrip)"
    );
    assert_eq!(with_limit(""), "", "an empty query stays empty");
    assert_eq!(
        with_limit("select a from t limit 3"),
        "select a from t limit 3"
    );
    assert_eq!(
        with_limit("SELECT a FROM t LIMIT\n3"),
        "SELECT a FROM t LIMIT\n3"
    );
    assert_eq!(
        with_limit("SELECT a FROM t LIMIT\t3"),
        "SELECT a FROM t LIMIT\t3"
    );
    // `LIMIT(` and a column named `limit_x` do not count.
    assert_eq!(
        with_limit("SELECT limit_x FROM t"),
        "SELECT limit_x FROM t LIMIT 5000;"
    );
    // A LIMIT inside a string literal or a subquery counts.
    assert_eq!(
        with_limit("SELECT 'limit 1' FROM t"),
        "SELECT 'limit 1' FROM t"
    );
}

#[test]
fn extraction_order() {
    assert_eq!(extract_sql("no sql"), None);
    assert_eq!(
        extract_sql("```sql\n  SELECT a FROM t  \n```").as_deref(),
        Some("SELECT a FROM t")
    );
    assert_eq!(
        extract_sql("```sqlite\nSELECT a FROM t\n```").as_deref(),
        Some("ite\nSELECT a FROM t"),
        "the sql-block pattern is a prefix match, as in the reference"
    );
    assert_eq!(
        extract_sql("```SQL\nSELECT a FROM t\n```").as_deref(),
        Some("SQL\nSELECT a FROM t"),
        "other info strings are generic blocks, the word kept"
    );
    assert_eq!(
        extract_sql("```\nx\n```json\n{\"sql\": \"SELECT b FROM t\"}\n```").as_deref(),
        Some("SELECT b FROM t")
    );
    assert_eq!(
        extract_sql("so select a\nfrom t\n\nend").as_deref(),
        Some("select a\nfrom t")
    );
}

#[test]
fn think_tag_check() {
    assert!(think_tags_ok("<think>a</think>b"));
    assert!(!think_tags_ok("a</think>"));
    assert!(!think_tags_ok("</think><think>"));
    assert!(!think_tags_ok("<think><think></think>"));
}

/// A fence whose first bytes are not ASCII must not split a character (the `json` check
/// once sliced four bytes and panicked on such text).
#[test]
fn fence_starting_with_multibyte_text_is_read_not_panicked_on() {
    let response = "<think>plan</think>\n```éé\nSELECT name FROM t\n```";
    let sql = extract_sql(response).expect("the fenced SELECT is found");
    assert!(sql.ends_with("SELECT name FROM t"), "{sql:?}");
}

/// What Python's `re` and `json.loads(strict=False)` extract from each response, as the
/// reference's extraction steps apply them (expected values computed with Python 3.11).
#[test]
fn extraction_matches_python_re_and_json_on_each_kind() {
    let cases: &[(&str, &str, Option<&str>)] = &[
        ("kind1: a json block containing SELECT is a generic block, fence word and all", "<think>\nsingers aged 30\n</think>\n<answer>\n```json\n{\"sql\": \"SELECT name FROM singer WHERE age = 30\"}\n```\n</answer>", Some("json\n{\"sql\": \"SELECT name FROM singer WHERE age = 30\"}")),
        ("kind1: a json fence that closes a code block is read for its sql key; escaped quotes decode", "<think>\nsingers aged 30\n</think>\n<answer>\n```python\nplan = 1\n```json\n{\"sql\": \"SELECT name AS \\\"name\\\" FROM singer WHERE age = 30\"}\n```\n</answer>", Some("SELECT name AS \"name\" FROM singer WHERE age = 30")),
        ("kind1: escaped single quotes are unescaped before parsing", "<think>\nsingers aged 30\n</think>\n<answer>\n```python\nplan = 1\n```json\n{\"sql\": \"SELECT name FROM singer WHERE name = \\'Ann\\' OR age = 30\"}\n```\n</answer>", Some("SELECT name FROM singer WHERE name = 'Ann' OR age = 30")),
        ("kind1: raw newlines inside the JSON string are accepted (strict=False)", "<think>\nsingers aged 30\n</think>\n<answer>\n```python\nplan = 1\n```json\n{\"sql\": \"SELECT name\nFROM singer\nWHERE age = 30\"}\n```\n</answer>", Some("SELECT name\nFROM singer\nWHERE age = 30")),
        ("kind1: a nested object hides the sql key (last { to first })", "<think>\nsingers aged 30\n</think>\n<answer>\n```python\nplan = 1\n```json\n{\"sql\": \"SELECT name FROM singer WHERE age = 30\", \"meta\": {\"k\": 1}}\n```\n</answer>", Some("SELECT name FROM singer WHERE age = 30\", \"meta\": {\"k\": 1}}\n```\n</answer>")),
        ("kind1: JSON without SELECT, then raw SQL up to the end", "<think>\nsingers aged 30\n</think>\n<answer>\n```json\n{\"tables\": [\"singer\"]}\n```\nSELECT name FROM singer WHERE age = 30\n</answer>", Some("SELECT name FROM singer WHERE age = 30\n</answer>")),
        ("kind1: a code block mentioning select wins over the SQL after it", "<think>\nsingers aged 30\n</think>\n<answer>\n```\nselect the singers\n```\nSELECT name FROM singer WHERE age = 30\n</answer>", Some("select the singers")),
        ("kind2: ```SQL keeps the word", "<think>\nsingers aged 30\n</think>\n<answer>\n```SQL\nSELECT name FROM singer WHERE age = 30\n```\n</answer>", Some("SQL\nSELECT name FROM singer WHERE age = 30")),
        ("kind2: ```postgresql keeps the word", "<think>\nsingers aged 30\n</think>\n<answer>\n```postgresql\nSELECT name FROM singer WHERE age = 30\n```\n</answer>", Some("postgresql\nSELECT name FROM singer WHERE age = 30")),
        ("kind2: ```sqlite is a prefix match of ```sql", "<think>\nsingers aged 30\n</think>\n<answer>\n```sqlite\nSELECT name FROM singer WHERE age = 30\n```\n</answer>", Some("ite\nSELECT name FROM singer WHERE age = 30")),
        ("kind2: ```Sql keeps the word", "<think>\nsingers aged 30\n</think>\n<answer>\n```Sql\nSELECT name FROM singer WHERE age = 30;\n```\n</answer>", Some("Sql\nSELECT name FROM singer WHERE age = 30;")),
        ("kind5: a lone SELECT inside answer tags takes the closing tag along", "<think>\nsingers aged 30\n</think>\n<answer>\nSELECT\n</answer>", Some("SELECT\n</answer>")),
        ("kind5: a lone SELECT at the end is no SQL", "<think>x</think>SELECT", None),
        ("kind5: a lone SELECT and a final newline is no SQL", "<think>x</think>SELECT\n", None),
        ("kind5: SELECT * is SQL", "<think>x</think>SELECT *", Some("SELECT *")),
        ("kind5: a ```sql block of 6 characters falls to the generic block", "<think>x</think>```sql\nSELECT\n```", Some("sql\nSELECT")),
        ("kind5: SELECT inside a word counts", "<think>x</think>I will unselect nothing", Some("select nothing")),
        ("kind5: a blank line right after SELECT does not end it", "<think>x</think>SELECT\n\nname FROM singer", Some("SELECT\n\nname FROM singer")),
        ("kind5: a generic block of 6 characters falls to the raw SELECT", "<think>x</think>```\nSELECT\n```", Some("SELECT\n```")),
        ("kind5: an empty ```sql block is no SQL", "<think>x</think>```sql\n```", None),
        ("kind5: selection is not SELECT and whitespace", "<think>x</think>selection\n", None),
        ("python whitespace: U+001F separates like a space", "<think>x</think>SELECT\u{1f}1", Some("SELECT\u{1f}1")),
    ];
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|&(name, response, want)| {
            let got = extract_sql(response);
            (got.as_deref() != want).then(|| format!("{name}: got {got:?}, want {want:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// Scores `response` against `gold` (and `alternatives`) on a fresh database; returns the
/// score and whether the database file kept every byte.
fn score_on_db(response: &str, gold: &str, alternatives: &[&str]) -> (Text2SqlScore, bool) {
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    let before = std::fs::read(&db).unwrap();
    let alternatives: Vec<String> = alternatives.iter().map(|s| s.to_string()).collect();
    let got = reward().score(&Text2SqlCase {
        response,
        ground_truth: gold,
        alternative_answers: &alternatives,
        db_path: Some(&db),
    });
    (got, std::fs::read(&db).unwrap() == before)
}

/// (name, response, gold, (score, format_correct, execution_success)).
type ScoreCase<'a> = (&'a str, String, &'a str, (f64, bool, bool));

fn assert_scores(cases: &[ScoreCase<'_>]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(
            |(name, response, gold, (score, format_correct, execution_success))| {
                let (got, unchanged) = score_on_db(response, gold, &[]);
                let want = Text2SqlScore {
                    score: *score,
                    format_correct: *format_correct,
                    execution_success: *execution_success,
                };
                (got != want || !unchanged).then(|| {
                    format!("{name}: got {got:?} (db unchanged: {unchanged}), want {want:?}")
                })
            },
        )
        .collect();
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

#[test]
fn kind1_json_and_code_blocks_before_the_sql_score_as_the_reference() {
    let json = "{\"sql\": \"SELECT name FROM singer WHERE age = 30\"}";
    assert_scores(&[
        (
            "a json block with SELECT runs as `json\\n{...}` and fails",
            think(&format!("```json\n{json}\n```")),
            GOLD,
            (0.1, true, false),
        ),
        (
            "the same without think tags earns nothing",
            format!("```json\n{json}\n```"),
            GOLD,
            (0.0, false, false),
        ),
        (
            "escaped double quotes decode",
            think(
                "```python\nplan = 1\n```json\n\
                 {\"sql\": \"SELECT name AS \\\"name\\\" FROM singer WHERE age = 30\"}\n```",
            ),
            GOLD,
            (1.0, true, true),
        ),
        (
            "raw newlines inside the JSON string are accepted",
            think(
                "```python\nplan = 1\n```json\n\
                 {\"sql\": \"SELECT name\nFROM singer\nWHERE age = 30\"}\n```",
            ),
            GOLD,
            (1.0, true, true),
        ),
        (
            "a code block mentioning select is taken instead of the SQL after it",
            think("```\nselect the singers\n```\nSELECT name FROM singer WHERE age = 30"),
            GOLD,
            (0.1, true, false),
        ),
        (
            "JSON without SELECT, then raw SQL followed by a blank line",
            think("```json\n{\"tables\": [\"singer\"]}\n```\nSELECT name FROM singer WHERE age = 30\n\n"),
            GOLD,
            (1.0, true, true),
        ),
    ]);
}

#[test]
fn kind2_a_fence_naming_another_case_or_dialect_keeps_the_word_and_fails() {
    let body = "\nSELECT name FROM singer WHERE age = 30\n```";
    let mut cases = Vec::new();
    for fence in ["```SQL", "```Sql", "```postgresql", "```sqlite", "```mysql"] {
        cases.push((
            fence,
            think(&format!("{fence}{body}")),
            GOLD,
            (0.1, true, false),
        ));
        cases.push((fence, format!("{fence}{body}"), GOLD, (0.0, false, false)));
    }
    cases.push((
        "```sql itself",
        think(&format!("```sql{body}")),
        GOLD,
        (1.0, true, true),
    ));
    assert_scores(&cases);
}

#[test]
fn kind3_a_missing_or_empty_gold_scores_zero_without_the_format_bonus() {
    let answer = think(&sql_block("SELECT name FROM singer WHERE age = 30"));
    let zero = Text2SqlScore {
        score: 0.0,
        format_correct: true,
        execution_success: false,
    };
    assert_eq!(score_on_db(&answer, "", &[]).0, zero, "empty ground truth");
    assert_eq!(
        score_on_db(&answer, GOLD, &["", "  \n"]).0,
        zero,
        "alternatives that are all blank replace even a good ground truth"
    );
    assert_eq!(
        score_on_db(
            &answer,
            "",
            &["  SELECT name FROM singer WHERE age = 30 \n"]
        )
        .0,
        Text2SqlScore {
            score: 1.0,
            format_correct: true,
            execution_success: true
        },
        "alternatives are stripped"
    );
    // A whitespace-only gold is not empty: it runs, fails, and the bonus applies.
    assert_eq!(score_on_db(&answer, " ", &[]).0.score, 0.1);
}

#[test]
fn kind3_a_row_without_gold_builds_an_env_that_scores_zero() {
    use floe_env::env::Env;
    use floe_env::text2sql::Text2SqlEnv;
    let dir = tempfile::tempdir().unwrap();
    let db = make_db(dir.path());
    for gold in [serde_json::json!(null), serde_json::json!("")] {
        let extras = serde_json::json!({
            "reward_model": {"ground_truth": gold},
            "extra_info": {"db_path": db.to_str().unwrap()},
        });
        let mut env = Text2SqlEnv::from_extras(Arc::new(reward()), &extras).unwrap();
        let out = env.step(&think(&sql_block(GOLD))).unwrap();
        assert_eq!(out.reward, 0.0, "gold {gold}");
        assert_eq!(out.metrics["format_correct"], 1.0);
        assert_eq!(out.metrics["execution_success"], 0.0);
    }
}

#[test]
fn kind4_harmless_statements_run_and_leave_the_db_bytes_unchanged() {
    let empty_gold = "SELECT name FROM singer WHERE age = 99";
    assert_scores(&[
        (
            "a TEMP table from a SELECT returns no rows, like an empty gold",
            think(&sql_block(
                "CREATE TEMP TABLE s AS SELECT name FROM singer WHERE age = 30",
            )),
            empty_gold,
            (1.0, true, true),
        ),
        (
            "ATTACH ':memory:' runs (a LIMIT in a comment stops the appended one)",
            sql_block("ATTACH ':memory:' AS m -- LIMIT 1"),
            GOLD,
            (0.1, false, true),
        ),
        (
            "a connection pragma returns its row",
            sql_block("PRAGMA busy_timeout = 100 /* LIMIT\n */"),
            "SELECT 100",
            (1.0, false, true),
        ),
        (
            "a pragma with the appended LIMIT is a syntax error, as in the reference",
            sql_block("PRAGMA foreign_keys = ON"),
            GOLD,
            (0.0, false, false),
        ),
        (
            "attaching a file is still refused",
            sql_block("ATTACH 'other.sqlite' AS o -- LIMIT 1"),
            GOLD,
            (0.0, false, false),
        ),
        (
            "writes are still refused",
            sql_block("DELETE FROM singer -- LIMIT 1"),
            GOLD,
            (0.0, false, false),
        ),
    ]);
}

#[test]
fn kind5_degenerate_answers_score_as_the_reference() {
    assert_scores(&[
        (
            "a lone SELECT is no SQL",
            "<think>x</think>SELECT".into(),
            GOLD,
            (0.0, false, false),
        ),
        (
            "SELECT and a newline",
            "<think>x</think>\nSELECT\n".into(),
            GOLD,
            (0.0, false, false),
        ),
        (
            "a lone SELECT inside answer tags runs with the tag and fails",
            think("SELECT"),
            GOLD,
            (0.1, true, false),
        ),
        (
            "a ```sql block holding only SELECT",
            think(&sql_block("SELECT")),
            GOLD,
            (0.1, true, false),
        ),
        (
            "SELECT *",
            "<think>x</think>SELECT *".into(),
            GOLD,
            (0.1, true, false),
        ),
        (
            "an empty ```sql block",
            "<think>x</think>```sql\n```".into(),
            GOLD,
            (0.0, false, false),
        ),
        (
            "selection",
            "<think>x</think>selection".into(),
            GOLD,
            (0.0, false, false),
        ),
    ]);
}
