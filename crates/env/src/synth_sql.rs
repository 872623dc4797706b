//! A synthetic text-to-SQL task small enough to learn from scratch on a laptop.
//!
//! Three SQLite databases (a shop, a school and a library; four tables each, linked by foreign
//! keys, tens of rows) are filled deterministically from a seed. Questions come from eleven
//! regular templates of graded difficulty, each with gold SQL that is executed at generation
//! time; questions whose answer is empty, NULL, a zero count or a tie under `LIMIT 1` are
//! skipped, and so are those whose deciding word does not change the answer (any aggregate
//! of a single row). Prompts use the same Arctic format as BIRD ([`crate::bird::arctic_prompt`]) over
//! the compact one-line-per-table schema, so a whole prompt stays within a few hundred tokens.
//!
//! Two ways to hold questions out ([`Holdout`]): by value, where every constant that appears
//! in a question (a name, a category, a threshold) belongs to exactly one split, so test
//! questions ask about things no training question mentions; or by question, where test
//! questions are combinations of template, table and values that no training question
//! asks, over values training questions do mention. Templates are drawn round-robin, so
//! every kind of question appears in both splits in similar proportions.
//!
//! A confused teacher ([`SynthSqlOptions::decision_confusion`]) writes some training rows'
//! reference answers with the deciding word of the question (an aggregate, a sort
//! direction, a comparison) mistaken for another: a warm start on them learns the confusion,
//! and only the execution reward, which checks the gold SQL, can correct it. A chatty
//! teacher ([`SynthSqlOptions::extra_column`]) also selects the column a question filters,
//! sorts or joins on, the commonest way a text-to-SQL answer fails execution match.
//!
//! Each row's `extra_info` carries `db_id`, `db_path`, `difficulty` (1–5), `template`, the
//! question's `constants`, `confused` and `extra_column` (whether its reference answer has
//! that mistake), and
//! `reference_answer`, a completion in the expected format (its reasoning restates the
//! question, then the plan) that a supervised warm start can train on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use rusqlite::types::Value as SqlValue;
use rusqlite::Connection;
use serde_json::{json, Map};

use crate::bird::{arctic_answer, arctic_prompt, render_schema, SchemaOptions};
use crate::dataset::{write_rows, DatasetError, Row, SplitMix64};

/// Prefix of the synthetic SQL rows' `data_source`, which is `synth_sql_<database>` so that
/// metrics split per database (`eval/synth_sql_school/accuracy`).
pub const DATA_SOURCE: &str = "synth_sql";

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSqlOptions {
    /// Seed for database contents, held-out values and question order.
    pub seed: u64,
    /// Number of training rows. When it exceeds the distinct training questions, they repeat
    /// in a fresh order.
    pub train: usize,
    /// Number of test rows, likewise.
    pub test: usize,
    /// The one-line-per-table schema (default) instead of the annotated BIRD-train layout.
    pub compact: bool,
    /// What the test split holds out.
    pub holdout: Holdout,
    /// Fraction held out for the test split: of each pool of constants
    /// ([`Holdout::Values`]) or of the distinct questions ([`Holdout::Questions`]).
    pub test_fraction: f64,
    /// Fraction of the training rows whose question turns on a deciding word (an aggregate,
    /// a sort direction, a comparison) whose reference answer, reasoning and SQL, takes the
    /// next option of that decision instead: ascending for "highest", `<` for "greater
    /// than", `MIN` for "highest", as a teacher that mixes the words up would write. The
    /// gold SQL the reward checks stays right. Above 0.5 a warm start learns the wrong
    /// meaning of each word, which only the reward can correct.
    pub decision_confusion: f64,
    /// Fraction of the training rows whose reference answer also selects the column the
    /// question filters, sorts or joins on (`SELECT name, price ... ORDER BY price`), with
    /// a closing sentence of reasoning that says so; the extra column fails execution match.
    /// Above 0.5 a warm start adds it by habit, which only the reward can correct. Rows
    /// the confusion takes keep its answer.
    pub extra_column: f64,
}

/// What separates the test split from the training split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Holdout {
    /// Every constant belongs to one split: test questions name values training never
    /// shows, so answering them takes copying from the question.
    #[default]
    Values,
    /// Test questions are unseen combinations of template, table and values; every value
    /// they name also appears in some training question.
    Questions,
}

/// Parses the names serde uses (`values`, `questions`): the CLI flag and the config key
/// accept the same ones.
impl std::str::FromStr for Holdout {
    type Err = serde::de::value::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        use serde::de::IntoDeserializer;
        serde::Deserialize::deserialize(s.into_deserializer())
    }
}

impl Default for SynthSqlOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            train: 2000,
            test: 200,
            compact: true,
            holdout: Holdout::Values,
            test_fraction: 0.3,
            decision_confusion: 0.0,
            extra_column: 0.0,
        }
    }
}

/// Errors generating the task.
#[derive(Debug, thiserror::Error)]
pub enum SynthSqlError {
    /// A file or folder could not be created.
    #[error("{}: {cause}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// SQLite failed while building a database or running a gold query.
    #[error("{}: {cause}", path.display())]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// The underlying error.
        cause: rusqlite::Error,
    },
    /// Writing a split failed.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// A split has no questions (e.g. a `test_fraction` of 0 with test rows requested).
    #[error("no {split} questions can be generated with these options")]
    EmptySplit {
        /// `train` or `test`.
        split: &'static str,
    },
}

/// The generated task.
#[derive(Debug, Clone)]
pub struct SynthSql {
    /// Training rows; `db_path` absolute.
    pub train: Vec<Row>,
    /// Test rows; `db_path` absolute.
    pub test: Vec<Row>,
    /// The SQLite files written.
    pub databases: Vec<PathBuf>,
    /// Distinct questions available to each split before any repetition: (train, test).
    pub distinct_questions: (usize, usize),
}

