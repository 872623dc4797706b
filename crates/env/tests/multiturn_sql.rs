//! SkyRL-SQL: the format check, observations, turn budget and the −1 / 0 / 1 reward.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use floe_env::env::{BuiltinConfig, Env, EnvError, Registry};
use floe_env::multiturn_sql::{extract_solution, MultiTurnSqlEnv};
use floe_env::sandbox::{Sandbox, SandboxConfig};
use serde_json::json;

fn make_db(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.execute_batch(
        "CREATE TABLE city (id INTEGER PRIMARY KEY, name TEXT, pop INTEGER);
         INSERT INTO city VALUES (1, 'Oslo', 700), (2, 'Bergen', 290), (3, 'Tromso', 77);
         CREATE TABLE wide (x INTEGER, pad TEXT);
         WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 500)
         INSERT INTO wide SELECT x, 'padding padding padding' FROM c;",
    )
    .unwrap();
}

const GOLD: &str = "SELECT name FROM city WHERE pop > 100";

fn env(dir: &Path, max_turns: usize) -> MultiTurnSqlEnv {
    let db = dir.join("geo.sqlite");
    make_db(&db);
    let sandbox = Arc::new(Sandbox::new(SandboxConfig::default()));
    MultiTurnSqlEnv::new(sandbox, db, GOLD.to_string(), max_turns)
}

#[test]
fn format_check_table() {
    let valid = "<think>a</think><sql>SELECT 1</sql>\n\n<observation>1\n</observation>\n\n \
                 <think>b</think><solution>SELECT 2</solution>";
    assert_eq!(extract_solution(valid), Some("SELECT 2"));
    let cases = [
        ("no solution", "<think>a</think>"),
        ("two solutions", "<think>a</think><solution>x</solution><solution>y</solution>"),
        ("two closings", "<think>a</think><solution>x</solution></solution>"),
        ("unclosed", "<think>a</think><solution>x"),
        ("think inside", "<think>a</think><solution><think>x</solution>"),
        ("sql inside, any case", "<think>a</think><solution></SQL>x</solution>"),
        ("observation inside", "<think>a</think><solution><observation x</solution>"),
        ("no think", "<solution>SELECT 1</solution>"),
        ("unclosed think", "<think>a<solution>SELECT 1</solution>"),
        (
            "observation not followed by think",
            "<think>a</think><observation>r</observation>\nok<think>b</think><solution>x</solution>",
        ),
    ];
    for (name, text) in cases {
        assert_eq!(extract_solution(text), None, "{name}");
    }
    // `<thinking>` is not a think tag inside the solution (word boundary), and the
    // observation check is case-insensitive.
    assert_eq!(
        extract_solution(
            "<think>a</think><OBSERVATION>r</OBSERVATION> <THINK>b</think><solution><thinking>x</solution>"
        ),
        Some("<thinking>x")
    );
}

#[test]
fn episode_explores_then_solves() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = env(dir.path(), 5);
    let first = env
        .step("<think>look</think><sql>SELECT name, pop FROM city WHERE id = 1</sql>")
        .unwrap();
    assert!(!first.done);
    assert_eq!(first.reward, 0.0);
    assert_eq!(first.observations.len(), 1);
    assert_eq!(first.observations[0].role, "user");
    assert_eq!(
        first.observations[0].content,
        "\n\n<observation>   0   1\nOslo 700\n<reminder>You have 4 turns left to complete the \
         task.</reminder></observation>\n\n"
    );
    let last = env
        .step("<think>got it</think><solution>SELECT name FROM city WHERE pop >= 290</solution>")
        .unwrap();
    assert!(last.done);
    assert!(last.observations.is_empty());
    assert_eq!(last.reward, 1.0);
    assert!(matches!(env.step("again"), Err(EnvError::StepAfterDone(_))));
}

