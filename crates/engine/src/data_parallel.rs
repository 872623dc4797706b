//! Data-parallel training (DDP semantics) of a [`crate::LocalEngine`]: each rank of a
//! [`Collective`] group trains on its share of a mini-batch, and every rank takes the same
//! optimizer step, the step one engine would take on the whole mini-batch (up to the
//! order of float sums); see `docs/distributed.md`.
//!
//! What travels between ranks, and when:
//! - at creation, rank 0's trained weights to every rank ([`crate::policy::Policy::broadcast_weights`]);
//! - at each `forward_backward`, before any compute, the totals the loss divides by
//!   ([`DataParallel::global_norm`], [`DataParallel::sum`]), so every rank weighs its
//!   tokens by the whole mini-batch's counts; after it, each rank's loss and
//!   per-micro-batch metrics, so every rank reports the mini-batch's values;
//! - at `optim_step`, the gradients, summed ([`crate::policy::Policy::optim_step_data_parallel`]).
//!
//! Small values (counts, losses, metrics) travel exactly, as the bits of their `f64`s in
//! Index buffers, and every rank combines them in rank order, so all ranks agree bit for
//! bit.

use std::collections::BTreeMap;
use std::sync::Arc;

use floe_backend::{Backend, Collective};
use floe_rl::metrics::reduce_micro_batch_metrics;
use floe_rl::GlobalNorm;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::verbs::ForwardBackwardOutput;
use crate::{Error, Result};

/// The ranks of a data-parallel group as one of them sees it: who it is, and an exact
/// exchange of small values over the group's collective (a trainer's scored rollouts,
/// log-probs and metrics). Every rank calls it at the same points, in the same order
/// as its engine's training verbs.
pub trait RankExchange: Send + Sync {
    /// This rank, `0 .. world_size`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Every rank's `bytes` (of any lengths), in rank order, the same on every rank.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// One rank's place in a data-parallel group, with the backend its buffers live on.
pub(crate) struct DataParallel<B: Backend> {
    pub(crate) collective: Arc<dyn Collective<B>>,
    pub(crate) backend: Arc<B>,
}

/// A rank's share of a mini-batch's [`GlobalNorm`], floats as bits.
#[derive(Serialize, Deserialize)]
struct NormShare {
    /// Groups in the rank's call, with responses or without (they number the ids).
    groups: usize,
    num_tokens: u64,
    num_sequences: usize,
    /// `(group index in the rank's call, its valid tokens)`.
    group_tokens: Vec<(u64, u64)>,
}

/// A rank's loss and the metrics of each of its micro-batches, floats as bits.
#[derive(Serialize, Deserialize)]
struct OutputShare {
    loss: u64,
    micro_batches: Vec<Vec<(String, u64)>>,
}

impl<B: Backend> DataParallel<B> {
    pub(crate) fn new(collective: Arc<dyn Collective<B>>, backend: Arc<B>) -> Self {
        Self {
            collective,
            backend,
        }
    }

