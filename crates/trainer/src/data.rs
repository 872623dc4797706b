//! Prompts for the loop: dataset sources (files or `synthetic:<task>`) resolved to rows,
//! rendered through the chat template, tokenized, and filtered by the prompt budget.

use std::path::Path;

use floe_env::dataset::{self, DataCursor, Row};
use floe_env::synth_sql::{self, SynthSqlOptions};
use floe_model::chat_template::{ChatMessage, ChatTemplate};
use floe_model::tokenizer::Tokenizer;
use serde_json::json;

use crate::config::Config;
use crate::error::{Error, Result};

/// Folder of a run directory holding generated synthetic datasets.
pub const SYNTHETIC_DIR: &str = "data";

/// Prefix of a generated data source (`synthetic:sql`, `synthetic:math`).
const SYNTHETIC_PREFIX: &str = "synthetic:";

/// One dataset row with its prompt as the model sees it.
#[derive(Clone, Debug)]
pub struct Prompt {
    /// The dataset row (messages, data source, env class, extras).
    pub row: Row,
    /// The rendered prompt (chat template with the generation prompt).
    pub text: String,
    /// Token ids of `text`.
    pub ids: Vec<u32>,
}

/// The database a row asks about (`extra_info.db_id`), for text-to-SQL rows.
pub fn row_database(row: &Row) -> Option<&str> {
    row.extra_info().get("db_id").and_then(|v| v.as_str())
}

/// Which split of a source to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `data.train_data`.
    Train,
    /// `data.val_data`.
    Val,
}

/// Rows of every source of `split`, concatenated in order and capped at
/// `data.max_{train,val}_prompts`. Synthetic tasks are generated under
/// `<run_dir>/data/` from `trainer.seed` (the same seed always gives the same rows).
pub fn load_split(config: &Config, run_dir: &Path, split: Split) -> Result<Vec<Row>> {
    let (sources, cap) = match split {
        Split::Train => (&config.data.train_data, config.data.max_train_prompts),
        Split::Val => (&config.data.val_data, config.data.max_val_prompts),
    };
    let mut rows = Vec::new();
    for source in sources {
        rows.extend(load_source(config, run_dir, source, split)?);
    }
    if let Some(cap) = cap {
        rows.truncate(cap);
    }
    Ok(rows)
}

fn load_source(config: &Config, run_dir: &Path, source: &str, split: Split) -> Result<Vec<Row>> {
    let Some(task) = source.strip_prefix(SYNTHETIC_PREFIX) else {
        if !Path::new(source).exists() {
            let key = match split {
                Split::Train => "data.train_data",
                Split::Val => "data.val_data",
            };
            let from = std::env::current_dir()
                .map(|dir| format!(" (from {})", dir.display()))
                .unwrap_or_default();
            return Err(Error::Data(format!(
                "{key}: {source}: no such file{from}; BIRD's splits come from `floe data bird \
                 --bird-dir <BIRD> --out data/bird`, a synthetic task needs no file \
                 ({key} = [\"synthetic:sql\"])"
            )));
        }
        return Ok(dataset::load_rows(source)?);
    };
    let seed = config.trainer.seed;
    let (train, val) = (
        config.data.synthetic_train_size,
        config.data.synthetic_val_size,
    );
    match task {
        "sql" => {
            let task = synth_sql::generate(
                &run_dir.join(SYNTHETIC_DIR).join("synth_sql"),
                &SynthSqlOptions {
                    seed,
                    train,
                    test: val,
                    holdout: config.data.synthetic_holdout,
                    decision_confusion: config.data.synthetic_decision_confusion,
                    extra_column: config.data.synthetic_extra_column,
                    ..SynthSqlOptions::default()
                },
            )?;
            Ok(match split {
                Split::Train => task.train,
                Split::Val => task.test,
            })
        }
        // Disjoint seeds keep the validation problems apart from the training ones.
        "math" => Ok(match split {
            Split::Train => floe_env::synth_math::rows(seed.wrapping_mul(2), train),
            Split::Val => floe_env::synth_math::rows(seed.wrapping_mul(2) + 1, val),
        }),
        other => Err(Error::Data(format!(
            "unknown synthetic task `{source}` ({other}); use synthetic:sql or synthetic:math"
        ))),
    }
}

/// Renders chat messages through `template` (`enable_thinking` passed as Qwen3 expects).
pub fn render_messages(
    template: &ChatTemplate,
    messages: &[floe_env::env::Message],
    add_generation_prompt: bool,
    enable_thinking: bool,
) -> Result<String> {
    let messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect();
    Ok(template.render(
        &messages,
        add_generation_prompt,
        &json!({ "enable_thinking": enable_thinking }),
    )?)
}

/// Renders and tokenizes every row; rows whose prompt exceeds `max_prompt_length` tokens
/// are dropped (never truncated: a cut prompt asks another question). Returns the kept
/// prompts and how many were dropped.
pub fn prepare_prompts(
    rows: Vec<Row>,
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    enable_thinking: bool,
    max_prompt_length: usize,
) -> Result<(Vec<Prompt>, usize)> {
    let mut kept = Vec::with_capacity(rows.len());
    let mut dropped = 0;
    for row in rows {
        let text = render_messages(template, &row.prompt, true, enable_thinking)?;
        let ids = tokenizer.encode(&text, false)?;
        if ids.is_empty() {
            return Err(Error::Data(format!(
                "row {} of {} renders to an empty prompt",
                row.index, row.data_source
            )));
        }
        if ids.len() > max_prompt_length {
            dropped += 1;
        } else {
            kept.push(Prompt { row, text, ids });
        }
    }
    Ok((kept, dropped))
}

/// The next `n` prompt indices of a run: the cursor's seeded shuffle when `shuffle` is on,
/// file order otherwise; either way the cursor's `(epoch, position)` is the whole state.
pub fn next_batch(cursor: &mut DataCursor, n: usize, shuffle: bool) -> Vec<usize> {
    if shuffle {
        return cursor.next_batch(n);
    }
    let mut batch = Vec::with_capacity(n);
    while batch.len() < n && cursor.len > 0 {
        if cursor.position == cursor.len {
            cursor.epoch += 1;
            cursor.position = 0;
        }
        batch.push(cursor.position);
        cursor.position += 1;
    }
    batch
}

/// The row's `extra_info.reference_answer`: a completion in the format the reward accepts.
pub fn reference_answer(row: &Row) -> Option<&str> {
    row.extra_info()
        .get("reference_answer")
        .and_then(|v| v.as_str())
}
