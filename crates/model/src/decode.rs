//! KV-cached forward for sampling: new tokens of many sequences in one call (prefill,
//! chunked prefill and decoding alike), keys and values kept in a paged cache whose
//! blocks sequences may share.
//!
//! The cache of each layer is `[num_blocks, block_size, kv_heads, head_dim]` for keys and
//! the same for values. Sequence `s` keeps its positions in the blocks listed in row `s`
//! of the block tables (see [`floe_backend::PagedLayout`]); the engine's block manager
//! decides which blocks a sequence owns and which it shares.

use floe_backend::{Backend, BufKind, Matmul, PagedLayout, QueryRun, SharedKeys};

use crate::transformer::{Attend, LayerActs, ModelError, Residual, Result, Transformer};

/// The paged KV cache of every layer.
pub struct KvCache<B: Backend> {
    /// Per layer: `(keys, values)`, each `[num_blocks, block_size, kv_heads, head_dim]`
    /// (Compute).
    layers: Vec<(B::Buf, B::Buf)>,
    /// Activations of the last call, reused while the number of new tokens stays the
    /// same (every decoding step of a steady batch).
    scratch: Option<DecodeScratch<B::Buf>>,
    /// Blocks in each layer's cache.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
}

/// Per-call buffers of [`Transformer::forward_cached`] for `T` new tokens.
struct DecodeScratch<Buf> {
    /// Rows these buffers hold.
    tokens: usize,
    /// `[T, hidden]` residual stream, updated in place by each layer.
    x: Buf,
    /// One layer's internals, reused by every layer.
    layer: LayerActs<Buf>,
}

/// The new tokens of one [`Transformer::forward_cached`] call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachedInput {
    /// `[T]` token ids to run.
    pub tokens: Vec<u32>,
    /// `[T]` sequence (row of `block_tables`) of each token.
    pub token_seq: Vec<u32>,
    /// `[T]` position of each token in its sequence; every earlier position of that
    /// sequence must be in the cache already or be among this call's tokens.
    pub token_pos: Vec<u32>,
    /// `[T]` cache slot of each token: `block_tables[seq][pos / block_size] · block_size +
    /// pos % block_size`.
    pub slots: Vec<u32>,
    /// `[n_seqs, max_blocks]` physical block ids of each sequence.
    pub block_tables: Vec<u32>,
    /// Columns of `block_tables`.
    pub max_blocks: usize,
    /// Rows (indices into `tokens`) whose logits to return, usually each sequence's last
    /// new token.
    pub logit_rows: Vec<u32>,
}

impl CachedInput {
    /// The runs of two or more tokens that continue one sequence position by position
    /// (prefill chunks), for [`PagedLayout::runs`].
    fn query_runs(&self) -> Vec<QueryRun> {
        let mut runs = Vec::new();
        let mut first = 0;
        for t in 1..=self.tokens.len() {
            let continues = t < self.tokens.len()
                && self.token_seq[t] == self.token_seq[t - 1]
                && self.token_pos[t] == self.token_pos[t - 1] + 1;
            if !continues {
                if t - first >= 2 {
                    runs.push(QueryRun {
                        first: first as u32,
                        len: (t - first) as u32,
                    });
                }
                first = t;
            }
        }
        runs
    }

    /// The groups of consecutive tokens outside `runs` (decodes) whose sequences hold the
    /// same physical blocks in their leading columns (the samples of one prompt), for
    /// [`PagedLayout::shared`]. The first two members fix the group's shared blocks; a
    /// later token joins while it shares at least those, so samples of another prompt
    /// that begin with the same system prompt start a group of their own. Only whole
    /// blocks before every member's position count: a token's own position is never
    /// shared.
    fn shared_keys(&self, runs: &[QueryRun], block_size: usize) -> Vec<SharedKeys> {
        let tokens = self.tokens.len();
        let mut in_run = vec![false; tokens];
        for run in runs {
            in_run[run.first as usize..(run.first + run.len) as usize].fill(true);
        }
        let mb = self.max_blocks;
        let table = |t: usize| {
            let s = self.token_seq[t] as usize;
            &self.block_tables[s * mb..(s + 1) * mb]
        };
        // Leading blocks tokens a and b share, whole blocks before both positions.
        let common = |a: usize, b: usize| {
            let whole = (self.token_pos[a].min(self.token_pos[b]) as usize / block_size).min(mb);
            table(a)[..whole]
                .iter()
                .zip(&table(b)[..whole])
                .take_while(|(x, y)| x == y)
                .count()
        };
        let mut groups = Vec::new();
        let mut first = 0;
        while first < tokens {
            if in_run[first] || first + 1 == tokens || in_run[first + 1] {
                first += 1;
                continue;
            }
            let blocks = common(first, first + 1);
            if blocks == 0 {
                first += 1;
                continue;
            }
            let mut end = first + 2;
            while end < tokens && !in_run[end] && common(first, end) >= blocks {
                end += 1;
            }
            groups.push(SharedKeys {
                first: first as u32,
                len: (end - first) as u32,
                keys: (blocks * block_size) as u32,
            });
            first = end;
        }
        groups
    }

