//! The ranks of a data-parallel run (`docs/distributed.md`): which rank this process is,
//! which one writes the run's files, each rank's share of a step's work, and the exact
//! exchange of what the ranks made, so every rank holds the same rollouts, log-probs and
//! metrics and computes the same splits.
//!
//! Every rank runs the whole loop in the same order; where the work divides (sampling,
//! scoring, log-probs, the mini-batches' forward and backward, the warm start), each rank
//! does its share and the results are gathered, so that what the loop computes from them
//! (advantages, metrics, the next split) is the same on every rank and the same as one
//! process computes. Rank 0 alone writes files.

use std::sync::Arc;

use floe_dist::{balance_groups, balance_whole_groups, GroupPiece, GroupShape};
use floe_engine::{RankExchange, SequenceGroup, TrainGroup, TrainingSide, Weights};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// This process's place among the ranks of its run; one rank without a group.
#[derive(Clone)]
pub struct Ranks {
    exchange: Option<Arc<dyn RankExchange>>,
}

impl Ranks {
    /// A run of one process.
    pub fn single() -> Self {
        Self { exchange: None }
    }

    /// A rank of the group `exchange` connects.
    pub fn new(exchange: Arc<dyn RankExchange>) -> Self {
        Self {
            exchange: Some(exchange),
        }
    }

    /// This rank, `0 .. world_size`.
    pub fn rank(&self) -> usize {
        self.exchange.as_ref().map_or(0, |e| e.rank())
    }

    /// Ranks in the run.
    pub fn world_size(&self) -> usize {
        self.exchange.as_ref().map_or(1, |e| e.world_size())
    }

    /// Whether this rank writes the run's files (metrics, report, checkpoints, the
    /// tokenizer, the data): rank 0. The others hold the same state and write nothing.
    pub fn writes(&self) -> bool {
        self.rank() == 0
    }

    /// Every rank's `value`, in rank order, the same on every rank; values travel as
    /// JSON, so floats that must arrive exactly (non-finite ones included) are written
    /// with `floe_engine::native_api::float` or `crate::checkpoint::float_vec`.
    pub fn all_gather<T: Serialize + DeserializeOwned>(&self, value: T) -> Result<Vec<T>> {
        if self.exchange.is_none() {
            return Ok(vec![value]);
        }
        self.gather_bytes(&value)?
            .iter()
            .enumerate()
            .map(|(rank, bytes)| decode(rank, bytes))
            .collect()
    }

    /// What `make` gives on rank 0, on every rank: rank 0 alone runs it (it decides or
    /// prepares what the others must share, and writes the files that come with it). When
    /// it fails on rank 0 the others fail too, naming rank 0's error.
    pub fn from_rank_zero<T: Serialize + DeserializeOwned>(
        &self,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if self.exchange.is_none() {
            return make();
        }
        if self.writes() {
            let made = make();
            let sent: std::result::Result<&T, String> =
                made.as_ref().map_err(|err| err.to_string());
            self.gather_bytes(&Some(sent))?;
            return made;
        }
        let blocks = self.gather_bytes(&None::<()>)?;
        let sent: Option<std::result::Result<T, String>> = decode(0, &blocks[0])?;
        match sent {
            Some(Ok(value)) => Ok(value),
            Some(Err(why)) => Err(Error::DataParallel(format!("rank 0 failed: {why}"))),
            None => Err(Error::DataParallel("rank 0 sent nothing".into())),
        }
    }

    /// Every rank's `value`, encoded, in rank order.
    fn gather_bytes<T: Serialize + ?Sized>(&self, value: &T) -> Result<Vec<Vec<u8>>> {
        let exchange = self.exchange.as_ref().expect("called with several ranks");
        let bytes = serde_json::to_vec(value)
            .map_err(|e| Error::DataParallel(format!("encoding this rank's share: {e}")))?;
        Ok(exchange.all_gather_bytes(&bytes)?)
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        self.all_gather(()).map(drop)
    }

    /// This rank's share of sampling `samples` samples of each of `prompt_lens` prompts:
    /// `(prompt, sample range)` pieces, balanced by prompt tokens × samples. A prompt's
    /// samples may go to several ranks (fewer prompts than ranks): sampling is seeded per
    /// sample, and groups are whole again once the rollouts are gathered.
    pub fn sampling_share(
        &self,
        prompt_lens: &[usize],
        samples: usize,
    ) -> Vec<(usize, std::ops::Range<usize>)> {
        let shapes: Vec<GroupShape> = prompt_lens
            .iter()
            .map(|&len| GroupShape {
                prompt_tokens: 0,
                response_tokens: vec![len; samples],
            })
            .collect();
        balance_groups(&shapes, self.world_size())
            .swap_remove(self.rank())
            .into_iter()
            .map(|piece| (piece.group, piece.responses))
            .collect()
    }

