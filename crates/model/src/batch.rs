//! Packed batches: many sequences laid end to end in one token dimension, with the
//! segment table that keeps their attention apart, and the per-token statistics the
//! model returns for them.
//!
//! Row `t` of a [`PackedBatch`] feeds `tokens[t]` at `positions[t]` and scores
//! `targets[t]`: [`TokenStats::logprobs`]`[t]` is `log p(targets[t] | the tokens row t
//! attends to)`. A plain sequence `s` of `n` tokens takes `n − 1` rows (`s[..n−1]`
//! predicting `s[1..]`). Prompt sharing ([`PackedBatch::push_shared_prompt`]) puts a
//! group's prompt once, as its own segment, and each response as a segment that attends
//! to it as a prefix and continues its positions.

use std::ops::Range;

use floe_backend::Segment;

/// Why a batch is malformed; each variant names the row, segment or sequence at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    /// `tokens`, `targets` and `positions` differ in length.
    #[error("batch: tokens has {tokens} rows, targets {targets}, positions {positions}")]
    Lengths {
        /// Rows of `tokens`.
        tokens: usize,
        /// Rows of `targets`.
        targets: usize,
        /// Rows of `positions`.
        positions: usize,
    },
    /// A segment reaches past the batch, or its prefix does.
    #[error("batch: segment {segment} ({what}) ends at row {end}, past the {rows} rows")]
    OutOfRange {
        /// Index of the segment.
        segment: usize,
        /// `tokens` or `prefix`.
        what: &'static str,
        /// One past its last row.
        end: usize,
        /// Rows in the batch.
        rows: usize,
    },
    /// Two segments claim the same row.
    #[error("batch: row {row} belongs to segments {first} and {second}")]
    Overlap {
        /// The row.
        row: usize,
        /// The first segment claiming it.
        first: usize,
        /// The second.
        second: usize,
    },
    /// A sequence too short to score anything.
    #[error("batch: {what} {index} has {len} tokens, needs at least {min}")]
    TooShort {
        /// `sequence`, `prompt` or `response`.
        what: &'static str,
        /// Its index in the call.
        index: usize,
        /// Its length.
        len: usize,
        /// The least length accepted.
        min: usize,
    },
}

/// Sequences packed into one token dimension, with their attention segments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackedBatch {
    /// `[T]` input token of each row.
    pub tokens: Vec<u32>,
    /// `[T]` the token whose log-prob row `t` scores.
    pub targets: Vec<u32>,
    /// `[T]` RoPE position of each row (restarting per sequence; a response that shares a
    /// prompt continues the prompt's positions).
    pub positions: Vec<u32>,
    /// The attention segments; rows outside every segment attend to nothing.
    pub segments: Vec<Segment>,
}

impl PackedBatch {
    /// A batch from its parts, checked: equal lengths, segments inside the batch and
    /// disjoint.
    pub fn new(
        tokens: Vec<u32>,
        targets: Vec<u32>,
        positions: Vec<u32>,
        segments: Vec<Segment>,
    ) -> Result<Self, BatchError> {
        let batch = Self {
            tokens,
            targets,
            positions,
            segments,
        };
        batch.validate()?;
        Ok(batch)
    }

    /// Packs whole sequences one after another: each of `n ≥ 2` tokens takes `n − 1`
    /// rows scoring its tokens `1..n`.
    pub fn from_sequences(sequences: &[Vec<u32>]) -> Result<Self, BatchError> {
        let mut batch = Self::default();
        for (i, seq) in sequences.iter().enumerate() {
            if seq.len() < 2 {
                return Err(BatchError::TooShort {
                    what: "sequence",
                    index: i,
                    len: seq.len(),
                    min: 2,
                });
            }
            batch.push_sequence(seq);
        }
        Ok(batch)
    }

    /// Rows in the batch (`T`).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True when the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Appends `seq` as its own segment (positions from 0) and returns the rows that
    /// score `seq[1..]`, in order. A sequence of fewer than 2 tokens adds nothing.
    pub fn push_sequence(&mut self, seq: &[u32]) -> Range<usize> {
        let start = self.len();
        if seq.len() < 2 {
            return start..start;
        }
        let rows = seq.len() - 1;
        self.tokens.extend_from_slice(&seq[..rows]);
        self.targets.extend_from_slice(&seq[1..]);
        self.positions.extend(0..rows as u32);
        self.segments.push(Segment {
            start: start as u32,
            len: rows as u32,
            prefix_start: 0,
            prefix_len: 0,
        });
        start..start + rows
    }