    /// Checks lengths, ids and that every slot agrees with the block tables.
    fn validate(&self, vocab: usize, cache_blocks: usize, block_size: usize) -> Result<()> {
        let bad = |msg: String| Err(ModelError::Input(format!("cached input: {msg}")));
        let t = self.tokens.len();
        if t == 0 {
            return bad("no tokens".into());
        }
        for (what, len) in [
            ("token_seq", self.token_seq.len()),
            ("token_pos", self.token_pos.len()),
            ("slots", self.slots.len()),
        ] {
            if len != t {
                return bad(format!("{what} has {len} entries for {t} tokens"));
            }
        }
        if self.max_blocks == 0 || self.block_tables.len() % self.max_blocks != 0 {
            return bad(format!(
                "block_tables has {} entries, not whole rows of max_blocks {}",
                self.block_tables.len(),
                self.max_blocks
            ));
        }
        let n_seqs = self.block_tables.len() / self.max_blocks;
        if let Some(i) = self.tokens.iter().position(|&id| id as usize >= vocab) {
            return bad(format!(
                "tokens[{i}] = {} is not below vocab_size {vocab}",
                self.tokens[i]
            ));
        }
        if let Some(i) = self
            .block_tables
            .iter()
            .position(|&b| b as usize >= cache_blocks)
        {
            return bad(format!(
                "block_tables[{i}] = {} is not below the cache's {cache_blocks} blocks",
                self.block_tables[i]
            ));
        }
        if let Some(i) = self.logit_rows.iter().position(|&r| r as usize >= t) {
            return bad(format!(
                "logit_rows[{i}] = {} is not below {t} tokens",
                self.logit_rows[i]
            ));
        }
        for i in 0..t {
            let (seq, pos) = (self.token_seq[i] as usize, self.token_pos[i] as usize);
            if seq >= n_seqs {
                return bad(format!(
                    "token_seq[{i}] = {seq} has no row among {n_seqs} block tables"
                ));
            }
            let col = pos / block_size;
            if col >= self.max_blocks {
                return bad(format!(
                    "token_pos[{i}] = {pos} needs block column {col}, max_blocks is {}",
                    self.max_blocks
                ));
            }
            let want = self.block_tables[seq * self.max_blocks + col] as usize * block_size
                + pos % block_size;
            if self.slots[i] as usize != want {
                return bad(format!(
                    "slots[{i}] = {} but sequence {seq} position {pos} lives in slot {want}",
                    self.slots[i]
                ));
            }
        }
        Ok(())
    }
}

