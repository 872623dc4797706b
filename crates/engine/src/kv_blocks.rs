//! The paged KV cache's block manager: which physical blocks each sequence owns.
//!
//! The device cache of every layer is a fixed pool of `num_blocks` blocks of
//! `block_size` token slots (see [`floe_backend::PagedLayout`]). This module only does the
//! bookkeeping on the host: a free list, a reference count per block, and per-sequence
//! [`BlockTable`]s mapping logical block `p / block_size` to a physical block.
//!
//! # Prefix sharing
//!
//! The `n` samples of one request share the KV of their prompt's *full* blocks: one
//! sequence prefills them once, and every sample's table starts with the same physical
//! blocks ([`BlockManager::share_prefix`] increments their reference counts). The prompt's
//! remaining tail, at least one token and at most one block, is recomputed by each sample
//! into a block of its own. This needs no copy-on-write: a shared block is written only
//! by the prefill that fills it, before any sample reads it, and never again, because
//! every later position of every sample lands in a private block. Recomputing at most
//! `block_size` tokens per sample is the price, and it also gives each sample its own
//! logits row for its first token.

/// The pool had too few free blocks for an allocation; nothing was allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV cache exhausted: {requested} blocks requested, {free} free")]
pub struct OutOfBlocks {
    /// Blocks the allocation needed.
    pub requested: usize,
    /// Blocks free at the time.
    pub free: usize,
}

/// The physical blocks of one sequence, in logical order.
///
/// A table holds one reference to each of its blocks; give it back with
/// [`BlockManager::release`] (it is deliberately not `Clone`, so references are never
/// duplicated behind the manager's back).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// Physical block ids, logical block `i` at index `i`.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when the table holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// A fixed pool of KV blocks with reference counts.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    /// References to each block; 0 means free.
    ref_counts: Vec<u32>,
    /// Free block ids; allocation pops from the end, so freed blocks are reused first.
    free: Vec<u32>,
}

