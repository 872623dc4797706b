//! The optimizer state of a data-parallel group split over its ranks (ZeRO stage 1, as
//! DeepSpeed names it): each rank keeps the f32 master weights and AdamW moments of one
//! shard of the parameters, on its device or in host memory, instead of all of them.
//!
//! The trained parameters, in [`Transformer::visit_params`] order, are laid end to end in
//! one flat space cut into buckets of a fixed number of elements ([`plan_buckets`]; the
//! cut does not depend on the world size, so a checkpoint reshards bucket by bucket). Each
//! bucket is padded to a multiple of the world size and split by
//! [`FlatPartition`]. An optimizer step:
//! 1. packs every bucket's gradients into a staging buffer and `reduce_scatter_sum`s it,
//!    so each rank holds the summed gradient of its shard;
//! 2. sums the shards' squares over the ranks (exactly, in rank order) for the global
//!    norm, the same on every rank, which decides the skip and the clip;
//! 3. applies AdamW to each shard ([`Backend::adamw`] or [`Backend::adamw_host`]);
//! 4. `all_gather`s the updated shards in the model's storage (bf16 on CUDA: half the
//!    bytes of the masters) and unpacks them into every rank's weights.
//!
//! The model keeps its weights in compute precision only (where the backend has a lower
//! one) and full gradients; staging is one bucket of gradients and one of weights.
//!
//! # Gradient shards (ZeRO stage 2)
//!
//! After [`ShardedOptimizer::stream_gradients`] the model keeps no full gradients: its
//! backward hands each parameter's gradient over as soon as it is complete
//! ([`Transformer::forward_backward_streamed`]), in reverse visit order, and
//! [`ShardedOptimizer::receive`] copies it into the staging buffer of the bucket it
//! belongs to. Buckets follow visit order, so they complete from the last: a bucket is
//! complete once its first piece arrived (a bucket spanning two layers once both are
//! done), and is then reduce-scattered into this rank's shard of the gradient, summed
//! over the micro-batches. One staging bucket is filled at a time. Step 1 above is then
//! already done; the norm, AdamW and the gather are stage 1's. Every rank must run as
//! many backwards between two steps ([`ShardedOptimizer::reduce_empty_backward`] evens
//! them out).

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use floe_backend::{AdamW, Backend, BufKind, Collective};
use floe_dist::{reshard_reads, FlatPartition};
use floe_model::transformer::{self, ModelError, Transformer};
use floe_model::weights::{self, HostTensor};
use serde::{Deserialize, Serialize};

use crate::policy::OptimizerPlacement;
use crate::{Error, Result};

/// The layout a sharded optimizer state was saved with: enough to read it back at any
/// world size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShardingMeta {
    /// Ranks the state was split over.
    pub(crate) world_size: usize,
    /// Elements of every bucket but the last.
    pub(crate) bucket_elements: usize,
    /// Elements of all trained parameters.
    pub(crate) elements: usize,
    /// Whether the AdamW moments exist (they do after the first step).
    pub(crate) moments: bool,
}

/// A stretch of one parameter inside a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index of the parameter in visit order.
    pub(crate) param: usize,
    /// Elements of the parameter.
    pub(crate) in_param: Range<usize>,
    /// Where they start in the bucket.
    pub(crate) in_bucket: usize,
}

/// One bucket of the flat parameter space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// The pieces, in flat order.
    pub(crate) pieces: Vec<Piece>,
    /// Elements, without padding.
    pub(crate) len: usize,
}

/// The parameters of `lens` (in visit order) laid end to end and cut every `capacity`
/// elements; a parameter may span buckets.
pub(crate) fn plan_buckets(lens: &[usize], capacity: usize) -> Vec<Bucket> {
    assert!(capacity > 0, "bucket capacity 0");
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open = Bucket {
        pieces: Vec::new(),
        len: 0,
    };
    for (param, &len) in lens.iter().enumerate() {
        let mut at = 0;
        while at < len {
            let take = (capacity - open.len).min(len - at);
            open.pieces.push(Piece {
                param,
                in_param: at..at + take,
                in_bucket: open.len,
            });
            open.len += take;
            at += take;
            if open.len == capacity {
                buckets.push(std::mem::replace(
                    &mut open,
                    Bucket {
                        pieces: Vec::new(),
                        len: 0,
                    },
                ));
            }
        }
    }
    if open.len > 0 {
        buckets.push(open);
    }
    buckets
}

/// The AdamW moments of one shard.
struct Moments<T> {
    m: T,
    v: T,
}

