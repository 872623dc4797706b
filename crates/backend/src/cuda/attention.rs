//! Host-side work lists of the packed-segment attention kernels (see
//! `kernels/attention.cu` for how each list is read).

use crate::{QueryRun, Segment, SharedKeys};

/// Query rows per forward / dQ block (`Q_TILE` in `attention.cu`).
pub(crate) const QUERY_TILE: u32 = 64;
/// Key rows per dK/dV block (`K_TILE` in `attention.cu`).
pub(crate) const KEY_TILE: u32 = 64;
/// Query rows per shared-memory tile of the dK/dV kernel (`QB_TILE`).
pub(crate) const DKDV_QUERY_TILE: u32 = 32;
/// Threads of every attention block (4 warps).
pub(crate) const THREADS: u32 = 128;

/// Bytes of one padded shared-memory row (`D + 8` bf16).
fn row_bytes(head_dim: usize) -> u32 {
    (head_dim as u32 + 8) * 2
}

/// Dynamic shared memory of the forward and dQ kernels: two stages of K and V tiles.
pub(crate) fn forward_shared_bytes(head_dim: usize) -> u32 {
    4 * KEY_TILE * row_bytes(head_dim)
}

/// Dynamic shared memory of the dK/dV kernel: the K and V tiles, two stages of Q and dO
/// tiles, then two stages of the query tile's log-sum-exps and deltas.
pub(crate) fn dkdv_shared_bytes(head_dim: usize) -> u32 {
    (2 * KEY_TILE + 4 * DKDV_QUERY_TILE) * row_bytes(head_dim) + 4 * DKDV_QUERY_TILE * 4
}

/// The work lists of one attention call, flattened to `u32` for upload.
pub(crate) struct WorkLists {
    /// `[n_seg * 4]`: start, len, prefix_start, prefix_len.
    pub segs: Vec<u32>,
    /// `[n_item * 3]`: segment, first query, end query (at most [`QUERY_TILE`] queries).
    pub query_tiles: Vec<u32>,
    /// `[n_tile * 2]`: first key, end key (at most [`KEY_TILE`] keys).
    pub key_tiles: Vec<u32>,
    /// `[n_tile + 1]`: offsets of each key tile's query ranges in `ranges`.
    pub tile_ranges: Vec<u32>,
    /// `[n_range * 3]`: segment, first query, end query: the queries that read a key tile.
    pub ranges: Vec<u32>,
}

impl WorkLists {
    /// Number of query tiles.
    pub fn n_query_tiles(&self) -> usize {
        self.query_tiles.len() / 3
    }

    /// Number of key tiles.
    pub fn n_key_tiles(&self) -> usize {
        self.key_tiles.len() / 2
    }
}