/// Builds the databases in `out_dir` (creating it; existing database files are replaced) and
/// returns the rows of both splits.
pub fn generate(out_dir: &Path, options: &SynthSqlOptions) -> Result<SynthSql, SynthSqlError> {
    std::fs::create_dir_all(out_dir).map_err(|cause| SynthSqlError::Io {
        path: out_dir.to_path_buf(),
        cause,
    })?;
    let out_dir = std::path::absolute(out_dir).map_err(|cause| SynthSqlError::Io {
        path: out_dir.to_path_buf(),
        cause,
    })?;
    let mut databases = Vec::new();
    let mut schemas = Vec::new();
    let mut pools: Vec<Vec<String>> = Vec::new();
    let mut candidates = Vec::new();
    for (db_index, spec) in DATABASES.iter().enumerate() {
        let path = out_dir.join(format!("{}.sqlite", spec.id));
        let sqlite_err = |cause| SynthSqlError::Sqlite {
            path: path.clone(),
            cause,
        };
        let mut rng = SplitMix64::new(options.seed, db_index as u64);
        let conn = build_database(&path, spec, &mut rng)?;
        let schema_options = if options.compact {
            SchemaOptions::compact()
        } else {
            SchemaOptions::bird_train()
        };
        schemas.push(render_schema(&conn, &schema_options, None).map_err(sqlite_err)?);
        let db_candidates = questions(&conn, spec, db_index, &mut pools).map_err(sqlite_err)?;
        candidates.extend(db_candidates);
        databases.push(path);
    }

    let splits = match options.holdout {
        Holdout::Values => split_by_values(&candidates, &pools, options),
        Holdout::Questions => split_by_questions(&candidates, options),
    };
    let mut by_split: [BTreeMap<&'static str, Vec<Question>>; 2] = Default::default();
    for (question, split) in candidates.into_iter().zip(splits) {
        if let Some(split) = split {
            by_split[split]
                .entry(question.template)
                .or_default()
                .push(question);
        }
    }
    let distinct = (
        by_split[0].values().map(Vec::len).sum(),
        by_split[1].values().map(Vec::len).sum(),
    );
    let mut rows = Vec::new();
    for (split_index, (name, count)) in [("train", options.train), ("test", options.test)]
        .into_iter()
        .enumerate()
    {
        let groups = std::mem::take(&mut by_split[split_index]);
        let mut rng = SplitMix64::new(options.seed, 100 + split_index as u64);
        let chosen = round_robin(groups, count, &mut rng);
        if count > 0 && chosen.is_empty() {
            return Err(SynthSqlError::EmptySplit { split: name });
        }
        // Streams of their own, so the questions drawn do not depend on the teacher's
        // mistakes, nor one mistake's draws on the other's rate.
        let mut confusing = SplitMix64::new(options.seed, 200 + split_index as u64);
        let mut chatty = SplitMix64::new(options.seed, 300 + split_index as u64);
        rows.push(
            chosen
                .iter()
                .enumerate()
                .map(|(index, q)| {
                    let train = name == "train";
                    let confused = q
                        .confused
                        .as_ref()
                        .filter(|_| train && confusing.chance(options.decision_confusion))
                        .map(|answer| (Mistake::Confused, answer));
                    let extra = q
                        .extra_column
                        .as_ref()
                        .filter(|_| train && chatty.chance(options.extra_column))
                        .map(|answer| (Mistake::ExtraColumn, answer));
                    to_row(
                        q,
                        confused.or(extra),
                        &databases[q.db],
                        &schemas[q.db],
                        name,
                        index,
                        options.compact,
                    )
                })
                .collect::<Vec<Row>>(),
        );
    }
    let test = rows.pop().unwrap_or_default();
    let train = rows.pop().unwrap_or_default();
    Ok(SynthSql {
        train,
        test,
        databases,
        distinct_questions: distinct,
    })
}

/// [`generate`], then writes `train.parquet` and `test.parquet` next to the databases (their
/// `db_path` relative, so the folder can move).
pub fn write_synth_sql(
    out_dir: &Path,
    options: &SynthSqlOptions,
) -> Result<SynthSql, SynthSqlError> {
    let task = generate(out_dir, options)?;
    write_rows(out_dir.join("train.parquet"), &task.train)?;
    write_rows(out_dir.join("test.parquet"), &task.test)?;
    Ok(task)
}

/// A teacher's mistake in a reference answer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mistake {
    /// [`SynthSqlOptions::decision_confusion`].
    Confused,
    /// [`SynthSqlOptions::extra_column`].
    ExtraColumn,
}

/// The row of question `q`; a `mistaken` (reasoning, SQL) replaces the reference answer's.
fn to_row(
    q: &Question,
    mistaken: Option<(Mistake, &(String, String))>,
    db_path: &Path,
    schema: &str,
    split: &str,
    index: usize,
    compact: bool,
) -> Row {
    let spec = &DATABASES[q.db];
    let (reasoning, sql) = mistaken.map_or((&q.reasoning, &q.sql), |(_, (r, s))| (r, s));
    let mistake = mistaken.map(|(m, _)| m);
    let mut extras = Map::new();
    extras.insert("db_id".into(), json!(spec.id));
    extras.insert("db_path".into(), json!(db_path.to_string_lossy()));
    extras.insert("difficulty".into(), json!(q.difficulty));
    extras.insert("template".into(), json!(q.template));
    extras.insert("constants".into(), json!(q.constants));
    extras.insert("question".into(), json!(q.text));
    extras.insert("confused".into(), json!(mistake == Some(Mistake::Confused)));
    extras.insert(
        "extra_column".into(),
        json!(mistake == Some(Mistake::ExtraColumn)),
    );
    extras.insert("split".into(), json!(split));
    extras.insert(
        "reference_answer".into(),
        json!(arctic_answer(
            &format!("The question: {}\n{reasoning}", q.text),
            sql
        )),
    );
    Row::new(
        arctic_prompt(schema, &q.text, compact),
        format!("{DATA_SOURCE}_{}", spec.id),
        Some(crate::env::TEXT2SQL.to_string()),
        Some(json!(q.sql)),
        extras,
        index,
    )
}

