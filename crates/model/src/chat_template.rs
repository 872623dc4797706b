//! Hugging Face chat templates (Jinja), rendered with minijinja the way transformers'
//! `apply_chat_template` renders them.
//!
//! transformers renders with `trim_blocks` and `lstrip_blocks`, gives templates the
//! globals `raise_exception` and `strftime_now`, and replaces `tojson` with Python's
//! `json.dumps(..., ensure_ascii=False)` (spaces after `,` and `:`, no HTML escaping).
//! Templates also call Python string and dict methods (`startswith`, `split`, `rstrip`,
//! `items`, `get`, …); [`ChatTemplate`] provides the ones chat templates use.
//!
//! Known difference: JSON objects passed in (e.g. tool definitions) reach the template
//! with their keys sorted, so `tojson` prints keys in sorted order where Python keeps
//! insertion order.

use std::path::{Path, PathBuf};

use minijinja::value::{from_args, Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::{Deserialize, Serialize};

/// Qwen3's chat template (the `chat_template` of the Qwen3 instruct models'
/// `tokenizer_config.json`): thinking blocks, `enable_thinking`, tool calls. The default
/// template of floe's embedded tokenizer.
pub const QWEN3_CHAT_TEMPLATE: &str = include_str!("chat_template/qwen3.jinja");

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message in the shape HF templates read. Any `Serialize` value with `role`
/// and `content` works with [`ChatTemplate::render`]; this is a convenience.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant's reasoning, rendered inside `<think>` by templates that know it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A message without reasoning.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
        }
    }
}

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("{path}: not valid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: serde_json::Error,
    },
    /// Neither `chat_template` in the config nor a `chat_template.jinja` beside it.
    #[error("{path}: no `chat_template` key and no chat_template.jinja beside it")]
    NoTemplate {
        /// The config file.
        path: PathBuf,
    },
    /// The template does not parse.
    #[error("{origin}: chat template does not parse: {detail}")]
    Syntax {
        /// Where the template came from.
        origin: String,
        /// minijinja's message, with the line.
        detail: String,
    },
    /// Rendering failed (including the template's own `raise_exception`).
    #[error("rendering the chat template from {origin} failed: {detail}")]
    Render {
        /// Where the template came from.
        origin: String,
        /// minijinja's message.
        detail: String,
    },
}

/// Result of chat-template operations.
pub type Result<T> = std::result::Result<T, TemplateError>;

/// A compiled chat template plus the special tokens transformers passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    origin: String,
    /// `bos_token` given to the template (from `tokenizer_config.json`), if any.
    pub bos_token: Option<String>,
    /// `eos_token` given to the template, if any.
    pub eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Qwen3's template ([`QWEN3_CHAT_TEMPLATE`]).
    pub fn qwen3() -> Self {
        Self::compile(QWEN3_CHAT_TEMPLATE.to_string(), "<qwen3>".into())
            .expect("the embedded Qwen3 template parses")
    }

    /// Compiles `template` (Jinja source).
    #[allow(clippy::should_implement_trait)]
    pub fn from_str(template: &str) -> Result<Self> {
        Self::compile(template.to_string(), "<string>".into())
    }

    /// Reads the template of a Hugging Face tokenizer: the `chat_template` key of
    /// `tokenizer_config.json` (a string, or a list of `{name, template}` of which
    /// `default` is taken), else the `chat_template.jinja` beside it (what transformers 5
    /// writes). `bos_token` and `eos_token` come from the config too.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TemplateError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let config: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| TemplateError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        let template = match config.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        let template = match template {
            Some(t) => t,
            None => {
                let sibling = path.with_file_name("chat_template.jinja");
                if !sibling.is_file() {
                    return Err(TemplateError::NoTemplate {
                        path: path.to_path_buf(),
                    });
                }
                std::fs::read_to_string(&sibling).map_err(|source| TemplateError::Io {
                    path: sibling,
                    source,
                })?
            }
        };
        let mut this = Self::compile(template, path.display().to_string())?;
        this.bos_token = special_token(&config, "bos_token");
        this.eos_token = special_token(&config, "eos_token");
        Ok(this)
    }

    /// The chat template that came with `tokenizer` (from its folder, or Qwen3's for a
    /// [`crate::tokenizer::train_bpe`] tokenizer), given its `eos_token`; `None` when it
    /// has none.
    pub fn from_tokenizer(tokenizer: &crate::tokenizer::Tokenizer) -> Result<Option<Self>> {
        let Some(source) = &tokenizer.chat_template else {
            return Ok(None);
        };
        let mut this = Self::compile(source.clone(), "<tokenizer>".into())?;
        this.eos_token = tokenizer.eos_token.clone();
        Ok(Some(this))
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    fn compile(source: String, origin: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TemplateError::Syntax {
                origin: origin.clone(),
                detail: format!("{e:#}"),
            })?;
        Ok(Self {
            env,
            source,
            origin,
            bos_token: None,
            eos_token: None,
        })
    }

    /// Renders `messages`. `extra` (a JSON object, or null) adds template variables such
    /// as `enable_thinking` or `tools`, and may override `bos_token`/`eos_token`.
    pub fn render<M: Serialize>(
        &self,
        messages: &[M],
        add_generation_prompt: bool,
        extra: &serde_json::Value,
    ) -> Result<String> {
        let render_err = |detail: String| TemplateError::Render {
            origin: self.origin.clone(),
            detail,
        };
        let mut ctx = serde_json::Map::new();
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), bos.clone().into());
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), eos.clone().into());
        }
        match extra {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => ctx.extend(map.clone()),
            other => {
                return Err(render_err(format!(
                    "`extra` must be a JSON object, got {other}"
                )))
            }
        }
        let messages = serde_json::to_value(messages)
            .map_err(|e| render_err(format!("messages do not serialize: {e}")))?;
        ctx.insert("messages".into(), messages);
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("compiled at construction");
        template
            .render(Value::from_serialize(&ctx))
            .map_err(|e| render_err(format!("{e:#}")))
    }
}