impl<B: Backend> Transformer<B> {
    /// A zeroed cache of `num_blocks` blocks of `block_size` tokens for every layer.
    pub fn new_kv_cache(&self, num_blocks: usize, block_size: usize) -> Result<KvCache<B>> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::Input(format!(
                "kv cache: num_blocks ({num_blocks}) and block_size ({block_size}) must be positive"
            )));
        }
        let len = num_blocks * block_size * self.config.kv_dim();
        let layers = (0..self.config.num_hidden_layers)
            .map(|_| {
                Ok((
                    self.backend.zeros(len, BufKind::Compute)?,
                    self.backend.zeros(len, BufKind::Compute)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            scratch: None,
            num_blocks,
            block_size,
        })
    }

    /// Device bytes one cache block of `block_size` tokens takes over all layers (keys and
    /// values), for memory budgeting.
    pub fn kv_cache_bytes_per_block(&self, block_size: usize) -> usize {
        2 * self.config.num_hidden_layers
            * block_size
            * self.config.kv_dim()
            * self.backend.element_bytes(BufKind::Compute)
    }

    /// Runs `input`'s new tokens through the model: writes their keys and values into the
    /// cache at `slots`, attends over each sequence's cached positions `0..=pos`, and
    /// returns the Compute logits `[logit_rows.len(), vocab]` of the requested rows
    /// (unscaled: temperature is the sampler's business).
    pub fn forward_cached(&self, cache: &mut KvCache<B>, input: &CachedInput) -> Result<B::Buf> {
        let c = &self.config;
        input.validate(c.vocab_size, cache.num_blocks, cache.block_size)?;
        let b = &*self.backend;
        let (t, h, vocab) = (input.tokens.len(), c.hidden_size, c.vocab_size);
        let w = self.weights();

        let ids = b.upload_index(&input.tokens)?;
        let token_seq = b.upload_index(&input.token_seq)?;
        let token_pos = b.upload_index(&input.token_pos)?;
        let slots = b.upload_index(&input.slots)?;
        let block_tables = b.upload_index(&input.block_tables)?;
        let max_context = input.token_pos.iter().max().map_or(0, |&p| p as usize + 1);
        let runs = input.query_runs();
        let shared = input.shared_keys(&runs, cache.block_size);

        let mut scratch = match cache.scratch.take() {
            Some(s) if s.tokens == t => s,
            _ => DecodeScratch {
                tokens: t,
                x: b.zeros(t * h, BufKind::Compute)?,
                layer: LayerActs::new(&mut crate::transformer::zeros_on(b), c, t)?,
            },
        };
        let DecodeScratch { x, layer: acts, .. } = &mut scratch;
        b.embedding_forward(x, &w.embed, &ids, h)?;
        for (l, (wl, (k_cache, v_cache))) in
            w.layers.iter().zip(cache.layers.iter_mut()).enumerate()
        {
            let attend = Attend::Paged {
                slots: &slots,
                layout: PagedLayout {
                    block_tables: &block_tables,
                    max_blocks: input.max_blocks,
                    block_size: cache.block_size,
                    token_seq: &token_seq,
                    token_pos: &token_pos,
                    max_context,
                    runs: &runs,
                    shared: &shared,
                },
                k_cache,
                v_cache,
            };
            self.layer_forward(l, wl, Residual::InPlace(x), acts, &token_pos, attend)?;
        }

        // Only the requested rows go through the final norm and the lm-head.
        let r = input.logit_rows.len();
        let rows = b.upload_index(&input.logit_rows)?;
        let mut last = b.zeros(r * h, BufKind::Compute)?;
        b.gather_rows(&mut last, x, &rows, h)?;
        cache.scratch = Some(scratch);
        let mut normed = b.zeros(r * h, BufKind::Compute)?;
        let mut rstd = b.zeros(r, BufKind::Full)?;
        b.rmsnorm_forward(
            &mut normed,
            &mut rstd,
            &last,
            &w.final_norm,
            r,
            h,
            c.rms_norm_eps,
        )?;
        let mut logits = b.zeros(r * vocab, BufKind::Compute)?;
        let dims = Matmul {
            m: r,
            n: vocab,
            k: h,
            trans_a: false,
            trans_b: true,
        };
        b.matmul(&mut logits, &normed, w.lm_head(), dims, false)?;
        self.adapt_logits(&mut logits, &normed, r)?;
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_runs_are_the_chunks_that_continue_one_sequence() {
        // Two decodes, a 3-token chunk of sequence 2 from position 5, a decode of
        // sequence 2 far ahead (not a continuation), then a 2-token chunk of sequence 0.
        let input = CachedInput {
            tokens: vec![1; 8],
            token_seq: vec![0, 1, 2, 2, 2, 2, 0, 0],
            token_pos: vec![9, 4, 5, 6, 7, 20, 0, 1],
            ..CachedInput::default()
        };
        assert_eq!(
            input.query_runs(),
            vec![QueryRun { first: 2, len: 3 }, QueryRun { first: 6, len: 2 }]
        );
    }

    #[test]
    fn shared_keys_are_decodes_of_sequences_with_the_same_leading_blocks() {
        // Blocks of 4, tables of 4 columns. Sequences 0-2: one prompt's samples sharing
        // blocks 7, 8 (then their own); 3: another prompt that starts with block 7 (a
        // common system prompt); 4: shares both blocks but decodes at position 6, so only
        // block 7 lies wholly before it; 5: shares nothing.
        let block_tables = vec![
            7, 8, 1, 0, //
            7, 8, 2, 0, //
            7, 8, 3, 0, //
            7, 9, 4, 0, //
            7, 8, 5, 0, //
            6, 8, 10, 0,
        ];
        let input = CachedInput {
            tokens: vec![1; 9],
            token_seq: vec![0, 1, 2, 3, 4, 4, 4, 5, 3],
            token_pos: vec![9, 9, 10, 9, 6, 7, 8, 9, 10],
            block_tables,
            max_blocks: 4,
            ..CachedInput::default()
        };
        let runs = input.query_runs();
        // Sequence 4's chunk 6..9 is a run; 0-2 share 8 keys; 3 and the last token (its
        // own sequence again, at 10) share block 7 with nothing before the run.
        assert_eq!(runs, vec![QueryRun { first: 4, len: 3 }]);
        let group = |first, len, keys| SharedKeys { first, len, keys };
        assert_eq!(input.shared_keys(&runs, 4), vec![group(0, 3, 8)]);
        // Without the run, the 3-4 pair shares block 7 (position 6: one whole block).
        let decodes = CachedInput {
            token_pos: vec![9, 9, 10, 9, 6, 17, 18, 9, 10],
            ..input.clone()
        };
        let runs = decodes.query_runs();
        assert_eq!(runs, vec![QueryRun { first: 5, len: 2 }]);
        assert_eq!(
            decodes.shared_keys(&runs, 4),
            vec![group(0, 3, 8), group(3, 2, 4)]
        );
    }
}