/// Takes `count` questions, cycling through the templates in a seeded order and taking each
/// template's questions in a seeded order; a template that runs out reshuffles and repeats.
fn round_robin(
    groups: BTreeMap<&'static str, Vec<Question>>,
    count: usize,
    rng: &mut SplitMix64,
) -> Vec<Question> {
    let mut groups: Vec<Vec<Question>> = groups.into_values().filter(|g| !g.is_empty()).collect();
    if groups.is_empty() {
        return Vec::new();
    }
    for group in &mut groups {
        rng.shuffle(group);
    }
    let mut next = vec![0usize; groups.len()];
    let mut chosen = Vec::with_capacity(count);
    let mut order: Vec<usize> = (0..groups.len()).collect();
    while chosen.len() < count {
        rng.shuffle(&mut order);
        for &g in &order {
            if chosen.len() == count {
                break;
            }
            if next[g] == groups[g].len() {
                rng.shuffle(&mut groups[g]);
                next[g] = 0;
            }
            chosen.push(groups[g][next[g]].clone());
            next[g] += 1;
        }
    }
    chosen
}

/// The split of each question (0 train, 1 test, `None` dropped) when values are held out:
/// a question goes where all its constants are, and is dropped when they disagree.
fn split_by_values(
    candidates: &[Question],
    pools: &[Vec<String>],
    options: &SynthSqlOptions,
) -> Vec<Option<usize>> {
    let held_out = hold_out(pools, options);
    candidates
        .iter()
        .map(|q| {
            let test: Vec<bool> = q.constants.iter().map(|c| held_out[c]).collect();
            if test.iter().all(|&t| t) {
                Some(1)
            } else if test.iter().all(|&t| !t) {
                Some(0)
            } else {
                None
            }
        })
        .collect()
}

/// The split of each question when questions are held out: a seeded `test_fraction` of
/// them is drawn for the test split, and a drawn question naming a value no training
/// question names goes back to training, so every test value has been seen.
fn split_by_questions(candidates: &[Question], options: &SynthSqlOptions) -> Vec<Option<usize>> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    SplitMix64::new(options.seed, 99).shuffle(&mut order);
    let n_test = (candidates.len() as f64 * options.test_fraction).round() as usize;
    let drawn = &order[..n_test.min(order.len())];
    let mut splits = vec![Some(0); candidates.len()];
    for &i in drawn {
        splits[i] = Some(1);
    }
    let mut seen: HashSet<&str> = candidates
        .iter()
        .zip(&splits)
        .filter(|(_, s)| **s == Some(0))
        .flat_map(|(q, _)| q.constants.iter().map(String::as_str))
        .collect();
    for &i in drawn {
        let q = &candidates[i];
        if !q.constants.iter().all(|c| seen.contains(c.as_str())) {
            splits[i] = Some(0);
            seen.extend(q.constants.iter().map(String::as_str));
        }
    }
    splits
}

/// Marks each constant held out (`true`) or not. Pools are visited in a fixed order and each
/// pool's values in a seeded order; a constant already marked by an earlier pool keeps its
/// mark, so a string shared by two pools (a city that is also a name) is never split.
fn hold_out(pools: &[Vec<String>], options: &SynthSqlOptions) -> HashMap<String, bool> {
    let mut held_out: HashMap<String, bool> = HashMap::new();
    let mut rng = SplitMix64::new(options.seed, 99);
    for pool in pools {
        let mut values = pool.clone();
        values.sort();
        values.dedup();
        rng.shuffle(&mut values);
        let target = (values.len() as f64 * options.test_fraction).round() as usize;
        let target = if options.test_fraction > 0.0 && values.len() >= 2 {
            target.clamp(1, values.len() - 1)
        } else {
            target
        };
        let mut in_test = values
            .iter()
            .filter(|v| held_out.get(*v) == Some(&true))
            .count();
        for value in values {
            if held_out.contains_key(&value) {
                continue;
            }
            let test = in_test < target;
            in_test += usize::from(test);
            held_out.insert(value, test);
        }
    }
    held_out
}

// ---------------------------------------------------------------------------------------------
// Database specifications

#[derive(Debug)]
struct DatabaseSpec {
    id: &'static str,
    tables: &'static [TableSpec],
}

#[derive(Debug)]
struct TableSpec {
    name: &'static str,
    singular: &'static str,
    plural: &'static str,
    rows: usize,
    columns: &'static [ColumnSpec],
}

#[derive(Debug)]
struct ColumnSpec {
    name: &'static str,
    /// How questions call the column ("price", "number of pages").
    phrase: &'static str,
    kind: ColumnKind,
}

#[derive(Debug)]
enum ColumnKind {
    /// `INTEGER PRIMARY KEY`, 1..=rows.
    Id,
    /// The unique text that names a row; `plural` is how questions call the column's values
    /// ("names", "titles").
    Label {
        pool: LabelPool,
        plural: &'static str,
    },
    /// Text from a short list.
    Category(&'static [&'static str]),
    /// An integer in `lo..=hi`; `total` marks quantities that make sense summed.
    Number { lo: i64, hi: i64, total: bool },
    /// A reference to another table's `id`; `verb` reads "{child plural} are {verb} the
    /// {parent}" ("placed by", "for").
    ForeignKey {
        table: &'static str,
        verb: &'static str,
    },
}

#[derive(Debug, Clone, Copy)]
enum LabelPool {
    Person,
    Product,
    Company,
    Course,
    Book,
}