/// The work lists of `segments` (checked against the op's contract by the caller);
/// `with_keys` adds the key-tile lists the backward's dK/dV kernel needs.
pub(crate) fn work_lists(segments: &[Segment], with_keys: bool) -> WorkLists {
    let mut segs = Vec::with_capacity(segments.len() * 4);
    // (keys read, [segment, lo, hi]) per query tile.
    let mut q_work: Vec<(u32, [u32; 3])> = Vec::new();
    for (i, s) in segments.iter().enumerate() {
        let prefix_start = if s.prefix_len > 0 { s.prefix_start } else { 0 };
        segs.extend([s.start, s.len, prefix_start, s.prefix_len]);
        let mut lo = s.start;
        while lo < s.start + s.len {
            let hi = (lo + QUERY_TILE).min(s.start + s.len);
            q_work.push((s.prefix_len + (hi - s.start), [i as u32, lo, hi]));
            lo = hi;
        }
    }
    // Heaviest tiles first, so the causal tail (the long tiles at the ends of segments) does
    // not run alone at the end of the grid.
    q_work.sort_by_key(|&(cost, _)| std::cmp::Reverse(cost));
    let query_tiles = q_work.iter().flat_map(|(_, t)| *t).collect();
    let (mut key_tiles, mut tile_ranges, mut ranges) = (Vec::new(), vec![0u32], Vec::new());
    // (queries that read it, [lo, hi], its query ranges) per key tile.
    let mut k_work: Vec<(u32, [u32; 2], Vec<[u32; 3]>)> = Vec::new();
    if with_keys {
        // Keys that anything reads: the segments and their prefixes, merged.
        let mut spans: Vec<(u32, u32)> = Vec::new();
        for s in segments {
            spans.push((s.start, s.start + s.len));
            if s.prefix_len > 0 {
                spans.push((s.prefix_start, s.prefix_start + s.prefix_len));
            }
        }
        spans.retain(|&(a, b)| b > a);
        spans.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::new();
        for (a, b) in spans {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (a, b) in merged {
            let mut lo = a;
            while lo < b {
                let hi = (lo + KEY_TILE).min(b);
                let mut readers = Vec::new();
                for (i, s) in segments.iter().enumerate() {
                    let s_end = s.start + s.len;
                    let in_prefix = s.prefix_len > 0
                        && s.prefix_start < hi
                        && lo < s.prefix_start + s.prefix_len;
                    if in_prefix {
                        // A prefix is read by every query of the segment.
                        readers.push([i as u32, s.start, s_end]);
                    } else if s.start < hi && lo < s_end {
                        // Own keys are read causally: queries at or after the tile's first key.
                        readers.push([i as u32, lo.max(s.start), s_end]);
                    }
                }
                let cost = readers.iter().map(|r| r[2] - r[1]).sum();
                k_work.push((cost, [lo, hi], readers));
                lo = hi;
            }
        }
    }
    k_work.sort_by_key(|(cost, _, _)| std::cmp::Reverse(*cost));
    for (_, tile, readers) in k_work {
        key_tiles.extend(tile);
        ranges.extend(readers.into_iter().flatten());
        tile_ranges.push((ranges.len() / 3) as u32);
    }
    WorkLists {
        segs,
        query_tiles,
        key_tiles,
        tile_ranges,
        ranges,
    }
}

/// Warps of a paged-attention block (`PAGED_WARPS` in `attention.cu`), which all work on
/// one (token, kv head, context split).
pub(crate) const PAGED_WARPS: usize = 4;
/// Most query heads one paged-attention block takes (`PAGED_GMAX`); larger groups are
/// split over several blocks.
pub(crate) const PAGED_MAX_GROUP: usize = 8;
/// Shortest context split of paged attention, in keys (64 for each of the block's warps):
/// shorter splits would spend more on the combine pass than they gain in parallel blocks.
const PAGED_MIN_SPLIT: usize = 256;
/// Paged-attention blocks an SM holds at once, about (the kernels keep 2 to 4 by their
/// register bounds); the splits aim at two such waves.
const PAGED_BLOCKS_PER_SM: usize = 4;

/// The decode kernel for `head_dim` and a kv head's `group` of query heads: the group is
/// held in registers of 2, 4 or 8 heads (`PAGED_DECODE_INSTANCES` in `attention.cu`).
pub(crate) fn paged_decode_kernel(head_dim: usize, group: usize) -> &'static str {
    match (head_dim, group.min(PAGED_MAX_GROUP)) {
        (32, 0..=2) => "paged_attention_d32_g2",
        (32, 3..=4) => "paged_attention_d32_g4",
        (32, _) => "paged_attention_d32_g8",
        (64, 0..=2) => "paged_attention_d64_g2",
        (64, 3..=4) => "paged_attention_d64_g4",
        (64, _) => "paged_attention_d64_g8",
        (_, 0..=2) => "paged_attention_d128_g2",
        (_, 3..=4) => "paged_attention_d128_g4",
        _ => "paged_attention_d128_g8",
    }
}