/// One rank's state of one bucket.
enum ShardState<B: Backend> {
    Device {
        /// f32 masters (Full).
        master: B::Buf,
        moments: Option<Moments<B::Buf>>,
        /// The shard in the model's storage when that is not Full (the update writes it).
        weights: Option<B::Buf>,
    },
    Host {
        master: Vec<f32>,
        moments: Option<Moments<Vec<f32>>>,
        /// The shard in the model's storage (the update writes it).
        weights: B::Buf,
    },
}

struct Shard<B: Backend> {
    /// The summed gradient of this rank's shard (Full).
    grad: B::Buf,
    state: ShardState<B>,
}

/// How a rank takes the gradients as the backward completes them (ZeRO stage 2).
struct Streaming<B: Backend> {
    /// Each parameter's pieces (visit order) as `(bucket, index in its pieces)`.
    param_pieces: Vec<Vec<(usize, usize)>>,
    /// The parameters the current backward has not handed over yet are `0 .. pending`
    /// (they come last first).
    pending: usize,
    /// Backwards reduced into the shards since the last step; the first one writes the
    /// shards, the next ones add to them.
    backwards: usize,
    /// Shard-sized buffers a later backward's reduce-scatter lands in, by length.
    scratch: Vec<B::Buf>,
}

/// A rank's part of the optimizer state of a data-parallel group (module docs).
pub(crate) struct ShardedOptimizer<B: Backend> {
    collective: Arc<dyn Collective<B>>,
    backend: Arc<B>,
    placement: OptimizerPlacement,
    bucket_elements: usize,
    buckets: Vec<Bucket>,
    partitions: Vec<FlatPartition>,
    shards: Vec<Shard<B>>,
    /// Kind of the model's weights: what the updated shards are gathered as.
    weights_kind: BufKind,
    /// Zero-padded staging buffers by bucket length and kind; padding is never written.
    staging: Vec<(usize, BufKind, B::Buf)>,
    /// Present when the gradients are sharded too (stage 2).
    streaming: Option<Streaming<B>>,
}

/// A trained parameter's gradient or weights, as [`Transformer::visit_params`] or
/// [`Transformer::visit_weights`] lends it.
#[derive(Clone, Copy)]
enum Side {
    Param,
    Grad,
}

impl<B: Backend> ShardedOptimizer<B> {
    /// Splits the optimizer state of `model` (holding its Full masters) over the ranks of
    /// `collective`: each rank keeps its shard of the masters and of `moments` (full
    /// moments by parameter name, e.g. from an unsharded checkpoint; empty before the
    /// first step). The model then drops its Full masters where it keeps a Compute copy.
    pub(crate) fn new(
        model: &mut Transformer<B>,
        collective: Arc<dyn Collective<B>>,
        placement: OptimizerPlacement,
        bucket_elements: usize,
        moments: &BTreeMap<String, (B::Buf, B::Buf)>,
    ) -> Result<Self> {
        let (names, lens) = layout(model)?;
        let mut this = Self::empty(model, collective, placement, bucket_elements, &lens, true)?;
        let rank = this.collective.rank();
        let backend = Arc::clone(&this.backend);
        let names = &names;
        for b in 0..this.buckets.len() {
            let from = rank * this.partitions[b].shard_len();
            let at = this.staging(b, BufKind::Full)?;
            let staging = &mut this.staging[at].2;
            let bucket = &this.buckets[b];
            pack(&*backend, model, bucket, staging, Side::Param)?;
            let master = shard_of(&*backend, staging, from, this.partitions[b].shard_len())?;
            let shard_moments = if moments.is_empty() {
                None
            } else {
                let mut shard = |second: bool| -> Result<B::Buf> {
                    for piece in &bucket.pieces {
                        let name = &names[piece.param];
                        let pair = moments.get(name).ok_or_else(|| {
                            Error::InvalidRequest(format!(
                                "sharding the optimizer: no AdamW moments for `{name}`"
                            ))
                        })?;
                        let n = piece.in_param.len();
                        backend.copy_range(
                            staging,
                            piece.in_bucket,
                            if second { &pair.1 } else { &pair.0 },
                            piece.in_param.start,
                            n,
                        )?;
                    }
                    shard_of(&*backend, staging, from, this.partitions[b].shard_len())
                };
                Some(Moments {
                    m: shard(false)?,
                    v: shard(true)?,
                })
            };
            let state = this.shard_state(master, shard_moments)?;
            this.shards.push(Shard {
                grad: backend.zeros(this.partitions[b].shard_len(), BufKind::Full)?,
                state,
            });
        }
        this.drop_model_masters(model)?;
        Ok(this)
    }