    /// This rank's share of the groups of a forward (the log-probs of a batch): pieces
    /// balanced by tokens, groups split where fewer than ranks (a forward reads no group
    /// as a whole).
    pub fn forward_share(&self, groups: &[SequenceGroup]) -> Vec<GroupPiece> {
        let shapes: Vec<GroupShape> = groups
            .iter()
            .map(|g| GroupShape {
                prompt_tokens: g.prompt.len(),
                response_tokens: g.responses.iter().map(Vec::len).collect(),
            })
            .collect();
        balance_groups(&shapes, self.world_size()).swap_remove(self.rank())
    }

    /// This rank's share of a mini-batch for `forward_backward`: whole groups balanced by
    /// tokens, the same split on every rank; with fewer groups than ranks the last ranks
    /// get none (and still call the verb). Groups stay whole because the advantages and
    /// `prompt_mean` read a group as a whole.
    pub fn train_share(&self, groups: &[TrainGroup]) -> Vec<TrainGroup> {
        if self.exchange.is_none() {
            return groups.to_vec();
        }
        let shapes: Vec<GroupShape> = groups.iter().map(train_shape).collect();
        balance_whole_groups(&shapes, self.world_size())
            .swap_remove(self.rank())
            .into_iter()
            .map(|piece| groups[piece.group].clone())
            .collect()
    }

    /// This rank's share of a warm-start batch: its groups balanced by tokens, split
    /// where fewer than ranks (cross-entropy counts tokens only).
    pub fn sft_share(&self, groups: &[TrainGroup]) -> Vec<TrainGroup> {
        if self.exchange.is_none() {
            return groups.to_vec();
        }
        let shapes: Vec<GroupShape> = groups.iter().map(train_shape).collect();
        balance_groups(&shapes, self.world_size())
            .swap_remove(self.rank())
            .into_iter()
            .map(|piece| TrainGroup {
                prompt: groups[piece.group].prompt.clone(),
                responses: groups[piece.group].responses[piece.responses].to_vec(),
            })
            .collect()
    }
}

fn decode<T: DeserializeOwned>(rank: usize, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::DataParallel(format!("rank {rank}'s share does not decode: {e}")))
}

fn train_shape(group: &TrainGroup) -> GroupShape {
    GroupShape {
        prompt_tokens: group.prompt.len(),
        response_tokens: group.responses.iter().map(|r| r.tokens.len()).collect(),
    }
}

/// The log-probs of a piece of a group, as the exchange carries them (exact).
#[derive(Serialize, Deserialize)]
struct PieceLogprobs {
    group: usize,
    first_response: usize,
    /// Per response of the piece, per token.
    #[serde(with = "crate::checkpoint::float_vec")]
    logprobs: Vec<f64>,
    /// Tokens of each response of the piece, to cut `logprobs`.
    lens: Vec<usize>,
}

impl Ranks {
    /// The log-probs of every response of `groups` under `weights` (per group, per
    /// response, per token): this rank forwards its share ([`Ranks::forward_share`]) and
    /// every rank's are gathered, so every rank holds them all.
    pub fn forward_logprobs<X: std::error::Error + Send + Sync + 'static>(
        &self,
        trainer: &mut dyn TrainingSide<Error = X>,
        groups: &[SequenceGroup],
        weights: Weights,
        temperature: f32,
    ) -> Result<Vec<Vec<Vec<f64>>>> {
        if self.exchange.is_none() {
            let outputs = trainer
                .forward(groups, weights, temperature)
                .map_err(Error::verb("forward"))?;
            return Ok(outputs
                .into_iter()
                .map(|g| g.into_iter().map(|r| r.logprobs).collect())
                .collect());
        }
        let share = self.forward_share(groups);
        let pieces: Vec<SequenceGroup> = share
            .iter()
            .map(|piece| {
                let group = &groups[piece.group];
                SequenceGroup {
                    prompt: group.prompt.clone(),
                    responses: group.responses[piece.responses.clone()].to_vec(),
                    targets: group
                        .targets
                        .as_ref()
                        .map(|t| t[piece.responses.clone()].to_vec()),
                }
            })
            .collect();
        let outputs = trainer
            .forward(&pieces, weights, temperature)
            .map_err(Error::verb("forward"))?;
        let mine: Vec<PieceLogprobs> = share
            .iter()
            .zip(outputs)
            .map(|(piece, out)| PieceLogprobs {
                group: piece.group,
                first_response: piece.responses.start,
                lens: out.iter().map(|r| r.logprobs.len()).collect(),
                logprobs: out.into_iter().flat_map(|r| r.logprobs).collect(),
            })
            .collect();
        let mut logprobs: Vec<Vec<Vec<f64>>> = groups
            .iter()
            .map(|g| vec![Vec::new(); g.responses.len()])
            .collect();
        for piece in self.all_gather(mine)?.into_iter().flatten() {
            let mut at = 0;
            for (r, len) in piece.lens.iter().enumerate() {
                logprobs[piece.group][piece.first_response + r] =
                    piece.logprobs[at..at + len].to_vec();
                at += len;
            }
        }
        Ok(logprobs)
    }
}
