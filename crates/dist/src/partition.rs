//! ZeRO-3's split of a layer's tensors into one equal shard per rank, and how shards
//! saved at one world size become the shards of another.

use std::ops::Range;

/// A unit's tensors (e.g. one layer's) laid end to end in one flat buffer, padded with
/// zeros to a multiple of the world size; rank `r` owns elements
/// `[r·shard_len, (r+1)·shard_len)` of it. Masters, gradients and optimizer moments are
/// sharded alike; `all_gather` of the shards gives the flat buffer back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatPartition {
    world_size: usize,
    lens: Vec<usize>,
    offsets: Vec<usize>,
    len: usize,
    shard_len: usize,
}

/// The part of one tensor a rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPiece {
    /// Index of the tensor.
    pub tensor: usize,
    /// Elements of the tensor (flattened).
    pub in_tensor: Range<usize>,
    /// Where they sit in the rank's shard.
    pub in_shard: Range<usize>,
}

/// One copy that builds a new shard from a saved one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardCopy {
    /// The rank whose saved shard is read.
    pub from_rank: usize,
    /// Elements of that shard.
    pub from: Range<usize>,
    /// Where they go in the new shard.
    pub to: Range<usize>,
}

impl FlatPartition {
    /// The partition of tensors of `tensor_lens` elements over `world_size` ranks.
    pub fn new(tensor_lens: &[usize], world_size: usize) -> Self {
        assert!(world_size > 0, "FlatPartition: world size 0");
        let mut offsets = Vec::with_capacity(tensor_lens.len());
        let mut len = 0;
        for &n in tensor_lens {
            offsets.push(len);
            len += n;
        }
        Self {
            world_size,
            lens: tensor_lens.to_vec(),
            offsets,
            len,
            shard_len: len.div_ceil(world_size),
        }
    }

    /// The same tensors over another number of ranks.
    pub fn with_world_size(&self, world_size: usize) -> Self {
        Self::new(&self.lens, world_size)
    }

    /// Ranks the tensors are split over.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Elements of each tensor.
    pub fn tensor_lens(&self) -> &[usize] {
        &self.lens
    }

    /// Elements of the flat buffer before padding.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements of every rank's shard.
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Elements of the flat buffer with padding: `world_size · shard_len`.
    pub fn padded_len(&self) -> usize {
        self.world_size * self.shard_len
    }

    /// The elements of the flat buffer `rank` owns, padding included.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        assert!(
            rank < self.world_size,
            "rank {rank} of world size {}",
            self.world_size
        );
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The tensor slices `rank` owns, in flat order; the rest of its shard is padding.
    pub fn pieces(&self, rank: usize) -> Vec<TensorPiece> {
        let shard = self.shard_range(rank);
        (0..self.lens.len())
            .filter_map(|tensor| {
                let start = self.offsets[tensor].max(shard.start);
                let end = (self.offsets[tensor] + self.lens[tensor]).min(shard.end);
                (start < end).then(|| TensorPiece {
                    tensor,
                    in_tensor: start - self.offsets[tensor]..end - self.offsets[tensor],
                    in_shard: start - shard.start..end - shard.start,
                })
            })
            .collect()
    }

    /// `rank`'s shard of `tensors` (one slice per tensor, of the partition's lengths),
    /// zero (`T::default()`) where it is padding.
    pub fn shard<T: Copy + Default>(&self, tensors: &[&[T]], rank: usize) -> Vec<T> {
        self.check_tensors(tensors);
        let mut shard = vec![T::default(); self.shard_len];
        for piece in self.pieces(rank) {
            shard[piece.in_shard].copy_from_slice(&tensors[piece.tensor][piece.in_tensor]);
        }
        shard
    }

    /// The full tensors from every rank's shard (what an all-gather then unflatten does).
    pub fn gather<T: Copy + Default>(&self, shards: &[&[T]]) -> Vec<Vec<T>> {
        assert_eq!(shards.len(), self.world_size, "one shard per rank");
        let mut tensors: Vec<Vec<T>> = self.lens.iter().map(|&n| vec![T::default(); n]).collect();
        for (rank, shard) in shards.iter().enumerate() {
            assert_eq!(shard.len(), self.shard_len, "rank {rank}'s shard length");
            for piece in self.pieces(rank) {
                tensors[piece.tensor][piece.in_tensor].copy_from_slice(&shard[piece.in_shard]);
            }
        }
        tensors
    }

    fn check_tensors<T>(&self, tensors: &[&[T]]) {
        assert_eq!(tensors.len(), self.lens.len(), "one slice per tensor");
        for (i, (t, &n)) in tensors.iter().zip(&self.lens).enumerate() {
            assert_eq!(t.len(), n, "tensor {i}'s length");
        }
    }
}

/// The copies from shards saved under `saved` that make rank `rank`'s shard under `new`
/// (the same tensors at another world size); what they do not cover is padding (zero).
/// A rank thus reads only the saved shards that overlap its own.
pub fn reshard_reads(saved: &FlatPartition, new: &FlatPartition, rank: usize) -> Vec<ShardCopy> {
    assert_eq!(
        saved.lens, new.lens,
        "resharding needs the same tensors at both world sizes"
    );
    let target = new.shard_range(rank);
    let end = target.end.min(new.len);
    if saved.shard_len == 0 {
        return Vec::new();
    }
    let mut copies = Vec::new();
    let mut at = target.start;
    while at < end {
        let from_rank = at / saved.shard_len;
        let source = saved.shard_range(from_rank);
        let stop = source.end.min(end);
        copies.push(ShardCopy {
            from_rank,
            from: at - source.start..stop - source.start,
            to: at - target.start..stop - target.start,
        });
        at = stop;
    }
    copies
}