    /// The state [`ShardedOptimizer::save`] wrote under `dir` with `meta`, resharded for
    /// this rank of `collective` (any world size): the model (holding Full weights) gets
    /// the saved f32 masters, then drops them where it keeps a Compute copy.
    pub(crate) fn load(
        model: &mut Transformer<B>,
        collective: Arc<dyn Collective<B>>,
        placement: OptimizerPlacement,
        dir: &Path,
        meta: &ShardingMeta,
    ) -> Result<Self> {
        let (_, lens) = layout(model)?;
        check_elements(dir, meta, &lens)?;
        let mut this = Self::empty(
            model,
            collective,
            placement,
            meta.bucket_elements,
            &lens,
            false,
        )?;
        for b in 0..this.buckets.len() {
            let shard_len = this.partitions[b].shard_len();
            let master = this.backend.zeros(shard_len, BufKind::Full)?;
            let state = this.shard_state(master, None)?;
            let grad = this.backend.zeros(shard_len, BufKind::Full)?;
            this.shards.push(Shard { grad, state });
        }
        this.drop_model_masters(model)?;
        // The buckets are the checkpoint's by construction: restore takes it.
        let restored = this.restore(model, dir, meta)?;
        debug_assert!(restored, "a checkpoint's own bucket layout restores");
        Ok(this)
    }

    /// Puts the state [`ShardedOptimizer::save`] wrote under `dir` with `meta` into this
    /// optimizer's own buffers and gathers its masters into `model`'s weights, when it was
    /// saved in the same buckets (at any world size); `Ok(false)` otherwise, and then
    /// nothing changed. Every rank calls it together. Only this rank's shard is read
    /// into host memory, all of it before anything is overwritten.
    pub(crate) fn restore(
        &mut self,
        model: &mut Transformer<B>,
        dir: &Path,
        meta: &ShardingMeta,
    ) -> Result<bool> {
        let elements: usize = self.buckets.iter().map(|b| b.len).sum();
        if meta.bucket_elements != self.bucket_elements || meta.elements != elements {
            return Ok(false);
        }
        let (rank, world_size) = (self.collective.rank(), self.collective.world_size());
        let saved = read_shards(dir, meta, &self.buckets, world_size, rank)?;
        let backend = Arc::clone(&self.backend);
        let b_ = &*backend;
        for (b, (master, moments)) in saved.into_iter().enumerate() {
            let at = self.staging(b, self.weights_kind)?;
            let shard = &mut self.shards[b];
            let weights: &B::Buf = match &mut shard.state {
                ShardState::Device {
                    master: device_master,
                    moments: device_moments,
                    weights,
                } => {
                    b_.copy(device_master, &b_.upload(&master, BufKind::Full)?)?;
                    *device_moments = match moments {
                        Some((m, v)) => Some(Moments {
                            m: b_.upload(&m, BufKind::Full)?,
                            v: b_.upload(&v, BufKind::Full)?,
                        }),
                        None => None,
                    };
                    match weights {
                        Some(weights) => {
                            b_.copy(weights, device_master)?;
                            weights
                        }
                        None => device_master,
                    }
                }
                ShardState::Host {
                    master: host_master,
                    moments: host_moments,
                    weights,
                } => {
                    b_.copy(weights, &b_.upload(&master, BufKind::Full)?)?;
                    *host_master = master;
                    *host_moments = moments.map(|(m, v)| Moments { m, v });
                    weights
                }
            };
            let staging = &mut self.staging[at].2;
            self.collective.all_gather(weights, staging)?;
            unpack(b_, model, &self.buckets[b], staging)?;
        }
        model.zero_grad()?;
        self.discard_gradients();
        Ok(true)
    }

    /// No shards yet, buckets planned over `lens`. The shards' masters come from the
    /// model's Full weights (`from_masters`) or from a checkpoint; in the second case the
    /// model may hold its weights in Compute storage alone.
    fn empty(
        model: &mut Transformer<B>,
        collective: Arc<dyn Collective<B>>,
        placement: OptimizerPlacement,
        bucket_elements: usize,
        lens: &[usize],
        from_masters: bool,
    ) -> Result<Self> {
        let backend = Arc::clone(model.backend());
        let mut has_compute = false;
        model.visit_weights(&mut |_, slot| {
            let full = backend.kind(slot.param) == BufKind::Full;
            if from_masters && !full {
                return Err(ModelError::Input(
                    "sharding the optimizer: the model no longer holds its Full master \
                     weights (shard before moving the optimizer state)"
                        .into(),
                ));
            }
            has_compute |= slot.compute.is_some() || !full;
            Ok(())
        })?;
        let buckets = plan_buckets(lens, bucket_elements);
        let world_size = collective.world_size();
        let partitions = buckets
            .iter()
            .map(|bucket| FlatPartition::new(&[bucket.len], world_size))
            .collect();
        Ok(Self {
            collective,
            backend,
            placement,
            bucket_elements,
            buckets,
            partitions,
            shards: Vec::new(),
            weights_kind: if has_compute {
                BufKind::Compute
            } else {
                BufKind::Full
            },
            staging: Vec::new(),
            streaming: None,
        })
    }

