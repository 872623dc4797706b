//! Where a process stands in a job of several processes, one per GPU, and the pure plans
//! data parallelism runs on (`docs/distributed.md`).
//!
//! - [`World`]: rank, world size, local rank (the GPU) and rank 0's address, read from
//!   the environment torchrun, `floe launch` or Slurm's `srun` sets.
//! - [`rendezvous`]: rank 0 hands a blob (NCCL's unique id) to every other rank over TCP;
//!   [`rendezvous_linked`] keeps the connections as [`Liveness`] links, so every rank
//!   learns at once which rank stopped.
//! - [`balance_groups`], [`balance_whole_groups`]: which rank trains (or samples) which
//!   sequence groups.
//! - [`FlatPartition`]: the ZeRO-3 split of a layer's tensors into equal shards per rank,
//!   and [`reshard_reads`], how shards saved at one world size make shards at another.
//!
//! No floe dependencies: the collectives themselves are backend ops
//! (`floe_backend::Collective`).

#![deny(missing_docs)]

mod balance;
mod liveness;
mod partition;
mod rendezvous;
mod world;

pub use balance::{balance_groups, balance_whole_groups, GroupPiece, GroupShape};
pub use liveness::{Liveness, OnStop, RankStopped};
pub use partition::{reshard_reads, FlatPartition, ShardCopy, TensorPiece};
pub use rendezvous::{join, rendezvous, rendezvous_linked, Master, RendezvousError};
pub use world::{World, WorldError, DEFAULT_MASTER_PORT};