const FIRST_NAMES: &[&str] = &[
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen",
    "Leo", "Maria", "Nina", "Oscar", "Paul", "Rosa", "Sam", "Tina", "Victor", "Wendy", "Yara",
];
const LAST_NAMES: &[&str] = &[
    "Smith", "Jones", "Brown", "Lee", "Garcia", "Miller", "Davis", "Wilson", "Moore", "Clark",
    "Lewis", "Walker", "Hall", "Young", "King", "Wright",
];
const PRODUCT_ADJECTIVES: &[&str] = &[
    "Red", "Blue", "Green", "Small", "Large", "Smart", "Classic", "Deluxe",
];
const PRODUCT_NOUNS: &[&str] = &[
    "Lamp", "Chair", "Desk", "Mug", "Phone", "Clock", "Bag", "Kettle", "Fan", "Pen",
];
const COMPANIES: &[&str] = &[
    "Acme",
    "Globex",
    "Initech",
    "Umbrella",
    "Stark",
    "Wayne",
    "Hooli",
    "Vandelay",
    "Soylent",
    "Tyrell",
    "Cyberdyne",
    "Wonka",
];
const COURSE_NAMES: &[&str] = &[
    "Algebra",
    "Geometry",
    "Biology",
    "Chemistry",
    "Physics",
    "Botany",
    "Poetry",
    "Drawing",
    "Choir",
    "Economics",
    "Statistics",
    "Robotics",
    "Painting",
    "Spanish",
    "French",
    "Latin",
    "Astronomy",
    "Geology",
    "Ethics",
    "Logic",
];
const BOOK_ADJECTIVES: &[&str] = &[
    "Silent", "Hidden", "Golden", "Broken", "Last", "Lost", "Secret", "Winter",
];
const BOOK_NOUNS: &[&str] = &[
    "River", "Garden", "Road", "Tower", "Island", "Forest", "Letter", "Mirror",
];
const CITIES: &[&str] = &[
    "Paris", "Tokyo", "Lima", "Oslo", "Rome", "Cairo", "Delhi", "Berlin", "Madrid", "Sydney",
];
const COUNTRIES: &[&str] = &[
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Mexico", "Spain", "Kenya",
];

impl LabelPool {
    /// Every possible label, in a fixed order.
    fn all(self) -> Vec<String> {
        let cross = |a: &[&str], b: &[&str], fmt: fn(&str, &str) -> String| {
            a.iter()
                .flat_map(|x| b.iter().map(move |y| fmt(x, y)))
                .collect()
        };
        match self {
            LabelPool::Person => cross(FIRST_NAMES, LAST_NAMES, |a, b| format!("{a} {b}")),
            LabelPool::Product => {
                cross(PRODUCT_ADJECTIVES, PRODUCT_NOUNS, |a, b| format!("{a} {b}"))
            }
            LabelPool::Company => COMPANIES.iter().map(|s| s.to_string()).collect(),
            LabelPool::Course => COURSE_NAMES.iter().map(|s| s.to_string()).collect(),
            LabelPool::Book => cross(BOOK_ADJECTIVES, BOOK_NOUNS, |a, b| format!("The {a} {b}")),
        }
    }
}

const fn col(name: &'static str, phrase: &'static str, kind: ColumnKind) -> ColumnSpec {
    ColumnSpec { name, phrase, kind }
}

const ID: ColumnSpec = col("id", "id", ColumnKind::Id);

const fn label(pool: LabelPool, name: &'static str, plural: &'static str) -> ColumnSpec {
    col(name, name, ColumnKind::Label { pool, plural })
}

const fn number(name: &'static str, phrase: &'static str, lo: i64, hi: i64) -> ColumnSpec {
    col(
        name,
        phrase,
        ColumnKind::Number {
            lo,
            hi,
            total: false,
        },
    )
}

const fn amount(name: &'static str, phrase: &'static str, lo: i64, hi: i64) -> ColumnSpec {
    col(
        name,
        phrase,
        ColumnKind::Number {
            lo,
            hi,
            total: true,
        },
    )
}