    fn shard_state(
        &self,
        master: B::Buf,
        moments: Option<Moments<B::Buf>>,
    ) -> Result<ShardState<B>> {
        let b = &*self.backend;
        let len = b.len(&master);
        Ok(match self.placement {
            OptimizerPlacement::Device => ShardState::Device {
                master,
                moments,
                weights: match self.weights_kind {
                    BufKind::Full => None,
                    kind => Some(b.zeros(len, kind)?),
                },
            },
            OptimizerPlacement::Host => ShardState::Host {
                master: b.download(&master)?,
                moments: match moments {
                    Some(Moments { m, v }) => Some(Moments {
                        m: b.download(&m)?,
                        v: b.download(&v)?,
                    }),
                    None => None,
                },
                weights: b.zeros(len, self.weights_kind)?,
            },
        })
    }

    fn drop_model_masters(&self, model: &mut Transformer<B>) -> Result<()> {
        if self.weights_kind != BufKind::Full {
            model.drop_device_masters()?;
        }
        Ok(())
    }

    /// Index in `self.staging` of bucket `b`'s buffer in `kind`, made (zeros, padded)
    /// the first time.
    fn staging(&mut self, b: usize, kind: BufKind) -> Result<usize> {
        let len = self.buckets[b].len;
        if let Some(i) = self.staging.iter().position(|s| (s.0, s.1) == (len, kind)) {
            return Ok(i);
        }
        let buf = self.backend.zeros(self.partitions[b].padded_len(), kind)?;
        self.staging.push((len, kind, buf));
        Ok(self.staging.len() - 1)
    }

    /// Index in `self.staging` of bucket `b`'s buffer in `kind`, made before.
    fn staging_of(&self, b: usize, kind: BufKind) -> usize {
        let len = self.buckets[b].len;
        self.staging
            .iter()
            .position(|s| (s.0, s.1) == (len, kind))
            .expect("the staging buffer was made before")
    }

    /// Where the shards live.
    pub(crate) fn placement(&self) -> OptimizerPlacement {
        self.placement
    }

    /// This rank in the group.
    pub(crate) fn rank(&self) -> usize {
        self.collective.rank()
    }

    /// Sums every rank's gradients into each rank's shard, clears the model's gradients
    /// and returns the global L2 norm, the same bits on every rank. Streamed gradients
    /// (stage 2) are already in the shards; the next backward starts new sums.
    pub(crate) fn reduce_gradients(&mut self, model: &mut Transformer<B>) -> Result<f64> {
        let backend = Arc::clone(&self.backend);
        let mut local = 0.0;
        if let Some(streaming) = &mut self.streaming {
            if streaming.pending != streaming.param_pieces.len() {
                return Err(Error::InvalidRequest(format!(
                    "optimizer step: a backward stopped with {} parameters' gradients \
                     not reduced",
                    streaming.pending
                )));
            }
            let fresh = streaming.backwards == 0;
            streaming.backwards = 0;
            for shard in &mut self.shards {
                // No backward since the last step: nothing to apply.
                if fresh {
                    backend.fill_zero(&mut shard.grad)?;
                }
                local += backend.sum_squares(&shard.grad)?;
            }
            return Ok(self.sum_over_ranks(local)?.sqrt());
        }
        for b in 0..self.buckets.len() {
            let at = self.staging(b, BufKind::Full)?;
            let staging = &mut self.staging[at].2;
            pack(&*backend, model, &self.buckets[b], staging, Side::Grad)?;
            let shard = &mut self.shards[b];
            self.collective
                .reduce_scatter_sum(staging, &mut shard.grad)?;
            local += backend.sum_squares(&shard.grad)?;
        }
        model.zero_grad()?;
        Ok(self.sum_over_ranks(local)?.sqrt())
    }