/// How paged attention splits each token's context: `(splits, split_len)`, where split
/// `s` covers keys `[s * split_len, (s + 1) * split_len)`. Enough splits to give the
/// device about two waves of blocks (decode of a small batch is otherwise a few long
/// walks on a few SMs), none shorter than [`PAGED_MIN_SPLIT`], one when the tokens alone
/// fill the device. `split_len` is a multiple of 64 keys.
pub(crate) fn paged_splits(
    tokens: usize,
    blocks_per_token: usize,
    max_context: usize,
    sm_count: usize,
) -> (usize, usize) {
    let target_blocks = sm_count * PAGED_BLOCKS_PER_SM * 2;
    let blocks = (tokens * blocks_per_token).max(1);
    let splits = target_blocks
        .div_ceil(blocks)
        .clamp(1, max_context.div_ceil(PAGED_MIN_SPLIT).max(1));
    let split_len = max_context.div_ceil(splits).max(1).next_multiple_of(64);
    (max_context.div_ceil(split_len).max(1), split_len)
}

/// Fewest shared keys a group needs for cascade attention: below one shortest split, the
/// extra launch costs more than reading the keys once per token.
const CASCADE_MIN_KEYS: u32 = PAGED_MIN_SPLIT as u32;

/// Cascade attention of a paged-attention call: its groups' shared keys read once per
/// group on the tensor cores (`paged_cascade_attention`), each token's own keys by the
/// decode kernel.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Cascade {
    /// `[n_item * 4]`: first listed token, first and end flat row (tokens x the query
    /// heads of a kv head, at most [`QUERY_TILE`]), shared keys.
    pub items: Vec<u32>,
    /// Per token of the decode kernel's list: the first key it reads itself (0 outside
    /// the groups).
    pub key_start: Vec<u32>,
    /// Most shared keys of a group.
    pub max_keys: usize,
    /// Fewest shared keys of a token of the list (0 when one is in no group).
    pub min_keys: usize,
}

/// Blocks of the cascade kernel an SM holds: its two stages of K and V tiles take 70 KB of
/// shared memory at D = 128.
const CASCADE_BLOCKS_PER_SM: usize = 3;
/// Shortest split of the cascade's shared keys: eight key tiles, so the pipeline's first
/// load is a small part of a block's time.
const CASCADE_MIN_SPLIT: usize = 512;

/// The split length of a cascade whose splits each take `blocks_per_split` blocks (items ×
/// kv heads), over at most `max_keys` shared keys: as many splits as one wave of the
/// device holds (the decode kernel's own-key blocks follow as a second launch), none
/// shorter than [`CASCADE_MIN_SPLIT`]; a multiple of 64 keys. The decode kernel's own keys
/// split by the same length, so a token's own keys rarely split at all.
pub(crate) fn cascade_split_len(
    blocks_per_split: usize,
    max_keys: usize,
    sm_count: usize,
) -> usize {
    let splits = (sm_count * CASCADE_BLOCKS_PER_SM / blocks_per_split.max(1))
        .clamp(1, max_keys.div_ceil(CASCADE_MIN_SPLIT).max(1));
    max_keys.div_ceil(splits).max(1).next_multiple_of(64)
}

impl Cascade {
    /// How the call's keys split: `(splits, split_len, slots)`. One `split_len`
    /// ([`cascade_split_len`]) for the shared keys and the decode kernel's own; the decode
    /// kernel takes `splits` splits of the longest own context (`max_context` less the
    /// fewest shared keys), and a token's partials need `slots`: its group's shared splits,
    /// then its own (`paged_attention_combine` counts them the same way).
    pub fn splits(
        &self,
        kv_heads: usize,
        max_context: usize,
        sm_count: usize,
    ) -> (usize, usize, usize) {
        let split_len = cascade_split_len(self.items.len() / 4 * kv_heads, self.max_keys, sm_count);
        let splits = (max_context - self.min_keys).div_ceil(split_len);
        (
            splits,
            split_len,
            self.max_keys.div_ceil(split_len) + splits,
        )
    }
}

