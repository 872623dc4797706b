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
            "a json block's sql key",
            think(&format!("```json\n{{\"sql\": \"{correct}\"}}\n```")),
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
    assert_eq!(got.score, 0.0);
    assert!(!got.execution_success);
}

#[test]
fn limit_rule_is_a_substring_test() {
    assert_eq!(with_limit("SELECT a FROM t"), "SELECT a FROM t LIMIT 5000;");
    assert_eq!(
        with_limit("SELECT a FROM t;\n"),
        "SELECT a FROM t LIMIT 5000;"
    );
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
        Some("SELECT a FROM t"),
        "other info strings are generic blocks"
    );
    assert_eq!(
        extract_sql("```json\n{\"sql\": \"SELECT b FROM t\"}\n```").as_deref(),
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