    /// Shards the gradients too (ZeRO stage 2, module docs): `model` streams its
    /// gradients from now on, freeing its full ones, and this optimizer reduces them
    /// into its shards bucket by bucket as the backward completes them.
    pub(crate) fn stream_gradients(&mut self, model: &mut Transformer<B>) -> Result<()> {
        if self.streaming.is_some() {
            return Ok(());
        }
        model.stream_gradients()?;
        let (_, lens) = layout(model)?;
        let mut param_pieces = vec![Vec::new(); lens.len()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            for (i, piece) in bucket.pieces.iter().enumerate() {
                param_pieces[piece.param].push((b, i));
            }
        }
        // Staging and scratch are made now: the backward's receiver cannot allocate.
        let mut scratch: Vec<B::Buf> = Vec::new();
        for b in 0..self.buckets.len() {
            self.staging(b, BufKind::Full)?;
            let len = self.partitions[b].shard_len();
            if !scratch.iter().any(|buf| self.backend.len(buf) == len) {
                scratch.push(self.backend.zeros(len, BufKind::Full)?);
            }
        }
        self.streaming = Some(Streaming {
            pending: lens.len(),
            param_pieces,
            backwards: 0,
            scratch,
        });
        Ok(())
    }

    /// Whether the gradients are sharded too (stage 2).
    pub(crate) fn streams_gradients(&self) -> bool {
        self.streaming.is_some()
    }

    /// Takes the gradients of parameters `first .. first + grads.len()` (visit order) of
    /// the running backward, as [`transformer::GradReceiverFn`] hands them over: packs
    /// them into their buckets' staging and reduce-scatters each bucket they complete.
    pub(crate) fn receive(&mut self, first: usize, grads: &[&B::Buf]) -> transformer::Result<()> {
        let mut streaming = self
            .streaming
            .take()
            .expect("receive is called on a streaming optimizer");
        let result = self.receive_into(&mut streaming, first, grads);
        self.streaming = Some(streaming);
        result
    }

    fn receive_into(
        &mut self,
        streaming: &mut Streaming<B>,
        first: usize,
        grads: &[&B::Buf],
    ) -> transformer::Result<()> {
        for (i, grad) in grads.iter().enumerate().rev() {
            let param = first + i;
            if param + 1 != streaming.pending {
                return Err(ModelError::Input(format!(
                    "ZeRO-2: the backward handed over parameter {param}'s gradient while \
                     {} parameters were pending (they come in reverse visit order)",
                    streaming.pending
                )));
            }
            streaming.pending = param;
            let backwards = streaming.backwards;
            for &(b, p) in streaming.param_pieces[param].iter().rev() {
                let piece = &self.buckets[b].pieces[p];
                let at = self.staging_of(b, BufKind::Full);
                let n = piece.in_param.len();
                let staging = &mut self.staging[at].2;
                self.backend
                    .copy_range(staging, piece.in_bucket, grad, piece.in_param.start, n)?;
                // Its first piece is the last to arrive.
                if p == 0 {
                    self.reduce_bucket(backwards, &mut streaming.scratch, b)?;
                }
            }
        }
        if streaming.pending == 0 {
            streaming.pending = streaming.param_pieces.len();
            streaming.backwards += 1;
        }
        Ok(())
    }

    /// A backward of zeros: every bucket reduce-scattered from a zeroed staging, so this
    /// rank joins the collectives of a backward the others run (a rank with fewer
    /// micro-batches than another in the same call).
    pub(crate) fn reduce_empty_backward(&mut self) -> Result<()> {
        let mut streaming = self
            .streaming
            .take()
            .expect("reduce_empty_backward is called on a streaming optimizer");
        let result = self.reduce_zeros(&mut streaming);
        streaming.backwards += 1;
        self.streaming = Some(streaming);
        result
    }

    fn reduce_zeros(&mut self, streaming: &mut Streaming<B>) -> Result<()> {
        for b in (0..self.buckets.len()).rev() {
            let at = self.staging_of(b, BufKind::Full);
            self.backend.fill_zero(&mut self.staging[at].2)?;
            self.reduce_bucket(streaming.backwards, &mut streaming.scratch, b)?;
        }
        Ok(())
    }

    /// Reduce-scatters bucket `b`'s staging into this rank's shard of its gradient: the
    /// first backward since the step writes the shard, later ones add to it.
    /// `backwards` counts those already summed, `scratch` is [`Streaming::scratch`].
    fn reduce_bucket(
        &mut self,
        backwards: usize,
        scratch: &mut [B::Buf],
        b: usize,
    ) -> floe_backend::Result<()> {
        let at = self.staging_of(b, BufKind::Full);
        let staging = &self.staging[at].2;
        let shard = &mut self.shards[b].grad;
        if backwards == 0 {
            return self.collective.reduce_scatter_sum(staging, shard);
        }
        let len = self.backend.len(shard);
        let scratch = scratch
            .iter_mut()
            .find(|buf| self.backend.len(buf) == len)
            .expect("stream_gradients made a scratch buffer of every shard length");
        self.collective.reduce_scatter_sum(staging, scratch)?;
        self.backend.add_assign(shard, scratch)
    }