/// The cascade of the `shared` groups (checked by the contract) with at least
/// [`CASCADE_MIN_KEYS`] keys, over the decode kernel's tokens (`listed`, or all `tokens`
/// without a list), `group` query heads per kv head. `None` when no group qualifies.
pub(crate) fn cascade(
    shared: &[SharedKeys],
    listed: Option<&[u32]>,
    tokens: usize,
    group: usize,
) -> Option<Cascade> {
    let n = listed.map_or(tokens, <[u32]>::len);
    let mut key_start = vec![0u32; n];
    let mut items = Vec::new();
    for g in shared
        .iter()
        .filter(|g| g.len >= 2 && g.keys >= CASCADE_MIN_KEYS)
    {
        // Group members are consecutive tokens outside every run, so consecutive in the
        // list too.
        let first = match listed {
            None => g.first as usize,
            Some(list) => list
                .binary_search(&g.first)
                .expect("shared tokens lie outside every run"),
        };
        key_start[first..first + g.len as usize].fill(g.keys);
        let rows = g.len * group as u32;
        let mut lo = 0;
        while lo < rows {
            let hi = (lo + QUERY_TILE).min(rows);
            items.extend([first as u32, lo, hi, g.keys]);
            lo = hi;
        }
    }
    if items.is_empty() {
        return None;
    }
    let max_keys = items.chunks(4).map(|i| i[3]).max().unwrap_or(0) as usize;
    let min_keys = key_start.iter().copied().min().unwrap_or(0) as usize;
    Some(Cascade {
        items,
        key_start,
        max_keys,
        min_keys,
    })
}

/// Shortest run of query tokens paged attention takes on the tensor cores: shorter runs
/// would leave most of a 64-row tile's rows empty.
const PREFILL_MIN_RUN: u32 = 16;

/// How a paged-attention call divides its tokens between the two kernels.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PagedWork {
    /// `[n_tile * 2]`: first and end token of each tile (at most [`QUERY_TILE`] tokens)
    /// of the runs of at least [`PREFILL_MIN_RUN`] tokens, for `paged_prefill_attention`.
    pub prefill_tiles: Vec<u32>,
    /// The other tokens, for `paged_attention`; `None` when that is every token.
    pub decode_tokens: Option<Vec<u32>>,
}

