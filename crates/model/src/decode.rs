//! KV-cached forward for sampling: new tokens of many sequences in one call (prefill,
//! chunked prefill and decoding alike), keys and values kept in a paged cache whose
//! blocks sequences may share.
//!
//! The cache of each layer is `[num_blocks, block_size, kv_heads, head_dim]` for keys and
//! the same for values. Sequence `s` keeps its positions in the blocks listed in row `s`
//! of the block tables (see [`floe_backend::PagedLayout`]); the engine's block manager
//! decides which blocks a sequence owns and which it shares.

use std::borrow::Cow;

use floe_backend::{Backend, BufKind, Matmul, PagedLayout, QueryRun, SharedKeys};

use crate::transformer::{Attend, LayerActs, ModelError, Residual, Result, Transformer};

/// The paged KV cache of every layer.
pub struct KvCache<B: Backend> {
    /// Per layer: `(keys, values)`, each `[num_blocks + 1, block_size, kv_heads,
    /// head_dim]` (Compute): block `num_blocks` takes the padding tokens of graphed
    /// steps (see [`Transformer::forward_cached`]).
    layers: Vec<(B::Buf, B::Buf)>,
    /// Activations of the last call, reused while the number of new tokens stays the
    /// same (every decoding step of a steady batch).
    scratch: Option<DecodeScratch<B::Buf>>,
    /// Blocks in each layer's cache.
    pub num_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
}

/// Per-call buffers of [`Transformer::forward_cached`] for `T` new tokens. They keep
/// their addresses from step to step, as a graphed step needs.
struct DecodeScratch<Buf> {
    /// Rows these buffers hold.
    tokens: usize,
    /// `[T, hidden]` residual stream, updated in place by each layer.
    x: Buf,
    /// One layer's internals, reused by every layer.
    layer: LayerActs<Buf>,
    /// `[T]` token ids, sequences (rows of `block_tables`), positions and cache slots.
    ids: Buf,
    token_seq: Buf,
    token_pos: Buf,
    slots: Buf,
    /// `[rows, max_blocks]` block tables, reallocated when their size changes.
    block_tables: Buf,
}

/// Most tokens of a step that runs as a graph: beyond this, a step's kernels are long
/// enough that launching them costs little.
const GRAPH_MAX_TOKENS: usize = 512;

/// The token count a graphed step of `t` tokens is padded to: few distinct counts, so
/// that a batch that shrinks as its samples finish reuses a handful of graphs.
fn graph_tokens(t: usize) -> usize {
    if t <= 16 {
        t.next_power_of_two()
    } else {
        t.next_multiple_of(16)
    }
}

/// Block-table columns of a graphed step: a multiple of 32, so that the tables keep
/// their shape (and the step its graph) while sequences grow by a block.
const GRAPH_BLOCK_COLUMNS: usize = 32;

/// The model input of one step as the device buffers hold it: `input`, padded for a
/// graph to `tokens` tokens and a multiple of [`GRAPH_BLOCK_COLUMNS`] table columns.
/// Padding tokens (id 0 at position 0) each get a table row of their own that lists
/// only `pad_block`, whose first slot they write; no real token reads that block.
struct StepInput<'a> {
    tokens: Cow<'a, [u32]>,
    token_seq: Cow<'a, [u32]>,
    token_pos: Cow<'a, [u32]>,
    slots: Cow<'a, [u32]>,
    block_tables: Cow<'a, [u32]>,
    max_blocks: usize,
}