impl BlockManager {
    /// A pool of `num_blocks` blocks of `block_size` slots, all free.
    ///
    /// # Panics
    /// When `block_size` is 0 or `num_blocks × block_size` does not fit a `u32` slot id.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        assert!(
            num_blocks
                .checked_mul(block_size)
                .is_some_and(|slots| slots <= u32::MAX as usize),
            "{num_blocks} blocks of {block_size} slots overflow u32 slot ids"
        );
        Self {
            block_size,
            ref_counts: vec![0; num_blocks],
            // Reversed so that blocks are handed out 0, 1, 2, … from a fresh pool.
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks not referenced by any table.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// True when `blocks` more blocks can be allocated now.
    pub fn can_allocate(&self, blocks: usize) -> bool {
        blocks <= self.free.len()
    }

    /// References currently held on `block`.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Grows `table` with fresh blocks until it covers positions `0..tokens`. All or
    /// nothing: on [`OutOfBlocks`] the table and the pool are unchanged.
    pub fn grow(&mut self, table: &mut BlockTable, tokens: usize) -> Result<(), OutOfBlocks> {
        let needed = self.blocks_for(tokens).saturating_sub(table.blocks.len());
        if !self.can_allocate(needed) {
            return Err(OutOfBlocks {
                requested: needed,
                free: self.free.len(),
            });
        }
        for _ in 0..needed {
            let block = self.free.pop().expect("checked by can_allocate");
            debug_assert_eq!(self.ref_counts[block as usize], 0);
            self.ref_counts[block as usize] = 1;
            table.blocks.push(block);
        }
        Ok(())
    }

    /// A new table whose first `num_blocks` blocks are `source`'s first `num_blocks`,
    /// shared (one more reference each). The caller must only ever *read* those blocks
    /// through the new table; see the module docs.
    ///
    /// # Panics
    /// When `source` holds fewer than `num_blocks` blocks.
    pub fn share_prefix(&mut self, source: &BlockTable, num_blocks: usize) -> BlockTable {
        let blocks = source.blocks[..num_blocks].to_vec();
        for &block in &blocks {
            self.ref_counts[block as usize] += 1;
        }
        BlockTable { blocks }
    }

    /// Drops `table`'s reference to each of its blocks (a block whose count reaches zero
    /// returns to the pool) and leaves the table empty.
    pub fn release(&mut self, table: &mut BlockTable) {
        // Reverse order so the blocks a sequence took first are handed out last: the
        // free list then tends to give a sequence contiguous ids again.
        for block in table.blocks.drain(..).rev() {
            let count = &mut self.ref_counts[block as usize];
            assert!(
                *count > 0,
                "block {block} released more often than referenced"
            );
            *count -= 1;
            if *count == 0 {
                self.free.push(block);
            }
        }
    }

    /// The cache slot of position `pos` of the sequence owning `table`:
    /// `blocks[pos / block_size] * block_size + pos % block_size`.
    ///
    /// # Panics
    /// When `table` does not cover `pos`.
    pub fn slot(&self, table: &BlockTable, pos: usize) -> u32 {
        let block = table.blocks[pos / self.block_size] as usize;
        (block * self.block_size + pos % self.block_size) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_allocates_whole_blocks_and_maps_slots() {
        let mut pool = BlockManager::new(8, 4);
        let mut table = BlockTable::default();
        pool.grow(&mut table, 5).unwrap();
        assert_eq!(table.blocks(), &[0, 1]);
        assert_eq!(pool.num_free(), 6);
        // Covered already: no new block.
        pool.grow(&mut table, 8).unwrap();
        assert_eq!(table.len(), 2);
        pool.grow(&mut table, 9).unwrap();
        assert_eq!(table.blocks(), &[0, 1, 2]);
        assert_eq!(pool.slot(&table, 0), 0);
        assert_eq!(pool.slot(&table, 5), 5);
        assert_eq!(pool.slot(&table, 8), 8);

        let mut other = BlockTable::default();
        pool.grow(&mut other, 1).unwrap();
        assert_eq!(other.blocks(), &[3]);
        assert_eq!(pool.slot(&other, 3), 3 * 4 + 3);
    }

    #[test]
    fn shared_blocks_are_freed_by_the_last_release() {
        let mut pool = BlockManager::new(6, 4);
        let mut prompt = BlockTable::default();
        pool.grow(&mut prompt, 8).unwrap();
        let mut a = pool.share_prefix(&prompt, 2);
        let mut b = pool.share_prefix(&prompt, 2);
        pool.grow(&mut a, 9).unwrap();
        pool.grow(&mut b, 9).unwrap();
        assert_eq!(pool.ref_count(0), 3);
        assert_eq!(pool.ref_count(1), 3);
        // Same slots for shared positions, distinct slots past them.
        assert_eq!(pool.slot(&a, 7), pool.slot(&b, 7));
        assert_ne!(pool.slot(&a, 8), pool.slot(&b, 8));
        assert_eq!(pool.num_free(), 2);

        pool.release(&mut prompt);
        assert!(prompt.is_empty());
        assert_eq!(pool.ref_count(0), 2);
        pool.release(&mut a);
        assert_eq!(pool.ref_count(0), 1);
        assert_eq!(pool.num_free(), 3, "only a's private block returns");
        pool.release(&mut b);
        assert_eq!(pool.num_free(), 6);
        assert!((0..6).all(|block| pool.ref_count(block) == 0));
    }

    #[test]
    fn exhaustion_allocates_nothing() {
        let mut pool = BlockManager::new(3, 2);
        let mut a = BlockTable::default();
        pool.grow(&mut a, 4).unwrap();
        let mut b = BlockTable::default();
        assert!(!pool.can_allocate(2));
        assert_eq!(
            pool.grow(&mut b, 4),
            Err(OutOfBlocks {
                requested: 2,
                free: 1
            })
        );
        assert!(b.is_empty());
        assert_eq!(pool.num_free(), 1);
        pool.release(&mut a);
        pool.grow(&mut b, 6).unwrap();
        assert_eq!(pool.num_free(), 0);
    }
}