/// The division of a call's `tokens` given its `runs` (checked by the contract).
pub(crate) fn paged_work(runs: &[QueryRun], tokens: usize) -> PagedWork {
    let mut prefill_tiles = Vec::new();
    let mut decode_tokens = Vec::new();
    let mut next = 0u32;
    for run in runs.iter().filter(|r| r.len >= PREFILL_MIN_RUN) {
        decode_tokens.extend(next..run.first);
        let end = run.first + run.len;
        let mut lo = run.first;
        while lo < end {
            let hi = (lo + QUERY_TILE).min(end);
            prefill_tiles.extend([lo, hi]);
            lo = hi;
        }
        next = end;
    }
    if prefill_tiles.is_empty() {
        return PagedWork {
            prefill_tiles,
            decode_tokens: None,
        };
    }
    decode_tokens.extend(next..tokens as u32);
    PagedWork {
        prefill_tiles,
        decode_tokens: Some(decode_tokens),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paged_splits_fill_the_device_and_cover_the_context() {
        // H100: 132 SMs, 1,056 blocks in two waves. Decode of 256 sequences at 512 keys, 8
        // kv heads: 2,048 blocks, no split.
        assert_eq!(paged_splits(256, 8, 512, 132), (1, 512));
        // 64 sequences at 2048: three splits.
        assert_eq!(paged_splits(64, 8, 2048, 132), (3, 704));
        // One sequence at 32K: 128 splits of 256.
        assert_eq!(paged_splits(1, 8, 32768, 132), (128, 256));
        // Prefill of 4096 tokens: the tokens fill the device; one split.
        assert_eq!(paged_splits(4096, 8, 4096, 132), (1, 4096));
        // A context shorter than a chunk.
        assert_eq!(paged_splits(1, 1, 5, 132), (1, 64));
        for (tokens, ctx) in [(3, 1000), (100, 777), (1, 1), (7, 300)] {
            let (splits, len) = paged_splits(tokens, 2, ctx, 132);
            assert_eq!(len % 64, 0);
            assert!(
                splits * len >= ctx && (splits - 1) * len < ctx,
                "{tokens} {ctx}"
            );
        }
    }

    #[test]
    fn cascade_tiles_each_groups_rows_and_lists_where_its_tokens_own_keys_start() {
        let group = |first, len, keys| SharedKeys { first, len, keys };
        // 40 samples of a 4096-key prompt, 2 query heads a kv head: 80 rows in two tiles;
        // a pair sharing too few keys stays with the decode kernel, as does token 0.
        let c = cascade(&[group(1, 40, 4096), group(41, 2, 64)], None, 43, 2).unwrap();
        assert_eq!(c.items, vec![1, 0, 64, 4096, 1, 64, 80, 4096]);
        assert_eq!(c.key_start[0], 0);
        assert!(c.key_start[1..41].iter().all(|&k| k == 4096));
        assert_eq!(&c.key_start[41..], &[0, 0]);
        assert_eq!((c.max_keys, c.min_keys), (4096, 0));
        // Token 0 decodes at up to 4200 keys, all its own: 9 splits of 512; a grouped
        // token needs 8 shared slots and at most 9 own ones.
        assert_eq!(c.splits(8, 4200, 132), (9, 512, 17));
        // With a list (a prefill run at tokens 0..20), groups are found by their place in
        // it; every listed token grouped.
        let listed: Vec<u32> = (20..30).collect();
        let c = cascade(
            &[group(20, 4, 512), group(24, 6, 256)],
            Some(&listed),
            30,
            8,
        )
        .unwrap();
        assert_eq!(c.items, vec![0, 0, 32, 512, 4, 0, 48, 256]);
        assert_eq!((c.max_keys, c.min_keys), (512, 256));
        assert_eq!(cascade(&[group(0, 1, 4096)], None, 3, 2), None);
    }

    #[test]
    fn cascade_splits_fill_one_wave_in_splits_of_at_least_512_keys() {
        // 8 prompts of 4080 shared keys, 8 kv heads on an H100: 396 blocks a wave, 64 a
        // split: 6 splits of 704 keys.
        assert_eq!(cascade_split_len(64, 4080, 132), 704);
        // One group, one kv head: as many splits as 512 keys allow.
        assert_eq!(cascade_split_len(1, 4096, 132), 512);
        // More blocks than a wave: one split.
        assert_eq!(cascade_split_len(1000, 300, 132), 320);
    }

    #[test]
    fn decode_kernels_hold_the_group_rounded_up() {
        assert_eq!(paged_decode_kernel(128, 1), "paged_attention_d128_g2");
        assert_eq!(paged_decode_kernel(128, 2), "paged_attention_d128_g2");
        assert_eq!(paged_decode_kernel(128, 3), "paged_attention_d128_g4");
        assert_eq!(paged_decode_kernel(64, 5), "paged_attention_d64_g8");
        // Groups above 8 take several blocks of 8.
        assert_eq!(paged_decode_kernel(32, 16), "paged_attention_d32_g8");
    }

    #[test]
    fn long_runs_go_to_the_prefill_kernel_in_tiles_the_rest_to_the_warp_kernel() {
        let run = |first, len| QueryRun { first, len };
        // No run long enough: every token with the warp kernel, no list.
        assert_eq!(
            paged_work(&[run(2, 5)], 10),
            PagedWork {
                prefill_tiles: vec![],
                decode_tokens: None
            }
        );
        // Decodes 0..3, a 100-token run (two tiles), a short run left to the warp kernel,
        // and a trailing decode.
        let work = paged_work(&[run(3, 100), run(103, 4)], 108);
        assert_eq!(work.prefill_tiles, vec![3, 67, 67, 103]);
        assert_eq!(
            work.decode_tokens,
            Some(vec![0, 1, 2, 103, 104, 105, 106, 107])
        );
        // All prefill: an empty list, so the warp kernel does not run.
        let work = paged_work(&[run(0, 16)], 16);
        assert_eq!(work.prefill_tiles, vec![0, 16]);
        assert_eq!(work.decode_tokens, Some(vec![]));
    }
}