    /// Drops the gradients summed since the last step (the next backward starts anew).
    pub(crate) fn discard_gradients(&mut self) {
        if let Some(streaming) = &mut self.streaming {
            streaming.backwards = 0;
        }
    }

    /// Applies AdamW `hp` to this rank's shards (the gradients of the last
    /// [`ShardedOptimizer::reduce_gradients`]) and gathers the new weights into the model
    /// on every rank.
    pub(crate) fn apply(&mut self, model: &mut Transformer<B>, hp: AdamW) -> Result<()> {
        let backend = Arc::clone(&self.backend);
        let b_ = &*backend;
        for b in 0..self.buckets.len() {
            let at = self.staging(b, self.weights_kind)?;
            let shard = &mut self.shards[b];
            let weights: &B::Buf = match &mut shard.state {
                ShardState::Device {
                    master,
                    moments,
                    weights,
                } => {
                    let len = b_.len(master);
                    let moments = match moments {
                        Some(moments) => moments,
                        None => moments.insert(Moments {
                            m: b_.zeros(len, BufKind::Full)?,
                            v: b_.zeros(len, BufKind::Full)?,
                        }),
                    };
                    b_.adamw(
                        master,
                        &shard.grad,
                        &mut moments.m,
                        &mut moments.v,
                        weights.as_mut(),
                        hp,
                    )?;
                    match weights {
                        Some(weights) => weights,
                        None => master,
                    }
                }
                ShardState::Host {
                    master,
                    moments,
                    weights,
                } => {
                    let len = master.len();
                    let moments = moments.get_or_insert_with(|| Moments {
                        m: vec![0.0; len],
                        v: vec![0.0; len],
                    });
                    b_.adamw_host(
                        weights,
                        &shard.grad,
                        master,
                        &mut moments.m,
                        &mut moments.v,
                        hp,
                    )?;
                    weights
                }
            };
            let staging = &mut self.staging[at].2;
            self.collective.all_gather(weights, staging)?;
            unpack(b_, model, &self.buckets[b], staging)?;
        }
        Ok(())
    }

    /// Drops the moments (a fresh optimizer's start); the masters stay.
    pub(crate) fn reset(&mut self) {
        for shard in &mut self.shards {
            match &mut shard.state {
                ShardState::Device { moments, .. } => *moments = None,
                ShardState::Host { moments, .. } => *moments = None,
            }
        }
    }

    /// Writes this rank's shards into `dir` ([`shard_file`]) and returns the layout
    /// [`ShardedOptimizer::load`] reads them back with.
    pub(crate) fn save(&self, dir: &Path) -> Result<ShardingMeta> {
        let b = &*self.backend;
        let mut tensors = BTreeMap::new();
        let mut with_moments = false;
        for (i, shard) in self.shards.iter().enumerate() {
            let (master, moments) = match &shard.state {
                ShardState::Device {
                    master, moments, ..
                } => (
                    b.download(master)?,
                    match moments {
                        Some(Moments { m, v }) => Some((b.download(m)?, b.download(v)?)),
                        None => None,
                    },
                ),
                ShardState::Host {
                    master, moments, ..
                } => (
                    master.clone(),
                    moments
                        .as_ref()
                        .map(|Moments { m, v }| (m.clone(), v.clone())),
                ),
            };
            let tensor = |data: Vec<f32>| HostTensor {
                shape: vec![data.len()],
                data,
            };
            tensors.insert(format!("bucket.{i}.master"), tensor(master));
            if let Some((m, v)) = moments {
                with_moments = true;
                tensors.insert(format!("bucket.{i}.exp_avg"), tensor(m));
                tensors.insert(format!("bucket.{i}.exp_avg_sq"), tensor(v));
            }
        }
        let (rank, world_size) = (self.collective.rank(), self.collective.world_size());
        weights::save_tensors(dir.join(shard_file(rank, world_size)), &tensors)?;
        Ok(ShardingMeta {
            world_size,
            bucket_elements: self.bucket_elements,
            elements: self.buckets.iter().map(|b| b.len).sum(),
            moments: with_moments,
        })
    }

    /// Waits for every rank (a save is complete once all have written their shards).
    pub(crate) fn barrier(&self) -> Result<()> {
        Ok(self.collective.barrier()?)
    }

    /// The sum over ranks of `value`, added in rank order so every rank gets its bits.
    fn sum_over_ranks(&self, value: f64) -> Result<f64> {
        let b = &*self.backend;
        let bits = value.to_bits();
        let send = b.upload_index(&[bits as u32, (bits >> 32) as u32])?;
        let mut recv = b.upload_index(&vec![0; 2 * self.collective.world_size()])?;
        self.collective.all_gather(&send, &mut recv)?;
        Ok(b.download_index(&recv)?
            .chunks(2)
            .map(|w| f64::from_bits(u64::from(w[0]) | (u64::from(w[1]) << 32)))
            .sum())
    }
}