/// A special token of `tokenizer_config.json`: a string or `{"content": ...}`.
fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time, with the common `strftime` codes.
fn strftime_now(format: String) -> std::result::Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(secs, &format)
}

/// Formats `secs` since the Unix epoch (UTC) with `%Y %y %m %d %e %H %M %S %j %b %B %a
/// %A %p %I %%`.
fn strftime(secs: u64, format: &str) -> std::result::Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (secs / 86_400) as i64;
    let (h, mi, s) = (secs % 86_400 / 3600, secs % 3600 / 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let d = doy_march - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let code = chars.next().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                "strftime_now: format ends in `%`",
            )
        })?;
        let piece = match code {
            'Y' => y.to_string(),
            'y' => format!("{:02}", y % 100),
            'm' => format!("{m:02}"),
            'd' => format!("{d:02}"),
            'e' => format!("{d:>2}"),
            'H' => format!("{h:02}"),
            'I' => format!("{:02}", (h + 11) % 12 + 1),
            'p' => (if h < 12 { "AM" } else { "PM" }).to_string(),
            'M' => format!("{mi:02}"),
            'S' => format!("{s:02}"),
            'j' => format!("{yday:03}"),
            'b' => MONTHS[(m - 1) as usize][..3].to_string(),
            'B' => MONTHS[(m - 1) as usize].to_string(),
            'a' => DAYS[weekday][..3].to_string(),
            'A' => DAYS[weekday].to_string(),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported code `%{other}`"),
                ))
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=..., separators=...)`.
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    // Accepted for compatibility: output is never ASCII-escaped, and keys arrive sorted.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(value).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(e)
    })?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &item_sep, &key_sep, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(
    v: &serde_json::Value,
    indent: Option<usize>,
    level: usize,
    item_sep: &str,
    key_sep: &str,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&n.to_string()),
        J::String(s) => write_py_string(s, out),
        J::Array(items) if items.is_empty() => out.push_str("[]"),
        J::Object(map) if map.is_empty() => out.push_str("{}"),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_json(item, indent, level + 1, item_sep, key_sep, out);
            }
            newline(out, level);
            out.push(']');
        }
        J::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_py_string(k, out);
                out.push_str(key_sep);
                write_py_json(item, indent, level + 1, item_sep, key_sep, out);
            }
            newline(out, level);
            out.push('}');
        }
    }
}

fn write_py_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `str.strip` family: `chars` is a set of characters (whitespace when absent).
fn strip_chars<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let matches = |c: char| chars.map_or(c.is_whitespace(), |set| set.contains(c));
    let s = if left {
        s.trim_start_matches(matches)
    } else {
        s
    };
    if right {
        s.trim_end_matches(matches)
    } else {
        s
    }
}

/// Python's `str.split(sep=None, maxsplit=-1)`.
fn py_split(s: &str, sep: Option<&str>, maxsplit: i64) -> std::result::Result<Vec<String>, Error> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize + 1
    };
    Ok(match sep {
        Some("") => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "split: empty separator",
            ))
        }
        Some(sep) => s.splitn(limit, sep).map(str::to_string).collect(),
        None => {
            // Whitespace runs separate; leading/trailing whitespace yields no empty parts.
            let mut parts = Vec::new();
            let mut rest = s.trim_start();
            while !rest.is_empty() {
                if parts.len() + 1 == limit {
                    parts.push(rest.to_string());
                    break;
                }
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                parts.push(rest[..end].to_string());
                rest = rest[end..].trim_start();
            }
            parts
        }
    })
}

/// The Python methods chat templates call on strings and dicts.
fn python_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> std::result::Result<Value, Error> {
    if let Some(s) = value.as_str() {
        return string_method(s, method, args);
    }
    if value.kind() == ValueKind::Map {
        match method {
            "items" => {
                let _: () = from_args(args)?;
                return state.apply_filter("items", std::slice::from_ref(value));
            }
            "keys" | "values" => {
                let _: () = from_args(args)?;
                let keys = value.try_iter()?;
                return Ok(Value::from(
                    keys.map(|k| {
                        if method == "keys" {
                            Ok(k)
                        } else {
                            value.get_item(&k)
                        }
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?,
                ));
            }
            "get" => {
                let (key, default): (Value, Option<Value>) = from_args(args)?;
                let got = value.get_item(&key)?;
                return Ok(if got.is_undefined() {
                    default.unwrap_or(Value::from(()))
                } else {
                    got
                });
            }
            _ => {}
        }
    }
    Err(Error::new(
        ErrorKind::UnknownMethod,
        format!("{} has no method `{method}`", value.kind()),
    ))
}

fn string_method(s: &str, method: &str, args: &[Value]) -> std::result::Result<Value, Error> {
    let prefixes = |v: &Value| -> std::result::Result<Vec<String>, Error> {
        match v.as_str() {
            Some(p) => Ok(vec![p.to_string()]),
            None => Ok(v.try_iter()?.map(|x| x.to_string()).collect()),
        }
    };
    Ok(match method {
        "startswith" | "endswith" => {
            let (p,): (Value,) = from_args(args)?;
            let ps = prefixes(&p)?;
            Value::from(ps.iter().any(|p| {
                if method == "startswith" {
                    s.starts_with(p.as_str())
                } else {
                    s.ends_with(p.as_str())
                }
            }))
        }
        "strip" | "lstrip" | "rstrip" => {
            let (chars,): (Option<String>,) = from_args(args)?;
            let (l, r) = (method != "rstrip", method != "lstrip");
            Value::from(strip_chars(s, chars.as_deref(), l, r))
        }
        "split" => {
            let (sep, maxsplit): (Option<String>, Option<i64>) = from_args(args)?;
            Value::from(py_split(s, sep.as_deref(), maxsplit.unwrap_or(-1))?)
        }
        "replace" => {
            let (old, new, count): (String, String, Option<i64>) = from_args(args)?;
            match count {
                Some(n) if n >= 0 => Value::from(s.replacen(&old, &new, n as usize)),
                _ => Value::from(s.replace(&old, &new)),
            }
        }
        "upper" => {
            let _: () = from_args(args)?;
            Value::from(s.to_uppercase())
        }
        "lower" => {
            let _: () = from_args(args)?;
            Value::from(s.to_lowercase())
        }
        "find" => {
            let (sub,): (String,) = from_args(args)?;
            Value::from(
                s.find(&sub)
                    .map_or(-1, |byte| s[..byte].chars().count() as i64),
            )
        }
        "count" => {
            let (sub,): (String,) = from_args(args)?;
            Value::from(s.matches(&sub).count())
        }
        "join" => {
            let (items,): (Value,) = from_args(args)?;
            let parts: Vec<String> = items
                .try_iter()?
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .unwrap_or_else(|| v.to_string())
                })
                .collect();
            Value::from(parts.join(s))
        }
        "isdigit" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit())),
        "isspace" => Value::from(!s.is_empty() && s.chars().all(char::is_whitespace)),
        _ => {
            return Err(Error::new(
                ErrorKind::UnknownMethod,
                format!("string has no method `{method}`"),
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_instants() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime(t, "%Y-%m-%d %H:%M:%S %j %a %A %b %B %y %I%p %%").unwrap(),
            "2024-02-29 13:05:09 060 Thu Thursday Feb February 24 01PM %"
        );
        assert_eq!(strftime(0, "%d %b %Y").unwrap(), "01 Jan 1970");
        assert!(strftime(0, "%Q").is_err());
    }

    #[test]
    fn python_split_and_strip_semantics() {
        assert_eq!(py_split("a,,b", Some(","), -1).unwrap(), ["a", "", "b"]);
        assert_eq!(py_split("  a  b ", None, -1).unwrap(), ["a", "b"]);
        assert_eq!(py_split("a b c", None, 1).unwrap(), ["a", "b c"]);
        assert_eq!(py_split("a-b-c", Some("-"), 1).unwrap(), ["a", "b-c"]);
        assert_eq!(strip_chars("\n\nx\n", Some("\n"), true, false), "x\n");
        assert_eq!(strip_chars("ab xba", Some("ab"), true, true), " x");
    }
}