    /// Appends a prompt once and every response after it, each response attending to the
    /// prompt as a shared prefix. Returns, per response, the rows that score its tokens.
    ///
    /// Layout: the prompt segment holds `prompt[..P−1]` (positions `0..P−1`); each
    /// response segment starts with the prompt's last token, so that its first row
    /// scores the response's first token, and runs at positions `P−1..`. The result is the
    /// same, row for row, as packing each `prompt ++ response` on its own.
    pub fn push_shared_prompt(
        &mut self,
        prompt: &[u32],
        responses: &[Vec<u32>],
    ) -> Result<Vec<Range<usize>>, BatchError> {
        let Some((&last, head)) = prompt.split_last() else {
            return Err(BatchError::TooShort {
                what: "prompt",
                index: 0,
                len: 0,
                min: 1,
            });
        };
        if let Some(i) = responses.iter().position(|r| r.is_empty()) {
            return Err(BatchError::TooShort {
                what: "response",
                index: i,
                len: 0,
                min: 1,
            });
        }
        let prefix_start = self.len() as u32;
        let prefix_len = head.len() as u32;
        if !head.is_empty() {
            self.tokens.extend_from_slice(head);
            self.targets.extend_from_slice(&prompt[1..]);
            self.positions.extend(0..prefix_len);
            self.segments.push(Segment {
                start: prefix_start,
                len: prefix_len,
                prefix_start: 0,
                prefix_len: 0,
            });
        }
        let mut rows = Vec::with_capacity(responses.len());
        for response in responses {
            let start = self.len();
            let len = response.len();
            self.tokens.push(last);
            self.tokens.extend_from_slice(&response[..len - 1]);
            self.targets.extend_from_slice(response);
            self.positions.extend(prefix_len..prefix_len + len as u32);
            self.segments.push(Segment {
                start: start as u32,
                len: len as u32,
                prefix_start: if prefix_len > 0 { prefix_start } else { 0 },
                prefix_len,
            });
            rows.push(start..start + len);
        }
        Ok(rows)
    }

    /// Checks lengths and the segment table.
    pub fn validate(&self) -> Result<(), BatchError> {
        let rows = self.tokens.len();
        if self.targets.len() != rows || self.positions.len() != rows {
            return Err(BatchError::Lengths {
                tokens: rows,
                targets: self.targets.len(),
                positions: self.positions.len(),
            });
        }
        let mut owner: Vec<Option<usize>> = vec![None; rows];
        for (i, s) in self.segments.iter().enumerate() {
            let end = (s.start + s.len) as usize;
            if end > rows {
                return Err(BatchError::OutOfRange {
                    segment: i,
                    what: "tokens",
                    end,
                    rows,
                });
            }
            let prefix_end = (s.prefix_start + s.prefix_len) as usize;
            if s.prefix_len > 0 && prefix_end > rows {
                return Err(BatchError::OutOfRange {
                    segment: i,
                    what: "prefix",
                    end: prefix_end,
                    rows,
                });
            }
            for (row, o) in owner
                .iter_mut()
                .enumerate()
                .take(end)
                .skip(s.start as usize)
            {
                if let Some(first) = *o {
                    return Err(BatchError::Overlap {
                        row,
                        first,
                        second: i,
                    });
                }
                *o = Some(i);
            }
        }
        Ok(())
    }
}

/// Per-row statistics of a forward pass over a [`PackedBatch`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenStats {
    /// `[T]` log-prob of each row's target under `softmax(logit_scale · logits)`.
    pub logprobs: Vec<f64>,
    /// `[T]` entropy of each row's distribution.
    pub entropy: Vec<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prompt_layout_continues_positions() {
        let mut b = PackedBatch::default();
        let rows = b
            .push_shared_prompt(&[1, 2, 3], &[vec![7, 8], vec![9]])
            .unwrap();
        assert_eq!(b.tokens, vec![1, 2, 3, 7, 3]);
        assert_eq!(b.targets, vec![2, 3, 7, 8, 9]);
        assert_eq!(b.positions, vec![0, 1, 2, 3, 2]);
        assert_eq!(rows, vec![2..4, 4..5]);
        assert_eq!(b.segments[1].prefix_len, 2);
        b.validate().unwrap();
    }

    #[test]
    fn malformed_batches_are_rejected() {
        let seg = |start, len| Segment {
            start,
            len,
            ..Default::default()
        };
        let err = PackedBatch::new(vec![1, 2], vec![1], vec![0, 1], vec![]).unwrap_err();
        assert!(matches!(err, BatchError::Lengths { .. }));
        let err = PackedBatch::new(
            vec![1, 2],
            vec![1, 2],
            vec![0, 1],
            vec![seg(0, 2), seg(1, 1)],
        )
        .unwrap_err();
        assert_eq!(
            err,
            BatchError::Overlap {
                row: 1,
                first: 0,
                second: 1
            }
        );
        assert!(PackedBatch::from_sequences(&[vec![1]]).is_err());
    }
}