const fn category(name: &'static str, values: &'static [&'static str]) -> ColumnSpec {
    col(name, name, ColumnKind::Category(values))
}

const fn fk(name: &'static str, table: &'static str, verb: &'static str) -> ColumnSpec {
    col(name, name, ColumnKind::ForeignKey { table, verb })
}

const DATABASES: &[DatabaseSpec] = &[
    DatabaseSpec {
        id: "shop",
        tables: &[
            TableSpec {
                name: "suppliers",
                singular: "supplier",
                plural: "suppliers",
                rows: 10,
                columns: &[
                    ID,
                    label(LabelPool::Company, "name", "names"),
                    category("country", COUNTRIES),
                ],
            },
            TableSpec {
                name: "products",
                singular: "product",
                plural: "products",
                rows: 30,
                columns: &[
                    ID,
                    label(LabelPool::Product, "name", "names"),
                    category(
                        "category",
                        &["toys", "garden", "kitchen", "sports", "office", "travel"],
                    ),
                    number("price", "price", 5, 200),
                    amount("stock", "stock", 0, 100),
                    fk("supplier_id", "suppliers", "supplied by"),
                ],
            },
            TableSpec {
                name: "customers",
                singular: "customer",
                plural: "customers",
                rows: 30,
                columns: &[
                    ID,
                    label(LabelPool::Person, "name", "names"),
                    category("city", CITIES),
                    number("age", "age", 18, 80),
                ],
            },
            TableSpec {
                name: "orders",
                singular: "order",
                plural: "orders",
                rows: 60,
                columns: &[
                    ID,
                    fk("customer_id", "customers", "placed by"),
                    fk("product_id", "products", "for"),
                    amount("quantity", "quantity", 1, 10),
                    number("year", "year", 2015, 2024),
                ],
            },
        ],
    },
    DatabaseSpec {
        id: "school",
        tables: &[
            TableSpec {
                name: "teachers",
                singular: "teacher",
                plural: "teachers",
                rows: 12,
                columns: &[
                    ID,
                    label(LabelPool::Person, "name", "names"),
                    category(
                        "subject",
                        &["math", "science", "art", "history", "music", "language"],
                    ),
                    number("salary", "salary", 30, 90),
                ],
            },
            TableSpec {
                name: "courses",
                singular: "course",
                plural: "courses",
                rows: 16,
                columns: &[
                    ID,
                    label(LabelPool::Course, "name", "names"),
                    category("level", &["beginner", "intermediate", "advanced"]),
                    amount("credits", "number of credits", 1, 6),
                    fk("teacher_id", "teachers", "taught by"),
                ],
            },
            TableSpec {
                name: "students",
                singular: "student",
                plural: "students",
                rows: 40,
                columns: &[
                    ID,
                    label(LabelPool::Person, "name", "names"),
                    category("city", CITIES),
                    number("age", "age", 16, 30),
                ],
            },
            TableSpec {
                name: "enrollments",
                singular: "enrollment",
                plural: "enrollments",
                rows: 80,
                columns: &[
                    ID,
                    fk("student_id", "students", "made by"),
                    fk("course_id", "courses", "in"),
                    number("score", "score", 40, 100),
                ],
            },
        ],
    },
    DatabaseSpec {
        id: "library",
        tables: &[
            TableSpec {
                name: "authors",
                singular: "author",
                plural: "authors",
                rows: 15,
                columns: &[
                    ID,
                    label(LabelPool::Person, "name", "names"),
                    category("country", COUNTRIES),
                    number("birth_year", "birth year", 1940, 2000),
                ],
            },
            TableSpec {
                name: "books",
                singular: "book",
                plural: "books",
                rows: 40,
                columns: &[
                    ID,
                    label(LabelPool::Book, "title", "titles"),
                    category(
                        "genre",
                        &[
                            "mystery", "fantasy", "romance", "history", "poetry", "science",
                        ],
                    ),
                    amount("pages", "number of pages", 80, 900),
                    number("year", "year", 1950, 2023),
                    fk("author_id", "authors", "written by"),
                ],
            },
            TableSpec {
                name: "members",
                singular: "member",
                plural: "members",
                rows: 30,
                columns: &[
                    ID,
                    label(LabelPool::Person, "name", "names"),
                    category("city", CITIES),
                    number("age", "age", 12, 85),
                ],
            },
            TableSpec {
                name: "loans",
                singular: "loan",
                plural: "loans",
                rows: 80,
                columns: &[
                    ID,
                    fk("book_id", "books", "for"),
                    fk("member_id", "members", "made by"),
                    amount("days", "number of days", 1, 60),
                ],
            },
        ],
    },
];

impl TableSpec {
    fn label(&self) -> Option<(&ColumnSpec, &'static str)> {
        self.columns.iter().find_map(|c| match c.kind {
            ColumnKind::Label { plural, .. } => Some((c, plural)),
            _ => None,
        })
    }

    fn categories(&self) -> impl Iterator<Item = &ColumnSpec> {
        self.columns
            .iter()
            .filter(|c| matches!(c.kind, ColumnKind::Category(_)))
    }

    fn numbers(&self) -> impl Iterator<Item = (&ColumnSpec, bool)> {
        self.columns.iter().filter_map(|c| match c.kind {
            ColumnKind::Number { total, .. } => Some((c, total)),
            _ => None,
        })
    }
}

impl DatabaseSpec {
    fn table(&self, name: &str) -> &TableSpec {
        self.tables
            .iter()
            .find(|t| t.name == name)
            .expect("foreign keys name tables of the same database")
    }
}

// ---------------------------------------------------------------------------------------------
// Database contents

fn build_database(
    path: &Path,
    spec: &DatabaseSpec,
    rng: &mut SplitMix64,
) -> Result<Connection, SynthSqlError> {
    let sqlite_err = |cause| SynthSqlError::Sqlite {
        path: path.to_path_buf(),
        cause,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(cause) => {
            return Err(SynthSqlError::Io {
                path: path.to_path_buf(),
                cause,
            })
        }
    }
    let mut conn = Connection::open(path).map_err(sqlite_err)?;
    let tx = conn.transaction().map_err(sqlite_err)?;
    for table in spec.tables {
        let columns: Vec<String> = table
            .columns
            .iter()
            .map(|c| match c.kind {
                ColumnKind::Id => format!("{} INTEGER PRIMARY KEY", c.name),
                ColumnKind::Label { .. } | ColumnKind::Category(_) => format!("{} TEXT", c.name),
                ColumnKind::Number { .. } => format!("{} INTEGER", c.name),
                ColumnKind::ForeignKey { table, .. } => {
                    format!("{} INTEGER REFERENCES {table}(id)", c.name)
                }
            })
            .collect();
        tx.execute(
            &format!("CREATE TABLE {} ({})", table.name, columns.join(", ")),
            [],
        )
        .map_err(sqlite_err)?;
        let placeholders = vec!["?"; table.columns.len()].join(", ");
        let mut insert = tx
            .prepare(&format!(
                "INSERT INTO {} VALUES ({placeholders})",
                table.name
            ))
            .map_err(sqlite_err)?;
        let mut labels: HashMap<&str, Vec<String>> = HashMap::new();
        for c in table.columns {
            if let ColumnKind::Label { pool, .. } = c.kind {
                let mut all = pool.all();
                rng.shuffle(&mut all);
                all.truncate(table.rows);
                labels.insert(c.name, all);
            }
        }
        for row in 0..table.rows {
            let values: Vec<SqlValue> = table
                .columns
                .iter()
                .map(|c| match c.kind {
                    ColumnKind::Id => SqlValue::Integer(row as i64 + 1),
                    ColumnKind::Label { .. } => SqlValue::Text(
                        labels[c.name]
                            .get(row)
                            .expect("each label pool is larger than its table")
                            .clone(),
                    ),
                    ColumnKind::Category(values) => SqlValue::Text(rng.pick(values).to_string()),
                    ColumnKind::Number { lo, hi, .. } => SqlValue::Integer(rng.range(lo, hi)),
                    ColumnKind::ForeignKey { table: parent, .. } => {
                        SqlValue::Integer(rng.range(1, spec.table(parent).rows as i64))
                    }
                })
                .collect();
            insert
                .execute(rusqlite::params_from_iter(values))
                .map_err(sqlite_err)?;
        }
    }
    tx.commit().map_err(sqlite_err)?;
    Ok(conn)
}

// ---------------------------------------------------------------------------------------------
// Questions

#[derive(Debug, Clone)]
struct Question {
    db: usize,
    template: &'static str,
    difficulty: u8,
    text: String,
    sql: String,
    reasoning: String,
    /// The question's held-out-able values, as they appear in the text.
    constants: Vec<String>,
    /// (reasoning, SQL) with the deciding word mistaken for the next option of its decision
    /// ([`SynthSqlOptions::decision_confusion`]); `None` without a deciding word.
    confused: Option<(String, String)>,
    /// (reasoning, SQL) that also select the column the question filters, sorts or joins
    /// on ([`SynthSqlOptions::extra_column`]); `None` where the answer already shows it.
    extra_column: Option<(String, String)>,
}

/// The (reasoning, SQL) of `answer` for the option after `current` in `options`, as a
/// teacher that confuses the deciding word writes it.
fn confused(
    options: &[Decision],
    current: &str,
    answer: impl Fn(&str) -> (String, String),
) -> Option<(String, String)> {
    let index = options.iter().position(|&(sql, _)| sql == current)?;
    Some(answer(options[(index + 1) % options.len()].0))
}

/// A question under construction, with an optional query that must return two different
/// values (or fewer than two rows) for a `LIMIT 1` answer to be unambiguous.
struct Draft {
    question: Question,
    tie_check: Option<String>,
}

/// A deciding word of a question as (SQL, word). The options of a decision are listed in
/// the order a confused teacher mixes them up: each one for the next.
type Decision = (&'static str, &'static str);

/// Aggregates; `SUM` only for quantities that add up.
const AGGREGATES: &[Decision] = &[("AVG", "average"), ("MAX", "highest"), ("MIN", "lowest")];

/// Sort directions for "the row with the highest ...".
const DIRECTIONS: &[Decision] = &[("DESC", "highest"), ("ASC", "lowest")];

/// Comparisons with a threshold.
const COMPARISONS: &[Decision] = &[(">", "greater than"), ("<", "less than")];

/// Every question the templates can ask about one database whose gold answer is informative.
/// Each constant pool (the distinct values a template slot takes) is appended to `pools`.
fn questions(
    conn: &Connection,
    spec: &DatabaseSpec,
    db: usize,
    pools: &mut Vec<Vec<String>>,
) -> rusqlite::Result<Vec<Question>> {
    let mut drafts = Vec::new();
    let mut draft = |template: &'static str,
                     difficulty: u8,
                     text: String,
                     confused: Option<(String, String)>,
                     (sql, reasoning, shown): (String, String, Option<&str>),
                     constants: Vec<String>,
                     tie_check: Option<String>| {
        // The extra column goes last in the select list, which ends at the first FROM.
        let extra_column = shown.map(|column| {
            (
                format!("{reasoning} Show {column} as well."),
                sql.replacen(" FROM ", &format!(", {column} FROM "), 1),
            )
        });
        drafts.push(Draft {
            question: Question {
                db,
                template,
                difficulty,
                text,
                sql,
                reasoning,
                constants,
                confused,
                extra_column,
            },
            tie_check,
        })
    };
    for table in spec.tables {
        let t = table.name;
        let labels = match table.label() {
            Some((label, _)) => distinct_text(conn, t, label.name)?,
            None => Vec::new(),
        };
        pools.push(labels.clone());
        let categories: Vec<(&ColumnSpec, Vec<String>)> = table
            .categories()
            .map(|c| Ok((c, distinct_text(conn, t, c.name)?)))
            .collect::<rusqlite::Result<_>>()?;
        for (_, values) in &categories {
            pools.push(values.clone());
        }
        let thresholds: Vec<(&ColumnSpec, bool, Vec<i64>)> = table
            .numbers()
            .map(|(c, total)| {
                let ColumnKind::Number { lo, hi, .. } = c.kind else {
                    unreachable!("numbers() yields number columns")
                };
                (c, total, thresholds(lo, hi))
            })
            .collect();
        for (_, _, values) in &thresholds {
            pools.push(values.iter().map(i64::to_string).collect());
        }

        if let Some((label, label_plural)) = table.label() {
            let l = label.name;
            // Lookup: one attribute of one named row.
            for column in table
                .columns
                .iter()
                .filter(|c| matches!(c.kind, ColumnKind::Category(_) | ColumnKind::Number { .. }))
            {
                for v in &labels {
                    draft(
                        "lookup",
                        1,
                        format!(
                            "What is the {} of the {} '{v}'?",
                            column.phrase, table.singular
                        ),
                        None,
                        (
                            format!("SELECT {} FROM {t} WHERE {l} = '{v}'", column.name),
                            format!(
                                "Read {} from {t} for the row whose {l} is '{v}'.",
                                column.name
                            ),
                            Some(l),
                        ),
                        vec![v.clone()],
                        None,
                    );
                }
            }
            for (cat, values) in &categories {
                let c = cat.name;
                for v in values {
                    draft(
                        "filter_category",
                        1,
                        format!(
                            "List the {label_plural} of {} whose {} is '{v}'.",
                            table.plural, cat.phrase
                        ),
                        None,
                        (
                            format!("SELECT {l} FROM {t} WHERE {c} = '{v}'"),
                            format!("Select {l} from {t} where {c} is '{v}'."),
                            Some(c),
                        ),
                        vec![v.clone()],
                        None,
                    );
                }
                for (num, _, _) in &thresholds {
                    let n = num.name;
                    for &(direction, word) in DIRECTIONS {
                        for v in values {
                            let filter = format!("FROM {t} WHERE {c} = '{v}'");
                            let answer = |direction: &str| {
                                let sorted = if direction == "DESC" {
                                    "descending"
                                } else {
                                    "ascending"
                                };
                                (
                                    format!(
                                        "Filter {t} on {c} = '{v}', sort by {n} {sorted} and \
                                         keep the first {l}."
                                    ),
                                    format!("SELECT {l} {filter} ORDER BY {n} {direction} LIMIT 1"),
                                )
                            };
                            let (reasoning, sql) = answer(direction);
                            draft(
                                "order_limit",
                                3,
                                format!(
                                    "Which {} whose {} is '{v}' has the {word} {}?",
                                    table.singular, cat.phrase, num.phrase
                                ),
                                confused(DIRECTIONS, direction, answer),
                                (sql, reasoning, Some(n)),
                                vec![v.clone()],
                                Some(format!(
                                    "SELECT {n} {filter} ORDER BY {n} {direction} LIMIT 2"
                                )),
                            );
                        }
                    }
                }
            }
            for (num, _, values) in &thresholds {
                let n = num.name;
                for &(op, word) in COMPARISONS {
                    for x in values {
                        let answer = |op: &str| {
                            (
                                format!("Select {l} from {t} where {n} {op} {x}."),
                                format!("SELECT {l} FROM {t} WHERE {n} {op} {x}"),
                            )
                        };
                        let (reasoning, sql) = answer(op);
                        draft(
                            "filter_number",
                            2,
                            format!(
                                "List the {label_plural} of {} with {} {word} {x}.",
                                table.plural, num.phrase
                            ),
                            confused(COMPARISONS, op, answer),
                            (sql, reasoning, Some(n)),
                            vec![x.to_string()],
                            None,
                        );
                    }
                }
            }
        }

        for (cat, values) in &categories {
            let c = cat.name;
            for v in values {
                draft(
                    "count",
                    2,
                    format!("How many {} have {} '{v}'?", table.plural, cat.phrase),
                    None,
                    (
                        format!("SELECT COUNT(*) FROM {t} WHERE {c} = '{v}'"),
                        format!("Count the rows of {t} where {c} is '{v}'."),
                        Some(c),
                    ),
                    vec![v.clone()],
                    None,
                );
                for (num, total, _) in &thresholds {
                    let n = num.name;
                    let options = aggregates(*total);
                    for &(function, word) in options {
                        let answer = |function: &str| {
                            (
                                format!(
                                    "Take {function} of {n} over the rows of {t} where {c} is \
                                     '{v}'."
                                ),
                                format!("SELECT {function}({n}) FROM {t} WHERE {c} = '{v}'"),
                            )
                        };
                        let (reasoning, sql) = answer(function);
                        draft(
                            "aggregate",
                            3,
                            format!(
                                "What is the {word} {} of {} whose {} is '{v}'?",
                                num.phrase, table.plural, cat.phrase
                            ),
                            confused(options, function, answer),
                            (sql, reasoning, Some(c)),
                            vec![v.clone()],
                            None,
                        );
                    }
                }
            }
            for (num, _, xs) in &thresholds {
                let n = num.name;
                for &(op, word) in COMPARISONS {
                    for x in xs {
                        let answer = |op: &str| {
                            (
                                format!(
                                    "Filter {t} on {n} {op} {x}, group by {c} and count the rows."
                                ),
                                format!(
                                    "SELECT {c}, COUNT(*) FROM {t} WHERE {n} {op} {x} GROUP BY {c}"
                                ),
                            )
                        };
                        let (reasoning, sql) = answer(op);
                        draft(
                            "group_by",
                            3,
                            format!(
                                "For each {}, how many {} have {} {word} {x}?",
                                cat.phrase, table.plural, num.phrase
                            ),
                            // Its grouping column is shown already.
                            confused(COMPARISONS, op, answer),
                            (sql, reasoning, None),
                            vec![x.to_string()],
                            None,
                        );
                    }
                }
            }
        }

        // Joins from this table (the child) to the tables its foreign keys name.
        for key in table.columns {
            let ColumnKind::ForeignKey {
                table: parent_name,
                verb,
            } = key.kind
            else {
                continue;
            };
            let parent = spec.table(parent_name);
            let p = parent.name;
            let join = format!("FROM {t} AS T1 JOIN {p} AS T2 ON T1.{} = T2.id", key.name);
            if let Some((parent_label, _)) = parent.label() {
                let pl = parent_label.name;
                let parent_column = format!("T2.{pl}");
                let parent_labels = distinct_text(conn, p, pl)?;
                for v in &parent_labels {
                    let subject = format!("{} {verb} the {} '{v}'", table.plural, parent.singular);
                    let joined = format!("Join {t} to {p} on {}, keep {p}.{pl} = '{v}'", key.name);
                    draft(
                        "join_count",
                        4,
                        format!(
                            "How many {} are {verb} the {} '{v}'?",
                            table.plural, parent.singular
                        ),
                        None,
                        (
                            format!("SELECT COUNT(*) {join} WHERE T2.{pl} = '{v}'"),
                            format!("{joined} and count the rows."),
                            Some(&parent_column),
                        ),
                        vec![v.clone()],
                        None,
                    );
                    if let Some((label, label_plural)) = table.label() {
                        draft(
                            "join_list",
                            4,
                            format!("List the {label_plural} of {subject}."),
                            None,
                            (
                                format!("SELECT T1.{} {join} WHERE T2.{pl} = '{v}'", label.name),
                                format!("{joined} and select {t}.{}.", label.name),
                                Some(&parent_column),
                            ),
                            vec![v.clone()],
                            None,
                        );
                    }
                    for (num, total, _) in &thresholds {
                        let options = aggregates(*total);
                        for &(function, word) in options {
                            let answer = |function: &str| {
                                (
                                    format!("{joined} and take {function} of {t}.{}.", num.name),
                                    format!(
                                        "SELECT {function}(T1.{}) {join} WHERE T2.{pl} = '{v}'",
                                        num.name
                                    ),
                                )
                            };
                            let (reasoning, sql) = answer(function);
                            draft(
                                "join_aggregate",
                                5,
                                format!("What is the {word} {} of {subject}?", num.phrase),
                                confused(options, function, answer),
                                (sql, reasoning, Some(&parent_column)),
                                vec![v.clone()],
                                None,
                            );
                        }
                    }
                }
            }
            for cat in parent.categories() {
                let c = cat.name;
                for v in distinct_text(conn, p, c)? {
                    draft(
                        "join_filter",
                        5,
                        format!(
                            "How many {} are {verb} {} whose {} is '{v}'?",
                            table.plural, parent.plural, cat.phrase
                        ),
                        None,
                        (
                            format!("SELECT COUNT(*) {join} WHERE T2.{c} = '{v}'"),
                            format!(
                                "Join {t} to {p} on {}, keep {p}.{c} = '{v}' and count the rows.",
                                key.name
                            ),
                            Some(&format!("T2.{c}")),
                        ),
                        vec![v.clone()],
                        None,
                    );
                }
            }
        }
    }

    let mut kept = Vec::new();
    for Draft {
        question,
        tie_check,
    } in drafts
    {
        let gold = result(conn, &question.sql)?;
        if informative(&gold)
            && unambiguous(conn, tie_check.as_deref())?
            && decisive(conn, &gold, question.confused.as_ref())?
        {
            kept.push(question);
        }
    }
    Ok(kept)
}

fn aggregates(total: bool) -> &'static [Decision] {
    const WITH_TOTAL: &[Decision] = &[
        ("AVG", "average"),
        ("MAX", "highest"),
        ("MIN", "lowest"),
        ("SUM", "total"),
    ];
    if total {
        WITH_TOTAL
    } else {
        AGGREGATES
    }
}

