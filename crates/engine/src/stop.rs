//! When a sample stops: stop token ids, stop strings, length.
//!
//! Stop strings are matched on the detokenized text of the generated tokens, as vLLM
//! does: the tokens that completed a stop string stay in the sample (they are what the
//! policy produced, and the trainer needs their log-probs), while the reported text is
//! cut just before the stop string.

use serde::{Deserialize, Serialize};

/// What ended a sample early.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stop {
    /// The sample produced this stop token id (kept as its last token).
    Token(u32),
    /// The generated text contains this stop string.
    String(String),
}

/// Why a sample finished.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// A stop token or stop string.
    Stop(Stop),
    /// It reached its `max_new_tokens`.
    Length,
}

/// The stop conditions of one request.
#[derive(Clone, Debug, Default)]
pub struct StopConditions {
    token_ids: Vec<u32>,
    strings: Vec<String>,
    /// Bytes of the longest stop string.
    longest_string: usize,
}

/// Where a stop string matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StringMatch {
    /// Index of the matched string in the request's `stop_strings`.
    pub index: usize,
    /// Byte offset in the text where the match starts (the text is cut there).
    pub start: usize,
}

impl StopConditions {
    /// Stop on any of `token_ids` or when the text contains any of `strings` (empty
    /// strings are ignored: they would match before anything was generated).
    pub fn new(token_ids: &[u32], strings: &[String]) -> Self {
        let strings: Vec<String> = strings.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self {
            token_ids: token_ids.to_vec(),
            longest_string: strings.iter().map(String::len).max().unwrap_or(0),
            strings,
        }
    }

    /// True when matching needs the detokenized text.
    pub fn has_strings(&self) -> bool {
        !self.strings.is_empty()
    }

    /// The stop strings, in request order.
    pub fn strings(&self) -> &[String] {
        &self.strings
    }

    /// True when `token` is a stop token.
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.token_ids.contains(&token)
    }

    /// The earliest stop string in `text` that ends at or after byte `searched` (the
    /// length of the text already searched without a match), with ties going to the
    /// string listed first.
    ///
    /// Only the new tail of the text, widened backwards by the longest stop string and
    /// a few bytes of slack, is scanned, so checking after every token costs time in the
    /// length of the new text only. The slack covers detokenizers that render an
    /// incomplete UTF-8 sequence as a replacement character and rewrite it once the
    /// next token completes it.
    pub fn find_string(&self, text: &str, searched: usize) -> Option<StringMatch> {
        const REWRITE_SLACK: usize = 4;
        let mut from = searched.saturating_sub(self.longest_string + REWRITE_SLACK);
        from = from.min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        let window = &text[from..];
        self.strings
            .iter()
            .enumerate()
            .filter_map(|(index, s)| {
                window.find(s.as_str()).map(|at| StringMatch {
                    index,
                    start: from + at,
                })
            })
            .min_by_key(|m| (m.start, m.index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stop_tokens() {
        let stop = StopConditions::new(&[2, 7], &[]);
        assert!(stop.is_stop_token(7));
        assert!(!stop.is_stop_token(3));
        assert!(!stop.has_strings());
    }

    #[test]
    fn earliest_match_wins_and_ties_go_to_the_first_listed() {
        let stop = StopConditions::new(&[], &strings(&["</sql>", "sql", ""]));
        assert_eq!(stop.strings().len(), 2, "empty strings are dropped");
        assert_eq!(
            stop.find_string("select 1 </sql> rest", 0),
            Some(StringMatch { index: 0, start: 9 })
        );
        let stop = StopConditions::new(&[], &strings(&["ab", "a"]));
        assert_eq!(
            stop.find_string("xxab", 0),
            Some(StringMatch { index: 0, start: 2 })
        );
        assert_eq!(stop.find_string("xxb", 0), None);
    }

    #[test]
    fn incremental_search_finds_strings_spanning_old_and_new_text() {
        let stop = StopConditions::new(&[], &strings(&["STOP"]));
        // "ST" was searched already; "OP" arrives with the next token.
        assert_eq!(stop.find_string("hello ST", 0), None);
        assert_eq!(
            stop.find_string("hello STOP", "hello ST".len()),
            Some(StringMatch { index: 0, start: 6 })
        );
        // A start offset inside a multi-byte character is moved back to a boundary.
        let text = "ééééééé STOP";
        assert_eq!(stop.find_string(text, text.len() - 1).unwrap().start, 15);
    }
}