    /// Every rank's `value`, in rank order, the same on every rank.
    fn all_gather<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let bytes = serde_json::to_vec(value).map_err(|e| {
            Error::InvalidRequest(format!("data parallel: encoding a rank's share: {e}"))
        })?;
        self.all_gather_bytes(&bytes)?
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                serde_json::from_slice(bytes).map_err(|e| {
                    Error::InvalidRequest(format!(
                        "data parallel: rank {rank}'s share does not decode: {e}"
                    ))
                })
            })
            .collect()
    }

    /// Every rank's `words`, concatenated in rank order.
    fn gather_words(&self, words: &[u32]) -> Result<Vec<u32>> {
        let send = self.backend.upload_index(words)?;
        let world = self.collective.world_size();
        let mut recv = self.backend.upload_index(&vec![0; world * words.len()])?;
        self.collective.all_gather(&send, &mut recv)?;
        Ok(self.backend.download_index(&recv)?)
    }

    /// The largest of every rank's `value`.
    pub(crate) fn max(&self, value: usize) -> Result<usize> {
        Ok(self.all_gather(&value)?.into_iter().max().unwrap_or(value))
    }

    /// The sum over ranks of `value`, in rank order.
    pub(crate) fn sum(&self, value: f64) -> Result<f64> {
        let all = self.all_gather(&value.to_bits())?;
        Ok(all.into_iter().map(f64::from_bits).sum())
    }

    /// The whole mini-batch's totals from this rank's `local` ones (over its `groups`
    /// groups, numbered by their index in the call), and the id of this rank's first
    /// group in them: rank r's groups follow those of ranks below it.
    ///
    /// A group split between ranks counts once per rank that holds part of it, so
    /// `prompt_mean` wants groups whole on a rank (what `floe_dist::balance_groups` does
    /// when there are at least as many groups as ranks); the other reductions count
    /// tokens and sequences only.
    pub(crate) fn global_norm(
        &self,
        local: &GlobalNorm,
        groups: usize,
    ) -> Result<(GlobalNorm, u64)> {
        let share = NormShare {
            groups,
            num_tokens: local.num_tokens.to_bits(),
            num_sequences: local.num_sequences,
            group_tokens: local
                .group_tokens
                .iter()
                .map(|(&id, &tokens)| (id, tokens.to_bits()))
                .collect(),
        };
        let shares = self.all_gather(&share)?;
        let mut norm = GlobalNorm {
            num_tokens: 0.0,
            num_sequences: 0,
            group_tokens: BTreeMap::new(),
        };
        let mut first_id = 0u64;
        let mut own_first_id = 0;
        for (rank, share) in shares.iter().enumerate() {
            if rank == self.collective.rank() {
                own_first_id = first_id;
            }
            norm.num_tokens += f64::from_bits(share.num_tokens);
            norm.num_sequences += share.num_sequences;
            for &(id, tokens) in &share.group_tokens {
                norm.group_tokens
                    .insert(first_id + id, f64::from_bits(tokens));
            }
            first_id += share.groups as u64;
        }
        Ok((norm, own_first_id))
    }

    /// The mini-batch's output from this rank's loss and per-micro-batch metrics: losses
    /// summed (each rank's is already divided by the whole mini-batch's totals), metrics
    /// combined over every rank's micro-batches as one engine combines its own.
    pub(crate) fn policy_output(
        &self,
        loss: f64,
        micro_batches: &[BTreeMap<String, f64>],
    ) -> Result<ForwardBackwardOutput> {
        let share = OutputShare {
            loss: loss.to_bits(),
            micro_batches: micro_batches
                .iter()
                .map(|m| m.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect())
                .collect(),
        };
        let shares = self.all_gather(&share)?;
        let loss = shares.iter().map(|s| f64::from_bits(s.loss)).sum();
        let metrics: Vec<BTreeMap<String, f64>> = shares
            .into_iter()
            .flat_map(|s| s.micro_batches)
            .map(|m| m.into_iter().map(|(k, v)| (k, f64::from_bits(v))).collect())
            .collect();
        Ok(ForwardBackwardOutput {
            loss,
            metrics: reduce_micro_batch_metrics(&metrics),
        })
    }
}

impl<B: Backend> RankExchange for DataParallel<B> {
    fn rank(&self) -> usize {
        self.collective.rank()
    }

    fn world_size(&self) -> usize {
        self.collective.world_size()
    }

    /// Bytes travel as Index words (exact on every backend): the lengths first, since
    /// `all_gather` moves equal lengths, then every rank's bytes padded to the longest.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let words: Vec<u32> = bytes
            .chunks(4)
            .map(|chunk| {
                let mut word = [0u8; 4];
                word[..chunk.len()].copy_from_slice(chunk);
                u32::from_le_bytes(word)
            })
            .collect();
        let len = u32::try_from(bytes.len()).map_err(|_| {
            Error::InvalidRequest(format!(
                "data parallel: {} bytes are too many for one exchange (at most 4 GiB)",
                bytes.len()
            ))
        })?;
        let lengths = self.gather_words(&[len])?;
        let longest = lengths.iter().map(|&n| n as usize).max().unwrap_or(0);
        let mut padded = words;
        padded.resize(longest.div_ceil(4), 0);
        let all = self.gather_words(&padded)?;
        Ok((0..self.world_size())
            .map(|rank| {
                let block = &all[rank * padded.len()..(rank + 1) * padded.len()];
                let bytes: Vec<u8> = block.iter().flat_map(|w| w.to_le_bytes()).collect();
                bytes[..lengths[rank] as usize].to_vec()
            })
            .collect())
    }
}
