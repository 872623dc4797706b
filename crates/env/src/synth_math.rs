//! Deterministic arithmetic word problems in GSM8K's format.
//!
//! Each problem is a short story from one of a handful of templates (adding and removing,
//! groups of items, sharing equally, change from a purchase, two-phase rates, wages) with
//! numbers drawn from a seed. The worked answer reads like GSM8K's: one line per step with
//! calculator annotations (`3 * 4 = <<3*4=12>>12`), ending in `#### <number>`. Rows are scored
//! by the `gsm8k` environment; the ground truth is the number as a string.

use serde_json::{json, Map};

use crate::dataset::{Row, SplitMix64};
use crate::env::Message;

/// `data_source` of the synthetic math rows.
pub const DATA_SOURCE: &str = "synth_math";

/// The instruction SkyRL's GSM8K preparation appends to every question.
pub const INSTRUCTION: &str =
    "Let's think step by step and output the final answer after \"####\".";

/// One generated problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The story and its question.
    pub question: String,
    /// Worked steps ending in `#### <number>`.
    pub answer: String,
    /// The final number.
    pub result: i64,
    /// Which template produced it.
    pub template: &'static str,
}

const NAMES: &[&str] = &[
    "Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lina",
];
const ITEMS: &[&str] = &[
    "apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards",
];
const ITEMS_PRICED: &[&str] = &[
    "notebooks",
    "pens",
    "sandwiches",
    "tickets",
    "plants",
    "mugs",
];

/// `n` problems from `seed`; the same seed always gives the same problems.
pub fn problems(seed: u64, n: usize) -> Vec<Problem> {
    let mut rng = SplitMix64::new(seed, 0);
    (0..n).map(|_| problem(&mut rng)).collect()
}

/// `n` dataset rows from `seed`: the question plus [`INSTRUCTION`] as the user message, the
/// number as ground truth, and `question`, `answer`, `template` and `index` in `extra_info`.
pub fn rows(seed: u64, n: usize) -> Vec<Row> {
    problems(seed, n)
        .into_iter()
        .enumerate()
        .map(|(index, p)| {
            let mut extra_info = Map::new();
            extra_info.insert("question".into(), json!(p.question));
            extra_info.insert("answer".into(), json!(p.answer));
            extra_info.insert("template".into(), json!(p.template));
            extra_info.insert("index".into(), json!(index));
            Row::new(
                vec![Message::user(format!("{} {INSTRUCTION}", p.question))],
                DATA_SOURCE,
                Some(crate::env::GSM8K.to_string()),
                Some(json!(p.result.to_string())),
                extra_info,
                index,
            )
        })
        .collect()
}

fn problem(rng: &mut SplitMix64) -> Problem {
    let name = *rng.pick(NAMES);
    match rng.below(6) {
        0 => {
            let item = *rng.pick(ITEMS);
            let friend = pick_other(rng, name);
            let (a, b) = (rng.range(5, 60), rng.range(2, 30));
            let c = rng.range(1, a + b - 1);
            let (s, r) = (a + b, a + b - c);
            Problem {
                question: format!(
                    "{name} has {a} {item}. {name} gets {b} more and then gives {c} to \
                     {friend}. How many {item} does {name} have now?"
                ),
                answer: format!(
                    "After getting more, {name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.\n\
                     After giving some away, {name} has {s} - {c} = <<{s}-{c}={r}>>{r} {item}.\n\
                     #### {r}"
                ),
                result: r,
                template: "add_remove",
            }
        }
        1 => {
            let item = *rng.pick(ITEMS);
            let (per, boxes) = (rng.range(3, 12), rng.range(2, 9));
            let total = per * boxes;
            Problem {
                question: format!(
                    "A box holds {per} {item}. {name} buys {boxes} boxes. How many {item} does \
                     {name} have?"
                ),
                answer: format!(
                    "{name} has {boxes} * {per} = <<{boxes}*{per}={total}>>{total} {item}.\n\
                     #### {total}"
                ),
                result: total,
                template: "groups",
            }
        }
        2 => {
            let item = *rng.pick(ITEMS);
            let (each, friends) = (rng.range(2, 12), rng.range(2, 8));
            let total = each * friends;
            Problem {
                question: format!(
                    "{name} has {total} {item} and shares them equally among {friends} \
                     friends. How many {item} does each friend get?"
                ),
                answer: format!(
                    "Each friend gets {total} / {friends} = <<{total}/{friends}={each}>>{each} \
                     {item}.\n#### {each}"
                ),
                result: each,
                template: "share",
            }
        }
        3 => {
            let item = *rng.pick(ITEMS_PRICED);
            let (count, price) = (rng.range(2, 9), rng.range(2, 15));
            let cost = count * price;
            let bill = [20, 50, 100].into_iter().find(|&b| b > cost).unwrap_or(200);
            let change = bill - cost;
            Problem {
                question: format!(
                    "{name} buys {count} {item} that cost ${price} each and pays with a ${bill} \
                     bill. How much change does {name} get?"
                ),
                answer: format!(
                    "The {item} cost {count} * {price} = <<{count}*{price}={cost}>>{cost} \
                     dollars.\nThe change is {bill} - {cost} = <<{bill}-{cost}={change}>>{change} \
                     dollars.\n#### {change}"
                ),
                result: change,
                template: "change",
            }
        }
        4 => {
            let (a, d1) = (rng.range(5, 30), rng.range(2, 7));
            let (b, d2) = (rng.range(5, 30), rng.range(2, 7));
            let (x, y) = (a * d1, b * d2);
            let total = x + y;
            Problem {
                question: format!(
                    "{name} reads {a} pages a day for {d1} days, then {b} pages a day for {d2} \
                     days. How many pages does {name} read in total?"
                ),
                answer: format!(
                    "First {name} reads {a} * {d1} = <<{a}*{d1}={x}>>{x} pages.\n\
                     Then {name} reads {b} * {d2} = <<{b}*{d2}={y}>>{y} pages.\n\
                     In total that is {x} + {y} = <<{x}+{y}={total}>>{total} pages.\n\
                     #### {total}"
                ),
                result: total,
                template: "two_rates",
            }
        }
        _ => {
            let (wage, hours, days) = (rng.range(8, 25), rng.range(2, 8), rng.range(2, 6));
            let daily = wage * hours;
            let total = daily * days;
            Problem {
                question: format!(
                    "{name} earns ${wage} an hour and works {hours} hours a day for {days} days. \
                     How many dollars does {name} earn?"
                ),
                answer: format!(
                    "Each day {name} earns {wage} * {hours} = <<{wage}*{hours}={daily}>>{daily} \
                     dollars.\nOver {days} days that is {daily} * {days} = \
                     <<{daily}*{days}={total}>>{total} dollars.\n#### {total}"
                ),
                result: total,
                template: "wages",
            }
        }
    }
}

fn pick_other(rng: &mut SplitMix64, name: &str) -> &'static str {
    loop {
        let other = *rng.pick(NAMES);
        if other != name {
            return other;
        }
    }
}