/// The file of rank `rank`'s shards in a state saved over `world_size` ranks.
pub(crate) fn shard_file(rank: usize, world_size: usize) -> String {
    format!("optimizer-rank-{rank}-of-{world_size}.safetensors")
}

/// Names and lengths of the trained parameters in visit order; refused for a LoRA model.
fn layout<B: Backend>(model: &mut Transformer<B>) -> Result<(Vec<String>, Vec<usize>)> {
    if model.lora_config().is_some() {
        return Err(Error::InvalidRequest(
            "engine.zero_stage 1 and 2 shard full-parameter training; a LoRA engine's \
             optimizer state and gradients are small: leave zero_stage at 0"
                .into(),
        ));
    }
    let backend = Arc::clone(model.backend());
    let (mut names, mut lens) = (Vec::new(), Vec::new());
    model.visit_weights(&mut |name, slot| {
        names.push(name.to_string());
        lens.push(backend.len(slot.param));
        Ok(())
    })?;
    Ok((names, lens))
}

/// `len` elements of `staging` from `from`, as a new Full buffer.
fn shard_of<B: Backend>(backend: &B, staging: &B::Buf, from: usize, len: usize) -> Result<B::Buf> {
    let mut shard = backend.zeros(len, BufKind::Full)?;
    backend.copy_from(&mut shard, staging, from)?;
    Ok(shard)
}

/// Copies bucket `bucket`'s pieces of every parameter's `side` into `staging`.
fn pack<B: Backend>(
    backend: &B,
    model: &mut Transformer<B>,
    bucket: &Bucket,
    staging: &mut B::Buf,
    side: Side,
) -> Result<()> {
    let mut index = 0;
    let mut next = 0;
    let mut take = |src: &B::Buf| -> floe_backend::Result<()> {
        while let Some(piece) = bucket.pieces.get(next).filter(|p| p.param == index) {
            let n = piece.in_param.len();
            backend.copy_range(staging, piece.in_bucket, src, piece.in_param.start, n)?;
            next += 1;
        }
        index += 1;
        Ok(())
    };
    match side {
        Side::Param => model.visit_weights(&mut |_, slot| Ok(take(slot.param)?))?,
        Side::Grad => model.visit_params(&mut |_, slot| Ok(take(slot.grad)?))?,
    }
    Ok(())
}

/// Copies `staging`'s pieces into the parameters' weights; a parameter whose last piece
/// this is refreshes its Compute copy.
fn unpack<B: Backend>(
    backend: &B,
    model: &mut Transformer<B>,
    bucket: &Bucket,
    staging: &B::Buf,
) -> Result<()> {
    let mut index = 0;
    let mut next = 0;
    model.visit_weights(&mut |_, slot| {
        let mut ends_here = false;
        while let Some(piece) = bucket.pieces.get(next).filter(|p| p.param == index) {
            let n = piece.in_param.len();
            backend.copy_range(
                slot.param,
                piece.in_param.start,
                staging,
                piece.in_bucket,
                n,
            )?;
            ends_here = piece.in_param.end == backend.len(slot.param);
            next += 1;
        }
        if let (true, Some(compute)) = (ends_here, slot.compute) {
            backend.copy(compute, slot.param)?;
        }
        index += 1;
        Ok(())
    })?;
    Ok(())
}

fn check_elements(dir: &Path, meta: &ShardingMeta, lens: &[usize]) -> Result<()> {
    let elements: usize = lens.iter().sum();
    if meta.elements != elements || meta.bucket_elements == 0 || meta.world_size == 0 {
        return Err(Error::Corrupt {
            path: dir.to_path_buf(),
            msg: format!(
                "the sharded optimizer state holds {} elements in buckets of {} over {} \
                 ranks; the model trains {elements}",
                meta.elements, meta.bucket_elements, meta.world_size
            ),
        });
    }
    Ok(())
}

/// One bucket's shard read back: masters and, when saved, the moments.
type SavedShard = (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>);