impl<'a> StepInput<'a> {
    /// `input` as it is (eager), or padded to `graphed` tokens.
    fn new(
        input: &'a CachedInput,
        graphed: Option<usize>,
        pad_block: u32,
        block_size: usize,
    ) -> Self {
        let Some(tokens) = graphed else {
            return Self {
                tokens: Cow::Borrowed(&input.tokens),
                token_seq: Cow::Borrowed(&input.token_seq),
                token_pos: Cow::Borrowed(&input.token_pos),
                slots: Cow::Borrowed(&input.slots),
                block_tables: Cow::Borrowed(&input.block_tables),
                max_blocks: input.max_blocks,
            };
        };
        let pad = tokens - input.tokens.len();
        let n_seqs = input.block_tables.len() / input.max_blocks;
        let max_blocks = input.max_blocks.next_multiple_of(GRAPH_BLOCK_COLUMNS);
        let mut block_tables = vec![pad_block; (n_seqs + pad) * max_blocks];
        for (row, table) in input.block_tables.chunks(input.max_blocks).enumerate() {
            block_tables[row * max_blocks..][..input.max_blocks].copy_from_slice(table);
        }
        // `real` followed by `pad` values, the `j`-th padding token's being `value(j)`.
        let padded = |real: &[u32], value: &dyn Fn(u32) -> u32| -> Cow<'a, [u32]> {
            Cow::Owned(
                real.iter()
                    .copied()
                    .chain((0..pad as u32).map(value))
                    .collect(),
            )
        };
        Self {
            tokens: padded(&input.tokens, &|_| 0),
            token_seq: padded(&input.token_seq, &|j| n_seqs as u32 + j),
            token_pos: padded(&input.token_pos, &|_| 0),
            slots: padded(&input.slots, &|_| pad_block * block_size as u32),
            block_tables: Cow::Owned(block_tables),
            max_blocks,
        }
    }
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
        // One block more than asked for: the padding tokens' (see `StepInput`).
        let len = (num_blocks + 1) * block_size * self.config.kv_dim();
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
    ///
    /// A step of decodes alone (no run of two or more tokens of one sequence) repeats
    /// from step to step with new data: on a backend that captures graphs, its layers run
    /// as one ([`Backend::graphed`]), padded to a few token counts so that a batch whose
    /// samples finish one by one reuses the same graphs.
    pub fn forward_cached(&self, cache: &mut KvCache<B>, input: &CachedInput) -> Result<B::Buf> {
        let graphs = self.backend.captures_graphs();
        self.forward_step(cache, input, graphs)
    }

    /// [`Self::forward_cached`], with decode steps graphed (and padded) when `graphs`.
    fn forward_step(
        &self,
        cache: &mut KvCache<B>,
        input: &CachedInput,
        graphs: bool,
    ) -> Result<B::Buf> {
        let c = &self.config;
        input.validate(c.vocab_size, cache.num_blocks, cache.block_size)?;
        let b = &*self.backend;
        let (t, h, vocab) = (input.tokens.len(), c.hidden_size, c.vocab_size);
        let w = self.weights();

        // A bound on every token's context, rounded as the graphed tables' columns are: the
        // attention's split plan (and with it a graph's launch arguments) then changes
        // every 32 blocks of context instead of every 64 keys, and eager and graphed steps
        // plan alike.
        let max_context = input
            .token_pos
            .iter()
            .max()
            .map_or(0, |&p| p as usize + 1)
            .next_multiple_of(GRAPH_BLOCK_COLUMNS * cache.block_size);
        let runs = input.query_runs();
        let shared = input.shared_keys(&runs, cache.block_size);
        // A tensor-parallel step's collectives are not graph launches: it runs eagerly.
        let graphed =
            graphs && runs.is_empty() && t <= GRAPH_MAX_TOKENS && self.tensor_parallel.is_none();
        let padded = if graphed { graph_tokens(t) } else { t };
        let step = StepInput::new(
            input,
            graphed.then_some(padded),
            cache.num_blocks as u32,
            cache.block_size,
        );

        let mut scratch = match cache.scratch.take() {
            Some(s) if s.tokens == padded => s,
            _ => DecodeScratch {
                tokens: padded,
                x: b.zeros(padded * h, BufKind::Compute)?,
                layer: LayerActs {
                    // A graph cannot allocate LoRA's low-rank product each call.
                    low_rank: self
                        .lora_config()
                        .map(|lora| b.zeros(padded * lora.rank, BufKind::Compute))
                        .transpose()?,
                    ..LayerActs::new(&mut crate::transformer::zeros_on(b), c, padded)?
                },
                ids: b.zeros(padded, BufKind::Index)?,
                token_seq: b.zeros(padded, BufKind::Index)?,
                token_pos: b.zeros(padded, BufKind::Index)?,
                slots: b.zeros(padded, BufKind::Index)?,
                block_tables: b.zeros(step.block_tables.len(), BufKind::Index)?,
            },
        };
        if b.len(&scratch.block_tables) != step.block_tables.len() {
            scratch.block_tables = b.zeros(step.block_tables.len(), BufKind::Index)?;
        }
        b.write_index(&mut scratch.ids, &step.tokens)?;
        b.write_index(&mut scratch.token_seq, &step.token_seq)?;
        b.write_index(&mut scratch.token_pos, &step.token_pos)?;
        b.write_index(&mut scratch.slots, &step.slots)?;
        b.write_index(&mut scratch.block_tables, &step.block_tables)?;

        let block_size = cache.block_size;
        let layers = &mut cache.layers;
        let DecodeScratch {
            x,
            layer: acts,
            ids,
            token_seq,
            token_pos,
            slots,
            block_tables,
            ..
        } = &mut scratch;
        let mut run_layers = || -> Result<()> {
            b.embedding_forward(x, &w.embed, ids, h)?;
            for (l, (wl, (k_cache, v_cache))) in w.layers.iter().zip(layers.iter_mut()).enumerate()
            {
                let attend = Attend::Paged {
                    slots,
                    layout: PagedLayout {
                        block_tables,
                        max_blocks: step.max_blocks,
                        block_size,
                        token_seq,
                        token_pos,
                        max_context,
                        runs: &runs,
                        shared: &shared,
                    },
                    k_cache,
                    v_cache,
                };
                self.layer_forward(l, wl, Residual::InPlace(&mut *x), acts, token_pos, attend)?;
            }
            Ok(())
        };
        if graphed {
            b.graphed(&mut run_layers)?;
        } else {
            run_layers()?;
        }
        let x = &scratch.x;

        // Only the requested rows go through the final norm and the lm-head.
        let r = input.logit_rows.len();
        let rows = b.upload_index(&input.logit_rows)?;
        let mut last = b.zeros(r * h, BufKind::Compute)?;
        b.gather_rows(&mut last, x, &rows, h)?;
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
        cache.scratch = Some(scratch);
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Graphed decode steps are padded to a few token counts and table widths; the real
    /// tokens' logits must not change, step after step (the padding tokens write only
    /// their own block).
    #[test]
    fn padded_decode_steps_give_the_unpadded_logits() {
        use crate::config::{Architecture, ModelConfig};
        use crate::weights::{tensor_specs, HostTensor};
        use floe_backend::cpu::CpuBackend;

        let config = ModelConfig::test_shape(Architecture::Qwen3);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        let weights: std::collections::BTreeMap<String, HostTensor> = tensor_specs(&config)
            .into_iter()
            .map(|(name, shape)| {
                let n = shape.iter().product();
                let norm = name.ends_with("norm.weight");
                let data = (0..n)
                    .map(|_| {
                        (if norm {
                            1.0 + 0.3 * uniform()
                        } else {
                            0.4 * uniform()
                        }) as f32
                    })
                    .collect();
                (name, HostTensor { shape, data })
            })
            .collect();
        let backend = std::sync::Arc::new(CpuBackend::<f64>::new());
        let m = Transformer::from_host_weights(backend.clone(), config.clone(), &weights).unwrap();
        let vocab = config.vocab_size as u32;
        const BLOCK: usize = 4;
        // Three sequences of different lengths; the first two share their first block.
        let tables: Vec<Vec<u32>> = vec![vec![0, 1, 2, 3], vec![0, 4, 5, 6], vec![7, 8, 9, 10]];
        let mut caches = [
            m.new_kv_cache(12, BLOCK).unwrap(),
            m.new_kv_cache(12, BLOCK).unwrap(),
        ];
        let input_for = |seqs: &[(usize, usize)], token: u32| {
            let mut input = CachedInput {
                max_blocks: 4,
                ..CachedInput::default()
            };
            for (row, &(s, pos)) in seqs.iter().enumerate() {
                input.block_tables.extend(&tables[s]);
                input
                    .tokens
                    .push((token + pos as u32 * 7 + s as u32) % vocab);
                input.token_seq.push(row as u32);
                input.token_pos.push(pos as u32);
                input
                    .slots
                    .push(tables[s][pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32);
                input.logit_rows.push(row as u32);
            }
            input
        };
        // One token per sequence per step; sequence 2 finishes early, so the batch of
        // three (padded to four) shrinks to two.
        for step in 0..9usize {
            let seqs: Vec<(usize, usize)> = (0..3)
                .filter(|&s| s != 2 || step < 6)
                .map(|s| (s, step))
                .collect();
            let input = input_for(&seqs, 3);
            let plain = m.forward_step(&mut caches[0], &input, false).unwrap();
            let padded = m.forward_step(&mut caches[1], &input, true).unwrap();
            let rows = caches[1].scratch.as_ref().unwrap().tokens;
            assert_eq!(rows, seqs.len().next_power_of_two());
            let (plain, padded) = (
                backend.download_f64(&plain).unwrap(),
                backend.download_f64(&padded).unwrap(),
            );
            assert_eq!(plain.len(), seqs.len() * config.vocab_size);
            assert_eq!(plain.len(), padded.len());
            for (i, (a, b)) in plain.iter().zip(&padded).enumerate() {
                assert!((a - b).abs() < 1e-12, "step {step} logit {i}: {a} vs {b}");
            }
        }
    }

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
