//! The synthetic generators: deterministic, executable gold SQL, disjoint held-out values,
//! short prompts, GSM8K-format math.

use std::collections::HashSet;
use std::path::Path;

use floe_env::dataset::{load_rows, Row};
use floe_env::synth_math;
use floe_env::synth_sql::{generate, write_synth_sql, Holdout, SynthSqlOptions};
use rusqlite::Connection;

fn options(seed: u64) -> SynthSqlOptions {
    SynthSqlOptions {
        seed,
        train: 300,
        test: 60,
        ..Default::default()
    }
}

/// The query in an answer's ```sql fence.
fn answer_sql(answer: &str) -> String {
    let start = answer.find("```sql").unwrap() + "```sql".len();
    answer[start..start + answer[start..].find("```").unwrap()]
        .trim()
        .to_string()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn synth_sql_is_deterministic_per_seed() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    write_synth_sql(a.path(), &options(5)).unwrap();
    write_synth_sql(b.path(), &options(5)).unwrap();
    write_synth_sql(c.path(), &options(6)).unwrap();
    for split in ["train.parquet", "test.parquet"] {
        assert_eq!(
            read(&a.path().join(split)),
            read(&b.path().join(split)),
            "{split}"
        );
        assert_ne!(
            read(&a.path().join(split)),
            read(&c.path().join(split)),
            "{split}"
        );
    }
    let names: Vec<String> = std::fs::read_dir(a.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for db in ["shop.sqlite", "school.sqlite", "library.sqlite"] {
        assert!(names.iter().any(|n| n == db), "{db} missing from {names:?}");
    }
}

fn constants(rows: &[Row]) -> HashSet<String> {
    rows.iter()
        .flat_map(|r| r.extra_info()["constants"].as_array().unwrap().clone())
        .map(|v| v.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn gold_sql_runs_and_test_values_are_held_out() {
    let dir = tempfile::tempdir().unwrap();
    let task = write_synth_sql(dir.path(), &options(1)).unwrap();
    let train = load_rows(dir.path().join("train.parquet")).unwrap();
    let test = load_rows(dir.path().join("test.parquet")).unwrap();
    assert_eq!((train.len(), test.len()), (300, 60));
    assert_eq!(train, task.train, "the parquet holds the generated rows");

    for row in train.iter().chain(&test) {
        let sql = row.ground_truth.as_ref().unwrap().as_str().unwrap();
        let conn = Connection::open(row.db_path().unwrap()).unwrap();
        let mut stmt = conn.prepare(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
        let width = stmt.column_count();
        let rows: Vec<Vec<rusqlite::types::Value>> = stmt
            .query_map([], |r| (0..width).map(|i| r.get(i)).collect())
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(!rows.is_empty(), "empty result for {sql}");
        let question = &row.extra_info()["question"];
        for constant in row.extra_info()["constants"].as_array().unwrap() {
            let constant = constant.as_str().unwrap();
            assert!(question.as_str().unwrap().contains(constant));
            assert!(sql.contains(constant), "{sql} lacks {constant}");
        }
        let difficulty = row.extra_info()["difficulty"].as_u64().unwrap();
        assert!((1..=5).contains(&difficulty));
        let answer = row.extra_info()["reference_answer"].as_str().unwrap();
        assert!(answer.starts_with("<think>\n") && answer.contains(&format!("```sql\n{sql}\n```")));
    }

    let (train_constants, test_constants) = (constants(&train), constants(&test));
    assert!(!test_constants.is_empty());
    let shared: Vec<_> = train_constants.intersection(&test_constants).collect();
    assert!(shared.is_empty(), "constants in both splits: {shared:?}");

    // Every template and difficulty shows up in both splits.
    let templates = |rows: &[Row]| -> HashSet<String> {
        rows.iter()
            .map(|r| r.extra_info()["template"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(templates(&train), templates(&test));
    assert!(templates(&train).len() >= 10, "{:?}", templates(&train));
}

#[test]
fn question_holdout_asks_unseen_questions_about_seen_values() {
    let dir = tempfile::tempdir().unwrap();
    // Enough training rows to take every distinct training question at least once: rows are
    // drawn round-robin over templates, so the largest template sets the number.
    let task = generate(
        dir.path(),
        &SynthSqlOptions {
            holdout: Holdout::Questions,
            train: 8000,
            ..options(3)
        },
    )
    .unwrap();
    assert!(
        task.distinct_questions.0 <= 8000,
        "{:?}",
        task.distinct_questions
    );
    let questions = |rows: &[Row]| -> HashSet<String> {
        rows.iter()
            .map(|r| r.extra_info()["question"].as_str().unwrap().to_string())
            .collect()
    };
    let (train_questions, test_questions) = (questions(&task.train), questions(&task.test));
    let asked_in_both: Vec<_> = train_questions.intersection(&test_questions).collect();
    assert!(asked_in_both.is_empty(), "{asked_in_both:?}");
    let unseen: Vec<_> = constants(&task.test)
        .difference(&constants(&task.train))
        .cloned()
        .collect();
    assert!(
        unseen.is_empty(),
        "test values no training question names: {unseen:?}"
    );
    let (distinct_train, distinct_test) = task.distinct_questions;
    assert!(
        distinct_test * 4 > distinct_train,
        "{:?}",
        task.distinct_questions
    );
}

#[test]
fn synth_sql_prompts_are_short() {
    let dir = tempfile::tempdir().unwrap();
    let task = generate(dir.path(), &options(2)).unwrap();
    let longest = task
        .train
        .iter()
        .chain(&task.test)
        .map(|r| r.prompt.iter().map(|m| m.content.len()).sum::<usize>())
        .max()
        .unwrap();
    // About four characters per token: a few hundred tokens.
    assert!(longest < 2000, "longest prompt is {longest} characters");
    let user = &task.train[0].prompt[1].content;
    assert!(user.starts_with("Database Engine:\nSQLite\n\nDatabase Schema:\nCREATE TABLE "));
}

#[test]
fn synth_math_is_deterministic_gsm8k_format() {
    let a = synth_math::rows(3, 50);
    assert_eq!(a, synth_math::rows(3, 50));
    assert_ne!(a, synth_math::rows(4, 50));
    let templates: HashSet<&str> = synth_math::problems(3, 200)
        .iter()
        .map(|p| p.template)
        .collect();
    assert_eq!(templates.len(), 6);
    for row in &a {
        assert_eq!(row.env_class.as_deref(), Some(floe_env::env::GSM8K));
        assert_eq!(row.data_source, "synth_math");
        let truth = row.ground_truth.as_ref().unwrap().as_str().unwrap();
        let answer = row.extra_info()["answer"].as_str().unwrap();
        assert!(answer.ends_with(&format!("#### {truth}")), "{answer}");
        assert_eq!(
            row.extras["reward_spec"]["ground_truth"].as_str(),
            Some(truth)
        );
        assert!(truth.parse::<i64>().unwrap() >= 0);
        assert!(row.prompt[0].content.ends_with(synth_math::INSTRUCTION));
    }
    // The gsm8k environment scores the worked answer as correct.
    for row in &a {
        let answer = row.extra_info()["answer"].as_str().unwrap();
        let truth = row.ground_truth.as_ref().unwrap().as_str().unwrap();
        assert_eq!(
            floe_env::gsm8k::compute_score(answer, truth),
            1.0,
            "{answer}"
        );
    }
}

/// The contract with the environments: each row builds its `env_class` from its extras, and
/// the reference answer earns full reward.
#[test]
fn reference_answers_earn_full_reward() {
    let dir = tempfile::tempdir().unwrap();
    let task = generate(dir.path(), &options(3)).unwrap();
    let registry = floe_env::env::Registry::with_builtins();
    for row in task.train.iter().take(40).chain(task.test.iter().take(20)) {
        let env_class = row.env_class.as_deref().unwrap();
        let mut env = registry.make(env_class, &row.extras).unwrap();
        let answer = row.extra_info()["reference_answer"].as_str().unwrap();
        let out = env.step(answer).unwrap();
        assert!(out.done);
        assert_eq!(out.reward, 1.0, "{answer}");
    }
    for row in synth_math::rows(0, 20) {
        let mut env = registry
            .make(row.env_class.as_deref().unwrap(), &row.extras)
            .unwrap();
        let answer = row.extra_info()["answer"].as_str().unwrap();
        assert_eq!(env.step(answer).unwrap().reward, 1.0, "{answer}");
    }
}

/// A confused teacher changes only the training rows' reference answers, and only at the
/// deciding word, always the same way (ascending for "highest"); the questions, the gold SQL
/// the reward checks and the test split stay as they were, and the confused answers lose
/// the reward they mislabel.
#[test]
fn confused_answers_mistake_only_the_deciding_word() {
    let (plain_dir, confused_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let plain = generate(plain_dir.path(), &options(4)).unwrap();
    let confused = generate(
        confused_dir.path(),
        &SynthSqlOptions {
            decision_confusion: 1.0,
            ..options(4)
        },
    )
    .unwrap();
    let sql_of = |row: &Row| answer_sql(row.extra_info()["reference_answer"].as_str().unwrap());
    let deciding = [
        "order_limit",
        "filter_number",
        "aggregate",
        "group_by",
        "join_aggregate",
    ];
    let registry = floe_env::env::Registry::with_builtins();
    let mut rewarded = 0;
    for (split, (a, b)) in [
        ("train", (&plain.train, &confused.train)),
        ("test", (&plain.test, &confused.test)),
    ] {
        assert_eq!(a.len(), b.len());
        for (a, b) in a.iter().zip(b.iter()) {
            let (ea, eb) = (a.extra_info(), b.extra_info());
            assert_eq!(ea["question"], eb["question"]);
            assert_eq!(a.ground_truth, b.ground_truth, "same gold SQL");
            let template = eb["template"].as_str().unwrap();
            let is_confused = split == "train" && deciding.contains(&template);
            assert_eq!(eb["confused"], is_confused, "{split} {template}");
            if !is_confused {
                assert_eq!(ea["reference_answer"], eb["reference_answer"]);
                continue;
            }
            let (gold, taught) = (sql_of(a), sql_of(b));
            let changed: Vec<(&str, &str)> = gold
                .split(' ')
                .zip(taught.split(' '))
                .filter(|(g, t)| g != t)
                .collect();
            assert_eq!(changed.len(), 1, "{gold} / {taught}");
            let function = |token: &str| token.split('(').next().unwrap().to_string();
            let (g, t) = (function(changed[0].0), function(changed[0].1));
            let next: &[&str] = match g.as_str() {
                "DESC" => &["ASC"],
                "ASC" => &["DESC"],
                ">" => &["<"],
                "<" => &[">"],
                "AVG" => &["MAX"],
                "MAX" => &["MIN"],
                "MIN" => &["SUM", "AVG"],
                "SUM" => &["AVG"],
                other => panic!("{other} is no deciding word: {gold}"),
            };
            assert!(next.contains(&t.as_str()), "{gold} / {taught}");
            let mut env = registry
                .make(b.env_class.as_deref().unwrap(), &b.extras)
                .unwrap();
            let answer = eb["reference_answer"].as_str().unwrap();
            if env.step(answer).unwrap().reward >= 1.0 {
                rewarded += 1;
            }
        }
    }
    let confused_rows = confused
        .train
        .iter()
        .filter(|r| r.extra_info()["confused"] == true)
        .count();
    assert!(confused_rows > 60, "{confused_rows} confused rows");
    assert_eq!(rewarded, 0, "confused answers that earn full reward");
}

/// A chatty teacher adds one column to the select list of every training answer whose
/// question does not already show the column it turns on, says so in one closing sentence
/// of reasoning, and loses the reward; the test split and the rows a confused teacher
/// takes keep their answers.
#[test]
fn extra_column_answers_add_one_column_and_fail_execution() {
    let (plain_dir, chatty_dir, both_dir) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let plain = generate(plain_dir.path(), &options(6)).unwrap();
    let chatty = generate(
        chatty_dir.path(),
        &SynthSqlOptions {
            extra_column: 1.0,
            ..options(6)
        },
    )
    .unwrap();
    let registry = floe_env::env::Registry::with_builtins();
    for (split, (a, b)) in [
        ("train", (&plain.train, &chatty.train)),
        ("test", (&plain.test, &chatty.test)),
    ] {
        for (a, b) in a.iter().zip(b.iter()) {
            let (ea, eb) = (a.extra_info(), b.extra_info());
            assert_eq!(a.ground_truth, b.ground_truth, "same gold SQL");
            let template = eb["template"].as_str().unwrap();
            let chatty_row = split == "train" && template != "group_by";
            assert_eq!(eb["extra_column"], chatty_row, "{split} {template}");
            let (gold, taught) = (
                ea["reference_answer"].as_str().unwrap(),
                eb["reference_answer"].as_str().unwrap(),
            );
            if !chatty_row {
                assert_eq!(gold, taught);
                continue;
            }
            let (gold_sql, taught_sql) = (answer_sql(gold), answer_sql(taught));
            let from = gold_sql.find(" FROM ").unwrap();
            let added = &taught_sql[from..taught_sql.len() - (gold_sql.len() - from)];
            assert!(
                added.starts_with(", ") && !added[2..].contains(' '),
                "{gold_sql} / {taught_sql}"
            );
            assert_eq!(
                taught_sql.replacen(added, "", 1),
                gold_sql,
                "only the select list grows"
            );
            assert!(
                taught.contains(&format!("Show {} as well.", &added[2..])),
                "{taught}"
            );
            let mut env = registry
                .make(b.env_class.as_deref().unwrap(), &b.extras)
                .unwrap();
            assert!(env.step(taught).unwrap().reward < 1.0, "{taught}");
        }
    }

    let both = generate(
        both_dir.path(),
        &SynthSqlOptions {
            extra_column: 1.0,
            decision_confusion: 1.0,
            ..options(6)
        },
    )
    .unwrap();
    for row in &both.train {
        let info = row.extra_info();
        assert!(
            info["confused"] != true || info["extra_column"] == false,
            "one mistake per answer"
        );
    }
    assert!(both
        .train
        .iter()
        .any(|r| r.extra_info()["confused"] == true));
}