/// Rank `rank`'s shard of every bucket at `world_size`, from the shards saved with
/// `meta` under `dir`: each saved file is read once, only those that overlap.
fn read_shards(
    dir: &Path,
    meta: &ShardingMeta,
    buckets: &[Bucket],
    world_size: usize,
    rank: usize,
) -> Result<Vec<SavedShard>> {
    let mut files: BTreeMap<usize, BTreeMap<String, HostTensor>> = BTreeMap::new();
    let mut shards = Vec::with_capacity(buckets.len());
    for (i, bucket) in buckets.iter().enumerate() {
        let saved = FlatPartition::new(&[bucket.len], meta.world_size);
        let new = FlatPartition::new(&[bucket.len], world_size);
        let mut master = vec![0.0; new.shard_len()];
        let mut moments = meta
            .moments
            .then(|| (vec![0.0; new.shard_len()], vec![0.0; new.shard_len()]));
        for copy in reshard_reads(&saved, &new, rank) {
            let path = dir.join(shard_file(copy.from_rank, meta.world_size));
            if let Entry::Vacant(entry) = files.entry(copy.from_rank) {
                entry.insert(weights::load_tensors(&path)?);
            }
            let file = &files[&copy.from_rank];
            let take = |suffix: &str, out: &mut [f32]| -> Result<()> {
                let key = format!("bucket.{i}.{suffix}");
                let tensor = file.get(&key).ok_or_else(|| Error::Corrupt {
                    path: path.clone(),
                    msg: format!("no tensor `{key}`"),
                })?;
                if tensor.data.len() != saved.shard_len() {
                    return Err(Error::Corrupt {
                        path: path.clone(),
                        msg: format!(
                            "tensor `{key}` has {} values; a shard of bucket {i} has {}",
                            tensor.data.len(),
                            saved.shard_len()
                        ),
                    });
                }
                out[copy.to.clone()].copy_from_slice(&tensor.data[copy.from.clone()]);
                Ok(())
            };
            take("master", &mut master)?;
            if let Some((m, v)) = &mut moments {
                take("exp_avg", m)?;
                take("exp_avg_sq", v)?;
            }
        }
        shards.push((master, moments));
    }
    Ok(shards)
}

/// Every parameter's f32 masters and, when saved, AdamW moments `(m, v)`.
pub(crate) type FullState = (Vec<Vec<f32>>, Option<Vec<(Vec<f32>, Vec<f32>)>>);

/// The whole state saved with `meta` under `dir`, by parameter (`lens` in visit order):
/// f32 masters and, when saved, the moments; what an engine without sharding loads.
pub(crate) fn read_full_state(
    dir: &Path,
    meta: &ShardingMeta,
    lens: &[usize],
) -> Result<FullState> {
    check_elements(dir, meta, lens)?;
    let buckets = plan_buckets(lens, meta.bucket_elements);
    let shards = read_shards(dir, meta, &buckets, 1, 0)?;
    let mut masters: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
    let mut moments: Option<Vec<(Vec<f32>, Vec<f32>)>> = meta
        .moments
        .then(|| lens.iter().map(|&n| (vec![0.0; n], vec![0.0; n])).collect());
    for (bucket, (master, bucket_moments)) in buckets.iter().zip(shards) {
        for piece in &bucket.pieces {
            let from = piece.in_bucket..piece.in_bucket + piece.in_param.len();
            masters[piece.param][piece.in_param.clone()].copy_from_slice(&master[from.clone()]);
            if let (Some(all), Some((m, v))) = (&mut moments, &bucket_moments) {
                let (pm, pv) = &mut all[piece.param];
                pm[piece.in_param.clone()].copy_from_slice(&m[from.clone()]);
                pv[piece.in_param.clone()].copy_from_slice(&v[from]);
            }
        }
    }
    Ok((masters, moments))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cut_the_flat_parameters_at_a_fixed_size() {
        let buckets = plan_buckets(&[3, 10, 2], 4);
        let lens: Vec<usize> = buckets.iter().map(|b| b.len).collect();
        assert_eq!(lens, vec![4, 4, 4, 3]);
        assert_eq!(
            buckets[0].pieces,
            vec![
                Piece {
                    param: 0,
                    in_param: 0..3,
                    in_bucket: 0
                },
                Piece {
                    param: 1,
                    in_param: 0..1,
                    in_bucket: 3
                },
            ]
        );
        assert_eq!(
            buckets[3].pieces,
            vec![
                Piece {
                    param: 1,
                    in_param: 9..10,
                    in_bucket: 0
                },
                Piece {
                    param: 2,
                    in_param: 0..2,
                    in_bucket: 1
                },
            ]
        );
        // Every element once, in order.
        let mut covered = vec![Vec::new(); 3];
        for bucket in &buckets {
            for piece in &bucket.pieces {
                covered[piece.param].extend(piece.in_param.clone());
            }
        }
        assert_eq!(covered[1], (0..10).collect::<Vec<_>>());
        assert_eq!(plan_buckets(&[0, 5], 8).len(), 1);
        assert!(plan_buckets(&[], 8).is_empty());
    }
}