/// Six round thresholds spread inside `lo..=hi`.
fn thresholds(lo: i64, hi: i64) -> Vec<i64> {
    let span = hi - lo;
    let step = 10i64.pow(((span as f64 / 10.0).log10().floor().max(0.0)) as u32);
    let mut values: Vec<i64> = (1..=6)
        .map(|k| {
            let raw = lo + span * k / 7;
            (raw + step / 2) / step * step
        })
        .collect();
    values.dedup();
    values
}

fn distinct_text(conn: &Connection, table: &str, column: &str) -> rusqlite::Result<Vec<String>> {
    conn.prepare(&format!(
        "SELECT DISTINCT {column} FROM {table} ORDER BY {column}"
    ))?
    .query_map([], |row| row.get(0))?
    .collect()
}

/// Whether a gold query's answer tells a right query from a wrong one: at least one row, not
/// all NULL, and not a lone zero count.
/// The rows `sql` returns, in its order.
fn result(conn: &Connection, sql: &str) -> rusqlite::Result<Vec<Vec<SqlValue>>> {
    let mut stmt = conn.prepare(sql)?;
    let width = stmt.column_count();
    let rows = stmt
        .query_map([], |row| (0..width).map(|i| row.get(i)).collect())?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

fn informative(rows: &[Vec<SqlValue>]) -> bool {
    let all_null = rows.iter().flatten().all(|v| *v == SqlValue::Null);
    let zero_count = rows.len() == 1 && rows[0] == [SqlValue::Integer(0)];
    !rows.is_empty() && !all_null && !zero_count
}

fn unambiguous(conn: &Connection, tie_check: Option<&str>) -> rusqlite::Result<bool> {
    let Some(sql) = tie_check else {
        return Ok(true);
    };
    let values: Vec<SqlValue> = conn
        .prepare(sql)?
        .query_map([], |row| row.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(values.len() < 2 || values[0] != values[1])
}

/// Whether the question's deciding word changes its answer: over a single row, say, every
/// aggregate and sort direction gives the same one, and the word teaches nothing.
fn decisive(
    conn: &Connection,
    gold: &[Vec<SqlValue>],
    confused: Option<&(String, String)>,
) -> rusqlite::Result<bool> {
    let Some((_, confused_sql)) = confused else {
        return Ok(true);
    };
    // As the reward compares them: 10 and 10.0 are one answer.
    let numeric = |rows: &[Vec<SqlValue>]| -> Vec<Vec<SqlValue>> {
        rows.iter()
            .map(|row| {
                row.iter()
                    .map(|v| match v {
                        SqlValue::Integer(i) => SqlValue::Real(*i as f64),
                        v => v.clone(),
                    })
                    .collect()
            })
            .collect()
    };
    Ok(numeric(gold) != numeric(&result(conn, confused_sql)?))
}

/// A one-line summary of a generated task, for the CLI.
pub fn summary(task: &SynthSql) -> String {
    let mut by_difficulty: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for (split, rows) in [(0, &task.train), (1, &task.test)] {
        for row in rows {
            let d = row
                .extra_info()
                .get("difficulty")
                .and_then(|d| d.as_u64())
                .unwrap_or(0);
            let entry = by_difficulty.entry(d).or_default();
            if split == 0 {
                entry.0 += 1;
            } else {
                entry.1 += 1;
            }
        }
    }
    let mut out = format!(
        "{} train rows ({} distinct questions), {} test rows ({} distinct); by difficulty \
         (train/test):",
        task.train.len(),
        task.distinct_questions.0,
        task.test.len(),
        task.distinct_questions.1
    );
    for (d, (train, test)) in by_difficulty {
        let _ = write!(out, " {d}: {train}/{test}");
    }
    out
}