#[test]
fn wrong_solution_scores_zero_and_bad_format_minus_one() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut wrong = env(dirs[0].path(), 5);
    let out = wrong
        .step("<think>x</think><solution>SELECT name FROM city</solution>")
        .unwrap();
    assert_eq!((out.done, out.reward), (true, 0.0));
    let mut failing = env(dirs[1].path(), 5);
    let out = failing
        .step("<think>x</think><solution>SELECT nope FROM city</solution>")
        .unwrap();
    assert_eq!((out.done, out.reward), (true, 0.0));
    let mut unformatted = env(dirs[2].path(), 5);
    let out = unformatted
        .step(&format!("<solution>{GOLD}</solution>"))
        .unwrap();
    assert_eq!((out.done, out.reward), (true, -1.0));
}

#[test]
fn observation_after_second_turn_must_be_followed_by_think() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = env(dir.path(), 5);
    env.step("<think>a</think><sql>SELECT 1</sql>").unwrap();
    // The next turn starts without <think> right after the observation.
    let out = env
        .step(&format!(
            "Answer: <think>b</think><solution>{GOLD}</solution>"
        ))
        .unwrap();
    assert_eq!((out.done, out.reward), (true, -1.0));
}

#[test]
fn invalid_actions_errors_and_the_turn_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = env(dir.path(), 3);
    let out = env.step("<think>hmm</think> no tool call").unwrap();
    assert!(out.observations[0]
        .content
        .contains("Your previous action is invalid."));
    assert!(out.observations[0]
        .content
        .contains("You have 2 turns left"));
    let out = env
        .step("<think>x</think><sql>SELECT nope FROM city</sql>")
        .unwrap();
    let text = &out.observations[0].content;
    assert!(
        text.contains("Error executing SQL: no such column: nope, db file: "),
        "{text}"
    );
    assert!(text.contains("You have 1 turns left"));
    // The last turn ends the episode even without a solution.
    let out = env.step("<think>x</think><sql>SELECT 1</sql>").unwrap();
    assert!(out.done);
    assert_eq!(out.reward, -1.0);
    assert_eq!(env.turns(), 3);
}

#[test]
fn long_results_are_cut_to_fifty_rows() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = env(dir.path(), 5);
    let out = env
        .step("<think>x</think><sql>SELECT x, pad FROM wide</sql>")
        .unwrap();
    let text = &out.observations[0].content;
    assert!(text
        .starts_with("\n\n<observation>Truncated to 50 lines since returned response too long: "));
    assert_eq!(text.matches("padding padding padding").count(), 50);
    let out = env
        .step("<think>x</think><sql>SELECT x FROM wide WHERE x < 0</sql>")
        .unwrap();
    assert!(out.observations[0]
        .content
        .contains("Empty DataFrame\nColumns: []\nIndex: []"));
}

#[test]
fn registry_resolves_databases_under_the_root() {
    let dir = tempfile::tempdir().unwrap();
    make_db(&dir.path().join("spider/database/geo/geo.sqlite"));
    let registry = Registry::with_builtins_config(BuiltinConfig {
        sql_db_root: Some(dir.path().to_path_buf()),
        ..BuiltinConfig::default()
    });
    let extras = json!({
        "db_id": "geo", "data": "spider", "max_turns": 2,
        "reward_spec": {"ground_truth": GOLD}
    });
    let mut env = registry.make("text2sql_multiturn", &extras).unwrap();
    let out = env
        .step(&format!("<think>a</think><solution>{GOLD}</solution>"))
        .unwrap();
    assert_eq!(out.reward, 1.0);

    let missing = json!({
        "db_id": "nowhere", "data": "spider",
        "reward_spec": {"ground_truth": GOLD}
    });
    let err = registry
        .make("text2sql_multiturn", &missing)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("database file not found"), "{err}");
    let bad_data = json!({
        "db_id": "geo", "data": "mystery",
        "reward_spec": {"ground_truth": GOLD}
    });
    let err = registry
        .make("text2sql_multiturn", &bad_data)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("\"mystery\" is not one of"), "{err}");
    let explicit: PathBuf = dir.path().join("spider/database/geo/geo.sqlite");
    let direct = json!({
        "extra_info": {"db_path": explicit},
        "reward_spec": {"ground_truth": GOLD}
    });
    assert!(registry.make("text2sql_multiturn", &direct).is_ok());
}
